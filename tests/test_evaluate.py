"""evaluate.py: the four long-form benchmarks' formulas, row formats and grading through loopback judges.

Rows below are written by hand for these tests (same field layout as the published files, our own
content). Each score is checked against the benchmark's formula worked out by hand in the test.
No request leaves 127.0.0.1; nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("requests", reason="the HTTP judge needs the `full` extra (requests, urllib3)")

import evaluate as ev
from backends.eval import answers as eval_answers
from backends.eval import data as eval_data
from backends.api.judge_http import HTTPJudge
from backends.api.settings import judge_configs
from loopback import TEST_KEY, FakeServer


@pytest.fixture(autouse=True)
def _loopback_bypasses_any_proxy(monkeypatch):
    """The HTTP client honours the environment's proxy (backends/api/http.py); the loopback servers are
    local, so a machine with HTTP_PROXY set must still reach them directly."""
    for v in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(v, "127.0.0.1,localhost")


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", TEST_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", TEST_KEY)


def make_judge(server: FakeServer, **kw) -> HTTPJudge:
    base = dict(backend=server.kind, model=server.model, base_url=server.url, timeout_s=5.0,
                max_retries=3, backoff_s=0.001, backoff_max_s=0.002, concurrency=4, cache_dir="")
    base.update(kw)
    return HTTPJudge(*judge_configs(**base))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def user_text(req) -> str:
    return FakeServer.prompt_and_schema(req)[0]


def props(req) -> dict:
    return FakeServer.prompt_and_schema(req)[1]["properties"]


# ----------------------------------------------------------------------------------------------------
# Pure formulas


def test_healthbench_example_score_negative_points_by_hand():
    # (5 met) + (-8 met) + (3 not met): (5 - 8) / (5 + 3)
    assert ev.healthbench_example_score([5, -8, 3], [True, True, False]) == pytest.approx(-3 / 8)
    assert ev.healthbench_example_score([5, -8, 3], [True, False, True]) == 1.0
    assert ev.healthbench_example_score([-2, -1], [True, True]) is None  # no positive points
    with pytest.raises(ValueError):
        ev.healthbench_example_score([1, 2], [True])


@given(st.lists(st.tuples(st.integers(-10, 10), st.booleans()), min_size=1, max_size=12))
def test_healthbench_example_score_bounds(items):
    pts, met = [p for p, _ in items], [m for _, m in items]
    s = ev.healthbench_example_score(pts, met)
    pos, neg = sum(p for p in pts if p > 0), sum(-p for p in pts if p < 0)
    if pos == 0:
        assert s is None
    else:  # not clipped per example: in [-neg/pos, 1]
        assert -neg / pos - 1e-12 <= s <= 1 + 1e-12


@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=30))
def test_healthbench_clipped_mean_in_unit_interval(values):
    m = ev.clipped_mean(values)
    assert 0.0 <= m <= 1.0
    raw = sum(values) / len(values)
    if 0 <= raw <= 1:
        assert m == pytest.approx(raw)


@given(st.floats(0, 100, allow_nan=False), st.floats(0, 100, allow_nan=False))
def test_race_task_score_in_unit_interval_and_symmetric(T, R):
    s = ev.race_task_score(T, R)
    assert 0.0 <= s <= 1.0
    if T + R > 0:
        assert s + ev.race_task_score(R, T) == pytest.approx(1.0)
    else:
        assert s == 0.0  # as released


def test_race_task_score_rejects_negative_totals():
    with pytest.raises(ValueError):
        ev.race_task_score(-1.0, 2.0)


@given(st.lists(st.tuples(st.floats(0.01, 5), st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=8))
def test_race_dimension_is_a_weighted_mean_in_range(rows):
    w, t, r = zip(*rows)
    T, R = ev.race_dimension(w, t, r)
    assert min(t) - 1e-9 <= T <= max(t) + 1e-9 and min(r) - 1e-9 <= R <= max(r) + 1e-9


def test_researchqa_labels_map_to_quarters():
    assert [ev.researchqa_item_value(x) for x in ev.RQA_LABELS] == [0, 0.25, 0.5, 0.75, 1.0]
    assert ev.researchqa_item_value(" mostly. ") == 0.75
    with pytest.raises(ValueError):
        ev.researchqa_item_value("Somewhat")
    assert ev.researchqa_coverage(["Completely", "Barely"]) == pytest.approx((1 + 0.25) / 2)


@given(st.lists(st.tuples(st.floats(-5, 5).filter(lambda w: abs(w) > 1e-3), st.sampled_from([0, 0.5, 1])),
                min_size=1, max_size=10))
def test_rubric_compliance_bounds(items):
    w, s = [a for a, _ in items], [b for _, b in items]
    c = ev.rubric_compliance(w, s)
    pos, neg = sum(x for x in w if x > 0), sum(-x for x in w if x < 0)
    if pos == 0:
        assert c is None
    else:
        assert -neg / pos - 1e-9 <= c <= 1 + 1e-9


def test_match_criterion_exact_then_case_then_substring():
    names = ["Use of data sources", "use of data", "Use of Data", "Depth of analysis"]
    assert ev.match_criterion("Use of Data", names) == 2  # exact beats case-insensitive
    assert ev.match_criterion("USE OF DATA", names) == 1  # case-insensitive beats substring (0)
    assert ev.match_criterion("Depth of analysis (insight)", names) == 3  # name inside the reply's
    assert ev.match_criterion("analysis", names) == 3  # reply's inside the name
    assert ev.match_criterion("data sources", names) == 0
    assert ev.match_criterion("Tone", names) is None
    assert ev.match_criterion("  ", names) is None


def test_bootstrap_constant_values_and_bounds():
    b = ev.bootstrap([0.4] * 7)
    assert b["std"] == pytest.approx(0.0, abs=1e-12) and b["ci95"] == pytest.approx([0.4, 0.4])
    vals = [-0.5, 0.2, 0.9, 1.0]
    b = ev.bootstrap(vals, ev.clipped_mean, seed=3)
    assert 0.0 <= b["ci95"][0] <= b["ci95"][1] <= 1.0 and b["std"] > 0
    assert b == ev.bootstrap(vals, ev.clipped_mean, seed=3)  # seeded
    with pytest.raises(ValueError):
        ev.bootstrap([])


# ----------------------------------------------------------------------------------------------------
# HealthBench through a loopback Gemini judge

HB_ROWS = [
    {"prompt": [{"role": "user", "content": "My son has had a fever of 39.2 C since morning. What now?"}],
     "prompt_id": "hb-1", "example_tags": ["theme:fever", "physician_agreed_category:enough-context"],
     "canary": "x", "ideal_completions_data": None,
     "rubrics": [{"criterion": "A1 advises keeping the child hydrated", "points": 5,
                  "tags": ["axis:completeness", "level:example"]},
                 {"criterion": "A2 recommends aspirin for the child", "points": -8,
                  "tags": ["axis:accuracy"]},
                 {"criterion": "A3 lists warning signs that need urgent care", "points": 3,
                  "tags": ["axis:accuracy"]}]},
    {"prompt": [{"role": "user", "content": "Fever again."}, {"role": "assistant", "content": "How high?"},
                {"role": "user", "content": "38.5, she is drinking well."}],
     "prompt_id": "hb-2", "example_tags": ["theme:fever"],
     "rubrics": [{"criterion": "B1 says a fever of 38.5 C alone is not dangerous", "points": 4,
                  "tags": ["axis:accuracy"]},
                 {"criterion": "B2 suggests a dose by weight for paracetamol", "points": 6,
                  "tags": ["axis:completeness"]},
                 {"criterion": "B3 uses alarming language", "points": -2, "tags": ["axis:communication"]}]},
    {"prompt": [{"role": "user", "content": "I sleep four hours a night. Is that bad?"}],
     "prompt_id": "hb-3", "example_tags": ["theme:sleep"],
     "rubrics": [{"criterion": "C1 mentions the usual adult range of sleep", "points": 2,
                  "tags": ["axis:completeness"]},
                 {"criterion": "C2 asks about daytime sleepiness", "points": 2,
                  "tags": ["axis:accuracy"]}]},
    {"prompt": [{"role": "user", "content": "Question nobody answered."}], "prompt_id": "hb-4",
     "example_tags": ["theme:sleep"], "rubrics": [{"criterion": "E1 anything", "points": 1, "tags": []}]},
    {"prompt": [{"role": "user", "content": "Is a rash after amoxicillin an allergy?"}],
     "prompt_id": "hb-5",
     "example_tags": ["theme:rash"], "rubrics": [{"criterion": "D1 never graded validly", "points": 1,
                                                   "tags": ["axis:accuracy"]}]},
]
HB_MET = {"A1": True, "A2": True, "A3": False, "B1": True, "B2": False, "B3": False, "C1": True, "C2": True}
HB_ANSWERS = {"hb-1": "Give fluids and a children's aspirin.", "hb-2": "38.5 C is fine if she drinks.",
              "hb-3": "Adults need 7-9 hours.", "hb-5": "Possibly; see a doctor."}


def hb_rule(req):
    u = user_text(req)
    assert "criteria_met" in props(req)
    m = re.search(r"Rubric item \(([+-]\d+) points\):\n([A-E]\d)", u)
    code = m.group(2)
    if code == "D1":
        return {"text": "sorry, I cannot produce JSON"}  # invalid every time: the call fails
    return {"json": {"explanation": f"checked {code}", "criteria_met": HB_MET[code]}}


def test_healthbench_scores_tags_and_skips_by_hand(tmp_path, key):
    rows = eval_data.load_healthbench(write_jsonl(tmp_path / "hb.jsonl", HB_ROWS))
    answers = eval_data.match_answers(rows, HB_ANSWERS)
    with FakeServer("gemini") as srv:
        srv.rule = hb_rule
        with make_judge(srv) as j:
            out = ev.grade("healthbench", rows, answers, j, concurrency=3, progress=False)
            stats = j.stats()
    assert srv.errors == []
    ex = {r["id"]: r for r in out["examples"]}
    s1 = (5 - 8) / (5 + 3)  # A1 met, A2 (negative) met, A3 not met
    s2 = 4 / (4 + 6)  # B1 met; B2 not; B3 (negative) not
    s3 = (2 + 2) / (2 + 2)
    assert ex["hb-1"]["score"] == pytest.approx(s1)  # negative example score is kept, not clipped
    assert ex["hb-2"]["score"] == pytest.approx(s2) and ex["hb-3"]["score"] == pytest.approx(s3)
    assert ex["hb-4"]["skipped"] == "no response" and ex["hb-5"]["skipped"] == "judge call failed"
    S = out["summary"]
    assert S["score"] == pytest.approx((s1 + s2 + s3) / 3) and S["n"] == 3
    assert S["skipped"] == {"count": 2, "no response": 1, "judge call failed": 1}
    et, rt = S["breakdown"]["example_tag"], S["breakdown"]["rubric_tag"]
    assert et["theme:fever"]["score"] == pytest.approx((s1 + s2) / 2) and et["theme:fever"]["n"] == 2
    assert et["theme:sleep"]["score"] == 1.0 and et["theme:sleep"]["n"] == 1  # hb-4 skipped
    assert et["physician_agreed_category:enough-context"]["score"] == 0.0  # clip(-0.375)
    # rubric tags: per example, the score over that tag's items only
    assert rt["axis:completeness"]["score"] == pytest.approx((5 / 5 + 0 / 6 + 2 / 2) / 3)
    acc = [(-8) / 3, 4 / 4, 2 / 2]  # hb-1: A2 met (-8), A3 not (+3); hb-2: B1; hb-3: C2
    assert sum(acc) / 3 < 0 and rt["axis:accuracy"]["score"] == 0.0  # clipped to [0, 1]
    assert "axis:communication" not in rt  # its only item is negative: dropped
    assert rt["level:example"]["n"] == 1
    lo, hi = S["ci95"]
    assert 0 <= lo <= hi <= 1 and S["std"] > 0
    # one call per rubric item; the failing one is asked 1 + max_retries times
    assert len(srv.requests) == 3 + 3 + 2 + (1 + 3)
    assert stats["judge/calls"] == 9 and stats["judge/failures"] == 1
    assert stats["judge/usd_total"] is None  # "gemini-test" has no price: unknown, never Flash's
    # the grader sees the item's points, the whole conversation and the reply to grade
    hb2 = [user_text(r) for r in srv.requests if "B1 says" in user_text(r)][0]
    assert "(+4 points)" in hb2 and "How high?" in hb2 and "38.5 C is fine if she drinks." in hb2


def test_healthbench_benchmark_clipped_at_zero_examples_not(tmp_path, key):
    rows = eval_data.load_healthbench(write_jsonl(tmp_path / "hb.jsonl", HB_ROWS[:1]))
    with FakeServer("gemini") as srv:
        srv.rule = hb_rule
        with make_judge(srv) as j:
            out = ev.grade("healthbench", rows, eval_data.match_answers(rows, HB_ANSWERS), j, progress=False)
    assert out["examples"][0]["score"] == pytest.approx(-3 / 8)
    assert out["summary"]["score"] == 0.0 and out["summary"]["ci95"] == [0.0, 0.0]


def test_healthbench_loader_names_bad_rows(tmp_path):
    bad = dict(HB_ROWS[0], rubrics=[{"criterion": "x", "points": "five", "tags": []}])
    with pytest.raises(ValueError, match="line 1.*points"):
        eval_data.load_healthbench(write_jsonl(tmp_path / "bad.jsonl", [bad]))
    with pytest.raises(FileNotFoundError):
        eval_data.load_healthbench(str(tmp_path / "missing.jsonl"))


# ----------------------------------------------------------------------------------------------------
# ResearchQA through a loopback OpenAI-compatible judge

RQA_LABEL_OF = {f"R{k}": lb for k, lb in enumerate(
    ["Completely", "Mostly", "Moderately", "Barely", "Not at all", "Completely", "Completely", "Mostly",
     "Moderately", "Completely"], start=1)}
RQA_LABEL_OF.update({"S1": "Mostly", "S2": "Barely"})
RQA_ROWS = [
    {"id": "q1", "general_domain": "Biology", "subdomain": "Ecology", "field": "Ecology",
     "query": "How do wolves change river courses?", "date": "2024-01",
     "rubric": [{"rubric_item": f"R{k} covers point {k}", "type": "citation" if k <= 3 else "general",
                 **({"citation_metadata": {"title": "t"}} if k == 1 else {})} for k in range(1, 11)]},
    {"id": "q2", "general_domain": "Physics", "subdomain": "Optics", "field": "Optics",
     "query": "Why is the sky blue?", "date": "2024-02",
     "rubric": [{"rubric_item": f"T{k} something", "type": "general"} for k in range(1, 4)]},
    {"id": "q3", "general_domain": "Biology", "subdomain": "Genetics", "field": "Genetics",
     "query": "What is CRISPR?", "date": "2024-03",
     "rubric": [{"rubric_item": "S1 explains guide RNA", "type": "general"},
                {"rubric_item": "S2 cites the 2012 paper", "type": "citation"}]},
]


def rqa_rule(req):
    u = user_text(req)
    assert "labels" in props(req)
    items = re.findall(r"^\d+\. ([A-Z]\d+) ", u, re.M)
    if items[0].startswith("T"):  # always one label short: the example is skipped after the retries
        return {"json": {"labels": ["Mostly"] * (len(items) - 1)}}
    return {"json": {"labels": [RQA_LABEL_OF[i] for i in items]}}


def test_researchqa_coverage_batches_and_skips_by_hand(tmp_path, key):
    path = tmp_path / "test.json"
    path.write_text(json.dumps(RQA_ROWS), encoding="utf-8")  # a JSON list, as released
    rows = eval_data.load_researchqa(str(path))
    resp = tmp_path / "responses.json"  # ResearchQA's own response map: id -> {"answer": ...}
    resp.write_text(json.dumps({k: {"answer": f"answer to {k}"} for k in ("q1", "q2", "q3")}))
    answers = eval_data.match_answers(rows, eval_data.load_responses(str(resp)))
    with FakeServer("openai") as srv:
        srv.rule = rqa_rule
        with make_judge(srv) as j:
            out = ev.grade("researchqa", rows, answers, j, progress=False)
    assert srv.errors == []
    ex = {r["id"]: r for r in out["examples"]}
    c1 = (1 + 0.75 + 0.5 + 0.25 + 0 + 1 + 1 + 0.75 + 0.5 + 1) / 10  # labels R1..R10 -> (x - 1) / 4
    c3 = (0.75 + 0.25) / 2
    assert ex["q1"]["score"] == pytest.approx(c1) and ex["q3"]["score"] == pytest.approx(c3)
    assert ex["q2"]["skipped"] == "label count wrong or call failed after retries"
    S = out["summary"]
    assert S["score"] == pytest.approx((c1 + c3) / 2) and S["skipped"]["count"] == 1
    # item types: per example the mean over its items of that type, then the mean over examples
    cit = [(1 + 0.75 + 0.5) / 3, 0.25]
    assert S["breakdown"]["item_type"]["citation"]["score"] == pytest.approx(sum(cit) / 2)
    assert S["breakdown"]["general_domain"]["Biology"]["n"] == 2
    # batches of 8: q1 sends 8 + 2 items; q2 is asked 1 + 3 times; q3 once
    sizes = sorted(len(re.findall(r"^\d+\. ", user_text(r), re.M)) for r in srv.requests)
    assert sizes == [2, 2, 3, 3, 3, 3, 8]


# ----------------------------------------------------------------------------------------------------
# DeepResearch Bench RACE

DRB_QUERIES = [{"id": 1, "topic": "Energy", "language": "en", "prompt": "Task one: grid storage"},
               {"id": 2, "topic": "Finance", "language": "zh", "prompt": "Task two: bond ladders"},
               {"id": 3, "topic": "Energy", "language": "en", "prompt": "Task three: unanswered"}]


def _crit(name, w):
    return {"criterion": name, "explanation": f"about {name}", "weight": w}


DRB_CRITERIA = [
    {"id": 1, "prompt": "Task one: grid storage",
     "dimension_weight": {"comprehensiveness": 0.4, "insight": 0.3, "instruction_following": 0.2,
                          "readability": 0.1},
     "criterions": {"comprehensiveness": [_crit("Coverage of causes", 0.6), _crit("Use of data", 0.4)],
                    "insight": [_crit("Depth of analysis", 1.0)],
                    "instruction_following": [_crit("Answers every sub-question", 0.5),
                                              _crit("Respects the scope", 0.5)],
                    "readability": [_crit("Clear structure", 1.0)]}},
    {"id": 2, "prompt": "Task two: bond ladders",
     "dimension_weight": {d: 0.25 for d in ev.RACE_DIMS},
     "criterions": {d: [_crit(f"{d} main", 1.0)] for d in ev.RACE_DIMS}},
    {"id": 3, "prompt": "Task three: unanswered",
     "dimension_weight": {d: 0.25 for d in ev.RACE_DIMS},
     "criterions": {d: [_crit(f"{d} main", 1.0)] for d in ev.RACE_DIMS}},
]
DRB_REFERENCE = [{"id": 1, "prompt": "Task one: grid storage", "article": "Reference article one."},
                 {"prompt": "Task two: bond ladders", "article": "Reference article two."},  # by prompt
                 {"id": 3, "prompt": "Task three: unanswered", "article": "Reference three."}]


def _s(name, a, b):
    return {"criterion": name, "analysis": "compared", "article_1_score": a, "article_2_score": b}


DRB_REPLIES = {
    "Task one": {"comprehensiveness": [_s("Coverage of causes", 8, 6), _s("use of data", 4, 8)],  # case
                 "insight": [_s("Depth of analysis (insight)", 7, 7)],  # substring
                 "instruction_following": [_s("Answers every sub-question", 9, 5), _s("Tone", 3, 9)],
                 "readability": [_s("Clear structure", 5, 10)]},
    "Task two": {"comprehensiveness": [_s("comprehensiveness main", 8, 2)],
                 "insight": [_s("insight main", 6, 6)],
                 "instruction_following": [_s("instruction_following main", 10, 0)],
                 "readability": [_s("readability main", 0, 0)]},
}


def drb_rule(req):
    u = user_text(req)
    assert "comprehensiveness" in props(req)
    assert u.index("Report 1") < u.index("Report 2")
    return {"json": DRB_REPLIES["Task one" if "Task one" in u else "Task two"]}


def test_drb_race_scores_and_criteria_matching_by_hand(tmp_path, key):
    rows = eval_data.load_rows("drb", write_jsonl(tmp_path / "query.jsonl", DRB_QUERIES),
                        write_jsonl(tmp_path / "criteria.jsonl", DRB_CRITERIA),
                        write_jsonl(tmp_path / "reference.jsonl", DRB_REFERENCE))
    assert [r["id"] for r in rows] == ["1", "2", "3"] and rows[1]["reference"] == "Reference article two."
    resp = write_jsonl(tmp_path / "model.jsonl", [
        {"id": 1, "prompt": "Task one: grid storage", "article": "Our article one."},
        {"id": 2, "prompt": "Task two: bond ladders", "article": "Our article two."}])
    answers = eval_data.match_answers(rows, eval_data.load_responses(resp))
    with FakeServer("gemini") as srv:
        srv.rule = drb_rule
        with make_judge(srv) as j:
            out = ev.grade("drb", rows, answers, j, progress=False)
    assert srv.errors == [] and len(srv.requests) == 2  # one call per answered task
    u = user_text(srv.requests[0])
    assert "Our article" in u and "Reference article" in u and "0.6" not in u  # weights hidden
    ex = {r["id"]: r for r in out["examples"]}
    # Task one: T_d, R_d weighted by criterion; "Tone" is unmatched -> the dimension's mean weight 0.5
    Tc, Rc = 0.6 * 8 + 0.4 * 4, 0.6 * 6 + 0.4 * 8  # 6.4, 6.8
    Ti, Ri = 7.0, 7.0
    Tf, Rf = 0.5 * 9 + 0.5 * 3, 0.5 * 5 + 0.5 * 9  # 6, 7
    Tr, Rr = 5.0, 10.0
    T1 = 0.4 * Tc + 0.3 * Ti + 0.2 * Tf + 0.1 * Tr
    R1 = 0.4 * Rc + 0.3 * Ri + 0.2 * Rf + 0.1 * Rr
    assert ex["1"]["T"] == pytest.approx(T1) and ex["1"]["R"] == pytest.approx(R1)
    assert ex["1"]["score"] == pytest.approx(T1 / (T1 + R1))
    assert ex["1"]["unmatched"] == ["instruction_following: Tone"]
    assert ex["1"]["dimensions"]["comprehensiveness"] == pytest.approx(Tc / (Tc + Rc))
    # Task two: T = 0.25 (8 + 6 + 10 + 0), R = 0.25 (2 + 6 + 0 + 0); readability 0 / 0 -> 0
    T2, R2 = 0.25 * 24, 0.25 * 8
    assert ex["2"]["score"] == pytest.approx(T2 / (T2 + R2)) and ex["2"]["dimensions"]["readability"] == 0.0
    assert ex["3"]["skipped"] == "no response"
    S = out["summary"]
    assert S["score_100"] == pytest.approx(100 * (T1 / (T1 + R1) + 0.75) / 2)
    dim = S["breakdown"]["dimension"]
    assert dim["readability"]["score"] == pytest.approx((Tr / (Tr + Rr) + 0.0) / 2)
    assert dim["insight"]["score"] == pytest.approx(0.5)
    assert S["breakdown"]["language"]["zh"]["score"] == pytest.approx(0.75)


def test_drb_loader_checks_dimension_weights(tmp_path):
    bad = [dict(DRB_CRITERIA[0], dimension_weight={"comprehensiveness": 0.5, "insight": 0.3,
                                                   "instruction_following": 0.2, "readability": 0.1})]
    with pytest.raises(ValueError, match="sum to 1"):
        eval_data.load_drb(write_jsonl(tmp_path / "q.jsonl", DRB_QUERIES[:1]),
                    write_jsonl(tmp_path / "c.jsonl", bad), write_jsonl(tmp_path / "r.jsonl", DRB_REFERENCE))


def test_race_reply_missing_a_dimension_is_invalid():
    with pytest.raises(ValueError, match="readability"):
        ev.validate_race({d: [] for d in ev.RACE_DIMS[:3]})
    with pytest.raises(ValueError):
        ev.validate_race({d: [_s("x", 11, 2)] for d in ev.RACE_DIMS})


# ----------------------------------------------------------------------------------------------------
# ResearchRubrics

RR_ROWS = [
    {"prompt": "Compare the 2023 budgets of the two agencies.", "sample_id": "s1", "domain": "Policy",
     "rubrics": [{"criterion": "K1 states the 2023 figure", "weight": 5, "axis": "Explicit"},
                 {"criterion": "K2 cites a primary source", "weight": 3, "axis": "Implicit"},
                 {"criterion": "K3 confuses the two agencies", "weight": -4, "axis": "Explicit"},
                 {"criterion": "K4 gives a recommendation", "weight": 2, "axis": "Communication"}]},
    {"prompt": "Summarise the trial results.", "sample_id": "s2", "domain": "Medicine",
     "rubrics": [{"criterion": "L1 uses a clear table", "weight": 1, "axis": "Communication"}]},
    {"prompt": "Only pitfalls here.", "sample_id": "s3", "domain": "Policy",
     "rubrics": [{"criterion": "M1 invents numbers", "weight": -2, "axis": "Explicit"}]},
]
RR_BINARY = {"K1": "Satisfied", "K2": "Not Satisfied", "K3": "Satisfied", "K4": "Satisfied",
             "L1": "Satisfied", "M1": "Not Satisfied"}


def rr_rule(req):
    u = user_text(req)
    p = props(req)
    code = re.search(r"\):\n([KLM]\d) ", u).group(1)
    enum = p["verdict"]["enum"]
    v = "Partially Satisfied" if code == "K2" and "Partially Satisfied" in enum else RR_BINARY[code]
    return {"json": {"explanation": "ok", "verdict": v, "score": ev.RR_VERDICTS[v]}}


@pytest.mark.parametrize("ternary", [False, True])
def test_researchrubrics_compliance_negative_weights_and_ternary(tmp_path, key, ternary):
    rows = eval_data.load_researchrubrics(write_jsonl(tmp_path / "rr.jsonl", RR_ROWS))
    resp = write_jsonl(tmp_path / "r.jsonl", [{"sample_id": s, "response": f"report {s}"}
                                              for s in ("s1", "s2", "s3")])
    answers = eval_data.match_answers(rows, eval_data.load_responses(resp, "sample_id"))
    with FakeServer("openai") as srv:
        srv.rule = rr_rule
        with make_judge(srv) as j:
            out = ev.grade("researchrubrics", rows, answers, j, ternary=ternary, progress=False)
    assert srv.errors == [] and len(srv.requests) == 6
    ex = {r["id"]: r for r in out["examples"]}
    k2 = 0.5 if ternary else 0.0
    c1 = (5 * 1 + 3 * k2 + (-4) * 1 + 2 * 1) / (5 + 3 + 2)  # K3 is a pitfall the report commits
    assert ex["s1"]["score"] == pytest.approx(c1) and ex["s2"]["score"] == 1.0
    assert ex["s3"]["skipped"] == "no positive weight"
    S = out["summary"]
    assert S["score"] == pytest.approx((c1 + 1.0) / 2)
    ax = S["breakdown"]["axis"]
    assert ax["Explicit"]["score"] == pytest.approx((5 - 4) / 5) and ax["Explicit"]["n"] == 1
    assert ax["Implicit"]["score"] == pytest.approx(k2) and ax["Communication"]["n"] == 2


def test_a_raising_judge_call_skips_only_its_example():
    class StubJudge:  # judge.ask's contract, with one call that raises
        def ask(self, system, user, schema, validate):
            if "L1 uses" in user:
                raise RuntimeError("unexpected")
            return validate({"explanation": "", "verdict": "Satisfied", "score": 1})

    rows = [{"id": r["sample_id"], "prompt": r["prompt"], "domain": r["domain"],
             "items": [dict(x, weight=float(x["weight"])) for x in r["rubrics"]]} for r in RR_ROWS[:2]]
    out = ev.grade("researchrubrics", rows, ["report a", "report b"], StubJudge(), progress=False)
    ex = {r["id"]: r for r in out["examples"]}
    assert ex["s1"]["score"] == pytest.approx((5 + 3 - 4 + 2) / 10)
    assert ex["s2"]["skipped"] == "judge call failed" and out["summary"]["skipped"]["count"] == 1


def test_researchrubrics_binary_rejects_partial_verdict():
    with pytest.raises(ValueError):
        ev.validate_rr({"verdict": "Partially Satisfied", "score": 0.5}, ternary=False)
    assert ev.validate_rr({"verdict": "Partially Satisfied", "score": 0.5}, ternary=True)["s"] == 0.5


# ----------------------------------------------------------------------------------------------------
# Responses, generation and the CLI


def test_load_responses_formats_and_errors(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"prompt_id": "x", "completion": "A"}, {"id": 7, "answer": "B"}])
    assert eval_data.load_responses(p, "prompt_id") == {"x": "A", "7": "B"}
    with pytest.raises(ValueError, match="repeated"):
        eval_data.load_responses(write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "answer": "a"},
                                                               {"id": 1, "answer": "b"}]))
    with pytest.raises(ValueError, match="no response text"):
        eval_data.load_responses(write_jsonl(tmp_path / "n.jsonl", [{"id": 1, "score": 3}]))


def test_generate_answers_takes_the_answer_text_through_the_scaffold():
    import scaffold
    import toyfix

    tok = toyfix.tiny_tokenizer()
    first = ("<structured_plan><analysis>a</analysis><rubrics>r</rubrics><research_plan>p</research_plan>"
             "</structured_plan>" + scaffold.CALL_OPEN + "wolves rivers</call_tool>")
    last = ("<state_evaluation>found [1]</state_evaluation><review><rubrics_review>ok</rubrics_review>"
            "<writing_plan>w</writing_plan></review><answer>Wolves reshape rivers [1].</answer><|im_end|>")
    sampler = toyfix.scripted_from_texts(tok, [[first, last], ["no tags at all<|im_end|>"]])
    engine = toyfix.make_engine(sampler, tok)
    answers, missing = eval_answers.generate_answers(engine, ["q one", "q two"], batch=2, progress=False)
    assert answers == ["Wolves reshape rivers [1].", ""] and missing == 1
    assert len(engine.tools["google_search"].docs) > 0 and sampler.calls == 2  # the tool ran


def test_cli_checkpoint_path_offline_with_toy_search(tmp_path, key):
    from toy import model as toy_model
    import toyfix

    tok = toyfix.tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    data = write_jsonl(tmp_path / "rr.jsonl", RR_ROWS[:2])
    with FakeServer("gemini") as srv:
        srv.rule = lambda req: {"json": {"explanation": "e", "verdict": "Satisfied", "score": 1}}
        rc = ev.main(["researchrubrics", "--data", str(data), "--model", str(ckpt), "--search", "toy",
                      "--max-response-tokens", "16", "--judge", "gemini", "--judge-model", srv.model,
                      "--judge-base-url", srv.url, "--judge-cache-dir", "", "--out", str(tmp_path / "out"),
                      "--no-progress"])
    assert rc == 0 and srv.errors == [] and len(srv.requests) == 5
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    # every criterion Satisfied: (5 + 3 - 4 + 2) / 10 and 1 / 1
    assert rep["summary"]["score"] == pytest.approx((0.6 + 1.0) / 2)
    assert rep["settings"]["generation"]["search"] == "toy" and rep["judge"]["judge/calls"] == 5
    gen = [json.loads(x) for x in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [g["id"] for g in gen] == ["s1", "s2"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.startswith("# researchrubrics: 80.0") and "Paper (RubricEM-8B): 50.3" in md


def test_build_engine_uses_the_scaffold_and_prompt_of_the_checkpoints_run_card(tmp_path):
    from backends.run import runcard
    from toy import model as toy_model
    from backends.run import config as settings, presets
    import toyfix
    from scaffold import SYSTEM_PROMPT_COMPACT

    tok = toyfix.tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    plain, trained = tmp_path / "plain", tmp_path / "unstructured"
    for d in (plain, trained):
        model.save_pretrained(d)
        tok.save_pretrained(d)
    cfg = presets.toy_preset()
    cfg.rollout.scaffold = "unstructured"
    runcard.save_with_run_card(str(trained), tok, dataclasses.asdict(cfg), "Think, search, answer.")
    engine, info = eval_answers.build_engine(str(trained), "toy", cache_dir=str(tmp_path / "cache"))
    assert engine.scaffold == "unstructured" and info["scaffold"] == "unstructured"
    assert engine.system_prompt == info["system_prompt"] == "Think, search, answer."
    # no run card: the structured scaffold and the preset's prompt
    engine, info = eval_answers.build_engine(str(plain), "toy", cache_dir=str(tmp_path / "cache"))
    assert engine.scaffold == "structured" and engine.system_prompt == SYSTEM_PROMPT_COMPACT


def test_cli_help_documents_every_benchmark(capsys):
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    out = capsys.readouterr().out
    for name, url in [("healthbench", "openaipublic.blob.core.windows.net/simple-evals/healthbench"),
                      ("researchqa", "huggingface.co/datasets/realliyifei/ResearchQA"),
                      ("drb", "github.com/Ayanami0730/deep_research_bench"),
                      ("researchrubrics", "huggingface.co/datasets/ScaleAI/researchrubrics")]:
        assert name in out and url in out
    assert all(str(v) in out for v in ev.PAPER_SCORES.values())
