"""The HTTP backends' sections of the run configuration: `judge_http` (HTTPJudgeConfig, how the HTTP
judge calls its model) and `search_http` (SearchHTTPConfig, how web search calls its API), with
their checks.

Not part of the paper's method: transport. Which model judges (judge.backend, judge.model) and the
buffer caps are the paper's (hparams.JudgeConfig), as are search.backend and search.k
(hparams.SearchConfig). Nothing here opens a connection or imports requests: backends/run/presets.py
registers both sections, and a toy run leaves them out (None).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from backends.api.pricing import resolve_prices, unknown_price_message
from hparams import JudgeConfig


# ----------------------------------------------------------------------------------------------------
# Configuration (the run config's `judge_http` section; the paper's judge settings are hparams.JudgeConfig)

# The HTTP judge's public endpoints and key variables.
DEFAULT_BASE_URLS = {"gemini": "https://generativelanguage.googleapis.com/v1beta",
                     "openai": "https://api.openai.com/v1"}
DEFAULT_KEY_ENVS = {"gemini": "GEMINI_API_KEY", "openai": "OPENAI_API_KEY"}


@dataclass
class HTTPJudgeConfig:
    """How the HTTP judge calls its model: endpoint, key, concurrency, retries, cache, prices, rate
    limits, request options (not in the paper: transport). Which model judges (judge.backend,
    judge.model) and the buffer caps are the paper's (hparams.JudgeConfig). Holds the *name* of the
    key's environment variable, never the key. Times in seconds; prices in USD per 1M tokens."""

    base_url: str = ""
    """API root without a trailing slash; "" = the backend's public endpoint (DEFAULT_BASE_URLS);
    tests point it at a loopback server."""
    api_key_env: str = ""
    """Environment variable holding the key; "" = GEMINI_API_KEY / OPENAI_API_KEY. Optional for openai."""
    concurrency: int = 8
    """Maximum parallel HTTP judge requests (thread pool + semaphore). With ~6 s per call, 8 in flight
    judge a paper-scale step's 288 task calls in ~3.6 min (the dry run's plan); raise it (32-64) where
    the provider's quota allows."""
    timeout_s: float = 120.0
    """Connect and read timeout of one request; a read timeout is re-asked (counts as a retry)."""
    backoff_s: float = 1.0
    """Base of the exponential backoff: waits backoff_s * 2^(attempt-1), capped at backoff_max_s."""
    backoff_max_s: float = 30.0
    """Cap of one backoff wait."""
    cache_dir: str = ""
    """Disk cache of validated HTTP replies. In a training run "" = cache_dir/judge (the run's cache
    folder); for an HTTPJudge built on its own, "" disables it."""
    prompt_version: str = "v1"
    """Part of the cache key: change it when the prompts change."""
    price_in: float = -1.0
    """USD per 1M input tokens; -1 = the dated table in backends/api/pricing.py (a model not in it has an
    unknown cost: give price_in and price_out, e.g. 0 for a self-hosted server)."""
    price_out: float = -1.0
    """USD per 1M output tokens (thinking tokens included); -1 = backends/api/pricing.py."""
    max_usd: float = 0.0
    """Ours: stop the run (a checkpoint, then exit) once the judge has spent this many USD in
    total (judge/usd_total); 0 = no cap. Needs a known price."""
    rpm: int = 0
    """Ours: at most this many judge requests started per minute (0 = no limit; 429s are backed
    off in any case, backends/api/http.py)."""
    tpm: int = 0
    """Ours: the provider's tokens-per-minute quota for the judge's model (0 = unknown / unlimited).
    The client paces itself to it (backends/api/http.RateLimiter: each request's tokens, estimated
    before it is sent and corrected by the reply's usage, must fit the last 60 s) instead of running
    into 429s. The Gemini API counts input tokens only (its rate-limit page: "Tokens per minute
    (input)"); an OpenAI-compatible server input + output. The dry run's step-time plan takes the
    judge phase as at least a step's judge input tokens / tpm (backends/distributed/plan.py)."""
    retry_after_max_s: float = 120.0
    """A 429's Retry-After up to this long is waited out (pausing every judge request); a longer
    one fails the call at once."""
    thinking_budget: int = -1
    """Gemini generationConfig.thinkingConfig.thinkingBudget: -1 = not sent (the model's default,
    dynamic thinking on 2.5 models); 0 disables thinking where the model allows it (2.5 Flash,
    not 2.5 Pro); N > 0 caps thinking tokens."""
    temperature: float = 0.0
    """Judge sampling temperature; 0 keeps rewards as reproducible as the API allows (our choice)."""
    max_output_tokens: int = 0
    """0 = the server's default."""
    gemini_schema_field: str = "responseSchema"
    """"responseSchema" (OpenAPI subset) or "responseJsonSchema" (JSON Schema) in generationConfig."""
    openai_response_format: str = "json_schema"
    """"json_schema" (strict structured output) or "json_object" for servers without schema support."""
    max_text_chars: int = 40000
    """Each untrusted block (one stage of a response, one candidate) is cut to this many characters."""

    def url_root(self, backend: str) -> str:
        """The API root of `backend` ("gemini" | "openai"), without a trailing slash."""
        return (self.base_url or DEFAULT_BASE_URLS[backend]).rstrip("/")

    def key_env(self, backend: str) -> str:
        """The environment variable that holds `backend`'s key."""
        return self.api_key_env or DEFAULT_KEY_ENVS[backend]

    def check(self, judge: JudgeConfig) -> None:
        """check_http_config(judge, self): raises ValueError naming the field."""
        check_http_config(judge, self)


def judge_configs(**kw) -> tuple[JudgeConfig, HTTPJudgeConfig]:
    """(judge section, judge_http section) from keyword arguments of both, split by field name, e.g.
    judge_configs(backend="openai", model="m", base_url=url). Raises TypeError for a name of neither."""
    names = {f.name for f in dataclasses.fields(JudgeConfig)}
    return (JudgeConfig(**{k: v for k, v in kw.items() if k in names}),
            HTTPJudgeConfig(**{k: v for k, v in kw.items() if k not in names}))


def check_http_config(c: JudgeConfig, h: HTTPJudgeConfig) -> None:
    """Raise ValueError naming the field when the judge and judge_http sections cannot drive HTTPJudge."""
    if c.backend not in DEFAULT_BASE_URLS:
        raise ValueError(f"judge.backend must be 'gemini' or 'openai' for the HTTP judge, got {c.backend!r}")
    if h.gemini_schema_field not in ("responseSchema", "responseJsonSchema"):
        raise ValueError("judge_http.gemini_schema_field must be 'responseSchema' or 'responseJsonSchema'")
    if h.openai_response_format not in ("json_schema", "json_object"):
        raise ValueError("judge_http.openai_response_format must be 'json_schema' or 'json_object'")
    if c.max_retries < 0 or h.concurrency < 1 or h.timeout_s <= 0:
        raise ValueError("judge.max_retries must be >= 0; judge_http: need concurrency >= 1 and timeout_s > 0")
    if h.rpm < 0 or h.tpm < 0 or h.retry_after_max_s < 0 or h.max_usd < 0:
        raise ValueError("judge_http: need rpm, tpm, retry_after_max_s and max_usd >= 0 (0 = no limit)")
    if h.thinking_budget < -1:
        raise ValueError("judge_http.thinking_budget must be -1 (model default), 0 (off) or a token count")
    prices = resolve_prices(c.model, h.price_in, h.price_out)  # ValueError when only one is given
    if h.max_usd > 0 and prices is None:
        raise ValueError("judge_http.max_usd needs a known price: " + unknown_price_message(c.model))


# ----------------------------------------------------------------------------------------------------
# Configuration (the run config's `search_http` section; search.backend and search.k are the paper
# layer's, hparams.SearchConfig)


@dataclass
class SearchHTTPConfig:
    """How the web search tool calls its API (not in the paper: transport): endpoint, key, timeouts,
    retries, cache, rate limit. Holds the *name* of the key's environment variable, never the key."""

    base_url: str = "https://google.serper.dev"
    """Serper-compatible API root without a trailing slash (tests point it at a loopback server)."""
    api_key_env: str = "SERPER_API_KEY"
    """Environment variable holding the Serper key."""
    timeout_s: float = 15.0
    """Connect and read timeout of one search request."""
    max_retries: int = 3
    """Bound per kind (connect errors, read timeouts, 429/5xx statuses) before SearchError."""
    backoff_s: float = 0.5
    """Backoff base: waits backoff_s * 2^(retry-1), capped at backoff_max_s (the first retry is
    immediate in urllib3 2)."""
    backoff_max_s: float = 8.0
    """Cap of one backoff wait."""
    cache_dir: str = ""
    """Disk cache of result lists. In a training run "" = cache_dir/search (the run's cache folder);
    for a SerperSearchTool built on its own, "" disables it."""
    max_snippet_chars: int = 1000
    """Each search result's text is cut to this many characters."""
    rpm: int = 0
    """Ours: at most this many search requests started per minute (0 = no limit; a 429's
    Retry-After is honoured in any case, backends/api/http.py)."""

    def check(self, k: int = 5) -> None:
        """check_search_config(self, k): raises ValueError naming the field."""
        check_search_config(self, k)


def check_search_config(c: SearchHTTPConfig, k: int = 5) -> None:
    """Raise ValueError naming the field when the search_http section (and search.k) cannot drive
    SerperSearchTool."""
    if k < 1:
        raise ValueError(f"search.k must be >= 1, got {k!r}")
    if c.max_retries < 0 or c.timeout_s <= 0:
        raise ValueError("search_http: need max_retries >= 0 and timeout_s > 0")
    if c.rpm < 0:
        raise ValueError("search_http.rpm must be >= 0 (0 = no limit)")
