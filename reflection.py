"""The reflection meta-policy (§3.4, second half): reflections written by the policy, judged with
privileged information, stored in the rubric bank, and trained as a GRPO group.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements §3.4: after judging, sample one (query, trajectory) pair (PAPER: reflection trajectories
sampled = 1); prompt the *same* backbone with the query and that trajectory as fixed context; sample
m candidates (PAPER: m = 8, temperature 0.7); the privileged judge scores each on within-episode and
cross-episode usefulness; the best *valid* candidate is upserted into the bank (key: sha256 of the
query); the m candidates and their scores form a GRPO group in which only reflection tokens carry
gradient (the trajectory context is masked).

Equation (K = 1 GRPO over the m candidates, `ss_grpo.group_advantages` with Lambda = [[1]]):
    A_j = (s_j - mean_j' s_j') / (Std_j' s_j' + eps),   every token of candidate j gets A_j.

Asynchrony (PAPER: one-step lag): the branch runs on the trajectories of step t after step t's update
and returns a `ReflectionBatch` that the trainer adds to step t+1's update. In a distributed run the
branch would overlap step t+1's rollouts; here it runs in sequence, which keeps toy runs exactly
reproducible for a fixed seed and gives the same data dependencies.

Deviations from the paper
1. The policy does not see scores or rubrics (as in the paper); candidates that fail bank admission
   (bank.validate_reflection) keep their judge score in the GRPO group but are never stored.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from scaffold import Rollout


@dataclass
class ReflectionConfig:
    """Reflection branch settings (PAPER values: m = 8, temperature 0.7, 1 trajectory per step)."""

    enabled: bool = True  # run the reflection branch (false: no reflections, the bank stays empty)
    m: int = 8  # PAPER: 8 candidates
    temperature: float = 0.7  # PAPER: 0.7
    trajectories_per_step: int = 1  # PAPER: reflection trajectories sampled = 1
    max_new_tokens: int = 64  # ours: toy reflections are one or two sentences
    train: bool = True  # add the GRPO group to the next update (False: bank only)


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


def reflection_prompt_ids(tok, query: str, rollout: Rollout, system: str) -> list[int]:
    """Token ids of the reflection prompt: query + the trajectory (forged tool outputs neutralised)."""
    from sft import reflection_messages

    traj = rollout.judge_text.replace("<|im_end|>", "")
    ids = tok.apply_chat_template(reflection_messages(query, traj, system),
                                  add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def reflection_text(tok, ids: Sequence[int]) -> str:
    """Decoded candidate without end-of-turn markup."""
    text = tok.decode(list(ids), skip_special_tokens=False)
    for s in ("<|im_end|>", "<|endoftext|>"):
        text = text.replace(s, "")
    return text.strip()


def run_reflection_branch(step: int, rollouts: Sequence[Rollout], judged: dict, judge, bank, sampler,
                          tok, system: str, cfg: ReflectionConfig, rng: random.Random,
                          std: str = "sample", eps: float = 1e-6) -> tuple[ReflectionBatch, dict]:
    """One reflection step (§3.4). `judged` maps a rollout's index to (JudgeResult, row in it).

    Returns (batch for the next update, metrics). Never raises on model output; a judge failure
    gives NaN scores, whose candidates get advantage 0.
    """
    from ss_grpo import group_advantages
    import torch

    batch = ReflectionBatch(step)
    metrics = {"reflect/candidates": 0, "reflect/admitted": 0, "reflect/score_mean": float("nan"),
               "reflect/score_best": float("nan"), "reflect/within": float("nan"),
               "reflect/cross": float("nan")}
    if not cfg.enabled or not rollouts:
        return batch, metrics
    picks = rng.sample(range(len(rollouts)), min(cfg.trajectories_per_step, len(rollouts)))
    all_scores, within, cross = [], [], []
    for idx in picks:
        ro = rollouts[idx]
        res, row = judged[idx]
        prompt = reflection_prompt_ids(tok, ro.query.query, ro, system)
        cands = sampler.generate([prompt] * cfg.m, [cfg.max_new_tokens] * cfg.m, cfg.temperature)
        texts = [reflection_text(tok, c) for c in cands]
        scored = judge.score_reflections(ro.query, ro, res, row, texts)
        s = np.array([r.score for r in scored], dtype=np.float64)
        all_scores += s.tolist()
        within += [r.within for r in scored]
        cross += [r.cross for r in scored]
        # Best valid candidate -> bank (upsert by sha256 of the query).
        order = sorted(range(len(texts)), key=lambda j: (-(s[j] if np.isfinite(s[j]) else -1), j))
        for j in order:
            if not np.isfinite(s[j]):
                break
            meta = {"within": scored[j].within, "cross": scored[j].cross}
            if bank.upsert(ro.query.query, texts[j], step, float(s[j]), meta=meta,
                           trajectory_text=ro.judge_text):
                metrics["reflect/admitted"] += 1
                break
        if cfg.train:
            # Eq.: A_j = (s_j - mean s) / (Std s + eps)  (GRPO over the m candidates, K = 1)
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
    metrics["reflect/candidates"] = len(all_scores)
    if all_scores:
        arr = np.array(all_scores)
        if np.isfinite(arr).any():
            metrics["reflect/score_mean"] = float(np.nanmean(arr))
            metrics["reflect/score_best"] = float(np.nanmax(arr))
        metrics["reflect/within"] = float(np.mean(within))
        metrics["reflect/cross"] = float(np.mean(cross))
    return batch, metrics
