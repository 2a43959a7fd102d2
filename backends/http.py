"""HTTP plumbing of the full-mode backends (the judge, backends/judge_http.py, and web search,
backends/search_http.py): a `requests` session with urllib3 transport retries, and an atomic
on-disk cache of replies. Not in the paper; `requests` is imported only when a session is made, so
a toy run never loads it.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

RETRY_STATUSES = (429, 500, 502, 503, 504)  # HTTP statuses retried by the transport (rate limit, 5xx)



def make_session(max_retries: int, backoff_s: float, backoff_max_s: float, pool: int,
                 retry_reads: bool):
    """A `requests.Session` whose adapter retries connect errors and 429/5xx on POST.

    max_retries (int >= 0): bound per kind; backoff_s, backoff_max_s (s): exponential backoff base
    and cap; pool: connection-pool size; retry_reads: let urllib3 also retry read timeouts (False:
    they raise `requests.ReadTimeout` for the caller's own loop). requests is imported here, so a
    toy run never loads it.
    """
    import requests  # SCALE: full backend only
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    # SCALE: a long Retry-After would stall a training step; our capped exponential backoff spaces
    # the retries instead.
    retry = Retry(total=None, connect=max_retries, read=max_retries if retry_reads else False,
                  status=max_retries, other=0, status_forcelist=RETRY_STATUSES,
                  allowed_methods=frozenset({"POST"}), backoff_factor=backoff_s,
                  backoff_max=backoff_max_s, respect_retry_after_header=False,
                  raise_on_status=False)
    s = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_connections=1, pool_maxsize=max(1, pool))
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    s.trust_env = False  # no proxy or netrc credentials picked up from the environment
    return s


def transport_retries(resp) -> int:
    """How many retries urllib3 made before `resp` (0 if unknown)."""
    r = getattr(getattr(resp, "raw", None), "retries", None)
    return len(getattr(r, "history", ()) or ())


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
