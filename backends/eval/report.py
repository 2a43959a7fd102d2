"""The evaluation's report: report.json (everything) and report.md (score, CI, paper, breakdowns,
skipped, cost, settings), the judge's settings from the command line, and the exit status.

Not part of the paper's method: reporting. The paper's scores and the score formulas are evaluate.py's.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict

from backends.api.pricing import resolve_prices, unknown_price_message
from backends.api.settings import judge_configs
from backends.run.checkpoint import atomic_write_bytes

log = logging.getLogger("rubricem.evaluate")

# Evaluation fields of the judge config written to the report (not the training-only ones).
JUDGE_REPORT_FIELDS = ("backend", "model", "base_url", "temperature", "thinking_budget",
                       "openai_response_format", "gemini_schema_field", "max_output_tokens",
                       "concurrency", "rpm", "tpm", "timeout_s", "max_retries", "backoff_s",
                       "retry_after_max_s", "price_in", "price_out", "prompt_version", "cache_dir")
BACKEND_ONLY = {"thinking_budget": "gemini", "gemini_schema_field": "gemini",
                "openai_response_format": "openai"}


def judge_config(a: argparse.Namespace):
    """The evaluation judge's (judge section, judge_http section) from the CLI (hparams.JudgeConfig,
    judge_http.HTTPJudgeConfig); raises ValueError for prices given half."""
    hc = judge_configs(backend=a.judge, model=a.judge_model, base_url=a.judge_base_url,
                     timeout_s=a.judge_timeout, max_retries=a.judge_max_retries,
                     backoff_s=a.judge_backoff, concurrency=a.judge_concurrency, rpm=a.judge_rpm,
                     tpm=a.judge_tpm, cache_dir=a.judge_cache_dir, prompt_version="eval-v1",
                     price_in=a.price_in, price_out=a.price_out, thinking_budget=a.thinking_budget,
                     openai_response_format=a.openai_response_format)
    resolve_prices(hc[0].model, hc[1].price_in, hc[1].price_out)
    return hc


def write_report(report: dict, out_dir: str) -> tuple[str, str]:
    """report.json (everything) and report.md (score, CI, paper, breakdown, skipped, cost, settings)
    under out_dir, written atomically. Returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    jp, mp = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    atomic_write_bytes(jp, json.dumps(report, indent=1, ensure_ascii=False).encode("utf-8"))
    s, b = report["summary"], report["benchmark"]
    if s["score"] is None:
        lines = [f"# {b}: no example could be scored", ""]
    else:
        lo, hi = s["ci95"]
        lines = [f"# {b}: {s['score_100']:.1f} (95% CI {100 * lo:.1f}-{100 * hi:.1f}, bootstrap std "
                 f"{100 * s['std']:.2f})", ""]
    lines += [f"Scored {s['n']} of {s['n_rows']} examples; skipped {s['skipped']['count']}"
              + "".join(f", {k}: {v}" for k, v in s["skipped"].items() if k != "count") + ".",
              f"Paper (RubricEM-8B): {report['paper']['RubricEM-8B']}.", ""]
    for note in report.get("notes", []):
        lines += [f"**{note}**", ""]
    for group, rows in s["breakdown"].items():
        lines += [f"| {group} | score | std | n |", "|---|---|---|---|"]
        lines += [f"| {k} | {100 * v['score']:.1f} | {100 * v['std']:.2f} | {v['n']} |"
                  for k, v in rows.items()]
        lines.append("")
    unmatched = [(r["id"], n) for r in report.get("examples", []) for n in r.get("unmatched", [])]
    if unmatched:  # DRB: judge criterion names that matched none of the task's (deviation 3)
        lines += [f"Unmatched criterion names ({len(unmatched)}; each weighted by its dimension's "
                  "mean criterion weight):", ""] + [f"- task {t}: {n}" for t, n in unmatched] + [""]
    j = report["judge"]
    usd = j.get("judge/usd_total", j.get("judge/cost_usd"))
    cost = (f"${usd:.4f} (prices: {report.get('price', '')})" if usd is not None else
            f"cost unknown: {report.get('price', 'no price').rstrip('.')}")
    lines += [f"Judge: {j.get('judge/calls', 0)} calls, {j.get('judge/requests', 0)} requests, "
              f"{j.get('judge/failures', 0)} failed, {j.get('judge/cache_hits', 0)} cached, "
              f"{j.get('judge/throttled', 0)} throttled (429), {j.get('judge/tokens_in', 0)} input + "
              f"{j.get('judge/tokens_out', 0)} output tokens, {cost}.", "", "Settings:", "```",
              json.dumps(report["settings"], indent=1), "```", ""]
    atomic_write_bytes(mp, "\n".join(lines).encode("utf-8"))
    return jp, mp


def build_report(a: argparse.Namespace, hc, result: dict, stats: dict, gen_info: dict, clean: bool,
                 wall_s: float, paper: dict, method: dict) -> dict:
    """report.json's content: summary, paper scores, judge counters and prices, notes (DRB cleaning,
    an early stop), the evaluation settings (no training-only fields) and every example. paper: the
    paper's scores ({"RubricEM-8B": this benchmark's, "averages": ...}); method: the grading
    settings the formulas fix ({"bootstrap": {"n", "seed"}, "researchqa_batch"})."""
    jc, http = hc  # judge_config's pair
    prices = resolve_prices(jc.model, http.price_in, http.price_out)
    judge_settings = {**asdict(jc), **asdict(http)}
    notes = []
    if a.benchmark == "drb":
        notes.append("DRB target articles: " + (
            "cleaned of citations and reference lists by the judge before scoring, as the released "
            "RACE pipeline does" if clean else "graded RAW (--drb-raw): citations and reference lists "
            "were not removed, unlike the released RACE pipeline; not comparable to its scores"))
    if result["stopped"]:
        notes.append(f"Stopped early: {result['stopped']}")
    settings = {"benchmark": a.benchmark, "data": a.data, "criteria": a.criteria, "reference": a.reference,
                "language": a.language, "limit": a.limit,
                "sampling": "first N" if a.limit_first else "random.Random(0).sample",
                "responses": a.responses or "", "generation": gen_info,
                "judge": {k: judge_settings[k] for k in JUDGE_REPORT_FIELDS
                          if k not in BACKEND_ONLY or BACKEND_ONLY[k] == jc.backend},
                "ternary": a.ternary,
                "drb_articles": ("cleaned" if clean else "raw") if a.benchmark == "drb" else None,
                **method,
                "max_skip_share": a.max_skip_share, "deadline_s": a.deadline, "wall_s": round(wall_s, 2)}
    return {"benchmark": a.benchmark, "summary": result["summary"], "paper": paper,
        "judge": stats, "price": prices.source if prices else unknown_price_message(
            jc.model, "--price-in / --price-out"),
        "calls": result["calls"], "stopped": result["stopped"], "cleaning": result["cleaning"],
        "notes": notes, "settings": settings, "examples": result["examples"]}


def exit_status(a: argparse.Namespace, result: dict) -> int:
    """main's exit code once the report is written (see main), with the reason logged."""
    s = result["summary"]
    if result["stop_error"] is not None:
        log.error("%s", result["stopped"])
        return 3
    if s["score"] is None:
        log.error("no example could be scored; the report says why")
        return 2
    share = s["skipped"]["count"] / max(1, s["n_rows"])
    if share > a.max_skip_share and not a.allow_skips:
        log.error("%.1f%% of the examples were skipped, above --max-skip-share %.1f%%; the score "
                  "leaves them out. Fix the cause or pass --allow-skips", 100 * share,
                  100 * a.max_skip_share)
        return 4
    return 0


def score_line(bench: str, summary: dict, stats: dict, paths: tuple[str, str]) -> str:
    """The line main prints: the score with its 95% CI, n, skipped and the judge's cost, and the
    report's two files (report.json, report.md)."""
    jp, mp = paths
    s, usd = summary, stats.get("judge/usd_total")
    cost = f"${usd:.4f}" if usd is not None else "cost unknown"
    if s["score"] is None:
        return (f"{bench}: no example scored (skipped {s['skipped']['count']}; judge {cost}) "
                f"-> {jp}, {mp}")
    return (f"{bench}: {s['score_100']:.1f} (95% CI {100 * s['ci95'][0]:.1f}-"
            f"{100 * s['ci95'][1]:.1f}; n={s['n']}, skipped {s['skipped']['count']}; judge {cost}) "
            f"-> {jp}, {mp}")
