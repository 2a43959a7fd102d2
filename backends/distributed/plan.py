"""Full mode before launch: per-GPU and per-node memory plan, and an estimated step time.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements nothing of the method; it sizes the appendix's RL systems configuration ("ZeRO-3 with
CPU offload, gradient checkpointing", 32 x 8 sequences, prompt <= 8,192 and response <= 18,432
tokens) for the configured model and launcher, so that `train.py --full --dry-run` can say whether
it fits before anything is loaded. Pure arithmetic: no torch, no DeepSpeed, no model weights.

What is here
    ModelShape / model_shape          the sizes that matter (parameters, layers, hidden, vocabulary,
                                      KV heads) from the model folder's config.json, or Qwen3-8B's
    param_count                       parameters of a Qwen3 / Qwen2 / Llama-style decoder
    memory_plan -> MemoryPlan         bytes per GPU (rank 0, other ranks) and per node, item by item
    step_time -> StepTime             seconds per RL step by phase, with every assumption named
                                      (today's sequential schedule)
    step_time_concurrent              the same for the concurrent schedule (backends/scale/rollout_engine.py)
    plan_lines                        both as dry-run text, plus the problems (a plan that does not fit)

Memory model (bytes; P parameters, W ranks, T = max pack tokens, b = micro-batch; GB = 1e9 B)
    policy bf16 weights        2P / W           (ZeRO-3 partitions)
    policy bf16 gradients      2P / W           (partitioned; reduce buckets below)
    pi_ref bf16 weights        2P / W           (settings.FullConfig.reference = "zero3")
    optimizer                  0 when offloaded, else (4 + 4 + 4) P / W (fp32 master, m, v) + 4P / W
                               (fp32 gradient partition); offloaded, it lives in host RAM instead
    ZeRO-3 working set         2 (max(V H, 2 layer) + 5e8) : the largest gathered module (the
                               embedding / head, or two prefetched layers) and one reduce bucket
                               (DeepSpeed's default reduce_bucket_size, 5e8 elements)
    checkpointed activations   b T H 2 per layer (one hidden state per layer kept)
    one layer recomputed       2 b T (4H + 2 n_q d + 2 n_kv d + 3 I) 2 (its activations and their
                               gradients during the backward; flash / SDPA attention, no T^2 term)
    LM head                    3 b C V 4 (C = full.logprob_chunk rows of fp32 logits, log-softmax
                               and gradient) with the recompute (fast_logprobs.token_logprobs); b T V 4
                               without it
    vLLM (co-located)          utilization x GPU memory: weights 2P, ~2 GB activation reserve, and the
                               KV cache in what is left: 2 L n_kv d 2 bytes per token; on rank 0, and
                               on every rank with full.rollout_ranks "all" (an engine per rank)
    embedding model (rank 0)   4 P_e (fp32, sentence-transformers' default; Qwen3-Embedding-0.6B)
    HF / KV sampling copy      2P bf16 on rank 0, and on every rank with full.rollout_ranks "all"
    CUDA context               ~0.6 GB per process on the GPU (two on a GPU with an out-of-process vLLM)
Per-GPU peak: with more than one rank every vLLM engine sleeps through the update
(full.vllm_sleep_level > 0, backends/distributed/engine.py), so a GPU never holds the engine's weights + KV cache and
the update's transients (gathered module, activations, recomputed layer, LM head) at once:
    peak = resident + max(vLLM, update transients)      (resident: shards, copies, CUDA contexts)
and without sleep (one rank, level 0) the sum of everything.
Host memory per node: offloaded optimizer 16P / W per local rank (fp32 master, m, v, gradients; pinned
on GPU), rank 0's plain bf16 sampling copy 2P (on node 0), ~4 GB per rank of process overhead
(CUDA / torch libraries, Python, the data), vLLM's CPU swap space (4 GiB by default) per engine, and
with sleep level 1 each sleeping engine's weights (2P per engine).

Deviations from the paper: none; the paper gives no memory figures. Every constant above is ours and
is stated where it is used (the estimate is a plan, not a measurement: compare with
scripts/gpu_smoke.sh's per-rank peaks).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

from backends.scale.rollout_engine import shard

GB = 1e9
GIB = 2 ** 30

CUDA_CONTEXT_B = 1.5 * GB  # ours: the trainer's CUDA context with NCCL communicators, cuBLAS workspace
# What the memory plan leaves unused beside vLLM on a GPU (ours): allocator fragmentation, NCCL
# buffers, what a sleeping engine keeps; 6 % of the GPU, at least 3 GiB
ENGINE_SLACK_FRAC = 0.06
ENGINE_SLACK_MIN_B = 3 * GIB
VLLM_ACTIVATION_RESERVE_B = 2.0 * GB  # ours: vLLM's profiled peak activations for an 8B model
REDUCE_BUCKET_ELEMS = 5e8  # DeepSpeed's default reduce_bucket_size
HOST_PER_RANK_B = 4.0 * GB  # ours: torch / CUDA libraries, Python, tokenizer, data, per process
VLLM_SWAP_B = 4 * GIB  # vLLM's default CPU swap space
EMBED_PARAMS = 0.6e9  # PAPER: Qwen3-Embedding-0.6B (the dense retriever)
VLLM_ITEM = "vLLM (weights + KV cache)"
# GPU items that exist only while the update runs (freed to the device before the engine wakes)
UPDATE_TRANSIENTS = ("ZeRO-3 gathered module + reduce bucket", "activations (checkpointed, max pack)",
                     "one layer recomputed (backward)", "activations (no checkpointing, max pack)",
                     "LM head (fp32 logits, chunked, recomputed)", "LM head (fp32 logits, chunked)")


@dataclass(frozen=True)
class ModelShape:
    """The decoder sizes the plan needs. `source`: the config.json read, or "assumed: Qwen3-8B"."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    source: str

    @property
    def layer_params(self) -> int:
        return _layer_params(self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        # Eq.: KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x 2 B (bf16)
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _layer_params(H: int, I: int, nq: int, nkv: int, d: int) -> int:
    # q, k, v, o projections; q / k norms (Qwen3); gate, up, down; two RMSNorms
    return H * nq * d + 2 * H * nkv * d + nq * d * H + 2 * d + 3 * H * I + 2 * H


def param_count(c: dict) -> int:
    """Parameters of a Qwen3 / Qwen2 / Llama-style causal LM from its config.json dict (biases ignored:
    < 0.01 % at 8B). Raises KeyError naming a missing size."""
    H, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    nq = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nq
    d = c.get("head_dim") or H // nq
    tied = bool(c.get("tie_word_embeddings", False))
    # Eq.: P = V H (embedding) [+ V H (untied head)] + L x layer + H (final norm)
    return V * H * (1 if tied else 2) + L * _layer_params(H, I, nq, nkv, d) + H


# PAPER: the policy is Qwen3-8B (its SFT checkpoint); these are Qwen3-8B's published sizes.
QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936, "intermediate_size": 12288,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "tie_word_embeddings": False}


def model_shape(model_dir: str | None) -> ModelShape:
    """ModelShape from model_dir/config.json (a text config under "text_config" too), else Qwen3-8B's
    sizes marked as assumed. Never raises for a missing or unreadable folder (the dry run reports
    that separately); a config without the needed sizes falls back to the assumption as well."""
    c, source = QWEN3_8B, "assumed: Qwen3-8B (no readable config.json)"
    path = os.path.join(os.path.expanduser(model_dir or ""), "config.json")
    if model_dir and os.path.isfile(path):
        try:
            with open(path) as fh:
                raw = json.load(fh)
            raw = raw.get("text_config", raw) if "hidden_size" not in raw else raw
            param_count(raw)
            c, source = raw, path
        except (OSError, ValueError, KeyError, TypeError):
            pass
    nq = c["num_attention_heads"]
    return ModelShape(param_count(c), c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"],
                      c["vocab_size"], nq, c.get("num_key_value_heads") or nq,
                      c.get("head_dim") or c["hidden_size"] // nq,
                      bool(c.get("tie_word_embeddings", False)), source)


@dataclass
class MemoryPlan:
    """Bytes per GPU for rank 0 and for the other ranks (item -> bytes), host bytes per node, and
    the capacities they are checked against."""

    rank0: dict = field(default_factory=dict)
    others: dict = field(default_factory=dict)
    host_node0: dict = field(default_factory=dict)
    host_other_nodes: dict = field(default_factory=dict)
    gpu_bytes: float = 0.0
    host_bytes: float = 0.0
    kv_tokens: int = 0
    kv_contexts: float = 0.0
    world: int = 1
    ranks_per_node: int = 1
    notes: list = field(default_factory=list)
    sleeps: bool = False  # vLLM engines sleep through the update (the peak is then by phase)
    engines: int = 0  # vLLM engines (one per rank with engine zero3)
    sampling_ranks: int = 1  # ranks whose engine samples (full.rollout_ranks)
    util: dict = field(default_factory=dict)  # vLLM's share of the GPU: "rank 0", "ranks 1.."

    def utilization_for(self, d: dict, gpu_bytes: float) -> float:
        """vLLM's share of one GPU whose other items are `d` (VLLM_ITEM left out): what stays
        resident while the engine samples (everything but the update's transients when the engine
        sleeps through the update, everything otherwise) plus ENGINE_SLACK, the rest for vLLM;
        floored to 0.01 and kept in [0.3, 0.9]. vLLM checks at start that this share is free."""
        resident = float(sum(v for k, v in d.items() if k != VLLM_ITEM
                             and (not self.sleeps or k not in UPDATE_TRANSIENTS)))
        slack = max(ENGINE_SLACK_MIN_B, ENGINE_SLACK_FRAC * gpu_bytes)
        # Eq.: util = floor((G - resident - slack) / G, 0.01), in [0.3, 0.9]
        util = math.floor((gpu_bytes - resident - slack) / gpu_bytes * 100) / 100
        return min(0.9, max(0.3, util))

    @staticmethod
    def total(d: dict) -> float:
        return float(sum(d.values()))

    def phases(self, d: dict) -> tuple[float, float]:
        """(rollout-phase bytes, update-phase bytes) of one GPU's items `d`: the rollouts hold
        everything but the update's transients; the update everything but a sleeping engine's
        weights + KV cache (all of it when the engine does not sleep)."""
        tot = self.total(d)
        transient = float(sum(v for k, v in d.items() if k in UPDATE_TRANSIENTS))
        engine = float(d.get(VLLM_ITEM, 0.0)) if self.sleeps else 0.0
        return tot - transient, tot - engine

    def peak(self, d: dict) -> float:
        """Bytes one GPU needs at its busiest phase (the sum of everything without sleep)."""
        return max(self.phases(d))


def memory_plan(shape: ModelShape, cfg, world: int, ranks_per_node: int, gpu_bytes: float,
                host_bytes: float) -> MemoryPlan:
    """The plan of the module docstring for `cfg` (a config.Config: cfg.full, cfg.ss_grpo.micro_batch,
    cfg.sampler, cfg.bank.retriever, the pack length) on `world` ranks, `ranks_per_node` per node,
    GPUs of `gpu_bytes` and nodes of `host_bytes`. Raises ValueError for world < 1."""
    if world < 1 or ranks_per_node < 1:
        raise ValueError("world and ranks_per_node must be >= 1")
    full = cfg.full
    P, W, H, V = shape.params, world, shape.hidden, shape.vocab
    b = int(cfg.ss_grpo.micro_batch)
    T = pack_tokens(cfg)
    bf16 = full.bf16 != "off"
    wb = 2 if bf16 else 4  # bytes per weight on the GPU
    g = {}
    # Eq.: ZeRO-3 shards: weights, gradients and pi_ref each (bytes per weight) x P / W
    g["policy weights (ZeRO-3 shard)"] = wb * P / W
    g["policy gradients (shard)"] = wb * P / W
    if cfg.ss_grpo.beta > 0:
        g["pi_ref weights (ZeRO-3 shard)"] = wb * P / W
    if not full.offload_optimizer:
        # Eq.: fp32 master + Adam m + v + fp32 gradient partition = 16 P / W
        g["optimizer (fp32 master, m, v, grads)"] = 16 * P / W
    g["ZeRO-3 gathered module + reduce bucket"] = wb * (max(V * H, 2 * shape.layer_params)
                                                        + REDUCE_BUCKET_ELEMS)
    if full.gradient_checkpointing:
        # Eq.: one hidden state per layer: b T H x 2 B x layers
        g["activations (checkpointed, max pack)"] = b * T * H * wb * shape.layers
        per_layer = 4 * H + 2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim \
            + 3 * shape.intermediate
        g["one layer recomputed (backward)"] = 2 * b * T * per_layer * wb
    else:
        per_layer = 4 * H + 2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim \
            + 3 * shape.intermediate
        g["activations (no checkpointing, max pack)"] = b * T * per_layer * wb * shape.layers
    # Eq.: chunked head with recompute: 3 x (b x chunk) x V x 4 B; the decision is
    # fast_logprobs._recompute_head's (positions x V x 4 B above 256 MiB)
    from_recompute = b * T * V * 4 > 256 * 2 ** 20
    rows = b * min(full.logprob_chunk, T)
    g["LM head (fp32 logits, chunked" + (", recomputed)" if from_recompute else ")")] = \
        3 * rows * V * 4 if from_recompute else b * T * V * 4
    g["CUDA context"] = CUDA_CONTEXT_B
    others = dict(g)
    r0 = dict(g)
    plan = MemoryPlan(world=W, ranks_per_node=ranks_per_node, gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    if cfg.bank.retriever == "dense":
        r0["embedding model (fp32, Qwen3-Embedding-0.6B)"] = 4 * EMBED_PARAMS
    if cfg.sampler == "vllm":
        # build.vllm_engines: with engine zero3 every rank holds an engine inside its own process
        # (one CUDA context per GPU), at every world size, asleep through each update
        everywhere = getattr(cfg, "engine", "zero3") == "zero3"
        plan.engines = W if everywhere else 1
        plan.sleeps = everywhere and int(getattr(full, "vllm_sleep_level", 1)) > 0
        plan.sampling_ranks = W if everywhere and full.rollout_ranks == "all" else 1
        for who, d in (("rank 0", r0), ("ranks 1..", others)) if everywhere and W > 1 else (("rank 0", r0),):
            # Eq.: utilisation = (GPU - what stays resident while the engine runs - slack) / GPU
            util = float(full.vllm_gpu_memory_utilization) or plan.utilization_for(d, gpu_bytes)
            d[VLLM_ITEM] = util * gpu_bytes
            plan.util[who] = util
            # Eq.: KV tokens = (util x GPU - 2P weights - activation reserve) / KV bytes per token
            kv = max(0, int((util * gpu_bytes - 2 * P - VLLM_ACTIVATION_RESERVE_B) // shape.kv_bytes_per_token))
            plan.kv_tokens = kv if not plan.kv_tokens else min(plan.kv_tokens, kv)
        max_len = full.vllm_max_model_len or T
        plan.kv_contexts = plan.kv_tokens / max_len
    elif cfg.sampler in ("hf", "kv"):
        r0["sampling copy (HF generate, bf16)"] = wb * P
        if W > 1 and full.rollout_ranks == "all":  # every rank samples with its own copy
            others["sampling copy (HF generate, bf16)"] = wb * P
    plan.rank0, plan.others = r0, others
    n_local = min(ranks_per_node, W)
    h = {}
    if full.offload_optimizer:
        # Eq.: host optimizer = 16 P / W per local rank (fp32 master, m, v, gradient partition)
        h["offloaded optimizer (16P/W per rank)"] = 16 * P / W * n_local
    h["process overhead (per rank)"] = HOST_PER_RANK_B * n_local
    other = dict(h)
    if cfg.sampler == "vllm":
        h["rank 0 plain bf16 copy (fingerprint, resume)"] = 2 * P
        per_node = n_local if plan.engines > 1 else 1
        h["vLLM CPU swap space"] = VLLM_SWAP_B * per_node
        if plan.engines > 1:
            other["vLLM CPU swap space"] = VLLM_SWAP_B * n_local
        if plan.sleeps and int(getattr(full, "vllm_sleep_level", 1)) == 1:
            # Eq.: level 1 keeps each sleeping engine's bf16 weights in host RAM: 2P per engine
            h["vLLM weights asleep (level 1, 2P per engine)"] = 2 * P * per_node
            if plan.engines > 1:
                other["vLLM weights asleep (level 1, 2P per engine)"] = 2 * P * n_local
    plan.host_node0, plan.host_other_nodes = h, (other if W > ranks_per_node else {})
    return plan


def vllm_utilization(shape: ModelShape, cfg, world: int, gpu_bytes: float, rank0: bool = True) -> float:
    """vLLM's gpu_memory_utilization for one rank's engine from the memory plan
    (MemoryPlan.utilization_for; full.vllm_gpu_memory_utilization > 0 overrides it): rank 0's GPU
    also holds the embedding model. A float in [0.3, 0.9]."""
    mp = memory_plan(shape, cfg, world, min(world, 8), gpu_bytes, 0.0)
    return mp.util.get("rank 0" if rank0 else "ranks 1..", mp.util.get("rank 0", 0.3))


def pack_tokens(cfg) -> int:
    """The longest sequence an update sees: full.max_prompt_tokens + rollout.max_response_tokens
    (PAPER: 8,192 + 18,432 = 26,624), or full.vllm_max_model_len when that is set."""
    mp = int(getattr(cfg.full, "max_prompt_tokens", 0) or 4096)
    return int(cfg.full.vllm_max_model_len or mp + cfg.rollout.max_response_tokens)


def mean_context(cfg) -> float:
    """The mean context of a sampled sequence while it decodes to its end, in tokens: the prompt
    (~2,048 of the 8,192 allowed, ours) plus the mean response (ASSUME mean_response_frac of the max)."""
    prompt = min(pack_tokens(cfg) - cfg.rollout.max_response_tokens, 2048)
    return prompt + ASSUME["mean_response_frac"] * cfg.rollout.max_response_tokens


@dataclass
class StepTime:
    """Seconds per RL step by phase, the assumptions behind them, and the total."""

    phases: dict
    assumptions: list
    total_s: float


# Assumptions of the step-time estimate (ours; every one is printed with the estimate).
ASSUME = {
    "mean_response_frac": 0.5,  # mean response length / max response (DR Tulu-style trajectories)
    "hbm_bytes_per_s": 3.35e12,  # H100 SXM HBM3 bandwidth (decode is bandwidth bound)
    "eager_overhead": 3.0,  # vLLM enforce_eager (no CUDA graphs): x per decode step
    "tool_calls_per_rollout": 5.0,  # of at most 10
    "search_s": 1.5,  # one Serper call
    "judge_call_s": 6.0,  # one Gemini Flash call with thinking
    "judge_concurrency": 8,  # judge_http.concurrency (its default; the configured value is used)
    "gpu_flops": 989e12,  # H100 dense bf16
    "mfu": 0.25,  # ZeRO-3 with optimizer offload and checkpointing
    "cpu_adam_params_per_s": 1.0e9,  # DeepSpeedCPUAdam, per rank
    "sync_bytes_per_s": 2e9,  # ours, conservative: gathers + two device copies per byte into the in-process engine
    "sampling_ranks": 1,  # vLLM engines sampling (1: rank 0 alone; plan_lines passes MemoryPlan.engines)
    "sleeps": False,  # engines sleep through each update (level 1: weights to host and back)
    "pcie_bytes_per_s": 25e9,  # host <-> GPU copy of a sleeping engine's weights (pinned, PCIe 5)
    # Convoys: with blocking batch calls (schedule "lockstep": every turn is one generate call over
    # the wave) a call lasts as long as its longest segment, and a rollout whose search returned
    # waits for it. The rollout phase is then this factor x the continuous-batching one: the ratio
    # of a discrete-event model of one engine (docs/full_mode.md, "Convoys"; 15.5 / 9.0 min, 1.7-1.9
    # over its variants). Continuous batching (schedule "async", backends/scale/engine_loop.py) has none.
    "convoy_factor": 1.7,
}


def reflection_update_tokens(cfg, ctx: float) -> tuple[float, float]:
    """(tokens the reflection update processes as the code runs it, the same at one sequence per row)
    for one step's reflection batch (train.apply_reflection_batch): rollout.prompts_per_step groups
    (PAPER: one reflection group per question) of reflection.m candidates, each candidate = the
    reflection prompt (the trajectory it reflects on, ~`ctx` tokens, ASSUME) + at most
    reflection.max_new_tokens. On the fast path (fast_logprobs, the full preset's; not under agg
    "seq_mean_token_mean") a group's candidates travel as one unit of the update
    (fast_logprobs.SharedPrefixRows.units, policy.plan_update) and share one row, the trajectory once,
    rows of at most the max pack T (pack_tokens): k = floor((T - ctx) / new) candidates per row.
    Otherwise every candidate is a row of its own. Floats, tokens."""
    g, m = cfg.rollout.prompts_per_step, int(cfg.reflection.m)
    new = float(cfg.reflection.max_new_tokens or 512)
    # Eq.: one sequence per row = G m (ctx + new)
    per_row = g * m * (ctx + new)
    if not (cfg.fast_logprobs and cfg.ss_grpo.agg != "seq_mean_token_mean" and ctx >= new):
        return per_row, per_row  # (ctx >= new: share_groups packs a prompt >= its continuations)
    k = max(1, int((pack_tokens(cfg) - ctx) // new))  # candidates per packed row
    # Eq.: packed per group = G (ceil(m / k) ctx + m new)
    return g * (math.ceil(m / k) * ctx + m * new), per_row


def _update_s(tokens: float, P: float, W: int, cfg, a: dict) -> float:
    """Seconds of one policy update over `tokens` tokens: training FLOPs (6 + 2 recompute) P per token,
    + 2P (pi_ref) + 2P (old pass when > 1 minibatch), at the MFU; + DeepSpeedCPUAdam's steps."""
    # Eq.: training FLOPs = (6 + 2 recompute) P per token; + 2P (pi_ref) + 2P (old pass if > 1 minibatch)
    flops = tokens * P * (8 + (2 if cfg.ss_grpo.beta > 0 else 0) + (2 if cfg.ss_grpo.minibatches > 1 else 0))
    return flops / (W * a["gpu_flops"] * a["mfu"]) + cfg.ss_grpo.minibatches * P / W / a["cpu_adam_params_per_s"]


def step_time(shape: ModelShape, cfg, world: int, kv_tokens: int, assume: dict | None = None) -> StepTime:
    """Estimated seconds per RL step of the sequential schedule (train.rl_step): rollouts in
    lock-step rounds on `sampling_ranks` vLLM engines (1: rank 0 alone; every rank with
    full.rollout_ranks "all", a contiguous share each), search, judge, update, weight syncs (and the
    engines' sleep / wake when they sleep through the update). `kv_tokens`: one engine's KV capacity
    in tokens (MemoryPlan.kv_tokens; 0 = unknown, then one context). Every figure in ASSUME (or
    `assume` overrides) is printed."""
    a = {**ASSUME, "judge_concurrency": int(getattr(cfg.judge_http, "concurrency", ASSUME["judge_concurrency"])),
         **(assume or {})}
    P, W = shape.params, world
    ranks = max(1, int(a["sampling_ranks"]))
    # Eq.: each engine samples its share: ceil(prompts x n / engines) sequences (rollout_engine.shard)
    seqs = math.ceil(cfg.rollout.prompts_per_step * cfg.rollout.n / ranks)
    resp = a["mean_response_frac"] * cfg.rollout.max_response_tokens
    prompt = min(pack_tokens(cfg) - cfg.rollout.max_response_tokens, 2048)
    ctx = prompt + resp  # mean context while decoding ends at this
    concurrency = max(1, min(seqs, int(kv_tokens // max(ctx, 1)) if kv_tokens else 1))
    # Eq.: one decode step reads the weights once: 2P bytes / bandwidth x eager overhead
    decode_step = 2 * P / a["hbm_bytes_per_s"] * a["eager_overhead"]
    waves = math.ceil(seqs / concurrency)
    # Eq.: rollouts = waves x mean response x decode step x convoy factor (blocking calls per turn)
    rollouts = waves * resp * decode_step * a["convoy_factor"]
    # rounds are synchronised across the rollouts of a wave and searches run one at a time
    search = waves * a["tool_calls_per_rollout"] * concurrency * a["search_s"]
    judge_calls = cfg.rollout.prompts_per_step * (1 + cfg.rollout.n)
    reflect_calls = cfg.rollout.prompts_per_step
    judge = math.ceil(judge_calls / a["judge_concurrency"]) * a["judge_call_s"] \
        + reflect_calls * a["judge_call_s"]
    tokens = cfg.rollout.prompts_per_step * cfg.rollout.n * (prompt + resp)
    update = _update_s(tokens, P, W, cfg, a)
    r_tok, r_rows = reflection_update_tokens(cfg, ctx)
    r_update = _update_s(r_tok, P, W, cfg, a)
    sync = 2 * 2 * P / a["sync_bytes_per_s"]  # two syncs per step (task and reflection updates)
    phases = {"rollouts (decode)": rollouts, "search calls": search, "judge + reflection judge": judge,
              "update (forward/backward/optimizer)": update, "reflection update": r_update,
              "weight syncs (2 per step)": sync}
    if a["sleeps"]:  # Eq.: per update, weights 2P to host and back at PCIe speed (all engines at once)
        phases["vLLM sleep + wake (2 per step)"] = 2 * 2 * 2 * P / a["pcie_bytes_per_s"]
    engines = "one vLLM engine (rank 0)" if ranks == 1 else \
        f"{ranks} vLLM engines (one per rank), {seqs} sequences each"
    assumptions = [
        f"mean response {resp:.0f} tokens ({a['mean_response_frac']:g} x max), prompt ~{prompt} tokens",
        f"{engines}: {concurrency} concurrent sequences (KV capacity / mean context), "
        f"{waves} waves; decode step {decode_step * 1e3:.0f} ms = 2P / {a['hbm_bytes_per_s'] / 1e12:g} "
        f"TB/s x {a['eager_overhead']:g} (eager); convoys x {a['convoy_factor']:g} (every turn one "
        "blocking call over the wave: a call lasts its longest segment)",
        f"{a['tool_calls_per_rollout']:g} searches per rollout at {a['search_s']:g} s, one at a time "
        "on each engine's rank (a turn waits for every rollout of its wave)",
        f"{judge_calls} judge calls ({a['judge_concurrency']} in flight) + {reflect_calls} serial "
        f"reflection calls, {a['judge_call_s']:g} s each",
        f"update at {a['mfu']:g} MFU of {a['gpu_flops'] / 1e12:g} TFLOP/s per GPU, CPU Adam at "
        f"{a['cpu_adam_params_per_s'] / 1e9:g}e9 params/s per rank",
        _reflection_line(cfg, r_tok, r_rows, ctx),
        f"sync: 2 x 2P bytes at {a['sync_bytes_per_s'] / 1e9:g} GB/s (in memory, into each rank's engine)",
    ]
    if a["sleeps"]:
        assumptions.append(f"vLLM sleep (level 1) through each update: 2P to host and back at "
                           f"{a['pcie_bytes_per_s'] / 1e9:g} GB/s, all engines at once")
    return StepTime(phases, assumptions, float(sum(phases.values())))


# Assumptions of the concurrent schedule's estimate besides ASSUME (ours; printed with it).
ASSUME_CONCURRENT = {
    "sampling_ranks": 0,  # ranks with a co-located vLLM engine (0: every rank; backends/scale/rollout_engine.py)
    "judge_rounds_exposed": 2,  # the last group's proposal + scoring round trips after its rollouts
    "reflection_m": 8,  # PAPER: 8 candidates per reflection
    "reflection_tokens": 512,  # reflection.max_new_tokens of the full preset
}


def step_time_concurrent(shape: ModelShape, cfg, world: int, kv_tokens: int,
                         assume: dict | None = None) -> StepTime:
    """Estimated seconds per RL step under the concurrent schedule (backends/scale/rollout_engine.py): every
    rank samples 1/W of the sequences on its own engine with `kv_tokens` of KV cache; a rollout's
    searches delay only that rollout (no turn barrier); groups are judged while others still sample,
    so only what the judge cannot hide behind the rollouts is counted; step t's reflection overlaps
    step t+1's rollouts (its judging counts only where it is longer; its sampling delays rank 0's
    rollouts, which share rank 0's engine with it); one weight sync.
    The same ASSUME figures as step_time (plus ASSUME_CONCURRENT), so the two compare like for like."""
    a = {**ASSUME, **ASSUME_CONCURRENT,
         "judge_concurrency": int(getattr(cfg.judge, "concurrency", ASSUME["judge_concurrency"])),
         **(assume or {})}
    P, W = shape.params, world
    ranks = int(a["sampling_ranks"]) or W
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.n
    # each rank's groups (rank 0 takes full.rank0_rollout_share of a share: the reflection branch
    # samples on its engine too)
    share = float(getattr(getattr(cfg, "full", None), "rank0_rollout_share", 1.0)) if ranks > 1 else 1.0
    groups = [len(shard(cfg.rollout.prompts_per_step, ranks, r, share)) for r in range(ranks)]
    per_rank = max(groups) * cfg.rollout.n
    resp = a["mean_response_frac"] * cfg.rollout.max_response_tokens
    prompt = min(pack_tokens(cfg) - cfg.rollout.max_response_tokens, 2048)
    ctx = prompt + resp
    fits = int(kv_tokens // max(ctx, 1)) if kv_tokens else 1
    concurrency = max(1, min(per_rank, fits))
    # Eq.: one decode step reads the weights once: 2P bytes / bandwidth x eager overhead
    decode_step = 2 * P / a["hbm_bytes_per_s"] * a["eager_overhead"]
    # continuous batching (engine_loop.py): a segment joins the running batch when its search
    # returns and a waiting sequence takes the place of one that ends, so no convoy factor (ASSUME
    # convoy_factor applies to blocking calls only) and no wave barrier: waves = sequences / concurrency
    waves = max(1.0, per_rank / concurrency)
    waves0 = max(1.0, groups[0] * cfg.rollout.n / max(1, min(groups[0] * cfg.rollout.n, fits)))
    rollouts = waves * resp * decode_step
    # each rollout waits only for its own searches, one after another (its turns are sequential)
    search = waves * a["tool_calls_per_rollout"] * a["search_s"]
    C, L = a["judge_concurrency"], a["judge_call_s"]
    judge_calls = cfg.rollout.prompts_per_step * (1 + cfg.rollout.n)
    judge_busy = math.ceil(judge_calls / C) * L  # the judge's own time at C requests in flight
    judge = max(a["judge_rounds_exposed"] * L, judge_busy - (rollouts + search))
    reflect_calls = cfg.rollout.prompts_per_step
    # the branch samples its P x m candidates on rank 0's engine, in the same batches as rank 0's
    # rollouts (engine_loop.py): they take engine steps from it, so rank 0 finishes that much later
    reflect_seqs = reflect_calls * a["reflection_m"]
    # (continuous batching: no wave barrier here either)
    reflect_sample = max(1.0, reflect_seqs / max(1, int(kv_tokens // (ctx + a["reflection_tokens"]))
                                                if kv_tokens else 1)) * a["reflection_tokens"] * decode_step
    reflect_judge = math.ceil(reflect_calls / C) * L
    reflection = reflect_sample + reflect_judge
    rank0_busy = waves0 * resp * decode_step + reflect_sample
    # Eq.: exposed = how much later rank 0 (its rollouts + the candidates) ends than the slowest
    # other rank, + the judging the rollouts do not hide
    reflection_exposed = max(0.0, rank0_busy - rollouts) + max(0.0, reflect_judge - (rollouts + search))
    tokens = seqs * (prompt + resp)
    update = _update_s(tokens, P, W, cfg, a)
    r_tok, r_rows = reflection_update_tokens(cfg, ctx)
    r_update = _update_s(r_tok, P, W, cfg, a)  # step t-1's reflection batch, before the task batch
    sync = 2 * P / a["sync_bytes_per_s"]  # one sync per step (reflection and task batch, then sync)
    phases = {"rollouts (decode)": rollouts, "search calls": search,
              "judge (not hidden by rollouts)": judge,
              "reflection (not hidden by next rollouts)": reflection_exposed,
              "update (forward/backward/optimizer)": update, "reflection update": r_update,
              "weight sync (1 per step)": sync}
    if a["sleeps"]:  # one update per step: one sleep + wake
        phases["vLLM sleep + wake (1 per step)"] = 2 * 2 * P / a["pcie_bytes_per_s"]
    assumptions = [
        f"{ranks} sampling ranks, one co-located vLLM engine each: up to {per_rank} sequences per "
        f"engine, {concurrency} concurrent (KV capacity / mean context), {waves:.2f} waves; decode step "
        "as above; continuous batching: no convoys, no wave barrier" + ("" if share == 1.0 else f"; rank 0 takes {groups[0]} of "
                      f"{cfg.rollout.prompts_per_step} groups ({waves0:.2f} waves; "
                      f"full.rank0_rollout_share {share:g})"),
        f"{a['tool_calls_per_rollout']:g} searches per rollout at {a['search_s']:g} s, on each rollout's "
        "own path (no turn barrier; calls of different rollouts concurrent)",
        f"judge busy {judge_busy / 60:.1f} min ({judge_calls} calls, {C} in flight) runs during the "
        f"rollouts; at least {a['judge_rounds_exposed']:g} round trips of the last group after them",
        f"reflection: {reflect_calls * a['reflection_m']:g} candidates of {a['reflection_tokens']:g} "
        f"tokens + {reflect_calls} judge calls ({C} in flight) = {reflection / 60:.1f} min, "
        "overlapping the next step's rollouts (one-step lag); the candidates take "
        f"{reflect_sample / 60:.1f} min of rank 0's engine",
        _reflection_line(cfg, r_tok, r_rows, ctx),
        f"sync: 1 x 2P bytes at {a['sync_bytes_per_s'] / 1e9:g} GB/s",
    ]
    return StepTime(phases, assumptions, float(sum(phases.values())))


def _reflection_line(cfg, as_run: float, per_row: float, ctx: float) -> str:
    """The reflection update's assumption line (reflection_update_tokens)."""
    how = ("one sequence per row" if as_run == per_row else
           f"each group packed behind its trajectory (one sequence per row it would be {per_row / 1e6:.2f}M)")
    return (f"reflection update: {cfg.rollout.prompts_per_step} groups x {cfg.reflection.m} candidates "
            f"behind their ~{ctx:.0f}-token trajectories, {as_run / 1e6:.2f}M tokens, {how}; its own "
            "optimizer step(s)")


def _fmt(d: dict) -> list[str]:
    return [f"    {k:<46} {v / GIB:8.1f} GiB" for k, v in d.items()]


def plan_lines(cfg, world: int, ranks_per_node: int, gpu_bytes: float, gpu_src: str,
               host_bytes: float, host_src: str) -> tuple[list[str], list[str]]:
    """The dry run's "memory plan" and "step time" sections for cfg on this launch, and the problems:
    a GPU or node whose planned bytes exceed its capacity, or a KV cache below one full context."""
    shape = model_shape(cfg.model)
    mp = memory_plan(shape, cfg, world, ranks_per_node, gpu_bytes, host_bytes)
    problems = []
    lines = ["memory plan (estimate; backends/distributed/plan.py)",
             f"  model: {shape.params / 1e9:.2f}B parameters, {shape.layers} layers, hidden {shape.hidden}, "
             f"vocabulary {shape.vocab} ({shape.source})",
             f"  max pack {pack_tokens(cfg)} tokens, micro-batch {cfg.ss_grpo.micro_batch}, world {world} "
             f"({ranks_per_node} per node), GPU {gpu_bytes / GIB:.1f} GiB ({gpu_src})"]
    for who, d in (("GPU 0 (rank 0)", mp.rank0), ("GPUs of ranks 1.." if world > 1 else None, mp.others)):
        if who is None:
            continue
        tot = mp.peak(d)
        if mp.sleeps and VLLM_ITEM in d:
            roll, upd = mp.phases(d)
            lines.append(f"  {who}: peak {tot / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB (rollouts "
                         f"{roll / GIB:.1f} GiB; update {upd / GIB:.1f} GiB with vLLM asleep)")
        else:
            lines.append(f"  {who}: {tot / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB")
        lines += _fmt(d)
        if tot > gpu_bytes:
            problems.append(f"memory plan: {who} needs ~{tot / GIB:.1f} GiB, more than the GPU's "
                            f"{gpu_bytes / GIB:.1f} GiB (lower full.vllm_gpu_memory_utilization, "
                            "shorter packs, or more ranks)")
    if cfg.sampler == "vllm":
        max_len = cfg.full.vllm_max_model_len or pack_tokens(cfg)
        mean_ctx = mean_context(cfg)
        src = "full.vllm_gpu_memory_utilization" if cfg.full.vllm_gpu_memory_utilization else \
            "from this plan: what the rollouts leave free, less slack"
        lines.append("  vLLM gpu_memory_utilization " + ", ".join(f"{k} {v:.2f}" for k, v in mp.util.items())
                     + f" ({src})")
        lines.append(f"  vLLM KV cache: {mp.kv_tokens} tokens per engine ({shape.kv_bytes_per_token / 1024:.0f} "
                     f"KiB per token) = {mp.kv_tokens / mean_ctx:.1f} concurrent sequences at the mean "
                     f"context ({mean_ctx:.0f} tokens), {mp.kv_contexts:.1f} at the max context ({max_len}); "
                     f"{mp.engines} engine(s), one inside each rank's process"
                     + (f", asleep (level {cfg.full.vllm_sleep_level}) during the update" if mp.sleeps else ""))
        if mp.kv_tokens < max_len:
            problems.append(f"memory plan: vLLM's KV cache holds {mp.kv_tokens} tokens, less than one "
                            f"context of {max_len} (raise full.vllm_gpu_memory_utilization)")
    for who, d in (("node 0", mp.host_node0), ("other nodes", mp.host_other_nodes)):
        if not d:
            continue
        tot = MemoryPlan.total(d)
        cap = f"of {host_bytes / GIB:.1f} GiB ({host_src})" if host_bytes else f"({host_src})"
        lines.append(f"  host RAM, {who}: {tot / GIB:.1f} GiB {cap}")
        lines += _fmt(d)
        if host_bytes and tot > host_bytes:
            problems.append(f"memory plan: host RAM of {who} needs ~{tot / GIB:.1f} GiB, more than "
                            f"{host_bytes / GIB:.1f} GiB ({host_src})")
    st = step_time(shape, cfg, world, mp.kv_tokens, {"sampling_ranks": mp.sampling_ranks,
                                                    "sleeps": mp.sleeps})
    ours = getattr(getattr(cfg, "full", None), "rollout_schedule", "lockstep")
    mark = {s: f', this run\'s: full.rollout_schedule="{s}"' if s == ours else "" for s in ("lockstep", "async")}
    lines += ["", f"step time (estimate{mark['lockstep']}): {st.total_s / 60:.1f} min per RL step, "
                  f"{st.total_s * cfg.steps / 3600:.0f} h for {cfg.steps} steps"]
    lines += [f"    {k:<46} {v / 60:8.1f} min" for k, v in st.phases.items()]
    lines += ["  assumptions:"] + [f"    - {x}" for x in st.assumptions]
    sc = step_time_concurrent(shape, cfg, world, mp.kv_tokens, {"sleeps": mp.sleeps})
    lines += ["", f"step time, concurrent schedule (estimate; backends/distributed/overlap.py{mark['async']}): "
                  f"{sc.total_s / 60:.1f} min per RL step ({sc.total_s / st.total_s:.2f}x), "
                  f"{sc.total_s * cfg.steps / 3600:.0f} h for {cfg.steps} steps"]
    lines += [f"    {k:<46} {v / 60:8.1f} min" for k, v in sc.phases.items()]
    lines += ["  assumptions (besides the ones above):"] + [f"    - {x}" for x in sc.assumptions]
    return lines, problems


# ----------------------------------------------------------------------------------------------------
# The SFT stage (backends/sft/zero3.py): memory per GPU at the max length, GPU-hours

SFT_ASSUME = {
    "gpu_flops": 989e12,  # H100 dense bf16 (PAPER: 8 x H100 80GB)
    "mfu": 0.35,  # ZeRO-3 without offload, gradient checkpointing, micro-batch 1 (ours)
}


def sft_memory_plan(shape: ModelShape, cfg, world: int, gpu_bytes: float) -> MemoryPlan:
    """The RL plan's per-GPU items for the SFT engine: no pi_ref, no sampler, no embedding model, one
    sequence of cfg.max_len tokens per micro-batch (cfg: backends.sft.zero3.SFTRunConfig)."""
    full = cfg.full_config()  # settings.FullConfig (plan.py imports no backend module: full imports it)
    as_rl = SimpleNamespace(full=full, ss_grpo=SimpleNamespace(micro_batch=cfg.micro_batch, beta=0.0),
                            sampler="none", bank=SimpleNamespace(retriever="none"),
                            rollout=SimpleNamespace(max_response_tokens=cfg.max_len))
    return memory_plan(shape, as_rl, world, min(world, 8), gpu_bytes, 0.0)


def sft_gpu_hours(shape: ModelShape, cfg, n_examples: int, mean_tokens: float,
                  assume: dict | None = None) -> tuple[float, list[str]]:
    """(GPU-hours, assumptions) of cfg.epochs passes over n_examples of mean_tokens tokens."""
    a = {**SFT_ASSUME, **(assume or {})}
    tokens = n_examples * mean_tokens * cfg.epochs
    # Eq.: FLOPs = (6 + 2 recompute) P per token (2 P forward, 4 P backward, 2 P checkpoint recompute)
    flops = tokens * shape.params * (8 if cfg.gradient_checkpointing else 6)
    hours = flops / (a["gpu_flops"] * a["mfu"]) / 3600
    return hours, [f"{n_examples} examples x {mean_tokens:.0f} tokens x {cfg.epochs} epochs = "
                   f"{tokens:.3g} tokens", f"{8 if cfg.gradient_checkpointing else 6} P FLOPs per token "
                   "(attention's T^2 term ignored: ~10 % at 16k tokens for 8B)",
                   f"{a['mfu']:g} MFU of {a['gpu_flops'] / 1e12:g} TFLOP/s per GPU"]


def sft_plan_lines(shape: ModelShape, cfg, world: int, gpu_bytes: float, n_examples: int,
                   mean_tokens: float) -> list[str]:
    """The SFT dry run's memory and GPU-hour sections."""
    mp = sft_memory_plan(shape, cfg, world, gpu_bytes)
    tot = MemoryPlan.total(mp.others)
    lines = ["memory plan (estimate; backends/distributed/plan.py)",
             f"  model: {shape.params / 1e9:.2f}B parameters ({shape.source}); {cfg.max_len} tokens per "
             f"micro-batch of {cfg.micro_batch}, world {world}",
             f"  per GPU: {tot / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB"
             + ("" if tot <= gpu_bytes else "  (DOES NOT FIT: --offload-optimizer or more GPUs)")]
    lines += _fmt(mp.others)
    if mp.host_node0:
        lines.append(f"  host RAM per node: {MemoryPlan.total(mp.host_node0) / GIB:.1f} GiB")
        lines += _fmt(mp.host_node0)
    hours, assumptions = sft_gpu_hours(shape, cfg, n_examples, mean_tokens)
    lines += ["", f"GPU-hours (estimate): {hours:.0f} GPU-hours = {hours / world:.1f} h on {world} GPUs"]
    lines += ["  assumptions:"] + [f"    - {x}" for x in assumptions]
    return lines
