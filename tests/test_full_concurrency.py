"""Full mode's concurrent schedule (backends/scale/rollout_engine.py): no turn barrier, bounded concurrent
tool calls, the same rollouts under any schedule and rank count, groups judged as they finish, and the
asynchronous reflection branch giving the sequential branch's bank entries.

The sampler is benchmarks/full_step.BenchSampler over the XS tiny Qwen3 (real decoding, scripted turn
structure, one seed per request); the tool is a fake search whose latency depends on the query, so
tool results arrive out of order.
"""
import dataclasses
import hashlib
import importlib.util
import os
import random
import threading
import time

import pytest

from toyfix import SYSTEM, tiny_tokenizer, train_queries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("full_step", os.path.join(ROOT, "benchmarks", "full_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_tok():
    from toy import model as toy_model

    tok = tiny_tokenizer()
    m = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    m.eval()
    return m, tok


class SlowTool:
    """Search results that depend only on the query, after a latency that also does (0 to `base` s),
    or `slow_s` for queries in `slow`. Records the calls in flight."""

    def __init__(self, base: float = 0.03, slow: tuple = (), slow_s: float = 0.0,
                 gate: threading.Event | None = None, on_slow_return=None):
        """gate: a slow query waits for it (at most slow_s) instead of sleeping slow_s;
        on_slow_return(): called as a slow query returns."""
        self.base, self.slow, self.slow_s, self.gate = base, slow, slow_s, gate
        self.on_slow_return = on_slow_return
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.calls = 0

    def __call__(self, query: str):
        from scaffold import SearchResult

        with self.lock:
            self.in_flight += 1
            self.calls += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        h = int(hashlib.sha256(query.encode()).hexdigest()[:8], 16)
        if any(s in query for s in self.slow):
            if self.gate is not None:
                self.gate.wait(self.slow_s)
            else:
                time.sleep(self.slow_s)
            if self.on_slow_return is not None:
                self.on_slow_return()
        else:
            time.sleep(self.base * (h % 7) / 6)
        with self.lock:
            self.in_flight -= 1
        return [SearchResult(f"d{h % 97}", f"Result for {query[:20]}", f"text {h % 13}")]


def _engine(model_tok, tool, schedule="async", tool_concurrency=8, max_batch=None):
    from backends.scale.rollout_engine import ConcurrentRolloutEngine
    from scaffold import RolloutEngine

    model, tok = model_tok
    sampler = _bench().BenchSampler(model, tok)
    eng = RolloutEngine(sampler, tok, {"google_search": tool}, max_response_tokens=400,
                        system_prompt=SYSTEM)
    return ConcurrentRolloutEngine(eng, tool_concurrency, schedule, max_batch)


def _key(rollouts):
    return [(r.response_ids, r.loss_mask, r.stage_ids, [c.query for c in r.tool_calls], r.truncated,
             r.finished) for r in rollouts]


def test_same_rollouts_under_every_schedule_and_rank_count(model_tok):
    """Deterministic for a seed: lockstep, async, and async split over 2 or 3 "ranks" (shards run with
    their global index offsets) give identical rollouts, tool calls included; another seed differs."""
    from backends.scale.rollout_engine import shard

    qs, n = list(train_queries()[:5]), 2
    ref = _engine(model_tok, SlowTool(), "lockstep").run(qs, n, None, seed=3)
    assert sum(len(r.tool_calls) for r in ref) >= 3  # the schedule matters: there are tool turns
    assert _key(_engine(model_tok, SlowTool(), "async").run(qs, n, None, seed=3)) == _key(ref)
    for world in (2, 3):
        got = []
        for rank in range(world):
            mine = shard(len(qs), world, rank)
            got += _engine(model_tok, SlowTool(), "async", max_batch=1).run(
                [qs[g] for g in mine], n, None, seed=3, index_offset=mine.start * n)
        assert _key(got) == _key(ref), world
    assert _key(_engine(model_tok, SlowTool(), "async").run(qs, n, None, seed=4)) != _key(ref)


def test_shard_covers_every_group_once():
    from backends.scale.rollout_engine import shard

    for P in (0, 1, 7, 32):
        for w in (1, 2, 3, 8):
            parts = [list(shard(P, w, r)) for r in range(w)]
            assert sum(parts, []) == list(range(P))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        shard(4, 2, 2)
    # rank 0's smaller share (full.rank0_rollout_share, the overlapped step): every group once,
    # rank 0 about `share` of another rank's groups, the others within 1 of each other
    for P, w, share, first in ((32, 8, 0.5, 2), (2, 2, 0.5, 1), (8, 2, 0.5, 3), (5, 3, 0.0, 0),
                               (32, 8, 1.0, 4)):
        parts = [list(shard(P, w, r, share)) for r in range(w)]
        assert sum(parts, []) == list(range(P)) and len(parts[0]) == first, (P, w, share, parts)
        assert max(map(len, parts[1:])) - min(map(len, parts[1:])) <= 1
    with pytest.raises(ValueError):
        shard(4, 2, 0, 1.5)


def test_no_turn_barrier_and_bounded_tool_concurrency(model_tok):
    """A rollout whose tool call hangs does not hold the others back: under "async" the call returns
    only once every other group has finished all its turns (a gate the last of them opens; with a
    turn barrier that would never happen and the call would give up after 60 s), whereas under
    "lockstep" no group can finish while it hangs. Tool calls run concurrently, never more than the
    bound. (Ordering, not wall time: the test holds on a loaded machine.)"""
    qs = list(train_queries()[:4])
    probe = _engine(model_tok, SlowTool(base=0.0), "lockstep").run(qs, 2, None, seed=5)
    called = [r for r in probe if r.tool_calls]
    assert len(called) >= 2
    slow_q = called[0].tool_calls[0].query  # the first call of one rollout hangs
    slow_group = next(i // 2 for i, r in enumerate(probe) if any(c.query == slow_q for c in r.tool_calls))

    def ordered(schedule, bound, wait_s):
        gate, done, at_return = threading.Event(), [], []

        def on_done(g):
            done.append(g)
            if set(done) == set(range(len(qs))) - {slow_group}:
                gate.set()  # every other group has finished

        tool = SlowTool(base=0.05, slow=(slow_q,), slow_s=wait_s, gate=gate,
                        on_slow_return=lambda: at_return.append(len(done)))
        out = _engine(model_tok, tool, schedule, tool_concurrency=bound).run(
            qs, 2, None, seed=5, on_group_done=on_done)
        return out, tool, done, at_return, gate

    out, tool, done, at_return, gate = ordered("async", 3, 60.0)
    assert _key(out) == _key(probe)
    assert gate.is_set() and at_return[0] == len(qs) - 1  # the others never waited for it
    assert done[-1] == slow_group
    assert 2 <= tool.max_in_flight <= 3  # concurrent, within the bound
    out, _, _, at_return, _ = ordered("lockstep", 3, 1.0)
    assert _key(out) == _key(probe)
    assert at_return[0] == 0  # the turn barrier: no group finished while the call hung


def test_streaming_judge_starts_before_the_rollouts_end(model_tok):
    """Groups reach the judge as they finish, while other groups still sample; groups of the same
    query go in group order; results come back in group order."""
    from backends.scale.rollout_engine import StreamingJudge

    qs = list(train_queries()[:3])
    qs = [qs[0], qs[1], qs[0], qs[2]]  # query 0 twice: its two groups share a buffer
    events, lock = [], threading.Lock()

    class Judge:
        def judge_group(self, q, group, step):
            with lock:
                g = next(g for g in range(len(qs)) if sj.groups[g] is group)
                events.append(("start", g, time.perf_counter()))
            time.sleep(0.05)
            return ("R", q.query, len(group))

    out: list = []
    sj = StreamingJudge(Judge(), qs, [None] * len(qs), 0, concurrency=4)
    ce = _engine(model_tok, SlowTool(base=0.02))

    def done(g):
        sj.groups[g] = out[g * 2:(g + 1) * 2]
        sj.submit(g)

    ce.run(qs, 2, None, seed=1, on_group_done=done, sink=out)
    t_end = time.perf_counter()
    res = sj.results()
    assert res == [("R", q.query, 2) for q in qs]
    first = min(t for _, _, t in events)
    assert first < t_end  # judging began while rollouts were still running
    starts = [g for kind, g, _ in events]
    assert starts.index(2) > starts.index(0)  # the query's second group after its first


def test_streaming_judge_close_makes_later_submits_no_ops():
    """When the rollouts fail, the overlapped step closes its StreamingJudge while another rank's
    receiving thread may still hand in groups: those submits must return (not raise "cannot schedule
    new futures after shutdown", which ended that thread and left the sending rank waiting)."""
    from backends.scale.rollout_engine import StreamingJudge

    qs = list(train_queries()[:2])
    started = []

    class Judge:
        def judge_group(self, q, group, step):
            started.append(q.query)
            return "R"

    sj = StreamingJudge(Judge(), qs, [["a"], ["b"]], 0, concurrency=2)
    sj.submit(0)
    sj.close()
    sj.submit(1)  # after close: nothing scheduled, nothing raised
    assert 1 not in sj.futures and started in ([], [qs[0].query])


class HashJudge:
    """score_reflections: scores from a hash of the candidate text, after a random latency (so
    concurrent calls finish out of order)."""

    concurrent_groups = True

    def __init__(self):
        self.rng, self.lock, self.calls = random.Random(), threading.Lock(), 0

    def score_reflections(self, query, rollout, judged, row, candidates):
        from judge import ReflectionScore

        with self.lock:
            self.calls += 1
            d = self.rng.random() * 0.05
        time.sleep(d)
        out = []
        for c in candidates:
            h = int(hashlib.sha256(c.encode()).hexdigest()[:8], 16)
            w, x = (h % 101) / 100, (h // 101 % 101) / 100
            out.append(ReflectionScore(w, x, (w + x) / 2, "hash"))
        return out


def test_async_reflection_equals_sequential_from_the_same_snapshot(model_tok):
    """The reflection branch of one step, run at once with serial judge calls (sequential schedule)
    and in AsyncReflection's thread with concurrent judge calls while the next step's rollouts use
    the same sampler, gives the same bank entries and the same GRPO batch."""
    from bank import RubricBank
    from backends.scale.rollout_engine import AsyncReflection, reflection_branch
    from hparams import ReflectionConfig

    _, tok = model_tok
    qs, n = list(train_queries()[:3]), 2
    ce = _engine(model_tok, SlowTool())
    sampler = ce.engine.sampler
    rollouts = ce.run(qs, n, None, seed=2)
    judged = {i: (None, i % n) for i in range(len(rollouts))}
    cfg = ReflectionConfig(m=3, max_new_tokens=16)

    def branch(bank, conc):
        return reflection_branch(0, rollouts, judged, HashJudge(), bank, sampler, tok, SYSTEM, cfg,
                                 random.Random(7), "sample", 1e-6, n, seed=11, judge_concurrency=conc)

    b1 = RubricBank()
    batch1, m1 = branch(b1, 1)()
    b2 = RubricBank()
    ar, gate = AsyncReflection(), threading.Event()
    ar.start(reflection_branch(0, rollouts, judged, HashJudge(), b2, sampler, tok, SYSTEM, cfg,
                               random.Random(7), "sample", 1e-6, n, seed=11, judge_concurrency=8,
                               bank_gate=gate), bank_gate=gate)
    nxt = ce.run(list(train_queries()[3:6]), n, None, seed=9)  # the next step's rollouts, meanwhile
    assert ar.pending
    time.sleep(0.5)
    assert len(b2) == 0  # the bank's writes wait for the next step's retrieval (the gate)
    batch2, m2 = ar.result()  # opens the gate
    assert nxt and not ar.pending
    e1 = [(e.query, e.reflection, e.score, e.step) for e in b1.entries()]
    e2 = [(e.query, e.reflection, e.score, e.step) for e in b2.entries()]
    assert len(e1) >= 2 and e1 == e2
    assert batch1.to_dict() == batch2.to_dict() and batch1.sequences
    assert m2["reflect/async_s"] > 0 and "reflect/async_wait_s" in m2
    # A different branch seed samples different candidates: the comparison can fail.
    b3 = RubricBank()
    reflection_branch(0, rollouts, judged, HashJudge(), b3, sampler, tok, SYSTEM, cfg, random.Random(7),
                      "sample", 1e-6, n, seed=12)()
    assert [(e.query, e.reflection) for e in b3.entries()] != [(q, r) for q, r, _, _ in e1]


def test_async_reflection_passes_errors_and_refuses_two_in_flight():
    from backends.scale.rollout_engine import AsyncReflection

    ar = AsyncReflection()
    with pytest.raises(RuntimeError):
        ar.result()
    ev = threading.Event()
    ar.start(lambda: (ev.wait(5), {}))
    with pytest.raises(RuntimeError):
        ar.start(lambda: (None, {}))
    ev.set()
    ar.result()
    ar.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ar.result()


def test_request_seed_depends_on_every_part():
    from backends.scale.rollout_engine import request_seed

    s = {request_seed(b, i, t) for b in (0, 1) for i in (0, 1, 2) for t in (0, 1)}
    assert len(s) == 12 and all(0 <= x < 2 ** 31 - 1 for x in s)
    assert request_seed(5, 3, 1) == request_seed(5, 3, 1)



def test_full_step_benchmark_runs_both_schedules_on_two_ranks():
    """benchmarks/full_step.py end to end at its smallest (2 gloo ranks, 2 groups x 2, 2 steps, short
    sleeps): both schedules run, sample the same step-0 rollouts, and the last line has the figures.
    No timing is asserted (a shared machine); the figures are in docs/full_mode.md."""
    import re
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "full_step.py"), "--groups", "2",
                        "--n", "2", "--steps", "2", "--m", "2", "--max-tokens", "256", "--judge-sleep",
                        "0.05", "--search-sleep", "0.02"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert "same_rollouts(step 0, both schedules)=True" in lines
    assert any(x.startswith("rollout/sampling_ranks=2 ") for x in lines)
    m = re.fullmatch(r"FULL_STEP step_s=([\d.]+) sequential_step_s=([\d.]+) ratio=([\d.]+)", lines[-1])
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0


def test_seeded_rollouts_in_the_training_loop_interface(model_tok):
    """rollout_engine.SeededRollouts, what build.build_run puts in run.rollout_engine for
    full.rollout_schedule = "async" on one engine (vLLM on rank 0): scaffold.RolloutEngine's run()
    signature, seeded by the sampler's reseed, the same rollouts as the lockstep comparison
    schedule, counters shared with the wrapped engine (checkpoints save them), the rollouts' own
    token count; the settings are validated."""
    from backends.run.config import validate_config
    from backends.run.presets import full_preset
    from backends.scale.rollout_engine import SeededRollouts

    qs = list(train_queries()[:3])
    ce = _engine(model_tok, SlowTool(), "lockstep")
    ref = ce.run(qs, 2, None, seed=6)
    inner = _engine(model_tok, SlowTool()).engine
    eng = SeededRollouts(inner, "async", 4)
    eng.sampler.reseed(6)
    out = eng.run(qs, n=2, bank_items=[[], [], []])
    assert _key(out) == _key(ref)
    assert eng.stats is inner.stats and eng.max_response_tokens == inner.max_response_tokens
    assert eng.prompt_ids(qs[0].query) == ref[0].prompt_ids
    # the tokens its rollouts sampled (tool outputs are not sampled: loss mask 0)
    assert eng._ce.stats["gen_tokens"] == sum(sum(r.loss_mask) for r in out) > 0
    cfg = full_preset()
    cfg.full.rollout_schedule = "barrier-free"
    with pytest.raises(ValueError, match="full.rollout_schedule"):
        validate_config(cfg)
    cfg.full.rollout_schedule, cfg.full.tool_concurrency = "async", 0
    with pytest.raises(ValueError, match="full.tool_concurrency"):
        validate_config(cfg)


def test_pool_map_keeps_order_bounds_threads_and_raises():
    """rollout_engine.pool_map (Run.judge_map for the HTTP judge): input order whatever the finish
    order, at most n calls at once, the first error raised, no thread left behind."""
    from backends.scale.rollout_engine import pool_map

    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def slow(x):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(0.02 * (5 - x % 5))
        with lock:
            state["now"] -= 1
        return x * x

    assert pool_map(3)(slow, range(10)) == [x * x for x in range(10)]
    assert 2 <= state["max"] <= 3
    with pytest.raises(ZeroDivisionError):
        pool_map(2)(lambda x: 1 / x, [1, 0, 2])
    with pytest.raises(ValueError):
        pool_map(0)


def test_seeded_torch_sampler_is_per_request_and_leaves_the_global_rng(model_tok):
    """rollout_engine.SeededTorchSampler over the HF sampler (full mode's rollouts on every rank):
    a request's tokens depend on its seed, not on its batch or position; the caller's RNG is left as
    it was; without seeds it is the wrapped sampler's own call."""
    import torch

    from backends.scale.rollout_engine import SeededTorchSampler
    from toy.hf_sampler import HFSampler

    model, tok = model_tok
    s = SeededTorchSampler(HFSampler(model, tok))
    ps = [tok.encode(q.query, add_special_tokens=False) for q in train_queries()[:3]]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = s.generate(ps, [12, 12, 12], 1.0, seeds=[5, 6, 7])
    assert torch.equal(torch.get_rng_state(), state)
    b = s.generate(ps[::-1], [12, 12, 12], 1.0, seeds=[7, 6, 5])
    c = s.generate(ps[1:2], [12], 1.0, seeds=[6])
    assert a == b[::-1] and c[0] == a[1]
    assert s.generate(ps[:1], [12], 1.0, seeds=[9]) != a[:1]  # another seed, other tokens
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        s.generate(ps, [4, 4, 4], 1.0, seeds=[1, 2])
    torch.manual_seed(1)
    plain = s.generate(ps, [6, 6, 6], 1.0)
    torch.manual_seed(1)
    assert plain == s.inner.generate(ps, [6, 6, 6], 1.0)
    s.reseed(11)
    assert s.seed == 11 and s.model is model
    from toy.kv_sampler import KVSampler  # the KV-cache loop too (sampler = "kv")

    kv = SeededTorchSampler(KVSampler(model, tok))
    a = kv.generate(ps, [12, 12, 12], 1.0, seeds=[5, 6, 7])
    assert kv.generate(ps[::-1], [12, 12, 12], 1.0, seeds=[7, 6, 5]) == a[::-1]


def test_seeded_rollouts_deal_and_local_give_the_same_rollouts(model_tok):
    """rollout_engine.SeededRollouts (run.rollout_engine for full mode's HF / KV sampler): the step's
    seed comes from the sampler's reseed; run with a `deal` (engine.ZeRO3Engine.sample_shards) gets
    the same call as a local run, and the lockstep and async schedules give the same rollouts."""
    from backends.scale.rollout_engine import SeededRollouts, shard

    qs = list(train_queries()[:4])
    outs = {}
    for schedule in ("lockstep", "async"):
        inner = _engine(model_tok, SlowTool()).engine
        inner.sampler.reseed(4)
        outs[schedule] = SeededRollouts(inner, schedule, 4).run(qs, n=2)
    assert _key(outs["lockstep"]) == _key(outs["async"])

    calls = []

    def deal(ce, queries, n, items, seed, temperature):  # two "ranks", one after the other
        calls.append(seed)
        out = []
        for r in range(2):
            part = shard(len(queries), 2, r)
            out += ce.run(queries[part.start:part.stop], n, None, seed, temperature,
                          index_offset=part.start * n)
        return out

    inner = _engine(model_tok, SlowTool()).engine
    inner.sampler.reseed(4)
    eng = SeededRollouts(inner, "async", 4, deal)
    assert _key(eng.run(qs, n=2)) == _key(outs["lockstep"]) and calls == [4]
    assert eng.stats is inner.stats


def test_which_runs_sample_on_every_rank():
    """build.seeded_rollouts / every_rank_samples: full mode with the HF / KV sampler samples one seed
    per request; with vLLM (the full preset) every rank has its own engine (vllm_rank_engines),
    which takes per-request seeds itself (no SeededTorchSampler); every ZeRO-3 rank samples its
    share unless full.rollout_ranks is "rank0", the engine is "torch" or tool faults are injected;
    the toy path never; an unknown value is refused (and the dry run lists it)."""
    from backends.distributed import dry_run
    from backends.run.build import every_rank_samples, seeded_rollouts, vllm_rank_engines
    from backends.run.presets import full_preset, toy_preset

    cfg = full_preset()
    assert cfg.sampler == "vllm"
    assert not seeded_rollouts(cfg) and vllm_rank_engines(cfg) and every_rank_samples(cfg)
    cfg.full.rollout_ranks = "rank0"
    assert not vllm_rank_engines(cfg) and not every_rank_samples(cfg)
    cfg.full.rollout_ranks, cfg.engine = "all", "torch"
    assert not vllm_rank_engines(cfg) and not every_rank_samples(cfg)
    cfg.engine = "zero3"
    cfg.faults.tool_rate = 0.2
    assert vllm_rank_engines(cfg) and not every_rank_samples(cfg)
    cfg.faults.tool_rate = 0.0
    cfg.sampler = "hf"
    assert not vllm_rank_engines(cfg)
    assert seeded_rollouts(cfg) and every_rank_samples(cfg)
    cfg.sampler, cfg.engine = "kv", "torch"
    assert seeded_rollouts(cfg) and not every_rank_samples(cfg)
    cfg.engine = "zero3"
    cfg.full.rollout_ranks = "rank0"
    assert seeded_rollouts(cfg) and not every_rank_samples(cfg)
    cfg.full.rollout_ranks = "all"
    cfg.faults.tool_rate = 0.2
    assert not every_rank_samples(cfg)
    cfg.full.rollout_ranks = "everyone"
    with pytest.raises(ValueError, match="full.rollout_ranks must be one of"):
        seeded_rollouts(cfg)
    assert any("full.rollout_ranks must be one of" in p for p in dry_run.dry_run(cfg, {})[1])
    with pytest.raises(ValueError, match="full.rollout_ranks must be one of"):
        vllm_rank_engines(dataclasses.replace(cfg, sampler="vllm"))
    toy = toy_preset()
    assert not seeded_rollouts(toy) and not every_rank_samples(toy) and not vllm_rank_engines(toy)


def test_dry_run_asks_every_sampling_rank_for_the_search_key():
    """When every rank samples with Serper search, a rank > 0 makes search calls: its dry run lists
    a missing search key (the judge key stays rank 0's); with rank 0 sampling alone it needs none."""
    from backends.distributed import dist, dry_run
    from backends.run.presets import full_preset

    cfg = full_preset()
    cfg.sampler = "hf"
    rank1 = dist.DistEnv(rank=1, local_rank=1, world_size=2, launched=True)
    bad = dry_run._rank_search_key_problems(cfg, {}, rank1)
    assert len(bad) == 1 and "SERPER_API_KEY is not set on global rank 1" in bad[0]
    assert dry_run._rank_search_key_problems(cfg, {"SERPER_API_KEY": "x" * 12}, rank1) == []
    assert dry_run._rank_search_key_problems(cfg, {}, dist.DistEnv(world_size=2, launched=True)) == []
    cfg.full.rollout_ranks = "rank0"
    assert dry_run._rank_search_key_problems(cfg, {}, rank1) == []
