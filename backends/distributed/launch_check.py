"""Launch-time checks of the full-mode dry run that depend on where a rank runs: which rank needs the
API keys and whether the launcher forwards them, what DeepSpeedCPUAdam needs to build, /dev/shm.

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing only. Who talks to which API: global rank 0 alone judges and reflects (train.py;
backends/distributed/engine.py ZeRO3Engine), so the judge key ($GEMINI_API_KEY, or judge_http.api_key_env) is read on
global rank 0 only. Every rank that samples also searches, so the search key ($SERPER_API_KEY) is
read on rank 0 and, when every ZeRO-3 rank samples its share of the rollouts (full.rollout_ranks
"all", backends/run/build.every_rank_samples), on every rank (full._rank_search_key_problems checks it
there); the ranks > 0 call no other API.

The multi-node trap: `deepspeed --hostfile H` starts the ranks of other nodes over ssh (pdsh) and
forwards only variables whose names start with MLFLOW, PYTHON, MV2, UCX or NCCL, plus every KEY=VALUE
line of `.deepspeed_env` (DS_ENV_FILE) in the home directory or the launch directory. Global rank 0 runs
on the hostfile's first node, which need not be the node the launcher is started on. A dry run under
plain `python` sees the launching shell, not rank 0's environment: run it under the launcher
(`deepspeed --hostfile H train.py --full --dry-run ...`) to check the keys where they are read.

Nothing here imports torch, DeepSpeed or vLLM.
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil

FORWARDED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")  # deepspeed's runner (CUDA accelerator)


def nodes(environ) -> int:
    """Number of nodes of this launch: CROSS_SIZE (deepspeed), GROUP_WORLD_SIZE (torchrun), else
    WORLD_SIZE / LOCAL_SIZE or LOCAL_WORLD_SIZE; 1 when not launched."""
    for name in ("CROSS_SIZE", "GROUP_WORLD_SIZE"):
        v = environ.get(name)
        if v and v.isdigit() and int(v) > 0:
            return int(v)
    ws = environ.get("WORLD_SIZE")
    local = environ.get("LOCAL_SIZE") or environ.get("LOCAL_WORLD_SIZE")
    if ws and local and ws.isdigit() and local.isdigit() and int(local) > 0:
        return math.ceil(int(ws) / int(local))
    return 1


def ranks_per_node(environ) -> int:
    """LOCAL_SIZE (deepspeed) or LOCAL_WORLD_SIZE (torchrun); 0 when unknown."""
    v = environ.get("LOCAL_SIZE") or environ.get("LOCAL_WORLD_SIZE") or ""
    return int(v) if v.isdigit() else 0


def deepspeed_env_files(environ, home: str | None = None, cwd: str | None = None) -> list[str]:
    """The .deepspeed_env files (name from DS_ENV_FILE) the deepspeed launcher would read: home, then
    the launch directory; only those that exist."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    out = []
    for d in (home or os.path.expanduser("~"), cwd or os.getcwd()):
        p = os.path.join(d, name)
        if os.path.isfile(p) and p not in out:
            out.append(p)
    return out


def _names_in(path: str) -> set[str]:
    try:
        with open(path) as fh:
            return {ln.split("=", 1)[0].strip() for ln in fh if "=" in ln}
    except OSError:
        return set()


def key_lines(keys: list[tuple[str, str]], environ, rank: int, launched: bool,
              home: str | None = None, cwd: str | None = None) -> tuple[list[str], list[str]]:
    """The dry run's "API keys" section. keys: (purpose, variable NAME) pairs (full._key_envs). Values
    are never printed. On a launched rank > 0 no judge key is needed (its search key, when it
    samples, is full._rank_search_key_problems' check). Problems: a key missing on the rank
    that reads it; a multi-node launch whose .deepspeed_env does not list a key (the launcher then
    leaves it out on rank 0's node unless that is the launching node); an unlaunched dry run only
    notes the file."""
    n_nodes = nodes(environ) if launched else 1
    files = deepspeed_env_files(environ, home, cwd)
    listed = set().union(*(_names_in(f) for f in files)) if files else set()
    lines = ["API keys (the judge key on global rank 0 only: it judges and reflects; the search key "
             "on every rank that samples: rank 0, and all ranks when build.every_rank_samples)"]
    problems = []
    if launched and rank != 0:
        lines.append(f"  this is global rank {rank}: it needs no judge key (a sampling rank's search key "
                     "is checked below)")
        return lines, problems
    where = f"global rank 0 under the launcher ({n_nodes} node(s))" if launched else \
        "this shell (not under a launcher; run the dry run under deepspeed/torchrun to check rank 0)"
    lines.append(f"  checked in {where}")
    for purpose, name in keys:
        ok = bool(environ.get(name))
        fwd = name in listed or name.startswith(FORWARDED_PREFIXES)
        lines.append(f"  {purpose}: ${name} {'set' if ok else 'NOT SET'}"
                     + (f"; listed in .deepspeed_env" if name in listed else ""))
        if not ok:
            problems.append(f"environment variable {name} is not set ({purpose})")
        elif launched and n_nodes > 1 and not fwd:
            problems.append(f"{name} is set on rank 0 but not listed in .deepspeed_env: a multi-node "
                            "`deepspeed --hostfile` launch forwards it only from there (add "
                            f"{name}=... to ~/.deepspeed_env on the launching node)")
    lines.append("  .deepspeed_env: " + (", ".join(files) if files else
                                          "none (needed for a multi-node deepspeed launch: it forwards "
                                          "only MLFLOW*, PYTHON*, MV2*, UCX*, NCCL* variables)"))
    return lines, problems


def cpu_adam_lines(uses_cpu_adam: bool, n_gpu: int, environ) -> tuple[list[str], list[str]]:
    """What DeepSpeedCPUAdam (DeepSpeed's AdamW with the optimizer offloaded) needs on every rank: a
    prebuilt op in the deepspeed package, or a JIT build with a C++ compiler, ninja and, on GPU
    nodes, the CUDA toolkit (CUDA_HOME or nvcc on PATH; it links curand). Problems only on a machine
    with GPUs (a CPU machine is not the node being planned)."""
    if not uses_cpu_adam:
        return ["DeepSpeedCPUAdam: not used (torch AdamW, or the optimizer is not offloaded)"], []
    spec = importlib.util.find_spec("deepspeed")
    prebuilt = False
    if spec is not None and spec.submodule_search_locations:
        root = list(spec.submodule_search_locations)[0]
        for d, _, fs in os.walk(os.path.join(root, "ops")):
            prebuilt |= any(f.startswith("cpu_adam") and f.endswith(".so") for f in fs)
    cxx = shutil.which(environ.get("CXX", "c++")) or shutil.which("g++")
    ninja = shutil.which("ninja") or importlib.util.find_spec("ninja") is not None
    cuda_home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    lines = ["DeepSpeedCPUAdam (the offloaded optimizer; built on every rank at first use)",
             f"  prebuilt op: {'yes' if prebuilt else 'no (JIT build, ~1-5 min, cached in $TORCH_EXTENSIONS_DIR)'}",
             f"  C++ compiler {cxx or 'NOT FOUND'}, ninja {'found' if ninja else 'NOT FOUND'}, "
             f"CUDA_HOME {cuda_home or 'not set'}, nvcc {nvcc or 'not on PATH'}"]
    problems = []
    if n_gpu and not prebuilt:
        missing = [x for x, ok in (("a C++ compiler", cxx), ("ninja", ninja),
                                   ("the CUDA toolkit (CUDA_HOME or nvcc)", cuda_home or nvcc)) if not ok]
        if missing:
            problems.append("DeepSpeedCPUAdam cannot be built here: missing " + ", ".join(missing)
                            + " (or set --set full.optimizer=\"torch\")")
    return lines, problems


def shm_lines(n_gpu: int, path: str = "/dev/shm") -> tuple[list[str], list[str]]:
    """/dev/shm: the weight sync no longer writes there (it moves in memory), but NCCL's intra-node
    transport and vLLM's engine queues use it; under 1 GiB (Docker's default is 64 MiB) is a problem
    on a GPU node (`docker run --shm-size=16g`)."""
    try:
        st = os.statvfs(path)
        size = st.f_frsize * st.f_blocks
    except OSError:
        return [f"{path}: not present"], []
    lines = [f"{path}: {size / 2 ** 30:.1f} GiB (the weight sync writes nothing there; NCCL and vLLM "
             "use a little)"]
    problems = []
    if n_gpu and size < 2 ** 30:
        problems.append(f"{path} is {size / 2 ** 20:.0f} MiB: NCCL and vLLM need more (docker run "
                        "--shm-size=16g)")
    return lines, problems
