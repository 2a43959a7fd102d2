"""Packaging: the distribution carries every module of the project, so `pip install .` gives a
working `import train` (which pulls in full, data, retrieval, ...) outside the checkout.

The project is a flat set of top-level modules named one by one in pyproject.toml's
`[tool.setuptools] py-modules`; setuptools packages exactly that list. The first test ties the list
to the files on disk (a new module, or a new package folder, fails it until it is listed); the second
builds the wheel offline, installs it into an empty folder and imports every module from there.
"""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Folders of the checkout that are not importable code of the distribution.
NOT_CODE = {"tests", "docs", "scripts", "benchmarks", "build", "dist", ".git", ".ci"}


def _setuptools_table() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["tool"]["setuptools"]


def _top_level_modules() -> list[str]:
    """Names of the *.py files at the top of the checkout (setup.py is a build script, not code)."""
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))
                  if os.path.basename(p) != "setup.py")


def _top_level_packages() -> list[str]:
    """Folders at the top of the checkout that Python can import as packages (have __init__.py)."""
    return sorted(d for d in os.listdir(ROOT)
                  if d not in NOT_CODE and os.path.isfile(os.path.join(ROOT, d, "__init__.py")))


def _packages() -> list[str]:
    """Every importable package of the checkout, sub-packages included (backends.api, ...)."""
    out = []
    for top in _top_level_packages():
        for folder, dirs, _ in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py"))]
            out.append(os.path.relpath(folder, ROOT).replace(os.sep, "."))
    return sorted(out)


def test_pyproject_lists_every_top_level_module_and_package():
    table = _setuptools_table()
    listed = table.get("py-modules", [])
    assert len(listed) == len(set(listed)), f"py-modules repeats a name: {listed}"
    on_disk = _top_level_modules()
    assert sorted(listed) == on_disk, (
        f"pyproject.toml [tool.setuptools] py-modules must name every top-level module; "
        f"missing: {sorted(set(on_disk) - set(listed))}, "
        f"not on disk: {sorted(set(listed) - set(on_disk))}")
    packages = _packages()
    assert sorted(table.get("packages", [])) == packages, (
        f"package folders {packages} (sub-packages included) must be listed in [tool.setuptools] "
        f"packages (listed: {table.get('packages', [])})")


@pytest.mark.slow
def test_built_wheel_installs_and_imports_every_module_outside_the_checkout(tmp_path):
    """Wheel built offline from a copy of the checkout (no build isolation: the venv's setuptools),
    installed with --no-deps into an empty folder, every module imported from a third folder."""
    pytest.importorskip("setuptools", minversion="70.1",
                        reason="building the wheel offline needs setuptools >= 70.1 (test extra)")
    modules = _top_level_modules()
    src, wheels, site, elsewhere = (tmp_path / n for n in ("src", "wheels", "site", "elsewhere"))
    # A copy, so the build's build/ and *.egg-info folders never land in the checkout.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "tests", "docs", "__pycache__", "*.egg-info", "build", "dist", ".venv", "venv",
        ".hypothesis", ".pytest_cache", "runs", ".cache"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    r = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index",
                              "-w", str(wheels), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = glob.glob(str(wheels / "*.whl"))
    shipped = sorted(n[:-3] for n in zipfile.ZipFile(wheel).namelist()
                     if n.endswith(".py") and "/" not in n)
    assert shipped == modules, f"wheel lacks {sorted(set(modules) - set(shipped))}"
    # The packages' modules (toy/, backends/ and its sub-packages) ship too, and import as
    # toy.world, backends.run.build, ...
    in_packages = sorted(f"{d}.{os.path.basename(f)[:-3]}" for d in _packages()
                         for f in glob.glob(os.path.join(ROOT, *d.split("."), "*.py"))
                         if not f.endswith("__init__.py"))
    shipped_pk = sorted(n[:-3].replace("/", ".") for n in zipfile.ZipFile(wheel).namelist()
                        if n.endswith(".py") and "/" in n and not n.endswith("__init__.py")
                        and ".dist-info" not in n)
    assert shipped_pk == in_packages, f"wheel lacks {sorted(set(in_packages) - set(shipped_pk))}"
    # ... and the shipped SFT warm start, which a default toy run loads
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"toy/warm_start/model.safetensors", "toy/warm_start/warm_start.json",
            "toy/warm_start/tokenizer.json"} <= names
    modules = modules + in_packages

    r = subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), wheel],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    elsewhere.mkdir()
    # Each module must come from the installed folder: an editable install of the project (a
    # finder that maps names to the checkout) must not hide a module missing from the wheel.
    code = ("import importlib, os, sys\n"
            "site = os.path.realpath(sys.argv[1])\n"
            "for name in sys.argv[2:]:\n"
            "    m = importlib.import_module(name)\n"
            "    where = os.path.realpath(m.__file__)\n"
            "    assert where.startswith(site + os.sep), f'{name} imported from {where}, not {site}'\n"
            "print('imported', len(sys.argv) - 2)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", code, str(site)] + modules, cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip() == f"imported {len(modules)}"
