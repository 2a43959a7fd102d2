"""The Hugging Face `generate` sampler (`HFSampler`, behind scaffold's `Sampler` interface) and the
precision and thread settings the toy model's forwards run under.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Speed only, not in the paper: `autocast` (fp32 | bf16), `pad_multiple` (padded lengths under bf16),
`intra_op_threads` (torch's intra-op threads while the samplers decode). toy/kv_sampler.py's
KVSampler (the toy default) builds on HFSampler.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch


PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device_type: str = "cpu"):
    """The context the toy model's forward passes run under (SFT, rollouts, the update's log-probs).

    precision: "fp32" (no autocast: every op in float32) | "bf16" (torch.autocast: matrix products
    and attention in bfloat16 with float32 accumulation; weights, optimizer state, norms, softmax,
    log-probs and the loss stay float32; on CPUs with AVX512-BF16 the products run 3-5x faster).
    device_type: "cpu" | "cuda". Wrap forwards only: the backward then follows each forward op's
    dtype. Raises ValueError for another precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def pad_multiple(precision: str) -> int:
    """Padded batch lengths under `precision` are multiples of this: 64 for "bf16", 1 (exact) for
    "fp32". Few distinct tensor sizes let the C allocator reuse freed blocks: with exact lengths the
    resident heap of a bf16 run grew update after update (float32's did not); rounded, it levels
    off. Right padding that no real position attends to changes no value; float32 keeps exact
    lengths, so its results are as before (docs/performance.md section 5)."""
    return 64 if precision == "bf16" else 1


def intra_op_threads(n: int):
    """A context with torch's intra-op thread count set to n (n >= 1), restored on exit; n = 0 or the
    current count changes nothing. The samplers decode under it (settings `sample_threads`)."""
    old = torch.get_num_threads()
    if not n or n == old:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _ctx():
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(old)

    return _ctx()


class HFSampler:
    """`Sampler` over a Hugging Face causal LM's `generate` (batched, left padding, top_k=0, top_p=1).

    Stops each sequence at the first of `stop_token_ids` (ids) or `stop_strings` (text, for tokenizers
    that spell tags out). Randomness comes from torch's global RNG (seed it for determinism).
    precision: the forwards' `autocast` ("fp32" | "bf16"; ValueError otherwise). threads: torch
    intra-op threads while generating (`intra_op_threads`; 0 = leave the process's count).
    """

    def __init__(self, model, tokenizer, stop_strings: Sequence[str] = ("</call_tool>",),
                 batch_size: int = 64, precision: str = "fp32", threads: int = 0):
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        autocast(precision)  # ValueError for an unknown precision
        self.precision = precision  # the forwards' autocast ("fp32" | "bf16")
        self.threads = threads  # intra-op threads while generating (0 = unchanged)
        self.stop_strings = tuple(stop_strings)
        ids = {tokenizer.eos_token_id}
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            ids.add(im_end)
        # A stop string that is one token in this vocabulary becomes a stop id (cheap, exact).
        self._string_stops = []
        for s in self.stop_strings:
            enc = tokenizer.encode(s, add_special_tokens=False)
            if len(enc) == 1:
                ids.add(enc[0])
            else:
                self._string_stops.append(s)
        self.stop_token_ids = sorted(i for i in ids if i is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        self.stats: dict = {}

    def sync_weights(self, named_params, copy: bool = True) -> None:
        """No-op: this sampler generates with the trained model object itself."""

    def reseed(self, seed: int) -> None:
        """No-op: sampling draws from torch's global RNG, which the loop seeds per step."""

    def close(self) -> None:
        """No-op: nothing to release."""

    def generate(self, prompts, max_new_tokens, temperature):
        with intra_op_threads(self.threads):
            return self._generate(prompts, max_new_tokens, temperature)

    def _generate(self, prompts, max_new_tokens, temperature):
        out: list[list[int]] = [None] * len(prompts)  # type: ignore[list-item]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            L = max(len(prompts[i]) for i in idx)
            inp = torch.full((len(idx), L), self.pad_id, dtype=torch.long)
            att = torch.zeros((len(idx), L), dtype=torch.long)
            for r, i in enumerate(idx):  # left padding
                p = prompts[i]
                inp[r, L - len(p):] = torch.tensor(p, dtype=torch.long)
                att[r, L - len(p):] = 1
            mnt = max(max_new_tokens[i] for i in idx)
            if mnt <= 0:
                for i in idx:
                    out[i] = []
                continue
            kw = dict(do_sample=temperature > 0, max_new_tokens=mnt, eos_token_id=self.stop_token_ids,
                      pad_token_id=self.pad_id, top_k=0, top_p=1.0,
                      # Each full-mode rank samples its own share on its own plain copy of the policy:
                      # never wait for the other ranks (HF would turn this on by itself under a
                      # DeepSpeed ZeRO-3 config with world size > 1).
                      synced_gpus=False)
            if temperature > 0:
                kw["temperature"] = temperature
            if self._string_stops:
                kw.update(stop_strings=list(self._string_stops), tokenizer=self.tok)
            # the model's device: CPU in toy mode, rank 0's GPU in full mode (stand-ins may have none)
            dev = getattr(self.model, "device", None) or torch.device("cpu")
            with torch.no_grad(), autocast(self.precision, getattr(dev, "type", "cpu")):
                gen = self.model.generate(input_ids=inp.to(dev), attention_mask=att.to(dev),
                                          **kw)[:, L:].cpu()
            for r, i in enumerate(idx):
                out[i] = self._cut(gen[r].tolist(), max_new_tokens[i])
        return out

    def _cut(self, ids: list[int], limit: int) -> list[int]:
        ids = ids[: max(0, limit)]
        for j, t in enumerate(ids):
            if t in self.stop_token_ids:
                return ids[: j + 1]
        if self._string_stops:
            text = self.tok.decode(ids, skip_special_tokens=False)
            if any(s in text for s in self._string_stops):
                lo, hi = 1, len(ids)  # smallest prefix whose text contains a stop string
                while lo < hi:
                    mid = (lo + hi) // 2
                    t = self.tok.decode(ids[:mid], skip_special_tokens=False)
                    if any(s in t for s in self._string_stops):
                        hi = mid
                    else:
                        lo = mid + 1
                return ids[:lo]
        return ids
