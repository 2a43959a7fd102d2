"""A toy run under injected faults next to a fault-free run with the same seed: how much do judge and
tool failures cost, and does anything non-finite get through?

RubricEM (arXiv 2605.10899), Algorithm 1 (train.py) with faults.py. Not a part of the paper.

Run A is fault-free; run B injects judge faults at `--judge-rate` (mixed kinds: timeout, 429, 5xx,
malformed, wrong count, out of range; retried up to judge.max_retries, then missing) and tool faults
at `--tool-rate` (errors and hangs, cut by a short per-call timeout). Both use the same seed and the
same per-call tool timeout. The script prints the fault counts of run B, checks that no loss,
advantage or weight of either run is NaN or inf, and prints both held-out scores (evaluation runs
without faults, so the scores compare the trained policies).

Launch
    python scripts/fault_run.py                          # toy preset, 30 steps x 2 runs (~25 min)
    python scripts/fault_run.py --small --steps 3        # the test-suite sizes (~1 min): a quick check
Exits 1 if a non-finite value is found.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import train  # noqa: E402
from runfix import fast_args  # noqa: E402


def finite_report(run_dir: str) -> list[str]:
    """Non-finite values in a run: loss/kl/grad-norm/advantage metrics (None in metrics.jsonl stands
    for NaN/inf) and the final weights."""
    bad = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    for r in rows:
        for k, v in r.items():
            if k.startswith(("loss/", "adv/", "adv_abs/", "kl", "grad_norm", "clip_frac")):
                if v is None or not math.isfinite(v):
                    bad.append(f"step {r['step']} {k} = {v}")
    final = os.path.join(run_dir, "final")
    for f in os.listdir(final):
        if f.endswith(".safetensors"):
            for name, t in load_file(os.path.join(final, f)).items():
                if not torch.isfinite(t).all():
                    bad.append(f"weight {name} not finite")
    return bad


def fault_counts(run_dir: str) -> dict:
    """Sums over steps of the judge/*, tools/* and bank/rejected counts of metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    keys = ["judge/calls", "judge/failures", "judge/retries", "judge/missing"]
    keys += sorted({k for r in rows for k in r if k.startswith(("judge/faults/", "tools/faults/"))})
    keys += ["tools/errors", "tools/timeouts", "tools/deadline_refusals"]
    out = {k: sum(r.get(k) or 0 for r in rows) for k in keys}
    out["judge/failure_rate (mean over steps)"] = sum(r["judge/failure_rate"] for r in rows) / len(rows)
    out["bank/rejected (end)"] = rows[-1].get("bank/rejected", 0)
    out["bank/size (end)"] = rows[-1].get("bank/size", 0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judge-rate", type=float, default=0.3)
    ap.add_argument("--tool-rate", type=float, default=0.1)
    ap.add_argument("--tool-timeout", type=float, default=0.5, help="per-call tool timeout (s), both runs")
    ap.add_argument("--small", action="store_true", help="test-suite sizes (tests/runfix.py)")
    ap.add_argument("--work-dir", default=None, help="where the runs go (default: a temp dir, kept)")
    a = ap.parse_args(argv)
    work = a.work_dir or tempfile.mkdtemp(prefix="fault-run-")
    common = ["--steps", str(a.steps), "--seed", str(a.seed), "--no-progress",
              "--set", f"rollout.tool_timeout_s={a.tool_timeout}", "--set", "checkpoint.every=0"]
    if a.small:
        def args(d):
            return fast_args(d, os.path.join(work, "cache"), a.steps) + common
    else:
        def args(d):
            return ["--toy", "--run-dir", d] + common
    runs = {"fault-free": [], f"faults judge {a.judge_rate:g} / tool {a.tool_rate:g}":
            ["--faults", f"{a.judge_rate},{a.tool_rate}"]}
    summaries, dirs = {}, {}
    for name, extra in runs.items():
        d = os.path.join(work, "faulty" if extra else "clean")
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        code = train.main(args(d) + extra)
        if code != 0:
            print(f"{name}: train.py exited with {code}")
            return 1
        dirs[name] = d
        summaries[name] = json.load(open(os.path.join(d, "eval.json")))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)

    print("\nfault counts (sums over steps)")
    print("| counter | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    counts = {n: fault_counts(d) for n, d in dirs.items()}
    for k in sorted(set().union(*[c.keys() for c in counts.values()])):
        print(f"| {k} | " + " | ".join(f"{counts[n].get(k, 0):.3g}" for n in runs) + " |")
    print("(judge/calls: one call per group for the plain toy judge, one per (rollout, stage) cell "
          "under FaultyJudge; faults.py, deviation 2)")
    bad = {n: finite_report(d) for n, d in dirs.items()}
    print("\nnon-finite values: " + "; ".join(f"{n}: {len(b)}" + (f" ({b[:3]})" if b else "")
                                          for n, b in bad.items()))
    print("\nheld-out evaluation (no faults at evaluation)")
    print("| run | score (mean of 4 stages) | answer | fact recall |")
    print("|---|---|---|---|")
    first = next(iter(summaries.values()))
    if "eval_sft" in first:
        e = first["eval_sft"]
        print(f"| SFT start | {e['score']:.3f} | {e['answer']:.3f} | {e['fact_recall']:.3f} |")
    for n, s in summaries.items():
        if "eval_rl" in s:
            e = s["eval_rl"]
            print(f"| RL, {n} | {e['score']:.3f} | {e['answer']:.3f} | {e['fact_recall']:.3f} |")
    print(f"\nruns in {work}")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
