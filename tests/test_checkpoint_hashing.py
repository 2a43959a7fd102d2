"""Checkpoint hashing that never holds the ranks (backends/run/checkpoint.py, hash "background", the
full preset's default) and the rank-count check at resume (backends/run/resume.py)."""
import hashlib
import json
import os
import threading

import pytest

from backends.run import checkpoint as ck


class _Files:
    """A stand-in model / tokenizer: save_pretrained writes one file of `size` bytes."""

    def __init__(self, name, size):
        self.name, self.size = name, size

    def save_pretrained(self, d, **_):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, self.name), "wb") as fh:
            fh.write(os.urandom(self.size))


def _save(tmp_path, step, mode, extra=None):
    return ck.save_checkpoint(str(tmp_path), step, _Files("w.bin", 1 << 20), _Files("tok.json", 100),
                              {"step": step}, keep=2, extra=extra, hash_mode=mode)


def _manifest(path):
    with open(os.path.join(path, "checkpoint.json")) as fh:
        return json.load(fh)


def test_background_hashing_returns_before_the_hashes_and_adds_them_later(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ck._sha256_file

    def slow(p):  # a hash that takes until the test says so (minutes at 115 GB)
        gate.wait(30)
        return real(p)

    monkeypatch.setattr(ck, "_sha256_file", slow)
    path = _save(tmp_path, 1, "background")
    # the save returned with the checkpoint in place and no hash computed yet
    m = _manifest(path)
    assert os.path.basename(path) == "step-000001" and m["step"] == 1
    assert all(info["sha256"] is None for info in m["files"].values())
    ck.verify_checkpoint(path, deep=True)  # sizes only, until the hashes arrive
    gate.set()
    assert ck.wait_for_hashes(30)
    m = _manifest(path)
    for rel, info in m["files"].items():
        with open(os.path.join(path, rel), "rb") as fh:
            assert info["sha256"] == hashlib.sha256(fh.read()).hexdigest(), rel
    ck.verify_checkpoint(path, deep=True)
    with open(os.path.join(path, "model", "w.bin"), "r+b") as fh:  # flip one byte, same size
        b = fh.read(1)
        fh.seek(0)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(ck.CheckpointError, match="does not match its sha256"):
        ck.verify_checkpoint(path, deep=True)
    ck.verify_checkpoint(path, deep=False)  # a size check cannot see it


def test_sync_hashing_writes_every_hash_before_the_rename(tmp_path):
    m = _manifest(_save(tmp_path, 1, "sync"))
    assert all(isinstance(info["sha256"], str) for info in m["files"].values())
    with pytest.raises(ValueError, match="hash mode"):
        _save(tmp_path, 2, "later")


def test_background_hashing_of_a_pruned_checkpoint_ends_quietly(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ck._sha256_file
    monkeypatch.setattr(ck, "_sha256_file", lambda p: (gate.wait(30), real(p))[1])
    first = _save(tmp_path, 1, "background")
    ck._remove_dir(first)  # pruned (keep) while its hashes were being computed
    gate.set()
    assert ck.wait_for_hashes(30)
    assert not os.path.exists(first)


def test_full_preset_hashes_in_the_background_and_resumes_by_size():
    from backends.run.presets import full_preset, toy_preset

    assert (full_preset().checkpoint.hash, full_preset().checkpoint.verify) == ("background", False)
    assert (toy_preset().checkpoint.hash, toy_preset().checkpoint.verify) == ("sync", True)


def test_resume_with_another_rank_count_stops_before_anything_loads(tmp_path, monkeypatch):
    """A checkpoint holding 2 ranks' ZeRO-3 partitions, resumed by 1 rank: CheckpointError at once,
    naming both counts and both ways on (the same rank count, or a new run from its weights)."""
    from backends.run.presets import full_preset
    from backends.run.resume import _open_run

    def zero(d):
        os.makedirs(os.path.join(d, "zero", "state"))
        for r in range(2):
            for kind in ("optim_states", "model_states"):
                with open(os.path.join(d, "zero", "state", f"zero_pp_rank_{r}_mp_rank_00_{kind}.pt"), "wb") as fh:
                    fh.write(b"x")

    path = ck.save_checkpoint(str(tmp_path), 3, _Files("w.bin", 10), _Files("t.json", 10),
                              {"step": 3, "config": {}}, extra=zero)
    assert ck.zero_world_size(path) == 2
    cfg = full_preset()
    cfg.run_dir = str(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ck.CheckpointError, match=r"on 1 rank\(s\): its DeepSpeed state \(zero/\) holds "
                                                 r"the partitions of 2 ranks") as e:
        _open_run(cfg, path)
    assert "--nproc_per_node 2" in str(e.value) and os.path.join(path, "model") in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ck.CheckpointError, match="configuration differs"):  # past the rank check
        _open_run(cfg, path)
