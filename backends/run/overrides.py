"""`--set key=value` overrides typed by the configuration tree, the configuration reference
(`--list-config`), and the default run directory of each command-line variation.

Not part of the paper's method: plumbing that makes a bad setting stop the run at parse time, before
anything is written. The tree itself, its sections, the checks and the renamed keys are config.py's.

    python train.py --list-config                       # every key, its default and what it means
    python train.py --toy --set ss_grpo.lr=abc          # refused at parse time: exit code 2

Conversion rules of `--set key=value` (the target type is the field's annotation in the config tree)
    int    a JSON integer ("4"; "1e3" is accepted as 1000); "4.5", "abc" and booleans are refused
    float  a finite number ("1e-4", "3", ".5"); "abc", "nan", "inf" and booleans are refused
    bool   true / false (also 1 / 0, yes / no, on / off; any case)
    str    the text as given, or a JSON string ('"XS"' and 'XS' both give XS)
    list / tuple   a JSON array whose items have the types of the default's items
                   ("[1,1,1,1]"); a tuple field gets a tuple
Every error names the field: "ss_grpo.lr: expected a float, got 'abc'".
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import json
import math
import re
import textwrap
import tokenize
import typing
from typing import Any, Iterator, Sequence

from backends.run.config import SECTION_FIELDS, Config, attach_sections, canonical_key, env_secrets


# ----------------------------------------------------------------------------------------------------
# Default run directories


def variation_run_dir(base: str, seed: int | None = None, model: str | None = None,
                      faults: str | None = None) -> str:
    """The default run directory of a command line that varies the preset: `base` plus one suffix
    per variation, so that each variation of the README runs beside the quick start's `runs/toy`
    instead of being refused there.

    base: the preset's run directory (str); seed: --seed (int or None) -> "-seed1"; model: --model
    (a path or None) -> "-model-<name>", name = the directory's last component (the last two when it
    ends in "final", e.g. runs/toy/final -> "toy-final"), characters outside [A-Za-z0-9._-] replaced
    by "-"; faults: --faults text or None -> "-faults-0.3-0.1". Returns a str; raises nothing.
    Example: variation_run_dir("runs/toy", model="path/to/hf-model") == "runs/toy-model-hf-model".
    """
    out = base
    if seed is not None:
        out += f"-seed{seed}"
    if model:
        parts = [p for p in re.split(r"[\\/]+", model.strip()) if p not in ("", ".")]
        name = "-".join(parts[-2:]) if len(parts) >= 2 and parts[-1] == "final" else (parts or ["model"])[-1]
        out += "-model-" + re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    if faults:
        out += "-faults-" + re.sub(r"[^A-Za-z0-9.]+", "-", faults.strip())
    return out


# ----------------------------------------------------------------------------------------------------
# Typed overrides


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def leaf_fields(cfg, prefix: str = "") -> Iterator[tuple[str, type, Any]]:
    """(dotted key, annotated type, current value) of every leaf field of a config dataclass
    instance, depth first in declaration order (nested dataclasses are walked, not yielded)."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from leaf_fields(v, f"{prefix}{f.name}.")
        elif not (v is None and f.name in SECTION_FIELDS):  # a section this run does not use
            yield f"{prefix}{f.name}", hints[f.name], v


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_ARTICLE = {int: "an int", float: "a float", bool: "a bool (true or false)", str: "a string",
            list: "a list (JSON array, e.g. [1, 2])", tuple: "a list (JSON array, e.g. [\"a\", \"b\"])"}


def _like(key: str, v: Any, like: Any, raw: str) -> Any:
    """v (a decoded JSON value) converted to the type of `like` (a default value), or ValueError."""
    t = type(like)
    want = _ARTICLE.get(t, t.__name__)
    bad = ValueError(f"{key}: expected {want}, got {raw!r}")
    if t is bool:
        if isinstance(v, bool):
            return v
        s = str(v).strip().lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
        raise bad
    if t is int:
        if isinstance(v, bool):
            raise bad
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            return int(v)
        if isinstance(v, int):
            return v
        raise bad
    if t is float:
        if isinstance(v, str):  # Python spellings JSON lacks: ".5", "5.", "nan", "inf"
            try:
                v = float(v)
            except ValueError:
                raise bad from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad
        if not math.isfinite(v):
            raise ValueError(f"{key}: expected a finite float, got {raw!r}")
        return float(v)
    if t is str:
        return v if isinstance(v, str) else raw
    if t in (list, tuple):
        if not isinstance(v, list):
            raise bad
        if like:  # items take the type of the default's first item (e.g. the rows of Lambda)
            v = [_like(f"{key}[{i}]", x, like[0], json.dumps(x)) for i, x in enumerate(v)]
        return tuple(v) if t is tuple else list(v)
    return v


def convert(key: str, raw: str, typ: type, default: Any) -> Any:
    """The value of `--set key=raw` for a field annotated `typ` whose current value is `default`.

    raw: the text after "="; JSON is decoded first, then converted by the rules of the module
    docstring. Returns int / float / bool / str / list / tuple. Raises ValueError naming the key,
    e.g. "ss_grpo.lr: expected a float, got 'abc'"."""
    try:
        v = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        v = raw
    if typ is str:
        return v if isinstance(v, str) else raw
    like = default if typ in (list, tuple) else typ()
    if typ in (list, tuple) and not isinstance(like, typ):
        like = typ(like)
    return _like(key, v, like, raw)


def set_override(cfg, item: str) -> None:
    """Apply one `key=value` item to the config tree `cfg` in place, converted to the field's type.

    Raises ValueError: no "=", an unknown key (with the closest known keys), a key that names a group
    of settings instead of one field, or a value of the wrong type (see `convert`)."""
    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    key = canonical_key(key.strip())
    obj, parts = cfg, key.split(".")
    for i, p in enumerate(parts):
        if obj is cfg and len(parts) > 1 and p in SECTION_FIELDS:
            attach_sections(cfg, p)  # a section the preset left out (e.g. judge_http on the toy)
        if not (dataclasses.is_dataclass(obj) and p in {f.name for f in dataclasses.fields(obj)}):
            known = [k for k, _, _ in leaf_fields(cfg)]
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else \
                "; python train.py --list-config lists every key"
            raise ValueError(f"unknown config field {key!r}{hint}")
        if i < len(parts) - 1:
            obj = getattr(obj, p)
    name = parts[-1]
    cur = getattr(obj, name)
    if dataclasses.is_dataclass(cur):
        first = dataclasses.fields(cur)[0].name
        raise ValueError(f"{key} is a group of settings, not one field: set one of its fields, "
                         f"e.g. {key}.{first}=...")
    setattr(obj, name, convert(key, raw, _hints(type(obj))[name], cur))


# ----------------------------------------------------------------------------------------------------
# The configuration reference (--list-config)


def field_docs(cls) -> dict[str, str]:
    """{field name: its documentation} for a dataclass, read from its source: the comment after the
    field on its line, the comment-only lines that continue it, and a string literal right below the
    field (an attribute docstring), its base classes' fields included. Fields without any get ""."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            out.update(_own_field_docs(base))
    return {**out, **_own_field_docs(cls)}


def _own_field_docs(cls) -> dict[str, str]:
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    body = ast.parse(src).body[0].body
    code_lines = {n for node in body for n in range(node.lineno, node.end_lineno + 1)}
    out: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts = []
        line = node.end_lineno
        if line in comments:
            parts.append(comments[line])
            nxt = line + 1
            while nxt in comments and nxt not in code_lines:  # a comment continued below the field
                parts.append(comments[nxt])
                nxt += 1
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant) \
                and isinstance(after.value.value, str):
            parts.append(" ".join(after.value.value.split()))
        out[node.target.id] = " ".join(p for p in parts if p)
    return out


def describe_config(cfg) -> list[tuple[str, str, str]]:
    """(dotted key, default as JSON, documentation) for every leaf field of `cfg` (a config dataclass
    instance, e.g. presets.toy_preset()), in declaration order."""
    rows = []

    def walk(obj, prefix):
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, f"{prefix}{f.name}.")
            elif not (v is None and f.name in SECTION_FIELDS):  # a section this run does not use
                rows.append((f"{prefix}{f.name}", json.dumps(v), docs.get(f.name, "")))

    walk(cfg, "")
    return rows


def format_config_reference(cfg, other=None, other_name: str = "full", width: int = 100) -> str:
    """Text of `--list-config`: per key "key = default", with "(full: value)" where the preset `other`
    (a config of the same tree) differs, then the key's documentation indented and wrapped to
    `width` columns."""
    others = {k: v for k, v, _ in describe_config(other)} if other is not None else {}
    out = []
    for key, default, doc in describe_config(cfg):
        alt = others.get(key, default)
        out.append(f"{key} = {default}" + (f"   ({other_name}: {alt})" if alt != default else ""))
        if doc:
            out.extend(textwrap.wrap(doc, width, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------
# Overrides (the checks of the whole tree are config.validate_config)


def apply_overrides(cfg: Config, items: Sequence[str]) -> Config:
    """`a.b=value` overrides, each converted to its field's type (int, float, bool, str, list;
    `convert`) when the command line is parsed, so that a bad value stops the run before
    anything is written. Raises ValueError naming the field: an unknown field (with the closest
    known ones), a value of the wrong type ("ss_grpo.lr: expected a float, got 'abc'"), or a value
    that contains an API key (named by its variable, never quoted)."""
    for it in items:
        key = it.split("=", 1)[0]
        for name, secret in env_secrets().items():  # the type errors below quote the value
            if secret in it:
                raise ValueError(f"{key} contains the value of ${name}: API keys are read from the "
                                 "environment only and never stored in the configuration")
        set_override(cfg, it)
    return cfg
