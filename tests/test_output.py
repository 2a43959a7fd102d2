"""What a newcomer reads: the end-of-run summary (artefacts, held-out numbers with 95 % CIs, fact
recall, warm-start wording), the progress-bar legend, the SFT filter counts, --help and --list-config,
and metrics.jsonl keys that are all explained in the README's glossary."""
import contextlib
import io
import json
import logging
import os
import re

import numpy as np
import pytest

from backends import report
import train
from backends import cli
from backends import config as settings
from backends import presets
from runfix import fast_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args) -> tuple[int, str, str]:
    """train.main(args) -> (exit code, stdout, log records of the rubricem loggers)."""
    out, logs = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(logs)
    lg = logging.getLogger("rubricem")
    lg.addHandler(handler)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out):
            rc = train.main(args)
    finally:
        lg.removeHandler(handler)
        lg.setLevel(old)
    return rc, out.getvalue(), logs.getvalue()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, toy_cache):
    """Two tiny 2-step runs sharing the warm-start cache (the second one loads it), the second with
    the progress bar on."""
    d = tmp_path_factory.mktemp("out")
    a = _run(fast_args(d / "a", toy_cache, 2))
    b = _run(fast_args(d / "b", toy_cache, 2, "--set", "progress=true"))
    return d, a, b


def glossary_keys() -> set:
    """Every metric key the README's "Logged metrics" table names, {a,b} and {stage} expanded."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = text.split("## Logged metrics", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        for pat in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            pat = pat.replace("{stage}", "{plan,research,review,answer}")
            todo = [pat]
            while todo:
                p = todo.pop()
                m = re.search(r"\{([^{}]*)\}", p)
                if m:
                    todo += [p[:m.start()] + alt + p[m.end():] for alt in m.group(1).split(",")]
                else:
                    keys.add(p)
    return keys


@pytest.mark.slow
def test_every_logged_metric_key_is_in_the_readme_glossary_and_every_line_has_them_all(two_runs):
    d, (rc, _, _), _ = two_runs
    assert rc == 0
    rows = [json.loads(line) for line in open(d / "a" / "metrics.jsonl")]
    assert len(rows) == 2 and all(list(r) == list(rows[0]) for r in rows)
    missing = sorted(set(rows[0]) - glossary_keys())
    assert not missing, f"logged but not in README's Logged metrics: {missing}"


def test_glossary_names_the_fault_and_bank_keys():
    import bank
    from backends.faults import JUDGE_KINDS, TOOL_KINDS

    keys = glossary_keys()
    reasons = [getattr(bank, n) for n in dir(bank) if n.startswith("REASON_") and n != "REASON_OK"]
    assert {f"judge/faults/{k}" for k in JUDGE_KINDS} <= keys
    assert {f"tools/faults/{k}" for k in TOOL_KINDS} <= keys
    assert {f"bank/rejected/{r}" for r in reasons} <= keys


def test_metrics_lines_share_one_key_set_with_null_for_keys_a_step_lacks(tmp_path):
    log = report.MetricsLog(str(tmp_path / "m.jsonl"))
    log.log({"a": 1.0}, 0)
    log.log({"a": 2.0, "bank/rejected/empty": 1}, 1)  # a key that appears at step 1
    log.log({"b": float("nan")}, 2)
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert rows == log.rows == [
        {"step": 0, "a": 1.0, "bank/rejected/empty": None, "b": None},
        {"step": 1, "a": 2.0, "bank/rejected/empty": 1, "b": None},
        {"step": 2, "a": None, "bank/rejected/empty": None, "b": None}]
    again = report.MetricsLog(str(tmp_path / "m.jsonl"))  # a resumed run starts from the rows
    again.reset(rows[:2])
    again.log({"a": 3.0}, 2)
    assert [json.loads(line) for line in open(tmp_path / "m.jsonl")][2] == \
        {"step": 2, "a": 3.0, "bank/rejected/empty": None, "b": None}


@pytest.mark.slow
def test_summary_lists_artefacts_heldout_cis_fact_recall_and_cached_wording(two_runs):
    d, (rc_a, out_a, logs_a), (rc_b, out_b, logs_b) = two_runs
    assert rc_a == rc_b == 0
    for name in ("metrics.jsonl", "reward_curves.png", "final/", "bank.jsonl", "samples.jsonl",
                 "eval.json"):
        assert f"  {d / 'b' / name}" in out_b, name
    assert re.search(r"held-out score \(mean of 4 stage scores\): SFT \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] "
                     r"-> RL \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]; RL - SFT [+-]\d\.\d{3} \[", out_b), out_b
    assert "held-out fact recall:" in out_b and "95% CIs: bootstrap over the 1 held-out questions" in out_b
    assert re.search(r"SFT warm start: cached \(trained earlier in \d+ s, final loss", out_b), out_b
    assert "SFT filters kept " in out_b and "{'generated'" not in out_b + logs_a + logs_b
    assert report.PROGRESS_LEGEND in logs_b and report.PROGRESS_LEGEND not in logs_a
    ev = json.load(open(d / "b" / "eval.json"))
    assert len(ev["eval_rl"]["per_question"]["score"]) == 1
    assert ev["eval_rl"]["per_question"]["fact_recall"][0] == pytest.approx(ev["eval_rl"]["fact_recall"])


def test_bootstrap_ci_over_questions():
    x = np.random.default_rng(1).random(200)
    lo, hi = report.bootstrap_ci(x)
    assert lo < x.mean() < hi and hi - lo < 0.2
    assert report.bootstrap_ci(x) == (lo, hi)  # seeded
    assert report.bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    assert all(np.isnan(report.bootstrap_ci([float("nan")])))
    with pytest.raises(ValueError):
        report.bootstrap_ci(x, level=1.0)


def test_filter_counts_read_as_a_sentence():
    s = report.format_filter_counts({"generated": 42, "kept": 40, "no_closing_answer": 1,
                                     "consecutive_tool_errors": 1})
    assert s == "kept 40 of 42 teacher trajectories; dropped: 1 no closing </answer>, 1 two tool errors in a row"


def test_help_explains_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_cli(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    entries = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
    assert len(entries) >= 12
    for entry in entries:
        flag = entry.split()[0]
        if flag in ("-h,", "--list-config"):  # actions, not settings
            continue
        assert len(entry.split()) > 3 and "default" in entry, entry


def test_list_config_prints_every_key_with_its_default_and_doc(capsys):
    from backends.config import leaf_fields

    with pytest.raises(SystemExit) as e:
        cli.parse_cli(["--list-config"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    blocks = {b.split(" = ", 1)[0]: b for b in re.split(r"\n(?=\S)", text.strip())}
    keys = [k for k, _, _ in leaf_fields(presets.reference_config())]
    assert list(blocks) == keys
    for key, typ, value in leaf_fields(presets.reference_config()):
        head, _, doc = blocks[key].partition("\n")
        assert head.startswith(f"{key} = {json.dumps(value)}"), head
        assert doc.startswith("    ") and doc.strip(), f"{key} has no documentation"
    assert '(full: 1400)' in blocks["steps"] and "PAPER" in blocks["rollout.n"]


# ----------------------------------------------------------------------------------------------------
# Opt-in metric backends (--report-to): TensorBoard and W&B (offline) next to metrics.jsonl


@pytest.mark.slow
def test_report_to_tensorboard_and_wandb_log_what_metrics_jsonl_logs(tmp_path, toy_cache):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import glob
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    code = ("import sys, os\nsys.path.insert(0, os.path.join(os.getcwd(), 'tests'))\n"
            "import train\nfrom runfix import fast_args\n"
            f"sys.exit(train.main(fast_args({str(run)!r}, {str(toy_cache)!r}, 2, "
            "'--report-to', 'tensorboard,wandb')))\n")
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    got = {e.step: e.value for e in ea.Scalars("reward/answer")}
    assert got == pytest.approx({row["step"]: row["reward/answer"] for row in rows}, rel=1e-6)
    assert "time/step_s" in ea.Tags()["scalars"] and "judge/missing" in ea.Tags()["scalars"]
    (wb,) = glob.glob(str(run / "wandb" / "offline-run-*" / "*.wandb"))  # offline: no network used
    blob = open(wb, "rb").read()
    assert b"reward/answer" in blob and b"loss/total" in blob


def test_report_to_refuses_unknown_or_missing_backends(monkeypatch):
    import importlib.util

    from backends import config as settings

    from backends import presets

    cfg = presets.toy_preset()
    cfg.report_to = ["mlflow"]
    with pytest.raises(ValueError, match="unknown backend 'mlflow'"):
        settings.validate_config(cfg)
    cfg.report_to = ["wandb"]
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else find(n, *a))
    with pytest.raises(ValueError, match="pip install wandb"):
        settings.validate_config(cfg)
    assert cli.parse_args(["--toy", "--report-to", "tensorboard, wandb"]).report_to == [
        "tensorboard", "wandb"]
