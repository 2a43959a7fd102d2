"""Training-time evaluation of a run (not in the paper): the static-rubric stage scores of a step's
training rollouts (train.py logs them as score/{stage}) and the held-out evaluation of a toy run (the
SFT start, the curve points, the end; scripts/memory_eval.py and scripts/answer_breakdown.py reuse it).
The paper's benchmark graders are in evaluate.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from backends.run import checkpoint as ckpt_mod
from backends.run.build import Run, eval_settings, heldout_engines
from scaffold import STAGES

log = logging.getLogger("rubricem.evaluate")  # the name these messages had in evaluate.py


# ----------------------------------------------------------------------------------------------------
# Configuration (the run config's `eval` section, registered by backends/run/presets.py)


@dataclass
class EvalConfig:
    """Held-out evaluation of a toy run (not in the paper): questions, samples, temperature."""

    n_questions: int = 64
    """held-out questions evaluated at the end (0 = no evaluation)"""
    samples: int = 2
    """rollouts per held-out question"""
    temperature: float = 1.0
    """sampling temperature of the held-out evaluation"""
    every: int = 0
    """ours: also evaluate the current policy every this many RL steps, same questions and settings,
    into eval_curve.jsonl (0 = only the SFT start and the end)"""
    greedy: bool = True
    """ours: at the end also evaluate the SFT start and the trained policy greedily (temperature 0,
    one rollout per question), into eval.json's eval_sft_greedy / eval_rl_greedy"""


# ----------------------------------------------------------------------------------------------------
# Static-rubric scores of training rollouts (not in the paper; train.py logs them as score/{stage})


def static_stage_scores(judge, queries: Sequence, rollouts: Sequence, n: int) -> list | None:
    """Mean stage scores (4 floats in [0, 1], None for a stage the judge does not grade: the
    unstructured scaffold's Plan, Research, Review) of a step's rollouts under the judge's *static*
    rubric set (the held-out evaluation's, `judge.evaluate`), or None for a judge without one (HTTP).

    Not in the paper. R is scored on the evolving buffers, which keep the rubrics the group still
    fails (§3.4), so its mean is not comparable from step to step; this score is, and shows whether
    the training rollouts get better. rollouts: len(queries) * n, query gi's group contiguous."""
    S = static_scores(judge, queries, rollouts, n) if rollouts else None
    # a stage the judge does not grade (the unstructured scaffold's Plan, Research, Review) is None
    return None if S is None else [float(x) if np.isfinite(x) else None for x in S.mean(0)]  # (4,)


def static_scores(judge, queries: Sequence, rollouts: Sequence, n: int) -> np.ndarray | None:
    """(len(rollouts), 4) float stage scores in [0, 1] under the judge's static rubric set
    (`judge.evaluate`), one group of `n` contiguous rollouts per query; None for a judge without a
    static rubric set; a column is NaN for a stage the judge does not grade (the unstructured
    scaffold's Plan, Research, Review)."""
    parts = [judge.evaluate(q, rollouts[gi * n:(gi + 1) * n]) for gi, q in enumerate(queries)]
    return None if any(p is None for p in parts) else np.concatenate(parts)


# ----------------------------------------------------------------------------------------------------
# Held-out evaluation of a toy run (the toy judge's static rubric set; train.py, scripts/memory_eval.py)


def heldout_seed(cfg) -> int:
    """The sampling seed of a run's held-out evaluation (config.Config `cfg`): the same for the
    SFT start, every curve point and the end, and for memory_eval's pass 1 and answer_breakdown.py."""
    return cfg.seed + 12345


def sample_heldout(engine, queries: Sequence, samples: int, temperature: float, seed: int,
                   bank_items: Sequence[Sequence[str]] | None = None) -> list:
    """The held-out rollouts (query-major, `samples` per query) behind `evaluate_heldout`: torch's
    global RNG reseeded with `seed`, then one batched `engine.run`."""
    torch.manual_seed(seed)
    return engine.run(list(queries), n=samples, temperature=temperature, bank_items=bank_items)


def evaluate_heldout(engine, judge, queries: Sequence, samples: int, temperature: float, seed: int,
             bank_items: Sequence[Sequence[str]] | None = None) -> dict:
    """Held-out score with the judge's static rubric set (judge.py, deviation 3): mean of the four
    stage scores (of the Answer score alone for the unstructured scaffold, whose other stages are
    not graded: their stage/* are None) and the answer score, plus format and tool-use rates, and
    "per_question": the score,
    answer score and fact recall of each query (lists of len(queries), each the mean over its
    samples). bank_items: per query, the bank reflections placed in its prompt (§3.5; default none).
    Deterministic per seed; reseeds torch's global RNG (wrap in `preserved_rng` inside a run)."""
    ro = sample_heldout(engine, queries, samples, temperature, seed, bank_items)
    return heldout_scores(judge, queries, ro, samples)


def heldout_scores(judge, queries: Sequence, ro: Sequence, samples: int) -> dict:
    """`evaluate_heldout`'s result for rollouts `ro` (query-major, `samples` per query) already sampled."""
    S = static_scores(judge, queries, ro, samples)  # (N, 4)
    graded = np.isfinite(S).all(0)  # (4,): False for a stage the judge does not grade
    Sg = S if graded.all() else S[:, graded]  # (N, K graded)
    facts = [judge.fact_recall(r.query, r) for r in ro]  # the toy judge's ground truth
    return {"score": float(Sg.mean()), "answer": float(S[:, 3].mean()),
            **{f"stage/{s}": float(S[:, k].mean()) if graded[k] else None
               for k, s in enumerate(STAGES)},
            "well_formed": float(np.mean([r.parsed.well_formed_strict  # toy judge's "answer_block"
                                          if "answer_block" in getattr(judge, "fixes", ()) else
                                          r.parsed.well_formed for r in ro])),
            "tool_call_rate": float(np.mean([r.n_tool_calls >= 1 for r in ro])),
            "mean_tool_calls": float(np.mean([r.n_tool_calls for r in ro])),
            "fact_recall": float(np.mean(facts)), "rollouts": len(ro),
            # per held-out question (mean over its samples), for confidence intervals (report.py)
            "per_question": {"score": Sg.reshape(len(queries), samples, -1).mean(axis=(1, 2)).tolist(),
                             "answer": S[:, 3].reshape(len(queries), samples).mean(axis=1).tolist(),
                             "fact_recall": np.reshape(facts, (len(queries), samples)).mean(axis=1).tolist()}}


@contextlib.contextmanager
def preserved_rng():
    """Run a block without moving the run's global random streams: python `random`, numpy and torch
    (CPU, and every CUDA device when there is one) are saved on entry and restored on exit, also
    when the block raises. Lets an evaluation between RL steps reseed and sample freely while the
    training metrics stay those of a run without it (not in the paper)."""
    py, npst, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npst)
        torch.set_rng_state(th)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class EvalCurve:
    """Held-out evaluations during a run, one JSON line per evaluation in run_dir/eval_curve.jsonl:
    {"step": completed RL steps (0 = the SFT start), "eval": {n_questions, samples, temperature},
    then `evaluate`'s keys (score, answer, fact_recall, stage/*, per_question, ...)}. Not in the paper.

    A fresh run starts an empty file; a resumed run keeps the rows up to its checkpoint's step that
    were taken with the current evaluation settings (the others are dropped with a warning, since
    eval.* may change on resume), so no step appears twice. Writes are atomic rewrites.
    """

    def __init__(self, path: str, settings: dict, resume_step: int | None):
        self.path, self.settings = path, dict(settings)
        self.rows: list[dict] = []
        if resume_step is not None and os.path.exists(path):
            with open(path) as fh:
                old = [json.loads(l) for l in fh if l.strip().endswith("}")]
            keep = [r for r in old if r.get("step", 1 << 30) <= resume_step
                    and r.get("eval") == self.settings]
            if len(keep) < len([r for r in old if r.get("step", 1 << 30) <= resume_step]):
                log.warning("eval_curve.jsonl: dropped rows taken with other eval settings")
            self.rows = keep
        self._write()

    def _write(self) -> None:
        data = "".join(json.dumps(r) + "\n" for r in self.rows).encode("utf-8")
        ckpt_mod.atomic_write_bytes(self.path, data)

    def add(self, step: int, result: dict) -> None:
        self.rows = [r for r in self.rows if r["step"] != step]
        self.rows.append({"step": int(step), "eval": dict(self.settings), **result})
        self.rows.sort(key=lambda r: r["step"])
        self._write()

    def get(self, step: int) -> dict | None:
        """The evaluation at `step` without the curve's own keys, or None."""
        for r in self.rows:
            if r["step"] == step:
                return {k: v for k, v in r.items() if k not in ("step", "eval")}
        return None


class HeldOut:
    """Held-out evaluations of the run (not in the paper): the SFT start, every eval.every steps into
    eval_curve.jsonl, and the end; the same questions, samples, temperature and seed each time,
    scored by the clean judge with the clean tool, with the run's random streams saved and restored
    around them, so the training metrics do not depend on eval.every. Only with the toy judge and
    the torch engine (`enabled`)."""

    def __init__(self, run: Run, resume_step: int | None, timings: dict):
        cfg = run.cfg
        self.run, self.timings = run, timings
        self.qs = run.held_q[: cfg.eval.n_questions]
        self.enabled = bool(cfg.eval.n_questions > 0 and cfg.judge.backend == "toy"
                            and cfg.engine == "torch" and self.qs)
        path = os.path.join(cfg.run_dir, "eval_curve.jsonl")
        self.curve = EvalCurve(path, eval_settings(cfg), resume_step) if self.enabled else None
        if self.curve is None and resume_step is None and os.path.exists(path):
            os.remove(path)  # an earlier run's, in this run dir
        self.ref_engine = self.cur_engine = None
        if self.enabled:
            self.ref_engine, self.cur_engine = heldout_engines(cfg, run.policy.ref_model, run.model,
                                                               run.tok, run.tool, run.system)
        timings["curve_eval_s"] = 0.0

    def evaluate(self, sft: bool = False, greedy: bool = False) -> dict:
        """evaluate_heldout of the SFT start (sft) or the current policy, at eval.temperature with
        eval.samples rollouts per question, or greedily (temperature 0, one rollout per question)."""
        cfg = self.run.cfg
        samples, temperature = (1, 0.0) if greedy else (cfg.eval.samples, cfg.eval.temperature)
        return evaluate_heldout(self.ref_engine if sft else self.cur_engine, self.run.clean_judge,
                                self.qs, samples, temperature, heldout_seed(cfg))

    def point(self, done: int, sft: bool = False) -> None:
        """A point of eval_curve.jsonl after `done` steps (sft: the SFT start, once)."""
        if not self.enabled or (sft and self.curve.get(0) is not None):
            return
        t0 = time.perf_counter()
        with preserved_rng():
            self.curve.add(done, self.evaluate(sft))
        self.timings["curve_eval_s"] += time.perf_counter() - t0
