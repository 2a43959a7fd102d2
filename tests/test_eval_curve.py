"""Held-out evaluation during RL (eval.every, --eval-every; not in the paper): eval_curve.jsonl rows
at the SFT start, every N steps and at the end, taken without moving the training's random streams."""
import json
import random

import numpy as np
import pytest
import torch

import train

from backends.run import cli

from backends.run import heldout

from backends.run import config as settings
from runfix import fast_args, metric_rows, sha256


def curve_rows(run_dir) -> list[dict]:
    return [json.loads(l) for l in open(run_dir / "eval_curve.jsonl")]


def test_preserved_rng_restores_python_numpy_and_torch_streams():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with heldout.preserved_rng():
        torch.manual_seed(99)
        random.random(), np.random.rand(), torch.rand(3)
    a = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    b = (random.random(), float(np.random.rand()), torch.rand(3))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_eval_every_flag_sets_config():
    assert cli.parse_args(["--toy", "--eval-every", "3"]).eval.every == 3
    assert cli.parse_args(["--toy"]).eval.every == 0
    with pytest.raises(ValueError, match="eval.every"):
        settings.validate_config(cli.parse_args(["--toy", "--eval-every", "-1"]))


@pytest.mark.slow
def test_eval_every_writes_a_curve_and_leaves_training_unchanged(tmp_path, toy_cache):
    plain, curved = tmp_path / "plain", tmp_path / "curved"
    assert train.main(fast_args(plain, toy_cache, 3, "--set", "eval.n_questions=2")) == 0
    assert train.main(fast_args(curved, toy_cache, 3, "--set", "eval.n_questions=2",
                                "--eval-every", "1")) == 0
    # Training is the same run: every metric (but wall-clock time), bank, weights.
    assert metric_rows(curved) == metric_rows(plain)
    for name in ("bank.jsonl", "samples.jsonl", "final/model.safetensors"):
        assert sha256(curved / name) == sha256(plain / name), name
    ev_plain, ev_curved = (json.load(open(d / "eval.json")) for d in (plain, curved))
    assert ev_curved["eval_rl"] == ev_plain["eval_rl"]
    assert ev_curved["eval_sft"] == ev_plain["eval_sft"]
    rows = curve_rows(curved)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["eval"] == {"n_questions": 2, "samples": 1, "temperature": 1.0}
        assert len(r["per_question"]["answer"]) == 2 and 0 <= r["answer"] <= 1
        assert {"score", "fact_recall"} <= set(r)
    # the ends are the final evaluation's SFT start and trained policy
    assert {k: rows[0][k] for k in ("answer", "per_question")} == \
        {k: ev_plain["eval_sft"][k] for k in ("answer", "per_question")}
    assert rows[-1]["per_question"] == ev_plain["eval_rl"]["per_question"]
    # without --eval-every the curve holds the two ends only
    assert [r["step"] for r in curve_rows(plain)] == [0, 3]
    # stopped after 2 steps and resumed: the same curve, each step once
    split = tmp_path / "split"
    args = fast_args(split, toy_cache, 3, "--set", "eval.n_questions=2", "--eval-every", "1")
    assert train.main(args + ["--set", "checkpoint.stop_after=2"]) == 0
    assert [r["step"] for r in curve_rows(split)] == [0, 1, 2]
    assert train.main(args + ["--resume"]) == 0
    assert curve_rows(split) == rows and metric_rows(split) == metric_rows(plain)


def test_eval_curve_resume_keeps_rows_up_to_the_checkpoint(tmp_path):
    path = str(tmp_path / "eval_curve.jsonl")
    s = {"n_questions": 2, "samples": 1, "temperature": 1.0}
    c = heldout.EvalCurve(path, s, None)
    for step in (0, 2, 4):
        c.add(step, {"answer": step / 10})
    with open(path, "a") as fh:
        fh.write('{"step": 6, "eval"')  # a line cut short by a kill
    c2 = heldout.EvalCurve(path, s, 3)
    assert [r["step"] for r in c2.rows] == [0, 2] and c2.get(2) == {"answer": 0.2}
    c3 = heldout.EvalCurve(path, {**s, "samples": 2}, 3)  # eval settings changed on resume
    assert c3.rows == [] and c3.get(0) is None
    assert heldout.EvalCurve(path, s, None).rows == []  # a fresh run starts empty
