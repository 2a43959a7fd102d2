"""Ask a trained policy a question: rollouts through the RubricEM scaffold (§3.1-3.2) with the real
search tool, printed stage by stage (Plan, Research with each tool call and its output, Review,
Answer).

    python ask.py runs/toy/final "What is known about the use and discoverer of Harta? Give a short cited report."
    python ask.py runs/toy/final                      # the toy world's first held-out question
    python ask.py runs/toy/final --samples 3 --temperature 0.7 --bank runs/toy/bank.jsonl
    python ask.py path/to/hf-model "..." --system full   # any local HF causal LM

The checkpoint is a run's final/ (or any local Hugging Face causal-LM directory). Its run card
(rubricem.json, runcard.py) gives the system prompt the policy was trained under and the run's
configuration: the toy world (the search tool's corpus; toy questions are about its fictional
entities), the search backend and the rollout limits. Without a card the run dir's config.json is
used for a final/, else the toy preset with --system's prompt. The same builders as training
(build.build_environment, setup_policy, build_sampler) and scaffold.RolloutEngine make the rollouts,
so what is printed is what training would have sampled.

Not part of the paper's method: an inspection tool.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's root

import bank as bank_mod  # noqa: E402
from scaffold import STAGES, SYSTEM_PROMPT, SYSTEM_PROMPT_COMPACT, Query, RolloutEngine  # noqa: E402
from backends.run import build, presets  # noqa: E402
from backends.run.runcard import read_run_card  # noqa: E402

log = logging.getLogger("rubricem.ask")


def load_setup(model_dir: str, system: str | None = None):
    """(config, system prompt, where it came from) for asking `model_dir`.

    system: None (the run card's prompt; else the run config's rollout.system_prompt; else "full"),
    "compact", "full" or a literal prompt. The config is the run's (config.Config) with model =
    model_dir, one process, HF sampling, and the toy world's questions as data. Raises ValueError for
    an unreadable run card."""
    card, where = read_run_card(model_dir)
    cfg = presets.load_config(card["config"]) if card and "config" in card else presets.toy_preset()
    cfg.model, cfg.engine, cfg.sampler, cfg.dry_run = model_dir, "torch", "hf", False
    cfg.data.source, cfg.rollout.prompts_per_step = "", 1  # questions come from the command line
    named = {"compact": SYSTEM_PROMPT_COMPACT, "full": SYSTEM_PROMPT}
    if system is not None:
        return cfg, named.get(system, system), "--system"
    if card and "system_prompt" in card:
        return cfg, card["system_prompt"], where
    if card:
        return cfg, named.get(cfg.rollout.system_prompt, SYSTEM_PROMPT), f"{where} (rollout.system_prompt)"
    return cfg, SYSTEM_PROMPT, "default (full prompt; no run card)"


def ask(model_dir: str, question: str | None = None, samples: int = 1, temperature: float | None = None,
        seed: int = 0, bank_path: str | None = None, system: str | None = None,
        max_response_tokens: int | None = None) -> dict:
    """Sample `samples` (int >= 1) rollouts of `question` from the policy in `model_dir`.

    question None -> the toy world's first held-out question. temperature None -> the run's
    rollout.temperature. bank_path: a rubric bank (bank.jsonl) whose similar entries (top-k of the
    run) go into the prompt's <memory>, as in training (§3.5). Deterministic per seed on CPU.
    Returns {"question", "system", "system_source", "temperature", "bank_items", "rollouts"
    (list[scaffold.Rollout])}. Raises ValueError (bad argument, run card, question), OSError (the
    model directory or bank file cannot be read)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not os.path.isdir(model_dir):
        raise OSError(f"{model_dir}: no such model directory (a run's final/ or a local Hugging Face "
                      "causal-LM directory)")
    cfg, system_prompt, source = load_setup(model_dir, system)
    if max_response_tokens is not None:
        cfg.rollout.max_response_tokens = max_response_tokens
    temp = cfg.rollout.temperature if temperature is None else temperature
    world, tool, _, held_q = build.build_environment(cfg)
    if question is None:
        if not held_q:
            raise ValueError("no question given and no toy held-out questions to pick from")
        q = held_q[0]
    elif not question.strip():
        raise ValueError("the question is empty")
    else:
        q = Query(question.strip(), [])
    items: list[str] = []
    if bank_path:
        b = bank_mod.RubricBank.load(bank_path)
        items = bank_mod.format_for_prompt(b.retrieve_similar(q.query, cfg.bank.top_k,
                                                              exclude_self=False))
    model, tok, _ = build.setup_policy(cfg, world, tool)
    model.eval()
    sampler = build.build_sampler(cfg, model, tok)
    engine = RolloutEngine(sampler, tok, {tool.name: tool}, cfg.rollout.max_response_tokens,
                           cfg.rollout.max_tool_calls, system_prompt, temp,
                           scaffold=cfg.rollout.scaffold)  # the run's scaffold (parser)
    torch.manual_seed(seed)
    rollouts = engine.run([q], n=samples, bank_items=[items])
    return {"question": q.query, "system": system_prompt, "system_source": source,
            "temperature": temp, "bank_items": items, "rollouts": rollouts}


def _policy_lines(out: list[str], text: str) -> None:
    for line in text.strip("\n").splitlines():
        if line.strip():
            out.append("  " + line)


def format_trajectory(r) -> str:
    """A scaffold.Rollout as text, stage by stage: "[plan]", "[research]", "[review]", "[answer]",
    each followed by the policy's text; every tool call as "  -> google_search('query'): N results
    [h1]-[hN]" (or its error) and the tool output's lines after "     | ". Stages the response lacks
    show "(missing)". Ends with one summary line (tool calls, well formed, truncated, tokens)."""
    text = r.text
    b = (0, *r.parsed.bounds, len(text))
    spans = list(r.env_spans)
    calls = list(r.tool_calls) if len(r.tool_calls) == len(spans) else [None] * len(spans)
    out: list[str] = []
    for k, stage in enumerate(STAGES):
        lo, hi = b[k], b[k + 1]
        out.append(f"[{stage}]" + ("" if r.parsed.has_stage[k] else " (missing)"))
        pos = lo
        for (s, e), call in zip(spans, calls):
            if e <= lo or s >= hi:
                continue
            s2, e2 = max(s, lo), min(e, hi)
            _policy_lines(out, text[pos:s2])
            if s >= lo and call is not None:
                what = f"error: {call.error}" if call.error else \
                    (f"{len(call.handles)} results [{call.handles[0]}]-[{call.handles[-1]}]"
                     if call.handles else "no results")
                out.append(f"  -> {call.name or '?'}({call.query!r}): {what}")
            body = text[s2:e2].replace("<tool_output>", "").replace("</tool_output>", "")
            out.extend("     | " + line for line in body.strip("\n").splitlines() if line.strip())
            pos = e2
        _policy_lines(out, text[pos:hi])
    out.append(f"({r.n_tool_calls} tool calls, {'well formed' if r.parsed.well_formed else 'not well formed'}"
               f"{', truncated' if r.truncated else ''}, {sum(r.loss_mask)} sampled tokens)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """`python ask.py MODEL_DIR [QUESTION] [options]`; exit code 0, or 2 for unusable input."""
    ap = argparse.ArgumentParser(prog="ask.py", description="Ask a trained policy a question and print "
                                 "its trajectory stage by stage, with every tool call and output.")
    ap.add_argument("model_dir", help="a run's final/ directory or any local Hugging Face causal-LM dir")
    ap.add_argument("question", nargs="?", default=None,
                    help="the question (default: the toy world's first held-out question)")
    ap.add_argument("--samples", type=int, default=1, help="rollouts to sample (default: 1)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (default: the run's rollout.temperature, 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the sampling (default: 0)")
    ap.add_argument("--bank", default=None, metavar="BANK_JSONL",
                    help="put the similar entries of this rubric bank into the prompt (default: none)")
    ap.add_argument("--system", default=None,
                    help="system prompt: 'compact', 'full' or the text itself (default: the one "
                         "saved with the checkpoint)")
    ap.add_argument("--max-response-tokens", type=int, default=None,
                    help="token budget of a response (default: the run's rollout.max_response_tokens)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
    try:
        res = ask(a.model_dir, a.question, a.samples, a.temperature, a.seed, a.bank, a.system,
                  a.max_response_tokens)
    except (ValueError, OSError) as e:
        print(f"ask.py: error: {e}", file=sys.stderr)
        return 2
    print(f"model: {a.model_dir}   system prompt: {res['system_source']}   temperature: "
          f"{res['temperature']:g}   seed: {a.seed}")
    print(f"question: {res['question']}")
    for item in res["bank_items"]:
        print(f"bank item: {item}")
    for i, r in enumerate(res["rollouts"]):
        print(f"\n=== rollout {i + 1} of {len(res['rollouts'])} ===")
        print(format_trajectory(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
