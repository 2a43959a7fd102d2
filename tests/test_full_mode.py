"""Full mode for real on CPU: `train.py --full` with 2 DeepSpeed ZeRO-3 ranks (gloo), the Gemini judge
and the Serper search tool pointed at loopback servers that speak their wire formats (tests/loopback.py),
and DR Tulu-schema RL rows from a local JSONL file.

One module-scoped fixture runs, each as a subprocess:
  * `python train.py --full --set engine="torch"`: the same two RL steps in one process, plain PyTorch
    (the reference);
  * `torchrun --nproc_per_node 2 train.py --full`: two ZeRO-3 ranks;
  * the ZeRO-3 run again, stopped after step 1 and resumed from its checkpoint.
Tolerance: the update statistics (loss/total, loss/policy, kl, grad_norm) agree within rtol 1e-4
(float summation order differs across ranks; measured ~3e-6); every other metric (rewards,
advantages, judge and search counts, tokens, clip fraction, bank) is equal exactly, because rank 0
samples with weights that differ from the single process only by rounding. The policy is a tiny
Qwen3 given a short SFT warm start, so that it writes tool calls and stage tags. ~90 s on 2 cores.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from loopback import TEST_KEY, FakeServer
from toyfix import MILD, tiny_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_DS = (importlib.util.find_spec("deepspeed") is not None
           and importlib.util.find_spec("accelerate") is not None)
pytestmark = pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed "
                                "(DS_BUILD_OPS=0 pip install deepspeed accelerate)")

UPDATE_KEYS = ("loss/total", "loss/policy", "kl", "grad_norm")
STEPS = 2


def _env():
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
            "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
            "GEMINI_API_KEY": TEST_KEY, "SERPER_API_KEY": TEST_KEY}


LAUNCH_TIMEOUT_S = float(os.environ.get("RUBRICEM_TEST_LAUNCH_TIMEOUT_S", 1200))


def _run(cmd, timeout=LAUNCH_TIMEOUT_S, env: dict | None = None):
    """Run one launch to completion in its own process group; returns its wall time in seconds
    (_launch)."""
    t0 = time.perf_counter()
    _launch(cmd, timeout, env)
    return time.perf_counter() - t0


def _launch(cmd, timeout=LAUNCH_TIMEOUT_S, env: dict | None = None) -> tuple[str, str]:
    """Run one launch to completion in its own process group (environment _env() plus `env`);
    returns (stdout, stderr). On a timeout the whole group (torchrun and its ranks) is killed, so no
    orphaned rank keeps loading the CPU for the tests that follow. A failure or timeout fails the
    test with the output."""
    p = subprocess.Popen(cmd, cwd=ROOT, env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        what = f"exit code {p.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        what = f"timed out after {timeout:.0f} s"
    if p.returncode != 0:  # the whole stderr minus progress bars: a rank's own traceback is there
        err = [ln for ln in err.splitlines() if "it/s]" not in ln and "FutureWarning" not in ln]
        pytest.fail(f"{what}: {' '.join(cmd[:8])} ...\nstdout:\n{out[-2000:]}\n"
                    "stderr:\n" + "\n".join(err[-120:]), pytrace=False)
    return out, err


def full_args(tmp, name, model, rows, judge_url, search_url, *extra) -> list[str]:
    """train.py's arguments of one small full-mode run (2 steps, checkpoints every step) named `name`
    under `tmp` (run dir tmp/name, cache tmp/cache-name), against the judge and search servers at
    judge_url / search_url (tests/loopback.py); `extra` arguments last (a later --set wins)."""
    return ["--full", "--model", str(model), "--steps", str(STEPS), "--run-dir", str(tmp / name),
            "--no-progress", "--set", f'data.source="{rows}"',
            "--set", f'judge_http.base_url="{judge_url}"', "--set", 'judge.model="gemini-test"',
            "--set", f'search_http.base_url="{search_url}"', "--set", 'sampler="hf"',
            "--set", "full.vllm_cpu_kv_cache_gib=1", "--set", "full.vllm_gpu_memory_utilization=0.3",
            "--set", 'bank.retriever="bm25"', "--set", "rollout.prompts_per_step=2",
            "--set", "rollout.n=4", "--set", "rollout.max_response_tokens=96",
            "--set", 'rollout.system_prompt="compact"', "--set", "reflection.m=4",
            "--set", "reflection.max_new_tokens=16", "--set", "ss_grpo.minibatches=2",
            "--set", "ss_grpo.micro_batch=1", "--set", "ss_grpo.lr=1e-3",
            "--set", f'cache_dir="{tmp / ("cache-" + name)}"', "--set", "threads=1",
            "--set", "checkpoint.every=1", *extra]


def _full_run(tmp, name, model, rows, ranks, *extra, python=sys.executable, torchrun=None, env=None,
              expect_failure=False):
    """One `train.py --full` run against fresh loopback servers; returns (run dir, servers, seconds).
    ranks=1 without torchrun: the one-process torch engine; otherwise ZeRO-3 under torchrun. env:
    more environment variables for the launch. expect_failure: return the finished
    subprocess.CompletedProcess instead (the run must fail)."""
    torchrun = ranks > 1 if torchrun is None else torchrun
    with FakeServer("gemini", model="gemini-test") as gj, FakeServer("serper") as ss:
        args = full_args(tmp, name, model, rows, gj.url, ss.url, *extra)
        if not torchrun:
            cmd = [python, os.path.join(ROOT, "train.py"), *args, "--set", 'engine="torch"']
        else:
            # --standalone: torchrun picks a free rendezvous port itself (no race with free_port)
            cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(ranks), os.path.join(ROOT, "train.py"), *args]
        if expect_failure:
            p = subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True,
                               text=True, timeout=LAUNCH_TIMEOUT_S)
            assert p.returncode != 0, p.stdout[-2000:]
            return p
        secs = _run(cmd, env=env)
        servers = {"judge": (list(gj.requests), list(gj.errors)),
                   "search": (list(ss.requests), list(ss.errors))}
    return tmp / name, servers, secs


def tiny_policy_and_rows(tmp) -> tuple:
    """(model dir, rows file) under `tmp`: a tiny Qwen3 with a short SFT warm start on the toy world
    (it writes tags and tool calls), and the toy world's training questions as DR Tulu-schema RL rows
    (messages + ground_truth with rubrics) in a local JSONL file. Its teacher is the mild one and
    searches every asked fact (p_skip 0): the toy's default teacher makes systematic mistakes on
    purpose, after which 150 SFT steps need not give a policy that calls the search tool within 96
    tokens, and the full-mode tests need those calls."""
    teacher = [x for k, v in {**MILD, "p_skip": 0.0}.items() for x in ("--set", f"teacher.{k}={v}")]
    warm = ["--toy", "--steps", "0", "--run-dir", str(tmp / "warm"), "--no-progress", *teacher,
            "--set", "world.n_train_entities=40", "--set", "world.n_heldout_entities=8",
            "--set", "sft.steps=150", "--set", "sft.n_trajectories=300", "--set", "sft.n_reflections=20",
            "--set", "sft.batch_size=8", "--set", 'toy_model.size="XS"', "--set", "toy_model.vocab_size=400",
            "--set", "eval.n_questions=0", "--set", f'cache_dir="{tmp / "warm-cache"}"',
            "--set", "threads=1"]
    _run([sys.executable, os.path.join(ROOT, "train.py"), *warm])
    rows = tmp / "rows.jsonl"
    with open(rows, "w") as fh:
        for r in tiny_world().train_rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "toy"}) + "\n")
    return tmp / "warm" / "final", rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fullmode")
    model, rows = tiny_policy_and_rows(tmp)
    out = {"model": model, "rows": rows}
    out["single"] = _full_run(tmp, "single", model, rows, 1)
    out["zero3"] = _full_run(tmp, "zero3", model, rows, 2)
    # the same run again, every process group's timeout recorded at the end (dist.record_group_timeouts)
    out["zero3-again"] = _full_run(tmp, "zero3-again", model, rows, 2, "--set", "full.dist_timeout_min=47",
                                   env={"RUBRICEM_GROUP_TIMEOUT_DIR": str(tmp / "timeouts")})
    out["timeouts"] = tmp / "timeouts"
    _full_run(tmp, "resumed", model, rows, 2, "--set", "checkpoint.stop_after=1")
    out["resumed"] = _full_run(tmp, "resumed", model, rows, 2, "--resume", "latest")
    # the same checkpoint (2 ranks' partitions) on 1 ZeRO-3 rank
    t0 = time.perf_counter()
    out["one-rank-resume"] = (_full_run(tmp, "one-rank", model, rows, 1, "--resume",
                                        str(tmp / "resumed" / "checkpoints" / "step-000001"),
                                        torchrun=True, expect_failure=True), time.perf_counter() - t0)
    return out


def _metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def assert_same_run(single: list, multi: list) -> None:
    """The metrics rows of a ZeRO-3 run (`multi`) against the one-process run's (`single`): the same
    steps and keys (besides the sampling ranks' own), the update statistics within rtol 1e-4 and
    every other metric (rewards, advantages, judge and search counts, tokens, clip fraction, bank)
    equal, time/* aside."""
    assert [r["step"] for r in single] == [r["step"] for r in multi] == list(range(STEPS))
    for a, b in zip(single, multi):
        assert set(a) == {k for k in b if not k.startswith(("rollout/sampling_ranks", "rollout/rank0_groups",
                                                            "time/rollout_rank"))}
        for k in a:
            if k.startswith("time/"):
                continue
            if a[k] is None:  # a key this step did not log (every metrics line has every key)
                assert b[k] is None, (a["step"], k, b[k])
            elif k.removeprefix("reflect/") in UPDATE_KEYS:  # the task or the reflection update
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (a["step"], k, a[k], b[k])
            else:
                assert b[k] == a[k], (a["step"], k, a[k], b[k])


def test_full_mode_two_zero3_ranks_match_single_process_run(runs):
    single, zero3 = _metrics(runs["single"][0]), _metrics(runs["zero3"][0])
    # Both sample with one seed per request; on 2 ranks each rank samples half of the groups.
    assert all(b["rollout/sampling_ranks"] == 2 and b["time/rollout_rank1_s"] > 0 for b in zero3)
    assert_same_run(single, zero3)
    # The runs did real work: tool calls through the search server, judge calls, clipping, KL.
    assert sum(r["tools/calls"] for r in zero3) > 0
    assert all(r["judge/http/calls"] > 0 and r["judge/http/failures"] == 0 for r in zero3)
    assert zero3[1]["kl"] > 0 and zero3[1]["clip_frac"] > 0
    assert zero3[1]["update/reflection_seqs"] > 0  # step 0's reflection batch, applied before step 1
    print({k: zero3[-1][k] for k in ("loss/total", "kl", "clip_frac", "grad_norm", "tools/calls",
                                     "reward/answer", "judge/http/calls")},
          f"single {runs['single'][2]:.1f} s, zero3 {runs['zero3'][2]:.1f} s")


def test_full_mode_two_rank_sampling_is_deterministic(runs):
    """Every rank samples its share of the groups (full.rollout_ranks "all", per-request seeds): two
    identical 2-rank runs log the same metrics (all but time/*) and write the same bank, rollouts
    and weights."""
    a, b = runs["zero3"][0], runs["zero3-again"][0]
    strip = lambda rows: [{k: v for k, v in x.items()  # noqa: E731
                           if not k.startswith(("time/", "judge/http/"))} for x in rows]
    assert strip(_metrics(a)) == strip(_metrics(b))
    assert all(r["rollout/sampling_ranks"] == 2 for r in _metrics(a))
    for f in ("bank.jsonl", "samples.jsonl", "final/model.safetensors"):
        assert open(a / f, "rb").read() == open(b / f, "rb").read(), f


def test_every_process_group_of_the_run_waits_full_dist_timeout_min(runs):
    """The default group, DeepSpeed's groups and the side gloo group that streams finished groups to
    rank 0 (torch would give it 30 min) all wait full.dist_timeout_min (47 in that run)."""
    for r in range(2):
        groups = json.loads((runs["timeouts"] / f"rank{r}.json").read_text())
        assert len(groups) >= 3, groups  # default, DeepSpeed's, the side group
        assert {g["timeout_s"] for g in groups} == {47 * 60.0}, groups


def test_full_mode_speaks_the_gemini_and_serper_wire_formats(runs):
    for name in ("single", "zero3"):
        _, servers, _ = runs[name]
        for kind in ("judge", "search"):
            requests, errors = servers[kind]
            assert requests and not errors, (name, kind, errors[:3])  # path, key header, body shape
        judge_requests = servers["judge"][0]
        assert all(r["path"] == "/v1beta/models/gemini-test:generateContent" for r in judge_requests)
        assert all(r["headers"].get("x-goog-api-key") == TEST_KEY for r in judge_requests)
    # Same rollouts, same prompts: both runs asked the judge and the search engine the same things.
    key = lambda reqs: sorted(json.dumps(r["body"], sort_keys=True) for r in reqs)  # noqa: E731
    for kind in ("judge", "search"):
        assert key(runs["single"][1][kind][0]) == key(runs["zero3"][1][kind][0])


def test_full_mode_checkpoint_loads_with_plain_transformers_and_matches(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    z = runs["zero3"][0]
    m = AutoModelForCausalLM.from_pretrained(z / "final", local_files_only=True)
    assert torch.isfinite(m(torch.tensor([[1, 2, 3]])).logits).all()
    a = load_file(runs["single"][0] / "final" / "model.safetensors")
    b = load_file(z / "final" / "model.safetensors")
    init = load_file(runs["model"] / "model.safetensors")
    assert set(a) == set(b)
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    moved = max((a[k] - init[k]).abs().max().item() for k in a)
    # 4 AdamW steps of lr 1e-3 move weights by up to 4e-3. Adam divides by sqrt(v): an element whose
    # gradient is near zero turns rounding noise into a visible step, so a few elements differ more
    # than the rest (measured over 4 runs: max 1.6e-6 to 1.1e-5, 1-3 of 125,888 elements above 1e-6).
    # A wrong update moves every weight by ~lr; the bounds: max 1e-4 (10% of one step), and at most
    # 0.01% of the elements above 1e-6.
    assert diff.max().item() < 1e-4 < moved, (diff.max().item(), moved)
    assert (diff > 1e-6).float().mean().item() <= 1e-4, (diff > 1e-6).sum().item()
    # Training-state checkpoints: HF weights + DeepSpeed partitions (one optimizer file per rank).
    ck = z / "checkpoints" / f"step-{STEPS:06d}"
    AutoModelForCausalLM.from_pretrained(ck / "model", local_files_only=True)
    parts = [f for _, _, fs in os.walk(ck / "zero") for f in fs if "optim_states" in f]
    assert len(parts) == 2, parts


def test_full_mode_zero3_resume_equals_uninterrupted_run(runs):
    z, r = runs["zero3"][0], runs["resumed"][0]
    strip = lambda rows: [{k: v for k, v in x.items()  # noqa: E731
                           if not k.startswith(("time/", "judge/http/"))} for x in rows]
    assert strip(_metrics(r)) == strip(_metrics(z))
    a = open(z / "final" / "model.safetensors", "rb").read()
    b = open(r / "final" / "model.safetensors", "rb").read()
    assert a == b


def test_resuming_two_ranks_partitions_on_one_rank_stops_at_once_with_what_to_do(runs):
    p, secs = runs["one-rank-resume"]
    assert "exitcode  : 2" in p.stderr, p.stderr[-3000:]  # train.main: unusable input, before any load
    assert "holds the partitions of 2 ranks" in p.stderr and "on 1 rank(s)" in p.stderr
    assert "--nproc_per_node 2" in p.stderr and "--model" in p.stderr
    assert "Loading" not in p.stderr  # no model was loaded first
    print(f"stopped after {secs:.1f} s")


def test_full_mode_never_writes_the_api_key(runs):
    for name in ("single", "zero3", "resumed"):
        root = runs[name][0]
        for dirpath, _, files in os.walk(root):
            for f in files:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    assert TEST_KEY.encode() not in fh.read(), os.path.join(dirpath, f)


def _vllm_python_with_deepspeed():
    py = os.environ.get("RUBRICEM_VLLM_PYTHON")
    if not py or not os.path.exists(py):
        pytest.skip("RUBRICEM_VLLM_PYTHON is not set (a python with vllm / vllm-cpu; see docs/vllm.md)")
    r = subprocess.run([py, "-c", "import deepspeed, accelerate"], capture_output=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if r.returncode:
        pytest.skip("the vLLM environment has no deepspeed / accelerate")
    return py


@pytest.mark.slow
def test_full_mode_two_zero3_ranks_with_the_vllm_sampler(runs, tmp_path):
    """ZeRO-3 on 2 ranks + vLLM sampling on rank 0 alone (full.rollout_ranks="rank0", the fallback;
    every rank's engine inside its own process, built together: see build.build_sampler), synced
    after every update in memory. The sync must reach the engine: with lr 0 and lr 1e-3 the first
    step samples the same trajectories (same weights, same per-request seeds) and the second step
    differs only if the engine received the updated weights. Then one ZeRO-3 rank, on the same
    engine path, samples the same as the 2-rank run. (An engine per sampling rank, the default
    "all": tests/test_full_vllm_ranks.py.)"""
    py = _vllm_python_with_deepspeed()
    rows = runs["rows"]
    out, syncs = {}, {}
    for lr in ("0", "1e-3"):
        d, servers, secs = _full_run(tmp_path, f"vllm-lr{lr}", runs["model"], rows, 2,
                                     "--set", 'sampler="vllm"', "--set", f"ss_grpo.lr={lr}",
                                     "--set", 'full.rollout_ranks="rank0"', python=py)
        assert not servers["judge"][1] and not servers["search"][1]
        rows_m = _metrics(d)
        # the full preset's overlapped step (backends/distributed/overlap.py): one sync per step, after step
        # t-1's reflection batch and step t's task batch (Algorithm 1's one-step lag)
        assert [r["sampler/syncs"] for r in rows_m] == [1, 2]
        with open(d / "samples.jsonl") as fh:
            out[lr] = [json.loads(line) for line in fh]
        print(f"lr {lr}: {secs:.1f} s")
        syncs[lr] = [r["sampler/sync_bytes"] for r in rows_m]
    first = lambda xs, step: [x["trajectory"] for x in xs if x["step"] == step]  # noqa: E731
    assert first(out["0"], 0) == first(out["1e-3"], 0)
    assert first(out["0"], 1) != first(out["1e-3"], 1)
    # 2 ranks: the engine takes pi_theta in memory (the gathered tensors as rpc arguments), never
    # from a checkpoint on tmpfs
    assert all(b > 0 for b in syncs["1e-3"]), syncs
    # One ZeRO-3 rank streams iter_full_params() into its engine's sync_weights as every rank does;
    # the engine then holds the same weights as after the 2-rank sync, so it samples the same.
    d, _, _ = _full_run(tmp_path, "vllm-1rank", runs["model"], rows, 1, "--set", 'sampler="vllm"',
                        "--set", "ss_grpo.lr=1e-3", python=py, torchrun=True)
    one = _metrics(d)
    assert [r["sampler/syncs"] for r in one] == [1, 2] and all(r["sampler/sync_bytes"] > 0 for r in one)
    with open(d / "samples.jsonl") as fh:
        samples = [json.loads(line) for line in fh]
    assert first(samples, 0) == first(out["1e-3"], 0) and first(samples, 1) == first(out["1e-3"], 1)


@pytest.mark.slow
def test_full_mode_async_rollout_schedule_is_deterministic(runs, tmp_path):
    """full.rollout_schedule="async" on 2 ZeRO-3 ranks + vLLM on rank 0 (full.rollout_ranks="rank0"):
    the overlapped step (backends/distributed/overlap.py) with no turn barrier, concurrent Serper calls against
    the loopback server and one seed per request, step 0's reflection branch sampling on the same
    engine while step 1's rollouts run (checkpoint.every=0: step 0 is no synchronisation point).
    Two runs with the same seed log the same metrics and sample the same trajectories at both
    steps; one weight sync per step reaches the engine."""
    py = _vllm_python_with_deepspeed()
    samples, metrics = [], []
    for name in ("async-a", "async-b"):
        d, servers, _ = _full_run(tmp_path, name, runs["model"], runs["rows"], 2, "--set", 'sampler="vllm"',
                                  "--set", 'full.rollout_ranks="rank0"', "--set", "checkpoint.every=0",
                                  "--set", 'full.rollout_schedule="async"', "--set", "full.tool_concurrency=4",
                                  python=py)
        assert not servers["judge"][1] and not servers["search"][1]
        rows_m = _metrics(d)
        assert [r["sampler/syncs"] for r in rows_m] == [1, 2] and all(r["tokens/total"] > 0 for r in rows_m)
        # step 1 collected step 0's branch, which ran beside its rollouts
        assert "time/reflection_wait_s" in rows_m[1] and "reflect/candidates" in rows_m[1], rows_m[1]
        metrics.append([{k: v for k, v in r.items() if not k.startswith(("time/", "judge/http/"))}
                        for r in rows_m])
        with open(d / "samples.jsonl") as fh:
            samples.append([json.loads(line)["trajectory"] for line in fh])
    assert samples[0] == samples[1] and samples[0]
    assert json.dumps(metrics[0], sort_keys=True) == json.dumps(metrics[1], sort_keys=True)


def test_full_mode_search_key_refused_ends_every_sampling_rank(runs, tmp_path):
    """Both ZeRO-3 ranks sample and search; the search API answers 401 to every call. The run must
    end (no rank left waiting for another's rollouts) with the API's message and train.py's exit
    code for a refused key (4) on rank 0, whichever rank's search was refused first."""
    with FakeServer("gemini", model="gemini-test") as gj, FakeServer("serper") as ss:
        ss.rule = lambda req: {"status": 401, "message": "API key not valid"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "train.py"), "--full", "--model", str(runs["model"]), "--steps", "1",
               "--run-dir", str(tmp_path / "refused"), "--no-progress",
               "--set", f'data.source="{runs["rows"]}"', "--set", f'judge_http.base_url="{gj.url}"',
               "--set", 'judge.model="gemini-test"', "--set", f'search_http.base_url="{ss.url}"',
               "--set", 'sampler="hf"', "--set", 'bank.retriever="bm25"',
               "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=4",
               # room for the plan (every asked fact and what to avoid) and a first call
               "--set", "rollout.max_response_tokens=192", "--set", 'rollout.system_prompt="compact"',
               "--set", "ss_grpo.micro_batch=1", "--set", f'cache_dir="{tmp_path / "cache"}"',
               "--set", "threads=1"]
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("a rank was left waiting after the search API refused the key")
        assert ss.requests  # the rollouts reached the search server
    assert p.returncode != 0
    assert "API key not valid" in err and "exitcode  : 4" in err, err[-3000:]
