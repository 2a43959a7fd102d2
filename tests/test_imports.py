"""The module graph of the project: no import cycles, no module imports train.py (the entry point),
and none of backends/' scale modules (DeepSpeed, vLLM, HTTP judge and search, dense retrieval) is
imported by a toy run (backends/ also holds the run's plumbing, which a toy run uses). Imports are read from the source (every `import` / `from ... import`, at
module level or inside a function), so a lazy import counts too.
"""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("toy", "backends")


def project_modules() -> dict[str, str]:
    """Dotted module name -> file, for the top-level modules and the package folders' modules."""
    out = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for pk in PACKAGES:
        for f in os.listdir(os.path.join(ROOT, pk)):
            if f.endswith(".py") and f != "__init__.py":
                out[f"{pk}.{f[:-3]}"] = os.path.join(ROOT, pk, f)
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


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_module_imports_train():
    g = graph()
    assert len(g) > 20  # the walk sees the project
    assert not sorted(m for m, deps in g.items() if "train" in deps)


SCALE_MODULES = ("backends.full", "backends.http", "backends.judge_http", "backends.search_http",
                 "backends.retrieval", "backends.vllm_sampler", "backends.vllm_sync_ext")


def test_a_toy_run_imports_no_scale_backend(tmp_path):
    """One toy RL step end to end: no scale module of backends/, no vLLM, no HTTP client. (DeepSpeed
    may still be loaded by `accelerate`, which transformers imports to load a model when both
    packages are installed; none of our code imports it in toy mode.)"""
    assert all(m in project_modules() for m in SCALE_MODULES)
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

