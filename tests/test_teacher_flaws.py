"""The toy teacher's flaws (toy/sft.TeacherConfig).

The causal chain (p_plan_omit, p_distractor with p_distractor_avoid, p_writing_omit): on by
default and the teacher's most likely behaviour, each lowers its own stage's static score *and* the
Answer's (the answer states what the plan, the research notes and the writing plan let through), and
a memory item from a first attempt undoes it for the facts it names. The stage-local flaws of the
previous toy (p_plan_unsearched, p_eval_bare, p_writing_gap, p_unknown_omitted): off by default
but p_unknown_omitted, each lowers its own stage's static score and no other. A flaw switched off
draws nothing, so a configuration without it makes the data it made before."""
import dataclasses
import os
import random
import sys

import numpy as np
import pytest

from toy import sft
from toy.judge import ToyJudge
from scaffold import STAGES, load_rows

import toyfix as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from teacher_flaws import teacher_rollout  # noqa: E402

FLAW_STAGE = {"p_plan_unsearched": "plan", "p_eval_bare": "research", "p_writing_gap": "review",
              "p_unknown_omitted": "answer"}
BASE = tf.mild_teacher(p_tool_fail=0.0, p_defect=0.0)


def _scores(cfg, queries, judge):
    out = []
    for i, q in enumerate(queries):
        tr = sft.teacher_trajectory(q, tf.tiny_tool(), tf.tiny_world(), random.Random(i), cfg)
        out.append(judge.evaluate(q, [teacher_rollout(q, tr.segments, tf.tiny_tool())])[0])
    return np.array(out)


def test_flaws_are_systematic_by_default_and_off_leave_the_cache_key_sec_appendix_sft():
    # The toy's teacher makes each causal flaw its most likely behaviour (above 0.5), and the plan's
    # missing negative constraint; skipping, citation and an omitted "no source" stay minorities.
    t = sft.TeacherConfig()
    assert t.p_plan_omit > 0.5 and t.p_writing_omit > 0.5 and t.p_distractor > 0.5
    assert t.p_distractor_avoid < 0.5 < t.p_no_negative
    assert t.p_uncited < 0.5 and t.p_skip < 0.5 and t.p_unknown_omitted < 0.5
    assert t.p_plan_unsearched == t.p_eval_bare == t.p_writing_gap == 0.0
    d = tf.mild_teacher()
    assert all(getattr(d, f) == 0.0 for f in FLAW_STAGE) and d.p_plan_omit == d.p_writing_omit == 0.0
    assert set(FLAW_STAGE) == set(sft._LOCAL_FLAWS)
    w = tf.tiny_world()
    k0 = sft.warm_start_key(w.config, "s", sft.SFTConfig(), d, "S", 1024)
    k1 = sft.warm_start_key(w.config, "s", sft.SFTConfig(),
                            dataclasses.replace(d, p_writing_gap=0.5), "S", 1024)
    assert k0 != k1  # a flaw switched on is a different warm start
    # Off, the teacher seeds no stream for the flaws (seeding one takes a draw from its own stream,
    # which would change every later decision); on, one per trajectory.
    made = []

    class Spy(random.Random):
        def __init__(self, *a):
            made.append(a)
            super().__init__(*a)

    counts = []
    real = sft.random.Random
    try:
        sft.random.Random = Spy
        for cfg in (d, dataclasses.replace(d, p_writing_gap=1e-12),
                    dataclasses.replace(d, p_plan_omit=1e-12)):
            made.clear()
            for i, q in enumerate(tf.train_queries()[:10]):
                sft.teacher_trajectory(q, tf.tiny_tool(), w, real(i), cfg)
            counts.append(len(made))
    finally:
        sft.random.Random = real
    assert counts == [0, 10, 10]


# The causal flaws: (settings that switch it on, its stage). p = 1e-12 seeds the chain's stream
# without firing, so "off" and "on" draw the same numbers and differ only in what the flaw does.
CHAIN = {"plan": ({"p_plan_omit": 1.0}, {"p_plan_omit": 1e-12}),
         "review": ({"p_writing_omit": 1.0}, {"p_writing_omit": 1e-12}),
         "research": ({"p_distractor": 1.0, "p_no_negative": 1.0},
                      {"p_distractor": 0.0, "p_no_negative": 1.0})}
CHAIN_BASE = tf.mild_teacher(p_tool_fail=0.0, p_defect=0.0, p_skip=0.0, p_vague=0.0,
                             p_distractor=0.0, p_distractor_avoid=0.0)


@pytest.mark.parametrize("stage", sorted(CHAIN))
def test_each_causal_flaw_lowers_its_stage_and_the_answer_sec3_2(stage):
    on_kw, off_kw = CHAIN[stage]
    queries = list(tf.train_queries()[:80])
    judge = ToyJudge(tf.tiny_world())
    on = _scores(dataclasses.replace(CHAIN_BASE, **on_kw), queries, judge)
    off = _scores(dataclasses.replace(CHAIN_BASE, **off_kw), queries, judge)
    k, ans = STAGES.index(stage), STAGES.index("answer")
    assert on[:, k].mean() < off[:, k].mean() - 0.02, stage
    assert on[:, ans].mean() < off[:, ans].mean() - 0.02, stage  # seen in the answer too
    assert (on[:, ans] < off[:, ans] - 1e-9).sum() >= 3


def test_a_lesson_from_a_first_attempt_undoes_the_flaws_it_names_sec3_5():
    """Within-episode memory: a fact named as missed is planned, searched and written; a fact named
    with a wrong value gets a careful note (the true document's value, not the old record's)."""
    w, tool = tf.tiny_world(), tf.tiny_tool()
    cfg = dataclasses.replace(CHAIN_BASE, p_plan_omit=1.0, p_writing_omit=1.0, p_distractor=1.0,
                              p_no_negative=1.0, p_uncited=0.0)
    judge = ToyJudge(w)
    before, after = [], []
    for i, q in enumerate(tf.train_queries()[:80]):
        first = sft.teacher_trajectory(q, tool, w, random.Random(i), cfg)
        lesson = sft.teacher_reflection(q, first)
        again = sft.teacher_trajectory(q, tool, w, random.Random(i), cfg, [lesson])
        missed = {k for k, v in again.defects.items() if v in sft.MISSED_DEFECTS}
        copied = {k for k, v in again.defects.items() if v.startswith("copied")}
        assert not sft.memory_missed([lesson]) & missed and not sft.memory_wrong([lesson]) & copied
        before.append(judge.evaluate(q, [teacher_rollout(q, first.segments, tool)])[0, 3])
        after.append(judge.evaluate(q, [teacher_rollout(q, again.segments, tool)])[0, 3])
    # A fact the lesson brings into the plan can meet a new trap (its old record), which this
    # lesson did not name: the answer gains on the whole, not on every question.
    assert np.mean(after) > np.mean(before) + 0.1
    assert sum(a > b + 1e-9 for a, b in zip(after, before)) >= 20


def test_an_unmarked_old_record_is_taken_when_first_unless_a_lesson_names_its_value_sec3_5():
    """WorldConfig.p_unmarked: an old record that reads like the true document is taken whenever it
    comes back first, whatever the plan's negative constraint; a lesson that names its value as
    wrong (the teacher's reflection on that first attempt) makes the second attempt read on."""
    from toy.world import BM25SearchTool, WorldConfig, make_world

    w = make_world(WorldConfig(**{**dataclasses.asdict(tf.tiny_world().config), "p_unmarked": 1.0}))
    tool = BM25SearchTool(w.docs)
    cfg = dataclasses.replace(CHAIN_BASE, p_no_negative=0.0, p_distractor=0.0, p_distractor_avoid=0.0)
    taken = fixed = 0
    for i, q in enumerate(load_rows(w.train_rows)[:150]):
        first = sft.teacher_trajectory(q, tool, w, random.Random(i), cfg)
        for f in q.facts:
            k = sft.fact_key(f)
            res = [w.doc(x.doc_id) for x in tool(k)]
            on = [d for d in res if d.aspect == f["aspect"] and d.entity == f["entity"]]
            if not on or on[0].kind != "outdated" or k not in [sft.fact_key(g) for g in q.facts]:
                continue
            assert not on[0].marked and first.copied.get(k) == on[0].value  # "avoid:" does not help
            taken += 1
            lesson = sft.teacher_reflection(q, first)
            assert k in sft.memory_wrong([lesson]) and f"{k} {on[0].value}" in lesson
            again = sft.teacher_trajectory(q, tool, w, random.Random(i), cfg, [lesson])
            assert k not in again.copied
            fixed += 1
    assert taken >= 10 and fixed == taken


def test_the_oracle_lesson_names_every_fact_and_every_old_value_sec3_5():
    w = tf.tiny_world()
    for q in tf.train_queries()[:40]:
        lesson = sft.oracle_lesson(q, w)
        assert sft.memory_missed([lesson]) == {sft.fact_key(f) for f in q.facts}
        old = {sft.fact_key(f) for f in q.facts
               if any(d.kind == "outdated" for d in w.docs_of(f["entity"], f["aspect"]))}
        assert sft.memory_wrong([lesson]) == old


@pytest.mark.parametrize("flaw", sorted(FLAW_STAGE))
def test_each_flaw_lowers_only_its_own_stage_sec_appendix_sft(flaw):
    # p = 1e-12 switches the flaw's random stream on without ever firing, so both configurations
    # draw the same numbers and differ only in what the flaw does.
    queries = list(tf.train_queries()[:60])
    judge = ToyJudge(tf.tiny_world())
    off = _scores(dataclasses.replace(BASE, **{flaw: 1e-12}), queries, judge)
    on = _scores(dataclasses.replace(BASE, **{flaw: 1.0}), queries, judge)
    k = STAGES.index(FLAW_STAGE[flaw])
    others = [j for j in range(len(STAGES)) if j != k]
    np.testing.assert_allclose(on[:, others], off[:, others])
    assert np.all(on[:, k] <= off[:, k] + 1e-12)
    assert (on[:, k] < off[:, k] - 1e-9).sum() >= 3, flaw


def test_random_lessons_name_only_their_query_and_the_teacher_follows_the_names_sec3_4():
    """teacher.memory_lessons = "random" (toy/teacher.random_lesson): a lesson names a random non-empty
    subset of its query's asked facts (and maybe their old-record values) with a general clause
    drawn apart; the teacher with the default flaws then plans every named fact, while an unnamed
    later fact is left out of the plan at about p_plan_omit, as without a lesson."""
    from toy.teacher import GENERAL_LESSONS, fact_key, memory_missed, memory_wrong, random_lesson

    world, tool = tf.tiny_world(), tf.tiny_tool()
    rows = [q for q in load_rows(world.train_rows) if len(q.facts) >= 2]
    cfg = sft.TeacherConfig(p_tool_fail=0.0, p_defect=0.0)
    rng = random.Random(0)
    named_planned, unnamed_planned, subsets = [], [], set()
    for i in range(300):
        q = rows[i % len(rows)]
        keys = [fact_key(f) for f in q.facts]
        lesson = random_lesson(q, world, rng)
        missed = memory_missed([lesson])
        assert missed and missed <= set(keys)  # names only its own query's facts, at least one
        assert memory_wrong([lesson]) <= set(keys)
        assert any(g in lesson for g in GENERAL_LESSONS)
        subsets.add((q.query, tuple(sorted(missed))))
        tr = sft.teacher_trajectory(q, tool, world, random.Random(i), cfg, [lesson])
        plan = tr.segments[0][1]
        for k in keys[1:]:  # the first asked fact is never left out of a plan
            (named_planned if k in missed else unnamed_planned).append(f"need: {k}" in plan)
    assert all(named_planned) and len(named_planned) > 50
    assert abs(1 - np.mean(unnamed_planned) - cfg.p_plan_omit) < 0.12, np.mean(unnamed_planned)
    assert len(subsets) > 100  # the names vary, question by question and draw by draw


def test_random_lesson_data_give_own_and_foreign_lessons_of_one_form_sec3_4():
    """build_sft_data with memory_lessons "random": an own-query lesson names only that query's facts,
    another query's lesson none of them; an unknown memory_lessons is refused."""
    world = tf.tiny_world()
    scfg = sft.SFTConfig(n_trajectories=120, n_reflections=0)
    tcfg = sft.TeacherConfig(memory_lessons="random", p_memory=1.0, p_memory_exact=0.5)
    from toy.teacher import memory_missed
    examples, _ = sft.build_sft_data(world, tf.tiny_tool(), "sys", scfg, tcfg)
    rows = {q.query: q for q in load_rows(world.train_rows)}
    own = foreign = 0
    for msgs, _ in examples:
        user = msgs[-1]["content"]
        named = memory_missed([user])
        if not named:
            continue
        q = next(q for text, q in rows.items() if text in user)
        keys = {f"{f['entity']} {f['aspect']}" for f in q.facts}
        if named <= keys:
            own += 1
        else:
            assert not named & keys
            foreign += 1
    assert own > 20 and foreign > 20
    with pytest.raises(ValueError, match="memory_lessons"):
        sft.build_sft_data(world, tf.tiny_tool(), "sys", scfg,
                           dataclasses.replace(tcfg, memory_lessons="other"))


def test_memory_first_plans_the_named_facts_first_in_the_lessons_order_sec3_4():
    """teacher.memory_first (ours): the plan's rubrics list the facts a lesson names as missed first,
    in the lesson's order and words, then the other planned facts in the question's order; the
    research plan, the review and the answer follow that order. Another query's lesson (names none
    of this query's facts) leaves the question's order; memory_first off leaves the trajectory, the
    draws included, as it was; the default keeps the warm start's cache key."""
    import re as _re

    from toy.teacher import fact_key, memory_missed_order, random_lesson

    world, tool = tf.tiny_world(), tf.tiny_tool()
    rows = [q for q in load_rows(world.train_rows) if len(q.facts) >= 3]
    base = sft.TeacherConfig(p_tool_fail=0.0, p_defect=0.0, memory_lessons="random")
    first = dataclasses.replace(base, memory_first=True)
    rng = random.Random(1)
    reordered = 0
    for i in range(120):
        q, other = rows[i % len(rows)], rows[(i + 1) % len(rows)]
        keys = [fact_key(f) for f in q.facts]
        lesson = random_lesson(q, world, rng)
        named = memory_missed_order([lesson])
        assert named and set(named) <= set(keys)
        tr = sft.teacher_trajectory(q, tool, world, random.Random(i), first, [lesson])
        text = "".join(s for _, s in tr.segments)
        need = _re.findall(r"need: ([^;<]+)", text)
        assert need[:len(named)] == named  # the lesson's names, copied in its order
        rest = need[len(named):]
        assert rest == [k for k in keys if k in rest]  # then the question's order
        searched = _re.findall(r"search ([^;<]+)", text)
        assert searched == [k for k in need if k in searched]  # the research plan follows the plan
        reordered += need != [k for k in keys if k in need]
        # another query's lesson: nothing of this query named, the question's order
        foreign = random_lesson(other, world, rng)
        if not set(memory_missed_order([foreign])) & set(keys):
            tr_f = sft.teacher_trajectory(q, tool, world, random.Random(i), first, [foreign])
            need_f = _re.findall(r"need: ([^;<]+)", "".join(s for _, s in tr_f.segments))
            assert need_f == [k for k in keys if k in need_f]
        # memory_first off: the trajectory of the question's order
        off = sft.teacher_trajectory(q, tool, world, random.Random(i), base, [lesson])
        need_off = _re.findall(r"need: ([^;<]+)", "".join(s for _, s in off.segments))
        assert need_off == [k for k in keys if k in need_off] and set(need_off) == set(need)
    assert reordered > 20
    assert memory_missed_order(["missed: A year, B use. Lesson: x.", "missed: B use, C size."]) \
        == ["A year", "B use", "C size"]
    args = (world.config, "sys", sft.SFTConfig(), sft.TeacherConfig(), "S", 400)
    assert sft.warm_start_key(*args) == sft.warm_start_key(
        *args[:3], dataclasses.replace(sft.TeacherConfig(), memory_first=False), *args[4:])
    assert sft.warm_start_key(*args) != sft.warm_start_key(
        *args[:3], dataclasses.replace(sft.TeacherConfig(), memory_first=True), *args[4:])


def test_memory_append_keeps_the_bare_plan_and_adds_the_named_facts_sec3_4():
    """teacher.memory_append (ours): with a lesson, the plan's rubrics are the plan the same draws give
    without any lesson, then "need: X" for every fact the lesson names, in its order; the research
    plan takes the plan's facts once, in that order, and every named fact is researched. Another
    query's lesson leaves the bare plan; the default keeps the warm start's cache key."""
    import re as _re

    from toy.teacher import fact_key, memory_missed_order, random_lesson

    world, tool = tf.tiny_world(), tf.tiny_tool()
    rows = [q for q in load_rows(world.train_rows) if len(q.facts) >= 3]
    base = sft.TeacherConfig(p_tool_fail=0.0, p_defect=0.0, memory_lessons="random")
    app = dataclasses.replace(base, memory_append=True)
    rng = random.Random(2)
    added = 0
    for i in range(120):
        q, other = rows[i % len(rows)], rows[(i + 1) % len(rows)]
        keys = [fact_key(f) for f in q.facts]
        lesson = random_lesson(q, world, rng)
        named = memory_missed_order([lesson])

        def needs(cfg, memory):
            tr = sft.teacher_trajectory(q, tool, world, random.Random(i), cfg, memory)
            text = "".join(s for _, s in tr.segments)
            return _re.findall(r"need: ([^;<]+)", text), _re.findall(r"search ([^;<]+)", text), tr

        bare, _, _ = needs(app, [])
        need, searched, tr = needs(app, [lesson])
        assert need == bare + named  # the bare plan, then the lesson's names copied in its order
        once = list(dict.fromkeys(need))
        assert searched == [k for k in once if k in searched] and len(set(searched)) == len(searched)
        assert not any(tr.defects.get(k) == "not planned" for k in named)
        added += bool(set(named) - set(bare))
        foreign = random_lesson(other, world, rng)
        if not set(memory_missed_order([foreign])) & set(keys):
            assert needs(app, [foreign])[0] == bare
        assert bare == [k for k in keys if k in bare]  # the question's order, as without the option
    assert added > 20
    args = (world.config, "sys", sft.SFTConfig(), sft.TeacherConfig(), "S", 400)
    assert sft.warm_start_key(*args) == sft.warm_start_key(
        *args[:3], dataclasses.replace(sft.TeacherConfig(), memory_append=False), *args[4:])
    assert sft.warm_start_key(*args) != sft.warm_start_key(
        *args[:3], dataclasses.replace(sft.TeacherConfig(), memory_append=True), *args[4:])
