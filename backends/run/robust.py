"""Guards of the training loop against a failing judge (not in the paper; docs/robustness.md): the
shape check of a group's judge result, the per-step judge reliability metrics, and the monitor that
stops a run whose judge keeps failing (train.py deviation 4).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.run.faults import JUDGE_KINDS
from judge import JudgeResult
from scaffold import STAGES

log = logging.getLogger("rubricem")


class JudgeFailureAbort(RuntimeError):
    """The judge failed on more than judge.max_failure_rate of its calls for judge.max_failure_steps
    consecutive steps; `train` stops (main exits with code 3)."""


class UpdateFailureAbort(RuntimeError):
    """max_nonfinite_updates updates in a row had every optimizer step skipped for a non-finite
    gradient norm; `train` stops after a checkpoint (main exits with code 6)."""

    exit_code = 6


@dataclass
class FailureMonitor:
    """Consecutive steps whose judge failure rate exceeded `max_rate`, and consecutive updates that
    applied no optimizer step because every gradient norm was non-finite (training state)."""

    max_rate: float
    max_steps: int
    streak: list = field(default_factory=list)  # the failure rates of the current run of bad steps
    max_nonfinite: int = 3  # Config.max_nonfinite_updates; 0 = never stop
    nonfinite: int = 0  # updates in a row that skipped every optimizer step

    def update_nonfinite(self, m: dict, step: int) -> None:
        """Record one RL step's updates from its metrics m: the deferred reflection update first
        (keys under reflect/, it runs first in the step), then the task update. An update whose
        optimizer steps were all skipped (update/nonfinite_grad_steps > 0 and no finite grad_norm)
        lengthens the run of skipped updates; an update that applied a step ends it; a step with no
        update (an empty batch) leaves it as it is. Raises UpdateFailureAbort when the run reaches
        max_nonfinite (> 0). Not in the paper: a policy whose ratios keep overflowing learns nothing,
        so we stop instead of spending compute on it."""
        for pre in ("reflect/", ""):
            if m.get(pre + "grad_norm") is not None:
                self.nonfinite = 0
            elif m.get(pre + "update/nonfinite_grad_steps"):
                self.nonfinite += 1
        if self.max_nonfinite and self.nonfinite >= self.max_nonfinite:
            raise UpdateFailureAbort(
                f"{self.nonfinite} updates in a row skipped every optimizer step for a non-finite "
                f"gradient norm (max_nonfinite_updates = {self.max_nonfinite}, last step {step}); "
                "stopping after a checkpoint. Lower ss_grpo.lr or check the data, then continue with "
                "--resume latest, or raise max_nonfinite_updates.")

    def update(self, rate: float, step: int) -> None:
        """Record one step's failure rate in [0, 1]; raises JudgeFailureAbort naming the thresholds
        when the last `max_steps` rates all exceeded `max_rate`."""
        self.streak = self.streak + [rate] if rate > self.max_rate else []
        if len(self.streak) >= self.max_steps:
            rates = ", ".join(f"{r:.2f}" for r in self.streak[-self.max_steps:])
            raise JudgeFailureAbort(
                f"judge failure rate above judge.max_failure_rate = {self.max_rate:g} for "
                f"judge.max_failure_steps = {self.max_steps} consecutive steps (rates {rates}, last "
                f"step {step}); stopping. Fix the judge backend (key, quota, endpoint) and continue "
                "with --resume latest, or raise the thresholds.")


def checked_judge_result(res: Any, n: int, step: int = 0, query: str = "") -> tuple[Any, bool]:
    """A group's judge result as the loop may use it, and whether it had to be replaced.

    The loop reads R (n, 4) float64 stage scores in [0,1] or NaN (§3.4), justifications[i][k] for
    i < n, k < 4, rubrics[k] for k < 4 and stats["proposed"], ["pruned"], ["missing"],
    ["buffer_sizes"] (4 ints).
    A result with any of these missing or wrong-shaped (e.g. R of shape (1, 4) for n = 2, which
    numpy would broadcast to every rollout, or the wrong stage count) is not trained on: it becomes
    a result with every cell missing (NaN; SS-GRPO gives those cells advantage 0, ss_grpo.py
    deviation 1), a warning is logged, and the second value is True (counted in judge/bad_shape).
    Never raises. Not in the paper; a guard against a broken judge backend.
    """
    K = len(STAGES)
    try:
        R = np.asarray(res.R, dtype=np.float64)
        just, st = res.justifications, res.stats
        if R.shape != (n, K):
            why = f"R has shape {R.shape}, expected {(n, K)}"
        elif len(just) != n or any(len(j) != K for j in just):
            why = f"justifications are not {n} x {K}"
        elif len(res.rubrics) != K:
            why = f"rubrics are not {K} lists, one per stage"
        elif len(st["buffer_sizes"]) != K or not all(np.isscalar(st[k])
                                                       for k in ("proposed", "pruned", "missing")):
            why = "stats lack proposed / pruned / missing / buffer_sizes"
        else:
            return res, False
    except Exception as e:  # not even readable: no R, a ragged array, stats that are not a dict, ...
        why = f"unreadable result ({type(e).__name__}: {str(e)[:80]})"
    log.warning("step %d: judge result for %r has the wrong shape (%s); its %d x %d cells are "
                "missing", step, query[:60], why, n, K)
    return JudgeResult(np.full((n, K), np.nan), [["judge result had the wrong shape"] * K for _ in range(n)],
                       [[] for _ in range(K)], {"proposed": 0, "pruned": 0, "missing": n * K,
                                                "buffer_sizes": [0] * K}), True


def judge_step_metrics(before: dict, after: dict, http_before: dict | None = None,
                       http_after: dict | None = None) -> dict:
    """Per-step judge reliability from two snapshots of judge.counters: judge/calls,
    judge/failures (calls given up after the retry bound), judge/failure_rate in [0, 1] (0 when
    there were no calls), judge/retries, and judge/faults/<kind> (injected faults per kind).

    With an HTTP judge, http_before / http_after are two snapshots of HTTPJudge.stats(): the step's
    HTTP figures are logged as judge/http/<name> (calls, requests, failures, retries,
    invalid_replies, cache_hits, tokens_in, tokens_out, cost_usd in USD), and calls / failures /
    failure_rate count HTTP calls (one per rollout scored, per proposal, per reflection scoring)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    if http_before is not None and http_after is not None:
        h = {k[len("judge/"):]: http_after[k] - http_before.get(k, 0) for k in http_after
             if k not in ("judge/latency_s", "judge/usd_total")}
        d["calls"], d["failures"] = h["calls"], h["failures"]
        d["retries"] = d.get("retries", 0) + h["retries"]
    calls, fails = d.get("calls", 0), d.get("failures", 0)
    out = {"judge/calls": calls, "judge/failures": fails,
           "judge/failure_rate": fails / calls if calls else 0.0, "judge/retries": d.get("retries", 0)}
    for kind in JUDGE_KINDS:
        if f"fault/{kind}" in after:
            out[f"judge/faults/{kind}"] = d[f"fault/{kind}"]
    if http_before is not None and http_after is not None:
        out.update({f"judge/http/{k}": v for k, v in h.items()})
        out["judge/usd_total"] = http_after.get("judge/usd_total")  # cumulative USD (None: unknown price)
    return out
