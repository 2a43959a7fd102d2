"""Full mode at 4 ZeRO-3 ranks and across 2 nodes, on CPU (gloo): `train.py --full` as in
tests/test_full_mode.py (its helpers: the tiny SFT-started Qwen3, DR Tulu-schema rows in a local
JSONL file, loopback Gemini judge and Serper search), at more ranks than its 2.

One module-scoped fixture runs, each as a subprocess:
  * the one-process reference (`--set engine="torch"`), 2 RL steps;
  * `torchrun --standalone --nproc_per_node 4`: rank 0 receives the other 3 ranks' rollout groups on
    3 threads at once (engine.ZeRO3Engine.sample_shards, one 2-member side group per rank);
  * `torchrun --nnodes 2 --nproc_per_node 2 --node_rank {0,1} --master_addr 127.0.0.1` started twice
    (a second node whose ranks 2 and 3 have LOCAL_RANK 0 and 1), stopped after step 1 and resumed
    from the checkpoint both nodes wrote. Each node has its own scratch (TMPDIR, caches, cache_dir);
    the run directory, with its checkpoints, is shared, as docs/full_mode.md asks of a multi-node
    run. Node 1 is offline and sees no rows: its data.source is the hub id, under HF_HUB_OFFLINE with
    an empty HF cache, so any rank there that read rows would stop the run.
Checks: the 4-rank runs log the one-process run's metrics (update statistics within rtol 1e-4,
everything else equal: tests/test_full_mode.py's assert_same_run); the 2-node run, stopped and
resumed, equals the 4-rank run bit for bit (metrics but time/* and judge/http/*, final weights); every duty sits on
the rank or node it belongs to. The policy is tiny and responses short (96 tokens, 16 for
reflections), so every update pass stays far below 1,024 loss tokens. ~2-4 min on 2 busy cores.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import test_full_mode as fm
from backends.distributed.dist import free_port
from backends.run.data import PAPER_RL_DATA
from loopback import FakeServer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not fm.HAVE_DS, reason="deepspeed and accelerate are "
                                                   "not installed (DS_BUILD_OPS=0 pip install deepspeed accelerate)")]
ROOT = fm.ROOT
# 4 prompts x 2 rollouts: every one of 4 ranks samples a group (shard), 8 sequences per step as in
# tests/test_full_mode.py
SHAPE = ("--set", "rollout.prompts_per_step=4", "--set", "rollout.n=2")


def _node_env(scratch) -> dict:
    """A node's own scratch: temporary files, the HF / torch-extension / Triton caches."""
    env = {}
    for var, sub in (("TMPDIR", "tmp"), ("XDG_CACHE_HOME", "xdg-cache"), ("HF_HOME", "hf"),
                     ("TORCH_EXTENSIONS_DIR", "torch-extensions"), ("TRITON_CACHE_DIR", "triton"),
                     ("RUBRICEM_GROUP_TIMEOUT_DIR", "groups")):
        os.makedirs(scratch / sub, exist_ok=True)
        env[var] = str(scratch / sub)
    return env


def _two_nodes(tmp, name, model, rows, *extra, timeout=fm.LAUNCH_TIMEOUT_S):
    """One `train.py --full` run on 2 "nodes" of 2 ranks on this machine: two torchrun launches
    (node ranks 0 and 1) meeting at 127.0.0.1; returns (run dir, servers, seconds). Node 1 is offline
    (HF_HUB_OFFLINE) and gets the hub id as data.source. If either launch fails or the pair outlives
    `timeout`, both process groups are killed and the test fails with their output."""
    port = free_port()
    t0 = time.perf_counter()
    with FakeServer("gemini", model="gemini-test") as gj, FakeServer("serper") as ss:
        procs = []
        for node in (0, 1):
            scratch = tmp / f"{name}-node{node}"
            env = {**fm._env(), **_node_env(scratch)}
            data = []
            if node == 1:
                env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
                data = ["--set", f'data.source="{PAPER_RL_DATA}"']
            args = fm.full_args(tmp, name, model, rows, gj.url, ss.url, *SHAPE, *extra, *data,
                                "--set", f'cache_dir="{scratch / "cache"}"')
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                   "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                   os.path.join(ROOT, "train.py"), *args]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        outs, why = _wait_all(procs, timeout)
        servers = {"judge": (list(gj.requests), list(gj.errors)),
                   "search": (list(ss.requests), list(ss.errors))}
    if why:
        text = "\n".join(f"node {i} stdout:\n{o[-1500:]}\nnode {i} stderr:\n" + "\n".join(
            ln for ln in e.splitlines()[-80:] if "it/s]" not in ln) for i, (o, e) in enumerate(outs))
        pytest.fail(f"2-node run {name}: {why}\n{text}", pytrace=False)
    return tmp / name, servers, time.perf_counter() - t0


def _wait_all(procs, timeout) -> tuple[list, str]:
    """Wait for every launch; ([(stdout, stderr)], "" or what went wrong). A launch that fails ends
    the others after a grace period (the surviving node's ranks would wait out the group timeout);
    at the deadline every process group still running is killed."""
    deadline, why = time.monotonic() + timeout, ""
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed and not why:
            why = f"node {failed[0]} exited with code {procs[failed[0]].returncode}"
            deadline = min(deadline, time.monotonic() + 60)
        if time.monotonic() > deadline:
            why = why or f"timed out after {timeout:.0f} s"
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    outs = [p.communicate() for p in procs]
    if not why and any(p.returncode for p in procs):
        why = "exit codes " + ", ".join(str(p.returncode) for p in procs)
    return outs, why


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fullranks")
    model, rows = fm.tiny_policy_and_rows(tmp)
    out = {"single": fm._full_run(tmp, "single", model, rows, 1, *SHAPE)}
    out["four"] = fm._full_run(tmp, "four", model, rows, 4, *SHAPE,
                               env={"RUBRICEM_GROUP_TIMEOUT_DIR": str(tmp / "four-groups")})
    out["four-groups"] = tmp / "four-groups"
    _two_nodes(tmp, "nodes", model, rows, "--set", "checkpoint.stop_after=1")
    out["nodes"] = _two_nodes(tmp, "nodes", model, rows, "--resume", "latest")
    out["tmp"] = tmp
    print(", ".join(f"{k} {out[k][2]:.0f} s" for k in ("single", "four", "nodes")))
    return out


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "judge/http/"))} for r in rows]


def test_four_zero3_ranks_match_the_single_process_run(runs):
    single, four = fm._metrics(runs["single"][0]), fm._metrics(runs["four"][0])
    # every rank sampled a group: rank 0 received 3 ranks' groups on 3 threads at once
    for r in four:
        assert r["rollout/sampling_ranks"] == 4, r["step"]
        assert all(r[f"time/rollout_rank{k}_s"] > 0 for k in (1, 2, 3)), r["step"]
    fm.assert_same_run(single, four)
    # the runs did real work on every path: searches, judge calls, clipping, KL, reflection
    assert sum(r["tools/calls"] for r in four) > 0
    assert all(r["judge/http/calls"] > 0 and r["judge/http/failures"] == 0 for r in four)
    assert four[1]["kl"] > 0 and four[1]["update/reflection_seqs"] > 0
    for kind in ("judge", "search"):
        assert runs["four"][1][kind][0] and not runs["four"][1][kind][1], (kind, runs["four"][1][kind][1][:3])


def test_every_rank_waits_on_its_own_side_group_with_the_run_timeout(runs):
    """Rank 0 belongs to the 3 side groups {0, r}, rank r to its own only; each waits
    full.dist_timeout_min (full_args leaves it at its default)."""
    from backends.scale.settings import FullConfig

    want = FullConfig().dist_timeout_min * 60.0
    pairs = {}
    for r in range(4):
        groups = json.loads((runs["four-groups"] / f"rank{r}.json").read_text())
        assert {g["timeout_s"] for g in groups} == {want}, groups
        pairs[r] = sorted({tuple(g["ranks"]) for g in groups if len(g["ranks"]) == 2})
    assert pairs[0] == [(0, 1), (0, 2), (0, 3)], pairs
    assert all(pairs[r] == [(0, r)] for r in (1, 2, 3)), pairs


def test_two_nodes_stopped_and_resumed_equal_the_four_rank_run(runs):
    four, nodes = runs["four"][0], runs["nodes"][0]
    assert _strip(fm._metrics(nodes)) == _strip(fm._metrics(four))
    assert all(r["rollout/sampling_ranks"] == 4 for r in fm._metrics(nodes))
    assert (nodes / "final" / "model.safetensors").read_bytes() == \
        (four / "final" / "model.safetensors").read_bytes()
    # the shared checkpoint holds every rank's partition: 2 from each node
    ck = nodes / "checkpoints" / "step-000002" / "zero"
    assert len([f for _, _, fs in os.walk(ck) for f in fs if "optim_states" in f]) == 4


def test_two_nodes_keep_node_duties_on_their_node_and_global_ones_on_rank_0(runs):
    tmp = runs["tmp"]
    # node 1 ran global ranks 2 and 3 (LOCAL_RANK 0 and 1): each rank records its groups by RANK
    # into its own node's scratch
    assert sorted(os.listdir(tmp / "nodes-node0" / "groups")) == ["rank0.json", "rank1.json"]
    assert sorted(os.listdir(tmp / "nodes-node1" / "groups")) == ["rank2.json", "rank3.json"]
    # the judge is rank 0's: its reply cache is on node 0 alone (the search cache, which every
    # sampling rank writes, holds what that node's ranks searched: node 1's may hold nothing when
    # its 4 rollouts made no valid call)
    assert any(fs for _, _, fs in os.walk(tmp / "nodes-node0" / "cache" / "judge"))
    assert not (tmp / "nodes-node1" / "cache" / "judge").exists()
    # rank 0 wrote the run's files into the shared run dir with its own settings (node 0's rows)
    cfg = json.loads((runs["nodes"][0] / "config.json").read_text())
    assert cfg["data"]["source"] != PAPER_RL_DATA

