"""The toy teacher's stage-local flaws (toy/sft.TeacherConfig.p_plan_unsearched, p_eval_bare,
p_writing_gap, p_unknown_omitted): off by default without changing the default teacher's data or
warm-start cache key, and each one, switched on, lowers its own stage's static score and no other."""
import dataclasses
import os
import random
import sys

import numpy as np
import pytest

from toy import sft
from toy.judge import ToyJudge
from scaffold import STAGES

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
    # The toy's teacher makes each stage-local flaw its most likely behaviour (above 0.5), and
    # so the citation and the plan's negative constraint; skipping stays a minority behaviour.
    t = sft.TeacherConfig()
    assert all(getattr(t, f) > 0.5 for f in FLAW_STAGE)
    assert t.p_uncited > 0.5 and t.p_no_negative > 0.5 and t.p_skip < 0.5
    d = tf.mild_teacher()
    assert all(getattr(d, f) == 0.0 for f in FLAW_STAGE)
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
        for cfg in (d, dataclasses.replace(d, p_writing_gap=1e-12)):
            made.clear()
            for i, q in enumerate(tf.train_queries()[:10]):
                sft.teacher_trajectory(q, tf.tiny_tool(), w, real(i), cfg)
            counts.append(len(made))
    finally:
        sft.random.Random = real
    assert counts == [0, 10]


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
