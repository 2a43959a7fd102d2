"""Where a toy run's rollouts lose their format: the stage scores and advantages of well-formed and
malformed rollouts, step by step, and the advantage of the token that skipped a stage.

RubricEM (arXiv 2605.10899) §3.3 gives every token of stage block B_{i,k} the advantage A[i,k]. A
rollout that skips a stage (writes <answer> where <review> was due) has no block for it: its low
score R[i,k] still lowers A[i,k] (and, through Lambda, the earlier stages' returns), but no token
carries A[i,k], and the token that made the skip (the tag opening the next block) gets the *next*
stage's advantage. This script shows how that plays out in a run that lost its format.

What it does: copies RUN_DIR to a temporary directory, resumes the copy from checkpoint step-N
(`train.py --resume`, exact: the steps replay as they ran) and, at each step's update, records per
rollout: well-formed or not, which stages are present, R (4 stage scores), A (4 stage advantages),
sampled tokens per stage and, for a rollout that skipped a stage, the advantage its skipping token
got (§3.3) and the skipped stage's advantage (what `ss_grpo.skipped_stage_credit` would give it).
The original run directory is not touched. Prints one block per step.

Run (after `python scripts/reproduce.py`, whose runs keep checkpoints at steps 10, 20, 24):
    python scripts/skipped_stages.py runs/reproduce/seed0 --from-step 20
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ss_grpo  # noqa: E402
import train  # noqa: E402

STAGES = ("plan", "research", "review", "answer")


def record(rollouts, A, R) -> list[dict]:
    """One dict per rollout of a step (see the module docstring)."""
    rows = []
    for i, r in enumerate(rollouts):
        p = r.parsed
        tok = [sum(1 for s, m in zip(r.stage_ids, r.loss_mask) if s == k and m) for k in range(4)]
        row = {"wf": bool(p.well_formed), "has": list(p.has_stage), "R": [float(x) for x in R[i]],
               "A": [float(x) for x in A[i]], "tok": tok, "skip": None}
        skip = ss_grpo.skipping_token(torch.tensor(r.stage_ids), torch.tensor(r.loss_mask),
                                      p.has_stage)
        if skip is not None:  # (skipped stage, the block whose first token made the skip, token)
            k, j, _ = skip
            row["skip"] = {"stage": k, "opens": j, "A_token": float(A[i, j]),
                           "A_skipped": float(A[i, k])}
        rows.append(row)
    return rows


def summary(step: int, rows: list[dict]) -> str:
    """One step's block of text."""
    wf = np.array([r["wf"] for r in rows])
    out = [f"step {step}: {len(rows)} rollouts, well-formed {wf.mean():.2f}"]
    for name, sel in (("well-formed", wf), ("malformed", ~wf)):
        if not sel.any():
            continue
        R = np.array([r["R"] for r in rows])[sel].mean(0)
        A = np.array([r["A"] for r in rows])[sel].mean(0)
        T = np.array([r["tok"] for r in rows])[sel].mean(0)
        out.append(f"  {name:<11} n={int(sel.sum()):>2}  R " + " ".join(f"{x:.2f}" for x in R)
                   + "  A " + " ".join(f"{x:+.2f}" for x in A)
                   + "  tokens " + " ".join(f"{x:.0f}" for x in T))
    missing = {}
    for r in rows:
        if not r["wf"]:
            key = "+".join(STAGES[k] for k in range(4) if not r["has"][k]) or "none (a block unclosed)"
            missing[key] = missing.get(key, 0) + 1
    if missing:
        out.append("  malformed, stages missing: " + ", ".join(f"{k} {v}" for k, v in
                                                              sorted(missing.items(), key=lambda x: -x[1])))
    skips = [r["skip"] for r in rows if r["skip"]]
    if skips:
        out.append(f"  skipping token ({len(skips)} rollouts): advantage it gets (the block it opens) "
                   f"{np.mean([s['A_token'] for s in skips]):+.3f}, the skipped stage's "
                   f"{np.mean([s['A_skipped'] for s in skips]):+.3f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a toy run directory with checkpoints (e.g. runs/reproduce/seed0)")
    ap.add_argument("--from-step", type=int, required=True, help="resume from checkpoints/step-N")
    ap.add_argument("--json", help="also write the per-rollout records here")
    a = ap.parse_args(argv)
    ckpt = os.path.join(a.run_dir, "checkpoints", f"step-{a.from_step:06d}")
    if not os.path.isdir(ckpt):
        raise SystemExit(f"{ckpt}: no such checkpoint")
    steps: list[list[dict]] = []
    scores: dict = {}
    judge_groups, update_batch = train.judge_groups, train.update_batch

    def judged(run, queries, rollouts, step, m):
        out = judge_groups(run, queries, rollouts, step, m)
        scores["R"] = out[0]
        return out

    def batch(rollouts, A, *args, **kw):
        steps.append(record(rollouts, A, scores["R"]))
        return update_batch(rollouts, A, *args, **kw)

    train.judge_groups, train.update_batch = judged, batch
    try:
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "run")
            shutil.copytree(a.run_dir, copy)
            train.main(["--resume", os.path.join(copy, "checkpoints", f"step-{a.from_step:06d}"),
                        "--no-progress"])
    finally:
        train.judge_groups, train.update_batch = judge_groups, update_batch
    print(f"\n{a.run_dir}, resumed from step {a.from_step} (a copy; R: stage scores plan research "
          "review answer, A: stage advantages, tokens: sampled tokens per stage, means)")
    for j, rows in enumerate(steps):
        print(summary(a.from_step + j, rows))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(steps, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
