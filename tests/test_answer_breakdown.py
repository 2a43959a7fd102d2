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


@pytest.mark.slow
def test_sweep_equals_the_runs_eval_json_at_its_own_temperature(tmp_path, toy_cache, capsys):
    d = tmp_path / "run"
    assert train.main(fast_args(d, toy_cache, 1, "--set", "eval.n_questions=3")) == 0
    ev = json.load(open(d / "eval.json"))
    T = json.load(open(d / "config.json"))["eval"]["temperature"]
    r = ab.sweep(str(d), [T, 0.0])
    for phase, key in zip(ab.PHASES, ("eval_sft", "eval_rl")):
        for k in ab.SWEEP_KEYS:
            assert r[T][phase][k] == pytest.approx(ev[key][k], abs=1e-9), (phase, k)
    # greedy decoding is deterministic: the same figures on a second sweep
    assert ab.sweep(str(d), [0.0])[0.0] == r[0.0]
    assert ab.main([str(d), "--sweep", str(T), "0"]) == 0
    out = capsys.readouterr().out
    assert "| T | answer SFT | answer RL |" in out and "| 0 |" in out
    assert ab.main([str(d), "--sweep", "-1"]) == 1
