"""Tests of the rubric bank (bank.py): §3.4 upsert and admission, §3.5 exact / similar retrieval,
atomic JSONL persistence, and the command-line tool."""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import example, given, strategies as st

import bank as bank_mod
from bank import BankEntry, BM25Retriever, RubricBank, Retriever, content_tokens, copy_fraction, format_for_prompt, query_key, validate_reflection
from hparams import BankConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANK_PY = os.path.join(ROOT, "bank.py")

SLEEP = "How does sleep affect cognitive decline in aging?"
SLEEP2 = "Sleep duration and cognitive decline in older adults"
SLEEP3 = "Does sleep quality predict memory in students?"
BATTERY = "Best battery chemistry for grid-scale storage"
SOLAR = "Solar panel efficiency records in 2024"
QUERIES = [SLEEP, SLEEP2, SLEEP3, BATTERY, SOLAR]

TRAJECTORY = (
    "<structured_plan><analysis>The user asks how sleep relates to cognitive decline.</analysis>"
    "<rubrics>need: longitudinal cohort evidence; avoid: causal claims from cross-sectional data"
    "</rubrics><research_plan>search cohort studies</research_plan></structured_plan>"
    '<call_tool name="google_search">sleep cognitive decline cohort</call_tool>'
    "<tool_output>[1] Whitehall II | short sleep in midlife was associated with higher dementia risk"
    " over twenty five years of follow up in a large British cohort</tool_output>"
    "<state_evaluation>Found one cohort study with a long follow up period.</state_evaluation>"
)


def make_bank(**kw) -> RubricBank:
    b = RubricBank(**kw)
    for i, q in enumerate(QUERIES):
        assert b.upsert(q, f"Lesson {i}: cite primary studies and name their design.", step=1, score=0.5)
    return b


# ---------------------------------------------------------------------------------------------------
# §3.4 key and upsert

def test_query_key_is_sha256_of_stripped_utf8_query_sec3_4():
    q = "  Qu'est-ce que la mémoire ? \n"
    assert query_key(q) == hashlib.sha256(q.strip().encode("utf-8")).hexdigest()
    assert query_key(q) == query_key(q.strip()) and len(query_key(q)) == 64
    assert query_key("Sleep") != query_key("sleep")  # no case folding
    with pytest.raises(TypeError):
        query_key(b"bytes")


def test_upsert_inserts_with_provenance_sec3_4():
    b = RubricBank()
    assert b.upsert("  " + SLEEP + "\n", "  Prefer cohort studies.  ", step=7, score=0.75,
                    meta={"within": 0.8, "cross": 0.7})
    e = b.get_exact(SLEEP)
    assert e == BankEntry(key=query_key(SLEEP), query=SLEEP, reflection="Prefer cohort studies.", step=7,
                          score=0.75, query_hash=query_key(SLEEP), created_step=7, updated_step=7,
                          n_updates=0, meta={"within": 0.8, "cross": 0.7})
    assert len(b) == 1 and b.n_admitted == 1 and b.rejections == {}
    json.dumps(e.to_dict())  # JSON-serialisable


def test_upsert_replaces_newest_wins_and_counts_updates_sec3_4():
    b = RubricBank()
    meta = {"within": 0.9}
    assert b.upsert(SLEEP, "First lesson.", step=1, score=0.9, meta=meta)
    meta["within"] = 0.0  # the bank holds its own copy
    assert b.get_exact(SLEEP).meta == {"within": 0.9}
    assert b.upsert(SLEEP, "Second lesson.", step=4, score=0.2)  # lower score still replaces
    assert b.upsert(SLEEP, "Third lesson.", step=4, score=0.3)  # same step replaces
    e = b.get_exact(SLEEP)
    assert (e.reflection, e.score, e.step, e.created_step, e.updated_step, e.n_updates, e.meta) == \
        ("Third lesson.", 0.3, 4, 1, 4, 2, {})
    assert len(b) == 1 and b.n_admitted == 3


def test_upsert_refuses_stale_step():
    b = RubricBank()
    assert b.upsert(SLEEP, "From step five.", step=5, score=0.5)
    assert not b.upsert(SLEEP, "From step three.", step=3, score=1.0)
    assert b.get_exact(SLEEP).reflection == "From step five." and b.rejections == {"stale_step": 1}


def test_keep_best_keeps_higher_score():
    b = RubricBank(keep_best=True)
    assert b.upsert(SLEEP, "Good lesson.", step=1, score=0.8)
    assert not b.upsert(SLEEP, "Worse lesson.", step=2, score=0.5)
    assert b.get_exact(SLEEP).reflection == "Good lesson." and b.rejections == {"not_better": 1}
    assert b.upsert(SLEEP, "Equal lesson.", step=3, score=0.8)  # ties replace: newest wins
    assert b.get_exact(SLEEP).n_updates == 1


@pytest.mark.parametrize("kw, exc", [
    (dict(score=float("nan")), ValueError), (dict(score=1.01), ValueError),
    (dict(score=-0.1), ValueError), (dict(score=float("inf")), ValueError),
    (dict(score="0.5"), TypeError), (dict(score=True), TypeError),
    (dict(step=-1), ValueError), (dict(step=1.0), TypeError),
    (dict(query="   "), ValueError), (dict(query=None), TypeError),
    (dict(reflection=None), TypeError), (dict(meta={"x": float("nan")}), ValueError),
    (dict(meta={"x": object()}), ValueError), (dict(meta=[1]), TypeError),
])
def test_upsert_programming_errors_raise(kw, exc):
    args = dict(query=SLEEP, reflection="A lesson.", step=1, score=0.5, meta=None) | kw
    b = RubricBank()
    with pytest.raises(exc):
        b.upsert(**args)
    assert len(b) == 0 and b.rejections == {}


# ---------------------------------------------------------------------------------------------------
# Admission ("the best valid candidate", §3.4)

BAD_TAGS = [t for name in bank_mod.SCAFFOLD_TAG_NAMES for t in (f"<{name}>", f"</{name}>")] + [
    '<call_tool name="google_search">', "<call_tool", "<ANSWER>", "< /answer >",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_sep|>"]


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ("  \n\t ", "empty"), ("x" * 601, "too_long"), ("\ud800 lone surrogate", "not_utf8"),
] + [(f"Lesson: keep {t} out of notes.", "scaffold_tag") for t in BAD_TAGS])
def test_admission_refusals_are_counted_and_not_inserted_sec3_4(text, reason):
    assert validate_reflection(text) == (False, reason)
    b = RubricBank()
    assert b.upsert(SLEEP, text, step=1, score=0.5) is False
    assert len(b) == 0 and b.rejections == {reason: 1}
    assert b.metrics()[f"bank/rejected/{reason}"] == 1.0


def test_admission_length_boundary_counts_stripped_code_points():
    assert validate_reflection("é" * 600) == (True, "ok")
    assert validate_reflection("  " + "é" * 600 + "\n") == (True, "ok")
    assert validate_reflection("é" * 601) == (False, "too_long")
    assert validate_reflection("abcd", max_chars=3) == (False, "too_long")


def test_admission_refuses_trajectory_copy_sec3_4():
    copied = ("Short sleep in midlife was associated with higher DEMENTIA risk over twenty-five years of "
              "follow up in a large British cohort.")
    assert copy_fraction(copied, TRAJECTORY) == 1.0  # case and punctuation do not hide a copy
    b = RubricBank()
    assert not b.upsert(SLEEP, copied, step=1, score=0.9, trajectory_text=TRAJECTORY)
    assert b.rejections == {"trajectory_copy": 1} and len(b) == 0
    # Without the trajectory the same text is admissible: the check needs the caller's context.
    assert b.upsert(SLEEP, copied, step=1, score=0.9)


def test_admission_accepts_distilled_lessons_and_tag_like_words():
    lesson = ("Search for longitudinal cohorts first; midlife short sleep predicted dementia in one "
              "cohort, so state the design and avoid causal wording.")
    assert copy_fraction(lesson, TRAJECTORY) < 0.8
    assert validate_reflection(lesson, TRAJECTORY) == (True, "ok")
    for text in ["The answer should map each rubric to evidence.", "Use <answers> sparingly.",
                 "If a < b then analysis>review.", "Write |im_start| in prose."]:
        assert validate_reflection(text) == (True, "ok"), text


def test_copy_fraction_short_text_and_edges():
    assert copy_fraction("cohort study", "a cohort study design") == 1.0  # whole short text occurs
    assert copy_fraction("study cohort", "a cohort study design") == 0.0
    assert copy_fraction("", TRAJECTORY) == 0.0 and copy_fraction("words", "") == 0.0
    with pytest.raises(ValueError):
        copy_fraction("a", "a", n=0)


def test_validate_argument_errors_raise():
    with pytest.raises(TypeError):
        validate_reflection(None)
    with pytest.raises(TypeError):
        validate_reflection("ok", trajectory_text=3)
    with pytest.raises(ValueError):
        validate_reflection("ok", max_chars=0)
    with pytest.raises(ValueError):
        validate_reflection("ok", copy_threshold=0.0)


@given(st.text(st.characters(categories=["Cs"]) | st.characters(), max_size=80),
       st.none() | st.text(max_size=80))
def test_validate_never_raises_on_model_text(text, trajectory):
    ok, reason = validate_reflection(text, trajectory)
    assert reason in {"ok", "empty", "not_utf8", "too_long", "scaffold_tag", "trajectory_copy"}
    assert ok == (reason == "ok")


# ---------------------------------------------------------------------------------------------------
# §3.5 retrieval: "within-episode exact" and "cross-episode similar"

def test_exact_mode_finds_own_entry_sec3_5():
    b = make_bank()
    assert b.get_exact(SLEEP).query == SLEEP
    assert b.get_exact("\n" + SLEEP + "  ").query == SLEEP
    assert b.retrieve(SLEEP, "exact") == [b.get_exact(SLEEP)]
    assert b.get_exact("An unseen query") is None and b.retrieve("An unseen query", "exact") == []


def test_similar_mode_returns_top_k_bm25_and_excludes_self_sec3_5():
    b = make_bank()
    got = b.retrieve(SLEEP, "similar", k=2)
    # The two other sleep queries share "sleep"/"cognitive decline"; SLEEP2 shares the most.
    assert [e.query for e in got] == [SLEEP2, SLEEP3]
    assert b.retrieve_similar(SLEEP, k=2) == got
    with_self = b.retrieve_similar(SLEEP, k=2, exclude_self=False)
    assert [e.query for e in with_self] == [SLEEP, SLEEP2]
    assert [e.query for e in b.retrieve_similar("grid storage battery", k=5)] == [BATTERY]


def test_similar_mode_returns_only_positive_scores_no_padding():
    b = make_bank()
    assert b.retrieve_similar("quantum chromodynamics lattice", k=2) == []
    assert b.retrieve_similar("?!", k=2) == []
    assert b.retrieve_similar(SLEEP, k=0) == []
    with pytest.raises(ValueError):
        b.retrieve_similar(SLEEP, k=-1)


def test_empty_bank_returns_nothing():
    b = RubricBank()
    assert b.retrieve(SLEEP, "similar") == [] and b.retrieve(SLEEP, "exact") == []
    assert b.retrieve_similar(SLEEP, exclude_self=False) == []


def test_similar_works_with_one_and_two_stored_queries():
    # rank_bm25's Okapi idf is <= 0 on such small corpora; our Lucene idf keeps scores positive.
    b = RubricBank()
    b.upsert(SLEEP, "Lesson A.", step=1, score=0.5)
    assert [e.query for e in b.retrieve_similar("sleep and aging", k=2)] == [SLEEP]
    b.upsert(SLEEP2, "Lesson B.", step=1, score=0.5)
    assert [e.query for e in b.retrieve_similar(SLEEP, k=2)] == [SLEEP2]


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        make_bank().retrieve(SLEEP, "nearest")


class CountingRetriever(BM25Retriever):
    def __init__(self):
        super().__init__()
        self.fits = 0

    def fit(self, queries):
        self.fits += 1
        super().fit(queries)


def test_index_is_rebuilt_lazily_only_when_keys_change():
    r = CountingRetriever()
    assert isinstance(r, Retriever)
    b = make_bank(retriever=r)
    assert r.fits == 0  # upserts alone never fit
    b.retrieve_similar(SLEEP)
    b.retrieve_similar(BATTERY)
    assert r.fits == 1
    b.upsert(SLEEP, "A replacement lesson.", step=2, score=0.5)  # same key: corpus unchanged
    b.retrieve_similar(SOLAR)
    assert r.fits == 1
    b.upsert("Sleep apnea treatment options", "New lesson.", step=2, score=0.5)
    assert [e.query for e in b.retrieve_similar(SLEEP2, k=1)] == [SLEEP]
    assert r.fits == 2
    assert b.remove(SLEEP)
    assert SLEEP not in [e.query for e in b.retrieve_similar(SLEEP2, k=4)]
    assert r.fits == 3


def test_custom_retriever_is_used():
    class Last:
        def fit(self, queries):
            self.n = len(queries)

        def topk(self, query, k):
            return [(self.n - 1, 1.0), (0, 0.0)][:k]

    b = make_bank(retriever=Last())
    assert b.retrieve_similar("anything", k=2) == [b.entries()[-1]]  # the 0.0 score is dropped
    with pytest.raises(TypeError):
        RubricBank(retriever=object())


def test_format_for_prompt_gives_stripped_reflections():
    b = make_bank()
    got = b.retrieve(SLEEP, "similar")
    assert format_for_prompt(got) == [e.reflection for e in got]
    assert RubricBank.format_for_prompt([]) == []
    with pytest.raises(TypeError):
        format_for_prompt(["a string"])


# ---------------------------------------------------------------------------------------------------
# Container API, state dicts

def test_remove_contains_len_iter():
    b = make_bank()
    assert len(b) == 5 and SLEEP in b and query_key(SLEEP) in b and 3 not in b
    assert list(b) == b.entries() and [e.key for e in b] == sorted(e.key for e in b)
    assert b.remove(query_key(SLEEP)) and SLEEP not in b and len(b) == 4
    assert b.remove(" " + BATTERY) and not b.remove(BATTERY) and not b.remove("nothing")


def test_state_dict_round_trip_and_invalid_state_leaves_bank_unchanged():
    b = make_bank()
    b.upsert(SLEEP, "", step=2, score=0.5)
    b2 = RubricBank()
    b2.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert b2.entries() == b.entries() and b2.rejections == {"empty": 1} and b2.n_admitted == 5
    bad = b.state_dict()
    bad["entries"][1]["score"] = 2.0
    with pytest.raises(ValueError, match="entry 2"):
        b2.load_state_dict(bad)
    assert b2.entries() == b.entries()


def test_config_builds_bank():
    cfg = BankConfig()
    assert (cfg.top_k, cfg.save_every) == (2, 10)  # PAPER: top-k 2, saved every 10 steps
    b = RubricBank.from_config(BankConfig(max_chars=10, keep_best=True))
    assert b.max_chars == 10 and b.keep_best
    with pytest.raises(ValueError):
        RubricBank.from_config(BankConfig(retriever="dense"))


# ---------------------------------------------------------------------------------------------------
# Persistence: JSONL, atomic save

def test_jsonl_round_trip_sorted_and_after_remove(tmp_path):
    path = tmp_path / "bank.jsonl"
    b = make_bank()
    b.upsert(SLEEP, "Updated: prefer cohorts.", step=3, score=0.9, meta={"within": 0.9, "cross": [1, 2]})
    b.save(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5 and [json.loads(x)["key"] for x in lines] == sorted(b_.key for b_ in b)
    assert RubricBank.load(path).entries() == b.entries()
    b.remove(SOLAR)
    b.save(path)
    loaded = RubricBank.load(path)
    assert loaded.entries() == b.entries() and SOLAR not in loaded and len(loaded) == 4
    # Bytes depend on the entries only, not on insertion order.
    b_rev = RubricBank()
    b_rev.load_state_dict({"version": 1, "entries": [e.to_dict() for e in reversed(b.entries())]})
    b_rev.save(tmp_path / "rev.jsonl")
    assert (tmp_path / "rev.jsonl").read_bytes() == path.read_bytes()


def test_save_creates_directories_and_empty_bank(tmp_path):
    path = tmp_path / "a" / "b" / "bank.jsonl"
    RubricBank().save(path)
    assert path.read_bytes() == b"" and len(RubricBank.load(path)) == 0


def test_atomic_save_survives_crash_between_write_and_rename(tmp_path, monkeypatch):
    path = tmp_path / "bank.jsonl"
    old = make_bank()
    old.save(path)
    before = path.read_bytes()
    new = make_bank()
    new.upsert("A brand new query", "A brand new lesson.", step=9, score=1.0)

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(bank_mod.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        new.save(path)
    assert path.read_bytes() == before
    assert RubricBank.load(path).entries() == old.entries()
    assert os.listdir(tmp_path) == ["bank.jsonl"]  # the temp file was cleaned up


def test_atomic_save_survives_process_killed_mid_write(tmp_path):
    path = tmp_path / "bank.jsonl"
    old = make_bank()
    old.save(path)
    before = path.read_bytes()
    # The child writes a new bank and blocks right after fsync of the temp file, before the rename;
    # we kill it there, so the timing is deterministic.
    child = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
import bank
b = bank.RubricBank()
b.upsert("A brand new query", "A brand new lesson.", step=9, score=1.0)
real_fsync = os.fsync
def blocking_fsync(fd):
    real_fsync(fd)
    print("WRITTEN", flush=True)
    time.sleep(60)
os.fsync = blocking_fsync
b.save({str(path)!r})
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITTEN"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    leftovers = [n for n in os.listdir(tmp_path) if n != "bank.jsonl"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")  # killed after writing, before rename
    assert b"brand new" in (tmp_path / leftovers[0]).read_bytes()
    assert path.read_bytes() == before and RubricBank.load(path).entries() == old.entries()
    new = make_bank()
    new.save(path)  # a later save works beside the stray temp file
    assert RubricBank.load(path).entries() == new.entries()


def test_load_missing_file(tmp_path):
    assert len(RubricBank.load(tmp_path / "none.jsonl", missing_ok=True)) == 0
    with pytest.raises(FileNotFoundError):
        RubricBank.load(tmp_path / "none.jsonl")


@pytest.mark.parametrize("bad", [
    b"{not json", b"[1, 2]", b"\xff\xfe", b'{"key": "x"}', "WRONG_KEY", "WRONG_SCORE", "DUPLICATE"])
def test_load_malformed_line_names_line_number_or_is_skipped(tmp_path, bad):
    path = tmp_path / "bank.jsonl"
    make_bank().save(path)
    lines = path.read_bytes().splitlines(keepends=True)
    first = json.loads(lines[0])
    if bad == "WRONG_KEY":
        bad = json.dumps(first | {"query": "tampered"}).encode()
    elif bad == "WRONG_SCORE":
        bad = json.dumps(first | {"score": 1.5}).encode()
    elif bad == "DUPLICATE":
        bad = lines[0].rstrip(b"\n")
    lines.insert(2, bad + b"\n")
    lines.insert(1, b"\n")  # blank lines are ignored; the bad line is now line 4
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"bank\.jsonl:4: malformed"):
        RubricBank.load(path)
    b = RubricBank.load(path, strict=False)
    assert len(b) == 5 and b.skipped_lines == 1


# ---------------------------------------------------------------------------------------------------
# Property: save -> load is the identity for any valid content

queries = st.text(min_size=1, max_size=40).filter(lambda s: s.strip())
reflections = st.text(min_size=1, max_size=120).filter(lambda s: validate_reflection(s)[0])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=6)
writes = st.lists(st.tuples(queries, reflections, st.integers(0, 5), st.floats(0, 1),
                            st.none() | st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
                  max_size=6)


@given(writes)
@example([("q\u2028with line separator\x85", "r\nwith\r\nnewlines\u2029 and \"quotes\" \\ é 😀", 0, 1.0,
           {"k": [None, 1.5, "\u2028"]})])
def test_save_load_is_identity_for_arbitrary_unicode(ws):
    b = RubricBank()
    for q, r, step, score, meta in ws:
        b.upsert(q, r, step, score, meta)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bank.jsonl")
        b.save(path)
        loaded = RubricBank.load(path)
        assert loaded.entries() == b.entries()
        assert len(open(path, "rb").read().splitlines()) == len(b)  # one entry per line
        loaded.save(os.path.join(d, "again.jsonl"))
        assert open(os.path.join(d, "again.jsonl"), "rb").read() == open(path, "rb").read()


@given(st.lists(queries, max_size=8, unique=True), queries, st.integers(0, 4))
def test_similar_results_are_distinct_other_entries_at_most_k(stored, q, k):
    b = RubricBank()
    for s in stored:
        b.upsert(s, "A lesson.", 0, 0.5)
    got = b.retrieve_similar(q, k=k)
    keys = [e.key for e in got]
    assert len(got) <= k and len(set(keys)) == len(keys) and query_key(q) not in keys
    assert all(e in b.entries() for e in got)


# ---------------------------------------------------------------------------------------------------
# Command line

def run_cli(*args):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, BANK_PY, *map(str, args)], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=60)


def test_cli_list_show_remove(tmp_path):
    path = tmp_path / "bank.jsonl"
    b = make_bank()
    b.upsert("Qu'est-ce que la mémoire ?", "Cherchez des méta-analyses.", step=2, score=0.25)
    b.save(path)

    out = run_cli("list", path)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert rows[0].split("\t") == ["key", "step", "score", "query", "reflection"] and len(rows) == 7
    assert any("mémoire" in r and "0.250" in r for r in rows)

    key = query_key(SLEEP)
    out = run_cli("show", path, key[:10])
    assert out.returncode == 0 and json.loads(out.stdout) == b.get_exact(SLEEP).to_dict()
    assert json.loads(run_cli("show", path, SOLAR).stdout)["query"] == SOLAR  # by query text
    miss = run_cli("show", path, "zzzz")
    assert miss.returncode == 1 and "no entry" in miss.stderr

    out = run_cli("remove", path, key[:10])
    assert out.returncode == 0 and key in out.stdout
    loaded = RubricBank.load(path)
    assert SLEEP not in loaded and len(loaded) == 5
    assert [n for n in os.listdir(tmp_path)] == ["bank.jsonl"]
    assert run_cli("list", tmp_path / "missing.jsonl").returncode == 1


def test_cli_list_shows_reflections_newest_first_one_line_each(tmp_path):
    path = tmp_path / "bank.jsonl"
    b = RubricBank()
    b.upsert("old question", "Search the first record.", step=1, score=0.5)
    b.upsert("new question", "Check the year twice.\nThen cite it. " + "Long tail " * 30, step=7,
             score=0.875)
    b.upsert("middle question", "Name the discoverer.", step=4, score=0.25)
    b.save(path)
    out = run_cli("list", path)
    assert out.returncode == 0, out.stderr
    rows = [r.split("\t") for r in out.stdout.splitlines()[1:]]
    assert [(r[1], r[2]) for r in rows] == [("7", "0.875"), ("4", "0.250"), ("1", "0.500")]
    assert rows[0][4].startswith("Check the year twice. Then cite it.") and rows[0][4].endswith("...")
    assert len(rows[0][4]) <= 80 and rows[2][4] == "Search the first record."
    assert len(out.stdout.splitlines()) == 4  # one line per entry, newlines in a reflection folded


def test_cli_ambiguous_prefix_is_an_error(tmp_path):
    path = tmp_path / "bank.jsonl"
    b = RubricBank()
    for i in range(40):  # 40 keys share some first hex digits
        b.upsert(f"query number {i}", "A lesson.", 0, 0.5)
    b.save(path)
    first = {}
    for e in b:
        first.setdefault(e.key[0], []).append(e)
    digit = next(d for d, es in first.items() if len(es) > 1)
    assert bank_mod.main(["show", str(path), digit]) == 1
    assert bank_mod.main(["remove", str(path), digit]) == 1
    assert len(RubricBank.load(path)) == 40


# ---------------------------------------------------------------------------------------------------
# Similar retrieval matches what a query is about, not its phrasing (Deviation 7)

def test_similar_retrieval_ignores_the_question_template_sec3_5():
    from toy.world import QUESTION_TEMPLATES_COMPARE, QUESTION_TEMPLATES_SINGLE

    tpl = QUESTION_TEMPLATES_SINGLE[1]  # "What is known about the {aspects} of {name}? Give a ..."
    q = tpl.format(aspects="habitat and use", name="Kuvebro")
    same_template = tpl.format(aspects="discoverer and year", name="Tasemi")  # another entity
    same_aspect = QUESTION_TEMPLATES_COMPARE[0].format(name="Lorani", name2="Mibel", aspects="habitat")
    same_entity = QUESTION_TEMPLATES_SINGLE[0].format(name="Kuvebro", aspects="year")
    b = RubricBank()
    for s in (same_template, same_aspect):
        b.upsert(s, "Search each aspect by name.", step=0, score=0.5)
    # the look-alike question on the same aspect comes first; the template alone matches nothing
    assert [e.query for e in b.retrieve(q, "similar", k=1)] == [same_aspect]
    assert [e.query for e in b.retrieve(q, "similar", k=2)] == [same_aspect]
    b.upsert(same_entity, "Kuvebro's year has no source.", step=0, score=0.5)
    assert [e.query for e in b.retrieve(q, "similar", k=2)] == [same_entity, same_aspect]
    # every single-entity template reduces to its entity and aspects
    for t in QUESTION_TEMPLATES_SINGLE:
        assert sorted(content_tokens(t.format(name="Kuvebro", aspects="habitat and use"))) == \
            ["habitat", "kuvebro", "use"]
    for t in QUESTION_TEMPLATES_COMPARE:
        assert sorted(content_tokens(t.format(name="Kuvebro", name2="Tasemi", aspects="year"))) == \
            ["kuvebro", "tasemi", "year"]
