"""SFT warm start: a scripted teacher, the paper's SFT filters, and masked supervised fine-tuning.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the SFT stage of the appendix: stage-structured trajectories from a teacher, filtered by the
paper's four rules, trained with the loss on assistant tokens only and `<tool_output>` spans masked.

The teacher writes complete four-stage trajectories *through the real tool* (BM25 search), and is
deliberately imperfect in controllable ways (`TeacherConfig`): it skips asked aspects, writes vague
queries, leaves claims uncited, copies a distractor's value, or forgets the negative constraint. The
SFT policy therefore starts with headroom for RL. The teacher also writes reflections on its own
trajectories (for the reflection meta-policy of §3.4) and, when a retrieved memory names a fact it
missed before, it does not miss it again: that is how the policy learns what a bank item is for.

The unstructured scaffold (the scaffold ablation, Fig. 6a-c; scaffold.parse_unstructured) has its own
teacher and warm start: `teacher_trajectory(..., scaffold="unstructured")` draws the same random
numbers as the structured teacher, so for the same query and seed it makes the same imperfections
(same error rates), runs the same searches and writes the same answer, but writes no plan and no
review, and its notes after each tool output are <think> blocks instead of <state_evaluation>. Its
warm start has no memory prompts and no reflection examples (the unstructured agent has neither a
bank nor a reflection meta-policy), and its cache key holds the scaffold.

SFT filters (PAPER, appendix): drop a trajectory
  (1) without a closing </answer>;
  (2) with a non-final turn (a segment followed by a tool output) that does not end in a valid call;
  (3) missing a required tag (<structured_plan>, </structured_plan>, <state_evaluation>, <review>,
      </review>, <answer>);
  (4) with two or more consecutive tool errors.
The teacher produces each defect at a small rate so the filters have real work; counts are logged.

Loss (per example): mean over assistant tokens with mask 1 of -log pi(x_t | x_<t); tool outputs and
the prompt have mask 0 (PAPER: span masking of <tool_output>).

Deviations from the paper
1. The teacher is a script, not Gemini-3.1-Pro; trajectories are short (~200-400 tokens).
2. The toy SFT runs a fixed number of steps sized for ~4 minutes on 2 CPU cores, not 5 epochs.
3. Tiny-model training uses AdamW(0.9, 0.95), lr 2e-3, warm-up + cosine (the paper's 4e-5 is for 8B).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from reflection import reflection_messages
from scaffold import (CALL_OPEN, SCAFFOLD_TAGS, THINK_TAGS, build_messages, format_tool_error,
                      format_tool_output)
from sft import (REQUIRED_TAGS, UNSTRUCTURED_REQUIRED_TAGS, Segment,  # noqa: F401  (re-exported)
                 sft_filter)
from scaffold import Query, load_rows
from toy import model as policy
from toy.hf_sampler import autocast, pad_multiple
from toy.report import format_filter_counts, warm_start_line
from toy.world import ANSWER_TEMPLATES, SYLLABLES, World

log = logging.getLogger("rubricem.sft")


@dataclass
class TeacherConfig:
    """Imperfection rates of the scripted teacher (our values; the paper's teacher is an LLM)."""

    # The task is a causal chain (docs/results.md, "The toy task"): the plan decides which asked facts
    # are researched, the research notes decide which record's value is used, the review's writing
    # plan decides which findings reach the answer, and the answer writes exactly those. So a flaw
    # of an early stage shows in the answer, but only through the later stages, and each stage's
    # rubrics see the decision where it is made. Set above 0.5, a flaw is the teacher's most likely
    # behaviour: greedy decoding of the SFT policy inherits it, sampling at T = 1 meets the fix.
    p_plan_omit: float = 0.6
    """Plan (per asked fact after the first): the fact is left out of the plan's rubrics and research
    plan, so it is never searched nor answered (0 = off: no draw is made)"""
    p_skip: float = 0.05
    """Research (per planned fact): the planned search is never run, so the fact is not answered"""
    p_vague: float = 0.10
    """Research: a query without the entity name (it then finds other entities' documents)"""
    p_distractor: float = 0.8
    """Research: when a distractor (an old record, or a look-alike's document on the aspect) comes
    back above the true document, the state evaluation copies its value, and so do the review and
    the answer; with a plan that names what to avoid, p_distractor_avoid instead"""
    p_distractor_avoid: float = 0.1
    """Research: p_distractor when the plan's rubrics name what to avoid (look-alike names and old
    records): the negative constraint makes the research careful"""
    p_no_negative: float = 0.7
    """Plan: the plan's rubrics omit the negative constraint"""
    p_writing_omit: float = 0.6
    """Review (per mapped fact after the first): the writing plan leaves the fact out, and the
    answer, which writes the writing plan's facts, does not state it (0 = off: no draw is made)"""
    p_uncited: float = 0.3
    """Answer (per sentence): the sentence is written without its citation"""
    p_unknown_omitted: float = 0.3
    """Answer (per fact): a fact of the writing plan that no snippet gave is left out of the answer
    (no "No source gives ..." sentence)"""
    p_tool_fail: float = 0.05
    """the teacher's tool call fails (an error output); it retries"""
    p_defect: float = 0.02
    """per kind: truncated answer, invalid call, missing review block"""
    p_memory: float = 0.5
    """share of prompts with a retrieved memory item (was 0.3)"""
    p_memory_exact: float = 0.7
    """share of those whose item is the query's own lesson from a first attempt (within-episode exact,
    which the teacher then follows); the others get another query's lesson (cross-episode similar,
    nothing in it about this query: the teacher ignores it). 0.5 before the causal task"""
    # The stage-local flaws of the previous toy (0 = off, and then no random draw is made): each
    # made a decision of one stage go wrong and changed nothing in the other stages.
    p_plan_unsearched: float = 0.0
    """Plan (per trajectory): the research plan lists the first asked fact's search only (the
    research still runs every search)"""
    p_eval_bare: float = 0.0
    """Research (per trajectory): the state evaluations give found values without their snippet
    ids ("E a: v", not "E a: v [h]")"""
    p_writing_gap: float = 0.0
    """Review (per trajectory): the writing plan lists only the first fact it found (the answer
    still states every fact)"""


# ----------------------------------------------------------------------------------------------------
# Teacher


def fact_key(f: dict) -> str:
    return f"{f['entity']} {f['aspect']}"


_MISSED_RE = re.compile(r"missed: ([^.;]+)")
_WRONG_RE = re.compile(r"wrong: ([^.;]+)")


def memory_missed(items: Sequence[str]) -> set[str]:
    """Fact keys named as missed ("missed: Harta year, Harta use.") in memory items."""
    out = set()
    for it in items:
        for m in _MISSED_RE.finditer(it):
            out.update(k.strip() for k in m.group(1).split(","))
    return out


def memory_wrong(items: Sequence[str]) -> set[str]:
    """Fact keys named with a wrong value ("wrong: Harta habitat north dunes, Harta use tea.") in
    memory items: the first two words of each item (entity and aspect)."""
    out = set()
    for it in items:
        for m in _WRONG_RE.finditer(it):
            out.update(" ".join(k.split()[:2]) for k in m.group(1).split(",") if len(k.split()) >= 2)
    return out


@dataclass
class TeacherTrace:
    segments: list[Segment]
    defects: dict = field(default_factory=dict)  # fact key -> what went wrong; "_kind" -> defect
    copied: dict = field(default_factory=dict)  # fact key -> the distractor value it copied


def teacher_trajectory(q: Query, tool, world: World, rng: random.Random, cfg: TeacherConfig,
                       memory: Sequence[str] = (), scaffold: str = "structured") -> TeacherTrace:
    """One trajectory for query q through `tool`, with controlled imperfections: stage-structured
    (scaffold "structured", §3.2), or think / call / answer only ("unstructured": no plan, no
    review, <think> notes; the same random draws, so the same searches, imperfections and answer).

    The task is a causal chain: the research searches the planned facts, the state evaluation of
    each search names the value the later stages use, the answer states the writing plan's facts.
    A memory item that names a fact as missed ("missed: E a") keeps it in the plan, the research
    and the writing plan; one that names a fact's wrong value ("wrong: E a v") makes its research
    careful. The teacher is privileged: it reads each retrieved document's ground truth from `world`.
    """
    structured = scaffold == "structured"
    note_open, note_close = ("<state_evaluation>", "</state_evaluation>") if structured else THINK_TAGS
    facts = q.facts
    remembered, warned = memory_missed(memory), memory_wrong(memory)
    ents = (q.toy or {}).get("entities", [])
    aspects = (q.toy or {}).get("aspects", [])
    defects: dict = {}
    copied: dict = {}
    # A list in the order of the asked facts, not a set: the set's iteration order follows Python's
    # per-process string hashing (PYTHONHASHSEED), and `defects` keeps this order into the teacher's
    # reflection text ("missed: A year, B use"), so a set made the SFT data differ between processes.
    skip = [fact_key(f) for f in facts if rng.random() < cfg.p_skip and fact_key(f) not in remembered]
    if len(skip) == len(facts):
        skip.remove(fact_key(facts[0]))
    for k in skip:
        defects[k] = "skipped"
    neg = "" if rng.random() < cfg.p_no_negative else "; avoid: look-alike names and old records"
    if not neg and structured:
        defects["_negative"] = "no negative constraint"
    p_copy = cfg.p_distractor_avoid if neg else cfg.p_distractor
    # Stage-local flaws draw only when switched on (see TeacherConfig), each from its own stream
    # seeded by the trajectory's, so the draws above and below stay those of a teacher without them.
    local = random.Random(rng.random()) if _local_flaws(cfg) else None
    bare = local is not None and local.random() < cfg.p_eval_bare
    unplanned = [fact_key(f) for f in facts[1:]] \
        if local is not None and local.random() < cfg.p_plan_unsearched else []
    if unplanned and structured:
        defects["_plan_search"] = "research plan omits " + ", ".join(unplanned)
    # The causal chain's plan and writing-plan omissions (their own stream, likewise).
    chain = random.Random(rng.random()) if _chain_flaws(cfg) else None
    omitted = [fact_key(f) for f in facts[1:] if chain is not None
               and chain.random() < cfg.p_plan_omit and fact_key(f) not in remembered]
    for k in omitted:
        defects[k] = "not planned"
    planned = [f for f in facts if fact_key(f) not in omitted]
    need = "; ".join(f"need: {fact_key(f)}" for f in planned)
    plan = (f"<structured_plan><analysis>Report on {' and '.join(ents)}: {', '.join(aspects)}."
            f"</analysis><rubrics>{need}{neg}</rubrics><research_plan>"
            + "; ".join(f"search {fact_key(f)}" for f in planned
                        if fact_key(f) not in skip and fact_key(f) not in unplanned)
            + "</research_plan></structured_plan>\n") if structured else ""
    segs: list[Segment] = []
    cur = plan
    handle = 1
    found: dict[str, tuple[int, str] | None] = {}
    kind_defect = rng.random()
    for f in planned:
        k = fact_key(f)
        if k in skip:
            continue
        query = k
        if rng.random() < cfg.p_vague and k not in remembered:
            query = f["aspect"]
            defects[k] = "vague query"
        for attempt in range(3):
            cur += f"{CALL_OPEN}{query}</call_tool>"
            if kind_defect < cfg.p_defect and not segs:  # defect: an invalid tool name
                cur = cur.replace(CALL_OPEN, '<call_tool name="web_browse">', 1)
                defects["_kind"] = "invalid call"
            segs.append((False, cur))
            if rng.random() < cfg.p_tool_fail:
                segs.append((True, format_tool_error("search failed")))
                cur = f"{note_open}search failed, retrying{note_close}\n"
                continue
            results = tool(query)
            segs.append((True, format_tool_output(results, handle)))
            hit = None
            for j, r in enumerate(results):
                d = world.doc(r.doc_id)
                if d.aspect != f["aspect"]:
                    continue
                if d.kind == "true" and d.entity == f["entity"]:
                    hit = (handle + j, d.value, "true")
                    break
                # A careless note takes the value of a distractor that came back first (an old
                # record, or a look-alike's document on the aspect), never for a fact that a memory
                # item named with its wrong value; a careful one reads on to the true document.
                if (d.entity == f["entity"] or d.kind == "lookalike") \
                        and rng.random() < p_copy and k not in warned:
                    hit = (handle + j, d.value, d.kind)
                    defects[k] = f"copied {d.kind}"
                    copied[k] = d.value
                    break
            handle += len(results)
            found[k] = (hit[0], hit[1]) if hit else None
            ev = f"{k}: {hit[1]} [{hit[0]}]" if hit else f"{k}: not found"
            if hit and bare:
                ev = f"{k}: {hit[1]}"  # the value without its snippet id
                defects["_eval_bare"] = "state evaluation without a snippet id"
            cur = f"{note_open}{ev}{note_close}\n"
            break
        else:
            found[k] = None
    review_items = []
    for f in planned:
        k = fact_key(f)
        h = found.get(k)
        review_items.append(f"{k}: [{h[0]}]" if h else f"{k}: missing")
    written = [fact_key(f) for f in planned if fact_key(f) not in skip]
    if chain is not None:  # the writing plan leaves out later facts; the answer follows it
        left = [k for k in written[1:] if chain.random() < cfg.p_writing_omit and k not in remembered]
        for k in left:
            defects[k] = "not written"
        written = [k for k in written if k not in left]
    listed = written
    if local is not None and len(written) > 1 and local.random() < cfg.p_writing_gap:
        listed = written[:1]  # stage-local: the writing plan forgets later findings, the answer not
        defects["_writing_gap"] = "writing plan lists one fact"
    review = (f"<review><rubrics_review>{'; '.join(review_items)}</rubrics_review><writing_plan>"
              f"{', '.join(listed)}</writing_plan>"
              "</review>\n")
    if not structured:
        review = ""  # the unstructured scaffold has no review
    elif 0.5 * cfg.p_defect <= kind_defect < 1.5 * cfg.p_defect and "_kind" not in defects:
        review = ""  # defect: a missing review block
        defects["_kind"] = "missing review"
    sentences = []
    for f in planned:
        k = fact_key(f)
        if k not in written:
            continue
        h = found.get(k)
        if h is None:
            if local is not None and local.random() < cfg.p_unknown_omitted:
                defects["_unknown_omitted"] = "left out a fact no source gave"
                continue
            sentences.append(f"No source gives the {f['aspect']} of {f['entity']}.")
            continue
        s = ANSWER_TEMPLATES[f["aspect"]].format(name=f["entity"], value=h[1])
        if rng.random() < cfg.p_uncited:
            defects.setdefault(k, "uncited")
            sentences.append(s + ".")
        else:
            sentences.append(f"{s} [{h[0]}].")
    answer = "<answer>" + " ".join(sentences) + "</answer><|im_end|>"
    if 1.5 * cfg.p_defect <= kind_defect < 2.5 * cfg.p_defect and "_kind" not in defects:
        answer = answer[: len(answer) // 2]  # defect: a truncated answer
        defects["_kind"] = "truncated answer"
    segs.append((False, cur + review + answer))
    return TeacherTrace(segs, defects, copied)


_LOCAL_FLAWS = ("p_plan_unsearched", "p_eval_bare", "p_writing_gap", "p_unknown_omitted")
_CHAIN_FLAWS = ("p_plan_omit", "p_writing_omit")


def _local_flaws(cfg: TeacherConfig) -> bool:
    """True if any stage-local flaw is switched on (then the teacher draws them, else it does not)."""
    return any(getattr(cfg, f) > 0 for f in _LOCAL_FLAWS)


def _chain_flaws(cfg: TeacherConfig) -> bool:
    """True if the plan or writing-plan omission is switched on (then the teacher draws them)."""
    return any(getattr(cfg, f) > 0 for f in _CHAIN_FLAWS)


MISSED_DEFECTS = ("skipped", "vague query", "not planned", "not written")


def teacher_reflection(q: Query, trace: TeacherTrace) -> str:
    """The teacher's reflection on its own trajectory: the facts it missed and the wrong values it
    used, by name (within-episode use: the teacher follows both when they come back as memory),
    then general lessons for the failure kinds it made (cross-episode transfer)."""
    missed = [k for k, v in trace.defects.items() if not k.startswith("_") and v in MISSED_DEFECTS]
    wrong = [k for k, v in trace.defects.items() if not k.startswith("_") and v.startswith("copied")]
    uncited = [k for k, v in trace.defects.items() if v == "uncited"]
    parts = []
    if missed:
        parts.append("missed: " + ", ".join(missed) + ".")
    if wrong:
        parts.append("wrong: " + ", ".join(f"{k} {trace.copied[k]}" for k in wrong if k in trace.copied)
                     + ".")
    lessons = []
    if any(trace.defects[k] == "not planned" for k in missed):
        lessons.append("plan every asked aspect")
    if any(trace.defects[k] in ("skipped", "vague query") for k in missed):
        lessons.append("search each with the full name")
    if any(trace.defects[k] == "not written" for k in missed):
        lessons.append("every found fact in the writing plan")
    if wrong:
        lessons.append("ignore old records")
    if uncited:
        lessons.append("cite every claim")
    if "_negative" in trace.defects:
        lessons.append("list what to avoid")
    # The stage-local flaws of the previous toy (TeacherConfig.p_plan_unsearched and after; off).
    if "_plan_search" in trace.defects:
        lessons.append("plan one search per asked aspect")
    if "_eval_bare" in trace.defects:
        lessons.append("give the snippet id or not found in each state evaluation")
    if "_writing_gap" in trace.defects:
        lessons.append("list every found fact in the writing plan")
    if "_unknown_omitted" in trace.defects:
        lessons.append("say when a fact is not found")
    if not lessons:
        lessons.append("one search per asked aspect, cite each claim")
    parts.append("Lesson: " + "; ".join(lessons) + ".")
    return " ".join(parts)


def oracle_lesson(q: Query, world: World) -> str:
    """The lesson a perfect reflection on this query could write (the oracle-lesson control of
    scripts/memory_eval.py; not in the paper): every asked fact named as missed, and each asked
    fact's old-record value named as wrong, in the teacher's reflection format, from ground truth.
    A policy that has learned what a lesson is for plans, searches and writes every fact and keeps
    away from those values."""
    keys = [fact_key(f) for f in q.facts]
    old = [f"{fact_key(f)} {d.value}" for f in q.facts for d in world.docs_of(f["entity"], f["aspect"])
           if d.kind == "outdated"]
    parts = ["missed: " + ", ".join(keys) + "."]
    if old:
        parts.append("wrong: " + ", ".join(old) + ".")
    parts.append("Lesson: plan every asked aspect; every found fact in the writing plan"
                 + ("; ignore old records" if old else "") + ".")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------------
# Filters


# The filters are the paper's, shared with the full SFT: sft.sft_filter (root module sft.py).


# ----------------------------------------------------------------------------------------------------
# Examples and training


def encode_example(tok, messages: list, segments: Sequence[Segment]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one chat example: prompt (mask 0) + segments (policy 1, env 0).

    Segments are tokenised one by one, exactly as the rollout engine appends them.
    """
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    mask = [0] * len(ids)
    for is_env, text in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        mask += [0 if is_env else 1] * len(seg)
    return ids, mask


def encode_examples(tok, examples: Sequence[tuple[list, Sequence[Segment]]]):
    """`encode_example` for many examples with batched tokenizer calls (same ids, ~10x faster)."""
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
               for m, _ in examples]
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    flat = [t for _, segs in examples for _, t in segs]
    s_ids = iter(tok(flat, add_special_tokens=False)["input_ids"])
    out = []
    for (_, segs), ids in zip(examples, p_ids):
        ids, mask = list(ids), [0] * len(ids)
        for is_env, _ in segs:
            seg = next(s_ids)
            ids += seg
            mask += [0 if is_env else 1] * len(seg)
        out.append((ids, mask))
    return out


@dataclass
class SFTConfig:
    """SFT hyperparameters (toy values are ours; the default build takes ~15 min on 2 cores and is
    shipped in toy/warm_start/, so a default run loads it instead of training)."""

    n_trajectories: int = 20000
    """teacher trajectories kept after the SFT filters"""
    n_reflections: int = 1200
    """reflection examples (the reflection meta-policy's warm start)"""
    steps: int = 5000
    """optimizer steps"""
    batch_size: int = 16
    """sequences per optimizer step"""
    lr: float = 2e-3
    """peak learning rate (linear warm-up, then cosine to 10 %)"""
    warmup: int = 30
    """warm-up steps"""
    weight_decay: float = 0.1
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max global gradient norm"""
    seed: int = 0
    """seed of the teacher data, the tokenizer and the model initialisation"""
    shipped: bool = True
    """ours: start from the warm start shipped in toy/warm_start/ when it was built with this run's
    configuration (its key equals `warm_start_key`), as the paper starts RL from a released SFT
    checkpoint; false trains it in the run instead (cached under cache_dir). Not in the key."""


def build_sft_data(world: World, tool, tok_system: str, cfg: SFTConfig, tcfg: TeacherConfig,
                   scaffold: str = "structured"):
    """Teacher trajectories (filtered) and reflection examples over the *train* rows; for the
    unstructured scaffold trajectories only, without memory in the prompts.

    Returns (examples, stats): examples are (messages, segments) pairs; stats counts filter drops.
    """
    structured = scaffold == "structured"
    rng = random.Random(cfg.seed)
    rows = load_rows(world.train_rows)
    stats = {"generated": 0, "kept": 0}
    examples, traces = [], []
    while len(examples) < cfg.n_trajectories:
        q = rng.choice(rows)
        memory: list[str] = []
        if structured and rng.random() < tcfg.p_memory and traces:
            # Memory is either this query's own lesson from a first attempt (within-episode exact,
            # §3.5: the teacher then avoids what that attempt got wrong) or another query's lesson
            # (cross-episode: nothing in it is about this query, and the teacher ignores it).
            if rng.random() < tcfg.p_memory_exact:
                first = teacher_trajectory(q, tool, world, rng, tcfg, (), scaffold)
                memory = [teacher_reflection(q, first)]
            else:
                src = rng.choice(traces[-200:])
                memory = [teacher_reflection(src[0], src[1])]
        tr = teacher_trajectory(q, tool, world, rng, tcfg, memory, scaffold)
        stats["generated"] += 1
        why = sft_filter(tr.segments, scaffold)
        if why:
            stats[why] = stats.get(why, 0) + 1
            continue
        stats["kept"] += 1
        examples.append((build_messages(q.query, memory, tok_system), tr.segments))
        traces.append((q, tr))
    # The unstructured agent has no reflection meta-policy: no reflection examples.
    picked = rng.sample(traces, min(cfg.n_reflections, len(traces))) if structured else []
    for q, tr in picked:
        traj = "".join(t for _, t in tr.segments).replace("<|im_end|>", "")
        msgs = reflection_messages(q.query, traj, tok_system)
        examples.append((msgs, [(False, teacher_reflection(q, tr) + "<|im_end|>")]))
    return examples, stats


def train_sft(model, tok, encoded: list[tuple[list[int], list[int]]], cfg: SFTConfig,
              progress: bool = True, precision: str = "fp32") -> dict:
    """Masked next-token SFT. encoded: (ids, mask) pairs. Returns {"loss", "steps", "seconds"}.

    Batches are length-bucketed (sorted by length in chunks of 50 batches) and right-padded.
    precision: the forward's `scaffold.autocast` ("fp32" | "bf16"; ValueError otherwise); the loss,
    gradients, weights and AdamW state are float32 either way.
    """
    cast, mult = autocast(precision), pad_multiple(precision)

    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)

    def lr_at(s: int) -> float:
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        p = (s - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    pad = tok.pad_token_id
    model.train()
    t0, ema, step = time.perf_counter(), None, 0
    bar = tqdm(total=cfg.steps, desc="sft", disable=not progress, mininterval=2.0)
    while step < cfg.steps:
        perm = torch.randperm(len(encoded), generator=g).tolist()
        chunk = cfg.batch_size * 50
        batches = []
        for c in range(0, len(perm), chunk):
            part = sorted(perm[c : c + chunk], key=lambda i: len(encoded[i][0]))
            batches += [part[b : b + cfg.batch_size] for b in range(0, len(part), cfg.batch_size)]
        order = torch.randperm(len(batches), generator=g).tolist()
        for bi in order:
            if step >= cfg.steps:
                break
            idx = batches[bi]
            L = -(-max(len(encoded[i][0]) for i in idx) // mult) * mult  # rounded up (bf16 only)
            x = torch.full((len(idx), L), pad, dtype=torch.long)
            m = torch.zeros((len(idx), L), dtype=torch.float32)
            att = torch.zeros((len(idx), L), dtype=torch.long)
            for r, i in enumerate(idx):
                ids, mk = encoded[i]
                x[r, : len(ids)] = torch.tensor(ids)
                m[r, : len(ids)] = torch.tensor(mk, dtype=torch.float32)
                att[r, : len(ids)] = 1
            sel = m[:, 1:] > 0  # (B, L-1): predict token t+1 from position t where it is trained
            with cast:
                hidden = model.get_decoder()(input_ids=x, attention_mask=att).last_hidden_state
                # The vocabulary projection runs only on trained positions (~15% faster per step).
                h = hidden[:, :-1][sel]  # (N_mask, H)
                n = h.shape[0]
                if mult > 1:  # bf16: N_mask rounded up to a multiple of 4 * mult rows, as L above
                    h = torch.nn.functional.pad(h, (0, 0, 0, -n % (4 * mult)))
                logits = model.get_output_embeddings()(h).float()[:n]  # (N_mask, V)
            # SFT loss = sum_t mask_t * (-log pi(x_t | x_<t)) / sum_t mask_t  (tool outputs masked)
            loss = torch.nn.functional.cross_entropy(logits, x[:, 1:][sel])
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            step += 1
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    model.eval()
    return {"loss": ema, "steps": step, "seconds": time.perf_counter() - t0}


def tok_text(messages: list, segments: Sequence[Segment]) -> str:
    """Plain text of one example, chat markup included (tokenizer training text; the layout of
    toy.model.CHATML_TEMPLATE)."""
    head = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return head + "<|im_start|>assistant\n" + "".join(t for _, t in segments)


def cache_key(obj: dict) -> str:
    """sha256 of a JSON-serialisable configuration: the warm start's cache key."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warm_start_key(world_config, system: str, cfg: SFTConfig, tcfg: TeacherConfig, size: str,
                   vocab_size: int, scaffold: str = "structured", extra_key: dict | None = None) -> str:
    """The warm start's cache key (16 hex characters): world, teacher, SFT and model configuration,
    the system prompt and the scaffold. The structured scaffold's key leaves the scaffold out, so
    warm starts cached before the scaffold ablation existed stay valid; every other scaffold is in
    the key, so two scaffolds' warm starts never share a cache entry."""
    teacher = {k: v for k, v in asdict(tcfg).items() if not (k in _LOCAL_FLAWS and v == 0)}
    sft = {k: v for k, v in asdict(cfg).items() if k != "shipped"}  # where it comes from, not what
    return cache_key({"world": asdict(world_config), "teacher": teacher, "sft": sft,
                      "size": size, "vocab": vocab_size, "system": system, "v": 1,
                      **({} if scaffold == "structured" else {"scaffold": scaffold}),
                      **(extra_key or {})})


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_start")
"""The shipped warm start (scripts/build_warm_start.py --out toy/warm_start, default configuration)."""


def shipped_manifest() -> dict | None:
    """The shipped warm start's warm_start.json (its "key" is the `warm_start_key` it was built
    with), or None when there is none or it cannot be read."""
    try:
        with open(os.path.join(SHIPPED, "warm_start.json")) as fh:
            man = json.load(fh)
        return man if isinstance(man, dict) and "key" in man else None
    except (OSError, ValueError):
        return None


def shipped_key() -> str | None:
    """The `warm_start_key` of the shipped warm start, or None (shipped_manifest)."""
    man = shipped_manifest()
    return None if man is None else man["key"]


def warm_start(world: World, tool, system: str, cfg: SFTConfig, tcfg: TeacherConfig, size: str,
               vocab_size: int, cache_dir: str, progress: bool = True, extra_key: dict | None = None,
               scaffold: str = "structured", precision: str = "fp32"):
    """Build (or load from cache) the SFT policy of a scaffold ("structured" | "unstructured").
    Returns (model, tokenizer, info dict, path).

    The cache key (`warm_start_key`) covers the world, teacher, SFT and model configuration, the
    scaffold and the training precision (`train_sft`; "fp32" leaves the key as it was before the
    option existed); a second run with the same configuration loads `cache_dir/sft-<key>`
    (save_pretrained format) and skips training. The weights are float32 either way.
    """
    if precision != "fp32":
        extra_key = {**(extra_key or {}), "precision": precision}
    key = warm_start_key(world.config, system, cfg, tcfg, size, vocab_size, scaffold, extra_key)
    man = shipped_manifest() if cfg.shipped else None
    if man is not None and man["key"] == key:  # the released warm start of this configuration
        model, tok = policy.load_policy(SHIPPED)
        info = {k: man[k] for k in ("key", "params", "final_loss", "steps")}
        info.update(cached=True, shipped=True)
        log.info(warm_start_line(True, SHIPPED, cfg.steps))
        return model, tok, info, SHIPPED
    path = os.path.join(cache_dir, f"sft-{key}")
    info_path = os.path.join(path, "sft_info.json")
    if os.path.exists(info_path):
        model, tok = policy.load_policy(path)
        with open(info_path) as fh:
            info = json.load(fh)
        info["cached"] = True
        log.info(warm_start_line(True, path, cfg.steps))
        return model, tok, info, path
    log.info(warm_start_line(False, path, cfg.steps))
    t0 = time.perf_counter()
    examples, stats = build_sft_data(world, tool, system, cfg, tcfg, scaffold)
    t_data = time.perf_counter() - t0
    texts = [d.title + " " + d.text for d in world.docs]
    texts += [tok_text(msgs, segs) for msgs, segs in examples[:3000]]
    tok = policy.train_tokenizer(texts, names=list(world.entities), vocab_size=vocab_size,
                                 syllables=SYLLABLES, seed=cfg.seed,
                                 tags=SCAFFOLD_TAGS + (THINK_TAGS if scaffold == "unstructured" else ()))
    encoded = encode_examples(tok, examples)
    model = policy.build_tiny_qwen3(tok, size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    res = train_sft(model, tok, encoded, cfg, progress, precision)
    info = {"filter": stats, "examples": len(encoded), "data_seconds": round(t_data, 2),
            "train_seconds": round(res["seconds"], 2), "final_loss": res["loss"],
            "steps": res["steps"], "params": sum(p.numel() for p in model.parameters()),
            "mean_tokens": sum(len(e[0]) for e in encoded) / len(encoded), "key": key,
            "precision": precision, "cached": False}
    log.info("SFT filters: %s", format_filter_counts(stats))
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "sft_info.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    os.makedirs(cache_dir, exist_ok=True)
    if os.path.exists(path):  # a concurrent run finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)  # atomic: a half-written warm start is never picked up
    del examples, encoded, texts, model
    release_heap()
    # The run continues from the saved copy, exactly as a later run that finds it in the cache: the
    # trained objects in memory and the loaded ones hold the same numbers, but not in the same
    # memory, and a run from one drifted from a run from the other after a few RL steps.
    model, tok = policy.load_policy(path)
    return model, tok, info, path


def release_heap() -> None:
    """Give the memory freed after the SFT data and training back to the operating system: a
    garbage collection, then glibc's malloc_trim (a no-op where the C library has none). Without it
    the process keeps about 600 MB of freed heap through the RL phase, and a cold toy run peaks
    about 0.3 GiB above a run with the warm start cached (not part of the paper's method)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
