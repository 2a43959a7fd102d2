"""Threads that may touch CUDA start on this rank's GPU and on the engine's stream.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing of full mode (SCALE); nothing of the method lives here.

Why: CUDA's current device and current stream belong to the host *thread*. `init_distributed`
selects the rank's GPU (LOCAL_RANK) on the main thread only; a thread started later begins on
device 0 and on the legacy default stream. The vLLM engine runs in whichever thread calls it (the
in-process external-launcher executor, vllm/v1/executor/uniproc_executor.py): the engine loop
(backends/scale/engine_loop.py) and the weight-sync rpc threads (backends/scale/vllm_sampler.py).
On ranks 1.. such a thread would launch Model Runner V2's Triton kernels on device 0 with tensors on
device r ("Pointer argument cannot be accessed from Triton", triton-lang/triton#2925) and leave a
stray CUDA context on GPU 0. vLLM selects the device in its own helper threads for the same reason
(vllm/v1/executor/multiproc_executor.py, "a thread will not inherit the context of the main
thread"). And the stream: vLLM keeps one current stream per thread (vllm/utils/torch_utils.py
`current_stream`, which creates a new stream for a thread that has none), so without care the loop,
the rpc threads and the trainer's main thread queue their kernels on different streams that order
nothing against each other (with CUDA graphs, full.vllm_enforce_eager False, that is a silent race
between the sync's copies and the trainer's gathers).

So every thread of backends/scale/ and backends/distributed/ that can touch CUDA starts through
`start_thread` (or a pool with `initializer=enter`); tests/test_thread_devices.py checks the source
for thread starts that do not.

What is here
    select_device(index)     the rank's GPU: this thread's now, every started thread's from now on
    share_current_stream()   after the engine build: the calling thread's stream for every thread
    recorded()               (device, stream) a thread started now selects
    enter()                  what a started thread does first (also a ThreadPoolExecutor initializer)
    start_thread(...)        threading.Thread whose target runs after enter()
    record_event() / wait_event(ev)
                             order one thread's queued work before another's (the weight sync)
Without CUDA every function is a no-op (toy mode, the CPU tests), and nothing here imports vLLM.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["select_device", "share_current_stream", "enter", "start_thread", "record_event",
           "wait_event", "recorded"]

# The process's choice (one rank per process): set on the main thread, read by every new thread.
_device: int | None = None  # the rank's GPU index (LOCAL_RANK), None: never selected
_stream = None  # torch.cuda.Stream every engine thread runs on, None: the thread's default


def select_device(index: int) -> None:
    """Make GPU `index` (int, >= 0; LOCAL_RANK) this process's device: the calling thread's at once
    (torch.cuda.set_device) and the first act of every thread started here from now on.
    Raises ValueError for a negative index; whatever torch raises for a GPU that does not exist.
    Without CUDA it only records the index."""
    global _device
    if int(index) < 0:
        raise ValueError(f"a CUDA device index must be >= 0, got {index}")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(index))
    _device = int(index)


def share_current_stream() -> None:
    """Record the calling thread's current CUDA device and stream; every thread started here from
    now on selects both before anything else. The sampler calls it on the thread that built its
    vLLM engine (the main thread, the trainer's), right after the build, so the engine loop, the
    sync rpc threads and the trainer queue their kernels on one stream, in one order. With CUDA
    graphs off this is normally the legacy default stream (then it changes nothing); whatever the
    build left current (vLLM's capture machinery sets streams per thread) is what we share.
    A no-op without CUDA."""
    global _device, _stream
    if not torch.cuda.is_available():
        return
    _device = torch.cuda.current_device()
    _stream = torch.cuda.current_stream()


def recorded() -> tuple[int | None, Any]:
    """(device index or None, shared stream or None): what a thread started now selects."""
    return _device, _stream


def enter() -> None:
    """Select the recorded device, then the shared stream, in the calling thread (the first act of
    every thread `start_thread` starts; pass it as a ThreadPoolExecutor's `initializer`). We call
    torch.cuda.set_stream by attribute, so vLLM's patched version (which also records the stream
    for vLLM's own `current_stream()` in this thread) runs when vLLM is loaded. A no-op without
    CUDA or when nothing was recorded."""
    device, stream = _device, _stream
    if not torch.cuda.is_available():
        return
    if device is not None:
        torch.cuda.set_device(device)
    if stream is not None:
        torch.cuda.set_stream(stream)


def start_thread(target: Callable, *, name: str, args: tuple = (), kwargs: dict | None = None,
                 daemon: bool = True,
                 on_error: Callable[[BaseException], None] | None = None) -> threading.Thread:
    """Start and return a threading.Thread named `name` that runs enter() and then
    target(*args, **kwargs). An exception of `target` ends the thread as in threading.Thread
    (callers hand errors back themselves). If enter() itself raises (a GPU that vanished), target
    never runs on the wrong device: on_error(exception) is called instead (give it, so that whoever
    waits for the target's results learns of it rather than waiting forever), and the thread ends."""
    kwargs = dict(kwargs or {})

    def run() -> None:
        try:
            enter()  # SCALE: the rank's GPU and the engine's stream before any CUDA call
        except BaseException as e:
            if on_error is None:
                raise
            on_error(e)
            return
        target(*args, **kwargs)

    th = threading.Thread(target=run, name=name, daemon=daemon)
    th.start()
    return th


def record_event():
    """A torch.cuda.Event recorded on the calling thread's current stream (everything this thread
    has queued so far), or None without CUDA or before any stream was shared (no engine on a GPU)."""
    if _stream is None or not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return ev


def wait_event(ev) -> None:
    """Make the calling thread's current stream wait for `ev` (from record_event; None: nothing to
    wait for). Queues the wait on the GPU; the host does not block."""
    if ev is not None:
        torch.cuda.current_stream().wait_event(ev)
