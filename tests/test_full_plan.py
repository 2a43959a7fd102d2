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
    assert (util_0, util_others) == (0.82, 0.85) and mp.caps == {"rank 0": 0.82, "ranks 1..": 0.85}
    # one share on every rank (vLLM sizes every engine's KV cache by the least over the ranks): the
    # least cap, rank 0's, less full.vllm_margin_gib = 4 GiB: floor((0.82 x 80 GiB - 4 GiB) / 80 GiB) = 0.77
    assert cfg.full.vllm_margin_gib == 4.0
    assert mp.share == 0.77 and mp.util == {"rank 0": 0.77, "ranks 1..": 0.77}
    assert plan.engine_share(plan.model_shape(None), cfg, 8, GIB80) == 0.77
    # KV = share x 80 GiB - 2P - 2 GB reserve, 147,456 B per token, the same in every engine
    kv = (0.77 * GIB80 - 2 * P8B - 2e9) // 147456
    assert mp.kv_tokens == int(kv) == 323_900
    assert mp.kv_contexts == pytest.approx(323_900 / 26624)
    assert mp.rank0["vLLM (weights + KV cache)"] == 0.77 * GIB80
    # every rank has its own engine inside its process (one CUDA context per GPU), asleep in updates
    assert mp.engines == 8 and mp.sleeps and mp.sampling_ranks == 8
    assert o["vLLM (weights + KV cache)"] == 0.77 * GIB80 and "vLLM process CUDA context" not in o
    # per GPU of ranks 1..: resident = 3 shards of 2P / 8 + one CUDA context; the rollouts add the
    # engine (68 GiB), the update its transients (gathered head + bucket, activations, one layer,
    # LM head) while the engine sleeps: peak = resident + max(engine, transients) = the rollouts
    transients = 2 * (151936 * 4096 + 5e8) + 7_851_737_088 \
        + 2 * 26624 * (4 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 3 * 12288) * 2 + 3 * 1024 * 151936 * 4
    assert mp.phases(o) == pytest.approx((resident + 0.77 * GIB80, resident + transients))
    assert mp.peak(o) == pytest.approx(resident + 0.77 * GIB80)  # the slack and the margin are left
    assert GIB80 - mp.peak(o) >= slack + 4 * 2 ** 30
    # a set utilisation overrides the plan's
    cfg.full.vllm_gpu_memory_utilization = 0.5
    assert plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0).util == {"rank 0": 0.5, "ranks 1..": 0.5}
    cfg.full.vllm_gpu_memory_utilization = 0.0
    # host, node 0: 16P / 8 per rank x 8 ranks = 16P, + 4 GB x 8 + 4 GiB swap per engine + each
    # sleeping engine's bf16 weights (level 1) in pinned memory, each of vLLM's tensors rounded up to
    # a power of two: per layer qkv 50.3 MB -> 2^26, o 2^25 (exact), gate_up 201 MB -> 2^28, down
    # 101 MB -> 2^27, two norms of 8 KiB, q / k norms of 256 B; embedding and head 1.24 GB -> 2^31
    # each, final norm 8 KiB: 22.4 GB per engine (2P = 16.4 GB); with vLLM no plain copy on rank 0
    layer = 2 ** 26 + 2 ** 25 + 2 ** 28 + 2 ** 27 + 2 * 8192 + 2 * 256
    pinned = 36 * layer + 2 * 2 ** 31 + 8192
    assert plan.pinned_sleep_bytes(plan.model_shape(None)) == pinned == 22_414_977_024
    assert plan.MemoryPlan.total(mp.host_node0) == 16 * P8B + 8 * 4e9 + 8 * 4 * 2 ** 30 + 8 * pinned
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
    # ... and the engine could have what the optimizer leaves: 0.66 of the GPU instead of 0.85
    assert mp2.caps["ranks 1.."] == math.floor((GIB80 - resident - 16 * P8B / 8 - slack) / GIB80 * 100) / 100 == 0.66
    assert mp2.share == math.floor((mp2.caps["rank 0"] * GIB80 - 4 * 2 ** 30) / GIB80 * 100 + 1e-9) / 100
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


# The decode step and the update, written out from their formulas (backends/distributed/plan.py
# ASSUME: 3.35 TB/s H100 HBM at 80 %, a 14 ms eager / 7 ms CUDA-graph CPU floor per step, 147,456 B of
# KV per token; 4.9 s per measured 26,624-token pass at 0.85 ZeRO-3 efficiency).
KVB = 2 * 36 * 8 * 128 * 2
HBM = 0.8 * 3.35e12
T_TOK = 4.9 / 26624 / 0.85
LIVE = 2048 + 9216 / 2  # the mean context while a rollout decodes: prompt + half the mean response


def step_by_hand(batch: float, live: float = LIVE, floor: float = 0.014) -> float:
    # Eq.: step = max(CPU floor, (2P + batch x live x KV bytes per token) / (0.8 x 3.35 TB/s))
    return max(floor, (2 * P8B + batch * live * KVB) / HBM)


def update_by_hand(tokens: float, passes: int, dense_row: float = 0.0, threads: int = 2,
                   joint: bool = False) -> float:
    # Eq.: compute = tokens / 8 ranks x seconds per token x (1 + 1/4 for the pi_ref forward [+ the
    # dense-mask share L n_q d layers / P]); offload = (passes - 1) x 2 x 4P / 8 over 25 GB/s;
    # DeepSpeedCPUAdam = P / 8 parameters at threads x 0.25e9 per second (cap 2e9). joint (the
    # reflection batch inside the task's optimizer step): every pass accumulates, no Adam step
    dense = dense_row * 32 * 128 * 36 / P8B
    return tokens / 8 * T_TOK * (1.25 + dense) + (passes - (0 if joint else 1)) * 2 * 4 * P8B / 8 / 25e9 \
        + (0.0 if joint else P8B / 8 / min(threads * 0.25e9, 2e9))


def test_step_time_rollout_arithmetic_by_hand():
    cfg = full_preset()
    cfg.threads = 2
    st = plan.step_time(plan.model_shape(None), cfg, 8, 166_613)
    conc = 166_613 // (2048 + 9216)  # 14 sequences fit the KV cache at the mean context
    assert conc == 14
    # 14 sequences of 6,656 live tokens read 16.4 GB of weights + 13.7 GB of KV: 11.2 ms, below the
    # eager CPU floor
    assert step_by_hand(14) == 0.014
    # lockstep: every turn is one blocking call over the wave, which lasts its longest segment:
    # the convoy factor (1.7, a discrete-event model's blocking / continuous ratio) on the decode time
    assert st.phases["rollouts (decode)"] == pytest.approx(math.ceil(256 / 14) * 9216 * 0.014 * 1.7)
    assert any("convoys x 1.7" in x for x in st.assumptions)
    assert st.phases["judge + reflection judge"] == pytest.approx((math.ceil(288 / 8) + 32) * 6.0)
    assert st.total_s == pytest.approx(sum(st.phases.values()))
    # The task update: 256 x 11,264 tokens dealt by tokens over 8 ranks (balanced passes), 32 passes
    # per rank at micro-batch 1, one DeepSpeedCPUAdam step on 2 threads
    assert st.phases["update (forward/backward/optimizer)"] == pytest.approx(update_by_hand(256 * 11264, 32))
    # The reflection update: 32 groups x 8 candidates, each behind its ~11,264-token trajectory
    # (+ 512 new tokens). The fast path packs a group into one row, the trajectory once
    # (11,264 + 8 x 512 = 15,360 tokens <= the max pack 26,624): 0.49M tokens in 32 rows (4 passes
    # per rank), where one sequence per row would be 3.01M; a packed row's dense mask computes its
    # whole 15,360 x 15,360 attention; inside the task update's optimizer step (no CPU Adam step)
    refl_tok = 32 * (11264 + 8 * 512)
    per_row = 32 * 8 * (2048 + 9216 + 512)
    assert plan.reflection_update_tokens(cfg, 2048 + 9216) == (refl_tok, per_row)
    assert plan.reflection_rows(cfg, 2048 + 9216) == (32, 15360)
    assert st.phases["reflection update"] == pytest.approx(update_by_hand(refl_tok, 4, dense_row=15360,
                                                                          joint=True))
    assert any("0.49M tokens, each group packed" in x and "3.01M" in x for x in
               plan.step_time_concurrent(plan.model_shape(None), cfg, 8, 166_613).assumptions)
    # a row holds at most the max pack: at T = 13,312 only 4 candidates fit behind 11,264 tokens
    small = copy.deepcopy(cfg)
    small.full.vllm_max_model_len = 13_312
    assert plan.reflection_update_tokens(small, 11264) == (32 * (2 * 11264 + 8 * 512), per_row)
    assert plan.reflection_rows(small, 11264) == (64, 11264 + 4 * 512)
    plain = copy.deepcopy(cfg)  # the plain path, or per-sequence means: one sequence per row
    plain.fast_logprobs = False
    assert plan.reflection_update_tokens(plain, 11264) == (per_row, per_row)
    assert plan.reflection_rows(plain, 11264) == (256, 11264 + 512)
    plain = copy.deepcopy(cfg)
    plain.ss_grpo.agg = "seq_mean_token_mean"
    assert plan.reflection_update_tokens(plain, 11264) == (per_row, per_row)
    # CPU Adam on 24 threads (a 192-core node's share per rank) runs at the 2e9 parameters/s cap
    many = copy.deepcopy(cfg)
    many.threads = 24
    st24 = plan.step_time(plan.model_shape(None), many, 8, 166_613)
    assert st.phases["update (forward/backward/optimizer)"] - st24.phases["update (forward/backward/optimizer)"] \
        == pytest.approx(P8B / 8 / 0.5e9 - P8B / 8 / 2e9)
    # The preset on 8 engines (one per rank, full.rollout_ranks "all") whose KV cache comes from the
    # memory plan (353,027 tokens: 31 sequences at the mean context), 32 sequences each = 2 waves,
    # searches one at a time on each rank, and every engine asleep through the step's one update
    # (level 1: 2P to host and back at 25 GB/s)
    cfg.full.vllm_margin_gib = 0.0  # the plan's own share, rank 0's cap 0.82 (the margin is tested above)
    mp = plan.memory_plan(plan.model_shape(None), cfg, 8, 8, GIB80, 0)
    assert mp.kv_tokens // (2048 + 9216) == 31
    st8 = plan.step_time(plan.model_shape(None), cfg, 8, mp.kv_tokens,
                         {"sampling_ranks": mp.sampling_ranks, "sleeps": mp.sleeps})
    # 31 sequences: 16.4 GB of weights + 30.4 GB of KV per step = 17.5 ms, above the CPU floor
    assert step_by_hand(31) == pytest.approx((2 * P8B + 31 * LIVE * KVB) / HBM) and step_by_hand(31) > 0.017
    assert st8.phases["rollouts (decode)"] == pytest.approx(math.ceil(32 / 31) * 9216 * step_by_hand(31) * 1.7)
    assert st8.phases["search calls"] == pytest.approx(2 * 5 * 31 * 1.5)
    assert st8.phases["vLLM sleep + wake (1 per step)"] == pytest.approx(2 * 2 * P8B / 25e9)
    for k in ("judge + reflection judge", "update (forward/backward/optimizer)", "reflection update",
              "weight sync (1 per step)"):
        assert st8.phases[k] == pytest.approx(st.phases[k]), k
    text = "\n".join(plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")[0])
    assert f"{st8.total_s / 60:.1f} min per RL step" in text
    assert "8 vLLM engines (one per rank), 32 sequences each: 31 concurrent" in text
    # the memory plan's line: vLLM's share and the concurrent sequences at the mean and max context
    # (margin 0 here: the share is rank 0's cap; one figure on every rank, with each GPU's cap)
    assert "vLLM gpu_memory_utilization 0.82 on every rank (from this plan" in text
    assert "(rank 0 0.82, ranks 1.. 0.85), less full.vllm_margin_gib = 0 GiB" in text
    assert (f"= {353_027 / 11264:.1f} concurrent sequences at the mean context (11264 tokens), "
            f"{353_027 / 26624:.1f} at the max context (26624)") in text


def test_dry_run_prints_the_memory_plan_for_the_model_folder(tmp_path):
    c = dict(plan.QWEN3_8B, num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(c))
    cfg = full_preset()
    cfg.model = str(tmp_path)
    text, problems = dry_run.dry_run(cfg, {"GEMINI_API_KEY": "k" * 10, "SERPER_API_KEY": "k" * 10})
    assert "memory plan (estimate" in text and "step time (estimate; this run's schedule" in text
    assert f"({tmp_path / 'config.json'})" in text
    assert f"{plan.param_count(c) / 1e9:.2f}B parameters" in text
    assert "assumptions:" in text
    assert not any(p.startswith("memory plan") for p in problems)


def prefill_by_hand(tokens: float) -> float:
    # Eq.: prefill = tokens x 2P FLOPs / (989 TFLOP/s x 0.55 MFU)
    return tokens * 2 * P8B / (989e12 * 0.55)


def test_step_time_concurrent_by_hand():
    """The concurrent schedule's estimate (backends/distributed/overlap.py, the preset's "async"):
    every engine's phase = max(its work at its throughput, KV reads counted; its longest rollout);
    groups 2/5/5/4/4/4/4/4 (rank 0 half a share: full.rank0_rollout_share 0.5, since the reflection
    branch samples on its engine too); the judge hidden by the second half of the rollouts; the
    branch's candidates on rank 0's engine; one sync, both updates."""
    cfg = full_preset()
    cfg.threads = 2
    shape = plan.model_shape(None)
    seq = plan.step_time(shape, cfg, 8, 166_613)
    # A small KV cache (166,613 tokens: 14 concurrent) makes the busiest engine (40 rollouts)
    # throughput-bound: 40 / 14 waves of 9,216 decode steps at the 14 ms CPU floor + 5 searches of
    # 1.5 s each, + prefill of 40 x (2,048 prompt + 5 x 500 tool tokens)
    st = plan.step_time_concurrent(shape, cfg, 8, 166_613)
    work = 40 / 14 * (9216 * 0.014 + 5 * 1.5) + prefill_by_hand(40 * (2048 + 5 * 500))
    longest = 18432 * step_by_hand(7) + 10 * 1.5  # the cap at a half-full batch + 10 searches
    assert work > longest
    assert st.phases["rollouts (slowest engine, with its searches)"] == pytest.approx(work)
    # The memory plan's KV cache (353,027 tokens: 31 concurrent) makes every engine wait for its
    # longest rollout: 18,432 tokens one step at a time beside a half-full batch (15.5 sequences:
    # 11.8 ms of HBM time, so the 14 ms CPU floor) plus 10 searches = 4.55 min; the 40-rollout
    # engine's work is 3.7 min
    full = plan.step_time_concurrent(shape, cfg, 8, 353_027)
    work31 = 40 / 31 * (9216 * step_by_hand(31) + 5 * 1.5) + prefill_by_hand(40 * (2048 + 5 * 500))
    longest = 18432 * step_by_hand(15.5) + 10 * 1.5
    assert step_by_hand(15.5) == 0.014 and work31 < longest
    assert full.phases["rollouts (slowest engine, with its searches)"] == pytest.approx(longest)
    assert longest / 60 == pytest.approx(4.55, abs=0.01)
    # With CUDA graphs (full.vllm_enforce_eager False; 7 ms floor) the tail step is its HBM time
    graphs = copy.deepcopy(cfg)
    graphs.full.vllm_enforce_eager = False
    g = plan.step_time_concurrent(shape, graphs, 8, 353_027)
    assert g.phases["rollouts (slowest engine, with its searches)"] == pytest.approx(
        18432 * step_by_hand(15.5, floor=0.007) + 10 * 1.5)
    # The judge: 32 proposal + 256 scoring calls at 8 in flight, 6 s each = (4 + 32) x 6 = 216 s busy,
    # half of the rollouts hide it: 216 - 0.5 x 273 s show
    assert full.phases["judge (not hidden by rollouts)"] == pytest.approx(216 - 0.5 * longest)
    # ... and a provider quota of 1M input tokens per minute paces it: the step's judge input is
    # (pricing.PLAN_ASSUMPTIONS: 600 system + query tokens, 14 rubrics of 45 tokens, mean response
    # 9,216) 32 proposals x (600 + 8 x 9,216 + 630) + 256 scorings x (600 + 9,216 + 630) + 32
    # reflection calls x (600 + 9,216 + 14 x 90 + 8 x 120) = 5,457,984 tokens = 5.5 min
    tin = 32 * (600 + 8 * 9216 + 630) + 256 * (600 + 9216 + 630) + 32 * (600 + 9216 + 14 * 90 + 8 * 120)
    assert tin == 5_457_984
    quota = copy.deepcopy(cfg)
    quota.judge_http.tpm = 1_000_000
    q = plan.step_time_concurrent(shape, quota, 8, 353_027)
    assert q.phases["judge (not hidden by rollouts)"] == pytest.approx(tin / 1e6 * 60 - 0.5 * longest)
    assert any("5.46M input tokens / 1,000,000 tpm = 5.5 min" in x for x in q.assumptions)
    # judge_http.concurrency is the configured one (not cfg.judge): 32 in flight, 1 + 8 rounds = 54 s,
    # hidden but for the last group's 2 round trips
    wide = copy.deepcopy(cfg)
    wide.judge_http.concurrency = 32
    assert plan.step_time_concurrent(shape, wide, 8, 353_027).phases["judge (not hidden by rollouts)"] \
        == pytest.approx(2 * 6.0)
    # The reflection branch on rank 0's engine: 32 groups x 8 candidates of 512 tokens behind ~11,264
    # tokens; a group holds 11,264 + 8 x 512 = 15,360 tokens of KV, so 22 groups (176 candidates) at
    # once, then 10 (80); every candidate reads its whole context (11,264 + 256 on average) per step
    assert 353_027 // 15360 == 22
    branch = 512 * step_by_hand(176, 11264 + 256) + 512 * step_by_hand(80, 11264 + 256)
    assert plan.branch_s(shape, cfg, 353_027, 11264, plan._assume(cfg, None)) == (pytest.approx(branch), 1024)
    # rank 0 (16 rollouts) ends when its longest rollout does, slowed by the branch's steps:
    # 273 s + (89 s - 1,024 x 14 ms) = 348 s, against 273 s for the others: 75 s exposed
    work0 = 1 * (9216 * 0.014 + 5 * 1.5) + prefill_by_hand(16 * (2048 + 5 * 500))
    rank0 = max(work0 + branch, longest + branch - 1024 * 0.014)
    assert rank0 == pytest.approx(longest + branch - 1024 * 0.014)
    assert full.phases["reflection (not hidden by next rollouts)"] == pytest.approx(rank0 - longest)
    # the updates are the lockstep schedule's (both run in either schedule); one sync in each
    for k in ("update (forward/backward/optimizer)", "reflection update", "weight sync (1 per step)"):
        assert full.phases[k] == pytest.approx(seq.phases[k]), k
    assert full.total_s == pytest.approx(sum(full.phases.values()))
    # one engine (full.rollout_ranks "rank0"): all 256 rollouts on it, 31 at once, work-bound
    one = plan.step_time_concurrent(shape, cfg, 8, 353_027, {"sampling_ranks": 1})
    assert one.phases["rollouts (slowest engine, with its searches)"] == pytest.approx(
        256 / 31 * (9216 * step_by_hand(31) + 5 * 1.5) + prefill_by_hand(256 * (2048 + 5 * 500)))


def test_startup_is_its_own_estimate():
    cfg = full_preset()
    shape = plan.model_shape(None)
    su = plan.startup_time(shape, cfg, cpu_adam_prebuilt=False)
    # Eq.: loads = 3 reads of 2P (pi, pi_ref, its vLLM engine; no plain copy with vLLM) at 1 GB/s +
    # the sha256 of the 2P bytes of weight files at 1 GB/s + 60 s of engine build
    assert su.phases == pytest.approx({"DeepSpeedCPUAdam JIT build (no prebuilt op)": 180.0,
                                       "Triton compile (vLLM's kernels)": 60.0,
                                       "model and engine loading": 3 * 2 * P8B / 1e9 + 2 * P8B / 1e9 + 60.0})
    assert "DeepSpeedCPUAdam JIT build (no prebuilt op)" not in plan.startup_time(shape, cfg, True).phases
    cfg.full.vllm_enforce_eager = False  # CUDA graphs: their capture at start-up ...
    assert plan.startup_time(shape, cfg, True).phases["CUDA graph capture (vllm_enforce_eager off)"] == 30.0
    # ... and their memory, taken from the KV cache inside vLLM's share (1 GB less of KV)
    kv_eager = plan.memory_plan(shape, full_preset(), 8, 8, GIB80, 0).kv_tokens
    kv_graphs = plan.memory_plan(shape, cfg, 8, 8, GIB80, 0).kv_tokens
    assert kv_graphs == int((0.77 * GIB80 - 2 * P8B - 2e9 - 1e9) // KVB) < kv_eager == 323_900


def test_largest_micro_batch_fits_the_update_phase_by_hand():
    """With the engine asleep the update phase holds the resident shards and contexts and the
    update's transients, which grow with the micro-batch b: b x (checkpointed activations, one
    recomputed layer, LM-head chunks) at the max pack of 26,624 tokens."""
    cfg = full_preset()
    shape = plan.model_shape(None)
    resident = 3 * 2 * P8B / 8 + 1.5e9 + 4 * plan.EMBED_PARAMS  # rank 0: + the fp32 embedding model
    per_layer = 4 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 3 * 12288

    def update_phase(b):
        return resident + 2 * (151936 * 4096 + 5e8) + b * 26624 * 4096 * 2 * 36 \
            + 2 * b * 26624 * per_layer * 2 + 3 * b * 1024 * 151936 * 4

    slack = 0.06 * GIB80
    assert update_phase(4) + slack <= GIB80 < update_phase(8) + slack  # 70.1 GiB fits, 136 does not
    assert plan.largest_micro_batch(shape, cfg, 8, GIB80) == 4
    # the dry run names it, with the update's time at that micro-batch (fewer offload copies)
    text = "\n".join(plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")[0])
    assert "the update phase fits micro-batch 4" in text and "--set ss_grpo.micro_batch=4" in text
    cfg.ss_grpo.micro_batch = 4
    assert "the update phase fits micro-batch" not in "\n".join(
        plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")[0])
    # a 40 GiB GPU fits micro-batch 1 only
    assert plan.largest_micro_batch(shape, full_preset(), 8, 40 * 2 ** 30) == 1


def test_plan_vs_measured_puts_each_phase_beside_its_metric():
    phases = {plan.ROLLOUTS: 300.0, plan.JUDGE: 60.0, plan.REFLECTION: 0.0, plan.R_UPDATE: 30.0,
              plan.UPDATE: 120.0, plan.SYNC: 6.0, plan.SLEEP: 1.2, "made-up phase": 6.0}
    m = {"time/rollout_s": 360.0, "time/judge_s": 90.0, "time/reflection_update_s": 30.0,
         "time/update_s": 60.0, "time/sync_s": 7.2, "time/step_s": 600.0,
         "time/rollout_rank0_s": 250.0, "time/rollout_rank3_s": 355.0, "time/rollout_rank3_cpu_s": 999.0}
    rows = plan.plan_vs_measured(phases, m)
    by = lambda name: next(r for r in rows if r.strip().startswith(name))  # noqa: E731
    # minutes: plan, measured, measured / plan, the metric
    assert by(plan.ROLLOUTS).split()[-4:] == ["5.0", "6.0", "1.20", "time/rollout_s"]
    assert by(plan.UPDATE).split()[-4:] == ["2.0", "1.0", "0.50", "time/update_s"]
    # the engine's wake is inside the sync: one line for both, 7.2 s measured against 7.2 s planned
    assert by(plan.SYNC + " + " + plan.SLEEP).split()[-4:] == ["0.1", "0.1", "1.00", "time/sync_s"]
    assert by(plan.REFLECTION).endswith("not logged this step")  # no branch was collected
    assert by("made-up phase").endswith("no metric")
    assert by("step").split()[-4:] == ["8.7", "10.0", "1.15", "time/step_s"]
    assert any("slowest rank's rollouts: 5.9 min (time/rollout_rank3_s); fastest 4.2 min" in r for r in rows)
    # lockstep: the rollouts hold their searches, the judging the reflection's
    rows = plan.plan_vs_measured({"rollouts (decode)": 120.0, "search calls": 60.0,
                                  "judge + reflection judge": 60.0},
                                 {"time/rollout_s": 240.0, "time/judge_s": 30.0, "time/reflection_s": 60.0})
    assert next(r for r in rows if "search calls" in r).split()[-4:] == ["3.0", "4.0", "1.33", "time/rollout_s"]
    assert next(r for r in rows if "judge +" in r).split()[-6:] == \
        ["1.0", "1.5", "1.50", "time/judge_s", "+", "time/reflection_s"]


def test_dry_run_prints_both_schedules_the_running_one_first():
    cfg = full_preset()
    lines, _ = plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "not checked")
    text = "\n".join(lines)
    first = next(x for x in lines if x.startswith("step time"))
    assert first.startswith('step time (estimate; this run\'s schedule, full.rollout_schedule="async"')
    assert text.index("start-up (estimate") < text.index(first) < text.index("step time, the other schedule")
    assert 'the other schedule (estimate; full.rollout_schedule="lockstep"' in text
    other = text.index("step time, the other schedule")
    assert text.index("rollouts (slowest engine, with its searches)") < other < text.index("search calls")
    cfg.full.rollout_schedule = "lockstep"
    first = next(x for x in plan.plan_lines(cfg, 8, 8, GIB80, "test", 0, "n")[0] if x.startswith("step time"))
    assert 'full.rollout_schedule="lockstep"' in first
