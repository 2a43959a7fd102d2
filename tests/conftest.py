"""Shared pytest set-up: a deterministic, bounded hypothesis profile for CI and local runs, and a
check that no test leaves a thread (or a torch.distributed process group) behind."""
import os
import sys
import threading
import time
import traceback

import pytest
from hypothesis import HealthCheck, settings

# The project is a flat set of top-level modules; make them importable from tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# "ci": deterministic (derandomize) and bounded, so the suite is reproducible and quick on 2 cores.
settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory):
    """One warm-start cache directory for every end-to-end toy run of one pytest run (tests/runfix.py):
    the first run trains the tiny SFT policy, the others load it."""
    return tmp_path_factory.mktemp("toy-cache")


# ----------------------------------------------------------------------------------------------------
# No thread outlives its test, and none is left when the run ends.
#
# A daemon thread still running at interpreter exit is stopped mid-call: when it was inside native
# code that had released the GIL (a torch op, a weight copy), libstdc++ aborts the interpreter
# ("terminate called without an active exception", exit code 134) after every test has passed.
# Threads the libraries keep for the whole process (tqdm's monitor, which only refreshes bars) are
# allowed; any other thread a test starts must have ended (been joined) by the end of the test.

PROCESS_THREADS = ("tqdm_monitor",)
THREAD_GRACE_S = 0.25  # for a thread whose target has just returned to finish
_started_by: dict = {}  # thread -> node id of the test that left it running


def _stack(thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    return "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "  (no frame)\n"


def _foreign_threads(exclude=()) -> list:
    return [t for t in threading.enumerate() if t is not threading.main_thread()
            and t not in exclude and t.name not in PROCESS_THREADS and t.is_alive()]


@pytest.fixture(autouse=True)
def _no_thread_left_running(request):
    """Fails a test (at teardown) that leaves a thread running after it ended."""
    before = set(threading.enumerate())
    yield
    new = _foreign_threads(exclude=before)
    deadline = time.monotonic() + THREAD_GRACE_S
    for t in new:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in new if t.is_alive()]
    for t in alive:
        _started_by[t] = request.node.nodeid
    if alive:
        pytest.fail("the test left threads running (end or join them in the test): "
                    + "; ".join(f"{t.name} (daemon={t.daemon}) at\n{_stack(t)}" for t in alive),
                    pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """The run fails when, as pytest returns, a thread other than the main one and the libraries'
    own is alive, or a torch.distributed process group is still initialised (its native threads
    outlive the interpreter)."""
    problems = [f"thread {t.name!r} (daemon={t.daemon}, left by {_started_by.get(t, 'an unknown test')})"
                f" still running at\n{_stack(t)}" for t in _foreign_threads()]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        problems.append("a torch.distributed process group is still initialised "
                        "(call torch.distributed.destroy_process_group())")
    if problems:
        sys.stderr.write("\nconftest: the interpreter would exit with\n  " + "\n  ".join(problems) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
