"""HTTP plumbing of the full-mode backends (the judge, backends/api/judge_http.py; web search,
backends/api/search_http.py; the benchmark grader, evaluate.py): one rate-limit-aware client
(`HTTPClient`) and an atomic on-disk cache of replies. Not in the paper; `requests` is imported only
when a session is made, so a toy run never loads it.

What the client does with a request (`HTTPClient.post`), every line `# SCALE:` (no effect on the math):
1. Proxy: the session takes HTTPS_PROXY / HTTP_PROXY / NO_PROXY (and REQUESTS_CA_BUNDLE) from the
   environment, as `requests` does by default; ~/.netrc is never read (it would replace our
   Authorization header).
2. Admission (`RateLimiter`): at most `limit` requests in flight, where `limit` starts at the
   configured concurrency, halves on a 429 (once per throttling episode: the 429s of requests
   already in flight during the pause cut no further) and grows back by one after `limit`
   successes in a row (additive increase, multiplicative decrease); at most `rpm` requests and `tpm` tokens
   (estimated before, corrected after) started in any sliding 60 s window (0 = no limit).
3. Retries: connect errors are retried by urllib3 (at most max_retries, capped exponential backoff).
   429 / 500 / 502 / 503 / 504 are retried by us, at most max_retries times: we wait Retry-After when
   the server sends one (delta-seconds or an HTTP-date; `retry-after-ms` first, as OpenAI's own
   client reads it; or the Gemini API's RetryInfo retryDelay in the error body), else backoff_s * 2^attempt capped at
   backoff_max_s. A 429 pauses *every* request of the client until then, not only this one. A
   Retry-After longer than `retry_after_max_s` is not waited out: the answer is returned at once
   (a daily quota would otherwise hang the run for hours).
4. 401 / 403 / 404 (and a 400 that says the API key is invalid, as the Gemini API answers a wrong
   key) are never retried: `APIStopError` carries the server's own message, and the
   training loop and evaluate.py stop at once with it (a wrong key, model name or base URL). The
   client then sends nothing more: every later `post` raises the same error.
5. Deadline: with `deadline` set (time.monotonic() seconds) no request starts after it and none
   runs past it (`DeadlineExceeded`).
"""
from __future__ import annotations

import email.utils
import hashlib
import json
import math
import os
import tempfile
import threading
import time
from typing import Any

RETRY_STATUSES = (429, 500, 502, 503, 504)  # retried (rate limit, server errors)
STOP_STATUSES = (401, 403, 404)  # never retried: the run stops with the server's message


class APIStopError(RuntimeError):
    """An HTTP answer no retry can fix (401 / 403 / 404): wrong key, no permission, unknown model or
    wrong base URL. The training loop and evaluate.py turn it into a clean exit with this message;
    judge and search code re-raise it instead of counting a failure (`stops_run` marks it)."""

    stops_run = True
    exit_code = 4

    def __init__(self, service: str, status: int, url: str, message: str):
        self.service, self.status, self.url, self.server_message = service, status, url, message
        hint = {400: "the API key is not valid", 401: "check the API key", 403: "the key lacks permission for this model or API",
                404: "check the model name and the base URL"}.get(status, "")
        super().__init__(f"{service}: HTTP {status} from {url}: {message or '(no message)'}"
                         + (f" ({hint}; not retried)" if hint else " (not retried)"))


class DeadlineExceeded(RuntimeError):
    """The client's overall deadline passed before the request could finish."""


def server_message(resp, limit: int = 300) -> str:
    """The server's error text from a non-200 answer: JSON error.message (Gemini, OpenAI), error,
    message or detail (vLLM, FastAPI), else the body's start; one line, at most `limit` chars."""
    msg = ""
    try:
        data = resp.json()
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            msg = str(err.get("message") or err.get("status") or err)
        elif err:
            msg = str(err)
        elif isinstance(data, dict):
            msg = str(data.get("message") or data.get("detail") or "")
    except (ValueError, AttributeError):
        pass
    if not msg:
        msg = (getattr(resp, "text", "") or "").strip()
    return " ".join(msg.split())[:limit]


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (RFC 9110 §10.2.3): delta-seconds ("120") or an
    HTTP-date ("Wed, 21 Oct 2026 07:28:00 GMT", waited until then; a past date is 0). None when
    absent or unreadable. now: the wall clock (time.time()) to measure a date against."""
    if value is None:
        return None
    v = str(value).strip()
    if not v:
        return None
    try:
        s = float(v)
        return s if math.isfinite(s) and s >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_info_delay(resp) -> float | None:
    """Seconds from a Google RPC error body's RetryInfo (the Gemini API's 429 RESOURCE_EXHAUSTED
    carries `error.details[] = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay":
    "36s"}` rather than a Retry-After header); None when absent or unreadable."""
    try:
        details = resp.json()["error"]["details"]
        for d in details:
            if str(d.get("@type", "")).endswith("google.rpc.RetryInfo"):
                v = str(d.get("retryDelay", "")).strip()
                sec = float(v[:-1]) if v.endswith("s") else float(v)
                return sec if math.isfinite(sec) and sec >= 0 else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return None


def is_bad_key(resp) -> bool:
    """A 400 that says the API key is invalid (the Gemini API answers a wrong key with 400
    INVALID_ARGUMENT, reason API_KEY_INVALID, not 401): as final as a 401."""
    if resp.status_code != 400:
        return False
    try:
        err = resp.json()["error"]
        reasons = {str(d.get("reason", "")) for d in err.get("details", []) if isinstance(d, dict)}
        return "API_KEY_INVALID" in reasons or "API key not valid" in str(err.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def make_session(max_retries: int, backoff_s: float, backoff_max_s: float, pool: int,
                 retry_reads: bool):
    """A `requests.Session` whose adapter retries connect errors (and read timeouts when
    retry_reads) with capped exponential backoff; HTTP statuses are left to `HTTPClient.post`.

    max_retries (int >= 0): bound per kind; backoff_s, backoff_max_s (s): backoff base and cap;
    pool: connection-pool size. The proxy comes from the environment (trust_env); ~/.netrc does not.
    """
    import requests  # lazy: requests / urllib3 only when an HTTP session opens
    from requests.adapters import HTTPAdapter  # lazy: requests / urllib3 only when an HTTP session opens
    from urllib3.util.retry import Retry  # lazy: requests / urllib3 only when an HTTP session opens

    retry = Retry(total=None, connect=max_retries, read=max_retries if retry_reads else False,
                  status=0, other=0, allowed_methods=frozenset({"POST"}), backoff_factor=backoff_s,
                  backoff_max=backoff_max_s, raise_on_status=False)
    s = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_connections=1, pool_maxsize=max(1, pool))
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    # SCALE: HTTPS_PROXY / NO_PROXY / REQUESTS_CA_BUNDLE are honoured (trust_env, requests' default);
    # a no-op auth keeps requests from reading ~/.netrc, which would replace our Authorization.
    s.trust_env = True
    s.auth = _no_netrc
    return s


def _no_netrc(r):
    return r


def transport_retries(resp) -> int:
    """How many retries urllib3 made before `resp` (0 if unknown)."""
    r = getattr(getattr(resp, "raw", None), "retries", None)
    return len(getattr(r, "history", ()) or ())


class RateLimiter:
    """Admission control shared by every thread of one client (see the module docstring, point 2).

    concurrency: the most requests in flight (the AIMD ceiling); rpm, tpm: requests and tokens per
    `window_s` seconds (0 = unlimited). The tokens-per-minute pacing keeps a log of the window's
    requests with their estimated tokens (corrected by `add_tokens` once the reply's usage is known):
    a request starts only when it fits beside what the last window_s seconds started, so the client
    stays inside a provider's quota instead of running into its 429s. clock: seconds, monotonic
    (time.monotonic; tests pass a fake one). Thread-safe. `stats()` gives the current limit, the
    number of throttling answers and the seconds spent waiting for admission.
    """

    def __init__(self, concurrency: int, rpm: int = 0, tpm: int = 0, window_s: float = 60.0,
                 clock=time.monotonic):
        if concurrency < 1 or rpm < 0 or tpm < 0 or window_s <= 0:
            raise ValueError("rate limiter: need concurrency >= 1, rpm >= 0, tpm >= 0, window_s > 0")
        self.max_limit, self.rpm, self.tpm, self.window_s = concurrency, rpm, tpm, window_s
        self.clock = clock
        self.limit, self.in_flight, self._ok_streak = concurrency, 0, 0
        self.paused_until = 0.0  # clock(): no request starts before this
        self._window: list = []  # [start time, tokens] of requests started in the last window_s
        self._cv = threading.Condition()
        self.throttled, self.waited_s, self.peak_in_flight = 0, 0.0, 0

    def _blocked(self, now: float, tokens: int) -> float:
        """Seconds until a request of `tokens` may start (0: now)."""
        self._window = [e for e in self._window if e[0] > now - self.window_s]
        waits = [self.paused_until - now]
        if self.in_flight >= self.limit:
            waits.append(0.05)  # woken by a release
        if self.rpm and len(self._window) >= self.rpm:
            waits.append(self._window[-self.rpm][0] + self.window_s - now)
        if self.tpm and self._window:
            used = sum(e[1] for e in self._window)
            # wait until enough old entries age out; a request larger than tpm on its own waits for
            # an empty window and then starts alone
            need = used + tokens - self.tpm if tokens <= self.tpm else used
            if need > 0:
                for t, n in self._window:
                    need -= n
                    if need <= 0:
                        waits.append(t + self.window_s - now)
                        break
        return max(waits)

    def wait_s(self, tokens: int = 0) -> float:
        """Seconds until a request of about `tokens` tokens may start (0: now), by the clock."""
        with self._cv:
            return max(0.0, self._blocked(self.clock(), tokens))

    def acquire(self, tokens: int = 0, deadline: float | None = None) -> list:
        """Block until a request of about `tokens` tokens may start; returns its ticket. Raises
        DeadlineExceeded when `deadline` (by the clock: time.monotonic()) comes first."""
        t0 = self.clock()
        with self._cv:
            while True:
                now = self.clock()
                wait = self._blocked(now, tokens)
                if wait <= 0:
                    break
                if deadline is not None and now + min(wait, 0.05) >= deadline:
                    raise DeadlineExceeded("deadline reached while waiting for the rate limit")
                self._cv.wait(timeout=min(wait, 0.5))
            ticket = [now, int(tokens)]
            self._window.append(ticket)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.waited_s += now - t0
        return ticket

    def release(self, ticket: list, throttled: bool = False, pause_s: float = 0.0) -> None:
        """End a request. throttled (a 429): halve the limit and pause every request for pause_s."""
        with self._cv:
            self.in_flight -= 1
            if throttled:
                self.throttled += 1
                now = self.clock()
                if now >= self.paused_until:  # one cut per throttling episode: the other 429s of
                    self.limit = max(1, self.limit // 2)  # requests already in flight cut no more
                self._ok_streak = 0
                self.paused_until = max(self.paused_until, now + pause_s)
            else:
                self._ok_streak += 1
                if self._ok_streak >= self.limit and self.limit < self.max_limit:
                    self.limit += 1
                    self._ok_streak = 0
            self._cv.notify_all()

    def add_tokens(self, ticket: list, tokens: int) -> None:
        """Correct a started request's token count once the reply's usage is known."""
        with self._cv:
            ticket[1] = int(tokens)
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return {"limit": self.limit, "throttled": self.throttled,
                    "wait_s": round(self.waited_s, 3), "peak_in_flight": self.peak_in_flight}


class HTTPClient:
    """The rate-limit-aware POST client of the judge, search and evaluate.py (module docstring).

    service: a name for messages ("judge", "search"); timeout_s: connect and read timeout of one
    request; retry_reads: urllib3 also retries read timeouts (search; the judge re-asks itself).
    Thread-safe: one `requests.Session` per thread. `close()` releases the connections.
    """

    def __init__(self, service: str, *, max_retries: int = 3, backoff_s: float = 1.0,
                 backoff_max_s: float = 30.0, timeout_s: float = 120.0, concurrency: int = 8,
                 rpm: int = 0, tpm: int = 0, retry_after_max_s: float = 120.0,
                 retry_reads: bool = False, window_s: float = 60.0):
        if max_retries < 0 or timeout_s <= 0 or retry_after_max_s < 0:
            raise ValueError(f"{service}: need max_retries >= 0, timeout_s > 0, retry_after_max_s >= 0")
        self.service, self.max_retries, self.timeout_s = service, max_retries, timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.retry_after_max_s, self.retry_reads, self.pool = retry_after_max_s, retry_reads, concurrency
        self.limiter = RateLimiter(concurrency, rpm, tpm, window_s)
        self.deadline: float | None = None  # time.monotonic() after which nothing is sent
        self._local = threading.local()
        self._sessions: list = []
        self._lock = threading.Lock()
        self.status_retries = 0
        self.stopped: APIStopError | None = None  # after a 401/403/404 nothing more is sent

    def session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = make_session(self.max_retries, self.backoff_s,
                                                   self.backoff_max_s, self.pool, self.retry_reads)
            with self._lock:
                self._sessions.append(s)
        return s

    def close(self) -> None:
        with self._lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def post(self, url: str, body: Any, headers: dict, tokens: int = 0) -> tuple[Any, int, int, list]:
        """POST `body` as JSON; returns (response, retries made, 429 answers among them, the ticket
        for `limiter.add_tokens`).

        The response is a 200, or the last non-200 once the retries are spent (or a Retry-After
        beyond retry_after_max_s). Raises APIStopError (401/403/404, never retried),
        DeadlineExceeded, or requests' exceptions for connect errors and timeouts after urllib3's
        own retries. tokens: the request's estimated tokens for the tokens-per-minute limit.
        """
        retries = throttled = 0
        while True:
            if self.stopped is not None:  # another call got a 401/403/404: send nothing more
                raise self.stopped
            left = self._left()
            if left is not None and left <= 0:
                raise DeadlineExceeded(f"{self.service}: deadline reached")
            ticket = self.limiter.acquire(tokens, self.deadline)
            left = self._left()
            timeout = self.timeout_s if left is None else max(0.01, min(self.timeout_s, left))
            try:
                resp = self.session().post(url, json=body, headers=headers, timeout=timeout)
            except BaseException:
                self.limiter.release(ticket)
                raise
            retries += transport_retries(resp)
            st = resp.status_code
            if st in STOP_STATUSES or is_bad_key(resp):
                self.limiter.release(ticket)
                self.stopped = APIStopError(self.service, st, url.split("?")[0], server_message(resp))
                raise self.stopped
            if st not in RETRY_STATUSES:
                self.limiter.release(ticket)
                return resp, retries, throttled, ticket
            ms = parse_retry_after(resp.headers.get("retry-after-ms"))  # OpenAI / Azure, milliseconds
            ra = ms / 1000 if ms is not None else parse_retry_after(resp.headers.get("Retry-After"))
            if ra is None:
                ra = retry_info_delay(resp)
            # SCALE: the server's Retry-After when it sends one, else capped exponential backoff
            wait = ra if ra is not None else min(self.backoff_max_s, self.backoff_s * 2 ** retries)
            give_up = retries >= self.max_retries or wait > self.retry_after_max_s
            left = self._left()
            if left is not None and wait >= left:
                give_up = True
            throttled += st == 429
            self.limiter.release(ticket, throttled=st == 429, pause_s=0.0 if give_up else wait)
            if give_up:
                return resp, retries, throttled, ticket
            if st != 429:  # a 429 pauses the whole client inside the limiter; a 5xx only this call
                time.sleep(wait)
            retries += 1
            with self._lock:
                self.status_retries += 1


class DiskCache:
    """JSON values under `root/ab/<sha256>.json`, written atomically (tmp file + os.replace).

    `root` "" disables the cache (get -> None, put -> no-op). A file that cannot be read or parsed is
    a miss. Keys are sha256 hex digests computed by the caller over non-secret request fields.
    """

    def __init__(self, root: str):
        self.root = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".json")

    def get(self, key: str) -> Any | None:
        if not self.root:
            return None
        try:
            with open(self._path(key), encoding="utf-8") as fh:
                return json.load(fh)["value"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, value: Any, meta: dict | None = None) -> None:
        if not self.root:
            return
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"key": key, "meta": meta or {}, "value": value}, fh, ensure_ascii=False)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def cache_key(*parts: Any) -> str:
    """sha256 over the canonical JSON of `parts` (sorted keys); never pass secrets here."""
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
