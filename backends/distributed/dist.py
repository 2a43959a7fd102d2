"""The launcher's ranks: where this process sits (read from the environment in one place), the process
group, rank-0 helpers, the collectives full mode uses, and a clean end of a multi-rank process.

Not part of the paper's method (SCALE): torchrun and the deepspeed launcher set RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT; everything else asks `dist_env`. A plain `python` run is
rank 0 of 1 (init_distributed still makes a process group, since ZeRO-3 needs one).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import resource
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from backends.scale.cuda_threads import select_device


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on `host` (int; another process may take it before it is bound: torchrun's
    --standalone picks its own instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    timeout_min: collective timeout in minutes (None = torch's default) of the default group and,
    through set_group_timeout, of every group made later without its own (DeepSpeed's, vLLM's).
    On GPU it selects the GPU numbered LOCAL_RANK for this thread and for every thread started later
    through backends/scale/cuda_threads.py. Idempotent. Returns the DistEnv in effect.
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
        # SCALE: this thread's GPU, and the first act of every thread we start later (the engine
        # loop, the sync rpc and receive threads): CUDA's current device is per thread
        select_device(env.local_rank)
    import deepspeed  # lazy: DeepSpeed only when a full run starts

    if device_kind() == "cpu" and os.environ.get("RUBRICEM_DS_SHM") != "1":
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel at its first
        # init (40-90 s on a fresh machine); plain gloo is ample for the tiny CPU runs, so we mark
        # the kernel unavailable (RUBRICEM_DS_SHM=1 keeps it).
        import deepspeed.ops  # lazy: as above

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    kw = {}
    if timeout_min is not None:
        kw["timeout"] = set_group_timeout(timeout_min)
    deepspeed.init_distributed(verbose=False, **kw)
    return env


def set_group_timeout(minutes: float) -> datetime.timedelta:
    """Make `minutes` the timeout of every process group created from now on without one of its own
    (SCALE): torch gives such a group its constant default (30 min for gloo, 10 for NCCL), not the
    default group's, so DeepSpeed's and vLLM's groups would otherwise time out before a rank that
    waits for rank 0's rollouts does. Returns the timedelta (pass it to groups we create ourselves).
    Raises ValueError for minutes <= 0."""
    if not float(minutes) > 0:
        raise ValueError(f"a process-group timeout must be > 0 minutes, got {minutes}")
    from torch.distributed import distributed_c10d as c10d

    td = datetime.timedelta(minutes=float(minutes))
    # torch reads these module defaults whenever a group is made without `timeout=`
    c10d.default_pg_timeout = td
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = td
    return td


def group_timeouts() -> list[dict]:
    """Every process group of this process with its timeout: [{"ranks": [global ranks], "backend":
    name, "timeout_s": seconds}], one entry per backend of a group (CPU and CUDA). Empty without
    torch.distributed. For the dry run's tests and RUBRICEM_GROUP_TIMEOUT_DIR."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return []
    from torch.distributed import distributed_c10d as c10d

    out = []
    for pg in list(c10d._world.pg_map):
        for dev in ("cpu", "cuda"):
            try:
                be = pg._get_backend(torch.device(dev))
            except RuntimeError:  # no backend for this device type
                continue
            opts = getattr(be, "options", None)
            if opts is not None and getattr(opts, "_timeout", None) is not None:
                out.append({"ranks": torch.distributed.get_process_group_ranks(pg),
                            "backend": type(be).__name__, "timeout_s": opts._timeout.total_seconds()})
    return out


def record_group_timeouts() -> None:
    """When $RUBRICEM_GROUP_TIMEOUT_DIR is set, write this rank's group_timeouts() to
    <dir>/rank<R>.json (atomically). Called by every rank at shutdown; tests check that every group
    the run made waits full.dist_timeout_min."""
    d = os.environ.get("RUBRICEM_GROUP_TIMEOUT_DIR")
    if not d:
        return
    rank = _world()[0]
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(group_timeouts(), fh)
    os.replace(tmp, os.path.join(d, f"rank{rank}.json"))


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
    record_group_timeouts()
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
