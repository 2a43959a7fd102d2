"""Length bucketing of SFT examples at the maximum length (16,384 tokens), and the SFT step plan.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements nothing of the method: it arranges the examples of sft.py for backends/sft/zero3.py.
Pure Python (no torch).

What is here
    step_plan        epochs -> optimizer steps of `batch` examples each (PAPER: effective batch 128),
                     shuffled per epoch with the seed; the last partial batch of an epoch is kept
    deal             one step's examples to W ranks, longest first, each to the rank with the fewest
                     tokens so far (every rank computes the same deal: no communication)
    bucket           one rank's examples -> micro-batches of similar length whose padded size
                     (rows x longest row) stays <= max_tokens (PAPER: max length 16,384; with the
                     paper's per-device batch 1, every micro-batch is one example)
    lr_at            PAPER: cosine schedule with 10 % linear warm-up, to 0 at the last step

We bucket by length instead of packing several examples into one row: packing needs a block-diagonal
attention mask and restarted positions for every packed example, which the chunked log-prob path
(backends/run/fast_logprobs.token_logprobs) supports only for a shared prompt; at the paper's
per-device batch of 1 a bucket is one example and nothing is padded anyway.
"""
from __future__ import annotations

import math
import random
from typing import Sequence


def step_plan(n: int, epochs: int, batch: int, seed: int = 0) -> list[list[int]]:
    """Optimizer steps over `epochs` passes of n examples: each a list of example indices (at most
    `batch`). Raises ValueError for n < 1, epochs < 1 or batch < 1."""
    if n < 1 or epochs < 1 or batch < 1:
        raise ValueError(f"need n, epochs, batch >= 1, got {n}, {epochs}, {batch}")
    rng = random.Random(seed)
    steps = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        steps += [order[i : i + batch] for i in range(0, n, batch)]
    return steps


def deal(indices: Sequence[int], lengths: Sequence[int], world: int) -> list[list[int]]:
    """Split one step's examples over `world` ranks, balancing tokens (longest first, greedy)."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def bucket(indices: Sequence[int], lengths: Sequence[int], max_tokens: int,
           micro_batch: int) -> list[list[int]]:
    """Micro-batches of at most `micro_batch` examples with rows x max length <= max_tokens, similar
    lengths together (sorted). Raises ValueError for an example longer than max_tokens."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(indices, key=lambda i: (lengths[i], i)):
        if lengths[i] > max_tokens:
            raise ValueError(f"example {i} has {lengths[i]} tokens, more than {max_tokens}")
        # sorted ascending: the new example is the longest of the micro-batch
        if cur and (len(cur) >= micro_batch or (len(cur) + 1) * lengths[i] > max_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def lr_at(step: int, total: int, peak: float, warmup_frac: float = 0.1) -> float:
    """Learning rate of optimizer step `step` (0-based) of `total`: linear warm-up over
    ceil(warmup_frac x total) steps, then cosine from `peak` to 0."""
    w = math.ceil(warmup_frac * total)
    if step < w:
        return peak * (step + 1) / w
    p = (step - w) / max(1, total - w)
    # Eq.: lr = peak x 0.5 (1 + cos(pi p)), p the fraction of the post-warm-up steps done
    return peak * 0.5 * (1 + math.cos(math.pi * p))
