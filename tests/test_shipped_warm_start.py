"""The shipped warm start (toy/warm_start/, built by scripts/build_warm_start.py): its files match its
manifest, it was built with the default toy configuration (so `python train.py --toy` starts RL from
it instead of training one), a short prefix of its build reproduces byte for byte, and
`sft.shipped=false` or any other configuration trains a warm start instead."""
import hashlib
import json
import os
import sys

import pytest

from backends.run.overrides import apply_overrides
from backends.run.presets import toy_preset
from toy import sft as toy_sft

from toyfix import torch_threads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import build_warm_start  # noqa: E402

MANIFEST = os.path.join(toy_sft.SHIPPED, "warm_start.json")


def _manifest():
    with open(MANIFEST) as fh:
        return json.load(fh)


def test_files_match_the_manifest_and_the_size_limit():
    m = _manifest()
    total = 0
    for name, digest in m["files"].items():
        path = os.path.join(toy_sft.SHIPPED, name)
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest, name
        total += os.path.getsize(path)
    assert total <= 50 * 2**20


def test_the_default_toy_configuration_starts_from_it():
    cfg = toy_preset()
    assert build_warm_start.warm_start_key_of(cfg) == toy_sft.shipped_key() == _manifest()["key"]
    # any change to what the warm start is built from is another key: trained in the run instead
    other = apply_overrides(toy_preset(), ["teacher.p_skip=0.1"])
    assert build_warm_start.warm_start_key_of(other) != toy_sft.shipped_key()
    # where the warm start comes from is not part of what it is
    assert build_warm_start.warm_start_key_of(apply_overrides(toy_preset(), ["sft.shipped=false"])) \
        == toy_sft.shipped_key()


def test_sft_shipped_false_trains_instead(tmp_path, monkeypatch):
    """warm_start loads the shipped directory only for its key and only with sft.shipped."""
    calls = []
    monkeypatch.setattr(toy_sft, "build_sft_data", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(
        RuntimeError("would train")))
    cfg = toy_preset()
    world = toy_sft.World.__new__(toy_sft.World)
    world.config = cfg.world
    from scaffold import system_prompt

    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)
    model, tok, info, path = toy_sft.warm_start(world, None, system, cfg.sft, cfg.teacher,
                                                cfg.toy_model.size, cfg.toy_model.vocab_size,
                                                str(tmp_path), progress=False)
    assert path == toy_sft.SHIPPED and info["shipped"] and info["key"] == _manifest()["key"]
    assert sum(p.numel() for p in model.parameters()) == _manifest()["params"]
    off = apply_overrides(toy_preset(), ["sft.shipped=false"])
    with pytest.raises(RuntimeError, match="would train"):
        toy_sft.warm_start(world, None, system, off.sft, off.teacher, off.toy_model.size,
                           off.toy_model.vocab_size, str(tmp_path), progress=False)
    assert calls == [1]


@pytest.mark.slow
def test_a_prefix_of_the_shipped_build_reproduces(tmp_path):
    """The first K SFT steps of the shipped build, rebuilt from its recorded settings and thread
    count, give the recorded weights and tokenizer bytes (the same teacher data, tokenizer,
    initialisation and batch order; a few minutes on 2 cores, most of it teacher data)."""
    m = _manifest()
    cfg = toy_preset()
    assert build_warm_start.warm_start_key_of(cfg) == m["key"]
    cfg = apply_overrides(cfg, [f"threads={m['threads']}"])
    with torch_threads(m["threads"]):
        got = build_warm_start.prefix_digest(cfg, m["prefix"]["sft_steps"], str(tmp_path))
    assert got == m["prefix"]
    assert got["files"]["tokenizer.json"] == m["files"]["tokenizer.json"]
