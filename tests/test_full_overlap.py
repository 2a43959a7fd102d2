"""The overlapped full-mode step (backends/distributed/overlap.py): `train.py --full` with full.rollout_schedule
"async", one process (engine "torch"), the HF sampler over a tiny Qwen3 with a short SFT warm start,
the Gemini judge and Serper search on loopback servers (tests/loopback.py).

  * the reflection branch of step 0 run overlapped with step 1's rollouts writes the same bank
    entries and gives the same GRPO batch as the same branch run in sequence (every step a
    synchronisation point), from the same policy snapshot;
  * a run stopped after step 2 and resumed equals the uninterrupted run (metrics except time/*,
    bank, weights), with the branch collected before each checkpoint;
  * "lockstep" (train.rl_step) and "async" sample, judge and update step 0 identically;
  * on 2 ZeRO-3 gloo ranks (torchrun; skipped without deepspeed), where both ranks sample and rank 1
    streams its groups to rank 0's StreamingJudge, the overlapped step logs the one-process run's
    metrics (update statistics within rtol 1e-4) and writes its bank and samples.
~30 s, and ~60 s for the 2-rank run, on one core.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import train
from backends.distributed import overlap
from backends.scale import rollout_engine
from loopback import TEST_KEY, FakeServer
from toyfix import tiny_world

HAVE_HF = importlib.util.find_spec("transformers") is not None
HAVE_DS = (importlib.util.find_spec("deepspeed") is not None
           and importlib.util.find_spec("accelerate") is not None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
STEPS = 4
CORE = ("reward/", "adv/", "score/", "tokens/", "tools/", "loss/", "kl", "grad_norm", "clip_frac",
        "retrieval/", "rollout/")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    warm = ["--toy", "--steps", "0", "--run-dir", str(tmp / "warm"), "--no-progress",
            "--set", "world.n_train_entities=40", "--set", "world.n_heldout_entities=8",
            "--set", "sft.steps=80", "--set", "sft.n_trajectories=300", "--set", "sft.n_reflections=20",
            "--set", "sft.batch_size=8", "--set", 'toy_model.size="XS"', "--set", "toy_model.vocab_size=400",
            "--set", "eval.n_questions=0", "--set", f'cache_dir="{tmp / "warm-cache"}"', "--set", "threads=1"]
    assert train.main(warm) == 0
    rows = tmp / "rows.jsonl"
    with open(rows, "w") as fh:
        for r in tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    return tmp, tmp / "warm" / "final", rows


def _run(base, monkeypatch, name, *extra, steps=STEPS, ranks=1):
    """One `train.py --full` run against fresh loopback servers: in this process (engine "torch"),
    or with ranks > 1 under torchrun (ZeRO-3, gloo) in a subprocess."""
    tmp, model, rows = base
    monkeypatch.setenv("GEMINI_API_KEY", TEST_KEY)
    monkeypatch.setenv("SERPER_API_KEY", TEST_KEY)
    with FakeServer("gemini", model="gemini-test") as gj, FakeServer("serper") as ss:
        args = ["--full", "--model", str(model), "--steps", str(steps), "--run-dir", str(tmp / name),
                "--no-progress", "--set", f'data.source="{rows}"',
                "--set", f'judge_http.base_url="{gj.url}"', "--set", 'judge.model="gemini-test"',
                "--set", f'search_http.base_url="{ss.url}"', "--set", 'sampler="hf"',
                "--set", 'bank.retriever="bm25"',
                "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=4",
                "--set", "rollout.max_response_tokens=64", "--set", 'rollout.system_prompt="compact"',
                "--set", "reflection.m=4", "--set", "reflection.max_new_tokens=16",
                "--set", "ss_grpo.minibatches=2", "--set", "ss_grpo.micro_batch=1",
                "--set", "ss_grpo.lr=1e-3", "--set", "eval.n_questions=0",
                "--set", f'cache_dir="{tmp / ("cache-" + name)}"', "--set", "threads=1", *extra]
        if ranks == 1:
            assert train.main(args + ["--set", 'engine="torch"']) == 0
        else:
            env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
                   "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc_per_node", str(ranks), os.path.join(ROOT, "train.py"), *args],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
            assert p.returncode == 0, p.stderr[-4000:]
        assert not gj.errors and not ss.errors
    return tmp / name


def _rows(d):
    with open(d / "metrics.jsonl") as fh:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "judge/http/"))}
                for line in fh]


def _record(monkeypatch) -> dict:
    """Every bank write of a reflection branch and every batch it returned, by step."""
    seen: dict = {"upserts": [], "batches": {}}
    up, res = rollout_engine.GatedBank.upsert, rollout_engine.AsyncReflection.result

    def upsert(self, query, reflection, step, *a, **k):
        ok = up(self, query, reflection, step, *a, **k)
        seen["upserts"].append((step, query, reflection, ok))
        return ok

    def result(self):
        batch, metrics = res(self)
        seen["batches"][batch.step] = batch.to_dict()
        return batch, metrics

    monkeypatch.setattr(rollout_engine.GatedBank, "upsert", upsert)
    monkeypatch.setattr(rollout_engine.AsyncReflection, "result", result)
    return seen


def test_overlapped_branch_gives_the_sequential_bank_entries(base, monkeypatch):
    """Step 0's branch overlapped with step 1's rollouts (checkpoint every 2 steps: step 0 is no
    synchronisation point) against the same branch collected at once (every step a
    synchronisation point): the same policy snapshot (the weights after step 0's update), so the
    same bank writes and the same GRPO batch."""
    a = _record(monkeypatch)
    da = _run(base, monkeypatch, "overlapped", "--set", 'full.rollout_schedule="async"',
              "--set", "checkpoint.every=2", steps=2)
    ra = _rows(da)
    # Overlapped: step 0's branch was collected by step 1 (its metrics in row 1, none in row 0).
    assert ra[0]["reflect/candidates"] is None and ra[1]["reflect/candidates"] == 8
    assert ra[0]["update/reflection_seqs"] == 0 and ra[1]["update/reflection_seqs"] == 8
    w0a, batch0a = [u for u in a["upserts"] if u[0] == 0], a["batches"][0]  # before b records too
    b = _record(monkeypatch)
    monkeypatch.setattr(overlap.OverlappedStep, "sync_point", lambda self, done: True)
    db = _run(base, monkeypatch, "inline", "--set", 'full.rollout_schedule="async"',
              "--set", "checkpoint.every=2", steps=2)
    rb = _rows(db)
    assert rb[0]["reflect/candidates"] == 8  # collected within step 0
    w0b = [u for u in b["upserts"] if u[0] == 0]
    assert w0a and w0a == w0b  # the candidates offered to the bank, in order, and its answers
    assert batch0a == b["batches"][0] and batch0a["sequences"]
    # Step 0 itself (rollouts, judge, task update) is the same in both (the judge and bank counters
    # of row 0 hold the branch's calls and writes only where it was collected within step 0).
    core = [k for k in ra[0] if k.startswith(CORE)]
    assert len(core) > 20 and {k: ra[0][k] for k in core} == {k: rb[0][k] for k in core}


def test_overlapped_resume_equals_uninterrupted(base, monkeypatch):
    every = ["--set", 'full.rollout_schedule="async"', "--set", "checkpoint.every=2"]
    whole = _run(base, monkeypatch, "whole", *every)
    _run(base, monkeypatch, "resumed", *every, "--set", "checkpoint.stop_after=2")
    resumed = _run(base, monkeypatch, "resumed", *every, "--resume", "latest")
    rw, rr = _rows(whole), _rows(resumed)
    assert [r["step"] for r in rw] == list(range(STEPS)) and rr == rw
    assert rw[1]["reflect/candidates"] == 8 and rw[3]["reflect/candidates"] == 8  # sync points
    assert rw[2]["reflect/candidates"] is None  # step 2's row: step 1's branch was collected at step 1
    for f in ("bank.jsonl", "final/model.safetensors"):
        assert (whole / f).read_bytes() == (resumed / f).read_bytes(), f
    # the judge's buffers and counters, less its wall-clock figures (latency_*)
    assert _no_latency(json.load(open(whole / "rubric_buffers.json"))) == \
        _no_latency(json.load(open(resumed / "rubric_buffers.json")))


def _no_latency(x):
    if isinstance(x, dict):
        return {k: _no_latency(v) for k, v in x.items() if not k.startswith("latency")}
    return [_no_latency(v) for v in x] if isinstance(x, list) else x


def test_lockstep_and_async_agree_on_step_zero(base, monkeypatch):
    """Same seed: the lockstep rl_step and the overlapped step sample the same rollouts, score them
    the same and make the same task update at step 0 (the reflection branches then differ: the
    overlapped one samples with its own request seeds)."""
    dl = _run(base, monkeypatch, "lockstep1", "--set", 'full.rollout_schedule="lockstep"', steps=1)
    da = _run(base, monkeypatch, "async1", "--set", 'full.rollout_schedule="async"', steps=1)
    rl, ra = _rows(dl)[0], _rows(da)[0]
    keys = [k for k in rl if k.startswith(CORE)]
    assert len(keys) > 20 and {k: rl[k] for k in keys} == {k: ra[k] for k in keys}
    with open(dl / "samples.jsonl") as fl, open(da / "samples.jsonl") as fa:
        assert [json.loads(x)["trajectory"] for x in fl] == [json.loads(x)["trajectory"] for x in fa]


UPDATE_KEYS = ("loss/total", "loss/policy", "kl", "grad_norm", "reflect/loss/total", "reflect/loss/policy",
               "reflect/kl")


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed")
def test_overlapped_step_on_two_zero3_ranks_equals_one_process(base, monkeypatch):
    every = ["--set", 'full.rollout_schedule="async"', "--set", "checkpoint.every=0"]
    one = _run(base, monkeypatch, "one-process", *every, steps=3)
    # rank 0 samples no group while a reflection branch shares its sampler (steps 1-2; step 0 has
    # none in flight): which rank samples a rollout must not change it
    two = _run(base, monkeypatch, "two-ranks", *every, "--set", "full.rank0_rollout_share=0", steps=3, ranks=2)
    r1, r2 = _rows(one), _rows(two)
    assert [r["rollout/sampling_ranks"] for r in r2] == [2, 2, 2]
    assert [r["rollout/rank0_groups"] for r in r2] == [1, 0, 0]
    assert r2[1]["reflect/candidates"] == 8  # step 0's branch, collected by step 1
    for a, b in zip(r1, r2):
        for k in UPDATE_KEYS:
            assert (a[k] is None and b[k] is None) or a[k] == pytest.approx(b[k], rel=1e-4), k
        same = [k for k in a if k not in UPDATE_KEYS and k != "rollout/sampling_ranks"]
        assert {k: a[k] for k in same} == {k: b.get(k) for k in same}
    for f in ("bank.jsonl", "samples.jsonl"):
        assert (one / f).read_bytes() == (two / f).read_bytes(), f
