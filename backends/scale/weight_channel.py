"""A two-party tensor channel from the trainer to an out-of-process rollout engine, in memory.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing for Algorithm 1's "sample with the current policy" (§3.1, §3.3): after every update each
sampling rank streams the gathered pi_theta into its own vLLM engine's worker process (rank 0 alone
with full.rollout_ranks "rank0"). Nothing of the method lives here.

A standalone torch.distributed process group of two members (a trainer rank = member 0, its
engine's worker = member 1), built from its own TCPStore, so it never touches the trainer's default
group (which every trainer rank joins) nor the engine's own groups: NCCL on GPU (GPU-to-GPU,
NVLink / PCIe), gloo on CPU. Each tensor is one broadcast from member 0; the receiver allocates it from
(shape, dtype) sent ahead through the engine's RPC. No file is written, so neither /dev/shm's size nor
disk speed matters.

    store = WeightChannel.listen(host, timeout_s)                member 0, first: the channel's TCPStore
                                                                 on a port the OS picks (store.port)
    WeightChannel.open(host, port, member, backend, timeout_s,   both sides, concurrently (it blocks
                       store=store)                              until the other member joins)
    channel.send(tensor) / channel.recv(shape, dtype, device)    one tensor, in the same order
    channel.close()

The module imports only torch (the vLLM worker imports it by name through backends/scale/vllm_sync_ext.py).
"""
from __future__ import annotations

import datetime
import socket

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" | "bfloat16" | "float16" for a torch dtype. Raises ValueError for anything else."""
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"weights must be float32, bfloat16 or float16, got {dtype}")


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on `host` (another process may take it before we bind it: the sampler
    uses `WeightChannel.listen` instead, which keeps the port bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightChannel:
    """Member 0 sends, member 1 receives; see the module docstring. `device`: where tensors travel
    (cuda:N for NCCL, cpu for gloo)."""

    def __init__(self, pg, store, member: int, device: torch.device, backend: str):
        self.pg, self.store, self.member, self.device, self.backend = pg, store, member, device, backend
        self.bytes = 0

    @staticmethod
    def listen(host: str = "127.0.0.1", timeout_s: float = 600.0):
        """Member 0's TCPStore, bound now to a port the OS picks (`store.port`, an int) and held until
        the channel closes, so channels opened at the same time (one per training rank and engine on
        a node) never race for a port. Pass it to `open(..., store=store)`; the engine joins at
        host:store.port. Raises RuntimeError (torch) when nothing can be bound on host."""
        timeout = datetime.timedelta(seconds=float(timeout_s))
        # SCALE: port 0 = the OS's choice; no wait for the other member here (open() waits)
        return torch.distributed.TCPStore(host, 0, 2, True, timeout=timeout, wait_for_workers=False)

    @classmethod
    def open(cls, host: str, port: int, member: int, backend: str = "gloo", timeout_s: float = 600.0,
             device: str | torch.device | None = None, store=None) -> "WeightChannel":
        """Join the two-member group (member 0 hosts the TCPStore on host:port, or passes the one
        `listen` bound as `store`). Blocks until both members have joined or timeout_s passes (then
        RuntimeError from torch). backend "gloo" (CPU tensors) or "nccl" (CUDA tensors on `device`,
        default the current CUDA device)."""
        if member not in (0, 1):
            raise ValueError(f"member must be 0 (trainer) or 1 (engine), got {member}")
        if store is not None and member != 0:
            raise ValueError("only member 0 hosts the store")
        timeout = datetime.timedelta(seconds=float(timeout_s))
        if store is None:
            store = torch.distributed.TCPStore(host, int(port), 2, member == 0, timeout=timeout)
        prefixed = torch.distributed.PrefixStore("rubricem-weights", store)
        if backend == "gloo":
            pg = torch.distributed.ProcessGroupGloo(prefixed, member, 2, timeout)
            dev = torch.device("cpu")
        elif backend == "nccl":  # SCALE: GPU to GPU; untested on CPU machines
            dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            opts = torch.distributed.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = torch.distributed.ProcessGroupNCCL(prefixed, member, 2, opts)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        ch = cls(pg, store, member, dev, backend)
        ch.barrier()  # both members are in: the first broadcast cannot race the group's set-up
        return ch

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.pg.broadcast(t, 0).wait()

    def send(self, tensor: torch.Tensor) -> None:
        """Member 0: broadcast one tensor (contiguous; moved to the channel's device)."""
        t = tensor.detach().to(self.device).contiguous()
        self.pg.broadcast(t, 0).wait()
        self.bytes += t.numel() * t.element_size()

    def recv(self, shape, dtype: str | torch.dtype) -> torch.Tensor:
        """Member 1: receive the next tensor, of this shape and dtype, on the channel's device."""
        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        t = torch.empty(tuple(int(s) for s in shape), dtype=dt, device=self.device)
        self.pg.broadcast(t, 0).wait()
        self.bytes += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:  # already gone on the other side
                pass
