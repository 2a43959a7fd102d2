"""Full mode's overlapped step: `full.rollout_schedule = "async"` (HF / KV or vLLM sampler).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Algorithm 1 (§3.1-3.6) in the order the paper runs it at scale: the reflection branch of step t
(sampling, privileged judging, bank upserts) overlaps step t+1's rollouts, and its GRPO batch joins
step t+1's update (one-step lag). The named steps are train.py's (`steps` below is the train
module), so what is sampled, judged and trained is theirs; only the order and the concurrency
differ from train.rl_step, which stays the schedule of the toy path and of "lockstep".

One step t (`OverlappedStep.__call__`):
    1. curriculum batch and retrieval (train.retrieve_memory); then step t-1's branch may judge and
       write the bank (its gate opens; for a judge not safe in threads only at step 4), so the bank
       step t retrieves from and each step's judge counters never depend on timing
    2. rollouts on every sampling rank (rollout_engine.SeededRollouts, no turn barrier), each group
       handed to a StreamingJudge the moment it is final
    3. the judge's results (most were scored while other rollouts still ran)
    4. step t-1's branch is collected (rollout_engine.AsyncReflection.result)
    5. the task batch's update with its reflection batch in the same optimizer steps
       (train.update_policy, Alg. 1 steps 5-6), then ONE weight sync
    6. step t's branch starts in a thread (rollout_engine.reflection_branch: sampling through
       SeededView with its own seeds, trajectory picks from its own random.Random, privileged judge
       calls on a pool; its judge calls and bank writes wait for step t+1's gate)

Rank 0's sampler serves two threads: the branch's reflection requests and rank 0's share of step
t+1's rollouts. Both samplers take that: SeededTorchSampler decodes one seeded request at a time
(TORCH_RNG_LOCK); VLLMSampler puts both threads' requests into its engine loop
(backends/scale/engine_loop.py), so reflection candidates and rollout segments decode in the same
batches. Each request has its own seed, so the tokens never depend on how the two threads
interleave (the other ranks' engines never serve the branch).

Synchronisation points. After a step that ends on a checkpoint (checkpoint.every, the run's last
step or checkpoint.stop_after) or a held-out evaluation point, the branch is collected before the
step returns: the checkpoint then holds its bank entries and its batch as the pending batch, and
the evaluation samples with no branch running. A resumed run therefore equals the uninterrupted one
when both stop on the same points (a stop_after that is a multiple of checkpoint.every, or
checkpoint.every = 1); a run stopped elsewhere resumes correctly but took one extra
synchronisation point. An abort's checkpoint collects the branch in flight (`settle`).

Metrics: the branch's reflect/* metrics land in the row of the step that collected it (step t+1,
or step t at a synchronisation point); time/reflection_s is the branch's own wall time (hidden
behind the rollouts when overlapped) and time/reflection_wait_s how long the collecting step waited.
"""
from __future__ import annotations

import logging
import random
import threading
import time

import numpy as np
import torch

import ss_grpo
from backends.scale.rollout_engine import (TORCH_RNG_LOCK, AsyncReflection, SeededRollouts,
                                           StreamingJudge, reflection_branch)
from backends.run.robust import checked_judge_result
from bank import curriculum
from judge import judge_all
from reflection import ReflectionBatch
from scaffold import STAGES

log = logging.getLogger("rubricem.overlap")

# The reflection branch's request seeds: SeededView(sampler, REFLECTION_SEED_OFFSET + step seed),
# apart from the rollouts' request_seed(step seed, index, turn).
REFLECTION_SEED_OFFSET = 1_000_003


def overlapped_step(run, stop_at: int, steps) -> "OverlappedStep | None":
    """The overlapped step for `run` (full mode, full.rollout_schedule "async", any sampler of full
    mode: HF / KV, or vLLM on rank 0 or on every rank), or None: train.rl_step is the step (toy
    mode, "lockstep"). stop_at: the loop's last step + 1 (a synchronisation point); steps: the
    train module."""
    cfg = run.cfg
    # the rollout engine must hand each group over as it finishes (SeededRollouts: build.build_run)
    if cfg.mode != "full" or cfg.full.rollout_schedule != "async" \
            or not isinstance(run.rollout_engine, SeededRollouts):
        return None
    return OverlappedStep(run, stop_at, steps)


class OverlappedStep:
    """Callable as train.rl_step (run, step, pending, rng, m) -> train.StepOut; holds the reflection
    branch in flight between calls. `settle(pending)` collects it (for a checkpoint)."""

    def __init__(self, run, stop_at: int, steps):
        self.run, self.stop_at, self.steps = run, int(stop_at), steps
        self.inflight = AsyncReflection()
        self.gate: threading.Event | None = None
        cfg = run.cfg
        # Streaming needs a judge that is safe in threads (the HTTP judge); others judge the step's
        # groups after the rollouts, in group order, as train.judge_groups.
        self.judge_concurrency = (cfg.judge_http.concurrency
                                  if getattr(run.judge, "concurrent_groups", False) else 0)

    def sync_point(self, done: int) -> bool:
        """True when the step that makes `done` steps collects its own branch (see the module)."""
        cfg = self.run.cfg
        every, ev = cfg.checkpoint.every, cfg.eval.every
        return (bool(every) and done % every == 0) or done >= self.stop_at \
            or (bool(ev) and done % ev == 0 and done < cfg.steps)

    def settle(self, pending: ReflectionBatch) -> ReflectionBatch:
        """The pending batch with the branch in flight, if any, collected into it (its bank writes
        done). Its reflect/* metrics are logged here, not in a metrics row."""
        if not self.inflight.pending:
            return pending
        batch, rmet = self.inflight.result()
        log.info("reflection branch of step %d collected for the checkpoint: %s", batch.step,
                 {k: v for k, v in rmet.items() if k.startswith("reflect/")})
        return batch

    def _collect(self, m: dict) -> ReflectionBatch:
        """The branch in flight, its metrics into m. A branch collected at a synchronisation point
        right after the previous one (collected in the same step) replaces that one's reflect/*
        figures, which then go to the log; the time/* keys stay the first branch's."""
        batch, rmet = self.inflight.result()
        own, wait = rmet.pop("reflect/async_s"), rmet.pop("reflect/async_wait_s")
        if "time/reflection_s" not in m:
            m["time/reflection_s"], m["time/reflection_wait_s"] = own, wait
        else:
            log.info("step %d: the previous branch's metrics (the row shows this step's own branch, "
                     "collected for a synchronisation point): %s", batch.step,
                     {k: v for k, v in m.items() if k.startswith("reflect/")})
        m.update(rmet)
        return batch

    def __call__(self, run, step: int, pending: ReflectionBatch, rng: random.Random, m: dict):
        S, cfg, n = self.steps, run.cfg, run.cfg.rollout.n
        b, mode = curriculum(step, cfg.curriculum.K, cfg.curriculum.enabled)  # §3.5 windowed curriculum
        queries = [run.train_q[i] for i in run.order.batch(b)]
        items = S.retrieve_memory(run, queries, mode, b, m)  # Alg. 1 step 2
        if self.gate is not None and self.judge_concurrency:
            # step t-1's branch may now judge and write the bank (a judge that is not safe in
            # threads waits until the branch is collected, after this step's judging)
            self.gate.set()
        rollouts, raws = self._rollouts_and_judge(run, queries, items, step, m)  # Alg. 1 steps 3-4
        R, results, judged, bad_shape = np.zeros((len(rollouts), len(STAGES))), [], {}, 0
        for gi, (q, raw) in enumerate(zip(queries, raws)):
            res, bad = checked_judge_result(raw, n, step, q.query)
            bad_shape += bad
            results.append(res)
            R[gi * n:(gi + 1) * n] = res.R
            judged.update({gi * n + j: (res, j) for j in range(n)})
        if bad_shape:
            m["judge/bad_shape"] = bad_shape
        if self.inflight.pending:  # step t-1's branch: its batch joins this step's update
            pending = self._collect(m)
        with S.timed(m, "time/update_s"):
            A, am = ss_grpo.task_advantages(R, n, cfg.ss_grpo, run.arm.advantage)  # Alg. 1 step 5
            m.update(am)
            batch = S.update_batch(rollouts, A, cfg.ss_grpo.skipped_stage_credit, cfg.rollout.temperature)
            # Alg. 1 step 6, with step t-1's reflection GRPO groups in the same optimizer steps
            m.update(S.update_policy(run.policy, batch, pending, run.tok.pad_token_id, rng,
                                     cfg.reflection.loss_coef, cfg.reflection.temperature
                                     if cfg.reflection.score_at_temperature else 1.0))
        m["time/update_s"] -= m.get("time/reflection_update_s", 0.0)  # disjoint phases, as rl_step
        with S.timed(m, "time/sync_s"):
            run.policy.sync(run.sampler)  # the one weight sync of the step
        if "syncs" in run.sampler.stats:  # vLLM: weight syncs so far and the last one's size
            m["sampler/syncs"] = run.sampler.stats["syncs"] + run.sampler.stats["reloads"]
            m["sampler/sync_bytes"] = run.sampler.stats["last_sync"].get("bytes", 0)
            m["sampler/sleeps"] = run.sampler.stats.get("sleeps", 0)  # rank 0's engine asleep in updates
        nxt = ReflectionBatch(step)
        self.gate = None
        if run.arm.reflection:  # Alg. 1 step 7, in a thread: it overlaps step t+1's rollouts
            seed = REFLECTION_SEED_OFFSET + cfg.seed * 7919 + step
            self.gate = threading.Event()
            self.inflight.start(reflection_branch(
                step, rollouts, judged, run.judge, run.bank, run.sampler, run.tok, run.system,
                cfg.reflection, random.Random(seed), cfg.ss_grpo.std, cfg.ss_grpo.eps, n, seed,
                judge_concurrency=max(1, self.judge_concurrency), bank_gate=self.gate),
                bank_gate=self.gate)
            if self.sync_point(step + 1):
                nxt = self._collect(m)
        return S.StepOut(queries, rollouts, R, results, batch, nxt)

    def _rollouts_and_judge(self, run, queries: list, items: list, step: int, m: dict):
        """The step's rollouts (every sampling rank, no turn barrier) and each group's raw judge
        result, the groups judged as they finish when the judge allows it (StreamingJudge). Sets
        time/rollout_s (the rollouts) and time/judge_s (the judge's tail after the last rollout)."""
        cfg, n = run.cfg, run.cfg.rollout.n
        seed = cfg.seed * 7919 + step  # as train.sample_rollouts
        with TORCH_RNG_LOCK:  # the branch in flight may hold torch's RNG (SeededTorchSampler)
            torch.manual_seed(seed)
            run.sampler.reseed(seed)
        # SCALE: while step t-1's branch samples on rank 0's engine, rank 0 takes a smaller share of
        # the groups (full.rank0_rollout_share; which rank samples a rollout never changes its tokens)
        share = {"rank0_share": cfg.full.rank0_rollout_share} if self.inflight.pending else {}
        t0 = time.perf_counter()
        if not self.judge_concurrency:
            rollouts = run.rollout_engine.run(queries, n=n, bank_items=items, **share)
            t1 = m["time/rollout_s"] = time.perf_counter() - t0
            raws = judge_all(run.judge, queries, [rollouts[g * n:(g + 1) * n] for g in range(len(queries))],
                             step)
            m["time/judge_s"] = time.perf_counter() - t0 - t1
            return rollouts, raws
        groups: list = [None] * len(queries)
        sj = StreamingJudge(run.judge, queries, groups, step, self.judge_concurrency)

        def on_group(g: int, group: list) -> None:
            groups[g] = group
            sj.submit(g)

        try:
            rollouts = run.rollout_engine.run(queries, n=n, bank_items=items, on_group=on_group, **share)
        except BaseException:
            sj.close()  # another rank's groups may still arrive: their submits become no-ops
            raise
        t1 = m["time/rollout_s"] = time.perf_counter() - t0
        raws = sj.results()
        m["time/judge_s"] = time.perf_counter() - t0 - t1
        return rollouts, raws
