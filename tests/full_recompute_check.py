"""Worker of tests/test_full_memory.py: which LM-head path does backends/run/fast_logprobs.token_logprobs
take under ZeRO-3?

usage: torchrun --nproc_per_node 2 tests/full_recompute_check.py MODEL_DIR OUT_DIR THRESHOLD_BYTES [MIN_LEN MAX_LEN]
One SS-GRPO update (§3.3; one optimizer step, micro-batch 2, no reference model) of a ZeRO-3 policy on a
synthetic batch, with fast_logprobs.RECOMPUTE_ABOVE_BYTES = THRESHOLD_BYTES. Every `_recompute_head`
decision is recorded (the head weight's local shape, the vocabulary the decision read, positions,
whether gradients were recorded, the verdict), and every chunk projection as "recompute" (under
torch.utils.checkpoint) or "plain"; and one decision outside the forward, where the head is an
empty ZeRO-3 partition (shape (0,)), for just enough positions (with gradient) to pass the threshold. Each rank writes OUT_DIR/rank<R>.json.
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
from backends.run import fast_logprobs  # noqa: E402
import policy  # noqa: E402


def main(model_dir: str, out_dir: str, threshold: int, min_len: int = 40, max_len: int = 56) -> None:
    env = dist.init_distributed()
    fast_logprobs.RECOMPUTE_ABOVE_BYTES = int(threshold)
    decisions, calls = [], {"recompute": 0, "plain": 0}
    decide, project = fast_logprobs._recompute_head, fast_logprobs._project

    def spy_decide(head, hidden, positions):
        verdict = decide(head, hidden, positions)
        decisions.append({"local_rows": int(head.weight.shape[0]),
                          "rows": fast_logprobs.head_rows(head),
                          "status": str(getattr(head.weight, "ds_status", None)),
                          "persist": bool(getattr(head.weight, "ds_persist", False)),
                          "positions": int(positions), "verdict": bool(verdict),
                          "grad": bool(torch.is_grad_enabled() and hidden.requires_grad)})
        return verdict

    def spy_project(weight, bias, h, nxt, recompute, temperature=1.0):
        calls["recompute" if recompute else "plain"] += 1
        return project(weight, bias, h, nxt, recompute, temperature)

    fast_logprobs._recompute_head, fast_logprobs._project = spy_decide, spy_project
    cfg = selftest.selftest_config(8, 4, 1, 2, 1e-3)
    cfg.ss_grpo.beta = 0.0  # no reference model: the policy's passes are what we watch
    ds = full_settings.deepspeed_config(cfg, env.world_size, dist.device_kind(), full_settings.FullConfig())
    pol = zero3.ZeRO3Policy.from_pretrained(model_dir, ds, cfg.ss_grpo.lr)
    vocab = pol.module.config.vocab_size
    batch = selftest.synthetic_batch(vocab, 8, group=4, seed=0, min_len=min_len, max_len=max_len)
    engine = ZeRO3Engine(cfg, policy=pol)
    shards, plans = policy.plan_update(batch, env.world_size, 1, 2, random.Random(0))
    # Outside the engine's forward the head is an empty ZeRO-3 partition (inside it, DeepSpeed has
    # gathered it for the ChunkedHead's call): the decision must still see the true vocabulary.
    head = pol.module.get_output_embeddings()
    h = torch.zeros(4, pol.module.config.hidden_size, requires_grad=True, device=pol.device)
    # positions x V x 4 B just above it
    n_pos = fast_logprobs.RECOMPUTE_ABOVE_BYTES // (4 * vocab) + 1
    outside = {"local_rows": int(head.weight.shape[0]), "rows": fast_logprobs.head_rows(head),
               "positions": n_pos, "verdict": bool(decide(head, h, n_pos))}
    st = policy.policy_update(engine, shards[env.rank], cfg.ss_grpo, 0, plans[env.rank])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as fh:
        json.dump({"vocab": vocab, "outside": outside, "decisions": decisions, "calls": calls, "stats": st,
                   "world_size": env.world_size, "device": dist.device_kind(),
                   "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2 ** 30
                   if torch.cuda.is_available() else None}, fh, default=float)
    dist._shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *[int(x) for x in sys.argv[4:6]])
    dist.exit_process(0)
