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
    1. For each seed, then each arm (settings.ARMS), one subprocess
           train.py --toy --arm A --seed S --run-dir GRID/A-seedS --steps N --eval-every E --no-progress
       with the same --set overrides for all. Every arm of a seed loads the same cached SFT warm start
       (its cache key holds the world, teacher, SFT and model settings and the seed, not the arm),
       draws the same data order (DataOrder is seeded by the seed alone) and is evaluated on the same
       held-out questions with the same sampling seed (heldout.evaluate_heldout); the script checks that the SFT
       start (warm-start key and step-0 evaluation) is the same for every arm of a seed.
    2. Memory reuse (scripts/memory_eval.py) of the rubricem and baseline_rl runs, as subprocesses; an arm
       without a bank of its own reads the same seed's rubricem bank in pass 1.
    3. GRID/results.jsonl: one row per (arm, seed, evaluated step) with the answer score and its
       difference from the SFT start (step 0 of the same run), per question.
    4. The table (held-out answer-score difference from the SFT start at the final step: mean and 95 %
       percentile-bootstrap interval over seeds x questions), the figure (that difference against the
       RL step, one line per arm with its interval as a band) and the findings, into --doc.
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

Resumable: a run whose eval.json exists is done and never redone; a run dir with checkpoints
continues with --resume latest; memory.json marks a finished memory evaluation. Kill the grid at any
time and start the same command again.

Launch
    python scripts/ablate.py                                 # 5 arms x seeds 0,1,2, toy steps (hours)
    python scripts/ablate.py --quick                         # fewer steps, questions, smaller SFT
    python scripts/ablate.py --arms rubricem,baseline_rl --seeds 0 --steps 12 --set threads=1
    python scripts/ablate.py --arms baseline_rl --scaffold --quick   # scaffold ablation (Fig. 6a-c)
    python scripts/ablate.py --paper-sft --arms rubricem,baseline_rl --set threads=1 --set sample_threads=1
    python scripts/ablate.py --render-only                   # redraw the doc from GRID/results.jsonl
    python scripts/ablate.py memory --run-dir runs/toy       # memory reuse of one run (scripts/memory_eval.py)

Deviations from the paper
    1. Toy world, toy steps and toy sizes (train.py); seeds and their confidence intervals are ours
       (the paper reports single runs).
    2. A finding is called reproduced only when the two arms' 95 % intervals do not overlap and the
       order is the paper's; not reproduced when they do not overlap and the order is reversed;
       inconclusive when they overlap. For memory reuse the sign of the difference is judged the
       same way against 0.
"""
from __future__ import annotations

import argparse
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
MEMORY_ARMS = ("rubricem", "baseline_rl")  # the arms of the paper's memory-reuse figure
# The scaffold ablation (Fig. 6a-c, --scaffold): Baseline RL on the unstructured scaffold, run beside
# the structured baseline_rl run under this name (its run dir GRID/unstructured-seedS).
UNSTRUCTURED = "unstructured"
SCAFFOLD_SET = 'rollout.scaffold="unstructured"'
PAPER_NAMES[UNSTRUCTURED] = "Baseline RL, unstructured scaffold"
# Paper findings on the scaffold (Fig. 6a-c): (what is compared, results-row key, at the SFT start?).
SCAFFOLD_FINDINGS = (
    ("structured > unstructured after SFT (paper: DRB 43.0 vs 39.8)", "per_question_answer", True),
    ("structured > unstructured after RL", "per_question_answer", False),
    ("RL gain (RL - SFT) larger with the scaffold (paper: without it RL gains are small and "
     "unstable)", "per_question_delta", False))
# The SFT-confound ablation (--paper-sft): RubricEM and Baseline RL from a warm start trained without
# the toy's reflection examples and retrieved memory in the SFT prompts, as the paper's SFT set
# (teacher trajectories only), run beside the default-SFT runs under these names (run dirs
# GRID/<name>-seedS). PAPER_SFT_SET goes after the other overrides, so it wins.
PAPER_SFT_SET = ["sft.n_reflections=0", "teacher.p_memory=0"]
PAPERSFT = {"rubricem-papersft": "rubricem", "baseline_rl-papersft": "baseline_rl"}  # name -> arm
PAPER_NAMES["rubricem-papersft"] = "RubricEM, paper-style SFT"
PAPER_NAMES["baseline_rl-papersft"] = "Baseline RL, paper-style SFT"
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
    scaffold ("unstructured" for the UNSTRUCTURED run, else "structured"), the SFT set ("paper" for
    a PAPERSFT run, else "toy"), the answer score, score and fact recall, the answer score of the
    SFT start (the run's step-0 row) and the per-question answer scores, their differences from the
    SFT start and fact recalls. Raises ValueError when the curve has no step-0 row."""
    base = next((r for r in curve if r["step"] == 0), None)
    if base is None:
        raise ValueError(f"{arm}-seed{seed}: eval_curve.jsonl has no step-0 (SFT start) row")
    a0 = np.asarray(base["per_question"]["answer"])
    s0 = np.asarray(base["per_question"].get("score", []))
    out = []
    for r in curve:
        a = np.asarray(r["per_question"]["answer"])
        sc = np.asarray(r["per_question"].get("score", []))
        out.append({"per_question_score_delta": (sc - s0).tolist() if len(sc) == len(s0) else [],
                    "arm": arm, "seed": seed, "step": r["step"],
                    "scaffold": "unstructured" if arm == UNSTRUCTURED else "structured",
                    "sft_set": "paper" if arm in PAPERSFT else "toy",
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
    per_question_delta, per_question_fact_recall) of run `arm` (an arm, UNSTRUCTURED or a PAPERSFT
    name) at `step`, pooled over its seeds x questions; all NaN when there are none."""
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
    """The train.py command line of one (arm, seed); `--resume latest` when its run dir holds
    checkpoints (a half-finished run). arm UNSTRUCTURED: Baseline RL on the unstructured scaffold
    (--arm baseline_rl, SCAFFOLD_SET after the other overrides); a PAPERSFT name: its arm from the
    paper-style SFT set (PAPER_SFT_SET after the other overrides)."""
    rd = run_dir(grid, arm, seed)
    if arm == UNSTRUCTURED:
        cli_arm, sets = "baseline_rl", [*sets, SCAFFOLD_SET]
    elif arm in PAPERSFT:
        cli_arm, sets = PAPERSFT[arm], [*sets, *PAPER_SFT_SET]
    else:
        cli_arm = arm
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--toy", "--arm", cli_arm, "--seed",
           str(seed), "--run-dir", rd, "--steps", str(steps), "--eval-every", str(eval_every),
           "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    if ckpt_mod.list_checkpoints(rd):
        cmd += ["--resume", "latest"]
    return cmd


def memory_command(grid: str, arm: str, seed: int, arms: Sequence[str]) -> list[str]:
    """scripts/memory_eval.py for one run, with the oracle-lesson control (--oracle); an arm without
    reflection reads the same seed's rubricem bank."""
    rd = run_dir(grid, arm, seed)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "memory_eval.py"), rd, "--oracle"]
    other = os.path.join(run_dir(grid, "rubricem", seed), "bank.jsonl")
    if not settings.ARMS[arm].reflection and "rubricem" in arms and os.path.exists(other):
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
    """Train every (arm, seed) not yet done (with `scaffold`, also the UNSTRUCTURED run per seed;
    with `paper_sft`, the PAPERSFT runs per seed), then the memory evaluations; returns {"done":
    [...], "skipped": [...], "failed": [...]} of "arm-seedS" (memory: "memory:arm-seedS"). jobs:
    subprocesses at once (>= 1); each run's result does not depend on it (every run is its own
    process, seeded alone), its wall time does. The first PAPERSFT run trains the paper-style warm
    start (every seed shares it: sft.seed is not the run's seed), so it goes first and the other
    PAPERSFT runs go last and wait for it to end: the warm start is trained once, beside the others."""
    runs = list(arms) + ([UNSTRUCTURED] if scaffold else [])
    todo = [("train", a, s) for s in seeds for a in runs]
    paper = [("train", n, s) for s in seeds for n in PAPERSFT] if paper_sft else []
    todo = paper[:1] + todo + paper[1:]
    leader_done = threading.Event()  # the first PAPERSFT run ended (done, skipped or failed)
    if memory:
        todo += [("memory", a, s) for s in seeds for a in arms if a in MEMORY_ARMS]

    def finished(kind: str, a: str, s: int) -> bool:
        name = "eval.json" if kind == "train" else "memory.json"
        return os.path.exists(os.path.join(run_dir(grid, a, s), name))

    status = {"done": [], "skipped": [], "failed": []}
    n_done = sum(finished(*j) for j in todo)
    bar = tqdm(total=len(todo), initial=n_done, desc="ablation grid", disable=not progress,
               unit="run")
    def one(job: tuple) -> None:
        try:
            if job in paper[1:]:
                leader_done.wait()  # the paper-style warm start is in the cache (or its run failed)
            train_or_evaluate(job)
        finally:
            if paper and job == paper[0]:
                leader_done.set()

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
               else memory_command(grid, a, s, arms))
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
    """(results rows, memory results by (arm, seed), checks) from the finished runs (with
    `scaffold`, the UNSTRUCTURED runs too; with `paper_sft`, the PAPERSFT runs); writes
    GRID/results.jsonl. Checks: the SFT start is the same for every arm of a seed (warm-start cache
    key and the step-0 evaluation), the evaluations used the same settings, an unstructured run
    had its own warm start and the structured run's held-out questions and evaluation settings,
    and the PAPERSFT runs of a seed shared one warm start (key and step-0 evaluation) other than
    the main arms' (`_papersft_rows`)."""
    rows, mem, checks = [], {}, []
    for s in seeds:
        keys, base = {}, {}
        for a in arms:
            got = _finished_run(grid, a, s)
            if got is None:
                continue
            ev, curve = got
            keys[a] = _sft_key(ev)
            rd = run_dir(grid, a, s)
            try:
                rows += curve_rows(a, s, curve)
            except ValueError as e:  # e.g. eval.n_questions = 0: nothing to compare
                checks.append(f"{e}; left out")
                continue
            base[a] = (curve[0]["per_question"]["answer"], json.dumps(curve[0]["eval"]))
            mp = os.path.join(rd, "memory.json")
            if os.path.exists(mp):
                mem[(a, s)] = json.load(open(mp))
        if keys:
            checks.append(_shared_start(f"seed {s}: SFT warm start shared by {len(keys)} arms", keys, base))
        got = _finished_run(grid, UNSTRUCTURED, s) if scaffold else None
        if got is not None:
            more, lines = _unstructured_rows(got, s, keys.get("baseline_rl"), base.get("baseline_rl"))
            rows, checks = rows + more, checks + lines
        if paper_sft:
            more, lines = _papersft_rows(grid, s, keys, base)
            rows, checks = rows + more, checks + lines
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


def _unstructured_rows(got: tuple[dict, list[dict]], seed: int, key_structured: str | None,
                       base_structured: tuple | None) -> tuple[list[dict], list[str]]:
    """Results rows and checks of one seed's UNSTRUCTURED run: its own SFT warm start (a cache key
    other than the structured baseline_rl run's), the same number of held-out questions and the
    same evaluation settings (questions, samples, temperature) as that run."""
    ev, curve = got
    try:
        rows = curve_rows(UNSTRUCTURED, seed, curve)
    except ValueError as e:
        return [], [f"{e}; left out"]
    key = _sft_key(ev)
    line = (f"seed {seed}: unstructured scaffold: own SFT warm start (cache key {key[:12]}): "
            f"{'yes' if key != key_structured else 'NO'}")
    if base_structured is not None:
        same = _same_questions((curve[0]["per_question"]["answer"], json.dumps(curve[0]["eval"])),
                               base_structured)
        line += (f"; same held-out question count and evaluation settings as structured baseline_rl: "
                 f"{'yes' if same else 'NO'}")
    return rows, [line]


def _papersft_rows(grid: str, seed: int, main_keys: dict,
                   main_base: dict) -> tuple[list[dict], list[str]]:
    """Results rows and the check line of one seed's finished PAPERSFT runs (none: no line). The
    check: both runs loaded one warm start (cache key) and evaluated it identically at step 0 (the
    same per-question answer scores and evaluation settings), that key is none of the main arms'
    (`main_keys`: arm -> key; a paper-style warm start equal to the default one would measure
    nothing), and the held-out question count and evaluation settings are the main arms'
    (`main_base`: arm -> (step-0 per-question answers, evaluation settings as JSON)). Any failed
    part reads NO."""
    rows, keys, base, lines = [], {}, {}, []
    for name in PAPERSFT:
        got = _finished_run(grid, name, seed)
        if got is None:
            continue
        ev, curve = got
        try:
            rows += curve_rows(name, seed, curve)
        except ValueError as e:
            lines.append(f"{e}; left out")
            continue
        keys[name] = _sft_key(ev)
        base[name] = (curve[0]["per_question"]["answer"], json.dumps(curve[0]["eval"]))
    if not keys:
        return rows, lines
    line = _shared_start(f"seed {seed}: paper-style SFT: warm start shared by {len(keys)} runs", keys, base)
    main = sorted(set(map(str, main_keys.values())))
    if main:
        line += (f"; own warm start, not the default SFT's (cache key {', '.join(k[:12] for k in main)}): "
                 f"{'yes' if not set(keys.values()) & set(main) else 'NO'}")
    if main_base:
        ref = next(iter(main_base.values()))
        same = all(_same_questions(b, ref) for b in base.values())
        line += (f"; same held-out question count and evaluation settings as the default-SFT arms: "
                 f"{'yes' if same else 'NO'}")
    return rows, lines + [line]


# ----------------------------------------------------------------------------------------------------
# The report


def plot(rows: list[dict], arms: Sequence[str], path: str) -> None:
    """Fig. 5-style figure: answer-score difference from the SFT start vs RL step, one line per arm,
    its 95 % interval over seeds x questions as a band; a PAPERSFT run dashed, in its arm's colour
    when that arm is drawn too."""
    import matplotlib  # lazy: matplotlib only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the figure

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=120)
    colour = {}
    for a in sorted(arms, key=lambda x: x in PAPERSFT):  # the default-SFT arms first: their colours
        steps = sorted({r["step"] for r in rows if r["arm"] == a})
        if not steps:
            continue
        st = [arm_stats(rows, a, t) for t in steps]
        m, lo, hi = (np.array([x[i] for x in st]) for i in range(3))
        style = {"ls": "--", "color": colour.get(PAPERSFT[a])} if a in PAPERSFT else {}
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
    L += ["## Memory reuse (with minus without memory, answer score)", ""]
    if not mem:
        L += ["No memory evaluations yet.", ""]
    else:
        L += ["| arm | seeds | pass 1 similar [95% CI] | pass 1 hits | pass 2 exact [95% CI] | pass 2 hits |",
              "|---|---|---|---|---|---|"]
        for a in arms:
            ms = [v for (x, _), v in mem.items() if x == a]
            if not ms:
                continue
            cells = []
            for p in ("pass1", "pass2"):
                m, lo, hi = memory_stats(mem, a, p)
                cells += [f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]", f"{np.mean([x[p]['hits'] for x in ms]):.2f}"]
            L.append(f"| `{a}` | {len(ms)} | " + " | ".join(cells) + " |")
        L.append("")
        L += render_memory_controls(mem)
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


def oracle_stats(mem: dict, arm: str, who: str, control: str = "oracle") -> tuple[float, float, float]:
    """(mean, lo, hi) of a memory control's with-minus-without answer difference of the arm's runs
    (control: "oracle", the oracle-lesson control, or "attempt", the attempt-lesson control; who:
    "sft", the SFT start, or "final", the trained policy), pooled over seeds x questions; NaN when
    no memory evaluation ran the control."""
    return mean_ci([d for (a, _), v in mem.items() if a == arm and who in v.get(control, {})
                    for d in v[control][who]["delta"]["answer_per_question"]])


def paired_memory_difference(mem: dict, a: str, b: str, p: str) -> tuple[float, float, float] | None:
    """(mean, lo, hi): arm a's with-minus-without memory effect in pass p minus arm b's, paired by
    seed and held-out question (the same questions and sampling seeds); None when a seed lacks
    either arm."""
    diffs = []
    for seed in sorted({s for (x, s) in mem if x in (a, b)}):
        if (a, seed) not in mem or (b, seed) not in mem:
            return None
        va = mem[(a, seed)][p]["delta"]["answer_per_question"]
        vb = mem[(b, seed)][p]["delta"]["answer_per_question"]
        if len(va) != len(vb):
            return None
        diffs += (np.asarray(va) - np.asarray(vb)).tolist()
    return mean_ci(diffs) if diffs else None


def render_memory_controls(mem: dict) -> list[str]:
    """The memory section's control and comparison lines: the oracle-lesson control (what a lesson
    can do at most: the SFT start and each arm's final policy with toy.sft.oracle_lesson in the
    prompt, minus without), the attempt-lesson control (pass 2's ceiling: ToyJudge.attempt_lesson
    on the policy's own first attempt) and RubricEM's pass-2 memory effect minus Baseline RL's,
    paired."""
    L = []
    for control, name, what in (
            ("oracle", "Oracle-lesson", "every asked fact named as missed, each old record's value "
             "named as wrong, from ground truth"),
            ("attempt", "Attempt-lesson", "pass 2's ceiling: a perfect reflection on the policy's own "
             "first attempt, naming only the facts it missed or got wrong, from ground truth")):
        sft = oracle_stats(mem, "rubricem", "sft", control)
        if np.isfinite(sft[0]):
            L.append(f"- {name} control, SFT start ({what}): answer {sft[0]:+.3f} "
                     f"[{sft[1]:+.3f}, {sft[2]:+.3f}]")
        for a in MEMORY_ARMS:
            f = oracle_stats(mem, a, "final", control)
            if np.isfinite(f[0]):
                L.append(f"- {name} control, {PAPER_NAMES[a]} after RL: answer {f[0]:+.3f} "
                         f"[{f[1]:+.3f}, {f[2]:+.3f}]")
    for p, label in (("pass2", "within-episode pass 2"), ("pass1", "cross-episode pass 1")):
        d = paired_memory_difference(mem, "rubricem", "baseline_rl", p)
        if d is not None:
            L.append(f"- RubricEM's memory effect minus Baseline RL's at {label}, paired by seed and "
                     f"question: answer {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]")
    return L + ([""] if L else [])


def memory_stats(mem: dict, arm: str, p: str) -> tuple[float, float, float]:
    """(mean, lo, hi) of a pass's with-minus-without answer difference, pooled over the arm's seeds
    x questions."""
    vals = [d for (a, _), v in mem.items() if a == arm for d in v[p]["delta"]["answer_per_question"]]
    return mean_ci(vals)


def write_report(grid: str, arms: Sequence[str], seeds: Sequence[int], doc: str, meta: dict) -> str:
    """Collect the finished runs, write GRID/results.jsonl, the figure next to `doc` and `doc`
    (meta["scaffold"]: the UNSTRUCTURED runs too, drawn in the figure as a line of their own;
    meta["paper_sft"]: the PAPERSFT runs too, drawn dashed)."""
    scaffold, paper_sft = bool(meta.get("scaffold")), bool(meta.get("paper_sft"))
    rows, mem, checks = collect(grid, arms, seeds, scaffold, paper_sft)
    runs = list(arms) + ([UNSTRUCTURED] if scaffold else []) + (list(PAPERSFT) if paper_sft else [])
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
                    help=f"comma-separated arms (default: all, {','.join(ARM_ORDER)})")
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
    bad = [x for x in a.arms if x not in settings.ARMS]
    if bad:
        ap.error(f"unknown arms {bad}; choose from {ARM_ORDER}")
    if a.scaffold and "baseline_rl" not in a.arms:
        a.arms.append("baseline_rl")  # the structured side of the scaffold comparison
    for arm in dict.fromkeys(PAPERSFT.values()) if a.paper_sft else ():
        if arm not in a.arms:
            a.arms.append(arm)  # the default-SFT side of the SFT-confound comparison
    a.seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else (QUICK_SEEDS if a.quick else [0, 1, 2])
    a.steps = a.steps or (QUICK_STEPS if a.quick else presets.toy_preset().steps)
    a.eval_every = a.eval_every or max(1, a.steps // 6)
    a.sets = (QUICK_SET if a.quick else []) + a.set
    try:  # a bad override stops here, before any run starts
        overrides.apply_overrides(presets.toy_preset(), a.sets)
    except ValueError as e:
        ap.error(str(e))
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 every run finished, 1 some run failed (the report covers the others)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["memory"]:
        ap = argparse.ArgumentParser(prog="ablate.py memory", description="memory reuse of one run")
        ap.add_argument("--run-dir", required=True)
        a, rest = ap.parse_known_args(argv[1:])
        return memory_eval.main([a.run_dir, *rest])
    a = parse_args(argv)
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
