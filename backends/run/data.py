"""Full-mode data: RL queries in the DR Tulu schema and SFT trajectories in chat `messages` form.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the data side of the appendix: the RL data set is rl-research/dr-tulu-rl-data (~4.9K
queries, SearchArena + OpenScholar), one row per query with `messages` (the user turn) and
`ground_truth` (JSON: `query` and initial `rubrics`); SFT trains single-turn ChatML trajectories
(system, user, assistant) with `<tool_output>` spans masked.

Functions
    read_records(source, split)    rows as dicts from a Hugging Face dataset id, a JSONL / JSON file,
                                   or a Parquet file (pyarrow, else pandas)
    load_rl_rows(source, split)    read_records + parse_row on every row -> list[data.Query]
    load_sft_examples(source)      read_records + validate_messages -> list of `messages` lists
    sft_segments(text)             (sft.py, re-exported) an assistant message -> [(is_env, text)] split at <tool_output>
    sft_example(messages)          (sft.py, re-exported) (prompt messages, segments), ready for sft.encode_example

Deviations from the paper
    1. The paper does not say how tool outputs sit inside a stored SFT trajectory. We take the
       rollout engine's layout (scaffold.format_tool_output): the environment inserts
       "\\n<tool_output>...</tool_output>\\n", so one newline on each side of a span belongs to the
       environment segment (mask 0) when present. An unclosed <tool_output> runs to the end of the
       message and is masked: we never train on text the policy did not write.
    2. Multi-turn chats: only the last assistant turn is trained; earlier turns are prompt (mask 0),
       as in the paper's single-turn ChatML format.

Launch: no entry point; full mode calls load_rl_rows(FullConfig.data) (see backends/run/build.py).
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from scaffold import load_rows  # the RL row schema (DR Tulu)
# The SFT example format is the paper's (sft.py); re-exported for the loaders below and callers.
from sft import ROLES, TOOL_CLOSE, TOOL_OPEN, sft_example, sft_segments, validate_messages  # noqa: F401

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


# ----------------------------------------------------------------------------------------------------
# Reading rows


def _is_local(source: str) -> bool:
    """A local file: it exists, or it looks like a path (so a typo is not sent to the hub)."""
    return (os.path.exists(source) or source.lower().endswith(LOCAL_SUFFIXES)
            or source.startswith(("/", "./", "../", "~")))


def _plain(x: Any) -> Any:
    """numpy arrays / scalars (pandas' Parquet rows) -> Python lists / numbers, recursively."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist") and type(x).__module__.startswith("numpy"):
        return _plain(x.tolist())
    return x


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for ln, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {ln} is not valid JSON ({e.msg})") from None
    return rows


def _read_json(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        try:
            obj = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):  # {"data": [rows]}
        obj = obj["data"]
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of rows (or {{\"data\": [rows]}})")
    return obj


def _read_parquet(path: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # lazy: pyarrow / pandas only for a parquet source
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd  # lazy: pyarrow / pandas only for a parquet source
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow); neither pyarrow nor "
                          "pandas is installed") from None
    return [_plain(r) for r in pd.read_parquet(path).to_dict("records")]


def _read_hub(name: str, split: str) -> list[dict]:
    try:
        import datasets  # lazy: datasets only for a hub source
    except ImportError:
        raise ImportError(f"loading the Hugging Face dataset {name!r} needs the `datasets` package "
                          "(pip install datasets), or pass a local .jsonl / .parquet file") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except (ConnectionError, TimeoutError, OSError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        hint = (" (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set and the data set is not cached)"
                if offline else "")
        raise OSError(f"could not load Hugging Face dataset {name!r} split {split!r}: the hub is "
                      f"unreachable or the data set is missing{hint}: {type(e).__name__}: {e}") from e
    return [dict(r) for r in ds]


def read_records(source: str, split: str = "train", limit: int | None = None) -> list[dict]:
    """Rows (dicts) from `source`: a .jsonl, .json or .parquet file, or a Hugging Face dataset id
    ("org/name", loaded with datasets.load_dataset(source, split=split), imported only then).

    limit: keep the first `limit` rows (None: all). Raises FileNotFoundError for a missing local
    path, ValueError for malformed JSON (naming the line) or an unknown suffix, ImportError naming
    the missing package (datasets; pyarrow for Parquet), OSError when the hub cannot be reached.
    """
    if _is_local(source):
        path = os.path.expanduser(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file not found: {path}")
        low = path.lower()
        if low.endswith(".jsonl"):
            rows = _read_jsonl(path)
        elif low.endswith(".json"):
            rows = _read_json(path)
        elif low.endswith((".parquet", ".pq")):
            rows = _read_parquet(path)
        else:
            raise ValueError(f"{path}: unknown data format; use .jsonl, .json or .parquet")
    else:
        rows = _read_hub(source, split)
    return rows[:limit] if limit is not None else rows


# ----------------------------------------------------------------------------------------------------
# RL rows (DR Tulu schema)


def load_rl_rows(source: str, split: str = "train", limit: int | None = None) -> list:
    """RL queries from `source` (read_records; the run's data.source), each validated by parse_row.

    Returns list[data.Query] (row_index = position in the file). Raises ValueError naming the row
    index and the field for a row that does not fit the DR Tulu schema, or for an empty data set;
    OSError naming data.source and the local-file way out when a Hugging Face dataset id cannot be
    read here (no `datasets` package, no network, an offline node); and whatever else read_records
    raises.
    """

    try:
        rows = read_records(source, split, limit)
    except (ImportError, OSError) as e:
        if _is_local(source):
            raise
        # An offline node (HF_HUB_OFFLINE, no route to the hub) or one without `datasets`: the
        # same rows from a local file need neither (under ZeRO-3 rank 0 alone reads them).
        raise OSError(f"data.source {source!r}: {e}. On a node without network or `datasets`, point "
                      "data.source at a local copy of the rows (--set data.source=\"rows.jsonl\", "
                      "written once where the hub is reachable: "
                      "datasets.load_dataset(name, split=split).to_json(\"rows.jsonl\"))") from e
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"row {i}: expected a JSON object, got {type(r).__name__}")
    return load_rows(_plain(rows))


# ----------------------------------------------------------------------------------------------------
# SFT trajectories (chat messages)


def load_sft_examples(source: str, split: str = "train", limit: int | None = None) -> list[list[dict]]:
    """SFT examples (`messages` lists) from `source` (read_records); each row holds a `messages`
    column, validated by validate_messages. Raises ValueError naming the row for a bad row."""
    out = []
    for i, r in enumerate(read_records(source, split, limit)):
        if not isinstance(r, dict) or "messages" not in r:
            raise ValueError(f"row {i}: missing `messages`")
        out.append(validate_messages(_plain(r["messages"]), i))
    if not out:
        raise ValueError(f"{source}: no SFT examples")
    return out


# ----------------------------------------------------------------------------------------------------
# Data order of the RL batches (fresh batches of the windowed curriculum, bank.curriculum)


class DataOrder:
    """Fresh batch b = queries [b*P, (b+1)*P) of a seeded permutation, reshuffled per epoch."""

    def __init__(self, n_queries: int, per_batch: int, seed: int):
        self.n, self.P, self.seed = n_queries, per_batch, seed

    def batch(self, b: int) -> list[int]:
        out = []
        for pos in range(b * self.P, (b + 1) * self.P):
            epoch, i = divmod(pos, self.n)
            perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            out.append(perm[i])
        return out


# ----------------------------------------------------------------------------------------------------
# Configuration (the run config's `data` section; backends/run/config.py nests it)


# PAPER (appendix): RL data "rl-research/dr-tulu-rl-data".
PAPER_RL_DATA = "rl-research/dr-tulu-rl-data"


@dataclass
class DataConfig:
    """Where the RL questions come from: the toy world, or DR Tulu-schema rows (load_rl_rows)."""

    source: str = ""
    """"" = the toy world's questions; else RL rows in the DR Tulu schema: a Hugging Face dataset id
    or a local .jsonl / .json / .parquet file (data.load_rl_rows); full: PAPER"""
    split: str = "train"
    """dataset split of a Hugging Face dataset id in data.source"""
    limit: int = 0
    """0 = every row"""
