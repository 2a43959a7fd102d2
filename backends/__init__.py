"""Speed, scale and robustness around the paper layer (the root modules), one concern per package,
lower packages first (tests/test_imports.py holds every import to this order):

    api/          HTTP APIs: the §3.4 judge behind HTTP, web search, their HTTP client and prices
    scale/        the scale backends a run is built from: the `full` section, rollouts without a turn
                  barrier with continuous batching, the vLLM sampler, the dense bank retriever
    run/          one run's plumbing, toy and full: configuration, presets, command line, builder,
                  policy engine of one process, checkpoints, resume, guards, held-out evaluation, reports
    distributed/  full mode across the launcher's ranks: ZeRO-3 engine, the overlapped step, dry run
    eval/         evaluate.py's machinery: benchmark rows, answers, judge calls, reports
    sft/          the SFT stage at scale: teacher trajectories, ZeRO-3 fine-tuning

docs/layout.md says who calls each and whether the toy uses it.

One release of old names: the modules of the flat backends/ folder of rubricem 0.1.0 (backends.full,
backends.config, backends.versions, ...) still import, and still run with `python -m`, through
`MOVED` below, each with a one-line notice that names where it went.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

# The old flat modules -> the modules that hold their names now (a name in several: the first that
# has it). Removed in the next release.
MOVED: dict[str, tuple[str, ...]] = {
    **{f"backends.{m}": (f"backends.api.{m}",) for m in ("http", "pricing")},
    "backends.judge_http": ("backends.api.judge_http", "backends.api.judge_prompts", "backends.api.settings"),
    "backends.search_http": ("backends.api.search_http", "backends.api.settings"),
    **{f"backends.{m}": (f"backends.scale.{m}",) for m in ("rollout_engine", "vllm_sampler", "vllm_sync_ext",
                                                           "retrieval", "zero3_scope")},
    "backends.config": ("backends.run.config", "backends.run.overrides"),
    **{f"backends.{m}": (f"backends.run.{m}",) for m in ("build", "checkpoint", "cli", "data", "fast_logprobs",
                                                         "faults", "heldout", "presets", "report", "resume",
                                                         "robust", "runcard", "torch_engine")},
    "backends.full": ("backends.distributed.engine", "backends.distributed.zero3", "backends.distributed.dist",
                      "backends.scale.settings", "backends.distributed.dry_run",
                      "backends.distributed.selftest", "backends.distributed.__main__"),
    **{f"backends.{m}": (f"backends.distributed.{m}",) for m in ("launch_check", "overlap", "plan", "versions")},
    "backends.sft_pack": ("backends.sft.pack",),
    "backends.sft_teacher": ("backends.sft.teacher",),
    "backends.sft_zero3": ("backends.sft.zero3",),
}
# `python -m OLD` runs this module (default: the first of MOVED[OLD]).
RUN_AS = {"backends.full": "backends.distributed.__main__"}

log = logging.getLogger("rubricem.backends")


def _notice(old: str, new: str) -> None:
    log.warning("%s is deprecated: it is now %s (the old name works until the next release)", old, new)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of MOVED after every real module (sys.meta_path's end). Importing it gives
    the new module itself, or, for a module whose names went to several, a module holding all of
    their names; `python -m` runs RUN_AS's module."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        # the file of the module that `python -m` runs (runpy makes it sys.argv[0] and __file__)
        origin = importlib.util.find_spec(RUN_AS.get(name, MOVED[name][0])).origin
        return importlib.util.spec_from_loader(name, self, origin=origin)

    def create_module(self, spec):
        return None  # a plain module; exec_module fills it or puts the new module in its place

    def exec_module(self, module) -> None:
        old, new = module.__name__, MOVED[module.__name__]
        _notice(old, " and ".join(new))
        if len(new) == 1:  # the import system hands out what sys.modules holds after this call
            sys.modules[old] = importlib.import_module(new[0])
            return
        for mod in reversed([importlib.import_module(n) for n in new]):  # the first one's win
            module.__dict__.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})

    def get_code(self, name):
        new = RUN_AS.get(name, MOVED[name][0])
        _notice(f"python -m {name}", f"python -m {new.removesuffix('.__main__')}")
        return importlib.util.find_spec(new).loader.get_code(new)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
