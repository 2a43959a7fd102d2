"""How often the toy teacher does each judged thing right: the share of its trajectories that meet
each check of the toy judge's static rubric set, and its mean static stage scores.

Not in the paper (the paper's teacher is an LLM). The toy SFT policy imitates this teacher, so a
check the teacher meets in a minority of its trajectories is one the greedy SFT policy inherits as a
flaw while sampling at T = 1 still explores the fix. The teacher's trajectories are scored as they
are written, through the same BM25 tool and the same judge as RL rollouts (no policy, no tokenizer).

    python scripts/teacher_flaws.py                                    # the default teacher
    python scripts/teacher_flaws.py --set teacher.p_skip=0.6 --set teacher.p_eval_bare=0.7
    python scripts/teacher_flaws.py -n 400 --json out.json

Prints one line per check kind: the share of trajectories where it is fully met (score 1), with the
stage it belongs to; then the mean static stage scores. Runs in seconds on one core.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from backends.run.overrides import apply_overrides  # noqa: E402
from backends.run.presets import toy_preset  # noqa: E402
from scaffold import (_CALL_RE, PARSERS, STAGES, Rollout, ToolCall, _strip_tool_outputs,  # noqa: E402
                      load_rows)
from toy.judge import ToyJudge  # noqa: E402
from toy.sft import sft_filter, teacher_trajectory  # noqa: E402
from toy.world import BM25SearchTool, make_world  # noqa: E402


def teacher_rollout(q, segments, tool, scaffold: str = "structured"):
    """A scaffold.Rollout of a teacher trace as the rollout engine would record it: the text, the
    environment's spans, the tool calls (re-run through the deterministic tool) and the evidence
    by handle. No token ids (the judge reads none)."""
    ro = Rollout(query=q, bank_items=[], prompt_ids=[])
    text = ""
    for j, (is_env, seg) in enumerate(segments):
        if is_env:
            start = len(text)
            prev = segments[j - 1][1] if j else ""
            calls = list(_CALL_RE.finditer(_strip_tool_outputs(prev)))
            name, query = (calls[-1].group(1), calls[-1].group(2).strip()) if calls else ("", "")
            if seg.lstrip().startswith("<tool_output>error:") or name != tool.name or not query:
                ro.tool_calls.append(ToolCall(name, query, [], [], "error"))
            else:
                results = tool(query)
                first = len(ro.evidence) + 1
                handles = list(range(first, first + len(results)))
                ro.evidence.update(zip(handles, results))
                ro.tool_calls.append(ToolCall(name, query, results, handles))
            ro.env_spans.append((start, start + len(seg)))
        text += seg
    ro.text = text.replace("<|im_end|>", "")
    ro.parsed = PARSERS[scaffold](ro.text, ro.env_spans)
    ro.finished = True
    return ro


def measure(cfg, n: int, seed: int = 0) -> dict:
    """Share of `n` teacher trajectories (train rows, drawn with `seed`) meeting each check kind,
    and the mean static stage scores. cfg: a settings.Config (its world and teacher sections)."""
    world = make_world(cfg.world)
    tool = BM25SearchTool(world.docs)
    judge = ToyJudge(world)
    rows = load_rows(world.train_rows)
    rng = random.Random(seed)
    met: dict[str, list[float]] = {}
    stage_of: dict[str, str] = {}
    scores = []
    while len(scores) < n:
        q = rng.choice(rows)
        tr = teacher_trajectory(q, tool, world, rng, cfg.teacher)
        if sft_filter(tr.segments):
            continue  # the SFT set keeps only filtered trajectories
        ro = teacher_rollout(q, tr.segments, tool)
        rubrics = judge.pool(q) + judge.initial_rubrics(q)
        S = judge.score_rubrics(q, [ro], rubrics)[0]
        per_kind: dict[str, list[float]] = {}
        for r, s in zip(rubrics, S):
            if r.check is None or not np.isfinite(s):
                continue
            kind = r.check[0]
            if kind == "ans_fact":  # split the facts a document gives from the unknown ones
                f = next(f for f in q.facts if f"{f['entity']} {f['aspect']}" == r.check[1])
                kind = "ans_fact" if f["doc_id"] else "ans_fact_unknown"
            per_kind.setdefault(kind, []).append(float(s))
            stage_of[kind] = STAGES[r.stage]
        for kind, v in per_kind.items():
            met.setdefault(kind, []).append(float(min(v) >= 1.0))
        scores.append(judge.evaluate(q, [ro])[0])
    S = np.array(scores)
    return {"n": n, "met": {k: float(np.mean(v)) for k, v in sorted(met.items())},
            "trajectories_with_check": {k: len(v) for k, v in sorted(met.items())},
            "stage_of": stage_of, "stage_scores": dict(zip(STAGES, S.mean(0).round(4).tolist()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="teacher trajectories kept by the SFT filters")
    ap.add_argument("--seed", type=int, default=0, help="which train rows and teacher draws")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=V",
                    help="a configuration override, as train.py --set (teacher.*, world.*)")
    ap.add_argument("--json", default="", help="also write the result here")
    a = ap.parse_args(argv)
    if a.n < 1:
        ap.error("-n must be >= 1")
    cfg = apply_overrides(toy_preset(), a.set)
    out = measure(cfg, a.n, a.seed)
    for k, v in out["met"].items():
        print(f"{out['stage_of'][k]:8s} {k:18s} met in {v:6.1%} of {out['trajectories_with_check'][k]}")
    print("static stage scores:", out["stage_scores"])
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
