"""Serper-compatible `google_search` (backends/api/search_http.py, the §3.1 tool environment in full mode) against a
loopback fake server. No request leaves 127.0.0.1."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("requests", reason="the HTTP backends need the `full` extra (requests, urllib3)")

import scaffold
from loopback import TEST_KEY, FakeServer
from backends.api.http import APIStopError
from backends.api.search_http import SearchError, SerperSearchTool
from backends.api.settings import SearchHTTPConfig
from scaffold import SearchResult


@pytest.fixture(autouse=True)
def _loopback_bypasses_any_proxy(monkeypatch):
    """The HTTP client honours the environment's proxy (backends/api/http.py); the loopback servers are
    local, so a machine with HTTP_PROXY set must still reach them directly."""
    for v in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(v, "127.0.0.1,localhost")


@pytest.fixture
def serper(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", TEST_KEY)
    with FakeServer("serper") as s:
        yield s


def tool_for(server, tmp_path=None, **kw) -> SerperSearchTool:
    base = dict(base_url=server.url, k=3, timeout_s=2.0, max_retries=2, backoff_s=0.01,
                backoff_max_s=0.02, cache_dir=str(tmp_path / "search") if tmp_path is not None else "")
    base.update(kw)
    k = base.pop("k")
    return SerperSearchTool(SearchHTTPConfig(**base), k=k)


def test_s31_request_format_and_header(serper):
    out = tool_for(serper)("  Kuvebro   habitat ")
    assert serper.errors == [] and len(serper.requests) == 1
    r = serper.requests[0]
    assert r["path"] == "/search" and r["body"] == {"q": "Kuvebro habitat", "num": 3}
    assert {k.lower(): v for k, v in r["headers"].items()}["x-api-key"] == TEST_KEY
    assert len(out) == 3


def test_s31_results_map_onto_search_result(serper):
    t = tool_for(serper, k=2)
    assert t.name == "google_search"
    out = t("Kuvebro habitat")
    assert out == [SearchResult("https://example.org/kuvebro-habitat/0", "Result 0 for Kuvebro habitat",
                                "Snippet 0 about Kuvebro habitat."),
                   SearchResult("https://example.org/kuvebro-habitat/1", "Result 1 for Kuvebro habitat",
                                "Snippet 1 about Kuvebro habitat.")]
    # the rollout engine formats them like BM25 results
    assert scaffold.format_tool_output(out, 1).startswith("\n<tool_output>[1] Result 0 for Kuvebro")


def test_s31_blank_query_and_no_hits(serper):
    t = tool_for(serper)
    assert t("   ") == [] and serper.requests == []
    serper.script.append({"body": '{"organic": []}'})
    assert t("nothing") == []


@pytest.mark.parametrize("action", [{"status": 429}, {"status": 500}, {"status": 502}, {"sleep": 0.6},
                                    {"drop": True}])
def test_s31_retry_then_success(serper, action):
    serper.script.append(action)
    t = tool_for(serper, timeout_s=0.3)
    assert len(t("Kuvebro year")) == 3
    assert t.stats()["search/retries"] == 1 and t.stats()["search/failures"] == 0
    assert len(serper.requests) == 2


def test_s31_give_up_after_bound_raises(serper, caplog):
    caplog.set_level(logging.DEBUG)
    serper.rule = lambda req: {"status": 503}
    t = tool_for(serper, max_retries=2)
    with pytest.raises(SearchError, match="HTTP 503 after 2 retries"):
        t("Kuvebro use")
    assert len(serper.requests) == 3 and t.stats()["search/failures"] == 1
    assert TEST_KEY not in caplog.text


def test_s31_malformed_reply_and_non_retryable_status_raise(serper):
    t = tool_for(serper)
    serper.script.append({"body": "<html>oops</html>"})
    with pytest.raises(SearchError, match="not the expected JSON"):
        t("a")
    serper.script.append({"status": 400})
    with pytest.raises(SearchError, match="HTTP 400"):
        t("b")
    serper.script.append({"status": 403, "message": "Not enough credits"})
    with pytest.raises(APIStopError, match="Not enough credits"):  # 401/403/404 stop the run
        t("c")
    assert len(serper.requests) == 3  # 4xx other than 429 is not retried


def test_s31_missing_key_raises_clearly(serper, monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY")
    with pytest.raises(SearchError, match="SERPER_API_KEY is not set"):
        tool_for(serper)("a")
    assert serper.requests == []


class CharTok:
    """Character-level stand-in tokenizer: enough for the rollout engine's tool step."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _tool_step(tool, query: str) -> scaffold.Rollout:
    tok = CharTok()
    engine = scaffold.RolloutEngine(None, tok, {"google_search": tool})
    ids = tok.encode(scaffold.CALL_OPEN + query + "</call_tool>")
    r = scaffold.Rollout(None, [], [], response_ids=ids, loss_mask=[1] * len(ids))
    engine._run_tool(r)
    r.text = tok.decode(r.response_ids)
    return r


def test_s31_tool_works_inside_the_rollout_engine(serper):
    r = _tool_step(tool_for(serper), "Kuvebro habitat")
    assert r.tool_calls[0].error == "" and r.tool_calls[0].handles == [1, 2, 3]
    assert r.evidence[1].doc_id == "https://example.org/kuvebro-habitat/0"
    assert "<tool_output>[1] Result 0 for Kuvebro habitat | Snippet 0" in r.text


def test_s31_raising_tool_becomes_tool_error_in_rollout(serper):
    """The engine's contract: a raising tool yields "error: search failed" and the rollout goes on."""
    serper.rule = lambda req: {"status": 500}
    r = _tool_step(tool_for(serper, max_retries=0), "Kuvebro habitat")
    assert r.tool_calls[0].error.startswith("SearchError") and r.evidence == {}
    assert r.text.endswith("<tool_output>error: search failed</tool_output>\n")


def test_s31_cache_hit_makes_no_request(serper, tmp_path):
    t = tool_for(serper, tmp_path)
    a = t("Kuvebro habitat")
    b = t("Kuvebro   habitat")  # same normalised query
    assert a == b and len(serper.requests) == 1 and t.stats()["search/cache_hits"] == 1
    t2 = tool_for(serper, tmp_path)  # a fresh tool reads the disk cache
    assert t2("Kuvebro habitat") == a and len(serper.requests) == 1
    files = [p for p in (tmp_path / "search").rglob("*") if p.is_file()]
    assert len(files) == 1 and TEST_KEY not in files[0].read_text()
    assert TEST_KEY not in repr(t.config)


def test_s31_a_401_from_search_ends_the_rollout_and_the_run(serper):
    """A wrong search key is not a tool error to write into the trajectory: it stops the run."""
    serper.rule = lambda req: {"status": 401, "message": "Unauthorized: invalid API key"}
    with pytest.raises(APIStopError, match="invalid API key"):
        _tool_step(tool_for(serper), "Kuvebro habitat")
    assert len(serper.requests) == 1
