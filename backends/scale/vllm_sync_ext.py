"""Worker-side half of the live weight sync into a vLLM engine (full mode; rollouts of §3.1 under the
newest policy pi_theta after every SS-GRPO update of §3.3).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
The paper samples rollouts with the current policy after each update; it does not say how the rollout
engine receives the weights. This module is our plumbing for that, loaded into the vLLM worker with
`LLM(..., worker_extension_cls="backends.scale.vllm_sync_ext.WeightSyncExt")`; `vllm_sampler.VLLMSampler` calls its
methods by name through `LLM.collective_rpc`. It must be importable by the worker (the repository root
on `PYTHONPATH`, or the same process for an in-process engine). vLLM is imported inside the methods
only, so the module itself imports without vLLM.

One sync is a transaction of three calls, so the trainer can send the parameters in chunks and the whole
model never exists twice in memory:
    rubricem_sync_begin()          vLLM's layer-wise reload set-up (every layer back to checkpoint
                                   format, weight loaders wrapped to buffer)
    rubricem_sync_load(weights)    model.load_weights on one chunk of (hf_name, tensor) pairs; a layer
                                   is re-processed (fused q/k/v, gate/up, CPU GEMM re-pack) and copied
                                   back into the engine's storage as soon as all its tensors arrived
    rubricem_sync_finish()         vLLM's layer-wise finalisation, then the tied-lm_head re-pack
These are the same steps, in the same order, as vLLM's own `reload_weights(weights_iterator=...)`
(vllm.model_executor.model_loader.reload.inplace, 0.32), split at the iterator so that each chunk can
travel in its own `collective_rpc` call with its own deadline.
The engine runs in the trainer's process (docs/full_mode.md, "One engine path"), so a chunk's tensors
arrive as they are: on a GPU the gathered parameters stay on the device and `load_weights` copies
them into the engine's storage, one device copy per byte.
`rubricem_reload_from_path(path)` is the disk fallback: vLLM's `reload_weights(weights_path=...)` plus
the same re-pack.

Deviations from the paper
1. None in the math: this module moves weights, it computes nothing the paper fixes.
2. Tied embeddings (Qwen3-0.6B/1.7B/4B and the toy model): vLLM's layer-wise reload updates
   `embed_tokens` but never re-processes `lm_head`, whose prepacked CPU GEMM copy would keep the old
   output matrix (measured: log-prob errors up to 2.7). We re-run the lm_head's
   `process_weights_after_loading` on the shared, already updated weight after every reload.
"""
from __future__ import annotations

import hashlib
import os
import time

import torch


def _tied_lm_head(model):
    """The lm_head module if its weight is the very tensor of the input embedding, else None."""
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if lm_head is None or embed is None:
        return None
    w_head, w_embed = getattr(lm_head, "weight", None), getattr(embed, "weight", None)
    if w_head is None or w_head is not w_embed:
        return None
    return lm_head


class WeightSyncExt:
    """Methods mixed into the vLLM worker class (so `self` is the worker: `self.model_runner`,
    `self.vllm_config`). Call them through `llm.collective_rpc("<name>", kwargs=...)`; every method
    returns a small dict of plain Python values (it travels back through the rpc).

    Only one sync transaction may be open at a time; the caller (VLLMSampler) serialises them.
    """

    def rubricem_sync_begin(self) -> dict:
        """Open a sync transaction: vLLM's `initialize_layerwise_reload` on the live model.

        Returns {"tied_lm_head": bool, "t_s": float seconds}. Until `rubricem_sync_finish` returns,
        layers that have not received all their tensors are on the meta device: the engine must not
        run a forward pass in between. Raises RuntimeError if a transaction is already open.
        """
        # lazy: vLLM internals, inside a vLLM worker only
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_rubricem_open", False):
            raise RuntimeError("a weight-sync transaction is already open; call rubricem_sync_finish")
        t0 = time.perf_counter()
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        self._rubricem_open = True
        self._rubricem_loaded = 0
        return {"tied_lm_head": _tied_lm_head(model) is not None, "t_s": time.perf_counter() - t0}

    def rubricem_sync_load(self, weights) -> dict:
        """Load one chunk: weights is a list of (hf_name: str, tensor) pairs in checkpoint format
        (Hugging Face names and shapes, any float dtype; the loader casts to the engine dtype).

        Returns {"n": tensors in this chunk, "loaded": engine parameters that received data (a
        fused qkv_proj counts once), "t_s": seconds, "sha256": {hf_name: hex digest of the bytes
        handed over} when RUBRICEM_SYNC_DIGESTS=1 (tests compare them with the trainer's weights),
        else {}}. Raises RuntimeError outside a transaction; an unknown name raises whatever the
        model's `load_weights` raises (KeyError).
        """
        from vllm.config import set_current_vllm_config  # lazy: as above

        if not getattr(self, "_rubricem_open", False):
            raise RuntimeError("no weight-sync transaction is open; call rubricem_sync_begin first")
        t0 = time.perf_counter()
        digests = {}
        if os.environ.get("RUBRICEM_SYNC_DIGESTS") == "1":
            for name, t in weights:
                b = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
                digests[name] = hashlib.sha256(b.numpy().tobytes()).hexdigest()
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            loaded = model.load_weights(iter(weights))
        self._rubricem_loaded += len(weights)
        return {"n": len(weights), "loaded": len(loaded or ()), "t_s": time.perf_counter() - t0,
                "sha256": digests}

    def rubricem_sync_finish(self) -> dict:
        """Close the transaction: vLLM's `finalize_layerwise_reload` (layers that received nothing get
        their previous tensors back), the tied-lm_head re-pack, and the runner's cache resets that
        vLLM's `reload_weights` performs. Safe to call after a failed `rubricem_sync_load`.

        Returns {"n_tensors": tensors received in this transaction, "repacked_lm_head": bool,
        "t_finalize_s", "t_repack_s": seconds}. The caller must still `llm.reset_prefix_cache()`.
        """
        from vllm.config import set_current_vllm_config  # lazy: as above
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # lazy: as above

        t0 = time.perf_counter()
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        self._rubricem_open = False
        t1 = time.perf_counter()
        repacked = self._rubricem_repack(model)
        t2 = time.perf_counter()
        self._rubricem_reset_runner_caches()
        return {"n_tensors": getattr(self, "_rubricem_loaded", 0), "repacked_lm_head": repacked,
                "t_finalize_s": t1 - t0, "t_repack_s": t2 - t1}

    def rubricem_named_tensors(self, names) -> dict:
        """{name: [shape, flat float list]} of the engine's own parameters with these names that hold
        data here (the CPU backend keeps linear weights only in its prepacked GEMM copies; the
        embedding and the norms stay readable). For tests on tiny models only."""
        params = dict(self.model_runner.get_model().named_parameters())
        out = {}
        for n in names:
            p = params.get(n)
            if p is not None and p.numel() > 0:
                out[n] = [list(p.shape), p.detach().float().cpu().view(-1).tolist()]
        return out

    def rubricem_reload_from_path(self, path: str) -> dict:
        """Disk fallback: vLLM's `reload_weights(weights_path=path)` (a folder of *.safetensors in
        Hugging Face format), then the tied-lm_head re-pack. vLLM also re-points the engine's
        `model_config.model` at `path`. Returns {"repacked_lm_head": bool, "t_s": seconds}."""
        t0 = time.perf_counter()
        self._rubricem_open = False
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        repacked = self._rubricem_repack(self.model_runner.get_model())
        return {"repacked_lm_head": repacked, "t_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------------

    def _rubricem_repack(self, model) -> bool:
        # SCALE: the CPU backend keeps a prepacked copy of every linear weight; a tied lm_head is not
        # re-processed by the layer-wise reload (no checkpoint tensor targets it), so re-pack it from
        # the shared, already updated embedding. On GPU this re-runs a cheap no-op-like method.
        lm_head = _tied_lm_head(model)
        if lm_head is None:
            return False
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is None or not hasattr(quant_method, "process_weights_after_loading"):
            return False
        quant_method.process_weights_after_loading(lm_head)
        return True

    def _rubricem_reset_runner_caches(self) -> None:
        # What GPUModelRunner.reload_weights does after the reload (LoRA, encoder and multimodal
        # caches hold state derived from the old weights); absent methods are skipped.
        runner = self.model_runner
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, name, None)
            if callable(fn):
                fn()
