"""Resume bookkeeping of the training loop (not in the paper; docs/robustness.md): the training state a
checkpoint holds besides the weights, its restore, and the choice of the checkpoint to resume from.
A resumed run equals the uninterrupted one bit for bit on CPU.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict

import numpy as np
import torch

from backends.run import checkpoint as ckpt_mod
from backends.run.data import DataOrder
from backends.run.report import Logger
from backends.run.robust import FailureMonitor
from backends.run.config import RESUME_MAY_CHANGE, Config, _flatten, migrate_config_dict, resume_config_diff


def training_state(step: int, cfg: Config, engine, rng: random.Random, judge, bank, pending,
                   logger: Logger, samples_out: list, rollout_engine, tool, monitor: FailureMonitor,
                   reference: dict, order: DataOrder) -> dict:
    """Everything besides the policy weights that step `step` (completed steps) needs to continue
    exactly: a dict of tensors and plain values for checkpoint.save_checkpoint."""
    npst = np.random.get_state()
    return {
        "format": 1, "step": int(step), "config": asdict(cfg), "reference": dict(reference),
        "data_order": {"n": order.n, "per_batch": order.P, "seed": order.seed},
        "optimizer": engine.state_dict(),  # None for ZeRO-3: its partitions are in zero/
        "rng": {"python": random.getstate(), "loop": rng.getstate(),
                "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
                "torch": torch.get_rng_state()},
        "judge": judge.state_dict(), "bank": bank.state_dict(), "pending": pending.to_dict(),
        "metrics": [dict(r) for r in logger.rows], "samples": list(samples_out),
        "engine": dict(rollout_engine.stats), "tool": tool.state_dict() if hasattr(tool, "state_dict") else None,
        "monitor": list(monitor.streak), "monitor_nonfinite": int(monitor.nonfinite),
    }


def restore_training_state(state: dict, rng: random.Random, judge, bank, rollout_engine, tool,
                           monitor: FailureMonitor, order: DataOrder) -> None:
    """Inverse of `training_state` for the objects rebuilt by `train` (in place; the policy engine
    restores its weights and optimizer itself). Raises checkpoint.CheckpointError if the checkpoint's
    data order does not fit this data set, ValueError (from the bank) if its bank state is invalid."""
    if state["data_order"] != {"n": order.n, "per_batch": order.P, "seed": order.seed}:
        raise ckpt_mod.CheckpointError(f"the checkpoint's data order {state['data_order']} does not "
                                       "fit this data set")
    rs = state["rng"]
    random.setstate(rs["python"])
    rng.setstate(rs["loop"])
    name, keys, pos, has_gauss, cached = rs["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rs["torch"])
    judge.load_state_dict(state["judge"])
    bank.load_state_dict(state["bank"])
    rollout_engine.stats.update(state["engine"])
    if state.get("tool") is not None and hasattr(tool, "load_state_dict"):
        tool.load_state_dict(state["tool"])
    monitor.streak = list(state["monitor"])
    monitor.nonfinite = int(state.get("monitor_nonfinite", 0))  # checkpoints from before it: 0


def reference_record(source: str, model=None, model_dir: str | None = None) -> dict:
    """What a checkpoint records of the frozen reference pi_ref (the SFT warm start; its weights are
    not stored): {"source": where it comes from, "kind", "sha256"}. kind "weights": the sha256 of the
    loaded `model` (checkpoint.weights_fingerprint); "files", when no model is given: the sha256 of
    the weight files in `model_dir` (checkpoint.files_fingerprint; a ZeRO-3 run that samples with
    vLLM loads no plain copy). Raises ValueError with neither, checkpoint.CheckpointError for a
    folder without weight files."""
    if model is not None:
        return {"source": source, "kind": "weights", "sha256": ckpt_mod.weights_fingerprint(model)}
    if not model_dir:
        raise ValueError("reference_record: pass the loaded model or its folder")
    return {"source": source, "kind": "files", "sha256": ckpt_mod.files_fingerprint(model_dir)}


def reference_kind(record: dict) -> str:
    """The kind of a checkpoint's reference record; "weights" for one written before kinds."""
    return record.get("kind", "weights")


def check_reference(saved: dict, now: dict, path: str) -> None:
    """Refuse to resume from checkpoint `path` against another reference than it trained against:
    raises checkpoint.CheckpointError, naming both sources, when the records' sha256s differ
    (reference_record; `now` computed in the checkpoint's kind, train.reference_of)."""
    if saved["sha256"] != now["sha256"]:
        raise ckpt_mod.CheckpointError(
            f"cannot resume from {path}: the reference model (SFT warm start) rebuilt from "
            f"{now['source']} differs from the one the run started with ({saved['source']}); "
            "restore that warm start or --model")


def _check_world_size(cfg: Config, path: str) -> None:
    """Engine zero3: the checkpoint's DeepSpeed partitions (one per rank) must meet as many ranks as
    this launch has; raises checkpoint.CheckpointError at once, before any model is loaded, naming
    both counts and the two ways on. ZeRO-3 partitions belong to their rank count (DeepSpeed's
    universal-checkpoint conversion would lift that; not done here)."""
    saved = ckpt_mod.zero_world_size(path) if cfg.engine == "zero3" else None
    if not saved:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        now = torch.distributed.get_world_size()
    else:
        now = int(os.environ.get("WORLD_SIZE") or 1)
    if saved != now:
        raise ckpt_mod.CheckpointError(
            f"cannot resume from {path} on {now} rank(s): its DeepSpeed state (zero/) holds the "
            f"partitions of {saved} ranks, and ZeRO-3 partitions fit only that count. Resume with "
            f"{saved} ranks (torchrun --nproc_per_node {saved} ... --resume), or start a new run "
            f"from its weights: --model {os.path.join(path, 'model')} (Adam's moments start afresh)")


def _open_run(cfg: Config, resume: str | None) -> tuple[str | None, dict | None]:
    """(checkpoint path, training state) to resume from, or (None, None) for a fresh run."""
    path = ckpt_mod.resolve_resume(resume, cfg.run_dir, deep=cfg.checkpoint.verify)
    if path is None:
        have = ckpt_mod.list_checkpoints(cfg.run_dir)
        if have:
            why = ("none of them verifies (see the warnings above)" if resume else
                   "continue that run with --resume (= --resume latest), or start a separate run "
                   f"with --run-dir DIR (or delete {cfg.run_dir})")
            raise ckpt_mod.CheckpointError(f"{cfg.run_dir} already holds checkpoints (up to step "
                                           f"{have[-1][0]}); {why}")
        return None, None
    state = ckpt_mod.load_state(path)
    _check_world_size(cfg, path)
    diff = resume_config_diff(state["config"], cfg)
    if diff:
        saved = _flatten(migrate_config_dict(state["config"]))
        now = _flatten(json.loads(json.dumps(asdict(cfg))))
        shown = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:8])
        raise ckpt_mod.CheckpointError(f"cannot resume from {path}: the configuration differs in "
                                       f"{', '.join(diff)} ({shown}); a resumed run may change only "
                                       f"{', '.join(RESUME_MAY_CHANGE)}")
    if state["step"] > cfg.steps:
        raise ckpt_mod.CheckpointError(f"{path} is at step {state['step']}, beyond steps = {cfg.steps}")
    return path, state
