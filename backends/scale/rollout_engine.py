"""Full mode's rollout schedule: no turn barrier, concurrent tool calls, every rank samples, groups
judged as they finish, and the reflection branch overlapping the next step's rollouts.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for Algorithm 1 steps 3, 4 and 7 (§3.1-3.4) at scale; nothing of the method lives here. The
rollouts, tool outputs, judge calls and reflection candidates are those of scaffold.RolloutEngine,
judge.judge_group and reflection.run_reflection_branch; only *when* each piece runs changes.

What is here
    request_seed(base, index, turn)        the sampling seed of one request: a rollout's turn, or a
                                           reflection candidate; independent of the schedule
    SeededSampler                          what the engine needs of a sampler: generate(...) with one
                                           seed per prompt (backends/scale/vllm_sampler.VLLMSampler and
                                           the CPU benchmark's sampler implement it)
    ConcurrentRolloutEngine.run            schedule "async": continuous batching, one request per
                                           segment (backends/scale/continuous.py): a rollout's next
                                           turn reaches the engine as soon as its own tool result
                                           arrives (tools on a bounded thread pool,
                                           full.tool_concurrency), never waiting for another
                                           rollout's segment; "batched": every ready rollout in one
                                           blocking generate call (the convoy schedule, kept for
                                           benchmarks/rollout_phase.py); "lockstep": rounds, every
                                           rollout waits for every tool call, run one after another
    shard(n_groups, world, rank)           the contiguous groups rank `rank` samples
    StreamingJudge                         judge.judge_group of a group as soon as its n rollouts are
                                           done, on a bounded pool; groups of the same query text in
                                           group order (they share a rubric buffer)
    AsyncReflection                        the reflection branch of step t in a thread, overlapping
                                           step t+1's rollouts; its batch is collected before step
                                           t+1's update (one-step lag, Algorithm 1)
    GatedBank                              the branch's bank writes (and, in reflection_branch, its
                                           judge calls) wait until step t+1's retrieval has read
                                           the bank
    TORCH_RNG_LOCK                         one seeded request at a time on torch's global RNG
    SeededTorchSampler                     the HF / KV sampler with one seed per request (each
                                           request decoded on its own under a forked, seeded RNG)
    SeededRollouts                         train.py's rollout engine in full mode (HF / KV sampler,
                                           and vLLM with "async" or an engine per rank):
                                           per-request seeds, "lockstep" or "async", and every
                                           ZeRO-3 rank's share (engine.ZeRO3Engine.sample_shards)

Determinism: a request's seed depends only on (step seed, rollout index, turn), so the tokens a
rollout samples do not depend on which rank sampled it, on the batch it shared, or on the order the
tools answered; tool outputs depend only on the call. Both schedules and any rank count therefore give
the same rollouts for a seed (tests/test_full_concurrency.py), bit for bit on CPU when the sampler
decodes each request on its own (the benchmark's sampler does); vLLM's batch-dependent kernels make
that "same distribution", not bit-identical, on GPU.

train.py --full puts these together in backends/distributed/overlap.py (full.rollout_schedule "async"). The toy
path does not use this module: its samplers keep lock-step turns, and its numbers stay as they were.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import hashlib
import threading
import time
from typing import Callable, Protocol, Sequence

import torch

from backends.scale.continuous import requests_for
from reflection import run_reflection_branch
from scaffold import Rollout, finalize


SCHEDULES = ("async", "batched", "lockstep")

# Held around each seeded request of SeededTorchSampler (fork the global RNG, seed, decode, restore)
# and around the step's torch.manual_seed in backends/distributed/overlap.py: the overlapped reflection branch
# samples in its own thread, and two threads forking torch's one global RNG would mix their streams.
TORCH_RNG_LOCK = threading.Lock()


def request_seed(base: int, index: int, turn: int) -> int:
    """Seed of one sampling request, in [0, 2**31 - 1): sha256 of (base, index, turn).

    base: the step's sampling seed (train.sample_rollouts: seed * 7919 + step); index: the rollout's
    global index in the step (query-major); turn: 0 for the first policy turn, +1 after each tool
    output. Independent of rank, batch and arrival order."""
    h = hashlib.sha256(f"{int(base)}:{int(index)}:{int(turn)}".encode()).digest()
    return int.from_bytes(h[:8], "little") % (2 ** 31 - 1)


class SeededSampler(Protocol):
    """A scaffold.Sampler whose generate takes one seed per prompt (None: the engine's RNG)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float,
                 seeds: list[int] | None = None) -> list[list[int]]: ...


def shard(n_groups: int, world: int, rank: int, rank0_share: float = 1.0) -> range:
    """The groups rank `rank` of `world` samples: contiguous, rank 0 first. rank0_share 1: sizes
    differing by at most 1, the larger shares first. rank0_share in [0, 1): rank 0 takes
    round(n_groups * rank0_share / (rank0_share + world - 1)) groups (its engine also samples the
    overlapped reflection branch), the other ranks split the rest as above. Raises ValueError for
    world < 1, rank outside [0, world) or rank0_share outside [0, 1]."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    if not 0.0 <= rank0_share <= 1.0:
        raise ValueError(f"rank0_share must be in [0, 1], got {rank0_share}")
    if rank0_share < 1.0 and world > 1:
        first = min(n_groups, int(n_groups * rank0_share / (rank0_share + world - 1) + 0.5))
        if rank == 0:
            return range(0, first)
        rest = shard(n_groups - first, world - 1, rank - 1)
        return range(first + rest.start, first + rest.stop)
    base, extra = divmod(n_groups, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class ConcurrentRolloutEngine:
    """Multi-turn rollouts (§3.1-3.2) over a scaffold.RolloutEngine's sampler, tools, prompt, parser
    and fault rules, with one seed per request (request_seed).

    schedule "async" (continuous batching): each segment is one request to the sampler
    (continuous.requests_for: VLLMSampler.submit, or one request at a time for a sampler with only
    `generate`); a segment that ends with a call goes to the tool pool (at most `tool_concurrency`
    calls in flight) and the rollout's next segment is submitted the moment the tool returns, while
    the others keep sampling. schedule "batched": a loop hands the sampler every rollout that is
    ready in one blocking generate call, `max_batch` at a time (None: all that are ready), so a
    rollout whose tool returned waits for that call's longest segment (the convoy the "async"
    schedule removes; kept to measure it). schedule "lockstep": the rounds of
    scaffold.RolloutEngine.run (every active rollout samples, then every call runs, one at a time).

    on_group_done(g) is called from the loop when the n rollouts of group g (0-based, of this call)
    are all finished and finalised, so a judge can start on it while other groups still sample.
    `stats` adds up the engine's tool counters (tool_errors, tool_refusals, tool_timeouts,
    deadline_refusals) plus sampler_calls, gen_tokens (tokens this engine's rollouts sampled: a
    sampler shared with the overlapped reflection branch counts that branch's tokens too, these
    never do) and max_tool_calls_pending (calls handed to the pool, running or queued; at most
    tool_concurrency of them run); sampler_calls counts generate calls ("batched", "lockstep") or
    requests ("async").

    engine: a scaffold.RolloutEngine whose sampler takes seeds (SeededSampler); tool_concurrency
    >= 1; max_batch >= 1 or None. Raises ValueError for an unknown schedule or a bound below 1.
    """

    def __init__(self, engine, tool_concurrency: int = 8, schedule: str = "async",
                 max_batch: int | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if tool_concurrency < 1:
            raise ValueError(f"tool_concurrency must be >= 1, got {tool_concurrency}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        self.engine, self.schedule = engine, schedule
        self.tool_concurrency, self.max_batch = int(tool_concurrency), max_batch
        self.stats = collections.Counter()
        self._lock = threading.Lock()

    # -- helpers shared by both schedules ------------------------------------------------------------

    def _sample(self, batch: list[Rollout], seed: int, temp: float, turns: dict) -> list[list[int]]:
        e = self.engine
        budgets = [e.max_response_tokens - len(r.response_ids) for r in batch]
        seeds = [request_seed(seed, r._index, turns[id(r)]) for r in batch]
        self.stats["sampler_calls"] += 1
        out = e.sampler.generate([r.prompt_ids + r.response_ids for r in batch], budgets, temp,
                                 seeds=seeds)
        self.stats["gen_tokens"] += sum(len(ids) for ids in out)
        return out

    def _tool(self, r: Rollout) -> None:
        """engine._run_tool on a private copy of the engine (its counters merged under a lock), so
        calls in different threads never race on the shared counters."""
        e = copy.copy(self.engine)
        e.stats = dict.fromkeys(self.engine.stats, 0)
        e._run_tool(r)
        with self._lock:
            for k, v in e.stats.items():
                self.engine.stats[k] += v
                self.stats[k] += v

    def _after_sample(self, r: Rollout, ids: list[int]) -> str:
        """Append a sampled segment; "call" (a tool call to run), "finished" or "truncated"."""
        e = self.engine
        r.response_ids.extend(ids)
        r.loss_mask.extend([1] * len(ids))
        if e._ends_with_call(ids):
            return "call"
        if ids and ids[-1] in e._eos_ids():
            r.finished = True
            return "finished"
        r.truncated = True
        return "truncated"

    def _close(self, r: Rollout) -> None:
        e = self.engine
        if len(r.response_ids) > e.max_response_tokens:  # a tool output may overshoot by one block
            del r.response_ids[e.max_response_tokens:]
            del r.loss_mask[e.max_response_tokens:]
            r.truncated = True
        finalize(r, e.tok, e.scaffold)

    # -- the two schedules ---------------------------------------------------------------------------

    def run(self, queries: Sequence, n: int, bank_items: Sequence[Sequence[str]] | None, seed: int,
            temperature: float | None = None, index_offset: int = 0,
            on_group_done: Callable[[int], None] | None = None,
            sink: list | None = None) -> list[Rollout]:
        """n rollouts per query (query-major, as scaffold.RolloutEngine.run). seed: the step's
        sampling seed; index_offset: the global index of this call's first rollout (a rank's
        share starts at shard(...).start * n); sink: a list to hold the rollouts from the start,
        so on_group_done(g) can read group g's from sink[g * n:(g + 1) * n].
        Returns len(queries) * n finalised Rollouts (`sink` itself when given). Tool faults never
        end a rollout (scaffold.RolloutEngine's rules); a tool error marked `stops_run` (an API's
        401/403/404, backends/api/http.py) is raised here, as is anything the sampler raises."""
        e = self.engine
        temp = e.temperature if temperature is None else temperature
        e._deadline = time.monotonic() + e.deadline_s if e.deadline_s else None
        rollouts: list[Rollout] = sink if sink is not None else []
        del rollouts[:]
        for qi, q in enumerate(queries):
            items = list(bank_items[qi]) if bank_items else []
            p = e.prompt_ids(q.query, items)
            for _ in range(n):
                r = Rollout(q, items, p)
                r._index = index_offset + len(rollouts)
                rollouts.append(r)
        left = collections.Counter(i // n for i in range(len(rollouts)))

        def done(r: Rollout) -> None:
            self._close(r)
            g = (r._index - index_offset) // n
            left[g] -= 1
            if left[g] == 0 and on_group_done is not None:
                for x in rollouts[g * n:(g + 1) * n]:
                    x.__dict__.pop("_index", None)  # the group leaves the engine clean
                on_group_done(g)

        turns = {id(r): 0 for r in rollouts}
        if self.schedule == "lockstep":
            self._lockstep(rollouts, seed, temp, turns, done)
        elif self.schedule == "batched":
            self._batched(rollouts, seed, temp, turns, done)
        else:
            self._continuous(rollouts, seed, temp, turns, done)
        for r in rollouts:
            r.__dict__.pop("_index", None)
        return rollouts

    def _lockstep(self, rollouts, seed, temp, turns, done) -> None:
        e, active = self.engine, list(rollouts)
        for _ in range(e.max_rounds):
            if not active:
                break
            new = self._sample(active, seed, temp, turns)
            still = []
            for r, ids in zip(active, new):
                if self._after_sample(r, ids) == "call":
                    self._tool(r)  # one after another: every rollout waits for every call
                    turns[id(r)] += 1
                    if len(r.response_ids) >= e.max_response_tokens:
                        r.truncated = True
                    else:
                        still.append(r)
                        continue
                done(r)
            active = still
        for r in active:
            r.truncated = True
            done(r)

    def _continuous(self, rollouts, seed, temp, turns, done) -> None:
        """Schedule "async": one request per segment; every future (a segment or a tool call) is
        handled as it completes, in rollout-index order among those done together."""
        e = self.engine
        front, close = requests_for(e.sampler)
        rounds = {id(r): 0 for r in rollouts}
        pending: dict = {}  # future -> ("sample" | "tool", rollout)

        def next_turn(r: Rollout) -> None:
            # SCALE: the rollout's next segment goes to the engine now, whatever else is running
            budget = e.max_response_tokens - len(r.response_ids)
            f = front.submit(r.prompt_ids + r.response_ids, budget, temp,
                             request_seed(seed, r._index, turns[id(r)]))
            self.stats["sampler_calls"] += 1
            pending[f] = ("sample", r)

        try:
            with cf.ThreadPoolExecutor(self.tool_concurrency, thread_name_prefix="tool") as pool:
                for r in rollouts:
                    next_turn(r)
                while pending:
                    finished, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
                    for f in sorted(finished, key=lambda f: pending[f][1]._index):
                        kind, r = pending.pop(f)
                        if kind == "sample":
                            ids = f.result()  # re-raise what the sampler raised
                            self.stats["gen_tokens"] += len(ids)
                            rounds[id(r)] += 1
                            if self._after_sample(r, ids) != "call":
                                done(r)
                                continue
                            pending[pool.submit(self._tool, r)] = ("tool", r)
                            n_tools = sum(k == "tool" for k, _ in pending.values())
                            self.stats["max_tool_calls_pending"] = max(
                                self.stats["max_tool_calls_pending"], n_tools)
                            continue
                        f.result()  # a 401/403/404 of the search API stops the run
                        turns[id(r)] += 1
                        if len(r.response_ids) >= e.max_response_tokens or rounds[id(r)] >= e.max_rounds:
                            r.truncated = True
                            done(r)
                        else:
                            next_turn(r)
        finally:
            for f in pending:  # an error above: requests still queued are not waited for
                f.cancel()
            close()

    def _batched(self, rollouts, seed, temp, turns, done) -> None:
        e = self.engine
        ready = collections.deque(rollouts)
        rounds = {id(r): 0 for r in rollouts}
        in_flight: dict = {}
        with cf.ThreadPoolExecutor(self.tool_concurrency, thread_name_prefix="tool") as pool:
            while ready or in_flight:
                if ready:
                    k = len(ready) if self.max_batch is None else min(self.max_batch, len(ready))
                    batch = [ready.popleft() for _ in range(k)]
                    for r, ids in zip(batch, self._sample(batch, seed, temp, turns)):
                        rounds[id(r)] += 1
                        if self._after_sample(r, ids) != "call":
                            done(r)
                            continue
                        in_flight[pool.submit(self._tool, r)] = r
                        self.stats["max_tool_calls_pending"] = max(self.stats["max_tool_calls_pending"],
                                                                len(in_flight))
                    finished = [f for f in in_flight if f.done()]
                else:
                    finished, _ = cf.wait(list(in_flight), return_when=cf.FIRST_COMPLETED)
                # Rollouts whose tool answered rejoin in index order (deterministic batches).
                for f in sorted(finished, key=lambda f: in_flight[f]._index):
                    r = in_flight.pop(f)
                    f.result()  # re-raise what the engine lets through (a 401/403/404 stops the run)
                    turns[id(r)] += 1
                    if len(r.response_ids) >= e.max_response_tokens or rounds[id(r)] >= e.max_rounds:
                        r.truncated = True
                        done(r)
                    else:
                        ready.append(r)


class StreamingJudge:
    """judge.judge_group(query, group, step) for each group as soon as it is submitted, at most
    `concurrency` groups at a time (each HTTP judge call also passes the judge's own request bound
    and rate limits: backends/api/http.py). Groups of the same query text run in submission-index order,
    one after another, because they share that query's rubric buffer.

    submit(g) from any thread once group g's rollouts are final; results() waits for all and returns
    them in group order. Raises what judge_group raised. close() (when the rollouts failed) cancels
    what has not started and makes later submits no-ops, so a thread still handing in another
    rank's groups goes on receiving them (that rank must not be left waiting on its sends)."""

    def __init__(self, judge, queries: Sequence, groups: Sequence[Sequence[Rollout]], step: int,
                 concurrency: int = 8):
        if concurrency < 1:
            raise ValueError(f"judge concurrency must be >= 1, got {concurrency}")
        self.judge, self.queries, self.groups, self.step = judge, list(queries), groups, step
        self.pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="judge")
        self.futures: dict[int, cf.Future] = {}
        self.submitted_at: dict[int, float] = {}
        self._lock = threading.Lock()
        self._waiting: set[int] = set()
        self._closed = False

    def _prior(self, g: int) -> list[int]:
        return [h for h in range(g) if self.queries[h].query == self.queries[g].query]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, g: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._waiting.add(g)
            self.submitted_at[g] = time.perf_counter()
            self._launch()

    def _launch(self) -> None:
        for g in sorted(self._waiting):
            prior = self._prior(g)
            if prior and prior[-1] not in self.futures:
                continue  # its query's earlier group is not even submitted yet
            self._waiting.discard(g)
            before = self.futures[prior[-1]] if prior else None
            self.futures[g] = self.pool.submit(self._one, g, before)

    def _one(self, g: int, before: cf.Future | None):
        if before is not None:
            before.result()
        return self.judge.judge_group(self.queries[g], self.groups[g], self.step)

    def results(self) -> list:
        try:
            if len(self.futures) + len(self._waiting) != len(self.queries):
                missing = sorted(set(range(len(self.queries))) - set(self.futures) - self._waiting)
                raise RuntimeError(f"groups never submitted to the judge: {missing}")
            return [self.futures[g].result() for g in range(len(self.queries))]
        finally:
            self.pool.shutdown(wait=True)


class AsyncReflection:
    """The reflection branch of step t (a callable returning (ReflectionBatch, metrics)) in a
    background thread, so its sampling and judging overlap step t+1's rollouts (PAPER: one-step lag,
    Algorithm 1); `result()` is called before step t+1's update, whose batch it joins. At most one
    branch is in flight. The branch must read only what step t fixed (its rollouts, judge results,
    an rng of its own) and sample with per-request seeds, so it gives the same bank entries as the
    sequential schedule from the same policy snapshot (tests/test_full_concurrency.py)."""

    def __init__(self):
        self._th: threading.Thread | None = None
        self._box: dict = {}
        self._gate: threading.Event | None = None

    def start(self, branch: Callable[[], tuple], bank_gate: threading.Event | None = None) -> None:
        """Run `branch` in a thread. bank_gate: the Event the branch's bank writes wait for
        (reflection_branch(bank_gate=...)); the caller sets it once step t+1's retrieval has read
        the bank, and result() sets it in any case before waiting."""
        from backends.scale.cuda_threads import start_thread  # lazy: full mode's overlapped step only

        if self._th is not None:
            raise RuntimeError("a reflection branch is already in flight; collect it with result()")
        self._gate = bank_gate
        box: dict = {}

        def work():
            t0 = time.perf_counter()
            try:
                box["value"] = branch()
            except BaseException as e:  # handed to result()
                box["error"] = e
            box["seconds"] = time.perf_counter() - t0

        self._box = box
        # SCALE: the branch may touch CUDA (a torch sampler's decoding, the dense bank retriever's
        # embeddings): it starts on the rank's GPU (backends/scale/cuda_threads.py)
        self._th = start_thread(work, name="reflection")

    @property
    def pending(self) -> bool:
        return self._th is not None

    def result(self) -> tuple:
        """Wait for the branch in flight; its (batch, metrics), metrics with reflect/async_wait_s
        (how long the caller waited) and reflect/async_s (the branch's own time). Raises what the
        branch raised, or RuntimeError when none is in flight."""
        if self._th is None:
            raise RuntimeError("no reflection branch in flight")
        t0 = time.perf_counter()
        if self._gate is not None:
            self._gate.set()
        self._th.join()
        self._th, box = None, self._box
        if "error" in box:
            raise box["error"]
        batch, metrics = box["value"]
        metrics = dict(metrics)
        metrics["reflect/async_wait_s"] = time.perf_counter() - t0
        metrics["reflect/async_s"] = box["seconds"]
        return batch, metrics


def pool_map(n: int) -> Callable:
    """A `map` whose calls run on a fresh pool of n >= 1 threads (closed before it returns); results
    in input order, the first exception raised. The reflection branch's privileged judge calls go
    through it with an HTTP judge (build.build_run: Run.judge_map), whose client bounds the requests
    in flight and the rate (judge_http.concurrency, rpm / tpm). Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"pool size must be >= 1, got {n}")

    def pmap(fn, xs):
        with cf.ThreadPoolExecutor(n, thread_name_prefix="judge-map") as pool:
            return list(pool.map(fn, xs))

    return pmap


class SeededView:
    """A SeededSampler seen through the plain scaffold.Sampler contract: the i-th prompt of each
    generate call samples with request_seed(base, i, call), call counting this view's generate calls
    from 0. The reflection branch samples through it (one call per step, P x m prompts), so its
    candidates do not depend on what else the engine is doing at the same time."""

    def __init__(self, sampler, base: int):
        self.sampler, self.base, self.calls = sampler, int(base), 0
        self.stats = getattr(sampler, "stats", {})

    def generate(self, prompts, max_new_tokens, temperature):
        call, self.calls = self.calls, self.calls + 1
        seeds = [request_seed(self.base, i, call) for i in range(len(prompts))]
        return self.sampler.generate(prompts, max_new_tokens, temperature, seeds=seeds)


class GatedBank:
    """A rubric bank whose writes (upsert) wait until `gate` is set; reads and everything else go to
    `bank` at once. The asynchronous reflection branch of step t writes through it, so its upserts
    land after step t+1's retrieval has read the bank, whenever the thread gets there: the bank a
    step retrieves from does not depend on thread timing (the branch is the bank's only writer, so
    each upsert also sees the state the sequential branch saw)."""

    def __init__(self, bank, gate: threading.Event):
        self.bank, self.gate = bank, gate

    def upsert(self, *args, **kwargs):
        self.gate.wait()
        return self.bank.upsert(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.bank, name)


def reflection_branch(step: int, rollouts, judged, judge, bank, sampler, tok, system: str, cfg, rng,
                      std: str, eps: float, group_size: int, seed: int,
                      judge_concurrency: int = 8,
                      bank_gate: threading.Event | None = None) -> Callable[[], tuple]:
    """reflection.run_reflection_branch of step `step` as a closure for AsyncReflection (or to call
    at once: the sequential schedule): sampling through SeededView(sampler, seed), the privileged
    judge calls of the P trajectories on a pool of `judge_concurrency` threads (1: one after
    another, as the toy path). rng: the branch's own random.Random (trajectory picks). bank_gate:
    the branch's privileged judge calls and bank writes wait for this Event (AsyncReflection.start(
    bank_gate=...)); its sampling does not. The calls wait in the branch's own (daemon) thread,
    before their pool exists, so a run that stops with a branch waiting does not hang at exit; the
    per-step judge counters then never see a branch's calls before step t+1's snapshot."""
    if bank_gate is not None:
        bank = GatedBank(bank, bank_gate)

    def judge_map(fn, xs):
        if bank_gate is not None:
            bank_gate.wait()
        if judge_concurrency <= 1:
            return list(map(fn, xs))
        with cf.ThreadPoolExecutor(judge_concurrency, thread_name_prefix="reflect-judge") as pool:
            return list(pool.map(fn, xs))

    def branch():
        view = SeededView(sampler, seed)
        return run_reflection_branch(step, rollouts, judged, judge, bank, view, tok, system, cfg,
                                     rng, std, eps, group_size=group_size, map_fn=judge_map)

    return branch


class SeededTorchSampler:
    """A SeededSampler over an in-process torch sampler (toy/hf_sampler.HFSampler or
    toy/kv_sampler.KVSampler), for full mode's HF / KV rollouts on every rank.

    generate(prompts, max_new_tokens, temperature, seeds): with seeds, each prompt is decoded on its
    own, under torch's global RNG forked and seeded with its seed (torch.random.fork_rng: the
    caller's RNG state is left as it was), so a request's tokens depend only on (weights, prompt,
    budget, temperature, seed): not on the rank, the batch or the order. Without seeds it is the
    wrapped sampler's own batched call (the reflection branch's, as before). One request at a time
    costs the batching a GPU would give; on GPU full mode samples with vLLM (docs/full_mode.md).

    reseed(seed) keeps the step's seed (`seed`, read by SeededRollouts); `model` and `stats` are the
    wrapped sampler's, so engine.ZeRO3Engine.sync copies new weights straight into the model."""

    def __init__(self, inner):
        self.inner = inner
        self.model = getattr(inner, "model", None)
        self.stats = getattr(inner, "stats", {})
        self.seed: int | None = None

    def reseed(self, seed: int) -> None:
        self.seed = int(seed)
        getattr(self.inner, "reseed", lambda s: None)(seed)

    def sync_weights(self, named_params, copy: bool = True) -> None:
        self.inner.sync_weights(named_params, copy=copy)

    def close(self) -> None:
        self.inner.close()

    def generate(self, prompts, max_new_tokens, temperature, seeds=None):
        if seeds is None:
            return self.inner.generate(prompts, max_new_tokens, temperature)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        dev = getattr(self.model, "device", None)
        cuda = [dev.index or 0] if getattr(dev, "type", "cpu") == "cuda" else []
        out = []
        for p, m, s in zip(prompts, max_new_tokens, seeds):
            with TORCH_RNG_LOCK, torch.random.fork_rng(devices=cuda):
                torch.manual_seed(int(s))
                out.extend(self.inner.generate([p], [m], temperature))
        return out


class SeededRollouts:
    """scaffold.RolloutEngine's interface (run, prompt_ids, stats, ...) over ConcurrentRolloutEngine
    with one seed per request, for train.py's loop (build.build_run) in full mode with the HF / KV
    sampler, and with the vLLM sampler when it runs on every rank or under "async": `schedule`
    "lockstep" or "async" (full.rollout_schedule). The step's seed is the one train.sample_rollouts
    gave the sampler (SeededTorchSampler.reseed, VLLMSampler.reseed: its `seed`); every request then
    carries request_seed(seed, rollout index, turn).

    deal: None (this process samples every group), or engine.ZeRO3Engine.sample_shards, which gives
    each ZeRO-3 rank its contiguous share of the groups (`shard`), samples rank 0's own, and
    collects the others' as they finish. The rollouts are the same either way (request_seed), so a
    run is deterministic for a seed, and the same for any rank count up to the weights' rounding.
    The wrapped engine's attributes (prompt_ids, ...) and counters (`stats`, which checkpoints
    save) pass through."""

    def __init__(self, engine, schedule: str = "lockstep", tool_concurrency: int = 8,
                 deal: Callable | None = None):
        self._engine = engine
        self._ce = ConcurrentRolloutEngine(engine, tool_concurrency, schedule)
        self._deal = deal

    @property
    def stats(self) -> dict:
        return self._engine.stats

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, queries: Sequence, n: int = 1, bank_items: Sequence[Sequence[str]] | None = None,
            temperature: float | None = None,
            on_group: Callable[[int, list], None] | None = None,
            rank0_share: float = 1.0) -> list[Rollout]:
        """scaffold.RolloutEngine.run; on_group(g, rollouts of group g), when given, is called (from
        the sampling loop or a receiving thread) as soon as group g of this step is final (the
        overlapped step's StreamingJudge, backends/distributed/overlap.py). rank0_share: rank 0's share of the
        groups under `deal` (`shard`; the overlapped step lowers it while the reflection branch
        shares rank 0's sampler); without `deal` it changes nothing."""
        seed = getattr(self._engine.sampler, "seed", None)
        seed = 0 if seed is None else int(seed)
        if self._deal is not None:
            kw = {} if on_group is None else {"on_group": on_group}
            if rank0_share != 1.0:
                kw["rank0_share"] = rank0_share
            return self._deal(self._ce, list(queries), n, bank_items, seed, temperature, **kw)
        sink: list = []
        done = None if on_group is None else (lambda g: on_group(g, sink[g * n:(g + 1) * n]))
        return self._ce.run(queries, n, bank_items, seed, temperature, on_group_done=done, sink=sink)
