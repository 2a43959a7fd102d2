"""Teacher trajectories for the SFT stage: an LLM behind HTTP (Gemini or OpenAI-compatible) writes
stage-structured trajectories in the scaffold, calling the real search tool.
`python -m backends.sft.teacher --queries Q.jsonl --out data/teacher.jsonl [--dry-run]`.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the data side of the appendix's SFT ("~11K trajectories from a Gemini-3.1-Pro teacher in
the stage-structured scaffold", from DR Tulu's SFT queries). The method is in sft.py (filters,
conversions); everything here is `# SCALE:` plumbing.

How one trajectory is written (`Teacher.trajectory`): the scaffold's system prompt
(scaffold.SYSTEM_PROMPT) and the query (scaffold.build_user_message) open a chat; each request asks
the teacher to continue, with the stop sequence "</call_tool>". A reply that ends in a tool call is
executed exactly as the rollout engine executes one (scaffold.RolloutEngine._run_tool: the tool
names of sft.TOOL_ALIASES, at most scaffold.MAX_TOOL_CALLS calls, errors as format_tool_error), and
the tool output goes back to the teacher as the next user turn; a reply without a call ends the
trajectory. The record keeps the segments (teacher text / tool output) in order, which is what
sft.filter_and_convert reads.

Plumbing
- Requests go through backends/api/http.HTTPClient (rate limits, Retry-After, 429 back-off, proxy;
  401/403/404 stop the run with APIStopError), `concurrency` trajectories at a time (threads).
- Resume: finished trajectories are appended to the JSONL at once (one line each, flushed); a rerun
  skips the queries already there. Every teacher reply and every search result list is also kept in
  a disk cache (`<out>.cache/`, backends/api/http.DiskCache, keyed on the request without the key), so a
  trajectory cut by an interruption replays its earlier turns for free: nothing is paid twice.
- Cost: tokens from each reply's usage, priced by backends/api/pricing.py (or --price-in/--price-out);
  before each request the spend so far is checked against --max-usd, and at the cap no new request
  starts; the run ends cleanly with what it has written (stats "stopped": "budget"). Requests
  already in flight still complete, so the spend can pass the cap by up to concurrency - 1 calls.
- Stats: `<out>.stats.json`: queries, written, resumed, failed, calls, cached calls, tokens, USD,
  search calls, `max_tokens_stops` (turns the API cut at their token cap), and the count per filter
  of sft.filter_and_convert over everything written.
- Budgets: `max_output_tokens` caps a turn's text and `thinking_budget` the teacher's thinking, as
  two settings (Gemini's maxOutputTokens counts both, so the request asks for their sum).
- Dry run (--dry-run): calls, tokens and dollars for the configured number of queries, from the
  assumptions in GEN_ASSUMPTIONS (printed).

Deviations from the paper
1. The paper's teacher is Gemini-3.1-Pro; any Gemini or OpenAI-compatible chat model can be named
   (--backend, --model). Its sampling settings are not in the paper; temperature 0.7 is ours.
2. Multi-turn chat (tool outputs returned as user turns) is our wire format; the record is one
   assistant turn with the tool outputs inline (sft.to_chatml), as the paper trains it.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field

from backends.run.data import _read_jsonl
from backends.api.http import DiskCache, HTTPClient, cache_key
from backends.api.pricing import resolve_prices
from backends.api.settings import SearchHTTPConfig
from backends.api.search_http import SerperSearchTool
from scaffold import (MAX_TOOL_CALLS, SYSTEM_PROMPT, SearchResult, build_user_message, format_tool_error,
                      format_tool_output)
from sft import TOOL_ALIASES, filter_and_convert

log = logging.getLogger("rubricem.sft_teacher")

STOP = "</call_tool>"
_CALL_RE = re.compile(r'<call_tool\s+name\s*=\s*["\']([^"\']*)["\']\s*>(.*?)</call_tool>', re.S)


@dataclass
class TeacherConfig:
    """The teacher model and the generation run (flags of `python -m backends.sft.teacher`)."""

    backend: str = "gemini"
    """"gemini" (generateContent) | "openai" (chat completions, any compatible server)."""
    model: str = "gemini-3.1-pro"
    """PAPER: "Gemini-3.1-Pro teacher"."""
    base_url: str = ""
    """API root; "" = the public endpoint of the backend."""
    api_key_env: str = ""
    """Environment variable of the key; "" = GEMINI_API_KEY / OPENAI_API_KEY by backend."""
    temperature: float = 0.7
    """Ours (deviation 1)."""
    max_output_tokens: int = 8192
    """Per request (one turn): the visible text the teacher may write (ours: a final turn with the
    last evaluation, the review and a ~2,500-token answer fits with room)."""
    thinking_budget: int = 8192
    """Gemini `thinkingConfig.thinkingBudget` per request, a separate budget from
    max_output_tokens: on Gemini's thinking models `maxOutputTokens` caps thinking and text
    together, so we send maxOutputTokens = max_output_tokens + thinking_budget. -1: no thinking
    config is sent and maxOutputTokens = max_output_tokens (thinking then eats into the text's cap:
    a long answer can stop at MAX_TOKENS, counted as `max_tokens_stops`); 0: no thinking (models
    that allow it). Ignored by the OpenAI-compatible backend (its `max_tokens` is the text cap)."""
    concurrency: int = 8
    """Trajectories written at once (and HTTP requests in flight)."""
    rpm: int = 0
    tpm: int = 0
    max_retries: int = 3
    timeout_s: float = 300.0
    max_usd: float = 0.0
    """Budget cap in USD (0 = none)."""
    price_in: float = -1.0
    price_out: float = -1.0
    max_tool_calls: int = 10
    """PAPER: at most 10 tool calls per trajectory."""
    search_backend: str = "serper"
    search_base_url: str = "https://google.serper.dev"
    search_k: int = 5

    @property
    def key_env(self) -> str:
        return self.api_key_env or ("GEMINI_API_KEY" if self.backend == "gemini" else "OPENAI_API_KEY")

    @property
    def url_root(self) -> str:
        if self.base_url:
            return self.base_url.rstrip("/")
        return ("https://generativelanguage.googleapis.com/v1beta" if self.backend == "gemini"
                else "https://api.openai.com/v1")


class BudgetReached(RuntimeError):
    """The spend reached --max-usd: no further request is started."""


def read_queries(path: str, limit: int = 0) -> list[dict]:
    """Queries from a JSONL file: each line an object with "query" (or "question" / "prompt"), or
    with "messages" (the first user turn is the query; DR Tulu's SFT rows). Returns [{"id", "query"}]
    with id = the row's "id" or sha256 of the query (16 hex). Raises ValueError naming the line for a
    line that is not JSON (data._read_jsonl) or a row (0-based, blank lines left out) with no query."""
    out = []
    for i, r in enumerate(_read_jsonl(path)):
        q = None
        if isinstance(r, dict):
            q = r.get("query") or r.get("question") or r.get("prompt")
            if q is None and isinstance(r.get("messages"), list):
                q = next((m.get("content") for m in r["messages"]
                          if isinstance(m, dict) and m.get("role") == "user"), None)
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}: row {i}: no query (need `query`, `question`, `prompt` or a user message)")
        rid = str(r.get("id") or hashlib.sha256(q.encode()).hexdigest()[:16])
        out.append({"id": rid, "query": q.strip()})
        if limit and len(out) >= limit:
            break
    return out


@dataclass
class _Meter:
    """Thread-safe counters of the run (USD None when the price is unknown)."""

    calls: int = 0
    cached_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    usd: float | None = 0.0
    search_calls: int = 0
    tool_errors: int = 0
    max_tokens_stops: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict:
        with self.lock:
            return {f: getattr(self, f) for f in ("calls", "cached_calls", "tokens_in", "tokens_out",
                                                  "usd", "search_calls", "tool_errors", "max_tokens_stops")}


class Teacher:
    """Writes trajectories (module docstring). `tool`: a search tool (query -> list[SearchResult]);
    `cache_dir`: the reply cache ("" = none); `tool_names`: the call names (case-folded, spaces and
    hyphens as underscores) that run the search tool, mapped to "google_search" (default
    sft.TOOL_ALIASES). Thread-safe; `close()` releases the HTTP client."""

    def __init__(self, config: TeacherConfig, tool, cache_dir: str = "",
                 tool_names: dict | None = None):
        if config.backend not in ("gemini", "openai"):
            raise ValueError(f"teacher backend must be 'gemini' or 'openai', got {config.backend!r}")
        if config.max_output_tokens < 1 or config.thinking_budget < -1:
            raise ValueError(f"teacher max_output_tokens must be >= 1 and thinking_budget >= -1, got "
                             f"{config.max_output_tokens}, {config.thinking_budget}")
        self.config, self.tool = config, tool
        self.tool_names = dict(TOOL_ALIASES if tool_names is None else tool_names)
        self.prices = resolve_prices(config.model, config.price_in, config.price_out)
        if config.max_usd > 0 and self.prices is None:
            raise ValueError(f"no price for teacher model {config.model!r} in backends/api/pricing.py: a "
                             "budget cap needs --price-in and --price-out (USD per 1M tokens)")
        self.client = HTTPClient("teacher", max_retries=config.max_retries, timeout_s=config.timeout_s,
                                 concurrency=config.concurrency, rpm=config.rpm, tpm=config.tpm)
        self.cache = DiskCache(os.path.join(cache_dir, "teacher") if cache_dir else "")
        self.search_cache = DiskCache(os.path.join(cache_dir, "search") if cache_dir else "")
        self.meter = _Meter(usd=0.0 if self.prices is not None else None)

    def close(self) -> None:
        self.client.close()

    # one request ------------------------------------------------------------------------------
    def _request(self, system: str, turns: list[tuple[str, str]]) -> tuple[str, dict, dict]:
        """(url, headers, body) of one continuation; turns: (role "user"|"assistant", text)."""
        c = self.config
        key = os.environ.get(c.key_env, "")
        headers = {"Content-Type": "application/json"}
        if c.backend == "gemini":
            if not key:
                raise RuntimeError(f"environment variable {c.key_env} is not set")
            headers["x-goog-api-key"] = key
            gen = {"temperature": c.temperature, "stopSequences": [STOP],
                   "maxOutputTokens": c.max_output_tokens + max(0, c.thinking_budget)}
            if c.thinking_budget >= 0:  # SCALE: thinking gets its own budget (TeacherConfig)
                gen["thinkingConfig"] = {"thinkingBudget": c.thinking_budget}
            body = {"systemInstruction": {"parts": [{"text": system}]},
                    "contents": [{"role": "model" if r == "assistant" else "user", "parts": [{"text": t}]}
                                 for r, t in turns],
                    "generationConfig": gen}
            return f"{c.url_root}/models/{c.model}:generateContent", headers, body
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = {"model": c.model, "temperature": c.temperature, "max_tokens": c.max_output_tokens,
                "stop": [STOP], "messages": [{"role": "system", "content": system}]
                + [{"role": r, "content": t} for r, t in turns]}
        return f"{c.url_root}/chat/completions", headers, body

    def _reply(self, data) -> tuple[str, int, int, bool]:
        """(text, tokens in, tokens out, cut) of a 200 reply; cut: the reply stopped at its token cap
        (Gemini finishReason "MAX_TOKENS", OpenAI finish_reason "length"). ValueError for a wrong
        wire shape."""
        try:
            if self.config.backend == "gemini":
                u = data.get("usageMetadata") or {}
                tin = int(u.get("promptTokenCount", 0))
                tout = int(u.get("candidatesTokenCount", 0)) + int(u.get("thoughtsTokenCount", 0))
                cand = data["candidates"][0]
                text = "".join(p.get("text", "") for p in cand["content"]["parts"] if not p.get("thought"))
                return text, tin, tout, cand.get("finishReason") == "MAX_TOKENS"
            u = data.get("usage") or {}
            ch = data["choices"][0]
            return (ch["message"]["content"] or "", int(u.get("prompt_tokens", 0)),
                    int(u.get("completion_tokens", 0)), ch.get("finish_reason") == "length")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(f"teacher reply without model text ({type(e).__name__})") from None

    def continue_(self, system: str, turns: list[tuple[str, str]]) -> str:
        """One teacher turn: cached reply, or one POST (after the budget check). Raises
        BudgetReached, APIStopError, or RuntimeError for a reply that stays unusable."""
        url, headers, body = self._request(system, turns)
        key = cache_key("teacher", 1, url.split("?")[0], body)  # no secret: the key is in headers
        hit = self.cache.get(key)
        if hit is not None:
            with self.meter.lock:
                self.meter.cached_calls += 1
            return hit["text"]
        with self.meter.lock:
            # SCALE: the budget cap: no request starts once the spend reached it
            if self.config.max_usd > 0 and self.meter.usd is not None and self.meter.usd >= self.config.max_usd:
                raise BudgetReached(f"teacher spend ${self.meter.usd:.4f} reached the cap ${self.config.max_usd:.4f}")
        est = sum(len(t) for _, t in turns) // 4 + len(system) // 4 + self.config.max_output_tokens \
            + max(0, self.config.thinking_budget)
        resp, _, _, ticket = self.client.post(url, body, headers, tokens=est)
        if resp.status_code != 200:
            raise RuntimeError(f"teacher: HTTP {resp.status_code} after retries")
        text, tin, tout, cut = self._reply(resp.json())
        if tin + tout > 0:
            self.client.limiter.add_tokens(ticket, tin + tout)
        with self.meter.lock:
            self.meter.calls += 1
            # a turn cut at the cap: filter 1 (no closing </answer>) will likely drop its trajectory
            self.meter.max_tokens_stops += int(cut)
            self.meter.tokens_in += tin
            self.meter.tokens_out += tout
            if self.prices is not None:
                self.meter.usd += self.prices.request_cost(tin, tout)
        self.cache.put(key, {"text": text, "tokens_in": tin, "tokens_out": tout})
        return text

    def search(self, query: str) -> list:
        """The tool, through the search cache (a replayed trajectory pays no search twice)."""
        key = cache_key("search", query)
        hit = self.search_cache.get(key)
        if hit is not None:
            return [SearchResult(**r) for r in hit]
        res = self.tool(query)
        with self.meter.lock:
            self.meter.search_calls += 1
        self.search_cache.put(key, [asdict(r) for r in res])
        return res

    # one trajectory ---------------------------------------------------------------------------
    def trajectory(self, query: str, system: str | None = None) -> dict:
        """One trajectory for `query`: {"query", "segments": [[is_env, text], ...], "tool_calls",
        "finish"} with finish "answer" (no further call), "max_turns". Raises as continue_."""
        system = system or SYSTEM_PROMPT
        turns: list[tuple[str, str]] = [("user", build_user_message(query))]
        segs: list[list] = []
        n_calls, handle = 0, 1
        max_calls = min(self.config.max_tool_calls, MAX_TOOL_CALLS)
        for _ in range(max_calls + 3):
            text = self.continue_(system, turns)
            # The stop sequence is not part of the reply: close an unclosed last call.
            opened = text.rfind("<call_tool")
            if opened >= 0 and STOP not in text[opened:]:
                text = text + STOP
            # Only the environment writes tool outputs: anything after a self-written one is cut.
            forged = text.find("<tool_output>")
            if forged >= 0:
                text = text[:forged]
            calls = list(_CALL_RE.finditer(text))
            if not calls or not text.rstrip().endswith(STOP):
                segs.append([False, text])
                return {"query": query, "segments": segs, "tool_calls": n_calls, "finish": "answer"}
            name = re.sub(r"[\s\-]+", "_", calls[-1].group(1).strip().lower())
            q = calls[-1].group(2).strip()
            segs.append([False, text])
            if n_calls >= max_calls:
                env = format_tool_error(f"tool-call limit of {max_calls} reached; write the review and the answer")
            elif self.tool_names.get(name) != "google_search":
                env = format_tool_error(f"unknown tool {calls[-1].group(1)!r}")
            elif not q:
                env = format_tool_error("empty query")
            else:
                n_calls += 1
                try:
                    results = self.search(q)
                    env = format_tool_output(results, handle)
                    handle += len(results)
                except Exception as e:  # a failing search is an error output, as in the rollout engine
                    if getattr(e, "stops_run", False):
                        raise
                    env = format_tool_error("search failed")
            if env.lstrip().startswith("<tool_output>error:"):
                with self.meter.lock:
                    self.meter.tool_errors += 1
            segs.append([True, env])
            turns += [("assistant", text), ("user", env.strip())]
        return {"query": query, "segments": segs, "tool_calls": n_calls, "finish": "max_turns"}


# ----------------------------------------------------------------------------------------------------
# The run


def done_ids(path: str) -> set:
    """Ids of the trajectories already in the output JSONL (a torn last line is ignored)."""
    ids = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    ids.add(json.loads(line)["id"])
                except (ValueError, KeyError, TypeError):
                    continue
    return ids


def _repair_tail(path: str) -> None:
    """Cut a torn last line (an interrupted write) so that appended lines stay valid JSONL."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return
        fh.truncate(data.rfind(b"\n") + 1)


def write_stats(path: str, stats: dict) -> None:
    """Atomic JSON write (tmp file + os.replace)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(stats, fh, indent=1)
    os.replace(tmp, path)


def generate(queries: list[dict], out: str, teacher: Teacher, system: str | None = None) -> dict:
    """Write one trajectory per query not yet in `out` (JSONL), `teacher.config.concurrency` at a
    time; then `<out>.stats.json` with the count per filter of sft.filter_and_convert over the whole
    file ("filters"). Returns the stats. An APIStopError ends the run (re-raised after the stats are
    written); a budget stop or a failed trajectory does not."""
    _repair_tail(out)
    have = done_ids(out)
    todo, seen = [], set(have)
    for q in queries:  # a query listed twice is written once
        if q["id"] not in seen:
            seen.add(q["id"])
            todo.append(q)
    stats = {"queries": len(queries), "resumed": len({q["id"] for q in queries} & have), "written": 0,
             "failed": 0, "duplicates": len(queries) - len({q["id"] for q in queries}),
             "stopped": None}
    lock = threading.Lock()
    stop = threading.Event()
    fatal: list = []
    t0 = time.perf_counter()

    def one(q):
        if stop.is_set():
            return
        try:
            tr = teacher.trajectory(q["query"], system)
        except BudgetReached as e:
            stop.set()
            stats["stopped"] = "budget"
            log.warning("%s: stopping (trajectories in flight are not written; their replies are cached)", e)
            return
        except Exception as e:
            if getattr(e, "stops_run", False):
                stop.set()
                fatal.append(e)
                return
            with lock:
                stats["failed"] += 1
            log.warning("query %s failed: %s", q["id"], e)
            return
        line = json.dumps({"id": q["id"], **tr}, ensure_ascii=False) + "\n"
        with lock:
            with open(out, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            stats["written"] += 1

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with cf.ThreadPoolExecutor(max_workers=max(1, teacher.config.concurrency)) as ex:
        list(ex.map(one, todo))
    with open(out, encoding="utf-8") if os.path.exists(out) else open(os.devnull) as fh:
        fstats = filter_and_convert([json.loads(line) for line in fh if line.strip()])[1]
    stats.update({"seconds": round(time.perf_counter() - t0, 2), "teacher": teacher.config.model,
                  **teacher.meter.as_dict(), "filters": fstats,
                  "price_source": teacher.prices.source if teacher.prices else "unknown"})
    if fatal:
        stats["stopped"] = str(fatal[0])
    write_stats(out + ".stats.json", stats)
    if fatal:
        raise fatal[0]
    return stats


# Assumptions of the dry run's cost plan (ours; every one is printed).
GEN_ASSUMPTIONS = {
    "tool_calls": 6.0,  # mean search calls per trajectory (of at most 10)
    "system_tokens": 400,  # scaffold.SYSTEM_PROMPT
    "query_tokens": 120,
    "turn_out_tokens": 350,  # plan + first call, or one state evaluation + the next call
    "final_out_tokens": 2500,  # the last evaluation, the review and the answer
    "tool_output_tokens": 600,  # 5 snippets
    "thinking_tokens": 800,  # per request, billed as output (a thinking teacher)
}


def cost_plan(n_queries: int, prices, assume: dict | None = None) -> dict:
    """Calls, tokens and USD for n_queries trajectories under GEN_ASSUMPTIONS (or overrides).
    Each call re-sends the conversation so far: call j (0-based) reads system + query + j x (turn
    output + tool output) tokens. prices: pricing.Prices or None (unknown USD)."""
    a = {**GEN_ASSUMPTIONS, **(assume or {})}
    c = int(round(a["tool_calls"]))
    calls = c + 1
    base = a["system_tokens"] + a["query_tokens"]
    step = a["turn_out_tokens"] + a["tool_output_tokens"]
    # Eq.: tokens_in per trajectory = sum_{j=0..c} (base + j x step)
    tin = calls * base + step * c * (c + 1) / 2
    tout = c * a["turn_out_tokens"] + a["final_out_tokens"] + calls * a["thinking_tokens"]
    per = prices.request_cost(tin / calls, tout / calls) * calls if prices else None
    return {"queries": n_queries, "calls": n_queries * calls, "tokens_in": int(n_queries * tin),
            "tokens_out": int(n_queries * tout), "usd": per * n_queries if per is not None else None,
            "search_calls": n_queries * c, "assumptions": a}


def dry_run_text(cfg: TeacherConfig, n_queries: int) -> str:
    prices = resolve_prices(cfg.model, cfg.price_in, cfg.price_out)
    p = cost_plan(n_queries, prices)
    usd = f"${p['usd']:,.2f}" if p["usd"] is not None else "unknown (no price: give --price-in/--price-out)"
    lines = ["RubricEM SFT teacher: dry run (nothing is sent)",
             f"  teacher {cfg.backend} {cfg.model} at {cfg.url_root}; key from ${cfg.key_env}",
             f"  search {cfg.search_backend} ({cfg.search_base_url}), k {cfg.search_k}; "
             f"concurrency {cfg.concurrency}, budget cap "
             + (f"${cfg.max_usd:,.2f}" if cfg.max_usd > 0 else "none"),
             f"  queries {n_queries}: {p['calls']:,} teacher calls, {p['tokens_in']:,} input tokens, "
             f"{p['tokens_out']:,} output tokens, {p['search_calls']:,} searches",
             f"  teacher cost: {usd}"
             + (f" (prices {prices.price_in:g} / {prices.price_out:g} USD per 1M tokens, {prices.source})"
                if prices else ""),
             "  assumptions:"] + [f"    - {k} = {v:g}" for k, v in p["assumptions"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    """`python -m backends.sft.teacher --queries Q.jsonl --out OUT.jsonl [--dry-run] [options]`."""
    ap = argparse.ArgumentParser(prog="python -m backends.sft.teacher", description=__doc__.split("\n")[0])
    ap.add_argument("--queries", required=True, help="JSONL of queries (query / messages)")
    ap.add_argument("--out", required=True, help="output JSONL (appended; resumed)")
    ap.add_argument("--limit", type=int, default=0, help="first N queries (0 = all)")
    ap.add_argument("--dry-run", action="store_true", help="print calls, tokens and dollars; send nothing")
    for f in TeacherConfig.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = ap.parse_args(argv)
    cfg = TeacherConfig(**{k: getattr(a, k) for k in TeacherConfig.__dataclass_fields__})
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    queries = read_queries(a.queries, a.limit)
    if a.dry_run:
        print(dry_run_text(cfg, len(queries)))
        return 0
    missing = [v for v in (cfg.key_env, "SERPER_API_KEY") if not os.environ.get(v)]
    if cfg.backend == "openai" and cfg.key_env in missing and cfg.base_url:
        missing.remove(cfg.key_env)  # a self-hosted OpenAI-compatible server may need no key
    if missing:
        raise SystemExit(f"sft_teacher: set {' and '.join(missing)} (keys come from the environment only)")
    if cfg.search_backend != "serper":
        raise SystemExit("sft_teacher: --search-backend must be 'serper' (the toy world's BM25 "
                         "has its own scripted teacher, toy/sft.py)")
    tool = SerperSearchTool(SearchHTTPConfig(base_url=cfg.search_base_url), k=cfg.search_k)
    teacher = Teacher(cfg, tool, cache_dir=a.out + ".cache")
    try:
        stats = generate(queries, a.out, teacher)
    except Exception as e:
        if getattr(e, "stops_run", False):
            print(f"sft_teacher: stopped: {e}")
            return getattr(e, "exit_code", 4)
        raise
    finally:
        teacher.close()
        tool.close()
    print(json.dumps({k: stats[k] for k in ("queries", "resumed", "written", "failed", "stopped",
                                             "calls", "cached_calls", "usd", "max_tokens_stops")}))
    print(f"filters: {json.dumps(stats['filters'])}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
