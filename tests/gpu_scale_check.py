"""Worker of scripts/gpu_smoke.sh, checks "update" and "decode": Qwen3-8B's width and vocabulary at
a few layers, on one GPU, measured at two depths (2 and 8 layers) and extrapolated to Qwen3-8B's 36 layers.

RubricEM (arXiv 2605.10899), appendix: Qwen3-8B, packs of up to 26,624 tokens (8,192 prompt +
18,432 response), gradient checkpointing, bf16. Nothing of the method runs here; this measures what
backends/distributed/plan.py assumes.

usage: python tests/gpu_scale_check.py update|decode OUT_JSON [--layers 2 8] [--tokens 26624]
                                         [--contexts 8192 12288] [--batch 8] [--cpu]
--cpu: the same code on CPU at a width of 256 and a vocabulary of 8,192, to check this worker (no
memory figures; the times are not a GPU's).

update  one forward + backward of the SS-GRPO log-prob path (backends/run/fast_logprobs.token_logprobs:
        head on the loss tokens only, chunked, recomputed in the backward; the model under
        non-reentrant gradient checkpointing, as ZeRO3Policy sets it) over one packed row of
        --tokens tokens whose last 18,432 carry the loss. Peak GPU memory above the weights, per
        depth: with weight gradients (unsharded bf16, as no ZeRO-3 rank holds them), and with the
        weights frozen (the activations alone: gradients flow from the embedding output on). The
        per-layer slope extrapolates to 36 layers: a(36) = a(L1) + (36 - L1) x (a(L2) - a(L1)) /
        (L2 - L1). Also seconds per pass and TFLOP/s at 8 P_active per token (6 for forward and
        backward, 2 for the recompute).
decode  Hugging Face `generate` with a KV cache (greedy, eager decode: no CUDA graphs, unlike vLLM)
        of --batch sequences at each context: seconds per decode step from the time of 33 new
        tokens minus the time of 1 (the prefill), the median of 3, at each depth, extrapolated to
        36 layers the same way; tokens per second = batch / step.

Writes OUT_JSON ({"check", "device", rows per depth, "extrapolated_36"}) and prints one line. Exits 2
without a CUDA device unless --cpu.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=False,
                rms_norm_eps=1e-6, max_position_embeddings=40960)
LAYERS_8B = 36
SMALL = dict(QWEN3_8B, vocab_size=8192, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)  # --cpu
RESPONSE_TOKENS = 18432  # PAPER: rollout.max_response_tokens; the rest of a pack is the prompt
DEV = "cuda"
SHAPE = QWEN3_8B


def build(layers: int):
    """Qwen3-8B's width and vocabulary (SHAPE) with `layers` layers, random bf16 weights built on
    the device DEV."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(num_hidden_layers=layers, **SHAPE)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> int:
    """Reset the device's peak-memory counter; the bytes allocated now (0 on CPU)."""
    if DEV != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_since(base: int) -> int | None:
    """Peak bytes allocated above `base` since reset_peak (None on CPU: not measured)."""
    return torch.cuda.max_memory_allocated() - base if DEV == "cuda" else None


def n_params(model) -> tuple[int, int]:
    """(all parameters, those a token's forward multiplies: all but the input embedding)."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def update_row(layers: int, tokens: int) -> dict:
    """One forward + backward at `layers` layers over one row of `tokens` tokens (see module doc):
    first with weight gradients (the update as it runs, unsharded), then with the weights frozen and
    the gradient taken from the embedding output on (the activations alone: checkpointed layer
    inputs, the recomputed layer, the head's chunks)."""
    from backends.run import fast_logprobs

    model = build(layers)
    model.train()
    kw = {"use_reentrant": False}  # as ZeRO3Policy: the variant ZeRO-3's hooks support
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.config.use_cache = False
    P, P_active = n_params(model)
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(1, SHAPE["vocab_size"], (1, tokens), device=DEV, generator=g)
    att = torch.ones_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, -min(RESPONSE_TOKENS, tokens - 1):] = True

    def one_pass() -> tuple[float, int | None, float]:
        model.zero_grad(set_to_none=True)
        base = reset_peak()
        t0 = time.perf_counter()
        lp = fast_logprobs.token_logprobs(model, ids, att, chunk_size=1024, recompute=True,
                                          loss_mask=mask)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        sync()
        return time.perf_counter() - t0, peak_since(base), float(loss.detach())

    one_pass()  # warms up kernels and the allocator
    pass_s, peak, loss = one_pass()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(False)
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: o.requires_grad_(True))
    _, act, _ = one_pass()
    hook.remove()
    # Eq.: training FLOPs per token = 6 P_active (forward + backward) + 2 P_active (recompute)
    flops = 8 * P_active * tokens
    row = {"layers": layers, "params": P, "tokens": tokens, "loss_tokens": int(mask.sum()),
           "weights_gib": weights / 2**30, "grads_gib": grads / 2**30,
           "peak_above_weights_gib": None if peak is None else peak / 2**30,
           "activations_gib": None if act is None else act / 2**30,  # weights frozen: no gradients
           "pass_s": pass_s, "tflops": flops / pass_s / 1e12, "loss": loss}
    return row  # the model goes with this frame (main empties the cache before the next depth)


def decode_row(layers: int, contexts: list[int], batch: int, repeats: int = 3) -> dict:
    """Seconds per decode step at each context (see module doc): the median over `repeats` timed
    pairs, after one warm-up pair."""
    model = build(layers).eval()
    model.generation_config.pad_token_id = 0
    out = {"layers": layers, "batch": batch, "step_s": {}, "prefill_s": {}}
    for ctx in contexts:
        g = torch.Generator(device=DEV).manual_seed(ctx)
        ids = torch.randint(1, SHAPE["vocab_size"], (batch, ctx), device=DEV, generator=g)
        att = torch.ones_like(ids)
        steps, prefills = [], []
        for rep in range(repeats + 1):
            t = {}
            for new in (1, 33):
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=att, max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False)
                sync()
                t[new] = time.perf_counter() - t0
            if rep:  # rep 0 warms up
                # Eq.: decode step = (t(33 new) - t(1 new, the prefill)) / 32
                steps.append((t[33] - t[1]) / 32)
                prefills.append(t[1])
        out["step_s"][str(ctx)] = sorted(steps)[len(steps) // 2]
        out["prefill_s"][str(ctx)] = sorted(prefills)[len(prefills) // 2]
    del model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return out


def extrapolate(a: float, b: float, la: int, lb: int, to: int = LAYERS_8B) -> float:
    """Linear in depth through (la, a) and (lb, b), at `to` layers."""
    # Eq.: f(36) = f(L1) + (36 - L1) (f(L2) - f(L1)) / (L2 - L1)
    return a + (to - la) * (b - a) / (lb - la)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=["update", "decode"])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 8])
    ap.add_argument("--tokens", type=int, default=26624)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 12288])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)
    global DEV, SHAPE
    if a.cpu:
        DEV, SHAPE = "cpu", SMALL
    elif not torch.cuda.is_available():
        print("no CUDA device: this check measures a GPU (--cpu checks the worker)")
        return 2
    l1, l2 = a.layers
    res = {"check": a.check, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (small width)"}
    if a.check == "update":
        rows = []
        for L in (l1, l2):
            rows.append(update_row(L, a.tokens))
            if DEV == "cuda":
                torch.cuda.empty_cache()
        acts = [r["activations_gib"] for r in rows]
        act = None if None in acts else extrapolate(acts[0], acts[1], l1, l2)
        sec = extrapolate(rows[0]["pass_s"], rows[1]["pass_s"], l1, l2)
        res.update(rows=rows, extrapolated_36={"activations_gib": act, "pass_s": sec})
        peaks = [r["peak_above_weights_gib"] for r in rows]
        pk = None if None in peaks else extrapolate(peaks[0], peaks[1], l1, l2)
        gib = "n/a" if act is None else (
            f"{acts[0]:.2f} / {acts[1]:.2f} GiB at {l1} / {l2} layers -> {act:.2f} GiB at 36 (with unsharded "
            f"weight gradients {peaks[0]:.2f} / {peaks[1]:.2f} -> {pk:.2f} GiB)")
        res["extrapolated_36"]["peak_above_weights_gib"] = pk
        print(f"update at {a.tokens} tokens, {res['device']}: activations {gib}; "
              f"pass {rows[0]['pass_s']:.2f} / {rows[1]['pass_s']:.2f} s -> {sec:.1f} s at 36 "
              f"({rows[1]['tflops']:.0f} TFLOP/s at {l2} layers)")
    else:
        rows = [decode_row(L, a.contexts, a.batch) for L in (l1, l2)]
        ext = {c: extrapolate(rows[0]["step_s"][str(c)], rows[1]["step_s"][str(c)], l1, l2)
               for c in a.contexts}
        res.update(rows=rows, extrapolated_36={"step_s": {str(c): s for c, s in ext.items()},
                                               "tokens_per_s": {str(c): a.batch / s for c, s in ext.items()}})
        print("decode (HF generate, eager), batch " + str(a.batch) + ": " + "; ".join(
            f"{c} context: {rows[0]['step_s'][str(c)] * 1e3:.1f} / {rows[1]['step_s'][str(c)] * 1e3:.1f} ms "
            f"per step at {l1} / {l2} layers -> {ext[c] * 1e3:.1f} ms at 36 ({a.batch / ext[c]:.0f} tokens/s)"
            for c in a.contexts))
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
