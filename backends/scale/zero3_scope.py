"""Where transformers' global "ZeRO-3 is on" switch is live, and where it must not be.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for the appendix's "ZeRO-3" training (full mode only; no equation lives here).

transformers decides whether `from_pretrained` loads a model into ZeRO-3 partitions from one
process-wide weak reference to the last `HfDeepSpeedConfig` created
(`transformers.integrations.deepspeed.is_deepspeed_zero3_enabled`). While that object lives, *every*
`from_pretrained` in the process runs under `deepspeed.zero.Init`, whose partitioning is a collective:
all ranks must call it together. In full mode only rank 0 loads the rollout-side models (the dense
bank retriever's embedding model, vLLM's tokenizer and config, a checkpoint's sampling copy), so a
live switch there makes rank 0 enter ZeRO-3 collectives alone while the other ranks wait in
`scatter_object_list` for its next command: a collective mismatch on gloo (`Received data size
doesn't match expected size`), a hang on NCCL. So:

    zero3_loading(ds)      the switch is on only for the policy / pi_ref loads, which every rank
                           makes together (backends/distributed/zero3.py), and off again when the load returns
    zero3_suspended()      the switch is off inside the block and restored after it: a guard for
                           rank-0-only model loads (backends/scale/retrieval.py), whatever the caller left on

Nothing here imports transformers unless it is already imported (a toy run never loads it).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


def zero3_enabled() -> bool:
    """transformers' verdict (`is_deepspeed_zero3_enabled()`); False when transformers' DeepSpeed
    integration was never imported (then nothing has switched it on)."""
    mod = sys.modules.get("transformers.integrations.deepspeed")
    return bool(mod is not None and mod.is_deepspeed_zero3_enabled())


@contextlib.contextmanager
def zero3_loading(ds_config: dict) -> Iterator[object]:
    """Switch transformers' ZeRO-3 loading on for the block (a `from_pretrained` inside loads straight
    into ZeRO-3 partitions; collective: every rank must run the same loads), then off again, so that no
    later, rank-0-only load becomes a ZeRO-3 collective. Yields the HfDeepSpeedConfig. Restores an
    HfDeepSpeedConfig that was live before the block (nested use). Raises ImportError without
    transformers / accelerate."""
    # lazy: transformers' DeepSpeed integration only under ZeRO-3
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_ds

    before = hf_ds._hf_deepspeed_config_weak_ref
    keep = HfDeepSpeedConfig(ds_config)  # SCALE: from_pretrained loads into ZeRO-3 partitions
    try:
        yield keep
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = before


@contextlib.contextmanager
def zero3_suspended() -> Iterator[bool]:
    """transformers' ZeRO-3 switch off inside the block, as it was after it. Yields whether it was on
    (a caller may log it). For loads that run on one rank only (the embedding model on rank 0)."""
    mod = sys.modules.get("transformers.integrations.deepspeed")
    if mod is None:
        yield False
        return
    before = mod._hf_deepspeed_config_weak_ref
    was_on = bool(mod.is_deepspeed_zero3_enabled())
    mod._hf_deepspeed_config_weak_ref = None
    try:
        yield was_on
    finally:
        mod._hf_deepspeed_config_weak_ref = before
