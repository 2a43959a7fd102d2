"""The ZeRO-3 self-test: a synthetic SS-GRPO update batch and `selftest`, which runs policy updates on
it under the launcher's ranks (CI on 2 CPU ranks: tests/test_full_zero3.py; GPU smoke on 1 GPU:
scripts/gpu_smoke.sh). Not part of the paper's method: a check that ZeRO-3 computes the toy path's
update.

Launch
    torchrun --nproc_per_node 2 -m backends.distributed selftest --model DIR --out DIR
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import torch

import ss_grpo
from backends.distributed.dist import barrier, device_kind, init_distributed
from backends.distributed.engine import ZeRO3Engine
from backends.distributed.zero3 import FrozenReference, ZeRO3Policy
from backends.run.presets import full_preset
from backends.scale.settings import FullConfig, batch_plan, deepspeed_config
from policy import UpdateBatch, plan_update, policy_update


def synthetic_batch(vocab_size: int, n_seq: int, group: int = 8, seed: int = 0, min_len: int = 24,
                    max_len: int = 48, prompt_len: int = 8):
    """A deterministic policy.UpdateBatch shaped like a real one: a prompt (mask 0), a response split
    into the four stage blocks, a masked tool-output span inside the research block, and SS-GRPO
    token advantages from random stage scores R (n_seq, 4) with groups of `group` rollouts.

    Raises ValueError when n_seq is not a multiple of group or the lengths leave no response."""
    if n_seq % group or group < 2:
        raise ValueError(f"n_seq={n_seq} must be a multiple of group={group} >= 2")
    if not prompt_len + 8 <= min_len <= max_len:
        raise ValueError("need prompt_len + 8 <= min_len <= max_len")
    g = torch.Generator().manual_seed(seed)
    R = torch.rand(n_seq, 4, generator=g, dtype=torch.float64)  # (n, K) judge scores
    # Eq.: G = R Lambda^T, then A[i,k] = (G[i,k] - mean G[:,k]) / (Std G[:,k] + eps) per group
    G, missing = ss_grpo.stage_returns(R, ss_grpo.PAPER_LAMBDA, group_size=group)
    A = ss_grpo.group_advantages_batched(G, group_size=group, missing=missing).float()
    out = UpdateBatch()
    for i in range(n_seq):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab_size, (L,), generator=g)
        T = L - prompt_len  # response tokens
        cuts = sorted(torch.randperm(T - 1, generator=g)[:3].add(1).tolist())  # 4 non-empty blocks
        stage = torch.full((L,), -1, dtype=torch.long)
        for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, T])):
            stage[prompt_len + a : prompt_len + b] = k
        mask = (stage >= 0).long()
        r0, r1 = prompt_len + cuts[0], prompt_len + cuts[1]  # the research block
        if r1 - r0 >= 3:  # a tool output: environment text, no gradient (§3.3)
            mask[r0 + 1 : r1 - 1] = 0
        adv = ss_grpo.token_advantages(A[i : i + 1], stage[None], mask[None])[0]
        out.ids.append(ids.tolist())
        out.mask.append(mask.tolist())
        out.adv.append(adv.tolist())
        out.kind.append("task")
    return out


def selftest_config(n_seq: int, group: int, minibatches: int, micro: int, lr: float,
                    eta: float | None = None):
    """The `full` preset with a small batch: n_seq = prompts x group sequences per RL step."""
    cfg = full_preset()
    cfg.rollout.prompts_per_step, cfg.rollout.n = n_seq // group, group
    cfg.ss_grpo.minibatches, cfg.ss_grpo.micro_batch, cfg.ss_grpo.lr = minibatches, micro, lr
    if eta is not None:
        cfg.ss_grpo.eta = eta
    return cfg


def selftest(model_dir: str, out_dir: str, *, updates: int = 1, n_seq: int = 16, group: int = 8,
             minibatches: int = 2, micro: int = 2, lr: float = 1e-3, min_len: int = 24,
             max_len: int = 48, eta: float | None = None, seed: int = 0,
             full: FullConfig | None = None) -> dict:
    """ZeRO-3 end to end on the current launcher's ranks: load `model_dir` into ZeRO3Policy and
    FrozenReference, run `updates` calls of policy.policy_update on synthetic_batch (each = `minibatches`
    optimizer steps), save the final policy to out_dir/final and (rank 0) write out_dir/stats.json:
    per-step global loss/kl/clip_frac/grad_norm, the batch plan and throughput (tokens/s)."""
    env = init_distributed()
    full = full or FullConfig()
    cfg = selftest_config(n_seq, group, minibatches, micro, lr, eta)
    device = device_kind()
    ds = deepspeed_config(cfg, env.world_size, device, full)
    t0 = time.perf_counter()
    policy = ZeRO3Policy.from_pretrained(model_dir, ds, lr, full=full)
    ref = FrozenReference.from_pretrained(model_dir, ds, chunk_size=full.logprob_chunk)
    t_load = time.perf_counter() - t0
    mc = policy.module.config
    batch = synthetic_batch(mc.vocab_size, n_seq, group, seed, min_len, max_len)
    shards, plans = plan_update(batch, env.world_size, minibatches, micro)
    local, lplan = shards[env.rank], plans[env.rank]
    engine = ZeRO3Engine(cfg, policy=policy, ref=ref)
    tokens = sum(len(x) for x in batch.ids)
    per_step, times = [], []
    for _ in range(updates):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        policy_update(engine, local, cfg.ss_grpo, mc.pad_token_id or 0, lplan, per_step)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    policy.save_pretrained(os.path.join(out_dir, "final"))
    t_save = time.perf_counter() - t0
    plan = batch_plan(cfg, env.world_size)
    res = {"world_size": env.world_size, "device": device, "plan": dataclasses.asdict(plan),
           "deepspeed_config": ds, "per_step": per_step, "update_s": times, "load_s": t_load,
           "save_s": t_save, "tokens_per_update": tokens,
           # one update = old + reference forward passes, then forward + backward per optimizer step
           "update_tokens_per_s": tokens / (sum(times[1:]) / max(len(times) - 1, 1))
           if len(times) > 1 else tokens / times[0],
           "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None}
    if env.is_rank0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "stats.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    barrier()
    return res
