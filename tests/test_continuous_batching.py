"""Continuous batching of the rollout phase (backends/scale/continuous.py, schedule "async" of
backends/scale/rollout_engine.ConcurrentRolloutEngine; §3.1-3.2 rollouts with search): a rollout's next
turn reaches the engine as soon as its own tool result arrives, never waiting for another rollout's
segment; a second caller's requests (the reflection branch on rank 0's engine) join the same batch;
and the trajectories are the same under every schedule, per request seed. Speed is measured by
benchmarks/rollout_phase.py, not here."""
import concurrent.futures as cf
import importlib.util
import os
import threading

import pytest

from toyfix import tiny_tokenizer, train_queries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = {"base_s": 0.0002, "per_seq_s": 0.0, "per_ctx_token_s": 0.0, "prefill_s_per_token": 0.0}


def _bench():
    spec = importlib.util.spec_from_file_location("rollout_phase",
                                                  os.path.join(ROOT, "benchmarks", "rollout_phase.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_same_trajectories_under_continuous_blocking_and_lockstep_per_request_seed():
    b = _bench()
    shape = {"turn_median": 12, "answer_median": 30, "cap": 80}
    tool = b.SlowSearch(0.0, 0.02)
    runs = {s: b.rollouts(s, 2, 4, seed=3, time_model=FAST, shape=shape, tool=tool)[0]
            for s in ("async", "batched", "lockstep")}
    ref = b.key(runs["lockstep"])
    assert sum(len(r.tool_calls) for r in runs["lockstep"]) >= 2 * 4 * 2  # 2-8 calls per rollout
    assert b.key(runs["async"]) == ref and b.key(runs["batched"]) == ref
    other = b.rollouts("async", 2, 4, seed=4, time_model=FAST, shape=shape, tool=tool)[0]
    assert b.key(other) != ref  # the seed matters


class HeldSampler:
    """A RequestSampler whose requests finish only when the test says so; records submissions."""

    def __init__(self, tok):
        self.tok = tok
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.submitted: list = []  # (seed, prompt length, future)
        self.lock = threading.Lock()
        self.new = threading.Condition(self.lock)

    def submit(self, prompt, max_new_tokens, temperature, seed=None):
        f = cf.Future()
        with self.new:
            self.submitted.append((seed, len(prompt), f))
            self.new.notify_all()
        return f

    def wait_for(self, n):
        with self.new:
            assert self.new.wait_for(lambda: len(self.submitted) >= n, timeout=30), len(self.submitted)
            return list(self.submitted)

    def call(self):
        return self.tok.encode('x<call_tool name="google_search">q</call_tool>', add_special_tokens=False)

    def answer(self):
        return self.tok.encode("<answer>a [1].</answer>", add_special_tokens=False) + [self.eot]


def test_next_turn_reaches_the_engine_while_another_rollouts_segment_still_runs():
    """Rollout 0's first segment runs on (a long answer: its future stays open); rollout 1's segment
    ends in a call, its tool answers, and its next segment is submitted at once, with rollout 0's
    segment still running. The batched schedule would hold it until rollout 0's segment ends."""
    from backends.scale.rollout_engine import ConcurrentRolloutEngine
    from scaffold import SYSTEM_PROMPT_COMPACT, RolloutEngine, SearchResult

    tok = tiny_tokenizer()
    s = HeldSampler(tok)
    searched = threading.Event()

    def tool(q):
        searched.set()
        return [SearchResult("d", "t", "x")]

    eng = RolloutEngine(s, tok, {"google_search": tool}, max_response_tokens=500,
                        system_prompt=SYSTEM_PROMPT_COMPACT)
    ce = ConcurrentRolloutEngine(eng, tool_concurrency=2, schedule="async")
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("out", ce.run(list(train_queries()[:1]), 2, None, 7)))
    th.start()
    first = s.wait_for(2)  # both rollouts' first segments
    first[1][2].set_result(s.call())  # rollout 1: a call
    assert searched.wait(30)
    third = s.wait_for(3)[2]  # rollout 1's second segment, submitted after its tool result...
    assert not first[0][2].done()  # ...while rollout 0's first segment is still running
    assert third[1] > first[1][1]  # it continues rollout 1 (the tool output is in its prompt)
    third[2].set_result(s.answer())
    first[0][2].set_result(s.answer())
    th.join(30)
    out = box["out"]
    assert [len(r.tool_calls) for r in out] == [0, 1] and all(r.finished for r in out)


def test_reflection_candidates_and_rollouts_share_the_engine_batch():
    """Two callers on one engine, as on rank 0 in the overlapped step: the rollouts' segments (one
    generate call in one thread) and the reflection branch's candidates (SeededView.generate from
    another thread, started while the segments run). Continuous: all 8 requests run in the same
    engine steps. Blocking calls (one at a time, the old sampler lock): never more than 4."""
    from backends.scale.rollout_engine import SeededView

    b = _bench()
    tok = tiny_tokenizer()
    shape = {"turn_median": 1500, "turn_sigma": 0.0, "cap": 1500}  # every segment 1,500+ steps
    prompt = tok.encode("reflect on this", add_special_tokens=False)
    most = {}
    for blocking in (False, True):
        eng = b.SimEngine(tok, blocking=blocking, time_model=FAST, shape=shape)
        roll = threading.Thread(target=eng.generate, args=([prompt] * 4, [3000] * 4, 1.0, list(range(4))))
        roll.start()
        for _ in range(3000):  # until the rollouts' 4 requests run
            if eng.stats["max_running"] >= 4:
                break
            threading.Event().wait(0.01)
        refl = threading.Thread(target=SeededView(eng, 99).generate, args=([prompt] * 4, [3000] * 4, 1.0))
        refl.start()
        roll.join(120)
        refl.join(120)
        eng.close()
        most[blocking] = eng.stats["max_running"]
    assert most == {False: 8, True: 4}


def test_serial_requests_keep_submission_order_and_pass_errors():
    from backends.scale.continuous import SerialRequests, requests_for

    calls = []

    class Gen:
        def generate(self, prompts, budgets, temperature, seeds=None):
            calls.append((prompts[0][0], seeds))
            if prompts[0][0] == 9:
                raise RuntimeError("boom")
            return [[prompts[0][0] * 10]]

    front, close = requests_for(Gen())
    assert isinstance(front, SerialRequests)
    fs = [front.submit([i], 4, 1.0, seed=i + 100) for i in (1, 2, 9, 3)]
    assert [f.result() for f in fs[:2]] == [[10], [20]]
    with pytest.raises(RuntimeError, match="boom"):
        fs[2].result()
    assert fs[3].result() == [30]
    close()
    assert calls == [(1, [101]), (2, [102]), (9, [109]), (3, [103])]
    sub = type("S", (), {"submit": lambda self, *a, **k: None})()
    assert requests_for(sub)[0] is sub
