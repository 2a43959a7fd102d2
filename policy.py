"""The policy side of the SS-GRPO update (§3.3): log-probs of pi_theta and the update of one batch,
written once for every policy engine.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The paper's policy is Qwen3-8B (appendix); toy mode's tiny Qwen3 and tokenizer are built in
toy/model.py, and the engines that run this update live in backends/ (`TorchEngine`: one process,
backends/torch_engine.py; `ZeRO3Engine`: ZeRO-3 ranks, backends/full.py).

Functions
- `token_logprobs(model, input_ids, attention_mask)`: log pi(a_t | h_t) of every next token, computed
  in chunks of the sequence so the (tokens x vocab) fp32 logits are never materialised at once;
  with a loss mask, the vocabulary projection runs only where the log-probs are used; at a
  temperature T, log pi_T = log_softmax(logits / T)[a_t], the distribution a sampler at T draws from.
- `pack_rows(batch, idx, pad_id)`: a micro-batch's sequences in rows, those behind one long shared
  prompt (a reflection group's m candidates) packed into one row with the prompt once; token_logprobs
  gives each the log-probs of its own row (ours: a speed-up, the same values).
- `plan_update` / `policy_update` (§3.3): the SS-GRPO update of one batch, written once for every
  policy engine (the `PolicyEngine` protocol). Old log-probs log pi_theta_old are fixed before the
  first optimizer step, then per optimizer step
      L = agg(-min(rho A, clip(rho, 1 - eta, 1 + eta) A)) + beta * agg(k3),
      rho = exp(log pi_theta - log pi_theta_old),
      k3 = exp(d) - d - 1,  d = log pi_ref - log pi_theta
  with the optimizer step's global normalisers (ss_grpo.ss_grpo_loss, ss_grpo.aggregate).

The toy run takes the plain path: each sequence in its own row, log_softmax + gather over every
position. The engines' fast path (`fast_logprobs`, on in the full preset) projects only the
loss-masked positions, in chunks, and packs the sequences that share a long prompt into one row
(pack_rows); it gives the same values to float rounding (tests/test_logprobs.py,
tests/test_prefix_sharing.py), not bit for bit.

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
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from torch.utils.checkpoint import checkpoint

import ss_grpo

log = logging.getLogger("rubricem")


def _chunk_logprobs(head, h: torch.Tensor, nxt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, c) float32 log-probs of the next tokens `nxt` (B, c) from hidden states h (B, c, H), of
    the distribution softmax(logits / temperature)."""
    logits = head(h).float()  # (B, c, V)
    if temperature != 1.0:
        logits = logits / temperature
    # log pi_T(x_{t+1} | x_{<=t}) = log_softmax(logits_t / T)[x_{t+1}]
    lp = torch.log_softmax(logits, dim=-1)  # (B, c, V)
    return lp.gather(-1, nxt[..., None]).squeeze(-1)


RECOMPUTE_ABOVE_BYTES = 256 * 2**20  # token_logprobs: keep a smaller log-softmax for the backward


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   chunk_size: int = 1024, recompute: bool | None = None,
                   loss_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """log pi_theta(x_{t+1} | x_{<=t}) for every position, memory-bounded.

    input_ids, attention_mask: (B, L) int64. Returns (B, L) float32 where column t holds the
    log-prob of token t given tokens < t (column 0 is 0: the first token has no prediction).
    The final hidden states (B, L, H) are computed once; the vocabulary projection and log-softmax
    run on `chunk_size` positions at a time, so the forward holds at most B * chunk_size * V floats
    of logits instead of B * L * V. Gradients flow through (use under torch.no_grad() for old/ref
    log-probs).

    attention_mask is 1 on tokens and 0 on padding, or, for a row that packs several sequences
    behind one shared prompt (`pack_rows`), a segment id per token: 1 on the shared prefix, which
    comes first, and 2, 3, ... on each sequence's own continuation (0 on padding). A continuation
    attends to the prefix and to itself only, its positions count on from the prefix, and its first
    token is predicted from the prefix's last position, so every column holds what the sequence
    alone would give (tests/test_prefix_sharing.py: equal to 1e-5, gradients too). Packed rows need
    an attention that takes a 4-D mask ("sdpa" or "eager"; ValueError otherwise).

    recompute: with gradient, autograd would keep every chunk's (B, c, V) log-softmax for the
    backward, i.e. the full B * L * V again; recompute=True keeps only each chunk's inputs and
    recomputes its projection in the backward (torch.utils.checkpoint), for one extra vocabulary
    projection per chunk (about 10 % of a toy update). None (the default): recompute when gradients
    are recorded and the kept log-softmax would exceed RECOMPUTE_ABOVE_BYTES (256 MiB; always at
    the paper's scale, never for a toy micro-batch). The values are the same either way.
    benchmarks/logprob_memory.py measures the memory of both.

    loss_mask: optional (B, L) bool / {0, 1}, 1 where a column's log-prob is used (the loss-masked
    tokens of an update). Then the vocabulary projection and log-softmax run on those positions
    only (N of them, in chunks of chunk_size * B rows; prompts, tool outputs and padding skip the
    head, as TRL's `logits_to_keep` skips prompts) and every other column is 0. The used columns
    equal the full computation's to float rounding (tests/test_logprobs.py). The head is called at
    least once even when N = 0, so every ZeRO-3 rank runs the same collectives.

    temperature: T > 0; the log-probs are those of softmax(logits / T), the distribution a sampler
    at temperature T draws from (an update of sequences sampled at T scores them under it, as TRL,
    verl and open-instruct do; T = 1, the default, is the model's own distribution, computed
    without the division). Raises ValueError for T <= 0 or not finite.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    B, L = input_ids.shape
    packed = attention_mask.numel() > 0 and int(attention_mask.max()) > 1
    if packed:
        mask, position_ids, prev = _segment_layout(attention_mask, model)
    else:
        # Left-padded batches: positions must count from each row's first real token.
        mask, position_ids = attention_mask, (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = base(input_ids=input_ids, attention_mask=mask,
                  position_ids=position_ids).last_hidden_state  # (B, L, H)
    if packed:  # column t + 1 is predicted from position prev[t + 1] (t, except at a branch's start)
        hidden = hidden.gather(1, prev[:, 1:, None].expand(-1, -1, hidden.shape[-1]))
    head = model.get_output_embeddings()
    if loss_mask is not None:
        return _masked_logprobs(head, hidden, input_ids, loss_mask, chunk_size * B, recompute,
                                temperature)
    if recompute is None:
        recompute = _recompute_head(head, hidden, B * (L - 1))
    pieces = [torch.zeros(B, 1, dtype=torch.float32, device=input_ids.device)]
    for s in range(0, L - 1, chunk_size):
        e = min(s + chunk_size, L - 1)
        # (B, c); without recompute its logits are freed here
        pieces.append(_project(head, hidden[:, s:e], input_ids[:, s + 1 : e + 1], recompute,
                               temperature))
    return torch.cat(pieces, dim=1)  # (B, L)


def head_rows(head) -> int:
    """V, the output vocabulary of an LM head (its weight's first dimension). Under ZeRO-3 a
    partitioned parameter is an empty tensor outside its module's forward (shape (0,)); DeepSpeed keeps
    the full shape in `ds_shape`, which we read then."""
    w = head.weight
    shape = getattr(w, "ds_shape", None)  # SCALE: a ZeRO-3 partition's true shape
    return int((shape if shape is not None and len(shape) else w.shape)[0])


def _recompute_head(head, hidden: torch.Tensor, positions: int) -> bool:
    """token_logprobs' default for `recompute`: gradients are recorded and the float32 log-softmax
    of `positions` positions (positions x V x 4 bytes) would exceed RECOMPUTE_ABOVE_BYTES."""
    return (torch.is_grad_enabled() and hidden.requires_grad
            and positions * head_rows(head) * 4 > RECOMPUTE_ABOVE_BYTES)


def _project(head, h: torch.Tensor, nxt: torch.Tensor, recompute: bool,
             temperature: float = 1.0) -> torch.Tensor:
    """_chunk_logprobs of one chunk, under torch.utils.checkpoint when `recompute`."""
    if recompute:  # SCALE: the backward rebuilds this chunk's logits instead of storing them
        return checkpoint(_chunk_logprobs, head, h, nxt, temperature, use_reentrant=False)
    return _chunk_logprobs(head, h, nxt, temperature)


def _masked_logprobs(head, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                     rows: int, recompute: bool | None, temperature: float = 1.0) -> torch.Tensor:
    """token_logprobs' loss_mask path: (B, L) float32, column t + 1 from hidden[:, t] (in a packed
    row, from its predecessor: token_logprobs has gathered those) where loss_mask[:, t + 1] is
    set, 0 elsewhere; `rows` positions per head call."""
    B, L = input_ids.shape
    sel = loss_mask[:, 1:].bool()  # (B, L - 1): the columns whose log-prob is used
    h, nxt = hidden[:, : L - 1][sel], input_ids[:, 1:][sel]  # (N, H), (N,)
    N = h.shape[0]
    if recompute is None:
        recompute = _recompute_head(head, h, N)
    # N = 0: one call on 0 rows (collective-safe)
    lp = torch.cat([_project(head, h[s: s + rows], nxt[s: s + rows], recompute, temperature)
                    for s in range(0, max(N, 1), max(1, rows))])  # (N,)
    out = lp.new_zeros((B, L - 1)).masked_scatter(sel, lp)  # (B, L - 1), differentiable in lp
    return torch.cat([lp.new_zeros((B, 1)), out], dim=1)  # (B, L)


def _segment_layout(seg: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For segment ids seg (B, L) (token_logprobs): the 4-D attention mask (B, 1, L, L), the
    position ids (B, L) and each position's predecessor prev (B, L) int64 (the position whose
    hidden state predicts it). Raises ValueError when the model's attention takes no 4-D mask."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"prefix-shared rows need 'sdpa' or 'eager' attention, not {impl!r}; "
                         "set fast_logprobs = false")
    B, L = seg.shape
    seg = seg.long()
    ar = torch.arange(L, device=seg.device)
    key = seg[:, None, :]  # (B, 1, L): the attended token's segment
    # token a attends to b <= a when b is a token of the shared prefix (1) or of a's own segment
    allowed = (ar[:, None] >= ar[None, :]) & (key > 0) & ((key == 1) | (key == seg[:, :, None]))
    # positions: the prefix counts 0..P-1, each continuation counts on from P
    position_ids = (allowed.sum(-1) - 1).clamp(min=0)
    start = (seg >= 2) & (seg != torch.nn.functional.pad(seg[:, :-1], (1, 0)))  # a branch's 1st token
    last_prefix = ((seg == 1).sum(-1, keepdim=True) - 1).clamp(min=0)  # (B, 1)
    prev = torch.where(start, last_prefix, (ar - 1).clamp(min=0)[None, :].expand(B, L))
    mask = allowed[:, None]
    if impl == "eager":  # eager attention adds the mask to the scores
        mask = torch.zeros(mask.shape, device=seg.device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)
    return mask, position_ids, prev


# ----------------------------------------------------------------------------------------------------
# The SS-GRPO update (§3.3), written once for every policy engine
#
# The update needs only five things from an engine (the `PolicyEngine` protocol below): log-probs
# with and without gradient, a backward with an accumulation boundary, and an optimizer step.
# `TorchEngine` (one process, toy mode) and backends/full.py's `ZeRO3Engine` (DeepSpeed ZeRO-3 over
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
    """Right-pad sequences idx of an UpdateBatch: (ids, attention, loss mask, advantages), each (B, L)
    with dtypes int64, int64, bool, float32 (B = len(idx), L = the longest of them); pack_rows
    without sharing."""
    return pack_rows(batch, idx, pad_id, share=False)[:4]


# Prefix sharing (ours, not in the paper; a speed-up with the same values). A reflection GRPO group
# is m candidates behind one prompt that holds the whole judged trajectory (about 300 tokens for a
# candidate of about 25 in toy mode), so most of a reflection update's forward and backward would be
# the same prompt m times. `pack_rows` puts the sequences of a micro-batch that begin with the same
# loss-free prompt into one row, the prompt once and each continuation after it, and token_logprobs
# masks the attention so every continuation sees the prompt and itself only: the same log-probs
# and gradients as separate rows (to float rounding), for far fewer tokens. A group is packed only
# when its prompt is at least as long as its continuations on average (SHARE_MIN_RATIO): a task
# rollout's prompt is short next to its response, and one long packed row would cost more attention
# than the prompt tokens it saves.

SHARE_MIN_RATIO = 1.0  # pack a group when prompt length >= this x the mean continuation length


def _loss_free_prefix(mask: Sequence[int]) -> int:
    """Number of leading tokens with loss mask 0 (the prompt a sequence may share)."""
    n = 0
    for x in mask:
        if x:
            break
        n += 1
    return n


def share_groups(batch: UpdateBatch, idx: Sequence[int],
                 min_ratio: float = SHARE_MIN_RATIO) -> list[list[int]]:
    """Partition idx (positions in `batch`) into groups, in order of first appearance: sequences with
    the same loss-free prefix (ids and length) whose prefix is at least min_ratio x their mean
    remainder form one group (packed into one row by pack_rows); every other sequence is its own
    group."""
    by_key: dict = {}
    for i in idx:
        k = _loss_free_prefix(batch.mask[i])
        key = (k, tuple(batch.ids[i][:k])) if k > 0 else ("alone", i)
        by_key.setdefault(key, []).append(i)
    out = []
    for key, members in by_key.items():
        k = key[0]
        rest = sum(len(batch.ids[i]) - k for i in members) / len(members)
        if len(members) > 1 and k >= min_ratio * rest:
            out.append(members)
        else:
            out.extend([i] for i in members)
    return out


def pack_rows(batch: UpdateBatch, idx: Sequence[int], pad_id: int, share: bool = True):
    """pad_rows with prefix sharing: (ids, att, loss mask, advantages, layout).

    The four tensors are (B', L') with dtypes int64, int64, bool, float32, one row per group of
    `share_groups` (share=False: one per sequence, exactly pad_rows' tensors). A packed row holds
    the shared prefix (att 1) and then each member's remainder (att 2, 3, ...; token_logprobs reads
    them as segments); padding has att 0. layout[r] lists row r's pieces (i, src, dst, n): tokens
    src..src+n of sequence i sit at dst..dst+n (the prefix is a piece of every member). Raises
    ValueError for an empty idx.
    """
    if not idx:
        raise ValueError("pack_rows needs at least one sequence")
    groups = share_groups(batch, idx) if share else [[i] for i in idx]
    rows = []  # per row: (ids, segment ids, mask, adv, layout)
    for g in groups:
        first = batch.ids[g[0]]
        if len(g) == 1:
            n = len(first)
            rows.append((first, [1] * n, batch.mask[g[0]], batch.adv[g[0]], [(g[0], 0, 0, n)]))
            continue
        k = _loss_free_prefix(batch.mask[g[0]])
        ids, seg, mk, ad = list(first[:k]), [1] * k, [0] * k, list(batch.adv[g[0]][:k])
        lay = [(i, 0, 0, k) for i in g]
        for j, i in enumerate(g):
            n = len(batch.ids[i]) - k
            lay.append((i, k, len(ids), n))
            ids += batch.ids[i][k:]
            seg += [2 + j] * n
            mk += batch.mask[i][k:]
            ad += batch.adv[i][k:]
        rows.append((ids, seg, mk, ad, lay))
    L, B = max(len(r[0]) for r in rows), len(rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.bool)
    adv = torch.zeros((B, L), dtype=torch.float32)
    for r, (i_, s_, m_, a_, _) in enumerate(rows):
        n = len(i_)
        ids[r, :n] = torch.tensor(i_)
        att[r, :n] = torch.tensor(s_)
        mask[r, :n] = torch.tensor(m_, dtype=torch.bool)
        adv[r, :n] = torch.tensor(a_, dtype=torch.float32)
    return ids, att, mask, adv, [r[4] for r in rows]


def place(values: list, layout: list, shape) -> torch.Tensor:
    """(B', L') float32 in pack_rows' layout from per-sequence values (values[i]: (L_i,) tensors,
    e.g. old or reference log-probs); 0 where no sequence's token sits."""
    out = torch.zeros(shape)
    for r, pieces in enumerate(layout):
        for i, src, dst, n in pieces:
            out[r, dst : dst + n] = values[i][src : src + n]
    return out


def unpack(rows: torch.Tensor, layout: list, lengths: Sequence[int]) -> dict:
    """Per-sequence (L_i,) tensors from (B', L') values in pack_rows' layout (the inverse of
    `place`): {i: tensor}; lengths[i] = L_i."""
    out: dict = {}
    for r, pieces in enumerate(layout):
        for i, src, dst, n in pieces:
            if i not in out:
                out[i] = torch.zeros(lengths[i], dtype=rows.dtype)
            out[i][src : src + n] = rows[r, dst : dst + n]
    return out


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


def plan_update(batch: UpdateBatch, world_size: int, minibatches: int, micro: int,
                rng: random.Random | None = None) -> tuple[list[UpdateBatch], list[UpdatePlan]]:
    """Split a whole UpdateBatch into per-rank shards and plans: ([UpdateBatch] * W, [UpdatePlan] * W).

    `rng` (None: no shuffle) shuffles the sequence order once; optimizer step j takes order[j::M],
    M = min(minibatches, N) (deviation 2 of train.py: several optimizer steps per batch, PPO-style);
    step j's sequences are then dealt to ranks round-robin. So W ranks and one process take the same
    optimizer steps on the same sequences, and the same `rng` state follows. Raises ValueError for
    world_size, minibatches or micro < 1.
    """
    if min(world_size, minibatches, micro) < 1:
        raise ValueError("world_size, minibatches and micro must be >= 1")
    N = len(batch.ids)
    order = list(range(N))
    if rng is not None:
        rng.shuffle(order)
    M = max(1, min(minibatches, N))
    mbs = [order[j::M] for j in range(M)]
    shards, plans = [], []
    ceil = lambda n: -(-n // micro)  # noqa: E731
    sel = [[mb[r::world_size] for mb in mbs] for r in range(world_size)]
    n_micro = [max(1, max(ceil(len(sel[r][j])) for r in range(world_size))) for j in range(M)]
    score = max(1, max(ceil(sum(len(p) for p in sel[r])) for r in range(world_size)))
    old = max(ceil(sum(len(p) for p in sel[r][1:])) for r in range(world_size))
    n_seq = [float(len(mb)) for mb in mbs]
    n_tok = [float(sum(sum(batch.mask[i]) for i in mb)) for mb in mbs]
    for r in range(world_size):
        flat = [i for part in sel[r] for i in part]
        shards.append(batch.select(flat))
        pos, local = 0, []
        for part in sel[r]:
            local.append(list(range(pos, pos + len(part))))
            pos += len(part)
        plans.append(UpdatePlan(local, list(n_micro), list(n_seq), list(n_tok), score, flat, old))
    return shards, plans


def _padding_pass(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-token all-padding micro-batch (1, 2) for ranks with fewer sequences than the plan."""
    return torch.full((1, 2), pad_id, dtype=torch.long), torch.ones((1, 2), dtype=torch.long)


@torch.no_grad()
def sequence_logprobs(fn, batch: UpdateBatch, pad_id: int, micro: int, passes: int | None = None,
                      index: Sequence[int] | None = None,
                      share: bool = False) -> list[torch.Tensor]:
    """Per-sequence token log-probs without gradient: a list of len(batch.ids) float32 CPU tensors
    (L_i,), from fn(ids, att, mask) -> (B, L) (an engine's `logprobs` or `ref_logprobs`; mask: the
    rows' loss masks, so the engine may skip the head elsewhere: those columns are then 0).

    Sequences go through fn `micro` at a time, shortest first (ties by `index`, the sequences'
    positions in the whole batch; default their own order), so each pass pads little; with
    `share`, sequences with a shared prompt go through together and are packed (pack_rows). With
    `passes`, fn is called exactly that many times (padding passes after this rank's sequences:
    every ZeRO-3 forward is collective). Raises ValueError when `passes` passes of `micro` cannot
    hold every sequence."""
    N = len(batch.ids)
    index = list(index) if index is not None else list(range(N))
    order = sorted(range(N), key=lambda i: (len(batch.ids[i]), index[i]))
    if share:  # siblings next to each other, groups in order of their shortest member
        order = [i for g in share_groups(batch, order) for i in g]
    chunks = [order[s : s + micro] for s in range(0, N, micro)]
    if passes is not None and len(chunks) > passes:
        raise ValueError(f"{passes} passes of {micro} cannot score {N} sequences")
    out: list[torch.Tensor] = [None] * N  # type: ignore[list-item]
    lengths = [len(x) for x in batch.ids]
    for idx in chunks:
        ids, att, mask, _, layout = pack_rows(batch, idx, pad_id, share)
        lp = fn(ids, att, mask).cpu()
        out_rows = unpack(lp, layout, lengths)
        for i in idx:
            out[i] = out_rows[i]
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
    backends/full.py's ZeRO3Engine at scale). The first six are the update's; on a multi-rank engine
    each is collective (every rank calls it, in the same order)."""

    world_size: int
    share_prefix: bool
    """policy_update packs the sequences that share a long prompt into one row (pack_rows); the
    engine then takes packed rows (segment ids in the attention) and a loss mask"""

    def logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """(B, L) int64 ids and attention -> (B, L) float32 log pi_theta of each next token (column 0
        is 0), with gradient unless under torch.no_grad(). mask: optional (B, L) bool loss mask;
        columns outside it may be 0 (token_logprobs' loss_mask). temperature: T > 0, the log-probs
        of softmax(logits / T) (token_logprobs)."""

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

    def update(self, batch: UpdateBatch, pad_id: int, rng: random.Random) -> dict:
        """plan_update + policy_update on a whole batch (rank 0's call); the update's metrics."""

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


def _minibatch(engine: PolicyEngine, local: UpdateBatch, mb: list, n_micro: int, n_seq: float,
               n_tok: float, old, ref, cfg, pad_id: int, share: bool = False) -> list[float]:
    """Forward/backward passes of one optimizer step's sequences (this rank's `mb`, in n_micro
    passes, padding passes when it has fewer; each pass's sequences packed by prompt when `share`);
    returns the summed loss statistics (_STAT_KEYS)."""
    micro = int(cfg.micro_batch)
    acc = [0.0] * len(_STAT_KEYS)
    for p in range(n_micro):
        idx = mb[p * micro : (p + 1) * micro]
        last = p == n_micro - 1
        if not idx:  # padding pass: same collectives as the other ranks, zero loss
            engine.backward(engine.logprobs(*_padding_pass(pad_id)).sum() * 0.0, last)
            continue
        ids, att, mask, adv, layout = pack_rows(local, idx, pad_id, share)
        # (B, L) with gradient, 0 outside the loss mask; of the sampling distribution (logits / T)
        logp = engine.logprobs(ids, att, mask, temperature=local.scoring_temperature)
        dev = logp.device
        # The first optimizer step of a batch (old is None): theta has not moved, pi_theta_old =
        # pi_theta, so log pi_old is this forward's own log-probs, detached (rho = 1 exactly)
        # instead of a second, no-grad forward.
        old_lp = logp.detach() if old is None else place(old, layout, ids.shape).to(dev)
        ref_lp = place(ref, layout, ids.shape).to(dev) if ref is not None else None
        # L = agg(-min(rho A, clip(rho, 1-eta, 1+eta) A)) + beta * agg(k3)   (§3.3), normalised with
        # the optimizer step's global counts so micro-batches and ranks add up (ss_grpo.aggregate)
        loss, st = ss_grpo.ss_grpo_loss(logp, old_lp, ref_lp, adv.to(dev), mask.to(dev), eta=cfg.eta,
                                        beta=cfg.beta, agg=cfg.agg, num_sequences=n_seq,
                                        num_tokens=n_tok)
        engine.backward(loss, last)
        acc = [a + float(st[k]) for a, k in zip(acc, _STAT_KEYS)]
    return acc


def policy_update(engine: PolicyEngine, local: UpdateBatch, cfg, pad_id: int, plan: UpdatePlan,
                  per_step: list | None = None) -> dict:
    """The SS-GRPO update (§3.3) of one batch on any engine: this rank's shard `local` and `plan`
    (from `plan_update`; one process: the whole batch, world_size 1). cfg: hparams.SSGRPOConfig.

    Old log-probs (and pi_ref's when beta > 0) are computed once, before the first optimizer step
    moves theta. The first optimizer step's sequences need no separate old pass: theta has not
    moved when their loss is computed, so pi_theta_old = pi_theta and their old log-probs are the
    loss forward's own, detached (rho = 1 exactly); only the sequences of later optimizer steps go
    through the no-grad old pass (none with one optimizer step per batch). Then one optimizer step
    per plan.minibatches entry, each normalised with the plan's global counts.

    Returns the means over optimizer steps of "loss/total", "loss/policy", "kl", "clip_frac" and
    "grad_norm" (pre-clip global L2 norm), {} for an empty batch. Not in the paper: a minibatch without a single
    loss-masked token on any rank has no loss to normalise; it is skipped and counted in
    "update/empty_minibatches" (present only when > 0). A step whose gradient norm is not finite
    (an overflowing ratio rho) is not applied (the engine drops its gradients), counted in
    "update/nonfinite_grad_steps" (only when > 0), and "grad_norm" averages the finite norms only
    (absent when there is none). per_step: a list that receives each optimizer step's global
    statistics (raw grad_norm included), for the ZeRO-3 self-test. Collective on a multi-rank
    engine: every rank calls it.
    """
    share = bool(getattr(engine, "share_prefix", False)) and cfg.agg != "seq_mean_token_mean"
    index = plan.index or None
    old = _later_old_logprobs(engine, local, plan, cfg, pad_id, share)
    ref = sequence_logprobs(functools.partial(engine.ref_logprobs,
                                              temperature=local.scoring_temperature),
                            local, pad_id, cfg.micro_batch, plan.score_passes, index,
                            share) if cfg.beta > 0 else None
    engine.train(True)
    done, empty = [], 0  # (stats, grad norm or None) of the optimizer steps taken; steps skipped
    for j, (mb, n_micro, n_seq, n_tok) in enumerate(zip(plan.minibatches, plan.n_micro, plan.n_seq,
                                                        plan.n_tok)):
        if n_tok == 0:  # nothing sampled to learn from, on any rank: no pass, no optimizer step
            empty += 1
            continue
        acc = _minibatch(engine, local, mb, n_micro, n_seq, n_tok, old if j else None, ref, cfg,
                         pad_id, share)
        gn = engine.step()  # the same global norm on every rank
        if not math.isfinite(gn):
            log.warning("SS-GRPO update: gradient norm %s; optimizer step skipped", gn)
        done.append((engine.all_reduce(acc), gn if math.isfinite(gn) else None))
        if per_step is not None:
            per_step.append({**dict(zip(_STAT_KEYS, done[-1][0])), "grad_norm": gn})
    engine.train(False)
    if empty:
        log.warning("SS-GRPO update: %d of %d minibatches have no loss-masked token; skipped",
                    empty, len(plan.minibatches))
    return _update_stats(done, empty)


def _later_old_logprobs(engine: PolicyEngine, local: UpdateBatch, plan: UpdatePlan, cfg, pad_id: int,
                        share: bool) -> list | None:
    """log pi_theta_old of the sequences of optimizer steps 1, 2, ... (before any step moves theta):
    a list over this rank's shard with None for step 0's sequences; None with one optimizer step.
    Runs plan.old_passes no-grad passes (the same count on every rank)."""
    if len(plan.minibatches) < 2:
        return None
    later = sorted(i for mb in plan.minibatches[1:] for i in mb)  # shard positions
    sub = local.select(later)
    index = [plan.index[i] for i in later] if plan.index else later
    passes = plan.score_passes if plan.old_passes is None else plan.old_passes
    scored = sequence_logprobs(functools.partial(engine.logprobs,
                                                 temperature=local.scoring_temperature),
                               sub, pad_id, cfg.micro_batch, passes, index, share)
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


