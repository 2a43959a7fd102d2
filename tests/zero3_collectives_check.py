"""Worker of tests/test_zero3_collectives.py: ZeRO-3 passes whose ranks hold different numbers of
loss tokens, so that the chunked LM head (backends/run/fast_logprobs.py, chunk size CHUNK) has a
different number of chunks on each rank.

usage: torchrun --standalone --nproc_per_node 2 tests/zero3_collectives_check.py MODEL_DIR OUT_DIR
Every collective times out after one minute (dist.init_distributed), so a rank that waits for a
gather the other never makes fails the launch instead of hanging it. On each rank, in order:
  (b) reference passes (FrozenReference.logprobs) of `ref_inputs(rank)`: 5 chunks against 1, 3
      against 0 loss tokens, and all columns of 2 x 30 tokens against a 2-token pass;
      OUT_DIR/ref_rank<R>.pt holds the inputs and log-probs;
  (a) two SS-GRPO updates (§3.3; policy.policy_update through ZeRO3Engine, ZeRO3Policy and the
      FrozenReference) of `rl_batch`: two optimizer steps, so an old pass, a reference pass and
      gradient passes, with 7 chunks against 4 and 2 against 0 loss tokens; the first update with
      the head recomputed in the backward (RECOMPUTE_ABOVE_BYTES = 0), the second without;
      OUT_DIR/rl (weights), rl_stats.json (per-step statistics, rank 0);
  (c) one SFT step (backends/sft/zero3.train) of `sft_examples`: dealt 1 / 2 over the ranks (6 chunks
      and a padding pass against 1 + 2 chunks), with the DeepSpeed optimizer entry of a GPU run;
      OUT_DIR/sft (weights), sft_records.json (rank 0: the step records, the optimizer's class).
"""
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.distributed import dist, selftest, zero3  # noqa: E402
from backends.distributed.engine import ZeRO3Engine  # noqa: E402
from backends.run import fast_logprobs  # noqa: E402
from backends.scale import settings as full_settings  # noqa: E402
import policy  # noqa: E402

CHUNK = 8  # positions per head chunk (micro-batch 1: rows per chunk)
LR = 1e-3
PAD = 0


def rl_config():
    """The full preset with 4 sequences, 2 optimizer steps of 2, micro-batch 1, lr LR (pi_ref on)."""
    return selftest.selftest_config(4, 2, 2, 1, LR)


def _sequence(g, vocab: int, length: int, loss: list) -> tuple[list, list, list]:
    """(ids, mask, advantages) of one sequence: random ids, mask 1 on the positions in `loss`."""
    ids = torch.randint(1, vocab, (length,), generator=g).tolist()
    mask = [1 if t in loss else 0 for t in range(length)]
    adv = [float(a) * m for a, m in zip(torch.randn(length, generator=g).tolist(), mask)]
    return ids, mask, adv


def rl_batch(vocab: int) -> policy.UpdateBatch:
    """4 sequences: 60 tokens with 50 loss tokens, 14 with none, 44 with 30, 20 with 9. plan_update
    (2 ranks, 2 optimizer steps, no shuffle) gives step 0 the first and third (rank 0: 50 loss
    tokens = 7 chunks of CHUNK, rank 1: 30 = 4) and step 1 the others (rank 0: 9 = 2 chunks, rank 1:
    0 loss tokens)."""
    g = torch.Generator().manual_seed(1)
    out = policy.UpdateBatch()
    for length, loss in ((60, range(8, 58)), (14, ()), (44, range(10, 40)), (20, range(10, 19))):
        ids, mask, adv = _sequence(g, vocab, length, list(loss))
        out.ids.append(ids)
        out.mask.append(mask)
        out.adv.append(adv)
        out.kind.append("task")
    return out


def ref_inputs(rank: int, vocab: int) -> list[tuple]:
    """This rank's reference passes: (ids (B, L), att (B, L), loss mask (B, L) bool or None)."""
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for n_loss in ((40, 17) if rank == 0 else (8, 0)):  # 5 chunks vs 1, then 3 vs 0
        ids = torch.randint(1, vocab, (1, 48), generator=g)
        mask = torch.zeros(1, 48, dtype=torch.bool)
        mask[0, 48 - n_loss:] = True
        out.append((ids, torch.ones_like(ids), mask))
    B, L = (2, 30) if rank == 0 else (1, 2)  # every column: 8 chunks of 2 x 4 vs 1
    ids = torch.randint(1, vocab, (B, L), generator=g)
    out.append((ids, torch.ones_like(ids), None))
    return out


def sft_examples(vocab: int) -> list[tuple[list, list]]:
    """3 SFT examples (ids, loss mask): 60 tokens with 45 loss tokens, 20 with 9, 12 with 5.
    backends/sft/pack.deal gives the first to rank 0 and the other two to rank 1."""
    g = torch.Generator().manual_seed(2)
    out = []
    for length, loss in ((60, range(15, 60)), (20, range(11, 20)), (12, range(7, 12))):
        ids, mask, _ = _sequence(g, vocab, length, list(loss))
        out.append((ids, mask))
    return out


def sft_config():
    """One SFT step of all 3 examples, lr LR from the first step (no warm-up), fp32, with the
    optimizer of a GPU run: DeepSpeed's AdamW entry, not offloaded (backends/sft/zero3.py makes it
    torch's AdamW through "torch_adam")."""
    from backends.sft.zero3 import SFTRunConfig

    return SFTRunConfig(epochs=1, lr=LR, warmup_frac=0.0, batch=3, micro_batch=1, max_len=128,
                        bf16="off", max_steps=1, optimizer="deepspeed")


def main(model_dir: str, out_dir: str) -> None:
    from backends.sft import zero3 as sft_zero3

    env = dist.init_distributed(timeout_min=1.0)
    rank, world = env.rank, env.world_size
    os.makedirs(out_dir, exist_ok=True)
    cfg = rl_config()
    full = full_settings.FullConfig(logprob_chunk=CHUNK)
    ds = full_settings.deepspeed_config(cfg, world, dist.device_kind(), full)

    # (b) the reference passes
    ref = zero3.FrozenReference.from_pretrained(model_dir, ds, chunk_size=CHUNK)
    vocab = ref.engine.module.lm.config.vocab_size
    passes = ref_inputs(rank, vocab)
    ref_out = [ref.logprobs(ids, att, mask).cpu() for ids, att, mask in passes]
    torch.save({"inputs": passes, "logprobs": ref_out}, os.path.join(out_dir, f"ref_rank{rank}.pt"))
    dist.rank0_print("reference passes done")

    # (a) two RL updates, the head recomputed in the backward in the first, not in the second
    pol = zero3.ZeRO3Policy.from_pretrained(model_dir, ds, cfg.ss_grpo.lr, full=full)
    engine = ZeRO3Engine(cfg, policy=pol, ref=ref)
    shards, plans = policy.plan_update(rl_batch(vocab), world, cfg.ss_grpo.minibatches,
                                       cfg.ss_grpo.micro_batch)
    per_step = []
    for threshold in (0, 2 ** 62):
        fast_logprobs.RECOMPUTE_ABOVE_BYTES = threshold
        policy.policy_update(engine, shards[rank], cfg.ss_grpo, PAD, plans[rank], per_step)
        dist.rank0_print(f"update done (RECOMPUTE_ABOVE_BYTES = {threshold})")
    fast_logprobs.RECOMPUTE_ABOVE_BYTES = 0  # (c) recomputes too
    pol.save_pretrained(os.path.join(out_dir, "rl"))
    if rank == 0:
        with open(os.path.join(out_dir, "rl_stats.json"), "w") as fh:
            json.dump(per_step, fh)

    # (c) one SFT step
    scfg = sft_config()
    sds, sfull = sft_zero3.sft_deepspeed_config(scfg, world, dist.device_kind())
    sft_pol = zero3.ZeRO3Policy.from_pretrained(model_dir, sds, scfg.lr,
                                                full=dataclasses.replace(sfull, logprob_chunk=CHUNK))
    records = sft_zero3.train(sft_pol, sft_examples(vocab), scfg, rank, world, PAD)
    sft_pol.save_pretrained(os.path.join(out_dir, "sft"))
    if rank == 0:
        with open(os.path.join(out_dir, "sft_records.json"), "w") as fh:
            json.dump({"records": records, "optimizer": sft_pol.optimizer_name}, fh)
    dist._shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    dist.exit_process(0)
