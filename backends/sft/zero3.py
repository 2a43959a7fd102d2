"""The SFT run at scale: the paper's recipe on DeepSpeed ZeRO-3 through the project's ZeRO-3 engine
(backends/distributed/zero3.ZeRO3Policy).
    deepspeed --num_gpus 8 --module backends.sft.zero3 --data data/teacher.jsonl --model /models/Qwen3-8B --out /ckpt/sft
    torchrun --nproc_per_node 8 -m backends.sft.zero3 --data data/teacher.jsonl --model /models/Qwen3-8B --out /ckpt/sft
    python -m backends.sft.zero3 --data data/teacher.jsonl --model /models/Qwen3-8B --out /ckpt/sft --dry-run
    ... --save-every 50 (checkpoints), the same line + --resume after a stop or a crash

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the appendix's SFT training: "DeepSpeed ZeRO-3, 5 epochs, lr 4e-5, cosine with 10 %
warm-up, bf16, weight decay 0, per-device batch 1, gradient accumulation 16, effective batch 128,
max length 16,384, span masking of <tool_output>". Data, filters, conversions and the loss mask come
from sft.py; length bucketing and the schedule from backends/sft/pack.py.

Why the project's ZeRO-3 engine and not TRL's SFTTrainer
1. The mask: the paper masks `<tool_output>` spans *inside* the assistant turn. SFTTrainer's
   completion-only / assistant-only loss masks the prompt, not spans within the answer; we would
   need our own collator anyway, and then the trainer adds nothing but its loop.
2. One engine for SFT and RL: ZeRO3Policy is what full-mode RL trains with (same DeepSpeed JSON
   layout, same chunked log-prob head `fast_logprobs.token_logprobs`, same HF-format gathered save,
   tested on 2 gloo ranks). The SFT checkpoint is written by the same `save_pretrained` that full
   mode's checkpoints use, and is read by the same loader.
3. Pins: TRL is not in the tested GPU set (constraints/gpu.txt: vllm 0.32 pins torch and
   transformers); adding it would add a fourth package whose version must agree with them.
The cost: our loop is ~100 lines that we test ourselves (tests/test_sft_zero3.py) instead of a
trainer used by many.

Loss per optimizer step (global token mean over the step's examples, all ranks):
    L = - sum_{examples e in the step} sum_t mask_{e,t} log pi(x_{e,t} | x_{e,<t}) / sum_e sum_t mask_{e,t}
Every rank computes the same step plan (sft_pack.step_plan, deal, bucket) and knows the global
normaliser without communication; a rank with fewer micro-batches than another runs padding passes
(2 pad tokens through the model, weight 0: `sft_step`), so that all ranks make the same number of
ZeRO-3 forwards and every backward has a graph. A pass makes the same parameter gathers whatever its
length and loss tokens (the LM head is one module call, fast_logprobs.ChunkedHead), so ranks with
examples of different lengths stay in step (tests/test_zero3_collectives.py).

Checkpoints (`--save-every N`): every N optimizer steps each rank writes its DeepSpeed partition and
rank 0 the step's records into `<out>.ckpt/checkpoints/step-NNNNNN` (atomically, the newest `--keep`
kept); `--resume` loads the newest and continues at the next step of the same plan, so a run killed
after a checkpoint ends with the weights of an uninterrupted run (tests/test_sft_resume.py).

Output (`--out DIR`, written atomically: DIR.tmp, then renamed): the HF checkpoint (config,
safetensors, tokenizer whose chat template defaults to the scaffold's system prompt), `rubricem.json`
(the run card: system prompt and a full-preset run configuration with model = DIR, read by scripts/ask.py;
plus "sft": the SFT settings, data stats and losses), `sft_info.json` (the same stats).

Deviations from the paper
1. LLaMA-Factory averages the loss per micro-batch, then over accumulation steps; we take one token
   mean over the whole optimizer step (each token weighs the same whatever its example's length).
2. Gradient checkpointing and the optimizer placement are not in the paper's SFT line; we checkpoint
   (as LLaMA-Factory does by default) and keep the optimizer on the GPU, as torch's AdamW (no CUDA
   op to build at start; `--offload-optimizer` moves it to the CPU, DeepSpeedCPUAdam, as full-mode
   RL does).
3. Examples over the maximum length are dropped and counted (sft.py, deviation 3).
4. AdamW betas (0.9, 0.95) and gradient clipping 1.0 are ours (the paper gives neither for SFT).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from backends.run import checkpoint as ckpt_mod
from backends.run.data import _read_jsonl, sft_segments
from backends.scale.settings import FullConfig
from backends.distributed.zero3 import ZeRO3Policy
from backends.distributed.dist import (_shutdown, all_reduce_sum, barrier, device_kind, dist_env,
                                       exit_process, init_distributed)
from backends.distributed.plan import model_shape, sft_plan_lines
from backends.run.presets import full_preset
from backends.run.runcard import CARD, save_with_run_card
from backends.sft.pack import bucket, deal, lr_at, step_plan
from policy import _padding_pass
from scaffold import SYSTEM_PROMPT, SYSTEM_PROMPT_COMPACT
from sft import encode_trajectory, filter_and_convert

log = logging.getLogger("rubricem.sft_zero3")


@dataclass
class SFTRunConfig:
    """The SFT run (flags of `backends.sft.zero3`); PAPER values from the appendix."""

    epochs: int = 5
    """PAPER: 5 epochs."""
    lr: float = 4e-5
    """PAPER: lr 4e-5."""
    warmup_frac: float = 0.1
    """PAPER: cosine schedule with 10 % warm-up."""
    batch: int = 128
    """PAPER: effective batch 128 (8 GPUs x per-device batch 1 x accumulation 16)."""
    micro_batch: int = 1
    """PAPER: per-device batch 1."""
    max_len: int = 16384
    """PAPER: max length 16,384."""
    weight_decay: float = 0.0
    """PAPER: weight decay 0."""
    bf16: str = "auto"
    """PAPER: bf16 ("auto" = on GPU, off on CPU where bf16 matmuls are slow and untested)."""
    gradient_checkpointing: bool = True
    """ours (deviation 2)"""
    offload_optimizer: bool = False
    """ours (deviation 2)"""
    optimizer: str = "auto"
    """"auto" = DeepSpeed's AdamW entry on GPU (torch's AdamW inside, no CUDA build; DeepSpeedCPUAdam
    when offloaded), a torch AdamW client optimizer on CPU (backends/scale/settings.py)."""
    grad_clip: float = 1.0
    """ours (deviation 4)"""
    max_steps: int = 0
    """stop after this many optimizer steps of the full schedule (0 = all epochs; tests)."""
    save_every: int = 0
    """ours: a resumable checkpoint (DeepSpeed's partitions + the step's records) every N optimizer
    steps into `<out>.ckpt/checkpoints/step-NNNNNN` (0 = none); `--resume` continues from the
    newest. At 8B each one is ~98 GB of fp32 master weights and Adam moments (12P bytes)."""
    keep: int = 2
    """ours: newest SFT checkpoints kept (>= 1)"""
    seed: int = 0
    scaffold: str = "structured"
    system: str = "full"
    """the system prompt of the examples and of the run card: "full" (scaffold.SYSTEM_PROMPT), or
    "compact" (toy models)"""

    def full_config(self):
        """The ZeRO-3 engine settings (settings.FullConfig) this SFT run implies, for the memory plan."""
        return FullConfig(offload_optimizer=self.offload_optimizer,
                          gradient_checkpointing=self.gradient_checkpointing,
                          bf16="on" if self.bf16 in ("auto", "on") else "off", vllm_max_model_len=self.max_len)


def system_prompt(name: str) -> str:
    return {"full": SYSTEM_PROMPT, "compact": SYSTEM_PROMPT_COMPACT}.get(name, name)


def sft_deepspeed_config(cfg: SFTRunConfig, world: int, device: str) -> tuple[dict, object]:
    """(DeepSpeed JSON, settings.FullConfig) of the SFT engine: ZeRO-3, the SFT batch arithmetic
    (train_batch_size nominal: the accumulation boundary is set by the loop), bf16 per cfg.bf16.
    The optimizer: DeepSpeed's AdamW on the GPU ("torch_adam": torch.optim.AdamW unless offloaded,
    DeepSpeedCPUAdam when offloaded), a torch AdamW client optimizer on the CPU (cfg.optimizer)."""
    full = FullConfig(offload_optimizer=cfg.offload_optimizer, gradient_checkpointing=cfg.gradient_checkpointing,
                      bf16=cfg.bf16, optimizer=cfg.optimizer, weight_decay=cfg.weight_decay)
    bf16 = cfg.bf16 == "on" or (cfg.bf16 == "auto" and device == "cuda")
    gas = max(1, cfg.batch // max(1, cfg.micro_batch * world))
    zero = {"stage": 3,  # PAPER: ZeRO-3
            "contiguous_gradients": True, "overlap_comm": device == "cuda",
            "stage3_gather_16bit_weights_on_model_save": False}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device == "cuda"}
    ds = {"train_batch_size": cfg.micro_batch * gas * world, "train_micro_batch_size_per_gpu": cfg.micro_batch,
          "gradient_accumulation_steps": gas, "gradient_clipping": float(cfg.grad_clip),
          "bf16": {"enabled": bf16}, "zero_optimization": zero, "steps_per_print": 10 ** 9,
          "wall_clock_breakdown": False}
    if cfg.optimizer == "deepspeed" or (cfg.optimizer == "auto" and device == "cuda"):
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": cfg.lr, "betas": list(full.adam_betas),
                                                        "eps": 1e-8, "weight_decay": cfg.weight_decay}}
        if not cfg.offload_optimizer:
            # SCALE: on the GPU DeepSpeed's AdamW is FusedAdam, a CUDA op JIT-built with nvcc at
            # start, whose CUDA minor must equal torch's exactly for CUDA 13 (DeepSpeed 0.19.8,
            # op_builder/builder.py assert_no_cuda_mismatch has no tolerance entry for 13). torch's
            # AdamW (runtime/engine.py, get_optimizer_configuration) needs no build. Offloaded, the
            # optimizer is DeepSpeedCPUAdam (a C++ op, no nvcc), and torch's would step on the CPU.
            ds["optimizer"]["params"]["torch_adam"] = True
    else:
        ds["zero_allow_untested_optimizer"] = True
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds, full


def read_records(paths) -> list[dict]:
    """Teacher records (sft_teacher: "query" + "segments") or ChatML rows ("messages": the last user
    turn is the query, the assistant turn is split at its tool outputs) from JSONL files, as
    sft.filter_and_convert reads them. Raises ValueError naming file and line for a non-JSON line."""
    out = []
    for p in paths:
        for r in _read_jsonl(p):
            if isinstance(r, dict) and "segments" not in r and isinstance(r.get("messages"), list):
                m = r["messages"]
                users = [x.get("content") for x in m if isinstance(x, dict) and x.get("role") == "user"]
                last = m[-1] if m and isinstance(m[-1], dict) else {}
                r = {"query": users[-1] if users else None,
                     "segments": sft_segments(last.get("content", "")) if last.get("role") == "assistant"
                     and isinstance(last.get("content"), str) else []}
            out.append(r)
    return out


def prepare(tok, records: list[dict], cfg: SFTRunConfig) -> tuple[list, dict]:
    """Filter, convert and encode (sft.py): ([(ids, mask)], stats) with the filter counts and
    "too_long"."""
    examples, stats = filter_and_convert(records, cfg.scaffold, system_prompt(cfg.system))
    enc, too_long = [], 0
    for ex in examples:
        e = encode_trajectory(tok, ex, cfg.max_len)
        if e is None:
            too_long += 1
        else:
            enc.append(e)
    stats["too_long"] = too_long
    stats["examples"] = len(enc)
    stats["tokens"] = sum(len(i) for i, _ in enc)
    stats["trained_tokens"] = sum(sum(m) for _, m in enc)
    return enc, stats


def _batch(encoded, idx, pad: int):
    L = max(len(encoded[i][0]) for i in idx)
    x = torch.full((len(idx), L), pad, dtype=torch.long)
    att = torch.zeros((len(idx), L), dtype=torch.long)
    m = torch.zeros((len(idx), L), dtype=torch.bool)
    for r, i in enumerate(idx):
        ids, mk = encoded[i]
        x[r, : len(ids)] = torch.tensor(ids)
        att[r, : len(ids)] = 1
        m[r, : len(ids)] = torch.tensor(mk, dtype=torch.bool)
    return x, att, m


def sft_step(policy, encoded: list, mine: list[list[int]], n_micro: int, n_tok: int, pad: int) -> float:
    """One optimizer step's forward/backward passes on this rank (collective): `mine`, this rank's
    micro-batches (lists of example indices into `encoded`), then padding passes up to `n_micro`,
    the most micro-batches any rank has this step, so that every rank runs the same ZeRO-3
    forwards. n_tok: the step's masked tokens over all ranks (the global normaliser, >= 1 used).
    Returns this rank's summed loss (float). Raises ValueError when mine has more than n_micro
    micro-batches."""
    if len(mine) > n_micro:
        raise ValueError(f"{len(mine)} micro-batches on this rank but n_micro = {n_micro}")
    total = 0.0
    for j in range(n_micro):
        if j < len(mine):
            x, att, m = _batch(encoded, mine[j], pad)
            logp = policy.logprobs(x, att, loss_mask=m)  # (B, L), column t = log pi(x_t | x_<t)
            # Eq.: L = - sum_t mask_t log pi(x_t | x_<t) / sum over the step of mask_t
            loss = -(logp * m.to(logp.device)).sum() / max(1, n_tok)
        else:
            # SCALE: a padding pass (the rank has fewer examples this step): 2 pad tokens through
            # the model and the head with weight 0. It keeps the ZeRO-3 gathers in step with the
            # other ranks (a pass makes the same module calls whatever its length and loss tokens:
            # one ChunkedHead call, fast_logprobs.py) and gives DeepSpeed's backward a loss with a
            # graph (a 1-token pass scores nothing and has no grad_fn: DeepSpeed asserts, the other
            # ranks hang).
            x, att = _padding_pass(pad)  # (1, 2), as policy.policy_update's padding pass
            loss = policy.logprobs(x, att).sum() * 0.0
        policy.backward(loss, boundary=j == n_micro - 1)
        total += float(loss.detach())
    return total


def train(policy, encoded: list, cfg: SFTRunConfig, rank: int, world: int, pad: int, *,
          start: int = 0, records: list | None = None, on_step=None) -> list[dict]:
    """The SFT loop on a ZeRO3Policy (collective: every rank calls it with the same data). Returns one
    record per optimizer step: step, lr, loss (the global token mean), tokens, grad_norm.
    start: optimizer steps already done (a resumed run: the plan is a pure function of the data,
    cfg.epochs, cfg.batch and cfg.seed, so step s is the same step whenever it runs); records:
    their records. on_step(steps done, records) after each step (checkpoints; collective)."""
    lengths = [len(i) for i, _ in encoded]
    masked = [sum(m) for _, m in encoded]
    steps = step_plan(len(encoded), cfg.epochs, cfg.batch, cfg.seed)
    n_steps = len(steps)  # the schedule's length; max_steps stops early on the same schedule
    if cfg.max_steps:
        steps = steps[: cfg.max_steps]
    records = list(records or [])
    policy.train()
    for s in range(start, len(steps)):
        idx = steps[s]
        lr = lr_at(s, n_steps, cfg.lr, cfg.warmup_frac)
        for g in policy.optimizer.param_groups:
            g["lr"] = lr
        # the learning rate the optimizer itself now holds (DeepSpeed's ZeRO-3 wrapper forwards it)
        held = getattr(policy.optimizer, "optimizer", policy.optimizer).param_groups[0]["lr"]
        shares = [bucket(sh, lengths, cfg.max_len, cfg.micro_batch) for sh in deal(idx, lengths, world)]
        n_tok = sum(masked[i] for i in idx)  # the global normaliser, known on every rank
        total = sft_step(policy, encoded, shares[rank], max(len(b) for b in shares), n_tok, pad)
        gn = policy.step()
        total = all_reduce_sum([total])[0]
        rec = {"step": s + 1, "lr": held, "loss": total, "tokens": n_tok, "grad_norm": gn}
        records.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
        if on_step is not None:
            on_step(s + 1, records)
    return records


# ----------------------------------------------------------------------------------------------------
# Resumable SFT checkpoints (ours; not in the paper)

_SFT_STATE = "sft_state.json"


def ckpt_root(out: str) -> str:
    """The run directory of out's resumable checkpoints: `<out>.ckpt` (its checkpoints/step-* are
    checkpoint.list_checkpoints's layout)."""
    return out.rstrip("/") + ".ckpt"


def plan_identity(cfg: SFTRunConfig, encoded: list, world: int) -> dict:
    """What must not change between a checkpoint and its resume: the step plan's inputs (examples and
    their lengths, epochs, batch, seed, max length, micro-batch), the schedule (lr, warm-up) and the
    world size (each rank's DeepSpeed partition is its own)."""
    import hashlib

    h = hashlib.sha256(json.dumps([[len(i), sum(m)] for i, m in encoded]).encode()).hexdigest()[:16]
    return {"examples": len(encoded), "lengths_sha256": h, "epochs": cfg.epochs, "batch": cfg.batch,
            "seed": cfg.seed, "max_len": cfg.max_len, "micro_batch": cfg.micro_batch, "lr": cfg.lr,
            "warmup_frac": cfg.warmup_frac, "world_size": world}


def save_sft_checkpoint(policy, out: str, step: int, records: list, identity: dict, rank: int,
                        keep: int) -> str | None:
    """Collective: every rank writes its DeepSpeed partition (fp32 master weights, Adam moments) into
    `<out>.ckpt/checkpoints/.tmp-step-N/zero`, then rank 0 adds sft_state.json (step, records,
    plan identity) and renames the folder to step-N atomically (checkpoint.commit_dir), pruning to
    the newest `keep`. Returns the checkpoint's path on rank 0, None elsewhere. Raises OSError when
    a write fails (older checkpoints stay as they were)."""
    root = os.path.join(ckpt_root(out), ckpt_mod.SUBDIR)
    name = ckpt_mod.step_name(step)
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    policy.engine.save_checkpoint(os.path.join(tmp, "zero"), tag="state")  # SCALE: every rank its partition
    barrier()
    if rank != 0:
        barrier()
        return None
    try:
        with open(os.path.join(tmp, _SFT_STATE), "w", encoding="utf-8") as fh:
            json.dump({"step": int(step), "records": records, "plan": identity}, fh, indent=1)
        ckpt_mod.commit_dir(tmp, final)
        ckpt_mod.prune(ckpt_root(out), max(1, int(keep)))
    finally:
        barrier()
    return final


def load_sft_checkpoint(policy, out: str, identity: dict) -> tuple[int, list]:
    """Collective: the newest SFT checkpoint of `<out>.ckpt` that has its state, loaded into `policy`
    (DeepSpeed partitions and optimizer); returns (steps done, their records), or (0, []) when there
    is none. Raises checkpoint.CheckpointError naming every difference when the checkpoint was made
    for another plan (data, recipe or world size: resume with the same ones)."""
    ckpts = [p for _, p in ckpt_mod.list_checkpoints(ckpt_root(out))
             if os.path.isfile(os.path.join(p, _SFT_STATE))]
    if not ckpts:
        return 0, []
    with open(os.path.join(ckpts[-1], _SFT_STATE), encoding="utf-8") as fh:
        state = json.load(fh)
    diff = {k: (v, identity.get(k)) for k, v in state["plan"].items() if identity.get(k) != v}
    if diff:
        shown = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in diff.items())
        raise ckpt_mod.CheckpointError(f"cannot resume SFT from {ckpts[-1]}: {shown}. Resume with the "
                                       "same data, recipe and number of ranks, or start without --resume")
    policy.engine.load_checkpoint(os.path.join(ckpts[-1], "zero"), tag="state",
                                  load_optimizer_states=True, load_lr_scheduler_states=False)
    return int(state["step"]), list(state["records"])


def write_checkpoint(policy, tok, out: str, cfg: SFTRunConfig, info: dict, rank: int) -> None:
    """HF weights (collective gathered save) + tokenizer + run card + sft_info.json into out (via
    out.tmp and a rename on rank 0)."""
    tmp = out.rstrip("/") + ".tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    barrier()
    policy.save_pretrained(tmp)
    if rank == 0:
        system = system_prompt(cfg.system)
        run = full_preset()
        run.model = os.path.abspath(out)
        run.rollout.system_prompt = cfg.system if cfg.system in ("full", "compact") else "full"
        save_with_run_card(tmp, tok, asdict(run), system)
        card_path = os.path.join(tmp, CARD)
        with open(card_path, encoding="utf-8") as fh:
            card = json.load(fh)
        card["sft"] = info
        with open(card_path, "w", encoding="utf-8") as fh:
            json.dump(card, fh, indent=1)
        with open(os.path.join(tmp, "sft_info.json"), "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a half-written checkpoint is never at `out`
    barrier()


def run(cfg: SFTRunConfig, data: list[str], model: str, out: str, resume: bool = False) -> dict:
    """The whole SFT run on this launch (collective). Returns the info dict written to the card.
    resume: continue from the newest checkpoint in `<out>.ckpt` (cfg.save_every writes them); a
    fresh run when there is none. Raises ValueError when no example survives the filters, and
    checkpoint.CheckpointError for a checkpoint of another plan."""
    from transformers import AutoTokenizer  # lazy: transformers when the run starts, not for --dry-run

    # SCALE: every group of the run waits up to full.dist_timeout_min (rank 0 gathers and writes
    # the checkpoints while the others wait)
    env = init_distributed(dist_env(), timeout_min=cfg.full_config().dist_timeout_min)
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model)
    encoded, stats = prepare(tok, read_records(data), cfg)
    if not encoded:
        raise ValueError(f"no SFT example left after the filters and the length cap: {stats}")
    if rank == 0:
        print(json.dumps({"data": stats}), flush=True)
    ds, full = sft_deepspeed_config(cfg, world, device_kind())
    policy = ZeRO3Policy.from_pretrained(model, ds, cfg.lr, full=full)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    identity = plan_identity(cfg, encoded, world)
    start, done = load_sft_checkpoint(policy, out, identity) if resume else (0, [])
    if rank == 0 and start:
        print(json.dumps({"resumed_at_step": start}), flush=True)

    def checkpoint(step: int, records: list) -> None:
        if cfg.save_every and step % cfg.save_every == 0:
            save_sft_checkpoint(policy, out, step, records, identity, rank, cfg.keep)

    records = train(policy, encoded, cfg, rank, world, pad, start=start, records=done, on_step=checkpoint)
    info = {"base_model": model, "data": [os.path.abspath(p) for p in data], "config": asdict(cfg),
            "world_size": world, "stats": stats, "steps": records, "resumed_at_step": start,
            "seconds": round(time.perf_counter() - t0, 2), "launched": env.launched}
    write_checkpoint(policy, tok, out, cfg, info, rank)
    return info


def dry_run_text(cfg: SFTRunConfig, model: str, world: int, gpu_gib: float, n_examples: int,
                 mean_tokens: float) -> str:
    """The SFT plan: memory per GPU at max_len and GPU-hours (backends/distributed/plan.py)."""
    return "\n".join(["RubricEM SFT: dry run (nothing is loaded or trained)",
                      f"  recipe: {cfg.epochs} epochs, lr {cfg.lr:g}, cosine with {cfg.warmup_frac:.0%} warm-up, "
                      f"weight decay {cfg.weight_decay:g}, effective batch {cfg.batch}, micro-batch "
                      f"{cfg.micro_batch}, max length {cfg.max_len}, ZeRO-3"]
                     + sft_plan_lines(model_shape(model), cfg, world, gpu_gib * 2 ** 30, n_examples,
                                      mean_tokens))


def main(argv=None) -> int:
    """`[deepspeed --module | torchrun -m] backends.sft.zero3 --data D.jsonl [D2.jsonl ...] --model M
    --out DIR [--dry-run] [options]`."""
    ap = argparse.ArgumentParser(prog="backends.sft.zero3", description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="teacher JSONL (backends.sft.teacher) or ChatML JSONL")
    ap.add_argument("--model", required=True, help="base model folder (HF format)")
    ap.add_argument("--out", required=True, help="output folder of the SFT checkpoint")
    ap.add_argument("--dry-run", action="store_true", help="print the memory and GPU-hour plan; train nothing")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in OUT.ckpt (--save-every writes them)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's launcher
    ap.add_argument("--world", type=int, default=8, help="dry run: GPUs (PAPER: 8 x H100 80GB)")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="dry run: GPU memory")
    ap.add_argument("--examples", type=int, default=11000, help="dry run: examples (PAPER: ~11K)")
    ap.add_argument("--mean-tokens", type=float, default=0.0,
                    help="dry run: mean tokens per example (0 = 6000, assumed)")
    for f in dataclasses.fields(SFTRunConfig):
        if f.type in ("bool", bool):
            ap.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                            default=f.default)
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = ap.parse_args(argv)
    cfg = SFTRunConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(SFTRunConfig)})
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if a.dry_run:
        mean = a.mean_tokens or 6000.0
        print(dry_run_text(cfg, a.model, a.world, a.gpu_gib, a.examples, mean))
        return 0
    if cfg.save_every < 0 or cfg.keep < 1:
        ap.error("--save-every must be >= 0 and --keep >= 1")
    try:
        run(cfg, a.data, a.model, a.out, resume=a.resume)
    except ckpt_mod.CheckpointError as e:  # every rank reads the same checkpoint and stops here
        print(f"backends.sft.zero3: {e}", file=sys.stderr, flush=True)
        _shutdown()
        exit_process(2)
    _shutdown()
    exit_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
