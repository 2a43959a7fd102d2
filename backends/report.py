"""What train.py prints for a person reading the run: the progress-bar legend, the SFT filter counts,
the held-out results with 95 % confidence intervals, and the list of artefacts in the run dir; and
where its metrics go: `Logger` (metrics.jsonl always, TensorBoard / W&B when asked for) and the
reward-curve figure.

Not part of the paper's method. The confidence intervals are percentile bootstrap intervals over
held-out questions (the unit that is sampled; each question's samples are averaged first), and the
SFT -> RL difference is bootstrapped paired, on the same resampled questions, since both policies
answer the same questions.
"""
from __future__ import annotations

import json
import math
import os
from typing import Sequence

import numpy as np
import torch

from backends import checkpoint as ckpt_mod
from backends.config import REPORT_BACKENDS
from scaffold import STAGES
from toy.report import format_filter_counts

# The short fields of the RL progress bar (train._train_loop's bar.set_postfix).
PROGRESS_LEGEND = ("rl progress bar: R = mean judge score of this step's rollouts over the 4 stages "
                   "(0-1; 'missing' when the judge gave none), bank = rubric-bank entries")


# The run dir's artefacts in the order they are listed, with what each holds.
ARTEFACTS = (("metrics.jsonl", "metrics, one JSON line per RL step (README: Logged metrics)"),
             ("reward_curves.png", "mean judge score per stage and step"),
             ("final", "the trained policy, Hugging Face format (python ask.py DIR asks it)"),
             ("bank.jsonl", "the rubric bank (python bank.py list FILE)"),
             ("samples.jsonl", "trajectories of the first and last step with stage scores"),
             ("eval.json", "held-out evaluation and timings"))


def bootstrap_ci(values: Sequence[float], level: float = 0.95, n_boot: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (one float per question, NaN ignored).

    level in (0, 1); n_boot resamples with replacement, seeded (deterministic). Returns (lo, hi);
    (nan, nan) for no finite values; lo == hi == the value for a single one. Raises ValueError for a
    level outside (0, 1)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))  # (n_boot, n)
    means = x[idx].mean(axis=1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def heldout_lines(e0: dict, e1: dict) -> list[str]:
    """Lines comparing the SFT start (e0) and the trained policy (e1), two heldout.evaluate_heldout results on
    the same questions: score, answer score and fact recall, each mean with its 95 % CI and the
    paired RL - SFT difference with its CI (when the results carry per-question values). The score
    of an unstructured-scaffold run (its stage/* other than the answer are None) is its answer score."""
    pq0, pq1 = e0.get("per_question") or {}, e1.get("per_question") or {}
    answer_only = e0.get("stage/plan", 0.0) is None
    labels = (("score", "held-out score (Answer stage only):     " if answer_only else
                        "held-out score (mean of 4 stage scores):"),
              ("answer", "held-out answer score:                  "),
              ("fact_recall", "held-out fact recall:                   "))
    out = []
    for key, label in labels:
        line = f"{label} SFT {e0[key]:.3f}"
        a, b = pq0.get(key), pq1.get(key)
        if a and b and len(a) == len(b):
            lo0, hi0 = bootstrap_ci(a)
            lo1, hi1 = bootstrap_ci(b)
            dlo, dhi = bootstrap_ci(np.asarray(b) - np.asarray(a))
            line += (f" [{lo0:.3f}, {hi0:.3f}] -> RL {e1[key]:.3f} [{lo1:.3f}, {hi1:.3f}]; "
                     f"RL - SFT {e1[key] - e0[key]:+.3f} [{dlo:+.3f}, {dhi:+.3f}]")
        else:
            line += f" -> RL {e1[key]:.3f}"
        out.append(line)
    if pq0.get("score"):
        out.append(f"(95% CIs: bootstrap over the {len(pq0['score'])} held-out questions, "
                   f"{e0.get('rollouts', 0) // max(1, len(pq0['score']))} samples each)")
    return out


def artefact_lines(run_dir: str) -> list[str]:
    """One line per artefact present in run_dir: its path and what it holds."""
    out = []
    for name, what in ARTEFACTS:
        p = os.path.join(run_dir, name)
        if os.path.exists(p):
            shown = p + ("/" if os.path.isdir(p) else "")
            out.append(f"  {shown:<40} {what}")
    return out


def sft_line(sft: dict) -> str:
    """The warm-start line of the summary: trained now, or loaded from the cache (then the seconds
    are those of the earlier training), with the final SFT loss and the filter counts."""
    loss = sft.get("final_loss", float("nan"))
    if sft.get("cached"):
        text = f"SFT warm start: cached (trained earlier in {sft['train_seconds']:.0f} s, final loss {loss:.3f})"
    else:
        text = f"SFT warm start: trained ({sft['train_seconds']:.0f} s, final loss {loss:.3f})"
    if sft.get("filter"):
        text += f"; SFT filters {format_filter_counts(sft['filter'])}"
    return text


# ----------------------------------------------------------------------------------------------------
# The metrics log (metrics.jsonl) and the reward-curve figure


class MetricsLog:
    """`log(metrics, step)`: one JSON line per step in run_dir/metrics.jsonl (rank 0 only).

    Every line has the same keys: a key a step does not log is null there, and a key that first
    appears at a later step (e.g. bank/rejected/<reason> after the first rejection) is added as null
    to the earlier lines, which are then rewritten atomically. Keys keep the order of first appearance.

    A resumed run calls `reset(rows)` with the checkpoint's rows: the file is rewritten atomically
    from them, so rows of steps after the checkpoint (or a line cut short by a crash) disappear and
    no step appears twice.
    """

    def __init__(self, path: str | None):
        self.path = path
        self.rows: list[dict] = []
        self.keys: list[str] = ["step"]

    def _rewrite(self) -> None:
        if self.path:
            data = "".join(json.dumps(r) + "\n" for r in self.rows).encode("utf-8")
            ckpt_mod.atomic_write_bytes(self.path, data)

    def _add_keys(self, row: dict) -> bool:
        new = [k for k in row if k not in self.keys]
        self.keys += new
        return bool(new)

    def _full(self, row: dict) -> dict:
        return {k: row.get(k) for k in self.keys}

    def reset(self, rows: list[dict]) -> None:
        self.keys = ["step"]
        for r in rows:
            self._add_keys(r)
        self.rows = [self._full(r) for r in rows]
        self._rewrite()

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _py(v) for k, v in metrics.items()}}
        if self._add_keys(row) and self.rows:  # a new key: earlier lines get it as null
            self.rows = [self._full(r) for r in self.rows]
            self.rows.append(self._full(row))
            self._rewrite()
            return
        self.rows.append(self._full(row))
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(self.rows[-1]) + "\n")


class TensorBoardLog:
    """metrics as TensorBoard scalars in run_dir/tensorboard (`tensorboard --logdir RUN_DIR`); a
    resumed run drops the events after its checkpoint (purge_step), as metrics.jsonl does."""

    def __init__(self, run_dir: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"),
                                    purge_step=resume_step)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in _numbers(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """metrics to Weights & Biases, one W&B run per invocation in run_dir/wandb. Offline unless
    $WANDB_MODE says otherwise (no network needed; `wandb sync` uploads later); project
    $WANDB_PROJECT or "rubricem"; the run config is the training configuration."""

    def __init__(self, run_dir: str, config: dict):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rubricem"), dir=run_dir,
                              name=os.path.basename(os.path.normpath(run_dir)), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def _numbers(metrics: dict) -> dict:
    """The finite numeric values of a metrics row (no nulls, flags or strings)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class Logger:
    """`log(metrics, step)`: the one place a run's metrics go. metrics.jsonl always (MetricsLog,
    rank 0); TensorBoard and W&B when asked for (`--report-to tensorboard,wandb`, config
    report_to). With no backend the extra calls do nothing (a null object for the loop)."""

    def __init__(self, path: str | None, report_to=(), run_dir: str = "", config: dict | None = None,
                 resume_step: int | None = None):
        self.jsonl = MetricsLog(path)
        self.backends = []
        for name in report_to:
            if name == "tensorboard":
                self.backends.append(TensorBoardLog(run_dir, resume_step))
            elif name == "wandb":
                self.backends.append(WandbLog(run_dir, config or {}))
            else:
                raise ValueError(f"report_to: unknown backend {name!r}; expected one of "
                                 f"{tuple(REPORT_BACKENDS)}")

    @property
    def rows(self) -> list[dict]:
        return self.jsonl.rows

    def reset(self, rows: list[dict]) -> None:
        self.jsonl.reset(rows)

    def log(self, metrics: dict, step: int) -> None:
        row = {k: _py(v) for k, v in metrics.items()}  # plain Python numbers, once for every sink
        self.jsonl.log(row, step)
        for b in self.backends:
            b.log(row, step)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.backends = []


def _py(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


def plot_rewards(rows: list[dict], path: str, curve: list[dict] | None = None) -> None:
    """PNG of the per-stage mean reward R per step (solid), the static-rubric score of the same
    rollouts (dashed, `score/{stage}`) and, with `curve` (EvalCurve rows), the held-out answer score
    at each evaluated step (black, dashed with dots); matplotlib, no display needed."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    steps = [r["step"] for r in rows]
    for k, s in enumerate(STAGES):
        ys = [r.get(f"reward/{s}") for r in rows]
        ax.plot(steps, [np.nan if y is None else y for y in ys], color=f"C{k}", label=f"{s} R")
        ys = [r.get(f"score/{s}") for r in rows]
        if any(y is not None for y in ys):
            ax.plot(steps, [np.nan if y is None else y for y in ys], color=f"C{k}", ls="--", lw=1,
                    label=f"{s} static")
    if curve:
        # a row at step s evaluates the policy after s updates, drawn where step s - 1 ended
        ax.plot([r["step"] - 1 for r in curve], [r["answer"] for r in curve], "k--o", ms=3,
                label="held-out answer")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean stage score (judge)")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
