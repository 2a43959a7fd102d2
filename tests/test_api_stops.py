"""How a training run stops on judge and API trouble (train.py's loop and main):
- a judge whose every group result has the wrong shape trains on nothing: it counts as a judge
  failure toward the abort rule (judge.max_failure_rate for judge.max_failure_steps steps), so the run
  stops with exit code 3 and a checkpoint instead of running on with judge/failure_rate 0;
- judge_http.max_usd reached (HTTPJudge.check_budget raises JudgeBudgetExceeded): checkpoint, exit code 5;
- an API's 401/403/404 (backends/api/http.APIStopError): exit code 4 with the server's message."""
from backends.run import build
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


def test_budget_reached_stops_after_the_checkpoint_with_exit_5(tmp_path, toy_cache, monkeypatch):
    from backends.api.judge_http import JudgeBudgetExceeded

    class Billed(ToyJudge):  # spends $1 per step against a $2 cap (judge_http.max_usd)
        spent = 0.0

        def judge_group(self, query, rollouts, step):
            return super().judge_group(query, rollouts, step)

        def check_budget(self):
            self.spent += 1.0
            if self.spent >= 2.0:
                raise JudgeBudgetExceeded(f"judge spent ${self.spent:.2f}, reaching judge_http.max_usd")

    monkeypatch.setattr(build, "build_judge", lambda cfg, world: Billed(world, cfg.judge.caps))
    d = tmp_path / "run"
    assert train.main(fast_args(d, toy_cache, 5, "--set", "checkpoint.every=0")) == 5
    assert len(metric_rows(d)) == 2 and (d / "checkpoints" / "step-000002").is_dir()


def test_a_401_from_an_api_exits_4_with_its_message(tmp_path, toy_cache, monkeypatch, capsys):
    from backends.api.http import APIStopError

    def fail(cfg, resume):
        raise APIStopError("judge", 401, "https://example.invalid/v1beta/models/m:generateContent",
                           "API key not valid.")

    monkeypatch.setattr(train, "train", fail)
    assert train.main(fast_args(tmp_path / "run", toy_cache, 1)) == 4
    assert "API key not valid." in capsys.readouterr().err
