"""Every thread of full mode that can touch CUDA starts on the rank's GPU and on the engine's stream
(backends/scale/cuda_threads.py).

CUDA's current device and stream belong to the host thread: `init_distributed` selects LOCAL_RANK on
the main thread only, and a thread started later begins on device 0. The in-process vLLM engine runs
in the thread that calls it (the engine loop, the weight-sync rpc threads), so on ranks 1.. it would
launch its Triton kernels on GPU 0 ("Pointer argument cannot be accessed from Triton"). Two checks:
  (a) the source: every Thread / ThreadPoolExecutor / Timer in backends/scale/ and
      backends/distributed/ starts through the helper, or is on an allow-list that says why it
      never touches CUDA;
  (b) on CPU, with torch.cuda's per-thread device and stream faked: the engine-loop thread (each
      time it is re-created) and the sync rpc threads select device 3 and the stream the engine was
      built on before their first engine call, and the rpc's copies are ordered with the caller's
      stream by events.
"""
import ast
import os
import threading
from types import SimpleNamespace

import pytest
import torch

import toyfix as tf
from backends.scale import cuda_threads
from backends.scale.vllm_sampler import VLLMSampler
from test_vllm_sampler import FakeLLM, FakeParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("backends/scale", "backends/distributed")
HELPER = "backends/scale/cuda_threads.py"
THREAD_CALLS = ("Thread", "ThreadPoolExecutor", "Timer")

# (file, thread name or name prefix) -> why the thread never touches CUDA
ALLOWED = {
    ("backends/scale/rollout_engine.py", "tool"):
        "tool calls only: HTTP search (Serper) or the toy world's BM25; a rollout's next segment is "
        "submitted to the sampler's own thread (engine loop or SerialRequests)",
    ("backends/scale/rollout_engine.py", "judge"):
        "StreamingJudge: the stage judge over HTTP (or the toy judge on CPU)",
    ("backends/scale/rollout_engine.py", "judge-map"):
        "the reflection branch's privileged judge calls over HTTP",
    ("backends/scale/rollout_engine.py", "reflect-judge"):
        "the reflection branch's privileged judge calls over HTTP (or the toy judge on CPU)",
}


# ----------------------------------------------------------------------------------------------------
# (a) the source


def _thread_name(call: ast.Call) -> str | None:
    """The literal name of a thread (name=...) or pool (thread_name_prefix=...): a string, or an
    f-string's leading text ("vllm-" of f"vllm-{method}")."""
    for kw in call.keywords:
        if kw.arg in ("name", "thread_name_prefix"):
            v = kw.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                return v.value
            if isinstance(v, ast.JoinedStr) and v.values and isinstance(v.values[0], ast.Constant):
                return v.values[0].value
    return None


def _uses_helper(call: ast.Call) -> bool:
    """A pool whose threads run cuda_threads.enter first (initializer=enter)."""
    for kw in call.keywords:
        if kw.arg == "initializer":
            v = kw.value
            name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            return name == "enter"
    return False


def thread_starts(root: str = ROOT) -> list[tuple[str, int, str | None, bool]]:
    """(file, line, thread name, starts through the helper) of every Thread / ThreadPoolExecutor /
    Timer call in the scanned packages, the helper module itself left out."""
    out = []
    for pkg in SCANNED:
        for folder, _, files in os.walk(os.path.join(root, pkg)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/")
                if rel == HELPER:
                    continue
                tree = ast.parse(open(os.path.join(folder, f)).read())
                for node in ast.walk(tree):
                    if not isinstance(node, ast.Call):
                        continue
                    fn = node.func
                    called = (fn.id if isinstance(fn, ast.Name)
                              else fn.attr if isinstance(fn, ast.Attribute) else None)
                    if called in THREAD_CALLS:
                        out.append((rel, node.lineno, _thread_name(node), _uses_helper(node)))
    return out


def test_every_thread_that_can_touch_cuda_starts_through_the_helper():
    starts = thread_starts()
    assert len(starts) >= len(ALLOWED)  # the walk sees the packages' pools
    bad = [f"{rel}:{line} ({name!r})" for rel, line, name, helper in starts
           if not helper and (rel, name) not in ALLOWED]
    assert not bad, ("threads started without backends/scale/cuda_threads.py (start_thread, or a "
                     "pool with initializer=enter), and not on the allow-list: " + ", ".join(bad))
    seen = {(rel, name) for rel, _, name, _ in starts}
    stale = sorted(k for k in ALLOWED if k not in seen)
    assert not stale, f"allow-list entries that match no thread any more: {stale}"


def test_the_engine_threads_use_the_helper_by_name():
    """The threads that run vLLM, and rank 0's receivers, are started by name with start_thread."""
    names = set()
    for pkg in SCANNED:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    for node in ast.walk(ast.parse(open(os.path.join(folder, f)).read())):
                        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "start_thread":
                            names.add(_thread_name(node))
    assert {"engine-loop", "vllm-", "rollouts-from-", "reflection"} <= names, names


def test_the_scan_catches_a_planted_plain_thread(tmp_path):
    pkg = tmp_path / "backends" / "scale"
    pkg.mkdir(parents=True)
    (tmp_path / "backends" / "distributed").mkdir()
    (pkg / "x.py").write_text(
        "import threading, concurrent.futures as cf\n"
        "from backends.scale.cuda_threads import enter, start_thread\n"
        "threading.Thread(target=print, name='engine-loop').start()\n"
        "start_thread(print, name='fine')\n"
        "cf.ThreadPoolExecutor(1, thread_name_prefix='requests', initializer=enter)\n"
        "cf.ThreadPoolExecutor(1, thread_name_prefix='other')\n")
    found = {(name, helper) for _, _, name, helper in thread_starts(str(tmp_path))}
    # start_thread is the helper itself (not a Thread call); the plain thread and pool are caught
    assert found == {("engine-loop", False), ("requests", True), ("other", False)}


# ----------------------------------------------------------------------------------------------------
# (b) the threads at run time, with CUDA faked


class FakeStream:
    """A CUDA stream stand-in: wait_event records (stream, event) into the fake's log."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, ev):
        self.log.append(("wait", self.name, ev.name, threading.current_thread().name))

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeCuda:
    """torch.cuda's per-thread state, faked: a thread's current device starts at 0 and its current
    stream at that device's default stream, as on a real GPU; set_device / set_stream change only
    the calling thread's."""

    def __init__(self):
        self.tls = threading.local()
        self.log: list = []
        self.n_events = 0
        cuda = self

        class Event:
            def __init__(self):
                cuda.n_events += 1
                self.name = f"ev{cuda.n_events}"

            def record(self, stream):
                cuda.log.append(("record", stream.name, self.name, threading.current_thread().name))

        self.Event = Event

    def set_device(self, d):
        self.tls.device = int(d)

    def current_device(self):
        return getattr(self.tls, "device", 0)

    def current_stream(self, device=None):
        s = getattr(self.tls, "stream", None)
        return s if s is not None else FakeStream(f"default:{self.current_device()}", self.log)

    def set_stream(self, s):
        self.tls.stream = s

    def where(self):
        """(device, stream name) of the calling thread."""
        return self.current_device(), self.current_stream().name


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda with a GPU, per-thread devices and streams (FakeCuda), and cuda_threads' process
    state cleared before and after."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("set_device", "current_device", "current_stream", "set_stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(cuda_threads, "_device", None)
    monkeypatch.setattr(cuda_threads, "_stream", None)
    return cuda


class WatchedLLM(FakeLLM):
    """FakeLLM whose engine calls (add_request, step, collective_rpc) record (call, the calling
    thread, its device, its stream's name) in `seen`."""

    def __init__(self, cuda, *a, **kw):
        super().__init__(*a, **kw)
        self.cuda, self.seen = cuda, []
        eng = self.llm_engine
        add, step = eng.add_request, eng.step

        def watched(fn, what):
            def call(*args, **kwargs):
                self.seen.append((what, threading.current_thread(), *self.cuda.where()))
                return fn(*args, **kwargs)
            return call

        eng.add_request, eng.step = watched(add, "add_request"), watched(step, "step")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.seen.append(("rpc", threading.current_thread(), *self.cuda.where()))
        self.cuda.log.append(("rpc", method, threading.current_thread().name))
        return super().collective_rpc(method, timeout, args, kwargs)


def _rank3_sampler(cuda):
    """As on LOCAL_RANK 3: init_distributed's device, the trainer's stream on the main thread, then
    the engine built (here: given) on the main thread."""
    tok = tf.tiny_tokenizer()
    cuda_threads.select_device(3)
    torch.cuda.set_stream(FakeStream("trainer", cuda.log))
    llm = WatchedLLM(cuda, tok, lambda p: [5, 6, 7, tok.eos_token_id])
    s = VLLMSampler("/nonexistent", tok, llm=llm, sampling_params_cls=FakeParams, dtype="float32")
    return s, llm, tok


def test_a_plain_thread_starts_on_device_0_with_the_fake(fake_cuda):
    """The fake behaves as CUDA does: what the main thread selected does not reach a new thread."""
    cuda_threads.select_device(3)
    seen = []
    th = threading.Thread(target=lambda: seen.append(fake_cuda.where()))
    th.start()
    th.join()
    assert fake_cuda.where()[0] == 3 and seen == [(0, "default:0")]


def test_engine_loop_and_rpc_threads_select_the_rank_device_first(fake_cuda):
    s, llm, tok = _rank3_sampler(fake_cuda)
    assert cuda_threads.recorded()[0] == 3
    for _ in range(2):  # the loop thread ends when idle: the second generate starts a new one
        assert s.generate([[1, 2], [3, 4]], [8, 8], 1.0) == [[5, 6, 7, tok.eos_token_id]] * 2
        s._stop_loop()  # waits until the loop thread has ended
        s._reopen_loop()
    loops = [x for x in llm.seen if x[0] in ("add_request", "step")]
    threads = {x[1] for x in loops}  # 1 or 2 per generate (the loop may go idle between submits)
    assert len(threads) >= 2 and {t.name for t in threads} == {"engine-loop"}
    # every engine call of every loop thread, the first included, on rank 3's GPU and stream
    assert {(d, st) for _, _, d, st in loops} == {(3, "trainer")}, loops
    s.sync_weights([("w", torch.zeros(2))], copy=False)
    rpcs = [x for x in llm.seen if x[0] == "rpc"]
    assert [x[1].name for x in rpcs] == ["vllm-rubricem_sync_begin", "vllm-rubricem_sync_load",
                                         "vllm-rubricem_sync_finish"]
    assert {(d, st) for _, _, d, st in rpcs} == {(3, "trainer")}, rpcs


def test_the_sync_rpc_is_ordered_with_the_callers_stream_by_events(fake_cuda):
    """Each rpc thread waits for an event the caller recorded before it (the chunk's gathers and
    casts), and the caller waits for the event the rpc thread recorded after its copies."""
    s, llm, _ = _rank3_sampler(fake_cuda)
    fake_cuda.log.clear()
    s.sync_weights([("w", torch.zeros(2))], copy=False)
    log = fake_cuda.log
    for method in ("rubricem_sync_begin", "rubricem_sync_load", "rubricem_sync_finish"):
        rpc = log.index(("rpc", method, f"vllm-{method}"))
        before, after = log[:rpc], log[rpc + 1:]
        ready = [e for e in before if e[0] == "record" and e[3] == "MainThread"][-1]
        assert ("wait", "trainer", ready[2], f"vllm-{method}") in before
        done = next(e for e in after if e[0] == "record" and e[3] == f"vllm-{method}")
        assert done[1] == "trainer"
        assert ("wait", "trainer", done[2], "MainThread") in after


def test_start_thread_and_pool_initializer_select_device_and_stream(fake_cuda):
    import concurrent.futures as cf

    cuda_threads.select_device(5)
    torch.cuda.set_stream(FakeStream("engine", fake_cuda.log))
    cuda_threads.share_current_stream()
    seen = []
    th = cuda_threads.start_thread(lambda x: seen.append((x, fake_cuda.where())), args=("t",), name="t")
    th.join()
    with cf.ThreadPoolExecutor(1, initializer=cuda_threads.enter) as pool:
        seen.append(("pool", pool.submit(fake_cuda.where).result()))
    assert seen == [("t", (5, "engine")), ("pool", (5, "engine"))]


def test_without_cuda_the_helper_changes_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run, even on a GPU host
    monkeypatch.setattr(cuda_threads, "_device", None)
    monkeypatch.setattr(cuda_threads, "_stream", None)
    called = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: called.append(d))
    cuda_threads.select_device(2)  # records the index only
    cuda_threads.share_current_stream()
    assert cuda_threads.recorded() == (2, None) and called == []
    assert cuda_threads.record_event() is None
    cuda_threads.wait_event(None)
    box = SimpleNamespace(v=None)
    cuda_threads.start_thread(lambda: setattr(box, "v", 1), name="cpu").join()
    assert box.v == 1 and called == []
    with pytest.raises(ValueError):
        cuda_threads.select_device(-1)


def test_a_loop_thread_that_cannot_select_its_device_fails_its_requests(fake_cuda, monkeypatch):
    """If a started thread's device selection raises (a GPU that vanished), its target never runs on
    another device, and the engine loop's queued requests fail with that error instead of waiting
    forever; the next submit starts a new loop thread."""
    s, llm, tok = _rank3_sampler(fake_cuda)

    def broken(d):
        if threading.current_thread().name == "engine-loop":
            raise RuntimeError("CUDA error: no device")
        fake_cuda.tls.device = int(d)

    monkeypatch.setattr(torch.cuda, "set_device", broken)
    f = s.submit([1, 2], 8, 1.0)
    with pytest.raises(RuntimeError, match="no device"):
        f.result(timeout=10)
    assert not [x for x in llm.seen if x[0] in ("add_request", "step")]  # nothing ran elsewhere
    monkeypatch.setattr(torch.cuda, "set_device", fake_cuda.set_device)
    assert s.submit([1, 2], 8, 1.0).result(timeout=10) == [5, 6, 7, tok.eos_token_id]
