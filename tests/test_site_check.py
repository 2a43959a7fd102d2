"""The dry run's site checks (backends/distributed/site_check.py), each on faked inputs: compute mode,
the allocator setting with vLLM's sleep mode, GPUs visible against LOCAL_RANK, a stale extension-build
lock, checkpoint size and free disk, the NVIDIA driver against the wheels' CUDA, nvcc against torch's
CUDA; and that a failing check is listed under the dry run's problems."""
import os
import subprocess
import time
import types

import pytest

from backends.distributed import site_check as sc


def test_compute_mode_prohibited_is_a_problem_exclusive_process_is_not():
    lines, bad = sc.compute_mode_lines(["Default", "Exclusive_Process"])
    assert not bad and "GPU 1 Exclusive_Process" in lines[0] and "admit one process each" in lines[1]
    _, bad = sc.compute_mode_lines(["Default", "Prohibited", "Exclusive_Thread"])
    assert [b.split(" is in")[0] for b in bad] == ["GPU 1", "GPU 2"]
    assert sc.compute_mode_lines(None) == (["compute mode: not checked (no nvidia-smi here)"], [])


def test_compute_modes_are_read_from_nvidia_smi():
    def run(cmd, **kw):
        assert cmd[:2] == ["nvidia-smi", "--query-gpu=compute_mode"]
        return types.SimpleNamespace(returncode=0, stdout="Default\nExclusive_Process\n")

    assert sc.read_compute_modes(run) == ["Default", "Exclusive_Process"]
    assert sc.read_compute_modes(lambda *a, **k: types.SimpleNamespace(returncode=9, stdout="")) is None

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    assert sc.read_compute_modes(missing) is None


OLD = 'assert "expandable_segments:True" not in conf, ("Expandable segments are not compatible with memory pool. "'
NEW = "expandable_was_enabled = conf_flag_enabled(prev_conf, EXPANDABLE_SEGMENTS)"


def test_expandable_segments_with_sleep_mode_is_a_problem_only_for_a_vllm_that_asserts():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    _, bad = sc.alloc_conf_lines(env, sleep_mode=True, allocator_source=OLD)
    assert len(bad) == 1 and "refuses" in bad[0]
    lines, bad = sc.alloc_conf_lines(env, sleep_mode=True, allocator_source=NEW)
    assert not bad and "trainer keeps them" in lines[0]
    assert sc.alloc_conf_lines(env, sleep_mode=False, allocator_source=OLD)[1] == []
    assert sc.alloc_conf_lines({}, sleep_mode=True, allocator_source=OLD)[1] == []
    _, bad = sc.alloc_conf_lines({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True, OLD)
    assert bad  # torch's newer variable name too


def test_one_gpu_per_process_against_local_rank_is_a_problem():
    # SLURM --gpus-per-task=1: every process sees one GPU, local rank 1 of 8
    _, bad = sc.visible_gpu_lines({"CUDA_VISIBLE_DEVICES": "3"}, 1, local_rank=1, local_world=8)
    assert len(bad) == 1 and "sees 1 GPU(s) but is local rank 1 of 8" in bad[0]
    _, bad = sc.visible_gpu_lines({"CUDA_VISIBLE_DEVICES": "3"}, 1, local_rank=0, local_world=8)
    assert bad  # rank 0 alone would work, but its peers cannot
    assert sc.visible_gpu_lines({}, 8, local_rank=7, local_world=8)[1] == []
    assert sc.visible_gpu_lines({}, 1, local_rank=0, local_world=0)[1] == []  # one GPU, one process
    assert sc.visible_gpu_lines({}, 0, local_rank=3, local_world=8)[1] == []  # no GPU: not this check


def test_a_stale_extension_build_lock_is_a_problem_a_fresh_one_a_note(tmp_path):
    lock = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    now = time.time()
    os.utime(lock, (now - 7200, now - 7200))
    _, bad = sc.build_lock_lines(str(tmp_path), now=now)
    assert len(bad) == 1 and f"rm {lock}" in bad[0] and "120 min old" in bad[0]
    lines, bad = sc.build_lock_lines(str(tmp_path), now=now - 7200 + 60)
    assert not bad and "a build may be running" in lines[-1]
    assert sc.build_lock_lines(str(tmp_path / "none"))[1] == []
    assert sc.extensions_dir({"TORCH_EXTENSIONS_DIR": "/x"}) == "/x"


def test_an_arch_list_deepspeed_cannot_parse_is_a_problem():
    # seen on an H200 node: "9.0a" stopped the JIT build of FusedAdam (DeepSpeed's int() parse)
    assert sc.arch_list_lines({}) == (["TORCH_CUDA_ARCH_LIST: not set (DeepSpeed builds for the "
                                       "visible GPUs)"], [])
    for ok in ("9.0", "8.0;9.0+PTX", "8.6 9.0"):
        assert sc.arch_list_lines({"TORCH_CUDA_ARCH_LIST": ok})[1] == [], ok
    _, problems = sc.arch_list_lines({"TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert len(problems) == 1 and "9.0a" in problems[0] and 'TORCH_CUDA_ARCH_LIST="9.0"' in problems[0]
    _, problems = sc.arch_list_lines({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a;10.0a+PTX"})
    assert 'TORCH_CUDA_ARCH_LIST="8.0 9.0 10.0"' in problems[0]


def test_checkpoint_size_and_free_disk_for_keep_of_them():
    P = 8_190_735_360  # Qwen3-8B
    parts = sc.checkpoint_bytes(P)
    # Eq.: 12 P of DeepSpeed state + 2 P of bf16 weights + 0.1 GB = 114.8 GB
    assert sum(parts.values()) / 1e9 == pytest.approx(12 * 8.1907 + 2 * 8.1907 + 0.1, abs=0.01)
    lines, bad = sc.checkpoint_disk_lines(P, keep=3, every=10, run_dir="runs/full", free=300e9, where="/x")
    assert "114.8 GB each" in lines[0] and "459 GB at the peak" in lines[1]
    assert len(bad) == 1 and "need 459 GB" in bad[0]
    assert sc.checkpoint_disk_lines(P, 3, 10, "r", free=500e9, where="/x")[1] == []
    # a resumed run's checkpoints already hold their space
    assert sc.checkpoint_disk_lines(P, 3, 10, "r", free=300e9, where="/x", existing=3 * 114.8e9)[1] == []


def test_free_bytes_measures_the_nearest_existing_parent(tmp_path):
    free, where = sc.free_bytes(str(tmp_path / "runs" / "full"))
    assert where == str(tmp_path) and free > 0


def test_failing_site_checks_are_listed_under_the_dry_runs_problems(tmp_path, monkeypatch):
    """Through the dry run itself: each failing site check is one problem in its list."""
    import torch

    from backends.distributed import dry_run
    from backends.run import presets

    cfg = presets.full_preset()
    cfg.run_dir = str(tmp_path / "run")
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    os.utime(lock, (time.time() - 7200,) * 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="H100", total_memory=80 * 2 ** 30))
    monkeypatch.setattr(sc, "read_compute_modes", lambda: ["Prohibited"])
    monkeypatch.setattr(sc, "vllm_allocator_source", lambda: OLD)
    monkeypatch.setattr(sc, "free_bytes", lambda p: (50e9, str(tmp_path)))
    monkeypatch.setattr(sc, "read_driver_version", lambda: "535.104.05")  # too old for CUDA 13
    monkeypatch.setattr(sc, "cuda_compat_libs", lambda: [])
    monkeypatch.setattr(sc, "read_nvcc_release", lambda **kw: None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CUDA_VISIBLE_DEVICES": "5",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WORLD_SIZE": "8", "RANK": "2",
           "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "8", "TORCH_CUDA_ARCH_LIST": "9.0a"}
    text, problems = dry_run.dry_run(cfg, env)
    assert "\nsite (settings that stop a run" in text
    for what in ("compute mode Prohibited", "expandable_segments:True, which this vLLM",
                 "sees 1 GPU(s) but is local rank 2 of 8", "stale extension-build lock",
                 "checkpoint.keep=3 checkpoints of 115 GB", "TORCH_CUDA_ARCH_LIST=9.0a",
                 "NVIDIA driver 535.104.05 is older than 580, the minimum for CUDA 13.0"):
        assert sum(what in p for p in problems) == 1, (what, problems)


def test_driver_against_the_wheels_cuda():
    """CUDA 13 (the pinned vllm 0.32.0 and torch 2.13.0 wheels) needs driver >= 580, CUDA 12 >= 525.60.13
    (minor-version compatibility); cuda-compat covers an older driver; no driver skips the check."""
    lines, bad = sc.driver_lines("580.65.06", "13.0", [], 8)
    assert not bad and lines == ["NVIDIA driver 580.65.06; CUDA 13.0 (torch.version.cuda) needs >= 580: ok"]
    _, bad = sc.driver_lines("575.57.08", "13.0", [], 0)
    assert len(bad) == 1 and "older than 580" in bad[0] and "is_available() is False" in bad[0]
    assert "R580+" in bad[0] and "cuda-compat" in bad[0]
    # a CPU build of torch here: the pinned CUDA 13.0 build is what the node will run
    _, bad = sc.driver_lines("550.54.15", None, [], 0)
    assert "the pinned vllm 0.32.0 / torch 2.13.0 wheels" in bad[0]
    assert sc.driver_lines("550.54.15", "12.8", [], 8) == (
        ["NVIDIA driver 550.54.15; CUDA 12.8 (torch.version.cuda) needs >= 525.60.13: ok"], [])
    assert sc.driver_lines("525.60.12", "12.1", [], 8)[1]  # one patch level short
    lines, bad = sc.driver_lines("550.54.15", "13.0", ["/usr/local/cuda-13.0/compat/libcuda.so.1"], 8)
    assert not bad and "cuda-compat is installed" in lines[0]
    lines, bad = sc.driver_lines(None, None, [], 0)
    assert not bad and lines[0].startswith("NVIDIA driver: not checked (no nvidia-smi")


def test_driver_version_is_read_from_nvidia_smi_else_the_kernel_module(tmp_path):
    def smi(cmd, **kw):
        assert cmd == ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return types.SimpleNamespace(returncode=0, stdout="580.65.06\n580.65.06\n")

    assert sc.read_driver_version(smi, str(tmp_path / "none")) == "580.65.06"
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  "
                    "(dvs-builder@U16-I3-B03-4-3)  Fri Mar 14 2025\nGCC version:  gcc version 12.3.0\n")

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    assert sc.read_driver_version(missing, str(proc)) == "570.133.20"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    assert sc.read_driver_version(missing, str(proc)) == "535.104.05"
    assert sc.read_driver_version(missing, str(tmp_path / "none")) is None


def test_cuda_compat_libraries_are_found(tmp_path):
    d = tmp_path / "cuda-13.0" / "compat"
    d.mkdir(parents=True)
    (d / "libcuda.so.580.65.06").write_text("")
    assert sc.cuda_compat_libs((str(tmp_path / "cuda-*" / "compat"),)) == [str(d / "libcuda.so.580.65.06")]
    assert sc.cuda_compat_libs((str(tmp_path / "nothing"),)) == []


def test_nvcc_against_torchs_cuda_as_deepspeeds_op_builder_judges_it(tmp_path):
    """deepspeed 0.19.8's assert_no_cuda_mismatch: equal major.minor, or another minor within CUDA
    10-12; CUDA 13 has no such entry. A problem only when the run JIT-builds a CUDA op."""
    lines, bad = sc.nvcc_lines("12.4", "12.8", True)
    assert not bad and "accepts it" in lines[0]
    lines, bad = sc.nvcc_lines("13.1", "13.0", True)
    assert "refuses it" in lines[0] and len(bad) == 1 and "CUDAMismatchException" in bad[0]
    lines, bad = sc.nvcc_lines("12.9", "13.0", False)  # the RL run: informational
    assert not bad and "refuses it" in lines[0] and "informational" in lines[0]
    assert sc.nvcc_lines(None, "13.0", True)[1] and not sc.nvcc_lines(None, "13.0", False)[1]
    assert "the pinned torch 2.13.0's CUDA 13.0" in sc.nvcc_lines("13.0", None, False)[0][0]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")

    def nvcc(cmd, **kw):
        assert cmd == [str(tmp_path / "bin" / "nvcc"), "--version"]
        return types.SimpleNamespace(returncode=0, stdout="Cuda compilation tools, release 13.0, V13.0.88\n")

    assert sc.read_nvcc_release(nvcc, {"CUDA_HOME": str(tmp_path)}) == "13.0"


def test_a_prebuilt_cpu_adam_op_is_found_in_the_deepspeed_package(tmp_path, monkeypatch):
    """The start-up plan counts DeepSpeedCPUAdam's JIT build only without a prebuilt op."""
    pkg = tmp_path / "deepspeed"
    (pkg / "ops" / "adam").mkdir(parents=True)
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.setattr(sc.importlib.util, "find_spec", lambda name: spec if name == "deepspeed" else None)
    assert sc.cpu_adam_prebuilt() is False
    (pkg / "ops" / "adam" / "cpu_adam_op.cpython-311-x86_64-linux-gnu.so").write_text("")
    assert sc.cpu_adam_prebuilt() is True
    monkeypatch.setattr(sc.importlib.util, "find_spec", lambda name: None)
    assert sc.cpu_adam_prebuilt() is False
