"""The evolving-rubric stage judge (§3.4, first half): propose -> merge -> score -> prune.

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

The toy world's judge (toy/judge.py, `ToyJudge`) and the HTTP judge (backends/api/judge_http.py,
Gemini or an OpenAI-compatible server) implement `propose`, `score_rubrics` and `score_reflections`.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

import numpy as np

from scaffold import ANSWER, STAGES, Rollout

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
    in [0,1], their mean `score` (NaN if the judge failed), and a justification. `valid` is False for
    a candidate that is no lesson at all (degenerate, cut off, about another entity): it scores 0 and
    must never be admitted to the bank, however the rest of its group scores."""

    within: float
    cross: float
    score: float
    justification: str
    valid: bool = True


class Judge(Protocol):
    """What the trainer needs from a judge (toy, Gemini or OpenAI-compatible)."""

    def judge_group(self, query, rollouts: Sequence[Rollout], step: int) -> JudgeResult: ...

    def score_reflections(self, query, rollout: Rollout, judged: JudgeResult, row: int,
                          candidates: Sequence[str]) -> list[ReflectionScore]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    counters: dict  # cumulative calls, failures, proposed, pruned (train.py logs per-step differences)
    concurrent_groups: bool  # judge_all may judge different queries' groups in threads

    def evaluate(self, query, rollouts: Sequence[Rollout]) -> np.ndarray | None: ...  # static rubrics

    def stats(self) -> dict | None: ...  # HTTP figures (requests, tokens, cost), None otherwise

    def close(self) -> None: ...


def discriminativeness(scores: np.ndarray) -> float:
    """d_r = population std of a rubric's scores over the group, NaNs ignored (0 if < 2 values)."""
    s = scores[~np.isnan(scores)]
    return float(s.std()) if s.size >= 2 else 0.0


def judge_all(judge, queries: Sequence, groups: Sequence[Sequence[Rollout]], step: int) -> list:
    """Algorithm 1 step 4: `judge.judge_group` for every (query, group) of a step; the results in
    query order. A judge with `concurrent_groups` (the HTTP judge) judges the groups of different
    queries in threads, so a step's judge phase waits about one proposal and one scoring round trip
    instead of one per group (the judge bounds its requests in flight by judge_http.concurrency); groups
    of the same query (a batch that wraps around an epoch) still go in order, since they share a
    rubric buffer. Other judges go group by group."""
    if not judge.concurrent_groups or len(queries) < 2:
        return [judge.judge_group(q, g, step) for q, g in zip(queries, groups)]
    out: list = [None] * len(queries)
    waves: list[list[int]] = []  # wave w: the w-th occurrence of each query text
    seen: dict[str, int] = {}
    for i, q in enumerate(queries):
        w = seen.get(q.query, 0)
        seen[q.query] = w + 1
        if w == len(waves):
            waves.append([])
        waves[w].append(i)
    with ThreadPoolExecutor(max_workers=max(len(w) for w in waves)) as ex:
        for wave in waves:
            for i, res in zip(wave, ex.map(lambda i: judge.judge_group(queries[i], groups[i], step),
                                           wave)):
                out[i] = res
    return out


# ----------------------------------------------------------------------------------------------------
# The evolving buffer mechanics, shared by every judge backend


class EvolvingJudge:
    """Buffer bookkeeping of §3.4 over two backend hooks:

    - `propose(query, rollouts, step) -> list[Rubric]`: candidate rubrics per stage;
    - `score_rubrics(query, rollouts, rubrics) -> np.ndarray (n, len(rubrics))` in [0,1] or NaN.
    Buffers are keyed by the query text and saved with `state_dict` (they are training state).
    """

    caps: tuple[int, ...] = BUFFER_CAPS
    stages: tuple[int, ...] = tuple(range(len(STAGES)))  # the stages this judge grades; the others'
    # cells of R are NaN, not applicable (the toy judge on the unstructured scaffold: Answer only)
    concurrent_groups: bool = False  # judge_all may judge different queries' groups in threads
    # (a backend whose calls wait on the network sets it; the toy judge computes, so it stays False)

    def __init__(self, caps: Sequence[int] = BUFFER_CAPS):
        if len(caps) != len(STAGES) or any(int(c) < 0 for c in caps):
            raise ValueError(f"judge.caps must hold {len(STAGES)} non-negative ints (one per stage "
                             f"{STAGES}), got {list(caps)}")
        self.caps = tuple(int(c) for c in caps)
        self.buffers: dict[str, list[list[Rubric]]] = {}
        self.counters = {"proposed": 0, "pruned": 0, "failures": 0, "calls": 0}
        self._count_lock = threading.Lock()  # counters are shared by concurrently judged groups

    def count(self, key: str, k: int = 1) -> None:
        """counters[key] += k, safe when groups are judged in threads (judge_all)."""
        with self._count_lock:
            self.counters[key] = self.counters.get(key, 0) + k

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
        self.count("proposed", stats["proposed"])
        self.count("pruned", stats["pruned"])
        # missing = judge failures in the stages this judge grades (not the not-applicable ones)
        stats["missing"] = int(np.isnan(R[:, list(self.stages)]).sum())
        stats["buffer_sizes"] = [len(b) for b in buf]
        return JudgeResult(R, just, active, stats)

    def _propose_step(self, query, rollouts, step, buf, init):
        """Step 1: (pool, fresh, S, col). pool[k]: the buffer plus every backend proposal for stage k
        not already in it; S (n, |pool| + |init|): one scoring call over all of them (it ranks the
        proposals, scores the merged set and backs an empty one); col: id(rubric) -> column of S;
        fresh[k]: the proposals with d_r > 0, most discriminative first, at most caps[k]."""
        try:
            proposals = self.propose(query, rollouts, step)
        except Exception as e:
            if getattr(e, "stops_run", False):  # 401/403/404 (backends/api/http.py): stop, not a failure
                raise
            proposals = []
            self.count("failures")
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
        self.count("calls")
        try:
            S = np.asarray(self.score_rubrics(query, rollouts, rubrics), dtype=np.float64)
            if S.shape != (n, len(rubrics)):
                raise ValueError(f"judge returned shape {S.shape}, expected {(n, len(rubrics))}")
            S[(S < 0) | (S > 1) | ~np.isfinite(S)] = np.nan  # out of range is missing, not clipped
            return S
        except Exception as e:
            if getattr(e, "stops_run", False):  # 401/403/404 (backends/api/http.py): stop, not a failure
                raise
            self.count("failures")
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

    # Defaults of the rest of the Judge interface (a backend overrides what it has)
    def evaluate(self, query, rollouts: Sequence[Rollout]) -> np.ndarray | None:
        """(n, 4) stage scores under a *static* rubric set, comparable across steps (the held-out
        evaluation's); None: this judge has none (the HTTP judge)."""
        return None

    def stats(self) -> dict | None:
        """Cumulative HTTP figures of a judge that makes requests (backends/api/judge_http.py); None."""
        return None

    def close(self) -> None:
        """Release what the judge holds (HTTP sessions, worker threads); nothing here."""


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
