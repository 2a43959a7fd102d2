"""`google_search` over a Serper-compatible web-search API: the tool environment T of §3.1 in full mode.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the search tool of §3.1-3.2 (`<call_tool name="google_search">query</call_tool>`) for full
mode, behind the same `scaffold.SearchTool` interface as the toy `BM25SearchTool`: called as
`tool(query) -> list[SearchResult]`, named "google_search", so trajectories read the same in both modes.

Wire format (Serper): POST {base_url}/search, header `X-API-KEY: <key>`, JSON {"q": query, "num": k};
reply {"organic": [{"title", "link", "snippet", ...}, ...]} -> SearchResult(doc_id=link, title,
text=snippet), in the API's order, at most k.

Failure semantics: requests go through backends/api/http.HTTPClient (the environment's proxy; connect
errors and read timeouts retried by urllib3; 429/5xx retried waiting the server's Retry-After, a 429
pausing every search request; at most `max_retries` of each; at most `search_http.rpm` requests per
minute, `# SCALE:`); after the bound, or on any other HTTP error or a malformed reply, the call raises
`SearchError` with a short reason. A 401/403/404 raises `backends.api.http.APIStopError` with the
server's message instead: the rollout engine lets it through and the run stops. The
rollout engine turns a raising tool into "error: search failed" inside <tool_output>, so a failing API
never ends a rollout. The key is read from the environment at call time and never logged or cached.

Deviations from the paper
1. The paper names the tool ("google_search", as in DR Tulu) but not its provider; Serper is our
   choice because its reply maps one-to-one onto `SearchResult`. Any server speaking the same format
   works (`base_url`).
2. Results are cached on disk per (base_url, query, k) with no expiry: a replayed query (the §3.5
   curriculum replays batches) sees the same web it saw the first time, which keeps within-episode
   reflections about the same evidence. Set `cache_dir=""` for a live web.

Usage:
    export SERPER_API_KEY=...
    tools = {"google_search": SerperSearchTool(SearchHTTPConfig(), k=5)}   # scaffold.RolloutEngine(tools=...)
"""
from __future__ import annotations

import logging
import os
import threading

from backends.api.http import DiskCache, HTTPClient, cache_key, server_message
from backends.api.settings import SearchHTTPConfig, check_search_config
from scaffold import SearchResult

log = logging.getLogger("rubricem.search_http")


class SearchError(RuntimeError):
    """A search call that failed after the retry bound (or got a non-retryable error)."""


class SerperSearchTool:
    """`google_search` over a Serper-compatible API (same interface as world.BM25SearchTool)."""

    name = "google_search"

    def __init__(self, config: SearchHTTPConfig | None = None, k: int = 5):
        """config: the run config's search_http section (default: Serper's public endpoint, no disk
        cache); k: results per query (search.k, Serper "num"). Raises ValueError (check_search_config)."""
        self.config = config or SearchHTTPConfig()
        self.k = k
        check_search_config(self.config, k)
        self.cache = DiskCache(self.config.cache_dir)
        c = self.config
        # SCALE: proxy, Retry-After, 429 back-off and search_http.rpm (backends/api/http.py)
        self.client = HTTPClient("search", max_retries=c.max_retries, backoff_s=c.backoff_s,
                                 backoff_max_s=c.backoff_max_s, timeout_s=c.timeout_s, concurrency=4,
                                 rpm=c.rpm, retry_reads=True)
        self._lock = threading.Lock()
        self.counters = {"calls": 0, "requests": 0, "retries": 0, "failures": 0, "cache_hits": 0}

    def _inc(self, key: str, by: int = 1) -> None:
        with self._lock:
            self.counters[key] += by

    def stats(self) -> dict:
        """Cumulative counts: search/calls, search/requests, search/retries, search/failures,
        search/cache_hits."""
        with self._lock:
            return {f"search/{k}": v for k, v in self.counters.items()}

    def close(self) -> None:
        """Release the connections."""
        self.client.close()

    def __call__(self, query: str) -> list[SearchResult]:
        """Top-k web results for `query` (str). Returns [] for a blank query or no hits.

        Raises SearchError (with the reason: missing key variable, HTTP status after retries,
        connection failure, malformed reply) after the retry bound. Never returns partial garbage.
        """
        import requests  # lazy: requests only when a search runs

        c = self.config
        q = " ".join(str(query).split())
        if not q:
            return []
        self._inc("calls")
        key = cache_key("serper", c.base_url.rstrip("/"), q, self.k)
        hit = self.cache.get(key)
        if hit is not None:
            try:
                out = [SearchResult(str(d["doc_id"]), str(d["title"]), str(d["text"])) for d in hit]
                self._inc("cache_hits")
                return out
            except (KeyError, TypeError):
                pass  # corrupt entry: a miss
        api_key = os.environ.get(c.api_key_env, "")
        if not api_key:
            self._inc("failures")
            raise SearchError(f"environment variable {c.api_key_env} is not set")
        try:
            resp, n_retry, _, _ = self.client.post(f"{c.base_url.rstrip('/')}/search",
                                                   {"q": q, "num": self.k}, {"X-API-KEY": api_key})
        except requests.exceptions.RequestException as e:
            self._inc("requests")
            self._inc("failures")
            raise SearchError(f"search request failed after retries ({type(e).__name__})") from None
        except RuntimeError:  # APIStopError (401/403/404: stops the run), DeadlineExceeded
            self._inc("requests")
            self._inc("failures")
            raise
        self._inc("requests", 1 + n_retry)
        self._inc("retries", n_retry)
        if resp.status_code != 200:
            self._inc("failures")
            raise SearchError(f"search API returned HTTP {resp.status_code} after {n_retry} retries: "
                              f"{server_message(resp, 160)}")
        try:
            organic = resp.json().get("organic", [])
            out = [SearchResult(str(r["link"]), str(r.get("title", "")),
                                str(r.get("snippet", ""))[: c.max_snippet_chars])
                   for r in organic[: self.k]]
        except (ValueError, KeyError, TypeError, AttributeError):
            self._inc("failures")
            raise SearchError("search API reply is not the expected JSON") from None
        self.cache.put(key, [{"doc_id": r.doc_id, "title": r.title, "text": r.text} for r in out],
                       {"provider": "serper"})
        return out
