"""scripts/answer_breakdown.py: it re-samples a finished toy run's own held-out evaluation (its
answer figures equal eval.json's), its loss shares add up to 1 - answer score, and the fact
outcomes are shares of all asked facts."""
import json

import pytest

import train
from runfix import fast_args, load_script

ab = load_script("answer_breakdown")


@pytest.mark.slow
def test_breakdown_reproduces_the_runs_own_held_out_answer_score(tmp_path, toy_cache, capsys):
    d = tmp_path / "run"
    assert train.main(fast_args(d, toy_cache, 1, "--set", "eval.n_questions=3")) == 0
    ev = json.load(open(d / "eval.json"))
    r = ab.breakdown(str(d))
    for phase, key in zip(ab.PHASES, ("eval_sft", "eval_rl")):
        assert r[phase]["answer"] == pytest.approx(ev[key]["answer"], abs=1e-9)
        assert r[phase]["answer"] == pytest.approx(1.0 - sum(r[phase]["loss"].values()))
        assert sum(r[phase]["facts"].values()) == pytest.approx(1.0)
    cold = ab.breakdown(str(d), temperature=0.3)  # another temperature: no eval.json figure to match
    assert all(cold[p]["eval_json_answer"] is None for p in ab.PHASES)
    assert ab.main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "| rubric kind | SFT start | after RL |" in out and "| outcome |" in out
    assert ab.main([str(tmp_path / "nowhere")]) == 1
