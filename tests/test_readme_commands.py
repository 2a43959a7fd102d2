"""Every shell command README.md shows works in a fresh checkout.

tests/readme_commands.py extracts each command of the README's ```bash blocks and classifies it:
  run       python train.py / scripts/ask.py / bank.py / scripts/memory_eval.py / evaluate.py / scripts/*.py: run in a
            subprocess, in README order, from a scratch copy of the checkout (cwd = that copy, so
            `runs/toy` etc. are relative to it, as in a fresh clone); must exit 0 without a traceback,
            and every `runs/...` path its comment names must exist afterwards.
  dry-run   python train.py --full ... --dry-run: run; exit 0 or 1 with its report, no traceback.
  static    python3 -m venv, . .venv/bin/activate, pip install, export: checked without running
            (torch pinned to .ci/run's version before a CPU `pip install -e`, extras in pyproject.toml,
            exported names are the keys the code reads).
  skip      GPU / multi-node / network commands, listed with the reason in SKIPPED by exact text.
Anything else fails `test_every_readme_command_is_handled`, so a new README command must be runnable,
checkable or skipped on purpose.

Tiny settings and placeholders (readme_commands.ADDITIONS / PLACEHOLDERS):

| in the README command          | in the test                                                        |
|--------------------------------|--------------------------------------------------------------------|
| python train.py ARGS           | python train.py TINY ARGS; TINY = tiny_args + FAST without --toy,  |
|                                | --run-dir (shared warm-start cache: the toy_cache fixture)         |
| path/to/hf-model               | a copy of runs/toy/final (the base run's policy)                   |
| healthbench.jsonl              | one hand-written HealthBench row                                   |
| answers.jsonl                  | its answer                                                         |
| python evaluate.py ... (judge) | + --judge-base-url of a loopback server (tests/loopback.py) with   |
|                                | the default judge's API and model name, GEMINI_API_KEY = test key  |
| /ckpt/qwen3-8b-sft (dry run)   | unchanged: the dry run reports the missing directory               |
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import readme_commands as rc
from runfix import FAST
from test_smoke import tiny_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300
COMMANDS = rc.extract_commands(open(rc.readme_path(REPO), encoding="utf-8").read())
RUNNABLE = [c for c in COMMANDS if rc.classify(c)[0] in ("run", "dry-run")]
HB_ROW = {"prompt": [{"role": "user", "content": "I sleep four hours a night. Is that bad?"}],
          "prompt_id": "hb-readme", "example_tags": ["theme:sleep"],
          "rubrics": [{"criterion": "mentions the usual adult range of sleep", "points": 2,
                       "tags": ["axis:completeness"]},
                      {"criterion": "uses alarming language", "points": -1, "tags": ["axis:communication"]}]}


def tiny_train_args(cache_dir) -> list[str]:
    """tests/test_smoke.py tiny_args + tests/runfix.py FAST, without --toy and --run-dir (the
    README command chooses its preset and run dir), --steps N given as --set steps=N."""
    args = tiny_args("RUN", cache_dir) + FAST
    i = args.index("--run-dir")
    del args[i:i + 2]
    args.remove("--toy")
    i = args.index("--steps")  # as a config value: --steps would give the run a -stepsN dir of its own
    args[i:i + 2] = ["--set", f"steps={args[i + 1]}"]
    return args


# ----------------------------------------------------------------------------------------------------
# Extraction and classification (fast)


def test_extract_joins_continuations_splits_chains_and_keeps_quotes():
    md = ("text\n```bash\nA=1 pip install -e \".[x]\" && python train.py --toy   # c && d\n"
          "deepspeed --a 1 \\\n    train.py --full   # two lines\n"
          "python scripts/ask.py d \"q # not a comment && not a chain\"\n```\n```\npython not_bash.py\n```\n")
    cmds = rc.extract_commands(md)
    assert [c.text for c in cmds] == ['A=1 pip install -e ".[x]"', "python train.py --toy",
                                      "deepspeed --a 1 train.py --full",
                                      'python scripts/ask.py d "q # not a comment && not a chain"']
    assert cmds[1].comment == "c && d" and cmds[1].index == 1 and cmds[1].chain == tuple(
        c.text for c in cmds[:2])
    assert cmds[2].comment == "two lines" and cmds[2].line == 4


@pytest.mark.parametrize("text, kind", [
    ("python train.py --toy --seed 7", "run"),
    ("python scripts/ablate.py --quick", "run"),
    ("python train.py --full --model m --dry-run", "dry-run"),
    ("python train.py --full --model /ckpt/other", "unhandled"),
    ("torchrun --nproc_per_node 8 train.py --full --model m", "unhandled"),
    ("python evaluate.py drb --data q.jsonl --model m --sampler vllm", "unhandled"),
    ("curl -O https://example.org/data.jsonl", "unhandled"),
    ("python -m pytest -q tests/test_bank.py", "unhandled"),
    ("python -m pytest -q", "skip"),
    ("pip install vllm", "static"),
])
def test_classify(text, kind):
    cmd = rc.extract_commands(f"```bash\n{text}\n```\n")[0]
    assert rc.classify(cmd)[0] == kind


@pytest.mark.parametrize("chain, problem", [
    ("pip install -e . && pip install torch==2.13.0", "before any `pip install torch"),
    ("pip install torch && pip install -e .", "expected 'torch=="),
    ("pip install torch==2.13.0 && pip install -e \".[nosuch]\"", "not in pyproject.toml"),
    ("pip install requests", "not one of"),
    ("pip install torch==2.13.0 --index-url https://example.org/simple", "expected PyTorch's wheel index"),
    ("pip install -e . --index-url https://download.pytorch.org/whl/cpu", "installs no torch"),
    (". venv2/bin/activate", "without creating that venv"),
    ("export GEMINI_KEY=x", "not NAME=VALUE of a variable the code reads"),
])
def test_static_checks_find_bad_setup_lines(chain, problem):
    cmds = rc.extract_commands(f"```bash\n{chain}\n```\n")
    probs = [p for c in cmds for p in rc.static_problems(c, REPO)]
    assert any(problem in p for p in probs), probs


def test_every_readme_command_is_handled():
    bad = [f"README line {c.line}: {c.text!r}: {detail}" for c in COMMANDS
           for kind, detail in [rc.classify(c)] if kind == "unhandled"]
    assert not bad, "\n".join(bad)
    stale = set(rc.SKIPPED) - {c.text for c in COMMANDS}
    assert not stale, f"SKIPPED names commands the README no longer shows: {sorted(stale)}"
    assert any(c.text.startswith("python train.py --toy") for c in RUNNABLE)


def test_readme_setup_lines_are_consistent():
    probs = [f"README line {c.line}: {c.text!r}: {p}" for c in COMMANDS
             if rc.classify(c)[0] == "static" for p in rc.static_problems(c, REPO)]
    assert not probs, "\n".join(probs)


# ----------------------------------------------------------------------------------------------------
# Running them (slow: one tiny base run and every command after it, about a minute on one core)


def _scratch_checkout(dest):
    for name in os.listdir(REPO):
        if name.endswith(".py") or name in ("pyproject.toml", "README.md"):
            shutil.copy2(os.path.join(REPO, name), dest / name)
    for name in ("scripts", "toy", "backends"):
        shutil.copytree(os.path.join(REPO, name), dest / name,
                        ignore=shutil.ignore_patterns("__pycache__"))


def _env(extra=None) -> dict:
    secret = set(rc.secret_env_vars(REPO))
    env = {k: v for k, v in os.environ.items()
           if k not in secret and not k.endswith(("_API_KEY", "_TOKEN", "_SECRET"))}
    env.pop("PYTHONPATH", None)  # the scratch copy's modules, as in a fresh clone
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def _materialise(cmd, cwd) -> None:
    """Create the placeholders (rc.PLACEHOLDERS) the command names."""
    argv = cmd.argv
    if "path/to/hf-model" in argv and not (cwd / "path/to/hf-model").exists():
        assert (cwd / "runs/toy/final").is_dir(), "path/to/hf-model needs the base run's runs/toy/final"
        shutil.copytree(cwd / "runs/toy/final", cwd / "path/to/hf-model")
    if "healthbench.jsonl" in argv:
        (cwd / "healthbench.jsonl").write_text(json.dumps(HB_ROW) + "\n")
    if "answers.jsonl" in argv:
        (cwd / "answers.jsonl").write_text(
            json.dumps({"prompt_id": HB_ROW["prompt_id"], "response": "Adults need 7 to 9 hours."}) + "\n")


def _run(cmd, cwd, cache_dir) -> subprocess.CompletedProcess:
    argv = [sys.executable] + cmd.argv[1:]
    script = cmd.argv[1]
    if script == "train.py":
        argv[2:2] = tiny_train_args(cache_dir)
    if script != "evaluate.py":
        return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    from hparams import JudgeConfig
    from loopback import TEST_KEY, FakeServer

    a = cmd.argv
    kind = a[a.index("--judge") + 1] if "--judge" in a else JudgeConfig(backend="gemini").backend
    model = a[a.index("--judge-model") + 1] if "--judge-model" in a else JudgeConfig().model
    with FakeServer(kind, model=model) as srv:
        if cmd.argv[2] == "healthbench":
            srv.rule = lambda req: {"json": {"explanation": "checked", "criteria_met":
                                             "adult range" in FakeServer.prompt_and_schema(req)[0]}}
        p = subprocess.run(argv + ["--judge-base-url", srv.url], cwd=cwd,
                           env=_env({"GEMINI_API_KEY": TEST_KEY, "OPENAI_API_KEY": TEST_KEY}),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert srv.errors == [], srv.errors
    assert srv.requests, "evaluate.py never asked the loopback judge"
    return p


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory, toy_cache):
    """{command text: CompletedProcess} for every runnable README command, run in README order from
    one scratch checkout (a later command sees what an earlier one wrote, as a reader's would); a
    command shown twice (once per install line) runs once."""
    cwd = tmp_path_factory.mktemp("readme-checkout")
    _scratch_checkout(cwd)
    out = {}
    for cmd in RUNNABLE:
        if cmd.text in out:  # the same command on another machine's install line: a reader runs one
            continue
        _materialise(cmd, cwd)
        out[cmd.text] = (_run(cmd, cwd, toy_cache), cwd)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cmd", RUNNABLE, ids=[c.text[:70] for c in RUNNABLE])
def test_readme_command_runs(readme_runs, cmd):
    p, cwd = readme_runs[cmd.text]
    log = f"$ {cmd.text}\n(exit {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "Traceback (most recent call last)" not in p.stdout + p.stderr, log
    if rc.classify(cmd)[0] == "dry-run":
        assert p.returncode in (0, 1), log
        assert "RubricEM full mode: dry run" in p.stdout, log
        assert p.returncode == 0 or "\nproblems\n" in p.stdout, log
    else:
        assert p.returncode == 0, log
    for path in re.findall(r"runs/[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-/]", cmd.comment):
        assert (cwd / path).exists(), f"{cmd.text}: its comment names {path}, which it did not write"
