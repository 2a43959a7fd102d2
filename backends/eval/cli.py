"""The command line of `python evaluate.py`: its arguments and the help text that names each
benchmark's files, grader and paper score.

Not part of the paper's method. evaluate.main parses with `parse_args` and runs the benchmark.
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from backends.api.settings import HTTPJudgeConfig
from hparams import JudgeConfig

EVAL_CONCURRENCY = 32  # with the client's 429 back-off; simple-evals runs 120 threads

HELP = """Benchmarks (give local files; nothing is downloaded):

healthbench      openai simple-evals HealthBench JSONL: rows {prompt [{role, content}], prompt_id,
                 example_tags, rubrics [{criterion, points, tags}]}. Public data (and the "hard" and
                 "consensus" files beside it):
                 https://openaipublic.blob.core.windows.net/simple-evals/healthbench/2025-05-07-06-14-12_oss_eval.jsonl
                 One call per rubric item; example = sum(points met) / sum(positive points); score =
                 clip(mean, 0, 1) with bootstrap std; per example tag and rubric tag.
                 Released grader: GPT-4.1. Paper (RubricEM-8B): 49.3.
researchqa       ResearchQA JSON list: rows {id, general_domain, subdomain, field, query, date,
                 rubric [{rubric_item, type}]}. Public data (test.json):
                 https://huggingface.co/datasets/realliyifei/ResearchQA
                 8 items per call; labels Not at all..Completely -> (x - 1) / 4; coverage = mean;
                 an example with a wrong label count after the retries is skipped.
                 Released grader: gpt-4.1-mini. Paper: 74.5.
drb              DeepResearch Bench RACE, three files from
                 https://github.com/Ayanami0730/deep_research_bench :
                 --data data/prompt_data/query.jsonl --criteria data/criteria_data/criteria.jsonl
                 --reference data/test_data/cleaned_data/reference.jsonl
                 One call per task scores the answer and the reference article on every criterion
                 (0-10); score = 100 * mean T / (T + R). Released grader: Gemini 2.5 Pro. Paper: 47.8.
researchrubrics  ResearchRubrics: rows {prompt, sample_id, domain, rubrics [{criterion, weight, axis}]}.
                 Public data: https://huggingface.co/datasets/ScaleAI/researchrubrics
                 One call per (report, criterion); compliance = sum(w s) / sum(positive w);
                 --ternary counts Partially Satisfied as 0.5. Paper: 50.3.

Answers: --responses FILE (JSONL rows {<benchmark id>, response | answer | article}, or a JSON map
id -> text), or --model CKPT_DIR run through the scaffold with its search tool (--search toy: BM25
over the toy world, offline on CPU; --search serper: the web).

Examples:
  python evaluate.py healthbench --data oss_eval.jsonl --responses answers.jsonl
  python evaluate.py researchqa --data test.json --model runs/toy/final --search toy --limit 20
  python evaluate.py drb --data query.jsonl --criteria criteria.jsonl --reference reference.jsonl \\
      --responses articles.jsonl --judge gemini --judge-model gemini-2.5-pro
  python evaluate.py researchrubrics --data rr.jsonl --responses r.jsonl --judge openai \\
      --judge-base-url http://localhost:8000/v1 --judge-model Qwen/Qwen3-32B --ternary
Reports: <out>/report.json and report.md (score, 95% CI, breakdowns, rows, judge cost, settings).
Keys come from the environment only: GEMINI_API_KEY / OPENAI_API_KEY, SERPER_API_KEY.
Paper averages: RubricEM-8B 55.5, its SFT start 49.2, DR Tulu-8B RL 53.6."""


def parse_args(argv: Sequence[str] | None, benchmarks: Sequence[str], description: str) -> argparse.Namespace:
    """evaluate.py's arguments; benchmarks: the names it grades (evaluate.BENCHMARKS); description:
    the first line of its help."""
    d, dh = JudgeConfig(backend="gemini"), HTTPJudgeConfig(cache_dir=".cache/rubricem/judge")
    p = argparse.ArgumentParser(prog="evaluate.py", description=description, epilog=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("benchmark", choices=sorted(benchmarks))
    p.add_argument("--data", required=True, help="benchmark rows (drb: query.jsonl)")
    p.add_argument("--criteria", default="", help="drb: criteria.jsonl")
    p.add_argument("--reference", default="", help="drb: reference articles (reference.jsonl)")
    p.add_argument("--language", default="", help="drb: keep only tasks in this language (en / zh)")
    p.add_argument("--limit", type=int, default=0, help="score N rows drawn as simple-evals does "
                   "(random.Random(0).sample); 0 = all")
    p.add_argument("--limit-first", action="store_true", help="with --limit: the first N rows instead")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--responses", help="answers file keyed by the benchmark's id")
    src.add_argument("--model", help="checkpoint directory (save_pretrained) to generate answers with")
    g = p.add_argument_group("generation (--model)")
    g.add_argument("--preset", choices=("toy", "full"), default="toy")
    g.add_argument("--search", choices=("toy", "serper"), default="", help="default: the preset's")
    g.add_argument("--sampler", choices=("hf", "vllm"), default="hf")
    g.add_argument("--max-response-tokens", type=int, default=0, help="0 = the preset's")
    g.add_argument("--max-tool-calls", type=int, default=0, help="0 = the preset's (PAPER: 10)")
    g.add_argument("--gen-temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--gen-batch", type=int, default=8)
    j = p.add_argument_group("judge")
    j.add_argument("--judge", choices=("gemini", "openai"), default=d.backend)
    j.add_argument("--judge-model", default=d.model)
    j.add_argument("--judge-base-url", default="")
    j.add_argument("--judge-concurrency", type=int, default=EVAL_CONCURRENCY,
                   help="most judge requests in flight; halved on every 429 and grown back "
                        f"(default {EVAL_CONCURRENCY})")
    j.add_argument("--judge-rpm", type=int, default=0, help="judge requests per minute (0 = no limit)")
    j.add_argument("--judge-tpm", type=int, default=0, help="judge tokens per minute (0 = no limit)")
    j.add_argument("--judge-max-retries", type=int, default=d.max_retries)
    j.add_argument("--judge-timeout", type=float, default=300.0, help="seconds per request")
    j.add_argument("--judge-cache-dir", default=os.path.join(".cache", "rubricem", "eval-judge"))
    j.add_argument("--judge-backoff", type=float, default=dh.backoff_s)
    j.add_argument("--thinking-budget", type=int, default=-1,
                   help="gemini thinkingBudget: -1 the model's default, 0 off (Flash), N tokens")
    j.add_argument("--price-in", type=float, default=-1.0,
                   help="USD per 1M input tokens (default: backends/api/pricing.py's table)")
    j.add_argument("--price-out", type=float, default=-1.0, help="USD per 1M output tokens")
    j.add_argument("--openai-response-format", choices=("json_schema", "json_object"),
                   default="json_schema", help="json_object for servers without schema support "
                   "(the schema and an example reply then go into the prompt)")
    p.add_argument("--ternary", action="store_true", help="researchrubrics: Partially Satisfied = 0.5")
    p.add_argument("--drb-raw", action="store_true", help="drb: grade the articles as given, without "
                   "the released pipeline's citation cleaning (default: cleaned)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap and generation seed")
    p.add_argument("--max-skip-share", type=float, default=0.05,
                   help="exit 4 when more than this share of examples is skipped (default 0.05)")
    p.add_argument("--allow-skips", action="store_true", help="exit 0 whatever the skipped share")
    p.add_argument("--deadline", type=float, default=0.0, help="overall seconds for the judge; calls "
                   "not done by then are cancelled and their examples skipped (0 = none)")
    p.add_argument("--out", default="", help="report directory (default runs/eval/<benchmark>)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report in --out")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)
