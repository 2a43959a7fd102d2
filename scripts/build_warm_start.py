"""Build the toy SFT warm start once, deterministically, as a directory a toy run can start from.

RubricEM starts RL from a released SFT checkpoint (appendix); toy mode otherwise trains its own warm
start inside every run (toy/sft.warm_start, cached per configuration). This script runs that same
build (teacher data, tokenizer, masked SFT) with the configuration given by --set, and writes only
what a run needs, with no timings in it, so the output is the same bytes for the same configuration,
seed, thread count, machine and library versions:
    OUT/model.safetensors, OUT/config.json, OUT/generation_config.json (if any), the tokenizer files,
    OUT/warm_start.json   {"key", "config" (world, teacher, sft, model size, vocab), "threads",
                           "files": sha256, "data_sha256", "machine", "prefix"}
A run loads it with `python train.py --toy --set model=OUT` (build.setup_policy: a local model
directory replaces the per-run warm start; the world, judge and evaluation are the toy's as usual),
with the same world.* settings as the build.

    python scripts/build_warm_start.py --out warmstart --set threads=2 --set sft.steps=6000
    python scripts/build_warm_start.py --out /tmp/ws --set sft.steps=5 --set world.n_train_entities=40

The prefix record ("prefix" in warm_start.json; `prefix_record`) is what another machine can check:
the build's first K SFT steps (default 8) rebuilt from the same settings and thread count. It holds
the sha256 of the toy world, of the encoded SFT examples and of the tokenizer (the same bytes on any
machine), the loss of each of the K steps and statistics of the weights after them (equal within
PREFIX_TOLERANCE on any machine: float kernels differ between CPUs), the weights' sha256 (the same
bytes on the machine that wrote it only) and that machine (backends/run/provenance.py).
docs/metrics.md, "Reproducibility", states this contract and how the tolerances were measured.

    # (re)write the prefix record of an existing build without retraining it (a few minutes: the
    # teacher data and K steps); pass the --set options the build was made with
    python scripts/build_warm_start.py --out toy/warm_start --prefix-only
    # check this machine against a build's prefix record (exit 1 beyond the tolerances)
    python scripts/build_warm_start.py --out toy/warm_start --check
    # how far a real change moves the prefix (exits 1: what the tolerances must stay below)
    python scripts/build_warm_start.py --out toy/warm_start --check --vary sft.lr=0.0022

Not in the paper (its warm start is an 8B model SFT'd by the authors). Bit-identical per seed,
thread count, machine and library versions (torch's CPU kernels reduce in an order that depends on
the thread count and the SIMD kernel set).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.run import provenance  # noqa: E402
from backends.run.overrides import apply_overrides  # noqa: E402
from backends.run.presets import toy_preset  # noqa: E402
from scaffold import system_prompt  # noqa: E402
from toy.sft import build_sft_data, warm_start, warm_start_key  # noqa: E402
from toy.world import BM25SearchTool, make_world  # noqa: E402

KEEP = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MANIFEST = "warm_start.json"

# How far a prefix rebuilt on another machine (or kernel set) may be from the recorded one: the
# largest absolute difference of a step's SFT loss, of a sampled weight, and the largest relative
# difference of a tensor's L2 norm. Measured, with their margins: docs/metrics.md, "Reproducibility".
PREFIX_TOLERANCE = {"loss": 1e-4, "weights": 1e-4, "l2": 1e-5}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# The prefix record and its comparison (pure but for the build itself)


def weight_stats(path: str) -> dict:
    """{tensor name: {"l2": its L2 norm, "sample": its values at the flat positions
    floor((2k + 1) n / 8), k = 0..3}} of a model.safetensors (n: the tensor's size)."""
    from safetensors.torch import load_file  # lazy: only the prefix record reads weights

    out = {}
    for name, t in sorted(load_file(path).items()):
        flat = t.detach().reshape(-1).double()
        n = flat.numel()
        out[name] = {"l2": float(flat.norm()),
                     "sample": [float(flat[(2 * k + 1) * n // 8]) for k in range(4)]}
    return out


def teacher_data(cfg) -> tuple:
    """The SFT examples of `cfg`'s build, (examples, stats) of toy.sft.build_sft_data: most of a
    prefix's time, so a caller that builds two prefixes of one configuration builds them once."""
    world = make_world(cfg.world)
    return build_sft_data(world, BM25SearchTool(world.docs),
                          system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt), cfg.sft,
                          cfg.teacher, cfg.rollout.scaffold)


def prefix_record(cfg, steps: int, parent: str, data: tuple | None = None) -> dict:
    """The first `steps` SFT steps of `cfg`'s build, rebuilt: the build with sft.steps = `steps`, whose
    first steps are those of the full build while `steps` <= sft.warmup (the learning rate then does
    not depend on sft.steps, and neither do the data, the tokenizer, the initialisation or the batch
    order). Returns {"sft_steps", "threads", "world_sha256" (toy.world.World.fingerprint),
    "data_sha256" (toy.sft.examples_digest), "files": {name: sha256} of the weights
    and tokenizer, "losses": the SFT loss of each step, "weights": `weight_stats`, "machine"}.
    data: `teacher_data(cfg)`, when the caller has it (None: built here). Raises ValueError for
    steps outside [1, sft.warmup]."""
    if not 1 <= steps <= cfg.sft.warmup:
        raise ValueError(f"prefix steps must be in [1, sft.warmup={cfg.sft.warmup}], got {steps}")
    short = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=steps))
    losses = []
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        out = os.path.join(tmp, "prefix")
        m = build(short, out, prefix_steps=0, on_step=lambda step, loss: losses.append(loss),
                  data=data)
        weights = weight_stats(os.path.join(out, "model.safetensors"))
    return {"sft_steps": steps, "threads": cfg.threads, "world_sha256": m["world_sha256"],
            "data_sha256": m["data_sha256"],
            "files": {k: m["files"][k] for k in ("model.safetensors", "tokenizer.json")},
            "losses": losses, "weights": weights, "machine": m["machine"]}


def prefix_differences(got: dict, want: dict) -> dict:
    """How a rebuilt prefix record `got` differs from a recorded one `want`: {"world", "data", "tokenizer",
    "bitwise": whether the sha256 agree (None where `want` has none), "loss": the largest absolute
    difference of a step's loss, "weights": of a sampled weight, "l2": the largest relative
    difference of a tensor's L2 norm (inf where steps or tensors differ; None where `want` has no
    losses or weights: a manifest written before they were recorded)}."""
    def same(a, b):
        return None if b is None else a == b

    out = {"world": same(got.get("world_sha256"), want.get("world_sha256")),
           "data": same(got.get("data_sha256"), want.get("data_sha256")),
           "tokenizer": same(got["files"]["tokenizer.json"], want["files"].get("tokenizer.json")),
           "bitwise": same(got["files"]["model.safetensors"], want["files"].get("model.safetensors")),
           "loss": None, "weights": None, "l2": None}
    if "losses" in want:
        a, b = got["losses"], want["losses"]
        out["loss"] = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else math.inf
    if "weights" in want:
        a, b = got["weights"], want["weights"]
        if sorted(a) != sorted(b):
            out["weights"] = out["l2"] = math.inf
        else:
            out["weights"] = max(abs(x - y) for k in a for x, y in zip(a[k]["sample"], b[k]["sample"]))
            out["l2"] = max(abs(a[k]["l2"] - b[k]["l2"]) / max(abs(b[k]["l2"]), 1e-12) for k in a)
    return out


def prefix_mismatches(diff: dict, tol: dict = PREFIX_TOLERANCE) -> list[str]:
    """What of `prefix_differences` breaks the contract: the world, data or tokenizer not the same bytes, a
    loss, weight or norm difference above its tolerance, or nothing recorded to compare. [] when it
    holds. The weights' sha256 is not part of it (equal on the recording machine only)."""
    bad = [f"{k} bytes differ" for k in ("world", "data", "tokenizer") if diff.get(k) is False]
    for k in ("loss", "weights", "l2"):
        if diff[k] is None:
            bad.append(f"no {k} recorded (rewrite the record: --prefix-only)")
        elif not diff[k] <= tol[k]:
            bad.append(f"{k} differs by {diff[k]:.3g} > {tol[k]:.3g}")
    return bad


# ----------------------------------------------------------------------------------------------------
# The build


def build(cfg, out: str, progress: bool = False, prefix_steps: int = 0, on_step=None,
          data: tuple | None = None) -> dict:
    """Train the warm start of `cfg` (settings.Config, toy) into `out`; returns the manifest.
    Writes into a temporary sibling first and renames it (an interrupted build leaves no `out`).
    prefix_steps > 0 also records `prefix_record` (a short build a test can repeat) as "prefix".
    on_step(step, loss): toy.sft.train_sft's; data: `teacher_data(cfg)` or None (built here).
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
                                      scaffold=cfg.rollout.scaffold, precision=cfg.precision,
                                      on_step=on_step, data=data)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        files = {}
        for name in sorted(os.listdir(path)):
            if name in KEEP:
                shutil.copyfile(os.path.join(path, name), os.path.join(tmp, name))
                files[name] = sha256(os.path.join(tmp, name))
        manifest = {"key": info["key"], "threads": cfg.threads, "files": files,
                    "data_sha256": info["data_sha256"], "world_sha256": world.fingerprint(),
                    "machine": provenance.machine(),
                    "config": {"world": dataclasses.asdict(cfg.world),
                               "teacher": dataclasses.asdict(cfg.teacher),
                               "sft": dataclasses.asdict(cfg.sft), "model_size": cfg.toy_model.size,
                               "vocab_size": cfg.toy_model.vocab_size, "scaffold": cfg.rollout.scaffold,
                               "precision": cfg.precision, "system": system},
                    "params": info["params"], "final_loss": info["final_loss"], "steps": info["steps"]}
        if prefix_steps > 0:
            manifest["prefix"] = prefix_record(cfg, prefix_steps, parent, data)
        write_manifest(tmp, manifest)
        os.replace(tmp, out)
    return manifest


def write_manifest(out: str, manifest: dict) -> None:
    """OUT/warm_start.json, atomically (sorted keys, one-space indent)."""
    path = os.path.join(out, MANIFEST)
    with open(path + ".tmp", "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def read_build(cfg, out: str) -> tuple[dict, object]:
    """An existing build's manifest, after checking that its files are the ones it lists and that
    `cfg` is the configuration it was built with (the same key); returns (manifest, cfg with the
    build's thread count). Raises ValueError otherwise."""
    with open(os.path.join(out, MANIFEST)) as fh:
        m = json.load(fh)
    for name, digest in m["files"].items():
        if sha256(os.path.join(out, name)) != digest:
            raise ValueError(f"{out}/{name} is not the file its manifest lists")
    if warm_start_key_of(cfg) != m["key"]:
        raise ValueError(f"this configuration's warm-start key is {warm_start_key_of(cfg)}, the build in "
                         f"{out} has {m['key']}: pass the --set options it was built with")
    return m, dataclasses.replace(cfg, threads=m["threads"])


def refresh_prefix(cfg, out: str, steps: int) -> dict:
    """Rewrite the prefix record of the build in `out` (its weights and other files stay as they
    are): `prefix_record` of `cfg` with the build's thread count. Returns the new manifest. Raises
    ValueError (read_build; or when the prefix's data or tokenizer are not the build's)."""
    m, cfg = read_build(cfg, out)
    torch.set_num_threads(max(1, cfg.threads))
    rec = prefix_record(cfg, steps, os.path.dirname(os.path.abspath(out)) or ".")
    if rec["files"]["tokenizer.json"] != m["files"]["tokenizer.json"] or \
            rec["data_sha256"] != m.get("data_sha256", rec["data_sha256"]) or \
            rec["world_sha256"] != m.get("world_sha256", rec["world_sha256"]):
        raise ValueError(f"the prefix's world, data or tokenizer are not those of the build in {out}")
    m["prefix"] = rec
    write_manifest(out, m)
    return m


def warm_start_key_of(cfg) -> str:
    """toy.sft.warm_start_key of a toy configuration (what `python train.py --toy` with it looks up)."""
    extra = None if cfg.precision == "fp32" else {"precision": cfg.precision}
    return warm_start_key(cfg.world, system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt),
                          cfg.sft, cfg.teacher, cfg.toy_model.size, cfg.toy_model.vocab_size,
                          cfg.rollout.scaffold, extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True,
                    help="output directory (must not exist; with --prefix-only or --check: a build)")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=V",
                    help="configuration override as train.py --set (world.*, teacher.*, sft.*, threads)")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--prefix-steps", type=int, default=8, metavar="K",
                    help="also record the build's first K SFT steps (0: none; default 8)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prefix-only", action="store_true",
                      help="rewrite the prefix record of the build in --out, not the build")
    mode.add_argument("--check", action="store_true",
                      help="rebuild the prefix of the build in --out and compare it with its record")
    ap.add_argument("--vary", action="append", default=[], metavar="A.B=V",
                    help="with --check: rebuild the prefix with this setting changed, to see how far a "
                         "real change moves it (the check then fails, as it should)")
    a = ap.parse_args(argv)
    if a.vary and not a.check:
        ap.error("--vary goes with --check")
    cfg = apply_overrides(toy_preset(), a.set)
    try:
        if a.prefix_only:
            m = refresh_prefix(cfg, a.out, a.prefix_steps)
            print(json.dumps({"out": a.out, "prefix": {k: v for k, v in m["prefix"].items()
                                                       if k != "weights"}}, indent=1))
            return 0
        if a.check:
            m, cfg = read_build(cfg, a.out)
            cfg = apply_overrides(cfg, a.vary)
            torch.set_num_threads(max(1, cfg.threads))
            rec = prefix_record(cfg, m["prefix"]["sft_steps"], os.path.dirname(os.path.abspath(a.out)))
            diff = prefix_differences(rec, m["prefix"])
            bad = prefix_mismatches(diff)
            print(json.dumps({"differences": diff, "tolerance": PREFIX_TOLERANCE, "mismatches": bad,
                              "varied": a.vary, "recorded_on": m["prefix"].get("machine"), "here": rec["machine"]},
                             indent=1))
            return 1 if bad else 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = build(cfg, a.out, a.progress, a.prefix_steps)
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(json.dumps({"out": a.out, "bytes": size, "params": m["params"], "steps": m["steps"],
                      "final_loss": m["final_loss"], "files": m["files"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
