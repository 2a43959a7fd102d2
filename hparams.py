"""The paper layer's settings in one place: every knob of the method of RubricEM (arXiv 2605.10899),
each with its default, its paper reference (section, equation or appendix value), or "not in the
paper; we ..." and the reason.

`PaperConfig` is the run configuration's paper part; backends/run/config.Config extends it with the run's
plumbing, and the sections of the backends and of the toy world live with their own modules
(`python train.py --list-config` prints the whole tree). The defaults are the toy preset's; where the
full preset (the paper's appendix) differs, the field says "full:". The paper modules take these
sections as plain attributes (cfg.eta, cfg.m, ...) and do not import this file: it sits above them.

    from hparams import PaperConfig
    PaperConfig().ss_grpo.lam        # the printed Lambda (§3.3)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bank import DEFAULT_MAX_CHARS, DEFAULT_TOP_K, PAPER_EMBED_MODEL
from judge import BUFFER_CAPS
from ss_grpo import DEFAULT_AGG, DEFAULT_EPS, DEFAULT_ETA, DEFAULT_STD, PAPER_BETA, PAPER_LAMBDA


@dataclass
class RolloutConfig:
    """Rollouts (§3.1-3.2, appendix "RL"): questions and rollouts per step, sampling, budgets."""

    prompts_per_step: int = 8
    """PAPER (appendix): 32 prompts per step, the full preset's; toy: 8 (ours, a CPU step)"""
    n: int = 8
    """PAPER (appendix; §3.3 n): 8 rollouts per prompt, one GRPO group"""
    temperature: float = 1.0
    """PAPER (appendix): sampling temperature 1.0"""
    max_response_tokens: int = 1024
    """PAPER (appendix): max response 18,432 tokens, the full preset's; toy: 1024 (ours): a complete
    trajectory for a four-aspect question (a plan, four searches of three snippets each, the review
    and four cited sentences) runs past 512 tokens; at 512 the arms that learned to research every
    asked fact were cut before their answer (seed 0: held-out well_formed 0.80 at step 24, against
    0.98 for Baseline RL, which researched fewer), and at 768 12 % of one step's rollouts were still
    cut (seed 2, step 18: well_formed 0.797)"""
    max_tool_calls: int = 10
    """PAPER (§3.2, appendix): at most 10 tool calls per trajectory"""
    system_prompt: str = "compact"
    """not in the paper (it prints no prompt); we use "compact" (toy: the format is learnt from the
    SFT demonstrations) | "full" (spells out the four stages' tags; the full preset)"""
    scaffold: str = "structured"
    """PAPER (§3.2; Fig. 6a-c): "structured" (the four stages) | "unstructured" (the scaffold
    ablation: think / tool call / answer only; its own SFT warm start; arm "baseline_rl" only)"""
    tool_timeout_s: float = 30.0
    """not in the paper; we abandon a tool call still running after this many seconds and answer
    "error: search timed out" (0 = no limit), far above a healthy call, so runs stay reproducible"""
    deadline_s: float = 1800.0
    """not in the paper; we refuse tool calls after this many seconds of one step's rollouts, which
    then finish within their token budget (0 = no deadline), so a stuck tool cannot stall a step"""


@dataclass
class SearchConfig:
    """The search tool of §3.1 (the tool environment T). Its transport (endpoint, key, retries, cache)
    is backends/api/settings.SearchHTTPConfig, the run's `search_http` section."""

    backend: str = "toy"
    """PAPER (appendix): web search (google_search), "serper" in the full preset; toy: "toy" (BM25
    over the toy world)"""
    k: int = 5
    """not in the paper (it does not fix it); we return 5 results per query, which keeps tool
    outputs short"""


@dataclass
class SSGRPOConfig:
    """SS-GRPO (§3.3): Lambda, stagewise normalisation, PPO clip, KL, aggregation, optimizer."""

    lam: list = field(default_factory=lambda: [list(r) for r in PAPER_LAMBDA])
    """PAPER (§3.3): Lambda, G = R Lambda^T; the printed matrix, rows Plan, Research, Review, Answer"""
    std: str = DEFAULT_STD
    """§3.3: Std in A = (G - mean) / (Std + eps), which the paper does not define; we use "sample"
    (n - 1) | "population" (ss_grpo deviation 2)"""
    eps: float = DEFAULT_EPS
    """§3.3: eps in A = (G - mean) / (Std + eps); the paper gives no value, we use verl's 1e-6"""
    eta: float = DEFAULT_ETA
    """§3.3: PPO clip range; the appendix says "PPO clipping" without a value, we use the usual 0.2"""
    beta: float = PAPER_BETA
    """PAPER (appendix): KL beta 0.001 with the k3 estimator"""
    agg: str = DEFAULT_AGG
    """§3.3: loss aggregation. "paper" is the printed -(1/n) sum over tokens; we default to
    "token_mean" (ss_grpo "Aggregation") | "seq_mean_token_mean" (per sequence, then the batch)"""
    lr: float = 2e-4
    """PAPER (appendix): lr 5e-7 constant, the full preset's; toy: 2e-4 (ours, a 0.5 M policy)"""
    minibatches: int = 1
    """not in the paper, which does not say how many updates a batch gets; optimizer steps per batch
    (train.py deviation 2). Both presets take 1 (one update per batch, so rho = 1 at the update and
    the clip does not act); 2 or more splits the batch PPO-style, which adds a no-grad old pass
    (the toy's default until docs/performance.md section 12: its step took about 1.2x as long)"""
    micro_batch: int = 4
    """not in the paper; sequences per forward pass (gradient accumulation within a minibatch): memory
    and speed only, the same gradient (to float rounding); full: 1; toy: 4. A pass pads to its
    longest sequence, and the passes of an optimizer step take its sequences longest first
    (policy.plan_update), so smaller passes pad less: on recorded toy batches the task update took
    about 0.9x the CPU time of micro-batch 8 and 0.65x that of 16 (benchmarks/toy_step.py times the
    whole step; at 32 and the 1,024-token budget a run peaked at 3.03 GiB RSS)"""
    grad_clip: float = 1.0
    """not in the paper; we clip the global gradient norm per optimizer step at 1.0 (verl's default)"""
    skipped_stage_credit: bool = False
    """not in the paper (off by default); a rollout that skips a stage gives that stage's advantage
    to the token that skipped it (ss_grpo deviation 7; docs/results.md)"""


@dataclass
class JudgeConfig:
    """The evolving-rubric judge of §3.4. How the HTTP judge is called (endpoint, key, retries, cache,
    prices, rate limits) is backends/api/settings.HTTPJudgeConfig, the run's `judge_http` section."""

    backend: str = "toy"
    """PAPER (appendix): judge and rubric generator Gemini Flash, "gemini" in the full preset |
    "openai" (chat completions: OpenAI, vLLM, SGLang); toy: "toy" (the toy world's ground truth)"""
    model: str = "gemini-2.5-flash"
    """PAPER (appendix): "Gemini Flash"; the exact version is ours"""
    caps: list = field(default_factory=lambda: list(BUFFER_CAPS))
    """PAPER (§3.4): rubric-buffer caps per stage, Plan 3, Research 2, Review 2, Answer 3"""
    max_retries: int = 3
    """not in the paper (it does not say what a failed judge call yields); we re-ask a failed call
    (HTTP: also retry 429/5xx/connect errors) up to this many times, then its cells of R are missing
    (advantage 0), never a made-up score"""
    max_failure_rate: float = 0.5
    """not in the paper; we stop the run (JudgeFailureAbort) when a step's share of failed judge
    calls exceeds this..."""
    max_failure_steps: int = 3
    """not in the paper; ...this many steps in a row (max_failure_rate): training on mostly missing
    rewards wastes compute"""
    toy_fixes: list = field(default_factory=lambda: ["answer_block", "false_missed", "repetition"])
    """not in the paper; toy judge only: fixes of the toy judge against known attacks, all on by
    default ([] scores as the toy judge did before them): "answer_block" (a call inside <answer> or a
    second <answer> is malformed), "false_missed", "repetition" (reflection scoring); toy.judge.ToyJudge"""
    record_static: bool = False
    """not in the paper; toy judge only: append each judged group's R and static stage scores to
    run_dir/judge_static.jsonl (the reward ladder's correlations, scripts/reward_ladder.py)"""


@dataclass
class BankConfig:
    """The rubric bank (§3.4, §3.5, appendix); bank.RubricBank.from_config builds it."""

    top_k: int = DEFAULT_TOP_K
    """PAPER (appendix): retrieval top-k 2, items retrieved per query in "cross-episode similar" mode"""
    max_chars: int = DEFAULT_MAX_CHARS
    """not in the paper; we refuse reflections longer than this many code points, since every
    retrieved one lands in every rollout's prompt (bank.DEFAULT_MAX_CHARS); full: 3000"""
    keep_best: bool = False
    """not in the paper; False: the newest valid reflection replaces the stored one (the paper's
    upsert, §3.4); True: keep the higher judge score"""
    save_every: int = 10
    """PAPER (appendix): bank saved every 10 steps"""
    retriever: str = "bm25"
    """PAPER (appendix): dense embeddings, "dense" in the full preset (backends/scale/retrieval.py); toy:
    "bm25" (ours: no embedding model on a CPU)"""
    embed_model: str = PAPER_EMBED_MODEL
    """PAPER (appendix): Qwen3-Embedding-0.6B (a hub id or a local directory)"""


@dataclass
class ReflectionConfig:
    """The reflection meta-policy (§3.4). Whether it runs at all is the arm's choice (ss_grpo.ARMS)."""

    m: int = 8
    """PAPER (§3.4): m = 8 reflection candidates"""
    temperature: float = 0.7
    """PAPER (§3.4): sampled at temperature 0.7"""
    trajectories_per_query: int = 1
    """PAPER (§3.4, appendix): reflection trajectories sampled = 1 (per query: Algorithm 1 launches a
    reflection job for every query of the step)"""
    max_new_tokens: int = 64
    """not in the paper (it gives no length); we cap a toy reflection at one or two sentences; full:
    512, room for a retrospective rubric plus takeaways (Fig. 2) inside the 8,192-token prompt"""
    max_prompt_tokens: int = 0
    """not in the paper (it does not say how a long trajectory enters the reflection prompt); a longer
    prompt keeps the trajectory's head (plan) and tail (review, answer) and drops the middle (research
    turns), so prompt plus max_new_tokens fits the sampler's context; 0 = no limit (the toy's
    trajectories are short); full: 26,624 - 512"""
    system_prompt: str = "task"
    """not in the paper (it prints no prompt); "task": the rollout's system prompt (the toy SFT
    teaches reflections under it) | "reflect": reflection.REFLECT_SYSTEM, plain prose without stage
    tags, which the bank refuses (the full preset)"""
    train: bool = True
    """PAPER (§3.4): the candidates form a GRPO group in the next update; False: bank only (ours)"""
    loss_coef: float = 0.1
    """§3.4: c in L = L_task + c * L_reflect: the deferred reflection GRPO groups join the next
    step's task update in the same optimizer steps (train.update_policy), each candidate's
    reflection tokens carrying c * A_j; each part is normalised over its own tokens, so c is the
    meta-policy objective's weight against the task's. The paper gives the two objectives no
    relative weight, i.e. c = 1 (full: 1). Toy: 0.1 (ours): a 0.5 M policy writes both, and the
    toy's reflections are ~30 tokens against ~200 policy tokens per rollout; docs/ablations.md
    compares c = 0.1 with c = 0 and with reflection training off"""
    score_at_temperature: bool = True
    """not in the paper (it gives the sampling temperature, not the scoring one); we score the
    candidates under the distribution they were sampled from, softmax(logits / temperature)
    (reflection deviation 2); False scores them at temperature 1"""


@dataclass
class CurriculumConfig:
    """The windowed curriculum of §3.5."""

    K: int = 3
    """PAPER (§3.5, appendix): window K = 3 (2K = 6 steps: 3 fresh, 3 replayed)"""
    enabled: bool = True
    """PAPER (§3.5) when true; false (ours, an ablation): every step a fresh batch with similar
    retrieval (no replay)"""


@dataclass
class PaperConfig:
    """The method's settings: the ablation arm, the run length and the sections of §3.1-3.5."""

    arm: str = "rubricem"
    """PAPER (§4 "Ablation: RL training recipes", Fig. 5): "rubricem" | "ss_grpo" | "meta_policy" |
    "baseline_rl" | "baseline_rl_info" (ours: the mean of the four stage scores); selects the
    advantage, the reflection branch and bank retrieval together (ss_grpo.ARMS)"""
    seed: int = 0
    """not in the paper; we seed data order, sampling, warm start and evaluation with it (--seed)"""
    steps: int = 24
    """PAPER (appendix): final run 1400 steps, the full preset's; toy: four curriculum windows of
    2K = 6 steps (ours)"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    ss_grpo: SSGRPOConfig = field(default_factory=SSGRPOConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    reflection: ReflectionConfig = field(default_factory=ReflectionConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
