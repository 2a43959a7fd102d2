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

from backends.run import checkpoint as ckpt_mod
from backends.run.config import REPORT_BACKENDS
from scaffold import STAGES
from toy.report import format_filter_counts, warm_start_line

# The short fields of the RL progress bar (train._train_loop's bar.set_postfix).
PROGRESS_LEGEND = ("rl progress bar: score = mean static-rubric score of this step's rollouts over the 4 "
                   "stages (0-1, comparable across steps: watch this one), R = the same under the "
                   "judge's evolving rubrics (the RL reward; its rubrics change every step, so it is "
                   "noisy by design; 'missing' when the judge gave none), bank = rubric-bank entries")


# The run dir's artefacts in the order they are listed, with what each holds.
ARTEFACTS = (("metrics.jsonl", "metrics, one JSON line per RL step (docs/metrics.md)"),
             ("reward_curves.png", "stage scores per RL step, smoothed, one panel per stage"),
             ("final", "the trained policy, Hugging Face format (python scripts/ask.py DIR asks it)"),
             ("bank.jsonl", "the rubric bank (python bank.py list FILE)"),
             ("samples.jsonl", "every rollout of the first and last RL step, with stage scores"),
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


def paired_gain(e0: dict, e1: dict, key: str = "answer") -> tuple[float, float, float] | None:
    """(RL - SFT, lo, hi) of a held-out score `key` ("score" | "answer" | "fact_recall"): the mean
    difference and its paired 95 % bootstrap interval over questions; None when the results carry no
    per-question values of equal length (e.g. an evaluation without them)."""
    a, b = (e0.get("per_question") or {}).get(key), (e1.get("per_question") or {}).get(key)
    if not a or not b or len(a) != len(b):
        return None
    lo, hi = bootstrap_ci(np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64))
    return float(e1[key] - e0[key]), lo, hi


def verdict_lines(e0: dict, e1: dict, run_dir: str) -> list[str]:
    """The summary's last words: one plain-language verdict on the held-out answer score, read off
    the paired 95 % interval of RL - SFT (above 0: improved; below 0: lowered; containing 0: no
    change beyond noise), and where to look next."""
    g = paired_gain(e0, e1, "answer")
    if g is None:
        d = e1["answer"] - e0["answer"]
        head = (f"verdict: held-out answer score {d:+.3f} (RL - SFT); no per-question values, so no "
                "interval: too little to call")
    else:
        d, lo, hi = g
        ci = f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        if lo > 0:
            head = f"verdict: RL improved the held-out answer score: {ci}"
        elif hi < 0:
            head = f"verdict: RL lowered the held-out answer score: {ci}"
        else:
            head = (f"verdict: no change in the held-out answer score beyond noise: {ci} (the 95 % "
                    "interval contains 0)")
    final = os.path.join(run_dir, "final")
    return [head, f"next: {os.path.join(run_dir, 'reward_curves.png')} (the trend), "
                  f"python scripts/ask.py {final} (the policy at work), docs/results.md (three seeds)"]


def phase_line(phase: str, **kw) -> str:
    """The one line that announces a phase before its progress bar: "warm_start" (cached=bool,
    path=str, steps=int), "rl" (steps, start, prompts, n) or "eval" (questions, samples, policies).
    Raises KeyError for an unknown phase or a missing field."""
    if phase == "warm_start":
        return warm_start_line(kw["cached"], kw["path"], kw["steps"])
    if phase == "rl":
        left = kw["steps"] - kw["start"]
        return (f"RL: {left} step{'s' * (left != 1)} of {kw['prompts']} questions x {kw['n']} rollouts"
                + (f", resuming at step {kw['start']}" if kw["start"] else ""))
    if phase == "eval":
        return (f"held-out evaluation: {kw['policies']} on {kw['questions']} questions x "
                f"{kw['samples']} samples")
    raise KeyError(f"unknown phase {phase!r}")


def quiet_third_party() -> None:
    """Turn off the progress bars of transformers / huggingface_hub ("Loading weights", "Writing
    model shards"), so that the run's own bars and phase lines are what the console shows. Call
    before they are first imported; cheap when they are not installed."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        # lazy: optional, and imported only after HF_HUB_DISABLE_PROGRESS_BARS is set above
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars  # lazy: as above
    except ImportError:
        return
    disable_progress_bars()


def artefact_lines(run_dir: str, skip: Sequence[str] = ()) -> list[str]:
    """One line per artefact present in run_dir and not in `skip` (e.g. "bank.jsonl" for an arm
    without a bank): its path and what it holds."""
    out = []
    for name, what in ARTEFACTS:
        p = os.path.join(run_dir, name)
        if name in skip:
            continue
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
        # lazy: tensorboard is optional, only when asked for
        from torch.utils.tensorboard import SummaryWriter

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
        import wandb  # lazy: wandb is optional, only when asked for

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


def smooth(y: Sequence, w: int) -> np.ndarray:
    """Trailing moving average over up to w steps (None / NaN left out; NaN where a window holds no
    value). (T,) -> (T,) float64. Raises ValueError for w < 1."""
    if w < 1:
        raise ValueError(f"smoothing window must be >= 1, got {w}")
    a = np.array([np.nan if v is None else v for v in y], dtype=np.float64)
    out = np.full(len(a), np.nan)
    for t in range(len(a)):
        win = a[max(0, t - w + 1): t + 1]
        win = win[np.isfinite(win)]
        if win.size:
            out[t] = win.mean()
    return out


def curve_panels(rows: list[dict], curve: list[dict] | None = None, window: int = 6) -> list[dict]:
    """What the per-run figure draws, one dict per stage panel: {"stage", "steps", "raw", "smooth",
    "key", "label", "heldout"}. The panel's score is the static-rubric score `score/{stage}`
    (comparable across steps) where the run logged it, else the evolving-rubric R `reward/{stage}`;
    "raw" per step (NaN where missing), "smooth" its trailing mean over `window` steps (one
    curriculum window, 2K). "heldout" (Answer panel only, else None) is [(x, answer score), ...] at
    the evaluated steps only: x = step - 1 for the policy after `step` updates (the SFT start at -1)."""
    steps = [r["step"] for r in rows]
    panels = []
    for s in STAGES:
        key = f"score/{s}" if any(r.get(f"score/{s}") is not None for r in rows) else f"reward/{s}"
        raw = np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=np.float64)
        label = ("static-rubric score" if key.startswith("score/") else "evolving-rubric R")
        held = None
        if s == "answer" and curve:
            held = [(int(r["step"]) - 1, float(r["answer"])) for r in curve if r.get("answer") is not None]
        panels.append({"stage": s, "steps": steps, "raw": raw, "smooth": smooth(raw, window),
                       "key": key, "label": label, "heldout": held})
    return panels


def plot_rewards(rows: list[dict], path: str, curve: list[dict] | None = None,
                 window: int = 6) -> list[dict]:
    """PNG of the run's stage scores: one panel per stage (Plan, Research, Review, Answer), the
    static-rubric score of the training rollouts per RL step as faint points and its trailing mean
    over `window` steps as a line (curve_panels); on the Answer panel the held-out answer score at
    the steps where it was measured (two points without eval.every, a curve with it). Returns the
    panels drawn ([] for no rows, nothing written). matplotlib, no display needed."""
    if not rows:
        return []
    import matplotlib  # lazy: matplotlib only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the figure

    panels = curve_panels(rows, curve, window)
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.4), dpi=110, sharey=True)
    handles = {}
    for k, (ax, p) in enumerate(zip(axes, panels)):
        h = ax.plot(p["steps"], p["raw"], "o", color=f"C{k}", alpha=0.25, ms=3)
        handles.setdefault("per step (faint)", h[0])
        h = ax.plot(p["steps"], p["smooth"], color=f"C{k}", lw=2)
        handles.setdefault(f"mean of the last {window} steps", h[0])
        if p["heldout"]:
            xs, ys = zip(*p["heldout"])
            h = ax.plot(xs, ys, "k-o" if len(xs) > 2 else "ko", ms=4)
            handles["held-out answer score (at the steps measured)"] = h[0]
        ax.set_title(f"{p['stage'].capitalize()} ({p['key']})", fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("judge score (0-1, higher is better)")
    static = all(p["key"].startswith("score/") for p in panels)
    fig.suptitle("Stage scores of the training rollouts under the judge's "
                 + ("static rubrics (comparable across steps)" if static else
                    "evolving rubrics R (no static scores logged)"), fontsize=10)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return panels
