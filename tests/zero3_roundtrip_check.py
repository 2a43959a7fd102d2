"""Worker of scripts/gpu_smoke.sh, check "save-load": a DeepSpeed ZeRO-3 save / load round trip of
the RL engine's training state, bitwise (what backends/distributed/engine.py's save_state and load
call: `engine.save_checkpoint(dir, tag="state")`, `engine.load_checkpoint(..., load_optimizer_states=True)`).

usage: python -m torch.distributed.run --nproc_per_node N tests/zero3_roundtrip_check.py MODEL_DIR WORKDIR

On every rank: the full preset's DeepSpeed config on this device (ZeRO-3, optimizer offloaded:
DeepSpeedCPUAdam where it builds), one SS-GRPO update (policy.policy_update, so the Adam moments are
not zero), save; then a second engine built from MODEL_DIR loads the checkpoint. Compared bitwise
(torch.equal): every gathered weight, and every tensor of the ZeRO-3 optimizer's state_dict (fp32
master partitions, Adam moments, step). Rank r writes WORKDIR/rank{r}.json; rank 0 prints one line.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.distributed import dist, selftest  # noqa: E402
from backends.distributed.engine import ZeRO3Engine  # noqa: E402
from backends.distributed.zero3 import ZeRO3Policy  # noqa: E402
from backends.scale.settings import FullConfig, deepspeed_config  # noqa: E402
import policy  # noqa: E402


def tensors(obj, prefix: str = "") -> dict:
    """Every tensor inside a nested dict / list / tuple, by its path (a state_dict's leaves)."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}/{i}"))
    return out


def snapshot(pol: ZeRO3Policy) -> tuple[dict, dict]:
    """(gathered weights on CPU, the optimizer state's tensors on CPU)."""
    weights = {n: t.cpu() for n, t in pol.iter_full_params(device="cpu")}
    return weights, tensors(pol.optimizer.state_dict())


def main(model_dir: str, workdir: str) -> None:
    env = dist.init_distributed()
    cfg = selftest.selftest_config(8, 2, 1, 2, 1e-3)
    cfg.ss_grpo.beta = 0.0  # no reference model: the optimizer state is what is checked
    full = FullConfig()
    ds = deepspeed_config(cfg, env.world_size, dist.device_kind(), full)
    pol = ZeRO3Policy.from_pretrained(model_dir, ds, cfg.ss_grpo.lr, full=full)
    init = {n: t.cpu() for n, t in pol.iter_full_params(device="cpu")}
    batch = selftest.synthetic_batch(pol.module.config.vocab_size, 8, 2, seed=0, min_len=16, max_len=24)
    shards, plans = policy.plan_update(batch, env.world_size, 1, 2, random.Random(0))
    policy.policy_update(ZeRO3Engine(cfg, policy=pol), shards[env.rank], cfg.ss_grpo,
                         pol.module.config.pad_token_id or 0, plans[env.rank])
    d = os.path.join(workdir, "zero")
    t0 = time.perf_counter()
    pol.engine.save_checkpoint(d, tag="state")
    save_s = time.perf_counter() - t0
    w1, o1 = snapshot(pol)
    moved = max((w1[k].float() - init[k].float()).abs().max().item() for k in w1)
    again = ZeRO3Policy.from_pretrained(model_dir, ds, cfg.ss_grpo.lr, full=full)
    t0 = time.perf_counter()
    again.engine.load_checkpoint(d, tag="state", load_optimizer_states=True, load_lr_scheduler_states=False)
    load_s = time.perf_counter() - t0
    w2, o2 = snapshot(again)
    res = {"rank": env.rank, "world_size": env.world_size, "optimizer": pol.optimizer_name,
           "weights": len(w1), "weights_equal": w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1),
           "optimizer_tensors": len(o1),
           "optimizer_equal": o1.keys() == o2.keys() and all(torch.equal(o1[k], o2[k]) for k in o1),
           "moved": moved, "save_s": save_s, "load_s": load_s}
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, f"rank{env.rank}.json"), "w") as fh:
        json.dump(res, fh)
    if env.is_rank0:
        print(json.dumps(res))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
