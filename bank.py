"""The rubric bank: reflection memory keyed by query, with exact and similar retrieval.

"RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards", arXiv 2605.10899.
Implements §3.4 (second half: "the best valid candidate is upserted into the rubric bank (key: sha256 of
the query)") and the two retrieval modes of the §3.5 windowed curriculum: "cross-episode similar" (top-k
bank items of similar queries, for fresh batches) and "within-episode exact" (the reflection written for
that very query on the first pass, for replayed batches). The bank is text memory: nothing here has
gradients, and the reflection GRPO update lives elsewhere.

Glossary
    q        a research query (one row of the RL data set)
    r        a reflection: free text of lessons / rubrics the reflection meta-policy wrote for q
    key      sha256(q.strip().encode("utf-8")).hexdigest(), the bank's primary key (§3.4)
    k        retrieval top-k (the paper: 2)

What each piece implements
    query_key                        the bank key, "sha256 of the query" (§3.4)
    validate_reflection              "valid" in "the best valid candidate" (§3.4); the rules are ours
    RubricBank.upsert                "the best valid candidate is upserted into the rubric bank" (§3.4)
    RubricBank.get_exact             "within-episode exact" retrieval (§3.5)
    RubricBank.retrieve_similar      "cross-episode similar" retrieval, top-k = 2 (§3.5, appendix)
    RubricBank.retrieve              the curriculum's switch between the two modes (§3.5)
    RubricBank.save / load           "bank saved every 10 steps" (appendix), written atomically
    format_for_prompt                the strings the scaffold places in the prompt (§3.2, inside <memory>)
    Retriever / BM25Retriever        the similarity backend behind retrieve_similar
    main                             command line: list, show and remove entries of a saved bank

Deviations from the paper
    1. Similar retrieval ranks the stored *query texts* by BM25, not by Qwen3-Embedding-0.6B embeddings
       (appendix). A dense retriever plugs in through `Retriever` (`RubricBank(retriever=...)`); BM25 is
       the default so that a toy run loads no embedding model.
    2. Our BM25 uses Lucene's idf, ln(1 + (N - n_t + 0.5) / (n_t + 0.5)) > 0, instead of rank_bm25's
       Okapi idf, which is <= 0 for every term while the bank holds one or two queries, so an early bank
       would never return anything.
    3. The paper does not define "valid". We refuse empty text, text longer than `max_chars`, text
       carrying scaffold tags or chat special tokens, and near-copies of the trajectory (rules in
       `validate_reflection`). Bad model text is refused and counted, never raised.
    4. Replacement: the paper's "upsert" replaces, and so do we (newest wins). We add two guards the
       paper does not state: a write from an older training step than the stored one is refused, since
       the asynchronous reflection branch can finish out of order (§3.5, Limitations); and
       `keep_best=True` keeps the higher judge score instead of the newest reflection.
    5. The paper does not say whether "cross-episode similar" may return the query's own entry; we
       exclude it by default (`exclude_self=True`) so that the mode really transfers across queries,
       and we return fewer than k items rather than pad with unrelated ones.
    6. The key hashes the query with surrounding whitespace stripped, so that "q" and "q\\n" share an
       entry; the paper says only "sha256 of the query".
    7. BM25 similar retrieval ignores function words and the words of a request's form ("write",
       "short", "cited report", ...: `RETRIEVAL_STOP_WORDS`): with them, two questions that share only
       their phrasing ("What is known about the ... of X? Give a short cited report.") outscored a
       question about the same entity or the same aspects, so a fresh query received the lessons of
       unrelated entities. Similarity now rests on what a query is about: names, aspects, topics.

Command line (the bank file is JSONL, one entry per line, sorted by key)
    python bank.py list   runs/toy/bank.jsonl
    python bank.py show   runs/toy/bank.jsonl 3fa9c2        # a unique key prefix, a full key, or the query
    python bank.py remove runs/toy/bank.jsonl 3fa9c2        # rewrites the file atomically
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, runtime_checkable

import numpy as np
from rank_bm25 import BM25Okapi

# PAPER: "rubric bank ... retrieval top-k = 2" (appendix).
DEFAULT_TOP_K = 2
# Not in the paper: every retrieved reflection lands in every rollout's prompt, so we cap its length
# (Unicode code points of the stripped text); 600 is about 150 tokens, two items stay under 400.
DEFAULT_MAX_CHARS = 600
# Not in the paper: a reflection whose words are more than 80% covered by 8-word runs that also occur
# in the trajectory restates the trajectory instead of distilling a lesson from it.
COPY_THRESHOLD = 0.8
COPY_NGRAM = 8
# PAPER: the two retrieval modes of the windowed curriculum (§3.5).
MODE_SIMILAR = "similar"  # "cross-episode similar"
MODE_EXACT = "exact"  # "within-episode exact"
MODES = (MODE_SIMILAR, MODE_EXACT)

# Tags of the §3.2 scaffold (scaffold.py), plus <memory> (where bank items sit in the prompt) and
# <think> (Qwen3 reasoning). A reflection carrying one would open or close a stage inside the prompt.
SCAFFOLD_TAG_NAMES = (
    "structured_plan", "analysis", "rubrics", "research_plan", "call_tool", "tool_output",
    "state_evaluation", "review", "rubrics_review", "writing_plan", "answer", "memory", "think",
)
CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
# "<" then an optional "/" then a tag name not followed by a word character: catches "<answer>",
# "</answer>", '<call_tool name="x">' and a truncated "<review", but not "<answers>" or "a < b".
_TAG_RE = re.compile(r"<\s*/?\s*(?:" + "|".join(SCAFFOLD_TAG_NAMES) + r")(?![\w-])", re.IGNORECASE)
# Any ChatML-style special token "<|...|>", so a new one (e.g. <|im_sep|>) is caught too.
_SPECIAL_RE = re.compile(r"<\|[^|<>\s]{1,64}\|>")
_WORD_RE = re.compile(r"\w+")

# Reason codes: what validate_reflection returns and what RubricBank.rejections counts.
REASON_OK = "ok"
REASON_EMPTY = "empty"  # empty or whitespace only
REASON_ENCODING = "not_utf8"  # lone surrogates: cannot be hashed, saved or tokenised
REASON_TOO_LONG = "too_long"  # more than max_chars code points after stripping
REASON_TAG = "scaffold_tag"  # a scaffold tag or a chat special token
REASON_COPY = "trajectory_copy"  # a near-copy of the trajectory
REASON_STALE = "stale_step"  # upsert only: older training step than the stored entry
REASON_NOT_BETTER = "not_better"  # upsert only, keep_best=True: lower score than the stored entry

_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------------
# Keys, tokens and validation (pure functions)

def query_key(query: str) -> str:
    """The bank key of a query, "sha256 of the query" (§3.4).

    Hashes exactly `query.strip().encode("utf-8")` (str.strip removes Unicode whitespace at both ends;
    no case folding, no Unicode normalisation) and returns the 64-character lowercase hex digest.
    Raises TypeError if `query` is not a str, UnicodeEncodeError (a ValueError) if it holds lone
    surrogates.
    """
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    return hashlib.sha256(query.strip().encode("utf-8")).hexdigest()


def tokenize(text: str) -> list[str]:
    """BM25 and copy-check tokens: `re.findall(r"\\w+", text.lower())` (Unicode word runs).

    Punctuation and whitespace separate tokens and are dropped; a run of CJK characters is one token
    (a known weakness of word BM25 that a dense retriever removes).
    """
    return _WORD_RE.findall(text.lower())


# Not in the paper (Deviation 7): words that carry a request's form, not its topic. English function
# words, and the instruction words of research prompts (the toy world's question templates use only
# these and the function words, so two toy questions match on their entities and aspects alone).
RETRIEVAL_STOP_WORDS = frozenset("""
    a about after all also an and any are as at be been before being both but by can could did do
    does each for from had has have how i if in into is it its me more most my no not of on or other
    our out over please so some such than that the their them then there these they this those to
    under up was we were what when where which while who whom why will with would you your
    answer brief cite cited cites citing covering describe detail details differ difference
    differences explain find give known list need overview provide question report research short
    source sources sourced summarise summarize tell write compare comparison
""".split())


def content_tokens(text: str) -> list[str]:
    """`tokenize` tokens without RETRIEVAL_STOP_WORDS (Deviation 7): the words BM25 similar retrieval
    matches on. "What is known about the habitat of Kuvebro? Give a short cited report." ->
    ["habitat", "kuvebro"]."""
    return [t for t in tokenize(text) if t not in RETRIEVAL_STOP_WORDS]


def copy_fraction(text: str, trajectory_text: str, n: int = COPY_NGRAM) -> float:
    """Fraction in [0, 1] of the words of `text` that lie inside a word n-gram also found in the trajectory.

    Words are `tokenize` tokens, so case, punctuation and spacing changes do not hide a copy. If `text`
    has fewer than n words, n shrinks to its length: a short text counts as copied (1.0) exactly when
    its whole word sequence occurs in the trajectory. Empty inputs give 0.0. Raises ValueError if n < 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    words, traj = tokenize(text), tokenize(trajectory_text)
    if not words or not traj:
        return 0.0
    n = min(n, len(words))
    if len(traj) < n:
        return 0.0
    seen = {tuple(traj[i:i + n]) for i in range(len(traj) - n + 1)}
    covered = [False] * len(words)
    for i in range(len(words) - n + 1):
        if tuple(words[i:i + n]) in seen:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(words)


def validate_reflection(text: str, trajectory_text: str | None = None, max_chars: int = DEFAULT_MAX_CHARS,
                        *, copy_threshold: float = COPY_THRESHOLD, copy_ngram: int = COPY_NGRAM,
                        ) -> tuple[bool, str]:
    """Bank admission check, the "valid" of "the best valid candidate" (§3.4; rules are ours, Deviation 3).

    Checks run on `text.strip()` in this order and the first failure is reported:
      "empty"            nothing but whitespace;
      "not_utf8"         lone surrogates (cannot be hashed, saved or tokenised);
      "too_long"         more than `max_chars` Unicode code points;
      "scaffold_tag"     a scaffold tag, opening or closing, any case, with or without attributes
                         (SCAFFOLD_TAG_NAMES), or a chat special token "<|...|>";
      "trajectory_copy"  `trajectory_text` given and copy_fraction(text, trajectory_text, copy_ngram)
                         > copy_threshold.
    Returns (True, "ok") or (False, reason). Never raises for the content of `text`: bad model text is
    a refusal. Raises TypeError if `text` or `trajectory_text` is not a str, ValueError if max_chars < 1,
    copy_ngram < 1 or copy_threshold is outside (0, 1].
    """
    if not isinstance(text, str):
        raise TypeError(f"reflection must be a str, got {type(text).__name__}")
    if trajectory_text is not None and not isinstance(trajectory_text, str):
        raise TypeError(f"trajectory_text must be a str or None, got {type(trajectory_text).__name__}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be an int >= 1, got {max_chars!r}")
    if not 0.0 < copy_threshold <= 1.0:
        raise ValueError(f"copy_threshold must lie in (0, 1], got {copy_threshold!r}")
    if copy_ngram < 1:
        raise ValueError(f"copy_ngram must be >= 1, got {copy_ngram!r}")
    body = text.strip()
    if not body:
        return False, REASON_EMPTY
    try:
        body.encode("utf-8")
    except UnicodeEncodeError:
        return False, REASON_ENCODING
    if len(body) > max_chars:
        return False, REASON_TOO_LONG
    if _TAG_RE.search(body) or _SPECIAL_RE.search(body):
        return False, REASON_TAG
    if trajectory_text and copy_fraction(body, trajectory_text, copy_ngram) > copy_threshold:
        return False, REASON_COPY
    return True, REASON_OK


def _check_step(step: Any, name: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{name} must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"{name} must be >= 0, got {step}")
    return step


def _check_score(score: Any) -> float:
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise TypeError(f"score must be a real number, got {type(score).__name__}")
    score = float(score)
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        raise ValueError(f"score must be a finite number in [0, 1], got {score!r}")
    return score


def _check_meta(meta: Any) -> dict:
    # A JSON round trip both checks that meta is serialisable and gives the bank its own copy.
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict or None, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta must be JSON-serialisable without NaN/inf: {exc}") from exc


def _check_query(query: Any) -> str:
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    q = query.strip()
    if not q:
        raise ValueError("query is empty")
    q.encode("utf-8")  # UnicodeEncodeError (a ValueError) on lone surrogates
    return q


# ----------------------------------------------------------------------------------------------------
# Entries

@dataclass(frozen=True)
class BankEntry:
    """One bank item: the reflection currently stored for one query (§3.4).

    key           str, query_key(query), 64 lowercase hex characters
    query         str, the query, stripped (so query_key(query) == key)
    reflection    str, the reflection text, stripped, non-empty
    step          int >= 0, training step at which this reflection was written (== updated_step)
    score         float in [0, 1], the privileged judge's score of this reflection
    query_hash    str, == key (kept under the paper's name, "query_hash=sha256(query)")
    created_step  int >= 0, step of the first admitted write for this query
    updated_step  int >= created_step, step of the latest admitted write
    n_updates     int >= 0, admitted writes after the first (0 for a fresh entry)
    meta          dict of JSON values, e.g. the two criterion scores; replaced on every write
    Frozen; `meta` is the bank's own copy and should be treated as read-only.
    """

    key: str
    query: str
    reflection: str
    step: int
    score: float
    query_hash: str
    created_step: int
    updated_step: int
    n_updates: int = 0
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-serialisable dict, fields in declaration order; `meta` is deep-copied."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "BankEntry":
        """Rebuild an entry from `to_dict` output, checking every field and invariant.

        `meta` may be absent (-> {}); any other missing or unknown field, a wrong type, a score outside
        [0, 1], key != query_key(query), query_hash != key, step != updated_step or
        created_step > updated_step raises ValueError.
        """
        if not isinstance(d, dict):
            raise ValueError(f"an entry must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = names - set(d) - {"meta"}, set(d) - names
        if missing or unknown:
            raise ValueError(f"missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        try:
            for name in ("key", "query", "reflection", "query_hash"):
                if not isinstance(d[name], str):
                    raise TypeError(f"{name} must be a str, got {type(d[name]).__name__}")
            for name in ("step", "created_step", "updated_step", "n_updates"):
                _check_step(d[name], name)
            entry = cls(key=d["key"], query=d["query"], reflection=d["reflection"], step=d["step"],
                        score=_check_score(d["score"]), query_hash=d["query_hash"],
                        created_step=d["created_step"], updated_step=d["updated_step"],
                        n_updates=d["n_updates"], meta=_check_meta(d.get("meta")))
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
        if entry.key != query_key(entry.query) or entry.query != entry.query.strip():
            raise ValueError(f"key {entry.key[:12]}... is not sha256 of the stripped query")
        if entry.query_hash != entry.key:
            raise ValueError("query_hash differs from key")
        if not entry.reflection or entry.reflection != entry.reflection.strip():
            raise ValueError("reflection must be non-empty and stripped")
        entry.reflection.encode("utf-8")  # UnicodeEncodeError (a ValueError) on lone surrogates
        if entry.step != entry.updated_step or entry.created_step > entry.updated_step:
            raise ValueError("steps must satisfy created_step <= updated_step == step")
        return entry


def format_for_prompt(entries: Iterable[BankEntry]) -> list[str]:
    """The strings the scaffold places into the prompt (§3.2/§3.5): each entry's reflection, stripped.

    Takes BankEntry items (e.g. `RubricBank.retrieve` output), keeps their order, returns list[str];
    raises TypeError on anything else. The scaffold adds its own wrapping (<memory>, bullets).
    """
    out = []
    for e in entries:
        if not isinstance(e, BankEntry):
            raise TypeError(f"expected BankEntry, got {type(e).__name__}")
        out.append(e.reflection.strip())
    return out


# ----------------------------------------------------------------------------------------------------
# Retrievers: the extension point for "cross-episode similar" (§3.5)

@runtime_checkable
class Retriever(Protocol):
    """Similarity backend over the bank's stored queries.

    `fit(queries)` indexes a list of query strings (called by the bank only when its set of keys
    changed, never with an empty list); `topk(query, k)` returns at most k (index into the fitted
    list, score) pairs, best first, ties by lower index. The bank drops pairs whose score is not > 0,
    so a backend signals "unrelated" with a score <= 0. A dense backend (the paper's
    Qwen3-Embedding-0.6B through sentence-transformers) implements these two methods, imports its
    library inside `__init__` so a toy run never loads it, and is passed as RubricBank(retriever=...).
    """

    def fit(self, queries: list[str]) -> None: ...

    def topk(self, query: str, k: int) -> list[tuple[int, float]]: ...


class _LuceneIdfBM25(BM25Okapi):
    """rank_bm25's Okapi scorer with Lucene's always-positive idf (Deviation 2)."""

    def _calc_idf(self, nd: dict) -> None:
        for word, n_t in nd.items():
            # Eq. (Lucene idf): idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5)) > 0
            self.idf[word] = math.log1p((self.corpus_size - n_t + 0.5) / (n_t + 0.5))
        self.average_idf = sum(self.idf.values()) / max(len(self.idf), 1)


class BM25Retriever:
    """BM25 over query texts as `content_tokens` (k1 = 1.5, b = 0.75, rank_bm25 defaults; Lucene idf):
    function words and request-form words are left out (Deviation 7).

    Scores are >= 0 and 0 exactly when a document shares no content token with the query; only
    positive scores are returned.
    """

    def __init__(self, k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self._bm25: BM25Okapi | None = None

    def fit(self, queries: list[str]) -> None:
        docs = [content_tokens(q) for q in queries]
        # rank_bm25 divides by the mean document length, so a corpus without tokens has no index.
        self._bm25 = _LuceneIdfBM25(docs, k1=self.k1, b=self.b) if any(docs) else None

    def topk(self, query: str, k: int) -> list[tuple[int, float]]:
        tokens = content_tokens(query)
        if k <= 0 or self._bm25 is None or not tokens:
            return []
        scores = self._bm25.get_scores(tokens)  # (N,)
        # Sort by score descending, ties by index ascending, so results do not depend on numpy's sort.
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        return [(int(i), float(scores[i])) for i in order if scores[i] > 0]


# ----------------------------------------------------------------------------------------------------
# The bank

# PAPER: "rubric bank embeddings Qwen3-Embedding-0.6B" (dense retrieval, backends/scale/retrieval.py)
PAPER_EMBED_MODEL = "Qwen/Qwen3-Embedding-0.6B"


class RubricBank:
    """The agent rubric bank (§3.4): one reflection per query, keyed by query_key, with exact and
    similar retrieval (§3.5) and atomic JSONL persistence.

    Replacement policy (`upsert`): a valid reflection for a new query is inserted; for a stored query
    it replaces the stored one (newest wins; n_updates += 1), except that a write from an older step
    than the stored `updated_step` is refused ("stale_step"), and with keep_best=True a write with a
    lower score than the stored one is refused ("not_better"; equal scores replace).

    Attributes: `rejections` (dict reason -> count of refused writes), `n_admitted` (admitted writes),
    `skipped_lines` (bad lines skipped by load(strict=False)). Methods that change or read the index
    hold a lock, because the reflection branch runs asynchronously (§3.5).
    """

    def __init__(self, *, max_chars: int = DEFAULT_MAX_CHARS, keep_best: bool = False,
                 retriever: Retriever | None = None, copy_threshold: float = COPY_THRESHOLD,
                 copy_ngram: int = COPY_NGRAM):
        # Reuse validate_reflection's argument checks, so that a bad setting fails here, not mid-run.
        validate_reflection("x", None, max_chars, copy_threshold=copy_threshold, copy_ngram=copy_ngram)
        self.max_chars, self.keep_best = max_chars, bool(keep_best)
        self.copy_threshold, self.copy_ngram = copy_threshold, copy_ngram
        # Extension point: any Retriever (e.g. a dense embedding one); one retriever per bank.
        self.retriever: Retriever = retriever if retriever is not None else BM25Retriever()
        if not isinstance(self.retriever, Retriever):
            raise TypeError("retriever must implement fit(queries) and topk(query, k)")
        self._entries: dict[str, BankEntry] = {}
        self._index_keys: list[str] | None = None  # keys in fitted order; None: refit before use
        self._lock = threading.RLock()
        self.rejections: dict[str, int] = {}
        self.n_admitted = 0
        self.skipped_lines = 0

    @classmethod
    def from_config(cls, cfg, retriever: Retriever | None = None) -> "RubricBank":
        """Build a bank from the run's `bank` section (hparams.BankConfig); raises ValueError for an unknown `cfg.retriever`."""
        if retriever is None and cfg.retriever != "bm25":
            raise ValueError(f"unknown retriever {cfg.retriever!r}; available: 'bm25' (or pass retriever=)")
        return cls(max_chars=cfg.max_chars, keep_best=cfg.keep_best, retriever=retriever)

    # -- writes --------------------------------------------------------------------------------------

    def upsert(self, query: str, reflection: str, step: int, score: float, meta: dict | None = None,
               *, trajectory_text: str | None = None) -> bool:
        """Insert or replace the reflection for `query` (§3.4: "the best valid candidate is upserted").

        query: str, non-empty after stripping; reflection: str (model text, validated by
        validate_reflection against `trajectory_text` if given); step: int >= 0, the training step;
        score: real in [0, 1], the judge's score of the reflection; meta: JSON-serialisable dict or None.
        Returns True if the write was admitted, False if refused (the reason is counted in
        `rejections`; see the class docstring for the replacement policy). Raises TypeError/ValueError
        for programming errors only: wrong types, empty query, step < 0, score not finite or outside
        [0, 1], meta not serialisable.
        """
        q, step, score, meta = _check_query(query), _check_step(step), _check_score(score), _check_meta(meta)
        ok, reason = validate_reflection(reflection, trajectory_text, self.max_chars,
                                         copy_threshold=self.copy_threshold, copy_ngram=self.copy_ngram)
        if not ok:
            return self._reject(reason)
        key = query_key(q)  # PAPER: "key: sha256 of the query"
        with self._lock:
            old = self._entries.get(key)
            if old is None:
                self._entries[key] = BankEntry(key=key, query=q, reflection=reflection.strip(), step=step,
                                               score=score, query_hash=key, created_step=step,
                                               updated_step=step, n_updates=0, meta=meta)
                self._index_keys = None  # a new query: the similarity index is stale
            else:
                if step < old.updated_step:
                    return self._reject(REASON_STALE)
                if self.keep_best and score < old.score:
                    return self._reject(REASON_NOT_BETTER)
                # The stored query text is unchanged, so the similarity index stays valid.
                self._entries[key] = dataclasses.replace(
                    old, reflection=reflection.strip(), step=step, score=score, updated_step=step,
                    n_updates=old.n_updates + 1, meta=meta)
            self.n_admitted += 1
            return True

    def _reject(self, reason: str) -> bool:
        with self._lock:
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
        return False

    def remove(self, key_or_query: str) -> bool:
        """Delete the entry with this key (64 hex) or for this query text; returns whether one existed."""
        with self._lock:
            key = self._resolve(key_or_query)
            if key is None:
                return False
            del self._entries[key]
            self._index_keys = None
            return True

    def _resolve(self, key_or_query: Any) -> str | None:
        # A stored key matches first; otherwise the string is read as a query text.
        if not isinstance(key_or_query, str):
            return None
        if key_or_query in self._entries:
            return key_or_query
        try:
            key = query_key(key_or_query)
        except UnicodeEncodeError:
            return None
        return key if key in self._entries else None

    # -- reads ---------------------------------------------------------------------------------------

    def get_exact(self, query: str) -> BankEntry | None:
        """"Within-episode exact" retrieval (§3.5): the entry stored for `query` itself, or None.

        The query is matched by query_key (surrounding whitespace ignored). Raises TypeError if it is
        not a str, UnicodeEncodeError (a ValueError) if it holds lone surrogates.
        """
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        with self._lock:
            return self._entries.get(query_key(query))

    def retrieve_similar(self, query: str, k: int = DEFAULT_TOP_K, exclude_self: bool = True,
                         ) -> list[BankEntry]:
        """"Cross-episode similar" retrieval (§3.5): up to k entries whose stored queries are most similar.

        Ranks stored queries with `self.retriever` (default: BM25 over `content_tokens`), best first,
        ties by key; only entries with a positive score are returned, so the list may be shorter than k
        and is [] for an empty bank or a query sharing no token with any stored query. With
        exclude_self=True (default) the query's own entry is never returned, so the mode transfers
        across queries (Deviation 5). The index is refitted lazily, only after the set of keys changed.
        k: int >= 0 (the paper: 2). Raises TypeError if query is not a str, ValueError if k < 0 or (with
        exclude_self) the query holds lone surrogates.
        """
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0, got {k!r}")
        with self._lock:
            if k == 0 or not self._entries:
                return []
            keys = self._ensure_index()
            self_key = query_key(query) if exclude_self else None
            # Ask for one more when our own entry may occupy a slot.
            hits = self.retriever.topk(query.strip(), k + (self_key in self._entries))
            out = []
            for i, s in hits:
                if keys[i] != self_key and s > 0:
                    out.append(self._entries[keys[i]])
            return out[:k]

    def _ensure_index(self) -> list[str]:
        if self._index_keys is None:
            keys = sorted(self._entries)  # key order: the index, and its ties, do not depend on history
            self.retriever.fit([self._entries[k].query for k in keys])
            self._index_keys = keys
        return self._index_keys

    def retrieve(self, query: str, mode: str, k: int = DEFAULT_TOP_K) -> list[BankEntry]:
        """Retrieval for one rollout prompt, in the §3.5 curriculum's mode.

        mode "similar" -> retrieve_similar(query, k, exclude_self=True) (fresh batches, steps 1-3 of a
        window); mode "exact" -> [get_exact(query)] or [] (replayed batches, steps 4-6; k is ignored).
        Raises ValueError for any other mode.
        """
        if mode == MODE_SIMILAR:
            return self.retrieve_similar(query, k, exclude_self=True)
        if mode == MODE_EXACT:
            entry = self.get_exact(query)
            return [entry] if entry is not None else []
        raise ValueError(f"unknown retrieval mode {mode!r}; expected one of {MODES}")

    def entries(self) -> list[BankEntry]:
        """All entries, sorted by key (a snapshot list)."""
        with self._lock:
            return [self._entries[k] for k in sorted(self._entries)]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key_or_query: object) -> bool:
        with self._lock:
            return self._resolve(key_or_query) is not None

    def __iter__(self) -> Iterator[BankEntry]:
        return iter(self.entries())

    def __repr__(self) -> str:
        return f"RubricBank(size={len(self)}, admitted={self.n_admitted}, rejections={self.rejections})"

    format_for_prompt = staticmethod(format_for_prompt)

    def metrics(self) -> dict[str, float]:
        """Logged scalars: bank/size, bank/admitted, bank/rejected, bank/rejected/<reason>."""
        with self._lock:
            out = {"bank/size": float(len(self)), "bank/admitted": float(self.n_admitted),
                   "bank/rejected": float(sum(self.rejections.values()))}
            out.update({f"bank/rejected/{r}": float(c) for r, c in sorted(self.rejections.items())})
            return out

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Checkpoint state: {"version", "entries" (to_dict list, key order), "rejections", "n_admitted"}."""
        with self._lock:
            return {"version": _FORMAT_VERSION, "entries": [e.to_dict() for e in self.entries()],
                    "rejections": dict(self.rejections), "n_admitted": self.n_admitted}

    def load_state_dict(self, state: dict) -> None:
        """Replace the contents with `state_dict()` output; raises ValueError (bank unchanged) if invalid."""
        if not isinstance(state, dict) or state.get("version") != _FORMAT_VERSION:
            raise ValueError(f"not a version-{_FORMAT_VERSION} bank state")
        entries = self._entries_from(enumerate(state.get("entries", []), start=1), "entry ", strict=True)
        rejections = state.get("rejections", {})
        if not all(isinstance(r, str) and isinstance(c, int) for r, c in rejections.items()):
            raise ValueError("rejections must map str -> int")
        with self._lock:
            self._entries, self._index_keys = entries, None
            self.rejections = dict(rejections)
            self.n_admitted = int(state.get("n_admitted", 0))

    def _entries_from(self, items: Iterable[tuple[int, Any]], where: str, strict: bool) -> dict:
        # items: (line or position number, parsed JSON); `where` prefixes the number in error messages.
        entries: dict[str, BankEntry] = {}
        for n, obj in items:
            try:
                e = BankEntry.from_dict(obj)
                if e.key in entries:
                    raise ValueError(f"duplicate key {e.key}")
            except ValueError as exc:
                if strict:
                    raise ValueError(f"{where}{n}: malformed bank entry: {exc}") from exc
                self.skipped_lines += 1
                continue
            entries[e.key] = e
        return entries

    def save(self, path: str | os.PathLike) -> None:
        """Write the bank to `path` as UTF-8 JSONL, one entry per line, sorted by key, atomically.

        The bytes depend only on the entries (not on insertion order). A crash at any point leaves
        either the previous file or the new one, never a mix (see atomic_write_bytes); it may leave a
        stray ".<name>.*.tmp" file beside it, which is safe to delete. Creates missing parent
        directories. Counters (rejections) are not saved here; state_dict carries them.
        """
        lines = [json.dumps(e.to_dict(), ensure_ascii=False, allow_nan=False) + "\n" for e in self.entries()]
        atomic_write_bytes(os.fspath(path), "".join(lines).encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike, *, missing_ok: bool = False, strict: bool = True,
             **kwargs: Any) -> "RubricBank":
        """Read a bank written by `save`; `kwargs` go to the constructor (max_chars, keep_best, retriever).

        A missing file gives an empty bank if missing_ok, else FileNotFoundError. Blank lines are
        ignored. A malformed line (not UTF-8, not JSON, or failing BankEntry.from_dict, or a duplicate
        key) raises ValueError naming "PATH:LINE"; with strict=False it is skipped and counted in
        `skipped_lines`. Entries are not re-validated against validate_reflection.
        """
        bank = cls(**kwargs)
        path = os.fspath(path)
        try:
            f = open(path, "rb")  # bytes, split on b"\n" only: JSON escapes every newline inside a value
        except FileNotFoundError:
            if missing_ok:
                return bank
            raise
        with f:
            items = []
            for lineno, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8").strip()
                    if text:
                        items.append((lineno, json.loads(text)))
                except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                    if strict:
                        raise ValueError(f"{path}:{lineno}: malformed bank line: {exc}") from exc
                    bank.skipped_lines += 1
        bank._entries = bank._entries_from(items, f"{path}:", strict)
        return bank


# ----------------------------------------------------------------------------------------------------
# Atomic file writes (the bank file; backends/run/checkpoint.py writes checkpoints and artefacts with it)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Replace `path` by `data` so that a crash leaves the old or the new file, never a partial one.

    Write a temp file in the same directory (same filesystem, so rename is atomic), flush and fsync
    it, os.replace it over `path`, then fsync the directory so the rename itself survives power loss.
    The new file keeps the old file's permission bits (0o644 for a new file).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if os.name == "posix":  # other systems cannot open a directory for fsync
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        except OSError:  # some filesystems refuse fsync on directories; the rename is done anyway
            pass
        finally:
            os.close(dfd)


# ----------------------------------------------------------------------------------------------------
# Command line

def _find(bank: RubricBank, key_or_prefix: str) -> BankEntry:
    """A full key, a query text, or a unique key prefix -> the entry; LookupError otherwise."""
    if key_or_prefix in bank:
        return bank._entries[bank._resolve(key_or_prefix)]
    s = key_or_prefix.strip().lower()
    matches = [e for e in bank if s and re.fullmatch(r"[0-9a-f]+", s) and e.key.startswith(s)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise LookupError(f"{key_or_prefix!r} is ambiguous: {len(matches)} keys start with it "
                          f"({', '.join(e.key[:12] for e in matches[:5])}...)")
    raise LookupError(f"no entry with key, key prefix or query {key_or_prefix!r}")


def _one_line(s: str, width: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= width else s[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    """`python bank.py {list,show,remove} PATH [KEY_OR_PREFIX]`; returns the exit status (0 ok, 1 error).

    list: one line per entry, newest (highest step) first: key prefix, step, score, the query (40
    characters at most) and the reflection (80 at most; whitespace folded, "..." marks a cut)."""
    parser = argparse.ArgumentParser(prog="bank.py", description="Inspect a saved rubric bank (JSONL).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="one line per entry, newest first: key prefix, step, score, "
                                    "query and reflection (each cut to fit one line)")
    p.add_argument("path")
    for name, text in (("show", "print one entry as JSON"),
                       ("remove", "delete one entry and rewrite the file atomically")):
        p = sub.add_parser(name, help=text)
        p.add_argument("path")
        p.add_argument("key", help="a full key, a unique key prefix, or the exact query text")
    args = parser.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # a non-UTF-8 terminal must not crash on a query
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        bank = RubricBank.load(args.path)
        if args.cmd == "list":
            print("key\tstep\tscore\tquery\treflection")
            for e in sorted(bank, key=lambda e: -e.step):  # newest first; ties keep key order
                print(f"{e.key[:12]}\t{e.step}\t{e.score:.3f}\t{_one_line(e.query, 40)}\t"
                      f"{_one_line(e.reflection, 80)}")
        elif args.cmd == "show":
            print(json.dumps(_find(bank, args.key).to_dict(), ensure_ascii=False, indent=2))
        else:
            entry = _find(bank, args.key)
            bank.remove(entry.key)
            bank.save(args.path)
            print(f"removed {entry.key}")
    except (OSError, ValueError, LookupError) as exc:
        print(f"bank.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

# ----------------------------------------------------------------------------------------------------
# The windowed curriculum (§3.5): which batch each step trains on, and how it retrieves


def curriculum(step: int, K: int = 3, enabled: bool = True) -> tuple[int, str]:
    """(batch index, retrieval mode) for a 0-based step. Windows of 2K steps: the first K steps
    draw fresh batches with "similar" retrieval, the next K replay them with "exact" retrieval.

    Example K = 3: steps 0,1,2 -> batches 0,1,2 similar; steps 3,4,5 -> batches 0,1,2 exact;
    steps 6,7,8 -> batches 3,4,5 similar; ... Without the curriculum: batch = step, "similar".
    """
    if not enabled:
        return step, "similar"
    w, j = divmod(step, 2 * K)
    # PAPER §3.5: steps 1..K fresh B_1..B_K (similar), steps K+1..2K replay B_1..B_K (exact)
    return (w * K + j, "similar") if j < K else (w * K + j - K, "exact")
