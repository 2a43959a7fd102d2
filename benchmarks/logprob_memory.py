"""Peak memory and time of the log-prob pass: the fast path's chunked token_logprobs
(backends/run/fast_logprobs.py) vs the full-logits log_softmax of the plain path (policy.token_logprobs).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Supports the appendix's full-mode setting: Qwen3's vocabulary of 151,936 and packed sequences of up to
26,624 tokens, where the full fp32 logits of one sequence take 26,624 x 151,936 x 4 B = 16 GB. The
SS-GRPO loss (§3.3) needs only log pi of each sampled token, so fast_logprobs.token_logprobs
projects `chunk` positions at a time.

Variants (each in a fresh subprocess, so every peak is its own)
    naive            model(...).logits -> log_softmax over (B, L, V) -> gather
    chunked          fast_logprobs.token_logprobs(model, ids, att, chunk, recompute=False): chunks, but
                     with gradient autograd keeps every chunk's log-softmax for the backward
    chunked_recompute  fast_logprobs.token_logprobs(model, ids, att, chunk, recompute=True), the training
                     default whenever the kept log-softmax would exceed 256 MiB: with gradient
                     each chunk is wrapped in torch.utils.checkpoint and the backward recomputes
                     its logits (without gradient it equals "chunked")
each with mode "nograd" (old / reference log-probs) and "grad" (forward + backward of the
SS-GRPO-like sum_t w_t log pi_t). Memory: CPU = peak RSS (getrusage ru_maxrss) minus the RSS after
the model and inputs exist; GPU = torch.cuda.max_memory_allocated minus the allocation before the
pass. Values and gradients of every variant are compared with "naive" (max abs diff).

Run
    python benchmarks/logprob_memory.py                      # L = 8192, vocab 151,936 (naive: ~15 GB)
    python benchmarks/logprob_memory.py --seq-len 4096 --chunk 256   # ~3 min on 2 CPU cores
    python benchmarks/logprob_memory.py --seq-len 26624 --device cuda   # the paper's pack length
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run.fast_logprobs import token_logprobs  # noqa: E402

VARIANTS = ("naive", "chunked", "chunked_recompute")
MODES = ("nograd", "grad")
QWEN3_VOCAB = 151_936  # PAPER: the Qwen3 policy's vocabulary size


def build_model(vocab: int, seq_len: int, dtype: torch.dtype, device: str):
    """A one-layer, 64-wide Qwen3 with the full vocabulary: the head dominates, as in the 8B model."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128,
                      max_position_embeddings=seq_len + 8, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype)


def naive_logprobs(model, ids, att):
    """Full (B, L, V) logits, one log_softmax, gather; same positions as policy.token_logprobs."""
    pos = (att.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()  # (B, L, V)
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # (B, L)


def worker(a) -> None:
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model = build_model(a.vocab, a.seq_len, dtype, a.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g).to(a.device)
    att = torch.ones_like(ids)
    w = torch.randn(a.batch, a.seq_len, generator=g).to(a.device)  # advantage-like token weights
    fn = {"naive": lambda: naive_logprobs(model, ids, att),
          "chunked": lambda: token_logprobs(model, ids, att, a.chunk, recompute=False),
          "chunked_recompute": lambda: token_logprobs(model, ids, att, a.chunk, recompute=True)}[a.variant]
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    t0 = time.perf_counter()
    if a.mode == "nograd":
        with torch.no_grad():
            lp = fn()
    else:
        lp = fn()
        (lp * w).sum().backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    dt = time.perf_counter() - t0
    res = {"lp": lp.detach().float().cpu()}
    if a.mode == "grad":
        res["grad"] = model.get_input_embeddings().weight.grad.float().cpu()
    torch.save(res, a.out)
    print(json.dumps({"peak_bytes": peak, "seconds": dt}))


def mem_available() -> float | None:
    """MemAvailable in bytes from /proc/meminfo (None elsewhere)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.worker:
        worker(a)
        return 0
    full_bytes = a.batch * a.seq_len * a.vocab * 4  # one fp32 (B, L, V) tensor
    print(f"log-prob pass: batch {a.batch} x {a.seq_len} tokens, vocab {a.vocab:,}, chunk {a.chunk}, "
          f"{a.device} {a.dtype}; one fp32 (B, L, V) tensor = {full_bytes / 2**30:.2f} GiB")
    avail = mem_available() if not a.device.startswith("cuda") else None
    rows, ref = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            for v in a.variants.split(","):
                need = full_bytes * (3 if mode == "grad" else 2) if v == "naive" else 0
                if avail is not None and need > 0.8 * avail:
                    print(f"  {v:18s} {mode:6s} skipped: needs ~{need / 2**30:.1f} GiB, "
                          f"MemAvailable {avail / 2**30:.1f} GiB")
                    continue
                out = os.path.join(tmp, f"{v}-{mode}.pt")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", v,
                       "--mode", mode, "--out", out, "--seq-len", str(a.seq_len), "--batch",
                       str(a.batch), "--vocab", str(a.vocab), "--chunk", str(a.chunk), "--device",
                       a.device, "--dtype", a.dtype, "--threads", str(a.threads)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"  {v:18s} {mode:6s} FAILED: {r.stderr.strip().splitlines()[-1:]}")
                    continue
                m = json.loads(r.stdout.strip().splitlines()[-1])
                res = torch.load(out)
                if v == "naive":
                    ref[mode] = res
                base = ref.get(mode)
                d_lp = (res["lp"] - base["lp"]).abs().max().item() if base else float("nan")
                d_g = ((res["grad"] - base["grad"]).abs().max().item()
                       if base and mode == "grad" else float("nan"))
                row = {"variant": v, "mode": mode, "peak_gib": m["peak_bytes"] / 2**30,
                       "seconds": m["seconds"], "max_abs_diff_lp": d_lp, "max_abs_diff_grad": d_g}
                rows.append(row)
                print(f"  {v:18s} {mode:6s} peak +{row['peak_gib']:6.2f} GiB  {row['seconds']:7.2f} s  "
                      f"max|lp - naive| {d_lp:.2e}" + (f"  max|grad - naive| {d_g:.2e}"
                                                       if mode == "grad" else ""))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
