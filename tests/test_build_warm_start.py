"""scripts/build_warm_start.py: a short prefix of the warm-start build (a few SFT steps on a tiny
world) gives the same bytes twice, its manifest's hashes match its files, and the result loads as
a policy directory (what `train.py --toy --set model=OUT` reads)."""
import hashlib
import os
import sys

import pytest

from backends.run.overrides import apply_overrides
from backends.run.presets import toy_preset

from toyfix import torch_threads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import build_warm_start  # noqa: E402

TINY = ["threads=1", "sft.steps=4", "sft.n_trajectories=200", "sft.n_reflections=20",
        "world.n_train_entities=40", "world.n_heldout_entities=10", "toy_model.vocab_size=400"]


def _digest(d):
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(d))}


def test_a_build_prefix_reproduces_byte_for_byte(tmp_path):
    cfg = apply_overrides(toy_preset(), TINY)
    with torch_threads(1):
        m1 = build_warm_start.build(cfg, str(tmp_path / "a"))
        m2 = build_warm_start.build(cfg, str(tmp_path / "b"))
    a, b = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert a == b
    assert {f: h for f, h in a.items() if f != "warm_start.json"} == m1["files"] == m2["files"]
    assert "model.safetensors" in a and "tokenizer.json" in a and m1["steps"] == 4
    with pytest.raises(FileExistsError):
        build_warm_start.build(cfg, str(tmp_path / "a"))
    # A different seed is a different warm start.
    with torch_threads(1):
        m3 = build_warm_start.build(apply_overrides(toy_preset(), TINY + ["sft.seed=1"]),
                                    str(tmp_path / "c"))
    assert m3["files"]["model.safetensors"] != m1["files"]["model.safetensors"]
    from toy import model as policy

    model, tok = policy.load_policy(str(tmp_path / "a"))
    assert sum(p.numel() for p in model.parameters()) == m1["params"]
    assert tok.eos_token == "<|im_end|>"
