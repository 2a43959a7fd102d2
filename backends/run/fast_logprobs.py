"""The fast log-prob path (Config.fast_logprobs; on in the full preset): the same log-probs as
policy.token_logprobs and the same update as policy.policy_update, for less memory and fewer tokens.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements nothing of the method (ours, not in the paper): the SS-GRPO update of §3.3 needs only
log pi_theta of each sampled token, and this module computes exactly that, three ways faster than
the plain path's one log_softmax over every position:

- `token_logprobs(model, input_ids, attention_mask, chunk_size, recompute, loss_mask, temperature,
  head)`:
  the vocabulary projection and log-softmax run `chunk_size` positions at a time (the (tokens x
  vocab) fp32 logits are never held at once), only on the loss-masked positions when given a loss
  mask, and under torch.utils.checkpoint (recomputed in the backward) above RECOMPUTE_ABOVE_BYTES.
  It also reads packed rows (segment ids in the attention mask, `pack_rows`).
- `ChunkedHead`: that chunk loop as one module call per pass, whatever the number of chunks. Under
  ZeRO-3 every module call gathers the module's partitioned parameters and the ranks' call orders
  must agree (DeepSpeed checks the recorded orders against each other; deepspeedai/DeepSpeed#7998):
  a head called once per chunk would make a rank with 5 chunks and one with 1 run different
  collectives and hang. backends/distributed/zero3.py registers the head's weight as the
  ChunkedHead's external parameter, so it is gathered once for the forward and once for the
  backward of a pass; the chunks (and their recompute) use the weight directly, not the head module.
- `SharedPrefixRows` (`pack_rows`, `place`, `unpack`, `share_groups`): the update's row layout with
  prefix sharing: the sequences of a micro-batch behind one long shared prompt (a reflection group's
  m candidates, §3.4) go into one row with the prompt once. An engine that runs the fast path sets
  `rows = rows_for(agg)`; policy_update then builds its rows with it (policy.PaddedRows otherwise).

The engines that run it: backends/run/torch_engine.py (TorchEngine(fast=True)), backends/distributed/zero3.py
(ZeRO3Policy / FrozenReference always use the chunked head, the ZeRO3Engine packs with
fast_logprobs), backends/sft/zero3.py (the SFT loss through ZeRO3Policy). The equivalence tests
against the plain path: tests/test_logprobs.py (chunked, loss-masked, recomputed head),
tests/test_prefix_sharing.py (packed rows and the update with them), both to float rounding, not
bit for bit.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from policy import PaddedRows, UpdateBatch

RECOMPUTE_ABOVE_BYTES = 256 * 2**20  # token_logprobs: keep a smaller log-softmax for the backward


def _chunk_logprobs(weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor,
                    nxt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(n,) float32 log-probs of the next tokens `nxt` (n,) int64 from hidden states h (n, H), of the
    distribution softmax(logits / temperature), logits = h weight^T + bias (the LM head, weight
    (V, H)). A function of tensors, not a module call: its recompute in the backward
    (torch.utils.checkpoint) makes no ZeRO-3 gather."""
    logits = torch.nn.functional.linear(h, weight, bias).float()  # (n, V)
    if temperature != 1.0:
        logits = logits / temperature
    # log pi_T(x_{t+1} | x_{<=t}) = log_softmax(logits_t / T)[x_{t+1}]
    lp = torch.log_softmax(logits, dim=-1)  # (n, V)
    return lp.gather(-1, nxt[:, None]).squeeze(-1)


class ChunkedHead(torch.nn.Module):
    """The LM head's log-probs of many positions as one module call: the chunk loop of
    token_logprobs runs inside this forward, with the head's weight used directly.

    head: the causal LM's output embeddings (an nn.Linear, weight (V, H), optional bias). We keep it
    as a plain attribute, not a child module: its parameters stay the LM's alone (one DeepSpeed
    registration, one state_dict entry, one optimizer entry), and the head module itself is never
    called. Under ZeRO-3 the owner registers head.weight (and bias) as this module's external
    parameters (deepspeed.zero.register_external_parameter, backends/distributed/zero3.py): DeepSpeed
    then gathers them in this module's pre-forward hook and releases them after it, and gathers them
    again before its backward (torch.utils.checkpoint's recompute of each chunk happens there) and
    releases them after: one gather per forward and one per backward, on every rank, whatever the
    number of chunks. Without DeepSpeed (toy mode, TorchEngine) it is a plain function holder.
    """

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule (see the class docstring)

    def forward(self, h: torch.Tensor, nxt: torch.Tensor, rows: int, recompute: bool | None = None,
                temperature: float = 1.0) -> torch.Tensor:
        """(N,) float32 log-probs of the next tokens nxt (N,) int64 from hidden states h (N, H),
        `rows` >= 1 positions per chunk (ValueError otherwise), of softmax(logits / temperature).
        recompute: token_logprobs' (None: `_recompute_head`). N = 0 still projects one chunk of 0
        rows, so the output has a backward like any other rank's. h and nxt must be positional:
        DeepSpeed's backward hooks see positional tensors only."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        N = h.shape[0]
        head = self.head
        if recompute is None:
            recompute = _recompute_head(head, h, N)
        weight, bias = head.weight, getattr(head, "bias", None)
        chunks = [_project(weight, bias, h[s: s + rows], nxt[s: s + rows], recompute, temperature)
                  for s in range(0, max(N, 1), rows)]  # each (<= rows,)
        return torch.cat(chunks)  # (N,)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   chunk_size: int = 1024, recompute: bool | None = None,
                   loss_mask: torch.Tensor | None = None, temperature: float = 1.0,
                   head: ChunkedHead | None = None) -> torch.Tensor:
    """policy.token_logprobs, memory-bounded: log pi_theta(x_{t+1} | x_{<=t}) for every position.

    input_ids, attention_mask: (B, L) int64. Returns (B, L) float32 where column t holds the
    log-prob of token t given tokens < t (column 0 is 0: the first token has no prediction).
    The final hidden states (B, L, H) are computed once; the vocabulary projection and log-softmax
    run on `chunk_size * B` positions at a time, so the forward holds at most B * chunk_size * V
    floats of logits instead of B * L * V. Gradients flow through (use under torch.no_grad() for
    old/ref log-probs).

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
    equal the full computation's to float rounding (tests/test_logprobs.py).

    head: the ChunkedHead that projects (None: a new one over model.get_output_embeddings(), for a
    model outside ZeRO-3). Whatever N, L or chunk_size, a pass calls it exactly once (on 0 rows when
    N = 0) and calls no other module after the decoder, so every ZeRO-3 rank makes the same module
    calls, and hence the same parameter gathers, whatever its data (ChunkedHead;
    tests/test_zero3_collectives.py).

    temperature: T > 0; the log-probs are those of softmax(logits / T) (policy.token_logprobs; T = 1
    is computed without the division). Raises ValueError for T <= 0 or not finite, or chunk_size < 1.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
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
    head = head if head is not None else ChunkedHead(model.get_output_embeddings())
    h, nxt = hidden[:, : L - 1], input_ids[:, 1:]  # (B, L - 1, H): column t + 1 from h[:, t]
    if loss_mask is None:
        lp = head(h.reshape(-1, h.shape[-1]), nxt.reshape(-1), chunk_size * B, recompute,
                  temperature).view(B, L - 1)  # (B * (L - 1),) -> (B, L - 1)
    else:
        sel = loss_mask[:, 1:].bool()  # (B, L - 1): the columns whose log-prob is used
        lp = head(h[sel], nxt[sel], chunk_size * B, recompute, temperature)  # (N,)
        lp = lp.new_zeros((B, L - 1)).masked_scatter(sel, lp)  # (B, L - 1), differentiable in lp
    return torch.cat([lp.new_zeros((B, 1)), lp], dim=1)  # (B, L)


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


def _project(weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor, nxt: torch.Tensor,
             recompute: bool, temperature: float = 1.0) -> torch.Tensor:
    """_chunk_logprobs of one chunk, under torch.utils.checkpoint when `recompute`."""
    if recompute:  # SCALE: the backward rebuilds this chunk's logits instead of storing them
        return checkpoint(_chunk_logprobs, weight, bias, h, nxt, temperature, use_reentrant=False)
    return _chunk_logprobs(weight, bias, h, nxt, temperature)


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


def share_groups(batch: UpdateBatch, idx: Sequence[int], min_ratio: float = SHARE_MIN_RATIO,
                 max_tokens: int | None = None) -> list[list[int]]:
    """Partition idx (positions in `batch`) into groups, in order of first appearance: sequences with
    the same loss-free prefix (ids and length) whose prefix is at least min_ratio x their mean
    remainder form one group (packed into one row by pack_rows); every other sequence is its own
    group. max_tokens (None: no cap): a group whose row (prefix + every remainder) would be longer
    is split, in order, into rows of at most max_tokens tokens (a row holds at least one member)."""
    by_key: dict = {}
    for i in idx:
        k = _loss_free_prefix(batch.mask[i])
        key = (k, tuple(batch.ids[i][:k])) if k > 0 else ("alone", i)
        by_key.setdefault(key, []).append(i)
    out = []
    for key, members in by_key.items():
        k = key[0]
        rest = sum(len(batch.ids[i]) - k for i in members) / len(members)
        if not (len(members) > 1 and k >= min_ratio * rest):
            out.extend([i] for i in members)
            continue
        row, n = [], k  # the row being filled and its length in tokens
        for i in members:
            extra = len(batch.ids[i]) - k
            if row and max_tokens is not None and n + extra > max_tokens:
                out.append(row)
                row, n = [], k
            row.append(i)
            n += extra
        out.append(row)
    return out


def pack_rows(batch: UpdateBatch, idx: Sequence[int], pad_id: int, share: bool = True,
              max_tokens: int | None = None):
    """policy.pad_rows with prefix sharing: (ids, att, loss mask, advantages, layout).

    The four tensors are (B', L') with dtypes int64, int64, bool, float32, one row per group of
    `share_groups` (share=False: one per sequence, exactly pad_rows' tensors). A packed row holds
    the shared prefix (att 1) and then each member's remainder (att 2, 3, ...; token_logprobs reads
    them as segments); padding has att 0. layout[r] lists row r's pieces (i, src, dst, n): tokens
    src..src+n of sequence i sit at dst..dst+n (the prefix is a piece of every member).
    max_tokens: share_groups' cap on a packed row (None: none). Raises ValueError for an empty idx.
    """
    if not idx:
        raise ValueError("pack_rows needs at least one sequence")
    groups = share_groups(batch, idx, max_tokens=max_tokens) if share else [[i] for i in idx]
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


class SharedPrefixRows(PaddedRows):
    """policy.PaddedRows with prefix sharing: the row layout of an engine on the fast path. The
    update's rows then hold segment ids in the attention (token_logprobs above reads them) and the
    engine takes a loss mask; the same values as one sequence per row, to float rounding.

    max_tokens (None: no cap): the longest packed row (an engine passes its max pack, the memory
    plan's T); a longer group is split into several rows (share_groups)."""

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens

    def order(self, batch: UpdateBatch, idx: Sequence[int]) -> list[int]:
        """idx with the sequences of one shared prompt next to each other, groups in order of their
        first member (so a no-grad pass of `micro` sequences packs them together)."""
        return [i for g in share_groups(batch, idx, max_tokens=self.max_tokens) for i in g]

    def units(self, batch: UpdateBatch) -> list[list[int]] | None:
        """The packed rows of the whole batch as policy.plan_update's units (each travels whole: one
        rank, one optimizer step, one pass, so its members share one row whatever the micro-batch),
        or None when no row packs more than one sequence. This is what packs a reflection group's
        m candidates (§3.4) behind their shared trajectory once: at micro_batch 1 (the full preset)
        a pass is one unit, so without units no two candidates would ever meet in one pass."""
        groups = share_groups(batch, range(len(batch.ids)), max_tokens=self.max_tokens)
        return groups if any(len(g) > 1 for g in groups) else None

    def pack(self, batch: UpdateBatch, idx: Sequence[int], pad_id: int):
        """pack_rows with sharing: (ids, att, loss mask, advantages, layout)."""
        return pack_rows(batch, idx, pad_id, share=True, max_tokens=self.max_tokens)

    def place(self, values: list, layout: list, shape) -> torch.Tensor:
        """`place` above."""
        return place(values, layout, shape)

    def unpack(self, rows: torch.Tensor, layout: list, lengths: Sequence[int]) -> dict:
        """`unpack` above."""
        return unpack(rows, layout, lengths)


def rows_for(agg: str, max_tokens: int | None = None) -> PaddedRows:
    """The row layout of an engine on the fast path under aggregation `agg` (hparams.SSGRPOConfig
    .agg): SharedPrefixRows (rows of at most max_tokens tokens; None: no cap), except for
    "seq_mean_token_mean", whose per-row means need one sequence per row (policy.PaddedRows)."""
    return PaddedRows() if agg == "seq_mean_token_mean" else SharedPrefixRows(max_tokens)
