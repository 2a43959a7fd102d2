"""The dry run's memory plan and step-time estimate (backends/distributed/plan.py) on a known configuration: the
full preset (PAPER: 32 x 8 sequences, max prompt 8,192 + max response 18,432 = pack 26,624, ZeRO-3
with CPU offload, gradient checkpointing) with Qwen3-8B's published sizes on one node of 8 x 80 GiB.
The expected numbers are worked out by hand below from the sizes, not from the module."""
import copy
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
    # vLLM's share of each GPU comes from the plan: what stays resident while the engine samples (3
    # shards of 2P / 8 and the trainer's CUDA context; rank 0 also the fp32 embedding model; the
    # update's transients are gone, since the engine sleeps through the update), less a slack of
    # max(3 GiB, 6 % of the GPU), floored to 0.01
    resident = 3 * 2 * P8B / 8 + 1.5e9
    slack = max(3 * 2 ** 30, 0.06 * GIB80)
    util_others = math.floor((GIB80 - resident - slack) / GIB80 * 100) / 100
    util_0 = math.floor((GIB80 - resident - 4 * plan.EMBED_PARAMS - slack) / GIB80 * 100) / 100
    assert (util_0, util_others) == (0.82, 0.85) and mp.util == {"rank 0": 0.82, "ranks 1..": 0.85}
    assert plan.vllm_utilization(plan.model_shape(None), cfg, 8, GIB80, rank0=False) == 0.85
    # KV = util x 80 GiB - 2P - 2 GB reserve, 147,456 B per token; the smaller engine (rank 0's) counts
    kv = (0.82 * GIB80 - 2 * P8B - 2e9) // 147456
    assert mp.kv_tokens == int(kv) == 353_027
    assert mp.kv_contexts == pytest.approx(353_027 / 26624)
    assert mp.rank0["vLLM (weights + KV cache)"] == 0.82 * GIB80
    # every rank has its own engine inside its process (one CUDA context per GPU), asleep in updates
    assert mp.engines == 8 and mp.sleeps and mp.sampling_ranks == 8
    assert o["vLLM (weights + KV cache)"] == 0.85 * GIB80 and "vLLM process CUDA context" not in o
    # per GPU of ranks 1..: resident = 3 shards of 2P / 8 + one CUDA context; the rollouts add the
    # engine (68 GiB), the update its transients (gathered head + bucket, activations, one layer,
    # LM head) while the engine sleeps: peak = resident + max(engine, transients) = the rollouts
    transients = 2 * (151936 * 4096 + 5e8) + 7_851_737_088 \
        + 2 * 26624 * (4 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 3 * 12288) * 2 + 3 * 1024 * 151936 * 4
    assert mp.phases(o) == pytest.approx((resident + 0.85 * GIB80, resident + transients))
    assert mp.peak(o) == pytest.approx(resident + 0.85 * GIB80)  # 75.1 GiB of 80: the slack is left
    assert GIB80 - mp.peak(o) >= slack
    # a set utilisation overrides the plan's
    cfg.full.vllm_gpu_memory_utilization = 0.5
    assert plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0).util == {"rank 0": 0.5, "ranks 1..": 0.5}
    cfg.full.vllm_gpu_memory_utilization = 0.0
    # host, node 0: 16P / 8 per rank x 8 ranks = 16P, + 4 GB x 8 + the bf16 copy 2P + 4 GiB swap
    # per engine + each sleeping engine's bf16 weights (level 1: 2P x 8)
    assert plan.MemoryPlan.total(mp.host_node0) == 16 * P8B + 8 * 4e9 + 2 * P8B + 8 * 4 * 2 ** 30 \
        + 8 * 2 * P8B
    # full.rollout_ranks "rank0": rank 0's engine alone samples, but every rank holds its engine
    # (they are built together, build.vllm_engines) and each follows the weights
    cfg.full.rollout_ranks = "rank0"
    mp0 = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    assert mp0.engines == 8 and mp0.sampling_ranks == 1 and "vLLM (weights + KV cache)" in mp0.others
    # one rank: the same path, its engine asleep through the update (the peak is by phase)
    one = plan.memory_plan(plan.model_shape(None), cfg, 1, 1, GIB80, 0)
    assert one.sleeps and one.engines == 1 and one.peak(one.rank0) < plan.MemoryPlan.total(one.rank0)
    cfg.full.rollout_ranks = "all"
    # not offloaded: +16P / 8 on every GPU
    cfg.full.offload_optimizer = False
    mp2 = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    no_vllm = lambda d: plan.MemoryPlan.total(d) - d[plan.VLLM_ITEM]  # noqa: E731
    assert no_vllm(mp2.others) - no_vllm(mp.others) == pytest.approx(16 * P8B / 8)
    # ... and the engine gets what the optimizer leaves: 0.66 of the GPU instead of 0.85
    assert mp2.util["ranks 1.."] == math.floor((GIB80 - resident - 16 * P8B / 8 - slack) / GIB80 * 100) / 100 == 0.66
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
    # lockstep: every turn is one blocking call over the wave, which lasts its longest segment:
    # the convoy factor (1.7, a discrete-event model's blocking / continuous ratio) on the decode time
    assert st.phases["rollouts (decode)"] == pytest.approx(math.ceil(256 / 14) * 9216 * step * 1.7)
    assert any("convoys x 1.7" in x for x in st.assumptions)
    assert st.phases["judge + reflection judge"] == pytest.approx((math.ceil(288 / 8) + 32) * 6.0)
    assert st.total_s == pytest.approx(sum(st.phases.values()))
    assert any("0.25 MFU" in a for a in st.assumptions)
    # The reflection update is counted: 32 groups x 8 candidates, each behind its ~11,264-token
    # trajectory (+ 512 new tokens). The fast path packs a group into one row, the trajectory once
    # (11,264 + 8 x 512 = 15,360 tokens <= the max pack 26,624): 0.49M tokens, where one sequence
    # per row would be 3.01M (more than the task update's 256 x 11,264 = 2.88M); the same per-token
    # cost and its own CPU Adam step
    task_tok, refl_tok = 256 * (2048 + 9216), 32 * (11264 + 8 * 512)
    per_row = 32 * 8 * (2048 + 9216 + 512)
    assert plan.reflection_update_tokens(cfg, 2048 + 9216) == (refl_tok, per_row)
    adam = cfg.ss_grpo.minibatches * P8B / 8 / 1e9
    per_tok = (st.phases["update (forward/backward/optimizer)"] - adam) / task_tok
    assert st.phases["reflection update"] == pytest.approx(refl_tok * per_tok + adam)
    assert any("0.49M tokens, each group packed" in x and "3.01M" in x for x in st.assumptions)
    # a row holds at most the max pack: at T = 13,312 only 4 candidates fit behind 11,264 tokens
    small = copy.deepcopy(cfg)
    small.full.vllm_max_model_len = 13_312
    assert plan.reflection_update_tokens(small, 11264) == (32 * (2 * 11264 + 8 * 512), per_row)
    plain = copy.deepcopy(cfg)  # the plain path, or per-sequence means: one sequence per row
    plain.fast_logprobs = False
    assert plan.reflection_update_tokens(plain, 11264) == (per_row, per_row)
    plain = copy.deepcopy(cfg)
    plain.ss_grpo.agg = "seq_mean_token_mean"
    assert plan.reflection_update_tokens(plain, 11264) == (per_row, per_row)
    # The dry run's figure for the preset: 8 engines (one per rank, full.rollout_ranks "all") whose
    # KV cache comes from the memory plan (353,027 tokens: 31 sequences at the mean context), 32
    # sequences each = 2 waves, searches one at a time on each rank, and every engine asleep
    # through the two updates (level 1: 2P to host and back per update at 25 GB/s)
    mp = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    assert mp.kv_tokens // (2048 + 9216) == 31
    st8 = plan.step_time(plan.model_shape(None), cfg, 8, mp.kv_tokens,
                         {"sampling_ranks": mp.sampling_ranks, "sleeps": mp.sleeps})
    assert st8.phases["rollouts (decode)"] == pytest.approx(math.ceil(32 / 31) * 9216 * step * 1.7)
    assert st8.phases["search calls"] == pytest.approx(2 * 5 * 31 * 1.5)
    assert st8.phases["vLLM sleep + wake (2 per step)"] == pytest.approx(2 * 2 * 2 * P8B / 25e9)
    for k in ("judge + reflection judge", "update (forward/backward/optimizer)", "reflection update",
              "weight syncs (2 per step)"):
        assert st8.phases[k] == pytest.approx(st.phases[k]), k
    text = "\n".join(plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")[0])
    assert f"{st8.total_s / 60:.1f} min per RL step" in text
    assert "8 vLLM engines (one per rank), 32 sequences each: 31 concurrent" in text
    # the memory plan's line: vLLM's share and the concurrent sequences at the mean and max context
    assert "vLLM gpu_memory_utilization rank 0 0.82, ranks 1.. 0.85 (from this plan" in text
    assert (f"= {353_027 / 11264:.1f} concurrent sequences at the mean context (11264 tokens), "
            f"{353_027 / 26624:.1f} at the max context (26624)") in text


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
    """The concurrent schedule's estimate (backends/scale/rollout_engine.py): continuous batching, so
    no convoy factor and no wave barrier (a waiting sequence takes the place of one that ends): the
    busiest engine's sequences / 14 concurrent x the mean response; each rollout's own 5 searches;
    the judge hidden behind the rollouts but for 2 round trips; the reflection's judging hidden and
    its 256 candidates sampled on rank 0's engine in the same batches as rank 0's rollouts (256 / 14
    x 512 tokens), rank 0 taking half a share of the groups (full.rank0_rollout_share 0.5: 2 of 32;
    the others up to 5 groups = 40 sequences), one sync, the reflection batch's update counted."""
    cfg = full_preset()
    shape = plan.model_shape(None)
    seq = plan.step_time(shape, cfg, 8, 166_613)
    st = plan.step_time_concurrent(shape, cfg, 8, 166_613)
    step = 2 * P8B / 3.35e12 * 3.0
    assert st.phases["rollouts (decode)"] == pytest.approx(40 / 14 * 9216 * step)
    assert st.phases["search calls"] == pytest.approx(40 / 14 * 5 * 1.5)
    assert st.phases["judge (not hidden by rollouts)"] == pytest.approx(2 * 6.0)
    assert 166_613 // (2048 + 9216 + 512) == 14
    cand = 256 / 14 * 512 * step  # rank 0's engine time for the reflection candidates
    # rank 0: 8 sequences (one "wave" at most) + the candidates, against the others' 40 / 14:
    # hidden
    assert 1 * 9216 * step + cand < 40 / 14 * 9216 * step
    assert st.phases["reflection (not hidden by next rollouts)"] == 0.0
    cfg.full.rank0_rollout_share = 1.0  # equal shares: rank 0's rollouts end after every candidate
    eq = plan.step_time_concurrent(shape, cfg, 8, 166_613)
    assert eq.phases["reflection (not hidden by next rollouts)"] == pytest.approx(cand)
    assert eq.phases["rollouts (decode)"] == pytest.approx(32 / 14 * 9216 * step)
    cfg.full.rank0_rollout_share = 0.5
    assert st.phases["weight sync (1 per step)"] == pytest.approx(seq.phases["weight syncs (2 per step)"] / 2)
    for k in ("update (forward/backward/optimizer)", "reflection update"):
        assert st.phases[k] == seq.phases[k], k  # both updates run in either schedule
    assert st.total_s == pytest.approx(sum(st.phases.values())) and st.total_s < seq.total_s / 5
    one = plan.step_time_concurrent(shape, cfg, 8, 166_613, {"sampling_ranks": 1})
    assert one.phases["rollouts (decode)"] == pytest.approx(256 / 14 * 9216 * step)
    # the lockstep schedule's convoys and wave barrier on the same engine: 19 waves x 1.7 against 256 / 14
    assert seq.phases["rollouts (decode)"] / one.phases["rollouts (decode)"] == pytest.approx(19 * 1.7 / (256 / 14))
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
