"""The shipped warm start (toy/warm_start/, built by scripts/build_warm_start.py): its files match its
manifest, it was built with the default toy configuration (so `python train.py --toy` starts RL from
it instead of training one), and `sft.shipped=false` or any other configuration trains a warm start
instead. A short prefix of its build, rebuilt here, is the contract of docs/metrics.md
("Reproducibility") on the machine that runs the test: built twice it gives the same bytes; against
the manifest's record, made on another machine, its world, data and tokenizer are the same bytes and its
losses and weights agree within build_warm_start.PREFIX_TOLERANCE, not bit for bit.

Every test here compares a figure stored in the repository with one computed here
(`stored_figures`: CI reruns them under a second kernel set, .ci/run)."""
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
pytestmark = pytest.mark.stored_figures


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


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """The shipped build's first K SFT steps, rebuilt twice here from its recorded settings and thread
    count and one copy of its teacher data (the teacher data are most of the time: a few minutes on
    2 cores; each K-step training takes seconds). Returns (manifest, first record, second record)."""
    m = _manifest()
    cfg = toy_preset()
    assert build_warm_start.warm_start_key_of(cfg) == m["key"]
    cfg = apply_overrides(cfg, [f"threads={m['threads']}"])
    tmp = str(tmp_path_factory.mktemp("prefix"))
    with torch_threads(m["threads"]):
        data = build_warm_start.teacher_data(cfg)
        a = build_warm_start.prefix_record(cfg, m["prefix"]["sft_steps"], tmp, data)
        b = build_warm_start.prefix_record(cfg, m["prefix"]["sft_steps"], tmp, data)
    return m, a, b


@pytest.mark.slow
def test_a_prefix_built_twice_here_is_the_same_bytes(rebuilt):
    """Same machine, threads and versions: bit-identical (weights' sha256, every loss, every
    statistic). The two trainings share one copy of the teacher data, whose bytes the next test
    checks against the manifest."""
    _, a, b = rebuilt
    assert a == b


@pytest.mark.slow
def test_the_prefix_matches_the_manifest_within_the_measured_tolerance(rebuilt):
    """Across machines: the toy world, the encoded SFT examples and the tokenizer are the same bytes
    as where the manifest was made (and the tokenizer is the full build's); each step's loss and the
    weights' statistics agree within PREFIX_TOLERANCE. The weights' sha256 is not compared: it holds on the
    recording machine only."""
    m, got, _ = rebuilt
    diff = build_warm_start.prefix_differences(got, m["prefix"])
    assert diff["world"] is diff["data"] is diff["tokenizer"] is True, diff
    assert got["files"]["tokenizer.json"] == m["files"]["tokenizer.json"]
    assert got["data_sha256"] == m.get("data_sha256", got["data_sha256"])
    assert got["sft_steps"] == len(got["losses"]) == len(m["prefix"]["losses"])
    assert build_warm_start.prefix_mismatches(diff) == [], (diff, got["machine"], m["prefix"]["machine"])
