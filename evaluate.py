"""Score a checkpoint's answers on the paper's four long-form rubric benchmarks, with their own formulas.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the long-form evaluation of the paper's results table: RubricEM-8B scores HealthBench 49.3,
ResearchQA 74.5, DeepResearch Bench (RACE) 47.8 and ResearchRubrics 50.3 (average 55.5; its SFT start
49.2; DR Tulu-8B RL 53.6). Rows are read in each benchmark's published format, answers come from a
JSONL file or from a policy checkpoint run through the scaffold with the search tool, an LLM judge over
HTTP (judge_http.HTTPJudge: Gemini or an OpenAI-compatible server, bounded concurrency, retries, disk
cache, cost accounting) grades them, and a JSON + markdown report is written.

Glossary: an *example* is one benchmark row (a task); an *item* one rubric line of it (HealthBench
rubric item, ResearchQA rubric item, RACE criterion, ResearchRubrics criterion); a *call* one judge
question (judge_http's glossary); an example is *skipped* when it has no answer or one of its calls
failed after the retry bound; skipped examples are counted by reason and left out of every mean.

Formulas (the function computing each)
    HealthBench      s_e = sum_{i met} p_i / sum_{i: p_i > 0} p_i  (not clipped)  healthbench_example_score
                     score = clip(mean_e s_e, 0, 1); std of 1000 bootstrap      clipped_mean, bootstrap
                     clipped means; per example tag / rubric tag the same
    ResearchQA       v_i = (x_i - 1) / 4, x_i in 1..5 (Not at all .. Completely)  researchqa_item_value
                     c_e = mean_i v_i; score = mean_e c_e                     researchqa_coverage
    DRB RACE         T_d = sum_c w_c s_c^T / sum_c w_c (R_d likewise)         race_dimension
                     T = sum_d W_d T_d, R = sum_d W_d R_d; task = T / (T + R)  race_totals, race_task_score
                     score = 100 * mean_tasks
    ResearchRubrics  c_e = sum_i w_i s_i / sum_{i: w_i > 0} w_i, s in {0, 1}   rubric_compliance
                     (ternary: Partially Satisfied = 0.5); score = mean_e c_e
    All              95% CI: 2.5 / 97.5 percentiles of the statistic over 1000  bootstrap
                     resamples of the examples (seeded)

Deviations (from the benchmarks' released graders; the formulas above are theirs)
    1. The grader prompts are our own wording, with each benchmark's output schema. ResearchQA's
       released grader answers one label per line; ours returns the same five labels as a JSON list
       (our HTTP judge validates JSON replies), one per item, in order.
    2. A call that still fails after judge_http's retry bound (1 + --judge-max-retries attempts,
       default 4) skips its whole example (counted, and named in a warning). The released graders bound attempts differently
       (ResearchQA: 3 then skip; RACE: 10 then skip; HealthBench: retries until valid).
    3. RACE matches a judge's criterion name to the task's criteria by exact, then case-insensitive,
       then substring name (either way round); a name that matches nothing gets the dimension's mean
       criterion weight (as we read the released scorer) and is counted in `unmatched`. A task whose
       T + R is 0 scores 0 (as released).
    4. Generating answers: a HealthBench conversation with more than one turn goes to the policy as
       one user message holding the transcript (the scaffold takes one query); the judge sees the
       original turns. The answer is the text inside <answer>; a rollout without one answers "" and
       is counted (`no_answer_tag`), then graded as is. Greedy decoding unless --gen-temperature.
    5. Responses and rows are matched by the benchmark's id (`prompt_id`, `id`, `id`, `sample_id`);
       the released RACE script matches by prompt text, which we accept as a fallback. Repeated ids
       are refused (either file).
    6. DRB target articles are cleaned of citations and reference lists by the judge before
       scoring (backends/eval/cleaning.py), as the released RACE pipeline does by default; the prompt is
       our own wording. Same semantics: a cleaning shorter than 100 characters is invalid, an
       article that cannot be cleaned whole is cleaned as two halves cut at a sentence end, and one
       that still fails is skipped. Default on, because the reference articles the targets are
       compared with were cleaned the same way; --drb-raw grades raw articles and the report says
       so. One extra call per article, billed as output tokens about the article's length.
    7. With --openai-response-format json_object the reply's JSON Schema and an example reply are
       written into the prompt (judge_prompts.schema_instruction), since the server sees no schema.
    8. --limit N draws N rows as simple-evals does (random.Random(0).sample); --limit-first takes
       the first N.

Stops and exit codes (main): 0 scored; 2 unusable input (one line naming the file, line and field),
an existing report without --overwrite, or no example scored; 3 an API answered 401/403/404 (its
message is printed and put in the report, nothing more is sent); 4 more than --max-skip-share
(default 5 %) of the examples skipped, --deadline included, unless --allow-skips. The report is
written in every case but 2 for bad input. Judge requests go through backends/api/http.HTTPClient (proxy
from the environment, Retry-After, 429 back-off, --judge-rpm / --judge-tpm); costs use
backends/api/pricing.py's dated table or --price-in / --price-out, else they are reported as unknown.

Here: the benchmarks' grader prompts, the parsing of the judge's replies, the score formulas and the
run of one benchmark (`grade`, `main`). In backends/eval/: reading and checking the rows and answers
(data.py), answers from a checkpoint (answers.py), the judge calls (grading.py), DRB cleaning
(cleaning.py), the report and exit status (report.py) and the arguments (cli.py).

Launch (keys only from the environment: GEMINI_API_KEY / OPENAI_API_KEY, SERPER_API_KEY)
    python evaluate.py healthbench --data healthbench.jsonl --responses answers.jsonl
    python evaluate.py researchqa --data test.json --model runs/toy/final --search toy \\
        --judge openai --judge-base-url http://localhost:8000/v1 --judge-model Qwen/Qwen3-8B
    python evaluate.py drb --data query.jsonl --criteria criteria.jsonl --reference reference.jsonl \\
        --model /ckpt/rubricem-8b --preset full --sampler vllm
    python evaluate.py researchrubrics --data researchrubrics.jsonl --responses r.jsonl --ternary
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from backends.api.judge_http import HTTPJudge
from backends.eval.answers import generate
from backends.eval.cleaning import clean_drb_answers
from backends.eval.cli import parse_args
from backends.eval.data import RACE_DIMS, finite, load_responses, load_rows, match_answers
from backends.eval.grading import DATA_NOTE, GradingStopped, Job, fence, run_jobs, schema_object
from backends.eval.report import build_report, exit_status, judge_config, score_line, write_report

log = logging.getLogger("rubricem.evaluate")


# PAPER: RubricEM-8B (RL) long-form scores, results table; SFT average 49.2, DR Tulu-8B RL average 53.6.
PAPER_SCORES = {"healthbench": 49.3, "researchqa": 74.5, "drb": 47.8, "researchrubrics": 50.3}
PAPER_AVERAGES = {"RubricEM-8B": 55.5, "RubricEM-8B SFT": 49.2, "DR Tulu-8B RL": 53.6}
RQA_LABELS = ("Not at all", "Barely", "Moderately", "Mostly", "Completely")  # x = 1..5
RR_VERDICTS = {"Satisfied": 1.0, "Partially Satisfied": 0.5, "Not Satisfied": 0.0}
BOOTSTRAP_N = 1000  # HealthBench's released grader: 1,000 bootstrap resamples
RQA_BATCH = 8  # ResearchQA's released grader: 8 rubric items per call


# ----------------------------------------------------------------------------------------------------
# Formulas: small pure functions
def healthbench_example_score(points: Sequence[float], met: Sequence[bool]) -> float | None:
    """HealthBench example score: achieved points over the possible (positive) points.

    points: item points (ints, may be negative); met: per item, the grader's criteria_met (for a
    negative item, True means the undesirable behaviour is present). Returns a float in
    [-sum |negative| / sum positive, 1], not clipped; None when no item has positive points (the
    example has no score). Raises ValueError if the lengths differ or a point value is not finite.
    """
    if len(points) != len(met):
        raise ValueError(f"{len(points)} points but {len(met)} verdicts")
    p = [finite(x, "points") for x in points]
    possible = sum(x for x in p if x > 0)
    if possible <= 0:
        return None
    # Eq.: s_e = sum_{i met} p_i / sum_{i: p_i > 0} p_i
    return sum(x for x, m in zip(p, met) if m) / possible


def clipped_mean(values: Sequence[float]) -> float:
    """HealthBench's aggregate: the mean of the example scores, then clipped to [0, 1].

    values: example scores (any finite reals). Returns a float in [0, 1]. Raises ValueError if empty.
    """
    if len(values) == 0:
        raise ValueError("no values to average")
    # Eq.: score = clip(mean_e s_e, 0, 1)
    return float(np.clip(np.mean(np.asarray(values, dtype=np.float64)), 0.0, 1.0))


def plain_mean(values: Sequence[float]) -> float:
    """Mean of the example scores (ResearchQA, RACE, ResearchRubrics). Raises ValueError if empty."""
    if len(values) == 0:
        raise ValueError("no values to average")
    return float(np.mean(np.asarray(values, dtype=np.float64)))


def bootstrap(values: Sequence[float], stat: Callable[[Sequence[float]], float] = plain_mean,
              n_resamples: int = BOOTSTRAP_N, seed: int = 0) -> dict:
    """Bootstrap of `stat` over the examples: {"std", "ci95": [lo, hi]}.

    values: (N,) example scores; stat: statistic of a sample (clipped_mean for HealthBench, whose
    released grader reports the std of 1000 resampled clipped means); resamples drawn with numpy's
    default_rng(seed), so the report is reproducible. ci95 = 2.5 / 97.5 percentiles of the resampled
    statistics; lo <= hi, both within [min stat, max stat] of the resamples. Raises ValueError if
    values is empty or n_resamples < 1.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or n_resamples < 1:
        raise ValueError("bootstrap needs at least one value and one resample")
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_resamples, v.size))  # (B, N)
    stats = np.array([stat(v[row]) for row in idx])  # (B,)
    return {"std": float(np.std(stats)),
            "ci95": [float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))]}


def researchqa_item_value(label: str) -> float:
    """ResearchQA item value of a coverage label: Not at all, Barely, Moderately, Mostly, Completely
    map to x = 1..5, value (x - 1) / 4 in {0, 0.25, 0.5, 0.75, 1}. Matching ignores case, surrounding
    space and trailing punctuation. Raises ValueError for any other label."""
    key = str(label).strip().rstrip(".!").strip().lower()
    for x, name in enumerate(RQA_LABELS, start=1):
        if key == name.lower():
            # Eq.: v = (x - 1) / 4
            return (x - 1) / 4
    raise ValueError(f"unknown coverage label {label!r}; expected one of {', '.join(RQA_LABELS)}")


def researchqa_coverage(labels: Sequence[str]) -> float:
    """ResearchQA example coverage: mean item value over the example's rubric items, in [0, 1].
    Raises ValueError on an empty list or an unknown label."""
    if not labels:
        raise ValueError("an example needs at least one label")
    # Eq.: c_e = mean_i (x_i - 1) / 4
    return sum(researchqa_item_value(lb) for lb in labels) / len(labels)


def race_dimension(weights: Sequence[float], target: Sequence[float],
                   reference: Sequence[float]) -> tuple[float, float]:
    """RACE per-dimension weighted averages (T_d, R_d) of the judge's 0-10 scores.

    weights: criterion weights w_c >= 0; target, reference: the scores of the target and the reference
    article per criterion, in [0, 10]. Returns (T_d, R_d) in [0, 10]^2; (0, 0) when sum w = 0 (no
    criterion scored, as the released scorer does). Raises ValueError if the lengths differ.
    """
    if not len(weights) == len(target) == len(reference):
        raise ValueError("weights, target and reference scores must have the same length")
    wsum = sum(weights)
    if wsum <= 0:
        return 0.0, 0.0
    # Eq.: T_d = sum_c w_c s_c^T / sum_c w_c ;  R_d = sum_c w_c s_c^R / sum_c w_c
    return (sum(w * s for w, s in zip(weights, target)) / wsum,
            sum(w * s for w, s in zip(weights, reference)) / wsum)


def race_totals(dim_weights: dict, per_dim: dict) -> tuple[float, float]:
    """RACE totals (T, R) = sum_d W_d (T_d, R_d). dim_weights: {dimension: W_d} (summing to 1);
    per_dim: {dimension: (T_d, R_d)}; a dimension missing from per_dim counts 0."""
    # Eq.: T = sum_d W_d T_d ;  R = sum_d W_d R_d
    T = sum(W * per_dim.get(d, (0.0, 0.0))[0] for d, W in dim_weights.items())
    R = sum(W * per_dim.get(d, (0.0, 0.0))[1] for d, W in dim_weights.items())
    return T, R


def race_task_score(T: float, R: float) -> float:
    """RACE task score T / (T + R) in [0, 1] for totals T, R >= 0; 0 when T + R = 0 (as released).
    Symmetric: race_task_score(T, R) + race_task_score(R, T) = 1 whenever T + R > 0. Raises
    ValueError for a negative or non-finite total."""
    T, R = finite(T, "T"), finite(R, "R")
    if T < 0 or R < 0:
        raise ValueError(f"RACE totals must be >= 0, got T={T}, R={R}")
    # Eq.: score = T / (T + R)
    return T / (T + R) if T + R > 0 else 0.0


def match_criterion(name: str, names: Sequence[str]) -> int | None:
    """Index in `names` of the criterion a judge called `name`: exact match, else case-insensitive
    (surrounding space ignored), else substring either way round (case-insensitive); the first in
    list order at each level. None when nothing matches or `name` is empty."""
    n = (name or "").strip()
    if not n:
        return None
    for i, c in enumerate(names):
        if c == n:
            return i
    low = n.lower()
    for i, c in enumerate(names):
        if c.strip().lower() == low:
            return i
    for i, c in enumerate(names):
        cl = c.strip().lower()
        if cl and (low in cl or cl in low):
            return i
    return None


def rubric_compliance(weights: Sequence[float], scores: Sequence[float]) -> float | None:
    """ResearchRubrics compliance: weighted satisfaction over the positive weight mass.

    weights: criterion weights (negative = a pitfall, where Satisfied means the report commits it);
    scores: s in {0, 1} (ternary: {0, 0.5, 1}). Returns a float in [-sum |w<0| / sum w>0, 1]; None when
    no weight is positive. Raises ValueError if the lengths differ.
    """
    if len(weights) != len(scores):
        raise ValueError(f"{len(weights)} weights but {len(scores)} scores")
    pos = sum(w for w in weights if w > 0)
    if pos <= 0:
        return None
    # Eq.: c_e = sum_i w_i s_i / sum_{i: w_i > 0} w_i
    return sum(w * s for w, s in zip(weights, scores)) / pos


# ----------------------------------------------------------------------------------------------------
# What the policy sees of a row (answers from a checkpoint: backends/eval/answers.py)


def policy_query(bench: str, row: dict) -> str:
    """The query text the policy sees for one row (deviation 4 for multi-turn HealthBench)."""
    if bench == "healthbench":
        msgs = row["prompt"]
        if len(msgs) == 1:
            return msgs[0]["content"]
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in msgs)
    return row["query"] if bench == "researchqa" else row["prompt"]


# ----------------------------------------------------------------------------------------------------
# Grader prompts (our own words) and reply validators (fence, schema_object, DATA_NOTE: the
# conventions every grader prompt follows, backends/eval/grading.py)

HB_SYSTEM = (
    "You grade the last assistant reply of a health conversation against a single rubric item "
    "written by a physician. Decide whether the reply fulfils what the item describes. An item with "
    "negative points describes something a good reply avoids: then criteria_met is true exactly when "
    "the reply does that undesirable thing. An item that names several requirements is met only if "
    "the reply meets all of them; an item that lists examples ('such as', 'e.g.') does not require "
    "every example. Write a short explanation first. " + DATA_NOTE)
HB_SCHEMA = schema_object({"explanation": {"type": "string"}, "criteria_met": {"type": "boolean"}})

RQA_SYSTEM = (
    "You measure how fully a research answer covers each of several rubric items. For every item "
    "choose one label: 'Not at all' (the answer gives no basis to infer it), 'Barely' (not stated, "
    "but it can be inferred), 'Moderately' (stated, but important details are missing), 'Mostly' "
    "(stated, some details missing), 'Completely' (stated with enough detail). Return exactly one "
    "label per item, in the items' order. " + DATA_NOTE)
RQA_SCHEMA = schema_object({"labels": {"type": "array", "items": {"type": "string", "enum": list(RQA_LABELS)}}})

RACE_SYSTEM = (
    "You are a demanding, even-handed reviewer of research reports. Two reports answer the same "
    "research task. Compare them criterion by criterion along four dimensions (comprehensiveness, "
    "insight, instruction following, readability) and give each report a score from 0 to 10 on every "
    "listed criterion: 0-2 very weak, 2-4 weak, 4-6 adequate, 6-8 good, 8-10 excellent; decimals are "
    "allowed. Copy each criterion's name as given and write the comparative analysis before the two "
    "scores. article_1 is Report 1, article_2 is Report 2. " + DATA_NOTE)
_RACE_ITEM = schema_object({"criterion": {"type": "string"}, "analysis": {"type": "string"},
                   "article_1_score": {"type": "number"}, "article_2_score": {"type": "number"}})
RACE_SCHEMA = schema_object({d: {"type": "array", "items": _RACE_ITEM} for d in RACE_DIMS})

RR_SYSTEM = (
    "You check one research report against one grading criterion written by an expert. A criterion "
    "with negative weight describes a mistake or pitfall: then the verdict says whether the report "
    "commits it ('Satisfied' = the pitfall is present). Give a brief explanation, then the verdict and "
    "its score (Satisfied 1, Partially Satisfied 0.5 where allowed, Not Satisfied 0). " + DATA_NOTE)


def rr_schema(ternary: bool) -> dict:
    """ResearchRubrics reply schema: {explanation, verdict, score}; verdicts binary or ternary."""
    verdicts = list(RR_VERDICTS) if ternary else ["Satisfied", "Not Satisfied"]
    return schema_object({"explanation": {"type": "string"}, "verdict": {"type": "string", "enum": verdicts},
                 "score": {"type": "number"}})


def validate_hb(obj: Any) -> dict:
    """{"explanation": str, "criteria_met": bool}; ValueError otherwise (the call is re-asked)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("criteria_met"), bool):
        raise ValueError("reply needs a boolean `criteria_met`")
    return {"explanation": str(obj.get("explanation", ""))[:500], "criteria_met": obj["criteria_met"]}


def validate_rqa(obj: Any, n: int) -> dict:
    """{"labels": [n known labels]}: a wrong label count or an unknown label is invalid (re-asked)."""
    labels = obj.get("labels") if isinstance(obj, dict) else None
    if not isinstance(labels, list) or len(labels) != n:
        raise ValueError(f"expected {n} labels, got {len(labels) if isinstance(labels, list) else 'none'}")
    return {"labels": [RQA_LABELS[int(round(researchqa_item_value(lb) * 4))] for lb in labels]}


def validate_race(obj: Any) -> dict:
    """All four dimensions present, each a list of {criterion, article_1_score, article_2_score in
    [0, 10]}; entries without a criterion name are dropped. ValueError otherwise (re-asked)."""
    if not isinstance(obj, dict):
        raise ValueError("reply is not an object")
    out = {}
    for d in RACE_DIMS:
        if not isinstance(obj.get(d), list):
            raise ValueError(f"missing dimension {d}")
        rows = []
        for e in obj[d]:
            if not isinstance(e, dict) or not isinstance(e.get("criterion"), str):
                continue
            a, b = e.get("article_1_score"), e.get("article_2_score")
            for v in (a, b):
                if finite(v, "article score") < 0 or v > 10:
                    raise ValueError(f"score {v!r} outside [0, 10]")
            rows.append({"criterion": e["criterion"], "article_1_score": float(a),
                         "article_2_score": float(b)})
        out[d] = rows
    return out


def validate_rr(obj: Any, ternary: bool) -> dict:
    """{explanation, verdict, score}: the verdict must be allowed (Partially Satisfied only when
    ternary); s comes from the verdict, the reported score is kept for the record."""
    allowed = {k: v for k, v in RR_VERDICTS.items() if ternary or k != "Partially Satisfied"}
    v = obj.get("verdict") if isinstance(obj, dict) else None
    if v not in allowed:
        raise ValueError(f"verdict {v!r} not in {sorted(allowed)}")
    rep = obj.get("score")
    return {"verdict": v, "s": allowed[v], "reported_score": rep if isinstance(rep, (int, float)) else None,
            "explanation": str(obj.get("explanation", ""))[:500]}


# ----------------------------------------------------------------------------------------------------
# Grading: one job per judge call (run through the HTTP judge: backends/eval/grading.run_jobs)


def _conversation(msgs: list, answer: str) -> str:
    turns = [f"[{m['role']}]\n" + fence(m["content"], f"turn-{t}") for t, m in enumerate(msgs)]
    return "\n".join(turns) + "\n[assistant, final reply to grade]\n" + fence(answer, "reply")


def jobs_healthbench(rows, answers) -> list[Job]:
    """One call per (example, rubric item)."""
    jobs = []
    for e, (r, a) in enumerate(zip(rows, answers)):
        if a is None:
            continue
        conv = _conversation(r["prompt"], a)
        for i, it in enumerate(r["items"]):
            user = (f"Conversation:\n{conv}\n\nRubric item ({it['points']:+g} points):\n{it['criterion']}"
                    "\n\nDoes the final reply meet this rubric item?")
            jobs.append(Job(e, i, HB_SYSTEM, user, HB_SCHEMA, validate_hb))
    return jobs


def jobs_researchqa(rows, answers, batch: int = RQA_BATCH) -> list[Job]:
    """One call per batch of `batch` rubric items of an example."""
    jobs = []
    for e, (r, a) in enumerate(zip(rows, answers)):
        if a is None:
            continue
        for s in range(0, len(r["items"]), batch):
            chunk = r["items"][s:s + batch]
            user = ("Answer:\n" + fence(a, "answer") + "\n\nRubric items:\n"
                    + "\n".join(f"{k + 1}. {it['item']}" for k, it in enumerate(chunk))
                    + f"\n\nGive {len(chunk)} labels, one per item, in order.")
            jobs.append(Job(e, s, RQA_SYSTEM, user, RQA_SCHEMA,
                            lambda o, n=len(chunk): validate_rqa(o, n)))
    return jobs


def jobs_drb(rows, answers) -> list[Job]:
    """One call per task: target (article_1) and reference (article_2) on every criterion."""
    jobs = []
    for e, (r, a) in enumerate(zip(rows, answers)):
        if a is None:
            continue
        crit = json.dumps({d: [{"criterion": c["criterion"], "explanation": c["explanation"]}
                               for c in r["criteria"][d]] for d in RACE_DIMS}, ensure_ascii=False, indent=1)
        user = ("Research task:\n" + fence(r["prompt"], "task") + "\n\nReport 1 (article_1):\n"
                + fence(a, "article_1") + "\n\nReport 2 (article_2):\n" + fence(r["reference"], "article_2")
                + "\n\nCriteria by dimension (JSON):\n" + crit
                + "\n\nScore both reports on every criterion of every dimension.")
        jobs.append(Job(e, 0, RACE_SYSTEM, user, RACE_SCHEMA, validate_race))
    return jobs


def jobs_researchrubrics(rows, answers, ternary: bool = False) -> list[Job]:
    """One call per (report, criterion)."""
    jobs, schema = [], rr_schema(ternary)
    for e, (r, a) in enumerate(zip(rows, answers)):
        if a is None:
            continue
        for i, it in enumerate(r["items"]):
            user = ("Research request:\n" + fence(r["prompt"], "request") + "\n\nReport:\n"
                    + fence(a, "report") + f"\n\nCriterion (weight {it['weight']:+g}, axis "
                    f"{it['axis'] or 'n/a'}):\n{it['criterion']}\n\nIs the criterion satisfied?")
            jobs.append(Job(e, i, RR_SYSTEM, user, schema, lambda o: validate_rr(o, ternary)))
    return jobs


# ----------------------------------------------------------------------------------------------------
# Assembling example rows and the benchmark summary


def _skip(row: dict, reason: str) -> dict:
    return {"id": row["id"], "score": None, "skipped": reason}


def _replies(res: dict, e: int, keys) -> list | None:
    got = [res.get((e, k)) for k in keys]
    return None if any(g is None for g in got) else got


def _graded(rows, answers, res, keys, out: list, failed: str = "judge call failed"):
    """The examples that have an answer and every judge reply, in order: yields (row, replies) and
    appends a skip row to `out` for each other example ("no response", or `failed`). keys(row) -> the
    call keys of that example's judge calls."""
    for e, (r, a) in enumerate(zip(rows, answers)):
        if a is None:
            out.append(_skip(r, "no response"))
            continue
        rep = _replies(res, e, keys(r))
        if rep is None:
            out.append(_skip(r, failed))
            continue
        yield r, rep


def examples_healthbench(rows, answers, res) -> list[dict]:
    """Per example: score s_e (or skipped), per-item verdicts, per rubric tag the tag's score."""
    out = []
    for r, rep in _graded(rows, answers, res, lambda r: range(len(r["items"])), out):
        pts, met = [it["points"] for it in r["items"]], [g["criteria_met"] for g in rep]
        s = healthbench_example_score(pts, met)
        if s is None:
            out.append(_skip(r, "no positive points"))
            continue
        tags: dict = {}
        for t in sorted({t for it in r["items"] for t in it["tags"]}):
            sel = [k for k, it in enumerate(r["items"]) if t in it["tags"]]
            v = healthbench_example_score([pts[k] for k in sel], [met[k] for k in sel])
            if v is not None:  # a tag with no positive item in this example is dropped
                tags[t] = v
        out.append({"id": r["id"], "score": s, "example_tags": r["example_tags"], "rubric_tags": tags,
                    "items": [{"criterion": it["criterion"], "points": it["points"],
                               "met": g["criteria_met"], "explanation": g["explanation"]}
                              for it, g in zip(r["items"], rep)]})
    return out


def examples_researchqa(rows, answers, res, batch: int = RQA_BATCH) -> list[dict]:
    """Per example: coverage c_e (or skipped) and each item's label and value."""
    out = []
    for r, rep in _graded(rows, answers, res, lambda r: range(0, len(r["items"]), batch), out,
                          failed="label count wrong or call failed after retries"):
        labels = [lb for g in rep for lb in g["labels"]]
        out.append({"id": r["id"], "score": researchqa_coverage(labels),
                    "general_domain": r["general_domain"],
                    "items": [{"item": it["item"], "type": it["type"], "label": lb,
                               "value": researchqa_item_value(lb)} for it, lb in zip(r["items"], labels)]})
    return out


def race_from_reply(reply: dict, task: dict) -> dict:
    """Per-dimension (T_d, R_d), totals, task score and unmatched names from one validated RACE reply
    (deviation 3 for unmatched names)."""
    per_dim, unmatched = {}, []
    for d in RACE_DIMS:
        crits = task["criteria"][d]
        names = [c["criterion"] for c in crits]
        mean_w = sum(c["weight"] for c in crits) / len(crits)
        w, t, ref = [], [], []
        for e in reply[d]:
            k = match_criterion(e["criterion"], names)
            if k is None:
                unmatched.append(f"{d}: {e['criterion'][:80]}")
            w.append(crits[k]["weight"] if k is not None else mean_w)
            t.append(e["article_1_score"])
            ref.append(e["article_2_score"])
        per_dim[d] = race_dimension(w, t, ref)
    T, R = race_totals(task["dim_weights"], per_dim)
    return {"score": race_task_score(T, R), "T": T, "R": R,
            "dimensions": {d: race_task_score(*per_dim[d]) for d in RACE_DIMS},
            "dimension_TR": {d: list(per_dim[d]) for d in RACE_DIMS}, "unmatched": unmatched}


def examples_drb(rows, answers, res) -> list[dict]:
    out = []
    for r, (rep,) in _graded(rows, answers, res, lambda r: [0], out):
        out.append({"id": r["id"], "language": r["language"], **race_from_reply(rep, r)})
    return out


def examples_researchrubrics(rows, answers, res) -> list[dict]:
    out = []
    for r, rep in _graded(rows, answers, res, lambda r: range(len(r["items"])), out):
        w, s = [it["weight"] for it in r["items"]], [g["s"] for g in rep]
        c = rubric_compliance(w, s)
        if c is None:
            out.append(_skip(r, "no positive weight"))
            continue
        axes = {}
        for ax in sorted({it["axis"] for it in r["items"]}):
            sel = [k for k, it in enumerate(r["items"]) if it["axis"] == ax]
            v = rubric_compliance([w[k] for k in sel], [s[k] for k in sel])
            if v is not None:
                axes[ax] = v
        out.append({"id": r["id"], "score": c, "domain": r["domain"], "axes": axes,
                    "items": [{"criterion": it["criterion"], "weight": it["weight"],
                               "verdict": g["verdict"], "s": g["s"], "explanation": g["explanation"]}
                              for it, g in zip(r["items"], rep)]})
    return out


def _group(rows: list[dict], keys_of: Callable[[dict], dict], stat, seed: int) -> dict:
    """{name: {score, std, n}} over the values keys_of(example) gives per name."""
    vals: dict = {}
    for r in rows:
        for k, v in keys_of(r).items():
            vals.setdefault(k, []).append(v)
    return {k: {"score": stat(v), "std": bootstrap(v, stat, seed=seed)["std"], "n": len(v)}
            for k, v in sorted(vals.items())}


def summarize(bench: str, examples: list[dict], seed: int = 0, n_resamples: int = BOOTSTRAP_N) -> dict:
    """Benchmark score in [0, 1] (score_100 on the paper's scale), bootstrap std and 95% CI,
    breakdowns and skipped counts. When no example could be scored, score, score_100, std and
    ci95 are None (n = 0) and the breakdown is empty."""
    ok = [r for r in examples if r.get("score") is not None]
    skipped: dict = {}
    for r in examples:
        if r.get("skipped"):
            skipped[r["skipped"]] = skipped.get(r["skipped"], 0) + 1
    if not ok:  # the report is still written: the skips and the judge's figures say why
        return {"score": None, "score_100": None, "std": None, "ci95": None, "n": 0,
                "n_rows": len(examples), "skipped": {"count": len(examples), **skipped},
                "breakdown": {}}
    stat = clipped_mean if bench == "healthbench" else plain_mean
    vals = [r["score"] for r in ok]
    score = stat(vals)
    bs = bootstrap(vals, stat, n_resamples, seed)
    if bench == "healthbench":
        breakdown = {"example_tag": _group(ok, lambda r: dict.fromkeys(r["example_tags"], r["score"]),
                                           stat, seed),
                     "rubric_tag": _group(ok, lambda r: r["rubric_tags"], stat, seed)}
    elif bench == "researchqa":
        def by_type(r):
            acc: dict = {}
            for it in r["items"]:  # an item of several types counts under each of them
                for t in it["type"] or ["untyped"]:
                    acc.setdefault(t, []).append(it["value"])
            return {k: sum(v) / len(v) for k, v in acc.items()}
        breakdown = {"item_type": _group(ok, by_type, stat, seed),
                     "general_domain": _group(ok, lambda r: {r["general_domain"]: r["score"]}, stat, seed)}
    elif bench == "drb":
        breakdown = {"dimension": _group(ok, lambda r: r["dimensions"], stat, seed),
                     "language": _group(ok, lambda r: {r["language"] or "?": r["score"]}, stat, seed)}
    else:
        breakdown = {"axis": _group(ok, lambda r: r["axes"], stat, seed),
                     "domain": _group(ok, lambda r: {r["domain"] or "?": r["score"]}, stat, seed)}
    return {"score": score, "score_100": 100 * score, "std": bs["std"], "ci95": bs["ci95"],
            "n": len(ok), "n_rows": len(examples), "skipped": {"count": len(examples) - len(ok), **skipped},
            "breakdown": breakdown}


# ----------------------------------------------------------------------------------------------------
# One benchmark end to end


BENCHMARKS = {
    "healthbench": dict(id_key="prompt_id", jobs=jobs_healthbench, examples=examples_healthbench),
    "researchqa": dict(id_key="id", jobs=jobs_researchqa, examples=examples_researchqa),
    "drb": dict(id_key="id", jobs=jobs_drb, examples=examples_drb),
    "researchrubrics": dict(id_key="sample_id", jobs=jobs_researchrubrics,
                            examples=examples_researchrubrics),
}


def grade(bench: str, rows: list[dict], answers: list[str | None], judge, concurrency: int = 8,
          ternary: bool = False, seed: int = 0, progress: bool = True, deadline: float | None = None,
          clean: bool = False) -> dict:
    """Grade `answers` (aligned with rows; None = no answer) with `judge` (judge_http.HTTPJudge or any
    object with its `ask`); returns {"summary", "examples", "calls", "stopped" (None, or why the
    grading stopped early: a 401/403/404 with the server's message, or the deadline), "stop_error"
    (the exception or None), "cleaning" (drb with clean=True: `clean_drb_answers`' counts)}.
    Never raises on judge failures: they skip their example, and so does an example not graded when
    the grading stopped. clean: DRB target articles cleaned first (the released pipeline's step)."""
    spec, names = BENCHMARKS[bench], [r["id"] for r in rows]
    stopped, cleaning, given = None, None, list(answers)
    if bench == "drb" and clean:
        try:
            answers, cleaning = clean_drb_answers(judge, rows, answers, concurrency, progress, deadline)
        except GradingStopped as e:
            stopped, answers = e, [None] * len(rows)
    jobs = (spec["jobs"](rows, answers, ternary) if bench == "researchrubrics"
            else spec["jobs"](rows, answers))
    res: dict = {}
    if stopped is None:
        try:
            res = run_jobs(judge, jobs, concurrency, progress, f"grading {bench}", deadline, names)
        except GradingStopped as e:
            stopped, res = e, e.results
    examples = spec["examples"](rows, answers, res)
    not_graded = {j.ex for j in jobs if (j.ex, j.key) not in res}
    for e, ex in enumerate(examples):  # one example row per benchmark row, in order
        if ex.get("skipped") and (e in not_graded or stopped is not None and given[e] is not None
                                  and answers[e] is None and not (cleaning and names[e] in cleaning["failed"])):
            ex["skipped"] = "not graded: the run stopped early"
        elif ex.get("skipped") == "no response" and cleaning and names[e] in cleaning["failed"]:
            ex["skipped"] = "article cleaning failed"
    skipped = [ex for ex in examples if ex.get("skipped")]
    for ex in skipped[:50] if stopped is None else ():  # each skip named (a stop says it once)
        log.warning("example %s skipped: %s", ex["id"], ex["skipped"])
    if len(skipped) > 50 and stopped is None:
        log.warning("... and %d more skipped examples (report.json lists them)", len(skipped) - 50)
    return {"summary": summarize(bench, examples, seed), "examples": examples, "calls": len(jobs),
            "stopped": str(stopped) if stopped is not None else None,
            "stop_error": stopped.cause if stopped is not None else None, "cleaning": cleaning}


# ----------------------------------------------------------------------------------------------------
# CLI (arguments, answers, report: backends/eval/)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: load rows, get answers, grade, write report.json / report.md; prints the score line.
    Exit codes: 0 scored; 2 bad input (a one-line error naming the file, line and field), an
    existing report without --overwrite, or no example scored; 3 an API answered 401/403/404 (the
    report of what was graded is written); 4 more than --max-skip-share of the examples skipped
    (the deadline included) without --allow-skips."""
    a = parse_args(argv, sorted(BENCHMARKS), __doc__.split("\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    progress, out_dir = not a.no_progress, a.out or os.path.join("runs", "eval", a.benchmark)
    if os.path.exists(os.path.join(out_dir, "report.json")) and not a.overwrite:
        log.error("%s already holds a report; pass --overwrite to replace it or --out DIR", out_dir)
        return 2
    t0, gen_info = time.perf_counter(), {}
    try:  # bad input is one line (DataError names the file, line and field), never a traceback
        rows = load_rows(a.benchmark, a.data, a.criteria, a.reference, a.limit, a.language,
                         a.limit_first)
        hc = judge_config(a)
        if a.responses:
            answers = match_answers(rows, load_responses(a.responses, BENCHMARKS[a.benchmark]["id_key"]))
        else:
            answers, gen_info = generate(a, rows, [policy_query(a.benchmark, r) for r in rows], out_dir,
                                         progress)
    except (ValueError, FileNotFoundError) as e:
        log.error("%s", e)
        return 2
    deadline = time.monotonic() + a.deadline if a.deadline > 0 else None
    clean = a.benchmark == "drb" and not a.drb_raw
    with HTTPJudge(*hc) as judge:
        judge.client.deadline = deadline  # no request runs past it
        result = grade(a.benchmark, rows, answers, judge, a.judge_concurrency, a.ternary, a.seed,
                       progress, deadline, clean)
        stats = judge.stats()
    paper = {"RubricEM-8B": PAPER_SCORES[a.benchmark], "averages": PAPER_AVERAGES}
    method = {"bootstrap": {"n": BOOTSTRAP_N, "seed": a.seed}, "researchqa_batch": RQA_BATCH}
    rep = build_report(a, hc, result, stats, gen_info, clean, time.perf_counter() - t0, paper, method)
    print(score_line(a.benchmark, result["summary"], stats, write_report(rep, out_dir)))
    return exit_status(a, result)


if __name__ == "__main__":
    sys.exit(main())
