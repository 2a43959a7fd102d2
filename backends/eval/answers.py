"""Answers to grade from a checkpoint: each query run once through the scaffold with its search tool,
the text inside <answer> taken (evaluate.py, deviation 4), written to responses.jsonl.

Not part of the paper's method: the policy is built with train.py's builders (backends/run/build.py)
and the checkpoint's run card (its scaffold and system prompt).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch
from tqdm import tqdm

from backends.run import build, presets
from backends.run.runcard import read_run_card
from scaffold import Query, RolloutEngine, parse_response, system_prompt

def answer_text(rollout) -> str:
    """The final answer of a rollout: the text inside <answer> (scaffold.parse_response), stripped;
    "" when the rollout wrote no <answer>."""
    p = rollout.parsed
    if p is None:
        p = parse_response(rollout.text, rollout.env_spans)
    return p.fields.get("answer", "").strip()


def generate_answers(engine, queries: Sequence[str], batch: int = 8, temperature: float = 0.0,
                     seed: int = 0, progress: bool = True) -> tuple[list[str], int]:
    """Run each query once through `engine` (scaffold.RolloutEngine, with its tool) and take the
    <answer> text. Returns (answers aligned with queries, number without an <answer> tag).
    Deterministic for a fixed seed and temperature 0 on CPU."""
    torch.manual_seed(seed)
    answers, missing = [], 0
    with tqdm(total=len(queries), desc="answers", disable=not progress) as bar:
        for s in range(0, len(queries), batch):
            qs = [Query(q, []) for q in queries[s:s + batch]]
            for ro in engine.run(qs, n=1, temperature=temperature):
                a = answer_text(ro)
                missing += "<answer>" not in ro.text
                answers.append(a)
            bar.update(len(qs))
    return answers, missing


def build_engine(model_dir: str, preset: str = "toy", search: str = "", sampler: str = "hf",
                 max_response_tokens: int = 0, max_tool_calls: int = 0, seed: int = 0,
                 cache_dir: str = ""):
    """(RolloutEngine, info) for a checkpoint directory, built with train.py's public builders
    (build_environment for the search tool, setup_policy, build_sampler). preset "toy" (compact
    system prompt, BM25 over the toy world) or "full" (full prompt, Serper, PAPER response budget);
    search "" keeps the preset's tool ("toy" | "serper"). The toy path runs offline on CPU.
    The scaffold (structured or unstructured, with its parser) and the system prompt are the ones the
    checkpoint was trained under, read from its run card (runcard.read_run_card); a directory without
    one gets the structured scaffold and the preset's prompt. Raises FileNotFoundError (no such
    directory), ValueError (an unreadable run card)."""
    if not model_dir or not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model must be a local checkpoint directory, got {model_dir!r}")
    cfg = presets.toy_preset() if preset == "toy" else presets.full_preset()
    cfg.model, cfg.seed, cfg.sampler, cfg.engine = model_dir, seed, sampler, "torch"
    cfg.data.source = ""  # the benchmark supplies the queries; train.py's data is not read
    cfg.search.backend = search or cfg.search.backend
    if cache_dir:
        cfg.cache_dir = cache_dir
    if max_response_tokens:
        cfg.rollout.max_response_tokens = max_response_tokens
    if max_tool_calls:
        cfg.rollout.max_tool_calls = max_tool_calls
    card, _ = read_run_card(model_dir)
    trained = (card or {}).get("config", {}).get("rollout", {})
    cfg.rollout.scaffold = trained.get("scaffold", cfg.rollout.scaffold)
    world, tool, _, _ = build.build_environment(cfg)
    model, tok, info = build.setup_policy(cfg, world, tool)
    model.eval()
    if sampler == "hf" and torch.cuda.is_available():
        # SCALE: HF generate on the GPU in bf16 (our choice; vLLM loads its own copy instead)
        model.to("cuda", dtype=torch.bfloat16)
    system = (card or {}).get("system_prompt") or system_prompt(cfg.rollout.scaffold,
                                                               cfg.rollout.system_prompt)
    engine = RolloutEngine(build.build_sampler(cfg, model, tok), tok, {tool.name: tool},
                           cfg.rollout.max_response_tokens, cfg.rollout.max_tool_calls, system,
                           tool_timeout_s=cfg.rollout.tool_timeout_s, scaffold=cfg.rollout.scaffold)
    return engine, {"model": model_dir, "source": info.get("source", model_dir), "preset": preset,
                    "search": cfg.search.backend,
                    "sampler": sampler, "max_response_tokens": cfg.rollout.max_response_tokens,
                    "max_tool_calls": cfg.rollout.max_tool_calls,
                    "system_prompt": system, "scaffold": cfg.rollout.scaffold}


def generate(a, rows: list[dict], queries: Sequence[str], out_dir: str, progress: bool) -> tuple[list, dict]:
    """Answers of the --model checkpoint to `queries` (what the policy sees of each row, aligned with
    rows: evaluate.policy_query), written to out_dir/responses.jsonl, and the generation settings.
    a: the command line (cli.parse_args). Raises ValueError / FileNotFoundError for an unusable
    checkpoint."""
    engine, info = build_engine(a.model, a.preset, a.search, a.sampler, a.max_response_tokens,
                                a.max_tool_calls, a.seed)
    texts, missing = generate_answers(engine, list(queries),
                                      a.gen_batch, a.gen_temperature, a.seed, progress)
    info.update(no_answer_tag=missing, temperature=a.gen_temperature, seed=a.seed)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "responses.jsonl"), "w", encoding="utf-8") as fh:
        for r, t in zip(rows, texts):
            fh.write(json.dumps({"id": r["id"], "response": t}, ensure_ascii=False) + "\n")
    return list(texts), info
