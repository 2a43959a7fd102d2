"""The reflection meta-policy (§3.4, second half): reflections written by the policy, judged with
privileged information, stored in the rubric bank, and trained as a GRPO group.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements §3.4 and the reflection jobs of Algorithm 1: after judging, for *every* query of the step
sample one (query, trajectory) pair uniformly from that query's group (PAPER: reflection trajectories
sampled = 1); prompt the *same* backbone with the query and that trajectory as fixed context; sample
m candidates (PAPER: m = 8, temperature 0.7), all P x m of the step in one batched sampler call; the
privileged judge scores each on within-episode and cross-episode usefulness; the best *valid*
candidate of each query is upserted into the bank (key: sha256 of the query), so a replayed batch
finds "the reflection written for that very query on the first pass" (§3.5); each query's m
candidates and their scores form one GRPO group (P groups of m, each normalised on its own) in which
only reflection tokens carry gradient (the trajectory context is masked).

Equation (K = 1 GRPO over each query's m candidates, `ss_grpo.group_advantages`, Lambda = [[1]]):
    A_{p,j} = (s_{p,j} - mean_j' s_{p,j'}) / (Std_j' s_{p,j'} + eps),  every token of candidate j of
    query p gets A_{p,j}.

Asynchrony (PAPER: one-step lag): the branch runs on the trajectories of step t after step t's update
and returns a `ReflectionBatch` that joins step t+1's update: the same optimizer steps as step
t+1's task batch, L = L_task + c * L_reflect (train.update_policy), as in Algorithm 1. Full mode's
"async" schedule overlaps the branch with step t+1's rollouts; the toy runs it in sequence, which
keeps toy runs exactly reproducible for a fixed seed and gives the same data dependencies.

Deviations from the paper
1. The policy does not see scores or rubrics (as in the paper); candidates that fail bank admission
   (bank.validate_reflection) keep their judge score in the GRPO group but are never stored.
2. The GRPO update scores the candidates under the distribution they were sampled from,
   softmax(logits / 0.7) (train.reflection_update_batch, ss_grpo deviation 8); the paper gives the
   sampling temperature, not the scoring one. `ReflectionConfig.score_at_temperature = False`
   scores them at temperature 1 instead.
3. A trajectory too long for the reflection prompt (`ReflectionConfig.max_prompt_tokens`, full:
   the 26,624-token context minus the 512-token reflection) keeps its head and tail and loses its
   middle, with a line saying how many tokens were left out (`reflection_prompt_ids`); the paper
   does not say how a long trajectory enters the prompt. 0 (the toy) never cuts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from scaffold import Rollout
from ss_grpo import group_advantages


@dataclass
class ReflectionBatch:
    """A pending GRPO group: sequences (prompt + candidate ids), per-token loss masks (1 on candidate
    tokens) and per-sequence advantages A_j; applied at the next update (one-step lag)."""

    step: int
    sequences: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"step": self.step, "sequences": self.sequences, "masks": self.masks,
                "advantages": self.advantages, "scores": self.scores}

    @classmethod
    def from_dict(cls, d: dict) -> "ReflectionBatch":
        return cls(**d)


# The instruction of the reflection meta-policy (ours: the paper does not give its wording).
REFLECT_INSTRUCTION = "Reflect on this attempt. Name what was missed and give lessons."


# The full preset's reflection system prompt (ours: the paper gives no wording). The task system prompt
# demands the four stage tags, which the bank refuses in a reflection (bank.validate_reflection).
REFLECT_SYSTEM = ("You are a research assistant reviewing one of your own attempts at a question. Write "
                  "a short reflection in plain prose: which stage fell short (planning, research, "
                  "review or the answer) and why, then concrete lessons for answering this question "
                  "again and similar questions. Do not use XML tags and do not redo the task.")


def reflection_system(cfg, task_system: str) -> str:
    """The system prompt of the reflection meta-policy: cfg.system_prompt "task" -> task_system,
    "reflect" -> REFLECT_SYSTEM. Raises ValueError for another value."""
    if cfg.system_prompt == "task":
        return task_system
    if cfg.system_prompt == "reflect":
        return REFLECT_SYSTEM
    raise ValueError(f"reflection.system_prompt must be 'task' or 'reflect', got {cfg.system_prompt!r}")


def reflection_messages(query: str, trajectory_text: str, system: str) -> list:
    """Prompt of the reflection meta-policy (§3.4): the query and the trajectory as fixed context."""
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"{REFLECT_INSTRUCTION}\nQuestion: {query}\n"
                                        f"Attempt:\n{trajectory_text}"}]


def reflection_prompt_ids(tok, query: str, rollout: Rollout, system: str,
                          max_tokens: int = 0) -> list[int]:
    """Token ids of the reflection prompt: query + the trajectory (forged tool outputs neutralised).

    max_tokens > 0 caps the prompt's length (ReflectionConfig.max_prompt_tokens): a longer prompt
    keeps the trajectory's first and last tokens in equal parts, with one line in between saying how
    many were left out (the plan and the review + answer survive; research turns go first). Raises
    ValueError when even the trajectory-free prompt does not fit."""
    traj = rollout.judge_text.replace("<|im_end|>", "")
    ids = _chat_ids(tok, reflection_messages(query, traj, system))
    if not max_tokens or len(ids) <= max_tokens:
        return ids
    t = tok.encode(traj, add_special_tokens=False)
    room = max_tokens - (len(ids) - len(t))  # trajectory tokens that fit, before the omission line
    while room >= 2:  # decode -> encode is not exact: shrink until the whole prompt fits
        head, tail = t[:room // 2], t[len(t) - (room - room // 2):]
        cut = (tok.decode(head) + f"\n[... {len(t) - len(head) - len(tail)} tokens of the attempt "
               "left out ...]\n" + tok.decode(tail))
        ids = _chat_ids(tok, reflection_messages(query, cut, system))
        if len(ids) <= max_tokens:
            return ids
        room -= len(ids) - max_tokens
    raise ValueError(f"the reflection prompt does not fit reflection.max_prompt_tokens = {max_tokens} "
                     "even without its trajectory")


def _chat_ids(tok, messages: list) -> list[int]:
    """The chat template's token ids, with the generation prompt."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def reflection_text(tok, ids: Sequence[int]) -> str:
    """Decoded candidate without end-of-turn markup."""
    text = tok.decode(list(ids), skip_special_tokens=False)
    for s in ("<|im_end|>", "<|endoftext|>"):
        text = text.replace(s, "")
    return text.strip()


def pick_trajectories(n_rollouts: int, group_size: int, per_query: int, rng: random.Random) -> list[int]:
    """Indices of the rollouts to reflect on: `per_query` drawn uniformly without replacement from each
    query's group (Algorithm 1: one reflection job per query of the step; PAPER per_query = 1).

    n_rollouts: int, a multiple of group_size (rollouts are query-major, group_size per query).
    Returns a list of ints in [0, n_rollouts), query-major. Uses `rng` only (deterministic per seed).
    Raises ValueError if group_size < 1 or n_rollouts is not a multiple of it.
    """
    if group_size < 1 or n_rollouts % group_size:
        raise ValueError(f"{n_rollouts} rollouts do not split into groups of {group_size}")
    out = []
    for g in range(n_rollouts // group_size):
        for j in sorted(rng.sample(range(group_size), min(per_query, group_size))):
            out.append(g * group_size + j)
    return out


def run_reflection_branch(step: int, rollouts: Sequence[Rollout], judged: dict, judge, bank, sampler,
                          tok, system: str, cfg, rng: random.Random,
                          std: str = "sample", eps: float = 1e-6,
                          group_size: int | None = None, map_fn=map) -> tuple[ReflectionBatch, dict]:
    """One reflection step (§3.4, Algorithm 1) over all queries of a training step.

    rollouts: the step's rollouts, query-major, `group_size` per query (None: one group of all).
    judged: maps a rollout's index to (JudgeResult, row in it). For every query, `cfg.trajectories_
    per_query` trajectories are drawn uniformly from its group (`pick_trajectories`); the m candidates
    of *every* picked trajectory are sampled in one batched sampler call (P x m prompts at
    temperature cfg.temperature); the privileged judge scores each trajectory's m candidates; the best
    valid candidate of each is upserted into the bank (key: sha256 of its query); each trajectory's m
    candidates form their own GRPO group (normalised on their own).

    map_fn: how the privileged judge calls of the trajectories run (map: one after another; full
    mode passes a thread pool's map, backends/scale/rollout_engine.py); results are used in pick order.
    Returns (batch for the next update, metrics). Never raises on model output; a judge failure
    gives NaN scores, whose candidates get advantage 0.
    """
    batch = ReflectionBatch(step)
    metrics = {"reflect/trajectories": 0, "reflect/candidates": 0, "reflect/admitted": 0,
               "reflect/invalid": 0,
               "reflect/score_mean": float("nan"), "reflect/score_best": float("nan"),
               "reflect/within": float("nan"), "reflect/cross": float("nan")}
    if not rollouts:
        return batch, metrics
    picks = pick_trajectories(len(rollouts), group_size or len(rollouts), cfg.trajectories_per_query,
                              rng)
    system = reflection_system(cfg, system)
    prompts = [reflection_prompt_ids(tok, rollouts[i].query.query, rollouts[i], system,
                                     cfg.max_prompt_tokens) for i in picks]
    # One batched call for the whole step: (P x m) prompts, candidate c of pick p at p * m + c.
    flat = sampler.generate([p for p in prompts for _ in range(cfg.m)],
                            [cfg.max_new_tokens] * (len(picks) * cfg.m), cfg.temperature)
    all_scores, within, cross = [], [], []
    cands_all = [[list(c) for c in flat[p * cfg.m:(p + 1) * cfg.m]] for p in range(len(picks))]  # (m,) ids each
    texts_all = [[reflection_text(tok, c) for c in cands] for cands in cands_all]
    scored_all = list(map_fn(lambda p: judge.score_reflections(
        rollouts[picks[p]].query, rollouts[picks[p]], *judged[picks[p]], texts_all[p]), range(len(picks))))
    for p, (idx, prompt) in enumerate(zip(picks, prompts)):
        ro, cands, texts, scored = rollouts[idx], cands_all[p], texts_all[p], scored_all[p]
        s = np.array([r.score for r in scored], dtype=np.float64)
        all_scores += s.tolist()
        within += [r.within for r in scored]
        cross += [r.cross for r in scored]
        metrics["reflect/invalid"] += sum(not getattr(x, "valid", True) for x in scored)
        metrics["reflect/admitted"] += admit_best(bank, ro, texts, s, scored, step)
        if cfg.train:
            grpo_group(batch, prompt, cands, s, std, eps)
    metrics["reflect/trajectories"] = len(picks)
    metrics["reflect/candidates"] = len(all_scores)
    if all_scores:
        arr = np.array(all_scores)
        if np.isfinite(arr).any():
            metrics["reflect/score_mean"] = float(np.nanmean(arr))
            metrics["reflect/score_best"] = float(np.nanmax(arr))
        metrics["reflect/within"] = float(np.mean(within))
        metrics["reflect/cross"] = float(np.mean(cross))
    return batch, metrics


def admit_best(bank, ro: Rollout, texts: list[str], s: np.ndarray, scored: list, step: int) -> int:
    """Upsert the best valid candidate of one trajectory into the bank (key: sha256 of its query);
    1 if one was admitted, else 0. "Valid" is two gates: the privileged judge's verdict
    (ReflectionScore.valid: degenerate, cut-off or off-topic text is never a lesson, whatever its
    score) and the bank's admission rules (bank.validate_reflection). s: (m,) float64 scores, NaN =
    the judge failed (such candidates are never admitted)."""
    order = sorted(range(len(texts)), key=lambda j: (-(s[j] if np.isfinite(s[j]) else -1), j))
    for j in order:
        if not np.isfinite(s[j]):
            break
        if not getattr(scored[j], "valid", True):  # keeps its (zero) score in the GRPO group
            continue
        meta = {"within": scored[j].within, "cross": scored[j].cross}
        if bank.upsert(ro.query.query, texts[j], step, float(s[j]), meta=meta,
                       trajectory_text=ro.judge_text):
            return 1
    return 0


def grpo_group(batch: ReflectionBatch, prompt: list[int], cands: list[list[int]], s: np.ndarray,
               std: str, eps: float) -> None:
    """Append one trajectory's m candidates to `batch` as their own GRPO group (§3.4): each
    candidate's tokens get its advantage A_j; NaN scores (judge failures) get A_j = 0; empty
    candidates are left out."""
    # Eq.: A_j = (s_j - mean s) / (Std s + eps)  (GRPO over this trajectory's m candidates)
    missing = torch.from_numpy(~np.isfinite(s))[:, None]
    A = group_advantages(torch.from_numpy(np.nan_to_num(s))[:, None], std=std, eps=eps,
                         missing=missing)[:, 0]
    for j, (c, a) in enumerate(zip(cands, A.tolist())):
        if not c:
            continue
        batch.sequences.append(prompt + list(c))
        batch.masks.append([0] * len(prompt) + [1] * len(c))
        batch.advantages.append(float(a))
        batch.scores.append(float(s[j]))
