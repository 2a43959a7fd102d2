"""Worker of tests/test_update_faults.py: the SS-GRPO update (§3.3) on a real DeepSpeed ZeRO-3 engine,
one CPU rank (a plain process becomes rank 0 of 1, dist.init_distributed).

usage: python tests/zero3_update_check.py MODEL_DIR OUT_JSON
MODEL_DIR: a tiny Qwen3 with attention_dropout > 0. Two updates of two optimizer steps each on one
batch: (1) as is, recording max |log rho| and the clip fraction of every loss call; (2) with the
old log-probs 60 nats below the current ones (rho = e^60 on the second optimizer step, whose
sequences have an old pass: its fp32 gradient norm overflows; the first step is on-policy by
construction). Writes the stats of both, whether the weights after (2) are finite and equal to
those after (1), the dropout settings of the engine's model and DeepSpeed's skipped-step count.
"""
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.scale import settings as full_settings  # noqa: E402
from backends.distributed.engine import ZeRO3Engine  # noqa: E402
from backends.distributed import dist, selftest, zero3  # noqa: E402
import policy  # noqa: E402
import ss_grpo  # noqa: E402


def main(model_dir: str, out_path: str) -> None:
    dist.init_distributed()
    cfg = selftest.selftest_config(8, 2, 2, 4, 1e-3, eta=0.02)
    cfg.ss_grpo.beta = 0.0  # no reference model: nothing here needs one
    ds = full_settings.deepspeed_config(cfg, 1, "cpu", full_settings.FullConfig())
    pol = zero3.ZeRO3Policy.from_pretrained(model_dir, ds, cfg.ss_grpo.lr)
    seen = []
    loss_fn = ss_grpo.ss_grpo_loss

    def recorded(logp, old_logp, ref_logp, adv, mask, **kw):
        loss, st = loss_fn(logp, old_logp, ref_logp, adv, mask, **kw)
        seen.append([(logp.detach() - old_logp)[mask.bool()].abs().max().item(),
                     float(st["clip_frac"])])
        return loss, st

    ss_grpo.ss_grpo_loss = recorded
    batch = selftest.synthetic_batch(pol.module.config.vocab_size, 8, group=2, seed=0, min_len=16,
                                 max_len=24)
    engine = ZeRO3Engine(cfg, policy=pol)
    shards, plans = policy.plan_update(batch, 1, 2, 4, random.Random(0))
    st1 = policy.policy_update(engine, shards[0], cfg.ss_grpo, 0, plans[0])
    w1 = dict(pol.iter_full_params(device="cpu"))
    scored = policy.sequence_logprobs
    policy.sequence_logprobs = lambda fn, *a: [x - 60.0 for x in scored(fn, *a)]
    st2 = policy.policy_update(engine, shards[0], cfg.ss_grpo, 0, plans[0])
    w2 = dict(pol.iter_full_params(device="cpu"))
    attn = pol.module.model.layers[0].self_attn
    res = {"seen": seen, "first": st1, "overflow": st2,
           "finite": all(bool(torch.isfinite(t).all()) for t in w2.values()),
           "unchanged": all(torch.equal(w1[k], w2[k]) for k in w1),
           "attention_dropout": [attn.attention_dropout, pol.module.config.attention_dropout],
           "skipped_steps": pol.engine.skipped_steps}
    with open(out_path, "w") as fh:
        json.dump(res, fh, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
