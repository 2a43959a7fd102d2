"""Tests of the toy research world (toy/world.py): the environment T of §3.1 in toy mode, its DR Tulu row
schema and loader, the BM25 `google_search` tool, and the distractors that make research necessary."""
import copy
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

import numpy as np

from toy.world import ASPECTS, BM25SearchTool, WorldConfig, bm25_tokens, make_world, top_k

from scaffold import Query, load_rows, parse_row

TINY = dict(n_train_entities=40, n_heldout_entities=10)


@pytest.fixture(scope="module")
def w():
    return make_world(WorldConfig(seed=0, **TINY))


@pytest.fixture(scope="module")
def tool(w):
    return BM25SearchTool(w.docs)


def _words(text: str) -> set:
    return set(re.findall(r"[A-Za-z]+", text))


# ---------------------------------------------------------------------------------------------------
# Determinism and splits


@settings(max_examples=8)
@given(seed=st.integers(0, 10_000))
def test_world_generator_is_deterministic_per_seed_sec3_1(seed):
    a = make_world(WorldConfig(seed=seed, **TINY))
    b = make_world(WorldConfig(seed=seed, **TINY))
    assert a.fingerprint() == b.fingerprint()
    assert a.docs == b.docs and a.train_rows == b.train_rows and a.heldout_rows == b.heldout_rows
    c = make_world(WorldConfig(seed=seed + 1, **TINY))
    assert c.fingerprint() != a.fingerprint()


def test_fingerprint_sees_any_change_to_rows_or_docs_sec3_1(w):
    w2 = copy.deepcopy(w)
    w2.train_rows[0] = dict(w2.train_rows[0], ground_truth=w2.train_rows[0]["ground_truth"] + " ")
    assert w2.fingerprint() != w.fingerprint()


def test_invalid_world_config_raises_naming_field_sec3_1():
    with pytest.raises(ValueError, match="p_outdated"):
        make_world(WorldConfig(p_outdated=1.5, **TINY))
    with pytest.raises(ValueError, match="count"):
        make_world(WorldConfig(n_train_entities=0, n_heldout_entities=1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heldout_split_shares_no_entity_with_train_sec3_1(seed):
    # A high comparison share so both splits certainly hold two-entity questions.
    wd = make_world(WorldConfig(seed=seed, p_compare=0.6, **TINY))
    train, held = set(wd.train_entities), set(wd.heldout_entities)
    assert not train & held
    assert len(train) == TINY["n_train_entities"] and len(held) == TINY["n_heldout_entities"]
    look = set(wd.lookalikes.values())
    for rows, mine, other in ((wd.train_rows, train, held), (wd.heldout_rows, held, train)):
        n_compare = 0
        for q in load_rows(rows):
            ents = q.toy["entities"]
            n_compare += len(ents) == 2
            assert set(ents) <= mine
            assert {f["entity"] for f in q.facts} <= mine
            # No entity of the other split (and no look-alike) is even named in the question text.
            assert not _words(q.query) & (other | look)
        assert n_compare > 0


# ---------------------------------------------------------------------------------------------------
# DR Tulu row schema and loader


def test_every_row_has_dr_tulu_schema_and_parses_sec3_1(w):
    rows = w.train_rows + w.heldout_rows
    qs = load_rows(rows)
    assert len(qs) == len(rows) == (40 + 10) * w.config.questions_per_entity
    for i, (row, q) in enumerate(zip(rows, qs)):
        assert set(row) == {"messages", "ground_truth"}
        msgs = row["messages"]
        assert isinstance(msgs, list) and len(msgs) == 1
        assert msgs[0]["role"] == "user" and msgs[0]["content"] == q.query
        assert isinstance(row["ground_truth"], str)
        gt = json.loads(row["ground_truth"])
        assert gt["query"] == q.query and q.row_index == i
        assert isinstance(gt["rubrics"], list) and gt["rubrics"]
        for r in gt["rubrics"]:
            assert {"title", "description", "weight"} <= set(r)
            assert isinstance(r["title"], str) and r["title"].strip()
            assert isinstance(r["description"], str) and r["description"].strip()
            assert isinstance(r["weight"], (int, float))
        # One rubric per asked fact plus the negative constraint.
        assert len(gt["rubrics"]) == len(q.facts) + 1
        for f in q.facts:
            assert f["aspect"] in ASPECTS and f["value"] == w.entities[f["entity"]][f["aspect"]]
            if f["doc_id"] is not None:
                d = w.doc(f["doc_id"])
                assert (d.entity, d.aspect, d.value, d.kind) == (
                    f["entity"], f["aspect"], f["value"], "true")


def test_real_rows_without_toy_key_load_sec3_1():
    row = {"messages": [{"role": "user", "content": "How does sleep affect memory?"}],
           "ground_truth": json.dumps({"query": "How does sleep affect memory?",
                                       "rubrics": [{"title": "t", "description": "d", "weight": 2}]})}
    (q,) = load_rows([row])
    assert isinstance(q, Query) and q.toy is None and q.facts == [] and q.rubrics[0]["weight"] == 2


def _good_row():
    return {"messages": [{"role": "user", "content": "Q?"}],
            "ground_truth": json.dumps({"query": "Q?", "rubrics": [
                {"title": "t", "description": "d", "weight": 1.0}]})}


def _with_gt(**gt):
    base = {"query": "Q?", "rubrics": [{"title": "t", "description": "d", "weight": 1.0}]}
    base.update(gt)
    row = _good_row()
    row["ground_truth"] = json.dumps(base)
    return row


@pytest.mark.parametrize("row, field", [
    (_with_gt(rubrics=[]), "rubrics"),
    (_with_gt(rubrics=None), "rubrics"),
    ({**_good_row(), "ground_truth": "{not json"}, "ground_truth"),
    ({**_good_row(), "ground_truth": json.dumps([1, 2])}, "ground_truth"),
    ({"messages": [{"role": "user", "content": ""}], "ground_truth": json.dumps(
        {"query": "", "rubrics": [{"title": "t", "description": "d", "weight": 1}]})}, "query"),
    (_with_gt(query="   "), "query"),
    ({**_good_row(), "messages": []}, "messages"),
    ({**_good_row(), "messages": [{"role": "assistant", "content": "Q?"}]}, "messages"),
    (_with_gt(rubrics=[{"title": "t", "weight": 1}]), "description"),
    (_with_gt(rubrics=[{"title": "t", "description": "d", "weight": "heavy"}]), "weight"),
])
def test_parse_row_error_names_the_field_sec3_1(row, field):
    with pytest.raises(ValueError, match=re.escape(field)) as e:
        parse_row(row, index=7)
    assert "row 7" in str(e.value)
    # load_rows reports the index of the first bad row.
    with pytest.raises(ValueError, match="row 1"):
        load_rows([_good_row(), row])


def test_parse_row_non_dict_message_raises_value_error_sec3_1():
    with pytest.raises(ValueError, match="messages"):
        parse_row({**_good_row(), "messages": ["Q?"]}, index=0)


def test_load_rows_empty_dataset_raises_sec3_1():
    with pytest.raises(ValueError, match="empty"):
        load_rows([])
    with pytest.raises(ValueError, match="empty"):
        load_rows(iter(()))


# ---------------------------------------------------------------------------------------------------
# The BM25 `google_search` tool


def test_bm25_tool_is_named_google_search_sec3_2(tool):
    assert tool.name == "google_search"
    with pytest.raises(ValueError):
        BM25SearchTool([])


_QUERY_WORDS = st.sampled_from(list(ASPECTS) + ["old", "record", "the", "of", "1974", "xyzzy"])


@settings(max_examples=40)
@given(data=st.data(), k=st.integers(1, 4))
def test_bm25_tool_returns_at_most_k_results_with_doc_ids_deterministically_sec3_2(w, data, k):
    names = sorted(w.entities)
    words = data.draw(st.lists(st.one_of(st.sampled_from(names), _QUERY_WORDS), max_size=4))
    query = " ".join(words)
    t1, t2 = BM25SearchTool(w.docs, k=k), BM25SearchTool(w.docs, k=k)
    r1 = t1(query)
    assert len(r1) <= k
    ids = [r.doc_id for r in r1]
    assert len(set(ids)) == len(ids)
    for r in r1:
        d = w.doc(r.doc_id)
        assert (r.title, r.text) == (d.title, d.text)
    assert t1(query) == r1 == t2(query)  # memoised and fresh index agree
    r1.clear()
    assert t1(query) == t2(query)  # the cache does not hand out its own list
    if not bm25_tokens(query):
        assert t1(query) == []


@given(scores=st.lists(st.sampled_from([0.0, 0.5, 1.25, 2.0, 3.5]), min_size=1, max_size=60),
       k=st.integers(1, 6))
def test_bm25_top_k_is_the_sorted_ranking_ties_by_document_order_sec3_2(scores, k):
    # the ranking BM25SearchTool returns: best score first, equal scores in document order (many
    # ties on purpose: five distinct values)
    want = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
    assert top_k(np.array(scores), k) == want


@settings(max_examples=40)
@given(data=st.data(), k=st.integers(1, 4))
def test_bm25_tool_ranks_as_rank_bm25_over_the_whole_corpus_sec3_2(w, data, k):
    """The tool scores only documents holding a query term (rank-bm25's get_batch_scores); its hits
    are exactly the top k of get_scores over every document, ties in document order, score > 0."""
    names = sorted(w.entities)
    words = data.draw(st.lists(st.one_of(st.sampled_from(names), _QUERY_WORDS), min_size=1, max_size=4))
    tool = BM25SearchTool(w.docs, k=k)
    terms = bm25_tokens(" ".join(words))
    full = tool._bm25.get_scores(terms) if terms else np.zeros(len(w.docs))
    want = [w.docs[i].doc_id for i in top_k(full, k) if full[i] > 0]
    assert [r.doc_id for r in tool(" ".join(words))] == want


def test_bm25_tool_finds_the_named_entity_sec3_2(w, tool):
    for name in w.train_entities[:15]:
        res = tool(name)
        assert res, name
        assert w.doc(res[0].doc_id).entity == name


def test_bm25_tool_punctuation_only_query_returns_nothing_sec3_2(tool):
    assert tool("") == [] and tool("?! ,;") == []


# ---------------------------------------------------------------------------------------------------
# Distractors


def test_distractors_exist_outdated_and_lookalike_docs_sec3_1(w):
    kinds = {d.kind for d in w.docs}
    assert kinds == {"true", "outdated", "lookalike"}
    asked = {e for r in load_rows(w.train_rows + w.heldout_rows) for e in r.toy["entities"]}
    for d in w.docs:
        if d.kind == "outdated":
            assert f"old {d.aspect} record" in d.text  # it says what it is: a careful reader can tell
            assert d.value != w.entities[d.entity][d.aspect]  # a wrong value
            assert d.entity in asked
        elif d.kind == "lookalike":
            assert d.entity in w.lookalikes.values() and d.entity not in asked
            (orig,) = [e for e, la in w.lookalikes.items() if la == d.entity]
            assert orig != d.entity and orig[:1] == d.entity[:1]
            assert d.value == w.entities[d.entity][d.aspect]
        else:
            assert d.value == w.entities[d.entity][d.aspect] and "old" not in d.text.split()


def test_an_old_record_comes_back_above_the_true_document_sec3_1(w, tool):
    """The causal task: a search for an asked fact that has an old record returns the old record
    first and the true document among the k results, so the research note must read on (the teacher's
    careless note copies the first)."""
    conflicts = 0
    for r in load_rows(w.train_rows):
        for f in r.facts:
            docs = w.docs_of(f["entity"], f["aspect"])
            if f["doc_id"] is None or not any(d.kind == "outdated" for d in docs):
                continue
            conflicts += 1
            res = [w.doc(x.doc_id) for x in tool(f"{f['entity']} {f['aspect']}")]
            assert res[0].kind == "outdated" and (res[0].entity, res[0].aspect) == (f["entity"], f["aspect"])
            assert f["doc_id"] in [d.doc_id for d in res]
    assert conflicts >= 10


def test_the_earlier_old_record_wording_stays_available_sec3_1():
    w = make_world(WorldConfig(outdated_first=False, p_outdated=0.15, **TINY))
    old = [d for d in w.docs if d.kind == "outdated"]
    assert old and all("(old record)" in d.title and "since corrected, gives" in d.text for d in old)


def test_unmarked_old_records_read_like_the_true_document_and_come_first_half_the_time_sec3_1():
    """WorldConfig.p_unmarked: a share of old records carries the true document's title and wording
    (no "old record" marker), so only the value tells them apart, and a coin puts the old record
    first in the corpus: BM25 ties go by document order, so about half the searches for such a fact
    return it above the true document. Every other draw of the world is unchanged."""
    base = make_world(WorldConfig(seed=3, n_train_entities=300, n_heldout_entities=10))
    w = make_world(WorldConfig(seed=3, n_train_entities=300, n_heldout_entities=10, p_unmarked=0.5))
    assert all(d.marked for d in base.docs)
    assert w.entities == base.entities and len(w.docs) == len(base.docs)
    assert [r["messages"] for r in w.train_rows] == [r["messages"] for r in base.train_rows]
    old = [d for d in w.docs if d.kind == "outdated"]
    unmarked = [d for d in old if not d.marked]
    assert 0.35 < len(unmarked) / len(old) < 0.65
    tool, first = BM25SearchTool(w.docs), []
    for d in unmarked:
        assert "old" not in d.text.split() and d.title == f"{d.entity} {d.aspect}"
        assert d.value != w.entities[d.entity][d.aspect]
        (true,) = [x for x in w.docs_of(d.entity, d.aspect) if x.kind == "true"] or [None]
        if true is None:
            continue
        assert true.text.replace(true.value, "") == d.text.replace(d.value, "")  # the same template
        ids = [x.doc_id for x in tool(f"{d.entity} {d.aspect}")]
        assert true.doc_id in ids
        first.append(d.doc_id in ids and ids.index(d.doc_id) < ids.index(true.doc_id))
    assert len(first) > 40 and 0.3 < sum(first) / len(first) < 0.7
    with pytest.raises(ValueError, match="p_unmarked"):
        make_world(WorldConfig(p_unmarked=1.5, **TINY))


def test_some_facts_are_missing_and_get_unknown_rubrics_sec3_1(w):
    qs = load_rows(w.train_rows + w.heldout_rows)
    missing = [(q, f) for q in qs for f in q.facts if f["doc_id"] is None]
    assert missing
    for q, f in missing:
        assert not any(d.kind == "true" and d.entity == f["entity"] and d.aspect == f["aspect"]
                       for d in w.docs)
        assert any(r["title"] == f"{f['entity']} {f['aspect']} unknown" for r in q.rubrics)
