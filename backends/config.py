"""Command-line settings of train.py: typed `--set key=value` overrides, the configuration reference
(`--list-config`) and the default run directory of each command-line variation.

Not part of the paper's method: plumbing that makes a run's settings checkable before any work starts.

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
import math
import os
import re
import textwrap
import tokenize
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import ss_grpo
from bank import BankConfig, CurriculumConfig
from backends.checkpoint import CheckpointConfig
from backends.data import PAPER_RL_DATA, DataConfig
from backends.faults import FaultConfig, validate_fault_config
from backends.report import REPORT_BACKENDS
from judge import JudgeConfig
from reflection import ReflectionConfig
from scaffold import SCAFFOLDS, STAGES, RolloutConfig, SearchConfig
from ss_grpo import ARMS, Arm, SSGRPOConfig  # noqa: F401  (config.ARMS, config.Arm)
from toy.sft import SFTConfig, TeacherConfig
from toy.world import WorldConfig

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
        else:
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
    key = key.strip()
    obj, parts = cfg, key.split(".")
    for i, p in enumerate(parts):
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
    field (an attribute docstring). Fields without any get ""."""
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
    instance, e.g. config.toy_preset()), in declaration order."""
    rows = []

    def walk(obj, prefix):
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, f"{prefix}{f.name}.")
            else:
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
# The run configuration: one typed tree (each section owned by its module), `toy` and `full`
# presets, the ablation arms, overrides and checks


@dataclass
class FullConfig:
    """DeepSpeed and vLLM settings of full mode, carried by config.Config as `full` (here, not in backends/full.py,
    so that a toy run never imports that module). Values the paper
    fixes are marked PAPER; the rest are ours (module docstring, deviation 1)."""

    zero_stage: int = 3
    """PAPER: "ZeRO-3"."""
    offload_optimizer: bool = True
    """PAPER: "with CPU offload"."""
    offload_param: bool = False
    """ours: parameters stay on GPU (2 GB per GPU for 8B over 8 GPUs)"""
    gradient_checkpointing: bool = True
    """PAPER: "gradient checkpointing"."""
    bf16: str = "auto"
    """"auto" = on for GPU, off for CPU; "on" | "off"."""
    optimizer: str = "auto"
    """"auto" = DeepSpeed AdamW on GPU, torch AdamW on CPU; "torch" | "deepspeed"."""
    adam_betas: tuple = (0.9, 0.95)
    """ours, as the toy path (train.py)"""
    weight_decay: float = 0.0
    """ours, as the toy path"""
    reference: str = "zero3"
    """pi_ref placement: ZeRO-3 partitioned for inference (see docstring)"""
    logprob_chunk: int = 1024
    """positions per vocabulary projection in policy.token_logprobs"""
    world_size_hint: int = 8
    """dry run without a launcher: assume one node of 8 GPUs (the paper's SFT node)"""
    dist_timeout_min: float = 180.0
    """ours: collective timeout; ranks > 0 wait in a collective while rank 0 samples, judges and
    reflects, which for 256 long rollouts can take far longer than torch's 10-30 minute default"""
    max_prompt_tokens: int = 8192
    """PAPER: max prompt length 8,192 tokens; with rollout.max_response_tokens (PAPER: 18,432) the
    longest sequence (pack) is 26,624 tokens"""
    vllm_max_model_len: int = 0
    """0 = max_prompt_tokens + rollout.max_response_tokens (PAPER: 26,624; see build.build_sampler);
    the engine's context length"""
    gpu_memory_gib: float = 80.0
    """dry run without a visible GPU: each GPU's memory the memory plan is checked against (ours: an
    80 GB H100; backends/plan.py)"""
    host_memory_gib: float = 0.0
    """dry run: host RAM per node the memory plan is checked against (0 = this machine's, checked only
    when it has GPUs)"""
    vllm_gpu_memory_utilization: float = 0.5
    """ours: leaves room for the ZeRO-3 shards on rank 0's GPU (on CPU: the fraction of RAM vLLM
    requires to be free at start)"""
    vllm_cpu_kv_cache_gib: int = 2
    """CPU only: vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    rollout_schedule: str = "lockstep"
    """sampler "vllm" only: "lockstep" (every tool turn waits for every rollout, calls one at a time)
    or "async" (a rollout moves on when its own tool result arrives, calls concurrent, one seed per
    request; backends/rollout_engine.py, docs/full_mode.md)"""
    tool_concurrency: int = 8
    """ours: tool calls in flight at once under rollout_schedule "async" (>= 1)"""


@dataclass
class EvalConfig:
    """Held-out evaluation of a toy run (not in the paper): questions, samples, temperature."""

    n_questions: int = 64
    """held-out questions evaluated at the end (0 = no evaluation)"""
    samples: int = 2
    """rollouts per held-out question"""
    temperature: float = 1.0
    """sampling temperature of the held-out evaluation"""
    every: int = 0
    """ours: also evaluate the current policy every this many RL steps, same questions and settings,
    into eval_curve.jsonl (0 = only the SFT start and the end)"""


@dataclass
class Config:
    """Everything a run needs. `toy_preset()` / `full_preset()` fill it; `--set a.b=v` overrides."""

    mode: str = "toy"
    """preset the run started from: "toy" | "full" (set by --toy / --full)"""
    arm: str = "rubricem"
    """ablation arm (ARMS): "rubricem" | "ss_grpo" | "meta_policy" | "baseline_rl" |
    "baseline_rl_info"; selects the advantage, the reflection branch and bank retrieval together"""
    seed: int = 0
    """seeds data order, sampling, warm start and evaluation (--seed)"""
    steps: int = 24
    """toy: four curriculum windows of 2K = 6 steps"""
    run_dir: str = "runs/toy"
    """where metrics, checkpoints, final/ and eval.json go (--run-dir)"""
    model: str = ""
    """"" = toy SFT warm start; else a local HF causal-LM directory"""
    model_size: str = "S"
    """toy policy size: "XS" | "S" | "M" (toy_model.SIZES); "S" = 0.5 M parameters"""
    vocab_size: int = 1024
    """toy byte-level BPE vocabulary size (tokenizer trained on the toy world)"""
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
    report_to: list = field(default_factory=list)
    """metrics besides metrics.jsonl: "tensorboard" (run_dir/tensorboard) and / or "wandb" (offline
    unless $WANDB_MODE says otherwise); --report-to"""
    dry_run: bool = False
    """full mode: check the environment and print the plan only"""
    engine: str = "torch"
    """policy engine: "torch" (one process, torch AdamW) | "zero3" (DeepSpeed ZeRO-3 over the
    launcher's ranks, full.ZeRO3Engine)"""
    sampler: str = "kv"
    """rollouts: "kv" (toy/kv_sampler.KVSampler: its own KV-cache decode loop, HF generate's greedy
    rollouts and next-token distributions, about 2x faster on CPU; the toy default) | "hf"
    (transformers generate, the reference path) | "vllm" (backends/vllm_sampler.VLLMSampler)"""
    data: DataConfig = field(default_factory=DataConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    full: FullConfig = field(default_factory=FullConfig)
    """DeepSpeed settings (engine = "zero3")"""
    world: WorldConfig = field(default_factory=WorldConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ss_grpo: SSGRPOConfig = field(default_factory=SSGRPOConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    reflection: ReflectionConfig = field(default_factory=ReflectionConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    """injected faults (off by default)"""


def toy_preset() -> Config:
    """Toy mode: 5-8 minutes on a 2-core CPU with the SFT warm start (the machine's speed varies
    between sittings), 2-3 once it is cached (docs/results.md; values are ours)."""
    return Config()


def full_preset() -> Config:
    """Full mode: the paper's RL configuration (appendix)."""
    c = Config(mode="full", steps=1400, run_dir="runs/full")  # PAPER: final run 1400 steps
    c.engine, c.sampler = "zero3", "vllm"  # PAPER: ZeRO-3 training, vLLM sampling
    c.data.source = PAPER_RL_DATA  # PAPER: rl-research/dr-tulu-rl-data
    c.search.backend = "serper"  # PAPER: web search tool (google_search)
    c.judge.backend = "gemini"  # PAPER: Gemini Flash judge and rubric generator
    c.bank.retriever = "dense"  # PAPER: Qwen3-Embedding-0.6B bank retrieval
    c.rollout = RolloutConfig(prompts_per_step=32, n=8, temperature=1.0,  # PAPER: 32 x 8
                              max_response_tokens=18432, max_tool_calls=10,  # PAPER
                              system_prompt="full")
    c.ss_grpo.lr = 5e-7  # PAPER: lr 5e-7 constant
    c.ss_grpo.minibatches = 1
    c.ss_grpo.micro_batch = 1
    c.eval = EvalConfig(n_questions=0)
    # not in the paper (it gives no length): a reflection is a retrospective rubric plus takeaways
    # (Fig. 2) that returns as a memory note inside the 8,192-token prompt (top-k 2). 512 tokens
    # leave two notes (<= 3,000 characters each, ~1,500 tokens) well inside it; 64 (toy) cut them.
    c.reflection.max_new_tokens = 512
    c.reflection.system_prompt = "reflect"  # plain prose: the bank refuses stage tags
    c.bank.max_chars = 3000
    return c


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
    """Clear errors naming the field for configurations that cannot run."""
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
                     ("eval.every", 0),
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
                          ("search.backend", ("toy", "serper")), ("bank.retriever", ("bm25", "dense")),
                          ("full.rollout_schedule", ("lockstep", "async"))):
        if _field(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {_field(cfg, name)!r}")
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
        from backends.judge_http import check_http_config

        check_http_config(cfg.judge)
    if cfg.search.backend == "serper":
        from backends.search_http import check_search_config

        check_search_config(cfg.search)
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
    """Inverse of dataclasses.asdict for the config tree (e.g. config.json or a checkpoint's config).
    Raises ValueError naming an unknown field; fields absent from `d` keep their defaults."""
    cls = cls or Config
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in d.items():
        if k not in fields:
            raise ValueError(f"unknown config field {prefix + k!r}")
        sub = fields[k].default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and isinstance(v, dict):
            v = config_from_dict(v, sub, f"{prefix}{k}.")
        kw[k] = v
    return cls(**kw)


# Fields a resumed run may change: where and how long it runs, not what it computes. The tool
# limits are wall-clock safety nets and the failure thresholds only decide when to stop.
RESUME_MAY_CHANGE = ("steps", "run_dir", "progress", "report_to", "threads", "sample_threads",
                     "cache_dir", "checkpoint.",
                     "eval.", "rollout.tool_timeout_s", "rollout.deadline_s", "judge.max_failure_rate",
                     "judge.max_failure_steps", "judge.base_url", "judge.api_key_env",
                     "judge.concurrency", "judge.timeout_s", "judge.backoff", "judge.cache_dir",
                     "judge.price_", "judge.max_usd", "judge.rpm", "judge.tpm",
                     "judge.retry_after_max_s", "search.base_url", "search.api_key_env", "search.timeout_s",
                     "search.backoff", "search.cache_dir", "search.rpm", "full.dist_timeout_min",
                     "full.gpu_memory_gib", "full.host_memory_gib")


def resume_config_diff(saved: dict, cfg: Config) -> list[str]:
    """Dotted names of the fields in which `cfg` differs from a checkpoint's config (`saved`, an
    asdict dict), leaving out RESUME_MAY_CHANGE."""
    a = _flatten(json.loads(json.dumps(saved)))
    b = _flatten(json.loads(json.dumps(asdict(cfg))))
    keys = sorted(set(a) | set(b))
    return [k for k in keys if not k.startswith(RESUME_MAY_CHANGE) and a.get(k) != b.get(k)]
