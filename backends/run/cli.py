"""The command line of train.py: flags and --set KEY=VALUE applied to the toy or full preset
(config.Config), --list-config (the configuration reference), --resume.
"""
from __future__ import annotations

import argparse
from typing import Sequence

from backends.run import checkpoint as ckpt_mod
from backends.run.config import ARMS, Config
from backends.run.overrides import apply_overrides, format_config_reference, variation_run_dir
from backends.run.presets import full_preset, load_config, reference_config, toy_preset


def _argument_parser() -> argparse.ArgumentParser:
    """The command line of train.py (flags and --set; parse_cli applies them to a preset)."""
    ap = argparse.ArgumentParser(description="RubricEM training (toy or full mode)",
                                 epilog="Every config key, its default and its meaning: --list-config. "
                                        "README.md has the quick start, docs/metrics.md the logged metrics.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--toy", action="store_true", help="toy preset: a tiny policy on CPU in a generated "
                   "research world; on 2 cores 5-8 min, about 3 min once the SFT warm start is cached "
                   "(default)")
    g.add_argument("--full", action="store_true", help="full preset: the paper's values (ZeRO-3, vLLM, "
                   "Gemini judge, web search; needs --model); default: off")
    ap.add_argument("--steps", type=int, help="RL steps (default: the preset's, toy 24, full 1400); the "
                    "run dir gets -stepsN when N differs from the preset's; with --resume, a larger "
                    "value continues a finished run in its own dir")
    ap.add_argument("--seed", type=int, help="random seed (default: 0); the run dir gets -seedN")
    ap.add_argument("--run-dir", help="where the run's files go (default: the preset's runs/toy or "
                    "runs/full, with -seedN, -model-NAME, -faults-J-T, -stepsN appended for --seed, "
                    "--model (toy), --faults and --steps)")
    ap.add_argument("--model", help="local Hugging Face causal-LM directory as the starting policy (skips "
                    "the toy SFT warm start; default: none, the warm start)")
    ap.add_argument("--arm", choices=list(ARMS),
                    help="ablation arm: rubricem (SS-GRPO + reflection meta-policy + bank; default), "
                         "ss_grpo (stagewise advantages only), meta_policy (terminal score + reflection "
                         "+ bank), baseline_rl (terminal Answer score only), baseline_rl_info (terminal "
                         "mean of the four stage scores only); the run dir gets -<arm>")
    ap.add_argument("--advantage", help=argparse.SUPPRESS)  # replaced by --arm: a clear error below
    ap.add_argument("--eval-every", type=int, metavar="N",
                    help="held-out evaluation of the current policy every N RL steps into "
                         "eval_curve.jsonl (config eval.every; default 0: only the SFT start and the "
                         "end)")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bars (default: shown)")
    ap.add_argument("--report-to", metavar="BACKENDS",
                    help="also log the metrics to tensorboard (run_dir/tensorboard) and / or wandb "
                         "(offline unless $WANDB_MODE is set), comma-separated (config report_to; "
                         "default: metrics.jsonl only)")
    ap.add_argument("--list-config", action=_ListConfig, nargs=0,
                    help="print every config key with its default (toy, and full where it differs) "
                         "and its meaning, then exit")
    ap.add_argument("--dry-run", action="store_true",
                    help="full mode: resolve the configuration, check the environment, print the "
                         "plan (dry_run.main_dry_run) and exit without training (default: off)")
    ap.add_argument("--resume", nargs="?", const="latest", metavar="PATH|latest",
                    help="continue from a checkpoint directory, or from the newest valid one in the "
                         "run dir ('latest', the default when the flag has no value; a fresh run if "
                         "there is none); a finished run is left as it is (default: a fresh run)")
    ap.add_argument("--faults", metavar="JUDGE_RATE[,TOOL_RATE]",
                    help="inject judge (and tool) faults at these rates, e.g. 0.3,0.1 (faults.py; "
                         "default: none); the run dir gets -faults-J-T")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any config key, repeatable, e.g. --set ss_grpo.lr=1e-4; the value "
                         "is checked against the key's type before the run starts (keys and defaults: "
                         "--list-config; default: none)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    return ap


def parse_cli(argv: Sequence[str] | None = None) -> tuple[Config, str | None]:
    """(config, resume) from the command line; resume is None, "latest" or a checkpoint path.

    With --resume the configuration starts from the checkpoint's own (so `--resume PATH` alone
    continues a run); flags and --set apply on top, and `train` refuses changes outside
    RESUME_MAY_CHANGE. Raises ValueError for unknown fields or malformed values.
    """
    a = _argument_parser().parse_args(argv)
    if a.advantage is not None:
        raise ValueError("--advantage was replaced by --arm: --arm baseline_rl is one terminal score "
                         "without reflection or bank, --arm meta_policy the same score with them")
    cfg = full_preset() if a.full else toy_preset()
    # Each variation of the preset gets its own default run dir (config.variation_run_dir); full
    # mode always names a --model, so only the toy preset derives a directory from it.
    base = cfg.run_dir + (f"-{a.arm}" if a.arm and a.arm != "rubricem" else "")
    run_dir = a.run_dir or variation_run_dir(base, seed=a.seed, model=None if a.full else a.model,
                                             faults=a.faults)
    if a.steps is not None and a.steps != cfg.steps and not a.run_dir and not a.resume:
        run_dir += f"-steps{a.steps}"  # a shorter or longer run beside the preset's, never refused there
    if a.resume:
        path = a.resume
        if a.resume == "latest":
            path = ckpt_mod.find_latest(run_dir, deep=False)
        elif not a.run_dir:
            run_dir = ckpt_mod.run_dir_of(a.resume)
        if path:
            meta = ckpt_mod.verify_checkpoint(path, deep=False).get("meta", {})
            if "config" in meta:
                cfg = load_config(meta["config"])
    cfg.run_dir = run_dir
    if a.steps is not None:
        cfg.steps = a.steps
    if a.seed is not None:
        cfg.seed = a.seed
    if a.model:
        cfg.model = a.model
    if a.arm:
        cfg.arm = a.arm
    if a.no_progress:
        cfg.progress = False
    if a.report_to is not None:
        cfg.report_to = [x.strip() for x in a.report_to.split(",") if x.strip()]
    if a.eval_every is not None:
        cfg.eval.every = a.eval_every
    cfg.dry_run = bool(a.dry_run)
    if a.faults:
        try:
            rates = [float(x) for x in a.faults.split(",")]
        except ValueError:
            raise ValueError(f"--faults expects JUDGE_RATE[,TOOL_RATE], got {a.faults!r}") from None
        if len(rates) > 2:
            raise ValueError(f"--faults expects JUDGE_RATE[,TOOL_RATE], got {a.faults!r}")
        cfg.faults.judge_rate = rates[0]
        cfg.faults.tool_rate = rates[1] if len(rates) > 1 else 0.0
    cfg = apply_overrides(cfg, a.set)
    if cfg.rollout.scaffold != "structured" and not a.run_dir and not a.resume:
        cfg.run_dir += f"-{cfg.rollout.scaffold}"  # its own run, beside the structured one
    return cfg, a.resume


class _ListConfig(argparse.Action):
    """--list-config: print the configuration reference (config.format_config_reference), exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(format_config_reference(reference_config(), full_preset()), end="")
        parser.exit(0)


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """The configuration of a command line (see parse_cli)."""
    return parse_cli(argv)[0]
