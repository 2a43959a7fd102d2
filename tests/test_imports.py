"""The module graph of the project: layers that no import runs back up, no import cycles, and none of
the scale modules (DeepSpeed, vLLM, HTTP judge and search, dense retrieval) imported by a toy run.
Imports are read from the source (every `import` / `from ... import`, at module level or inside a
function), so a lazy import counts too. Also: the old module names of the flat backends/ folder
still import and run for one release, each with a one-line notice (backends/__init__.py MOVED).
"""
import ast
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("toy", "backends")
ENTRY_POINTS = ("train", "evaluate")  # the command lines: nothing imports them


def project_modules() -> dict[str, str]:
    """Dotted module name -> file, for the top-level modules and every module of the package folders
    and their sub-packages (a package's __init__.py under the package's own name)."""
    out = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for pk in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, pk)):
            dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
            package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    out[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(folder, f)
    return out


def imports_of(path: str, mods: dict) -> set[str]:
    """The project modules that the file at `path` imports (anywhere in it)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in mods}
    return found


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(p, mods) - {m} for m, p in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of g as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                c = visit(v)
                if c:
                    return c
        state[u] = 2
        stack.pop()
        return None

    for u in sorted(g):
        if u not in state:
            c = visit(u)
            if c:
                return c
    return None


def _under(*packages: str):
    return lambda m: any(m == p or m.startswith(p + ".") for p in packages)


# The layers, lowest first. A module imports modules of its own layer or of lower ones, never of a
# higher one: the paper layer knows no backend, toy/ knows only the paper, and within backends/ the
# HTTP APIs and the scale backends know nothing of a run, a run nothing of full mode's ranks, the
# evaluation or the SFT stage (backends/__init__.py, docs/layout.md).
LAYERS = (
    ("the paper layer (root modules)", lambda m: "." not in m and m not in ENTRY_POINTS + PACKAGES),
    ("toy/", _under("toy")),
    ("backends/ api/ and scale/", lambda m: m == "backends" or _under("backends.api", "backends.scale")(m)),
    ("backends/run/", _under("backends.run")),
    ("backends/ distributed/ and eval/", _under("backends.distributed", "backends.eval")),
    ("backends/sft/", _under("backends.sft")),
    ("the entry points", lambda m: m in ENTRY_POINTS),
)


def layer(module: str) -> int:
    """The index in LAYERS of the one layer that holds `module`; AssertionError otherwise."""
    held = [i for i, (_, holds) in enumerate(LAYERS) if holds(module)]
    assert len(held) == 1, f"{module} is in {len(held)} layers: add it to exactly one of LAYERS"
    return held[0]


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_walk_sees_every_sub_package():
    mods = project_modules()
    for pk in ("backends.api", "backends.scale", "backends.run", "backends.distributed", "backends.eval",
               "backends.sft"):
        assert pk in mods and any(m.startswith(pk + ".") for m in mods), pk


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_module_imports_a_higher_layer():
    g = graph()
    up = sorted(f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
                for m, deps in g.items() for d in deps if layer(d) > layer(m))
    assert not up, "\n".join(up)


def test_a_planted_import_up_a_layer_is_caught():
    assert layer("toy.world") < layer("backends.run.build") < layer("backends.distributed.engine")
    assert layer("ss_grpo") < layer("toy.judge") < layer("backends.api.http") < layer("train")
    with pytest.raises(AssertionError):
        layer("backends.somewhere_new")


def test_no_module_imports_train():
    g = graph()
    assert len(g) > 20  # the walk sees the project
    assert not sorted(m for m, deps in g.items() if "train" in deps)


# What a toy run may load of the backends that exist for scale: two sections' dataclasses, the price
# table, build's names from the rollout schedule and the request interface it uses (none of them
# runs) and the overlapped step (it answers None for a toy run).
TOY_LOADS = ("backends.api.settings", "backends.api.pricing", "backends.scale.settings",
             "backends.scale.rollout_engine", "backends.scale.continuous", "backends.distributed.overlap")
SCALE_MODULES = tuple(sorted(
    m for m in project_modules() if m.count(".") == 2 and m not in TOY_LOADS
    and _under("backends.api", "backends.scale", "backends.distributed", "backends.eval", "backends.sft")(m)))


def test_a_toy_run_imports_no_scale_backend(tmp_path):
    """One toy RL step end to end: no scale module of backends/, no vLLM, no HTTP client. (DeepSpeed
    may still be loaded by `accelerate`, which transformers imports to load a model when both
    packages are installed; none of our code imports it in toy mode.)"""
    assert {"backends.distributed.engine", "backends.distributed.zero3", "backends.api.http",
            "backends.api.judge_http", "backends.api.search_http", "backends.scale.retrieval",
            "backends.scale.vllm_sampler", "backends.scale.vllm_sync_ext"} <= set(SCALE_MODULES)
    code = ("import sys, os\n"
            "sys.path.insert(0, os.path.join(os.getcwd(), 'tests'))\n"
            "import train\n"
            "from runfix import fast_args\n"
            f"assert train.main(fast_args({str(tmp_path / 'run')!r}, {str(tmp_path / 'cache')!r}, 1)) == 0\n"
            f"bad = sorted(m for m in sys.modules if m in {SCALE_MODULES + ('vllm', 'requests')!r})\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------
# One release of the old names (backends/__init__.py MOVED)


def test_old_module_names_import_the_moved_modules_with_one_notice_each():
    import backends

    code = ("import importlib, logging, sys, backends\n"
            "logging.basicConfig(format='NOTICE %(message)s')\n"
            "for old, new in backends.MOVED.items():\n"
            "    m = importlib.import_module(old)\n"
            "    importlib.import_module(old)\n"  # a second import says nothing more
            "    if len(new) == 1:\n"
            "        assert m is importlib.import_module(new[0]), old\n"
            "from backends import full, config\n"
            "from backends.distributed import dist, engine, selftest\n"
            "from backends.judge_http import HTTPJudge, HTTPJudgeConfig, TRUNCATED_NOTE\n"
            "from backends.search_http import SearchHTTPConfig, SerperSearchTool\n"
            "from backends.run import overrides\n"
            "assert full.ZeRO3Engine is engine.ZeRO3Engine and full.init_distributed is dist.init_distributed\n"
            "assert full.synthetic_batch is selftest.synthetic_batch and callable(full.main)\n"
            "assert config.apply_overrides is overrides.apply_overrides and config.Config\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]
    notices = [ln for ln in r.stderr.splitlines() if ln.startswith("NOTICE")]
    assert len(notices) == len(backends.MOVED), notices
    for old, ln in zip(backends.MOVED, notices):
        assert f"{old} is deprecated: it is now {backends.MOVED[old][0]}" in ln, ln


@pytest.mark.parametrize("old, says", [("backends.full", "dry-run"), ("backends.sft_teacher", "--queries"),
                                       ("backends.versions", "torch")])
def test_old_module_names_still_run_with_python_m(old, says):
    args = ["--help"] if old != "backends.versions" else ["--cpu"]
    r = subprocess.run([sys.executable, "-m", old, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert says in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode in (0, 1)  # versions: 1 when this machine's versions are not the pinned ones
    notice = [ln for ln in r.stderr.splitlines() if "deprecated" in ln]
    assert len(notice) == 1 and f"python -m {old}" in notice[0], r.stderr[-2000:]


def test_the_new_module_paths_run_with_python_m():
    for mod in ("backends.distributed", "backends.sft.teacher"):
        r = subprocess.run([sys.executable, "-m", mod, "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and "usage" in r.stdout and "deprecated" not in r.stderr, r.stderr[-2000:]


def test_moved_targets_exist():
    import backends

    mods = project_modules()
    for old, new in backends.MOVED.items():
        assert old not in mods, f"{old} is a module again: drop it from MOVED"
        assert all(n in mods for n in new), (old, new)
    assert importlib.util.find_spec("backends.no_such_module") is None
