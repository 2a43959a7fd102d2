"""The toy world's stage judge: `ToyJudge`, an `EvolvingJudge` (judge.py, §3.4) whose rubrics are
deterministic checks against the toy world's ground truth.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).

The toy judge (`ToyJudge`) is a real, deterministic scorer built on the toy world's ground truth.
Its rubrics are checks with a machine-readable `check` spec, proposed from a per-query pool:
Plan (names each asked fact, a concrete negative constraint, a search per fact, a plan with content),
Research (retrieved each needed document, searches whose outputs reach the asked entity, no call that
finds nothing, honest state evaluations), Review (each fact mapped once to supporting evidence, or to
"missing" only after a search for it), Answer (the data row's initial rubrics: correct, cited facts,
one value per fact; no unsupported claims; plus proposed checks). It reads only parsed structure, exact
values, environment-issued citation handles and the documents the tool returned, so instructions
written inside a rollout or a tool output cannot move it, and keyword stuffing or hedging earns nothing.
Reflection candidates are scored from the judged trajectory's rubrics (privileged, §3.4); degenerate,
cut-off or off-topic candidates are marked invalid.

The unstructured scaffold (the scaffold ablation, Fig. 6a-c; `ToyJudge(..., scaffold="unstructured")`)
has no plan, research notes or review to grade: its pool holds the Answer stage's checks only, so
its Answer score is computed from the same answer rubrics (the data row's initial rubrics plus the
proposed answer checks) as the structured scaffold's, and its Plan, Research and Review cells are
NaN (not applicable: no rubric scores them) in R and in `evaluate`. judge/missing counts only
failures of the graded stages (`stages`); the not-applicable cells never reach the advantage,
which is the terminal Answer score.

Deviations from the paper
1. Toy rubric proposal picks from a finite pool of checks derived from ground truth, ranked by d_r;
   the paper's Gemini judge writes free-text rubrics (full mode, backends/api/judge_http.py).
2. When a stage's buffer is empty (nothing separates the group), the stage is scored with its whole
   candidate pool, which gives every rollout the same score and so zero advantage.
3. Held-out evaluation uses a *static* rubric set (the whole pool + initial rubrics) so scores are
   comparable across checkpoints; training uses the evolving buffers.
"""
from __future__ import annotations


import json
import re
import threading
from typing import Sequence

import numpy as np

from judge import BUFFER_CAPS, EvolvingJudge, JudgeResult, ReflectionScore, Rubric
from scaffold import ANSWER, PLAN, RESEARCH, REVIEW, SCAFFOLDS, STAGES, Rollout
from toy import lessons
from toy.lessons import _KIND_OF_CHECK
from toy.teacher import lesson_text
from toy.world import ANSWER_TEMPLATES

# ----------------------------------------------------------------------------------------------------
# Toy judge: deterministic checks against the toy world's ground truth

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+")
_CITE = re.compile(r"\[(\d{1,3})\]")
_TOOL = "google_search"  # the one tool of the toy world (and of the paper's agent)


def _claim_patterns():
    pats = {}
    for aspect, tpl in ANSWER_TEMPLATES.items():
        rx = re.escape(tpl).replace(re.escape("{name}"), r"(?P<n>[A-Z][a-z]+)")
        rx = rx.replace(re.escape("{value}"), r"(?P<v>[^\[\].]+?)")
        pats[aspect] = re.compile(rx + r"\s*(?:\[|\.|$)")
    return pats


_PATTERNS = None
_MISSING_RE = re.compile(r"[Nn]o source gives the (\w+) of ([A-Z][a-z]+)")
_EVAL_RE = re.compile(r"([A-Z][a-z]+) (habitat|discoverer|year|use): (.+?)(?: \[(\d{1,3})\])?$")
_REVIEW_RE = re.compile(r"([A-Z][a-z]+) (habitat|discoverer|year|use): (?:\[(\d{1,3})\]|(missing))")
_AVOID_RE = re.compile(r"avoid:[^;<]*?(look-?alike|similar[- ]nam|old record|outdated)", re.I)
_QWORD = re.compile(r"[a-z0-9]+")


def answer_claims(answer: str) -> list[dict]:
    """Claims stated in an answer: {entity, aspect, value, handles, sentence}; plus "unknown" claims
    ("No source gives the year of X") with value None."""
    global _PATTERNS
    if _PATTERNS is None:
        _PATTERNS = _claim_patterns()
    out = []
    for sent in _SENT_SPLIT.split(answer.strip()):
        handles = [int(h) for h in _CITE.findall(sent)]
        for aspect, rx in _PATTERNS.items():
            for m in rx.finditer(sent):
                out.append({"entity": m.group("n"), "aspect": aspect, "value": m.group("v").strip(),
                            "handles": handles, "sentence": sent})
        for m in _MISSING_RE.finditer(sent):
            out.append({"entity": m.group(2), "aspect": m.group(1), "value": None,
                        "handles": handles, "sentence": sent})
    return out


def _key(f: dict) -> str:
    return f"{f['entity']} {f['aspect']}"


def _env_failure(cl) -> bool:
    """A well-formed search that failed for the environment's reasons (tool error or time-out). It is
    neither the policy's finding nor its waste, so the research checks leave it out. A call to an
    unknown tool or with an empty query is the policy's own fault and stays in."""
    return bool(cl.error) and cl.name == _TOOL and bool(cl.query.strip())


def _answer_stage_calls(ro) -> set[int]:
    """Indices into ro.tool_calls of the calls written after the response's first <answer>: the
    environment inserted each call's output at ro.env_spans[i] (one span per call, in order), so a
    span that starts after the answer opened belongs to a call made inside the Answer block."""
    a = ro.text.find("<answer>")
    if a < 0 or len(ro.env_spans) != len(ro.tool_calls):
        return set()
    return {i for i, (start, _) in enumerate(ro.env_spans) if start > a}


def answer_defect(ro) -> str:
    """Why the Answer block of rollout `ro` is malformed ("" if it is not): a tool call written
    after <answer> opened, or a second <answer> block (the policy's text only; tool outputs are
    the environment's). With the fix "answer_block" such a rollout is not well formed
    (scaffold.ParsedResponse.well_formed_strict, which reads the same from the parsed text)."""
    a = ro.text.find("<answer>")
    if a < 0:
        return ""
    own, pos = [], 0
    for s, e in sorted(ro.env_spans) + [(len(ro.text), len(ro.text))]:
        own.append(ro.text[max(pos, a):s] if s > a else "")
        pos = max(pos, e)
    tail = "".join(own)
    if "<call_tool" in tail or _answer_stage_calls(ro):
        return "tool call inside the answer"
    if tail.count("<answer>") > 1:
        return "second answer block"
    return ""


# The Answer stage's checks of form (every claim cited, a closed answer, no distractor value) weigh a
# quarter of one asked fact each, so the answer score is mostly the asked facts stated right and an
# answer that leaves facts out cannot score high on its form alone (ours; the paper's rubrics are
# mostly content items too).
ANSWER_FORM_WEIGHT = 0.25

# What became of an asked fact (ToyJudge.fact_outcomes: a diagnosis, not a score)
FACT_OUTCOMES = ("stated, cited", "stated, uncited", "several values",
                 "wrong value, in a retrieved snippet", "wrong value, in no snippet",
                 "not stated, document found", "not stated, searched, document not returned",
                 "not stated, name mis-copied into the search", "not stated, not searched",
                 "unknown, said so", "unknown, stated a value", "unknown, not stated")


class ToyJudge(EvolvingJudge):
    """Deterministic stage judge for the toy world (reads ground truth from `world`).

    Every check is one small method `_c_<kind>` (dispatched by `_check`); each says what it rewards
    and why a trajectory cannot earn it without doing the work: the checks read parsed structure,
    exact values, environment-issued citation handles and the documents the tool actually returned,
    never free text that a policy could stuff with keywords.
    """

    REWARDS = ("judge", "static")
    FIXES = ("answer_block", "false_missed", "repetition")

    def __init__(self, world, caps: Sequence[int] = BUFFER_CAPS, scaffold: str = "structured",
                 reward: str = "judge", record_path: str | None = None, fixes: Sequence[str] = ()):
        """fixes (judge.toy_fixes; none by default, which keeps the scores of the published runs):
        "answer_block": a tool call written inside <answer>, or a second <answer> block, is
        malformed: such calls are no research and their evidence supports no claim, and the answer
        does not count as closed (`answer_defect`); "false_missed": a reflection that lists a fact
        as missed which was not missed gets no credit for naming it (a false diagnosis);
        "repetition": each repeated mention of a fact in a reflection costs, and a phrase of 2-4
        words written 3+ times in a row is degenerate (invalid).
        reward: "judge" (R from the evolving rubric buffers, §3.4) or "static" (R = the static
        rubric set's stage scores, `evaluate`: the ground-truth oracle rung of the reward ladder,
        settings.ARMS "oracle" / "stage_oracle"; not in the paper). The buffers evolve either way,
        so the reflection branch reads the same rubrics. record_path: append one JSON line per
        judged group, {"step", "R", "static"} ((n, 4) lists, NaN as null), for the correlation
        of R with the static scores (scripts/reward_ladder.py); None records nothing."""
        if scaffold not in SCAFFOLDS:
            raise ValueError(f"scaffold must be one of {SCAFFOLDS}, got {scaffold!r}")
        if reward not in self.REWARDS:
            raise ValueError(f"reward must be one of {self.REWARDS}, got {reward!r}")
        bad = [f for f in fixes if f not in self.FIXES]
        if bad:
            raise ValueError(f"judge.toy_fixes: unknown {bad}; choose from {self.FIXES}")
        self.fixes = frozenset(fixes)
        super().__init__(caps)
        self.world = world
        self.reward = reward
        self.record_path = record_path
        self._record_lock = threading.Lock()
        # The stages this judge grades: all four, or the Answer stage alone for the unstructured
        # scaffold (its other cells are NaN: not applicable).
        self.stages = tuple(range(len(STAGES))) if scaffold == "structured" else (ANSWER,)

    # pool of candidate rubrics ------------------------------------------------------------------
    def pool(self, query) -> list[Rubric]:
        """Candidate rubrics of `query`, of the stages this judge grades (`self.stages`)."""
        facts = query.facts
        P = []
        for f in facts:
            key = _key(f)
            P.append(Rubric(f"plan:need:{key}", PLAN, f"plan names {key}",
                            f"The plan's rubrics list {key} as knowledge to gather.",
                            check=("plan_need", key)))
            P.append(Rubric(f"plan:search:{key}", PLAN, f"plan searches {key}",
                            f"The research plan includes a search for {key}.",
                            check=("plan_search", key)))
            P.append(Rubric(f"res:got:{key}", RESEARCH, f"retrieved {key}",
                            f"The tool calls retrieve the document that gives {key}"
                            " (or search for it by name if no document exists).",
                            check=("res_got", key)))
            P.append(Rubric(f"rev:map:{key}", REVIEW, f"review maps {key}",
                            f"The rubrics review maps {key} once, to supporting evidence, or to "
                            "'missing' only if it was searched for and not found.",
                            check=("rev_map", key)))
        P += [
            Rubric("plan:avoid", PLAN, "negative constraint",
                   "The plan's rubrics say what to avoid (look-alike names, old records).",
                   check=("plan_avoid",)),
            Rubric("plan:form", PLAN, "complete plan",
                   "A closed plan whose analysis names the entity and aspects, whose rubrics list a "
                   "concrete fact to gather and whose research plan names the entity.",
                   check=("plan_form",)),
            Rubric("res:named", RESEARCH, "searches reach the asked entity",
                   "Every search returns snippets about an entity of the question, not a look-alike.",
                   check=("res_named",)),
            Rubric("res:efficient", RESEARCH, "no wasted calls",
                   "Every call finds a needed fact; no repeats; at most one call more than the facts.",
                   check=("res_efficient",)),
            Rubric("res:honest", RESEARCH, "honest state evaluations",
                   "Each state evaluation reports what the cited snippet says, or 'not found' for a "
                   "fact that was searched for.", check=("res_honest",)),
            Rubric("rev:plan", REVIEW, "writing plan covers findings",
                   "The writing plan lists every fact the review found.", check=("rev_plan",)),
            Rubric("ans:cited", ANSWER, "every claim cited", "Every factual sentence cites a snippet.",
                   weight=ANSWER_FORM_WEIGHT, check=("ans_cited",)),
            Rubric("ans:closed", ANSWER, "closed answer", "The answer is complete and closed.",
                   weight=ANSWER_FORM_WEIGHT, check=("ans_closed",)),
            Rubric("ans:nodistractor", ANSWER, "no distractor values",
                   "No value copied from an old record or a look-alike entity.",
                   weight=ANSWER_FORM_WEIGHT, check=("ans_nodistractor",)),
        ]
        return [r for r in P if r.stage in self.stages]

    def propose(self, query, rollouts, step) -> list[Rubric]:
        return self.pool(query)

    def judge_group(self, query, rollouts: Sequence[Rollout], step: int) -> JudgeResult:
        """EvolvingJudge.judge_group (§3.4); with reward = "static" its R is replaced by the static
        stage scores (`evaluate`); with a record_path, both are appended there."""
        res = super().judge_group(query, rollouts, step)
        if self.reward == "judge" and self.record_path is None:
            return res
        static = self.evaluate(query, rollouts)
        if self.record_path is not None:
            row = {"step": int(step), "query": query.query,
                   "R": [[None if not np.isfinite(x) else float(x) for x in r] for r in res.R],
                   "static": [[None if not np.isfinite(x) else float(x) for x in r] for r in static]}
            with self._record_lock, open(self.record_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        if self.reward == "static":
            res.R = static
        return res

    def initial_rubrics(self, query) -> list[Rubric]:
        out = super().initial_rubrics(query)
        facts = {_key(f): f for f in query.facts}
        for r in out:  # attach checks to the toy row's rubrics by their titles
            t = r.title
            if t == "no unsupported claims":
                r.check = ("ans_supported",)
            elif t.endswith(" unknown") and t[: -len(" unknown")] in facts:
                r.check = ("ans_fact", t[: -len(" unknown")])
            elif t in facts:
                r.check = ("ans_fact", t)
        return out

    def score_rubrics(self, query, rollouts, rubrics) -> np.ndarray:
        facts = {_key(f): f for f in query.facts}
        S = np.full((len(rollouts), len(rubrics)), np.nan)
        for i, ro in enumerate(rollouts):
            ctx = self._context(query, ro)
            for j, r in enumerate(rubrics):
                if r.check is not None:
                    S[i, j] = self._check(r.check, ctx, facts)
        return S

    # evidence -------------------------------------------------------------------------------------
    def _context(self, query, ro: Rollout) -> dict:
        """What the checks read, parsed once per rollout: the parsed response `p`, the retrieved
        documents by handle `docs`, the answer's `claims`, the policy's own tool `calls` (refused
        calls and environment failures left out), the asked `facts` by key, and `found`: the
        (entity, aspect) pairs whose true document some call returned."""
        p = ro.parsed
        late = _answer_stage_calls(ro) if "answer_block" in self.fixes else set()
        # Evidence gathered by a call written inside the answer is no evidence of research: its
        # handles support nothing, and the call is no research call (the rollout is malformed).
        late_handles = {h for i in late for h in ro.tool_calls[i].handles}
        docs = {h: self.world.doc(res.doc_id) for h, res in ro.evidence.items() if h not in late_handles}
        return {"p": p, "docs": docs, "ro": ro, "entities": set((query.toy or {}).get("entities", [])),
                "claims": answer_claims(p.fields["answer"]) if p else [],
                "facts": {_key(f): f for f in query.facts},
                "calls": [cl for i, cl in enumerate(ro.tool_calls)
                          if not cl.refused and not _env_failure(cl) and i not in late],
                "found": {(d.entity, d.aspect) for d in docs.values() if d.kind == "true"},
                "malformed_answer": answer_defect(ro) if "answer_block" in self.fixes else ""}

    def _supports(self, docs: dict, h: int, entity: str, aspect: str, value: str | None) -> bool:
        d = docs.get(h)
        return (d is not None and d.kind == "true" and d.entity == entity and d.aspect == aspect
                and (value is None or d.value == value))

    @staticmethod
    def _searched(c: dict, entity: str, aspect: str) -> bool:
        """Some search that ran names both the entity and the aspect (whole words, any case)."""
        for cl in c["calls"]:
            words = set(_QWORD.findall(cl.query.lower()))
            if not cl.error and entity.lower() in words and aspect in words:
                return True
        return False

    def _finds_needed(self, c: dict, cl) -> bool:
        """The call returned the true document of an asked fact, or (for an asked fact with no
        document, where nothing can be found) ran a search naming it."""
        need = {f["doc_id"] for f in c["facts"].values() if f["doc_id"] is not None}
        if any(r.doc_id in need for r in cl.results):
            return True
        words = set(_QWORD.findall(cl.query.lower()))
        return not cl.error and any(f["doc_id"] is None and f["entity"].lower() in words
                                    and f["aspect"] in words for f in c["facts"].values())

    # checks: one method per kind; `_check` dispatches -------------------------------------------
    _KINDS = {"plan_need", "plan_search", "plan_avoid", "plan_form", "res_got", "res_named",
              "res_efficient", "res_honest", "rev_map", "rev_plan", "ans_fact", "ans_supported",
              "ans_cited", "ans_closed", "ans_nodistractor"}

    def fact_recall(self, query, ro: Rollout) -> float:
        """Share in [0, 1] of the query's required facts that rollout `ro`'s answer states with the
        right value (cited or not; the `ans_fact` check >= 0.5); 0.0 for a query without facts.
        The held-out evaluation reports it (evaluate.heldout_scores)."""
        hits = self.fact_hits(query, ro)
        return float(np.mean(list(hits.values()))) if hits else 0.0

    def fact_hits(self, query, ro: Rollout) -> dict[str, bool]:
        """Per required fact of the query ("Entity aspect"), whether rollout `ro`'s answer states it
        with the right value (cited or not; the `ans_fact` check >= 0.5); {} for a query without
        facts. The content index of scripts/memory_eval.py reads it fact by fact."""
        by_key = {f"{f['entity']} {f['aspect']}": f for f in query.facts}
        ctx = self._context(query, ro) if by_key else None  # parse evidence and claims once
        return {k: bool(self._check(("ans_fact", k), ctx, by_key) >= 0.5) for k in by_key}

    def fact_outcomes(self, query, ro: Rollout) -> dict[str, str]:
        """What became of each asked fact in rollout `ro` (a diagnosis, not a score; not in the
        paper): {"Entity aspect": outcome}, outcome one of FACT_OUTCOMES. For a fact with a document:
        "stated, cited" / "stated, uncited" (the `ans_fact` check gives 1 / 0.5); "several values";
        "wrong value, in a retrieved snippet" (copied from a wrong document: an old record or a
        look-alike); "wrong value, in no snippet" (mis-copied or made up); not stated (or said to
        be unknown although a document gives it): "not stated, document found" (some call returned
        its true document), "not stated, searched, document not returned" (a search named the
        entity and the aspect, whole words: ToyJudge._searched), "not stated, name mis-copied into
        the search" (none did, but a search named the aspect and no asked entity), "not stated, not
        searched".
        For a fact no document gives: "unknown, said so" / "unknown, stated a value" / "unknown,
        not stated". Never raises on a malformed rollout (its answer states nothing)."""
        c = self._context(query, ro)
        snippet_values = {d.value for d in c["docs"].values()}
        asked = {f["entity"].lower() for f in c["facts"].values()}
        searched = [set(_QWORD.findall(cl.query.lower())) for cl in c["calls"] if not cl.error]
        out = {}
        for key, f in c["facts"].items():
            values = {cl["value"] for cl in self._claims_of(c, f)}
            if f["doc_id"] is None:
                out[key] = ("unknown, not stated" if not values else "unknown, said so"
                            if values == {None} else "unknown, stated a value")
            elif len(values) > 1:
                out[key] = "several values"
            elif not values or values == {None}:
                if (f["entity"], f["aspect"]) in c["found"]:
                    out[key] = "not stated, document found"
                elif self._searched(c, f["entity"], f["aspect"]):
                    out[key] = "not stated, searched, document not returned"
                elif any(f["aspect"] in words and not words & asked for words in searched):
                    out[key] = "not stated, name mis-copied into the search"
                else:
                    out[key] = "not stated, not searched"
            elif values == {f["value"]}:
                out[key] = "stated, cited" if self._c_ans_fact(c, f) == 1.0 else "stated, uncited"
            else:
                out[key] = ("wrong value, in a retrieved snippet" if values & snippet_values
                            else "wrong value, in no snippet")
        return out

    def attempt_lesson(self, query, ro: Rollout) -> str:
        """The lesson a perfect reflection on rollout `ro` would write (the attempt-lesson control of
        scripts/memory_eval.py; not in the paper): from ground truth (`fact_outcomes`), the asked
        facts the attempt did not state ("missed: E a, ..."), those it stated with a wrong value
        ("wrong: E a v, ..."), then the teacher's general lessons for those failures, in the
        teacher's reflection format (toy.teacher.lesson_text, which the SFT policy learned to
        follow); an attempt without such a failure gets the teacher's generic lesson. Unlike
        toy.teacher.oracle_lesson it names only what this attempt got wrong, so it bounds what a
        within-episode reflection (§3.5, "exact" retrieval) can do for the same question. Returns
        one line of text; never raises on a malformed rollout (every fact counts as missed)."""
        out = self.fact_outcomes(query, ro)
        missed = [k for k, v in out.items() if v.startswith("not stated") or v == "unknown, not stated"]
        c = self._context(query, ro)
        wrong = []
        for k, v in out.items():
            if v.startswith("wrong value"):
                vals = sorted({cl["value"] for cl in self._claims_of(c, c["facts"][k])} - {None})
                wrong += [f"{k} {vals[0]}"] if vals else []
        lessons = (["plan every asked aspect", "every found fact in the writing plan"] if missed else []) \
            + (["ignore old records"] if wrong else [])
        return lesson_text(missed, wrong, lessons)

    def _check(self, check: tuple, c: dict, facts: dict) -> float:
        """Score in [0,1] of one check spec on one rollout's context; NaN for an unknown kind. A
        per-fact spec ("kind", "Entity aspect") whose fact is not asked scores 0."""
        kind = check[0]
        if kind not in self._KINDS:
            return float("nan")
        fn = getattr(self, "_c_" + kind)
        if len(check) > 1:
            f = facts.get(check[1])
            return 0.0 if f is None else float(fn(c, f))
        return float(fn(c))

    def _c_plan_need(self, c, f) -> float:
        """The plan's rubrics list "Entity aspect". Exact entity and aspect together: a list of
        aspect names, or the entity alone, earns nothing."""
        return float(_key(f) in c["p"].fields["rubrics"])

    def _c_plan_search(self, c, f) -> float:
        """The research plan holds "search Entity aspect": a concrete query, not a topic."""
        return float(f"search {_key(f)}" in c["p"].fields["research_plan"])

    def _c_plan_avoid(self, c) -> float:
        """The rubrics hold a negative constraint that names a distractor of this world after
        "avoid:" (look-alike names, old/outdated records); a bare "avoid:" earns nothing."""
        return float(bool(_AVOID_RE.search(c["p"].fields["rubrics"])))

    def _c_plan_form(self, c) -> float:
        """A closed plan with content, 1/3 per part: the analysis names an asked entity and an asked
        aspect; the rubrics list an asked fact ("Entity aspect"); the research plan names an asked
        entity. Tags filled with aspect names alone score 0, so form without content never
        saturates the Plan stage (even when form is the only rubric that separates a group)."""
        p, facts = c["p"], c["facts"].values()
        if not p.closed["structured_plan"]:
            return 0.0
        words = {k: set(re.findall(r"[A-Za-z-]+", p.fields[k]))
                 for k in ("analysis", "rubrics", "research_plan")}
        parts = (any(f["entity"] in words["analysis"] and f["aspect"] in words["analysis"]
                     for f in facts),
                 any(_key(f) in p.fields["rubrics"] for f in facts),
                 any(f["entity"] in words["research_plan"] for f in facts))
        return sum(parts) / 3.0

    def _c_res_got(self, c, f) -> float:
        """A call returned f's true document (by corpus id: a look-alike's or an old record's
        document does not count); if the world has no document for f, a search that ran named it."""
        if f["doc_id"] is None:
            return float(self._searched(c, f["entity"], f["aspect"]))
        return float(any(r.doc_id == f["doc_id"] for cl in c["calls"] for r in cl.results))

    def _c_res_named(self, c) -> float:
        """Share of the policy's calls whose *output* reached an asked entity: a returned snippet is
        about an entity of the question (a look-alike's snippets are not), or the call searched by
        name for an asked fact that has no document. Query words alone earn nothing."""
        calls = c["calls"]
        if not calls:
            return 0.0
        hit = sum(any(self.world.doc(r.doc_id).entity in c["entities"] for r in cl.results)
                  or self._finds_needed(c, cl) for cl in calls)
        return hit / len(calls)

    def _c_res_efficient(self, c) -> float:
        """No wasted calls: waste = calls that found nothing needed (`_finds_needed`) or repeat an
        earlier query, plus calls beyond (facts + 1); score 1 - 0.25 waste, and 0 if no call found
        anything. Counting calls or writing good queries is not enough: they must find the facts."""
        calls, seen, useful = c["calls"], set(), 0
        for cl in calls:
            q = " ".join(cl.query.lower().split())
            useful += q not in seen and self._finds_needed(c, cl)
            seen.add(q)
        if not useful:
            return 0.0
        waste = (len(calls) - useful) + max(0, len(calls) - (len(c["facts"]) + 1))
        return max(0.0, 1.0 - 0.25 * waste)

    def _c_res_honest(self, c) -> float:
        """Share of state evaluations that are true: "E a: value [h]" where snippet h is the true
        document giving that value, or "E a: not found" when a search named (E, a) and no true
        document for it came back. Padding with unsearched "not found" notes lowers the share."""
        evals = [e for e in c["p"].state_evaluations if e]
        if not evals:
            return 0.0
        good = 0
        for e in evals:
            m = _EVAL_RE.match(e.strip())
            if not m:
                continue
            ent, asp, val, h = m.group(1), m.group(2), m.group(3).strip(), m.group(4)
            if h is not None:
                good += self._supports(c["docs"], int(h), ent, asp, val)
            elif val == "not found":
                good += (ent, asp) not in c["found"] and self._searched(c, ent, asp)
        return good / len(evals)

    def _c_rev_map(self, c, f) -> float:
        """The review maps f exactly once: to a handle whose snippet is f's true document, or to
        "missing" when no true document came back *and* a search named f. Claiming "missing"
        without searching, or mapping one fact several ways (hedging), earns nothing."""
        maps = {(m.group(3), bool(m.group(4))) for m in _REVIEW_RE.finditer(c["p"].fields["rubrics_review"])
                if f"{m.group(1)} {m.group(2)}" == _key(f)}
        if len(maps) != 1:
            return 0.0
        h, missing = maps.pop()
        if missing:
            return float((f["entity"], f["aspect"]) not in c["found"]
                         and self._searched(c, f["entity"], f["aspect"]))
        return float(self._supports(c["docs"], int(h), f["entity"], f["aspect"], None))

    def _c_rev_plan(self, c) -> float:
        """The writing plan lists every fact the review mapped to evidence."""
        p = c["p"]
        found = [f"{m.group(1)} {m.group(2)}" for m in _REVIEW_RE.finditer(p.fields["rubrics_review"])
                 if m.group(3)]
        if not p.fields["writing_plan"]:
            return 0.0
        return float(all(k in p.fields["writing_plan"] for k in found))

    @staticmethod
    def _claims_of(c, f) -> list[dict]:
        return [cl for cl in c["claims"] if cl["entity"] == f["entity"] and cl["aspect"] == f["aspect"]]

    def _c_ans_fact(self, c, f) -> float:
        """The answer commits to f's true value: 1 cited with a snippet that gives it, 0.5 uncited;
        for a fact with no document, 1 for saying no source gives it. A fact stated with several
        different values (or a value and "no source gives") is wrong: 0. So hedging over m values
        scores 0 where committing to one scores at least 0 (and 1/m in expectation if one is true)."""
        mine = self._claims_of(c, f)
        if len({cl["value"] for cl in mine}) > 1:
            return 0.0
        if f["doc_id"] is None:
            return float(bool(mine) and mine[0]["value"] is None)
        best = 0.0
        for cl in mine:
            if cl["value"] == f["value"]:
                cited = any(self._supports(c["docs"], h, f["entity"], f["aspect"], f["value"])
                            for h in cl["handles"])
                best = max(best, 1.0 if cited else 0.5)
        return best

    @staticmethod
    def _valued(c) -> list[dict]:
        return [cl for cl in c["claims"] if cl["value"] is not None]

    def _c_ans_supported(self, c) -> float:
        """Share of stated values backed by a cited snippet that is the true document giving that
        value (0 for an answer with no claim at all; 1 for one that only says what is unknown)."""
        claims = self._valued(c)
        if not claims:
            return 0.0 if not c["claims"] else 1.0
        ok = sum(any(self._supports(c["docs"], h, cl["entity"], cl["aspect"], cl["value"])
                     for h in cl["handles"]) for cl in claims)
        return ok / len(claims)

    def _c_ans_cited(self, c) -> float:
        """Share of stated values whose sentence cites a snippet handle."""
        claims = self._valued(c)
        return sum(bool(cl["handles"]) for cl in claims) / len(claims) if claims else 0.0

    def _c_ans_closed(self, c) -> float:
        """The answer tag is closed (the answer was not cut off) and the answer is one block
        without a tool call (`answer_defect`)."""
        return float(c["p"].closed["answer"] and not c["malformed_answer"])

    def _c_ans_nodistractor(self, c) -> float:
        """Share of stated values not copied from a retrieved old record or look-alike document."""
        claims = self._valued(c)
        if not claims:
            return 0.0
        bad = sum(any(d.kind != "true" and d.value == cl["value"] and d.aspect == cl["aspect"]
                      for d in c["docs"].values()) for cl in claims)
        return 1.0 - bad / len(claims)

    # static evaluation ----------------------------------------------------------------------------
    def evaluate(self, query, rollouts: Sequence[Rollout]) -> np.ndarray:
        """Static held-out score (deviation 3): (n, 4) stage scores over the whole pool + initial
        rubrics, independent of the evolving buffers. Never NaN for a stage this judge grades;
        NaN (not applicable) for the others (the unstructured scaffold's Plan, Research, Review)."""
        pool, init = self.pool(query), self.initial_rubrics(query)
        allr = pool + init
        S = self.score_rubrics(query, rollouts, allr)
        out = np.zeros((len(rollouts), len(STAGES)))
        for k in range(len(STAGES)):
            if k not in self.stages:
                out[:, k] = np.nan
                continue
            cols = [j for j, r in enumerate(allr) if r.stage == k]
            w = np.array([allr[j].weight for j in cols])
            out[:, k] = (np.nan_to_num(S[:, cols]) * w).sum(1) / w.sum()
        return out

    # reflections ----------------------------------------------------------------------------------
    def _failure_kind(self, check: tuple, c: dict, facts: dict) -> str:
        """The lesson kind (a key of _LESSONS) that fixes a failed rubric with this check."""
        kind = check[0]
        if kind in _KIND_OF_CHECK:
            return _KIND_OF_CHECK[kind]
        f = facts.get(check[1]) if len(check) > 1 else None
        if kind == "rev_map" and f is not None:
            return "honest" if self._searched(c, f["entity"], f["aspect"]) else "search"
        if kind == "ans_supported":
            return "cite" if self._c_ans_cited(c) < 1.0 else "distractor"
        if kind == "ans_fact" and f is not None:
            values = {cl["value"] for cl in self._claims_of(c, f)}
            if len(values) > 1:
                return "commit"
            if not values:
                return "search"
            v = values.pop()
            if f["doc_id"] is None or v is None:
                return "honest"
            return "cite" if v == f["value"] else "distractor"
        return "search"

    def _diagnosis(self, query, rollout: Rollout, judged: JudgeResult, row: int):
        """The privileged view of §3.4: the rubrics that scored this trajectory's stages
        (`judged.rubrics`, the buffers behind `judged.justifications`), re-scored on it, give the
        failed stages, the failed facts and the failure kinds. A stage the judge left missing (NaN)
        is diagnosed with the static rubric set instead. Returns (context, stages, fact keys, kinds)."""
        facts = {_key(f): f for f in query.facts}
        ctx = self._context(query, rollout)
        static = self.pool(query) + self.initial_rubrics(query)
        stages, keys, kinds = set(), set(), set()
        by_fact: dict[str, set] = {}
        for k in range(len(STAGES)):
            scored = k < len(judged.rubrics) and np.isfinite(judged.R[row, k])
            rubs = judged.rubrics[k] if scored else [r for r in static if r.stage == k]
            for r in rubs:
                if r.check is None or not self._check(r.check, ctx, facts) < 1.0:
                    continue  # met, or an LLM rubric the toy judge cannot re-score
                stages.add(k)
                kind = self._failure_kind(r.check, ctx, facts)
                if len(r.check) > 1 and r.check[1] in facts:
                    keys.add(r.check[1])
                    by_fact.setdefault(r.check[1], set()).add(kind)
                kinds.add(kind)
        ctx["fact_kinds"] = by_fact  # failed fact key -> the lesson kinds that fix it
        return ctx, stages, keys, kinds

    def score_reflections(self, query, rollout: Rollout, judged: JudgeResult, row: int,
                          candidates: Sequence[str]) -> list[ReflectionScore]:
        """Privileged scoring (§3.4) of m reflection candidates on one judged trajectory: judged is
        the JudgeResult of the trajectory's group, row its index there. The judge diagnoses the
        trajectory with its own checks (`_diagnosis`); the candidates' scores, within, cross and
        score = (within + cross) / 2 in [0,1] (invalid ones 0 and valid=False), are
        toy/lessons.py's `score_reflections`."""
        ctx, stages, failed, need = self._diagnosis(query, rollout, judged, row)
        return lessons.score_reflections(candidates, ctx, stages, failed, need, self.fixes,
                                         self.world.entities)
