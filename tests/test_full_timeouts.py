"""Process-group timeouts (backends/distributed/dist.py): a group made without its own timeout waits
the run's full.dist_timeout_min, not torch's constant default (30 min for gloo). The 2-rank run of
tests/test_full_mode.py records every group of a real run (test_every_process_group_of_the_run_...)."""
import subprocess
import sys

import pytest

from test_full_mode import HAVE_DS, ROOT, _env

pytestmark = pytest.mark.skipif(not HAVE_DS, reason="deepspeed and accelerate are not installed")

SCRIPT = """
import datetime, torch
from backends.distributed import dist
dist.init_distributed(timeout_min=13)
late = torch.distributed.new_group(backend="gloo")  # as DeepSpeed and vLLM make theirs: no timeout
groups = dist.group_timeouts()
print(sorted({g["timeout_s"] for g in groups}), len(groups))
try:
    dist.set_group_timeout(0)
except ValueError as e:
    print("refused:", e)
"""


def test_a_group_made_without_a_timeout_waits_the_runs_timeout():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    timeouts, n = lines[-2].rsplit(" ", 1)
    assert timeouts == "[780.0]" and int(n) >= 2  # the default group, DeepSpeed's, the late one: 13 min
    assert lines[-1].startswith("refused: a process-group timeout must be > 0 minutes")
