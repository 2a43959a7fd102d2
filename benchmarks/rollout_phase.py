"""The rollout phase of one engine under continuous batching against blocking batch calls (convoys).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Algorithm 1 step 3 (multi-turn rollouts with search, §3.1-3.2) through the real rollout loop,
backends/scale/rollout_engine.ConcurrentRolloutEngine, under its two tool-aware schedules:
    continuous  schedule "async": one request per segment (backends/scale/continuous.py); a rollout's
                next segment reaches the engine as soon as its own search returns
    blocking    schedule "batched": every ready rollout goes into one blocking generate call, and a
                rollout whose search returns during a call waits for the call's longest segment
Both drive the same simulated engine (SimEngine): a decode loop whose every step advances each
running sequence by one token and takes
    step_s = base_s + per_seq_s x sequences + per_ctx_token_s x (their context tokens)
plus prefill_s_per_token x the prompt of each request it admits, so time grows with segment length
and with the prompt; a request waits for admission while the running sequences' context fills
the KV cache (kv_capacity_tokens) (a GPU decode step reads the weights once and every sequence's KV cache; the
defaults are the step-time model's 8B-on-H100 ratios, backends/distributed/plan.py, scaled so one
schedule runs in ~10-40 s of wall time). What each request samples is drawn from its seed alone
(rollout_engine.request_seed): 2-8 search calls per rollout, segment lengths lognormal (long-tailed),
a longer final answer; each search sleeps 0.5-3 s (drawn from its query). So both schedules produce
the same trajectories (checked: same_trajectories) and differ only in when segments run.

A second sitting (`REFLECTION_OVERLAP`) adds rank 0's case: a reflection branch's P x m candidates
sampled on the same engine from another thread while the rollouts run, one generate call at a time
under a lock (blocking) or as requests in the same batch (continuous).

Run (2 shared cores, ~2 min):
    python benchmarks/rollout_phase.py                   # 32 rollouts (4 queries x 8), seed 0
    python benchmarks/rollout_phase.py --rollouts 16 --seed 1
Last line:
    ROLLOUT_PHASE continuous_s=<s> blocking_s=<s> ratio=<continuous / blocking> same_trajectories=<bool>
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import math
import os
import random
import re
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from backends.scale.rollout_engine import ConcurrentRolloutEngine, SeededView  # noqa: E402
from scaffold import CALL_OPEN, SYSTEM_PROMPT_COMPACT, RolloutEngine, SearchResult  # noqa: E402
from toyfix import tiny_tokenizer, train_queries  # noqa: E402

# The engine's time model (ours). Ratios of the 8B step-time model (plan.py): a decode step reads
# 16.4 GB of weights (the base) and 144 KiB of KV cache per context token, ~110k context tokens per
# base; prefill is compute-bound, ~30 us per prompt token at 8B, scaled with the base.
TIME = {"base_s": 0.004, "per_seq_s": 0.00005, "per_ctx_token_s": 0.004 / 110_000,
        "prefill_s_per_token": 0.000008,
        # KV cache in tokens: about half of the 32 rollouts fit at their mean context, as 17 of 32-40
        # at ~11k tokens in 166k at the paper's scale (the memory plan at utilisation 0.5)
        "kv_capacity_tokens": 14_000}
# What a rollout writes (ours): lognormal segment lengths (median tokens, sigma), 2-8 calls.
SHAPE = {"turn_median": 120, "turn_sigma": 0.9, "answer_median": 500, "answer_sigma": 0.8,
         "min_calls": 2, "max_calls": 8, "cap": 3000}
_MARK = re.compile(r"\[plan (\d+) calls\]")


class SimEngine:
    """A continuous-batching decode engine in real time (see the module docstring). submit() is the
    RequestSampler interface (continuous.py); generate() is the blocking call of a batch (under a
    lock when blocking=True: one call at a time, as a sampler that serialises its callers). The
    tokens of a request depend only on its seed and its prompt."""

    def __init__(self, tok, blocking: bool, time_model: dict | None = None, shape: dict | None = None):
        self.tok, self.blocking = tok, blocking
        self.t = {**TIME, **(time_model or {})}
        self.shape = {**SHAPE, **(shape or {})}
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.filler = tok.encode(" fact", add_special_tokens=False)
        self._cv = threading.Condition()
        self._queue: list = []
        self._call_lock = threading.Lock()
        self.stats = {"steps": 0, "busy_s": 0.0, "max_running": 0, "tokens": 0}
        self._stop = False
        self._th = threading.Thread(target=self._loop, name="sim-engine", daemon=True)
        self._th.start()

    # -- what a request writes --------------------------------------------------------------------
    def _tokens(self, prompt: list[int], budget: int, seed: int) -> list[int]:
        s = self.shape
        rng = random.Random(seed)
        text = self.tok.decode(prompt, skip_special_tokens=False)
        m = _MARK.search(text)
        head = []
        if m is None:  # the first segment: the plan fixes the number of calls
            k = rng.randint(s["min_calls"], s["max_calls"])
            head = self.tok.encode(f" [plan {k} calls] ", add_special_tokens=False)
            done = 0
        else:
            k = int(m.group(1))
            done = text[m.end():].count("</call_tool>")
        final = done >= k
        med, sig = (s["answer_median"], s["answer_sigma"]) if final else (s["turn_median"], s["turn_sigma"])
        n = min(s["cap"], max(1, int(math.exp(rng.gauss(math.log(med), sig)))))
        body = (self.filler * n)[:n]
        if final:
            tail = self.tok.encode("<answer>It is so [1].</answer>", add_special_tokens=False) + [self.eot]
        else:
            tail = self.tok.encode(f'{CALL_OPEN}topic {rng.randrange(10 ** 6)}</call_tool>',
                                   add_special_tokens=False)
        return (head + body + tail)[:max(0, budget)]

    # -- the engine loop ----------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens, temperature, seed=None) -> cf.Future:
        f: cf.Future = cf.Future()
        out = self._tokens(list(prompt), int(max_new_tokens), int(seed or 0))
        with self._cv:
            self._queue.append({"ctx": len(prompt), "out": out, "pos": 0, "f": f})
            self._cv.notify()
        return f

    def generate(self, prompts, max_new_tokens, temperature, seeds=None):
        seeds = seeds or [None] * len(prompts)
        lock = self._call_lock if self.blocking else _NoLock()
        with lock:
            fs = [self.submit(p, m, temperature, s) for p, m, s in zip(prompts, max_new_tokens, seeds)]
            return [f.result() for f in fs]

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._th.join()

    def _loop(self) -> None:
        running: list = []
        t = self.t
        while True:
            with self._cv:
                while not self._queue and not running and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                used = sum(r["ctx"] + r["pos"] for r in running)
                new = []
                # SCALE: admission while the KV cache has room (at least one sequence always runs)
                while self._queue and (not running and not new
                                       or used + self._queue[0]["ctx"] <= t["kv_capacity_tokens"]):
                    r = self._queue.pop(0)
                    used += r["ctx"]
                    new.append(r)
            # Eq.: step = base + per_seq x n + per_ctx x sum(context) + prefill x new prompt tokens
            running += new
            dt = (t["base_s"] + t["per_seq_s"] * len(running)
                  + t["per_ctx_token_s"] * sum(r["ctx"] + r["pos"] for r in running)
                  + t["prefill_s_per_token"] * sum(r["ctx"] for r in new))
            time.sleep(dt)
            self.stats["steps"] += 1
            self.stats["busy_s"] += dt
            self.stats["max_running"] = max(self.stats["max_running"], len(running))
            still = []
            for r in running:
                r["pos"] += 1
                if r["pos"] >= len(r["out"]):
                    self.stats["tokens"] += len(r["out"])
                    r["f"].set_result(list(r["out"]))
                else:
                    still.append(r)
            running = still


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class SlowSearch:
    """The search tool: sleeps 0.5-3 s (uniform, drawn from the query), then one result."""

    def __init__(self, lo: float = 0.5, hi: float = 3.0):
        self.lo, self.hi, self.calls = lo, hi, 0

    def __call__(self, query: str):
        h = int(hashlib.sha256(query.encode()).hexdigest()[:8], 16)
        self.calls += 1
        time.sleep(self.lo + (self.hi - self.lo) * (h % 1000) / 999)
        return [SearchResult(f"d{h % 97}", f"Result {h % 13}", f"snippet {h % 31}")]


def rollouts(schedule: str, n_queries: int, n: int, seed: int, reflection: int = 0,
             time_model: dict | None = None, shape: dict | None = None, tool=None):
    """One rollout phase: (rollouts, wall seconds, engine stats) of n_queries x n rollouts under
    `schedule` ("async" = continuous, "batched" = blocking). reflection > 0: that many reflection
    candidates sampled on the same engine from another thread, started with the rollouts."""
    tok = tiny_tokenizer()
    eng = SimEngine(tok, blocking=schedule == "batched", time_model=time_model, shape=shape)
    rollout_engine = RolloutEngine(eng, tok, {"google_search": tool or SlowSearch()}, max_response_tokens=40000,
                                   system_prompt=SYSTEM_PROMPT_COMPACT)
    ce = ConcurrentRolloutEngine(rollout_engine, tool_concurrency=64, schedule=schedule)
    qs = list(train_queries()[:n_queries])
    branch = None
    if reflection:
        prompt = rollout_engine.prompt_ids("Reflect on the trajectory.", [])
        view = SeededView(eng, 10_000 + seed)  # the reflection branch's own request seeds
        branch = threading.Thread(target=view.generate, args=([prompt] * reflection, [2000] * reflection, 1.0))
    t0 = time.perf_counter()
    if branch is not None:
        branch.start()
    out = ce.run(qs, n, None, seed)
    t_roll = time.perf_counter() - t0
    if branch is not None:
        branch.join()
    eng.close()
    return out, t_roll, dict(eng.stats)


def key(rs) -> list:
    """What a trajectory is: its tokens, loss mask, tool calls and ending."""
    return [(r.response_ids, r.loss_mask, [c.query for c in r.tool_calls], r.finished, r.truncated) for r in rs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=32, help="rollouts (queries x 8)")
    ap.add_argument("--n", type=int, default=8, help="rollouts per query (PAPER: 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reflection", type=int, default=16, help="candidates in the REFLECTION_OVERLAP sitting")
    a = ap.parse_args(argv)
    nq = max(1, a.rollouts // a.n)
    res = {}
    for sched in ("batched", "async"):
        out, secs, st = rollouts(sched, nq, a.n, a.seed)
        res[sched] = (out, secs, st)
        calls = sum(len(r.tool_calls) for r in out)
        toks = sum(sum(r.loss_mask) for r in out)
        print(f"{'blocking' if sched == 'batched' else 'continuous':<10} {secs:6.1f} s  {len(out)} rollouts, "
              f"{calls} searches, {toks} sampled tokens, {st['steps']} engine steps, at most "
              f"{st['max_running']} sequences at once", flush=True)
    same = key(res["batched"][0]) == key(res["async"][0])
    lengths = sorted(sum(r.loss_mask) for r in res["async"][0])
    print(f"sampled tokens per rollout: min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}; searches per rollout "
          f"{min(len(r.tool_calls) for r in res['async'][0])}-{max(len(r.tool_calls) for r in res['async'][0])}")
    if a.reflection:
        rb = rollouts("batched", nq, a.n, a.seed, reflection=a.reflection)[1]
        rc = rollouts("async", nq, a.n, a.seed, reflection=a.reflection)[1]
        print(f"REFLECTION_OVERLAP candidates={a.reflection} continuous_s={rc:.2f} blocking_s={rb:.2f} "
              f"ratio={rc / rb:.2f}", flush=True)
    c, b = res["async"][1], res["batched"][1]
    print(f"ROLLOUT_PHASE continuous_s={c:.2f} blocking_s={b:.2f} ratio={c / b:.2f} same_trajectories={same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
