"""The dry run's site checks: settings of a GPU node that stop a full-mode run before step 0 (or at
its first checkpoint), each read from the machine and judged by a pure function that tests feed
with faked inputs (tests/test_site_check.py).

RubricEM: Meta-RL with Rubric-guided Policy Decomposition beyond Verifiable Rewards (arXiv 2605.10899).
Plumbing only (SCALE). What is checked, and why it matters for the engine path full mode uses (one
vLLM engine inside each trainer process, on the rank's GPU: docs/full_mode.md, "One engine path"):
    compute_mode_lines      the GPUs' compute mode (nvidia-smi): "Prohibited" refuses every CUDA
                            context; "Exclusive_Process" admits one process per GPU, which the
                            in-process engine satisfies (an engine in its own process would not)
    alloc_conf_lines        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with vLLM's sleep mode:
                            vLLM releases before the pinned 0.32 asserted against it in its
                            sleep-mode allocator; 0.32 turns it off around its own pool
    visible_gpu_lines       GPUs visible to this process against LOCAL_RANK: the trainer and its
                            engine both use GPU number LOCAL_RANK, so a launcher that shows each
                            process only its own GPU (SLURM --gpus-per-task=1) breaks both
    build_lock_lines        a stale torch-extension build lock (an interrupted DeepSpeedCPUAdam
                            JIT build leaves `lock` behind; every later start waits on it forever)
    arch_list_lines         TORCH_CUDA_ARCH_LIST entries DeepSpeed's op builder cannot read: it parses
                            each as numbers, so an arch-specific "9.0a" (an H200 image sets it) stops
                            the JIT build of FusedAdam, the SFT stage's optimizer
    checkpoint_disk_lines   one checkpoint's size (DeepSpeed's fp32 master weights and Adam
                            moments, the HF weights) and free disk for checkpoint.keep of them
    driver_lines            the NVIDIA driver against the CUDA build of the wheels: the pinned vLLM
                            0.32.0 wheel and the torch 2.13.0 it pins are CUDA 13 builds, which need
                            driver >= 580 (or the cuda-compat forward-compatibility package); an
                            older driver leaves torch.cuda.is_available() False with no reason given
    nvcc_lines              nvcc's release against torch.version.cuda's major.minor: DeepSpeed's op
                            builder refuses a mismatch for CUDA 13 (it tolerates minor mismatches
                            for CUDA 10-12 only), which stops a JIT build of a CUDA op (FusedAdam:
                            the SFT stage's optimizer when DeepSpeed's AdamW runs on the GPU). The
                            RL run's DeepSpeedCPUAdam is a C++ op: for it the line is informational

Each returns (report lines, problems). Nothing here imports torch, DeepSpeed or vLLM.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import time

GB = 1e9

# Markers of the two vLLM sleep-mode allocators (vllm/device_allocator/cumem.py): releases before
# vLLM PR 40812 assert against expandable segments; later ones switch them off around their pool.
_OLD_ASSERT = "Expandable segments are not compatible with memory pool"
_TOGGLE = "expandable_was_enabled"


def read_compute_modes(run=subprocess.run) -> list[str] | None:
    """Each visible GPU's compute mode from nvidia-smi ("Default", "Exclusive_Process",
    "Prohibited", ...), or None when nvidia-smi is missing or fails. `run`: subprocess.run (tests
    pass a stand-in)."""
    if run is subprocess.run and shutil.which("nvidia-smi") is None:
        return None
    try:
        r = run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return [x.strip() for x in r.stdout.splitlines() if x.strip()]


def compute_mode_lines(modes: list[str] | None) -> tuple[list[str], list[str]]:
    """modes: per GPU (read_compute_modes), None when unknown. A GPU in "Prohibited" mode (no CUDA
    context at all) or the retired "Exclusive_Thread" is a problem; "Exclusive_Process" is fine
    for the in-process engine (one process per GPU) and is noted."""
    if modes is None:
        return ["compute mode: not checked (no nvidia-smi here)"], []
    if not modes:
        return ["compute mode: no GPU listed by nvidia-smi"], []
    lines = [f"compute mode: {', '.join(f'GPU {i} {m}' for i, m in enumerate(modes))}"]
    bad = [i for i, m in enumerate(modes) if m.replace(" ", "_").lower() in ("prohibited", "exclusive_thread")]
    excl = [i for i, m in enumerate(modes) if m.replace(" ", "_").lower() == "exclusive_process"]
    if excl:
        lines.append("  exclusive-process GPUs admit one process each: the trainer with its vLLM engine "
                     "inside it needs no more (an engine in its own process would be refused)")
    problems = [f"GPU {i} is in compute mode {modes[i]}: no process may use it (nvidia-smi -c DEFAULT, "
                "as root, or ask the site)" for i in bad]
    return lines, problems


def vllm_allocator_source() -> str | None:
    """The text of the installed vLLM's sleep-mode allocator (vllm/device_allocator/cumem.py), read
    without importing vLLM; None when vLLM is not installed or the file is not there."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "device_allocator", "cumem.py")
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def alloc_conf_lines(environ, sleep_mode: bool, allocator_source: str | None) -> tuple[list[str], list[str]]:
    """PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) with expandable_segments:True, when the run's
    vLLM engines use sleep mode (sleep_mode). allocator_source: vllm_allocator_source(). A vLLM
    whose sleep-mode allocator asserts against expandable segments is a problem (the engine fails to
    build); one that switches them off around its pool keeps them for the trainer's allocations."""
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF") or ""
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    line = f"PYTORCH_CUDA_ALLOC_CONF: {conf or 'not set'}"
    if not on or not sleep_mode:
        return [line + ("" if not on else " (no vLLM sleep mode in this run: no conflict)")], []
    if allocator_source is None:
        return [line + "; vLLM not installed: its sleep-mode allocator not checked"], []
    if _OLD_ASSERT in allocator_source:
        return [line], ["PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which this vLLM's sleep "
                        "mode refuses (CuMemAllocator asserts): unset it, or install the pinned vllm "
                        "(constraints/gpu.txt), which switches it off around its own memory pool"]
    if _TOGGLE in allocator_source:
        return [line + "; vLLM turns expandable segments off around its sleep-mode pool, the "
                "trainer keeps them"], []
    return [line + "; vLLM's sleep-mode allocator not recognised: unchecked"], []


def visible_gpu_lines(environ, n_visible: int, local_rank: int, local_world: int) -> tuple[list[str], list[str]]:
    """GPUs this process sees (n_visible: torch.cuda.device_count()) against its LOCAL_RANK and the
    ranks per node (local_world; 0 = unknown). The trainer (torch.cuda.set_device) and its vLLM
    engine (external launcher: device LOCAL_RANK) both take GPU number LOCAL_RANK, so every process
    must see every GPU of its node, as torchrun and the deepspeed launcher arrange. No GPU: no check."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    line = (f"GPUs visible to this process: {n_visible} (CUDA_VISIBLE_DEVICES={cvd if cvd is not None else 'unset'}), "
            f"LOCAL_RANK {local_rank}" + (f" of {local_world} per node" if local_world else ""))
    if not n_visible:
        return [line], []
    need = max(local_rank + 1, local_world)
    if n_visible >= need:
        return [line], []
    return [line], [f"this process sees {n_visible} GPU(s) but is local rank {local_rank}"
                    + (f" of {local_world}" if local_world else "") + ": the trainer and its vLLM engine "
                    "use GPU number LOCAL_RANK, so every process must see all of its node's GPUs (torchrun "
                    "and deepspeed do this; under SLURM do not bind GPUs per task: one task per node "
                    "running torchrun, or --gpu-bind=none)"]


def extensions_dir(environ) -> str:
    """Where torch builds JIT extensions (DeepSpeedCPUAdam): $TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions."""
    return environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                               "torch_extensions")


def build_lock_lines(root: str, now: float | None = None, stale_s: float = 1800.0) -> tuple[list[str], list[str]]:
    """Lock files of torch's extension builds under `root` (torch's FileBaton writes `<build>/lock`
    and deletes it when the build ends). One older than stale_s seconds (a DeepSpeedCPUAdam build
    takes 1-5 min) is left by a killed build, and every rank's next start waits on it forever: a
    problem naming the file to delete. A younger one may be a build in progress (noted)."""
    now = time.time() if now is None else now
    if not os.path.isdir(root):
        return [f"torch extensions: {root} (none built yet)"], []
    locks = []
    for d, _, fs in os.walk(root):
        locks += [os.path.join(d, f) for f in fs if f == "lock"]
    if not locks:
        return [f"torch extensions: {root}, no build lock"], []
    lines, problems = [f"torch extensions: {root}"], []
    for p in sorted(locks):
        try:
            age = now - os.path.getmtime(p)
        except OSError:
            continue
        if age > stale_s:
            problems.append(f"stale extension-build lock {p} ({age / 60:.0f} min old): an interrupted "
                            f"build left it and every start will wait on it; delete it (rm {p})")
        else:
            lines.append(f"  build lock {p} ({age:.0f} s old): a build may be running")
    return lines, problems


def arch_list_lines(environ) -> tuple[list[str], list[str]]:
    """TORCH_CUDA_ARCH_LIST against what DeepSpeed's op builder parses (builder.py,
    compute_capability_args: every part of "M.N" or "M.N+PTX" through int()). An entry such as
    "9.0a" (Hopper's arch-specific target) raises ValueError in the JIT build of any CUDA op: seen on
    an H200 node, where the SFT stage's FusedAdam failed to build and DeepSpeedCPUAdam (a CPU op)
    built. A problem naming the list to set instead."""
    raw = environ.get("TORCH_CUDA_ARCH_LIST")
    if not raw:
        return ["TORCH_CUDA_ARCH_LIST: not set (DeepSpeed builds for the visible GPUs)"], []
    entries = raw.replace(";", " ").split()
    bad = [e for e in entries if not all(p.isdigit() for p in e.split("+")[0].split("."))]
    line = f"TORCH_CUDA_ARCH_LIST: {raw}"
    if not bad:
        return [line], []
    fixed = " ".join(dict.fromkeys(e.split("+")[0].rstrip("abcdefghijklmnopqrstuvwxyz") for e in entries))
    return [line], [f"TORCH_CUDA_ARCH_LIST={raw} has {', '.join(bad)}, which DeepSpeed's op builder cannot "
                    f"parse: the JIT build of its CUDA ops (FusedAdam, the SFT stage's optimizer) stops "
                    f"with ValueError; set TORCH_CUDA_ARCH_LIST=\"{fixed}\" for the run"]


def checkpoint_bytes(params: int, bf16: bool = True) -> dict:
    """One full-mode checkpoint (backends/run/checkpoint.py layout, engine zero3) in bytes by part:
    DeepSpeed's partitions (fp32 master weights + Adam m and v: 12 bytes per parameter, over all
    ranks together), the HF weights (2 or 4 bytes per parameter) and state.pt (bank, metrics, RNGs:
    ~0.1 GB, ours)."""
    # Eq.: checkpoint = 12 P (zero/) + 2 P (model/, bf16) + state.pt
    return {"DeepSpeed partitions (fp32 master, Adam m, v)": 12 * params,
            "HF weights (model/)": (2 if bf16 else 4) * params, "training state (state.pt)": 0.1 * GB}


def free_bytes(path: str) -> tuple[float, str]:
    """(free bytes, the existing directory measured) of the filesystem that holds `path` (its
    nearest existing parent)."""
    p = os.path.abspath(os.path.expanduser(path))
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return float(st.f_frsize * st.f_bavail), p


def checkpoint_disk_lines(params: int, keep: int, every: int, run_dir: str, free: float, where: str,
                          existing: float = 0.0, bf16: bool = True) -> tuple[list[str], list[str]]:
    """One checkpoint's size and the disk checkpoint.keep of them need: a new checkpoint is written
    in full before the oldest is pruned, so (keep + 1) checkpoints exist for a moment. free: bytes
    free where run_dir lives (free_bytes); existing: bytes of checkpoints already there (a resume),
    which the count includes. every = 0: only the last one (keep still applies to a resumed run)."""
    parts = checkpoint_bytes(params, bf16)
    one = float(sum(parts.values()))
    need = (max(1, keep) + 1) * one - existing
    lines = [f"checkpoints: {one / GB:.1f} GB each ("
             + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in parts.items()) + ")",
             f"  checkpoint.keep {keep}, every {every} steps: {(keep + 1) * one / GB:.0f} GB at the peak "
             f"(keep + 1 while the newest is written); {free / GB:.0f} GB free at {where}"]
    if free < need:
        return lines, [f"disk: {free / GB:.0f} GB free at {where} for run_dir {run_dir}, but "
                       f"checkpoint.keep={keep} checkpoints of {one / GB:.0f} GB need {need / GB:.0f} GB "
                       "more (lower checkpoint.keep, or a larger filesystem)"]
    return lines, []


# ----------------------------------------------------------------------------------------------------
# Driver and CUDA toolkit

# The oldest driver each CUDA major release runs on under minor-version compatibility (the CUDA
# Toolkit release notes' table "CUDA Toolkit and minimum required driver version for CUDA minor
# version compatibility": CUDA 12.x >= 525.60.13, CUDA 13.x >= 580).
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 0, 0)}
# The pinned wheels' CUDA (constraints/gpu.txt): vllm 0.32.0's extensions link libnvrtc.so.13 and it
# pins torch==2.13.0, whose default wheel is the CUDA 13.0 build.
PINNED_CUDA = "13.0"
# CUDA majors whose toolkit minor may differ from torch's for DeepSpeed's op builder (builder.py,
# cuda_minor_mismatch_ok in deepspeed 0.19.8: 10, 11 and 12; 13 has no entry).
DS_MINOR_MISMATCH_OK = (10, 11, 12)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def read_driver_version(run=subprocess.run, proc: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA driver version ("580.65.06") from nvidia-smi, else from the kernel module's
    /proc file; None where neither exists (no NVIDIA driver: no GPU). `run`: subprocess.run (tests
    pass a stand-in). nvidia-smi answers even when the driver is too old for the installed torch."""
    if run is not subprocess.run or shutil.which("nvidia-smi") is not None:
        try:
            r = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=20)
            first = r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""
            if re.fullmatch(r"\d+(\.\d+)*", first):
                return first
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open(proc) as fh:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", fh.read())
        return m.group(1) if m else None
    except OSError:
        return None


def cuda_compat_libs(roots: tuple = ("/usr/local/cuda/compat", "/usr/local/cuda-*/compat")) -> list[str]:
    """libcuda.so files of an installed cuda-compat package (NVIDIA's forward compatibility: a newer
    CUDA on an older data-centre driver, when LD_LIBRARY_PATH holds the folder)."""
    out: list[str] = []
    for r in roots:
        for d in sorted(glob.glob(r)):
            out += sorted(glob.glob(os.path.join(d, "libcuda.so*")))
    return out


def driver_lines(driver: str | None, torch_cuda: str | None, compat: list[str],
                 n_gpu: int) -> tuple[list[str], list[str]]:
    """driver: read_driver_version(); torch_cuda: torch.version.cuda (None for a CPU build of torch:
    the pinned CUDA 13.0 build is checked instead); compat: cuda_compat_libs(); n_gpu: GPUs torch sees.
    A driver older than MIN_DRIVER for that CUDA major is a problem unless cuda-compat is there
    (noted); no driver at all is skipped with the reason."""
    cuda = torch_cuda or PINNED_CUDA
    src = "torch.version.cuda" if torch_cuda else "the pinned vllm 0.32.0 / torch 2.13.0 wheels"
    major = _version_tuple(cuda)[0] if _version_tuple(cuda) else 0
    need = MIN_DRIVER.get(major)
    need_s = ".".join(map(str, need)).removesuffix(".0.0") if need else "?"
    if driver is None:
        return [f"NVIDIA driver: not checked (no nvidia-smi and no /proc/driver/nvidia here: no GPU); "
                f"CUDA {cuda} ({src}) needs driver >= {need_s}"], []
    line = f"NVIDIA driver {driver}; CUDA {cuda} ({src}) needs >= {need_s}"
    if need is None or _version_tuple(driver) >= need:
        return [line + ": ok"], []
    if compat:
        return [line + f"; below it, but cuda-compat is installed ({compat[0]}): forward compatibility "
                "(data-centre GPUs; its folder must be on LD_LIBRARY_PATH)"], []
    return [line], [f"NVIDIA driver {driver} is older than {need_s}, the minimum for CUDA {cuda} ({src})"
                    + (": torch.cuda.is_available() is False with it" if not n_gpu else "")
                    + "; install driver R" + need_s.split(".")[0] + "+ or the cuda-compat package "
                    "(forward compatibility)"]


def read_nvcc_release(run=subprocess.run, environ=None) -> str | None:
    """nvcc's release ("13.0") from `nvcc --version` ($CUDA_HOME/bin/nvcc first); None without nvcc."""
    env = os.environ if environ is None else environ
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    cand = os.path.join(home, "bin", "nvcc") if home else ""
    if not os.path.isfile(cand):
        cand = shutil.which("nvcc") or ""
    if not cand:
        return None
    try:
        r = run([cand, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", r.stdout or "")
    return m.group(1) if m else None


def nvcc_lines(nvcc: str | None, torch_cuda: str | None, needs_build: bool) -> tuple[list[str], list[str]]:
    """nvcc's release against torch.version.cuda (None: a CPU build here, the pinned CUDA 13.0 is
    compared). DeepSpeed's op builder (assert_no_cuda_mismatch) accepts equal major.minor, or a
    different minor within CUDA 10-12; else it raises CUDAMismatchException unless
    DS_SKIP_CUDA_CHECK=1. needs_build: this run JIT-builds a CUDA op (a problem then); otherwise the
    line is informational (the RL run's DeepSpeedCPUAdam is a C++ op)."""
    cuda = torch_cuda or PINNED_CUDA
    whose = "torch's" if torch_cuda else "the pinned torch 2.13.0's"
    why = "" if needs_build else (" (informational: the RL run builds no CUDA op; the SFT stage "
                                  "builds FusedAdam only with DeepSpeed's AdamW on the GPU)")
    if nvcc is None:
        line = f"nvcc: not found; {whose} CUDA {cuda}" + why
        return [line], ([f"nvcc not found: the JIT build of a CUDA op needs the CUDA {cuda} toolkit"]
                        if needs_build else [])
    t, c = _version_tuple(nvcc)[:2], _version_tuple(cuda)[:2]
    ok = t == c or (t[0] == c[0] and t[0] in DS_MINOR_MISMATCH_OK)
    line = f"nvcc {nvcc} against {whose} CUDA {cuda}: " + ("DeepSpeed's op builder accepts it" if ok else
                                                          "DeepSpeed's op builder refuses it") + why
    if ok or not needs_build:
        return [line], []
    return [line], [f"nvcc {nvcc} differs from {whose} CUDA {cuda} and DeepSpeed 0.19.8 allows a minor "
                    f"mismatch for CUDA 10-12 only: the JIT build of a CUDA op stops with "
                    f"CUDAMismatchException; install the CUDA {cuda} toolkit (CUDA_HOME), or set "
                    "DS_SKIP_CUDA_CHECK=1 at your own risk"]


def cpu_adam_prebuilt() -> bool:
    """Whether the installed deepspeed package holds a prebuilt DeepSpeedCPUAdam op (a cpu_adam*.so
    under deepspeed/ops, as DS_BUILD_CPU_ADAM=1 pip install deepspeed leaves it); the start-up plan
    then counts no JIT build."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return False
    for d, _, fs in os.walk(os.path.join(list(spec.submodule_search_locations)[0], "ops")):
        if any(f.startswith("cpu_adam") and f.endswith(".so") for f in fs):
            return True
    return False
