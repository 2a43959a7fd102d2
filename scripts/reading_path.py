"""The reading path of one RL step: the functions a reader follows from the step function to the
optimizer step, with file:line and length, written into docs/reading_path.md.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
One step of Algorithm 1 (train.rl_step) -> memory retrieval, rollouts (scaffold.RolloutEngine, read
as a black box here), the stage judge's four steps (§3.4), SS-GRPO advantages (§3.3), the one policy
update (policy.policy_update) and the reflection branch (§3.4). Lines are counted from the source
(each function's def to its last line, docstring included), so the figures follow the code.

Run from the repository root:
    python scripts/reading_path.py            # rewrite docs/reading_path.md
    python scripts/reading_path.py --check    # exit 1 if the file is stale or a limit is broken
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "reading_path.md")

# (file, qualified function name, what it is): in reading order.
PATH = [
    ("train.py", "rl_step", "one step of Algorithm 1, as named steps"),
    ("train.py", "apply_reflection_batch", "the previous step's reflection GRPO batch (one-step lag)"),
    ("train.py", "retrieve_memory", "step 2: rubric-bank items per query"),
    ("train.py", "sample_rollouts", "step 3: n rollouts per query"),
    ("train.py", "judge_groups", "step 4: one judge call per group"),
    ("judge.py", "EvolvingJudge.judge_group", "§3.4 propose -> merge -> score -> prune"),
    ("judge.py", "EvolvingJudge._propose_step", "§3.4 (1)-(2) propose and merge"),
    ("judge.py", "EvolvingJudge._score_step", "§3.4 (3) R on the merged set"),
    ("judge.py", "EvolvingJudge._prune_step", "§3.4 (4) prune for the next step"),
    ("judge.py", "discriminativeness", "d_r = Std_i s_{i,r}"),
    ("ss_grpo.py", "task_advantages", "step 5: the arm's advantages from R"),
    ("ss_grpo.py", "stage_returns", "§3.3 G = R Lambda^T"),
    ("ss_grpo.py", "group_advantages_batched", "§3.3 A = (G - mean) / (Std + eps) per group"),
    ("train.py", "update_batch", "token advantages of the update batch"),
    ("ss_grpo.py", "token_advantages", "§3.3 token t in B_{i,k} gets A_{i,k}"),
    ("policy.py", "TorchEngine.update", "step 6: the update on one process"),
    ("policy.py", "plan_update", "minibatches (and ranks) of the update"),
    ("policy.py", "policy_update", "the one SS-GRPO update of both engines"),
    ("policy.py", "sequence_logprobs", "old / reference log-probs"),
    ("policy.py", "_minibatch", "forward, loss and backward of one optimizer step"),
    ("ss_grpo.py", "ss_grpo_loss", "§3.3 PPO-clip + beta k3 loss"),
    ("policy.py", "TorchEngine.step", "clip and optimizer step"),
    ("train.py", "reflect", "step 7: the reflection branch"),
    ("reflection.py", "run_reflection_branch", "§3.4 reflection candidates, privileged judge, bank, GRPO groups"),
]
MAX_LINES, MAX_FILES, MAX_STEP_BODY, MAX_FUNCTION = 800, 5, 50, 80
CONCEPT_MODULES = ("scaffold.py", "judge.py", "ss_grpo.py", "reflection.py", "bank.py", "train.py")


def functions(path: str) -> dict[str, ast.AST]:
    """Qualified name ("f" or "Class.f") -> the def node, for the module-level functions and methods."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    out[f"{node.name}.{sub.name}"] = sub
    return out


def span(node: ast.AST) -> tuple[int, int]:
    """(first line, length in lines) of a def, decorators excluded."""
    return node.lineno, node.end_lineno - node.lineno + 1


def body_lines(node: ast.FunctionDef) -> int:
    """Lines of a function's body after its docstring."""
    body = node.body[1:] if (node.body and isinstance(node.body[0], ast.Expr)
                             and isinstance(node.body[0].value, ast.Constant)) else node.body
    return body[-1].end_lineno - body[0].lineno + 1


def measure() -> dict:
    """The reading path's rows and totals, the step body's length and the concept modules' longest
    functions. Raises KeyError naming a function of PATH that no longer exists."""
    rows, cache = [], {}
    for path, name, what in PATH:
        fns = cache.setdefault(path, functions(path))
        if name not in fns:
            raise KeyError(f"{path} has no function {name}: update scripts/reading_path.py")
        line, n = span(fns[name])
        rows.append((path, name, line, n, what))
    long = []
    for path in CONCEPT_MODULES:
        for name, node in functions(path).items():
            if span(node)[1] > MAX_FUNCTION:
                long.append((path, name, span(node)[1]))
    return {"rows": rows, "lines": sum(r[3] for r in rows), "files": sorted({r[0] for r in rows}),
            "step_body": body_lines(cache["train.py"]["rl_step"]), "long": long}


def render(res: dict) -> str:
    out = ["# Reading one RL step", "",
           "Written by `python scripts/reading_path.py` from the current source; "
           "`tests/test_imports.py` checks that it is up to date.", "",
           "Follow one step of Algorithm 1 from `train.rl_step` to the optimizer step, in this order. "
           "The rollout engine (`scaffold.RolloutEngine.run`), the bank's retrieval "
           "(`bank.RubricBank.retrieve`) and the windowed curriculum's schedule (`bank.curriculum`, "
           "§3.5: which batch a step trains on and whether it retrieves in exact or similar mode) are "
           "read as black boxes here; their tests show what they do.", "",
           "| # | file:line | function | lines | what |", "|---|---|---|---|---|"]
    for i, (path, name, line, n, what) in enumerate(res["rows"], 1):
        out.append(f"| {i} | {path}:{line} | `{name}` | {n} | {what} |")
    out += ["", f"Total: {res['lines']} lines in {len(res['files'])} files "
            f"({', '.join(res['files'])}); limits {MAX_LINES} lines, {MAX_FILES} files.",
            f"The step body (`train.rl_step` after its docstring): {res['step_body']} lines "
            f"(limit {MAX_STEP_BODY}).",
            f"Functions over {MAX_FUNCTION} lines in the concept modules ({', '.join(CONCEPT_MODULES)}): "
            + (", ".join(f"{p}:{n} ({k})" for p, n, k in res["long"]) or "none") + "."]
    return "\n".join(out) + "\n"


def problems(res: dict) -> list[str]:
    out = []
    if res["lines"] > MAX_LINES:
        out.append(f"reading path {res['lines']} lines > {MAX_LINES}")
    if len(res["files"]) > MAX_FILES:
        out.append(f"reading path spans {len(res['files'])} files > {MAX_FILES}")
    if res["step_body"] > MAX_STEP_BODY:
        out.append(f"rl_step body {res['step_body']} lines > {MAX_STEP_BODY}")
    out += [f"{p}: {n} has {k} lines > {MAX_FUNCTION}" for p, n, k in res["long"]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/reading_path.md is stale "
                    "or a limit is broken (default: rewrite the file)")
    a = ap.parse_args(argv)
    res = measure()
    text = render(res)
    bad = problems(res)
    if a.check:
        have = open(DOC).read() if os.path.exists(DOC) else ""
        if have != text:
            bad.append("docs/reading_path.md is stale: run python scripts/reading_path.py")
    else:
        with open(DOC, "w") as fh:
            fh.write(text)
    print(text if not a.check else "", end="")
    for b in bad:
        print("problem:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
