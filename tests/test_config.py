"""The configuration's layout: the paper layer's knobs in hparams.py (at most 60 leaves, each with its
paper reference), the backends' sections with their backends, the old key spellings as aliases, and
configs saved before the sections moved (tests/data/configs_before_sections.json: the toy and full
presets as config.json held them) still loading and resuming."""
from __future__ import annotations

import ast
import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest

import hparams
from backends.run import config, overrides, presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = json.load(open(os.path.join(ROOT, "tests", "data", "configs_before_sections.json")))
# What a paper-layer knob's documentation must hold: a paper reference or why it is not the paper's.
REFERENCE = ("PAPER", "§", "appendix", "not in the paper")


def project_imports(path: str) -> set[str]:
    """Top-level names of every module imported anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_paper_layer_has_at_most_60_leaves_each_with_a_paper_reference():
    rows = overrides.describe_config(hparams.PaperConfig())
    assert 30 <= len(rows) <= 60, len(rows)
    for key, _, doc in rows:
        assert any(r in doc for r in REFERENCE), f"{key}: no paper reference in {doc!r}"


def test_paper_layer_holds_no_transport_or_toy_knob():
    keys = {k for k, _, _ in overrides.leaf_fields(hparams.PaperConfig())}
    for old in config.ALIASES:  # every moved key left the paper layer
        assert old not in keys
    assert not keys & {"full", "eval", "world", "sft", "teacher", "toy_model"}
    # The paper layer sits above the paper modules and below every backend.
    assert not {m for m in project_imports(os.path.join(ROOT, "hparams.py"))
                if m.startswith(("backends", "toy"))}


def test_config_module_imports_no_toy_module_and_no_scale_backend():
    for name in ("config.py", "overrides.py"):
        mods = project_imports(os.path.join(ROOT, "backends", "run", name))
        assert not {m for m in mods if m.startswith("toy")}, mods
        assert not {m for m in mods if m.startswith(("backends.api", "backends.scale", "backends.distributed"))}
        assert not mods & {"backends.run.heldout", "backends.run.presets"}
    code = ("import sys, backends.run.config, backends.run.overrides; "
            "print(sorted(m for m in sys.modules if m.startswith('toy')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_backend_sections_are_defined_in_their_backends_modules():
    cfg = presets.reference_config()
    where = {"full": "backends.scale.settings", "judge_http": "backends.api.settings",
             "search_http": "backends.api.settings", "eval": "backends.run.heldout",
             "toy_model": "toy.model", "world": "toy.world", "sft": "toy.sft", "teacher": "toy.teacher"}
    assert set(where) == set(config.SECTION_FIELDS)
    for name, module in where.items():
        assert type(getattr(cfg, name)).__module__ == module, name


def test_toy_preset_leaves_the_scale_sections_out_and_validation_attaches_what_a_run_needs():
    cfg = presets.toy_preset()
    assert cfg.full is None and cfg.judge_http is None and cfg.search_http is None
    config.validate_config(cfg)
    assert cfg.judge_http is None  # the toy judge needs no transport
    cfg.judge.backend, cfg.data.source = "openai", "rows.jsonl"
    config.validate_config(cfg)
    assert cfg.judge_http.key_env("openai") == "OPENAI_API_KEY"
    full = presets.full_preset()
    assert full.full.zero_stage == 3 and full.search_http.api_key_env == "SERPER_API_KEY"


@pytest.mark.parametrize("old", sorted(config.ALIASES))
def test_every_old_key_spelling_still_sets_its_new_key_with_a_deprecation_line(old, caplog):
    new = config.ALIASES[old]
    ref = dict((k, v) for k, _, v in overrides.leaf_fields(presets.reference_config()))
    assert new in ref and old not in ref
    value = ref[new]
    changed = (not value if isinstance(value, bool) else
               value + 1 if isinstance(value, int) else
               value + 0.5 if isinstance(value, float) else "XS" if new == "toy_model.size" else
               "json_object" if new.endswith("openai_response_format") else
               "responseJsonSchema" if new.endswith("gemini_schema_field") else value + "-x")
    caplog.set_level(logging.WARNING, logger="rubricem.config")
    cfg = overrides.apply_overrides(presets.toy_preset(), [f"{old}={json.dumps(changed)}"])
    section, _, name = new.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == changed
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1 and old in lines[0] and new in lines[0] and "\n" not in lines[0]


def test_old_spellings_on_the_command_line():
    from backends.run import cli

    cfg = cli.parse_args(["--set", "judge.base_url=http://127.0.0.1:9", "--set", "model_size=XS",
                          "--set", "search.rpm=7", "--set", "vocab_size=400"])
    assert cfg.judge_http.base_url == "http://127.0.0.1:9" and cfg.search_http.rpm == 7
    assert (cfg.toy_model.size, cfg.toy_model.vocab_size) == ("XS", 400)


@pytest.mark.parametrize("preset", ["toy", "full"])
def test_configs_saved_before_the_sections_moved_load_and_resume(preset, caplog):
    caplog.set_level(logging.WARNING, logger="rubricem.config")
    saved = OLD[preset]
    assert "base_url" in saved["judge"] and "model_size" in saved  # the old layout
    now = presets.toy_preset() if preset == "toy" else presets.full_preset()
    # The toy's world, teacher, SFT and log-prob defaults changed after these were saved (the causal
    # toy task too): set them back (ss_grpo.share_prefix = true, saved then, reads as
    # fast_logprobs = true).
    now = overrides.apply_overrides(now, ["world.n_train_entities=1000", "sft.n_trajectories=8000",
                                       "sft.steps=1000", "teacher.p_skip=0.15", "teacher.p_uncited=0.15",
                                       "teacher.p_no_negative=0.3", "fast_logprobs=true",
                                       "world.p_outdated=0.15", "teacher.p_distractor=0.3",
                                       "teacher.p_memory=0.3"])
    if preset == "toy":  # the toy's response budget and reflection weight changed with the causal task,
        # its micro-batch with the 1,024-token budget, and its optimizer steps per batch from 2 to 1
        now = overrides.apply_overrides(now, ["rollout.max_response_tokens=512", "reflection.loss_coef=1.0",
                                              "ss_grpo.micro_batch=32", "ss_grpo.minibatches=2"])
    if preset == "full":  # the full preset's schedule became the overlapped one after it was saved,
        # and vLLM's GPU share comes from the memory plan
        assert config.resume_config_diff(saved, now) == ["full.rollout_schedule",
                                                         "full.vllm_gpu_memory_utilization"]
        now = overrides.apply_overrides(now, ['full.rollout_schedule="lockstep"',
                                              "full.vllm_gpu_memory_utilization=0.5"])
    assert config.resume_config_diff(saved, now) == []
    back = presets.load_config(saved)
    assert dataclasses.asdict(back)["toy_model"] == dataclasses.asdict(now.toy_model)
    assert back.judge_http.base_url == saved["judge"]["base_url"]
    assert back.search_http.rpm == saved["search"]["rpm"]
    assert config.resume_config_diff(saved, back) == []
    assert sum("deprecated keys" in r.getMessage() for r in caplog.records) >= 1
    # A change that matters is still refused: resume_config_diff does not ignore the moved keys.
    changed = json.loads(json.dumps(saved))
    changed["judge"]["temperature"] = 0.5
    changed["model_size"] = "M"
    assert config.resume_config_diff(changed, now) == (
        ["judge_http.temperature", "toy_model.size"] if preset == "full" else ["toy_model.size"])


def test_a_new_config_json_round_trips():
    for cfg in (presets.toy_preset(), presets.full_preset()):
        d = json.loads(json.dumps(dataclasses.asdict(cfg)))
        assert config.migrate_config_dict(d) == d
        back = presets.load_config(d)
        assert json.loads(json.dumps(dataclasses.asdict(back))) == d
        assert config.resume_config_diff(d, back) == []
