"""The command line of train.py as a newcomer meets it: the README's variations run beside the quick
start's run directory, refusals name their fix."""
import os
import re
import shlex

import pytest
import torch

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_variations() -> list[list[str]]:
    """The `python train.py ...` command lines of README.md's "Useful variations" block."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"Useful variations:\n\n```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line.split("#")[0])[2:] for line in block.splitlines()
            if line.startswith("python train.py")]


def test_readme_variations_each_default_to_their_own_run_dir():
    cmds = [c for c in readme_variations() if "--advantage" not in c]
    assert len(cmds) >= 3
    dirs = [train.parse_args(c).run_dir for c in cmds]
    assert "runs/toy" not in dirs and len(set(dirs)) == len(dirs), dirs
    assert train.parse_args(["--toy", "--model", "path/to/hf-model"]).run_dir == "runs/toy-model-hf-model"
    assert train.parse_args(["--toy", "--model", "runs/toy/final"]).run_dir == "runs/toy-model-toy-final"
    assert train.parse_args(["--toy", "--faults", "0.3,0.1"]).run_dir == "runs/toy-faults-0.3-0.1"
    assert train.parse_args(["--toy", "--seed", "1"]).run_dir == "runs/toy-seed1"
    assert train.parse_args(["--toy", "--model", "m", "--run-dir", "x"]).run_dir == "x"
    assert train.parse_args(["--full", "--model", "/ckpt/qwen3-8b"]).run_dir == "runs/full"


def test_fresh_run_into_a_run_dir_with_checkpoints_is_refused_naming_the_fix(tmp_path, capsys):
    d = tmp_path / "run"
    os.makedirs(d / "checkpoints" / "step-000024")
    threads = torch.get_num_threads()
    try:
        assert train.main(["--toy", "--run-dir", str(d), "--no-progress"]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "--run-dir DIR" in err and "--resume" in err and "step 24" in err
    assert sorted(os.listdir(d)) == ["checkpoints"]  # nothing written
