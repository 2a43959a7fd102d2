"""Kill-and-resume trials: SIGKILL a toy training run at random moments, resume it from its latest
checkpoint, and check that the result equals an uninterrupted run bit for bit.

RubricEM (arXiv 2605.10899), Algorithm 1 as implemented in train.py; checkpoints: checkpoint.py.
Not a part of the paper: this measures the checkpoint/resume machinery.

One trial: start `python train.py ...` in a subprocess, SIGKILL it after a delay drawn uniformly from
[0, T) where T is the uninterrupted run's wall time (so a kill can land anywhere: start-up, warm-start
load, a rollout, the update, the reflection branch, a checkpoint or bank write, the final artefacts);
then check every checkpoint on disk verifies (sha256 of each file) and bank.jsonl parses, resume with
`--resume latest` in a second subprocess, and compare with the uninterrupted run: metrics rows (all
keys but wall-clock `time/*`), bank.jsonl bytes, final weights bytes, rubric buffers, samples and the
held-out evaluation. It also checks metrics.jsonl holds each step exactly once.

Launch
    python scripts/kill_resume_trials.py --trials 10 --steps 6            # ~10-15 min on 2 cores
    python scripts/kill_resume_trials.py --trials 2 --steps 3 --fast      # a quick check (~2 min)
Prints one line per trial and a summary table; exits 1 if any trial differs or leaves a corrupt file.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from backends.run import checkpoint as ckpt_mod  # noqa: E402
from bank import RubricBank  # noqa: E402
from runfix import fast_args, run_fingerprint  # noqa: E402
from test_smoke import tiny_args  # noqa: E402


def train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), *args]


def run_to_end(args: list[str], log_path: str, timeout_s: float = 3600) -> float:
    """Run train.py to completion in a subprocess; returns its wall time (s). Raises on failure."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        subprocess.run(train_cmd(args), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                       timeout=timeout_s, check=True)
    return time.perf_counter() - t0


def check_disk(run_dir: str) -> list[str]:
    """Problems with what a killed run left behind: checkpoints that do not verify or load, a bank
    file that does not parse. Temp directories (.tmp-*, .del-*) are allowed."""
    problems = []
    for step, path in ckpt_mod.list_checkpoints(run_dir):
        try:
            ckpt_mod.verify_checkpoint(path, deep=True)
            ckpt_mod.load_state(path)
        except ckpt_mod.CheckpointError as e:
            problems.append(f"checkpoint {step}: {e}")
    bank = os.path.join(run_dir, "bank.jsonl")
    if os.path.exists(bank):
        try:
            RubricBank.load(bank, strict=True)
        except ValueError as e:
            problems.append(f"bank: {e}")
    return problems


def kill_trial(args_for, run_dir: str, delay_s: float, log_path: str) -> dict:
    """Start a run, SIGKILL it after delay_s seconds (if still running), check the disk, resume it
    to the end. args_for(run_dir) -> train.py arguments. Returns what happened."""
    shutil.rmtree(run_dir, ignore_errors=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(train_cmd(args_for(run_dir)), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=delay_s)
            killed = False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed = True
    ckpts = ckpt_mod.list_checkpoints(run_dir)
    debris = [n for n in os.listdir(ckpt_mod.checkpoints_dir(run_dir))
              if n.startswith(".")] if os.path.isdir(ckpt_mod.checkpoints_dir(run_dir)) else []
    problems = check_disk(run_dir)
    with open(log_path, "a") as log:
        subprocess.run(train_cmd(args_for(run_dir) + ["--resume", "latest"]), cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, check=True, timeout=3600)
    return {"killed": killed, "latest_step": ckpts[-1][0] if ckpts else None,
            "debris": len(debris), "problems": problems}


def compare(ref: dict, got: dict) -> list[str]:
    """Names of the fingerprint parts that differ (see tests/runfix.run_fingerprint)."""
    diff = [k for k in ref if ref[k] != got[k]]
    steps = [r["step"] for r in got["metrics"]]
    if steps != sorted(set(steps)) or steps != list(range(len(steps))):
        diff.append(f"metrics steps {steps}")
    return diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    ap.add_argument("--fast", action="store_true",
                    help="the test-suite settings (tests/runfix.py FAST) instead of the smoke-test ones")
    ap.add_argument("--work-dir", default=None, help="where runs go (default: a temp dir, removed)")
    a = ap.parse_args(argv)
    work = a.work_dir or tempfile.mkdtemp(prefix="kill-trials-")
    os.makedirs(work, exist_ok=True)
    cache = os.path.join(work, "cache")
    if a.fast:
        def args_for(d):
            return fast_args(d, cache, a.steps, "--set", "checkpoint.every=1")
    else:
        def args_for(d):
            return tiny_args(d, cache, a.steps) + ["--set", "checkpoint.every=1"]

    print(f"work dir {work}; warm start + uninterrupted reference run ({a.steps} steps) ...", flush=True)
    ref_dir = os.path.join(work, "reference")
    run_to_end(args_for(os.path.join(work, "warmup")), os.path.join(work, "warmup.log"))
    shutil.rmtree(ref_dir, ignore_errors=True)
    T = run_to_end(args_for(ref_dir), os.path.join(work, "reference.log"))
    ref = run_fingerprint(ref_dir)
    print(f"reference run: {T:.1f} s", flush=True)
    rnd = random.Random(a.seed)
    rows = []
    for t in range(a.trials):
        delay = rnd.uniform(0.0, T)
        d = os.path.join(work, f"trial{t}")
        t0 = time.perf_counter()
        res = kill_trial(args_for, d, delay, os.path.join(work, f"trial{t}.log"))
        diff = compare(ref, run_fingerprint(d))
        res.update(trial=t, delay_s=delay, diff=diff, wall_s=time.perf_counter() - t0)
        rows.append(res)
        print(f"trial {t}: kill at {delay:6.1f} s  killed={res['killed']}  resumed from step "
              f"{res['latest_step']}  debris={res['debris']}  corrupt={len(res['problems'])}  "
              f"{'IDENTICAL' if not diff else 'DIFFERS: ' + ', '.join(diff)}", flush=True)
    print()
    print("| trial | kill at (s) | killed | resumed from step | temp dirs left | corrupt files | result |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trial']} | {r['delay_s']:.1f} | {r['killed']} | {r['latest_step']} | {r['debris']} "
              f"| {len(r['problems'])} | {'identical' if not r['diff'] else 'differs: ' + ', '.join(r['diff'])} |")
    bad = [r for r in rows if r["diff"] or r["problems"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} trials identical to the uninterrupted run with no corrupt "
          f"checkpoint or bank (reference run {T:.1f} s, {a.steps} steps)")
    if not a.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
