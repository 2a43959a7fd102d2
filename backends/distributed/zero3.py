"""Full mode's policy under DeepSpeed ZeRO-3: pi_theta (`ZeRO3Policy`) and the frozen pi_ref
(`FrozenReference`).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the appendix's RL systems configuration: "ZeRO-3 with CPU offload, gradient checkpointing",
32 prompts x 8 rollouts = 256 sequences per step, lr 5e-7, and the SS-GRPO update of §3.3 sharded over
data-parallel ranks. The math is the toy path's (ss_grpo.ss_grpo_loss on policy.token_logprobs); this
module only moves it onto DeepSpeed, and `tests/test_full_zero3.py` checks that two ranks of ZeRO-3
give the same losses and weights as one plain PyTorch process. The settings and the batch arithmetic
are backends/scale/settings.py's; the engine train.py drives over these two is engine.py's.

What is here
    ZeRO3Policy                       pi_theta under ZeRO-3: logprobs, backward, step, save_pretrained,
                                      iter_full_params (one gathered parameter at a time)
    FrozenReference                   pi_ref, ZeRO-3 partitioned for inference (no optimizer)

Memory (Qwen3-8B, 8 GPUs, bf16, ZeRO-3, optimizer offloaded; P = 8.2e9 parameters)
    policy weights 2P bytes / 8 = 2.0 GB per GPU, gradients 2P / 8 = 2.0 GB per GPU;
    fp32 master weights + Adam moments 12P = 98 GB of host RAM per node (12 GB per rank);
    pi_ref ZeRO-3 partitioned too: 2P / 8 = 2.0 GB per GPU (we chose this over a rank-0 copy, which
    would hold 16 GB on one GPU and make every rank wait for rank 0's reference pass);
    logits: fast_logprobs.token_logprobs projects 1,024 positions at a time, so old / reference passes
    (no gradient) of a 26,624-token sequence hold ~2 x 1,024 x 151,936 x 4 B = 1.2 GB of fp32
    logits instead of 2 x 16 GB. With gradient, autograd keeps every chunk's log-softmax output for
    the backward: 26,624 x 151,936 x 4 B = 16 GB per sequence in the micro-batch. Recomputing each
    chunk in the backward removes that (benchmarks/logprob_memory.py measures both: at 4,096 tokens on
    CPU, +2.6 GiB chunked vs +0.5 GiB recomputed vs +7.0 GiB naive, for ~25% more time);
    activations: gradient checkpointing keeps one hidden state per layer, 36 x 26,624 x 4,096 x 2 B = 7.8 GB.

Deviations from the paper (1 and 2, the settings and the optimizer: backends/scale/settings.py)
    3. The loss is normalised with the *global* counts of the minibatch (sequences, masked tokens) on
       every rank; `ZeRO3Policy.backward` multiplies by the world size to undo DeepSpeed's gradient
       mean, so the update equals the single-process one exactly (up to float rounding).

Launch
    python -m backends.distributed dry-run                                 # print the plan, check the machine
    torchrun --nproc_per_node 2 -m backends.distributed selftest --model DIR --out DIR # ZeRO-3 check, any device
    deepspeed --num_gpus 8 train.py --full --model DIR       # the full loop (see docs/full_mode.md)
    torchrun --nproc_per_node 2 train.py --full --model DIR ...     # the same on 2 CPU ranks (tests)
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
from typing import Iterator

import torch

from backends.distributed.dist import barrier, is_rank0
from backends.run import fast_logprobs
from backends.run.torch_engine import disable_dropout
from backends.scale.settings import FullConfig, reference_config
from backends.scale.zero3_scope import zero3_loading

log = logging.getLogger("rubricem.full")


class _LogProbModule(torch.nn.Module):
    """The module DeepSpeed wraps: forward = fast_logprobs.token_logprobs on the HF model (chunked,
    memory-bounded at any setting: a full (tokens x vocab) log-softmax does not fit at scale).
    Making the chunked pass the top-level forward lets ZeRO-3's gather/release hooks and
    end-of-forward bookkeeping run exactly as for a plain model call.

    The LM head runs through `head`, a fast_logprobs.ChunkedHead: one module call per pass whatever
    the number of chunks, so every rank makes the same module calls, in the same order, whatever
    its data. DeepSpeed gathers a partitioned parameter per module call and, as the next pass
    starts, compares the module orders the ranks recorded (partitioned_param_coordinator.py,
    reset_step; deepspeedai/DeepSpeed#7998): with the head called once per chunk, a rank with more
    loss tokens than another made more gathers and the ranks' collectives stopped matching, a hang
    (or, Qwen3-8B's untied head and embedding having one shape, a surplus head gather could meet
    the other rank's embedding gather and swap their data).
    The head's parameters are registered as the ChunkedHead's external parameters, so DeepSpeed
    gathers them around that one call (forward, and backward with its recompute). We chose this over
    marking the ChunkedHead a ZeRO-3 leaf module (deepspeed.utils.set_z3_leaf_modules): a leaf's
    gradients are reduced in the leaf's backward hook (runtime/zero/stage3.py,
    create_reduce_and_remove_grad_hooks), before a tied input embedding (Qwen3 <= 4B) has added its
    share to the same weight's gradient.

    Raises ValueError for chunk_size < 1.
    """

    def __init__(self, lm, chunk_size: int):
        import deepspeed  # lazy: built only right before deepspeed.initialize

        super().__init__()
        if int(chunk_size) < 1:
            raise ValueError(f"full.logprob_chunk must be >= 1, got {chunk_size}")
        self.lm = lm
        self.chunk_size = int(chunk_size)
        self.head = fast_logprobs.ChunkedHead(lm.get_output_embeddings())
        for p in self.head.head.parameters():  # SCALE: gathered around the ChunkedHead's call
            deepspeed.zero.register_external_parameter(self.head, p)

    def forward(self, input_ids, attention_mask, loss_mask=None, temperature: float = 1.0):
        return fast_logprobs.token_logprobs(self.lm, input_ids, attention_mask, self.chunk_size,
                                            loss_mask=loss_mask, temperature=temperature,
                                            head=self.head)


def _load_lm(path: str, ds: dict, dtype: torch.dtype):
    """HF causal LM partitioned at load time. Collective: every rank loads together. transformers'
    ZeRO-3 switch (HfDeepSpeedConfig) is live during from_pretrained only (a bare constructor under
    zero.Init would skip HF's weight init; see docs/full_mode.md) and off again afterwards, so that
    a later rank-0-only load (the dense retriever's embedding model, vLLM) is not turned into a
    ZeRO-3 collective that the other ranks never join (backends/scale/zero3_scope.py)."""
    # lazy: transformers' model classes can load DeepSpeed (accelerate); a dry run must not
    from transformers import AutoModelForCausalLM

    with zero3_loading(ds):  # SCALE: from_pretrained loads straight into ZeRO-3 partitions
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


class ZeRO3Policy:
    """pi_theta as a DeepSpeed ZeRO-3 engine.

    Build with `ZeRO3Policy.from_pretrained(path, ds_config, lr)` (partitioned while loading) or
    `ZeRO3Policy(module, ds_config, lr)` (an already built HF model; deepspeed.initialize partitions it,
    and HF's weight init has run). Every method is collective: all ranks must call it, in the same
    order, with the same number of micro-batches (ZeRO-3 all-gathers each layer's weights per forward).

    Per optimizer step: (logprobs -> loss -> backward(loss, boundary)) per micro-batch, the last one
    with boundary=True, then `step()`. Dropout is disabled in `lm` (policy.disable_dropout), as in
    policy.TorchEngine.
    """

    def __init__(self, lm, ds_config: dict, lr: float, *, full: FullConfig | None = None):
        import deepspeed  # lazy: DeepSpeed only when a full run starts

        full = full or FullConfig()
        self.ds_config = ds_config
        if disable_dropout(lm):  # old (eval) and new (train) log-probs must be the same function
            log.info("dropout disabled for RL (policy.disable_dropout)")
        if full.gradient_checkpointing:  # PAPER: gradient checkpointing
            kw = {"use_reentrant": False}  # the non-reentrant variant is the one ZeRO-3 hooks support
            if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.2x
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        lm.config.use_cache = False  # this engine scores sequences, it never generates: no KV cache
        module = _LogProbModule(lm, full.logprob_chunk)
        opt = None
        if "optimizer" not in ds_config:  # SCALE: torch AdamW client optimizer (no JIT build)
            opt = torch.optim.AdamW(module.parameters(), lr=lr, betas=tuple(full.adam_betas),
                                    eps=1e-8, weight_decay=full.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=opt,
                                                                 config=ds_config)
        # DeepSpeedCPUAdam when DeepSpeed's AdamW meets an offloaded optimizer (JIT-built on first use)
        basic = getattr(self.optimizer, "optimizer", self.optimizer)
        self.optimizer_name = type(basic).__name__
        log.info("rank %d: optimizer %s inside %s", self.engine.global_rank, self.optimizer_name,
                 type(self.optimizer).__name__)
        self.world_size = self.engine.world_size
        self._boundary_pending = False

    @classmethod
    def from_pretrained(cls, path: str, ds_config: dict, lr: float, *, full: FullConfig | None = None):
        """Load a HF causal-LM directory or hub id straight into ZeRO-3 partitions (bf16 when the
        config enables it, else fp32). Raises OSError when the model cannot be found."""
        dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
        return cls(_load_lm(path, ds_config, dtype), ds_config, lr, full=full)

    @property
    def module(self):
        """The HF causal LM inside the engine (its parameters are ZeRO-3 partitions)."""
        return self.engine.module.lm

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """log pi_theta of every next token (fast_logprobs.token_logprobs through the engine).

        input_ids, attention_mask: (B, L) int64 on any device; loss_mask: optional (B, L) bool, the
        columns that are used (the head runs only there; the others are 0); temperature: T > 0,
        the log-probs of softmax(logits / T). Returns (B, L) float32 on the engine's device
        (column 0 is 0). With gradient unless called under torch.no_grad().
        """
        mask = loss_mask.to(self.device) if loss_mask is not None else None
        return self.engine(input_ids.to(self.device), attention_mask.to(self.device), mask,
                           temperature=temperature).float()

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Accumulate gradients of `loss`, a 0-dim tensor normalised with the *global* normalisers
        (sequences, masked tokens) of the optimizer step, so that summing it over micro-batches and
        ranks gives the full-batch loss (ss_grpo.aggregate). boundary: True for the last micro-batch
        of an optimizer step (then call step()). The number of micro-batches may vary from step to
        step (a reflection batch joins every other update); it must be the same on every rank."""
        if self._boundary_pending:
            raise RuntimeError("backward() after the boundary micro-batch: call step() first")
        # SCALE: the accumulation boundary is ours, not DeepSpeed's micro-step counter, so an
        # optimizer step can take any number of micro-batches (train_batch_size is nominal).
        self.engine.set_gradient_accumulation_boundary(bool(boundary))
        # SCALE: DeepSpeed averages gradients over ranks; x world_size restores the sum (deviation 3).
        # scale_wrt_gas=False: the global normalisers already account for accumulation.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        if boundary:
            self._boundary_pending = True
        else:
            self.engine.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    def step(self) -> float:
        """Apply the optimizer step (gradient clipping from the config). Returns the global gradient
        norm before clipping (nan if DeepSpeed does not report it). A non-finite norm means no step:
        DeepSpeed's ZeRO-3 optimizer discards a step whose norm is inf/NaN (its check does not
        depend on the dtype) and clears the gradients, and reports the norm as inf. Raises RuntimeError unless the last
        backward() was a boundary."""
        if not self._boundary_pending:
            raise RuntimeError("step() without a boundary backward(): pass boundary=True on the last "
                               "micro-batch of the optimizer step")
        assert self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self.engine.step()
        self.engine.set_gradient_accumulation_boundary(False)
        self._boundary_pending = False
        gn = self.engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else float("nan")
        if not math.isfinite(gn) and self.engine.skipped_steps == skipped:
            log.error("DeepSpeed applied an optimizer step with gradient norm %s instead of "
                      "discarding it: its clipped update is 0 or NaN", gn)
        return gn

    def iter_full_params(self, device: str | torch.device | None = None, copy: bool = True
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, full tensor) one parameter at a time (weight sync to a sampler,
        checkpoints). Only one parameter is ever gathered; with copy=True each yielded tensor is a
        copy (on `device`, default the engine's), safe to keep; with copy=False it is the gathered
        parameter itself, valid only until the next item (for a caller that copies it at once, or a
        rank that only takes part in the gathers). Collective: every rank must exhaust the iterator.
        Tied weights appear once (under the input embedding's name)."""
        import deepspeed  # lazy: DeepSpeed only when a full run starts

        for name, p in self.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):  # SCALE
                yield name, (p.detach().to(device or p.device, copy=True) if copy else p.detach())

    def save_pretrained(self, out_dir: str, max_shard_bytes: int = 5 * 2 ** 30) -> None:
        """Write a checkpoint that plain `transformers` loads: config, generation config and
        safetensors shards (with an index when there is more than one). Collective; only rank 0
        writes, holding at most one shard in host memory."""
        from safetensors.torch import save_file  # lazy: safetensors only when weights are saved

        rank0 = is_rank0()
        if rank0:
            os.makedirs(out_dir, exist_ok=True)
        shards, shard, size, total = [], {}, 0, 0

        def flush():
            nonlocal shard, size
            if shard:
                fn = f"_shard{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(out_dir, fn), metadata={"format": "pt"})
                shards.append((fn, list(shard)))
            shard, size = {}, 0

        for name, t in self.iter_full_params(device="cpu"):
            if not rank0:
                continue
            nb = t.numel() * t.element_size()
            if shard and size + nb > max_shard_bytes:
                flush()
            shard[name] = t.contiguous()
            size += nb
            total += nb
        if rank0:
            flush()
            _finalise_shards(out_dir, shards, total)
            cfg = copy.deepcopy(self.module.config)
            cfg.use_cache = True  # for whoever generates from the checkpoint (the engine keeps False)
            cfg.save_pretrained(out_dir)
            if getattr(self.module, "generation_config", None) is not None:
                self.module.generation_config.save_pretrained(out_dir)
        barrier()


def _finalise_shards(out_dir: str, shards: list, total: int) -> None:
    """Rename temporary shard files to HF's names; write the index for more than one shard."""
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0][0]), os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, (fn, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, fn), os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)


class FrozenReference:
    """pi_ref: a frozen copy of the starting policy, ZeRO-3 partitioned for inference (no optimizer,
    no gradients; 2P / world bytes per rank in bf16). Collective, like ZeRO3Policy."""

    def __init__(self, lm, ds_config: dict, *, chunk_size: int = 1024):
        import deepspeed  # lazy: DeepSpeed only when a full run starts

        for p in lm.parameters():
            p.requires_grad_(False)
        lm.config.use_cache = False
        rc = reference_config(ds_config)
        self.engine, *_ = deepspeed.initialize(model=_LogProbModule(lm, chunk_size), config=rc)
        self.engine.eval()

    @classmethod
    def from_pretrained(cls, path: str, ds_config: dict, *, chunk_size: int = 1024):
        """Load pi_ref from a HF directory or hub id straight into ZeRO-3 inference partitions, in the
        policy config's precision (ds_config: the policy's JSON, see reference_config). Raises OSError
        when the model cannot be found."""
        dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
        return cls(_load_lm(path, reference_config(ds_config), dtype), ds_config, chunk_size=chunk_size)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """(B, L) float32 log pi_ref of every next token (column 0 is 0; with loss_mask, 0 outside
        it; at `temperature`, of softmax(logits / T)), no gradient."""
        dev = self.engine.device
        mask = loss_mask.to(dev) if loss_mask is not None else None
        return self.engine(input_ids.to(dev), attention_mask.to(dev), mask,
                           temperature=temperature).float()
