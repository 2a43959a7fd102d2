"""The reward ladder's parts: the oracle arms reward with the toy judge's static stage scores
(ToyJudge(reward="static"), settings.ARMS "oracle" / "stage_oracle"), judge.record_static records
R beside the static scores, and scripts/reward_ladder.py's correlations and gains read them."""
import json
import os
import sys

import numpy as np
import pytest

from backends.run import build, config as settings, presets
from toy import sft
from toy.judge import ToyJudge

import toyfix as tf
from toyfix import one_thread  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import reward_ladder  # noqa: E402


def _group(q):
    cfgs = [tf.PERFECT_TEACHER, tf.CLEAN_TEACHER,
            tf.mild_teacher(p_skip=1.0, p_tool_fail=0.0, p_defect=0.0),
            tf.mild_teacher(p_uncited=1.0, p_no_negative=1.0, p_tool_fail=0.0, p_defect=0.0)]
    return [tf.replay(q, tf.policy_segments(tf.teacher(q, i, c).segments))[0] for i, c in enumerate(cfgs)]


def test_static_reward_is_the_static_stage_scores_and_is_recorded(tmp_path):
    w = tf.tiny_world()
    q = next(q for q in tf.train_queries() if len(q.facts) >= 2)
    group = _group(q)
    path = str(tmp_path / "pairs.jsonl")
    evolving, static = ToyJudge(w, record_path=path), ToyJudge(w, reward="static")
    r_ev = evolving.judge_group(q, group, 0)
    r_st = static.judge_group(q, group, 0)
    S = static.evaluate(q, group)
    np.testing.assert_allclose(r_st.R, S)
    assert not np.allclose(r_ev.R, S)  # the evolving buffers score differently
    assert r_st.rubrics == r_ev.rubrics  # the buffers (what reflections read) evolve alike
    (row,) = [json.loads(x) for x in open(path)]
    np.testing.assert_allclose(np.array(row["R"], float), r_ev.R)
    np.testing.assert_allclose(np.array(row["static"], float), S)
    assert row["step"] == 0 and row["query"] == q.query
    with pytest.raises(ValueError, match="reward"):
        ToyJudge(w, reward="oracle")


def test_ladder_arms_pick_the_static_judge():
    assert settings.ARMS["oracle"].advantage == "terminal_answer"
    assert settings.ARMS["stage_oracle"].advantage == "ss_grpo"
    assert all(a.reward == "judge" for k, a in settings.ARMS.items() if k not in ("oracle", "stage_oracle"))
    cfg = presets.toy_preset()
    cfg.arm = "stage_oracle"
    assert build.build_judge(cfg, tf.tiny_world()).reward == "static"
    cfg.arm, cfg.judge.record_static = "rubricem", True
    j = build.build_judge(cfg, tf.tiny_world())
    assert j.reward == "judge" and j.record_path.endswith("judge_static.jsonl")
    cfg.arm, cfg.judge.backend = "oracle", "gemini"
    with pytest.raises(ValueError, match="static"):
        build.build_judge(cfg, None)


def test_stage_correlations_and_paired_gains(tmp_path):
    rng = np.random.default_rng(0)
    S = rng.random((40, 4))
    R = S.copy()
    R[:, 1] = 1 - S[:, 1]  # research: perfectly anti-correlated
    R[:, 2] = 0.5  # review: constant, no correlation defined
    R[0, 3] = None
    with open(tmp_path / "judge_static.jsonl", "w") as fh:
        for i in range(0, 40, 8):
            fh.write(json.dumps({"step": i // 8, "R": [[None if v != v else v for v in r] for r in R[i:i + 8]],
                                 "static": S[i:i + 8].tolist()}) + "\n")
    c = reward_ladder.stage_correlations(str(tmp_path))
    assert c["plan"] == pytest.approx(1.0) and c["research"] == pytest.approx(-1.0)
    assert c["review"] is None and c["answer"] == pytest.approx(1.0) and c["rollouts"] == 40
    mean, lo, hi = reward_ladder.paired_ci([0.1, 0.2, 0.3, 0.4], [0.3, 0.4, 0.5, 0.6])
    assert mean == pytest.approx(0.2) and lo == pytest.approx(0.2) and hi == pytest.approx(0.2)
