"""A `scaffold.Sampler` with its own key/value-cache decode loop (toy mode, CPU).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the sampling step of §3.1 (a_t ~ pi_theta(. | h_t), temperature 1.0 in the paper) for
`scaffold.RolloutEngine`, like `hf_sampler.HFSampler`, which stays the reference.

Why: on a small model on CPU, Hugging Face `generate` spends much of each decode step in per-step
bookkeeping (input preparation, logits processors, stopping criteria) rather than in the model. This
loop calls the model's forward directly with a `DynamicCache` whose layers grow in place
(`new_cache`: a decode step writes its new keys and values into spare capacity instead of
concatenating the whole cache again):

    prefill: one forward over the left-padded prompts (logits of the last position only; a prompt
             that appears several times in the batch is prefilled once and its cache copied)
    step t:  sample x_t ~ softmax(logits / T) (argmax when T = 0), write it, then one forward of the
             new tokens (B, 1) against the cache

and drops the rows that have stopped from the batch (and from the cache), so a batch whose
sequences stop at very different lengths (tool calls, end of turn) stops paying for the finished
ones.

A multi-turn rollout calls `generate` once per turn with its whole context so far (the Sampler
interface is token-in/token-out). So that a turn does not re-encode that context, each row's keys
and values are kept when it stops (the prefix cache, of the last `generate` call only), and a
prompt that begins with a kept row's tokens reuses them: only the tool output and the next turn's
markup go through the model. The cache is dropped as soon as the weights change (an optimizer
step, a load: every parameter's in-place version is checked).

Same contract as HFSampler: left padding, position ids counted from each row's first real token,
top_k = 0, top_p = 1, batches of `batch_size` prompts sorted by length, stop at the first stop id
(eos, <|im_end|>, and every stop string that is a single token) or at the first token whose text
completes a stop string, and `HFSampler._cut` applied to every row, so the returned ids are exactly
the sampled ids up to and including the stop. Greedy decoding (T = 0) gives HF generate's tokens
(tests/test_kv_sampler.py); at T > 0 every next-token distribution is the model's (same log-probs as
a full forward, within 1e-5), but the random stream differs from generate's: tokens are drawn by
inverting the cumulative distribution with one uniform number per row (`draw_inverse_cdf`, an exact
draw and on CPU about 20 times cheaper than torch.multinomial over an 8k vocabulary), and finished
rows leave the batch. With draw="multinomial" the draws are generate's until the first row stops.

Deviations from HFSampler (not in the paper)
1. Only temperature sampling: sampling settings a model's own `generation_config` may carry (top-k,
   top-p, repetition penalty) are not applied (HFSampler overrides top-k / top-p as well; the toy
   model's generation config has no others).
"""
from __future__ import annotations

import functools
import inspect
from typing import Sequence

import torch

from toy.hf_sampler import HFSampler, autocast


DRAWS = ("cdf", "multinomial")


def draw_inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One exact draw per row of probs (b, V) (non-negative rows, each summing to about 1), by
    inverting the cumulative distribution with one uniform number per row: (b,) int64 ids.

    Token i is drawn with probability (c_i - c_{i-1}) / c_V, c the float32 cumulative sums, i.e.
    p_i up to the rounding of the sums (|error| < 1e-6 for V = 8,192; a token with p_i = 0 is never
    drawn). Uses torch's global RNG, b numbers per call (torch.multinomial: a pass over b x V).
    """
    c = probs.cumsum(dim=-1)  # (b, V)
    # Eq.: x = min{i : c_i > u * c_V},  u ~ U[0, 1)
    u = torch.rand((probs.shape[0], 1), dtype=c.dtype, device=c.device) * c[:, -1:]
    return torch.searchsorted(c, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@functools.lru_cache(maxsize=None)
def _growing_layer_class():
    """`GrowingLayer`, a transformers `DynamicLayer` (transformers >= 4.56) whose keys and values
    live in a buffer with spare capacity, or None on older transformers (plain DynamicCache)."""
    try:
        from transformers.cache_utils import DynamicLayer  # lazy: transformers only when a model runs
    except ImportError:
        return None

    class GrowingLayer(DynamicLayer):
        """One layer's keys / values (B, kv heads, n, head dim) as views of a buffer of capacity
        >= n. DynamicLayer concatenates the whole cache with each new token, i.e. copies it once
        per decode step and layer; here a step writes its (B, kv heads, 1, head dim) slice in place
        and the buffer grows by doubling (amortised O(1) copies per token). `keys` / `values` hold
        the same numbers as DynamicLayer's, so every forward gives the same floats."""

        def lazy_initialization(self, key_states, value_states) -> None:
            super().lazy_initialization(key_states, value_states)
            self._k = self._v = None
            self._n = 0

        def _views(self) -> None:
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self._n + key_states.shape[-2]
            if self._k is None or n > self._k.shape[-2]:
                cap = max(2 * n, n + 64)  # room for the next tokens without another copy
                k = key_states.new_empty(key_states.shape[:2] + (cap,) + key_states.shape[3:])
                v = value_states.new_empty(value_states.shape[:2] + (cap,) + value_states.shape[3:])
                if self._n:
                    k[:, :, : self._n] = self._k[:, :, : self._n]
                    v[:, :, : self._n] = self._v[:, :, : self._n]
                self._k, self._v = k, v
            self._k[:, :, self._n: n] = key_states
            self._v[:, :, self._n: n] = value_states
            self._n = n
            self._views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._n if self.is_initialized else 0

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            # The rows that stay, their filled part only, into a buffer with room for 64 more tokens:
            # a row that stops drops out of the batch (KVSampler.decode) up to once per decode step,
            # and copying the whole capacity (up to twice the filled part) each time cost more than
            # the attention of the steps in between.
            if self.get_seq_length() > 0:
                n = self._n
                k = self._k.new_empty((len(indices),) + self._k.shape[1:2] + (n + 64,) + self._k.shape[3:])
                v = self._v.new_empty((len(indices),) + self._v.shape[1:2] + (n + 64,) + self._v.shape[3:])
                torch.index_select(self._k[:, :, :n], 0, indices, out=k[:, :, :n])
                torch.index_select(self._v[:, :, :n], 0, indices, out=v[:, :, :n])
                self._k, self._v = k, v
                self._views()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("GrowingLayer: the decode loop never crops its cache")

    return GrowingLayer


def new_cache(config):
    """A DynamicCache for `config` whose full-attention layers grow in place (`_growing_layer_class`;
    other layer types, e.g. sliding windows, keep transformers' own)."""
    from transformers import DynamicCache  # lazy: `import train` and --help do not pay for transformers

    cache = DynamicCache(config=config)
    growing = _growing_layer_class()
    if growing is not None and hasattr(cache, "layers"):
        from transformers.cache_utils import DynamicLayer  # lazy: as above

        cache.layers = [growing() if type(lay) is DynamicLayer else lay for lay in cache.layers]
    return cache


def _layer_tensors(cache) -> list:
    """[(keys, values)] per layer of a DynamicCache, each (B, kv heads, length, head dim)
    (transformers >= 4.56 keeps them in `cache.layers`, earlier versions in two lists)."""
    if hasattr(cache, "layers"):
        return [(lay.keys, lay.values) for lay in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


class KVSampler(HFSampler):
    """`Sampler` over a causal LM's forward with a key/value cache (see the module docstring).

    model: a Hugging Face causal LM (e.g. `Qwen3ForCausalLM`) whose forward accepts a `Cache`;
    tokenizer: its tokenizer (stop ids and stop strings by HFSampler's rule). draw: how a token is
    drawn at T > 0: "cdf" (`draw_inverse_cdf`, one uniform number per row; the default, as
    torch.multinomial costs several lm-head projections per step on CPU at an 8k vocabulary) or
    "multinomial" (torch.multinomial, HF generate's draw: the same tokens as generate for the same
    seed until a row stops). Randomness comes from torch's global RNG (seed it for determinism).
    precision: the forwards' `hf_sampler.autocast` ("fp32" | "bf16"); threads: intra-op threads while
    generating (0 = unchanged; HFSampler). Raises ValueError for another draw or precision.
    """

    def __init__(self, model, tokenizer, stop_strings: Sequence[str] = ("</call_tool>",),
                 batch_size: int = 64, draw: str = "cdf", precision: str = "fp32", threads: int = 0):
        super().__init__(model, tokenizer, stop_strings, batch_size, precision, threads)
        if draw not in DRAWS:
            raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
        self.draw = draw
        params = inspect.signature(model.forward).parameters
        # transformers 5 names the cache argument `cache` (`past_key_values` before)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long)
        # A stop string is at most this many tokens long (a byte-level token holds >= 1 byte).
        self._tail = max((len(s.encode("utf-8")) for s in self._string_stops), default=0) + 1
        # The prefix cache: each row's keys / values from the last generate call, by the tokens
        # they hold, valid while the weights are unchanged (see `_lookup`).
        self._kept: dict = {}
        self._kept_weights = None

    def _generate(self, prompts, max_new_tokens, temperature):
        """Continue each prompt (list of token ids) by at most max_new_tokens[i] sampled ids
        (HFSampler's `generate` calls this under `hf_sampler.intra_op_threads(self.threads)`).

        temperature: float >= 0 (0 = greedy). Returns one list of new ids per prompt, each ending at
        its first stop (included) or at its budget. Raises ValueError for a negative temperature or
        mismatched lengths.
        """
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} budgets")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        out: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        kept: dict = {}  # this call's rows, for the next call (a rollout's next turn)
        for s in range(0, len(order), self.batch_size):
            idx = [i for i in order[s: s + self.batch_size] if max_new_tokens[i] > 0]
            if not idx:
                continue
            gen = self.decode([prompts[i] for i in idx], [int(max_new_tokens[i]) for i in idx],
                              temperature, keep=kept)[0]
            for r, i in enumerate(idx):
                out[i] = self._cut(gen[r], max_new_tokens[i])
        self._kept, self._kept_weights = kept, self._weights()
        return out

    def _weights(self) -> tuple:
        """What identifies the current weights: each parameter's storage and in-place version (an
        optimizer step or a load_state_dict bumps the version)."""
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def _lookup(self, prompts: list[list[int]]) -> list:
        """Per prompt, (n, keys / values) of the longest kept sequence that begins it (n of its
        tokens are reused, at most len(prompt) - 1 so the last one is computed), or (0, None).
        Nothing is reused after the weights changed."""
        if self._kept_weights != self._weights():
            self._kept = {}
        if not self._kept:
            return [(0, None)] * len(prompts)
        lengths = sorted({len(k) for k in self._kept}, reverse=True)
        out = []
        for p in prompts:
            hit = (0, None)
            for n in lengths:
                kv = self._kept.get(tuple(p[:n])) if n <= len(p) else None
                if kv is not None:
                    hit = (min(n, len(p) - 1), kv)
                    break
            out.append(hit)
        return out

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], limits: list[int], temperature: float,
               return_logprobs: bool = False,
               keep: dict | None = None) -> tuple[list[list[int]], list[list[float]] | None]:
        """One batch through the decode loop: (new ids per row, or also their log-probs).

        prompts: B non-empty lists of token ids; limits: B budgets >= 1. Row r stops at a stop id, at
        the token that completes a stop string, or after limits[r] tokens. With return_logprobs, the
        second value holds log pi(x_t | h_t) (float, natural log, of the untempered distribution) of
        every returned token; else None. keep: a dict that receives each row's keys / values when it
        stops (the prefix cache of the next generate call).
        """
        model, dev = self.model, getattr(self.model, "device", None) or torch.device("cpu")
        cache = new_cache(model.config)
        kw = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kw["logits_to_keep"] = 1
        cast = autocast(self.precision, dev.type)
        B = len(prompts)
        reuse = self._lookup(prompts)
        C = max(n for n, _ in reuse)  # the longest reused prefix
        L = max(len(p) - n for p, (n, _) in zip(prompts, reuse))  # the longest part to compute
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        att = torch.zeros((B, C + L), dtype=torch.long)
        pos = torch.zeros((B, L), dtype=torch.long)
        for r, (p, (n, _)) in enumerate(zip(prompts, reuse)):  # left padding, as HFSampler
            ids[r, L - len(p) + n:] = torch.tensor(p[n:], dtype=torch.long)
            att[r, C - n: C] = 1
            att[r, C + L - len(p) + n:] = 1
            # positions count from each row's first real token (padding gets 0), as HF generate
            pos[r, L - len(p) + n:] = torch.arange(n, len(p))
        ids, att, pos = ids.to(dev), att.to(dev), pos.to(dev)
        if C:
            # A rollout's next turn: the keys / values of its context so far come from the prefix
            # cache (right-aligned in C slots, padding masked); only the tool output and the turn's
            # markup go through the model.
            longest = next(kv for n, kv in reuse if n == C)
            for layer, (k0, v0) in enumerate(longest):
                k = k0.new_zeros((B, k0.shape[0], C, k0.shape[2]))
                v = v0.new_zeros((B, v0.shape[0], C, v0.shape[2]))
                for r, (n, kv) in enumerate(reuse):
                    if n:
                        k[r, :, C - n:] = kv[layer][0][:, :n]
                        v[r, :, C - n:] = kv[layer][1][:, :n]
                cache.update(k.to(dev), v.to(dev), layer)
            with cast:
                logits = model(input_ids=ids, attention_mask=att, position_ids=pos,
                               **kw).logits[:, -1]
        else:
            # Identical prompts (a reflection group's m candidates, a rollout group's first turn)
            # are prefilled once; the cache rows and last logits are copied to every row with them.
            first: dict = {}
            back = [first.setdefault(tuple(p), len(first)) for p in prompts]  # row -> distinct j
            if len(first) < B:
                u = torch.tensor([back.index(j) for j in range(len(first))], device=dev)
                with cast:
                    logits = model(input_ids=ids[u], attention_mask=att[u], position_ids=pos[u],
                                   **kw).logits[:, -1]
                cache.batch_select_indices(torch.tensor(back, device=dev))
                logits = logits[back]
            else:
                with cast:
                    logits = model(input_ids=ids, attention_mask=att, position_ids=pos,
                                   **kw).logits[:, -1]
        stop_ids = self._stop_ids.to(dev)
        limit = torch.tensor(limits, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)  # batch row -> original row
        nxt_pos = pos[:, -1:] + 1
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        toks: list[list[int]] = [[] for _ in range(B)]  # per row, its tokens so far
        for t in range(max(limits)):
            logits = logits.float()
            if temperature > 0:
                scores = logits / temperature if temperature != 1.0 else logits
                # x_t ~ softmax(logits / T)   (T = 1: the policy's own distribution, §3.1)
                tok = self._draw(torch.softmax(scores, dim=-1))
            else:
                tok = torch.argmax(logits, dim=-1)
            lp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(1) \
                if return_logprobs else None
            steps.append((rows, tok, lp))
            done = torch.isin(tok, stop_ids) | (limit[rows] <= t + 1)
            for r, x in zip(rows.tolist(), tok.tolist()):
                toks[r].append(x)
            if self._string_stops:
                done = done | self._string_stop_hits(rows, toks)
            if bool(done.any()):
                if keep is not None:
                    self._keep_rows(keep, cache, att, rows, done, prompts, toks)
                stay = (~done).nonzero().squeeze(1)
                if stay.numel() == 0:
                    break
                rows, tok, att, nxt_pos = rows[stay], tok[stay], att[stay], nxt_pos[stay]
                cache.batch_select_indices(stay)
            att = torch.cat([att, att.new_ones((att.shape[0], 1))], dim=1)
            with cast:
                logits = model(input_ids=tok[:, None], attention_mask=att, position_ids=nxt_pos,
                               **kw).logits[:, -1]
            nxt_pos = nxt_pos + 1
        out: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] | None = [[] for _ in range(B)] if return_logprobs else None
        for rws, tk, lp in steps:
            for j, (r, x) in enumerate(zip(rws.tolist(), tk.tolist())):
                out[r].append(x)
                if lps is not None:
                    lps[r].append(float(lp[j]))
        return out, lps

    def _keep_rows(self, keep: dict, cache, att: torch.Tensor, rows: torch.Tensor,
                   done: torch.Tensor, prompts: list[list[int]], toks: list[list[int]]) -> None:
        """Put the keys / values of the rows that stop now into `keep`, by the tokens they hold: the
        row's prompt and its sampled tokens but the last (sampled, not yet fed to the model)."""
        for j in done.nonzero().squeeze(1).tolist():
            r = int(rows[j])
            real = att[j].bool()
            keep[tuple(prompts[r] + toks[r][:-1])] = [
                (k[j][:, real].clone(), v[j][:, real].clone()) for k, v in _layer_tensors(cache)]

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row from probs (b, V) float32 rows summing to 1: (b,) int64."""
        if self.draw == "multinomial":
            return torch.multinomial(probs, num_samples=1).squeeze(1)
        return draw_inverse_cdf(probs)

    def _string_stop_hits(self, rows: torch.Tensor, toks: list[list[int]]) -> torch.Tensor:
        """(b,) bool: whether this step's token (the last of toks[r]) completes a stop string in its
        row's text."""
        hit = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        for j, r in enumerate(rows.tolist()):
            tail = self.tok.decode(toks[r][-self._tail:], skip_special_tokens=False)
            if any(s in tail for s in self._string_stops):
                hit[j] = True
        return hit
