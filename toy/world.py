"""The toy research world: fictional entities, a small web of documents, research questions, a search tool.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
This module is not a section of the paper: it is the environment T of §3.1 for toy mode, built so that a
policy must *research* (plan, search, weigh evidence, cite) to answer, and so that each of the four
stages of §3.2 can go wrong on its own.

What is in it
- Entities with made-up names built from shared syllables ("Kuvebro"), so a byte-level BPE splits
  them into common pieces and a tiny model can learn to copy an unseen name into a search query.
- Four aspects per entity (habitat, discoverer, year, use). Each (entity, aspect) has one short
  document, except a fraction that is *missing* (the honest answer is "no source gives it").
- Distractors that punish careless search and careless citation:
  * look-alike entities (last syllable changed) with documents on the same aspects;
  * outdated records: a second document on the same (entity, aspect) with a wrong value, titled
    "old record", which a careful agent must not report; optionally (WorldConfig.p_unmarked) some
    read like the current document, and only a lesson from an earlier attempt tells them apart.
- Questions asking for a short report on 2-4 aspects of one entity, or a comparison of two entities,
  in several phrasings; each row is stored in the DR Tulu RL schema
  (`messages` = one user turn, `ground_truth` = JSON `{"query", "rubrics": [{"description","title",
  "weight"}]}`) plus a `toy` key with the machine-checkable facts the toy judge uses. Real data goes
  through the same loader (`load_rows`) and simply has no `toy` key.
- `BM25SearchTool` ("google_search"): rank-bm25 over the corpus, returning the top few snippets.
  Full mode puts an HTTP search API behind the same `SearchTool` interface.

Deviations from the paper
1. The paper trains on real open-ended queries (DR Tulu RL data) with a live web search API; toy mode
   replaces both with this generated world so the whole method runs offline on a laptop CPU.
2. Citation handles are per-rollout numbers ([1], [2], ...) assigned by the rollout engine, not URLs
   or corpus ids: a tiny model can copy "[3]" but not a 4-digit id.

Launch: this module has no entry point; `python train.py --toy` builds the world from its seed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from rank_bm25 import BM25Okapi

from scaffold import SearchResult

# ----------------------------------------------------------------------------------------------------
# Vocabulary of the world

SYLLABLES = (
    "ka lo mi ren tu va sel dor bri na po gu fe lin mar te zo qui ran bel "
    "co da vi sun har el mo ri ta ne"
).split()
PLACES = "north south east west upper lower inner outer".split()
TERRAINS = "marshes hills forests dunes caves reefs".split()
FIRST = "Ada Boris Clara Dario Elena Felix Greta Hugo Irene Jonas".split()
LAST = "Moreau Lind Okafor Petrov Quist Rossi Sato Varga Weber Young".split()
USES = (
    "medicine dyes rope paper glue food fuel perfume tea soap ink glass"
).split()

ASPECTS = ("habitat", "discoverer", "year", "use")

# How a fact reads in a document, and in a teacher's answer sentence. One template per aspect keeps
# the judge's fact check exact ("the value appears in the sentence that names the entity").
DOC_TEMPLATES = {
    "habitat": ("{name} lives mainly in the {value}.", "Field notes place {name} in the {value}."),
    "discoverer": ("{name} was first described by {value}.", "The naturalist {value} described {name}."),
    "year": ("{name} was first recorded in {value}.", "Records of {name} begin in {value}."),
    "use": ("{name} is used for {value}.", "People value {name} for {value}."),
}
ANSWER_TEMPLATES = {
    "habitat": "{name} lives in the {value}",
    "discoverer": "{name} was described by {value}",
    "year": "{name} was first recorded in {value}",
    "use": "{name} is used for {value}",
}
QUESTION_TEMPLATES_SINGLE = (
    "Write a short report on {name}: its {aspects}.",
    "What is known about the {aspects} of {name}? Give a short cited report.",
    "Research {name} and report its {aspects}.",
    "I need a brief, sourced overview of {name} covering {aspects}.",
)
QUESTION_TEMPLATES_COMPARE = (
    "Compare {name} and {name2} by {aspects}.",
    "How do {name} and {name2} differ in {aspects}? Cite sources.",
)


def _join(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ----------------------------------------------------------------------------------------------------
# Data classes


@dataclass(frozen=True)
class Document:
    """One corpus document: one (entity, aspect) claim. `kind` is "true", "outdated" or "lookalike"."""

    doc_id: str
    title: str
    text: str
    entity: str
    aspect: str
    value: str
    kind: str
    marked: bool = True
    """False for an old record written like a current document (WorldConfig.p_unmarked)"""


@dataclass
class WorldConfig:
    """Size and difficulty of the toy world. Defaults follow ../notes measurements (>= 1000 train
    entities make name copying learnable); all values are ours, the paper has no toy world."""

    seed: int = 0
    """seed of the generated world (names, facts, documents, questions)"""
    n_train_entities: int = 3000
    """entities whose questions train the policy"""
    n_heldout_entities: int = 120
    """entities kept for the held-out evaluation (disjoint)"""
    p_missing: float = 0.10
    """(entity, aspect) pairs with no document at all"""
    p_outdated: float = 0.35
    """pairs with an extra "old record" carrying a wrong value (0.15 before the causal task)"""
    outdated_first: bool = True
    """an old record names its aspect twice ("Harta habitat | Harta habitat, old habitat record: north
    dunes."), so a search for "Harta habitat" returns it *above* the true document (and the true
    document second or third) and only a careful reading of the results avoids it; False: the earlier wording ("An old record, since corrected,
    gives: Harta lives mainly in ..."), which BM25 ranks below the entity's other documents, so with
    2 results per search an old record almost never came back"""
    p_unmarked: float = 0.0
    """share of old records written like a current document: no "old record" marker, the true
    document's title and wording, so no reading of the results tells the two values apart and a
    first attempt takes whichever BM25 ranks first; only a lesson that names the wrong value (from
    an earlier attempt's judged outcome, §3.4-3.5) tells them apart (0 = off: no draw is made)"""
    p_lookalike: float = 0.30
    """entities with a look-alike entity that has its own documents"""
    p_compare: float = 0.20
    """share of comparison questions"""
    questions_per_entity: int = 3
    """research questions generated per entity"""


@dataclass
class World:
    """A generated world: entities -> aspect values, the corpus, and the train / held-out rows."""

    config: WorldConfig
    entities: dict[str, dict[str, str]]  # name -> aspect -> true value
    train_entities: list[str]
    heldout_entities: list[str]
    lookalikes: dict[str, str]  # entity -> its look-alike entity's name
    docs: list[Document]
    train_rows: list[dict]
    heldout_rows: list[dict]

    def doc(self, doc_id: str) -> Document:
        return self._by_id[doc_id]

    def docs_of(self, entity: str, aspect: str) -> list[Document]:
        """The documents on (entity, aspect), of every kind, in corpus order."""
        return self._by_fact.get((entity, aspect), [])

    def __post_init__(self) -> None:
        self._by_id = {d.doc_id: d for d in self.docs}
        self._by_fact: dict[tuple[str, str], list[Document]] = {}
        for d in self.docs:
            self._by_fact.setdefault((d.entity, d.aspect), []).append(d)

    def fingerprint(self) -> str:
        """sha256 over the corpus and the rows: equal fingerprints mean identical worlds."""
        h = hashlib.sha256()
        for d in self.docs:
            rec = dataclasses.asdict(d)
            if d.marked:  # the field came later: a world without unmarked records keeps its hash
                del rec["marked"]
            h.update(json.dumps(rec, sort_keys=True).encode())
        for r in self.train_rows + self.heldout_rows:
            h.update(json.dumps(r, sort_keys=True).encode())
        return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# Generation


def _make_names(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        k = rng.choice((2, 2, 3))
        name = "".join(rng.choice(SYLLABLES) for _ in range(k)).capitalize()
        if name not in taken and 4 <= len(name) <= 11:
            taken.add(name)
            names.append(name)
    return names


def _lookalike(rng: random.Random, name: str, taken: set[str]) -> str | None:
    stem = name.lower()
    for _ in range(50):
        last = rng.choice(SYLLABLES)
        for s in sorted(SYLLABLES, key=len, reverse=True):
            if stem.endswith(s) and len(stem) > len(s):
                cand = (stem[: -len(s)] + last).capitalize()
                if cand not in taken and cand != name:
                    taken.add(cand)
                    return cand
                break
    return None


def _value(rng: random.Random, aspect: str) -> str:
    if aspect == "habitat":
        return f"{rng.choice(PLACES)} {rng.choice(TERRAINS)}"
    if aspect == "discoverer":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if aspect == "year":
        return str(rng.randint(1600, 1999))
    return rng.choice(USES)


def make_world(config: WorldConfig | None = None) -> World:
    """Generate the toy world deterministically from `config.seed` (pure Python, about a second).

    Returns a `World` whose train and held-out rows use disjoint entities (look-alikes are never
    asked about). Raises ValueError for non-positive sizes or probabilities outside [0, 1].
    """
    cfg = config or WorldConfig()
    if cfg.n_train_entities < 1 or cfg.n_heldout_entities < 1 or cfg.questions_per_entity < 1:
        raise ValueError("WorldConfig: entity and question counts must be >= 1")
    for f in ("p_missing", "p_outdated", "p_unmarked", "p_lookalike", "p_compare"):
        if not 0.0 <= getattr(cfg, f) <= 1.0:
            raise ValueError(f"WorldConfig.{f} must lie in [0, 1], got {getattr(cfg, f)}")
    rng = random.Random(cfg.seed)
    taken: set[str] = set()
    names = _make_names(rng, cfg.n_train_entities + cfg.n_heldout_entities, taken)
    train_names, heldout_names = names[: cfg.n_train_entities], names[cfg.n_train_entities :]

    entities: dict[str, dict[str, str]] = {}
    lookalikes: dict[str, str] = {}
    docs: list[Document] = []

    # The unmarked draws have their own stream, so a world without them keeps its draws.
    unmarked_rng = random.Random(f"{cfg.seed}-unmarked") if cfg.p_unmarked > 0 else None

    def add_doc(entity: str, aspect: str, value: str, kind: str) -> None:
        tpl = rng.choice(DOC_TEMPLATES[aspect])
        if kind == "outdated" and unmarked_rng is not None and unmarked_rng.random() < cfg.p_unmarked:
            # An old record that reads like the current one: the true document's title and template,
            # so BM25 scores the two alike (ties go by document order), and a coin decides which of
            # the two comes first in the corpus, hence in the results.
            true = docs[-1] if docs and (docs[-1].entity, docs[-1].aspect, docs[-1].kind) == \
                (entity, aspect, "true") else None
            tpl = next((t for t in DOC_TEMPLATES[aspect]
                        if true is not None and t.format(name=entity, value=true.value) == true.text), tpl)
            doc = Document(f"d{len(docs):05d}", f"{entity} {aspect}", tpl.format(name=entity, value=value),
                           entity, aspect, value, kind, False)
            if true is not None and unmarked_rng.random() < 0.5:  # the old record first
                docs[-1] = dataclasses.replace(doc, doc_id=true.doc_id)
                doc = dataclasses.replace(true, doc_id=doc.doc_id)
            docs.append(doc)
            return
        if kind == "outdated":
            if cfg.outdated_first:
                title, text = f"{entity} {aspect}", f"{entity} {aspect}, old {aspect} record: {value}."
            else:
                title = f"{entity} {aspect} (old record)"
                text = "An old record, since corrected, gives: " + tpl.format(name=entity, value=value)
        else:
            title = f"{entity} {aspect}"
            text = tpl.format(name=entity, value=value)
        docs.append(Document(f"d{len(docs):05d}", title, text, entity, aspect, value, kind))

    for name in names:
        entities[name] = {a: _value(rng, a) for a in ASPECTS}
        for a in ASPECTS:
            if rng.random() >= cfg.p_missing:
                add_doc(name, a, entities[name][a], "true")
            if rng.random() < cfg.p_outdated:
                wrong = _value(rng, a)
                while wrong == entities[name][a]:
                    wrong = _value(rng, a)
                add_doc(name, a, wrong, "outdated")
        if rng.random() < cfg.p_lookalike:
            la = _lookalike(rng, name, taken)
            if la is not None:
                lookalikes[name] = la
                entities[la] = {a: _value(rng, a) for a in ASPECTS}
                for a in rng.sample(ASPECTS, 2):
                    add_doc(la, a, entities[la][a], "lookalike")

    world = World(cfg, entities, train_names, heldout_names, lookalikes, docs, [], [])
    has_doc = {(d.entity, d.aspect): d.doc_id for d in docs if d.kind == "true"}
    world.train_rows = _make_rows(rng, world, train_names, has_doc)
    world.heldout_rows = _make_rows(rng, world, heldout_names, has_doc)
    return world


def _make_rows(rng: random.Random, world: World, names: list[str], has_doc: dict) -> list[dict]:
    cfg = world.config
    rows = []
    for name in names:
        for _ in range(cfg.questions_per_entity):
            if rng.random() < cfg.p_compare:
                other = rng.choice(names)
                while other == name:
                    other = rng.choice(names)
                aspects = rng.sample(ASPECTS, rng.choice((1, 2)))
                q = rng.choice(QUESTION_TEMPLATES_COMPARE).format(
                    name=name, name2=other, aspects=_join(aspects))
                targets = [(e, a) for a in aspects for e in (name, other)]
                ents = [name, other]
            else:
                aspects = rng.sample(ASPECTS, rng.choice((2, 2, 3, 4)))
                q = rng.choice(QUESTION_TEMPLATES_SINGLE).format(name=name, aspects=_join(aspects))
                targets = [(name, a) for a in aspects]
                ents = [name]
            facts = [
                {"entity": e, "aspect": a, "value": world.entities[e][a],
                 "doc_id": has_doc.get((e, a))}
                for e, a in targets
            ]
            rows.append(make_row(q, facts, ents, aspects, world.lookalikes))
    return rows


def initial_rubrics(facts: list[dict]) -> list[dict]:
    """Initial (data-row) rubrics in the DR Tulu format, one per fact plus one negative constraint."""
    rubrics = []
    for f in facts:
        if f["doc_id"] is None:
            rubrics.append({
                "title": f"{f['entity']} {f['aspect']} unknown",
                "description": f"Says that no source gives the {f['aspect']} of {f['entity']} "
                               f"instead of guessing.",
                "weight": 1.0})
        else:
            rubrics.append({
                "title": f"{f['entity']} {f['aspect']}",
                "description": f"States that the {f['aspect']} of {f['entity']} is {f['value']}, "
                               f"citing a retrieved source that says so.",
                "weight": 1.0})
    rubrics.append({
        "title": "no unsupported claims",
        "description": "Makes no claim taken from a look-alike entity or an outdated record, and no "
                       "claim that the retrieved evidence does not support.",
        "weight": 0.5})
    return rubrics


def make_row(query: str, facts: list[dict], entities: list[str], aspects: list[str],
             lookalikes: dict[str, str]) -> dict:
    """One RL row in the DR Tulu schema, with the toy judge's ground truth under `toy`."""
    gt = {
        "query": query,
        "rubrics": initial_rubrics(facts),
        "toy": {"facts": facts, "entities": entities, "aspects": list(aspects),
                "lookalikes": {e: lookalikes[e] for e in entities if e in lookalikes}},
    }
    return {"messages": [{"role": "user", "content": query}], "ground_truth": json.dumps(gt)}


# ----------------------------------------------------------------------------------------------------
# The search tool


_WORD = re.compile(r"[a-z0-9]+")


def bm25_tokens(text: str) -> list[str]:
    """Lower-case alphanumeric words: the tokenisation of every BM25 index in the project."""
    return _WORD.findall(text.lower())


def top_k(scores: np.ndarray, k: int) -> list[int]:
    """The indices of the k largest of scores (n,) float, best first, ties by index (the order of
    `sorted(range(n), key=lambda i: (-scores[i], i))[:k]`, without a Python sort over all n: a
    search of the toy corpus scores 17,003 documents, and that sort took longer than BM25 itself).
    k >= 1; fewer when n < k."""
    n = len(scores)
    if n <= k:
        cand = np.arange(n)
    else:  # every index that can be among the k best: those scoring at least the k-th largest
        cand = np.flatnonzero(scores >= np.partition(scores, n - k)[n - k])
    return cand[np.lexsort((cand, -scores[cand]))][:k].tolist()


class BM25SearchTool:
    """`google_search` over the toy corpus: rank-bm25 (Okapi) over title + text, top `k` hits.

    Named like the web-search tool of DR Tulu and the paper so that trajectories look the same in toy
    and full mode. Deterministic: ties are broken by document order.
    """

    name = "google_search"

    def __init__(self, docs: Sequence[Document], k: int = 3):
        if not docs:
            raise ValueError("BM25SearchTool needs a non-empty corpus")
        self.docs = list(docs)
        self.k = k
        self._bm25 = BM25Okapi([bm25_tokens(d.title + " " + d.text) for d in self.docs])
        # term -> the documents that hold it, in document order: a document without a query term
        # scores 0 (rank-bm25's idf is floored above 0), so only these need scoring
        self._holders: dict[str, list[int]] = {}
        for i, freqs in enumerate(self._bm25.doc_freqs):
            for t in freqs:
                self._holders.setdefault(t, []).append(i)
        self._cache: dict[str, list[SearchResult]] = {}

    def __call__(self, query: str) -> list[SearchResult]:
        key = " ".join(bm25_tokens(query))
        if not key:
            return []
        if key not in self._cache:  # the index is static, so results are memoised per query
            terms = key.split()
            # rank-bm25 scores only the documents holding a query term (get_batch_scores: the same
            # formula, element by element, as get_scores over all 17,003 documents, which spends
            # its time building every document's term counts in Python); the others score 0
            cand = sorted({i for t in terms for i in self._holders.get(t, ())})
            scores = np.asarray(self._bm25.get_batch_scores(terms, cand)) if cand else np.zeros(0)
            self._cache[key] = [SearchResult(self.docs[cand[j]].doc_id, self.docs[cand[j]].title,
                                             self.docs[cand[j]].text)
                                for j in top_k(scores, self.k) if scores[j] > 0]
        return list(self._cache[key])
