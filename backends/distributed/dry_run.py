"""Full mode's dry run: resolve the configuration, check the machine and the launch, print the batch,
memory, step-time and judge-cost plan, without loading or training anything.

Not part of the paper's method: it reads the run's configuration (the full preset's PAPER values,
backends/run/presets.py) and reports every problem it finds, by name, before a GPU hour is spent.
The checks of the launch (keys on rank 0, .deepspeed_env, DeepSpeedCPUAdam, /dev/shm) are in
launch_check.py, the tested versions in versions.py, the memory and step-time plan in plan.py.

Launch
    python -m backends.distributed dry-run       # the full preset
    python train.py --full --model DIR --dry-run  # the same for a run's own configuration
"""
from __future__ import annotations

import copy
import importlib.metadata
import os
import sys

import torch

from backends.api.pricing import format_cost_plan, judge_cost_plan
from backends.api.settings import HTTPJudgeConfig
from backends.distributed import launch_check, site_check, versions
from backends.distributed.dist import DistEnv, dist_env
from backends.distributed.launch_check import ranks_per_node
from backends.distributed.plan import model_shape, plan_lines, plan_vs_measured, schedule_estimate
from backends.run.build import ROLLOUT_RANKS, every_rank_samples
from backends.run.config import SECRET_ENV_VARS, validate_config
from backends.run.data import _is_local
from backends.run.runcard import card_mismatch
from backends.scale.settings import batch_plan, deepspeed_config, full_config
from scaffold import system_prompt


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _key_envs(cfg) -> list[tuple[str, str]]:
    """(purpose, environment variable NAME) pairs the configured backends read their keys from."""
    out = []
    if cfg.judge.backend in ("gemini", "openai"):
        out.append((f"judge ({cfg.judge.backend})",
                    (cfg.judge_http or HTTPJudgeConfig()).key_env(cfg.judge.backend)))
    if cfg.search.backend == "serper":
        out.append(("search (google_search, Serper)",
                    cfg.search_http.api_key_env if cfg.search_http else "SERPER_API_KEY"))
    return out


def _rank_search_key_problems(cfg, environ, env: DistEnv) -> list[str]:
    """On a launched rank > 0 of a run where every rank samples (build.every_rank_samples) with
    Serper search: the search key must be set on this rank too, since its rollouts make their own
    search calls (the judge key stays rank 0's). [] elsewhere or when it is set."""
    if not env.launched or env.rank == 0 or cfg.search.backend != "serper" \
            or full_config(cfg).rollout_ranks not in ROLLOUT_RANKS or not every_rank_samples(cfg):
        return []
    name = cfg.search_http.api_key_env if cfg.search_http else "SERPER_API_KEY"
    if environ.get(name):
        return []
    return [f"environment variable {name} is not set on global rank {env.rank}: with "
            f"full.rollout_ranks \"all\" every rank runs its own rollouts' searches (list it in "
            ".deepspeed_env for a multi-node launch)"]


def _required_packages(cfg) -> dict[str, str]:
    """{distribution: why this configuration needs it (and how to install it)} for cfg's backends."""
    full_extra = "pip install '.[full]'"
    need = {"torch": "every engine", "transformers": "every engine"}
    if cfg.engine == "zero3":
        need["deepspeed"] = f"engine 'zero3'; {full_extra}"
        need["accelerate"] = f"engine 'zero3' (transformers' HfDeepSpeedConfig); {full_extra}"
    if cfg.sampler == "vllm":
        need["vllm"] = ("sampler 'vllm'; pip install vllm (it pins its own torch and transformers, "
                        "docs/full_mode.md)")
    if cfg.bank.retriever == "dense":
        need["sentence-transformers"] = f"bank.retriever 'dense' ({cfg.bank.embed_model}); {full_extra}"
    http = [f"judge.backend '{cfg.judge.backend}'"] if cfg.judge.backend in ("gemini", "openai") else []
    http += [f"search.backend '{cfg.search.backend}'"] if cfg.search.backend == "serper" else []
    if http:
        need["requests"] = f"{' and '.join(http)}; {full_extra}"
    if cfg.data.source and not _looks_local(cfg.data.source):
        need["datasets"] = (f"data.source {cfg.data.source!r} (a Hugging Face dataset id, read by rank 0); "
                            f"{full_extra}, or offline: --set data.source=\"rows.jsonl\" (a local file)")
    return need


def _looks_local(path: str) -> bool:
    """data._is_local's rule: it exists, or it is written as a path or a file name."""
    return _is_local(path)


def _path_problems(cfg) -> list[str]:
    """Problems with the local paths the run would read: the policy model (--model, a Hugging Face
    directory), data.source and the dense retriever's embedding model when given as local paths."""
    out = []
    if not cfg.model:
        out.append("no policy model: pass --model (the paper starts RL from its Qwen3-8B SFT model)")
    elif not os.path.isdir(os.path.expanduser(cfg.model)):
        out.append(f"policy model {cfg.model!r} does not exist (--model takes a local Hugging Face "
                   "directory)")
    elif not os.path.isfile(os.path.join(os.path.expanduser(cfg.model), "config.json")):
        out.append(f"policy model {cfg.model!r} has no config.json: not a Hugging Face model directory")
    else:  # the SFT stage's run card (backends/sft/zero3.py) names the prompt the policy learned
        try:
            bad = card_mismatch(os.path.expanduser(cfg.model),
                                system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt),
                                cfg.rollout.scaffold)
        except ValueError as err:
            bad = str(err)
        if bad:
            out.append(bad)
    if cfg.data.source and _looks_local(cfg.data.source) \
            and not os.path.exists(os.path.expanduser(cfg.data.source)):
        out.append(f"data.source {cfg.data.source!r} does not exist")
    emb = cfg.bank.embed_model
    if cfg.bank.retriever == "dense" and _looks_local(emb) and not os.path.isdir(os.path.expanduser(emb)):
        out.append(f"bank.embed_model {emb!r} does not exist")
    return out


def _config_problem(cfg) -> list[str]:
    """settings.validate_config's verdict as a list (it stops at the first error). The policy model
    is checked by _path_problems, so a missing one is filled in here to let the other checks run."""
    probe = copy.deepcopy(cfg)
    probe.model = probe.model or "(--model)"
    try:
        validate_config(probe)
    except ValueError as err:
        return [f"configuration: {err}"]
    return []


def _redact(text: str, environ) -> str:
    """Replace the value of every secret environment variable (settings.SECRET_ENV_VARS, *_API_KEY,
    *_TOKEN, *_SECRET; 8 characters or more) in `text` by $NAME."""
    for name, v in environ.items():
        if (name in SECRET_ENV_VARS or name.endswith(("_API_KEY", "_TOKEN", "_SECRET"))) \
                and isinstance(v, str) and len(v) >= 8:
            text = text.replace(v, f"${name}")
    return text


def _host_memory_bytes() -> float:
    """This machine's RAM in bytes (/proc/meminfo MemTotal; 0 when unreadable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def _gpu_bytes(full, n_gpu: int) -> tuple[float, str]:
    """(one GPU's bytes, where the figure comes from): the visible GPU 0, else FullConfig.gpu_memory_gib."""
    if n_gpu:
        return float(torch.cuda.get_device_properties(0).total_memory), "GPU 0 of this machine"
    return full.gpu_memory_gib * 2 ** 30, f"assumed: full.gpu_memory_gib={full.gpu_memory_gib:g}"


def _memory_section(cfg, ws: int, n_gpu: int, environ) -> tuple[list[str], list[str]]:
    """The memory plan, start-up and step-time estimates (backends/distributed/plan.py) for `ws` ranks: GPU
    capacity from the visible GPU 0, else FullConfig.gpu_memory_gib; host RAM from
    FullConfig.host_memory_gib, else this machine's when it has GPUs (a CPU-only machine is not the
    node the plan is for); the start-up counts DeepSpeedCPUAdam's JIT build unless the deepspeed
    package holds the op prebuilt."""
    full = full_config(cfg)
    gpu_b, gpu_src = _gpu_bytes(full, n_gpu)
    if full.host_memory_gib:
        host_b, host_src = full.host_memory_gib * 2 ** 30, f"full.host_memory_gib={full.host_memory_gib:g}"
    elif n_gpu:
        host_b, host_src = _host_memory_bytes(), "this machine"
    else:
        host_b, host_src = 0.0, "not checked: no GPU here; set full.host_memory_gib"
    per_node = ranks_per_node(environ) or min(ws, n_gpu or full.world_size_hint)
    try:
        return plan_lines(cfg, ws, max(1, per_node), gpu_b, gpu_src, host_b, host_src,
                          cpu_adam_prebuilt=site_check.cpu_adam_prebuilt())
    except (ValueError, KeyError) as err:
        return [f"memory plan: not computed ({err})"], [f"memory plan: {err}"]


def step_report(cfg, metrics: dict, environ=None) -> str:
    """Step 1's measured time/* metrics (`metrics`, seconds) next to the plan's phases for the
    schedule this run uses (plan.schedule_estimate, plan.plan_vs_measured) on this launch: its world
    size and ranks per node from the launcher, one GPU's memory from GPU 0 (else
    full.gpu_memory_gib). Never raises: a plan that cannot be computed is reported in the text (the
    training loop logs it and goes on)."""
    e = os.environ if environ is None else environ
    try:
        full = full_config(cfg)
        env = dist_env(e)
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ws = env.world_size if env.launched else (n_gpu or 1)
        gpu_b, _ = _gpu_bytes(full, n_gpu)
        est = schedule_estimate(cfg, ws, max(1, ranks_per_node(e) or min(ws, n_gpu or 1)), gpu_b)
        rows = plan_vs_measured(est.phases, metrics)
    except Exception as err:  # a report, never a reason to stop training
        return f"step 1 against the plan: not computed ({type(err).__name__}: {err})"
    return "\n".join([f"step 1 against the plan (minutes; full.rollout_schedule="
                      f"\"{full.rollout_schedule}\", world {ws}; backends/distributed/plan.py)"] + rows)


def _checkpoint_bytes_in(run_dir: str) -> float:
    """Bytes of the checkpoints already in run_dir (a resumed run keeps them)."""
    root = os.path.join(run_dir, "checkpoints")
    total = 0.0
    for d, _, fs in os.walk(root):
        for f in fs:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def site_lines(cfg, environ, env: DistEnv, n_gpu: int) -> tuple[list[str], list[str]]:
    """The "site" section (site_check.py): compute mode, the allocator setting with vLLM's sleep
    mode, GPUs visible against LOCAL_RANK, a stale extension-build lock, checkpoint size and free
    disk, the NVIDIA driver against the wheels' CUDA, nvcc against torch's CUDA. Returns (lines,
    problems)."""
    full = full_config(cfg)
    lines = ["site (settings that stop a run before step 0 or at its first checkpoint)"]
    problems: list[str] = []
    sleep = cfg.sampler == "vllm" and int(full.vllm_sleep_level) > 0
    shape = model_shape(cfg.model)
    free, where = site_check.free_bytes(cfg.run_dir)
    checks = [
        site_check.compute_mode_lines(site_check.read_compute_modes() if n_gpu else None),
        site_check.alloc_conf_lines(environ, sleep, site_check.vllm_allocator_source()),
        site_check.visible_gpu_lines(environ, n_gpu, env.local_rank, ranks_per_node(environ)),
        site_check.build_lock_lines(site_check.extensions_dir(environ)),
        site_check.arch_list_lines(environ),
        site_check.checkpoint_disk_lines(shape.params, cfg.checkpoint.keep, cfg.checkpoint.every,
                                         cfg.run_dir, free, where, _checkpoint_bytes_in(cfg.run_dir),
                                         bf16=full.bf16 != "off"),
        site_check.driver_lines(site_check.read_driver_version(), torch.version.cuda,
                                site_check.cuda_compat_libs(), n_gpu),
        # the RL run JIT-builds no CUDA op (DeepSpeedCPUAdam is C++): the toolkit line informs only
        site_check.nvcc_lines(site_check.read_nvcc_release(environ=environ), torch.version.cuda, False),
    ]
    for more, bad in checks:
        lines += [f"  {x}" for x in more]
        problems += bad
    return lines, problems


def dry_run(cfg, environ: dict | None = None) -> tuple[str, list[str]]:
    """Resolve `cfg` (a config.Config, normally the `full` preset) into a launch plan without training.

    Collects every problem it finds instead of stopping at the first: the configuration
    (settings.validate_config), the local paths the run reads (policy model directory, data.source,
    embedding model), the batch arithmetic for the launcher's world size (or
    FullConfig.world_size_hint GPUs when not launched), each API key's environment variable
    (reported by NAME only; values never reach the report), GPUs via torch.cuda, and the packages
    the chosen backends need (deepspeed, accelerate, vllm, sentence-transformers, requests,
    datasets) with the versions found (importlib.metadata; nothing heavy is imported), and the
    site (site_lines: compute mode, the allocator setting, GPUs visible per process, a stale
    extension-build lock, checkpoint size against free disk). Returns
    (report text, list of problems); an empty list means the plan is launchable as far as we can
    tell.
    """
    e = os.environ if environ is None else environ
    full = full_config(cfg)
    problems: list[str] = _config_problem(cfg) + _path_problems(cfg)
    if full.rollout_ranks not in ROLLOUT_RANKS:
        problems.append(f"configuration: full.rollout_ranks must be one of {ROLLOUT_RANKS}, got "
                        f"{full.rollout_ranks!r}")
    lines = ["RubricEM full mode: dry run (nothing is trained)", ""]
    try:
        env = dist_env(e)
    except ValueError as err:
        problems.append(str(err))
        env = DistEnv()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ws = env.world_size if env.launched else (n_gpu or full.world_size_hint)
    ws_src = "launcher" if env.launched else (f"{n_gpu} visible GPUs" if n_gpu else
                                              f"assumed: {full.world_size_hint} GPUs, one node")
    lines += ["configuration",
              f"  mode {cfg.mode}, steps {cfg.steps}, run_dir {cfg.run_dir}",
              f"  policy model {cfg.model or '(not set: pass --model, the SFT checkpoint)'}",
              f"  lr {cfg.ss_grpo.lr:g}, beta {cfg.ss_grpo.beta:g} (k3), eta {cfg.ss_grpo.eta:g}, "
              f"agg {cfg.ss_grpo.agg}, arm {cfg.arm}, grad_clip {cfg.ss_grpo.grad_clip:g}",
              f"  rollouts: temperature {cfg.rollout.temperature:g}, max response "
              f"{cfg.rollout.max_response_tokens} tokens, max tool calls {cfg.rollout.max_tool_calls}",
              f"  data {cfg.data.source or '(toy world)'}; bank retriever {cfg.bank.retriever} "
              f"({cfg.bank.embed_model if cfg.bank.retriever == 'dense' else 'BM25'}), top-k {cfg.bank.top_k}", ""]
    try:
        plan = batch_plan(cfg, ws)
        lines += ["batch arithmetic (per RL step)",
                  f"  {plan.prompts} prompts x {plan.rollouts} rollouts = {plan.sequences} sequences",
                  f"  {plan.minibatches} optimizer step(s) of {plan.per_optimizer_step} sequences",
                  f"  world size {ws} ({ws_src}): {plan.per_rank} sequences per rank per optimizer step",
                  f"  micro-batch {plan.micro_batch} per rank -> gradient accumulation "
                  f"{plan.per_optimizer_step} / ({plan.micro_batch} x {ws}) = {plan.grad_accum}", ""]
        ds = deepspeed_config(cfg, ws, "cuda", full)  # the plan is for GPUs, even when none is here
        z = ds["zero_optimization"]
        lines += ["deepspeed",
                  f"  ZeRO stage {z['stage']}, optimizer offload "
                  f"{z.get('offload_optimizer', {}).get('device', 'none')}, parameter offload "
                  f"{z.get('offload_param', {}).get('device', 'none')}, bf16 {ds['bf16']['enabled']}, "
                  f"gradient checkpointing {full.gradient_checkpointing}",
                  f"  optimizer {'DeepSpeed AdamW' if 'optimizer' in ds else 'torch AdamW (client)'}, "
                  f"reference model {full.reference}", ""]
    except ValueError as err:
        problems.append(f"batch arithmetic: {err}")
    lines += ["backends", f"  engine {cfg.engine}, judge {cfg.judge.backend} ({cfg.judge.model}), sampler "
                          f"{cfg.sampler}, search {cfg.search.backend}"]
    if cfg.judge.backend == "toy":
        problems.append("judge.backend is 'toy': full mode scores with an HTTP judge "
                        "(--set judge.backend=\"gemini\"; PAPER: Gemini Flash)")
    k_lines, k_bad = launch_check.key_lines(_key_envs(cfg), e, env.rank, env.launched)
    lines += [""] + k_lines
    problems += k_bad
    problems += _rank_search_key_problems(cfg, e, env)
    lines += ["", "environment", f"  python {sys.version.split()[0]}, {os.cpu_count()} CPU cores"]
    if n_gpu:
        for i in range(n_gpu):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  GPU {i}: {p.name}, {p.total_memory / 2 ** 30:.0f} GiB")
    else:
        lines.append("  GPUs: none visible (torch.cuda.is_available() is False)")
        problems.append("no GPU visible: full mode trains on GPUs")
    needed = _required_packages(cfg)
    if env.rank > 0:  # only rank 0 reads the RL rows (the others get their queries from it)
        needed.pop("datasets", None)
    for dist in ("torch", "transformers", "deepspeed", "accelerate", "vllm", "sentence-transformers",
                 "requests", "datasets"):
        v = _version(dist)
        why = f" (needed: {needed[dist].split(';')[0]})" if dist in needed else ""
        lines.append(f"  {dist} {v or 'not installed'}{why}")
        if v is None and dist in needed:
            problems.append(f"{dist} is not installed, needed by {needed[dist]}")
    full_ = full_config(cfg)
    uses_cpu_adam = full_.offload_optimizer and full_.optimizer in ("auto", "deepspeed") \
        and cfg.engine == "zero3"  # "auto" is DeepSpeed's AdamW on GPU (deepspeed_config)
    for fn in (lambda: launch_check.cpu_adam_lines(uses_cpu_adam, n_gpu, e),
               lambda: launch_check.shm_lines(n_gpu)):
        more, bad = fn()
        lines += [""] + more
        problems += bad
    more, bad = site_lines(cfg, e, env, n_gpu)
    lines += [""] + more
    problems += bad
    v_lines, v_bad = versions.check(_version)
    lines += ["", "versions (the tested set: constraints/gpu.txt)"] + v_lines
    problems += [f"versions: {b}" for b in v_bad]
    mem_lines, mem_problems = _memory_section(cfg, ws, n_gpu, e)
    lines += [""] + mem_lines
    problems += mem_problems
    # The judge's calls, tokens and dollars per step and per run, at the configured prices.
    plan = judge_cost_plan(cfg)
    lines += ["", format_cost_plan(plan)]
    problems += plan["problems"]
    lines += ["", "problems" if problems else "no problems found"] + [f"  - {p}" for p in problems]
    return _redact("\n".join(lines), e), [_redact(p, e) for p in problems]


def main_dry_run(cfg) -> int:
    """Print dry_run(cfg); return 0 when no problem was found, else 1. Under a launcher (no process
    group is created) every rank checks itself: global rank 0 prints the whole report, the other
    ranks only their own problems (a node without what DeepSpeedCPUAdam needs, a missing GPU)."""
    text, problems = dry_run(cfg)
    env = dist_env()
    if env.rank == 0:
        print(text, flush=True)
    else:
        own = [p for p in problems if not p.startswith(("configuration", "batch arithmetic",
                                                         "memory plan", "no policy model"))]
        for p in own:
            print(f"[rank {env.rank}] problem: {p}", flush=True)
    return 1 if problems else 0
