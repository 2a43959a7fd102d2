"""A judge whose every group result has the wrong shape trains on nothing: it counts as a judge
failure toward the abort rule (judge.max_failure_rate for judge.max_failure_steps steps), so the run
stops with exit code 3 and a checkpoint instead of running on with judge/failure_rate 0."""
import build
import train
from judge import JudgeResult
from runfix import fast_args, metric_rows
from toy.judge import ToyJudge


def test_always_wrong_shaped_judge_aborts_sec3_4(tmp_path, toy_cache, monkeypatch):
    class AlwaysWrongShape(ToyJudge):
        def judge_group(self, query, rollouts, step):
            res = super().judge_group(query, rollouts, step)
            return JudgeResult(res.R[:1], res.justifications, res.rubrics, res.stats)  # one row for n

    monkeypatch.setattr(build, "build_judge", lambda cfg, world: AlwaysWrongShape(world, cfg.judge.caps))
    d = tmp_path / "run"
    assert train.main(fast_args(d, toy_cache, 5, "--set", "checkpoint.every=0")) == 3
    rows = metric_rows(d)
    assert len(rows) == 3  # judge.max_failure_steps = 3 bad steps, then the stop
    assert all(r["judge/bad_shape"] >= 1 and r["judge/failure_rate"] == 1.0 for r in rows)
    assert (d / "checkpoints" / "step-000003").is_dir()  # the run can continue once fixed
