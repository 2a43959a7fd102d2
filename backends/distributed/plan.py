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
    largest_micro_batch               the largest micro-batch whose update phase fits (engine asleep)
    step_time_concurrent -> StepTime  seconds per RL step by phase under the schedule the full preset
                                      runs ("async", backends/distributed/overlap.py), every
                                      assumption named: engine_phase (one engine's rollouts:
                                      decode_step_s with KV reads, the longest rollout), branch_s (the
                                      reflection candidates on rank 0's engine), judge_busy_s (latency
                                      or the provider's tokens-per-minute quota), _update_s (measured
                                      pass time, balanced passes, offload copies, cpu_adam_s)
    step_time                         the same for the sequential schedule ("lockstep", train.rl_step)
    startup_time                      the one-off start-up before step 0 (builds, compiles, loads)
    plan_vs_measured                  step 1's time/* metrics next to the plan's phases (train.py)
    plan_lines                        all of it as dry-run text, plus the problems (a plan that does
                                      not fit)

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
    vLLM (co-located)          utilization x GPU memory: weights 2P, ~2 GB activation reserve, with
                               CUDA graphs (full.vllm_enforce_eager False) ~1 GB for them, and the
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
on GPU), ~4 GB per rank of process overhead (CUDA / torch libraries, Python, the data), vLLM's CPU
swap space (4 GiB by default) per engine, and with sleep level 1 each sleeping engine's weights in
pinned memory (2P, each tensor rounded up to a power of two: pinned_sleep_bytes, ~1.37 x 2P). With vLLM rank 0 holds no plain copy of the policy (train.py: the engines and the ZeRO-3
partitions load from the model folder; the reference record hashes its weight files).

Deviations from the paper: none; the paper gives no memory figures. Every constant above is ours and
is stated where it is used (the estimate is a plan, not a measurement: compare with
scripts/gpu_smoke.sh's per-rank peaks).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

from backends.scale.rollout_engine import shard
from ss_grpo import ARMS

GB = 1e9
GIB = 2 ** 30

CUDA_CONTEXT_B = 1.5 * GB  # ours: the trainer's CUDA context with NCCL communicators, cuBLAS workspace
# What the memory plan leaves unused beside vLLM on a GPU (ours): allocator fragmentation, NCCL
# buffers, what a sleeping engine keeps; 6 % of the GPU, at least 3 GiB
ENGINE_SLACK_FRAC = 0.06
ENGINE_SLACK_MIN_B = 3 * GIB
VLLM_ACTIVATION_RESERVE_B = 2.0 * GB  # ours: vLLM's profiled peak activations for an 8B model
# With CUDA graphs (full.vllm_enforce_eager False) vLLM estimates their memory while profiling and
# takes it from the KV cache (on by default since vLLM 0.21; its start-up log "Estimated CUDA graph
# memory" reads 0.36-0.65 GiB in vllm-project/vllm#21489 and gpustack/runner#251); ours: 1 GB
VLLM_CUDA_GRAPH_B = 1.0 * GB
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


def pinned_sleep_bytes(shape: ModelShape) -> float:
    """Host bytes one vLLM engine asleep at level 1 pins for its bf16 weights: vLLM backs each
    weight allocation up into a pinned CPU tensor of its own (vllm/device_allocator/cumem.py), and
    torch's pinned host allocator rounds every request up to a power of two
    (ATen/core/CachingHostAllocator.h). vLLM holds the fused tensors of its Qwen3 layers: qkv_proj,
    o_proj, gate_up_proj, down_proj, and the embedding and (untied) head; norms are rounded too.
    Qwen3-8B: 22.4 GB against 2P = 16.4 GB (x 1.37)."""
    H, I, nq, nkv, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim
    up = lambda n: float(2 ** math.ceil(math.log2(max(1, n))))  # noqa: E731  (bytes -> pinned bytes)
    # Eq.: per layer 2 B x (qkv (nq + 2 nkv) d H, o H nq d, gate_up 2 I H, down H I, 2 norms H, q/k norms d)
    layer = up(2 * (nq + 2 * nkv) * d * H) + up(2 * H * nq * d) + up(2 * 2 * I * H) + up(2 * H * I) \
        + 2 * up(2 * H) + 2 * up(2 * d)
    emb = up(2 * shape.vocab * H)
    return shape.layers * layer + emb * (1 if shape.tied else 2) + up(2 * H)


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
    util: dict = field(default_factory=dict)  # vLLM's share of the GPU: "rank 0", "ranks 1.." (one
    # figure on every rank: `share`)
    caps: dict = field(default_factory=dict)  # the most each GPU could give vLLM (utilization_for)
    share: float = 0.0  # the one share every engine is built with (engine_share)

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
        gpus = (("rank 0", r0), ("ranks 1..", others)) if everywhere and W > 1 else (("rank 0", r0),)
        # Eq.: cap = (GPU - what stays resident while the engine runs - slack) / GPU, per GPU
        plan.caps = {who: plan.utilization_for(d, gpu_bytes) for who, d in gpus}
        # One share on every rank: vLLM's external-launcher executor gives every engine the KV cache
        # of the rank with the least (a MIN all-reduce), so more elsewhere would sit unused
        plan.share = float(full.vllm_gpu_memory_utilization) or _less_margin(
            min(plan.caps.values()), float(getattr(full, "vllm_margin_gib", 0.0)), gpu_bytes)
        for who, d in gpus:
            d[VLLM_ITEM] = plan.share * gpu_bytes
            plan.util[who] = plan.share
        # Eq.: KV tokens = (share x GPU - 2P weights - activation reserve [- CUDA graphs]) / KV bytes per token
        graphs = 0.0 if getattr(full, "vllm_enforce_eager", True) else VLLM_CUDA_GRAPH_B
        plan.kv_tokens = max(0, int((plan.share * gpu_bytes - 2 * P - VLLM_ACTIVATION_RESERVE_B - graphs)
                                    // shape.kv_bytes_per_token))
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
        per_node = n_local if plan.engines > 1 else 1
        h["vLLM CPU swap space"] = VLLM_SWAP_B * per_node
        if plan.engines > 1:
            other["vLLM CPU swap space"] = VLLM_SWAP_B * n_local
        if plan.sleeps and int(getattr(full, "vllm_sleep_level", 1)) == 1:
            # Eq.: level 1 keeps each sleeping engine's bf16 weights in pinned host RAM, every tensor
            # rounded up to a power of two (pinned_sleep_bytes: ~1.37 x 2P for Qwen3-8B)
            pinned = pinned_sleep_bytes(shape)
            h["vLLM weights asleep (level 1, pinned)"] = pinned * per_node
            if plan.engines > 1:
                other["vLLM weights asleep (level 1, pinned)"] = pinned * n_local
    plan.host_node0, plan.host_other_nodes = h, (other if W > ranks_per_node else {})
    return plan


def _less_margin(least: float, margin_gib: float, gpu_bytes: float) -> float:
    """engine_share's arithmetic: floor((least x G - margin) / G, 0.01), kept in [min(0.3, least),
    least]. Raises ValueError for a negative margin."""
    if margin_gib < 0:
        raise ValueError(f"full.vllm_margin_gib must be >= 0, got {margin_gib}")
    # Eq.: share = floor((least x G - margin) / G, 0.01)   (1e-9: a share that is exactly on a
    # hundredth, e.g. (0.82 x G - 4 GiB) / G at G = 80 GiB, stays on it despite the float error)
    share = math.floor((least * gpu_bytes - margin_gib * GIB) / gpu_bytes * 100 + 1e-9) / 100
    return min(least, max(0.3, share))


def engine_share(shape: ModelShape, cfg, world: int, gpu_bytes: float) -> float:
    """The gpu_memory_utilization every rank's engine is built with (engine.engine_utilization), the
    memory plan's `share`: full.vllm_gpu_memory_utilization when set (> 0), else the least of the
    plan's per-GPU caps (rank 0's: its GPU also holds the embedding model) less
    full.vllm_margin_gib. One share for all, since vLLM's external-launcher executor gives every
    engine the KV cache of the rank with the least (MIN all-reduce in
    vllm/v1/executor/uniproc_executor.py, determine_available_memory): a larger share elsewhere
    would be reserved and never used. A float in [0.3, least cap] (the margin never takes it below
    the plan's floor). Raises ValueError for a negative margin."""
    return memory_plan(shape, cfg, world, min(world, 8), gpu_bytes, 0.0).share


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
    """Seconds per RL step (or of start-up) by phase, the assumptions behind them, and the total."""

    phases: dict
    assumptions: list
    total_s: float


# Assumptions of the step-time estimate. Each figure is a cited one or labelled ours; every one is
# printed with the estimate, and step 1's measured time/* replace them (plan_vs_measured).
ASSUME = {
    "mean_response_frac": 0.5,  # ours: mean response / max response (DR Tulu-style trajectories)
    # decode (vLLM): one step reads the bf16 weights and every live sequence's KV cache
    "hbm_bytes_per_s": 3.35e12,  # H100 SXM HBM3 bandwidth (NVIDIA's H100 datasheet)
    "hbm_efficiency": 0.8,  # ours (assumption): the share of it a decode step reaches
    "cpu_floor_eager_s": 0.014,  # ours (assumption): vLLM's CPU time per step, no CUDA graphs
    "cpu_floor_graphs_s": 0.007,  # ours (assumption): the same with CUDA graphs (launches replayed)
    "prefill_mfu": 0.55,  # ours (assumption): prompts and tool results prefill compute-bound
    "tool_tokens": 500,  # ours (assumption): tokens one search result adds to a rollout's context
    "tail_batch_frac": 0.5,  # ours (assumption): the longest rollout decodes beside a half-full batch
    "tool_calls_per_rollout": 5.0,  # ours (assumption): the mean; rollout.max_tool_calls bounds one rollout
    "search_s": 1.5,  # ours (assumption): one Serper call
    "judge_call_s": 6.0,  # ours (assumption): one Gemini Flash call with thinking, 10-20k-token prompt
    "judge_concurrency": 8,  # judge_http.concurrency (its default; the configured value is used)
    "judge_tpm": 0,  # judge_http.tpm, the provider's input tokens per minute (0 = unknown: no quota term)
    # groups are judged as they finish; a group finishes with its slowest of n rollouts, so most
    # finish in the second half of the phase: the judge hides behind that half only (ours)
    "judge_hidden_frac": 0.5,
    "gpu_flops": 989e12,  # H100 dense bf16 (NVIDIA's H100 datasheet)
    # measured: one forward + backward + recompute pass of 26,624 tokens at 36 layers of Qwen3-8B's
    # width on one H200 took 4.9 s, 0.37 MFU (docs/full_mode.md, "Measured on one H200"; the H100 has
    # the same bf16 peak)
    "update_s_per_token": 4.9 / 26624,
    "zero3_efficiency": 0.85,  # ours (assumption): that pass had no ZeRO-3 gathers / reduce-scatters
    "cpu_adam_params_per_s_per_thread": 0.25e9,  # ours (assumption): DeepSpeedCPUAdam, one OpenMP thread
    "cpu_adam_max_params_per_s": 2.0e9,  # ours (assumption): a rank's share of host memory bandwidth
    "threads": 2,  # config.threads: DeepSpeedCPUAdam's OpenMP threads per rank (the configured value is used)
    "sync_bytes_per_s": 2e9,  # ours, conservative: gathers + two device copies per byte into the in-process engine
    "sampling_ranks": 1,  # vLLM engines sampling (1: rank 0 alone; plan_lines passes MemoryPlan.engines)
    "sleeps": False,  # engines sleep through each update (level 1: weights to host and back)
    "pcie_bytes_per_s": 25e9,  # ours (assumption): pinned host <-> GPU copies (PCIe 5 x16)
    "eager": True,  # full.vllm_enforce_eager (vLLM without CUDA graphs; the configured value is used)
    # Convoys: with blocking batch calls (schedule "lockstep": every turn is one generate call over
    # the wave) a call lasts as long as its longest segment, and a rollout whose search returned
    # waits for it. The rollout phase is then this factor x the continuous-batching one: the ratio
    # of a discrete-event model of one engine (docs/full_mode.md, "Convoys"; 15.5 / 9.0 min, 1.7-1.9
    # over its variants). Continuous batching (schedule "async", backends/scale/engine_loop.py) has none.
    "convoy_factor": 1.7,
}


def _assume(cfg, assume: dict | None, *more: dict) -> dict:
    """ASSUME (and `more`) with the configured judge concurrency and quota, CPU Adam threads and
    CUDA-graph switch, then the caller's overrides."""
    h = _judge_http(cfg)
    full = getattr(cfg, "full", None)
    return {**ASSUME, **{k: v for d in more for k, v in d.items()},
            "judge_concurrency": int(h.concurrency), "judge_tpm": int(h.tpm),
            "threads": int(getattr(cfg, "threads", ASSUME["threads"]) or 1),
            "eager": bool(getattr(full, "vllm_enforce_eager", True)), **(assume or {})}


def _judge_http(cfg):
    """The run's judge_http section (backends/api/settings.HTTPJudgeConfig), or its defaults."""
    from backends.api.settings import HTTPJudgeConfig  # a pure dataclass module (no HTTP)
    return getattr(cfg, "judge_http", None) or HTTPJudgeConfig()


def _prompt(cfg) -> int:
    """The mean prompt in tokens (ours: ~2,048 of the full.max_prompt_tokens allowed)."""
    return min(pack_tokens(cfg) - cfg.rollout.max_response_tokens, 2048)


def reflection_update_tokens(cfg, ctx: float) -> tuple[float, float]:
    """(tokens the reflection update processes as the code runs it, the same at one sequence per row)
    for one step's reflection batch (train.reflection_update_batch): rollout.prompts_per_step groups
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
    k = _per_row(cfg, ctx)
    if k is None:
        return per_row, per_row
    # Eq.: packed per group = G (ceil(m / k) ctx + m new)
    return g * (math.ceil(m / k) * ctx + m * new), per_row


def _per_row(cfg, ctx: float) -> int | None:
    """Reflection candidates packed per row behind one `ctx`-token trajectory, or None when every
    candidate is a row of its own (reflection_update_tokens)."""
    new = float(cfg.reflection.max_new_tokens or 512)
    if not (cfg.fast_logprobs and cfg.ss_grpo.agg != "seq_mean_token_mean" and ctx >= new):
        return None  # (ctx >= new: share_groups packs a prompt >= its continuations)
    return max(1, int((pack_tokens(cfg) - ctx) // new))


def reflection_rows(cfg, ctx: float) -> tuple[int, float]:
    """(rows of one step's reflection update, tokens of its longest row): G ceil(m / k) packed rows of
    ctx + k new tokens (k = candidates per row, reflection_update_tokens), else G m rows of ctx + new."""
    g, m = cfg.rollout.prompts_per_step, int(cfg.reflection.m)
    new = float(cfg.reflection.max_new_tokens or 512)
    k = _per_row(cfg, ctx)
    if k is None:
        return g * m, ctx + new
    return g * math.ceil(m / k), ctx + min(k, m) * new


def cpu_adam_s(P: float, W: int, cfg, a: dict) -> float:
    """Seconds of DeepSpeedCPUAdam's ss_grpo.minibatches steps on one rank's P / W parameters (0 when
    the optimizer is not offloaded): `threads` OpenMP threads (config.threads) at ASSUME's rate per
    thread, capped by a rank's share of host memory bandwidth."""
    if not getattr(cfg.full, "offload_optimizer", True):
        return 0.0
    # Eq.: rate = min(threads x per-thread rate, cap); Adam = minibatches x P / W / rate
    rate = min(a["threads"] * a["cpu_adam_params_per_s_per_thread"], a["cpu_adam_max_params_per_s"])
    return cfg.ss_grpo.minibatches * P / W / rate


def _update_s(shape: ModelShape, tokens: float, rows: int, W: int, cfg, a: dict,
              dense_row: float = 0.0, joint: bool = False) -> float:
    """Seconds of one policy update over `tokens` tokens in `rows` rows (sequences, or packed rows).
    - Compute: the measured seconds per token of a forward + backward + recompute pass (ASSUME
      update_s_per_token) at the ZeRO-3 efficiency, x (1 + 1/4 for the pi_ref forward + 1/4 for the
      old-log-prob forward when there is more than one minibatch: a forward is 2P of the pass's 8P
      FLOPs per token), over W ranks. policy.plan_update deals each optimizer step's rows by tokens
      and sorts each rank's passes, so every collective pass is as long on every rank: no imbalance.
    - dense_row > 0: rows of that many tokens carry a dense L x L mask (packed reflection rows,
      fast_logprobs): no causal skipping (transformers' SDPA path takes the efficient kernel), so half
      of each row's attention is computed in vain: + 8 L n_q d layers FLOPs per token (4 passes' worth
      of 2 L n_q d per layer), at the pass's FLOP rate.
    - Offload: each micro-batch pass beyond the first of an optimizer step accumulates the gradient
      into the fp32 partition in pinned host memory by copying it to the GPU and back (DeepSpeed
      stage3.py partition_grads: "adding directly to cpu is very slow"): 2 x 4P / W bytes over PCIe.
    - DeepSpeedCPUAdam (cpu_adam_s).
    joint: the rows join another update's optimizer steps (the deferred reflection batch inside the
    task update, train.update_policy): no optimizer step of their own, and every one of their passes
    accumulates into a step the task's passes opened."""
    P = shape.params
    t_tok = a["update_s_per_token"] / a["zero3_efficiency"]
    fwd = (0.25 if cfg.ss_grpo.beta > 0 else 0.0) + (0.25 if cfg.ss_grpo.minibatches > 1 else 0.0)
    # Eq.: extra share of a dense-mask row = 8 L n_q d layers / 8P = L n_q d layers / P
    dense = dense_row * shape.heads * shape.head_dim * shape.layers / P if dense_row else 0.0
    # Eq.: compute = tokens / W x t_tok x (1 + forward passes + dense share)
    compute = tokens / W * t_tok * (1.0 + fwd + dense)
    passes = micro_passes(rows, W, cfg)
    offload = 0.0
    if getattr(cfg.full, "offload_optimizer", True):
        # Eq.: offload = (passes - minibatches) x 2 x 4P / W / PCIe   (joint: passes x ...)
        opened = 0 if joint else cfg.ss_grpo.minibatches
        offload = max(0, passes - opened) * 2 * 4 * P / W / a["pcie_bytes_per_s"]
    return compute + offload + (0.0 if joint else cpu_adam_s(P, W, cfg, a))


def micro_passes(rows: int, W: int, cfg) -> int:
    """Micro-batch passes per rank for `rows` rows: ss_grpo.minibatches optimizer steps, each dealing
    its rows over W ranks, ss_grpo.micro_batch rows per pass."""
    mb, b = max(1, cfg.ss_grpo.minibatches), max(1, int(cfg.ss_grpo.micro_batch))
    # Eq.: passes = minibatches x ceil(rows / minibatches / W / b)
    return mb * math.ceil(rows / mb / W / b)


# ----------------------------------------------------------------------------------------------------
# One engine's rollout phase (vLLM, continuous batching)


def decode_step_s(shape: ModelShape, batch: float, live_ctx: float, a: dict) -> float:
    """Seconds of one vLLM decode step of `batch` sequences holding `live_ctx` tokens of context each:
    the larger of vLLM's CPU time per step (ASSUME cpu_floor_eager_s, or cpu_floor_graphs_s with CUDA
    graphs) and the HBM time to read the bf16 weights once and every sequence's KV cache
    (ModelShape.kv_bytes_per_token; Qwen3-8B: 147,456 B) at hbm_efficiency x hbm_bytes_per_s."""
    floor = a["cpu_floor_eager_s"] if a["eager"] else a["cpu_floor_graphs_s"]
    # Eq.: step = max(CPU floor, (2P + batch x live context x KV bytes per token) / (eff x HBM))
    mem = (2 * shape.params + batch * live_ctx * shape.kv_bytes_per_token) \
        / (a["hbm_efficiency"] * a["hbm_bytes_per_s"])
    return max(floor, mem)


def prefill_s(shape: ModelShape, tokens: float, a: dict) -> float:
    """Seconds to prefill `tokens` tokens (prompts, tool results) at ASSUME prefill_mfu."""
    # Eq.: prefill = tokens x 2P / (peak FLOP/s x MFU)
    return tokens * 2 * shape.params / (a["gpu_flops"] * a["prefill_mfu"])


@dataclass(frozen=True)
class EnginePhase:
    """One engine's rollout phase: seconds by the throughput bound (work_s) and by its longest
    rollout (longest_s); the concurrent sequences, waves, and the full and tail decode steps."""

    work_s: float
    longest_s: float
    concurrency: int
    waves: float
    step_s: float
    tail_step_s: float

    @property
    def phase_s(self) -> float:
        return max(self.work_s, self.longest_s)


def engine_phase(shape: ModelShape, cfg, seqs: int, kv_tokens: int, a: dict) -> EnginePhase:
    """The rollout phase of one engine sampling `seqs` rollouts with `kv_tokens` of KV cache (0 =
    unknown: one at a time), with continuous batching (backends/scale/engine_loop.py):
        concurrency c = min(seqs, KV tokens / mean end context)
        work    = seqs / c x (mean response x step(c) + mean searches x search) + prefill of every
                  rollout's prompt and tool results          (throughput, KV reads counted)
        longest = max response x step(tail_frac x c) + max tool calls x search
                  (the longest rollout decodes one token per step, beside a partly filled batch)
        phase   = max(work, longest)
    step(b) = decode_step_s at the mean live context (prompt + half the mean response)."""
    if seqs <= 0:
        return EnginePhase(0.0, 0.0, 0, 0.0, 0.0, 0.0)
    resp = a["mean_response_frac"] * cfg.rollout.max_response_tokens
    prompt = _prompt(cfg)
    ctx = prompt + resp
    live = prompt + resp / 2  # the mean context over a rollout's decoding
    c = max(1, min(seqs, int(kv_tokens // max(ctx, 1)) if kv_tokens else 1))
    step = decode_step_s(shape, c, live, a)
    waves = seqs / c
    calls = a["tool_calls_per_rollout"]
    # Eq.: work = waves x (resp x step + calls x search) + prefill(seqs x (prompt + calls x tool tokens))
    work = waves * (resp * step + calls * a["search_s"]) \
        + prefill_s(shape, seqs * (prompt + calls * a["tool_tokens"]), a)
    tail = decode_step_s(shape, max(1.0, a["tail_batch_frac"] * c), live, a)
    # Eq.: longest = max response x tail step + max tool calls x search
    longest = cfg.rollout.max_response_tokens * tail + cfg.rollout.max_tool_calls * a["search_s"]
    return EnginePhase(work, longest, c, waves, step, tail)


def branch_s(shape: ModelShape, cfg, kv_tokens: int, ctx: float, a: dict) -> tuple[float, int]:
    """(seconds, decode steps) of one reflection branch's candidates on rank 0's engine: P groups of
    reflection.m candidates of reflection.max_new_tokens behind their ~ctx-token trajectory. A group's
    candidates share the trajectory's KV blocks (prefix cache), so ctx + m new tokens of KV per group
    and as many groups at once as the KV cache holds; but every candidate reads its whole context at
    every step (decode kernels do not dedupe shared prefixes), so a step reads m x (ctx + new / 2)
    tokens of KV per group."""
    g_left, m = cfg.rollout.prompts_per_step, int(cfg.reflection.m)
    new = int(cfg.reflection.max_new_tokens or 512)
    fit = max(1, int(kv_tokens // (ctx + m * new))) if kv_tokens else 1
    total, steps = 0.0, 0
    while g_left > 0:  # batches of `fit` groups, one after another
        g = min(fit, g_left)
        # Eq.: batch = new x step(g m candidates at ctx + new / 2)
        total += new * decode_step_s(shape, g * m, ctx + new / 2, a)
        steps += new
        g_left -= g
    return total, steps


def judge_busy_s(cfg, a: dict) -> tuple[float, float, dict]:
    """(seconds the judge is busy with one step's task calls, of which the quota's floor, the judge
    cost plan) for cfg: max(task calls x latency / concurrency, the step's judge input tokens / tpm),
    task calls = proposals + scorings (backends/api/pricing.judge_cost_plan); the quota counts every
    call of the step (the reflection branch's too: one quota). tpm 0: no quota term."""
    from backends.api.pricing import judge_cost_plan  # pure arithmetic (no HTTP)
    view = cfg if getattr(cfg, "judge_http", None) is not None else \
        SimpleNamespace(**{k: getattr(cfg, k) for k in ("judge", "rollout", "steps", "reflection", "arm")},
                        judge_http=_judge_http(cfg))
    jp = judge_cost_plan(view)
    calls = jp["per_step"]["calls"]
    C, L = max(1, a["judge_concurrency"]), a["judge_call_s"]
    # Eq.: latency bound = ceil(P / C) + ceil(P n / C) rounds of one call each (proposals, then scorings)
    latency = (math.ceil(calls["proposal"] / C) + math.ceil(calls["scoring"] / C)) * L
    # Eq.: quota bound = input tokens per step / (tpm / 60 s)
    quota = jp["per_step"]["tokens_in"] / a["judge_tpm"] * 60.0 if a["judge_tpm"] else 0.0
    return max(latency, quota), quota, jp


# ----------------------------------------------------------------------------------------------------
# The two schedules


def step_time(shape: ModelShape, cfg, world: int, kv_tokens: int, assume: dict | None = None) -> StepTime:
    """Estimated seconds per RL step of the sequential schedule (train.rl_step, "lockstep"): rollouts
    in lock-step rounds on `sampling_ranks` vLLM engines (1: rank 0 alone; every rank with
    full.rollout_ranks "all", a contiguous share each), search, judge, update, weight syncs (and the
    engines' sleep / wake when they sleep through the update). `kv_tokens`: one engine's KV capacity
    in tokens (MemoryPlan.kv_tokens; 0 = unknown, then one context). The decode step and the updates
    are the concurrent model's (decode_step_s, _update_s), so the two compare like for like."""
    a = _assume(cfg, assume)
    P, W = shape.params, world
    ranks = max(1, int(a["sampling_ranks"]))
    # Eq.: each engine samples its share: ceil(prompts x n / engines) sequences (rollout_engine.shard)
    seqs = math.ceil(cfg.rollout.prompts_per_step * cfg.rollout.n / ranks)
    resp = a["mean_response_frac"] * cfg.rollout.max_response_tokens
    prompt = _prompt(cfg)
    ctx = prompt + resp  # mean context while decoding ends at this
    concurrency = max(1, min(seqs, int(kv_tokens // max(ctx, 1)) if kv_tokens else 1))
    decode_step = decode_step_s(shape, concurrency, prompt + resp / 2, a)
    waves = math.ceil(seqs / concurrency)
    # Eq.: rollouts = waves x mean response x decode step x convoy factor (blocking calls per turn)
    rollouts = waves * resp * decode_step * a["convoy_factor"]
    # rounds are synchronised across the rollouts of a wave and searches run one at a time
    search = waves * a["tool_calls_per_rollout"] * concurrency * a["search_s"]
    judge_calls = cfg.rollout.prompts_per_step * (1 + cfg.rollout.n)
    reflect_calls = cfg.rollout.prompts_per_step
    judge = math.ceil(judge_calls / a["judge_concurrency"]) * a["judge_call_s"] \
        + reflect_calls * a["judge_call_s"]
    seq_all = cfg.rollout.prompts_per_step * cfg.rollout.n
    update = _update_s(shape, seq_all * ctx, seq_all, W, cfg, a)
    r_tok, r_rows = reflection_update_tokens(cfg, ctx)
    rows, row_len = reflection_rows(cfg, ctx)
    r_update = _update_s(shape, r_tok, rows, W, cfg, a, row_len if r_tok != r_rows else 0.0,
                         joint=True)
    sync = 2 * P / a["sync_bytes_per_s"]  # one sync per step (one update: task and reflection)
    phases = {"rollouts (decode)": rollouts, "search calls": search, "judge + reflection judge": judge,
              "update (forward/backward/optimizer)": update, "reflection update": r_update,
              "weight sync (1 per step)": sync}
    if a["sleeps"]:  # Eq.: per update, weights 2P to host and back at PCIe speed (all engines at once)
        phases["vLLM sleep + wake (1 per step)"] = 2 * 2 * P / a["pcie_bytes_per_s"]
    engines = "one vLLM engine (rank 0)" if ranks == 1 else \
        f"{ranks} vLLM engines (one per rank), {seqs} sequences each"
    assumptions = [
        f"{engines}: {concurrency} concurrent sequences (KV capacity / mean context), {waves} waves; "
        f"decode step {decode_step * 1e3:.0f} ms (as the running schedule's); convoys x "
        f"{a['convoy_factor']:g} (every turn one blocking call over the wave: a call lasts its longest "
        "segment)",
        f"{a['tool_calls_per_rollout']:g} searches per rollout at {a['search_s']:g} s, one at a time "
        "on each engine's rank (a turn waits for every rollout of its wave)",
        f"{judge_calls} judge calls ({a['judge_concurrency']} in flight) + {reflect_calls} serial "
        f"reflection calls, {a['judge_call_s']:g} s each; updates and sleep / wake as the running "
        "schedule's; sync: 2P bytes (in memory, into each rank's engine)",
    ]
    return StepTime(phases, assumptions, float(sum(phases.values())))


# Assumptions of the concurrent schedule's estimate besides ASSUME (ours; printed with it).
ASSUME_CONCURRENT = {
    "sampling_ranks": 0,  # ranks with a co-located vLLM engine (0: every rank; backends/scale/rollout_engine.py)
    "judge_rounds_exposed": 2,  # the last group's proposal + scoring round trips after its rollouts
}

# The step's phases (concurrent schedule), in the order the dry run prints them.
ROLLOUTS = "rollouts (slowest engine, with its searches)"
JUDGE = "judge (not hidden by rollouts)"
REFLECTION = "reflection (not hidden by next rollouts)"
R_UPDATE = "reflection update"
UPDATE = "update (forward/backward/optimizer)"
SYNC = "weight sync (1 per step)"
SLEEP = "vLLM sleep + wake (1 per step)"


def step_time_concurrent(shape: ModelShape, cfg, world: int, kv_tokens: int,
                         assume: dict | None = None) -> StepTime:
    """Estimated seconds per RL step under the concurrent schedule (backends/distributed/overlap.py,
    full.rollout_schedule "async"; rollouts of backends/scale/rollout_engine.py):
    - rollouts: every rank samples its groups (rollout_engine.shard; rank 0 a full.rank0_rollout_share
      of a share) on its own engine with `kv_tokens` of KV cache; the phase is the slowest engine's
      engine_phase: max(work at the engine's throughput with KV reads counted, its longest rollout);
    - judge: groups are judged as they finish (StreamingJudge); its busy time (judge_busy_s: latency
      or the provider's tokens-per-minute quota) hides behind the part of the rollouts in which
      groups finish (ASSUME judge_hidden_frac), and at least the last group's round trips show;
    - reflection: step t's branch overlaps step t+1's rollouts; its candidates sample on rank 0's
      engine (branch_s), which ends that much later (its longest rollout decodes at the branch's
      slower steps meanwhile), and its judging counts only where it outlasts the rollouts;
    - updates: the reflection batch of step t-1, then the task batch (_update_s), one weight sync,
      one sleep + wake.
    The same ASSUME figures as step_time (plus ASSUME_CONCURRENT)."""
    a = _assume(cfg, assume, ASSUME_CONCURRENT)
    P, W = shape.params, world
    ranks = int(a["sampling_ranks"]) or W
    n, G = cfg.rollout.n, cfg.rollout.prompts_per_step
    reflects = bool(ARMS[cfg.arm].reflection) if cfg.arm in ARMS else True
    # each rank's groups (rank 0 takes full.rank0_rollout_share of a share while the branch samples
    # on its engine too)
    share = float(getattr(getattr(cfg, "full", None), "rank0_rollout_share", 1.0)) \
        if ranks > 1 and reflects else 1.0
    groups = [len(shard(G, ranks, r, share)) for r in range(ranks)]
    eng = [engine_phase(shape, cfg, g * n, kv_tokens, a) for g in groups]
    rollouts = max(e.phase_s for e in eng)
    slowest = max(range(ranks), key=lambda r: (eng[r].phase_s, eng[r].work_s))
    resp = a["mean_response_frac"] * cfg.rollout.max_response_tokens
    ctx = _prompt(cfg) + resp
    C, L = max(1, a["judge_concurrency"]), a["judge_call_s"]
    busy, quota, jp = judge_busy_s(cfg, a)
    # Eq.: judge exposed = max(last group's round trips, busy - hidden fraction x rollouts)
    judge = max(a["judge_rounds_exposed"] * L, busy - a["judge_hidden_frac"] * rollouts)
    b_s, b_steps, rank0 = 0.0, 0, eng[0].phase_s
    refl_calls = jp["per_step"]["calls"]["reflection"] if reflects else 0
    if reflects:
        b_s, b_steps = branch_s(shape, cfg, kv_tokens, ctx, a)
        e0 = eng[0]
        # Eq.: rank 0 = max(its work + the branch, its longest rollout + the branch's steps beyond
        # what that rollout's own steps would have taken)
        rank0 = max(e0.work_s + b_s, e0.longest_s + max(0.0, b_s - b_steps * e0.tail_step_s))
    reflect_judge = math.ceil(refl_calls / C) * L
    # Eq.: exposed = (rank 0 with the branch - the slowest engine) + the branch's judging beyond the rollouts
    reflection = max(0.0, rank0 - rollouts) + max(0.0, reflect_judge - rollouts)
    seqs = G * n
    update = _update_s(shape, seqs * ctx, seqs, W, cfg, a)
    r_tok, r_rows = reflection_update_tokens(cfg, ctx)
    rows, row_len = reflection_rows(cfg, ctx)
    r_update = _update_s(shape, r_tok, rows, W, cfg, a, row_len if r_tok != r_rows else 0.0, joint=True) \
        if reflects else 0.0
    sync = 2 * P / a["sync_bytes_per_s"]  # one sync per step (reflection and task batch, then sync)
    phases = {ROLLOUTS: rollouts, JUDGE: judge, REFLECTION: reflection, R_UPDATE: r_update,
              UPDATE: update, SYNC: sync}
    if a["sleeps"]:  # one update phase per step: one sleep + wake
        phases[SLEEP] = 2 * 2 * P / a["pcie_bytes_per_s"]
    e = eng[slowest]
    floor = a["cpu_floor_eager_s"] if a["eager"] else a["cpu_floor_graphs_s"]
    hbm = a["hbm_efficiency"] * a["hbm_bytes_per_s"]
    toks = jp["per_step"]["tokens_in"]
    task_calls = jp["per_step"]["calls"]["proposal"] + jp["per_step"]["calls"]["scoring"]
    assumptions = [
        f"mean response {resp:.0f} tokens ({a['mean_response_frac']:g} x max), prompt ~{_prompt(cfg)} "
        f"tokens; {ranks} sampling ranks, one co-located vLLM engine each, groups "
        f"{'/'.join(map(str, groups))} (rank 0 first; full.rank0_rollout_share {share:g})",
        f"decode step = max(CPU floor {floor * 1e3:.0f} ms ({'eager' if a['eager'] else 'CUDA graphs'}; "
        "full.vllm_enforce_eager), (2P + live sequences x live context x "
        f"{shape.kv_bytes_per_token:,} B of KV per token) / ({a['hbm_efficiency']:g} x "
        f"{a['hbm_bytes_per_s'] / 1e12:g} TB/s = {hbm / 1e12:.2f} TB/s)) + prefill at "
        f"{a['prefill_mfu']:g} MFU",
        f"slowest engine (rank {slowest}, {groups[slowest] * n} rollouts): {e.concurrency} concurrent "
        f"(KV capacity / mean context), {e.waves:.2f} waves, step {e.step_s * 1e3:.1f} ms -> work "
        f"{e.work_s / 60:.1f} min with {a['tool_calls_per_rollout']:g} searches per rollout at "
        f"{a['search_s']:g} s; longest rollout {cfg.rollout.max_response_tokens} tokens at "
        f"{e.tail_step_s * 1e3:.1f} ms (batch {a['tail_batch_frac']:g} full) + "
        f"{cfg.rollout.max_tool_calls} searches = {e.longest_s / 60:.1f} min; phase = the larger",
        f"judge busy {busy / 60:.1f} min: max({task_calls} calls x {L:g} s / {C} in flight, {toks / 1e6:.2f}M input tokens / "
        + (f"{a['judge_tpm']:,} tpm = {quota / 60:.1f} min)" if a["judge_tpm"] else
           "tpm unknown: judge_http.tpm = 0, set it to the provider's quota)")
        + f"; groups finish in the last {a['judge_hidden_frac']:g} of the rollouts, which hide that "
        f"much; at least {a['judge_rounds_exposed']:g} round trips after them",
        f"reflection branch: {G * int(cfg.reflection.m)} candidates of "
        f"{cfg.reflection.max_new_tokens or 512} tokens behind ~{ctx:.0f}-token trajectories take "
        f"{b_s / 60:.1f} min of rank 0's engine (every candidate reads its whole context per step); "
        f"rank 0 ends at {rank0 / 60:.1f} min; {refl_calls} judge calls overlap the next rollouts",
        _reflection_line(cfg, r_tok, r_rows, ctx),
        _update_line(shape, cfg, W, a),
        f"sync: 1 x 2P bytes at {a['sync_bytes_per_s'] / 1e9:g} GB/s"
        + (f"; vLLM sleep (level 1) through the update: 2P to host and back at "
           f"{a['pcie_bytes_per_s'] / 1e9:g} GB/s" if a["sleeps"] else ""),
    ]
    return StepTime(phases, assumptions, float(sum(phases.values())))


def _reflection_line(cfg, as_run: float, per_row: float, ctx: float) -> str:
    """The reflection update's assumption line (reflection_update_tokens)."""
    how = ("one sequence per row" if as_run == per_row else
           f"each group packed behind its trajectory (one sequence per row it would be {per_row / 1e6:.2f}M; "
           "a packed row's dense mask computes its whole L x L attention)")
    return (f"reflection update: {cfg.rollout.prompts_per_step} groups x {cfg.reflection.m} candidates "
            f"behind their ~{ctx:.0f}-token trajectories, {as_run / 1e6:.2f}M tokens, {how}; in the "
            "task update's optimizer steps (train.update_policy: no optimizer step of its own)")


def _update_line(shape: ModelShape, cfg, W: int, a: dict) -> str:
    """The updates' assumption line (_update_s, cpu_adam_s)."""
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.n
    adam = cpu_adam_s(shape.params, W, cfg, a)
    return (f"update: {a['update_s_per_token'] * 26624:.1f} s per 26,624-token pass (measured on one "
            f"H200, 0.37 MFU) at {a['zero3_efficiency']:g} ZeRO-3 efficiency, rows dealt to the ranks by "
            f"tokens (balanced passes); micro-batch {cfg.ss_grpo.micro_batch}: {micro_passes(seqs, W, cfg)} "
            f"passes per rank, each accumulating the fp32 gradient partition in host memory over PCIe; "
            f"DeepSpeedCPUAdam {adam:.1f} s per optimizer step on {a['threads']} thread(s) per rank "
            f"(config.threads; the full preset sets the cores per rank)")


# ----------------------------------------------------------------------------------------------------
# Start-up, the micro-batch that fits, and step 1 against the plan

# Assumptions of the start-up estimate (ours; printed with it).
START_ASSUME = {
    # DeepSpeedCPUAdam's JIT build without a prebuilt op: 1-5 min (277 s on 2 busy CPU cores,
    # backends/scale/settings.py); every rank waits on one build's file lock
    "cpu_adam_build_s": 180.0,
    "triton_compile_s": 60.0,  # ours (assumption): vLLM Model Runner V2's Triton kernels, first use
    "graph_capture_s": 30.0,  # ours (assumption): vLLM's CUDA graph capture (the engines capture at once)
    "engine_build_s": 60.0,  # ours (assumption): vLLM's profile run and KV cache allocation
    "read_bytes_per_s": 1e9,  # ours (assumption): checkpoint reads per rank, 8 ranks on one filesystem
    "hash_bytes_per_s": 1e9,  # ours (assumption; 1.19 GB/s measured on this project's 2-core CPU machine):
    # sha256 of the reference on one core
}


def startup_time(shape: ModelShape, cfg, cpu_adam_prebuilt: bool = False,
                 assume: dict | None = None) -> StepTime:
    """Seconds before step 0 starts, once per launch (or resume), by phase: DeepSpeedCPUAdam's JIT
    build (when the run uses it and the deepspeed package holds no prebuilt op), the Triton compile of
    vLLM's kernels, CUDA graph capture (full.vllm_enforce_eager False), and loading: pi and pi_ref
    under ZeRO-3 and each rank's vLLM engine from disk (2P bytes each), rank 0's plain bf16 copy
    with the HF / KV sampler (none with vLLM), the reference's sha256 fingerprint on rank 0 (of
    that copy, or of the model folder's weight files: 2P bytes either way; train.py), plus the
    engine's build."""
    a = {**START_ASSUME, **(assume or {})}
    P, full = shape.params, cfg.full
    phases = {}
    uses_cpu_adam = full.offload_optimizer and full.optimizer in ("auto", "deepspeed") \
        and cfg.engine == "zero3"  # "auto" is DeepSpeed's AdamW on GPU (scale.settings.deepspeed_config)
    if uses_cpu_adam and not cpu_adam_prebuilt:
        phases["DeepSpeedCPUAdam JIT build (no prebuilt op)"] = a["cpu_adam_build_s"]
    vllm = cfg.sampler == "vllm"
    if vllm:
        phases["Triton compile (vLLM's kernels)"] = a["triton_compile_s"]
        if not getattr(full, "vllm_enforce_eager", True):
            phases["CUDA graph capture (vllm_enforce_eager off)"] = a["graph_capture_s"]
    # Eq.: loads = ([plain copy] + pi [+ pi_ref] [+ engine]) x 2P / read rate + 2P / hash rate
    # [+ engine build]   (vLLM: the engine instead of rank 0's plain copy)
    copies = 1 + (1 if cfg.ss_grpo.beta > 0 else 0) + 1
    phases["model and engine loading"] = copies * 2 * P / a["read_bytes_per_s"] \
        + 2 * P / a["hash_bytes_per_s"] + (a["engine_build_s"] if vllm else 0.0)
    hashed = "the model folder's weight files" if vllm else "rank 0's plain copy"
    assumptions = [f"CPU Adam build {a['cpu_adam_build_s']:g} s (prebuilt op: "
                   f"{'yes' if cpu_adam_prebuilt else 'no'}; DS_BUILD_CPU_ADAM=1 pip install deepspeed "
                   "prebuilds it), Triton compile " f"{a['triton_compile_s']:g} s, CUDA graph capture "
                   f"{a['graph_capture_s']:g} s, engine build {a['engine_build_s']:g} s",
                   f"{copies} reads of 2P bytes at {a['read_bytes_per_s'] / 1e9:g} GB/s per rank, the "
                   f"sha256 of the reference ({hashed}) at {a['hash_bytes_per_s'] / 1e9:g} GB/s"]
    return StepTime(phases, assumptions, float(sum(phases.values())))


def largest_micro_batch(shape: ModelShape, cfg, world: int, gpu_bytes: float) -> int:
    """The largest ss_grpo.micro_batch whose update phase (the engine asleep: MemoryPlan.phases) fits
    every GPU with ENGINE_SLACK to spare, among the divisors of the sequences per rank per optimizer
    step (scale.settings.batch_plan needs one); 1 when none does (the plan then reports the problem)."""
    per_rank = cfg.rollout.prompts_per_step * cfg.rollout.n // max(1, cfg.ss_grpo.minibatches) // world
    slack = max(ENGINE_SLACK_MIN_B, ENGINE_SLACK_FRAC * gpu_bytes)
    best = 1
    for b in range(2, per_rank + 1):
        if per_rank % b:
            continue
        probe = copy.copy(cfg)
        probe.ss_grpo = dataclasses.replace(cfg.ss_grpo, micro_batch=b)
        mp = memory_plan(shape, probe, world, min(world, 8), gpu_bytes, 0.0)
        if all(mp.phases(d)[1] + slack <= gpu_bytes for d in (mp.rank0, mp.others) if d):
            best = b
    return best


# The time/* metrics (train.rl_step, backends/distributed/overlap.py) that measure each phase of the
# two estimates. Phases with the same metrics are compared as one line: the lockstep rollouts hold
# their searches, the reflection's judging is in time/reflection_s there; the engine's sleep is
# inside time/update_s and its wake inside time/sync_s.
PHASE_METRICS = {
    ROLLOUTS: ("time/rollout_s",), JUDGE: ("time/judge_s",), REFLECTION: ("time/reflection_wait_s",),
    R_UPDATE: ("time/reflection_update_s",), UPDATE: ("time/update_s",), SYNC: ("time/sync_s",),
    SLEEP: ("time/sync_s",),
    "rollouts (decode)": ("time/rollout_s",), "search calls": ("time/rollout_s",),
    "judge + reflection judge": ("time/judge_s", "time/reflection_s"),
    "weight syncs (2 per step)": ("time/sync_s",), "vLLM sleep + wake (2 per step)": ("time/sync_s",),
}


def plan_vs_measured(plan_phases: dict, metrics: dict) -> list[str]:
    """One line per measured quantity: the plan's minutes (the phases that map to it, PHASE_METRICS)
    next to the run's measured minutes (the time/* metrics of one step, in seconds) and their ratio,
    then the whole step (time/step_s) and the slowest rank's rollouts (time/rollout_rank<r>_s). A
    phase without a metric, or a metric the step did not log, says so. Pure: no I/O."""
    groups: dict = {}
    for name, s in plan_phases.items():
        keys = PHASE_METRICS.get(name, ())
        g = groups.setdefault(keys, [[], 0.0])
        g[0].append(name)
        g[1] += s
    out = [f"    {'phase':<58} {'plan':>7} {'measured':>9} {'ratio':>6}  metric"]

    def row(label: str, plan_s: float, keys: tuple) -> str:
        have = [k for k in keys if k in metrics]
        if not keys or not have:
            return f"    {label:<58} {plan_s / 60:7.1f} {'-':>9} {'':>6}  " + (
                "not logged this step" if keys else "no metric")
        got = float(sum(float(metrics[k]) for k in have))
        ratio = f"{got / plan_s:6.2f}" if plan_s > 0 else f"{'-':>6}"
        return f"    {label:<58} {plan_s / 60:7.1f} {got / 60:9.1f} {ratio}  {' + '.join(have)}"

    for keys, (names, s) in groups.items():
        out.append(row(" + ".join(names), s, keys))
    out.append(row("step", float(sum(plan_phases.values())), ("time/step_s",)))
    ranks = {k: float(v) for k, v in metrics.items()
             if k.startswith("time/rollout_rank") and k.endswith("_s") and not k.endswith("_cpu_s")}
    if ranks:
        k = max(ranks, key=ranks.get)
        out.append(f"    slowest rank's rollouts: {ranks[k] / 60:.1f} min ({k}); fastest "
                   f"{min(ranks.values()) / 60:.1f} min")
    return out


def schedule_estimate(cfg, world: int, ranks_per_node: int, gpu_bytes: float) -> StepTime:
    """The step-time estimate of the schedule this run uses (full.rollout_schedule; "async" is
    step_time_concurrent, else step_time) on this launch, from the memory plan's KV cache."""
    shape = model_shape(cfg.model)
    mp = memory_plan(shape, cfg, world, ranks_per_node, gpu_bytes, 0.0)
    if getattr(cfg.full, "rollout_schedule", "lockstep") == "async":
        return step_time_concurrent(shape, cfg, world, mp.kv_tokens, {"sleeps": mp.sleeps})
    return step_time(shape, cfg, world, mp.kv_tokens, {"sampling_ranks": mp.sampling_ranks,
                                                      "sleeps": mp.sleeps})


def _fmt(d: dict) -> list[str]:
    return [f"    {k:<46} {v / GIB:8.1f} GiB" for k, v in d.items()]


def _phase_lines(st: StepTime) -> list[str]:
    return [f"    {k:<46} {v / 60:8.1f} min" for k, v in st.phases.items()]


def plan_lines(cfg, world: int, ranks_per_node: int, gpu_bytes: float, gpu_src: str,
               host_bytes: float, host_src: str, cpu_adam_prebuilt: bool = False) -> tuple[list[str], list[str]]:
    """The dry run's "memory plan", "start-up" and "step time" sections for cfg on this launch, and
    the problems: a GPU or node whose planned bytes exceed its capacity, or a KV cache below one full
    context. The first step-time line is the schedule the run uses (full.rollout_schedule), the
    other schedule's follows; start-up is its own line. cpu_adam_prebuilt: the deepspeed package
    holds DeepSpeedCPUAdam's op (launch_check), so start-up builds none."""
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
        if cfg.full.vllm_gpu_memory_utilization:
            src = "full.vllm_gpu_memory_utilization"
        else:
            src = ("from this plan: the least of what each GPU's rollouts leave free, less slack ("
                   + ", ".join(f"{k} {v:.2f}" for k, v in mp.caps.items())
                   + f"), less full.vllm_margin_gib = {getattr(cfg.full, 'vllm_margin_gib', 0.0):g} GiB")
        lines.append(f"  vLLM gpu_memory_utilization {mp.share:.2f} on every rank ({src}; vLLM sizes "
                     "every engine's KV cache by the least over the ranks)")
        graphs = "" if getattr(cfg.full, "vllm_enforce_eager", True) else \
            f", less {VLLM_CUDA_GRAPH_B / GB:g} GB of CUDA graphs"
        lines.append(f"  vLLM KV cache: {mp.kv_tokens} tokens per engine ({shape.kv_bytes_per_token / 1024:.0f} "
                     f"KiB per token{graphs}) = {mp.kv_tokens / mean_ctx:.1f} concurrent sequences at the mean "
                     f"context ({mean_ctx:.0f} tokens), {mp.kv_contexts:.1f} at the max context ({max_len}); "
                     f"{mp.engines} engine(s), one inside each rank's process"
                     + (f", asleep (level {cfg.full.vllm_sleep_level}) during the update" if mp.sleeps else ""))
        if mp.kv_tokens < max_len:
            problems.append(f"memory plan: vLLM's KV cache holds {mp.kv_tokens} tokens, less than one "
                            f"context of {max_len} (raise full.vllm_gpu_memory_utilization)")
    best = largest_micro_batch(shape, cfg, world, gpu_bytes) if mp.sleeps else int(cfg.ss_grpo.micro_batch)
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
    ours = getattr(getattr(cfg, "full", None), "rollout_schedule", "lockstep")
    sc = step_time_concurrent(shape, cfg, world, mp.kv_tokens, {"sleeps": mp.sleeps})
    st = step_time(shape, cfg, world, mp.kv_tokens, {"sampling_ranks": mp.sampling_ranks, "sleeps": mp.sleeps})
    run, other = (sc, st) if ours == "async" else (st, sc)
    names = {"async": "concurrent (backends/distributed/overlap.py)", "lockstep": "lockstep (train.rl_step)"}
    other_name = "lockstep" if ours == "async" else "async"
    su = startup_time(shape, cfg, cpu_adam_prebuilt)
    lines += ["", f"start-up (estimate, once per launch, before step 0): {su.total_s / 60:.1f} min"]
    lines += _phase_lines(su)
    lines += ["  assumptions:"] + [f"    - {x}" for x in su.assumptions]
    lines += ["", f"step time (estimate; this run's schedule, full.rollout_schedule=\"{ours}\", "
                  f"{names.get(ours, ours)}): {run.total_s / 60:.1f} min per RL step, "
                  f"{run.total_s * cfg.steps / 3600:.0f} h for {cfg.steps} steps; step 1 prints its "
                  "measured time/* next to these"]
    lines += _phase_lines(run)
    lines += ["  assumptions:"] + [f"    - {x}" for x in run.assumptions]
    if best > cfg.ss_grpo.micro_batch:
        faster = copy.copy(cfg)
        faster.ss_grpo = dataclasses.replace(cfg.ss_grpo, micro_batch=best)
        a = _assume(cfg, None)
        seqs = cfg.rollout.prompts_per_step * cfg.rollout.n
        ctx = mean_context(cfg)
        lines.append(f"  micro-batch: the update phase fits micro-batch {best} (engine asleep, "
                     f"largest_micro_batch): --set ss_grpo.micro_batch={best} gives the update "
                     f"{_update_s(shape, seqs * ctx, seqs, world, faster, a) / 60:.1f} min instead of "
                     f"{_update_s(shape, seqs * ctx, seqs, world, cfg, a) / 60:.1f}")
    lines += ["", f"step time, the other schedule (estimate; full.rollout_schedule=\"{other_name}\", "
                  f"{names[other_name]}): {other.total_s / 60:.1f} min per RL step "
                  f"({other.total_s / run.total_s:.2f}x), {other.total_s * cfg.steps / 3600:.0f} h"]
    lines += _phase_lines(other)
    lines += ["  assumptions (besides the ones above):"] + [f"    - {x}" for x in other.assumptions]
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
