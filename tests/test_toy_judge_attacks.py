"""Adversarial tests of the toy judge (toy/judge.py, §3.4) for three attacks a sampled policy found:
keyword-stuffed reflections that prefix the asked facts to a list of lessons, a tool call written
inside <answer> followed by a second <answer> block, and reflections that repeat a fact. Each test
builds the attack by hand on the tiny world and checks that it earns less than honest work, with
the judge's fixes switched on (judge.toy_fixes; off by default until the published runs are
regenerated)."""
import itertools
import re

import numpy as np
import pytest

from toy import sft
from toy.judge import ToyJudge, answer_defect
from toy.world import ANSWER_TEMPLATES
from scaffold import ANSWER, RESEARCH

import toyfix as tf
from toyfix import one_thread  # noqa: F401  (module fixture: one torch thread)

# Every general lesson the judge knows, one phrase each (what a keyword list is made of).
LESSON_PHRASES = ("search every asked aspect with the full name", "cite a snippet for every claim",
                  "ignore old records and look-alike names", "list what to avoid in the plan",
                  "commit to one value", "say not found only after a search",
                  "write a complete plan", "do not repeat a search", "close the answer")


@pytest.fixture(scope="module")
def world():
    return tf.tiny_world()


def _query(n_facts: int = 2):
    """A question on n_facts facts that all have a document, where the search for one fact does not
    bring back another's document (so a fact is found only by searching for it: the attacks below
    leave facts unsearched)."""
    tool = tf.tiny_tool()

    def apart(q):
        docs = {f["doc_id"] for f in q.facts}
        return all({r.doc_id for r in tool(sft.fact_key(f))} & docs == {f["doc_id"]} for f in q.facts)

    return next(q for q in tf.train_queries()
                if len(q.facts) == n_facts and all(f["doc_id"] for f in q.facts) and apart(q))


def _replay(q, segments):
    return tf.replay(q, tf.policy_segments(segments))[0]


def _perfect(q):
    return tf.teacher(q, 0, tf.PERFECT_TEACHER)


def _uncited_all(q):
    """The perfect trajectory with every answer sentence left uncited (only the Answer fails)."""
    segs = tf.policy_segments(_perfect(q).segments)
    last = re.sub(r" \[\d+\]\.", ".", segs[-1].split("<answer>")[1])
    return tf.replay(q, segs[:-1] + [segs[-1].split("<answer>")[0] + "<answer>" + last])[0]


def _stuffed(keys, need_phrase):
    """Reflections that name every asked fact and add a keyword list of lessons: every label, and
    every list of 2-3 lessons (with and without the needed one)."""
    out = []
    for label in ("missed: ", "", "Facts: ", "failed: "):
        facts = label + ", ".join(keys) + "."
        for n in (1, 2, 3):
            for combo in itertools.combinations(LESSON_PHRASES, n):
                if combo == (need_phrase,):
                    continue  # the needed lesson alone is not a keyword list
                out.append(f"{facts} Lessons: {'; '.join(combo)}.")
        out.append(f"{facts} Lesson: search and cite.")
    return out


def test_honest_specific_lesson_outscores_every_stuffed_reflection_sec3_4(world):
    # Only the Answer failed (every claim uncited). A stuffed reflection used to score 0.938 on
    # such a trajectory by listing the facts as "missed" in front of a short keyword list, above
    # the honest lesson's 0.750.
    q = _query(2)
    ro = _uncited_all(q)
    judge = ToyJudge(world, fixes=ToyJudge.FIXES)
    judged = judge.judge_group(q, [ro, _replay(q, _perfect(q).segments)], 0)
    assert judged.R[0, ANSWER] < 1 and np.all(judged.R[0, :ANSWER] == 1)
    keys = [sft.fact_key(f) for f in q.facts]
    honest = f"The answer left {' and '.join(keys)} uncited: cite a snippet for every claim."
    stuffed = _stuffed(keys, "cite a snippet for every claim")
    s = judge.score_reflections(q, ro, judged, 0, [honest] + stuffed)
    assert s[0].valid
    best = max(range(1, len(s)), key=lambda i: s[i].score)
    assert s[0].score > s[best].score, (s[0].score, s[best].score, stuffed[best - 1])
    # Calling an uncited fact "missed" is a false diagnosis: it loses to the generic honest lesson.
    generic = judge.score_reflections(q, ro, judged, 0, ["Lesson: cite a snippet for every claim."])
    false_missed = [i for i, t in enumerate(stuffed, 1) if t.startswith("missed: ")]
    assert all(s[i].score < generic[0].score for i in false_missed)


def test_honest_lesson_outscores_stuffing_when_one_fact_was_skipped_sec3_4(world):
    q = _query(2)
    lazy = tf.mild_teacher(p_skip=1.0, p_vague=0.0, p_uncited=0.0, p_distractor=0.0,
                             p_no_negative=0.0, p_tool_fail=0.0, p_defect=0.0)
    tr = tf.teacher(q, 0, lazy)  # skips every fact but the first
    ro = _replay(q, tr.segments)
    judge = ToyJudge(world, fixes=ToyJudge.FIXES)
    judged = judge.judge_group(q, [ro, _replay(q, _perfect(q).segments)], 0)
    honest = sft.teacher_reflection(q, tr)  # "missed: <the skipped fact>. Lesson: search ..."
    keys = [sft.fact_key(f) for f in q.facts]
    stuffed = _stuffed(keys, "search every asked aspect with the full name")
    s = judge.score_reflections(q, ro, judged, 0, [honest] + stuffed)
    assert s[0].valid and s[0].score > max(c.score for c in s[1:])


def _answer_call_rollout(q, *, inside: bool):
    """Plan and a search for the first fact, review; then either (inside=True) <answer> with a call
    for the second fact inside it and a second <answer> block citing both, or (inside=False) the
    same research and an answer stating the first fact only."""
    f1, f2 = q.facts
    k1, k2 = sft.fact_key(f1), sft.fact_key(f2)
    plan = _perfect(q).segments[0][1].split("<call_tool")[0]
    call = '<call_tool name="google_search">{}</call_tool>'
    first = tf.replay(q, [plan + call.format(k1), "<answer></answer><|im_end|>"])[0]
    h1 = next(h for h, r in first.evidence.items() if r.doc_id == f1["doc_id"])
    s1 = ANSWER_TEMPLATES[f1["aspect"]].format(name=f1["entity"], value=f1["value"]) + f" [{h1}]."
    review = (f"<state_evaluation>{k1}: {f1['value']} [{h1}]</state_evaluation>\n<review><rubrics_review>"
              f"{k1}: [{h1}]; {k2}: missing</rubrics_review><writing_plan>{k1}</writing_plan></review>\n")
    if not inside:
        return tf.replay(q, [plan + call.format(k1), review + f"<answer>{s1}</answer><|im_end|>"])[0]
    probe = tf.replay(q, [plan + call.format(k1), review + "<answer>" + call.format(k2),
                          "<answer></answer><|im_end|>"])[0]
    h2 = next(h for h, r in probe.evidence.items() if r.doc_id == f2["doc_id"])
    s2 = ANSWER_TEMPLATES[f2["aspect"]].format(name=f2["entity"], value=f2["value"]) + f" [{h2}]."
    return tf.replay(q, [plan + call.format(k1), review + "<answer>" + call.format(k2),
                         f"<answer>{s1} {s2}</answer><|im_end|>"])[0]


def test_tool_call_inside_the_answer_and_a_second_answer_are_malformed_sec3_4(world):
    q = _query(2)
    bad = _answer_call_rollout(q, inside=True)
    honest = _answer_call_rollout(q, inside=False)
    assert len(bad.tool_calls) == 2 and bad.text.count("<answer>") == 2
    assert answer_defect(bad) and not answer_defect(honest)
    assert not bad.parsed.well_formed_strict and honest.parsed.well_formed_strict
    assert bad.parsed.answer_defect == "tool call inside the answer" and not honest.parsed.answer_defect
    judge = ToyJudge(world, fixes=ToyJudge.FIXES)
    sb, sh = judge.evaluate(q, [bad, honest])
    # The call inside the answer is no research: Research scores exactly as without it, and the
    # evidence it returned supports no claim, so the Answer gains nothing over stating one fact.
    assert sb[RESEARCH] == pytest.approx(sh[RESEARCH])
    assert sb[ANSWER] < sh[ANSWER]
    assert judge.fact_recall(q, bad) <= 1.0
    res = judge.judge_group(q, [bad, honest], 0)
    assert res.R[0, RESEARCH] <= res.R[1, RESEARCH] and res.R[0, ANSWER] < res.R[1, ANSWER]


def test_a_well_formed_rollout_has_no_answer_defect_sec3_4(world):
    q = _query(2)
    ro = _replay(q, _perfect(q).segments)
    assert ro.parsed.well_formed_strict and answer_defect(ro) == ""
    assert ToyJudge(world, fixes=ToyJudge.FIXES).evaluate(q, [ro])[0][ANSWER] == pytest.approx(1.0)


def test_fixes_are_off_by_default_and_unknown_ones_raise(world):
    # Off (the default: the published runs' scores), the attack keeps its old scores.
    q = _query(2)
    bad = _answer_call_rollout(q, inside=True)
    old, new = ToyJudge(world), ToyJudge(world, fixes=ToyJudge.FIXES)
    assert old.fixes == frozenset() and bad.parsed.well_formed
    assert old.evaluate(q, [bad])[0][RESEARCH] > new.evaluate(q, [bad])[0][RESEARCH]
    with pytest.raises(ValueError, match="judge.toy_fixes"):
        ToyJudge(world, fixes=["nope"])


def test_repetition_scores_below_an_honest_lesson_sec3_4(world):
    q = _query(2)
    lazy = tf.mild_teacher(p_skip=1.0, p_vague=0.0, p_uncited=0.0, p_distractor=0.0,
                             p_no_negative=0.0, p_tool_fail=0.0, p_defect=0.0)
    tr = tf.teacher(q, 0, lazy)
    ro = _replay(q, tr.segments)
    judge = ToyJudge(world, fixes=ToyJudge.FIXES)
    judged = judge.judge_group(q, [ro, _replay(q, _perfect(q).segments)], 0)
    (k,) = [key for key, v in tr.defects.items() if v == "skipped"]
    honest = f"missed: {k}. Lesson: search every asked aspect with the full name."
    repeats = [f"missed: {k}, {k}, {k}, {k}. Lesson: search {k}.",  # the bank admitted this
               f"missed: {k}, {k}. Lesson: search every asked aspect with the full name.",
               f"missed: {k}. Lesson: search {k}; search every asked aspect with the full name.",
               f"missed: {k}; {k}; {k}. Lesson: search every asked aspect with the full name."]
    s = judge.score_reflections(q, ro, judged, 0, [honest] + repeats)
    assert s[0].valid and s[0].score == pytest.approx(1.0)
    for c, text in zip(s[1:], repeats):
        assert c.score < s[0].score, text
    assert not s[1].valid and not s[4].valid  # a fact 3+ times in a row is degenerate repetition


def test_a_lesson_must_name_a_failure_by_its_kind_sec3_4(world):
    """A fact the attempt left unsearched belongs under "missed:"; naming it under "wrong:" (as if
    a distractor's value had been copied) is a false diagnosis and scores below the honest lesson;
    and a fact whose note copied an old record belongs under "wrong:", not "missed:"."""
    q = _query(2)
    judge = ToyJudge(world, fixes=ToyJudge.FIXES)
    lazy = tf.mild_teacher(p_skip=1.0, p_vague=0.0, p_uncited=0.0, p_distractor=0.0,
                           p_no_negative=0.0, p_tool_fail=0.0, p_defect=0.0)
    tr = tf.teacher(q, 0, lazy)
    ro = _replay(q, tr.segments)
    judged = judge.judge_group(q, [ro, _replay(q, _perfect(q).segments)], 0)
    (k,) = [key for key, v in tr.defects.items() if v == "skipped"]
    s = judge.score_reflections(q, ro, judged, 0, [f"missed: {k}. Lesson: plan every asked aspect.",
                                                   f"wrong: {k} tea. Lesson: plan every asked aspect."])
    assert s[0].valid and s[1].valid and s[1].score < s[0].score
    # A careless note: the old record came back first and its value was taken.
    w, tool = tf.tiny_world(), tf.tiny_tool()
    careless = tf.mild_teacher(p_skip=0.0, p_vague=0.0, p_uncited=0.0, p_distractor=1.0,
                               p_no_negative=1.0, p_tool_fail=0.0, p_defect=0.0)
    for i, q2 in enumerate(tf.train_queries()):
        tr2 = tf.teacher(q2, i, careless)
        copied = [key for key, v in tr2.defects.items() if v.startswith("copied")]
        if copied:
            break
    ro2 = _replay(q2, tr2.segments)
    judged2 = judge.judge_group(q2, [ro2, _replay(q2, _perfect(q2).segments)], 0)
    k2 = copied[0]
    s2 = judge.score_reflections(q2, ro2, judged2, 0,
                                 [f"wrong: {k2} {tr2.copied[k2]}. Lesson: ignore old records.",
                                  f"missed: {k2}. Lesson: ignore old records."])
    assert s2[0].valid and s2[1].valid and s2[1].score < s2[0].score
