"""The dry run's memory plan and step-time estimate (backends/distributed/plan.py) on a known configuration: the
full preset (PAPER: 32 x 8 sequences, max prompt 8,192 + max response 18,432 = pack 26,624, ZeRO-3
with CPU offload, gradient checkpointing) with Qwen3-8B's published sizes on one node of 8 x 80 GiB.
The expected numbers are worked out by hand below from the sizes, not from the module."""
import json
import math

import pytest

from backends.distributed import dry_run, plan
from backends.run.presets import full_preset

P8B = 8_190_735_360  # Qwen3-8B: 2 x 151,936 x 4,096 (untied) + 36 x 192,946,432 + 4,096
GIB80 = 80 * 2 ** 30


def test_qwen3_8b_parameter_count_and_kv_bytes():
    # per layer: q 4096x4096, k/v 4096x1024 each, o 4096x4096, q/k norms 2x128, MLP 3x4096x12288,
    # 2 RMSNorms of 4096 = 192,946,432
    assert plan._layer_params(4096, 12288, 32, 8, 128) == 192_946_432
    assert plan.param_count(plan.QWEN3_8B) == P8B
    s = plan.model_shape(None)
    assert s.params == P8B and s.source.startswith("assumed")
    assert s.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456  # 144 KiB per token


def test_memory_plan_full_preset_8_gpus_by_hand():
    cfg = full_preset()
    assert plan.pack_tokens(cfg) == 8192 + 18432 == 26624  # PAPER
    mp = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    o = mp.others
    assert o["policy weights (ZeRO-3 shard)"] == 2 * P8B / 8 == 2_047_683_840
    assert o["pi_ref weights (ZeRO-3 shard)"] == 2 * P8B / 8
    assert "optimizer (fp32 master, m, v, grads)" not in o  # PAPER: offloaded
    assert o["activations (checkpointed, max pack)"] == 26624 * 4096 * 2 * 36 == 7_851_737_088
    assert o["LM head (fp32 logits, chunked, recomputed)"] == 3 * 1024 * 151936 * 4
    # vLLM on GPU 0: half the GPU; KV = 0.5 x 80 GiB - 2P - 2 GB reserve, 147,456 B per token
    kv = (0.5 * GIB80 - 2 * P8B - 2e9) // 147456
    assert mp.kv_tokens == int(kv) == 166_613
    assert mp.kv_contexts == pytest.approx(166_613 / 26624)
    assert mp.rank0["vLLM (weights + KV cache)"] == 0.5 * GIB80
    # every rank has its own engine (full.rollout_ranks "all"), in its own process, asleep in updates
    assert mp.engines == 8 and mp.sleeps
    assert o["vLLM (weights + KV cache)"] == 0.5 * GIB80 and o["vLLM process CUDA context"] == 0.6e9
    # per GPU of ranks 1..: resident = 3 shards of 2P / 8 + two CUDA contexts; the rollouts add the
    # engine (40 GiB), the update its transients (gathered head + bucket, activations, one layer,
    # LM head) while the engine sleeps: peak = resident + max(engine, transients) = the rollouts
    resident = 3 * 2 * P8B / 8 + 2 * 0.6e9
    transients = 2 * (151936 * 4096 + 5e8) + 7_851_737_088 \
        + 2 * 26624 * (4 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 3 * 12288) * 2 + 3 * 1024 * 151936 * 4
    assert mp.phases(o) == pytest.approx((resident + 0.5 * GIB80, resident + transients))
    assert mp.peak(o) == pytest.approx(resident + 0.5 * GIB80)  # 46.8 GiB of 80
    # host, node 0: 16P / 8 per rank x 8 ranks = 16P, + 4 GB x 8 + the bf16 copy 2P + 4 GiB swap
    # per engine + each sleeping engine's bf16 weights (level 1: 2P x 8)
    assert plan.MemoryPlan.total(mp.host_node0) == 16 * P8B + 8 * 4e9 + 2 * P8B + 8 * 4 * 2 ** 30 \
        + 8 * 2 * P8B
    # full.rollout_ranks "rank0": one engine (rank 0's), ranks 1.. hold no engine
    cfg.full.rollout_ranks = "rank0"
    mp0 = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    assert mp0.engines == 1 and "vLLM (weights + KV cache)" not in mp0.others
    assert plan.MemoryPlan.total(mp0.host_node0) == 16 * P8B + 8 * 4e9 + 2 * P8B + 4 * 2 ** 30 + 2 * P8B
    # one rank: the in-process engine, no sleep, everything summed
    one = plan.memory_plan(plan.model_shape(None), cfg, 1, 1, GIB80, 0)
    assert not one.sleeps and one.peak(one.rank0) == plan.MemoryPlan.total(one.rank0)
    cfg.full.rollout_ranks = "all"
    # not offloaded: +16P / 8 on every GPU
    cfg.full.offload_optimizer = False
    mp2 = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    assert plan.MemoryPlan.total(mp2.others) - plan.MemoryPlan.total(mp.others) == 16 * P8B / 8
    # HF sampler: every rank samples with its own bf16 copy (full.rollout_ranks "all"), else rank 0
    cfg.sampler = "hf"
    mp3 = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    assert mp3.others["sampling copy (HF generate, bf16)"] == mp3.rank0["sampling copy (HF generate, bf16)"] \
        == 2 * P8B
    cfg.full.rollout_ranks = "rank0"
    assert "sampling copy (HF generate, bf16)" not in plan.memory_plan(plan.model_shape(None), cfg, 8, 8,
                                                                      GIB80, 0).others


def test_plan_that_does_not_fit_is_a_problem():
    cfg = full_preset()
    lines, problems = plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")
    assert not problems, problems  # the preset fits one 8 x 80 GiB node
    # vLLM takes 72 GiB of GPU 0 next to the resident shards, CUDA contexts and the embedding model
    # (9.1 GiB; the update's transients are not there while it samples: it sleeps in the update)
    cfg.full.vllm_gpu_memory_utilization = 0.9
    _, problems = plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")
    assert any("GPU 0 (rank 0) needs" in p for p in problems), problems
    cfg.full.vllm_gpu_memory_utilization = 0.25  # 20 GiB: weights 16.4 GB leave < one context
    _, problems = plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")
    assert any("less than one context of 26624" in p for p in problems), problems
    cfg = full_preset()
    _, problems = plan.plan_lines(cfg, 8, 8, GIB80, "test", 128 * 2 ** 30, "test")
    assert any("host RAM of node 0" in p for p in problems), problems  # 16P alone is 131 GB


def test_step_time_rollout_arithmetic_by_hand():
    cfg = full_preset()
    st = plan.step_time(plan.model_shape(None), cfg, 8, 166_613)
    step = 2 * P8B / 3.35e12 * 3.0  # one eager decode step reads the bf16 weights once
    conc = 166_613 // (2048 + 9216)  # 14 sequences fit the KV cache at the mean context
    assert conc == 14
    assert st.phases["rollouts (decode)"] == pytest.approx(math.ceil(256 / 14) * 9216 * step)
    assert st.phases["judge + reflection judge"] == pytest.approx((math.ceil(288 / 8) + 32) * 6.0)
    assert st.total_s == pytest.approx(sum(st.phases.values()))
    assert any("0.25 MFU" in a for a in st.assumptions)
    # The dry run's figure for the preset: 8 engines (one per rank, full.rollout_ranks "all"), 32
    # sequences each = 3 waves of 14, searches one at a time on each rank, and every engine asleep
    # through the two updates (level 1: 2P to host and back per update at 25 GB/s)
    mp = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    st8 = plan.step_time(plan.model_shape(None), cfg, 8, mp.kv_tokens,
                         {"sampling_ranks": mp.engines, "sleeps": mp.sleeps})
    assert st8.phases["rollouts (decode)"] == pytest.approx(math.ceil(32 / 14) * 9216 * step)
    assert st8.phases["search calls"] == pytest.approx(3 * 5 * 14 * 1.5)
    assert st8.phases["vLLM sleep + wake (2 per step)"] == pytest.approx(2 * 2 * 2 * P8B / 25e9)
    for k in ("judge + reflection judge", "update (forward/backward/optimizer)", "weight syncs (2 per step)"):
        assert st8.phases[k] == pytest.approx(st.phases[k]), k
    text = "\n".join(plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")[0])
    assert f"{st8.total_s / 60:.1f} min per RL step" in text
    assert "8 vLLM engines (one per rank), 32 sequences each: 14 concurrent" in text


def test_dry_run_prints_the_memory_plan_for_the_model_folder(tmp_path):
    c = dict(plan.QWEN3_8B, num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(c))
    cfg = full_preset()
    cfg.model = str(tmp_path)
    text, problems = dry_run.dry_run(cfg, {"GEMINI_API_KEY": "k" * 10, "SERPER_API_KEY": "k" * 10})
    assert "memory plan (estimate" in text and "step time (estimate)" in text
    assert f"({tmp_path / 'config.json'})" in text
    assert f"{plan.param_count(c) / 1e9:.2f}B parameters" in text
    assert "assumptions:" in text
    assert not any(p.startswith("memory plan") for p in problems)


def test_step_time_concurrent_by_hand():
    """The concurrent schedule's estimate (backends/scale/rollout_engine.py): 256 sequences over 8 engines
    of 14 concurrent sequences (3 waves of the same decode step), each rollout's own 5 searches, the
    judge hidden behind the rollouts but for 2 round trips, the reflection's judging hidden and its
    256 candidates sampled on rank 0's engine (19 waves of 14 at 11,264 + 512 tokens each), which
    takes half a share of the groups (full.rank0_rollout_share 0.5: 2 of 32, 2 waves; the others
    up to 5 groups, 3 waves), one sync."""
    cfg = full_preset()
    shape = plan.model_shape(None)
    seq = plan.step_time(shape, cfg, 8, 166_613)
    st = plan.step_time_concurrent(shape, cfg, 8, 166_613)
    step = 2 * P8B / 3.35e12 * 3.0
    assert st.phases["rollouts (decode)"] == pytest.approx(math.ceil(32 / 14) * 9216 * step)
    assert st.phases["search calls"] == pytest.approx(3 * 5 * 1.5)
    assert st.phases["judge (not hidden by rollouts)"] == pytest.approx(2 * 6.0)
    assert 166_613 // (2048 + 9216 + 512) == 14
    cand = math.ceil(256 / 14) * 512 * step  # rank 0's engine time for the reflection candidates
    # rank 0: 2 waves of rollouts + the candidates, against the others' 3 waves
    assert st.phases["reflection (not hidden by next rollouts)"] == pytest.approx(2 * 9216 * step + cand - 3 * 9216 * step)
    cfg.full.rank0_rollout_share = 1.0  # equal shares: rank 0's rollouts wait for every candidate
    eq = plan.step_time_concurrent(shape, cfg, 8, 166_613)
    assert eq.phases["reflection (not hidden by next rollouts)"] == pytest.approx(cand)
    assert eq.phases["rollouts (decode)"] == st.phases["rollouts (decode)"]
    cfg.full.rank0_rollout_share = 0.5
    assert st.phases["weight sync (1 per step)"] == pytest.approx(seq.phases["weight syncs (2 per step)"] / 2)
    assert st.phases["update (forward/backward/optimizer)"] == seq.phases["update (forward/backward/optimizer)"]
    assert st.total_s == pytest.approx(sum(st.phases.values())) and st.total_s < seq.total_s / 5
    one = plan.step_time_concurrent(shape, cfg, 8, 166_613, {"sampling_ranks": 1})
    assert one.phases["rollouts (decode)"] == pytest.approx(seq.phases["rollouts (decode)"])
    # A judge slower than the rollouts shows through: its busy time minus what the rollouts hide.
    slow = plan.step_time_concurrent(shape, cfg, 8, 166_613, {"judge_call_s": 120.0})
    hidden = slow.phases["rollouts (decode)"] + slow.phases["search calls"]
    assert slow.phases["judge (not hidden by rollouts)"] == pytest.approx(36 * 120.0 - hidden)


def test_dry_run_prints_both_schedules():
    cfg = full_preset()
    lines, _ = plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")
    text = "\n".join(lines)
    assert "step time (estimate):" in text and "step time, concurrent schedule (estimate" in text
    assert "weight sync (1 per step)" in text and "weight syncs (2 per step)" in text
