"""Requests instead of batches: the sampler interface of continuous batching, for full mode's rollout
schedule "async" (backends/scale/rollout_engine.py) and rank 0's reflection branch.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for Algorithm 1 steps 3 and 7 (§3.1-3.4) at scale; nothing of the method lives here.

Why: a rollout alternates policy segments and tool calls. When every ready rollout goes into one
blocking `generate` call, a rollout whose search has just returned waits for that call's longest
segment (often a multi-thousand-token answer): a convoy. With one request per segment the engine
takes each rollout's next turn the moment its tool result arrives and batches whatever is running,
and a second caller (the reflection branch on rank 0's engine) adds its requests to the same batch
instead of waiting for a lock. benchmarks/rollout_phase.py measures the difference.

What is here
    RequestSampler      the interface: submit(prompt, max_new_tokens, temperature, seed) -> Future
                        of the sampled token ids (VLLMSampler implements it over vLLM's engine loop)
    SerialRequests      the same interface over any SeededSampler's `generate`, one request at a
                        time in submission order on one thread (the HF / KV samplers decode one
                        seeded request at a time anyway)
    requests_for        the RequestSampler of a sampler: itself, or SerialRequests around it

Determinism: every request carries its own seed (rollout_engine.request_seed), so what a request
samples does not depend on what else runs or in which order requests arrive.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Callable, Protocol


class RequestSampler(Protocol):
    """A sampler that takes one request at a time and runs them concurrently (continuous batching)."""

    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float,
               seed: int | None = None) -> cf.Future: ...


class SerialRequests:
    """RequestSampler over a sampler that only has generate(prompts, budgets, temperature, seeds=):
    requests run one at a time, in submission order, on one worker thread. close() ends the thread
    once the queued requests are done. A request's exception goes to its future."""

    def __init__(self, sampler):
        from backends.scale.cuda_threads import enter  # lazy: a toy run loads this module, runs none

        self.sampler = sampler
        # SCALE: a torch sampler decodes on this thread: it starts on the rank's GPU (cuda_threads)
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="requests", initializer=enter)

    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float,
               seed: int | None = None) -> cf.Future:
        """The request's future: its sampled token ids (the wrapped generate's answer for it)."""
        seeds = None if seed is None else [int(seed)]
        return self._pool.submit(lambda: self.sampler.generate([list(prompt)], [int(max_new_tokens)],
                                                               temperature, seeds=seeds)[0])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def requests_for(sampler) -> tuple[RequestSampler, Callable[[], None]]:
    """(the RequestSampler of `sampler`, a close function): the sampler itself when it has `submit`
    (its engine batches continuously; close does nothing), else SerialRequests around it."""
    if callable(getattr(sampler, "submit", None)):
        return sampler, (lambda: None)
    serial = SerialRequests(sampler)
    return serial, serial.close


def gather(futures: list[cf.Future]) -> list:
    """The results of `futures` in order; the first exception raised (after every future is done, so
    no request is left running unseen)."""
    cf.wait(futures)
    return [f.result() for f in futures]

