"""Full-mode memory: the LM-head recompute decision under ZeRO-3 (fast_logprobs._recompute_head reads
the vocabulary from `ds_shape`, not from the empty local partition), on 2 gloo ranks; and the GPU
memory logged at every phase of a step (backends/scale/memory_phases.py: after the engine build,
before sleep, after the update, after each wake), with CUDA faked on CPU, and nothing sampled or
gathered without CUDA.

The 2-rank test launches tests/full_recompute_check.py under torchrun (~30 s on 2 cores): a tiny
untied Qwen3 (as Qwen3-8B: tie_word_embeddings false) with a vocabulary of 8,192, whose log-softmax
over one micro-batch (~100 positions x 8,192 x 4 B = 3 MiB) is above the threshold of 1 MiB set
there, so every gradient-recording head pass must take the recompute path. Inside the engine's
forward DeepSpeed's parameter getter (ZeROOrderedDict) gathers the head when it is touched, so there
`weight.shape[0]` happens to be right; outside it (a decision made before the forward, a benchmark,
another DeepSpeed version) the local partition is empty and only `ds_shape` is right: the test checks
both.
"""
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from backends.run import fast_logprobs
from test_thread_devices import fake_cuda  # noqa: F401  (fixture: CUDA's per-thread state, faked)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_DS = (importlib.util.find_spec("deepspeed") is not None
           and importlib.util.find_spec("accelerate") is not None)
needs_ds = pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed")


def test_head_rows_reads_the_zero3_partition_shape():
    head = torch.nn.Linear(16, 300, bias=False)
    assert fast_logprobs.head_rows(head) == 300
    # a ZeRO-3 partition outside forward: an empty local tensor, the full shape in ds_shape
    head.weight = torch.nn.Parameter(torch.empty(0))
    head.weight.ds_shape = torch.Size([151936, 4096])
    assert fast_logprobs.head_rows(head) == 151936
    h = torch.zeros(26624, 16, requires_grad=True)
    # PAPER-scale decision: 26,624 positions x 151,936 x 4 B = 16 GB > 256 MiB -> recompute
    assert fast_logprobs._recompute_head(head, h, 26624)
    with torch.no_grad():
        # no backward, nothing kept
        assert not fast_logprobs._recompute_head(head, h.detach(), 26624)


@needs_ds
def test_zero3_two_ranks_vocab_above_threshold_takes_the_recompute_path(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "model")
    threshold = 2 ** 20
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "tests", "full_recompute_check.py"), str(tmp_path / "model"),
           str(tmp_path / "out"), str(threshold)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    for rank in (0, 1):
        res = json.load(open(tmp_path / "out" / f"rank{rank}.json"))
        assert res["vocab"] == 8192 and res["world_size"] == 2
        grad = [d for d in res["decisions"] if d["grad"]]
        assert grad, res["decisions"]  # the update's forward with gradient decided
        for d in grad:
            assert d["rows"] == 8192
            assert d["positions"] * 8192 * 4 > threshold
            assert d["verdict"] is True
        # Outside the forward the head is an empty partition: the old `weight.shape[0]` read 0 there
        # (0 x positions x 4 B is never above any threshold); ds_shape gives the true vocabulary.
        out = res["outside"]
        assert out["local_rows"] == 0 and out["rows"] == 8192 and out["verdict"] is True, out
        assert res["calls"]["recompute"] >= len(grad)  # the chunks ran under checkpoint
        # the scoring passes without gradient keep nothing, so they never recompute
        assert all(not d["verdict"] for d in res["decisions"] if not d["grad"])
        assert torch.isfinite(torch.tensor(res["stats"]["loss/total"]))


# ----------------------------------------------------------------------------------------------------
# GPU memory per phase (backends/scale/memory_phases.py, engine.memory_report), with CUDA faked on CPU

GIB = 2 ** 30


class MemoryGPU:
    """An 80 GiB GPU's memory as mem_get_info sees it: a vLLM engine's weights (15 GiB) and KV cache
    (47 GiB) held while awake, the trainer's `trainer` GiB resident; torch reserves `reserved`."""

    def __init__(self):
        self.engine = {"weights": 15.0, "kv_cache": 47.0}
        self.trainer, self.reserved = 3.0, 5.0

    def free(self) -> float:
        return 80.0 - self.trainer - sum(self.engine.values())


class SleepyLLM:
    """A vLLM engine stand-in with sleep mode over MemoryGPU (and FakeLLM's rpc / prefix reset)."""

    def __init__(self, gpu, tok):
        from test_vllm_sampler import FakeLLM

        self.gpu, self.inner = gpu, FakeLLM(tok, lambda p: [5])
        self.llm_engine = self.inner.llm_engine

    def sleep(self, level):
        self.gpu.engine = {}

    def wake_up(self, tags):
        for t in tags:
            self.gpu.engine[t] = {"weights": 15.0, "kv_cache": 47.0}[t]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "rubricem_sync_load":  # a chunk held while its layer completes
            self.gpu.trainer += 1.0
        return self.inner.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self):
        return True


@pytest.fixture
def gpu(monkeypatch, fake_cuda):
    """CUDA faked over a MemoryGPU: mem_get_info, memory_reserved, empty_cache, and the per-thread
    devices and streams of test_thread_devices.fake_cuda; memory_phases' samples cleared before
    and after."""
    from backends.scale import memory_phases

    g = MemoryGPU()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (g.free() * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: g.reserved * GIB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    memory_phases.take()
    yield g
    memory_phases.take()


def _engine_over(sampler):
    """A one-rank ZeRO3Engine with only what update() reads (the DeepSpeed policy update and the
    batch deal faked by the caller)."""
    from backends.distributed.engine import ZeRO3Engine

    eng = ZeRO3Engine.__new__(ZeRO3Engine)
    eng.cfg = SimpleNamespace(ss_grpo=SimpleNamespace(minibatches=1, micro_batch=1),
                              full=SimpleNamespace(vllm_sleep_level=1))
    eng.world_size, eng.rows, eng.sampler = 1, SimpleNamespace(units=lambda b: None), sampler
    eng.rollout_metrics, eng._task_updates = {}, 0
    return eng


def test_memory_is_logged_at_every_phase_of_a_step_on_gpu(gpu, monkeypatch, caplog):
    import toyfix as tf
    from backends.distributed import engine
    from backends.scale import memory_phases
    from backends.scale.vllm_sampler import VLLMSampler
    from test_vllm_sampler import FakeParams

    def update(eng):  # one update of a batch of `kind`, the engine asleep through it
        return eng.update(SimpleNamespace(ids=[[1]], kind=kind), 0, None)

    monkeypatch.setattr(engine, "plan_update", lambda *a, **kw: ([["shard"]], [["plan"]]))
    monkeypatch.setattr(engine, "policy_update", lambda *a, **kw: {"loss/total": 0.0})
    tok = tf.tiny_tokenizer()
    s = VLLMSampler("/nonexistent", tok, llm=SleepyLLM(gpu, tok), sampling_params_cls=FakeParams,
                    dtype="float32", enable_sleep_mode=True)
    assert s.sleep_mode  # the fake GPU has sleep mode
    memory_phases.record("engine_build")  # as ZeRO3Engine.__init__ after the build
    eng = _engine_over(s)
    caplog.set_level(logging.INFO, logger="rubricem.full")
    kind = ["task"]
    m0 = update(eng)
    # step 0: build and the update's phases (no sync yet); engine awake: 80 - 3 - 62 = 15 GiB free
    assert m0["mem/engine_build_free_gib"] == m0["mem/before_sleep_free_gib"] == 15.0
    assert m0["mem/after_update_free_gib"] == 77.0  # asleep: weights and KV cache handed back
    assert m0["mem/after_update_reserved_gib"] == 5.0
    assert m0["mem/after_update_min_free_gib"] == 77.0 and m0["mem/after_update_min_free_rank"] == 0
    assert not any(k.startswith("mem/wake") for k in m0)
    s.sync_weights([("w", torch.zeros(2))], copy=False)  # wakes weights, loads (+1 GiB), wakes KV
    kind = ["reflection"]  # the next step's reflection update: no report, its samples carried over
    assert not any(k.startswith("mem/") for k in update(eng))
    s.sync_weights([("w", torch.zeros(2))], copy=False)
    kind = ["task"]
    m1 = update(eng)
    assert "mem/engine_build_free_gib" not in m1
    # the least free of each phase since step 0's report: the second sync holds 1 GiB more
    assert m1["mem/wake_weights_free_gib"] == 80 - 4 - 15 and m1["mem/wake_kv_free_gib"] == 80 - 5 - 62
    assert m1["mem/before_sleep_free_gib"] == 80 - 5 - 62 and m1["mem/after_update_free_gib"] == 75.0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory (")]
    assert len(lines) == 3 + 4  # one per phase at the first two task updates (steps 0 and 1)
    assert lines[0].startswith("memory (step 0 of this process) engine_build: rank 0 free 15.0 GiB")
    assert "memory (step 1 of this process) wake_kv: rank 0 free 13.0 GiB, reserved 5.0 GiB; " \
           "least free 13.0 GiB (rank 0)" in lines
    caplog.clear()
    assert "mem/after_update_free_gib" in update(eng)  # step 2: logged, no console lines
    assert not [r for r in caplog.records if r.getMessage().startswith("memory (")]


def test_memory_is_not_sampled_or_gathered_without_cuda(monkeypatch):
    from backends.distributed import engine
    from backends.scale import memory_phases

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run, even on a GPU host
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("sampled on CPU"))
    monkeypatch.setattr(engine, "all_reduce_sum", lambda v: pytest.fail("gathered on CPU"))
    for phase in memory_phases.PHASES:
        memory_phases.record(phase)
    assert memory_phases.take() == {}
    assert engine.memory_report(0, 2) == {}
    with pytest.raises(ValueError):
        memory_phases.record("after_lunch")


def test_memory_summary_takes_rank0_and_the_least_free_rank():
    from backends.scale import memory_phases as mp

    world = 3
    per_rank = [  # (free, reserved) GiB by phase; rank 1 never slept, rank 2 has the least at the wake
        {"before_sleep": (10.0, 4.0), "wake_kv": (9.0, 6.0)},
        {"wake_kv": (8.5, 6.5)},
        {"before_sleep": (12.0, 4.0), "wake_kv": (7.0, 7.0), "after_update": (70.0, 2.0)},
    ]
    packs = [mp.pack({k: (f * GIB, r * GIB) for k, (f, r) in s.items()}, rank, world)
             for rank, s in enumerate(per_rank)]
    summed = [sum(col) for col in zip(*packs)]  # what the all-reduce hands every rank
    m = mp.summarize(summed, world)
    assert m == {"mem/before_sleep_free_gib": 10.0, "mem/before_sleep_reserved_gib": 4.0,
                 "mem/before_sleep_min_free_gib": 10.0, "mem/before_sleep_min_free_rank": 0,
                 "mem/after_update_min_free_gib": 70.0, "mem/after_update_min_free_rank": 2,
                 "mem/wake_kv_free_gib": 9.0, "mem/wake_kv_reserved_gib": 6.0,
                 "mem/wake_kv_min_free_gib": 7.0, "mem/wake_kv_min_free_rank": 2}
    assert mp.report_lines(m, "x")[1] == ("memory (x) after_update: rank 0 no sample; least free "
                                          "70.0 GiB (rank 2)")
    with pytest.raises(ValueError):
        mp.summarize(summed[:-1], world)
    with pytest.raises(ValueError):
        mp.pack({}, 3, world)


# ----------------------------------------------------------------------------------------------------
# One vLLM share of the GPU on every rank (engine.engine_utilization, plan.engine_share)


def test_every_rank_builds_its_engine_with_rank0s_share_less_the_margin(monkeypatch):
    """vLLM's external-launcher executor gives every engine the KV cache of the rank with the least
    memory (MIN all-reduce), so every rank takes rank 0's share (its GPU also holds the embedding
    model), less full.vllm_margin_gib (4 GiB by default: a first run's headroom)."""
    from backends.distributed import engine, plan
    from backends.run.presets import full_preset

    gpu = 80 * GIB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=gpu))
    cfg = full_preset()
    shape = plan.model_shape(None)  # Qwen3-8B
    mp = plan.memory_plan(shape, cfg, 8, 8, gpu, 0.0)
    least = mp.caps["rank 0"]
    assert least < mp.caps["ranks 1.."]  # what each GPU could give (0.82 and 0.85 today)
    assert set(mp.util.values()) == {mp.share}  # the plan builds every engine with one share
    assert cfg.full.vllm_margin_gib == 4.0
    # by hand: floor((least x 80 GiB - 4 GiB) / 80 GiB, 0.01); at 0.82: floor(77.0) / 100 = 0.77
    want = math.floor(round((least * 80 - 4) / 80 * 100, 6)) / 100
    assert plan.engine_share(shape, cfg, 8, gpu) == engine.engine_utilization(cfg, 8) == want
    assert want == 0.77 or least != 0.82
    cfg.full.vllm_margin_gib = 0.0  # after a run measured its headroom: the plan's rank-0 share
    assert engine.engine_utilization(cfg, 8) == least
    cfg.full.vllm_margin_gib = 100.0  # never below the plan's floor
    assert engine.engine_utilization(cfg, 8) == 0.3
    cfg.full.vllm_gpu_memory_utilization = 0.6  # set: on every rank, no margin taken off
    assert engine.engine_utilization(cfg, 8) == 0.6
    cfg.full.vllm_gpu_memory_utilization, cfg.full.vllm_margin_gib = 0.0, -1.0
    with pytest.raises(ValueError, match="vllm_margin_gib"):
        engine.engine_utilization(cfg, 8)
