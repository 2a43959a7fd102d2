"""The policy engine in one process (`TorchEngine`, engine = "torch"): a Hugging Face model, torch
AdamW and policy.policy_update behind the `policy.PolicyEngine` interface. Toy mode uses it; in full
mode it is the single-process reference that backends/distributed/engine.py's ZeRO3Engine must reproduce.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
- `disable_dropout(model)`: every dropout probability to 0, so the old (eval-mode) and new
  (train-mode) log-probs of the SS-GRPO update come from the same function.
"""
from __future__ import annotations

import copy
import logging
import math
import random
import threading
from typing import Sequence

import torch

from backends.run import fast_logprobs
from backends.run.checkpoint import load_model_weights
from toy.hf_sampler import autocast, pad_multiple
from policy import PaddedRows, UpdateBatch, plan_update, policy_update, token_logprobs

log = logging.getLogger("rubricem")


def _device_type(model) -> str:
    """"cpu" | "cuda": the device type of a model's weights (autocast needs it)."""
    dev = getattr(model, "device", None)
    return dev.type if isinstance(dev, torch.device) else "cpu"


def disable_dropout(model) -> int:
    """Set every dropout probability of `model` to 0, in place; returns how many were > 0.

    Covers torch dropout modules (p), float module attributes whose name contains "dropout" (e.g.
    the `attention_dropout` a Hugging Face attention layer passes to its attention kernel in train
    mode) and such fields of `model.config` (so saved checkpoints say how the model was trained).
    Not in the paper; we do it for RL because the old log-probs are computed in eval mode and the
    new ones in train mode (gradient checkpointing needs it): with dropout p > 0 the ratio
    rho = exp(log pi_new - log pi_old) departs from 1 on the very first, on-policy minibatch
    (|log rho| up to ~0.1 at p = 0.1) and PPO clipping acts on noise. Idempotent.
    """
    changed = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            changed += 1
        for name, v in list(vars(m).items()):
            if "dropout" in name and isinstance(v, float) and v > 0:
                setattr(m, name, 0.0)
                changed += 1
    cfg = getattr(model, "config", None)
    for name, v in (list(vars(cfg).items()) if cfg is not None else []):
        if "dropout" in name and isinstance(v, float) and v > 0:
            setattr(cfg, name, 0.0)
            changed += 1
    return changed


class BackgroundLogprobs:
    """Per-sequence log-probs that `score(longest_first=True, on_pass=...)` (policy.sequence_logprobs
    with its arguments bound) computes in a thread: `values[i]` waits until sequence i's pass is
    done and re-raises the thread's error, if any (RuntimeError from it); join() waits for the
    thread. Only when the passes run changes, not what they compute."""

    def __init__(self, score, n: int):
        self._values: list = [None] * n
        self._error: BaseException | None = None
        self._done = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(score,), name="ref-logprobs",
                                        daemon=True)
        self._thread.start()

    def _run(self, score) -> None:
        try:
            score(longest_first=True, on_pass=self._put)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self._error = e
        finally:
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def _put(self, got: dict) -> None:
        with self._cv:
            for i, v in got.items():
                self._values[i] = v
            self._cv.notify_all()

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i: int) -> torch.Tensor:
        with self._cv:
            while self._values[i] is None and not self._done:
                self._cv.wait()
            if self._values[i] is None:
                raise RuntimeError("pi_ref's log-probs were not computed") from self._error
            return self._values[i]

    def join(self) -> None:
        self._thread.join()


class TorchEngine:
    """The policy engine in one process (engine = "torch"): a Hugging Face model, torch AdamW (betas
    0.9, 0.95, no weight decay) and `policy_update`. Toy mode uses it; in full mode it is the
    single-process reference that backends/distributed/engine.py's ZeRO3Engine must reproduce.

    model: pi_theta, also the weights the HF / KV sampler generates with; ref_model: the frozen pi_ref
    (default: a copy of the starting policy); opt: the optimizer (default: AdamW at cfg.lr).
    cfg: hparams.SSGRPOConfig. precision: the forwards' `autocast` ("fp32" | "bf16"; ValueError
    otherwise). fast: the fast log-prob path (Config.fast_logprobs, backends/run/fast_logprobs.py):
    the head only on loss-masked positions and prompt-sharing sequences packed into one row
    (`rows` = fast_logprobs.rows_for(cfg.agg)); False (default): the plain path
    (policy.token_logprobs over policy.PaddedRows).
    Dropout is disabled in the model (disable_dropout)."""

    world_size = 1
    overlap_ref = True  # score_ref runs pi_ref's passes in a thread (False: in line)

    def __init__(self, model, cfg, ref_model=None, opt=None, precision: str = "fp32",
                 fast: bool = False):
        self.model, self.cfg = model, cfg
        self.fast = bool(fast)
        # how policy_update lays out its rows: shared prompts packed on the fast path only
        self.rows = fast_logprobs.rows_for(cfg.agg) if self.fast else PaddedRows()
        autocast(precision)  # ValueError for an unknown precision, before any work
        self.precision = precision
        self.pad_multiple = pad_multiple(precision)  # forwards see lengths rounded up to this
        if disable_dropout(model):  # old (eval) and new (train) log-probs must be the same function
            log.info("dropout disabled for RL (torch_engine.disable_dropout)")
        if ref_model is None:
            ref_model = copy.deepcopy(model).eval()  # frozen reference pi_ref (= the starting policy)
            for p in ref_model.parameters():
                p.requires_grad_(False)
        self.ref_model = ref_model
        self.opt = opt if opt is not None else torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self._fresh = True  # the next backward starts a new optimizer step: gradients are cleared

    # the calls of policy_update (PolicyEngine documents each) ---------------------------------------
    def logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """(B, L) float32 log pi_theta of each next token (policy.token_logprobs on `model`, or
        fast_logprobs.token_logprobs on the fast path: with a loss mask, 0 outside it; at
        `temperature`, of softmax(logits / T))."""
        return self._forward(self.model, ids, att, mask, temperature)

    def ref_logprobs(self, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor | None = None,
                     temperature: float = 1.0) -> torch.Tensor:
        """(B, L) float32 log pi_ref of each next token (`ref_model`, frozen)."""
        return self._forward(self.ref_model, ids, att, mask, temperature)

    def _forward(self, model, ids: torch.Tensor, att: torch.Tensor,
                 mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """token_logprobs under the engine's precision, right-padded to pad_multiple (attention 0
        on the padding, which no real position attends to) and cut back to (B, L). The plain path
        (policy.token_logprobs) ignores the loss mask: every column is computed; the fast path
        (fast_logprobs.token_logprobs) runs the head on the loss-masked columns only."""
        if not self.fast:
            mask = None
        L = ids.shape[1]
        extra = -L % self.pad_multiple
        if extra:
            ids = torch.nn.functional.pad(ids, (0, extra), value=0)
            att = torch.nn.functional.pad(att, (0, extra), value=0)
            mask = torch.nn.functional.pad(mask, (0, extra), value=0) if mask is not None else None
        with autocast(self.precision, _device_type(model)):
            if self.fast:
                lp = fast_logprobs.token_logprobs(model, ids, att, loss_mask=mask,
                                                  temperature=temperature)
            else:
                lp = token_logprobs(model, ids, att, temperature=temperature)
            return lp[:, :L]

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """loss.backward(); the first call of an optimizer step clears the previous gradients."""
        if self._fresh:
            self.opt.zero_grad(set_to_none=True)
            self._fresh = False
        loss.backward()

    def step(self) -> float:
        """Clip the global gradient norm to cfg.grad_clip and take the optimizer step; a non-finite
        norm (clipping would scale every gradient by 0 or NaN) drops the gradients instead."""
        gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        if math.isfinite(gn):
            self.opt.step()
        else:
            self.opt.zero_grad(set_to_none=True)
        self._fresh = True
        return gn

    def score_ref(self, score, n: int):
        """pi_ref's per-sequence log-probs for policy_update (§3.3's KL term): `score` is
        policy.sequence_logprobs with its arguments bound, over n sequences. With overlap_ref, its
        passes run longest first in a thread beside the loss passes (one process, no collectives:
        the loss's second training thread buys little at toy size, docs/performance.md section 14)
        and a `BackgroundLogprobs` is returned; else, and always for a pi_ref on a GPU (a new
        thread would start on device 0, and kernels on one stream gain nothing from it), the list
        itself. The passes are the same, so the values are the same."""
        if self.overlap_ref and _device_type(self.ref_model) == "cpu":
            return BackgroundLogprobs(score, n)
        return score()

    def train(self, mode: bool = True) -> None:
        """Train / eval mode of `model`."""
        self.model.train(mode)

    def all_reduce(self, values: Sequence[float]) -> list[float]:
        """One process: the values themselves."""
        return list(values)

    # what the training loop calls -----------------------------------------------------------------
    def update(self, batch: UpdateBatch, pad_id: int, rng: random.Random,
               joint: UpdateBatch | None = None) -> dict:
        """`policy_update` on the whole batch, with `joint` (another batch, e.g. the deferred
        reflection GRPO groups) in the same optimizer steps when given and not empty; {} for an
        empty batch (rng untouched). Raises ValueError for a joint batch beside an empty one."""
        if not batch.ids:
            if joint is not None and joint.ids:
                raise ValueError("a joint batch needs a non-empty batch to share its optimizer steps")
            return {}
        # units: what the row layout keeps in one pass (a packed reflection group; None: nothing)
        shards, plans = plan_update(batch, 1, self.cfg.minibatches, self.cfg.micro_batch, rng,
                                    self.rows.units(batch))
        both = None
        if joint is not None and joint.ids:
            j_shards, j_plans = plan_update(joint, 1, self.cfg.minibatches, self.cfg.micro_batch,
                                            rng, self.rows.units(joint))
            both = (j_shards[0], j_plans[0])
        return policy_update(self, shards[0], self.cfg, pad_id, plans[0], joint=both)

    def sync(self, sampler) -> None:
        """HF and KV samplers share `model`; a sampler with its own copy (vLLM) gets the weights."""
        sampler.sync_weights(self.model.named_parameters())

    def save_pretrained(self, out_dir: str, **kw) -> None:
        """`model` as a Hugging Face checkpoint."""
        self.model.save_pretrained(out_dir, **kw)

    def save_state(self, ckpt_dir: str) -> None:
        """Nothing: the optimizer state travels in the training state (state_dict)."""

    def state_dict(self) -> dict:
        """The AdamW state."""
        return self.opt.state_dict()

    def load(self, ckpt_dir: str, state: dict) -> None:
        """Weights from ckpt_dir (checkpoint.load_model_weights), optimizer from state["optimizer"]."""
        load_model_weights(self.model, ckpt_dir)
        self.opt.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Nothing to release."""
