"""The reward ladder of the toy: the same RL run rewarded by ground truth, then by the evolving judge.

Not in the paper. It separates the two things a toy run's gain depends on: whether the update and its
hyperparameters can learn at all (the oracle rungs, rewarded with the toy judge's static rubric set,
the ground truth), and whether the evolving judge's rewards carry that signal (the last rung).
1. "oracle": flat GRPO on the static Answer score (settings.ARMS "oracle");
2. "stage_oracle": SS-GRPO (§3.3) on the static per-stage scores ("stage_oracle");
3. "rubricem": the evolving judge, RubricEM as the paper runs it.

For each seed and arm it runs `python train.py --toy --arm ARM --seed S --run-dir OUT/ARM-sS
--eval-every E --no-progress --set judge.record_static=true` (extra --set pass through; a run whose
eval.json exists is not rerun), then reads back:
- held-out answer score and mean stage score, warm start -> RL, at T = 1 (train.py's own eval.json)
  and with greedy decoding (one greedy rollout per question, evaluated here: `greedy_eval`), with
  the paired 95 % bootstrap interval of each gain over the held-out questions;
- fact recall (T = 1 and greedy), the lowest rollout/well_formed of the run, the training static
  answer score by quarter (score/answer in metrics.jsonl), wall time;
- per stage, the Pearson correlation between the evolving judge's R and the static score over all
  of the run's training rollouts (run_dir/judge_static.jsonl). In the rubricem rung R is what the
  update saw; in the oracle rungs the update saw the static scores, and R is what the evolving
  judge (whose buffers evolve alongside) would have given the same rollouts;
- over all seeds, each rung's held-out answer gain averaged over the evaluated steps of the curve
  (the paper's Fig. 5 metric; scripts/ablate.py's `curve_average`), and the stage oracle minus the
  terminal oracle, paired by seed and question, at the curve average and at the final step: the
  test that the world gives per-stage credit something to do.

    python scripts/reward_ladder.py --seeds 0 1 2 --arms oracle,stage_oracle --out runs/ladder \
        --set threads=1 --set sample_threads=1
    python scripts/reward_ladder.py --eval-only runs/toy            # greedy figures of one run
Writes OUT/ladder.json and prints one block per arm.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from backends.run.build import build_environment, build_judge, heldout_engines  # noqa: E402
from backends.run.heldout import heldout_scores, heldout_seed, sample_heldout  # noqa: E402
from backends.run.presets import load_config  # noqa: E402
from scaffold import system_prompt  # noqa: E402
from toy.model import load_policy  # noqa: E402

STAGES = ("plan", "research", "review", "answer")
ARMS = ("oracle", "stage_oracle", "rubricem")


def paired_ci(a, b, B: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of b - a over paired items and its 95 % bootstrap interval (items resampled)."""
    d = np.asarray(b, float) - np.asarray(a, float)
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, len(d), (B, len(d)))].mean(1)
    return float(d.mean()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def greedy_eval(run_dir: str) -> dict:
    """Greedy held-out evaluation (temperature 0, one rollout per question) of a finished toy run's
    warm start (eval.json's sft.source) and final policy (run_dir/final), on the run's held-out
    questions with its clean judge; {"sft": heldout_scores, "rl": heldout_scores}."""
    with open(os.path.join(run_dir, "config.json")) as fh:
        saved = json.load(fh)
    with open(os.path.join(run_dir, "eval.json")) as fh:
        ev = json.load(fh)
    cfg = load_config(saved)
    torch.set_num_threads(max(1, cfg.sample_threads or cfg.threads))
    world, tool, _, held_q = build_environment(cfg)
    judge = build_judge(dataclasses.replace(cfg, arm="rubricem"), world)  # static scores only
    ref_model, tok = load_policy(ev["sft"]["source"])
    model, _ = load_policy(os.path.join(run_dir, "final"))
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    ref_engine, cur_engine = heldout_engines(cfg, ref_model, model, tok, tool, system)
    qs = held_q[: cfg.eval.n_questions]
    out = {}
    for name, eng in (("sft", ref_engine), ("rl", cur_engine)):
        ro = sample_heldout(eng, qs, 1, 0.0, heldout_seed(cfg))
        out[name] = heldout_scores(judge, qs, ro, 1)
        out[name]["copy"] = copy_rate(judge, ro)
    return out


def copy_rate(judge, rollouts) -> dict:
    """How well the policy copies: of the asked facts whose true document some call returned, the
    share stated with the true value (toy.judge.ToyJudge.fact_outcomes); and the share of asked
    facts (with a document) whose document was returned at all."""
    found = right = asked = 0
    for ro in rollouts:
        for key, outcome in judge.fact_outcomes(ro.query, ro).items():
            f = next(f for f in ro.query.facts if f"{f['entity']} {f['aspect']}" == key)
            if f["doc_id"] is None:
                continue
            asked += 1
            got = any(r.doc_id == f["doc_id"] for cl in ro.tool_calls for r in cl.results)
            found += got
            right += got and outcome.startswith("stated")
    return {"copied_when_found": right / found if found else None,
            "found": found / asked if asked else None}


def stage_correlations(run_dir: str) -> dict:
    """Per stage, Pearson r between R and the static score over the rollouts recorded in
    run_dir/judge_static.jsonl (cells where either is missing left out; None if constant)."""
    path = os.path.join(run_dir, "judge_static.jsonl")
    if not os.path.exists(path):
        return {}
    R, S = [], []
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            R += row["R"]
            S += row["static"]
    R = np.array([[np.nan if x is None else x for x in r] for r in R], float)
    S = np.array([[np.nan if x is None else x for x in r] for r in S], float)
    out = {}
    for k, s in enumerate(STAGES):
        ok = np.isfinite(R[:, k]) & np.isfinite(S[:, k])
        a, b = R[ok, k], S[ok, k]
        out[s] = None if len(a) < 3 or a.std() == 0 or b.std() == 0 else \
            float(np.corrcoef(a, b)[0, 1])
    out["rollouts"] = int(len(R))
    return out


def summarise(run_dir: str, greedy: dict | None) -> dict:
    """The ladder's figures of one finished run (see the module docstring)."""
    with open(os.path.join(run_dir, "eval.json")) as fh:
        ev = json.load(fh)
    mp = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(x) for x in open(mp)] if os.path.exists(mp) else []  # none after --steps 0
    ans = [r.get("score/answer") for r in rows if r.get("score/answer") is not None]
    q = max(1, len(ans) // 4)
    out = {"run_dir": run_dir, "wall_s": ev.get("timings", {}).get("total_s"),
           "sft_seconds": ev.get("sft", {}).get("train_seconds"),
           "well_formed_min": min((r["rollout/well_formed"] for r in rows), default=None),
           "train_answer_quarters": [float(np.mean(ans[i * q:(i + 1) * q])) for i in range(4)]
           if len(ans) >= 4 else ans,
           "corr_R_static": stage_correlations(run_dir)}
    pairs = {"T1": (ev.get("eval_sft"), ev.get("eval_rl"))}
    if greedy:
        pairs["greedy"] = (greedy["sft"], greedy["rl"])
    for tag, (a, b) in pairs.items():
        if not a or not b:
            continue
        out[tag] = {"answer": [a["answer"], b["answer"]],
                    "answer_gain": paired_ci(a["per_question"]["answer"], b["per_question"]["answer"]),
                    "mean_stage": [a["score"], b["score"]],
                    "mean_stage_gain": paired_ci(a["per_question"]["score"], b["per_question"]["score"]),
                    "fact_recall": [a["fact_recall"], b["fact_recall"]],
                    "stages": {s: [a[f"stage/{s}"], b[f"stage/{s}"]] for s in STAGES},
                    "well_formed": [a["well_formed"], b["well_formed"]]}
        if "copy" in a:
            out[tag]["copy"] = [a["copy"], b["copy"]]
    return out


def run_arm(arm: str, seed: int, out: str, sets: list[str], eval_every: int = 4) -> str:
    """Train one arm (skipped if its eval.json exists), evaluated every `eval_every` steps; returns
    its run directory."""
    rd = os.path.join(out, f"{arm}-s{seed}")
    if os.path.exists(os.path.join(rd, "eval.json")):
        return rd
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--toy", "--arm", arm, "--seed", str(seed),
           "--run-dir", rd, "--eval-every", str(eval_every), "--no-progress",
           "--set", "judge.record_static=true"]
    for s in sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd), flush=True)
    if os.path.exists(os.path.join(rd, "judge_static.jsonl")):
        os.remove(os.path.join(rd, "judge_static.jsonl"))  # an interrupted run's rows
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"  {arm}: {time.time() - t0:.0f} s", flush=True)
    return rd


def curve_comparison(out: str, arms: list[str], seeds: list[int]) -> dict:
    """Per rung, the curve average of the held-out answer gain (mean, lo, hi over seeds x questions)
    and, for each later rung, its curve average and final-step gain minus the first rung's, paired
    by seed and question (scripts/ablate.py: curve_rows, curve_stats, paired_curve_difference)."""
    import ablate  # scripts/ablate.py: the grid's curve statistics

    rows = []
    for arm in arms:
        for seed in seeds:
            path = os.path.join(out, f"{arm}-s{seed}", "eval_curve.jsonl")
            if os.path.exists(path):
                rows += ablate.curve_rows(arm, seed, [json.loads(x) for x in open(path)])
    fs = ablate.final_step(rows)
    res = {"steps": ablate.curve_steps(rows), "final_step": fs,
           "curve": {a: ablate.curve_stats(rows, a) for a in arms}, "minus": {}}
    for a in arms[1:]:
        d = ablate.paired_curve_difference(rows, a, arms[0])
        f = ablate.paired_difference(rows, a, arms[0], fs) if fs is not None else None
        if d is not None and f is not None:
            res["minus"][a] = {"curve": d["answer"], "final": f["answer"],
                               "curve_mean_stage": d["score"]}
    return res


def fmt_curve(c: dict, base: str) -> str:
    lines = [f"== curve average of the held-out answer gain over steps {c['steps']} (seeds x questions)"]
    for a, (m, lo, hi) in c["curve"].items():
        lines.append(f"  {a:14s} {m:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    for a, d in c["minus"].items():
        lines.append(f"  {a} minus {base}, paired: curve average {d['curve'][0]:+.3f} "
                     f"[{d['curve'][1]:+.3f}, {d['curve'][2]:+.3f}]; at step {c['final_step']} "
                     f"{d['final'][0]:+.3f} [{d['final'][1]:+.3f}, {d['final'][2]:+.3f}]")
    return "\n".join(lines)


def fmt(name: str, s: dict) -> str:
    lines = [f"== {name}  ({s['run_dir']}; wall {s['wall_s'] or 0:.0f} s)"]
    for tag in ("T1", "greedy"):
        if tag in s:
            e = s[tag]
            g, gm = e["answer_gain"], e["mean_stage_gain"]
            lines.append(f"  {tag:6s} answer {e['answer'][0]:.3f} -> {e['answer'][1]:.3f} "
                         f"({g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]); mean stage {e['mean_stage'][0]:.3f}"
                         f" -> {e['mean_stage'][1]:.3f} ({gm[0]:+.3f} [{gm[1]:+.3f}, {gm[2]:+.3f}]); "
                         f"fact recall {e['fact_recall'][0]:.3f} -> {e['fact_recall'][1]:.3f}"
                         + ("; found / copied when found " + " -> ".join(
                             f"{c['found'] or 0:.3f} / {c['copied_when_found'] or 0:.3f}"
                             for c in e["copy"]) if "copy" in e else ""))
    lines.append("  train static answer by quarter: "
                 + ", ".join(f"{x:.3f}" for x in s["train_answer_quarters"])
                 + ("" if s["well_formed_min"] is None
                    else f"; lowest rollout/well_formed {s['well_formed_min']:.3f}"))
    c = s["corr_R_static"]
    if c:
        lines.append("  corr(R, static) per stage over " + str(c.get("rollouts")) + " rollouts: "
                     + ", ".join(f"{k} {'n/a' if c[k] is None else format(c[k], '.2f')}" for k in STAGES))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated (default: the ladder)")
    ap.add_argument("--seed", "--seeds", dest="seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every N steps")
    ap.add_argument("--out", default="runs/ladder")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=V", help="passed to train.py")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy held-out evaluation")
    ap.add_argument("--eval-only", nargs="*", default=None, metavar="RUN_DIR",
                    help="only summarise these finished runs (greedy evaluation included)")
    a = ap.parse_args(argv)
    res = {}
    if a.eval_only is not None:
        for rd in a.eval_only:
            res[rd] = summarise(rd, None if a.no_greedy else greedy_eval(rd))
            print(fmt(rd, res[rd]), flush=True)
        return 0
    os.makedirs(a.out, exist_ok=True)
    arms = [x for x in a.arms.split(",") if x]
    for seed in a.seeds:
        for arm in arms:
            rd = run_arm(arm, seed, a.out, a.set, a.eval_every)
            res[f"{arm}-s{seed}"] = summarise(rd, None if a.no_greedy else greedy_eval(rd))
            print(fmt(f"{arm} seed {seed}", res[f"{arm}-s{seed}"]), flush=True)
            with open(os.path.join(a.out, "ladder.json"), "w") as fh:
                json.dump(res, fh, indent=1)
    if len(arms) > 1:
        res["curve"] = curve_comparison(a.out, arms, a.seeds)
        print(fmt_curve(res["curve"], arms[0]), flush=True)
        with open(os.path.join(a.out, "ladder.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
