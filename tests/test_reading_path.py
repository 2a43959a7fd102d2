"""The reading path of one RL step (scripts/reading_path.py): a line trace of one step of the default
toy run at the fast settings counts the distinct project lines executed outside toy/ and backends/;
the cap is 700 lines in 7 files, and docs/reading_path.md is the same trace written out."""
import os
import re
import subprocess
import sys

import pytest
from runfix import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cap_fails_above_700_lines_or_7_files():
    rp = load_script("reading_path")
    assert (rp.MAX_LINES, rp.MAX_FILES) == (700, 7)
    assert rp.over_cap(700, 7) == []
    assert rp.over_cap(701, 7) and rp.over_cap(700, 8)


def test_counted_files_leave_out_toy_and_backends():
    rp = load_script("reading_path")
    assert rp.counted(os.path.join(ROOT, "train.py")) == "train.py"
    assert rp.counted(os.path.join(ROOT, "toy", "world.py")) is None
    assert rp.counted(os.path.join(ROOT, "backends", "run", "report.py")) is None
    assert rp.counted("/usr/lib/python3/random.py") is None


# The doc is a trace made on the machine that wrote it, and which lines run depends on the tokens
# sampled: a stored figure (CI reruns it under a second kernel set, docs/metrics.md).
@pytest.mark.stored_figures
def test_one_toy_step_is_within_the_cap_and_the_doc_is_its_trace():
    """`python scripts/reading_path.py --check`: last line READING_PATH lines=N files=M, exit 0 (the
    doc equals the trace, N <= 900, M <= 7)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "reading_path.py"), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = r.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"READING_PATH lines=(\d+) files=(\d+)", last)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert int(m.group(1)) <= 900 and int(m.group(2)) <= 7, last
    assert r.returncode == 0, r.stdout[-2000:]


# The root holds the paper layer and its entry points only (at most 10 .py files); plumbing lives in
# backends/, toy-only code in toy/, other commands in scripts/.
PAPER_ROOT = {"scaffold", "judge", "ss_grpo", "reflection", "bank", "train", "evaluate", "policy", "sft",
              "hparams"}


def test_the_root_holds_at_most_ten_paper_modules():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mods = {f[:-3] for f in os.listdir(root) if f.endswith(".py")}
    assert len(mods) <= 10 and mods <= PAPER_ROOT, sorted(mods - PAPER_ROOT)
