"""The reading path of one RL step, traced: the project lines that one step of the default toy run
executes outside toy/ and backends/, written into docs/reading_path.md in the order they first run.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
One step of Algorithm 1 is `train.rl_step`: the reflection batch of the previous step, memory
retrieval, rollouts, the stage judge (§3.4), SS-GRPO advantages and the update (§3.3), the
reflection branch (§3.4). This script runs the toy preset at the fast test settings
(tests/runfix.py: FAST) for STEP + 1 steps and records, with a line tracer (sys.settrace, every
thread), each distinct line executed during step STEP's `rl_step` call. Lines in toy/ (the toy
world's tiny model, tokenizer, samplers and judge) and in backends/ (speed and scale) are not
counted: what is counted is what a reader of the paper layer reads. The cap: MAX_LINES lines in
MAX_FILES files.

Run from the repository root (about 10 s on one core):
    python scripts/reading_path.py            # rewrite docs/reading_path.md
    python scripts/reading_path.py --check    # exit 1 if the file is stale or the cap is broken
Both print `READING_PATH lines=N files=M` as their last line.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402

DOC = os.path.join(ROOT, "docs", "reading_path.md")
MAX_LINES, MAX_FILES = 700, 7
STEP = 1  # the traced step (0-based): the second, so the previous step's reflection batch is applied
NOT_COUNTED = ("toy", "backends", "tests", "scripts", "benchmarks")
# The fast toy settings of tests/runfix.py (tests/test_smoke.py: tiny_args + runfix.FAST).
FAST = ["--set", "world.n_train_entities=40", "--set", "world.n_heldout_entities=8",
        "--set", "sft.steps=2", "--set", "sft.n_trajectories=40", "--set", "sft.n_reflections=4",
        "--set", "sft.batch_size=8", "--set", "toy_model.size=\"XS\"", "--set", "toy_model.vocab_size=400",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
        "--set", "rollout.max_response_tokens=48", "--set", "reflection.m=2",
        "--set", "reflection.max_new_tokens=16", "--set", "eval.n_questions=1",
        "--set", "eval.samples=1", "--set", "threads=1", "--set", "checkpoint.every=0"]


def counted(path: str) -> str | None:
    """The repository-relative path of a counted project file, else None."""
    path = os.path.abspath(path)
    if not path.startswith(ROOT + os.sep) or not path.endswith(".py"):
        return None
    rel = os.path.relpath(path, ROOT)
    parts = rel.split(os.sep)
    # a virtual environment inside the checkout (README's `python3 -m venv .venv`) is not the project
    if parts[0] in NOT_COUNTED or parts[0].startswith(".") or "site-packages" in parts:
        return None
    return rel


class LineTrace:
    """Distinct executed lines per counted file, and each function's first run (in order)."""

    def __init__(self):
        self.lines: dict[str, set[int]] = {}
        self.order: list[tuple[str, str, int]] = []  # (file, function, def line) by first call
        self._seen: set = set()
        self._rel: dict[str, str | None] = {}

    def _local(self, frame, event, arg):
        if event == "line":
            rel = self._rel[frame.f_code.co_filename]
            self.lines[rel].add(frame.f_lineno)
        return self._local

    def _global(self, frame, event, arg):
        fn = frame.f_code.co_filename
        rel = self._rel.get(fn, 0)
        if rel == 0:
            rel = self._rel[fn] = counted(fn)
        if rel is None:
            return None
        self.lines.setdefault(rel, set())
        key = (rel, frame.f_code.co_qualname, frame.f_code.co_firstlineno)
        if key not in self._seen:
            self._seen.add(key)
            self.order.append(key)
        return self._local

    def __enter__(self):
        threading.settrace(self._global)
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        threading.settrace(None)


def trace(step: int = STEP) -> LineTrace:
    """Run the fast toy preset for step + 1 steps and trace train.rl_step at `step`."""
    tr = LineTrace()
    real = train.rl_step

    def rl_step(run, s, *a, **kw):
        if s != step:
            return real(run, s, *a, **kw)
        with tr:
            return real(run, s, *a, **kw)

    train.rl_step = rl_step
    try:
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--toy", "--steps", str(step + 1), "--run-dir", os.path.join(tmp, "run"),
                    "--no-progress", "--set", f"cache_dir=\"{os.path.join(tmp, 'cache')}\""] + FAST
            if train.main(argv) != 0:
                raise RuntimeError("the traced toy run failed")
    finally:
        train.rl_step = real
    return tr


def render(tr: LineTrace) -> str:
    total = sum(len(v) for v in tr.lines.values())
    files = sorted(f for f, v in tr.lines.items() if v)
    by_fn: dict = {}
    for rel in files:  # executed lines per function: the innermost def holding the line
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for ln in tr.lines[rel]:
            inner = [d for d in defs if d.lineno <= ln <= d.end_lineno]
            first = max(inner, key=lambda d: d.lineno).lineno if inner else 0
            by_fn[(rel, first)] = by_fn.get((rel, first), 0) + 1
    out = ["# Reading one RL step", "",
           "Written by `python scripts/reading_path.py` from a line trace of one step (`train.rl_step`, "
           f"step {STEP}) of the toy preset at the fast test settings; `tests/test_reading_path.py` "
           "checks that it is up to date and under the cap.", "",
           "These are the functions that run, in the order they first run, with the number of their "
           "lines that execute. toy/ (the toy world, tiny model, tokenizer and samplers) and backends/ "
           "(speed and scale) are not counted.", "",
           "| # | file:line | function | lines run |", "|---|---|---|---|"]
    i = 0
    for rel, name, first in tr.order:
        n = by_fn.pop((rel, first), 0)
        if n:
            i += 1
            out.append(f"| {i} | {rel}:{first} | `{name}` | {n} |")
    for (rel, first), n in sorted(by_fn.items()):  # module-level lines (none expected)
        out.append(f"| - | {rel}:{first} | (module level) | {n} |")
    out += ["", "| file | lines run |", "|---|---|"]
    out += [f"| {f} | {len(tr.lines[f])} |" for f in files]
    out += ["", f"Total: {total} lines in {len(files)} files; cap {MAX_LINES} lines in {MAX_FILES} files."]
    return "\n".join(out) + "\n"


def summary(tr: LineTrace) -> tuple[int, int]:
    """(distinct lines run, files they are in)."""
    return sum(len(v) for v in tr.lines.values()), sum(1 for v in tr.lines.values() if v)


def over_cap(n: int, m: int) -> list[str]:
    """The cap's verdict on n lines in m files: [] or one problem."""
    if n > MAX_LINES or m > MAX_FILES:
        return [f"the step runs {n} lines in {m} files; cap {MAX_LINES} lines in {MAX_FILES} files"]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/reading_path.md is stale "
                    "or the cap is broken (default: rewrite the file)")
    a = ap.parse_args(argv)
    tr = trace()
    text = render(tr)
    n, m = summary(tr)
    bad = over_cap(n, m)
    if a.check:
        have = open(DOC).read() if os.path.exists(DOC) else ""
        if have != text:
            bad.append("docs/reading_path.md is stale: run python scripts/reading_path.py")
    else:
        with open(DOC, "w") as fh:
            fh.write(text)
    for b in bad:
        print("problem:", b)
    print(f"READING_PATH lines={n} files={m}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
