"""Where a toy run's held-out answer score is lost, before and after RL.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Not a section of the paper: a diagnosis of the toy demonstration (docs/results.md). For each run
directory it re-samples the run's own held-out evaluation (the same questions, samples, temperature
and seed as backends/run/heldout.py's `HeldOut`, so the rollouts are those behind eval.json) from the SFT start and
from the final policy, and prints two tables:

    1. the answer-stage score's loss by rubric kind: for each static Answer rubric, weight x (1 - score)
       over the stage's total weight, averaged over rollouts; the kinds add up to 1 - answer score.
       "fact" is the row's per-fact rubrics (ans_fact: 1 cited, 0.5 uncited, 0 otherwise),
       "unsupported" the row's "no unsupported claims", the rest the judge's pool (ans:cited,
       ans:nodistractor, ans:closed);
    2. what became of each asked fact (toy.judge.ToyJudge.fact_outcomes), as shares of all asked facts.

Launch (after a toy run; reuses its cached SFT warm start):
    python scripts/answer_breakdown.py runs/reproduce/seed0 runs/reproduce/seed1 runs/reproduce/seed2

With several run directories the tables give the mean over them. --temperature T samples the same
questions with the same seed at another temperature (then there is no eval.json figure to match).

--sweep T1 T2 ... prints, instead of the two tables, the held-out answer score, mean-stage score,
fact recall and well_formed of the SFT start and the final policy sampled at each temperature
(0 = greedy; same questions and seed), e.g. how much of the answer score a sharper SFT start has
before any RL:
    python scripts/answer_breakdown.py runs/reproduce/seed0 ... --sweep 1 0.7 0.5 0.3 0

Exits 1 if a directory is not a finished toy run (config.json and final/ are needed).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backends.run import build, heldout, presets  # noqa: E402
from scaffold import ANSWER, system_prompt  # noqa: E402
from toy.judge import FACT_OUTCOMES  # noqa: E402

PHASES = ("SFT start", "after RL")


def answer_loss(judge, q, rollouts) -> dict[str, float]:
    """Mean over `rollouts` of each Answer-rubric kind's share of the answer-stage loss."""
    rubrics = judge.pool(q) + judge.initial_rubrics(q)
    S = np.nan_to_num(judge.score_rubrics(q, rollouts, rubrics))  # (n, R)
    cols = [j for j, r in enumerate(rubrics) if r.stage == ANSWER]
    total = sum(rubrics[j].weight for j in cols)
    out: dict[str, float] = collections.defaultdict(float)
    for j in cols:
        r = rubrics[j]
        kind = r.rid if r.rid.startswith("ans:") else (
            "unsupported" if r.check and r.check[0] == "ans_supported" else "fact")
        # share of the stage's loss: w_j (1 - s_j) / sum_j w_j, mean over rollouts
        out[kind] += float(((1.0 - S[:, j]) * r.weight / total).mean())
    return dict(out)


def heldout_rollouts(run_dir: str, temperatures) -> tuple:
    """(judge, held-out questions, samples per question, eval.json, the run's eval.temperature,
    {T: {phase: rollouts}}) for one
    finished toy run: its held-out evaluation re-sampled from the SFT start and from the final
    policy at each temperature in `temperatures` (None = the run's eval.temperature), with the
    engines and seed of heldout.HeldOut, so at the run's own temperature the rollouts are those behind
    eval.json. Rollouts are query-major, `samples` per question."""
    # lazy: transformers' model classes only when a run's policy loads
    from transformers import AutoModelForCausalLM

    with open(os.path.join(run_dir, "config.json")) as fh:
        cfg = presets.load_config(json.load(fh))
    with open(os.path.join(run_dir, "eval.json")) as fh:
        ev = json.load(fh)
    cfg.progress = False
    torch.set_num_threads(cfg.threads)
    world, tool, _, held_q = build.build_environment(cfg)[:4]
    judge = build.build_judge(cfg, world)
    sft_model, tok, _ = build.setup_policy(cfg, world, tool)
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"))
    final.eval()
    qs, n = held_q[: cfg.eval.n_questions], cfg.eval.samples
    # the engines and the seed of heldout.HeldOut
    engines = build.heldout_engines(cfg, sft_model, final, tok, tool,
                                    system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt))
    ro = {T: {phase: heldout.sample_heldout(eng, qs, n, cfg.eval.temperature if T is None else T,
                                             heldout.heldout_seed(cfg))
              for phase, eng in zip(PHASES, engines)}
          for T in temperatures}
    return judge, qs, n, ev, cfg.eval.temperature, ro


def breakdown(run_dir: str, temperature: float | None = None) -> dict:
    """{phase: {"answer": mean answer score, "loss": {kind: share}, "facts": {outcome: share},
    "eval_json_answer": the run's own figure (None at another temperature)}} for one finished toy
    run, sampled at the run's evaluation temperature or at `temperature`."""
    judge, qs, n, ev, own_t, ro = heldout_rollouts(run_dir, [temperature])
    own = temperature is None or temperature == own_t
    out = {}
    for phase, key in zip(PHASES, ("eval_sft", "eval_rl")):
        loss: dict[str, float] = collections.defaultdict(float)
        facts: collections.Counter = collections.Counter()
        for gi, q in enumerate(qs):
            group = ro[temperature][phase][gi * n:(gi + 1) * n]
            for k, v in answer_loss(judge, q, group).items():
                loss[k] += v / len(qs)
            for r in group:
                facts.update(judge.fact_outcomes(q, r).values())
        total = sum(facts.values())
        out[phase] = {"answer": 1.0 - sum(loss.values()), "loss": dict(loss),
                      "facts": {k: v / total for k, v in facts.items()},
                      "eval_json_answer": ev.get(key, {}).get("answer") if own else None}
    return out


SWEEP_KEYS = ("answer", "score", "fact_recall", "well_formed")


def sweep(run_dir: str, temperatures) -> dict:
    """{T: {phase: {"answer", "score" (mean-stage), "fact_recall", "well_formed"}}} for one finished
    toy run: `heldout.heldout_scores` (the static rubric set of eval.json) of its held-out
    questions sampled at each temperature T >= 0 (0 = greedy) from the SFT start and the final
    policy. At the run's own eval.temperature the figures are eval.json's."""
    judge, qs, n, _, _, ro = heldout_rollouts(run_dir, temperatures)
    return {T: {phase: {k: heldout.heldout_scores(judge, qs, ro[T][phase], n)[k] for k in SWEEP_KEYS}
                for phase in PHASES} for T in temperatures}


def mean_over(results: list[dict], phase: str, part: str) -> dict[str, float]:
    keys = sorted({k for r in results for k in r[phase][part]})
    return {k: float(np.mean([r[phase][part].get(k, 0.0) for r in results])) for k in keys}


def print_sweep(results: list[dict], run_dirs, temperatures) -> int:
    """Print `sweep`'s figures: one row per temperature, means over the runs, and each run's
    answer scores."""
    m = {T: {p: {k: float(np.mean([r[T][p][k] for r in results])) for k in SWEEP_KEYS}
             for p in PHASES} for T in temperatures}
    print(f"Held-out scores by sampling temperature (mean over {len(results)} run(s))\n")
    print("| T | answer SFT | answer RL | RL - SFT | mean-stage SFT | mean-stage RL "
          "| fact recall SFT | fact recall RL | well_formed SFT | well_formed RL |")
    print("|---|" + "---|" * 9)
    for T in temperatures:
        s_, r_ = m[T][PHASES[0]], m[T][PHASES[1]]
        print(f"| {T:g} | {s_['answer']:.3f} | {r_['answer']:.3f} | {r_['answer'] - s_['answer']:+.3f} "
              f"| {s_['score']:.3f} | {r_['score']:.3f} | {s_['fact_recall']:.3f} | {r_['fact_recall']:.3f} "
              f"| {s_['well_formed']:.2f} | {r_['well_formed']:.2f} |")
    print("\nAnswer score per run (SFT -> RL):")
    for d, r in zip(run_dirs, results):
        print(f"  {d}: " + ", ".join(f"T={T:g} {r[T][PHASES[0]]['answer']:.3f} -> "
                                      f"{r[T][PHASES[1]]['answer']:.3f}" for T in temperatures))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", help="finished toy run directories (config.json, final/)")
    ap.add_argument("--temperature", type=float, help="sample at this temperature instead of the "
                    "run's eval.temperature (the same questions and seed)")
    ap.add_argument("--sweep", type=float, nargs="+", metavar="T",
                    help="instead of the two tables: the held-out scores of the SFT start and the "
                    "final policy sampled at each temperature T (0 = greedy)")
    a = ap.parse_args(argv)
    for d in a.run_dirs:
        if not (os.path.isfile(os.path.join(d, "config.json")) and os.path.isdir(os.path.join(d, "final"))):
            print(f"{d}: not a finished toy run (needs config.json and final/)", file=sys.stderr)
            return 1
    if a.sweep:
        if min(a.sweep) < 0:
            print(f"--sweep: temperatures must be >= 0, got {a.sweep}", file=sys.stderr)
            return 1
        return print_sweep([sweep(d, a.sweep) for d in a.run_dirs], a.run_dirs, a.sweep)
    results = []
    for d in a.run_dirs:
        r = breakdown(d, a.temperature)
        for phase in PHASES:
            own = r[phase]["eval_json_answer"]
            print(f"{d}: {phase}: answer {r[phase]['answer']:.3f} (the run's eval.json: "
                  f"{'-' if own is None else f'{own:.3f}'})")
        results.append(r)
    print(f"\nAnswer-score loss by rubric kind (share of the answer stage; mean over {len(results)} run(s))\n")
    print("| rubric kind | " + " | ".join(PHASES) + " |\n|---|---|---|")
    loss = {p: mean_over(results, p, "loss") for p in PHASES}
    kinds = sorted(set(loss[PHASES[0]]) | set(loss[PHASES[1]]), key=lambda k: -loss[PHASES[0]].get(k, 0))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{loss[p].get(k, 0.0):.3f}" for p in PHASES) + " |")
    print("| answer score (1 - sum) | " + " | ".join(
        f"{np.mean([r[p]['answer'] for r in results]):.3f}" for p in PHASES) + " |")
    print(f"\nWhat became of each asked fact (share of asked facts; mean over {len(results)} run(s))\n")
    print("| outcome | " + " | ".join(PHASES) + " |\n|---|---|---|")
    facts = {p: mean_over(results, p, "facts") for p in PHASES}
    for k in FACT_OUTCOMES:
        if any(facts[p].get(k) for p in PHASES):
            print(f"| {k} | " + " | ".join(f"{facts[p].get(k, 0.0):.3f}" for p in PHASES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
