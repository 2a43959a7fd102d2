"""Rollout phase of a toy step (§3.1-3.2, Algorithm 1 step 3) with each sampler: hf_sampler.HFSampler
(HF generate) and kv_sampler.KVSampler, alternating, on the same queries and policy.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The policy is the toy SFT warm start of the configuration given by the command line (train.py's
flags; its cache is reused, or trained once), the queries one toy batch, and each repetition samples
`rollout.prompts_per_step` x `rollout.n` multi-turn rollouts (tool calls through the toy BM25 tool) at
the configured temperature. Reported per sampler: wall seconds, process CPU seconds (far less
sensitive than wall time to other processes on the cores), tokens, tool calls.

Run (the toy preset's rollout shape on the tests' small warm start):
    python benchmarks/toy_rollouts.py --reps 2 -- --toy --set world.n_train_entities=40 \\
        --set sft.steps=2 --set sft.n_trajectories=40 --set 'toy_model.size="XS"' --set toy_model.vocab_size=400
Last line:
    TOY_ROLLOUTS hf_cpu_s=<median> kv_cpu_s=<median> speedup=<hf/kv>
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run import build, cli  # noqa: E402
from scaffold import RolloutEngine, system_prompt  # noqa: E402
from toy.hf_sampler import HFSampler  # noqa: E402
from toy.kv_sampler import KVSampler  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="repetitions per sampler (alternating)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py flags after --")
    a = ap.parse_args(argv)



    cfg = cli.parse_args([x for x in a.train_args if x != "--"])
    cfg.progress = False
    torch.set_num_threads(cfg.threads)
    world, tool, train_q, _ = build.build_environment(cfg)
    model, tok, _ = build.setup_policy(cfg, world, tool)
    model.eval()
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    queries = train_q[: cfg.rollout.prompts_per_step]
    res: dict[str, list] = {"hf": [], "kv": []}
    print(f"threads={torch.get_num_threads()} sample_threads={cfg.sample_threads} "
          f"nproc={os.cpu_count()} queries={len(queries)} n={cfg.rollout.n} "
          f"max_response_tokens={cfg.rollout.max_response_tokens} "
          f"params={sum(p.numel() for p in model.parameters())} vocab={len(tok)}", flush=True)
    for rep in range(a.reps):
        for name, cls in (("hf", HFSampler), ("kv", KVSampler)):
            engine = RolloutEngine(cls(model, tok, threads=cfg.sample_threads), tok,
                                   {tool.name: tool}, cfg.rollout.max_response_tokens,
                                   cfg.rollout.max_tool_calls, system, cfg.rollout.temperature)
            torch.manual_seed(cfg.seed * 7919 + rep)
            c0, t0 = time.process_time(), time.perf_counter()
            ros = engine.run(queries, n=cfg.rollout.n)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(r.response_ids) for r in ros)
            calls = sum(r.n_tool_calls for r in ros)
            res[name].append(cpu)
            print(f"[{name} rep {rep}] wall_s={dt:.2f} cpu_s={cpu:.2f} cpu_util={cpu / dt:.2f} "
                  f"tokens={tokens} tool_calls={calls} load1={os.getloadavg()[0]:.2f}", flush=True)
    hf, kv = statistics.median(res["hf"]), statistics.median(res["kv"])
    print(f"TOY_ROLLOUTS hf_cpu_s={hf:.2f} kv_cpu_s={kv:.2f} speedup={hf / kv:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
