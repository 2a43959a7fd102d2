"""DRB target articles cleaned of citations and reference lists by the judge before RACE scoring,
with the released RACE pipeline's semantics (evaluate.py, deviation 6): one call per article, an
article that cannot be cleaned whole is cleaned as two halves, one that still fails is skipped.
The prompt is our own wording.
"""
from __future__ import annotations

import logging
from typing import Any

from backends.eval.grading import DATA_NOTE, Job, fence, run_jobs, schema_object

log = logging.getLogger("rubricem.evaluate")

CLEAN_SYSTEM = (
    "You prepare a research report for grading. Return the report's full text with every citation "
    "removed: inline citation markers such as [1], [2, 3], [^4] or (Source: ...), footnote marks, the "
    "reference list or bibliography at the end, and bare URLs used as citations. Change nothing "
    "else: keep every sentence, heading, table and list as written, in the report's own language, "
    "without summarising, shortening, correcting or adding anything. " + DATA_NOTE)
CLEAN_SCHEMA = schema_object({"article": {"type": "string"}})
CLEAN_MIN_CHARS = 100  # released pipeline: a cleaned article under 100 characters is invalid
_SENTENCE_END = ".?!\n\u3002\uff1f\uff01"  # . ? ! newline and the CJK full stop, ? and !


def validate_clean(obj: Any) -> dict:
    """{"article": str with at least CLEAN_MIN_CHARS non-space characters}; ValueError otherwise."""
    a = obj.get("article") if isinstance(obj, dict) else None
    if not isinstance(a, str) or len(a.strip()) < CLEAN_MIN_CHARS:
        raise ValueError(f"cleaned article missing or shorter than {CLEAN_MIN_CHARS} characters")
    return {"article": a}


def split_in_two(text: str) -> tuple[str, str]:
    """The released pipeline's fallback for an article that cannot be cleaned whole: two halves, the
    cut moved back to just after the last sentence end within 200 characters before the middle."""
    mid = len(text) // 2
    for j in range(mid, max(0, mid - 200), -1):
        if j < len(text) and text[j] in _SENTENCE_END:
            mid = j + 1
            break
    return text[:mid], text[mid:]


def _clean_job(e: int, key: Any, text: str, language: str) -> Job:
    lang = {"zh": "Chinese", "en": "English"}.get(language, "its own language")
    user = ("Report to clean (keep it in " + lang + "):\n" + fence(text, "report")
            + "\n\nReturn the cleaned report.")
    return Job(e, key, CLEAN_SYSTEM, user, CLEAN_SCHEMA, validate_clean)


def clean_drb_answers(judge, rows, answers, concurrency: int, progress: bool = True,
                      deadline: float | None = None) -> tuple[list, dict]:
    """Target articles with citations and reference lists removed, through the judge client, with
    the released RACE pipeline's semantics: one call per article; an article that fails after the
    retry bound is cleaned as two halves (`split_in_two`) joined back; an article still without a
    valid cleaning (>= 100 characters) is skipped ("article cleaning failed"), as released. Returns
    (answers, {"cleaned", "halved", "failed": [ids]}); None answers stay None."""
    names = [r["id"] for r in rows]
    jobs = [_clean_job(e, "whole", a, rows[e]["language"]) for e, a in enumerate(answers) if a is not None]
    res = run_jobs(judge, jobs, concurrency, progress, "cleaning drb articles", deadline, names)
    retry = [e for e, a in enumerate(answers) if a is not None and res.get((e, "whole")) is None]
    halves = [_clean_job(e, ("half", h), part, rows[e]["language"])
              for e in retry for h, part in enumerate(split_in_two(answers[e]))]
    res.update(run_jobs(judge, halves, concurrency, progress, "cleaning (halves)", deadline, names)
               if halves else {})
    out, info = list(answers), {"cleaned": 0, "halved": 0, "failed": []}
    for e, a in enumerate(answers):
        if a is None:
            continue
        whole, parts = res.get((e, "whole")), [res.get((e, ("half", h))) for h in (0, 1)]
        if whole is not None:
            out[e], info["cleaned"] = whole["article"], info["cleaned"] + 1
        elif all(p is not None for p in parts):
            out[e] = "".join(p["article"] for p in parts)
            info["cleaned"], info["halved"] = info["cleaned"] + 1, info["halved"] + 1
        else:
            out[e] = None
            info["failed"].append(names[e])
            log.warning("example %s: article cleaning failed; the task is skipped", names[e])
    return out, info
