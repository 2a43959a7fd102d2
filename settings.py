"""Command-line settings of train.py: the default run directory of each command-line variation.

Not part of the paper's method: plumbing that keeps one run's files apart from another's.
"""
from __future__ import annotations

import re

# ----------------------------------------------------------------------------------------------------
# Default run directories


def variation_run_dir(base: str, seed: int | None = None, model: str | None = None,
                      faults: str | None = None) -> str:
    """The default run directory of a command line that varies the preset: `base` plus one suffix
    per variation, so that each variation of the README runs beside the quick start's `runs/toy`
    instead of being refused there.

    base: the preset's run directory (str); seed: --seed (int or None) -> "-seed1"; model: --model
    (a path or None) -> "-model-<name>", name = the directory's last component (the last two when it
    ends in "final", e.g. runs/toy/final -> "toy-final"), characters outside [A-Za-z0-9._-] replaced
    by "-"; faults: --faults text or None -> "-faults-0.3-0.1". Returns a str; raises nothing.
    Example: variation_run_dir("runs/toy", model="path/to/hf-model") == "runs/toy-model-hf-model".
    """
    out = base
    if seed is not None:
        out += f"-seed{seed}"
    if model:
        parts = [p for p in re.split(r"[\\/]+", model.strip()) if p not in ("", ".")]
        name = "-".join(parts[-2:]) if len(parts) >= 2 and parts[-1] == "final" else (parts or ["model"])[-1]
        out += "-model-" + re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    if faults:
        out += "-faults-" + re.sub(r"[^A-Za-z0-9.]+", "-", faults.strip())
    return out
