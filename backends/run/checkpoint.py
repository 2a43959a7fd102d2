"""Training checkpoints: everything a run needs to continue exactly, written so that a crash at any
moment leaves only complete checkpoints behind.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Supports Algorithm 1 (train.py): the paper saves the rubric bank every 10 steps (appendix) and says
nothing else about checkpoints; its Limitations name restarts. Here a checkpoint holds the whole
training state, so that a run of 2N steps and a run stopped (or killed) after N steps and resumed give
identical metrics, bank bytes and weights on CPU.

Layout of run_dir/checkpoints/step-000010/ (the number counts completed steps):
    model/             save_pretrained of the policy pi_theta (safetensors) and its tokenizer
    state.pt           torch.save of a dict of plain values and tensors (train.py `training_state`):
                       optimizer, RNG states, step, judge buffers and counters, rubric bank, pending
                       reflection batch, metrics rows, fault counters, the reference model's identity
    checkpoint.json    manifest: format, step, and size + sha256 of every file above (with
                       hash="background" the sha256s arrive after the save, see below)

How a checkpoint is written (`save_checkpoint`): into a temporary directory beside the others
(".tmp-step-...", same filesystem), every file fsynced, the manifest last, then one os.replace onto
"step-NNNNNN" and an fsync of the parent directory. A directory named step-* is therefore complete;
a crash leaves at most a ".tmp-*" directory, which `latest` ignores and the next run deletes. Old
checkpoints beyond `keep` are first renamed to ".del-*" (atomic) and then deleted, so a crash during
pruning never leaves a half-deleted step-* directory either.

Hashing (`CheckpointConfig.hash`): "sync" hashes every file before the rename (the toy default:
a few MB). "background" (the full preset's default) writes the manifest with sizes only, renames,
and hashes in a thread of this process, adding the sha256s to the manifest atomically when done:
at 8B a checkpoint holds ~115 GB (98 GB of DeepSpeed partitions), whose sha256 takes minutes, during
which every rank would wait. A checkpoint whose hashes have not arrived (the process ended first) is
checked by size. `verify` at resume rehashes what has a sha256 (the full preset: false, sizes only).

`state.pt` is read with torch.load(weights_only=True): a checkpoint can hold only tensors and plain
containers, never pickled code.

Deviations from the paper: none of this is in the paper. The frozen reference model pi_ref is not
stored (it is the SFT warm start, 8B parameters in full mode); a checkpoint records where it comes
from and a sha256 fingerprint of its weights (of the loaded copy, `weights_fingerprint`, or, where
no copy is loaded, a ZeRO-3 run that samples with vLLM, of its weight files, `files_fingerprint`),
and a resume that cannot rebuild the same reference stops with an error instead of training against
a different one (resume.check_reference).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch

from bank import atomic_write_bytes  # one atomic write for the bank, checkpoints and artefacts


log = logging.getLogger("rubricem.checkpoint")

FORMAT_VERSION = 1
SUBDIR = "checkpoints"
_NAME_RE = re.compile(r"^step-(\d{6,})$")
_MANIFEST = "checkpoint.json"
_STATE = "state.pt"
_MODEL = "model"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the current run."""


def atomic_write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    """`atomic_write_bytes` of json.dumps(obj) (UTF-8, trailing newline)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent) + "\n").encode("utf-8"))


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, SUBDIR)


def step_name(step: int) -> str:
    return f"step-{int(step):06d}"


# ----------------------------------------------------------------------------------------------------
# Fingerprints


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the model's state_dict (names, dtypes, shapes, raw bytes, in name order).

    Identifies the frozen reference model across processes; equal iff the weights are bit-identical.
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin")


def files_fingerprint(model_dir: str) -> str:
    """sha256 over the weight files of a Hugging Face model folder: every *.safetensors file (else
    every *.bin), its name, size and bytes, in name order; config, tokenizer and index files are
    left out. Identifies the frozen reference model without loading it (the 16 GB of an 8B bf16
    model are read once, never held); equal iff the weight files are byte-identical (the same
    weights saved in other shards or another dtype differ). Raises CheckpointError when the folder
    holds no weight file, OSError when one cannot be read."""
    for suffix in WEIGHT_SUFFIXES:
        names = sorted(f for f in os.listdir(model_dir) if f.endswith(suffix))
        if names:
            break
    else:
        raise CheckpointError(f"{model_dir}: no {' or '.join('*' + s for s in WEIGHT_SUFFIXES)} weight files")
    h = hashlib.sha256()
    for name in names:
        path = os.path.join(model_dir, name)
        h.update(f"{name}|{os.path.getsize(path)}|".encode())
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# Writing


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str, step: int, model, tokenizer, state: dict, keep: int = 3,
                    meta: dict | None = None, extra=None, hash_mode: str = "sync") -> str:
    """Write checkpoint `step` (completed steps, int >= 0) atomically; returns its directory.

    model/tokenizer: Hugging Face objects (save_pretrained); state: a dict of tensors and plain
    values (torch.save); meta: JSON-serialisable values stored in the manifest (e.g. the config, so
    that it can be read without loading state.pt). Keeps the newest `keep` (int >= 1) checkpoints
    and prunes older ones. extra: None or a callable(checkpoint_dir) that writes more files into the
    checkpoint before its manifest (engine.ZeRO3Engine.save_state: DeepSpeed's partitions); they are
    hashed and made atomic with the rest. hash_mode: "sync" (every file's sha256 in the manifest
    before the rename) or "background" (sizes now, sha256s added by a thread of this process;
    `wait_for_hashes` waits for it).
    Raises OSError if the disk write fails (the previous checkpoints are then untouched), ValueError
    for an unknown hash_mode.
    """
    if hash_mode not in HASH_MODES:
        raise ValueError(f"checkpoint hash mode must be one of {HASH_MODES}, got {hash_mode!r}")
    root = checkpoints_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, f".tmp-{step_name(step)}-{os.getpid()}-{time.monotonic_ns()}")
    wait_for_hashes()  # at most one hashing thread; the previous one finished long ago at 10 steps
    try:
        model.save_pretrained(os.path.join(tmp, _MODEL), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(tmp, _MODEL))
        torch.save(state, os.path.join(tmp, _STATE))
        if extra is not None:
            extra(tmp)
        files = {}
        for dirpath, _, names in os.walk(tmp):
            for f in sorted(names):
                p = os.path.join(dirpath, f)
                rel = os.path.relpath(p, tmp).replace(os.sep, "/")
                files[rel] = {"bytes": os.path.getsize(p),
                              "sha256": _sha256_file(p) if hash_mode == "sync" else None}
        manifest = {"format": FORMAT_VERSION, "step": int(step), "meta": meta or {},
                    "files": dict(sorted(files.items()))}
        with open(os.path.join(tmp, _MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, keep)
    if hash_mode == "background":
        _start_hashing(final, manifest)
    return final


HASH_MODES = ("sync", "background")
_HASHER: dict = {"thread": None}


def _start_hashing(path: str, manifest: dict) -> None:
    """Hash every file of the committed checkpoint `path` in a daemon thread, then rewrite its
    manifest atomically with the sha256s. A checkpoint pruned meanwhile ends the thread quietly."""
    import threading

    def work():
        t0 = time.perf_counter()
        try:
            done = {rel: dict(info, sha256=_sha256_file(os.path.join(path, rel)))
                    for rel, info in manifest["files"].items()}
            atomic_write_json(os.path.join(path, _MANIFEST), dict(manifest, files=done))
            log.info("checkpoint %s hashed in %.1f s (in the background)", path, time.perf_counter() - t0)
        except OSError as e:  # pruned or moved away before the hashes were done
            log.info("checkpoint %s not hashed: %s", path, e)

    th = threading.Thread(target=work, name="checkpoint-hash", daemon=True)
    _HASHER["thread"] = th
    th.start()


def wait_for_hashes(timeout_s: float | None = None) -> bool:
    """Wait for the background hashing of the last checkpoint (hash mode "background"); True when
    none is running (any more). Call before the process ends so its last manifest carries them."""
    th = _HASHER["thread"]
    if th is None:
        return True
    th.join(timeout_s)
    return not th.is_alive()


def _remove_dir(path: str) -> None:
    """Delete a directory so that no half-deleted one keeps its name: rename first, then delete."""
    parent, name = os.path.split(path)
    gone = os.path.join(parent, f".del-{name}-{os.getpid()}-{time.monotonic_ns()}")
    os.replace(path, gone)
    _fsync_dir(parent)
    shutil.rmtree(gone, ignore_errors=True)


def save_dir_atomic(save, path: str) -> None:
    """Run save(tmp_dir) (e.g. a save_pretrained), fsync it, then put tmp_dir in place of `path` by a
    rename, so `path` (e.g. run_dir/final) is either the old directory or the complete new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    commit_dir(tmp, path)


def commit_dir(tmp: str, path: str) -> None:
    """Make the finished directory `tmp` (same filesystem) the directory `path` atomically: fsync
    every file of tmp, delete an old `path` (renamed away first, so no half-deleted one keeps the
    name), rename tmp onto it, fsync the parent. Raises OSError when a step fails; `path` is then
    the old directory or absent, never a partial one."""
    _fsync_tree(tmp)
    if os.path.exists(path):
        _remove_dir(path)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def prune(run_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` step-* checkpoints (keep >= 1)."""
    for _, path in list_checkpoints(run_dir)[: -max(1, int(keep))]:
        _remove_dir(path)


def remove_debris(run_dir: str) -> int:
    """Delete ".tmp-*" / ".del-*" directories left by an interrupted save or prune; returns how many.
    Call only when no other process writes checkpoints into this run directory."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return 0
    n = 0
    for name in os.listdir(root):
        if name.startswith((".tmp-", ".del-")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            n += 1
    return n


# ----------------------------------------------------------------------------------------------------
# Finding and reading


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete-named checkpoint (step-NNNNNN) in run_dir, oldest first."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _NAME_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def verify_checkpoint(path: str, deep: bool = True) -> dict:
    """The manifest of checkpoint directory `path` after checking it; raises CheckpointError naming
    what is wrong (no manifest, unknown format, a file missing or of the wrong size, and with deep=True
    a sha256 mismatch; a file whose sha256 never arrived, hash mode "background", is checked by
    size only)."""
    mpath = os.path.join(path, _MANIFEST)
    try:
        with open(mpath) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {_MANIFEST} (not a checkpoint, or incomplete)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: unknown checkpoint format {manifest.get('format')!r}, "
                              f"expected {FORMAT_VERSION}")
    for rel, info in manifest.get("files", {}).items():
        p = os.path.join(path, rel)
        if not os.path.isfile(p) or os.path.getsize(p) != info["bytes"]:
            raise CheckpointError(f"{path}: file {rel} is missing or has the wrong size")
        if deep and info.get("sha256") is not None and _sha256_file(p) != info["sha256"]:
            raise CheckpointError(f"{path}: file {rel} does not match its sha256 (corrupt)")
    if _STATE not in manifest.get("files", {}):
        raise CheckpointError(f"{path}: the manifest lists no {_STATE}")
    return manifest


def find_latest(run_dir: str, deep: bool = True) -> str | None:
    """Path of the newest checkpoint in run_dir that verifies, or None. Checkpoints that fail
    verification are skipped with a warning (an older complete one is used instead)."""
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path, deep)
            return path
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    return None


def resolve_resume(resume: str | None, run_dir: str, deep: bool = True) -> str | None:
    """The checkpoint to resume from: None for a fresh run; "latest" -> the newest valid one in
    run_dir (None if there is none: the run starts fresh); otherwise a checkpoint directory path,
    which must verify (CheckpointError otherwise)."""
    if not resume:
        return None
    if resume == "latest":
        return find_latest(run_dir, deep)
    if not os.path.isdir(resume):
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    verify_checkpoint(resume, deep)
    return resume


def completed_run(run_dir: str, resume: str | None, steps: int) -> dict | None:
    """The manifest (with "step" and "meta") of the last checkpoint of a finished run that `--resume`
    would only repeat, else None.

    A run is finished when the checkpoint `resume` names ("latest": the newest one of run_dir that
    verifies by size, as parse_cli reads it) is at step == `steps` (int >= 0) and run_dir holds the
    end artefacts final/ and eval.json. Raising `steps` above the checkpoint's step (or a missing
    final/ or eval.json, e.g. a run stopped between its last checkpoint and eval.json) returns None:
    the run continues. Raises CheckpointError for an explicit checkpoint path that does not verify."""
    if not resume:
        return None
    path = resolve_resume(resume, run_dir, deep=False)
    if path is None:
        return None
    manifest = verify_checkpoint(path, deep=False)
    ends = os.path.isdir(os.path.join(run_dir, "final")) and os.path.isfile(os.path.join(run_dir, "eval.json"))
    return manifest if int(manifest.get("step", -1)) == steps and ends else None


def zero_world_size(path: str) -> int | None:
    """The number of data-parallel ranks whose DeepSpeed partitions checkpoint `path` holds (its
    zero/ folder: one *optim_states.pt file per rank), or None without a zero/ folder."""
    d = os.path.join(path, "zero")
    if not os.path.isdir(d):
        return None
    return sum(1 for _, _, fs in os.walk(d) for f in fs if f.endswith("optim_states.pt"))


def run_dir_of(checkpoint_path: str) -> str:
    """run_dir for a checkpoint path run_dir/checkpoints/step-NNNNNN."""
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_path)))


def load_state(path: str) -> dict:
    """The training-state dict of checkpoint `path` (torch.load with weights_only=True)."""
    try:
        return torch.load(os.path.join(path, _STATE), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or tampered file: name it, whatever torch raised
        raise CheckpointError(f"{path}: cannot read {_STATE} ({type(e).__name__}: {e})") from None


def load_model_weights(model: torch.nn.Module, path: str) -> None:
    """Copy the policy weights of checkpoint `path` into `model` in place (same module object, so
    its configuration, e.g. the attention implementation, stays exactly as built).

    Reads model/*.safetensors (single file or shards). Tied parameters absent from the file (the
    output embedding of a tied-embedding model) are fine; any other missing or unexpected key
    raises CheckpointError.
    """
    from safetensors.torch import load_file  # lazy: safetensors only when weights are read

    mdir = os.path.join(path, _MODEL)
    files = sorted(f for f in os.listdir(mdir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{mdir}: no .safetensors weights")
    sd: dict = {}
    for f in files:
        sd.update(load_file(os.path.join(mdir, f)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in sd if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise CheckpointError(f"{mdir}: weights do not fit the model (missing {untied[:5]}, "
                              f"unexpected {list(unexpected)[:5]})")

# ----------------------------------------------------------------------------------------------------
# Configuration (the run config's `checkpoint` section; backends/run/config.py nests it)


@dataclass
class CheckpointConfig:
    """Full training-state checkpoints (checkpoint.py); not in the paper, which saves only the bank."""

    every: int = 10
    """ours: steps between checkpoints (0 = only at the end); also written at the end"""
    keep: int = 3
    """ours: newest checkpoints kept on disk"""
    stop_after: int = 0
    """stop this invocation after this many steps, with a checkpoint (0 = run to `steps`); for
    time-sliced jobs: continue with --resume latest"""
    verify: bool = True
    """check every file's sha256 before resuming from a checkpoint (false: sizes and the manifest
    only; the full preset's default, where rehashing ~115 GB on rank 0 would hold every rank for
    minutes)"""
    hash: str = "sync"
    """ours: "sync" (every file's sha256 before the checkpoint is renamed into place) or
    "background" (the full preset: sizes at once, sha256s added to the manifest by a thread while
    training goes on); see the module docstring"""
