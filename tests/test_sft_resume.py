"""The SFT stage on 2 ZeRO-3 gloo ranks when the examples of a step split unequally, and its
checkpoints (appendix, "Training configuration"; backends/sft/zero3.py).

Each step of 3 examples of different lengths is dealt 1 / 2 over the ranks (the longest to rank 0,
the other two to rank 1), so rank 0 runs a padding pass at every step: the case that crashed
DeepSpeed's backward (a 1-token pass has no grad_fn) and left rank 1 waiting. One run goes through
its 4 steps with a checkpoint every 2; a second is SIGKILLed right after its step-2 checkpoint and
resumed with --resume: it ends with bitwise the weights and exactly the per-step records of the
uninterrupted run. A resume at another world size stops with a message naming both. ~3 min on 2 cores.
"""
import json
import os
import sys

import pytest

import test_full_mode as fm
from toyfix import sft_rows

pytestmark = fm.pytestmark
ROOT = fm.ROOT


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from toy import model as toy_model
    from toyfix import tiny_tokenizer

    tmp = tmp_path_factory.mktemp("sft-resume")
    tok = tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    model.save_pretrained(tmp / "base")
    tok.save_pretrained(tmp / "base")
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows(6)))
    return tmp


def _sft(tmp, out, *extra, script=("-m", "backends.sft.zero3"), ranks=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           *script, "--data", str(tmp / "rows.jsonl"), "--model", str(tmp / "base"), "--out", str(out),
           "--batch", "3", "--epochs", "2", "--max-len", "2048", "--system", "compact", "--lr", "1e-3",
           "--warmup-frac", "0.25", *extra]
    return cmd


def _steps(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith('{"step"')]


@pytest.mark.slow
def test_sft_unequal_split_finishes_and_a_killed_run_resumes_to_the_same_weights_appendix(setup):
    import subprocess

    from backends.sft.pack import deal, step_plan
    from backends.sft.zero3 import SFTRunConfig, prepare, read_records
    from toyfix import tiny_tokenizer

    tmp = setup
    # every step's 3 examples split 1 / 2 over the 2 ranks: rank 0 pads at every step
    enc, _ = prepare(tiny_tokenizer(), read_records([str(tmp / "rows.jsonl")]), SFTRunConfig(system="compact"))
    lengths = [len(i) for i, _ in enc]
    assert len(set(lengths)) == 6
    assert all([len(s) for s in deal(idx, lengths, 2)] == [1, 2] for idx in step_plan(6, 2, 3, 0))

    out_a, _ = fm._launch(_sft(tmp, tmp / "a", "--save-every", "2"))
    recs_a = _steps(out_a)
    assert [r["step"] for r in recs_a] == [1, 2, 3, 4]  # finished: no assertion, no hang
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in recs_a)

    kill = _sft(tmp, tmp / "b", "--save-every", "2", script=(os.path.join(ROOT, "tests", "sft_kill_check.py"), "2"))
    p = subprocess.run(kill, cwd=ROOT, env=fm._env(), capture_output=True, text=True, timeout=fm.LAUNCH_TIMEOUT_S)
    assert p.returncode != 0, p.stdout[-2000:]
    assert [r["step"] for r in _steps(p.stdout)] == [1, 2]
    assert os.path.isdir(tmp / "b.ckpt" / "checkpoints" / "step-000002")
    assert not (tmp / "b").exists()  # no final checkpoint: the run never finished

    out_c, _ = fm._launch(_sft(tmp, tmp / "b", "--save-every", "2", "--resume"))
    assert '{"resumed_at_step": 2}' in out_c
    assert [r["step"] for r in _steps(out_c)] == [3, 4]
    assert (tmp / "b" / "model.safetensors").read_bytes() == (tmp / "a" / "model.safetensors").read_bytes()
    info_a = json.loads((tmp / "a" / "sft_info.json").read_text())
    info_b = json.loads((tmp / "b" / "sft_info.json").read_text())
    assert info_b["steps"] == info_a["steps"] and info_b["resumed_at_step"] == 2
    # the newest `keep` (2) checkpoints are kept: steps 2 and 4
    assert sorted(os.listdir(tmp / "a.ckpt" / "checkpoints")) == ["step-000002", "step-000004"]

    # the checkpoint holds 2 ranks' partitions: 1 rank refuses it at once, naming both sizes
    p = subprocess.run(_sft(tmp, tmp / "b", "--resume", ranks=1), cwd=ROOT, env=fm._env(),
                       capture_output=True, text=True, timeout=fm.LAUNCH_TIMEOUT_S)
    assert p.returncode != 0 and "exitcode  : 2" in p.stderr, p.stderr[-2000:]  # torchrun: 1, the rank: 2
    assert "world_size: 2 in the checkpoint, 1 now" in p.stderr
