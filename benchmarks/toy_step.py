"""Where a default toy RL step's time goes, before and after: this checkout against another one (e.g.
an older commit), side by side in one sitting.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
One RL step is Algorithm 1's: the deferred reflection update (§3.4), rollouts (§3.1-3.2), the stage
judge (§3.4), advantages and the SS-GRPO update (§3.3), the weight sync, the reflection branch. Each
repetition runs `python train.py --toy --steps S` (default 4) in each checkout in turn (A, B, A, B,
...), with the held-out evaluation off, and reads the run's metrics.jsonl: the `time/*` keys of every
step (train.rl_step's `timed` blocks). It prints, per phase, the mean seconds per step of each
checkout (median over repetitions), their ratio, and the whole process's CPU seconds (far less
sensitive to other processes on the cores than wall seconds).

Run (a checkout of the older commit beside this one):
    git worktree add /tmp/rubricem-base 0a761ed
    python benchmarks/toy_step.py --base /tmp/rubricem-base --reps 3
Any train.py flag after `--` goes to both runs (e.g. `-- --seed 1`); `--this-set KEY=VALUE` (repeatable)
only to this checkout's (to time a setting before it becomes a default). Last line:
    TOY_STEP base_s=<median s per step> this_s=<...> ratio=<this / base>
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the phases of train.rl_step, in order, with what each holds
PHASES = (
    ("time/reflection_update_s", "reflection update (§3.4, last step's GRPO groups)"),
    ("time/rollout_s", "rollouts (§3.1-3.2, sampling and tool calls)"),
    ("time/judge_s", "stage judge (§3.4)"),
    ("time/update_s", "task update (§3.3, advantages and SS-GRPO)"),
    ("time/sync_s", "weight sync"),
    ("time/reflection_s", "reflection branch (sampling, privileged judge, bank)"),
)


def run_once(checkout: str, steps: int, extra: list[str], python: str) -> dict:
    """One `train.py --toy --steps steps` in `checkout`: {"phases": {key: mean s per step},
    "step_s": mean s per step, "cpu_s": the process's CPU seconds, "wall_s": its wall seconds}."""
    with tempfile.TemporaryDirectory(prefix="toy-step-") as tmp:
        cmd = [python, "train.py", "--toy", "--steps", str(steps), "--run-dir", tmp,
               "--no-progress", "--set", "eval.n_questions=0", "--set", "eval.greedy=false", *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} in {checkout} exited {p.returncode}:\n"
                               f"{p.stderr[-3000:]}")
        with open(os.path.join(tmp, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    phases = {k: sum(r.get(k) or 0.0 for r in rows) / len(rows) for k, _ in PHASES}  # null: 0
    return {"phases": phases, "step_s": sum(r["time/step_s"] for r in rows) / len(rows),
            "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "wall_s": wall}


def table(base: list[dict], this: list[dict]) -> list[str]:
    """The per-phase lines (median over repetitions of each run's mean seconds per step)."""
    med = lambda runs, f: statistics.median(f(r) for r in runs)  # noqa: E731
    lines = ["| phase | base s/step | base share | this s/step | this share | this / base |",
             "|---|---|---|---|---|---|"]
    b_step, t_step = med(base, lambda r: r["step_s"]), med(this, lambda r: r["step_s"])
    rows = [(label, med(base, lambda r, k=k: r["phases"][k]), med(this, lambda r, k=k: r["phases"][k]))
            for k, label in PHASES]
    rows.append(("rest of the step (metrics, retrieval, bookkeeping)",
                 b_step - sum(b for _, b, _ in rows), t_step - sum(t for _, _, t in rows)))
    for label, b, t in rows:
        lines.append(f"| {label} | {b:.2f} | {b / b_step:.0%} | {t:.2f} | {t / t_step:.0%} | "
                     f"{t / b if b > 0.005 else float('nan'):.2f} |")
    lines.append(f"| **step** | **{b_step:.2f}** | | **{t_step:.2f}** | | **{t_step / b_step:.2f}** |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout (e.g. a worktree of 0a761ed)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per checkout (alternating)")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run")
    ap.add_argument("--python", default=sys.executable, help="interpreter for both runs")
    ap.add_argument("--this-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a --set for this checkout's runs only (repeatable)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py flags after --")
    a = ap.parse_args(argv)
    extra = [x for x in a.train_args if x != "--"]
    own = {"base": [], "this": [x for kv in a.this_set for x in ("--set", kv)]}
    res: dict[str, list] = {"base": [], "this": []}
    print(f"nproc={os.cpu_count()} steps={a.steps} reps={a.reps} base={a.base} this={ROOT}", flush=True)
    for rep in range(a.reps):
        for name, where in (("base", a.base), ("this", ROOT)):
            r = run_once(where, a.steps, extra + own[name], a.python)
            res[name].append(r)
            print(f"[{name} rep {rep}] s/step={r['step_s']:.2f} cpu_s={r['cpu_s']:.1f} "
                  f"wall_s={r['wall_s']:.1f} load1={os.getloadavg()[0]:.2f}", flush=True)
    print("\n".join(table(res["base"], res["this"])))
    b = statistics.median(r["step_s"] for r in res["base"])
    t = statistics.median(r["step_s"] for r in res["this"])
    bc = statistics.median(r["cpu_s"] for r in res["base"])
    tc = statistics.median(r["cpu_s"] for r in res["this"])
    print(f"process CPU seconds per run (median): base {bc:.1f}, this {tc:.1f} ({tc / bc:.2f})")
    print(f"TOY_STEP base_s={b:.2f} this_s={t:.2f} ratio={t / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
