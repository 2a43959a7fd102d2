"""The run configuration (`Config`): the tree, the registry of its sections, the checks, renamed
keys, saved configs and what a resumed run may change.

Not part of the paper's method: plumbing that makes a run's settings checkable before any work starts.
Where the settings live:
    hparams.py                 the paper layer (PaperConfig: arm, seed, steps, rollout, search, ss_grpo,
                               judge, bank, reflection, curriculum), each knob with its paper reference
    Config (here)              PaperConfig + the run's plumbing (run_dir, engine, sampler, threads, ...)
                               + data, checkpoint, faults (backends/run/data.py, checkpoint.py, faults.py)
    the registry (SECTIONS)    eval (backends/run/heldout.py), toy_model, world, teacher, sft (toy/),
                               full (backends/scale/settings.py), judge_http, search_http
                               (backends/api/settings.py), registered by backends/run/presets.py, which
                               also builds the presets
Old key spellings (ALIASES: judge.base_url, search.rpm, model_size, ...) still work, with a one-line
deprecation notice, in --set and in a saved config.json. `--set` itself, the configuration reference
(`--list-config`) and the default run directories are overrides.py's.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import ss_grpo
from backends.run.checkpoint import CheckpointConfig
from backends.run.data import DataConfig
from backends.run.faults import FaultConfig, validate_fault_config
from hparams import PaperConfig
from scaffold import SCAFFOLDS, STAGES
from ss_grpo import ARMS, Arm  # noqa: F401  (config.ARMS, config.Arm)

log = logging.getLogger("rubricem.config")


# ----------------------------------------------------------------------------------------------------
# Renamed keys: the old spelling still works (a one-line deprecation notice), in --set and in a saved
# config.json (resume, scripts/ask.py, evaluate.py)

# The HTTP judge's and web search's transport knobs moved to their backends' sections
# (backends/api/settings.HTTPJudgeConfig, backends/api/settings.SearchHTTPConfig); the toy policy's size
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
                    "(backends/run/config.py ALIASES)", len(moved), moved[0])
    return out


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
# world's (toy/) and the held-out evaluation's are registered by the toy preset (backends/run/presets.py);
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
    ValueError for a section nobody registered (import backends.run.presets, which registers them)."""
    for name in names:
        if getattr(cfg, name) is None:
            if name not in SECTIONS:
                raise ValueError(f"config section {name!r} is not registered (backends/run/presets.py "
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
    then the backends' sections. backends/run/presets.toy_preset() / full_preset() fill it;
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
    (spinning, they took 2x as long). Results are deterministic per seed and thread counts. The full
    preset sets the cores per rank (presets.cores_per_rank): DeepSpeedCPUAdam's OpenMP threads"""
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
    fast_logprobs: bool = True
    """ours: the policy engine's log-probs. True (both presets): the vocabulary projection only where
    the loss mask is set, in chunks, and the sequences that share a long prompt (a reflection
    group's m candidates behind their trajectory) packed into one row
    (backends/run/fast_logprobs.py); the same values to float rounding (tests/test_logprobs.py,
    tests/test_prefix_sharing.py), less memory and time: in the toy it cut the reflection update's
    CPU time about 8x (benchmarks/toy_step.py, docs/performance.md). False: the plain path, one
    sequence per row and log_softmax + gather over every position (policy.token_logprobs). Was
    ss_grpo.share_prefix"""
    engine: str = "torch"
    """policy engine: "torch" (one process, torch AdamW) | "zero3" (DeepSpeed ZeRO-3 over the
    launcher's ranks, engine.ZeRO3Engine)"""
    sampler: str = "kv"
    """rollouts: "kv" (toy/kv_sampler.KVSampler: its own KV-cache decode loop, HF generate's greedy
    rollouts and next-token distributions, about 2x faster on CPU; the toy default) | "hf"
    (transformers generate, the reference path) | "vllm" (backends/scale/vllm_sampler.VLLMSampler)"""
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    """injected faults (off by default)"""
    eval: Any = field(default_factory=_section("eval"))
    """backends/run/heldout.EvalConfig: the held-out evaluation of a toy run"""
    toy_model: Any = field(default_factory=_section("toy_model"))
    """toy/model.ToyModelConfig: the toy policy's size and vocabulary"""
    world: Any = field(default_factory=_section("world"))
    """toy/world.WorldConfig: the generated research world"""
    teacher: Any = field(default_factory=_section("teacher"))
    """toy/teacher.TeacherConfig: the scripted teacher's mistakes"""
    sft: Any = field(default_factory=_section("sft"))
    """toy/sft.SFTConfig: the toy SFT warm start"""
    full: Any = field(default_factory=_section("full"))
    """backends/scale/settings.FullConfig: DeepSpeed and vLLM (None: not used by this run)"""
    judge_http: Any = field(default_factory=_section("judge_http"))
    """backends/api/settings.HTTPJudgeConfig: the HTTP judge's transport (None: not used)"""
    search_http: Any = field(default_factory=_section("search_http"))
    """backends/api/settings.SearchHTTPConfig: web search's transport (None: not used)"""


REPORT_BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # report_to name -> package

# The fields of Config whose sections come from the registry (SECTIONS).
SECTION_FIELDS = ("eval", "toy_model", "world", "teacher", "sft", "full", "judge_http", "search_http")


# ----------------------------------------------------------------------------------------------------
# Checks (the ablation arms, ss_grpo.ARMS, are the paper's)


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
    if cfg.checkpoint.hash not in ("sync", "background"):
        raise ValueError(f"checkpoint.hash must be 'sync' or 'background', got {cfg.checkpoint.hash!r}")
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
        if not 0.0 <= cfg.full.vllm_gpu_memory_utilization < 1.0:
            raise ValueError("full.vllm_gpu_memory_utilization must be in [0, 1) (0: from the memory "
                             f"plan), got {cfg.full.vllm_gpu_memory_utilization}")
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
    if cfg.judge.backend != "toy":  # the HTTP judge's own settings (backends/api/judge_http.py)
        cfg.judge_http.check(cfg.judge)
    if cfg.search.backend == "serper":  # web search's (backends/api/search_http.py)
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


def env_secrets() -> dict[str, str]:
    """{variable: value} of the environment's API keys (SECRET_ENV_VARS, *_API_KEY, *_TOKEN,
    *_SECRET) of 8 characters or more: values that must never be written anywhere."""
    names = set(SECRET_ENV_VARS) | {n for n in os.environ
                                    if n.endswith(("_API_KEY", "_TOKEN", "_SECRET"))}
    return {n: os.environ[n] for n in sorted(names) if len(os.environ.get(n, "")) >= 8}


def check_no_secrets(cfg: Config) -> None:
    """Raise ValueError naming the field if any string in the configuration contains the value of
    an API-key environment variable: keys come from the environment only, and the configuration is
    written to config.json and every checkpoint. The error names the variable, never its value."""
    secrets = env_secrets()
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
                                 "backends.run.presets.load_config")
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
