"""scripts/build_warm_start.py: a short prefix of the warm-start build (a few SFT steps on a tiny
world) gives the same bytes twice, its manifest's hashes match its files, and the result loads as
a policy directory (what `train.py --toy --set model=OUT` reads)."""
import hashlib
import json
import os
import subprocess
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


# ----------------------------------------------------------------------------------------------------
# The prefix record: what another machine compares (docs/metrics.md, "Reproducibility")


def _record(losses, sample, l2=2.0, model="aa", tokenizer="tt", data="dd", world="ww"):
    return {"sft_steps": len(losses), "world_sha256": world, "data_sha256": data, "losses": losses,
            "files": {"model.safetensors": model, "tokenizer.json": tokenizer},
            "weights": {"w": {"l2": l2, "sample": sample}}}


def test_prefix_differences_are_checked_against_the_tolerance_not_bitwise():
    tol = build_warm_start.PREFIX_TOLERANCE
    want = _record([7.0, 6.9], [0.1, 0.2, 0.3, 0.4])
    # other weight bytes, floats within the tolerance: the contract holds
    near = _record([7.0 + tol["loss"] / 2, 6.9], [0.1, 0.2 + tol["weights"] / 2, 0.3, 0.4],
                   l2=2.0 * (1 + tol["l2"] / 2), model="bb")
    d = build_warm_start.prefix_differences(near, want)
    assert d["bitwise"] is False and d["world"] is d["data"] is d["tokenizer"] is True
    assert build_warm_start.prefix_mismatches(d) == []
    # each figure beyond its tolerance, other data or tokenizer bytes, a missing record: reported
    for got, what in [(_record([7.0, 6.9 + 2 * tol["loss"]], [0.1, 0.2, 0.3, 0.4]), "loss"),
                      (_record([7.0, 6.9], [0.1, 0.2, 0.3, 0.4 - 2 * tol["weights"]]), "weights"),
                      (_record([7.0, 6.9], [0.1, 0.2, 0.3, 0.4], l2=2.0 * (1 + 2 * tol["l2"])), "l2"),
                      (_record([7.0], [0.1, 0.2, 0.3, 0.4]), "loss"),
                      (_record([7.0, 6.9], [0.1, 0.2, 0.3, 0.4], world="other"), "world"),
                      (_record([7.0, 6.9], [0.1, 0.2, 0.3, 0.4], data="other"), "data"),
                      (_record([7.0, 6.9], [0.1, 0.2, 0.3, 0.4], tokenizer="other"), "tokenizer")]:
        bad = build_warm_start.prefix_mismatches(build_warm_start.prefix_differences(got, want))
        assert len(bad) == 1 and bad[0].startswith(what), (what, bad)
    old = {"sft_steps": 2, "files": want["files"]}  # a record from before losses and weights were kept
    bad = build_warm_start.prefix_mismatches(build_warm_start.prefix_differences(want, old))
    assert [b.split()[1] for b in bad] == ["loss", "weights", "l2"]


@pytest.mark.slow
def test_prefix_only_rewrites_the_record_of_a_build_and_check_compares_it(tmp_path, capsys):
    """--prefix-only adds the record to a build made without one (its other files stay the same
    bytes); --check rebuilds the prefix and finds it within the tolerance; a configuration other
    than the build's is refused."""
    sets = [x for kv in TINY for x in ("--set", kv)]
    out = str(tmp_path / "ws")
    assert build_warm_start.main(["--out", out, "--prefix-steps", "0", *sets]) == 0
    before = _digest(out)
    m0 = json.load(open(os.path.join(out, "warm_start.json")))
    assert "prefix" not in m0 and m0["data_sha256"] and m0["machine"]["torch"]
    assert build_warm_start.main(["--out", out, "--prefix-only", "--prefix-steps", "2", *sets]) == 0
    m1 = json.load(open(os.path.join(out, "warm_start.json")))
    after = _digest(out)
    assert {f: h for f, h in after.items() if f != "warm_start.json"} == \
        {f: h for f, h in before.items() if f != "warm_start.json"}
    assert {k: v for k, v in m1.items() if k != "prefix"} == m0
    p = m1["prefix"]
    assert p["sft_steps"] == len(p["losses"]) == 2 and p["data_sha256"] == m0["data_sha256"]
    assert p["world_sha256"] == m0["world_sha256"]
    assert p["files"]["tokenizer.json"] == m0["files"]["tokenizer.json"]
    assert "model.embed_tokens.weight" in p["weights"]
    capsys.readouterr()
    assert build_warm_start.main(["--out", out, "--check", *sets]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mismatches"] == [] and report["differences"]["bitwise"] is True
    assert build_warm_start.main(["--out", out, "--prefix-only", *sets, "--set", "sft.seed=1"]) == 2
    assert "--set options it was built with" in capsys.readouterr().err


PREFIX_IN_A_PROCESS = r"""
import json, sys
sys.path.insert(0, "scripts")
import torch
import build_warm_start
from backends.run.overrides import apply_overrides
from backends.run.presets import toy_preset
torch.set_num_threads(1)
cfg = apply_overrides(toy_preset(), json.loads(sys.argv[1]))
print(json.dumps(build_warm_start.prefix_record(cfg, 4, sys.argv[2])))
"""


@pytest.mark.slow
def test_a_prefix_under_another_kernel_set_matches_within_the_tolerance(tmp_path):
    """The cross-machine clause of the contract, on one machine: the same prefix with torch's generic
    kernels (ATEN_CPU_CAPABILITY=default) and with this CPU's own has the same data and tokenizer
    bytes, and its losses and weights agree within PREFIX_TOLERANCE."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recs = []
    for cap in (None, "default"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if cap:
            env["ATEN_CPU_CAPABILITY"] = cap
        r = subprocess.run([sys.executable, "-c", PREFIX_IN_A_PROCESS, json.dumps(TINY), str(tmp_path)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        recs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    here, generic = recs
    assert generic["machine"]["cpu_capability"] == "DEFAULT"
    diff = build_warm_start.prefix_differences(generic, here)
    assert diff["world"] is diff["data"] is diff["tokenizer"] is True
    assert build_warm_start.prefix_mismatches(diff) == [], diff


def test_the_contract_states_the_tolerances_the_code_uses():
    """docs/metrics.md, "Reproducibility", is the contract: its tolerances are PREFIX_TOLERANCE and it
    gives the command that rewrites a build's prefix record."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = open(os.path.join(root, "docs", "metrics.md"), encoding="utf-8").read()
    section = " ".join(doc.split("\n## Reproducibility\n", 1)[1].split("\n## ", 1)[0].split())
    e = lambda x: f"{x:.0e}".replace("e-0", "e-")  # noqa: E731  (1e-4)
    tol = build_warm_start.PREFIX_TOLERANCE
    assert f"loss {e(tol['loss'])}, weights {e(tol['weights'])}, l2 {e(tol['l2'])}" in section
    assert "python scripts/build_warm_start.py --out toy/warm_start --prefix-only" in section
    assert "stored_figures" in section and "ATEN_CPU_CAPABILITY=default" in section
