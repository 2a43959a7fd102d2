"""The toy and full presets, and the registry entries of the configuration's sections that live with
their own module (backends/run/config.py SECTIONS).

Not part of the paper's method: the full preset's PAPER lines are the paper's appendix values; the toy
preset is ours. The toy world's sections (toy/) and the held-out evaluation's are attached to every
new configuration; the scale backends' (full, judge_http, search_http) only when a run uses them
(config.needed_sections, or a `--set` of one of their keys). Those three are plain dataclasses in
modules that load no backend (backends/scale/settings.py, backends/api/settings.py), so a toy run
never loads DeepSpeed's, vLLM's, the HTTP judge's or web search's code. The registry sits here, in
the module that builds the presets, so that backends/run/config.py (the tree and its checks) imports
no toy module and no backend's section, and toy/ imports nothing of backends/.

    from backends.run.presets import toy_preset, full_preset
    cfg = toy_preset(); cfg.ss_grpo.lr       # 2e-4
"""
from __future__ import annotations

import os

from backends.api.settings import HTTPJudgeConfig, SearchHTTPConfig
from backends.run.config import Config, attach_sections, config_from_dict, register_section
from backends.run.data import PAPER_RL_DATA
from backends.run.heldout import EvalConfig
from backends.scale.settings import FullConfig
from toy.model import ToyModelConfig
from toy.sft import SFTConfig, TeacherConfig
from toy.world import WorldConfig

register_section("eval", EvalConfig)
register_section("toy_model", ToyModelConfig)
register_section("world", WorldConfig)
register_section("teacher", TeacherConfig)
register_section("sft", SFTConfig)
# SCALE: the scale backends' sections, attached only when a run uses them
register_section("full", FullConfig, default=False)
register_section("judge_http", HTTPJudgeConfig, default=False)
register_section("search_http", SearchHTTPConfig, default=False)


def cores_per_rank(environ=None, cores: int | None = None, hint: int = 8) -> int:
    """CPU cores for one rank of a full-mode launch: the cores this process may run on
    (os.sched_getaffinity, else os.cpu_count) over the ranks on its node (LOCAL_SIZE from the
    deepspeed launcher, LOCAL_WORLD_SIZE from torchrun; `hint` ranks when not launched, the dry run's
    FullConfig.world_size_hint), at least 1. DeepSpeedCPUAdam runs one OpenMP thread per
    torch.set_num_threads thread (train.py sets config.threads), so this is its share of the node."""
    env = os.environ if environ is None else environ
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or ""
    ranks = int(local) if local.isdigit() and int(local) > 0 else hint
    return max(1, cores // ranks)


def toy_preset() -> Config:
    """Toy mode: 5-8 minutes on a 2-core CPU with the SFT warm start (the machine's speed varies
    between sittings), 2-3 once it is cached (docs/results.md; values are ours)."""
    return Config()


def full_preset() -> Config:
    """Full mode: the paper's RL configuration (appendix), every section attached."""
    c = Config(mode="full", steps=1400, run_dir="runs/full")  # PAPER: final run 1400 steps
    attach_sections(c, "full", "judge_http", "search_http")
    c.engine, c.sampler = "zero3", "vllm"  # PAPER: ZeRO-3 training, vLLM sampling
    # PAPER: step t's reflection branch overlaps step t+1's rollouts, its batch joins step t+1's
    # update (one-step lag, Algorithm 1, §3.6): the overlapped step of backends/distributed/overlap.py ("lockstep"
    # is the sequential schedule, kept for exact comparison)
    c.full.rollout_schedule = "async"
    c.fast_logprobs = True  # SCALE: head on the loss tokens only, in chunks; shared prompts packed
    c.data.source = PAPER_RL_DATA  # PAPER: rl-research/dr-tulu-rl-data
    c.search.backend = "serper"  # PAPER: web search tool (google_search)
    c.judge.backend = "gemini"  # PAPER: Gemini Flash judge and rubric generator
    c.bank.retriever = "dense"  # PAPER: Qwen3-Embedding-0.6B bank retrieval
    c.rollout.prompts_per_step, c.rollout.n = 32, 8  # PAPER: 32 prompts x 8 rollouts
    c.rollout.max_response_tokens = 18432  # PAPER: max response 18,432 tokens
    c.rollout.system_prompt = "full"
    c.ss_grpo.lr = 5e-7  # PAPER: lr 5e-7 constant
    c.ss_grpo.minibatches = 1
    c.ss_grpo.micro_batch = 1  # the dry run names the largest that fits (plan.largest_micro_batch)
    # SCALE: DeepSpeedCPUAdam's OpenMP threads: the node's cores shared by its ranks (the toy's 2
    # would leave an offloaded 8B optimizer step on 2 threads per rank)
    c.threads = cores_per_rank(hint=c.full.world_size_hint)
    c.eval = EvalConfig(n_questions=0)
    # not in the paper (it gives no length): a reflection is a retrospective rubric plus takeaways
    # (Fig. 2) that returns as a memory note inside the 8,192-token prompt (top-k 2). 512 tokens
    # leave two notes (<= 3,000 characters each, ~1,500 tokens) well inside it; 64 (toy) cut them.
    c.reflection.max_new_tokens = 512
    # The reflection prompt holds the whole trajectory (up to prompt + response tokens): keep it
    # within the sampler's context with room for the candidate (reflection.py, max_prompt_tokens).
    c.reflection.max_prompt_tokens = (c.full.max_prompt_tokens + c.rollout.max_response_tokens
                                      - c.reflection.max_new_tokens)
    c.reflection.system_prompt = "reflect"  # plain prose: the bank refuses stage tags
    c.reflection.loss_coef = 1.0  # the paper gives the two objectives no relative weight (toy: 0.1)
    c.bank.max_chars = 3000
    # SCALE: a checkpoint is ~115 GB at 8B: its sha256s are computed in the background, and a resume
    # checks sizes (checkpoint.verify=true rehashes it all on rank 0 first, minutes)
    c.checkpoint.hash, c.checkpoint.verify = "background", False
    return c


def reference_config() -> Config:
    """The toy preset with every section attached: what `--list-config` prints."""
    return attach_sections(toy_preset(), "full", "judge_http", "search_http")


def load_config(d: dict) -> Config:
    """A saved configuration (config.json, a checkpoint's or a run card's `config`, an asdict dict;
    old key spellings included) as a Config, every section it holds rebuilt through the registry
    above. Raises ValueError naming an unknown field."""
    return config_from_dict(d)
