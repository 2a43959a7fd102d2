"""The engine loop of continuous batching: one thread that adds submitted requests to a vLLM engine
and steps it, so that every caller's requests share the engine's batches.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for Algorithm 1 steps 3 and 7 (§3.1, §3.3): the rollouts and the reflection candidates are
sampled by it; nothing of the method lives here.

Why a loop: `vllm.LLM.generate` blocks until all its requests end, and two callers (rank 0's rollouts
and the overlapped reflection branch, backends/distributed/overlap.py) would take turns on it. Here
`submit` queues one request and returns a Future; the loop thread adds what is queued before every
engine step (`LLMEngine.add_request`, then `LLMEngine.step`), so a request submitted while others run
joins the very next step's batch: rollouts and reflection candidates decode together (vLLM's own
scheduler batches them, as it would in a server).

`EngineLoop` is a mixin of backends/scale/vllm_sampler.VLLMSampler; it needs from its host `llm`
(with `llm_engine.add_request(id, {"prompt_token_ids": ids}, params)` and `llm_engine.step()` ->
outputs with `request_id`, `finished`, `outputs[0].token_ids`), `_lock` (the engine: weight syncs,
sleep and scoring hold it, and wait for the loop to go idle with `_quiesce`), `_sampling_params`,
`_check_usable`, `_wake`, `_trace`, `_cut`, `max_model_len` and `stats`.

Determinism: each request carries its own seed (vLLM seeds a request's sampler with it), so what a
request samples does not depend on what shares its batches (tests/test_vllm_sampler.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
import time

from backends.scale.cuda_threads import start_thread

__all__ = ["EngineLoop", "WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight sync or reload did not complete; the message says what state the engine is in and
    what to do (raise the timeout, send every parameter, or call `reload_from_checkpoint`)."""


class EngineLoop:
    """Continuous batching over a vLLM engine (see the module docstring). Threads: `submit` from any
    thread; one loop thread, started by a submit when none runs, adds requests and steps the engine
    and ends once nothing is queued or running."""

    def _init_loop(self) -> None:
        """The loop's state: the queue of submitted requests, the running ones by request id
        (budget, future), the condition every change is announced on."""
        self._cv = threading.Condition()
        self._queue: list = []
        self._running: dict = {}
        self._ids = itertools.count()
        self._loop_thread: threading.Thread | None = None
        self._closing = False

    def _stop_loop(self) -> None:
        """Refuse new requests and wait for the ones in flight (close)."""
        with self._cv:
            self._closing = True
            self._cv.wait_for(lambda: self._loop_thread is None or
                              self._loop_thread is threading.current_thread())

    def _reopen_loop(self) -> None:
        """Accept requests again (after a rebuilt engine); the next submit starts a new loop thread."""
        with self._cv:
            self._closing = False

    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float,
               seed: int | None = None) -> cf.Future:
        """One request into the running engine (continuous batching, the interface of
        backends/scale/continuous.py).
        prompt: token ids; max_new_tokens: int (<= 0, an empty prompt or no room before
        max_model_len give []); temperature in [0, 2]; seed: the request's own seed (None: the
        `reseed` sequence). Returns a Future of the sampled ids, cut as `generate` cuts them; the
        future raises WeightSyncError after a failed sync and whatever the engine raised."""
        f: cf.Future = cf.Future()
        room = min(int(max_new_tokens), self.max_model_len - len(prompt))
        if room <= 0 or not prompt:
            f.set_result([])
            return f
        with self._cv:
            if self._closing:
                raise WeightSyncError("the engine was closed; call reload_from_checkpoint(..., rebuild=True)")
            params = self._sampling_params(room, float(temperature), None if seed is None else int(seed))
            self._queue.append((f"rubricem-{next(self._ids)}", [int(t) for t in prompt], params, room, f))
            if self._loop_thread is None:
                self._trace("submit")
                # SCALE: a new loop thread whenever the engine was idle; it steps vLLM, so it must
                # start on the rank's GPU and the engine's stream (backends/scale/cuda_threads.py)
                self._loop_thread = start_thread(self._loop, name="engine-loop",
                                                 on_error=self._fail_queued)
            self._cv.notify_all()
        return f

    def _fail_queued(self, e: BaseException) -> None:
        """A loop thread that could not start (its device selection raised): every queued request
        fails with that error, and the next submit starts a new thread."""
        with self._cv:
            failed = [f for *_, f in self._queue]
            self._queue = []
            self._loop_thread = None
            self._cv.notify_all()
        for f in failed:
            if not f.done():
                f.set_exception(e)

    def _loop(self) -> None:
        """The engine loop (one thread): add what was submitted, step the engine, resolve the
        futures of finished requests; return when nothing is queued or running. An engine error
        fails every request in flight."""
        while True:
            with self._cv:
                if not self._queue and not self._running:  # idle: the next submit starts a new loop
                    self._loop_thread = None
                    self._cv.notify_all()
                    return
                new, self._queue = self._queue, []
            try:
                with self._lock:  # SCALE: syncs, sleep and score wait for the loop to go idle
                    if new:
                        self._check_usable()
                        self._wake(None)  # an engine asleep since the update samples only awake
                        for rid, p, params, room, f in new:
                            self.llm.llm_engine.add_request(rid, {"prompt_token_ids": p}, params)
                            with self._cv:
                                self._running[rid] = (room, f)
                    t0 = time.perf_counter()
                    outs = self.llm.llm_engine.step()
                    self.stats["gen_s"] += time.perf_counter() - t0
            except BaseException as e:  # handed to every waiting caller
                with self._cv:
                    failed = [f for *_, f in new] + [f for _, f in self._running.values()]
                    ids = list(self._running)
                    self._running.clear()
                    self._cv.notify_all()
                try:  # the engine drops what it still holds of them (best effort)
                    self.llm.llm_engine.abort_request(ids)
                except Exception:
                    pass
                for f in failed:
                    if not f.done():
                        f.set_exception(e)
                continue
            done = []
            with self._cv:
                self.stats["engine_steps"] += 1
                self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
                for o in outs:
                    if getattr(o, "finished", False) and o.request_id in self._running:
                        room, f = self._running.pop(o.request_id)
                        done.append((room, f, [int(t) for t in o.outputs[0].token_ids]))
                self._cv.notify_all()
            for room, f, ids in done:
                cut = self._cut(ids, room)
                with self._cv:
                    self.stats["guard_trims"] += len(cut) < len(ids)  # 0 unless vLLM's stop differs
                    self.stats["gen_tokens"] += len(cut)
                f.set_result(cut)

    def _quiesce(self) -> None:
        """Wait until no request is queued or running (the loop is idle and will not step)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._running)

