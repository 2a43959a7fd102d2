"""The rate-limit-aware HTTP client (backends/api/http.py) as the judge and the search tool use it, against
loopback servers (tests/loopback.py): proxy from the environment, Retry-After (seconds and HTTP-date),
429 back-off of the whole client, requests- and tokens-per-minute limits, 401/403/404 stopping at once
with the server's message, the Gemini thinking budget, the schema in the prompt under json_object,
the cache key, prices and the budget. Waits are a few tenths of a second to two seconds at most.
"""
from __future__ import annotations

import email.utils
import json
import re
import threading
import time

import pytest

pytest.importorskip("requests", reason="the HTTP backends need the `full` extra (requests, urllib3)")

from backends.api.http import APIStopError, HTTPClient, RateLimiter, parse_retry_after
from backends.api.judge_http import HTTPJudge, JudgeBudgetExceeded
from backends.api.judge_prompts import schema_scores
from backends.api.pricing import PRICE_TABLE, format_cost_plan, judge_cost_plan, resolve_prices, table_prices
from backends.api.settings import SearchHTTPConfig
from backends.api.search_http import SerperSearchTool
from hparams import JudgeConfig
from loopback import TEST_KEY, FakeProxy, FakeServer
from test_judge_http import GOOD, fake_query, fake_rollout, make_judge

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
              "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def env(monkeypatch):
    for v in PROXY_VARS:  # the machine's own proxy settings must not reach the loopback servers
        monkeypatch.delenv(v, raising=False)
    for v in ("GEMINI_API_KEY", "OPENAI_API_KEY", "SERPER_API_KEY"):
        monkeypatch.setenv(v, TEST_KEY)
    return monkeypatch


def init_rubrics(j, q):
    return j.initial_rubrics(q)


def score_once(j, q=None):
    q = q or fake_query()
    return j.score_rubrics(q, [fake_rollout(q, GOOD)], init_rubrics(j, q))


# ----------------------------------------------------------------------------------------------------
# Proxy


def test_proxy_is_taken_from_the_environment(env):
    with FakeProxy() as proxy, FakeServer("openai") as s:
        env.setenv("HTTP_PROXY", proxy.url)
        with make_judge(s) as j:
            assert (score_once(j) >= 0).all()
            assert j.client.session().trust_env
        assert len(proxy.seen) == 1 and proxy.seen[0].startswith(s.url)  # the absolute URI
        assert len(s.requests) == 1 and not s.errors
        env.setenv("NO_PROXY", "127.0.0.1")  # NO_PROXY honoured: straight to the server
        with make_judge(s) as j:
            score_once(j)
        assert len(proxy.seen) == 1 and len(s.requests) == 2


def test_search_goes_through_the_environment_proxy(env):
    with FakeProxy() as proxy, FakeServer("serper") as s:
        env.setenv("HTTP_PROXY", proxy.url)
        tool = SerperSearchTool(SearchHTTPConfig(base_url=s.url), k=2)
        assert len(tool("kuvebro habitat")) == 2
        tool.close()
        assert len(proxy.seen) == 1 and proxy.seen[0].endswith("/search")


def test_netrc_never_replaces_the_bearer_key(env, tmp_path):
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login u password p\n")
    env.setenv("NETRC", str(tmp_path / ".netrc"))
    with FakeServer("openai") as s, make_judge(s) as j:  # the fake checks "Bearer <key>"
        assert (score_once(j) >= 0).all() and not s.errors


# ----------------------------------------------------------------------------------------------------
# Retry-After and 429 back-off


def test_parse_retry_after_seconds_and_http_date():
    assert parse_retry_after("3") == 3.0 and parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("-4") is None
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(30.0)
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0


@pytest.mark.parametrize("form", ["seconds", "http-date", "milliseconds"])
def test_judge_waits_the_retry_after_of_a_429(form):
    with FakeServer("openai") as s:
        headers = {"seconds": {"Retry-After": "1"},
                   "http-date": {"Retry-After": email.utils.formatdate(time.time() + 2, usegmt=True)},
                   "milliseconds": {"retry-after-ms": "1000", "Retry-After": "0"}}[form]
        s.script.append({"status": 429, "headers": headers})
        with make_judge(s, backoff_s=0.01, backoff_max_s=0.01) as j:  # backoff alone: 0.01 s
            t0 = time.perf_counter()
            assert (score_once(j) >= 0).all()
            waited = time.perf_counter() - t0
            st = j.stats()
    assert waited >= 0.95  # the header's wait, not the 0.01 s backoff
    assert st["judge/throttled"] == 1 and st["judge/requests"] == 2 and st["judge/failures"] == 0


def test_a_retry_after_beyond_the_cap_fails_the_call_at_once():
    with FakeServer("openai") as s:
        s.rule = lambda req: {"status": 429, "headers": {"Retry-After": "3600"}}
        with make_judge(s, retry_after_max_s=1.0) as j:
            t0 = time.perf_counter()
            assert (score_once(j) != score_once(j)).all()  # NaN: the call failed
            assert time.perf_counter() - t0 < 2.0
            assert j.stats()["judge/failures"] == 2


def test_a_429_pauses_every_request_and_halves_the_concurrency():
    lim = RateLimiter(8)
    t = lim.acquire()
    lim.release(t, throttled=True, pause_s=0.3)
    assert lim.limit == 4
    t0 = time.monotonic()
    t = lim.acquire()  # another thread's request waits out the pause too
    assert time.monotonic() - t0 >= 0.28
    for _ in range(4):  # additive increase: +1 after `limit` successes in a row
        lim.release(t)
        t = lim.acquire()
    lim.release(t)
    assert lim.limit == 5 and lim.stats()["throttled"] == 1
    # a burst: every request in flight gets a 429; the limit is cut once, not once per answer
    lim = RateLimiter(32)
    tickets = [lim.acquire() for _ in range(32)]
    for t in tickets:
        lim.release(t, throttled=True, pause_s=0.2)
    assert lim.limit == 16 and lim.stats()["throttled"] == 32


def test_concurrency_never_exceeds_the_limit_under_load():
    with FakeServer("openai") as s:
        s.rule = lambda req: {"sleep": 0.05}
        with make_judge(s, concurrency=3) as j:
            q = fake_query()
            ros = [fake_rollout(q, GOOD + f" {i}") for i in range(9)]
            j.score_rubrics(q, ros, init_rubrics(j, q))
            assert j.client.limiter.stats()["peak_in_flight"] <= 3


def test_requests_and_tokens_per_minute_limits():
    lim = RateLimiter(8, rpm=2, window_s=0.4)
    t0 = time.monotonic()
    for _ in range(3):
        lim.release(lim.acquire())
    assert time.monotonic() - t0 >= 0.38  # the third request waits for the window
    lim = RateLimiter(8, tpm=100, window_s=0.4)
    t0 = time.monotonic()
    lim.release(lim.acquire(60))
    t = lim.acquire(60)
    assert time.monotonic() - t0 >= 0.38
    lim.add_tokens(t, 10)  # corrected by the reply's usage: the next one fits at once
    t0 = time.monotonic()
    lim.release(t)
    lim.release(lim.acquire(60))
    assert time.monotonic() - t0 < 0.2
    lim = RateLimiter(8, tpm=100, window_s=0.4)  # a request larger than tpm waits for an empty window
    lim.release(lim.acquire(10))
    t0 = time.monotonic()
    lim.release(lim.acquire(500))
    assert time.monotonic() - t0 >= 0.38


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_tokens_per_minute_pacing_with_a_fake_clock():
    """judge_http.tpm: a request starts only when its tokens fit beside what the last 60 s started,
    so the client keeps inside the provider's quota instead of collecting 429s."""
    clock = FakeClock()
    lim = RateLimiter(8, tpm=1000, clock=clock)
    t = lim.acquire(600)  # an empty window admits at once (no sleep: the fake clock never moves here)
    assert lim.wait_s(600) == pytest.approx(60.0)  # 600 + 600 > 1000: until the first ages out
    assert lim.wait_s(400) == 0.0  # 600 + 400 fits
    clock.t += 30
    assert lim.wait_s(600) == pytest.approx(30.0)
    lim.add_tokens(t, 300)  # the reply's usage: 300 tokens, so 300 + 600 fits now
    assert lim.wait_s(600) == 0.0
    lim.release(t)
    # a stream of 400-token requests at 1,000 tokens per minute: two per minute, never more
    clock, starts = FakeClock(), []
    lim = RateLimiter(8, tpm=1000, clock=clock)
    for _ in range(9):
        clock.t += lim.wait_s(400)
        lim.release(lim.acquire(400))
        starts.append(clock.t - 1000.0)
    assert starts == pytest.approx([0, 0, 60, 60, 120, 120, 180, 180, 240])
    for s0 in starts:  # every 60 s window holds at most 1,000 tokens
        assert 400 * sum(s0 <= s < s0 + 60 for s in starts) <= 1000
    # a request larger than the quota starts alone, once the window is empty
    clock.t += 1
    assert lim.wait_s(5000) == pytest.approx(59.0)
    clock.t += 59
    assert lim.wait_s(5000) == 0.0


def test_judge_counts_what_the_providers_quota_counts():
    """Gemini's tokens-per-minute limit counts input tokens only; an OpenAI-compatible server's
    input + output: the limiter's entry is corrected to that from the reply's usage."""
    q = fake_query()
    for kind, want in (("gemini", 1000), ("openai", 1200)):
        with FakeServer(kind, usage=(1000, 200)) as s, make_judge(s, tpm=10**6) as j:
            score_once(j, q)
            assert [e[1] for e in j.client.limiter._window] == [want], kind


def test_judge_rpm_setting_spaces_the_requests():
    with FakeServer("openai") as s:
        with make_judge(s, rpm=2) as j:
            j.client.limiter.window_s = 0.5  # a 60 s window, shrunk for the test
            q = fake_query()
            t0 = time.perf_counter()
            j.score_rubrics(q, [fake_rollout(q, GOOD + f" {i}") for i in range(3)], init_rubrics(j, q))
            assert time.perf_counter() - t0 >= 0.45


# ----------------------------------------------------------------------------------------------------
# 401 / 403 / 404 stop at once


@pytest.mark.parametrize("status", [401, 403, 404])
def test_auth_and_not_found_stop_at_once_with_the_server_message(status):
    msg = {401: "API key not valid. Please pass a valid API key.", 403: "Permission denied on model",
           404: "models/gemini-9 is not found for API version v1beta"}[status]
    with FakeServer("gemini") as s:
        s.rule = lambda req: {"status": status, "message": msg}
        with make_judge(s) as j:
            q = fake_query()
            with pytest.raises(APIStopError) as e:
                j.judge_group(q, [fake_rollout(q, GOOD), fake_rollout(q, GOOD + " ")], step=0)
    assert msg in str(e.value) and f"HTTP {status}" in str(e.value) and e.value.status == status
    assert len(s.requests) <= 4  # one per call in flight, none retried


def test_search_401_stops_instead_of_a_tool_error():
    with FakeServer("serper") as s:
        s.rule = lambda req: {"status": 401, "message": "Unauthorized."}
        tool = SerperSearchTool(SearchHTTPConfig(base_url=s.url, max_retries=3))
        with pytest.raises(APIStopError, match="Unauthorized"):
            tool("query")
        tool.close()
        assert len(s.requests) == 1


def test_the_client_gives_up_after_max_retries_on_5xx():
    with FakeServer("serper", key=None) as s:
        s.rule = lambda req: {"status": 503, "message": "overloaded"}
        c = HTTPClient("t", max_retries=2, backoff_s=0.01, backoff_max_s=0.01, timeout_s=2)
        resp, retries, n429, _ = c.post(s.url + "/search", {"q": "a", "num": 1}, {})
        c.close()
    assert resp.status_code == 503 and retries == 2 and n429 == 0 and len(s.requests) == 3


# ----------------------------------------------------------------------------------------------------
# Gemini thinking budget, schema in the prompt, cache key


@pytest.mark.parametrize("budget", [-1, 0, 512])
def test_gemini_thinking_budget_is_a_setting(budget):
    with FakeServer("gemini") as s, make_judge(s, thinking_budget=budget) as j:
        score_once(j)
        gen = s.requests[0]["body"]["generationConfig"]
    if budget < 0:
        assert "thinkingConfig" not in gen
    else:
        assert gen["thinkingConfig"] == {"thinkingBudget": budget}


def reply_from_prompt_keys(req):
    """A judge without schema support: it sees only the prompt text, finds the JSON Schema written
    there and answers with those key names (ids from the schema's enum in the text)."""
    text = req["body"]["messages"][-1]["content"]
    assert req["body"]["response_format"] == {"type": "json_object"}
    m = re.search(r"JSON Schema \(use exactly these key names\):\n(\{.*\})\n", text)
    if m is None:
        return {"json": {"answer": "I do not know the format"}}
    schema = json.loads(m.group(1))

    def fill(sc):
        if "enum" in sc:
            return sc["enum"]
        t = sc.get("type")
        if t == "object":
            return {k: fill(v) for k, v in sc["properties"].items()}
        return {"string": "ok", "number": 0.5, "boolean": True}.get(t)

    item = schema["properties"]["scores"]["items"]
    ids = item["properties"]["rubric_id"]["enum"]
    out = []
    for rid in ids:
        e = {k: fill(v) for k, v in item["properties"].items()}
        e["rubric_id"] = rid
        out.append(e)
    return {"json": {"scores": out}}


def test_json_object_mode_puts_the_schema_in_the_prompt():
    with FakeServer("openai") as s:
        s.rule = reply_from_prompt_keys
        with make_judge(s, openai_response_format="json_object") as j:
            S = score_once(j)
            st = j.stats()
    assert (S == 0.5).all() and st["judge/failures"] == 0 and st["judge/invalid_replies"] == 0
    with FakeServer("openai") as s:  # json_schema mode: the schema travels in response_format only
        with make_judge(s) as j:
            score_once(j)
        assert "JSON Schema" not in s.requests[0]["body"]["messages"][-1]["content"]


def test_cache_key_includes_the_base_url(tmp_path):
    with FakeServer("openai") as a, FakeServer("openai") as b:
        with make_judge(a, tmp_path) as j:
            score_once(j)
        with make_judge(a, tmp_path) as j:  # same endpoint: replayed
            score_once(j)
            assert j.stats()["judge/cache_hits"] == 1
        with make_judge(b, tmp_path) as j:  # another server, same model name: asked again
            score_once(j)
            assert j.stats()["judge/cache_hits"] == 0
        assert len(a.requests) == 1 and len(b.requests) == 1


# ----------------------------------------------------------------------------------------------------
# Prices and the budget


def test_price_table_covers_the_documented_models_and_never_borrows_a_price():
    for m in ("gemini-2.5-flash", "gemini-2.5-pro", "gpt-4.1", "gpt-4.1-mini"):
        assert table_prices(m) is not None, m
    assert table_prices("gpt-4.1-2025-04-14") == table_prices("gpt-4.1")
    assert table_prices("gemini-2.5-flash-001") is None  # not silently priced as a neighbour
    assert resolve_prices("Qwen/Qwen3-8B") is None
    assert resolve_prices("Qwen/Qwen3-8B", 0.0, 0.0).request_cost(10**6, 10**6) == 0.0
    with pytest.raises(ValueError):
        resolve_prices("gpt-4.1", 1.0, -1.0)
    pro = table_prices("gemini-2.5-pro")
    # Eq.: usd = tokens_in / 1e6 * price_in + tokens_out / 1e6 * price_out
    assert pro.request_cost(10_000, 1_000) == pytest.approx(10_000 * 1.25e-6 + 1_000 * 10e-6)
    assert pro.request_cost(300_000, 0) == pytest.approx(300_000 * 2.50e-6)  # long-context tier
    assert PRICE_TABLE["gemini-2.5-flash"][:2] == (0.30, 2.50)


def test_unknown_model_cost_is_unknown_and_a_budget_needs_a_price():
    with FakeServer("openai", usage=(1000, 100)) as s:
        with make_judge(s) as j:  # model "gemini-test": not in the table
            score_once(j)
            st = j.stats()
        assert st["judge/usd_total"] is None and "judge/cost_usd" not in st
        with pytest.raises(ValueError, match="max_usd needs a known price"):
            make_judge(s, max_usd=1.0)


def test_budget_stops_once_reached():
    with FakeServer("openai", usage=(1000, 100)) as s:
        with make_judge(s, price_in=1000.0, price_out=0.0, max_usd=1.5) as j:  # $1 per call
            score_once(j)
            j.check_budget()  # $1.00 < $1.50
            score_once(j, fake_query(3))
            assert j.stats()["judge/usd_total"] == pytest.approx(2.0)
            with pytest.raises(JudgeBudgetExceeded, match="max_usd"):
                j.check_budget()


def test_judge_cost_plan_of_the_full_preset():
    from backends.run import config as settings, presets

    cfg = presets.full_preset()
    plan = judge_cost_plan(cfg)
    P, n = cfg.rollout.prompts_per_step, cfg.rollout.n
    c = plan["per_step"]["calls"]
    assert (c["proposal"], c["scoring"], c["reflection"]) == (P, P * n, P)
    assert c["total"] == 320 and plan["per_run"]["calls"]["total"] == 320 * cfg.steps
    assert 1 < plan["per_step"]["usd"] < 20 and not plan["problems"]
    assert plan["per_run"]["usd"] == pytest.approx(plan["per_step"]["usd"] * cfg.steps)
    text = format_cost_plan(plan)
    assert "per step: 320 calls" in text and "$" in text
    # Eq.: minutes = latency * (ceil(P/c) + ceil(P n/c) + reflection calls) / 60 (no rpm / tpm)
    c = cfg.judge_http.concurrency
    waves = -(-P // c) + -(-P * n // c) + P
    assert plan["per_step"]["judge_minutes"] == pytest.approx(5.0 * waves / 60)
    cfg.judge_http.rpm = 10  # 320 calls at 10 per minute: the rpm floor dominates
    assert judge_cost_plan(cfg)["per_step"]["judge_minutes"] == pytest.approx(32.0)
    cfg.judge_http.rpm = 0
    cfg.judge.model = "my-local-judge"
    plan = judge_cost_plan(cfg)
    assert plan["per_step"]["usd"] is None and "unknown" in format_cost_plan(plan)
    assert any("price_in" in p for p in plan["problems"])
    cfg.judge_http.price_in, cfg.judge_http.price_out = 0.0, 0.0
    assert judge_cost_plan(cfg)["per_step"]["usd"] == 0.0
    cfg.judge_http.thinking_budget = 0  # thinking off: fewer output tokens
    cfg.judge.model, cfg.judge_http.price_in, cfg.judge_http.price_out = "gemini-2.5-flash", -1.0, -1.0
    assert judge_cost_plan(cfg)["per_step"]["tokens_out"] < plan["per_step"]["tokens_out"]


def test_after_a_stop_the_client_sends_nothing_more():
    with FakeServer("gemini") as s:
        s.rule = lambda req: {"status": 403, "message": "Permission denied"}
        with make_judge(s, concurrency=1) as j:
            for _ in range(3):
                with pytest.raises(APIStopError, match="Permission denied"):
                    j.ask("system", "user", schema_scores(["a"]), lambda o: o)
        assert len(s.requests) == 1


def test_gemini_retry_info_in_the_body_is_waited_out():
    retry_info = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"}]
    with FakeServer("gemini") as s:
        s.script.append({"status": 429, "message": "Resource has been exhausted (e.g. check quota).",
                         "details": retry_info})
        with make_judge(s, backoff_s=0.01, backoff_max_s=0.01) as j:
            t0 = time.perf_counter()
            assert (score_once(j) >= 0).all()
            assert time.perf_counter() - t0 >= 0.95 and j.stats()["judge/throttled"] == 1


def test_gemini_invalid_key_400_stops_like_a_401():
    info = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID",
             "domain": "googleapis.com"}]
    with FakeServer("gemini") as s:
        s.rule = lambda req: {"status": 400, "message": "API key not valid. Please pass a valid API key.",
                              "details": info}
        with make_judge(s) as j, pytest.raises(APIStopError, match="API key not valid"):
            score_once(j)
    with FakeServer("gemini") as s:  # any other 400 fails the call (NaN), the run goes on
        s.rule = lambda req: {"status": 400, "message": "Invalid JSON payload received."}
        with make_judge(s) as j:
            S = score_once(j)
        assert (S != S).all() and len(s.requests) == 1
