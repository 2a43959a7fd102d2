"""Process CPU seconds of the pieces of one GRPO step on the TRL baseline's model and batch shape.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Sampling (§3.1): one token draw over (32, 8192) probabilities with torch.multinomial (HF generate's
draw) and with kv_sampler.draw_inverse_cdf, next to one lm-head projection of 32 rows. Update (§3.3,
policy.policy_update's work on 32 sequences of 28 prompt + 128 response tokens): the reference
forward (policy.batch_logprobs), the policy forward (fast_logprobs.token_logprobs with gradient,
with and without its lm-head recompute) and the backward of the SS-GRPO loss, AdamW's step. Token
advantages of a toy step (one ss_grpo.token_advantages call per rollout, as the loop, against one
call). CPU seconds, because on a shared machine they change far less than wall seconds.

Run:
    python benchmarks/cpu_parts.py --threads 1
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import policy  # noqa: E402
import ss_grpo  # noqa: E402
import step_vs_trl as svt  # noqa: E402
from backends.run import fast_logprobs  # noqa: E402
from toy.kv_sampler import draw_inverse_cdf  # noqa: E402


def cpu(f, n: int = 1):
    """(result of the last call, CPU seconds per call)."""
    c = time.process_time()
    for _ in range(n):
        r = f()
    return r, (time.process_time() - c) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bench-dir", default=os.environ.get("RUBRICEM_BENCH_DIR", ""))
    a = ap.parse_args(argv)
    svt._stand_ins()
    h = svt.load_harness(svt.find_bench_dir(a.bench_dir), svt.parse_args(["--threads", str(a.threads)]))
    torch.set_num_threads(a.threads)
    tok, _ = h.build_tokenizer(0, h.ARGS.vocab_size)
    model = h.build_model(tok, h.ARGS).eval()
    ref = copy.deepcopy(model)
    probs = torch.softmax(torch.randn(32, len(tok)), dim=-1)
    hidden = torch.randn(32, model.config.hidden_size)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for name, f in (("multinomial", lambda: torch.multinomial(probs, 1)),
                        ("inverse_cdf", lambda: draw_inverse_cdf(probs)),
                        ("lm_head_32_rows", lambda: head(hidden))):
            f()
            print(f"sampling {name}: {cpu(f, 200)[1] * 1e3:.3f} ms CPU per call", flush=True)
    g = torch.Generator().manual_seed(0)
    ub = policy.UpdateBatch()
    for i in range(32):
        P, C = 28, 128
        ub.ids.append(torch.randint(3, len(tok), (P + C,), generator=g).tolist())
        ub.mask.append([0] * P + [1] * C)
        ub.adv.append([0.0] * P + [float(i % 3 - 1)] * C)
        ub.kind.append("task")
    ids, att, mask, adv = policy.pad_rows(ub, list(range(32)), tok.pad_token_id)
    for rep in range(a.reps):
        _, t_ref = cpu(lambda: policy.batch_logprobs(ref, ub, tok.pad_token_id, 32))
        for rc in (True, False):
            model.train()
            logp, t_f = cpu(lambda: fast_logprobs.token_logprobs(model, ids, att, recompute=rc))
            loss, _ = ss_grpo.ss_grpo_loss(logp, logp.detach(), logp.detach(), adv, mask,
                                           agg="seq_mean_token_mean")
            _, t_b = cpu(lambda: loss.backward())
            model.zero_grad(set_to_none=True)
            model.eval()
            print(f"update rep {rep} recompute={rc}: reference forward {t_ref:.3f} s, policy forward "
                  f"{t_f:.3f} s, backward {t_b:.3f} s (CPU)", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    print(f"update AdamW step: {cpu(opt.step)[1]:.3f} s (CPU)")
    token_advantage_parts()
    return 0


def token_advantage_parts(n: int = 64, P: int = 40, T: int = 300) -> None:
    """Token advantages of a toy step's n rollouts (P prompt + T response tokens): one
    ss_grpo.token_advantages call per rollout, as the training loop makes them, against one call."""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(n, 4, generator=g)  # (n, K)
    stages = [sorted(torch.randint(0, 4, (T,), generator=g).tolist()) for _ in range(n)]

    def per_rollout():
        return [ss_grpo.token_advantages(A[i:i + 1], torch.tensor([-1] * P + stages[i])[None],
                                         torch.tensor([0] * P + [1] * T)[None])[0].tolist()
                for i in range(n)]

    def batched():
        st = torch.full((n, P + T), -1)
        st[:, P:] = torch.tensor(stages)
        mk = torch.zeros((n, P + T), dtype=torch.long)
        mk[:, P:] = 1
        return [row.tolist() for row in ss_grpo.token_advantages(A, st, mk)]

    assert per_rollout() == batched()
    for name, f in (("per rollout", per_rollout), ("batched", batched)):
        print(f"token advantages {name}: {cpu(f, 20)[1] * 1e3:.2f} ms CPU per step "
              f"({n} rollouts of {P} + {T} tokens)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
