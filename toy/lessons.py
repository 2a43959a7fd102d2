"""What a reflection teaches, and how the toy judge scores reflection candidates (§3.4's privileged
judge in the toy world): validity (degenerate, cut-off or off-topic candidates are never bank
material), the lessons a candidate states, and its within / cross scores.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
`ToyJudge.score_reflections` (toy/judge.py) diagnoses the judged trajectory with its own checks (which
stages, facts and failure kinds failed) and hands the diagnosis to `score_reflections` here.

Deviations from the paper
1. The paper's privileged judge is an LLM that reads the trajectory, its scores and justifications;
   ours compares the candidate's words with the diagnosis (failed facts and stages by name, the
   general lessons by keyword: _LESSONS), so a candidate earns only for naming what actually failed.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from judge import ReflectionScore
from scaffold import ANSWER, PLAN, RESEARCH, REVIEW, STAGES
from toy.world import SYLLABLES


# ---- reflection validity: degenerate, cut-off or off-topic candidates are never bank material ----

_REPEAT_RE = re.compile(r"(.{1,6}?)\1{3,}")  # a unit of 1-6 characters written 4+ times in a row
_WORD_REPEAT_RE = re.compile(r"\b(\w+)\b(?:\W+\1\b){2,}")  # the same word 3+ times in a row
# The same phrase of 2-4 words 3+ times in a row ("Sunnana year, Sunnana year, Sunnana year").
_PHRASE_REPEAT_RE = re.compile(r"\b(\w+(?:\W+\w+){1,3})\b(?:\W+\1\b){2,}")
_MISSED_CLAUSE_RE = re.compile(r"\bmissed:?([^.;:]*)", re.I)  # "missed: A year, B use." -> facts
_WRONG_CLAUSE_RE = re.compile(r"\bwrong:([^.;:]*)", re.I)  # "wrong: A habitat north dunes." -> facts
_END_RE = re.compile(r"[.!?][\"')\]]*$")
_LABEL_RE = re.compile(r"(?:^|[.;!?]\s+)([A-Za-z]+):")
_LABELS = ("missed", "wrong", "lesson", "lessons", "avoid", "need", "note", "fix")
_NAME_RE = re.compile(r"\b[A-Z][a-z]{3,10}\b")
_NAME_ASPECT_RE = re.compile(r"\b([A-Z][a-z]{3,10})(?:'s)? (?:habitat|discoverer|year|use)\b")
REFLECTION_MAX_CHARS = 600  # ours: toy reflections are one or two sentences


def _degenerate(text: str, phrases: bool = False) -> bool:
    """True for degenerate repetition ("Loelfefefefe", "cite cite cite"): a 1-6 character unit 4+
    times in a row, one word 3+ times in a row, or one phrase of 2-4 words 3+ times in a row
    ("Sunnana year, Sunnana year, Sunnana year"; only with phrases=True, the toy judge's fix
    "repetition"). Sampled text stuck in a loop; no lesson in it."""
    t = " ".join(text.lower().split())
    return bool(_REPEAT_RE.search(t) or _WORD_REPEAT_RE.search(t)
                or (phrases and _PHRASE_REPEAT_RE.search(t)))


def _cut_off(text: str) -> bool:
    """True for a truncated candidate: no sentence end ([.!?], optionally closed by a quote or a
    bracket), a trailing ellipsis, or a clipped label ("mis:" for "missed:"). Generation cut by the
    token budget leaves a fragment whose last instruction is unreadable."""
    t = text.strip()
    if not _END_RE.search(t) or t.rstrip("\"')]").endswith(("..", "\u2026")):
        return True
    for m in _LABEL_RE.finditer(t):
        w = m.group(1).lower()
        if len(w) >= 2 and w not in _LABELS and any(lab.startswith(w) for lab in _LABELS):
            return True
    return False


def _syllabic(word: str) -> bool:
    """True if `word` splits into the toy world's name syllables (so it reads like an entity name)."""
    w = word.lower()
    ok = [True] + [False] * len(w)
    for i in range(1, len(w) + 1):
        ok[i] = any(ok[i - len(s)] and w[i - len(s):i] == s for s in SYLLABLES if len(s) <= i)
    return ok[-1]


def reflection_defect(text: str, entities: set, world_entities, phrases: bool = False) -> str:
    """Why a candidate is not a usable lesson ("" if it is): empty, too long, degenerate
    repetition, cut off, or naming an entity the question does not ask about (a world entity
    or a name-like word before an aspect). Such candidates score 0 and are marked invalid.
    entities: the names the question asks about; world_entities: every entity of the toy world;
    phrases: the toy judge's fix "repetition" (a repeated 2-4 word phrase is degenerate too)."""
    t = " ".join(text.split())
    if not t:
        return "empty"
    if len(t) > REFLECTION_MAX_CHARS:
        return "too long"
    if _degenerate(t, phrases=phrases):
        return "degenerate repetition"
    if _cut_off(t):
        return "cut off"
    names = {w for w in _NAME_RE.findall(t) if w in world_entities}
    names |= {m.group(1) for m in _NAME_ASPECT_RE.finditer(t) if _syllabic(m.group(1))}
    foreign = sorted(names - set(entities))
    return f"names {', '.join(foreign)}, not in the question" if foreign else ""


# ---- lessons: what a reflection teaches, and which failure each rubric kind reveals ----

_STAGE_WORDS = {PLAN: re.compile(r"\bplan\b", re.I),
                RESEARCH: re.compile(r"\b(?:re)?search|\bquer(?:y|ies)\b", re.I),
                REVIEW: re.compile(r"\breview\b", re.I),
                ANSWER: re.compile(r"\banswer\b|\bclaims?\b", re.I)}
_LESSONS = {
    "search": ("search every", "search each", "every asked", "each asked", "one search per",
               "full name"),
    "cite": ("cite",),
    "distractor": ("old record", "look-alike", "lookalike", "outdated"),
    "avoid": ("what to avoid", "negative constraint"),
    "commit": ("one value", "single value", "hedg"),
    "honest": ("not found", "missing only"),
    "plan": ("concrete check", "name the entity", "complete plan"),
    "efficient": ("repeat", "wasted", "duplicate"),
    "writing": ("writing plan",),
    "finish": ("close the answer", "finish the answer", "complete the answer"),
}
_KIND_OF_CHECK = {"plan_need": "search", "plan_search": "search", "res_got": "search",
                  "res_named": "search", "plan_avoid": "avoid", "plan_form": "plan",
                  "res_efficient": "efficient", "res_honest": "honest", "rev_plan": "writing",
                  "ans_closed": "finish", "ans_cited": "cite", "ans_nodistractor": "distractor"}


def score_reflections(candidates: Sequence[str], ctx: dict, stages: set, failed: set, need: set,
                      fixes=frozenset(), world_entities=()) -> list[ReflectionScore]:
    """Privileged scoring (§3.4) of m reflection candidates on one judged trajectory, from the toy
    judge's diagnosis of it (`ToyJudge._diagnosis`, which re-scores the rubrics that scored each
    stage, what `judged.justifications` summarise): ctx, the trajectory's context (its asked
    `facts`, `entities` and `fact_kinds`); stages, the failed stages; failed, the failed facts'
    keys; need, the failure kinds (keys of _LESSONS). fixes: judge.toy_fixes; world_entities: every
    entity of the toy world (a candidate naming one the question does not ask about is invalid).
    Returns m ReflectionScores with within, cross, score = (within + cross) / 2 in [0,1]:
    within (same query again) = mean of
        facts: share of the failed facts named ("Entity aspect") minus the share of asked facts
               named that did not fail (a list of every fact gains nothing); a fact named as
               missed ("missed: Entity aspect") counts as named right only if it was missed (a
               failure that a search fixes: not searched, or searched and not found), else as
               a wrong name (a stated, uncited fact is not "missed"; fix "false_missed"), and
               one named with a wrong value ("wrong: Entity aspect value") only if its answer
               took a distractor's value (same fix); and
               each repeated mention of a fact beyond its first costs 0.25 (repetition is not
               specificity; fix "repetition");
        stage: 1 if it names a stage that failed, minus 0.25 per named stage that did not fail
               (1 when no stage failed);
    cross (similar queries) = share of the failure kinds for which it states the general
        lesson, minus 0.25 per lesson for a failure that did not occur (a keyword list loses).
    Invalid candidates (`_reflection_defect`) get 0, 0, 0 and valid=False: they must never be
    admitted to the bank. Never raises for the candidates' content.
    """
    facts = ctx["facts"]  # the asked facts by "Entity aspect" (ToyJudge._context)
    nf = max(1, len(facts))
    out = []
    for text in candidates:
        t = text if isinstance(text, str) else ""
        defect = reflection_defect(t, ctx["entities"], world_entities, "repetition" in fixes)
        if defect:
            out.append(ReflectionScore(0.0, 0.0, 0.0, f"invalid: {defect}", valid=False))
            continue
        counts = {k: t.count(k) for k in facts}
        named = {k for k, n in counts.items() if n}
        said = {k for k, rx in _STAGE_WORDS.items() if rx.search(t)}
        # A fact listed as missed that was not missed (stated but uncited, copied from a
        # distractor, hedged) is a false diagnosis: it counts as a wrong name, not a right one.
        # Likewise a fact named with a wrong value whose answer took no distractor's value.
        labelled = "false_missed" in fixes
        as_missed = {k for m in _MISSED_CLAUSE_RE.finditer(t) for k in facts if k in m.group(1)} \
            if labelled else set()
        as_wrong = {k for m in _WRONG_CLAUSE_RE.finditer(t) for k in facts if k in m.group(1)} \
            if labelled else set()
        false_missed = ({k for k in as_missed if "search" not in ctx["fact_kinds"].get(k, ())}
                        | {k for k in as_wrong if "distractor" not in ctx["fact_kinds"].get(k, ())})
        repeats = sum(n - 1 for n in counts.values() if n > 1) if "repetition" in fixes else 0
        if failed:
            fact_term = (len((named & failed) - false_missed) / len(failed)
                         - len((named - failed) | (false_missed & failed)) / nf)
        else:
            fact_term = 1.0 - len(named) / nf
        fact_term -= 0.25 * repeats
        # Nothing failed: any stage may carry the general lesson, so none is penalised.
        stage_term = float(bool(said & stages)) - 0.25 * len(said - stages) if stages else 1.0
        within = 0.5 * (float(np.clip(fact_term, 0, 1)) + float(np.clip(stage_term, 0, 1)))
        present = {k for k, ws in _LESSONS.items() if any(w in t.lower() for w in ws)}
        if need:
            cross = len(present & need) / len(need) - 0.25 * len(present - need)
        else:
            cross = 1.0 if ("one search" in t.lower() or not present) else 0.5
        cross = float(np.clip(cross, 0, 1))
        # Eq.: score = (within + cross) / 2  (§3.4, two criteria)
        out.append(ReflectionScore(within, cross, 0.5 * (within + cross),
                                   f"failed stages={[STAGES[k] for k in sorted(stages)]} "
                                   f"facts={sorted(failed)} named={sorted(named)} "
                                   f"stages named={[STAGES[k] for k in sorted(said)]} "
                                   f"lessons={sorted(present)} needed={sorted(need)}"))
    return out
