"""Reading the four benchmarks' rows in their published formats, and the answers to grade: every
field checked, a bad row refused with one line naming the file, the line and the field.

Not part of the paper's method: the data checks of evaluate.py (which holds the benchmarks' prompts,
parsing and score formulas). Files are local; nothing is downloaded.
"""
from __future__ import annotations

import json
import math
import os
import random
from typing import Any

from backends.run.data import read_records

RACE_DIMS = ("comprehensiveness", "insight", "instruction_following", "readability")  # DRB's criteria


def finite(x: Any, what: str) -> float:
    """x as a float; ValueError naming `what` unless it is a finite number (a bool is not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{what} must be a finite number, got {x!r}")
    return float(x)


class DataError(ValueError):
    """Unusable benchmark or responses data: one line naming the file, the line and the field."""


def _read(path: str, what: str = "--data (benchmark rows)") -> list:
    """Rows of a local .jsonl / .json / .parquet file (data.read_records); never a hub download.
    what: the flag and role of the file, named in the error when it is missing."""
    if not path:
        raise DataError(f"{what}: no file given")
    if not os.path.isfile(os.path.expanduser(path)):
        raise FileNotFoundError(f"{what} file not found: {path} (give a local path; nothing is "
                                "downloaded)")
    try:
        return read_records(path)
    except ValueError as e:
        raise DataError(f"{what}: {e}") from None


def _where(path: str, i: int) -> str:
    """'FILE line N' for a JSONL row (1-based), 'FILE row N' (0-based) for a JSON list / Parquet."""
    return f"{path} line {i + 1}" if path.lower().endswith(".jsonl") else f"{path} row {i}"


def refuse_duplicate_ids(rows: list[dict], path: str) -> list[dict]:
    """Raise DataError naming the first repeated id (both rows would be graded with one answer)."""
    seen: dict = {}
    for i, r in enumerate(rows):
        if r["id"] in seen:
            raise DataError(f"{path}: id {r['id']!r} appears twice ({_where(path, seen[r['id']])} "
                            f"and {_where(path, i)}); ids must be unique")
        seen[r["id"]] = i
    return rows


def _need(row: Any, key: str, kind, where: str):
    if not isinstance(row, dict) or key not in row or not isinstance(row[key], kind) \
            or isinstance(row[key], bool) and kind is not bool:
        name = getattr(kind, "__name__", None) or " or ".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field `{key}` missing or not {name}")
    return row[key]


def load_healthbench(path: str) -> list[dict]:
    """HealthBench rows (openai simple-evals JSONL): prompt [{role, content}], prompt_id,
    example_tags, rubrics [{criterion, points, tags}] (canary, ideal_completions_data ignored).
    Raises ValueError naming the row and field for a row that does not fit."""
    out = []
    for i, r in enumerate(_read(path)):
        w = _where(path, i)
        msgs = _need(r, "prompt", list, w)
        if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in msgs):
            raise ValueError(f"{w}: `prompt` must be a non-empty list of {{role, content}}")
        rubrics = _need(r, "rubrics", list, w)
        if not rubrics:
            raise ValueError(f"{w}: `rubrics` is empty")
        items = []
        for j, it in enumerate(rubrics):
            crit = _need(it, "criterion", str, f"{w} rubric {j}")
            pts = finite(_need(it, "points", (int, float), f"{w} rubric {j}"), f"{w} rubric {j} points")
            tags = it.get("tags") or []
            if not isinstance(tags, list):
                raise ValueError(f"{w} rubric {j}: `tags` must be a list")
            items.append({"criterion": crit, "points": pts, "tags": [str(t) for t in tags]})
        tags = r.get("example_tags") or []
        if not isinstance(tags, list):
            raise ValueError(f"{w}: `example_tags` must be a list")
        out.append({"id": str(_need(r, "prompt_id", (str, int), w)), "prompt": msgs, "items": items,
                    "example_tags": [str(t) for t in tags]})
    return refuse_duplicate_ids(out, path)


def load_researchqa(path: str) -> list[dict]:
    """ResearchQA rows (JSON list as released, or JSONL): id, general_domain, subdomain, field, query,
    date, rubric [{rubric_item, type, citation_metadata?}]. An item's type may be a string or a list
    of strings (the released file has both); it is kept as a sorted list of types. Raises DataError
    naming the line and field; a repeated id is refused."""
    out = []
    for i, r in enumerate(_read(path)):
        w = _where(path, i)
        rub = _need(r, "rubric", list, w)
        if not rub:
            raise DataError(f"{w}: `rubric` is empty")
        items = [{"item": _need(it, "rubric_item", str, f"{w} rubric {j}"),
                  "type": _item_types(it.get("type") if isinstance(it, dict) else None,
                                      f"{w} rubric {j}")}
                 for j, it in enumerate(rub)]
        out.append({"id": str(_need(r, "id", (str, int), w)), "query": _need(r, "query", str, w),
                    "items": items, "general_domain": str(r.get("general_domain", "")),
                    "field": str(r.get("field", ""))})
    return refuse_duplicate_ids(out, path)


def _item_types(t: Any, where: str) -> list[str]:
    """A ResearchQA item type as a sorted list of type names ([] for none)."""
    if t is None or t == "":
        return []
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return sorted(set(t))
    raise DataError(f"{where}: field `type` must be a string or a list of strings, got {t!r:.60}")


def load_drb(queries: str, criteria: str, reference: str) -> list[dict]:
    """DeepResearch Bench RACE tasks from its three files: queries {id, topic, language, prompt};
    criteria {id, prompt, dimension_weight (4 dimensions summing to 1), criterions {dimension:
    [{criterion, explanation, weight}]}}; reference articles {id, prompt, article}. Criteria and
    references join a query by id, else by prompt text. Raises ValueError for a malformed row, a
    query without criteria or reference, or dimension weights that do not sum to 1 (+-1e-3)."""
    crit_rows = _read(criteria, "--criteria (DRB criteria.jsonl)")
    ref_rows = _read(reference, "--reference (DRB reference articles)")
    by = lambda rows: ({str(r.get("id")): r for r in rows if isinstance(r, dict)},  # noqa: E731
                       {r.get("prompt"): r for r in rows if isinstance(r, dict)})
    cid, cprompt = by(crit_rows)
    rid, rprompt = by(ref_rows)
    out = []
    for i, q in enumerate(_read(queries, "--data (DRB query.jsonl)")):
        w = _where(queries, i)
        tid, prompt = str(_need(q, "id", (str, int), w)), _need(q, "prompt", str, w)
        c = cid.get(tid) or cprompt.get(prompt)
        ref = rid.get(tid) or rprompt.get(prompt)
        if c is None or ref is None:
            raise ValueError(f"{w}: task {tid} has no {'criteria' if c is None else 'reference article'}")
        W = _need(c, "dimension_weight", dict, f"{criteria} task {tid}")
        if set(W) != set(RACE_DIMS):
            raise ValueError(f"{criteria} task {tid}: dimension_weight must have {RACE_DIMS}")
        Wf = {d: finite(W[d], f"task {tid} weight of {d}") for d in RACE_DIMS}
        if abs(sum(Wf.values()) - 1.0) > 1e-3 or min(Wf.values()) < 0:
            raise ValueError(f"{criteria} task {tid}: dimension weights must be >= 0 and sum to 1, "
                             f"got {sum(Wf.values()):.4f}")
        crits = _need(c, "criterions", dict, f"{criteria} task {tid}")
        dims = {}
        for d in RACE_DIMS:
            lst = crits.get(d)
            if not isinstance(lst, list) or not lst:
                raise ValueError(f"{criteria} task {tid}: no criteria for dimension {d}")
            dims[d] = [{"criterion": _need(x, "criterion", str, f"task {tid} {d}"),
                        "explanation": str(x.get("explanation", "")),
                        "weight": finite(x.get("weight"), f"task {tid} {d} weight")} for x in lst]
        out.append({"id": tid, "prompt": prompt, "language": str(q.get("language", "")),
                    "topic": str(q.get("topic", "")), "dim_weights": Wf, "criteria": dims,
                    "reference": _need(ref, "article", str, f"{reference} task {tid}")})
    return refuse_duplicate_ids(out, queries)


def load_researchrubrics(path: str) -> list[dict]:
    """ResearchRubrics rows: prompt, sample_id, domain, rubrics [{criterion, weight (may be
    negative), axis}]. Raises ValueError naming the row and field."""
    out = []
    for i, r in enumerate(_read(path)):
        w = _where(path, i)
        rub = _need(r, "rubrics", list, w)
        if not rub:
            raise DataError(f"{w}: `rubrics` is empty")
        items = [{"criterion": _need(x, "criterion", str, f"{w} rubric {j}"),
                  "weight": finite(x.get("weight") if isinstance(x, dict) else None,
                                    f"{w} rubric {j} weight"),
                  "axis": str(x.get("axis", ""))} for j, x in enumerate(rub)]
        out.append({"id": str(_need(r, "sample_id", (str, int), w)), "prompt": _need(r, "prompt", str, w),
                    "domain": str(r.get("domain", "")), "items": items})
    return refuse_duplicate_ids(out, path)


# ----------------------------------------------------------------------------------------------------
# Answers: a responses file, matched to the rows by id (or prompt text)

RESPONSE_TEXT_KEYS = ("response", "answer", "article", "completion", "report", "output")


def _text_of(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        for k in RESPONSE_TEXT_KEYS:
            if isinstance(v.get(k), str):
                return v[k]
    raise DataError(f"{where}: no response text (field one of {', '.join(RESPONSE_TEXT_KEYS)})")


def load_responses(path: str, id_key: str = "id") -> dict[str, str]:
    """{example id: answer text} from a JSONL / JSON list of rows ({id_key or "id", and one of
    RESPONSE_TEXT_KEYS}) or a JSON object {id: text or {answer: text}} (ResearchQA's response map).
    Rows may also carry "prompt" (matched to a task by prompt text when the id is unknown). Raises
    ValueError for a row without an id or text, or a repeated id."""
    p = os.path.expanduser(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"--responses (answers) file not found: {path}")
    if p.lower().endswith(".json"):
        try:
            with open(p, encoding="utf-8") as fh:
                obj = json.load(fh)
        except ValueError as e:
            raise DataError(f"--responses {path}: not valid JSON ({e})") from None
        if isinstance(obj, dict) and not isinstance(obj.get("data"), list):
            return {str(k): _text_of(v, f"{path} id {k}") for k, v in obj.items()}
    out: dict[str, str] = {}
    for i, r in enumerate(_read(path, "--responses (answers)")):
        w = _where(path, i)
        key = r.get(id_key, r.get("id")) if isinstance(r, dict) else None
        if key is None or isinstance(key, bool):
            raise DataError(f"{w}: field `{id_key}` (or `id`) missing")
        if str(key) in out:
            raise DataError(f"{w}: repeated id {key!r}")
        out[str(key)] = _text_of(r, w)
        if isinstance(r.get("prompt"), str):
            out.setdefault("prompt:" + r["prompt"], out[str(key)])
    return out


def match_answers(rows: list[dict], responses: dict[str, str]) -> list[str | None]:
    """Answer per row (None when the responses hold neither its id nor its prompt)."""
    out = []
    for r in rows:
        a = responses.get(r["id"])
        if a is None and isinstance(r.get("prompt"), str):
            a = responses.get("prompt:" + r["prompt"])
        out.append(a)
    return out


# ----------------------------------------------------------------------------------------------------
# One benchmark's rows

LOADERS = {"healthbench": load_healthbench, "researchqa": load_researchqa,
           "researchrubrics": load_researchrubrics}  # drb: load_drb (three files)


def load_rows(bench: str, data: str, criteria: str = "", reference: str = "", limit: int = 0,
              language: str = "", first: bool = False) -> list[dict]:
    """Rows of `bench` from its files (see the loaders); language ("en" / "zh") filters DeepResearch
    Bench tasks. limit > 0 keeps `limit` rows drawn as simple-evals does
    (random.Random(0).sample(rows, limit), in the sample's order), or the first `limit` with
    first=True."""
    if bench not in (*LOADERS, "drb"):
        raise ValueError(f"unknown benchmark {bench!r}; choose one of {sorted((*LOADERS, 'drb'))}")
    if bench == "drb":
        if not criteria or not reference:
            raise ValueError("drb needs --criteria and --reference as well as --data (the queries)")
        rows = load_drb(data, criteria, reference)
        rows = [r for r in rows if not language or r["language"] == language]
    else:
        rows = LOADERS[bench](data)
    if limit <= 0 or limit >= len(rows):
        return rows
    return rows[:limit] if first else random.Random(0).sample(rows, limit)
