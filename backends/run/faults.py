"""Fault injection for the toy judge and the search tool: the failures a remote judge and a web search
API produce, simulated deterministically, so that the trainer's handling of them can be tested and
measured offline.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Supports §3.4 (the judge is an external LLM behind an API: "judge and rubric generator Gemini Flash",
appendix) and §3.1 (the tool environment T). The paper does not discuss failures; its Limitations name
API latency and restarts. Nothing here changes the method: a fault-free run never builds these classes.

What each piece does
    FaultConfig          rates and kinds of injected faults, and the seed of their schedule
    fault_draw           the schedule: (seed, channel, index) -> uniform u in [0, 1) and a kind;
                         a pure function, so a run is reproducible and a resumed run continues it
    FaultyJudge          wraps an EvolvingJudge backend (the toy judge) like a client of a remote
                         judge: every logical call (`propose`, one stage cell of `score_rubrics`,
                         `score_reflections`) may fail the way an HTTP judge fails; the client
                         validates each reply and retries up to `max_retries` times, then gives up:
                         the call's cells are missing (NaN in R), which SS-GRPO turns into advantage 0
                         for that (rollout, stage) cell only (ss_grpo.py, deviation 1)
    FaultyTool           wraps a search tool; a call raises (an HTTP error) or hangs

Judge fault kinds (what a real HTTP judge does, backends/api/judge_http.py)
    "timeout"       the request times out                   -> raises JudgeTimeout
    "429"           rate limited                             -> raises JudgeHTTPError(429)
    "5xx"           server error (500/502/503/504)           -> raises JudgeHTTPError(5xx)
    "malformed"     a reply that is not the expected JSON     -> returns a string of broken JSON
    "wrong_count"   a reply with one entry too few (scores,   -> returns a short array / list, or
                    reflections) or too many (proposals)         a proposal list with a repeat
    "out_of_range"  scores outside [0, 1]                     -> returns values shifted by +2
Tool fault kinds: "error" (the search API answers HTTP 503: raises ToolBackendError) and "hang" (the
call blocks for `hang_s` seconds, far beyond the rollout engine's per-call timeout).

Counting (all cumulative, in `counters`, saved by `state_dict` so a resumed run continues them):
a *call* is one logical question; an *attempt* is one request (a call makes 1 + retries attempts);
`failures` counts calls given up after the bound; `fault/<kind>` counts injected faults.

Deviations from the paper (none of this is in the paper)
1. Retries of the simulated client do not sleep (no backoff): the faults are simulated, so waiting
   would only slow tests down; the HTTP judge (backends/api/judge_http.py) does back off.
2. Under FaultyJudge the toy judge scores one (rollout, stage) cell per call, so one failure removes
   exactly one cell of R; the unwrapped toy judge scores a whole group in one call (same values).
3. A reply whose scores fall outside [0, 1] is invalid and re-asked; after the bound its cells are
   missing (NaN), never clipped (judge.py makes out-of-range cells missing for the same reason).
"""
from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from judge import EvolvingJudge, ReflectionScore, Rubric
from scaffold import STAGES

JUDGE_KINDS = ("timeout", "429", "5xx", "malformed", "wrong_count", "out_of_range")
TOOL_KINDS = ("error", "hang")
_5XX = (500, 502, 503, 504)


@dataclass
class FaultConfig:
    """Injected faults (all rates 0 = off, the default: a normal run injects nothing)."""

    judge_rate: float = 0.0
    """Probability in [0, 1] that one judge request (attempt) fails; a retry is a new request."""
    judge_kinds: tuple = JUDGE_KINDS
    """Kinds drawn uniformly when a judge request fails (a subset of JUDGE_KINDS)."""
    tool_rate: float = 0.0
    """Probability in [0, 1] that one search-tool call fails."""
    tool_kinds: tuple = TOOL_KINDS
    """Kinds drawn uniformly when a tool call fails (a subset of TOOL_KINDS)."""
    seed: int = 0
    """Seed of the fault schedule (independent of the training seed, so the same faults can be
    replayed under another training seed)."""
    hang_s: float = 3600.0
    """How long a hung tool call blocks (seconds; the engine's tool timeout cuts it short)."""

    @property
    def active(self) -> bool:
        return self.judge_rate > 0 or self.tool_rate > 0


def validate_fault_config(cfg: FaultConfig, prefix: str = "faults") -> None:
    """Raise ValueError naming the field (e.g. "faults.judge_rate") if a setting cannot work."""
    for name, kinds, known in (("judge", cfg.judge_kinds, JUDGE_KINDS), ("tool", cfg.tool_kinds, TOOL_KINDS)):
        rate = getattr(cfg, f"{name}_rate")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"{prefix}.{name}_rate must be a number in [0, 1], got {rate!r}")
        if isinstance(kinds, str) or not isinstance(kinds, (list, tuple)):
            raise ValueError(f"{prefix}.{name}_kinds must be a list of kinds from {known}, got {kinds!r}")
        bad = [k for k in kinds if k not in known]
        if bad:
            raise ValueError(f"{prefix}.{name}_kinds: unknown kind(s) {bad}; known: {known}")
        if rate > 0 and not kinds:
            raise ValueError(f"{prefix}.{name}_kinds is empty but {prefix}.{name}_rate = {rate} > 0")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ValueError(f"{prefix}.seed must be an int, got {cfg.seed!r}")
    if not isinstance(cfg.hang_s, (int, float)) or not cfg.hang_s > 0:
        raise ValueError(f"{prefix}.hang_s must be > 0 seconds, got {cfg.hang_s!r}")


def fault_draw(seed: int, channel: str, index: int, rate: float, kinds: Sequence[str]) -> str | None:
    """The fault schedule: the kind of fault injected into request `index` of `channel`, or None.

    A pure function of (seed, channel, index): sha256 gives two independent uniforms, u for "does it
    fail" (u < rate) and v for the kind (uniform over `kinds`). rate in [0, 1]; index >= 0.
    """
    if rate <= 0 or not kinds:
        return None
    h = hashlib.sha256(f"{seed}:{channel}:{index}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2.0 ** 64
    v = int.from_bytes(h[8:16], "big") / 2.0 ** 64
    if u >= rate:
        return None
    return kinds[min(int(v * len(kinds)), len(kinds) - 1)]


# ----------------------------------------------------------------------------------------------------
# Judge


class JudgeTimeout(TimeoutError):
    """A judge request timed out (simulated)."""


class JudgeHTTPError(RuntimeError):
    """A judge request answered with an HTTP error status (simulated)."""

    def __init__(self, status: int):
        super().__init__(f"HTTP {status} from the judge API (simulated)")
        self.status = status


class InvalidReply(ValueError):
    """A reply that arrived but does not validate (malformed, wrong count, out of range)."""


def _corrupt(kind: str, reply: Any) -> Any:
    """A valid reply turned into what a misbehaving judge returns for fault `kind`."""
    if kind == "malformed":
        return '{"scores": [{"rubric_id": '  # truncated JSON text, not the expected structure
    if kind == "wrong_count":
        if isinstance(reply, np.ndarray):
            return reply[:, :-1] if reply.shape[1] > 1 else reply[:-1]
        if reply and isinstance(reply[0], Rubric):
            return list(reply) + [reply[0]]  # proposals: one entry more than distinct rubrics
        return list(reply)[:-1] if reply else [None]
    if kind == "out_of_range":
        if isinstance(reply, np.ndarray):
            return np.nan_to_num(reply, nan=0.5) + 2.0
        if reply and isinstance(reply[0], ReflectionScore):
            return [ReflectionScore(r.within + 2.0, r.cross - 2.0, r.score + 2.0, r.justification)
                    for r in reply]
        return [Rubric(r.rid, len(STAGES) + 2, r.title, r.description, r.weight, r.source, r.check)
                for r in reply]  # a stage index that does not exist
    raise ValueError(f"not a reply fault: {kind!r}")


def _check_scores(S: Any, shape: tuple[int, int]) -> np.ndarray:
    try:
        S = np.asarray(S, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidReply("scores are not numbers") from None
    if S.shape != shape:
        raise InvalidReply(f"scores of shape {S.shape}, expected {shape}")
    fin = S[~np.isnan(S)]
    if np.isinf(fin).any() or (fin < 0).any() or (fin > 1).any():
        raise InvalidReply("scores outside [0, 1]")
    return S


def _check_proposals(P: Any) -> list[Rubric]:
    if not isinstance(P, list) or not all(isinstance(r, Rubric) for r in P):
        raise InvalidReply("proposals are not a list of rubrics")
    if any(not 0 <= r.stage < len(STAGES) for r in P):
        raise InvalidReply("a proposed rubric names a stage that does not exist")
    if len({r.rid for r in P}) != len(P):
        raise InvalidReply("more proposals than distinct rubrics")
    return P


def _check_reflections(out: Any, m: int) -> list[ReflectionScore]:
    if not isinstance(out, list) or not all(isinstance(r, ReflectionScore) for r in out):
        raise InvalidReply("reflection scores are not a list of scores")
    if len(out) != m:
        raise InvalidReply(f"{len(out)} reflection scores for {m} candidates")
    for r in out:
        for v in (r.within, r.cross, r.score):
            if not math.isnan(v) and not 0.0 <= v <= 1.0:
                raise InvalidReply("reflection score outside [0, 1]")
    return out


class FaultyJudge(EvolvingJudge):
    """An EvolvingJudge whose backend calls go through a simulated unreliable remote judge.

    inner: the backend (a ToyJudge; its hooks `propose`, `score_rubrics`, `score_reflections`,
    `initial_rubrics` are used, and every other attribute, e.g. `evaluate`, is delegated to it
    unfaulted: held-out evaluation is a measurement, not training). cfg: FaultConfig (judge_rate,
    judge_kinds, seed). max_retries: int >= 0, re-asks per call after a failed attempt.
    The buffer mechanics (merge, prune, weighted stage scores) are the base class's, unchanged.
    """

    def __init__(self, inner: EvolvingJudge, cfg: FaultConfig, max_retries: int = 3):
        super().__init__(inner.caps)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"judge.max_retries must be an int >= 0, got {max_retries!r}")
        self.inner, self.cfg, self.max_retries = inner, cfg, max_retries
        self.buffers = inner.buffers  # one set of buffers: backends that read them see ours
        self.counters.update({"retries": 0, "attempts": 0, "injected": 0,
                              **{f"fault/{k}": 0 for k in JUDGE_KINDS}})

    def __getattr__(self, name: str):
        # Only reached for attributes FaultyJudge lacks (evaluate, pool, world, _check, ...).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # the simulated client --------------------------------------------------------------------
    def evaluate(self, query, rollouts):
        return self.inner.evaluate(query, rollouts)  # evaluation scores without faults

    def stats(self):
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def _call(self, request: Callable[[], Any], validate: Callable[[Any], Any]) -> Any | None:
        """One logical call: up to 1 + max_retries attempts; the validated reply, or None (failed)."""
        self.counters["calls"] += 1
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.counters["retries"] += 1  # SCALE: a real client backs off here (deviation 1)
            idx = self.counters["attempts"]
            self.counters["attempts"] += 1
            kind = self._draw(idx)
            if kind is not None:
                self.counters["injected"] += 1
                self.counters[f"fault/{kind}"] += 1
            try:
                if kind == "timeout":
                    raise JudgeTimeout("judge request timed out (simulated)")
                if kind in ("429", "5xx"):
                    raise JudgeHTTPError(429 if kind == "429" else _5XX[idx % len(_5XX)])
                reply = request()
                return validate(_corrupt(kind, reply) if kind is not None else reply)
            except (JudgeTimeout, JudgeHTTPError, InvalidReply):
                continue
        self.counters["failures"] += 1
        return None

    def _draw(self, attempt: int) -> str | None:
        """The fault injected into request number `attempt` (0, 1, ... over the run), or None."""
        return fault_draw(self.cfg.seed, "judge", attempt, self.cfg.judge_rate, self.cfg.judge_kinds)

    # hooks -----------------------------------------------------------------------------------
    def initial_rubrics(self, query) -> list[Rubric]:
        return self.inner.initial_rubrics(query)

    def propose(self, query, rollouts, step) -> list[Rubric]:
        """The backend's proposals, or [] when the call fails after the bound (§3.4)."""
        got = self._call(lambda: self.inner.propose(query, rollouts, step), _check_proposals)
        return got if got is not None else []

    def _safe_scores(self, query, rollouts, rubrics) -> np.ndarray:
        """S (n, |rubrics|): one call per (rollout, stage) cell (deviation 2); a failed call leaves
        that rollout's rubrics of that stage NaN, so R is missing in exactly that cell."""
        S = np.full((len(rollouts), len(rubrics)), np.nan)
        for i, ro in enumerate(rollouts):
            for k in range(len(STAGES)):
                cols = [j for j, r in enumerate(rubrics) if r.stage == k]
                if not cols:
                    continue
                sub = [rubrics[j] for j in cols]
                got = self._call(lambda: self.inner.score_rubrics(query, [ro], sub),
                                 lambda s: _check_scores(s, (1, len(cols))))
                if got is not None:
                    S[i, cols] = got[0]
        return S

    def score_reflections(self, query, rollout, judged, row, candidates) -> list[ReflectionScore]:
        """The backend's privileged scores, or NaN for every candidate after the bound (§3.4)."""
        m = len(candidates)
        got = self._call(lambda: self.inner.score_reflections(query, rollout, judged, row, candidates),
                         lambda out: _check_reflections(out, m))
        if got is None:
            return [ReflectionScore(math.nan, math.nan, math.nan, "judge call failed")
                    for _ in candidates]
        return got

    def load_state_dict(self, state: dict) -> None:
        counters = dict(self.counters)
        super().load_state_dict(state)
        self.counters = {**counters, **self.counters}
        self.inner.buffers = self.buffers


# ----------------------------------------------------------------------------------------------------
# Tool


class ToolBackendError(ConnectionError):
    """The search API answered with an error (simulated)."""


class FaultyTool:
    """Wraps a search tool (`__call__(query) -> list[SearchResult]`, attribute `name`).

    Call `index` (0, 1, ... over the run) fails with kind fault_draw(seed, "tool", index, ...):
    "error" raises ToolBackendError; "hang" blocks up to cfg.hang_s seconds before answering, which
    the rollout engine's per-call timeout turns into "search timed out". `close()` releases hung
    calls (their results are discarded by the engine). `state_dict` holds the call index.
    """

    def __init__(self, inner, cfg: FaultConfig):
        self.inner, self.cfg = inner, cfg
        self.name = getattr(inner, "name", "google_search")
        self.calls = 0
        self.counts = {k: 0 for k in TOOL_KINDS}
        self._lock = threading.Lock()
        self._release = threading.Event()

    def __call__(self, query: str):
        with self._lock:
            idx = self.calls
            self.calls += 1
            kind = fault_draw(self.cfg.seed, "tool", idx, self.cfg.tool_rate, self.cfg.tool_kinds)
            if kind is not None:
                self.counts[kind] += 1
        if kind == "error":
            raise ToolBackendError("search API returned HTTP 503 (simulated)")
        if kind == "hang":
            self._release.wait(self.cfg.hang_s)
        return self.inner(query)

    def close(self) -> None:
        """Release every hung call now (for tests and clean shutdown)."""
        self._release.set()

    def state_dict(self) -> dict:
        with self._lock:
            return {"calls": self.calls, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.calls = int(state["calls"])
            self.counts = {**{k: 0 for k in TOOL_KINDS}, **state["counts"]}
