"""The run configuration (`Config`) and its plumbing: typed `--set key=value` overrides, the
configuration reference (`--list-config`), the checks, renamed keys, saved configs and the default run
directory of each command-line variation.

Not part of the paper's method: plumbing that makes a run's settings checkable before any work starts.
Where the settings live:
    hparams.py                 the paper layer (PaperConfig: arm, seed, steps, rollout, search, ss_grpo,
                               judge, bank, reflection, curriculum), each knob with its paper reference
    Config (here)              PaperConfig + the run's plumbing (run_dir, engine, sampler, threads, ...)
                               + data, checkpoint, faults (backends/data.py, checkpoint.py, faults.py)
    the registry (SECTIONS)    eval (backends/heldout.py), toy_model, world, teacher, sft (toy/), full,
                               judge_http, search_http (backends/full.py, judge_http.py, search_http.py),
                               registered by backends/presets.py, which also builds the presets
Old key spellings (ALIASES: judge.base_url, search.rpm, model_size, ...) still work, with a one-line
deprecation notice, in --set and in a saved config.json.

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
import importlib.util
import inspect
import io
import json
import logging
import math
import os
import re
import textwrap
import tokenize
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import ss_grpo
from backends.checkpoint import CheckpointConfig
from backends.data import DataConfig
from backends.faults import FaultConfig, validate_fault_config
from hparams import PaperConfig
from scaffold import SCAFFOLDS, STAGES
from ss_grpo import ARMS, Arm  # noqa: F401  (config.ARMS, config.Arm)

log = logging.getLogger("rubricem.config")

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
# Renamed keys: the old spelling still works (a one-line deprecation notice), in --set and in a saved
# config.json (resume, scripts/ask.py, evaluate.py)

# The HTTP judge's and web search's transport knobs moved to their backends' sections
# (backends/judge_http.HTTPJudgeConfig, backends/search_http.SearchHTTPConfig); the toy policy's size
# and vocabulary to toy/model.ToyModelConfig.
_JUDGE_HTTP = ("base_url", "api_key_env", "concurrency", "timeout_s", "backoff_s",
               "backoff_max_s", "cache_dir", "prompt_version", "price_in", "price_out", "max_usd", "rpm",
               "tpm", "retry_after_max_s", "thinking_budget", "temperature", "max_output_tokens",
               "gemini_schema_field", "openai_response_format", "max_text_chars")
_SEARCH_HTTP = ("base_url", "api_key_env", "timeout_s", "max_retries", "backoff_s", "backoff_max_s",
                "cache_dir", "max_snippet_chars", "rpm")
ALIASES: dict[str, str] = {**{f"judge.{k}": f"judge_http.{k}" for k in _JUDGE_HTTP},
                           **{f"search.{k}": f"search_http.{k}" for k in _SEARCH_HTTP},
                           "model_size": "toy_model.size", "vocab_size": "toy_model.vocab_size",
                           "ss_grpo.share_prefix": "fast_logprobs"}


def canonical_key(key: str) -> str:
    """The current spelling of a config key (dotted); an old one (ALIASES) logs a one-line notice."""
    new = ALIASES.get(key)
    if new is None:
        return key
    log.warning("config key %s is deprecated: it is now %s", key, new)
    return new


def migrate_config_dict(d: dict) -> dict:
    """A copy of a saved config (an asdict dict, e.g. config.json) with the old keys of ALIASES moved
    to their current place (one notice for all). A dict without old keys comes back equal."""
    out, moved = json.loads(json.dumps(d)), []
    for old, new in ALIASES.items():
        *osec, oname = old.split(".")
        src = out
        for p in osec:
            src = src.get(p) if isinstance(src, dict) else None
        if not isinstance(src, dict) or oname not in src:
            continue
        value = src.pop(oname)
        moved.append(old)
        *nsec, nname = new.split(".")
        dst = out
        for p in nsec:
            if not isinstance(dst.get(p), dict):
                dst[p] = {}
            dst = dst[p]
        dst.setdefault(nname, value)
    if moved:
        log.warning("saved config with %d deprecated keys (%s, ...): read under their current names "
                    "(backends/config.py ALIASES)", len(moved), moved[0])
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


def check_local_inputs(cfg) -> None:
    """Refuse, before a run writes anything, a --model that is not a local directory (the policy is
    loaded from local files only). cfg: a config.Config; a dry run is exempt (it reports problems
    itself). Raises ValueError naming the field."""
    if cfg.model and not cfg.dry_run and not os.path.isdir(cfg.model):
        raise ValueError(f"model: {cfg.model!r} is not a directory; --model takes a local Hugging Face "
                         "causal-LM directory (e.g. a toy run's final/)")

# ----------------------------------------------------------------------------------------------------
# The run configuration: the paper layer (hparams.PaperConfig) plus the run's plumbing and the
# sections that live with their own module


# Sections defined beside the code they configure, attached by name through this registry: the toy
# world's (toy/) and the held-out evaluation's are registered by the toy preset (backends/presets.py);
# the scale backends' (full, judge_http, search_http) are registered there too, but their modules are
# imported only when a run uses them, so a toy run never loads them. This module imports neither.
# A section whose value is None is one the run does not use (a toy run's full / judge_http /
# search_http); validate_config attaches the ones its backends need.
SECTIONS: dict[str, Callable[[], Any]] = {}
_DEFAULT_ON: set[str] = set()


def register_section(name: str, factory: Callable[[], Any], *, default: bool = True) -> None:
    """Register the factory of the section `name` (a field of Config typed Any): it builds the
    section's defaults. default=True attaches it to every new Config; False only on demand
    (attach_sections, a `--set name.key=...`, a saved config that holds it)."""
    SECTIONS[name] = factory
    (_DEFAULT_ON.add if default else _DEFAULT_ON.discard)(name)


def _section(name: str) -> Callable[[], Any]:
    return lambda: SECTIONS[name]() if name in _DEFAULT_ON else None


def attach_sections(cfg, *names: str):
    """Give each of `names` that is None in `cfg` its registered defaults; returns cfg. Raises
    ValueError for a section nobody registered (import backends.presets, which registers them)."""
    for name in names:
        if getattr(cfg, name) is None:
            if name not in SECTIONS:
                raise ValueError(f"config section {name!r} is not registered (backends/presets.py "
                                 "registers every section: build configs with presets.toy_preset)")
            setattr(cfg, name, SECTIONS[name]())
    return cfg


def needed_sections(cfg) -> list[str]:
    """The attached-on-demand sections the run's backends read: `full` for full mode, ZeRO-3 or vLLM,
    `judge_http` for an HTTP judge, `search_http` for web search."""
    out = []
    if cfg.mode == "full" or cfg.engine == "zero3" or cfg.sampler == "vllm":
        out.append("full")
    if cfg.judge.backend != "toy":
        out.append("judge_http")
    if cfg.search.backend != "toy":
        out.append("search_http")
    return out


@dataclass
class Config(PaperConfig):
    """Everything a run needs: the paper's settings (hparams.PaperConfig, first), the run's plumbing,
    then the backends' sections. backends/presets.toy_preset() / full_preset() fill it;
    `--set a.b=v` overrides."""

    mode: str = "toy"
    """preset the run started from: "toy" | "full" (set by --toy / --full)"""
    run_dir: str = "runs/toy"
    """where metrics, checkpoints, final/ and eval.json go (--run-dir)"""
    model: str = ""
    """"" = toy SFT warm start; else a local HF causal-LM directory (the paper starts RL from its SFT
    checkpoint)"""
    cache_dir: str = ".cache/rubricem"
    """SFT warm-start cache; HTTP judge and search caches"""
    threads: int = 2
    """ours: torch intra-op threads for training (SFT warm start, the policy and reflection updates).
    On a 2-core machine they run 1.3-1.6x faster on 2 threads than on 1 (docs/performance.md
    section 6). train.py sets OMP_WAIT_POLICY=PASSIVE unless the environment sets it: idle threads
    sleep instead of spinning, so beside another CPU-bound process 2 threads are about as fast as 1
    (spinning, they took 2x as long). Results are deterministic per seed and thread counts"""
    sample_threads: int = 1
    """ours: torch intra-op threads while the toy samplers decode (rollouts, reflections, held-out
    evaluation; HFSampler / KVSampler); 0 = `threads`. A decode step is many small ops: with the
    passive wait policy 2 sampling threads took 127 s of a run's rollouts against 70 s on one. The
    sampled tokens then do not depend on `threads` (seed 0's metrics, bank and final weights are
    the same with threads 1 and 2)"""
    precision: str = "fp32"
    """ours: the toy model's forward passes (SFT warm start, rollouts, the update's log-probs, the
    held-out evaluation): "fp32" | "bf16" (torch autocast: matrix products in bfloat16, weights,
    optimizer state, softmax and loss in float32; hf_sampler.autocast). Engine "torch" only: ZeRO-3
    sets its own with full.bf16"""
    progress: bool = True
    """progress bars (--no-progress turns them off)"""
    max_nonfinite_updates: int = 3
    """ours: stop (after a checkpoint, exit code 6) when this many updates in a row applied no
    optimizer step because every gradient norm was non-finite; 0 = never stop"""
    report_to: list = field(default_factory=list)
    """metrics besides metrics.jsonl: "tensorboard" (run_dir/tensorboard) and / or "wandb" (offline
    unless $WANDB_MODE says otherwise); --report-to"""
    dry_run: bool = False
    """full mode: check the environment and print the plan only"""
    fast_logprobs: bool = False
    """ours: the policy engine's log-probs. False (the toy default): the plain path, one sequence per
    row and log_softmax + gather over every position (policy.token_logprobs). True (the full
    preset): the vocabulary projection only where the loss mask is set, in chunks, and the
    sequences of a micro-batch that share a long prompt (a reflection group's m candidates) packed
    into one row (backends/fast_logprobs.py); the same values to float rounding (tests/test_logprobs.py,
    tests/test_prefix_sharing.py), less memory and time (docs/performance.md section 7). Was
    ss_grpo.share_prefix"""
    engine: str = "torch"
    """policy engine: "torch" (one process, torch AdamW) | "zero3" (DeepSpeed ZeRO-3 over the
    launcher's ranks, full.ZeRO3Engine)"""
    sampler: str = "kv"
    """rollouts: "kv" (toy/kv_sampler.KVSampler: its own KV-cache decode loop, HF generate's greedy
    rollouts and next-token distributions, about 2x faster on CPU; the toy default) | "hf"
    (transformers generate, the reference path) | "vllm" (backends/vllm_sampler.VLLMSampler)"""
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    """injected faults (off by default)"""
    eval: Any = field(default_factory=_section("eval"))
    """backends/heldout.EvalConfig: the held-out evaluation of a toy run"""
    toy_model: Any = field(default_factory=_section("toy_model"))
    """toy/model.ToyModelConfig: the toy policy's size and vocabulary"""
    world: Any = field(default_factory=_section("world"))
    """toy/world.WorldConfig: the generated research world"""
    teacher: Any = field(default_factory=_section("teacher"))
    """toy/sft.TeacherConfig: the scripted teacher's mistakes"""
    sft: Any = field(default_factory=_section("sft"))
    """toy/sft.SFTConfig: the toy SFT warm start"""
    full: Any = field(default_factory=_section("full"))
    """backends/full.FullConfig: DeepSpeed and vLLM (None: not used by this run)"""
    judge_http: Any = field(default_factory=_section("judge_http"))
    """backends/judge_http.HTTPJudgeConfig: the HTTP judge's transport (None: not used)"""
    search_http: Any = field(default_factory=_section("search_http"))
    """backends/search_http.SearchHTTPConfig: web search's transport (None: not used)"""


REPORT_BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # report_to name -> package

# The fields of Config whose sections come from the registry (SECTIONS).
SECTION_FIELDS = ("eval", "toy_model", "world", "teacher", "sft", "full", "judge_http", "search_http")


# ----------------------------------------------------------------------------------------------------
# Overrides and checks (the ablation arms, ss_grpo.ARMS, are the paper's)


def apply_overrides(cfg: Config, items: Sequence[str]) -> Config:
    """`a.b=value` overrides, each converted to its field's type (int, float, bool, str, list;
    settings.convert) when the command line is parsed, so that a bad value stops the run before
    anything is written. Raises ValueError naming the field: an unknown field (with the closest
    known ones), a value of the wrong type ("ss_grpo.lr: expected a float, got 'abc'"), or a value
    that contains an API key (named by its variable, never quoted)."""
    for it in items:
        key = it.split("=", 1)[0]
        for name, secret in _secrets().items():  # the type errors below quote the value
            if secret in it:
                raise ValueError(f"{key} contains the value of ${name}: API keys are read from the "
                                 "environment only and never stored in the configuration")
        set_override(cfg, it)
    return cfg


def validate_config(cfg: Config) -> None:
    """Clear errors naming the field for configurations that cannot run. First attaches the
    sections the run's backends need (needed_sections) with their defaults."""
    attach_sections(cfg, *needed_sections(cfg))
    check_no_secrets(cfg)  # first: the messages below quote values, and a key must never be printed
    K = len(STAGES)
    try:
        ss_grpo.validate_lambda(cfg.ss_grpo.lam, expected_k=K)
    except ValueError as e:
        raise ValueError(f"ss_grpo.lam: {e}") from None
    if len(cfg.judge.caps) != K:
        raise ValueError(f"judge.caps must have {K} entries (one per stage {STAGES}), "
                         f"got {cfg.judge.caps}")
    if cfg.arm not in ARMS:
        raise ValueError(f"arm must be one of {tuple(ARMS)}, got {cfg.arm!r}")
    validate_scaffold(cfg)
    if cfg.ss_grpo.agg not in ss_grpo.AGG_MODES:
        raise ValueError(f"ss_grpo.agg must be one of {ss_grpo.AGG_MODES}")
    if cfg.rollout.n < 2:
        raise ValueError("rollout.n must be >= 2: group normalisation needs a group")
    if cfg.rollout.prompts_per_step < 1 or cfg.steps < 0:
        raise ValueError("rollout.prompts_per_step must be >= 1 and steps >= 0")
    for name, lo in (("checkpoint.every", 0), ("checkpoint.keep", 1), ("checkpoint.stop_after", 0),
                     ("eval.every", 0), ("max_nonfinite_updates", 0),
                     ("judge.max_retries", 0), ("judge.max_failure_steps", 1)):
        v = _field(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    for name, hi in (("judge.max_failure_rate", 1.0), ("rollout.tool_timeout_s", None),
                     ("rollout.deadline_s", None)):
        v = _field(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= (hi or float("inf")) \
                or v == float("inf"):
            want = f"in [0, {hi:g}]" if hi is not None else ">= 0 and finite (0 = no limit)"
            raise ValueError(f"{name} must be a number {want}, got {v!r}")
    c = cfg.reflection.loss_coef
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < float("inf"):
        raise ValueError(f"reflection.loss_coef must be a finite number >= 0, got {c!r}")
    if cfg.reflection.system_prompt not in ("task", "reflect"):
        raise ValueError(f"reflection.system_prompt must be 'task' or 'reflect', got "
                         f"{cfg.reflection.system_prompt!r}")
    for name, lo in (("threads", 1), ("sample_threads", 0)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    for name, allowed in (("engine", ("torch", "zero3")), ("sampler", ("hf", "kv", "vllm")),
                          ("precision", ("fp32", "bf16")),
                          ("judge.backend", ("toy", "gemini", "openai")),
                          ("search.backend", ("toy", "serper")), ("bank.retriever", ("bm25", "dense"))):
        if _field(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {_field(cfg, name)!r}")
    if getattr(cfg, "full", None) is not None:  # the full section: attached when a run uses it
        if cfg.full.rollout_schedule not in ("lockstep", "async"):
            raise ValueError(f"full.rollout_schedule must be one of ('lockstep', 'async'), got "
                             f"{cfg.full.rollout_schedule!r}")
        if not 0.0 <= cfg.full.rank0_rollout_share <= 1.0:
            raise ValueError(f"full.rank0_rollout_share must be in [0, 1], got {cfg.full.rank0_rollout_share}")
        if cfg.full.tool_concurrency < 1:
            raise ValueError(f"full.tool_concurrency must be >= 1, got {cfg.full.tool_concurrency}")
    if cfg.judge.backend == "toy" and cfg.data.source:
        raise ValueError("judge.backend 'toy' scores against the toy world's ground truth: it needs "
                         "data.source = \"\" (the toy world's questions); use an HTTP judge "
                         "(gemini / openai) for other data")
    if cfg.engine == "zero3" and not cfg.model:
        raise ValueError("engine 'zero3' loads the policy on every rank from --model (a local Hugging "
                         "Face directory, e.g. an SFT checkpoint or a toy run's final/)")
    if cfg.engine == "zero3" and cfg.precision != "fp32":
        raise ValueError("precision applies to engine 'torch'; ZeRO-3 takes its precision from "
                         "full.bf16")
    if cfg.sampler == "vllm" and not cfg.model:
        raise ValueError("sampler 'vllm' loads its engine from --model (a local Hugging Face directory)")
    if cfg.faults.judge_rate > 0 and cfg.judge.backend != "toy":
        raise ValueError("--faults injects judge faults into the toy judge only; an HTTP judge is "
                         "tested against a loopback server instead (tests/loopback.py)")
    validate_fault_config(cfg.faults, "faults")
    if cfg.judge.backend != "toy":  # the HTTP judge's own settings (backends/judge_http.py)
        cfg.judge_http.check(cfg.judge)
    if cfg.search.backend == "serper":  # web search's (backends/search_http.py)
        cfg.search_http.check(cfg.search.k)
    for name in cfg.report_to:
        if name not in REPORT_BACKENDS:
            raise ValueError(f"report_to: unknown backend {name!r}; expected some of "
                             f"{tuple(REPORT_BACKENDS)}")
        if importlib.util.find_spec(REPORT_BACKENDS[name]) is None:
            raise ValueError(f"report_to {name!r} needs the {REPORT_BACKENDS[name]} package: "
                             f"pip install {REPORT_BACKENDS[name]}")


def validate_scaffold(cfg: Config) -> None:
    """The scaffold ablation (Fig. 6a-c): rollout.scaffold must be one of scaffold.SCAFFOLDS, and the
    unstructured scaffold, which has no stages, no reflection and no memory, trains only with an arm
    whose advantage is the terminal Answer score without reflection or bank ("baseline_rl": the
    paper's Baseline RL, one score broadcast to all tokens), scored by the toy judge (the only one
    that grades its Answer stage alone). Raises ValueError naming the fields."""
    sc = cfg.rollout.scaffold
    if sc not in SCAFFOLDS:
        raise ValueError(f"rollout.scaffold must be one of {SCAFFOLDS}, got {sc!r}")
    if sc == "structured":
        return
    arm = ARMS[cfg.arm]
    wants = (("stage-wise advantages (advantage 'ss_grpo')", arm.advantage == "ss_grpo"),
             ("all four stage scores (advantage 'terminal_mean')", arm.advantage == "terminal_mean"),
             ("the reflection meta-policy", arm.reflection), ("the rubric bank", arm.bank))
    needs = [what for what, on in wants if on]
    if needs:
        raise ValueError(f"rollout.scaffold = 'unstructured' has no stages, no reflection and no "
                         f"memory, but arm = {cfg.arm!r} needs {', '.join(needs)}; use arm "
                         "'baseline_rl' (--arm baseline_rl: terminal Answer score, no reflection, "
                         "no bank)")
    if cfg.judge.backend != "toy":
        raise ValueError(f"rollout.scaffold = 'unstructured' is graded by the toy judge only "
                         f"(judge.backend = 'toy'), got judge.backend = {cfg.judge.backend!r}")


def _field(cfg: Config, dotted: str):
    obj = cfg
    for p in dotted.split("."):
        obj = getattr(obj, p)
    return obj


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Environment variables whose values must never be written anywhere (the HTTP judge and search read
# them at request time); any other variable named *_API_KEY / *_TOKEN / *_SECRET counts too.
SECRET_ENV_VARS = ("GEMINI_API_KEY", "OPENAI_API_KEY", "SERPER_API_KEY", "HF_TOKEN")


def _secrets() -> dict[str, str]:
    names = set(SECRET_ENV_VARS) | {n for n in os.environ
                                    if n.endswith(("_API_KEY", "_TOKEN", "_SECRET"))}
    return {n: os.environ[n] for n in sorted(names) if len(os.environ.get(n, "")) >= 8}


def check_no_secrets(cfg: Config) -> None:
    """Raise ValueError naming the field if any string in the configuration contains the value of
    an API-key environment variable: keys come from the environment only, and the configuration is
    written to config.json and every checkpoint. The error names the variable, never its value."""
    secrets = _secrets()
    if not secrets:
        return
    for key, v in _flatten(json.loads(json.dumps(asdict(cfg)))).items():
        vals = v if isinstance(v, list) else [v]
        for x in vals:
            for name, secret in secrets.items():
                if isinstance(x, str) and secret in x:
                    raise ValueError(f"{key} contains the value of ${name}: API keys are read from "
                                     "the environment only and never stored in the configuration")


def config_from_dict(d: dict, cls=None, prefix: str = ""):
    """Inverse of dataclasses.asdict for the config tree (e.g. config.json or a checkpoint's config,
    old key spellings included: migrate_config_dict). Raises ValueError naming an unknown field;
    fields absent from `d` keep their defaults; a registered section saved as null stays None."""
    if cls is None:
        cls, d = Config, migrate_config_dict(d)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in d.items():
        if k not in fields:
            raise ValueError(f"unknown config field {prefix + k!r}")
        sub = fields[k].default_factory
        if cls is Config and k in SECTION_FIELDS and isinstance(v, dict):
            if k not in SECTIONS:
                raise ValueError(f"config section {k!r} is not registered: read saved configs with "
                                 "backends.presets.load_config")
            sub = type(SECTIONS[k]())
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and isinstance(v, dict):
            v = config_from_dict(v, sub, f"{prefix}{k}.")
        kw[k] = v
    return cls(**kw)


# Fields a resumed run may change: where and how long it runs, not what it computes. The tool
# limits are wall-clock safety nets, the failure thresholds only decide when to stop, and the
# reflection prompt cap only acts on a prompt that would not fit the sampler's context.
RESUME_MAY_CHANGE = ("steps", "run_dir", "progress", "report_to", "threads", "sample_threads",
                     "cache_dir", "checkpoint.", "max_nonfinite_updates", "reflection.max_prompt_tokens",
                     "eval.", "rollout.tool_timeout_s", "rollout.deadline_s", "judge.max_failure_rate",
                     "judge.max_failure_steps", "judge_http.base_url", "judge_http.api_key_env",
                     "judge_http.concurrency", "judge_http.timeout_s", "judge_http.backoff",
                     "judge_http.cache_dir", "judge_http.price_", "judge_http.max_usd", "judge_http.rpm",
                     "judge_http.tpm", "judge_http.retry_after_max_s", "search_http.base_url",
                     "search_http.api_key_env", "search_http.timeout_s", "search_http.backoff",
                     "search_http.cache_dir", "search_http.rpm", "full.dist_timeout_min",
                     "full.gpu_memory_gib", "full.host_memory_gib")


def resume_config_diff(saved: dict, cfg: Config) -> list[str]:
    """Dotted names of the fields in which `cfg` differs from a checkpoint's config (`saved`, an
    asdict dict, old key spellings included), leaving out RESUME_MAY_CHANGE and the sections that
    either side does not use (None: e.g. a toy run's judge_http)."""
    a = _flatten(migrate_config_dict(saved))
    b = _flatten(json.loads(json.dumps(asdict(cfg))))
    unused = {k for k in SECTION_FIELDS if (k in saved and saved[k] is None) or getattr(cfg, k, None) is None}
    keys = sorted(set(a) | set(b))
    return [k for k in keys if not k.startswith(RESUME_MAY_CHANGE) and k.split(".", 1)[0] not in unused
            and a.get(k, _field_default(cfg, k)) != b.get(k)]


def _field_default(cfg: Config, key: str):
    """The declared default of the field at dotted `key` (JSON form), for a key that a checkpoint
    written before the field existed does not hold: a run that leaves it at its default computes
    what the checkpoint's run computed. A key that cannot be resolved has no default (a change)."""
    *path, name = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p, None)
    f = {x.name: x for x in dataclasses.fields(obj)}.get(name) if dataclasses.is_dataclass(obj) else None
    if f is None:
        return object()
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return object()
    try:
        return json.loads(json.dumps(asdict(v) if dataclasses.is_dataclass(v) else v))
    except TypeError:
        return object()
