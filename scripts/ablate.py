"""The recipe ablation: every arm x seed from the same SFT start per seed, the held-out answer score over
RL steps, a table with 95 % confidence intervals, a figure like the paper's Fig. 5 and a verdict per
paper finding, written to docs/ablations.md and docs/ablations.png.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Reproduces in the toy world the comparisons of §4 "Ablation: RL training recipes" (Fig. 5: Baseline RL
< SS-GRPO alone and Meta-Policy alone < full RubricEM; 600 steps from the same SFT checkpoint) and the
memory-reuse analysis (Fig. 6d: RubricEM +0.4 / +0.7 at cross-episode pass 1 / within-episode pass 2,
Baseline RL -0.5 / -0.6; scripts/memory_eval.py) and, with --scaffold, the scaffold ablation (Fig. 6a-c: the
structured SFT start beats the unstructured one, DRB 43.0 vs 39.8, and without the scaffold RL gains
are small and unstable), and with --paper-sft, the SFT-confound ablation: RubricEM and Baseline RL
from a warm start trained without reflection and memory examples, as the paper's SFT set (appendix:
teacher trajectories only).

What one grid does
    1. For each seed, then each run of --arms (arms of settings.ARMS and variants, item 7), one
       subprocess
           train.py --toy --arm A --seed S --run-dir GRID/NAME-seedS --steps N --eval-every E --no-progress
       with the same --set overrides for all (a variant's own after them). Every run of a seed on one
       warm start loads the same cached SFT warm start (its cache key holds the world, teacher, SFT
       and model settings and the seed, not the arm), draws the same data order (DataOrder is seeded
       by the seed alone) and is evaluated on the same held-out questions with the same sampling seed
       (heldout.evaluate_heldout); the script checks, per seed and warm start, that the SFT start
       (warm-start key and step-0 evaluation) is the same for every run of that start, and that a
       start other than the toy's is its own.
    2. Memory reuse (scripts/memory_eval.py --oracle: the two passes, pass 2's foreign-lesson control
       and the oracle-lesson, attempt-lesson and content controls) of the MEMORY_ARMS runs (rubricem,
       baseline_rl, exposure and their repeats on the nomemsft and randlessons starts), as
       subprocesses; a run without a bank of its own reads the same seed's rubricem bank of its
       warm start in pass 1.
    3. GRID/results.jsonl: one row per (run, seed, evaluated step) with the answer score and its
       difference from the SFT start (step 0 of the same run), per question.
    4. The report, into --doc: the table (held-out answer-score difference from the SFT start at the
       final step: mean and 95 % percentile-bootstrap interval over seeds x questions), the curve
       averages (the Fig. 5 metric), the figure (that difference against the RL step, one line per
       run with its interval as a band), "The reflection update" (RubricEM against SS-GRPO,
       rubricem-c0 and exposure-only, exposure-only against SS-GRPO), memory reuse (Fig. 6d: pass 1,
       pass 2 and pass 2 own minus foreign, and the controls), "Does the policy read a lesson's
       content?" (the content index and the foreign-lesson effect per warm start and per run after
       RL), the paper findings and the goals. Each new contrast gives its paired 95 % interval and
       its half-width, (hi - lo) / 2.
    5. With --scaffold, per seed also Baseline RL on the unstructured scaffold (run dir
       GRID/unstructured-seedS: train.py --arm baseline_rl --set rollout.scaffold="unstructured"),
       beside the structured baseline_rl run (added to --arms if missing): the same steps, seed, data
       order and held-out questions, each from its own scaffold's SFT start. The report compares
       the two after SFT and after RL (held-out answer score, scored by the same answer rubrics, and
       fact recall; mean and 95 % interval over seeds x questions).
    6. With --paper-sft, per seed also RubricEM and Baseline RL from a warm start trained without
       the toy's reflection and memory examples (run dirs GRID/rubricem-papersft-seedS and
       GRID/baseline_rl-papersft-seedS: train.py --arm rubricem / baseline_rl with PAPER_SFT_SET,
       sft.n_reflections=0 teacher.p_memory=0, after the other overrides), beside the rubricem and
       baseline_rl runs from the toy's default SFT (added to --arms if missing). The toy's default
       SFT set teaches writing a reflection and using retrieved memory, which the paper's does not
       (its backbone writes reflections from pre-training); this measures that confound. The
       paper-style warm start is not the shipped one: the first such run trains it into cache_dir
       (about 45 min on 2 cores at threads=1), the others load it (with --jobs > 1 they wait for
       that run, queued after every other run). No memory-reuse evaluation for these runs. The
       report gives both arms' RL gain on both starts and RubricEM - Baseline RL per start.
    7. Variants (VARIANTS; name -> train.py --arm, overrides after the grid's, display name, warm
       start), named in --arms like arms: rubricem-c0 (reflection.loss_coef=0) and exposure
       (reflection.train=false: bank and memory in the prompts, no reflection GRPO) on the toy's
       start; rubricem-nomemsft, baseline_rl-nomemsft, exposure-nomemsft (teacher.p_memory=0: no
       lesson in the SFT prompts, reflection-writing examples kept); rubricem-randlessons,
       baseline_rl-randlessons, exposure-randlessons, ss_grpo-randlessons
       (teacher.memory_lessons="random": the SFT lessons name random subsets of facts); and the
       runs of items 5 and 6. A start other than the toy's is trained by its first run, as in item 6;
       its runs are compared only with runs from the same start.

Resumable: a run whose eval.json exists is done and never redone; a run dir with checkpoints
continues with --resume latest; memory.json marks a finished memory evaluation. Kill the grid at any
time and start the same command again.

Launch
    python scripts/ablate.py                                 # 5 arms x seeds 0,1,2, toy steps (hours)
    python scripts/ablate.py --quick                         # fewer steps, questions, smaller SFT
    python scripts/ablate.py --arms rubricem,baseline_rl --seeds 0 --steps 12 --set threads=1
    python scripts/ablate.py --arms baseline_rl --scaffold --quick   # scaffold ablation (Fig. 6a-c)
    python scripts/ablate.py --paper-sft --arms rubricem,baseline_rl --set threads=1 --set sample_threads=1
    python scripts/ablate.py --arms rubricem,ss_grpo,baseline_rl,rubricem-c0,exposure --jobs 2 \
        --set threads=1 --set sample_threads=1              # the reflection update
    python scripts/ablate.py --arms rubricem-nomemsft,baseline_rl-nomemsft,exposure-nomemsft \
        --jobs 2 --set threads=1 --set sample_threads=1     # a warm start without a memory reflex
    python scripts/ablate.py --render-only                   # redraw the doc from GRID/results.jsonl
    python scripts/ablate.py memory --run-dir runs/toy       # memory reuse of one run (scripts/memory_eval.py)

Deviations from the paper
    1. Toy world, toy steps and toy sizes (train.py); seeds and their confidence intervals are ours
       (the paper reports single runs).
    2. A finding is called reproduced only when the two arms' 95 % intervals do not overlap and the
       order is the paper's; not reproduced when they do not overlap and the order is reversed;
       inconclusive when they overlap. For memory reuse the sign of the difference is judged the
       same way against 0.
    3. Not in the paper, ours: the variants of item 7, pass 2's foreign-lesson control, the content
       index and the goals block (a goal on a difference is met when its 95 % interval lies above 0,
       the content-index goal when its mean reaches CONTENT_GOAL).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run import (checkpoint as ckpt_mod, config as settings, overrides,  # noqa: E402
                          presets, provenance, report)

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import memory_eval  # noqa: E402  (scripts/memory_eval.py: `ablate.py memory`)

# rubricem, ss_grpo, meta_policy, baseline_rl, baseline_rl_info: the paper's arms (the reward
# ladder's oracle arms, rewarded with ground truth, are not part of the grid)
ARM_ORDER = [a for a, arm in settings.ARMS.items() if arm.reward == "judge"]
PAPER_NAMES = {"rubricem": "RubricEM", "ss_grpo": "SS-GRPO", "meta_policy": "Meta-Policy",
               "baseline_rl": "Baseline RL", "baseline_rl_info": "Baseline RL (info-matched, ours)"}
# The scaffold ablation (Fig. 6a-c, --scaffold): Baseline RL on the unstructured scaffold, run beside
# the structured baseline_rl run under this name (its run dir GRID/unstructured-seedS).
UNSTRUCTURED = "unstructured"
SCAFFOLD_SET = 'rollout.scaffold="unstructured"'
# Paper findings on the scaffold (Fig. 6a-c): (what is compared, results-row key, at the SFT start?).
SCAFFOLD_FINDINGS = (
    ("structured > unstructured after SFT (paper: DRB 43.0 vs 39.8)", "per_question_answer", True),
    ("structured > unstructured after RL", "per_question_answer", False),
    ("RL gain (RL - SFT) larger with the scaffold (paper: without it RL gains are small and "
     "unstable)", "per_question_delta", False))
# The SFT-confound ablation (--paper-sft): RubricEM and Baseline RL from a warm start trained without
# the toy's reflection examples and retrieved memory in the SFT prompts, as the paper's SFT set
# (teacher trajectories only), run beside the default-SFT runs under the names of PAPERSFT (run dirs
# GRID/<name>-seedS). PAPER_SFT_SET goes after the other overrides, so it wins.
PAPER_SFT_SET = ["sft.n_reflections=0", "teacher.p_memory=0"]


@dataclasses.dataclass(frozen=True)
class Start:
    """One SFT warm start of the grid. sets: the --set overrides that make it, placed after the
    grid's own; label: its name in the report; sft_set, scaffold: what the results rows of its runs
    carry in "sft_set" and "scaffold"."""
    sets: tuple[str, ...]
    label: str
    sft_set: str = "toy"
    scaffold: str = "structured"


# Every warm start a grid can train from. Runs from one start are compared with each other only.
STARTS = {
    "toy": Start((), "toy default SFT"),
    "unstructured": Start((SCAFFOLD_SET,), "unstructured scaffold", scaffold="unstructured"),
    "papersft": Start(tuple(PAPER_SFT_SET), "paper-style SFT", sft_set="paper"),
    # no lesson in the SFT prompts (no memory reflex taught), reflection-writing examples kept
    "nomemsft": Start(("teacher.p_memory=0",), "no-memory SFT", sft_set="nomemsft"),
    # the SFT prompts' lessons name random subsets of the question's facts (toy.teacher.random_lesson):
    # a lesson's content then says nothing about which facts the answer needs
    "randlessons": Start(('teacher.memory_lessons="random"',), "random-lesson SFT",
                         sft_set="randlessons"),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A run of the grid other than a plain arm: train.py --arm `arm` with `sets` after the grid's
    overrides (its start's included), shown as `name`, from the warm start `start` (a STARTS key:
    every run of a seed on one start loads one warm start); base: the run it repeats on another
    start (None for a run of its own)."""
    arm: str
    sets: tuple[str, ...]
    name: str
    start: str = "toy"
    base: str | None = None


# Variants on the toy's default start, beside the arms: RubricEM whose reflection candidates'
# advantages are weighted c = 0 in the shared optimizer step (reflection.loss_coef), and exposure-only:
# the bank and memory in the prompts stay, no reflection GRPO (reflection.train=false).
OWN_VARIANTS = {
    "rubricem-c0": Variant("rubricem", ("reflection.loss_coef=0",), "RubricEM, reflection loss weight c = 0"),
    "exposure": Variant("rubricem", ("reflection.train=false",),
                        "Exposure-only (memory in prompts, no reflection training)"),
}
# Per start other than the toy's and the unstructured scaffold's: the runs repeated from it, each
# under the name "<base>-<start>" (run dirs GRID/<base>-<start>-seedS).
START_RUNS = {"papersft": ("rubricem", "baseline_rl"),
              "nomemsft": ("rubricem", "baseline_rl", "exposure"),
              "randlessons": ("rubricem", "baseline_rl", "exposure", "ss_grpo")}


def make_variants() -> dict[str, Variant]:
    """Every variant by name: UNSTRUCTURED, OWN_VARIANTS and the START_RUNS repeats (a repeat of an
    own variant keeps its overrides after the start's)."""
    out = {UNSTRUCTURED: Variant("baseline_rl", STARTS["unstructured"].sets,
                                 "Baseline RL, unstructured scaffold", "unstructured", "baseline_rl"),
           **OWN_VARIANTS}
    for start, bases in START_RUNS.items():
        for b in bases:
            v = OWN_VARIANTS[b] if b in OWN_VARIANTS else Variant(b, (), PAPER_NAMES[b])
            out[f"{b}-{start}"] = Variant(v.arm, (*STARTS[start].sets, *v.sets),
                                          f"{v.name}, {STARTS[start].label}", start, b)
    return out


VARIANTS = make_variants()
PAPER_NAMES.update({n: v.name for n, v in VARIANTS.items()})
PAPERSFT = {n: v.arm for n, v in VARIANTS.items() if v.start == "papersft"}  # name -> arm
# Short names for the report's contrast lines.
SHORT_NAMES = {"rubricem": "RubricEM", "ss_grpo": "SS-GRPO", "baseline_rl": "Baseline RL",
               "rubricem-c0": "RubricEM (c = 0)", "exposure": "Exposure-only"}


def variant(name: str) -> Variant:
    """The Variant of a run name; a plain arm (or any other name) is itself on the toy start."""
    return VARIANTS.get(name) or Variant(name, (), PAPER_NAMES.get(name, name))


def sibling(base: str, start: str) -> str | None:
    """The run name of `base` (an arm or an own variant) on warm start `start`: `base` itself on the
    toy start, None when the grid has no such run."""
    if start == "toy":
        return base
    return next((n for n, v in VARIANTS.items() if v.base == base and v.start == start), None)


def grid_runs(arms: Sequence[str], scaffold: bool = False, paper_sft: bool = False) -> list[str]:
    """The run names of a grid in order, without repeats: `arms` (arms and variant names), then
    UNSTRUCTURED with `scaffold` and the PAPERSFT runs with `paper_sft`."""
    return list(dict.fromkeys([*arms, *([UNSTRUCTURED] if scaffold else []),
                               *(PAPERSFT if paper_sft else [])]))


# The runs memory reuse is evaluated for (with the controls, --oracle): the arms of the paper's
# memory-reuse figure and exposure-only, on every warm start that repeats them.
MEMORY_ARMS = tuple(n for s in ("toy", "nomemsft", "randlessons")
                    for b in ("rubricem", "baseline_rl", "exposure") if (n := sibling(b, s)))
# Paper findings on the recipe (Fig. 5): (lower arm, higher arm).
ORDER_FINDINGS = (("baseline_rl", "ss_grpo"), ("baseline_rl", "meta_policy"),
                  ("ss_grpo", "rubricem"), ("meta_policy", "rubricem"))
# Paper findings on memory reuse (Fig. 6d): (arm, pass, paper's sign, paper's value).
MEMORY_FINDINGS = (("rubricem", "pass1", +1, "+0.4"), ("rubricem", "pass2", +1, "+0.7"),
                   ("baseline_rl", "pass1", -1, "-0.5"), ("baseline_rl", "pass2", -1, "-0.6"))
# --quick: one curriculum window, a small SFT start and 16 held-out questions (aimed at <= 15 min for
# the default grid on 2 cores; the numbers are too noisy for findings, it checks the machinery).
# Not measured: estimated from the README's timings (SFT 0.27 s per step, an RL step of 8 x 8 rollouts
# 17 s) as about 1 min of SFT per seed and 1 min per run with its three evaluations.
QUICK_SET = ["sft.steps=200", "sft.n_trajectories=1500", "sft.n_reflections=200",
             "rollout.prompts_per_step=4", "rollout.n=4", "reflection.m=4", "eval.n_questions=16",
             "eval.samples=1"]
QUICK_STEPS, QUICK_SEEDS = 6, [0, 1]


# ----------------------------------------------------------------------------------------------------
# Statistics (pure)


def mean_ci(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of `values` (NaN ignored) and its 95 % percentile-bootstrap interval
    (report.bootstrap_ci, 2000 resamples, seeded); all NaN for no finite value."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = report.bootstrap_ci(x, seed=seed)
    return float(x.mean()), lo, hi


def order_verdict(low: tuple, high: tuple) -> str:
    """Verdict on the paper's "low arm < high arm" from two (mean, lo, hi) triples: "reproduced"
    (intervals disjoint, high above), "not reproduced" (disjoint, high below), "inconclusive (CIs
    overlap)", or "not run" when either is missing (NaN)."""
    if not all(np.isfinite(v) for v in (*low, *high)):
        return "not run"
    if high[1] > low[2]:
        return "reproduced"
    if high[2] < low[1]:
        return "not reproduced"
    return "inconclusive (CIs overlap)"


def sign_verdict(stat: tuple, sign: int) -> str:
    """Verdict on "the difference has the paper's sign (+1 or -1)" from (mean, lo, hi): "reproduced"
    (the interval excludes 0 on the paper's side), "not reproduced" (excludes 0 on the other side),
    "inconclusive (CI contains 0)", or "not run" (NaN)."""
    if not all(np.isfinite(v) for v in stat):
        return "not run"
    if (sign > 0 and stat[1] > 0) or (sign < 0 and stat[2] < 0):
        return "reproduced"
    if (sign > 0 and stat[2] < 0) or (sign < 0 and stat[1] > 0):
        return "not reproduced"
    return "inconclusive (CI contains 0)"


def curve_rows(arm: str, seed: int, curve: list[dict]) -> list[dict]:
    """results.jsonl rows of one run from its eval_curve.jsonl rows: one per evaluated step with the
    scaffold and the SFT set of its warm start (Start.scaffold, Start.sft_set: "structured" and "toy"
    for an arm, "unstructured" for the UNSTRUCTURED run, "paper" for a PAPERSFT run), the answer
    score, score and fact recall, the answer score of the SFT start (the run's step-0 row) and the
    per-question answer scores, their differences from the SFT start and fact recalls. Raises
    ValueError when the curve has no step-0 row."""
    base = next((r for r in curve if r["step"] == 0), None)
    if base is None:
        raise ValueError(f"{arm}-seed{seed}: eval_curve.jsonl has no step-0 (SFT start) row")
    a0 = np.asarray(base["per_question"]["answer"])
    s0 = np.asarray(base["per_question"].get("score", []))
    start = STARTS[variant(arm).start]
    out = []
    for r in curve:
        a = np.asarray(r["per_question"]["answer"])
        sc = np.asarray(r["per_question"].get("score", []))
        out.append({"per_question_score_delta": (sc - s0).tolist() if len(sc) == len(s0) else [],
                    "arm": arm, "seed": seed, "step": r["step"],
                    "scaffold": start.scaffold, "sft_set": start.sft_set,
                    "answer": r["answer"], "score": r["score"], "fact_recall": r["fact_recall"],
                    "answer_sft": base["answer"], "delta_answer": float((a - a0).mean()),
                    "per_question_answer": a.tolist(), "per_question_delta": (a - a0).tolist(),
                    "per_question_fact_recall": list(r["per_question"].get("fact_recall", []))})
    return out


def arm_stats(rows: list[dict], arm: str, step: int) -> tuple[float, float, float]:
    """(mean, lo, hi) of the answer-score difference from the SFT start at `step`, pooled over the
    arm's seeds x questions."""
    return pooled_stats(rows, arm, step, "per_question_delta")


def pooled_stats(rows: list[dict], arm: str, step: int, key: str) -> tuple[float, float, float]:
    """(mean, lo, hi) of the per-question values `key` of results rows (per_question_answer,
    per_question_delta, per_question_fact_recall) of run `arm` (an arm or a variant name) at
    `step`, pooled over its seeds x questions; all NaN when there are none."""
    return mean_ci([d for r in rows if r["arm"] == arm and r["step"] == step for d in r.get(key, [])])


def paired_difference(rows: list[dict], a: str, b: str, step: int) -> dict | None:
    """{"answer": (mean, lo, hi), "score": (mean, lo, hi)}: arm a minus arm b at `step`, paired by
    seed and held-out question (both arms of a seed share the SFT start and the questions), with a
    percentile-bootstrap interval over the pairs; None when a seed lacks either arm."""
    out = {}
    for name, key in (("answer", "per_question_delta"), ("score", "per_question_score_delta")):
        diffs = []
        for seed in sorted({r["seed"] for r in rows if r["arm"] in (a, b)}):
            ra = [r for r in rows if r["arm"] == a and r["seed"] == seed and r["step"] == step]
            rb = [r for r in rows if r["arm"] == b and r["seed"] == seed and r["step"] == step]
            va, vb = (ra[0].get(key, []), rb[0].get(key, [])) if ra and rb else ([], [])
            if not va or len(va) != len(vb):
                return None  # a seed without either arm, or rows without per-question values
            diffs += (np.asarray(va) - np.asarray(vb)).tolist()
        if not diffs:
            return None
        out[name] = mean_ci(diffs)
    return out


def curve_steps(rows: list[dict]) -> list[int]:
    """The evaluated RL steps after the SFT start (step 0) that every run in `rows` evaluated, up to
    the grid's final step: the points of the curve average."""
    fs = final_step(rows)
    runs = {(r["arm"], r["seed"]) for r in rows}
    if fs is None:
        return []
    common = set.intersection(*({r["step"] for r in rows if (r["arm"], r["seed"]) == k} for k in runs))
    return sorted(t for t in common if 0 < t <= fs)


def curve_average(rows: list[dict], arm: str, seed: int, key: str = "per_question_delta",
                  steps: Sequence[int] | None = None) -> list[float]:
    """Per held-out question, the mean over the curve's evaluated steps (`curve_steps`, or `steps`)
    of the per-question value `key` of run (arm, seed): with per_question_delta, the paper's Fig. 5
    metric, the average difference from the SFT start along the training curve, per question. []
    when the run lacks a step or its rows lack `key`."""
    steps = curve_steps(rows) if steps is None else steps
    per_step = []
    for t in steps:
        r = [x for x in rows if x["arm"] == arm and x["seed"] == seed and x["step"] == t]
        if not r or not r[0].get(key):
            return []
        per_step.append(np.asarray(r[0][key], dtype=np.float64))
    if not per_step or len({len(v) for v in per_step}) != 1:
        return []
    return np.mean(per_step, axis=0).tolist()


def curve_stats(rows: list[dict], arm: str, key: str = "per_question_delta") -> tuple[float, float, float]:
    """(mean, lo, hi) of `curve_average` pooled over the arm's seeds x questions (the Fig. 5 metric
    of one arm: its average held-out answer gain over the SFT start along the curve)."""
    seeds = sorted({r["seed"] for r in rows if r["arm"] == arm})
    return mean_ci([v for s in seeds for v in curve_average(rows, arm, s, key)])


def paired_curve_difference(rows: list[dict], a: str, b: str) -> dict | None:
    """{"answer": (mean, lo, hi), "score": (mean, lo, hi)}: the curve average of arm a minus that of
    arm b, paired by seed and held-out question (both start from the same SFT checkpoint and are
    evaluated on the same questions with the same sampling seed), with a percentile-bootstrap
    interval over the pairs ("score", the mean-stage score's, all NaN when the rows lack it); None
    when a seed lacks either arm."""
    out = {}
    for name, key in (("answer", "per_question_delta"), ("score", "per_question_score_delta")):
        diffs = []
        for seed in sorted({r["seed"] for r in rows if r["arm"] in (a, b)}):
            va, vb = curve_average(rows, a, seed, key), curve_average(rows, b, seed, key)
            if not va or len(va) != len(vb):
                diffs = []
                break
            diffs += (np.asarray(va) - np.asarray(vb)).tolist()
        out[name] = mean_ci(diffs)
    return out if np.isfinite(out["answer"][0]) else None


def final_step(rows: list[dict]) -> int | None:
    """The last step every run in `rows` evaluated (the grid's common final step)."""
    runs = {(r["arm"], r["seed"]) for r in rows}
    if not runs:
        return None
    return min(max(r["step"] for r in rows if (r["arm"], r["seed"]) == k) for k in runs)


# ----------------------------------------------------------------------------------------------------
# Running the grid


def run_dir(grid: str, arm: str, seed: int) -> str:
    return os.path.join(grid, f"{arm}-seed{seed}")


def train_command(grid: str, arm: str, seed: int, steps: int, eval_every: int,
                  sets: Sequence[str]) -> list[str]:
    """The train.py command line of one run (`arm`: an arm or a VARIANTS name) and seed; `--resume
    latest` when its run dir holds checkpoints (a half-finished run). A variant runs its arm with its
    overrides after `sets`, so they win (UNSTRUCTURED: --arm baseline_rl, SCAFFOLD_SET; a PAPERSFT
    name: its arm, PAPER_SFT_SET)."""
    rd = run_dir(grid, arm, seed)
    v = variant(arm)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--toy", "--arm", v.arm, "--seed",
           str(seed), "--run-dir", rd, "--steps", str(steps), "--eval-every", str(eval_every),
           "--no-progress"]
    for s in [*sets, *v.sets]:
        cmd += ["--set", s]
    if ckpt_mod.list_checkpoints(rd):
        cmd += ["--resume", "latest"]
    return cmd


def memory_command(grid: str, arm: str, seed: int, arms: Sequence[str]) -> list[str]:
    """scripts/memory_eval.py for one run, with the controls (--oracle); a run whose arm writes no
    reflections reads in pass 1 the bank of the same seed's rubricem run on its warm start (`sibling`)
    when `arms` holds that run and its bank exists."""
    rd = run_dir(grid, arm, seed)
    v = variant(arm)
    # the SFT start's controls once per start and seed (memory_eval's --sft-cache, keyed)
    cache = os.path.join(grid, f"sft-controls-{v.start}-seed{seed}.json")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "memory_eval.py"), rd, "--oracle",
           "--sft-cache", cache]
    own = sibling("rubricem", v.start)
    other = os.path.join(run_dir(grid, own, seed), "bank.jsonl") if own else ""
    if not settings.ARMS[v.arm].reflection and own in arms and os.path.exists(other):
        cmd += ["--bank", other]
    return cmd


def run_logged(cmd: list[str], log_path: str) -> int:
    """Run one subprocess with its output appended to log_path; returns its exit code."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def run_grid(grid: str, arms: Sequence[str], seeds: Sequence[int], steps: int, eval_every: int,
             sets: Sequence[str], memory: bool = True, progress: bool = True,
             scaffold: bool = False, jobs: int = 1, paper_sft: bool = False) -> dict:
    """Train every (run, seed) not yet done (`arms`: arms and variant names; with `scaffold`, also
    the UNSTRUCTURED run per seed; with `paper_sft`, the PAPERSFT runs per seed), then the memory
    evaluations of the MEMORY_ARMS runs; returns {"done": [...], "skipped": [...], "failed": [...]}
    of "name-seedS" (memory: "memory:name-seedS"). jobs: subprocesses at once (>= 1); each run's
    result does not depend on it (every run is its own process, seeded alone), its wall time does.
    A start other than the toy's is trained by the first of its runs, into the cache (every seed
    shares it: sft.seed is not the run's seed), so that run goes first and the start's other runs
    go last and wait for it to end: each warm start is trained once, beside the other runs."""
    runs = grid_runs(arms, scaffold, paper_sft)
    train = [("train", a, s) for s in seeds for a in runs]
    leaders: dict[str, tuple] = {}  # start -> the run that trains its warm start
    for job in train:
        if variant(job[1]).start != "toy":
            leaders.setdefault(variant(job[1]).start, job)
    followers = [j for j in train if variant(j[1]).start != "toy" and j not in leaders.values()]
    todo = [*leaders.values(), *(j for j in train if variant(j[1]).start == "toy"), *followers]
    leader_done = {st: threading.Event() for st in leaders}  # the leader ended (done, skipped or failed)
    if memory:
        todo += [("memory", a, s) for s in seeds for a in runs if a in MEMORY_ARMS]

    def finished(kind: str, a: str, s: int) -> bool:
        name = "eval.json" if kind == "train" else "memory.json"
        return os.path.exists(os.path.join(run_dir(grid, a, s), name))

    status = {"done": [], "skipped": [], "failed": []}
    n_done = sum(finished(*j) for j in todo)
    bar = tqdm(total=len(todo), initial=n_done, desc="ablation grid", disable=not progress,
               unit="run")
    def one(job: tuple) -> None:
        start = variant(job[1]).start
        try:
            if job in followers:
                leader_done[start].wait()  # its warm start is in the cache (or its leader failed)
            train_or_evaluate(job)
        finally:
            if leaders.get(start) == job:
                leader_done[start].set()

    def train_or_evaluate(job: tuple) -> None:
        kind, a, s = job
        tag = f"{a}-seed{s}" if kind == "train" else f"memory:{a}-seed{s}"
        if finished(kind, a, s):
            status["skipped"].append(tag)
            return
        if kind == "memory" and not finished("train", a, s):
            status["failed"].append(tag)  # its training failed
            bar.update(1)
            return
        bar.set_postfix_str(tag)
        cmd = (train_command(grid, a, s, steps, eval_every, sets) if kind == "train"
               else memory_command(grid, a, s, runs))
        rc = run_logged(cmd, os.path.join(grid, "logs", tag.replace(":", "-") + ".log"))
        ok = rc == 0 and finished(kind, a, s)
        status["done" if ok else "failed"].append(tag)
        if not ok:
            print(f"{tag}: exit code {rc}; see {grid}/logs/", file=sys.stderr)
        bar.update(1)

    # every training run first (a memory evaluation may read another arm's bank), then the memory runs
    for kind in ("train", "memory"):
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(one, [j for j in todo if j[0] == kind]))
    bar.close()
    return status


def _finished_run(grid: str, arm: str, seed: int) -> tuple[dict, list[dict]] | None:
    """(eval.json, eval_curve.jsonl rows) of a finished run, or None when it has no eval.json."""
    rd = run_dir(grid, arm, seed)
    if not os.path.exists(os.path.join(rd, "eval.json")):
        return None
    ev = json.load(open(os.path.join(rd, "eval.json")))
    cp = os.path.join(rd, "eval_curve.jsonl")
    return ev, [json.loads(l) for l in open(cp) if l.strip()] if os.path.exists(cp) else []


WF_FLOOR = 0.8  # the toy demonstration's format target: rollout/well_formed >= 0.8 at every step


def format_stats(grid: str, arms: Sequence[str], seeds: Sequence[int]) -> dict:
    """{arm: {"seeds", "steps", "lowest", "mean", "below"}} of the finished runs' training format:
    `rollout/well_formed` (the share of a step's rollouts with every stage block, 0-1) over every
    step of every seed in metrics.jsonl; "below" counts the steps under WF_FLOOR. An arm without a
    finished run is left out."""
    out = {}
    for a in arms:
        wf, n = [], 0
        for s in seeds:
            rd = run_dir(grid, a, s)
            mp = os.path.join(rd, "metrics.jsonl")
            if not (os.path.exists(os.path.join(rd, "eval.json")) and os.path.exists(mp)):
                continue
            n += 1
            for line in open(mp):
                v = json.loads(line).get("rollout/well_formed") if line.strip() else None
                if v is not None:
                    wf.append(float(v))
        if wf:
            out[a] = {"seeds": n, "steps": len(wf), "lowest": min(wf), "mean": float(np.mean(wf)),
                      "below": sum(v < WF_FLOOR for v in wf)}
    return out


def _sft_key(ev: dict) -> str:
    return str(ev.get("sft", {}).get("key") or ev.get("sft", {}).get("source"))


def collect(grid: str, arms: Sequence[str], seeds: Sequence[int],
            scaffold: bool = False, paper_sft: bool = False) -> tuple[list[dict], dict, list[str]]:
    """(results rows, memory results by (run, seed), checks) from the finished runs of `grid_runs`
    (arms and variant names; with `scaffold`, the UNSTRUCTURED runs too; with `paper_sft`, the
    PAPERSFT runs); writes GRID/results.jsonl. Checks, per seed and warm start (`start_checks`): the
    runs of one start share its warm start (cache key) and evaluated it identically at step 0; a
    start other than the toy's is its own (a key none of the toy-start runs have) with the toy-start
    runs' held-out question count and evaluation settings."""
    rows, mem, checks = [], {}, []
    for s in seeds:
        keys: dict[str, dict] = {}  # start -> {run: warm-start key}
        base: dict[str, dict] = {}  # start -> {run: (step-0 per-question answers, evaluation JSON)}
        for name in grid_runs(arms, scaffold, paper_sft):
            got = _finished_run(grid, name, s)
            if got is None:
                continue
            ev, curve = got
            try:
                rows += curve_rows(name, s, curve)
            except ValueError as e:  # e.g. eval.n_questions = 0: nothing to compare
                checks.append(f"{e}; left out")
                continue
            start = variant(name).start
            keys.setdefault(start, {})[name] = _sft_key(ev)
            base.setdefault(start, {})[name] = (curve[0]["per_question"]["answer"],
                                                json.dumps(curve[0]["eval"]))
            mp = os.path.join(run_dir(grid, name, s), "memory.json")
            if os.path.exists(mp):
                mem[(name, s)] = json.load(open(mp))
        checks += start_checks(s, keys, base)
    if os.path.isdir(grid):
        data = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
        ckpt_mod.atomic_write_bytes(os.path.join(grid, "results.jsonl"), data)
    return rows, mem, checks


def _shared_start(what: str, keys: dict, base: dict) -> str:
    """The check line "WHAT: yes|NO (cache key ...); identical step-0 held-out evaluation: yes|NO"
    of runs that must share one SFT start: `keys` run -> warm-start cache key, `base` run ->
    (step-0 per-question answers, evaluation settings as JSON)."""
    distinct = sorted(set(map(str, keys.values())))
    same_base = len({json.dumps(v) for v in base.values()}) == 1
    return (f"{what}: {'yes' if len(distinct) == 1 else 'NO'} (cache key "
            f"{', '.join(k[:12] for k in distinct)}); identical step-0 held-out evaluation: "
            f"{'yes' if same_base else 'NO'}")


def _same_questions(base: tuple, ref: tuple) -> bool:
    """Two runs' step-0 (per-question answers, evaluation settings as JSON): the same number of
    held-out questions and the same evaluation settings (questions, samples, temperature)."""
    return len(base[0]) == len(ref[0]) and base[1] == ref[1]


def start_checks(seed: int, keys: dict, base: dict) -> list[str]:
    """The check lines of one seed's finished runs grouped by warm start (`keys`: start -> {run:
    cache key}, `base`: start -> {run: (step-0 per-question answers, evaluation settings as
    JSON)}): per start, its runs share one warm start and evaluated it identically at step 0
    (`_shared_start`); a start other than the toy's also has a key none of the toy-start runs have
    (one equal to the toy's would measure nothing) and their held-out question count and
    evaluation settings. Any failed part reads NO."""
    lines = []
    if keys.get("toy"):
        lines.append(_shared_start(f"seed {seed}: SFT warm start shared by {len(keys['toy'])} arms",
                                   keys["toy"], base["toy"]))
    main = sorted(set(map(str, keys.get("toy", {}).values())))
    for start in (st for st in STARTS if st != "toy" and keys.get(st)):
        n = len(keys[start])
        line = _shared_start(f"seed {seed}: {STARTS[start].label}: warm start shared by {n} "
                             f"run{'s' if n != 1 else ''}", keys[start], base[start])
        if main:
            line += (f"; own warm start, not the default SFT's (cache key "
                     f"{', '.join(k[:12] for k in main)}): "
                     f"{'yes' if not set(keys[start].values()) & set(main) else 'NO'}")
        if base.get("toy"):
            ref = next(iter(base["toy"].values()))
            same = all(_same_questions(b, ref) for b in base[start].values())
            line += (f"; same held-out question count and evaluation settings as the default-SFT arms: "
                     f"{'yes' if same else 'NO'}")
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------------
# The report


def plot(rows: list[dict], arms: Sequence[str], path: str) -> None:
    """Fig. 5-style figure: answer-score difference from the SFT start vs RL step, one line per arm,
    its 95 % interval over seeds x questions as a band; a run from another SFT set (papersft,
    nomemsft, randlessons) dashed, in the colour of its toy-start run when that is drawn too."""
    import matplotlib  # lazy: matplotlib only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the figure

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=120)
    colour = {}
    def dashed(a: str) -> bool:
        return STARTS[variant(a).start].sft_set != "toy"

    for a in sorted(arms, key=dashed):  # the default-SFT runs first: their colours
        steps = sorted({r["step"] for r in rows if r["arm"] == a})
        if not steps:
            continue
        st = [arm_stats(rows, a, t) for t in steps]
        m, lo, hi = (np.array([x[i] for x in st]) for i in range(3))
        style = {"ls": "--", "color": colour.get(variant(a).base)} if dashed(a) else {}
        (line,) = ax.plot(steps, m, marker="o", ms=3, label=PAPER_NAMES[a], **style)
        colour[a] = line.get_color()
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out answer score - SFT start")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def machine() -> str:
    """The CPU model, nproc, torch's kernel set and the torch / transformers versions
    (backends/run/provenance.py; other machines give other numbers: docs/metrics.md,
    "Reproducibility"), and the platform."""
    return f"{provenance.describe(provenance.machine())}; {platform.system()} {platform.release()}"


def commit() -> str:
    """The checkout's commit, with "+ local changes" when the work tree differs from it."""
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (h or "unknown") + (" + local changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def render(rows: list[dict], mem: dict, checks: list[str], arms: Sequence[str], meta: dict,
           fmt: dict | None = None) -> str:
    """docs/ablations.md as text (the figure is referenced when meta["figure"] is set; `fmt`, from
    `format_stats`, adds the training-format table)."""
    L = ["<!-- Generated by scripts/ablate.py; every run of the script overwrites this file. -->",
         "# Recipe ablation and memory reuse (toy)", "",
         "Arms of the paper's recipe ablation (§4, Fig. 5) trained from the same SFT start per seed, "
         "with the same steps, data order and held-out questions, and the memory-reuse evaluation "
         "(Fig. 6d, `scripts/memory_eval.py`). Numbers are held-out answer scores (toy judge, static "
         "rubrics, 0-1) minus the same run's SFT start; 95 % intervals are percentile bootstraps "
         "over seeds x held-out questions.", "",
         f"- command: `{meta['command']}`{meta.get('command_note', '')}", f"- commit: {meta['commit']}",
         f"- date (UTC): {meta['date']}", f"- machine: {meta['machine']}",
         f"- torch threads per run: {meta['threads']}", f"- grid: {meta['grid']}", ""]
    fs = final_step(rows)
    L += ["## Final held-out answer score minus the SFT start", ""]
    if fs is None:
        L += ["No finished runs yet: `python scripts/ablate.py` fills this section.", ""]
    else:
        L += [f"At RL step {fs} (the last step every run evaluated); the mean-stage score is the mean "
              "of the four stage scores.", "",
              "| arm | paper's name | seeds | SFT answer | final answer | final - SFT [95% CI] "
              "| mean-stage final - SFT [95% CI] |", "|---|---|---|---|---|---|---|"]
        for a in arms:
            rs = [r for r in rows if r["arm"] == a and r["step"] == fs]
            if not rs:
                L.append(f"| `{a}` | {PAPER_NAMES[a]} | 0 | | | not run | |")
                continue
            m, lo, hi = arm_stats(rows, a, fs)
            sm, slo, shi = pooled_stats(rows, a, fs, "per_question_score_delta")
            L.append(f"| `{a}` | {PAPER_NAMES[a]} | {len(rs)} | {np.mean([r['answer_sft'] for r in rs]):.3f} "
                     f"| {np.mean([r['answer'] for r in rs]):.3f} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                     f"| {sm:+.3f} [{slo:+.3f}, {shi:+.3f}] |")
        L.append("")
        d = paired_difference(rows, "rubricem", "baseline_rl", fs)
        if d is not None:
            L += ["RubricEM minus Baseline RL at the final step, paired by seed and held-out question "
                  f"(same SFT start, questions and sampling seed): answer score {d['answer'][0]:+.3f} "
                  f"[{d['answer'][1]:+.3f}, {d['answer'][2]:+.3f}], mean-stage score "
                  f"{d['score'][0]:+.3f} [{d['score'][1]:+.3f}, {d['score'][2]:+.3f}].", ""]
    if fs is not None:
        L += render_curve(rows, arms, fs)
    if meta.get("figure"):
        L += [f"![held-out answer score minus SFT start per RL step]({meta['figure']})", ""]
    if fs is not None:
        L += render_reflection_update(rows)
    if meta.get("scaffold") or any(r["arm"] == UNSTRUCTURED for r in rows):
        L += render_scaffold(rows, fs)
    if meta.get("paper_sft") or any(r["arm"] in PAPERSFT for r in rows):
        L += render_papersft(rows, fs)
    if fmt:
        L += ["## Format during RL", "",
              "`rollout/well_formed` of the training rollouts (share of a step's rollouts with every "
              f"stage block) over all RL steps of all seeds; the toy target is >= {WF_FLOOR} at every step.",
              "", "| arm | paper's name | seeds | lowest | mean over steps | steps below "
              f"{WF_FLOOR} |", "|---|---|---|---|---|---|"]
        for a, f in fmt.items():
            L.append(f"| `{a}` | {PAPER_NAMES[a]} | {f['seeds']} | {f['lowest']:.2f} | {f['mean']:.3f} "
                     f"| {f['below']} of {f['steps']} |")
        L.append("")
    L += render_memory(mem, arms) + render_content(mem)
    L += ["## Paper findings", ""]
    if fs is None:
        L += ["To be filled by a real run: for each finding the script writes reproduced / not "
              "reproduced / inconclusive (CIs overlap) from the numbers above.", ""]
    else:
        for lo_arm, hi_arm in ORDER_FINDINGS:
            d = paired_curve_difference(rows, hi_arm, lo_arm)
            v = "not run" if d is None else sign_verdict(d["answer"], +1)
            L.append(f"- {PAPER_NAMES[lo_arm]} < {PAPER_NAMES[hi_arm]} (Fig. 5; curve average of the "
                     f"held-out answer gain, paired): **{v}**")
        for a, p, sign, paper in MEMORY_FINDINGS:
            v = sign_verdict(memory_stats(mem, a, p), sign)
            hits = [x[p]["hits"] for (b, _), x in mem.items() if b == a]
            if hits and max(hits) == 0:  # nothing was in the prompts: no memory to reuse
                v = "not measured (no bank item retrieved)"
            word = "helps" if sign > 0 else "does not help"
            L.append(f"- memory reuse {word} {PAPER_NAMES[a]} at "
                     f"{'cross-episode pass 1' if p == 'pass1' else 'within-episode pass 2'} "
                     f"(paper {paper} points): **{v}**")
        L.append("")
    L += render_goals(rows, mem)
    L += ["## Checks", ""] + [f"- {c}" for c in checks or ["no finished runs"]] + [""]
    return "\n".join(L)


# The paired comparisons the curve section prints: (higher arm in the paper, lower arm).
CURVE_PAIRS = (("rubricem", "baseline_rl"), ("ss_grpo", "baseline_rl"), ("meta_policy", "baseline_rl"),
               ("rubricem", "ss_grpo"), ("rubricem", "meta_policy"), ("ss_grpo", "baseline_rl_info"))


def render_curve(rows: list[dict], arms: Sequence[str], fs: int) -> list[str]:
    """The report's section on the paper's Fig. 5 metric: per arm the held-out answer score minus the
    SFT start averaged over the evaluated steps of the curve (`curve_stats`), and the paired
    differences of CURVE_PAIRS, each with the final-step figure beside it."""
    steps = curve_steps(rows)
    L = ["## Average gain over the training curve (the paper's Fig. 5 metric)", ""]
    if not steps:
        return L + ["No evaluated step after the SFT start yet.", ""]
    L += [f"Per held-out question, the answer score minus the SFT start averaged over the evaluated "
          f"steps {', '.join(map(str, steps))}; mean and 95 % interval over seeds x questions.", "",
          "| arm | paper's name | curve average [95% CI] | mean-stage curve average [95% CI] "
          "| final - SFT [95% CI] |", "|---|---|---|---|---|"]
    def ci(t: tuple) -> str:
        return f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]" if np.isfinite(t[0]) else "n/a"

    for a in arms:
        if not any(r["arm"] == a for r in rows):
            continue
        L.append(f"| `{a}` | {PAPER_NAMES[a]} | {ci(curve_stats(rows, a))} "
                 f"| {ci(curve_stats(rows, a, 'per_question_score_delta'))} | {ci(arm_stats(rows, a, fs))} |")
    L += ["", "Paired by seed and held-out question (same SFT start, data order, questions and "
          "sampling seed):", ""]
    for a, b in CURVE_PAIRS:
        d = paired_curve_difference(rows, a, b)
        if d is None:
            continue
        final = mean_ci(paired_final(rows, a, b, fs))
        L.append(f"- {PAPER_NAMES[a]} minus {PAPER_NAMES[b]}: curve average answer {ci(d['answer'])}, "
                 f"mean-stage {ci(d['score'])}; at step {fs}: answer {ci(final)}")
    return L + [""]


def paired_final(rows: list[dict], a: str, b: str, step: int) -> list[float]:
    """Per (seed, question), arm a's held-out answer gain at `step` minus arm b's ([] when a seed
    lacks either arm)."""
    diffs = []
    for seed in sorted({r["seed"] for r in rows if r["arm"] in (a, b)}):
        ra = [r for r in rows if r["arm"] == a and r["seed"] == seed and r["step"] == step]
        rb = [r for r in rows if r["arm"] == b and r["seed"] == seed and r["step"] == step]
        if not ra or not rb or len(ra[0]["per_question_delta"]) != len(rb[0]["per_question_delta"]):
            return []
        diffs += (np.asarray(ra[0]["per_question_delta"]) - np.asarray(rb[0]["per_question_delta"])).tolist()
    return diffs


def render_scaffold(rows: list[dict], fs: int | None) -> list[str]:
    """The report's scaffold-ablation section (Fig. 6a-c): structured vs unstructured Baseline RL
    after SFT (step 0) and after RL (step `fs`), held-out answer score and fact recall, mean and 95 %
    interval over seeds x questions, and a verdict per paper finding (`order_verdict`)."""
    L = ["## Scaffold ablation: structured vs unstructured after SFT and after RL (Fig. 6a-c)", "",
         "Baseline RL (terminal Answer score, no reflection, no bank) on the four-stage scaffold and "
         "on an unstructured one (think / tool call / answer, ReAct-like), each from its own SFT "
         "start (the same scripted teacher without plan and review: same error rates, searches and "
         "answers; same SFT budget and seed), with the same steps, data order and held-out "
         "questions; both graded by the same answer rubrics of the toy judge.", ""]
    if fs is None or not any(r["arm"] == UNSTRUCTURED for r in rows):
        return L + ["Not run yet: `python scripts/ablate.py --scaffold` fills this section.", ""]
    L += [f"At RL step {fs} (after RL) and step 0 (after SFT).", "",
          "| scaffold | run | seeds | answer after SFT [95% CI] | answer after RL [95% CI] "
          "| RL - SFT [95% CI] | fact recall after SFT | fact recall after RL |",
          "|---|---|---|---|---|---|---|---|"]

    def cell(name: str, step: int, key: str, sign: str = "") -> str:
        m, lo, hi = pooled_stats(rows, name, step, key)
        return f"{m:{sign}.3f} [{lo:{sign}.3f}, {hi:{sign}.3f}]" if np.isfinite(m) else "n/a"

    for name, label in (("baseline_rl", "structured"), (UNSTRUCTURED, "unstructured")):
        n = len({r["seed"] for r in rows if r["arm"] == name and r["step"] == fs})
        cells = [cell(name, 0, "per_question_answer"), cell(name, fs, "per_question_answer"),
                 cell(name, fs, "per_question_delta", "+"), cell(name, 0, "per_question_fact_recall"),
                 cell(name, fs, "per_question_fact_recall")]
        L.append(f"| {label} | `{name}` | {n} | " + " | ".join(cells) + " |")
    L.append("")
    for text, key, at_sft in SCAFFOLD_FINDINGS:
        step = 0 if at_sft else fs
        v = order_verdict(pooled_stats(rows, UNSTRUCTURED, step, key),
                          pooled_stats(rows, "baseline_rl", step, key))
        L.append(f"- {text}: **{v}**")
    return L + [""]


def difference_verdict(a: tuple, b: tuple, a_name: str, b_name: str) -> str:
    """Verdict on "the two values differ" from two (mean, lo, hi) triples: "yes: larger on A" or
    "yes: larger on B" (intervals disjoint), "inconclusive (CIs overlap)", or "not run" when either
    is missing (NaN); the same rule as `order_verdict`, without a side the paper predicts."""
    v = order_verdict(b, a)
    return {"reproduced": f"yes: larger on {a_name} (CIs disjoint)",
            "not reproduced": f"yes: larger on {b_name} (CIs disjoint)"}.get(v, v)


def render_papersft(rows: list[dict], fs: int | None) -> list[str]:
    """The report's SFT-confound section (--paper-sft): RubricEM and Baseline RL from the toy's
    default SFT start and from the paper-style one (no reflection and memory examples); per (start,
    arm) the held-out answer score after SFT (step 0) and after RL (step `fs`), the RL gain and the
    mean-stage RL gain (mean and 95 % interval over seeds x questions); per start RubricEM minus
    Baseline RL of the RL gain, paired by seed and question (`paired_difference`); a verdict on
    whether the reflection SFT changes RubricEM's gain (`difference_verdict`) and on the paper's
    order RubricEM > Baseline RL on the paper-style start (`sign_verdict`)."""
    toy = presets.toy_preset()
    L = ["## SFT without reflection and memory examples (the paper's SFT set)", "",
         "The toy's default SFT set holds, besides the teacher's research trajectories, reflection "
         f"examples (`sft.n_reflections`, toy default {toy.sft.n_reflections}) and retrieved memory in "
         f"a share of the SFT prompts (`teacher.p_memory`, toy default {toy.teacher.p_memory:g}); the "
         "paper's SFT set has neither (teacher trajectories only: its backbone writes reflections "
         "from pre-training). The default keeps them because the tiny policy has no pre-trained "
         "ability to write a lesson or to use a retrieved one. Here RubricEM and Baseline RL also "
         "start from a warm start trained without them (`" + " ".join(PAPER_SFT_SET) + "`; "
         "otherwise the same teacher, SFT budget and seed), with the same RL steps, data order and "
         "held-out questions as the default-SFT runs. Memory reuse (`scripts/memory_eval.py`) is not "
         "run for the paper-style runs.", ""]
    if fs is None or not any(r["arm"] in PAPERSFT for r in rows):
        return L + ["Not run yet: `python scripts/ablate.py --paper-sft` fills this section.", ""]
    starts = (("toy default SFT", "rubricem", "baseline_rl"),
              ("paper-style SFT", "rubricem-papersft", "baseline_rl-papersft"))
    L += [f"At RL step {fs} (after RL) and step 0 (after SFT); the RL gain is the answer score after "
          "RL minus the same run's after SFT, the mean-stage gain that of the mean of the four stage "
          "scores.", "",
          "| SFT start | arm | run | seeds | answer after SFT [95% CI] | answer after RL [95% CI] "
          "| RL gain [95% CI] | mean-stage RL gain [95% CI] |", "|---|---|---|---|---|---|---|---|"]

    def cell(name: str, step: int, key: str, sign: str = "") -> str:
        m, lo, hi = pooled_stats(rows, name, step, key)
        return f"{m:{sign}.3f} [{lo:{sign}.3f}, {hi:{sign}.3f}]" if np.isfinite(m) else "n/a"

    for start, *names in starts:
        for name in names:
            n = len({r["seed"] for r in rows if r["arm"] == name and r["step"] == fs})
            arm = PAPERSFT.get(name, name)
            cells = [cell(name, 0, "per_question_answer"), cell(name, fs, "per_question_answer"),
                     cell(name, fs, "per_question_delta", "+"),
                     cell(name, fs, "per_question_score_delta", "+")]
            L.append(f"| {start} | {PAPER_NAMES[arm]} | `{name}` | {n} | " + " | ".join(cells) + " |")
    L += ["", "RubricEM minus Baseline RL of the RL gain at the final step, paired by seed and held-out "
          "question (both from the same SFT start, questions and sampling seed):", ""]
    paired = {}
    for start, a, b in starts:
        d = paired[start] = paired_difference(rows, a, b, fs)
        L.append(f"- {start}: " + ("not run (a seed lacks either run)" if d is None else
                 f"answer score {d['answer'][0]:+.3f} [{d['answer'][1]:+.3f}, {d['answer'][2]:+.3f}], "
                 f"mean-stage score {d['score'][0]:+.3f} [{d['score'][1]:+.3f}, {d['score'][2]:+.3f}]"))
    v = difference_verdict(arm_stats(rows, "rubricem", fs), arm_stats(rows, "rubricem-papersft", fs),
                           "the toy default SFT start", "the paper-style SFT start")
    d = paired["paper-style SFT"]
    L += ["", "- the reflection SFT changes RubricEM's RL gain (CIs of the gain on the two starts): "
          f"**{v}**",
          "- RubricEM > Baseline RL on the paper-style SFT start (RL gain, paired difference; the "
          f"paper's order, Fig. 5): **{'not run' if d is None else sign_verdict(d['answer'], +1)}**"]
    return L + [""]


def half_width(stat: tuple | None) -> float:
    """(hi - lo) / 2 of a (mean, lo, hi) triple: the half-width of its 95 % interval, in the units
    of the values; NaN for a missing one (None or NaN)."""
    return float("nan") if stat is None else (stat[2] - stat[1]) / 2


def ci_text(stat: tuple | None) -> str:
    """A (mean, lo, hi) triple as "+0.030 [+0.003, +0.058] (half-width 0.028)"; "not run" for a
    missing one (None or a NaN mean)."""
    if stat is None or not np.isfinite(stat[0]):
        return "not run"
    return f"{stat[0]:+.3f} [{stat[1]:+.3f}, {stat[2]:+.3f}] (half-width {half_width(stat):.3f})"


def memory_values(res: dict, p: str, kind: str = "delta") -> list[float] | None:
    """The per-question answer differences of one memory.json result: pass p ("pass1", "pass2"),
    kind "delta" (with minus without memory) or "own_minus_foreign" (pass 2's own lesson minus
    another question's of the same form); None when the result lacks them (an evaluation without
    that pass, or written before the foreign-lesson control existed)."""
    v = res.get(p, {}).get(kind, {}).get("answer_per_question")
    return None if v is None else list(v)


def memory_stats(mem: dict, arm: str, p: str, kind: str = "delta") -> tuple[float, float, float]:
    """(mean, lo, hi) of `memory_values` of run `arm` (pass p, kind), pooled over its seeds x
    questions; all NaN when none has them."""
    return mean_ci([d for (a, _), v in mem.items() if a == arm for d in memory_values(v, p, kind) or []])


def oracle_stats(mem: dict, arm: str, who: str, control: str = "oracle") -> tuple[float, float, float]:
    """(mean, lo, hi) of a memory control's with-minus-without answer difference of the arm's runs
    (control: "oracle", the oracle-lesson control, or "attempt", the attempt-lesson control; who:
    "sft", the SFT start, or "final", the trained policy), pooled over seeds x questions; NaN when
    no memory evaluation ran the control."""
    return mean_ci([d for (a, _), v in mem.items() if a == arm and who in v.get(control, {})
                    for d in v[control][who]["delta"]["answer_per_question"]])


def paired_memory_difference(mem: dict, a: str, b: str, p: str,
                             kind: str = "delta") -> tuple[float, float, float] | None:
    """(mean, lo, hi): run a's memory effect in pass p minus run b's (kind "delta": with minus
    without memory; "own_minus_foreign": pass 2's own lesson minus a foreign one), paired by seed
    and held-out question (the same questions and sampling seeds); None when a seed lacks either
    run or its values (`memory_values`)."""
    diffs = []
    for seed in sorted({s for (x, s) in mem if x in (a, b)}):
        if (a, seed) not in mem or (b, seed) not in mem:
            return None
        va, vb = memory_values(mem[(a, seed)], p, kind), memory_values(mem[(b, seed)], p, kind)
        if va is None or vb is None or len(va) != len(vb):
            return None
        diffs += (np.asarray(va) - np.asarray(vb)).tolist()
    return mean_ci(diffs) if diffs else None


def memory_runs(mem: dict, start: str) -> list[str]:
    """The runs of warm start `start` with a memory evaluation, MEMORY_ARMS first, in its order."""
    names = dict.fromkeys([*MEMORY_ARMS, *(a for a, _ in mem)])
    return [n for n in names if variant(n).start == start and any(a == n for a, _ in mem)]


def _starts_of(names) -> list[str]:
    """The STARTS keys of the runs `names`, in STARTS order."""
    have = {variant(n).start for n in names}
    return [st for st in STARTS if st in have]


# The memory contrasts at pass 2, own minus foreign, per warm start: (run a, run b) as bases.
MEMORY_PAIRS = (("rubricem", "baseline_rl"), ("exposure", "baseline_rl"), ("rubricem", "exposure"))


def render_memory_controls(mem: dict) -> list[str]:
    """The memory section's control and comparison lines: the oracle-lesson control (what a lesson
    can do at most: each warm start and each run's final policy with toy.sft.oracle_lesson in the
    prompt, minus without), the attempt-lesson control (pass 2's ceiling: ToyJudge.attempt_lesson
    on the policy's own first attempt), RubricEM's pass-1 and pass-2 memory effects minus Baseline
    RL's, and per warm start the MEMORY_PAIRS contrasts of pass 2 own minus foreign, paired by seed
    and question (the toy start's always, "not run" when missing), each with its half-width."""
    L = []
    for control, name, what in (
            ("oracle", "Oracle-lesson", "every asked fact named as missed, each old record's value "
             "named as wrong, from ground truth"),
            ("attempt", "Attempt-lesson", "pass 2's ceiling: a perfect reflection on the policy's own "
             "first attempt, naming only the facts it missed or got wrong, from ground truth")):
        for start in _starts_of(a for a, _ in mem):
            # every run of a seed on one start shares its warm start: the first run's control
            sft = oracle_stats(mem, memory_runs(mem, start)[0], "sft", control)
            where = "" if start == "toy" else f" of the {STARTS[start].label}"
            if np.isfinite(sft[0]):
                L.append(f"- {name} control, SFT start{where} ({what}): answer {ci_text(sft)}")
        for a in dict.fromkeys([*MEMORY_ARMS, *(x for x, _ in mem)]):
            f = oracle_stats(mem, a, "final", control)
            if np.isfinite(f[0]):
                L.append(f"- {name} control, {PAPER_NAMES.get(a, a)} after RL: answer {ci_text(f)}")
    for p, label in (("pass2", "within-episode pass 2"), ("pass1", "cross-episode pass 1")):
        d = paired_memory_difference(mem, "rubricem", "baseline_rl", p)
        if d is not None:
            L.append(f"- RubricEM's memory effect minus Baseline RL's at {label}, paired by seed and "
                     f"question: answer {ci_text(d)}")
    for start in ["toy", *(st for st in _starts_of(a for a, _ in mem) if st != "toy")]:
        for a, b in MEMORY_PAIRS:
            ra, rb = sibling(a, start), sibling(b, start)
            if ra is None or rb is None:
                continue
            d = paired_memory_difference(mem, ra, rb, "pass2", "own_minus_foreign")
            where = "" if start == "toy" else f"{STARTS[start].label}: "
            L.append(f"- {where}{SHORT_NAMES[a]}'s memory effect minus {SHORT_NAMES[b]}'s at "
                     f"within-episode pass 2 (own minus foreign): answer {ci_text(d)}; runs `{ra}` - "
                     f"`{rb}`, paired by seed and question")
    return L + ([""] if L else [])


def render_memory(mem: dict, arms: Sequence[str]) -> list[str]:
    """The memory-reuse section (Fig. 6d with the randomised control): per run with a memory
    evaluation (`arms` first), pass 1 and pass 2 with minus without memory and pass 2 own lesson
    minus a foreign one (another question's lesson of the same form: what the lesson says of this
    question, beyond its form), pooled over seeds x questions with 95 % intervals and half-widths,
    and the share of questions that received an item; then `render_memory_controls`."""
    L = ["## Memory reuse (with minus without memory, answer score)", ""]
    if not mem:
        return L + ["No memory evaluations yet.", ""]
    L += ["Pass 2 own - foreign: the same pass with another question's lesson (the same form, "
          "written the same way) in place of the question's own: what the lesson says about this "
          "question, beyond a lesson's presence. Half-width: (hi - lo) / 2 of the 95 % interval.", "",
          "| run | seeds | pass 1 similar [95% CI] | pass 1 hits | pass 2 exact [95% CI] | pass 2 hits "
          "| pass 2 own - foreign [95% CI] |", "|---|---|---|---|---|---|---|"]
    for a in dict.fromkeys([*arms, *MEMORY_ARMS, *(x for x, _ in mem)]):
        ms = [v for (x, _), v in mem.items() if x == a]
        if not ms:
            continue
        cells = []
        for p in ("pass1", "pass2"):
            hits = [x[p]["hits"] for x in ms if p in x]
            cells += [ci_text(memory_stats(mem, a, p)), f"{np.mean(hits):.2f}" if hits else "n/a"]
        cells.append(ci_text(memory_stats(mem, a, "pass2", "own_minus_foreign")))
        L.append(f"| `{a}` | {len(ms)} | " + " | ".join(cells) + " |")
    return L + [""] + render_memory_controls(mem)


def _content_values(c: dict, key: str) -> list[float]:
    """Per-question values of one content_control result: key "index" (the content index) or
    "foreign" (another question's lesson minus none, answer score)."""
    return list(c["per_question"] if key == "index" else c["foreign"]["delta"]["answer_per_question"])


def content_stats(mem: dict, name: str, key: str) -> tuple[float, float, float]:
    """(mean, lo, hi) of `_content_values` of run `name`'s trained policy (memory.json "content"
    "final"), pooled over its seeds x questions; all NaN when none ran the control."""
    return mean_ci([d for (a, _), v in mem.items() if a == name and "final" in v.get("content", {})
                    for d in _content_values(v["content"]["final"], key)])


def start_content(mem: dict, start: str, key: str) -> tuple[tuple[float, float, float], int, bool]:
    """((mean, lo, hi), seeds, identical) of `_content_values` of warm start `start`'s SFT-start
    control (memory.json "content" "sft"). Every memory-evaluated run of a seed on one start
    controls the same warm start on the same questions with the same sampling seed, so we take
    one run's values per seed (the first of `memory_runs`) and pool them over seeds x questions;
    identical: whether the runs of every seed agree (False points at a changed setting)."""
    per_seed: dict[int, list] = {}
    for name in memory_runs(mem, start):
        for (a, seed), v in sorted(mem.items(), key=lambda kv: kv[0][1]):
            if a == name and "sft" in v.get("content", {}):
                per_seed.setdefault(seed, []).append(_content_values(v["content"]["sft"], key))
    same = all(all(x == vs[0] for x in vs) for vs in per_seed.values())
    return mean_ci([d for s in sorted(per_seed) for d in per_seed[s][0]]), len(per_seed), same


def content_starts(mem: dict) -> list[str]:
    """The warm starts (STARTS order) with a content control in some run's memory.json."""
    return [st for st in _starts_of(a for a, _ in mem)
            if any(v.get("content") for (a, _), v in mem.items() if variant(a).start == st)]


CONTENT_GOAL = 0.2  # the content index a warm start should reach: its reader acts on a lesson's facts


def render_content(mem: dict) -> list[str]:
    """The section "Does the policy read a lesson's content?": per warm start, the content index and
    the foreign-lesson effect of its SFT start (`start_content`) and of each memory-evaluated run's
    trained policy (`content_stats`), with 95 % intervals and half-widths."""
    L = ["## Does the policy read a lesson's content?", "",
         "Content index (`scripts/memory_eval.py`, `content_control`): each held-out question's asked "
         "facts are split at random into halves A and B; the policy answers with a lesson naming the "
         "facts of A as missed and, with the same sampling seed, with one naming those of B (the "
         "same form and general clause). Per fact, the share of samples stating it when its lesson "
         "names it minus when the other half's does, averaged per question: 0 for a policy that "
         "reacts to a lesson's form only, up to 1 for one that writes exactly the named facts "
         f"(goal: >= {CONTENT_GOAL} at every warm start). Foreign lesson: another question's lesson "
         "of the same form against no lesson (answer score). The SFT start: one control per seed "
         "(the runs of a seed share it), pooled over seeds x questions; after RL: each run, pooled "
         "over its seeds x questions.", ""]
    starts = content_starts(mem)
    if not starts:
        return L + ["Not run yet: the memory evaluations with the controls (`scripts/memory_eval.py "
                    "--oracle`, which `python scripts/ablate.py` runs) fill this section.", ""]
    L += ["| warm start | policy | seeds | content index [95% CI] | foreign lesson - none, answer "
          "[95% CI] |", "|---|---|---|---|---|"]
    notes = []
    for start in starts:
        idx, n, same = start_content(mem, start, "index")
        foreign = start_content(mem, start, "foreign")[0]
        L.append(f"| {STARTS[start].label} | SFT start | {n} | {ci_text(idx)} | {ci_text(foreign)} |")
        if not same:
            notes.append(f"- {STARTS[start].label}: the SFT-start controls of one seed's runs "
                         "differ (identical: NO); the table takes the first run's")
        for name in memory_runs(mem, start):
            n = sum(1 for (a, _), v in mem.items() if a == name and "final" in v.get("content", {}))
            if n:
                L.append(f"| {STARTS[start].label} | `{name}` after RL | {n} "
                         f"| {ci_text(content_stats(mem, name, 'index'))} "
                         f"| {ci_text(content_stats(mem, name, 'foreign'))} |")
    return L + [""] + notes + ([""] if notes else [])


# The reflection update's contrasts (curve average, paired): (run a, run b) as bases, per warm start.
REFLECTION_PAIRS = (("rubricem", "ss_grpo"), ("rubricem", "rubricem-c0"), ("rubricem", "exposure"),
                    ("exposure", "ss_grpo"))


def render_reflection_update(rows: list[dict]) -> list[str]:
    """The section "The reflection update": curve-average paired differences (`paired_curve_difference`)
    of REFLECTION_PAIRS, per warm start (runs compared only with runs from their own start; the
    toy start's lines always, "not run" when missing; another start's when it has runs), each with
    its 95 % interval and half-width."""
    c = presets.toy_preset().reflection.loss_coef
    L = ["## The reflection update", "",
         "The deferred reflection update runs inside the task update's optimizer steps: one step "
         "takes the gradient of L_task + L_reflect, the reflection candidates' advantages weighted "
         f"by c = `reflection.loss_coef` (toy default {c:g}). Against SS-GRPO (stage-wise advantages, "
         "no reflection, no bank), against `rubricem-c0` (`reflection.loss_coef=0`), against "
         "exposure-only (`exposure`: `reflection.train=false`, the bank and memory in the prompts "
         "stay, no reflection GRPO), and exposure-only against SS-GRPO (memory in the prompts "
         "alone). Curve average of the held-out answer gain (the Fig. 5 metric), paired by seed and "
         "held-out question; the mean-stage score likewise.", ""]
    names = {r["arm"] for r in rows}
    for start in ["toy", *(st for st in _starts_of(names) if st != "toy")]:
        for a, b in REFLECTION_PAIRS:
            ra, rb = sibling(a, start), sibling(b, start)
            if ra is None or rb is None:
                continue
            d = paired_curve_difference(rows, ra, rb)
            where = "" if start == "toy" else f"{STARTS[start].label}: "
            L.append(f"- {where}{SHORT_NAMES[a]} minus {SHORT_NAMES[b]} (`{ra}` - `{rb}`): curve "
                     f"average answer {ci_text(d and d['answer'])}, mean-stage {ci_text(d and d['score'])}")
    return L + [""]


def goal_line(text: str, stat: tuple | None, met: bool) -> str:
    """One line of the goals block: "- TEXT: **met**, " / "**not met**, " and the value, its 95 %
    interval and half-width (`ci_text`), or "**not run**" when `stat` is missing (None or NaN)."""
    if stat is None or not np.isfinite(stat[0]):
        return f"- {text}: **not run**"
    return f"- {text}: **{'met' if met else 'not met'}**, {ci_text(stat)}"


def render_goals(rows: list[dict], mem: dict) -> list[str]:
    """The goals block: the content index >= CONTENT_GOAL at the SFT start of every warm start with
    a content control (on its mean), and, each on its 95 % interval lying above 0: RubricEM minus
    SS-GRPO, RubricEM's pass-2 own-minus-foreign memory effect minus Baseline RL's, RubricEM minus
    Baseline RL and SS-GRPO minus Baseline RL (curve averages on the toy start, paired)."""
    L = ["## Goals", "",
         f"A content index goal is met when the mean reaches {CONTENT_GOAL}; a difference goal when "
         "its 95 % interval lies above 0.", ""]
    starts = content_starts(mem)
    for start in starts or ["toy"]:
        idx = start_content(mem, start, "index")[0]
        L.append(goal_line(f"content index >= {CONTENT_GOAL} at the SFT start ({STARTS[start].label})",
                           idx, bool(idx[0] >= CONTENT_GOAL)))

    def above(d: tuple | None) -> bool:
        return d is not None and bool(d[1] > 0)

    d = paired_curve_difference(rows, "rubricem", "ss_grpo")
    L.append(goal_line("RubricEM minus SS-GRPO, curve average, CI above 0", d and d["answer"],
                       above(d and d["answer"])))
    m = paired_memory_difference(mem, "rubricem", "baseline_rl", "pass2", "own_minus_foreign")
    L.append(goal_line("RubricEM's pass-2 (own minus foreign) memory effect minus Baseline RL's, CI "
                       "above 0", m, above(m)))
    for a in ("rubricem", "ss_grpo"):
        d = paired_curve_difference(rows, a, "baseline_rl")
        L.append(goal_line(f"{SHORT_NAMES[a]} minus Baseline RL, curve average, CI above 0",
                           d and d["answer"], above(d and d["answer"])))
    return L + [""]


def write_report(grid: str, arms: Sequence[str], seeds: Sequence[int], doc: str, meta: dict) -> str:
    """Collect the finished runs, write GRID/results.jsonl, the figure next to `doc` and `doc`
    (`arms`: arms and variant names; meta["scaffold"]: the UNSTRUCTURED runs too, drawn in the figure
    as a line of their own; meta["paper_sft"]: the PAPERSFT runs too, drawn dashed)."""
    scaffold, paper_sft = bool(meta.get("scaffold")), bool(meta.get("paper_sft"))
    rows, mem, checks = collect(grid, arms, seeds, scaffold, paper_sft)
    runs = grid_runs(arms, scaffold, paper_sft)
    png = os.path.splitext(doc)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(doc)), exist_ok=True)
    if rows:
        plot(rows, runs, png)
        meta = {**meta, "figure": os.path.basename(png)}
    fmt = format_stats(grid, runs, seeds)
    text = render(rows, mem, checks, arms, meta, fmt)
    ckpt_mod.atomic_write_bytes(doc, text.encode("utf-8"))
    return text


def threads_of(grid: str, arms: Sequence[str], seeds: Sequence[int], sets: Sequence[str]) -> str:
    """The torch thread count the runs used (their config.json), else what --set asks for."""
    seen = set()
    for a in arms:
        for s in seeds:
            p = os.path.join(run_dir(grid, a, s), "config.json")
            if os.path.exists(p):
                seen.add(json.load(open(p)).get("threads"))
    if seen:
        return ", ".join(str(t) for t in sorted(seen, key=str))
    asked = [s.split("=", 1)[1] for s in sets if s.startswith("threads=")]
    return asked[-1] if asked else str(presets.toy_preset().threads)


# ----------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="arms x seeds ablation grid (paper Fig. 5 and 6d)")
    ap.add_argument("--arms", default=",".join(ARM_ORDER),
                    help=f"comma-separated arms and variants (default: every arm, {','.join(ARM_ORDER)}; "
                         f"variants: {','.join(VARIANTS)})")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; --quick: 0,1)")
    ap.add_argument("--steps", type=int, help="RL steps of every run (default: the toy preset's; "
                    f"--quick: {QUICK_STEPS})")
    ap.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (default: "
                    "steps // 6, at least 1)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and held-out questions, a small "
                    "SFT start: " + " ".join(QUICK_SET))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override passed to every run (after --quick's), repeatable")
    ap.add_argument("--out", default="runs/ablate", help="grid directory (default runs/ablate)")
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "ablations.md"),
                    help="report to write (the figure goes next to it as .png; default docs/ablations.md)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory-reuse evaluations")
    ap.add_argument("--scaffold", action="store_true", help="also the scaffold ablation (Fig. 6a-c): "
                    "per seed, Baseline RL on the unstructured scaffold (its own SFT start) beside "
                    "the structured baseline_rl run, which is added to --arms if missing")
    ap.add_argument("--paper-sft", action="store_true", help="also the SFT-confound ablation: per "
                    "seed, rubricem and baseline_rl from a warm start trained without reflection and "
                    "memory examples (" + " ".join(PAPER_SFT_SET) + ", as the paper's SFT set; the "
                    "first such run trains it, about 45 min on 2 cores) beside the default-SFT "
                    "rubricem and baseline_rl runs, which are added to --arms if missing")
    ap.add_argument("--render-only", action="store_true", help="only rewrite the report from the "
                    "finished runs in --out")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1); set each run's "
                    "threads with --set threads=T --set sample_threads=1 so jobs x T fits the cores")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    a.arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in a.arms if x not in settings.ARMS and x not in VARIANTS]
    if bad:
        ap.error(f"unknown arms {bad}; choose from the arms {ARM_ORDER} and the variants {list(VARIANTS)}")
    if a.scaffold and "baseline_rl" not in a.arms:
        a.arms.append("baseline_rl")  # the structured side of the scaffold comparison
    for arm in dict.fromkeys(PAPERSFT.values()) if a.paper_sft else ():
        if arm not in a.arms:
            a.arms.append(arm)  # the default-SFT side of the SFT-confound comparison
    a.seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else (QUICK_SEEDS if a.quick else [0, 1, 2])
    a.steps = a.steps or (QUICK_STEPS if a.quick else presets.toy_preset().steps)
    a.eval_every = a.eval_every or max(1, a.steps // 6)
    a.sets = (QUICK_SET if a.quick else []) + a.set
    try:  # a bad override stops here, before any run starts (a variant's with its own after them)
        for name in grid_runs(a.arms, a.scaffold, a.paper_sft):
            overrides.apply_overrides(presets.toy_preset(), [*a.sets, *variant(name).sets])
    except ValueError as e:
        ap.error(str(e))
    return a


def label_model_start(sets: Sequence[str]) -> None:
    """With a grid override `model=DIR` (every run starts from the warm start in DIR, e.g. one that
    scripts/build_warm_start.py wrote), the report names that start instead of the toy's default
    SFT: STARTS["toy"]'s label becomes "warm start DIR"."""
    for s in sets:
        key, _, value = s.partition("=")
        path = value.strip().strip("'\"").strip()
        if key.strip() == "model" and path:
            STARTS["toy"] = dataclasses.replace(STARTS["toy"], label=f"warm start {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 every run finished, 1 some run failed (the report covers the others)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["memory"]:
        ap = argparse.ArgumentParser(prog="ablate.py memory", description="memory reuse of one run")
        ap.add_argument("--run-dir", required=True)
        a, rest = ap.parse_known_args(argv[1:])
        return memory_eval.main([a.run_dir, *rest])
    a = parse_args(argv)
    label_model_start(a.sets)
    t0 = time.perf_counter()
    status = {"failed": []}
    if not a.render_only:
        status = run_grid(a.out, a.arms, a.seeds, a.steps, a.eval_every, a.sets,
                          memory=not a.no_memory, progress=not a.no_progress, scaffold=a.scaffold,
                          jobs=a.jobs, paper_sft=a.paper_sft)
    meta = {"command": "python scripts/ablate.py " + shlex.join(argv), "commit": commit(),
            "command_note": " (the report of finished runs: the same command without `--render-only` "
                            "trains them)" if a.render_only else "",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "machine": machine(), "threads": threads_of(a.out, a.arms, a.seeds, a.sets),
            "scaffold": a.scaffold, "paper_sft": a.paper_sft,
            "grid": f"arms {','.join(a.arms)}"
                    f"{' + baseline_rl on the unstructured scaffold' if a.scaffold else ''}"
                    f"{' + rubricem and baseline_rl from the paper-style SFT' if a.paper_sft else ''}; "
                    f"seeds {','.join(map(str, a.seeds))}; {a.steps} RL "
                    f"steps; evaluation every {a.eval_every} steps; overrides "
                    f"{' '.join(a.sets) or 'none'}; run dirs under {a.out}"}
    write_report(a.out, a.arms, a.seeds, a.doc, meta)
    print(f"report: {a.doc}; results: {os.path.join(a.out, 'results.jsonl')} "
          f"({time.perf_counter() - t0:.0f} s)")
    if status["failed"]:
        print(f"failed: {', '.join(status['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
