"""The toy's scripted SFT teacher: four-stage trajectories through the real tool, with controlled flaws.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Stands in for the appendix's SFT teacher (Gemini-3.1-Pro writing stage-structured trajectories); the
SFT filters and the training are in toy/sft.py.

The toy task is a causal chain (docs/results.md, "The toy task"):
  Plan      the rubrics name the asked facts ("need: E a") -- a fact left out is never searched;
            "avoid: look-alike names and old records" (the negative constraint) makes the research careful;
  Research  one search per planned fact; the state evaluation names the value the later stages use --
            a careless note copies the first distractor (an old record, ranked above the true
            document, or a look-alike's document) and the answer repeats it;
  Review    the writing plan lists the findings that reach the answer -- a finding left out is lost;
  Answer    one cited sentence per writing-plan fact.
So an early flaw shows in the answer only through the later stages, and each stage's rubrics see the
decision where it is made: the problem that stage-level credit (SS-GRPO, §3.3) addresses.

Memory: the teacher's reflection names what its attempt got wrong by name ("missed: E a. wrong: E a v.
Lesson: ..."). With that lesson retrieved for the same query (within-episode, §3.5) the teacher plans,
searches and writes every missed fact and keeps away from the named wrong values; another query's
lesson says nothing about this one and changes nothing. This is how the SFT policy learns what a bank
item is for (the oracle-lesson control of scripts/memory_eval.py measures it).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Sequence

from scaffold import CALL_OPEN, THINK_TAGS, Query, format_tool_error, format_tool_output
from sft import Segment
from toy.world import ANSWER_TEMPLATES, World


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
    memory_lessons: str = "attempt"
    """what an SFT prompt's lesson names (ours): "attempt", the teacher's reflection on its own
    first attempt at the query (the facts that attempt missed and the wrong values it used), so the
    facts a lesson names are mostly the ones the teacher tends to drop, and a lesson's presence
    alone predicts much of what follows; "random" (`random_lesson`), a random subset of the asked
    facts as missed and of their old-record values as wrong, with a general clause drawn
    independently of them, so only what the lesson names predicts which facts the teacher then
    plans, checks and writes (another query's lesson has the same form and names nothing of this
    one). The reader the content index of scripts/memory_eval.py measures needs "random"."""
    memory_first: bool = False
    """(ours, not in the paper) the plan lists the facts a memory item names as missed first, in the
    item's order and with the item's words ("missed: A year, B use." -> "need: A year; need: B use;
    ..."), then the other planned facts in the question's order; the research, review and answer
    follow the plan's order. False: the question's order. With True, acting on a lesson's content
    starts with copying its names into the plan, which a small transformer learns far more easily than
    looking up each asked fact in the lesson (scripts/memory_eval.py's content index)."""
    memory_append: bool = False
    """(ours, not in the paper) the plan is drawn as without a memory item (the same omissions), then
    its rubrics add "need: X" for every fact the item names as missed, in the item's order and words
    (a fact already planned is named twice); the research, review and answer take the plan's facts
    once, in that order. Unlike memory_first, a lesson leaves the plan of the bare prompt as it is
    and only adds to it, so what RL teaches the bare plan is the lesson context's plan too.
    Ignored when memory_first is set."""
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
    return set(memory_missed_order(items))


def memory_missed_order(items: Sequence[str]) -> list[str]:
    """Fact keys named as missed in memory items, in the order the items name them, each once."""
    out: dict[str, None] = {}  # insertion-ordered set
    for it in items:
        for m in _MISSED_RE.finditer(it):
            out.update(dict.fromkeys(k.strip() for k in m.group(1).split(",")))
    return list(out)


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
    # memory_append draws the plan as if there were no memory item, then adds the item's names.
    omitted = [fact_key(f) for f in facts[1:] if chain is not None and chain.random() < cfg.p_plan_omit
               and (cfg.memory_append or fact_key(f) not in remembered)]
    planned = [f for f in facts if fact_key(f) not in omitted]
    needs = planned  # the plan's rubrics, in order
    if cfg.memory_first:  # the remembered facts first, in the memory item's order (its names copied)
        by_key = {fact_key(f): f for f in planned}
        first = [by_key[k] for k in memory_missed_order(memory) if k in by_key]
        planned = needs = first + [f for f in planned if f not in first]
    elif cfg.memory_append:  # the plan without memory, then every named fact again, in the item's order
        by_key = {fact_key(f): f for f in facts}
        named = [by_key[k] for k in memory_missed_order(memory) if k in by_key]
        needs = planned + named
        planned = planned + [f for f in named if f not in planned]
        omitted = [k for k in omitted if k not in remembered]
    for k in omitted:
        defects[k] = "not planned"
    need = "; ".join(f"need: {fact_key(f)}" for f in needs)
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
                # An unmarked old record (WorldConfig.p_unmarked) looks like the true document: a
                # note takes it whenever it comes first, unless a memory item named its value.
                if (d.entity == f["entity"] or d.kind == "lookalike") \
                        and (rng.random() < p_copy or not d.marked) and k not in warned:
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
    memory_append: bool = False
    """(ours, not in the paper) the plan is drawn as without a memory item (the same omissions), then
    its rubrics add "need: X" for every fact the item names as missed, in the item's order and words
    (a fact already planned is named twice); the research, review and answer take the plan's facts
    once, in that order. Unlike memory_first, a lesson leaves the plan of the bare prompt as it is
    and only adds to it, so what RL teaches the bare plan is the lesson context's plan too.
    Ignored when memory_first is set."""
    # The stage-local flaws of the previous toy (TeacherConfig.p_plan_unsearched and after; off).
    if "_plan_search" in trace.defects:
        lessons.append("plan one search per asked aspect")
    if "_eval_bare" in trace.defects:
        lessons.append("give the snippet id or not found in each state evaluation")
    if "_writing_gap" in trace.defects:
        lessons.append("list every found fact in the writing plan")
    if "_unknown_omitted" in trace.defects:
        lessons.append("say when a fact is not found")
    return lesson_text(missed, [f"{k} {trace.copied[k]}" for k in wrong if k in trace.copied], lessons)


GENERIC_LESSON = "one search per asked aspect, cite each claim"


def lesson_text(missed: Sequence[str], wrong: Sequence[str], lessons: Sequence[str]) -> str:
    """A lesson in the teacher's reflection format, which memory_missed / memory_wrong parse and the
    teacher follows: "missed: E a, ...." (fact keys), "wrong: E a v, ...." (fact key and the wrong
    value), then "Lesson: " and the general lessons joined by "; " (GENERIC_LESSON when none)."""
    parts = (["missed: " + ", ".join(missed) + "."] if missed else []) \
        + (["wrong: " + ", ".join(wrong) + "."] if wrong else [])
    return " ".join(parts + ["Lesson: " + "; ".join(list(lessons) or [GENERIC_LESSON]) + "."])


# The general clauses of the teacher's reflections (teacher_reflection), which random_lesson draws from.
GENERAL_LESSONS = ("plan every asked aspect", "search each with the full name",
                   "every found fact in the writing plan", "ignore old records", "cite every claim",
                   "list what to avoid")
MEMORY_LESSONS = ("attempt", "random")


def random_lesson(q: Query, world: World, rng: random.Random) -> str:
    """A lesson about query q in the teacher's reflection format whose content is random (SFT prompts
    under TeacherConfig.memory_lessons = "random"; not in the paper): each asked fact named as missed
    with probability 1/2 (at least one), each of their old-record values named as wrong with
    probability 1/2, and one or two general clauses (GENERAL_LESSONS) drawn independently of both.
    The teacher then plans, searches and writes exactly the named facts for sure and keeps away from
    the named values, and treats every other fact as without a lesson, so a lesson's names are the
    only thing in it that predicts what the teacher does differently."""
    keys = [fact_key(f) for f in q.facts]
    missed = [k for k in keys if rng.random() < 0.5] or [rng.choice(keys)]
    wrong = [f"{fact_key(f)} {d.value}" for f in q.facts
             for d in world.docs_of(f["entity"], f["aspect"]) if d.kind == "outdated" and rng.random() < 0.5]
    return lesson_text(missed, wrong, rng.sample(GENERAL_LESSONS, rng.randint(1, 2)))


def oracle_lesson(q: Query, world: World) -> str:
    """The lesson a perfect reflection on this query could write (the oracle-lesson control of
    scripts/memory_eval.py; not in the paper): every asked fact named as missed, and each asked
    fact's old-record value named as wrong, in the teacher's reflection format, from ground truth.
    A policy that has learned what a lesson is for plans, searches and writes every fact and keeps
    away from those values."""
    keys = [fact_key(f) for f in q.facts]
    old = [f"{fact_key(f)} {d.value}" for f in q.facts for d in world.docs_of(f["entity"], f["aspect"])
           if d.kind == "outdated"]
    return lesson_text(keys, old, ["plan every asked aspect", "every found fact in the writing plan"]
                       + (["ignore old records"] if old else []))
