"""What a newcomer reads: the end-of-run summary (artefacts, held-out numbers with 95 % CIs, fact
recall, warm-start wording), the progress-bar legend, the SFT filter counts, --help and --list-config,
and metrics.jsonl keys that are all explained in the metrics glossary (docs/metrics.md)."""
import contextlib
import io
import json
import logging
import os
import re

import numpy as np
import pytest

from backends.run import report
import train
from backends.run import cli, config as settings, presets
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
    """Every metric key the "Logged metrics" table of docs/metrics.md (the glossary the README
    links) names, {a,b} and {stage} expanded."""
    text = open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8").read()
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
    assert not missing, f"logged but not in docs/metrics.md: {missing}"


def test_glossary_names_the_fault_and_bank_keys():
    import bank
    from backends.run.faults import JUDGE_KINDS, TOOL_KINDS

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
    from backends.run.overrides import leaf_fields

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

    from backends.run import config as settings

    from backends.run import presets

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


# ----------------------------------------------------------------------------------------------------
# The first run at a glance: phase lines, quiet third-party bars, the verdict, the figure, artefacts


def _heldout(answers0, answers1):
    return ({"answer": float(np.mean(answers0)), "per_question": {"answer": list(answers0)}},
            {"answer": float(np.mean(answers1)), "per_question": {"answer": list(answers1)}})


@pytest.mark.parametrize("gain, words", [(0.12, "RL improved the held-out answer score: +0.1"),
                                         (-0.12, "RL lowered the held-out answer score: -0.1"),
                                         (0.0, "no change in the held-out answer score beyond noise")])
def test_verdict_is_read_off_the_paired_interval(gain, words):
    rng = np.random.default_rng(0)
    a = rng.uniform(0.3, 0.7, 64)
    b = a + gain + (rng.normal(0, 0.02, 64) if gain else rng.choice([-0.1, 0.1], 64))
    e0, e1 = _heldout(a, b)
    head, nxt = report.verdict_lines(e0, e1, "runs/toy")
    d, lo, hi = report.paired_gain(e0, e1)
    assert head.startswith("verdict: " + words), head
    assert f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]" in head
    assert (lo > 0) == (gain > 0) and (hi < 0) == (gain < 0)
    assert "runs/toy/reward_curves.png" in nxt and "python scripts/ask.py runs/toy/final" in nxt


def test_verdict_without_per_question_values_makes_no_claim():
    head, _ = report.verdict_lines({"answer": 0.5}, {"answer": 0.6}, "r")
    assert "+0.100" in head and "too little to call" in head and "improved" not in head


def test_phase_lines_announce_warm_start_rl_and_evaluation():
    assert report.phase_line("warm_start", cached=True, path="C/sft-x", steps=9) == \
        "SFT warm start: cached, loading C/sft-x"
    cold = report.phase_line("warm_start", cached=False, path="C/sft-x", steps=1000)
    assert "not cached yet" in cold and "1000 SFT steps" in cold and "cached in C/sft-x" in cold
    assert report.phase_line("rl", steps=24, start=0, prompts=8, n=8) == "RL: 24 steps of 8 questions x 8 rollouts"
    assert "resuming at step 10" in report.phase_line("rl", steps=24, start=10, prompts=8, n=8)
    assert report.phase_line("eval", policies="p", questions=64, samples=2) == \
        "held-out evaluation: p on 64 questions x 2 samples"
    with pytest.raises(KeyError):
        report.phase_line("nope")


def test_curve_panels_smooth_per_stage_and_draw_heldout_only_where_measured(tmp_path):
    rows = [{"step": t, **{f"score/{s}": (t % 2) * 0.4 + 0.1 for s in ("plan", "research", "review",
                                                                       "answer")},
             **{f"reward/{s}": 0.5 for s in ("plan", "research", "review", "answer")}} for t in range(8)]
    rows[3]["score/plan"] = None
    curve = [{"step": 0, "answer": 0.4}, {"step": 8, "answer": 0.5}]
    panels = report.plot_rewards(rows, str(tmp_path / "f.png"), curve, window=2)
    assert (tmp_path / "f.png").stat().st_size > 10_000
    assert [p["stage"] for p in panels] == ["plan", "research", "review", "answer"]
    assert all(p["key"] == f"score/{p['stage']}" for p in panels)  # the static score, not R
    assert np.allclose(panels[1]["smooth"][1:], 0.3)  # window of 2 averages 0.1 and 0.5
    assert np.isnan(panels[0]["raw"][3]) and panels[0]["smooth"][3] == pytest.approx(0.1)
    assert panels[3]["heldout"] == [(-1, 0.4), (7, 0.5)]  # two measured points, nothing between
    assert all(p["heldout"] is None for p in panels[:3])
    no_static = [{k: v for k, v in r.items() if not k.startswith("score/")} for r in rows]
    assert report.curve_panels(no_static)[0]["key"] == "reward/plan"
    assert report.plot_rewards([], str(tmp_path / "none.png")) == []
    with pytest.raises(ValueError):
        report.smooth([1.0], 0)


def test_artefact_list_skips_what_the_arm_does_not_have(tmp_path):
    for name in ("metrics.jsonl", "bank.jsonl"):
        (tmp_path / name).write_text("")
    assert any("bank.jsonl" in line for line in report.artefact_lines(str(tmp_path)))
    lines = report.artefact_lines(str(tmp_path), skip=("bank.jsonl",))
    assert len(lines) == 1 and "metrics.jsonl" in lines[0]


def test_steps_variations_get_their_own_run_dir():
    assert cli.parse_args(["--toy", "--steps", "6"]).run_dir == "runs/toy-steps6"
    assert cli.parse_args(["--toy", "--seed", "1", "--steps", "6"]).run_dir == "runs/toy-seed1-steps6"
    assert cli.parse_args(["--toy", "--steps", "24"]).run_dir == "runs/toy"  # the preset's own
    assert cli.parse_args(["--toy", "--steps", "6", "--run-dir", "x"]).run_dir == "x"
    assert cli.parse_args(["--toy", "--steps", "48", "--resume"]).run_dir == "runs/toy"  # continues


def test_final_generation_config_stops_at_a_tool_call(tmp_path):
    """Plain transformers generate on final/ stops at </call_tool>: one token of the toy tokenizer
    joins eos_token_id; a multi-token stop goes into stop_strings."""
    from transformers import GenerationConfig

    from backends.run.runcard import write_generation_stops
    from toy.model import train_tokenizer

    tok = train_tokenizer(["a b c plan research"], vocab_size=300)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                                 "pad_token_id": 0}))
    write_generation_stops(str(tmp_path), tok)
    g = GenerationConfig.from_pretrained(tmp_path)
    call_end = tok.convert_tokens_to_ids("</call_tool>")
    assert g.eos_token_id == [tok.eos_token_id, call_end] and g.pad_token_id == 0
    assert not getattr(g, "stop_strings", None)
    write_generation_stops(str(tmp_path), tok)  # idempotent
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [tok.eos_token_id, call_end]

    class Multi:  # a tokenizer without the tag as one token (e.g. Qwen3's)
        eos_token_id = 7

        def encode(self, text, add_special_tokens=False):
            return [1, 2, 3]

    d = tmp_path / "multi"
    d.mkdir()
    gen = write_generation_stops(str(d), Multi())
    assert gen == {"eos_token_id": [7], "stop_strings": ["</call_tool>"]}


@pytest.mark.slow
def test_first_run_console_phases_verdict_samples_and_stopping_final(two_runs, capfd):
    d, (rc_a, out_a, logs_a), (rc_b, out_b, logs_b) = two_runs
    assert "SFT warm start: cached, loading" in logs_b and "RL: 2 steps of 2 questions x 2 rollouts" in logs_b
    assert "held-out evaluation: the SFT start and the trained policy on 1 questions x 1 samples" in logs_b
    assert re.search(r"\nverdict: (RL improved|RL lowered|no change)[^\n]*\[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]",
                     out_b), out_b
    assert out_b.rstrip().splitlines()[-1].startswith("next: ")
    samples = [json.loads(line) for line in open(d / "b" / "samples.jsonl")]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4  # 2 questions x 2 rollouts, both steps
    # plain transformers generate on final/ stops at the first tool call
    from transformers import AutoModelForCausalLM, AutoTokenizer

    capfd.readouterr()
    tok = AutoTokenizer.from_pretrained(d / "b" / "final")
    model = AutoModelForCausalLM.from_pretrained(d / "b" / "final")
    assert tok.convert_tokens_to_ids("</call_tool>") in model.generation_config.eos_token_id
    card = (d / "b" / "final" / "README.md").read_text()
    assert "python scripts/ask.py" in card and "</call_tool>" in card and "docs/final_policy.md" in card
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    import torch as _torch

    stop = tok.convert_tokens_to_ids("</call_tool>")
    with _torch.no_grad():  # force a tool-call end as the first sampled token: generation ends there
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False,
                             begin_suppress_tokens=[i for i in range(len(tok)) if i != stop])
    assert out.shape[1] == prompt["input_ids"].shape[1] + 1
    assert "Loading weights" not in capfd.readouterr().err  # third-party bars are off (train.main)


@pytest.mark.slow
def test_docs_tool_loop_example_runs_on_a_trained_policy(two_runs, monkeypatch):
    """docs/final_policy.md's plain-transformers tool loop runs as written on a run's final/."""
    d = two_runs[0] / "b" / "final"
    text = open(os.path.join(ROOT, "docs", "final_policy.md"), encoding="utf-8").read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert 'd = "runs/toy/final"' in code and len(code.splitlines()) <= 25
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code.replace('d = "runs/toy/final"', f"d = {str(d)!r}"), "final_policy.md", "exec"), ns)
    assert ns["ids"].shape[1] > ns["start"]  # the policy wrote something after the prompt
