"""SFT warm start: a scripted teacher, the paper's SFT filters, and masked supervised fine-tuning.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Implements the SFT stage of the appendix: stage-structured trajectories from a teacher, filtered by the
paper's four rules, trained with the loss on assistant tokens only and `<tool_output>` spans masked.

The teacher (toy/teacher.py) writes complete four-stage trajectories *through the real tool* (BM25
search), and is deliberately imperfect in controllable ways (`TeacherConfig`): along the task's causal
chain it leaves asked facts out of the plan, copies a distractor's value in a research note, leaves
findings out of the writing plan, and forgets the negative constraint; it also writes vague queries and
uncited claims. The SFT policy therefore starts with headroom for RL. The teacher also writes
reflections on its own trajectories (for the reflection meta-policy of §3.4), naming what it missed
and which values were wrong; when such a lesson about the same query comes back as memory, it does not
repeat those mistakes: that is how the policy learns what a bank item is for.

The unstructured scaffold (the scaffold ablation, Fig. 6a-c; scaffold.parse_unstructured) has its own
teacher and warm start: `teacher_trajectory(..., scaffold="unstructured")` draws the same random
numbers as the structured teacher, so for the same query and seed it makes the same imperfections
(same error rates), runs the same searches and writes the same answer, but writes no plan and no
review, and its notes after each tool output are <think> blocks instead of <state_evaluation>. Its
warm start has no memory prompts and no reflection examples (the unstructured agent has neither a
bank nor a reflection meta-policy), and its cache key holds the scaffold.

SFT filters (PAPER, appendix): drop a trajectory
  (1) without a closing </answer>;
  (2) with a non-final turn (a segment followed by a tool output) that does not end in a valid call;
  (3) missing a required tag (<structured_plan>, </structured_plan>, <state_evaluation>, <review>,
      </review>, <answer>);
  (4) with two or more consecutive tool errors.
The teacher produces each defect at a small rate so the filters have real work; counts are logged.

Loss (per example): mean over assistant tokens with mask 1 of -log pi(x_t | x_<t); tool outputs and
the prompt have mask 0 (PAPER: span masking of <tool_output>).

Deviations from the paper
1. The teacher is a script, not Gemini-3.1-Pro; trajectories are short (~200-400 tokens).
2. The toy SFT runs a fixed number of steps sized for ~4 minutes on 2 CPU cores, not 5 epochs.
3. Tiny-model training uses AdamW(0.9, 0.95), lr 2e-3, warm-up + cosine (the paper's 4e-5 is for 8B).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from reflection import reflection_messages
from scaffold import SCAFFOLD_TAGS, THINK_TAGS, build_messages, load_rows
from sft import (REQUIRED_TAGS, UNSTRUCTURED_REQUIRED_TAGS, Segment,  # noqa: F401  (re-exported)
                 sft_filter)
from toy import model as policy
from toy.hf_sampler import autocast, pad_multiple
from toy.report import format_filter_counts, warm_start_line
from toy.teacher import (MEMORY_LESSONS, MISSED_DEFECTS, TeacherConfig, TeacherTrace,  # noqa: F401  (re-exported)
                         _LOCAL_FLAWS, fact_key, memory_missed, memory_wrong, oracle_lesson,
                         random_lesson, teacher_reflection, teacher_trajectory)
from toy.world import SYLLABLES, World

log = logging.getLogger("rubricem.sft")


# The teacher (its flaws, reflections and the oracle lesson) is in toy/teacher.py.


# ----------------------------------------------------------------------------------------------------
# Filters


# The filters are the paper's, shared with the full SFT: sft.sft_filter (root module sft.py).


# ----------------------------------------------------------------------------------------------------
# Examples and training


def encode_example(tok, messages: list, segments: Sequence[Segment]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one chat example: prompt (mask 0) + segments (policy 1, env 0).

    Segments are tokenised one by one, exactly as the rollout engine appends them.
    """
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    mask = [0] * len(ids)
    for is_env, text in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        mask += [0 if is_env else 1] * len(seg)
    return ids, mask


def encode_examples(tok, examples: Sequence[tuple[list, Sequence[Segment]]]):
    """`encode_example` for many examples with batched tokenizer calls (same ids, ~10x faster)."""
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
               for m, _ in examples]
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    flat = [t for _, segs in examples for _, t in segs]
    s_ids = iter(tok(flat, add_special_tokens=False)["input_ids"])
    out = []
    for (_, segs), ids in zip(examples, p_ids):
        ids, mask = list(ids), [0] * len(ids)
        for is_env, _ in segs:
            seg = next(s_ids)
            ids += seg
            mask += [0 if is_env else 1] * len(seg)
        out.append((ids, mask))
    return out


@dataclass
class SFTConfig:
    """SFT hyperparameters (toy values are ours; the default build takes ~15 min on 2 cores and is
    shipped in toy/warm_start/, so a default run loads it instead of training)."""

    n_trajectories: int = 20000
    """teacher trajectories kept after the SFT filters"""
    n_reflections: int = 1200
    """reflection examples (the reflection meta-policy's warm start)"""
    steps: int = 5000
    """optimizer steps"""
    batch_size: int = 16
    """sequences per optimizer step"""
    lr: float = 2e-3
    """peak learning rate (linear warm-up, then cosine to 10 %)"""
    warmup: int = 30
    """warm-up steps"""
    weight_decay: float = 0.1
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max global gradient norm"""
    seed: int = 0
    """seed of the teacher data, the tokenizer and the model initialisation"""
    shipped: bool = True
    """ours: start from the warm start shipped in toy/warm_start/ when it was built with this run's
    configuration (its key equals `warm_start_key`), as the paper starts RL from a released SFT
    checkpoint; false trains it in the run instead (cached under cache_dir). Not in the key."""


def build_sft_data(world: World, tool, tok_system: str, cfg: SFTConfig, tcfg: TeacherConfig,
                   scaffold: str = "structured"):
    """Teacher trajectories (filtered) and reflection examples over the *train* rows; for the
    unstructured scaffold trajectories only, without memory in the prompts.

    Returns (examples, stats): examples are (messages, segments) pairs; stats counts filter drops.
    Raises ValueError for a teacher.memory_lessons outside MEMORY_LESSONS.
    """
    if tcfg.memory_lessons not in MEMORY_LESSONS:
        raise ValueError(f"teacher.memory_lessons must be one of {MEMORY_LESSONS}, got "
                         f"{tcfg.memory_lessons!r}")
    structured = scaffold == "structured"
    rng = random.Random(cfg.seed)
    rows = load_rows(world.train_rows)
    stats = {"generated": 0, "kept": 0}
    examples, traces = [], []
    while len(examples) < cfg.n_trajectories:
        q = rng.choice(rows)
        memory: list[str] = []
        if structured and rng.random() < tcfg.p_memory and traces:
            # Memory is either this query's own lesson from a first attempt (within-episode exact,
            # §3.5: the teacher then avoids what that attempt got wrong) or another query's lesson
            # (cross-episode: nothing in it is about this query, and the teacher ignores it).
            # With memory_lessons "random" both kinds name a random subset of a query's facts.
            if rng.random() < tcfg.p_memory_exact:
                if tcfg.memory_lessons == "random":
                    memory = [random_lesson(q, world, rng)]
                else:
                    first = teacher_trajectory(q, tool, world, rng, tcfg, (), scaffold)
                    memory = [teacher_reflection(q, first)]
            elif tcfg.memory_lessons == "random":
                memory = [random_lesson(rng.choice(rows), world, rng)]
            else:
                src = rng.choice(traces[-200:])
                memory = [teacher_reflection(src[0], src[1])]
        tr = teacher_trajectory(q, tool, world, rng, tcfg, memory, scaffold)
        stats["generated"] += 1
        why = sft_filter(tr.segments, scaffold)
        if why:
            stats[why] = stats.get(why, 0) + 1
            continue
        stats["kept"] += 1
        examples.append((build_messages(q.query, memory, tok_system), tr.segments))
        traces.append((q, tr))
    # The unstructured agent has no reflection meta-policy: no reflection examples.
    picked = rng.sample(traces, min(cfg.n_reflections, len(traces))) if structured else []
    for q, tr in picked:
        traj = "".join(t for _, t in tr.segments).replace("<|im_end|>", "")
        msgs = reflection_messages(q.query, traj, tok_system)
        examples.append((msgs, [(False, teacher_reflection(q, tr) + "<|im_end|>")]))
    return examples, stats


def train_sft(model, tok, encoded: list[tuple[list[int], list[int]]], cfg: SFTConfig,
              progress: bool = True, precision: str = "fp32",
              on_step: Callable[[int, float], None] | None = None) -> dict:
    """Masked next-token SFT. encoded: (ids, mask) pairs. Returns {"loss", "steps", "seconds"}.

    Batches are length-bucketed (sorted by length in chunks of 50 batches) and right-padded.
    precision: the forward's `scaffold.autocast` ("fp32" | "bf16"; ValueError otherwise); the loss,
    gradients, weights and AdamW state are float32 either way.
    on_step(step, loss): called after every optimizer step with its 0-based index and the batch's
    loss (scripts/build_warm_start.py records the loss curve of a short prefix this way).
    """
    cast, mult = autocast(precision), pad_multiple(precision)

    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)

    def lr_at(s: int) -> float:
        if s < cfg.warmup:
            return cfg.lr * (s + 1) / cfg.warmup
        p = (s - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    pad = tok.pad_token_id
    model.train()
    t0, ema, step = time.perf_counter(), None, 0
    bar = tqdm(total=cfg.steps, desc="sft", disable=not progress, mininterval=2.0)
    while step < cfg.steps:
        perm = torch.randperm(len(encoded), generator=g).tolist()
        chunk = cfg.batch_size * 50
        batches = []
        for c in range(0, len(perm), chunk):
            part = sorted(perm[c : c + chunk], key=lambda i: len(encoded[i][0]))
            batches += [part[b : b + cfg.batch_size] for b in range(0, len(part), cfg.batch_size)]
        order = torch.randperm(len(batches), generator=g).tolist()
        for bi in order:
            if step >= cfg.steps:
                break
            idx = batches[bi]
            L = -(-max(len(encoded[i][0]) for i in idx) // mult) * mult  # rounded up (bf16 only)
            x = torch.full((len(idx), L), pad, dtype=torch.long)
            m = torch.zeros((len(idx), L), dtype=torch.float32)
            att = torch.zeros((len(idx), L), dtype=torch.long)
            for r, i in enumerate(idx):
                ids, mk = encoded[i]
                x[r, : len(ids)] = torch.tensor(ids)
                m[r, : len(ids)] = torch.tensor(mk, dtype=torch.float32)
                att[r, : len(ids)] = 1
            sel = m[:, 1:] > 0  # (B, L-1): predict token t+1 from position t where it is trained
            with cast:
                hidden = model.get_decoder()(input_ids=x, attention_mask=att).last_hidden_state
                # The vocabulary projection runs only on trained positions (~15% faster per step).
                h = hidden[:, :-1][sel]  # (N_mask, H)
                n = h.shape[0]
                if mult > 1:  # bf16: N_mask rounded up to a multiple of 4 * mult rows, as L above
                    h = torch.nn.functional.pad(h, (0, 0, 0, -n % (4 * mult)))
                logits = model.get_output_embeddings()(h).float()[:n]  # (N_mask, V)
            # SFT loss = sum_t mask_t * (-log pi(x_t | x_<t)) / sum_t mask_t  (tool outputs masked)
            loss = torch.nn.functional.cross_entropy(logits, x[:, 1:][sel])
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            if on_step is not None:
                on_step(step, loss.item())
            step += 1
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    model.eval()
    return {"loss": ema, "steps": step, "seconds": time.perf_counter() - t0}


def tok_text(messages: list, segments: Sequence[Segment]) -> str:
    """Plain text of one example, chat markup included (tokenizer training text; the layout of
    toy.model.CHATML_TEMPLATE)."""
    head = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return head + "<|im_start|>assistant\n" + "".join(t for _, t in segments)


def examples_digest(encoded: Sequence[tuple[list[int], list[int]]]) -> str:
    """sha256 of the encoded SFT examples in training order (token ids and loss masks, as
    little-endian int32, each example's length first). No float enters them, so one configuration
    gives the same digest on any machine (docs/metrics.md, "Reproducibility")."""
    h = hashlib.sha256()
    for ids, mask in encoded:
        h.update(np.asarray([len(ids)], dtype="<i4").tobytes())
        h.update(np.asarray(ids, dtype="<i4").tobytes())
        h.update(np.asarray(mask, dtype="<i4").tobytes())
    return h.hexdigest()


def cache_key(obj: dict) -> str:
    """sha256 of a JSON-serialisable configuration: the warm start's cache key."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


_WORLD_LATER = ("p_unmarked",)  # WorldConfig fields added after the shipped warm start
# TeacherConfig fields added after the shipped warm start, keyed only away from their default
_TEACHER_LATER = {"memory_lessons": ("attempt",), "memory_first": (False,), "memory_append": (False,)}


def warm_start_key(world_config, system: str, cfg: SFTConfig, tcfg: TeacherConfig, size: str,
                   vocab_size: int, scaffold: str = "structured", extra_key: dict | None = None) -> str:
    """The warm start's cache key (16 hex characters): world, teacher, SFT and model configuration,
    the system prompt and the scaffold. The structured scaffold's key leaves the scaffold out, so
    warm starts cached before the scaffold ablation existed stay valid; every other scaffold is in
    the key, so two scaffolds' warm starts never share a cache entry."""
    teacher = {k: v for k, v in asdict(tcfg).items() if not (k in _LOCAL_FLAWS and v == 0)
               and not _TEACHER_LATER.get(k, (None,)) == (v,)}
    # a world knob added later is keyed only when on, so earlier warm starts keep their keys
    world = {k: v for k, v in asdict(world_config).items() if not (k in _WORLD_LATER and v == 0)}
    sft = {k: v for k, v in asdict(cfg).items() if k != "shipped"}  # where it comes from, not what
    return cache_key({"world": world, "teacher": teacher, "sft": sft,
                      "size": size, "vocab": vocab_size, "system": system, "v": 1,
                      **({} if scaffold == "structured" else {"scaffold": scaffold}),
                      **(extra_key or {})})


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_start")
"""The shipped warm start (scripts/build_warm_start.py --out toy/warm_start, default configuration)."""


def shipped_manifest() -> dict | None:
    """The shipped warm start's warm_start.json (its "key" is the `warm_start_key` it was built
    with), or None when there is none or it cannot be read."""
    try:
        with open(os.path.join(SHIPPED, "warm_start.json")) as fh:
            man = json.load(fh)
        return man if isinstance(man, dict) and "key" in man else None
    except (OSError, ValueError):
        return None


def shipped_key() -> str | None:
    """The `warm_start_key` of the shipped warm start, or None (shipped_manifest)."""
    man = shipped_manifest()
    return None if man is None else man["key"]


def warm_start(world: World, tool, system: str, cfg: SFTConfig, tcfg: TeacherConfig, size: str,
               vocab_size: int, cache_dir: str, progress: bool = True, extra_key: dict | None = None,
               scaffold: str = "structured", precision: str = "fp32",
               on_step: Callable[[int, float], None] | None = None, data: tuple | None = None):
    """Build (or load from cache) the SFT policy of a scaffold ("structured" | "unstructured").
    Returns (model, tokenizer, info dict, path). on_step: `train_sft`'s, when it trains. data: the
    (examples, stats) `build_sft_data` returns for this configuration, when the caller has them
    already (scripts/build_warm_start.py trains two prefixes on one copy); None builds them.

    The cache key (`warm_start_key`) covers the world, teacher, SFT and model configuration, the
    scaffold and the training precision (`train_sft`; "fp32" leaves the key as it was before the
    option existed); a second run with the same configuration loads `cache_dir/sft-<key>`
    (save_pretrained format) and skips training. The weights are float32 either way.
    """
    if precision != "fp32":
        extra_key = {**(extra_key or {}), "precision": precision}
    key = warm_start_key(world.config, system, cfg, tcfg, size, vocab_size, scaffold, extra_key)
    man = shipped_manifest() if cfg.shipped else None
    if man is not None and man["key"] == key:  # the released warm start of this configuration
        model, tok = policy.load_policy(SHIPPED)
        info = {k: man[k] for k in ("key", "params", "final_loss", "steps")}
        info.update(cached=True, shipped=True)
        log.info(warm_start_line(True, SHIPPED, cfg.steps))
        return model, tok, info, SHIPPED
    path = os.path.join(cache_dir, f"sft-{key}")
    info_path = os.path.join(path, "sft_info.json")
    if os.path.exists(info_path):
        model, tok = policy.load_policy(path)
        with open(info_path) as fh:
            info = json.load(fh)
        info["cached"] = True
        log.info(warm_start_line(True, path, cfg.steps))
        return model, tok, info, path
    log.info(warm_start_line(False, path, cfg.steps))
    t0 = time.perf_counter()
    examples, stats = data or build_sft_data(world, tool, system, cfg, tcfg, scaffold)
    t_data = time.perf_counter() - t0
    texts = [d.title + " " + d.text for d in world.docs]
    texts += [tok_text(msgs, segs) for msgs, segs in examples[:3000]]
    tok = policy.train_tokenizer(texts, names=list(world.entities), vocab_size=vocab_size,
                                 syllables=SYLLABLES, seed=cfg.seed,
                                 tags=SCAFFOLD_TAGS + (THINK_TAGS if scaffold == "unstructured" else ()))
    encoded = encode_examples(tok, examples)
    model = policy.build_tiny_qwen3(tok, size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    res = train_sft(model, tok, encoded, cfg, progress, precision, on_step)
    info = {"filter": stats, "examples": len(encoded), "data_sha256": examples_digest(encoded),
            "data_seconds": round(t_data, 2),
            "train_seconds": round(res["seconds"], 2), "final_loss": res["loss"],
            "steps": res["steps"], "params": sum(p.numel() for p in model.parameters()),
            "mean_tokens": sum(len(e[0]) for e in encoded) / len(encoded), "key": key,
            "precision": precision, "cached": False}
    log.info("SFT filters: %s", format_filter_counts(stats))
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "sft_info.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    os.makedirs(cache_dir, exist_ok=True)
    if os.path.exists(path):  # a concurrent run finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)  # atomic: a half-written warm start is never picked up
    del examples, encoded, texts, model
    release_heap()
    # The run continues from the saved copy, exactly as a later run that finds it in the cache: the
    # trained objects in memory and the loaded ones hold the same numbers, but not in the same
    # memory, and a run from one drifted from a run from the other after a few RL steps.
    model, tok = policy.load_policy(path)
    return model, tok, info, path


def release_heap() -> None:
    """Give the memory freed after the SFT data and training back to the operating system: a
    garbage collection, then glibc's malloc_trim (a no-op where the C library has none). Without it
    the process keeps about 600 MB of freed heap through the RL phase, and a cold toy run peaks
    about 0.3 GiB above a run with the warm start cached (not part of the paper's method)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
