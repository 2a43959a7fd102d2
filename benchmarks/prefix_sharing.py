"""The reflection GRPO update (§3.4) and the reflection prompts' prefill, with and without sharing the
prompt: backends/run/fast_logprobs.py's pack_rows and segment rows (`fast_logprobs`) and KVSampler's
once-per-distinct-prompt prefill.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Input: a toy run's checkpoint (`<run>/checkpoints/step-N`), which holds the policy (`model/`) and the
pending reflection batch of step N (`state.pt`, "pending": m = 8 candidates behind each of the
step's reflection prompts). For each repetition, alternating:
    update   TorchEngine.update on that batch (the toy preset's SS-GRPO settings: 2 optimizer steps,
             reference and old log-probs), from the same weights and a fresh optimizer, with
             fast_logprobs off and on; the losses must agree (printed)
    prefill  one forward over all the batch's prompts (what a sampler without prompt dedupe does)
             and over its distinct prompts only (what KVSampler does)
Wall seconds, one process, nothing else should run (a 2-core machine: see docs/performance.md).

Run (after any toy run, e.g. `python train.py --toy --run-dir runs/toy`):
    python benchmarks/prefix_sharing.py runs/toy/checkpoints/step-000020 --threads 2 --reps 3
Last line:
    PREFIX_SHARING update_off_s=<median> update_on_s=<median> prefill_all_s=<median> prefill_distinct_s=<median>
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run import presets  # noqa: E402
from backends.run.torch_engine import TorchEngine  # noqa: E402
from policy import UpdateBatch  # noqa: E402
from toy import model as toy_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a toy run's checkpoints/step-N directory")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the toy "
                    "default trains on 2 and samples on 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (alternating)")
    a = ap.parse_args(argv)


    torch.set_num_threads(a.threads)
    model, tok = toy_model.load_policy(os.path.join(a.checkpoint, "model"))
    model.eval()
    pending = torch.load(os.path.join(a.checkpoint, "state.pt"), weights_only=False)["pending"]
    if not pending["sequences"]:
        raise SystemExit(f"{a.checkpoint}: no pending reflection batch (reflection off?)")
    batch = UpdateBatch()
    for seq, mk, adv in zip(pending["sequences"], pending["masks"], pending["advantages"]):
        batch.ids.append(seq)
        batch.mask.append(mk)
        batch.adv.append([adv * x for x in mk])  # train.reflection_update_batch with loss_coef 1
        batch.kind.append("reflection")
    prompts = [s[: len(s) - sum(m)] for s, m in zip(batch.ids, batch.mask)]
    distinct = list({tuple(p): p for p in prompts}.values())
    n_tok = sum(len(s) for s in batch.ids)
    packed = sum(len(p) for p in distinct) + sum(sum(m) for m in batch.mask)
    print(f"threads={torch.get_num_threads()} nproc={os.cpu_count()} sequences={len(batch.ids)} "
          f"distinct_prompts={len(distinct)} tokens={n_tok} candidate_tokens="
          f"{sum(sum(m) for m in batch.mask)} tokens_if_each_prompt_once={packed} "
          f"params={sum(p.numel() for p in model.parameters())} vocab={len(tok)}", flush=True)

    cfg0 = presets.toy_preset().ss_grpo
    times: dict[str, list] = {"update_off": [], "update_on": [], "prefill_all": [],
                              "prefill_distinct": []}
    for rep in range(a.reps):
        stats = {}
        for share in (False, True):
            eng = TorchEngine(copy.deepcopy(model), copy.deepcopy(cfg0), fast=share)
            t = time.perf_counter()
            stats[share] = eng.update(batch, tok.pad_token_id, random.Random(rep))
            times["update_on" if share else "update_off"].append(time.perf_counter() - t)
        diff = max(abs(stats[False][k] - stats[True][k]) for k in stats[False])
        for name, ps in (("prefill_all", prompts), ("prefill_distinct", distinct)):
            L = max(len(p) for p in ps)
            ids = torch.full((len(ps), L), tok.pad_token_id, dtype=torch.long)
            att = torch.zeros((len(ps), L), dtype=torch.long)
            for r, p in enumerate(ps):
                ids[r, L - len(p):] = torch.tensor(p)
                att[r, L - len(p):] = 1
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            t = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=att, position_ids=pos, logits_to_keep=1)
            times[name].append(time.perf_counter() - t)
        print(f"rep {rep}: " + " ".join(f"{k}={v[-1]:.3f}s" for k, v in times.items())
              + f" max|stat off - on|={diff:.2e}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("PREFIX_SHARING " + " ".join(f"{k}_s={v:.3f}" for k, v in med.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
