"""The evolving-rubric stage judge with an LLM behind HTTP (§3.4, full mode): Gemini or OpenAI API.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements §3.4 with a language-model judge ("judge and rubric generator Gemini Flash", appendix). The
buffer mechanics (merge, prune to the caps Plan 3 / Research 2 / Review 2 / Answer 3, weighted stage
scores, NaN for missing) live in `judge.EvolvingJudge`; this module fills its three hooks:

    propose(query, rollouts, step)  one call per group: up to cap_k new discriminative rubrics per stage
    score_rubrics(query, rollouts, rubrics)
                                    one call per rollout scoring every requested rubric of every stage
                                    (initial data-row rubrics included) -> S (n, |rubrics|) in [0,1]/NaN
    score_reflections(query, rollout, judged, row, candidates)
                                    one call per candidate set; the privileged judge sees R[row], the
                                    justifications and the rubric buffers -> within, cross, mean

Glossary: a *call* is one logical question to the judge (one prompt); a *request* is one HTTP POST (a
call may send several: transport retries on 429/5xx/connect errors, re-asks on read timeouts,
dropped connections and invalid replies). A call still unanswered after the bound *fails*; its cells
are NaN.

Equations
- Cost of a request: usd = tokens_in / 1e6 * price_in + tokens_out / 1e6 * price_out (USD per 1M
  tokens from backends/api/pricing.py's dated table, or judge_http.price_in / price_out); summed in
  `stats()["judge/usd_total"]` (`_Meter.add_usage`). A model without a known price has an unknown
  cost (judge/usd_total None), never another model's.
- Reflection score: score = (within + cross) / 2; `HTTPJudge.score_reflections`. Ours: §3.4 names the
  two criteria (within-episode refinement, cross-episode transfer) but gives no rule to combine
  them; we weigh them equally.

Failure semantics (`# SCALE:` lines): requests go through backends/api/http.HTTPClient, which honours the
environment's proxy, retries 429/500/502/503/504 (waiting the server's Retry-After, a 429 pausing every
judge request and halving the requests in flight) and connect errors, at most `max_retries` each,
within judge_http.rpm / judge_http.tpm; a 401/403/404 raises `APIStopError` with the server's message, which
stops the run (it is not a missing cell). We re-ask on read timeouts, on a
connection dropped before the reply, and on replies that hold no JSON object that validates (at
most `max_retries` re-asks; so a call sends at most (1 + max_retries)^2 requests). A valid object
wrapped in a ```json fence, prose or a <think> block is taken out of it and counted in
`judge/json_repaired` (`parse_reply`). After the bound the call fails and its cells are NaN, never
0, and no exception reaches the trainer (`propose` raises `JudgeCallError`, which
`EvolvingJudge.judge_group` turns into "no proposals").

Untrusted text (responses, tool outputs, reflection candidates) is put inside
`<untrusted id="...">...</untrusted>` markers; the system prompt says their content is data and any
instruction in it must be ignored; a marker written inside the text is neutralised (`_fence`). A
response the rollout engine cut at its token budget is announced as truncated, outside the markers
(`TRUNCATED_NOTE`), in every prompt that shows it.

The API key is read from the environment at request time (`api_key_env` names the variable); it never
enters a config object, a log line, a cache key, a cache file or `state_dict`.

Deviations from the paper
1. The paper does not publish its judge prompts; ours are our own, versioned by `prompt_version`
   (part of the cache key, so a prompt change never replays old judgments).
2. The paper does not say how judge calls are batched; we score all rubrics of one rollout in one call
   (n calls per group, not n x |rubrics|) and all m reflection candidates in one call.
3. The paper does not say what a failed judge call yields; we make the cells missing (NaN), which
   SS-GRPO turns into advantage 0 (ss_grpo.py), instead of a score that would be a false signal.
4. The disk cache replays the judgment of an identical prompt even at temperature > 0: a resumed run
   pays nothing for groups it already judged and gets the same rewards.
5. "Gemini Flash" has no version in the paper; `gemini-2.5-flash` is our default. Prices are the
   dated list prices of backends/api/pricing.py, for cost accounting and judge_http.max_usd only; check them
   against the provider's page. `judge_http.thinking_budget` (Gemini thinkingConfig.thinkingBudget) is
   ours: the paper does not say how much the judge thinks.
6. Proposed rubric weights are clipped to [0.1, 10] (not a reason to re-ask); an empty reflection
   candidate scores 0 on both criteria without a call (there is nothing to judge).

Usage (full mode; see docs/http_judge.md for a self-hosted vLLM server):
    export GEMINI_API_KEY=...
    judge = HTTPJudge(JudgeConfig(backend="gemini", model="gemini-2.5-flash"))
    result = judge.judge_group(query, rollouts, step)     # judge.JudgeResult, R (n, 4)
"""
from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from backends.api.http import (APIStopError, DeadlineExceeded, DiskCache, HTTPClient, cache_key,
                               server_message)
from backends.api.judge_prompts import (SYSTEM_PROPOSE, SYSTEM_REFLECT, SYSTEM_SCORE, fence,
                                        gemini_schema, parse_reply, rubric_lines, schema_instruction,
                                        schema_propose, schema_reflections, schema_scores,
                                        stage_blocks, validate_proposals, validate_reflections,
                                        validate_scores)
from backends.api.pricing import resolve_prices, unknown_price_message
from backends.api.settings import HTTPJudgeConfig, check_http_config
from hparams import JudgeConfig
from judge import EvolvingJudge, JudgeResult, ReflectionScore, Rubric
from scaffold import STAGES, Rollout

log = logging.getLogger("rubricem.judge_http")


class JudgeBudgetExceeded(RuntimeError):
    """The judge's cumulative cost reached judge_http.max_usd (`HTTPJudge.check_budget`); the training
    loop stops after the step's checkpoint (exit code 5)."""

    exit_code = 5


class JudgeCallError(RuntimeError):
    """A judge call that failed after the retry bound (its cells are missing)."""

# ----------------------------------------------------------------------------------------------------
# Metering


class _Meter:
    """Thread-safe counters behind `stats()`."""

    KEYS = ("calls", "requests", "failures", "retries", "invalid_replies", "json_repaired", "cache_hits",
            "throttled", "tokens_in", "tokens_out", "cost_usd", "latency_total_s")

    def __init__(self, prices):
        self.prices = prices  # backends.api.pricing.Prices, or None: the cost is unknown
        self.c = {k: 0.0 if k in ("cost_usd", "latency_total_s") else 0 for k in self.KEYS}
        self.lock = threading.Lock()

    def inc(self, key: str, by: float = 1) -> None:
        with self.lock:
            self.c[key] += by

    def add_usage(self, tin: int, tout: int) -> None:
        with self.lock:
            self.c["tokens_in"] += tin
            self.c["tokens_out"] += tout
            if self.prices is not None:
                # Eq.: usd = tokens_in / 1e6 * price_in + tokens_out / 1e6 * price_out
                self.c["cost_usd"] += self.prices.request_cost(tin, tout)


# ----------------------------------------------------------------------------------------------------
# The judge


class HTTPJudge(EvolvingJudge):
    """§3.4 stage judge backed by an LLM over HTTP (Gemini or an OpenAI-compatible server).

    Thread-safe; `close()` (or a `with` block) releases the thread pool and connections.
    """

    concurrent_groups = True  # its calls wait on the network: judge.judge_all runs groups in threads

    def __init__(self, config: JudgeConfig | None = None, http: HTTPJudgeConfig | None = None,
                 caps: Sequence[int] | None = None):
        """config: the run config's judge section (hparams.JudgeConfig; default: Gemini Flash);
        http: its judge_http section (HTTPJudgeConfig; default: the public endpoint, no cache);
        caps: the rubric-buffer caps (default config.caps). Raises ValueError (check_http_config)."""
        self.config = config or JudgeConfig(backend="gemini")
        self.http = http or HTTPJudgeConfig()
        check_http_config(self.config, self.http)
        super().__init__(caps if caps is not None else self.config.caps)
        cfg, http = self.config, self.http
        self.cache = DiskCache(http.cache_dir)
        self.meter = _Meter(resolve_prices(cfg.model, http.price_in, http.price_out))
        if self.meter.prices is None:
            log.warning("%s", unknown_price_message(cfg.model))
        # SCALE: one rate-limit-aware client: proxy, Retry-After, AIMD concurrency, rpm / tpm
        self.client = HTTPClient("judge", max_retries=cfg.max_retries, backoff_s=http.backoff_s,
                                 backoff_max_s=http.backoff_max_s, timeout_s=http.timeout_s,
                                 concurrency=http.concurrency, rpm=http.rpm, tpm=http.tpm,
                                 retry_after_max_s=http.retry_after_max_s, retry_reads=False)
        self._pool = ThreadPoolExecutor(max_workers=http.concurrency, thread_name_prefix="judge-http")
        self._lock = threading.Lock()
        # LLM justifications of recent scoring calls, for the privileged reflection judge.
        self._why: collections.OrderedDict = collections.OrderedDict()

    # lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight calls, then release the thread pool and the connections."""
        self._pool.shutdown(wait=True)
        self.client.close()

    def __enter__(self) -> "HTTPJudge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Cumulative metrics: judge/calls (logical calls), judge/requests (HTTP POSTs), judge/failures
        (calls given up after the bound), judge/retries (transport retries + re-asks),
        judge/invalid_replies, judge/json_repaired (valid replies dug out of wrapping text,
        `parse_reply`), judge/cache_hits, judge/throttled (429 answers), judge/tokens_in,
        judge/tokens_out, judge/cost_usd (USD; absent when the price is unknown), judge/latency_s
        (mean seconds per request, 0 before the first), judge/usd_total (the same cumulative USD,
        None when the price is unknown; a running total, not differenced per step)."""
        with self.meter.lock:
            c = dict(self.meter.c)
        out = {f"judge/{k}": v for k, v in c.items() if k != "latency_total_s"}
        out["judge/latency_s"] = c["latency_total_s"] / c["requests"] if c["requests"] else 0.0
        if self.meter.prices is None:
            del out["judge/cost_usd"]
        out["judge/usd_total"] = None if self.meter.prices is None else c["cost_usd"]
        return out

    def check_budget(self) -> None:
        """Raise JudgeBudgetExceeded once the cumulative cost reached judge_http.max_usd (> 0). The
        training loop calls it after each step's checkpoint, so a step may overshoot the cap by at
        most its own cost (the dry run prints the cost per step)."""
        cap = self.http.max_usd
        with self.meter.lock:
            spent = self.meter.c["cost_usd"]
        if cap > 0 and spent >= cap:
            raise JudgeBudgetExceeded(
                f"judge spent ${spent:,.2f}, reaching judge_http.max_usd = ${cap:,.2f}; stopping after "
                "this step's checkpoint. Raise judge_http.max_usd and continue with --resume latest.")

    def state_dict(self) -> dict:
        """Buffers and counters (judge.EvolvingJudge) plus the HTTP meter, so cost accounting survives
        a resume. JSON-serialisable; holds no key and no prompt."""
        state = super().state_dict()
        with self.meter.lock:
            state["http_meter"] = dict(self.meter.c)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict`; a state without "http_meter" (e.g. from ToyJudge) keeps the meter."""
        super().load_state_dict(state)
        with self.meter.lock:
            self.meter.c.update(state.get("http_meter", {}))

    # transport ---------------------------------------------------------------------------------
    def _request(self, system: str, user: str, schema: dict) -> tuple[str, dict, dict]:
        """(url, headers, body) of one request. The key is read here and only placed in headers."""
        cfg, http = self.config, self.http
        key = os.environ.get(http.key_env(cfg.backend), "")
        headers = {"Content-Type": "application/json"}
        if cfg.backend == "gemini":
            if not key:
                raise JudgeCallError(f"environment variable {http.key_env(cfg.backend)} is not set")
            headers["x-goog-api-key"] = key
            gen = {"temperature": http.temperature, "responseMimeType": "application/json",
                   http.gemini_schema_field: gemini_schema(schema, http.gemini_schema_field)}
            if http.max_output_tokens:
                gen["maxOutputTokens"] = http.max_output_tokens
            if http.thinking_budget >= 0:  # -1: not sent, the model's default (dynamic on 2.5)
                gen["thinkingConfig"] = {"thinkingBudget": http.thinking_budget}
            body = {"contents": [{"role": "user", "parts": [{"text": user}]}],
                    "systemInstruction": {"parts": [{"text": system}]}, "generationConfig": gen}
            return f"{http.url_root(cfg.backend)}/models/{cfg.model}:generateContent", headers, body
        if key:  # self-hosted servers often need none
            headers["Authorization"] = f"Bearer {key}"
        fmt = ({"type": "json_schema", "json_schema": {"name": "judgment", "schema": schema,
                                                        "strict": True}}
               if http.openai_response_format == "json_schema" else {"type": "json_object"})
        if http.openai_response_format == "json_object":  # no schema on the wire: put it in the prompt
            user = user + schema_instruction(schema)
        body = {"model": cfg.model, "temperature": http.temperature, "response_format": fmt,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}]}
        if http.max_output_tokens:
            body["max_tokens"] = http.max_output_tokens
        return f"{http.url_root(cfg.backend)}/chat/completions", headers, body

    def _quota_tokens(self, tin: int, tout: int) -> int:
        """The tokens of one request that count against judge_http.tpm: the Gemini API's
        tokens-per-minute limit counts input tokens only ("Tokens per minute (input)",
        ai.google.dev/gemini-api/docs/rate-limits); an OpenAI-compatible server's counts both."""
        return int(tin) if self.config.backend == "gemini" else int(tin) + int(tout)

    def _reply_text(self, data: Any, ticket: list | None = None) -> str:
        """Model text and usage accounting from a 200 reply; ValueError if the wire shape is wrong.
        ticket: the request's rate-limiter entry, corrected to the tokens really used."""
        try:
            if self.config.backend == "gemini":
                u = data.get("usageMetadata") or {}
                # Thinking tokens are billed as output.
                tin = int(u.get("promptTokenCount", 0))
                tout = int(u.get("candidatesTokenCount", 0)) + int(u.get("thoughtsTokenCount", 0))
            else:
                u = data.get("usage") or {}
                tin, tout = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
            self.meter.add_usage(tin, tout)
            used = self._quota_tokens(tin, tout)
            if ticket is not None and used > 0:
                self.client.limiter.add_tokens(ticket, used)
            if self.config.backend == "gemini":
                parts = data["candidates"][0]["content"]["parts"]
                return "".join(p.get("text", "") for p in parts if not p.get("thought"))
            return data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(f"reply without model text ({type(e).__name__})") from None

    def ask(self, system: str, user: str, schema: dict, validate: Callable[[Any], Any]) -> Any | None:
        """One judge call: cache, then POST with bounded retries; returns the validated value or None.

        validate: parsed JSON -> value (raises ValueError/KeyError/TypeError if invalid). Never raises
        on transport or model errors: a call still unanswered after the bound counts as a failure and
        returns None (its cells become NaN).
        """
        import requests  # lazy: requests only when a call is made

        cfg, http, m = self.config, self.http, self.meter
        m.inc("calls")
        # Everything that can change the verdict: a verdict of another server, model, prompt,
        # schema, temperature or thinking budget is never replayed.
        key = cache_key(cfg.backend, http.url_root(cfg.backend), cfg.model, http.prompt_version, system, user, schema,
                        http.temperature, http.openai_response_format if cfg.backend == "openai" else "",
                        http.thinking_budget if cfg.backend == "gemini" else -1)
        hit = self.cache.get(key)
        if hit is not None:
            try:
                value = validate(hit)
                m.inc("cache_hits")
                return value
            except (ValueError, KeyError, TypeError):
                pass  # a stale or corrupt entry is a miss
        reason = ""
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                # SCALE: re-ask after a read timeout or an invalid reply, with capped backoff.
                m.inc("retries")
                time.sleep(min(http.backoff_max_s, http.backoff_s * 2 ** (attempt - 1)))
            try:
                url, headers, body = self._request(system, user, schema)
            except JudgeCallError as e:
                reason = str(e)
                break
            t0 = time.perf_counter()
            # SCALE: the request's estimated tokens for judge_http.tpm (~4 characters per token)
            est = self._quota_tokens((len(system) + len(user)) // 4, http.max_output_tokens or 1000)
            try:
                resp, n_retry, n429, ticket = self.client.post(url, body, headers, tokens=est)
            except APIStopError:
                m.inc("requests")
                m.inc("failures")
                raise  # 401/403/404: the run stops with the server's message
            except DeadlineExceeded as e:
                reason = str(e)
                break
            except requests.exceptions.RequestException as e:
                m.inc("requests")
                m.inc("latency_total_s", time.perf_counter() - t0)
                reason = type(e).__name__
                if _is_read_error(e):  # timeout or dropped connection mid-reply: re-ask
                    continue
                break  # connect errors come here after urllib3's own retries
            m.inc("requests", 1 + n_retry)
            m.inc("retries", n_retry)
            m.inc("throttled", n429)
            m.inc("latency_total_s", time.perf_counter() - t0)
            if resp.status_code != 200:  # 429/5xx already retried by the client; other 4xx are final
                reason = f"HTTP {resp.status_code}: {server_message(resp, 160)}"
                break
            try:
                value, repaired = parse_reply(self._reply_text(resp.json(), ticket), validate)
            except (ValueError, KeyError, TypeError) as e:
                m.inc("invalid_replies")
                reason = f"invalid reply: {str(e)[:120]}"
                continue
            if repaired:  # JSON wrapped in a fence, prose or a <think> block: valid, but counted
                m.inc("json_repaired")
            self.cache.put(key, value, {"backend": cfg.backend, "model": cfg.model,
                                        "prompt_version": http.prompt_version})
            return value
        m.inc("failures")
        log.warning("judge call failed (%s, %s): %s; its cells are missing", cfg.backend, cfg.model,
                    reason)
        return None

    # hooks ---------------------------------------------------------------------------------------
    def propose(self, query, rollouts: Sequence[Rollout], step: int) -> list[Rubric]:
        """Up to caps[k] new discriminative rubrics per stage k from one call over the group (§3.4).

        Returns Rubric(rid="llm:{stage}:{sha1(title+description)[:10]}", stage=k, source="proposed",
        born_step=step), deduplicated by rid. Raises JudgeCallError after the retry bound (the base
        class then proposes nothing and counts a failure).
        """
        lim = self.http.max_text_chars
        buf = self.buffers.get(query.query, [[] for _ in STAGES])
        active = [r for b in buf for r in b] + self.initial_rubrics(query)
        caps = ", ".join(f"{STAGES[k]} {c}" for k, c in enumerate(self.caps))
        user = (f"Query:\n{fence(query.query, 'query', lim)}\n\nActive rubrics (do not repeat):\n"
                f"{rubric_lines(active)}\n\nGroup of {len(rollouts)} responses:\n"
                + "\n\n".join(f"Response {i}:\n" + stage_blocks(ro, f"response-{i}", lim)
                              for i, ro in enumerate(rollouts))
                + f"\n\nPropose at most this many new rubrics per stage: {caps}. Weight 1 is "
                  "normal importance, up to 5 for critical criteria.")
        value = self.ask(SYSTEM_PROPOSE, user, schema_propose(), validate_proposals)
        if value is None:
            raise JudgeCallError("rubric proposal failed after the retry bound")
        out, seen, per = [], set(), [0] * len(STAGES)
        for e in value["rubrics"]:
            k = STAGES.index(e["stage"])
            rid = f"llm:{e['stage']}:" + hashlib.sha1(
                (e["title"] + e["description"]).encode("utf-8")).hexdigest()[:10]
            if rid in seen or per[k] >= self.caps[k]:
                continue
            seen.add(rid)
            per[k] += 1
            out.append(Rubric(rid, k, e["title"], e["description"], e["weight"], "proposed",
                              born_step=step))
        return out

    def score_rubrics(self, query, rollouts: Sequence[Rollout], rubrics: Sequence[Rubric]) -> np.ndarray:
        """S (n, len(rubrics)) float64: rubric scores in [0,1], NaN where a call failed (§3.4).

        One call per rollout scores every rubric of every stage (initial rubrics included); calls
        run in parallel (at most `concurrency`). Never raises on model or transport errors.
        """
        n, ids = len(rollouts), [r.rid for r in rubrics]
        S = np.full((n, len(rubrics)), np.nan)  # (n, |rubrics|)
        if not rubrics or not n:
            return S
        uniq = list(dict.fromkeys(ids))
        head = (f"Query:\n{fence(query.query, 'query', self.http.max_text_chars)}\n\n"
                f"Rubrics by stage:\n{rubric_lines(rubrics)}\n\n")

        def one(ro: Rollout):
            user = (head + "Response:\n" + stage_blocks(ro, "response", self.http.max_text_chars)
                    + f"\n\nScore each of these {len(uniq)} rubric ids: {', '.join(uniq)}.")
            return self.ask(SYSTEM_SCORE, user, schema_scores(uniq), lambda o: validate_scores(o, uniq))

        for i, value in enumerate(self._pool.map(one, rollouts)):
            if value is None:
                continue  # missing: NaN, never 0
            got = {e["rubric_id"]: e for e in value["scores"]}
            S[i] = [got[r]["score"] for r in ids]
            self._remember(query, rollouts[i], {r: (got[r]["score"], got[r]["justification"])
                                                for r in uniq})
        return S

    def _remember(self, query, ro: Rollout, why: dict) -> None:
        k = _rollout_key(query, ro)
        with self._lock:
            self._why[k] = why
            self._why.move_to_end(k)
            while len(self._why) > 4096:  # bounded: the reflection branch lags one step
                self._why.popitem(last=False)

    def score_reflections(self, query, rollout: Rollout, judged: JudgeResult, row: int,
                          candidates: Sequence[str]) -> list[ReflectionScore]:
        """Privileged scores of m reflection candidates (§3.4) from one call.

        The prompt holds the stage scores R[row] (in [0,1] or NaN), the justifications, the rubrics
        that scored each stage and the trajectory; each candidate gets within, cross in [0,1] and
        score = (within + cross) / 2. After the retry bound every non-empty candidate gets NaN.
        Empty candidates score 0 without a call (deviation 6). Never raises on model errors.
        """
        lim = self.http.max_text_chars
        out: list[ReflectionScore | None] = [None] * len(candidates)
        ids = []
        for j, c in enumerate(candidates):
            if not (c or "").strip():
                out[j] = ReflectionScore(0.0, 0.0, 0.0, "empty reflection")
            else:
                ids.append(f"c{j}")
        if ids:
            with self._lock:
                why = dict(self._why.get(_rollout_key(query, rollout), {}))
            lines = []
            for k, name in enumerate(STAGES):
                v = float(judged.R[row, k])
                lines.append(f"[{name}] stage score R = {'missing' if math.isnan(v) else f'{v:.2f}'}; "
                             f"summary: {judged.justifications[row][k]}")
                for r in judged.rubrics[k]:
                    s, j = why.get(r.rid, (None, ""))
                    lines.append(f"- id={r.rid} | weight={r.weight:g} | {r.title}: {r.description}"
                                 + (f" | score {s:.2f}: {j}" if s is not None else ""))
            user = (f"Query:\n{fence(query.query, 'query', lim)}\n\nStage scores, rubrics and "
                    f"justifications:\n" + "\n".join(lines) + "\n\nTrajectory:\n"
                    + stage_blocks(rollout, "trajectory", lim) + "\n\nCandidate reflections:\n"
                    + "\n".join(f"{i}:\n" + fence(candidates[int(i[1:])], i, lim) for i in ids)
                    + f"\n\nScore each of these {len(ids)} candidate ids: {', '.join(ids)}.")
            value = self.ask(SYSTEM_REFLECT, user, schema_reflections(ids),
                             lambda o: validate_reflections(o, ids))
            got = {e["candidate_id"]: e for e in value["scores"]} if value else {}
            for i in ids:
                e = got.get(i)
                if e is None:
                    out[int(i[1:])] = ReflectionScore(math.nan, math.nan, math.nan, "judge call failed")
                else:
                    # ours (§3.4 names the two criteria, not their combination): equal weights
                    out[int(i[1:])] = ReflectionScore(e["within"], e["cross"],
                                                      0.5 * (e["within"] + e["cross"]),
                                                      e["justification"])
        return out  # type: ignore[return-value]


def _is_read_error(e: Exception) -> bool:
    """A read timeout, or the server dropping the connection after we sent the request."""
    import requests  # lazy: requests / urllib3 only when a call failed
    from urllib3.exceptions import ProtocolError  # lazy: requests / urllib3 only when a call failed

    if isinstance(e, (requests.exceptions.ReadTimeout, requests.exceptions.ChunkedEncodingError)):
        return True
    return isinstance(e, requests.exceptions.ConnectionError) and bool(e.args) and \
        isinstance(e.args[0], ProtocolError)


def _rollout_key(query, ro: Rollout) -> str:
    return hashlib.sha1((query.query + "\x00" + ro.judge_text).encode("utf-8")).hexdigest()
