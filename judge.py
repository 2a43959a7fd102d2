"""The evolving-rubric stage judge (§3.4, first half) and its toy implementation.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements §3.4: per query the judge keeps a rubric buffer per stage (caps Plan 3, Research 2, Review 2,
Answer 3). Each step, for that query's group of n rollouts, it
  (1) proposes discriminative rubrics (failure modes seen on-policy)      -> `propose`
  (2) merges them with the active buffer                                  -> `EvolvingJudge.judge_group`
  (3) scores every rollout's every stage against that stage's merged rubrics (buffer + proposals)
                                                                          -> R in [0,1]^(n x 4)
  (4) prunes rubrics that no longer discriminate, keeping the most discriminative up to the cap,
      for the next step (R of this step is already computed on the merged set).
It also scores reflection candidates on the paper's two criteria (within-episode refinement and
cross-episode transfer) as a *privileged* judge: it sees stage scores, justifications and buffers.

Equations
- Stage score: R_{i,k} = sum_r w_r s_{i,r} / sum_r w_r over the rubrics r active for stage k
  (s in [0,1] the rubric's score for rollout i), over the merged set M_k = buffer + proposals;
  `EvolvingJudge._score_step`.
- Discriminativeness of a rubric over the group: d_r = Std_i s_{i,r} (population std); a rubric with
  d_r = 0 "no longer separates the rollouts" and is pruned; `discriminativeness`.

Missing values: a judge failure for a (rollout, stage) cell is NaN in R, never 0; SS-GRPO gives that
cell advantage 0 (ss_grpo.py). A rubric whose score is NaN for a rollout is left out of that rollout's
weighted mean; a stage with no scored rubric is NaN.

The toy judge (`ToyJudge`) is a real, deterministic scorer built on the toy world's ground truth.
Its rubrics are checks with a machine-readable `check` spec, proposed from a per-query pool:
Plan (names each asked fact, a negative constraint, a search per fact), Research (retrieved each needed
document, queries that name the entity, no wasted calls, honest state evaluations), Review (each rubric
mapped to supporting evidence or honestly "missing"), Answer (the data row's initial rubrics: correct,
cited facts; no unsupported claims; plus proposed checks). It reads only parsed structure, exact values
and environment-issued citation handles, so instructions written inside a rollout or a tool output
cannot move it.

Deviations from the paper
1. Toy rubric proposal picks from a finite pool of checks derived from ground truth, ranked by d_r;
   the paper's Gemini judge writes free-text rubrics (full mode, judge_http.py).
2. When a stage's buffer is empty (nothing separates the group), the stage is scored with its whole
   candidate pool, which gives every rollout the same score and so zero advantage.
3. Held-out evaluation uses a *static* rubric set (the whole pool + initial rubrics) so scores are
   comparable across checkpoints; training uses the evolving buffers.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

import numpy as np

from scaffold import ANSWER, PLAN, RESEARCH, REVIEW, STAGES, Rollout

BUFFER_CAPS = (3, 2, 2, 3)  # PAPER: rubric buffer caps Plan 3, Research 2, Review 2, Answer 3 (§3.4)


@dataclass
class Rubric:
    """One rubric of a stage. `check` is the toy judge's machine-readable spec (None for LLM rubrics).
    `source`: "initial" (from the data row; never pruned) or "proposed" (evolving buffer)."""

    rid: str
    stage: int
    title: str
    description: str
    weight: float = 1.0
    source: str = "proposed"
    check: tuple | None = None
    discrim: float = 0.0
    born_step: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["check"] = list(self.check) if self.check is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Rubric":
        d = dict(d)
        d["check"] = tuple(d["check"]) if d.get("check") is not None else None
        return cls(**d)


@dataclass
class JudgeResult:
    """Judge output for one group. R: (n, 4) float64 in [0,1] or NaN (missing); justifications[i][k]
    a short string; rubrics[k] the rubrics that scored stage k; stats: counts for the metrics."""

    R: np.ndarray
    justifications: list[list[str]]
    rubrics: list[list[Rubric]]
    stats: dict = field(default_factory=dict)


@dataclass
class ReflectionScore:
    """Privileged judge score of one reflection candidate: within-episode and cross-episode usefulness
    in [0,1], their mean `score` (NaN if the judge failed), and a justification."""

    within: float
    cross: float
    score: float
    justification: str


class Judge(Protocol):
    """What the trainer needs from a judge (toy, Gemini or OpenAI-compatible)."""

    def judge_group(self, query, rollouts: Sequence[Rollout], step: int) -> JudgeResult: ...

    def score_reflections(self, query, rollout: Rollout, judged: JudgeResult, row: int,
                          candidates: Sequence[str]) -> list[ReflectionScore]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def discriminativeness(scores: np.ndarray) -> float:
    """d_r = population std of a rubric's scores over the group, NaNs ignored (0 if < 2 values)."""
    s = scores[~np.isnan(scores)]
    return float(s.std()) if s.size >= 2 else 0.0


# ----------------------------------------------------------------------------------------------------
# The evolving buffer mechanics, shared by every judge backend


class EvolvingJudge:
    """Buffer bookkeeping of §3.4 over two backend hooks:

    - `propose(query, rollouts, step) -> list[Rubric]`: candidate rubrics per stage;
    - `score_rubrics(query, rollouts, rubrics) -> np.ndarray (n, len(rubrics))` in [0,1] or NaN.
    Buffers are keyed by the query text and saved with `state_dict` (they are training state).
    """

    caps: tuple[int, ...] = BUFFER_CAPS

    def __init__(self, caps: Sequence[int] = BUFFER_CAPS):
        if len(caps) != len(STAGES) or any(int(c) < 0 for c in caps):
            raise ValueError(f"judge.caps must hold {len(STAGES)} non-negative ints (one per stage "
                             f"{STAGES}), got {list(caps)}")
        self.caps = tuple(int(c) for c in caps)
        self.buffers: dict[str, list[list[Rubric]]] = {}
        self.counters = {"proposed": 0, "pruned": 0, "failures": 0, "calls": 0}

    # hooks -------------------------------------------------------------------------------------
    def propose(self, query, rollouts, step) -> list[Rubric]:
        raise NotImplementedError

    def score_rubrics(self, query, rollouts, rubrics) -> np.ndarray:
        raise NotImplementedError

    def initial_rubrics(self, query) -> list[Rubric]:
        """The data row's rubrics, attached to the Answer stage (DR Tulu rubrics grade the answer)."""
        out = []
        for j, r in enumerate(query.rubrics):
            out.append(Rubric(f"init:{j}", ANSWER, str(r.get("title", f"rubric {j}")),
                              str(r["description"]), float(r.get("weight", 1.0)), "initial"))
        return out

    # mechanics ---------------------------------------------------------------------------------
    def judge_group(self, query, rollouts: Sequence[Rollout], step: int) -> JudgeResult:
        """Propose -> merge -> score -> prune for one query's group of n rollouts (§3.4).

        The stage scores R (n, 4) are computed on the *merged* set, the active buffer plus this
        step's proposals, as in the paper; pruning runs afterwards and only decides which rubrics the
        buffer carries into the query's next step. Never raises on model output; a backend failure
        leaves NaN cells (missing), counted in `counters["failures"]`.
        """
        n = len(rollouts)
        buf = self.buffers.setdefault(query.query, [[] for _ in STAGES])
        init = self.initial_rubrics(query)
        # 1. propose: new discriminative rubrics (failure modes seen on-policy), at most cap per stage
        pool, fresh, S, col = self._propose_step(query, rollouts, step, buf, init)
        # 2. merge: M_k = B_k (active buffer) + P_k (proposals)
        merged = [list(buf[k]) + fresh[k] for k in range(len(STAGES))]
        # 3. score every rollout's every stage against the merged rubrics of that stage
        R, just, active = self._score_step(S, col, merged, pool, init)
        # 4. prune: B_k <- the most discriminative of M_k up to the cap (for the next step)
        stats = {"proposed": sum(len(f) for f in fresh), "pruned": self._prune_step(buf, merged, step)}
        self.counters["proposed"] += stats["proposed"]
        self.counters["pruned"] += stats["pruned"]
        stats["missing"] = int(np.isnan(R).sum())
        stats["buffer_sizes"] = [len(b) for b in buf]
        return JudgeResult(R, just, active, stats)

    def _propose_step(self, query, rollouts, step, buf, init):
        """Step 1: (pool, fresh, S, col). pool[k]: the buffer plus every backend proposal for stage k
        not already in it; S (n, |pool| + |init|): one scoring call over all of them (it ranks the
        proposals, scores the merged set and backs an empty one); col: id(rubric) -> column of S;
        fresh[k]: the proposals with d_r > 0, most discriminative first, at most caps[k]."""
        try:
            proposals = self.propose(query, rollouts, step)
        except Exception:
            proposals, self.counters["failures"] = [], self.counters["failures"] + 1
        pool, cands = [], []
        for k in range(len(STAGES)):
            have = {r.rid for r in buf[k]}
            cands.append([r for r in proposals if r.stage == k and r.rid not in have])
            pool.append(list(buf[k]) + cands[k])
        allr = [r for k in range(len(STAGES)) for r in pool[k]] + init
        S = self._safe_scores(query, rollouts, allr)  # (n, |allr|)
        col = {id(r): j for j, r in enumerate(allr)}
        for r in allr:
            # Eq.: d_r = Std_i s_{i,r}  (population std over the group)
            r.discrim = discriminativeness(S[:, col[id(r)]])
        fresh = [sorted((r for r in cands[k] if r.discrim > 0), key=lambda r: (-r.discrim, r.rid))
                 [: self.caps[k]] for k in range(len(STAGES))]
        return pool, fresh, S, col

    def _score_step(self, S, col, merged, pool, init):
        """Step 3: (R (n, 4), justifications, the rubrics that scored each stage). Stage k is scored
        on merged[k]; Answer on the data row's rubrics + merged[ANSWER]; an empty merged set on the
        stage's whole pool (deviation 2: the same score for everyone, zero advantage)."""
        n = S.shape[0]
        active = []
        for k in range(len(STAGES)):
            scoring = list(merged[k]) if merged[k] else list(pool[k])
            if k == ANSWER:
                scoring = init + list(merged[k])
            active.append(scoring)
        R = np.full((n, len(STAGES)), np.nan)
        just = [["" for _ in STAGES] for _ in range(n)]
        for k in range(len(STAGES)):
            cols = [col[id(r)] for r in active[k]]
            w = np.array([r.weight for r in active[k]], dtype=np.float64)
            for i in range(n):
                s = S[i, cols] if cols else np.array([])
                ok = ~np.isnan(s)  # a missing rubric score is left out of the weighted mean
                if ok.any() and w[ok].sum() > 0:
                    # Eq.: R_{i,k} = sum_r w_r s_{i,r} / sum_r w_r   (r over the merged rubrics of k)
                    R[i, k] = float(np.clip((w[ok] * s[ok]).sum() / w[ok].sum(), 0.0, 1.0))
                just[i][k] = _justify(active[k], s)
        return R, just, active

    def _prune_step(self, buf, merged, step) -> int:
        """Step 4, in place on `buf`: keep the most discriminative rubrics of each merged set up to the
        cap (d_r = 0 no longer separates the group); returns how many were dropped."""
        pruned = 0
        for k in range(len(STAGES)):
            old = {r.rid for r in buf[k]}
            # Eq.: B_k <- top_{caps[k]} of {r in M_k : d_r > 0} by d_r (ties by rubric id)
            keep = sorted((r for r in merged[k] if r.discrim > 0),
                          key=lambda r: (-r.discrim, r.rid))[: self.caps[k]]
            pruned += len(merged[k]) - len(keep)
            for r in keep:
                if r.rid not in old:
                    r.born_step = step
            buf[k] = keep
        return pruned

    def _safe_scores(self, query, rollouts, rubrics) -> np.ndarray:
        n = len(rollouts)
        self.counters["calls"] += 1
        try:
            S = np.asarray(self.score_rubrics(query, rollouts, rubrics), dtype=np.float64)
            if S.shape != (n, len(rubrics)):
                raise ValueError(f"judge returned shape {S.shape}, expected {(n, len(rubrics))}")
            S[(S < 0) | (S > 1) | ~np.isfinite(S)] = np.nan  # out of range is missing, not clipped
            return S
        except Exception:
            self.counters["failures"] += 1
            return np.full((n, len(rubrics)), np.nan)

    def state_dict(self) -> dict:
        return {"caps": list(self.caps), "counters": dict(self.counters),
                "buffers": {q: [[r.to_dict() for r in b] for b in bufs]
                            for q, bufs in sorted(self.buffers.items())}}

    def load_state_dict(self, state: dict) -> None:
        self.caps = tuple(state["caps"])
        self.counters = dict(state["counters"])
        self.buffers = {q: [[Rubric.from_dict(r) for r in b] for b in bufs]
                        for q, bufs in state["buffers"].items()}


def _justify(rubrics: Sequence[Rubric], s: np.ndarray) -> str:
    if len(s) == 0:
        return "no rubric could be scored"
    met = [r.title for r, v in zip(rubrics, s) if not math.isnan(v) and v >= 0.999]
    part = [f"{r.title} ({v:.1f})" for r, v in zip(rubrics, s) if not math.isnan(v) and 0 < v < 0.999]
    fail = [r.title for r, v in zip(rubrics, s) if not math.isnan(v) and v <= 0]
    out = []
    if met:
        out.append("met: " + "; ".join(met))
    if part:
        out.append("partly: " + "; ".join(part))
    if fail:
        out.append("failed: " + "; ".join(fail))
    return " | ".join(out) or "all rubric scores missing"


# ----------------------------------------------------------------------------------------------------
# Toy judge: deterministic checks against the toy world's ground truth

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+")
_CITE = re.compile(r"\[(\d{1,3})\]")


def _claim_patterns():
    from world import ANSWER_TEMPLATES

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


class ToyJudge(EvolvingJudge):
    """Deterministic stage judge for the toy world (reads ground truth from `world`)."""

    def __init__(self, world, caps: Sequence[int] = BUFFER_CAPS):
        super().__init__(caps)
        self.world = world

    # pool of candidate rubrics ------------------------------------------------------------------
    def pool(self, query) -> list[Rubric]:
        facts = query.facts
        P = []
        for f in facts:
            key = f"{f['entity']} {f['aspect']}"
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
                            f"The rubrics review maps {key} to supporting evidence, or honestly to "
                            "'missing'.", check=("rev_map", key)))
        P += [
            Rubric("plan:avoid", PLAN, "negative constraint", "The plan lists what to avoid.",
                   check=("plan_avoid",)),
            Rubric("plan:form", PLAN, "complete plan", "Analysis, rubrics and research plan, closed.",
                   check=("plan_form",)),
            Rubric("res:named", RESEARCH, "queries name the entity",
                   "Every search query names an entity of the question.", check=("res_named",)),
            Rubric("res:efficient", RESEARCH, "no wasted calls",
                   "No repeated queries and at most one call more than the facts asked.",
                   check=("res_efficient",)),
            Rubric("res:honest", RESEARCH, "honest state evaluations",
                   "Each state evaluation reports what the cited snippet says, or 'not found'.",
                   check=("res_honest",)),
            Rubric("rev:plan", REVIEW, "writing plan covers findings",
                   "The writing plan lists every fact the review found.", check=("rev_plan",)),
            Rubric("ans:cited", ANSWER, "every claim cited", "Every factual sentence cites a snippet.",
                   check=("ans_cited",)),
            Rubric("ans:closed", ANSWER, "closed answer", "The answer is complete and closed.",
                   check=("ans_closed",)),
            Rubric("ans:nodistractor", ANSWER, "no distractor values",
                   "No value copied from an old record or a look-alike entity.",
                   check=("ans_nodistractor",)),
        ]
        return P

    def propose(self, query, rollouts, step) -> list[Rubric]:
        return self.pool(query)

    def initial_rubrics(self, query) -> list[Rubric]:
        out = super().initial_rubrics(query)
        facts = {f"{f['entity']} {f['aspect']}": f for f in query.facts}
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
        facts = {f"{f['entity']} {f['aspect']}": f for f in query.facts}
        S = np.full((len(rollouts), len(rubrics)), np.nan)
        for i, ro in enumerate(rollouts):
            ctx = self._context(query, ro)
            for j, r in enumerate(rubrics):
                if r.check is not None:
                    S[i, j] = self._check(r.check, ctx, facts)
        return S

    # evidence and checks --------------------------------------------------------------------------
    def _context(self, query, ro: Rollout) -> dict:
        p = ro.parsed
        docs = {h: self.world.doc(res.doc_id) for h, res in ro.evidence.items()}
        return {"p": p, "docs": docs, "ro": ro, "entities": set((query.toy or {}).get("entities", [])),
                "claims": answer_claims(p.fields["answer"]) if p else []}

    def _supports(self, docs: dict, h: int, entity: str, aspect: str, value: str | None) -> bool:
        d = docs.get(h)
        return (d is not None and d.kind == "true" and d.entity == entity and d.aspect == aspect
                and (value is None or d.value == value))

    def _check(self, check: tuple, c: dict, facts: dict) -> float:
        p, docs, ro = c["p"], c["docs"], c["ro"]
        kind = check[0]
        f = facts.get(check[1]) if len(check) > 1 else None
        if kind == "plan_need":
            return float(check[1] in p.fields["rubrics"])
        if kind == "plan_search":
            return float(f"search {check[1]}" in p.fields["research_plan"])
        if kind == "plan_avoid":
            return float("avoid:" in p.fields["rubrics"])
        if kind == "plan_form":
            return float(all(p.fields[k] for k in ("analysis", "rubrics", "research_plan"))
                         and p.closed["structured_plan"])
        if kind == "res_got":
            if f is None:
                return 0.0
            if f["doc_id"] is None:
                return float(any(f["entity"] in cl.query and f["aspect"] in cl.query
                                 for cl in ro.tool_calls if not cl.error))
            return float(any(r.doc_id == f["doc_id"] for cl in ro.tool_calls for r in cl.results))
        if kind == "res_named":
            calls = [cl for cl in ro.tool_calls if not cl.refused]
            if not calls:
                return 0.0
            return sum(any(e in cl.query.split() for e in c["entities"]) for cl in calls) / len(calls)
        if kind == "res_efficient":
            calls = [cl.query.strip().lower() for cl in ro.tool_calls if not cl.refused]
            if not calls:
                return 0.0
            waste = (len(calls) - len(set(calls))) + max(0, len(calls) - (len(facts) + 1))
            return max(0.0, 1.0 - 0.25 * waste)
        if kind == "res_honest":
            evals = [e for e in p.state_evaluations if e]
            if not evals:
                return 0.0
            good = 0
            for e in evals:
                m = _EVAL_RE.match(e.strip())
                if not m:
                    continue
                ent, asp, val, h = m.group(1), m.group(2), m.group(3).strip(), m.group(4)
                if h is not None:
                    good += self._supports(docs, int(h), ent, asp, val)
                elif val == "not found":  # honest if no retrieved document gives it
                    good += not any(d.kind == "true" and d.entity == ent and d.aspect == asp
                                    for d in docs.values())
            return good / len(evals)
        if kind == "rev_map":
            if f is None:
                return 0.0
            got = any(d.kind == "true" and d.entity == f["entity"] and d.aspect == f["aspect"]
                      for d in docs.values())
            for m in _REVIEW_RE.finditer(p.fields["rubrics_review"]):
                if f"{m.group(1)} {m.group(2)}" != check[1]:
                    continue
                if m.group(4):
                    return float(not got)
                return float(self._supports(docs, int(m.group(3)), f["entity"], f["aspect"], None))
            return 0.0
        if kind == "rev_plan":
            found = [f"{m.group(1)} {m.group(2)}" for m in _REVIEW_RE.finditer(p.fields["rubrics_review"])
                     if m.group(3)]
            if not p.fields["writing_plan"]:
                return 0.0
            return float(all(k in p.fields["writing_plan"] for k in found))
        claims = [cl for cl in c["claims"] if cl["value"] is not None]
        if kind == "ans_fact":
            if f is None:
                return 0.0
            mine = [cl for cl in c["claims"] if cl["entity"] == f["entity"] and cl["aspect"] == f["aspect"]]
            if f["doc_id"] is None:
                return float(bool(mine) and all(cl["value"] is None for cl in mine))
            best = 0.0
            for cl in mine:
                if cl["value"] == f["value"]:
                    cited = any(self._supports(docs, h, f["entity"], f["aspect"], f["value"])
                                for h in cl["handles"])
                    best = max(best, 1.0 if cited else 0.5)
            return best
        if kind == "ans_supported":
            if not claims:
                return 0.0 if not c["claims"] else 1.0
            ok = sum(any(self._supports(docs, h, cl["entity"], cl["aspect"], cl["value"])
                         for h in cl["handles"]) for cl in claims)
            return ok / len(claims)
        if kind == "ans_cited":
            return sum(bool(cl["handles"]) for cl in claims) / len(claims) if claims else 0.0
        if kind == "ans_closed":
            return float(p.closed["answer"])
        if kind == "ans_nodistractor":
            if not claims:
                return 0.0
            bad = sum(any(d.kind != "true" and d.value == cl["value"] and d.aspect == cl["aspect"]
                          for d in docs.values()) for cl in claims)
            return 1.0 - bad / len(claims)
        return float("nan")

    # static evaluation ----------------------------------------------------------------------------
    def evaluate(self, query, rollouts: Sequence[Rollout]) -> np.ndarray:
        """Static held-out score (deviation 3): (n, 4) stage scores over the whole pool + initial
        rubrics, independent of the evolving buffers. Never NaN for the toy judge."""
        pool, init = self.pool(query), self.initial_rubrics(query)
        allr = pool + init
        S = self.score_rubrics(query, rollouts, allr)
        out = np.zeros((len(rollouts), len(STAGES)))
        for k in range(len(STAGES)):
            cols = [j for j, r in enumerate(allr) if r.stage == k]
            w = np.array([allr[j].weight for j in cols])
            out[:, k] = (np.nan_to_num(S[:, cols]) * w).sum(1) / w.sum()
        return out

    # reflections ----------------------------------------------------------------------------------
    def score_reflections(self, query, rollout: Rollout, judged: JudgeResult, row: int,
                          candidates: Sequence[str]) -> list[ReflectionScore]:
        """Privileged scoring (§3.4): the judge knows which rubrics this trajectory failed.

        within: share of the trajectory's missed facts (failed "retrieved"/fact rubrics) named in the
                reflection as "Entity aspect", minus a penalty for naming facts that were not missed;
        cross:  share of the failure *kinds* present (missed facts, uncited claims, distractor values,
                no negative constraint) for which the reflection states a general lesson, with no
                lesson for a kind that did not occur counting against it.
        """
        facts = {f"{f['entity']} {f['aspect']}": f for f in query.facts}
        ctx = self._context(query, rollout)
        missed = {k for k in facts if self._check(("ans_fact", k), ctx, facts) < 1.0
                  and self._check(("res_got", k), ctx, facts) < 1.0}
        kinds = {
            "search": bool(missed),
            "cite": self._check(("ans_cited",), ctx, facts) < 1.0,
            "distractor": self._check(("ans_nodistractor",), ctx, facts) < 1.0,
            "avoid": self._check(("plan_avoid",), ctx, facts) < 1.0,
        }
        lesson_words = {"search": ("search every", "each asked", "every asked"), "cite": ("cite",),
                        "distractor": ("old record", "look-alike"), "avoid": ("what to avoid",)}
        out = []
        for text in candidates:
            t = text or ""
            named = {k for k in facts if k in t}
            if missed:
                within = len(named & missed) / len(missed) - 0.5 * len(named - missed) / len(facts)
            else:
                within = 1.0 - len(named) / len(facts)
            present = {k for k, ws in lesson_words.items() if any(w in t.lower() for w in ws)}
            need = {k for k, v in kinds.items() if v}
            if need:
                cross = len(present & need) / len(need) - 0.25 * len(present - need)
            else:
                cross = 1.0 if ("one search" in t.lower() or not present) else 0.5
            within, cross = float(np.clip(within, 0, 1)), float(np.clip(cross, 0, 1))
            if not t.strip() or len(t) > 600:
                within = cross = 0.0
            out.append(ReflectionScore(within, cross, 0.5 * (within + cross),
                                       f"missed={sorted(missed)} named={sorted(named)} "
                                       f"lessons={sorted(present)} needed={sorted(need)}"))
        return out
