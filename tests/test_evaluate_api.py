"""evaluate.py as a researcher runs it against a real API: the schema in the prompt under json_object,
early stops (401/403/404, skip share, deadline), the report written whatever happens, data checks,
sampling, --out, prices, and DRB's article cleaning. Loopback judges only (tests/loopback.py)."""
from __future__ import annotations

import json
import random
import re
import time

import pytest

pytest.importorskip("requests", reason="the HTTP backends need the `full` extra (requests, urllib3)")

import evaluate as ev
from backends.eval import cleaning
from backends.eval import data as eval_data
from loopback import TEST_KEY, FakeServer
from test_evaluate import (DRB_CRITERIA, DRB_QUERIES, DRB_REFERENCE, DRB_REPLIES, HB_ROWS, RQA_ROWS,
                           RR_ROWS, write_jsonl)


@pytest.fixture(autouse=True)
def env(monkeypatch):
    for v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("GEMINI_API_KEY", TEST_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", TEST_KEY)


def files(tmp_path, bench):
    """(benchmark args, ids) with every row answered."""
    if bench == "drb":
        args = ["--data", write_jsonl(tmp_path / "query.jsonl", DRB_QUERIES),
                "--criteria", write_jsonl(tmp_path / "criteria.jsonl", DRB_CRITERIA),
                "--reference", write_jsonl(tmp_path / "reference.jsonl", DRB_REFERENCE)]
        ids = [q["id"] for q in DRB_QUERIES]
    else:
        rows = {"healthbench": HB_ROWS, "researchqa": RQA_ROWS, "researchrubrics": RR_ROWS[:2]}[bench]
        key = {"healthbench": "prompt_id", "researchqa": "id", "researchrubrics": "sample_id"}[bench]
        args = ["--data", write_jsonl(tmp_path / f"{bench}.jsonl", rows)]
        ids = [r[key] for r in rows]
    body = "Our report on the task, with sources [1] and [2]. " * 4 + "\n\nReferences\n[1] a\n[2] b"
    resp = write_jsonl(tmp_path / "answers.jsonl", [{"id": i, "response": body} for i in ids])
    return args + ["--responses", resp], ids


def run(srv, tmp_path, bench, *extra, out="out"):
    args, _ = files(tmp_path, bench)
    return ev.main([bench, *args, "--judge", srv.kind, "--judge-model", srv.model, "--judge-base-url",
                    srv.url, "--judge-cache-dir", "", "--judge-backoff", "0.001", "--out",
                    str(tmp_path / out), "--no-progress", *extra])


def report(tmp_path, out="out"):
    return (json.loads((tmp_path / out / "report.json").read_text()),
            (tmp_path / out / "report.md").read_text())


def from_prompt_keys(req):
    """A judge with no schema support: it reads the JSON Schema written in the prompt text and
    answers with exactly its key names (enum values and counts taken from the prompt)."""
    text = req["body"]["messages"][-1]["content"]
    m = re.search(r"JSON Schema \(use exactly these key names\):\n(\{.*\})\n", text)
    if m is None:
        return {"json": {"result": "no format given"}}
    n_items = len(re.findall(r"^\d+\. ", text, re.M)) or 1

    def fill(sc):
        if "enum" in sc:
            return sc["enum"][-1]
        t = sc.get("type")
        if t == "object":
            return {k: fill(v) for k, v in sc["properties"].items()}
        if t == "array":
            return [fill(sc["items"]) for _ in range(n_items)]
        return {"string": "text " * 30, "number": 5, "boolean": True}.get(t)

    return {"json": fill(json.loads(m.group(1)))}


@pytest.mark.parametrize("bench", ["healthbench", "researchqa", "drb", "researchrubrics"])
def test_json_object_mode_shows_the_schema_for_every_benchmark(tmp_path, bench):
    with FakeServer("openai") as srv:
        srv.rule = from_prompt_keys
        rc = run(srv, tmp_path, bench, "--openai-response-format", "json_object")
    rep, _ = report(tmp_path)
    assert rc == 0 and rep["summary"]["skipped"]["count"] == 0 and rep["judge"]["judge/failures"] == 0
    assert all(r["body"]["response_format"] == {"type": "json_object"} for r in srv.requests)


@pytest.mark.parametrize("status", [401, 403, 404])
def test_auth_errors_stop_at_once_with_the_message_and_a_report(tmp_path, status, caplog):
    with FakeServer("gemini") as srv:
        srv.rule = lambda req: {"status": status, "message": "API key not valid. Please pass a valid API key."}
        rc = run(srv, tmp_path, "researchrubrics", "--judge-concurrency", "2")
    rep, md = report(tmp_path)
    assert rc == 3 and len(srv.requests) <= 3  # the calls in flight, then nothing (not retried)
    assert "API key not valid" in rep["stopped"] and "API key not valid" in md
    assert "API key not valid" in caplog.text
    assert rep["summary"]["skipped"]["count"] == 2


def test_skip_share_threshold_and_warnings_name_the_example(tmp_path, caplog):
    fail = RR_ROWS[0]["sample_id"]
    with FakeServer("gemini") as srv:
        srv.rule = lambda req: ({"text": "no json"} if RR_ROWS[0]["prompt"] in
                                req["body"]["contents"][0]["parts"][0]["text"] else
                                {"json": {"explanation": "e", "verdict": "Satisfied", "score": 1}})
        assert run(srv, tmp_path, "researchrubrics", "--judge-max-retries", "0") == 4
        assert f"example {fail} skipped" in caplog.text
        assert run(srv, tmp_path, "researchrubrics", "--judge-max-retries", "0", "--allow-skips",
                   out="out2") == 0
        assert run(srv, tmp_path, "researchrubrics", "--judge-max-retries", "0", "--max-skip-share",
                   "0.9", out="out3") == 0


def test_report_is_written_when_nothing_scores(tmp_path):
    with FakeServer("gemini") as srv:
        srv.rule = lambda req: {"text": "no json"}
        assert run(srv, tmp_path, "healthbench", "--judge-max-retries", "0") == 2
    rep, md = report(tmp_path)
    assert rep["summary"]["score"] is None and rep["judge"]["judge/failures"] > 0
    assert md.startswith("# healthbench: no example could be scored")


def test_deadline_cancels_the_rest(tmp_path):
    with FakeServer("gemini") as srv:
        srv.rule = lambda req: {"sleep": 0.6}
        t0 = time.perf_counter()
        rc = run(srv, tmp_path, "researchrubrics", "--deadline", "0.3", "--judge-concurrency", "2")
        assert time.perf_counter() - t0 < 3.0
    rep, _ = report(tmp_path)
    assert rc == 2 and rep["summary"]["n"] == 0
    assert "deadline" in rep["stopped"] and rep["summary"]["skipped"]["count"] == 2


# ----------------------------------------------------------------------------------------------------
# Bad data


def test_duplicate_ids_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "rr.jsonl", RR_ROWS[:1] + RR_ROWS[:1])
    with pytest.raises(eval_data.DataError, match="appears twice.*line 1 and .*line 2"):
        eval_data.load_researchrubrics(path)


def test_list_typed_researchqa_types_count_under_each_type(tmp_path):
    rows = [dict(RQA_ROWS[2], rubric=[{"rubric_item": "S1 explains guide RNA", "type": ["general", "citation"]},
                                      {"rubric_item": "S2 cites the 2012 paper", "type": "citation"}])]
    loaded = eval_data.load_researchqa(write_jsonl(tmp_path / "rqa.jsonl", rows))
    assert loaded[0]["items"][0]["type"] == ["citation", "general"]

    class Judge:
        def ask(self, system, user, schema, validate):
            return validate({"labels": ["Completely", "Not at all"]})

    out = ev.grade("researchqa", loaded, ["answer"], Judge(), progress=False)
    types = out["summary"]["breakdown"]["item_type"]
    assert set(types) == {"citation", "general"}
    assert types["general"]["score"] == 1.0 and types["citation"]["score"] == 0.5


def test_each_missing_file_is_named_for_what_it_is(tmp_path, caplog):
    args, _ = files(tmp_path, "drb")
    for flag, what in (("--responses", "--responses (answers)"), ("--criteria", "--criteria (DRB"),
                       ("--reference", "--reference (DRB"), ("--data", "--data (DRB")):
        a = list(args)
        a[a.index(flag) + 1] = str(tmp_path / "nope.jsonl")
        caplog.clear()
        assert ev.main(["drb", *a, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
        assert what in caplog.text and "file not found" in caplog.text


def test_a_bad_row_is_one_line_naming_file_line_and_field(tmp_path, caplog, capsys):
    rows = [RR_ROWS[0], dict(RR_ROWS[1], rubrics=[{"criterion": "c", "weight": "heavy"}])]
    data = write_jsonl(tmp_path / "rr.jsonl", rows)
    resp = write_jsonl(tmp_path / "a.jsonl", [{"id": "s1", "response": "x"}])
    assert ev.main(["researchrubrics", "--data", data, "--responses", resp, "--out",
                    str(tmp_path / "o"), "--no-progress"]) == 2
    err = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(err) == 1 and "\n" not in err[0].getMessage()
    assert "rr.jsonl line 2" in err[0].getMessage() and "weight" in err[0].getMessage()
    assert "Traceback" not in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Sampling, --out, settings, prices


def test_limit_samples_like_simple_evals(tmp_path):
    many = [dict(RR_ROWS[0], sample_id=f"s{i}") for i in range(20)]
    path = write_jsonl(tmp_path / "rr.jsonl", many)
    all_rows = eval_data.load_rows("researchrubrics", path)
    got = eval_data.load_rows("researchrubrics", path, limit=5)
    assert [r["id"] for r in got] == [r["id"] for r in random.Random(0).sample(all_rows, 5)]
    assert [r["id"] for r in eval_data.load_rows("researchrubrics", path, limit=5, first=True)] == \
        [f"s{i}" for i in range(5)]


def test_out_refuses_to_overwrite_and_settings_hold_only_evaluation_fields(tmp_path, caplog):
    with FakeServer("gemini") as srv:
        srv.rule = lambda req: {"json": {"explanation": "e", "verdict": "Satisfied", "score": 1}}
        assert run(srv, tmp_path, "researchrubrics") == 0
        n = len(srv.requests)
        assert run(srv, tmp_path, "researchrubrics") == 2 and len(srv.requests) == n
        assert "--overwrite" in caplog.text
        assert run(srv, tmp_path, "researchrubrics", "--overwrite") == 0
    rep, md = report(tmp_path)
    for training_only in ("max_failure_rate", "max_failure_steps", "caps", "max_text_chars", "max_usd"):
        assert training_only not in rep["settings"]["judge"] and training_only not in md
    assert "cost unknown" in md and "--price-in" in md  # "gemini-test" is not in the price table


def test_prices_given_on_the_command_line(tmp_path):
    with FakeServer("gemini", usage=(1000, 100)) as srv:
        srv.rule = lambda req: {"json": {"explanation": "e", "verdict": "Satisfied", "score": 1}}
        assert run(srv, tmp_path, "researchrubrics", "--price-in", "2", "--price-out", "8") == 0
    rep, md = report(tmp_path)
    n = rep["judge"]["judge/requests"]
    # Eq.: usd = tokens_in / 1e6 * price_in + tokens_out / 1e6 * price_out
    assert rep["judge"]["judge/usd_total"] == pytest.approx(n * (1000 * 2 + 100 * 8) / 1e6)
    assert "given" in rep["price"]


# ----------------------------------------------------------------------------------------------------
# DRB: article cleaning (the released pipeline's step) and unmatched names in report.md


def drb_judge(long_fails=False):
    def rule(req):
        text = req["body"]["contents"][0]["parts"][0]["text"]
        if "Report to clean" in text:
            art = re.search(r'<untrusted id="report">\n(.*)\n</untrusted>', text, re.S).group(1)
            if long_fails and len(art) > 150:
                return {"text": "too long for me"}
            cleaned = re.sub(r"\s*\[\d+\]", "", art.split("\n\nReferences")[0])
            return {"json": {"article": cleaned + " " + "(kept text) " * 10}}
        return {"json": DRB_REPLIES["Task one" if "Task one" in text else "Task two"]}
    return rule


def test_drb_articles_are_cleaned_by_default_and_raw_is_stated(tmp_path):
    with FakeServer("gemini") as srv:
        srv.rule = drb_judge()
        assert run(srv, tmp_path, "drb", "--allow-skips") == 0
        race = [r for r in srv.requests if "Report 1" in r["body"]["contents"][0]["parts"][0]["text"]]
        assert race and all("[1]" not in r["body"]["contents"][0]["parts"][0]["text"].split("Report 2")[0]
                            .split("Report 1")[1] for r in race)
        rep, md = report(tmp_path)
        assert rep["settings"]["drb_articles"] == "cleaned" and "cleaned of citations" in md
        assert rep["cleaning"]["cleaned"] == 3
        assert "Unmatched criterion names" in md and "instruction_following: Tone" in md
        assert run(srv, tmp_path, "drb", "--drb-raw", "--allow-skips", out="raw") == 0
        rep, md = report(tmp_path, "raw")
        assert rep["settings"]["drb_articles"] == "raw" and "graded RAW" in md


def test_drb_cleaning_falls_back_to_two_halves(tmp_path):
    text = ("First part sentence. " * 6) + ("Second part sentence. " * 6)
    a, b = cleaning.split_in_two(text)
    assert a + b == text and a.endswith(". ") is False and a.endswith(".")
    with FakeServer("gemini") as srv:
        srv.rule = drb_judge(long_fails=True)
        assert run(srv, tmp_path, "drb", "--judge-max-retries", "0", "--allow-skips") == 0
    rep, _ = report(tmp_path)
    assert rep["cleaning"]["halved"] == 3 and rep["summary"]["n"] >= 2
