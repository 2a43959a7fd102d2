"""Launch checks of the full-mode dry run (backends/distributed/launch_check.py): the API keys on the rank that
reads them (global rank 0: it samples, judges and searches) and their forwarding by a multi-node
deepspeed launch (.deepspeed_env), what DeepSpeedCPUAdam needs to build, /dev/shm."""
import os
from types import SimpleNamespace

from backends.distributed import dry_run, launch_check
from backends.run.presets import full_preset

KEYS = [("judge (gemini)", "GEMINI_API_KEY"), ("search (google_search, Serper)", "SERPER_API_KEY")]
LAUNCH2 = {"WORLD_SIZE": "16", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_SIZE": "8", "CROSS_SIZE": "2"}


def test_nodes_and_ranks_per_node_from_either_launcher():
    assert launch_check.nodes(LAUNCH2) == 2 and launch_check.ranks_per_node(LAUNCH2) == 8
    torchrun = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}
    assert launch_check.nodes(torchrun) == 2 and launch_check.ranks_per_node(torchrun) == 8
    assert launch_check.nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert launch_check.nodes({}) == 1


def test_keys_multi_node_need_deepspeed_env(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    e = {**LAUNCH2, "GEMINI_API_KEY": "g" * 12, "SERPER_API_KEY": "s" * 12}
    lines, bad = launch_check.key_lines(KEYS, e, 0, True, str(home), str(cwd))
    assert len(bad) == 2 and all(".deepspeed_env" in b for b in bad)
    assert not any("g" * 12 in ln for ln in lines)  # names only, never values
    (home / ".deepspeed_env").write_text("GEMINI_API_KEY=x\nSERPER_API_KEY=y\n")
    lines, bad = launch_check.key_lines(KEYS, e, 0, True, str(home), str(cwd))
    assert not bad and any(str(home / ".deepspeed_env") in ln for ln in lines)
    # one node: the local launcher passes the whole environment
    one = {k: v for k, v in e.items() if k != "CROSS_SIZE"}
    one["WORLD_SIZE"] = "8"
    (home / ".deepspeed_env").unlink()
    assert not launch_check.key_lines(KEYS, one, 0, True, str(home), str(cwd))[1]


def test_keys_are_needed_on_rank_0_only(tmp_path):
    lines, bad = launch_check.key_lines(KEYS, {**LAUNCH2, "RANK": "9"}, 9, True, str(tmp_path), str(tmp_path))
    assert not bad and "global rank 9: it needs no judge key" in "\n".join(lines)
    lines, bad = launch_check.key_lines(KEYS, {}, 0, False, str(tmp_path), str(tmp_path))
    assert len(bad) == 2 and all("is not set" in b for b in bad)
    assert "not under a launcher" in "\n".join(lines)


def test_cpu_adam_prerequisites_are_problems_on_gpu_nodes_only(monkeypatch):
    monkeypatch.setattr(launch_check.shutil, "which", lambda name: None)
    monkeypatch.setattr(launch_check.importlib.util, "find_spec",
                        lambda name: None if name in ("ninja", "deepspeed") else SimpleNamespace())
    _, bad = launch_check.cpu_adam_lines(True, 8, {})
    assert len(bad) == 1 and "C++ compiler" in bad[0] and "ninja" in bad[0] and "CUDA" in bad[0]
    assert not launch_check.cpu_adam_lines(True, 0, {})[1]  # a CPU machine is not the planned node
    assert not launch_check.cpu_adam_lines(False, 8, {})[1]


def test_small_shm_is_a_problem_on_gpu_nodes(monkeypatch):
    monkeypatch.setattr(launch_check.os, "statvfs", lambda p: SimpleNamespace(f_frsize=4096, f_blocks=16384))
    lines, bad = launch_check.shm_lines(8)
    assert bad and "64 MiB" in bad[0] and "--shm-size" in bad[0]
    assert not launch_check.shm_lines(0)[1]


def test_dry_run_under_the_launcher_rank_0_reports_other_ranks_only_their_problems(monkeypatch, capsys):
    monkeypatch.setattr(os, "environ", {**os.environ, **LAUNCH2, "RANK": "3", "LOCAL_RANK": "3"})
    cfg = full_preset()
    dry_run.main_dry_run(cfg)
    out = capsys.readouterr().out
    assert "RubricEM full mode: dry run" not in out  # only rank 0 prints the report
    assert all(ln.startswith("[rank 3] problem:") for ln in out.splitlines())
    assert not any("GEMINI_API_KEY" in ln for ln in out.splitlines())  # rank 3 needs no key


def test_the_dry_run_reads_the_policys_run_card(tmp_path):
    """The SFT stage writes rubricem.json beside the weights (backends/sft/zero3.py); full mode's dry
    run compares it with the run's system prompt and scaffold (runcard.card_mismatch)."""
    import json

    from backends.run import runcard
    from scaffold import system_prompt

    cfg = full_preset()
    cfg.model = str(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    system = system_prompt(cfg.rollout.scaffold, cfg.rollout.system_prompt)

    def card(prompt, scaffold):
        (tmp_path / runcard.CARD).write_text(json.dumps(
            {"format": runcard.FORMAT, "system_prompt": prompt, "config": {"rollout": {"scaffold": scaffold}}}))
        return [p for p in dry_run._path_problems(cfg) if str(tmp_path) in p]

    assert dry_run._path_problems(cfg) == [] or all(str(tmp_path) not in p for p in dry_run._path_problems(cfg))
    assert card(system, "structured") == []  # the card agrees
    (bad,) = card("another prompt", "structured")
    assert "another system prompt" in bad and "rollout.system_prompt" in bad
    (bad,) = card(system, "unstructured")
    assert "'unstructured' scaffold" in bad
    (tmp_path / runcard.CARD).write_text("{not json")
    assert any("unreadable run card" in p for p in dry_run._path_problems(cfg))
