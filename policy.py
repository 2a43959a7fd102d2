"""The policy side of the SS-GRPO update (§3.3): log-probs of pi_theta and the update of one batch,
written once for every policy engine.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The paper's policy is Qwen3-8B (appendix); toy mode's tiny Qwen3 and tokenizer are built in
toy/model.py, and the engines that run this update live in backends/ (`TorchEngine`: one process,
backends/run/torch_engine.py; `ZeRO3Engine`: ZeRO-3 ranks, backends/distributed/engine.py).

Functions
- `token_logprobs(model, input_ids, attention_mask)`: log pi(a_t | h_t) of every next token: one
  forward, log_softmax and gather over every position; at a temperature T,
  log pi_T = log_softmax(logits / T)[a_t], the distribution a sampler at T draws from.
- `pad_rows(batch, idx, pad_id)` / `PaddedRows`: a micro-batch's sequences in right-padded rows, one
  per row, and back (the update's row layout; an engine may bring its own, see below).
- `plan_update` / `policy_update` (§3.3): the SS-GRPO update of one batch, written once for every
  policy engine (the `PolicyEngine` protocol), optionally with a second batch in the same optimizer
  steps (`joint`: §3.4's deferred reflection groups, L = L_task + L_reflect, each normalised over its
  own tokens). Old log-probs log pi_theta_old are fixed before the first optimizer step, then per
  optimizer step
      L = agg(-min(rho A, clip(rho, 1 - eta, 1 + eta) A)) + beta * agg(k3),
      rho = exp(log pi_theta - log pi_theta_old),
      k3 = exp(d) - d - 1,  d = log pi_ref - log pi_theta
  with the optimizer step's global normalisers (ss_grpo.ss_grpo_loss, ss_grpo.aggregate).

This is the plain path (Config.fast_logprobs = false). The engines' fast path (`fast_logprobs`, the
default of both presets) lives in backends/run/fast_logprobs.py: the head projects only the
loss-masked positions, in chunks, recomputed in the backward at scale, and the sequences that share
a long prompt (a reflection group's candidates) are packed into one row (the engine's `rows`,
SharedPrefixRows); it gives the same values to float rounding (tests/test_logprobs.py,
tests/test_prefix_sharing.py), not bit for bit. A packed row's sequences travel as one unit of
`plan_update` (one rank, one optimizer step, one pass), so with several optimizer steps per batch
the fast path's steps hold other sequences than the plain path's. Within an optimizer step the
units go longest first, so each pass pads little (plan_update).

Deviations from the paper
1. Toy mode trains a tiny model from scratch (SFT warm start, toy/sft.py) instead of starting from a
   pretrained Qwen3-8B: nothing may be downloaded here.
2. A batch may take several optimizer steps (`minibatches`, PPO-style; train.py deviation 2). The
   first step runs before theta moves, so for its sequences pi_theta_old = pi_theta and log
   pi_theta_old is the loss forward's own detached output (rho = 1 exactly) instead of a second
   forward; only the later steps' sequences get a no-grad old pass (none with one step).
3. Not in the paper: a minibatch without a loss-masked token is skipped, and an optimizer step whose
   gradient norm is not finite is not applied (both counted in the metrics).
4. Every log-prob of an update is taken at the batch's sampling temperature (UpdateBatch
   .scoring_temperature; 1 for greedy sampling): ss_grpo deviation 8.
"""
from __future__ import annotations

import functools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

import ss_grpo

log = logging.getLogger("rubricem")


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log pi_theta(x_{t+1} | x_{<=t}) for every position: one forward, log_softmax, gather.

    input_ids, attention_mask: (B, L) int64, attention 1 on tokens and 0 on padding (left or
    right). Returns (B, L) float32 where column t holds the log-prob of token t given tokens < t
    (column 0 is 0: the first token has no prediction). Gradients flow through (use under
    torch.no_grad() for old/ref log-probs). temperature: T > 0; the log-probs are those of
    softmax(logits / T), the distribution a sampler at temperature T draws from (an update of
    sequences sampled at T scores them under it, as TRL, verl and open-instruct do; T = 1 is the
    model's own distribution). Raises ValueError for T <= 0 or not finite.

    This holds the (B, L - 1, V) fp32 logits at once, which the toy can afford; the engines' fast path
    (backends/run/fast_logprobs.py: chunked, head on loss tokens only, recomputed in the backward,
    shared prompts packed) gives the same values to float rounding.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    # Left-padded batches: positions must count from each row's first real token.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = base(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids).last_hidden_state  # (B, L, H)
    logits = model.get_output_embeddings()(hidden[:, :-1]).float()  # (B, L - 1, V)
    # log pi_T(x_{t+1} | x_{<=t}) = log_softmax(logits_t / T)[x_{t+1}]
    lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)  # (B, L)


# ----------------------------------------------------------------------------------------------------
# The SS-GRPO update (§3.3), written once for every policy engine
#
# The update needs only five things from an engine (the `PolicyEngine` protocol below): log-probs
# with and without gradient, a backward with an accumulation boundary, and an optimizer step.
# `TorchEngine` (one process, toy mode) and backends/distributed/engine.py's `ZeRO3Engine` (DeepSpeed ZeRO-3 over
# the launcher's ranks) both implement them, and both call `policy_update` below.


@dataclass
class UpdateBatch:
    """Sequences for one update: ids (prompt + response), loss mask, per-token advantages (lists of
    equal length per sequence), each sequence's kind ("task" | "reflection"), and the temperature
    T >= 0 they were sampled at: the update's log-probs (pi_theta, pi_theta_old, pi_ref) are those
    of softmax(logits / T), the distribution that drew the tokens (token_logprobs)."""

    ids: list[list[int]] = field(default_factory=list)
    mask: list[list[int]] = field(default_factory=list)
    adv: list[list[float]] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    temperature: float = 1.0

    @property
    def scoring_temperature(self) -> float:
        """The T the update's log-probs use: the sampling temperature, or 1 for greedy sampling
        (T = 0 drew from no distribution; its tokens are scored under the model's own)."""
        return self.temperature if self.temperature > 0 else 1.0

    def select(self, idx: Sequence[int]) -> "UpdateBatch":
        """The sequences `idx` (in that order) as a batch of their own, at the same temperature."""
        return UpdateBatch([self.ids[i] for i in idx], [self.mask[i] for i in idx],
                           [self.adv[i] for i in idx], [self.kind[i] for i in idx], self.temperature)


def pad_rows(batch: UpdateBatch, idx: Sequence[int], pad_id: int):
    """Right-pad sequences idx of an UpdateBatch, one per row: (ids, attention, loss mask,
    advantages), each (B, L) with dtypes int64, int64, bool, float32 (B = len(idx), L = the longest
    of them; attention 1 on tokens, 0 on padding). Raises ValueError for an empty idx."""
    if not idx:
        raise ValueError("pad_rows needs at least one sequence")
    B, L = len(idx), max(len(batch.ids[i]) for i in idx)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.bool)
    adv = torch.zeros((B, L), dtype=torch.float32)
    for r, i in enumerate(idx):
        n = len(batch.ids[i])
        ids[r, :n] = torch.tensor(batch.ids[i])
        att[r, :n] = 1
        mask[r, :n] = torch.tensor(batch.mask[i], dtype=torch.bool)
        adv[r, :n] = torch.tensor(batch.adv[i], dtype=torch.float32)
    return ids, att, mask, adv


class PaddedRows:
    """How the update lays its sequences out in rows: one sequence per right-padded row (the plain
    path; every engine's `rows` unless it packs, as backends/run/fast_logprobs.SharedPrefixRows does).
    A layout is opaque to the update: here, the sequence of each row."""

    def order(self, batch: UpdateBatch, idx: Sequence[int]) -> list[int]:
        """The order in which a no-grad pass takes the sequences idx: theirs."""
        return list(idx)

    def units(self, batch: UpdateBatch) -> list[list[int]] | None:
        """The sequences of `batch` that must travel together (plan_update's units: one rank, one
        optimizer step, one pass each), or None: every sequence alone (here, always)."""
        return None

    def pack(self, batch: UpdateBatch, idx: Sequence[int], pad_id: int):
        """(ids, att, loss mask, advantages, layout): pad_rows and the sequence of each row."""
        return (*pad_rows(batch, idx, pad_id), list(idx))

    def place(self, values: list, layout: list, shape) -> torch.Tensor:
        """(B, L) float32 from per-sequence values (values[i]: (L_i,) tensors, e.g. old or reference
        log-probs): row r holds those of sequence layout[r], 0 on its padding."""
        out = torch.zeros(shape)
        for r, i in enumerate(layout):
            out[r, : len(values[i])] = values[i]
        return out

    def unpack(self, rows: torch.Tensor, layout: list, lengths: Sequence[int]) -> dict:
        """The inverse of place: {i: (L_i,) tensor} from (B, L) values; lengths[i] = L_i."""
        return {i: rows[r, : lengths[i]].clone() for r, i in enumerate(layout)}


@dataclass
class UpdatePlan:
    """One rank's part of an SS-GRPO update (built by `plan_update`). The pass counts are the same on
    every rank, because every ZeRO-3 forward is collective: a rank with fewer sequences runs padding
    passes that contribute nothing. With one process the plan is just the minibatch split."""

    minibatches: list  # per optimizer step, the positions of this rank's sequences in its shard
    n_micro: list  # per optimizer step, forward/backward passes (same on every rank)
    n_seq: list  # per optimizer step, the global number of sequences (loss normaliser)
    n_tok: list  # per optimizer step, the global number of loss-masked tokens (loss normaliser)
    score_passes: int  # no-grad forward passes for the reference log-probs (every sequence)
    index: list = field(default_factory=list)  # shard position -> index in the whole batch
    old_passes: int | None = None  # no-grad passes for the old log-probs (the sequences of optimizer
    # steps 1, 2, ...: step 0 runs before theta moves and uses its own forward); None: score_passes
    units: list = field(default_factory=list)  # per optimizer step, its units as lists of shard
    # positions (a pass takes `micro` units); empty: every sequence is a unit of its own


def plan_update(batch: UpdateBatch, world_size: int, minibatches: int, micro: int,
                rng: random.Random | None = None,
                units: Sequence[Sequence[int]] | None = None) -> tuple[list[UpdateBatch], list[UpdatePlan]]:
    """Split a whole UpdateBatch into per-rank shards and plans: ([UpdateBatch] * W, [UpdatePlan] * W).

    `rng` (None: no shuffle) shuffles the sequence order once; optimizer step j takes order[j::M],
    M = min(minibatches, N) (deviation 2 of train.py: several optimizer steps per batch, PPO-style);
    step j's sequences are then dealt to ranks round-robin. So W ranks and one process take the same
    optimizer steps on the same sequences, and the same `rng` state follows.

    units: None (every sequence alone), or a partition of range(N) into lists of sequences that
    travel whole: the shuffle, the minibatch split and the deal then take units instead of
    sequences, and a pass holds `micro` units. An engine that packs the candidates of a reflection
    group behind their shared prompt into one row (its `rows.units`, backends/run/fast_logprobs.py)
    needs them in one pass. Singleton units give exactly the plan of units=None.
    Raises ValueError for world_size, minibatches or micro < 1, or units that do not partition
    range(N).
    """
    if min(world_size, minibatches, micro) < 1:
        raise ValueError("world_size, minibatches and micro must be >= 1")
    N = len(batch.ids)
    units = [list(u) for u in units] if units is not None else [[i] for i in range(N)]
    if sorted(i for u in units for i in u) != list(range(N)) or not all(units):
        raise ValueError(f"units must partition the batch's {N} sequences into non-empty lists")
    grouped = any(len(u) > 1 for u in units)
    order = list(range(len(units)))  # units in shuffled order (sequences when units is None)
    if rng is not None:
        rng.shuffle(order)
    M = max(1, min(minibatches, len(units)))
    mbs = [order[j::M] for j in range(M)]
    shards, plans = [], []
    ceil = lambda n: -(-n // micro)  # noqa: E731
    # Balanced passes (ours, no change to the math: an optimizer step's gradient is a sum with
    # global normalisers, whatever the pass or rank a unit lands in). Each step's units go longest
    # first and are dealt round-robin, so pass p on every rank takes units of the p-th block of
    # micro x W in that order: a pass pads to about its own longest unit, and a ZeRO-3 pass, which
    # waits for its slowest rank, waits for a unit of about the same length on every rank.
    size = [sum(len(batch.ids[i]) for i in u) for u in units]  # tokens per unit
    mbs = [sorted(mb, key=lambda u: (-size[u], u)) for mb in mbs]
    sel = [[mb[r::world_size] for mb in mbs] for r in range(world_size)]  # unit ids per rank, step
    n_micro = [max(1, max(ceil(len(sel[r][j])) for r in range(world_size))) for j in range(M)]
    score = max(1, max(ceil(sum(len(p) for p in sel[r])) for r in range(world_size)))
    old = max(ceil(sum(len(p) for p in sel[r][1:])) for r in range(world_size))
    n_seq = [float(sum(len(units[u]) for u in mb)) for mb in mbs]
    n_tok = [float(sum(sum(batch.mask[i]) for u in mb for i in units[u])) for mb in mbs]
    for r in range(world_size):
        flat = [i for part in sel[r] for u in part for i in units[u]]
        shards.append(batch.select(flat))
        pos, local, local_units = 0, [], []
        for part in sel[r]:
            step_units = []
            for u in part:
                step_units.append(list(range(pos, pos + len(units[u]))))
                pos += len(units[u])
            local_units.append(step_units)
            local.append([i for su in step_units for i in su])
        plans.append(UpdatePlan(local, list(n_micro), list(n_seq), list(n_tok), score, flat, old,
                                local_units if grouped else []))
    return shards, plans


def _padding_pass(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-token all-padding micro-batch (1, 2) for ranks with fewer sequences than the plan."""
    return torch.full((1, 2), pad_id, dtype=torch.long), torch.ones((1, 2), dtype=torch.long)


@torch.no_grad()
def sequence_logprobs(fn, batch: UpdateBatch, pad_id: int, micro: int, passes: int | None = None,
                      index: Sequence[int] | None = None, rows: PaddedRows | None = None,
                      units: Sequence[Sequence[int]] | None = None, longest_first: bool = False,
                      on_pass=None) -> list[torch.Tensor]:
    """Per-sequence token log-probs without gradient: a list of len(batch.ids) float32 CPU tensors
    (L_i,), from fn(ids, att, mask) -> (B, L) (an engine's `logprobs` or `ref_logprobs`; mask: the
    rows' loss masks, so the engine may skip the head elsewhere: those columns are then 0).

    Sequences go through fn `micro` at a time, shortest first (ties by `index`, the sequences'
    positions in the whole batch; default their own order), so each pass pads little; `rows` lays
    each pass's sequences out in rows (default PaddedRows: one per row; an engine's packer may
    reorder them, e.g. to pack those behind one shared prompt together). units (plan_update's, as
    positions in `batch`; None: every sequence alone): a pass takes `micro` whole units instead,
    shortest longest-member first. With `passes`, fn is called exactly that many times (padding
    passes after this rank's sequences: every ZeRO-3 forward is collective). longest_first: the
    same passes in reverse order (each pass's sequences, hence its numbers, unchanged); on_pass: a
    callable that receives each pass's {sequence: log-probs} as soon as it is done. Raises
    ValueError when `passes` passes of `micro` cannot hold every sequence."""
    N = len(batch.ids)
    index = list(index) if index is not None else list(range(N))
    rows = rows or PaddedRows()
    if units is None:
        order = rows.order(batch, sorted(range(N), key=lambda i: (len(batch.ids[i]), index[i])))
        chunks = [order[s : s + micro] for s in range(0, N, micro)]
    else:
        key = lambda u: (max(len(batch.ids[i]) for i in u), min(index[i] for i in u))  # noqa: E731
        ordered = sorted((list(u) for u in units), key=key)
        chunks = [[i for u in ordered[s : s + micro] for i in u] for s in range(0, len(ordered), micro)]
    if passes is not None and len(chunks) > passes:
        raise ValueError(f"{passes} passes of {micro} cannot score {N} sequences")
    out: list[torch.Tensor] = [None] * N  # type: ignore[list-item]
    lengths = [len(x) for x in batch.ids]
    for idx in (chunks[::-1] if longest_first else chunks):
        ids, att, mask, _, layout = rows.pack(batch, idx, pad_id)
        lp = fn(ids, att, mask).cpu()
        out_rows = rows.unpack(lp, layout, lengths)
        for i in idx:
            out[i] = out_rows[i]
        if on_pass is not None:
            on_pass({i: out[i] for i in idx})
    for _ in range((passes or len(chunks)) - len(chunks)):
        fn(*_padding_pass(pad_id))
    return out


def batch_logprobs(model, batch: UpdateBatch, pad_id: int, micro: int) -> list[torch.Tensor]:
    """Per-sequence token log-probs (len L_i float32 tensors) of a plain HF model, without gradient
    (`sequence_logprobs` over `token_logprobs`)."""
    return sequence_logprobs(lambda ids, att, mask: token_logprobs(model, ids, att), batch, pad_id,
                             micro)


class PolicyEngine(Protocol):
    """What `policy_update` and the training loop call on pi_theta's engine (TorchEngine here,
    backends/distributed/engine.py's ZeRO3Engine at scale). The first six are the update's; on a multi-rank engine
    each is collective (every rank calls it, in the same order). Optional: `score_ref(score, n)`,
    pi_ref's per-sequence log-probs from `score` (sequence_logprobs with its arguments bound) as a
    list or a list-like whose items may wait (TorchEngine: a thread beside the loss passes);
    without it policy_update calls score() in line."""

    world_size: int
    rows: PaddedRows
    """how policy_update lays sequences out in rows: PaddedRows (the plain path, the default when
    an engine has none) or the engine's packer (backends/run/fast_logprobs.SharedPrefixRows: shared
    prompts once per row, segment ids in the attention)"""

    def logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """(B, L) int64 ids and attention -> (B, L) float32 log pi_theta of each next token (column 0
        is 0), with gradient unless under torch.no_grad(). att: 1 on tokens and 0 on padding, or
        the segment ids of the engine's own `rows`. mask: optional (B, L) bool loss mask; columns
        outside it may be 0 (backends/run/fast_logprobs.token_logprobs' loss_mask). temperature: T > 0,
        the log-probs of softmax(logits / T) (token_logprobs)."""

    def ref_logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                     temperature: float = 1.0) -> torch.Tensor:
        """The same under the frozen reference pi_ref (no gradient); called only when beta > 0."""

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Accumulate the gradient of a 0-dim loss normalised with the optimizer step's global
        counts; boundary: True on the last micro-batch of the optimizer step."""

    def step(self) -> float:
        """Clip and apply the optimizer step; returns the pre-clip global gradient norm (a non-finite
        norm: no step taken, gradients dropped)."""

    def train(self, mode: bool = True) -> None:
        """Train / eval mode of pi_theta (dropout is disabled either way)."""

    def all_reduce(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (identity in one process)."""

    def update(self, batch: UpdateBatch, pad_id: int, rng: random.Random,
               joint: UpdateBatch | None = None) -> dict:
        """plan_update + policy_update on a whole batch (rank 0's call); the update's metrics.
        joint: a second batch trained in the same optimizer steps (policy_update's `joint`; its
        statistics under "joint/"), planned after `batch` with the same rng."""

    def sync(self, sampler) -> None:
        """The sampler's weights follow pi_theta (a no-op for samplers that share the model)."""

    def save_pretrained(self, out_dir: str) -> None:
        """pi_theta as a Hugging Face checkpoint."""

    def save_state(self, ckpt_dir: str) -> None:
        """Engine state a checkpoint needs besides state_dict (ZeRO-3 partitions); may do nothing."""

    def state_dict(self) -> dict | None:
        """Optimizer state for the training state (None when save_state holds it)."""

    def load(self, ckpt_dir: str, state: dict) -> None:
        """Restore weights and optimizer from a checkpoint directory and its training state."""

    def close(self) -> None:
        """Release what the engine holds (other ranks, process groups)."""


_STAT_KEYS = ("loss/total", "loss/policy", "kl", "clip_frac")


def _minibatch(engine: PolicyEngine, local: UpdateBatch, units: list, n_micro: int, n_seq: float,
               n_tok: float, old, ref, cfg, pad_id: int, rows: PaddedRows,
               closes_step: bool = True) -> list[float]:
    """Forward/backward passes of one optimizer step's sequences (this rank's `units`, lists of
    shard positions, `micro` units per pass, in n_micro passes, padding passes when it has fewer;
    each pass's sequences laid out by `rows`); returns the summed loss statistics (_STAT_KEYS).
    closes_step: whether these passes are the optimizer step's last (the engine's accumulation
    boundary falls on the last of them); False when another objective's passes follow."""
    micro = int(cfg.micro_batch)
    acc = [0.0] * len(_STAT_KEYS)
    for p in range(n_micro):
        idx = [i for u in units[p * micro : (p + 1) * micro] for i in u]
        last = closes_step and p == n_micro - 1
        if not idx:  # padding pass: same collectives as the other ranks, zero loss
            engine.backward(engine.logprobs(*_padding_pass(pad_id)).sum() * 0.0, last)
            continue
        ids, att, mask, adv, layout = rows.pack(local, idx, pad_id)
        # (B, L) with gradient, 0 outside the loss mask; of the sampling distribution (logits / T)
        logp = engine.logprobs(ids, att, mask, temperature=local.scoring_temperature)
        dev = logp.device
        # The first optimizer step of a batch (old is None): theta has not moved, pi_theta_old =
        # pi_theta, so log pi_old is this forward's own log-probs, detached (rho = 1 exactly)
        # instead of a second, no-grad forward.
        old_lp = logp.detach() if old is None else rows.place(old, layout, ids.shape).to(dev)
        ref_lp = rows.place(ref, layout, ids.shape).to(dev) if ref is not None else None
        # L = agg(-min(rho A, clip(rho, 1-eta, 1+eta) A)) + beta * agg(k3)   (§3.3), normalised with
        # the optimizer step's global counts so micro-batches and ranks add up (ss_grpo.aggregate)
        loss, st = ss_grpo.ss_grpo_loss(logp, old_lp, ref_lp, adv.to(dev), mask.to(dev), eta=cfg.eta,
                                        beta=cfg.beta, agg=cfg.agg, num_sequences=n_seq,
                                        num_tokens=n_tok)
        engine.backward(loss, last)
        acc = [a + float(st[k]) for a, k in zip(acc, _STAT_KEYS)]
    return acc


def policy_update(engine: PolicyEngine, local: UpdateBatch, cfg, pad_id: int, plan: UpdatePlan,
                  per_step: list | None = None,
                  joint: tuple[UpdateBatch, UpdatePlan] | None = None) -> dict:
    """The SS-GRPO update (§3.3) of one batch on any engine: this rank's shard `local` and `plan`
    (from `plan_update`; one process: the whole batch, world_size 1). cfg: hparams.SSGRPOConfig.

    Old log-probs (and pi_ref's when beta > 0) are computed once, before the first optimizer step
    moves theta. The first optimizer step's sequences need no separate old pass: theta has not
    moved when their loss is computed, so pi_theta_old = pi_theta and their old log-probs are the
    loss forward's own, detached (rho = 1 exactly); only the sequences of later optimizer steps go
    through the no-grad old pass (none with one optimizer step per batch). Then one optimizer step
    per plan.minibatches entry, each normalised with the plan's global counts.

    joint: a second objective trained in the same optimizer steps (this rank's shard and plan of
    another batch, from its own plan_update; §3.4's deferred reflection GRPO batch, whose
    candidates' advantages carry the weight c): optimizer step j's gradient is that of
    L_j = L_j(batch) + L_j(joint), each term the SS-GRPO loss of its own sequences normalised with
    its own global counts and scored at its own batch's temperature, so one optimizer state moves
    the weights once per step for both objectives. A joint plan with fewer optimizer steps joins
    the first ones.

    Returns the means over optimizer steps of "loss/total", "loss/policy", "kl", "clip_frac" and
    "grad_norm" (pre-clip global L2 norm), {} for an empty batch; with `joint`, that part's
    "loss/total", "loss/policy", "kl" and "clip_frac" under "joint/" (its optimizer steps' grad_norm
    is the one above) and "joint/time_s", the wall seconds of its passes on this rank. Not in the paper: a minibatch without a single loss-masked token on any rank
    has no loss to normalise; it is skipped and counted in "update/empty_minibatches" (present only
    when > 0; an optimizer step of the joint part alone is not counted). A step whose gradient
    norm is not finite (an overflowing ratio rho) is not applied (the engine drops its gradients),
    counted in "update/nonfinite_grad_steps" (only when > 0), and "grad_norm" averages the finite
    norms only (absent when there is none). per_step: a list that receives each optimizer step's
    global statistics of `batch` (raw grad_norm included), for the ZeRO-3 self-test. Collective on a
    multi-rank engine: every rank calls it (with a joint part on every rank or on none).
    """
    rows = getattr(engine, "rows", None) or PaddedRows()  # one sequence per row unless it packs
    parts = [(local, plan)] + ([joint] if joint is not None else [])
    spent = [0.0 for _ in parts]  # wall seconds of each part's passes (its share of the update)
    prep = []
    for k, (b, p) in enumerate(parts):
        t0 = time.perf_counter()
        prep.append(_prepare(engine, b, p, cfg, pad_id, rows))
        spent[k] += time.perf_counter() - t0
    engine.train(True)
    done: list = [[] for _ in parts]  # per part, (stats, grad norm or None) of its steps taken
    empty = 0  # optimizer steps of `batch` skipped: no loss-masked token on any rank
    for j in range(max(len(p.minibatches) for _, p in parts)):
        # the parts with a loss in step j (global counts: the same on every rank)
        live = [k for k, (_, p) in enumerate(parts) if j < len(p.minibatches) and p.n_tok[j] > 0]
        empty += int(j < len(plan.minibatches) and plan.n_tok[j] == 0)
        if not live:  # nothing sampled to learn from, on any rank: no pass, no optimizer step
            continue
        accs = {}
        for k in live:
            (b, p), (step_units, old, ref) = parts[k], prep[k]
            t0 = time.perf_counter()
            accs[k] = _minibatch(engine, b, step_units[j], p.n_micro[j], p.n_seq[j], p.n_tok[j],
                                 old if j else None, ref, cfg, pad_id, rows, closes_step=k == live[-1])
            spent[k] += time.perf_counter() - t0
        gn = engine.step()  # the same global norm on every rank
        if not math.isfinite(gn):
            log.warning("SS-GRPO update: gradient norm %s; optimizer step skipped", gn)
        for k in live:
            done[k].append((engine.all_reduce(accs[k]), gn if math.isfinite(gn) else None))
        if per_step is not None and 0 in live:
            per_step.append({**dict(zip(_STAT_KEYS, done[0][-1][0])), "grad_norm": gn})
    for _, _, ref in prep:
        getattr(ref, "join", lambda: None)()  # pi_ref's passes in a thread (score_ref): done
    engine.train(False)
    if empty:
        log.warning("SS-GRPO update: %d of %d minibatches have no loss-masked token; skipped",
                    empty, len(plan.minibatches))
    out = _update_stats(done[0], empty)
    if joint is not None:
        out.update({f"joint/{k}": v for k, v in _update_stats(done[1], 0).items()
                    if k in _STAT_KEYS})
        out["joint/time_s"] = spent[1]
    return out


def _prepare(engine: PolicyEngine, local: UpdateBatch, plan: UpdatePlan, cfg, pad_id: int,
             rows: PaddedRows) -> tuple[list, list | None, list | None]:
    """policy_update's no-grad work for one batch, before any optimizer step moves theta:
    (per optimizer step its units, as lists of shard positions; log pi_old of the later steps'
    sequences, `_later_old_logprobs`; log pi_ref of every sequence when beta > 0, else None)."""
    index = plan.index or None
    # per optimizer step, the units a pass takes `micro` of: the plan's, or every sequence alone
    step_units = plan.units or [[[i] for i in mb] for mb in plan.minibatches]
    old = _later_old_logprobs(engine, local, plan, cfg, pad_id, rows)
    if cfg.beta <= 0:
        return step_units, old, None
    score = functools.partial(
        sequence_logprobs, functools.partial(engine.ref_logprobs, temperature=local.scoring_temperature),
        local, pad_id, cfg.micro_batch, plan.score_passes, index, rows,
        [u for su in plan.units for u in su] if plan.units else None)
    # an engine may run pi_ref's passes beside the loss passes (TorchEngine.score_ref: a thread);
    # the passes, hence the values, are the same
    return step_units, old, engine.score_ref(score, len(local.ids)) \
        if hasattr(engine, "score_ref") else score()


def _later_old_logprobs(engine: PolicyEngine, local: UpdateBatch, plan: UpdatePlan, cfg, pad_id: int,
                        rows: PaddedRows) -> list | None:
    """log pi_theta_old of the sequences of optimizer steps 1, 2, ... (before any step moves theta):
    a list over this rank's shard with None for step 0's sequences; None with one optimizer step.
    Runs plan.old_passes no-grad passes (the same count on every rank)."""
    if len(plan.minibatches) < 2:
        return None
    later = sorted(i for mb in plan.minibatches[1:] for i in mb)  # shard positions
    sub = local.select(later)
    index = [plan.index[i] for i in later] if plan.index else later
    passes = plan.score_passes if plan.old_passes is None else plan.old_passes
    at = {p: k for k, p in enumerate(later)}  # shard position -> position in `sub`
    units = [[at[i] for i in u] for su in plan.units[1:] for u in su] if plan.units else None
    scored = sequence_logprobs(functools.partial(engine.logprobs,
                                                 temperature=local.scoring_temperature),
                               sub, pad_id, cfg.micro_batch, passes, index, rows, units)
    old: list = [None] * len(local.ids)
    for i, lp in zip(later, scored):
        old[i] = lp
    return old


def _update_stats(done: list, empty: int) -> dict:
    """policy_update's result from each optimizer step's (summed stats, grad norm or None)."""
    if not done:
        return {"update/empty_minibatches": empty} if empty else {}
    tot = {k: 0.0 for k in _STAT_KEYS}
    tot["grad_norm"] = 0.0
    norms = [gn for _, gn in done if gn is not None]
    for acc, gn in done:
        for k, v in zip(_STAT_KEYS, acc):
            tot[k] += v / len(done)
        if gn is not None:
            tot["grad_norm"] += gn / len(norms)
    if not norms:
        del tot["grad_norm"]
    if len(norms) < len(done):
        tot["update/nonfinite_grad_steps"] = len(done) - len(norms)
    if empty:
        tot["update/empty_minibatches"] = empty
    return tot


