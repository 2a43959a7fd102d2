"""GPU memory at the phases of a full-mode step: free and reserved bytes where an engine beside the
trainer can run out of memory (the first run's check of the memory plan).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing of full mode (SCALE); nothing of the method lives here.

Why: each rank's vLLM engine shares its GPU with the ZeRO-3 trainer. The engine sleeps through the
update and wakes for the weight sync (weights first, then the KV cache: vLLM re-maps ~47 GiB at the KV
wake), and the memory plan (backends/distributed/plan.py) only estimates what the trainer leaves
free then. We measure it instead, at every phase:
    engine_build   after this rank's engine was built (backends/distributed/engine.py)
    before_sleep   just before the engine sleeps for an update
    after_update   after the update, its cached blocks handed back (torch.cuda.empty_cache)
    wake_weights   after the engine's weights woke (the sync loads into them next)
    wake_kv        after the KV cache woke (the engine is whole again; a full wake counts here)
Each phase keeps, per rank, the sample with the least free memory since the last report (`take`):
free = torch.cuda.mem_get_info()[0] (the device's, every process and allocator included, vLLM's
CuMem pool too), reserved = torch.cuda.memory_reserved() (torch's caching allocator in this
process). Without CUDA `record` returns at once and nothing is kept: toy mode and the CPU runs log
no memory and pay nothing.

Reported with each task update (backends/distributed/engine.py memory_report: one all-reduce, rank 0
logs mem/* with the step's metrics, and one console line per phase at the first two steps). A
step's report covers what happened since the previous one: its own before_sleep / after_update, the
engine build at the first step, and the wakes of the syncs before its update (the previous step's
sync, and the reflection update's where one runs first): the sync after a step's update is
reported with the next step.

What is here
    PHASES                    the phase names, in step order
    record(phase)             sample this rank's GPU now
    take()                    this rank's samples since the last take: {phase: (free, reserved)} bytes
    pack(samples, rank, world) / summarize(values, world)
                              one flat list per rank for a sum all-reduce, and rank 0's metrics from it
    report_lines(metrics, label)
                              one console line per phase
"""
from __future__ import annotations

import math
import threading

import torch

__all__ = ["PHASES", "record", "take", "pack", "summarize", "report_lines"]

PHASES = ("engine_build", "before_sleep", "after_update", "wake_weights", "wake_kv")
GIB = 2 ** 30

_samples: dict[str, tuple[float, float]] = {}  # phase -> (free, reserved) bytes, least free kept
_lock = threading.Lock()  # the engine loop's wake and the main thread's phases may record at once


def record(phase: str) -> None:
    """Sample the current GPU's free bytes (torch.cuda.mem_get_info) and this process's reserved
    bytes (torch.cuda.memory_reserved) for `phase` (one of PHASES), keeping the sample with the
    least free memory since the last `take`. Call it on a thread whose current device is the
    rank's (backends/scale/cuda_threads.py). A no-op without CUDA. Raises ValueError for an
    unknown phase."""
    if phase not in PHASES:
        raise ValueError(f"unknown memory phase {phase!r}; one of {PHASES}")
    if not torch.cuda.is_available():
        return
    free, _total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    with _lock:
        old = _samples.get(phase)
        if old is None or free < old[0]:
            _samples[phase] = (float(free), float(reserved))


def take() -> dict[str, tuple[float, float]]:
    """This rank's samples since the last take, {phase: (free bytes, reserved bytes)}, and forget
    them (the next report starts afresh)."""
    with _lock:
        out = dict(_samples)
        _samples.clear()
    return out


def pack(samples: dict, rank: int, world: int) -> list[float]:
    """A flat list of world x len(PHASES) x 2 floats that is zero except for `rank`'s block: its
    (free, reserved) bytes per phase, -1.0 where it has no sample. Summed over the ranks (one
    all-reduce) it holds every rank's block. Raises ValueError for a rank outside [0, world)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    vals = [0.0] * (world * len(PHASES) * 2)
    for i, phase in enumerate(PHASES):
        free, reserved = samples.get(phase, (-1.0, -1.0))
        base = (rank * len(PHASES) + i) * 2
        vals[base], vals[base + 1] = float(free), float(reserved)
    return vals


def summarize(values: list[float], world: int) -> dict[str, float]:
    """Rank 0's memory metrics from the summed `pack` lists (len world x len(PHASES) x 2), for every
    phase some rank sampled:
        mem/<phase>_free_gib       rank 0's free GiB (absent when rank 0 has no sample)
        mem/<phase>_reserved_gib   rank 0's torch-reserved GiB
        mem/<phase>_min_free_gib   the least free GiB over the ranks that sampled it
        mem/<phase>_min_free_rank  the rank with that least free memory (the lowest on a tie)
    We log rank 0's own figures and the minimum over ranks, not every rank's: rank 0 holds the most
    (the embedding model, its reflection branch), and the rank with the least free memory is the
    one that runs out first; 8 ranks x 5 phases x 2 keys per step would bury both. Raises
    ValueError when the length does not match `world`."""
    if len(values) != world * len(PHASES) * 2:
        raise ValueError(f"{len(values)} values do not make {world} ranks x {len(PHASES)} phases x 2")
    out: dict[str, float] = {}
    for i, phase in enumerate(PHASES):
        best = None
        for r in range(world):
            base = (r * len(PHASES) + i) * 2
            free, reserved = values[base], values[base + 1]
            if free < 0 or not math.isfinite(free):
                continue
            if r == 0:
                out[f"mem/{phase}_free_gib"] = free / GIB
                out[f"mem/{phase}_reserved_gib"] = reserved / GIB
            if best is None or free < best[0]:
                best = (free, r)
        if best is not None:
            out[f"mem/{phase}_min_free_gib"] = best[0] / GIB
            out[f"mem/{phase}_min_free_rank"] = best[1]
    return out


def report_lines(metrics: dict, label: str) -> list[str]:
    """One console line per phase present in `metrics` (summarize's keys), in step order, e.g.
    "memory (step 1 of this process) wake_kv: rank 0 free 9.8 GiB, reserved 21.3 GiB; least free
    8.9 GiB (rank 5)"."""
    lines = []
    for phase in PHASES:
        if f"mem/{phase}_min_free_gib" not in metrics:
            continue
        own = (f"rank 0 free {metrics[f'mem/{phase}_free_gib']:.1f} GiB, reserved "
               f"{metrics[f'mem/{phase}_reserved_gib']:.1f} GiB" if f"mem/{phase}_free_gib" in metrics
               else "rank 0 no sample")
        lines.append(f"memory ({label}) {phase}: {own}; least free "
                     f"{metrics[f'mem/{phase}_min_free_gib']:.1f} GiB "
                     f"(rank {int(metrics[f'mem/{phase}_min_free_rank'])})")
    return lines
