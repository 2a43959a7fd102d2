"""GPU smoke worker (scripts/gpu_smoke.sh, check "threads"): every thread full mode starts selects its
rank's GPU. Run under a launcher on a node with >= 2 GPUs:

    torchrun --standalone --nproc_per_node 2 tests/thread_device_check.py OUT_DIR

On each rank, after dist.init_distributed (which selects GPU LOCAL_RANK on the main thread):
  - a plain threading.Thread reports its current device: 0 on every rank, whatever LOCAL_RANK (what
    CUDA does, and why the helper exists);
  - a thread of backends/scale/cuda_threads.start_thread, and one of a pool with
    initializer=cuda_threads.enter, report theirs: LOCAL_RANK, on the stream the main thread shared;
  - a tensor made on the helper thread lands on GPU LOCAL_RANK.
OUT_DIR/rank<R>.json holds {"rank", "local_rank", "plain", "helper", "pool", "tensor", "same_stream"}.
Exits 1 without CUDA (the CPU tests cover the same with a faked torch.cuda: tests/test_thread_devices.py).
"""
import concurrent.futures as cf
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.distributed import dist  # noqa: E402
from backends.scale import cuda_threads  # noqa: E402


def where() -> dict:
    """The calling thread's current CUDA device and stream handle."""
    return {"device": torch.cuda.current_device(), "stream": torch.cuda.current_stream().cuda_stream}


def main(out_dir: str) -> int:
    if not torch.cuda.is_available():
        print("no CUDA: nothing to check (tests/test_thread_devices.py covers it on CPU)")
        return 1
    env = dist.init_distributed(timeout_min=2)
    main_stream = torch.cuda.Stream()  # a stream of the trainer's, as after a vLLM build
    torch.cuda.set_stream(main_stream)
    cuda_threads.share_current_stream()
    seen: dict = {}

    def plain():
        seen["plain"] = where()

    th = threading.Thread(target=plain, name="plain")
    th.start()
    th.join()

    def helper():
        seen["helper"] = where()
        seen["tensor"] = str(torch.ones(1, device="cuda").device)

    cuda_threads.start_thread(helper, name="helper").join()
    with cf.ThreadPoolExecutor(1, initializer=cuda_threads.enter) as pool:
        seen["pool"] = pool.submit(where).result()
    res = {"rank": env.rank, "local_rank": env.local_rank, **seen,
           "same_stream": seen["helper"]["stream"] == seen["pool"]["stream"] == main_stream.cuda_stream}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as fh:
        json.dump(res, fh)
    print(json.dumps(res), flush=True)
    dist._shutdown()
    dist.exit_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
