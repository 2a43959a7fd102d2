"""Memory reuse on held-out questions (ablations, Fig. 6d): pass 1 retrieves other questions' lessons
("cross-episode similar", §3.5), the policy reflects on its pass-1 trajectories into a copy of the
bank (§3.4), pass 2 retrieves each question's own lesson ("within-episode exact"); each pass is
reported with memory minus without."""
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

import bank as bank_mod
from runfix import load_script

memory_eval = load_script("memory_eval")
import train
from backends.run import build, presets
from runfix import fast_args, sha256
from test_reflection import ReflectionTextSampler, patch_sampler


def test_paired_delta_is_the_mean_per_question_difference():
    w = {"per_question": {"answer": [0.5, 1.0, 0.25], "score": [0.4, 0.4, 0.4]}}
    wo = {"per_question": {"answer": [0.25, 0.5, 0.25], "score": [0.5, 0.5, 0.5]}}
    d = memory_eval.paired_delta(w, wo)
    assert d["answer"] == pytest.approx(0.25) and d["score"] == pytest.approx(-0.1)
    assert d["answer_per_question"] == [0.25, 0.5, 0.0]
    assert d["answer_ci"][0] <= 0.25 <= d["answer_ci"][1] and d["score_ci"] == pytest.approx([-0.1, -0.1])


@pytest.mark.slow
def test_pass1_similar_then_reflect_then_pass2_exact_fig6d(tmp_path, toy_cache, monkeypatch):
    calls = []
    patch_sampler(monkeypatch, calls)  # training reflections: a valid lesson, so the bank fills
    run = tmp_path / "run"
    assert train.main(fast_args(run, toy_cache, 2, "--set", "curriculum.K=1", "--set",
                                "rollout.prompts_per_step=4", "--set", "reflection.max_new_tokens=96",
                                "--set", "eval.n_questions=2")) == 0
    bank_before = sha256(run / "bank.jsonl")
    assert len(bank_mod.RubricBank.load(run / "bank.jsonl")) == 4
    orig = memory_eval.build_sampler  # reflections on held-out trajectories: the valid lesson
    monkeypatch.setattr(memory_eval, "build_sampler",
                        lambda cfg, model, tok: ReflectionTextSampler(orig(cfg, model, tok), tok, []))
    seen = []
    retrieve = bank_mod.RubricBank.retrieve
    monkeypatch.setattr(bank_mod.RubricBank, "retrieve",
                        lambda self, q, mode, k=2: seen.append((q, mode, len(self))) or
                        retrieve(self, q, mode, k))
    res = memory_eval.memory_reuse(str(run))
    held = [q.query for q in build.build_environment(presets.load_config(
        json.load(open(run / "config.json"))))[3][:2]]
    # pass 1 asks the run's bank (4 training lessons) in similar mode, pass 2 the copy in exact mode
    assert seen[:2] == [(q, "similar", 4) for q in held]
    assert seen[2:] == [(q, "exact", 6) for q in held]
    assert res["pass1"]["mode"] == "similar" and res["pass2"]["mode"] == "exact"
    # each held-out question got its own lesson in pass 2
    assert res["reflection"]["reflect/admitted"] == 2 and res["pass2"]["hits"] == 1.0
    # pass 1 without memory is the run's final held-out evaluation (same questions and seed)
    ev = json.load(open(run / "eval.json"))
    assert res["pass1"]["without"]["per_question"] == ev["eval_rl"]["per_question"]
    for p in ("pass1", "pass2"):
        d = res[p]["delta"]
        w, wo = (np.asarray(res[p][x]["per_question"]["answer"]) for x in ("with", "without"))
        assert d["answer"] == pytest.approx(float((w - wo).mean()))
    assert sha256(run / "bank.jsonl") == bank_before  # the run's bank is not written
    # the command line writes memory.json
    assert memory_eval.main([str(run), "--out", str(tmp_path / "m.json")]) == 0
    assert json.load(open(tmp_path / "m.json"))["pass2"]["hits"] == 1.0
    assert memory_eval.main([str(tmp_path / "nothing")]) == 2



def test_attempt_control_reflects_each_questions_first_pass1_sample_then_samples_pass2(monkeypatch):
    """The attempt-lesson control (pass 2's ceiling): each question's first sample at the pass-1
    seed gets ToyJudge.attempt_lesson; the with and without answers use the pass-2 seed."""
    calls = []

    def sample(engine, qs, n_s, temperature, seed, items=None):
        calls.append((seed, items))
        return [f"{q}#{j}@{seed}" for q in qs for j in range(n_s)]

    def scores(judge, qs, ro, n_s):
        v = [float(len(r)) for r in ro[::n_s]]
        return {"answer": float(np.mean(v)), "score": 0.0, "per_question": {"answer": v, "score": [0.0] * len(v)}}

    class Judge:
        def attempt_lesson(self, q, ro):
            return "Lesson: one search per asked aspect, cite each claim." if q == "a" else f"missed: {ro}."

    monkeypatch.setattr(memory_eval.heldout, "sample_heldout", sample)
    monkeypatch.setattr(memory_eval.heldout, "heldout_scores", scores)
    cfg = presets.toy_preset()
    res = memory_eval.attempt_control(None, Judge(), ["a", "b"], 2, cfg, {"pass1": 5, "pass2": 6})
    assert calls[0] == (5, None)
    assert calls[1] == (6, [["Lesson: one search per asked aspect, cite each claim."], ["missed: b#0@5."]])
    assert calls[2] == (6, None) and len(calls) == 3
    assert res["named"] == 0.5 and res["lesson"].startswith("Lesson:")
    assert res["delta"]["answer"] == pytest.approx(res["with"]["answer"] - res["without"]["answer"])
    with pytest.raises(ValueError, match="ground truth"):
        memory_eval.attempt_control(None, object(), ["a"], 1, cfg, {"pass1": 5, "pass2": 6})


def test_sft_controls_cache_is_read_only_under_its_own_key(tmp_path):
    """memory_reuse's sft_cache: the SFT start's controls come back only for the key they were
    written under (another start, question set or setting computes them anew); an unreadable file
    reads as no cache."""
    path = str(tmp_path / "sft.json")
    key = memory_eval._normal({"source": "ws", "questions": ("q1", "q2"), "samples": 2})
    assert memory_eval._read_cache(path, key) is None  # no file yet
    json.dump({"key": key, "controls": {"oracle": {"x": 1}}}, open(path, "w"))
    assert memory_eval._read_cache(path, key) == {"oracle": {"x": 1}}
    assert memory_eval._read_cache(path, {**key, "samples": 4}) is None
    assert memory_eval._read_cache(None, key) is None
    open(path, "w").write("{not json")
    assert memory_eval._read_cache(path, key) is None


@given(st.lists(st.integers(), min_size=2, max_size=30, unique=True))
def test_derange_gives_every_question_another_questions_items(items):
    out = memory_eval.derange(items)
    assert sorted(out) == sorted(items) and all(a != b for a, b in zip(out, items))


class _Question:
    def __init__(self, name: str, n: int):
        self.facts = [{"entity": name, "aspect": f"a{k}"} for k in range(n)]


def _content_fakes(monkeypatch, reads: bool):
    """A fake sampler whose 'answer' states, per sample, the facts a reader would: the facts its
    lesson names (reads=True) or the question's first fact whatever the lesson says (reads=False);
    the judge's fact_hits checks the answer against each asked fact."""
    def sample(engine, qs, n_s, temperature, seed, items=None):
        out = []
        for g, q in enumerate(qs):
            keys = [f"{f['entity']} {f['aspect']}" for f in q.facts]
            lesson = items[g][0] if items else ""
            said = [k for k in keys if k in lesson] if reads else keys[:1]
            out += [(q, said)] * n_s
        return out

    def scores(judge, qs, ro, n_s):
        v = [float(len(r[1])) for r in ro[::n_s]]
        return {"answer": float(np.mean(v)), "score": 0.0, "per_question": {"answer": v, "score": [0.0] * len(v)}}

    class Judge:
        def fact_hits(self, q, ro):
            return {f"{f['entity']} {f['aspect']}": f"{f['entity']} {f['aspect']}" in ro[1] for f in q.facts}

    monkeypatch.setattr(memory_eval.heldout, "sample_heldout", sample)
    monkeypatch.setattr(memory_eval.heldout, "heldout_scores", scores)
    monkeypatch.setattr(memory_eval.heldout, "evaluate_heldout",
                        lambda engine, judge, qs, n_s, t, seed: scores(judge, qs, sample(None, qs, n_s, t, seed), n_s))
    return Judge()


@pytest.mark.parametrize("reads", [True, False])
def test_content_index_is_1_for_a_reader_of_the_named_facts_and_0_for_one_of_the_form(monkeypatch, reads):
    judge = _content_fakes(monkeypatch, reads)
    qs = [_Question(f"E{i}", 2 + i % 3) for i in range(12)] + [_Question("single", 1)]
    res = memory_eval.content_control(None, judge, qs, 2, presets.toy_preset(), seed=3)
    assert res["questions"] == 12  # the one-fact question has no split
    assert res["index"] == pytest.approx(1.0 if reads else 0.0)
    assert (res["named"], res["other"]) == ((1.0, 0.0) if reads else (res["named"], res["named"]))
    a, b = res["lessons"]  # the first question's two lessons: complementary halves, one clause
    assert ("E0 a0" in a) != ("E0 a0" in b) and ("E0 a1" in a) != ("E0 a1" in b)
    assert a.split("Lesson:")[1] == b.split("Lesson:")[1]
    # the foreign lesson names another question's facts, so a reader of the named facts states none
    # of its own (every question's own lesson A names at least one)
    if reads:
        assert res["foreign"]["with"]["answer"] == 0.0 and res["own"]["with"]["answer"] >= 1.0
    with pytest.raises(ValueError, match="two asked facts"):
        memory_eval.content_control(None, judge, [_Question("x", 1)], 1, presets.toy_preset(), 3)
    with pytest.raises(ValueError, match="ground truth"):
        memory_eval.content_control(None, object(), qs, 1, presets.toy_preset(), 3)
