"""Shared pieces of the tests that run the toy training loop end to end (checkpoints, resume, faults).

`fast_args` is the smoke test's `tiny_args` plus settings that make one RL step take about a second
on one core: 2 prompts x 2 rollouts of at most 48 tokens, 2 reflection candidates, a 2-step warm
start (its cache is shared by every test of one pytest run: see `toy_cache` in conftest.py), one
thread (tiny matrices on a shared 2-core machine run faster on one), a checkpoint every step.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os

from test_smoke import tiny_args

FAST = ["--set", "sft.steps=2", "--set", "sft.n_trajectories=40", "--set", "sft.n_reflections=4",
        "--set", "rollout.max_response_tokens=48", "--set", "rollout.n=2", "--set", "reflection.m=2",
        "--set", "eval.n_questions=1", "--set", "threads=1", "--set", "checkpoint.every=1"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    """scripts/NAME.py imported as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fast_args(run_dir, cache_dir, steps: int, *extra: str) -> list[str]:
    return tiny_args(run_dir, cache_dir, steps) + FAST + list(extra)


def metric_rows(run_dir) -> list[dict]:
    """metrics.jsonl rows without the wall-clock `time/*` keys."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
                for line in fh]


def sha256(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def run_fingerprint(run_dir) -> dict:
    """What must be identical between an uninterrupted run and a stopped/killed + resumed one."""
    ev = json.load(open(os.path.join(run_dir, "eval.json")))
    return {"metrics": metric_rows(run_dir),
            "bank": sha256(os.path.join(run_dir, "bank.jsonl")),
            "weights": sha256(os.path.join(run_dir, "final", "model.safetensors")),
            "buffers": sha256(os.path.join(run_dir, "rubric_buffers.json")),
            "samples": sha256(os.path.join(run_dir, "samples.jsonl")),
            "eval_rl": ev.get("eval_rl")}
