"""Where a figure came from: the CPU, torch's kernel set, the library versions.

Float results of the same code, seed and thread count are bit-identical on one machine, and differ in
their last bits between CPU families, SIMD kernel sets (torch's `ATEN_CPU_CAPABILITY`), thread counts
and library versions; a sampled run then drifts within its bootstrap interval (docs/metrics.md,
"Reproducibility"). So every stored figure says which machine made it: a run's eval.json
("machine"), the shipped warm start's manifest, and what scripts/reproduce.py writes to
docs/results.md and README.md.

Not part of the paper's method.
"""
from __future__ import annotations

import os
import platform
import subprocess


def cpu_model() -> str:
    """The CPU's model name (lscpu's "Model name", else /proc/cpuinfo's, else the platform's), or
    "unknown CPU"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((l.split(":", 1)[1].strip() for l in out.splitlines()
                     if l.startswith("Model name")), "")
        if name:
            return name
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")), "")
        if name:
            return name
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict:
    """What decides a float result besides the code, seed and threads: {"cpu", "nproc",
    "cpu_capability" (the kernel set torch dispatches to: DEFAULT, AVX2, AVX512, ...), "torch",
    "transformers", "python", "platform"}."""
    import torch  # lazy: the CPU description needs no torch
    import transformers

    return {"cpu": cpu_model(), "nproc": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}"}


def describe(m: dict) -> str:
    """One line for a person: "AMD EPYC, 2 CPUs (nproc), torch kernels AVX512; torch 2.13.0+cpu,
    transformers 5.25.0, Python 3.11.2"."""
    return (f"{m.get('cpu', 'unknown CPU')}, {m.get('nproc', '?')} CPUs (nproc), torch kernels "
            f"{m.get('cpu_capability', '?')}; torch {m.get('torch', '?')}, transformers "
            f"{m.get('transformers', '?')}, Python {m.get('python', '?')}")
