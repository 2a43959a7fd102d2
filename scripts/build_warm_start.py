"""Build the toy SFT warm start once, deterministically, as a directory a toy run can start from.

RubricEM starts RL from a released SFT checkpoint (appendix); toy mode otherwise trains its own warm
start inside every run (toy/sft.warm_start, cached per configuration). This script runs that same
build (teacher data, tokenizer, masked SFT) with the configuration given by --set, and writes only
what a run needs, with no timings in it, so the output is the same bytes for the same configuration,
seed and thread count:
    OUT/model.safetensors, OUT/config.json, OUT/generation_config.json (if any), the tokenizer files,
    OUT/warm_start.json   {"key", "config" (world, teacher, sft, model size, vocab), "files": sha256}
A run loads it with `python train.py --toy --set model=OUT` (build.setup_policy: a local model
directory replaces the per-run warm start; the world, judge and evaluation are the toy's as usual),
with the same world.* settings as the build.

    python scripts/build_warm_start.py --out warmstart --set threads=2 --set sft.steps=6000
    python scripts/build_warm_start.py --out /tmp/ws --set sft.steps=5 --set world.n_train_entities=40

Not in the paper (its warm start is an 8B model SFT'd by the authors). Deterministic per seed and
thread count (torch's CPU kernels reduce in an order that depends on the thread count).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run.overrides import apply_overrides  # noqa: E402
from backends.run.presets import toy_preset  # noqa: E402
from scaffold import system_prompt  # noqa: E402
from toy.sft import warm_start, warm_start_key  # noqa: E402
from toy.world import BM25SearchTool, make_world  # noqa: E402

KEEP = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prefix_digest(cfg, steps: int, parent: str) -> dict:
    """sha256 of the tokenizer and of the weights after the first `steps` SFT steps of `cfg`'s build
    ({"sft_steps", "files": {name: sha256}}): the build with sft.steps = `steps`, whose first steps
    are those of the full build while `steps` <= sft.warmup (the learning rate then does not depend
    on sft.steps, and neither do the data, the tokenizer, the initialisation or the batch order).
    Raises ValueError for steps outside [1, sft.warmup]."""
    if not 1 <= steps <= cfg.sft.warmup:
        raise ValueError(f"prefix steps must be in [1, sft.warmup={cfg.sft.warmup}], got {steps}")
    short = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=steps))
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        m = build(short, os.path.join(tmp, "prefix"), prefix_steps=0)
    return {"sft_steps": steps, "files": {k: m["files"][k] for k in ("model.safetensors", "tokenizer.json")}}


def build(cfg, out: str, progress: bool = False, prefix_steps: int = 0) -> dict:
    """Train the warm start of `cfg` (settings.Config, toy) into `out`; returns the manifest.
    Writes into a temporary sibling first and renames it (an interrupted build leaves no `out`).
    prefix_steps > 0 also records `prefix_digest` (a short build a test can repeat) as "prefix".
    Raises FileExistsError if `out` exists."""
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists; remove it or choose another --out")
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, shipped=False))  # train, never load
    torch.set_num_threads(max(1, cfg.threads))
    world = make_world(cfg.world)
    tool = BM25SearchTool(world.docs)
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    parent = os.path.dirname(os.path.abspath(out)) or "."
    with tempfile.TemporaryDirectory(dir=parent) as cache:
        _, _, info, path = warm_start(world, tool, system, cfg.sft, cfg.teacher, cfg.toy_model.size,
                                      cfg.toy_model.vocab_size, cache, progress=progress,
                                      scaffold=cfg.rollout.scaffold, precision=cfg.precision)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        files = {}
        for name in sorted(os.listdir(path)):
            if name in KEEP:
                shutil.copyfile(os.path.join(path, name), os.path.join(tmp, name))
                files[name] = sha256(os.path.join(tmp, name))
        manifest = {"key": info["key"], "threads": cfg.threads, "files": files,
                    "config": {"world": dataclasses.asdict(cfg.world),
                               "teacher": dataclasses.asdict(cfg.teacher),
                               "sft": dataclasses.asdict(cfg.sft), "model_size": cfg.toy_model.size,
                               "vocab_size": cfg.toy_model.vocab_size, "scaffold": cfg.rollout.scaffold,
                               "precision": cfg.precision, "system": system},
                    "params": info["params"], "final_loss": info["final_loss"], "steps": info["steps"]}
        if prefix_steps > 0:
            manifest["prefix"] = prefix_digest(cfg, prefix_steps, parent)
        with open(os.path.join(tmp, "warm_start.json"), "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
        os.replace(tmp, out)
    return manifest


def warm_start_key_of(cfg) -> str:
    """toy.sft.warm_start_key of a toy configuration (what `python train.py --toy` with it looks up)."""
    extra = None if cfg.precision == "fp32" else {"precision": cfg.precision}
    return warm_start_key(cfg.world, system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt),
                          cfg.sft, cfg.teacher, cfg.toy_model.size, cfg.toy_model.vocab_size,
                          cfg.rollout.scaffold, extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (must not exist)")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=V",
                    help="configuration override as train.py --set (world.*, teacher.*, sft.*, threads)")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--prefix-steps", type=int, default=8, metavar="K",
                    help="also record the digest of the build's first K SFT steps (0: none; default 8)")
    a = ap.parse_args(argv)
    cfg = apply_overrides(toy_preset(), a.set)
    m = build(cfg, a.out, a.progress, a.prefix_steps)
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(json.dumps({"out": a.out, "bytes": size, "params": m["params"], "steps": m["steps"],
                      "final_loss": m["final_loss"], "files": m["files"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
