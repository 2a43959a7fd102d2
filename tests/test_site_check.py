"""The dry run's site checks (backends/distributed/site_check.py), each on faked inputs: compute mode,
the allocator setting with vLLM's sleep mode, GPUs visible against LOCAL_RANK, a stale extension-build
lock, checkpoint size and free disk; and that a failing check is listed under the dry run's problems."""
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
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CUDA_VISIBLE_DEVICES": "5",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WORLD_SIZE": "8", "RANK": "2",
           "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "8", "TORCH_CUDA_ARCH_LIST": "9.0a"}
    text, problems = dry_run.dry_run(cfg, env)
    assert "\nsite (settings that stop a run" in text
    for what in ("compute mode Prohibited", "expandable_segments:True, which this vLLM",
                 "sees 1 GPU(s) but is local rank 2 of 8", "stale extension-build lock",
                 "checkpoint.keep=3 checkpoints of 115 GB", "TORCH_CUDA_ARCH_LIST=9.0a"):
        assert sum(what in p for p in problems) == 1, (what, problems)
