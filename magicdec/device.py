"""What a run measures of the machine it runs on, apart from the model: timing that waits for the device, copy
bandwidths, free memory, peak memory, and the environment and code version a record names."""
from __future__ import annotations

import functools
import gc
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """(fn(), wall seconds) with the device idle before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), the ceiling for decode."""
    if device.type != "cuda":
        return None
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[3:])


def host_to_device_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Pinned host memory to the GPU, bytes/s: what bounds an offloaded cache's step (PCIe)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / statistics.median(times[1:])


def memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device: the GPU's, or the RAM this process may use (host_memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    return host_memory()


NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def host_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> tuple[int, int]:
    """(free, total) bytes of RAM this process may use: the least of what the machine has available
    (/proc/meminfo), what its address-space limit leaves (RLIMIT_AS less the process's size) and what its memory
    cgroup leaves (each cgroup up the tree: v2 memory.max, v1 memory.limit_in_bytes, less its usage not counting
    reclaimable page cache). A container or `ulimit -v` smaller than the machine is the limit a run hits."""
    import resource

    info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in (proc / "meminfo").open())}
    bounds = [(info["MemAvailable"], info["MemTotal"])]
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        status = dict(line.split(":", 1) for line in (proc / "self" / "status").open() if ":" in line)
        size = int(status.get("VmSize", "0 kB").split()[0]) * 1024
        bounds.append((max(soft - size, 0), soft))
    bounds += cgroup_memory(proc, cgroups)
    return min(f for f, _ in bounds), min(t for _, t in bounds)


def cgroup_memory(proc: Path, cgroups: Path) -> list[tuple[int, int]]:
    """(limit less usage, limit) of each memory cgroup this process is in, from its own up to the root, that has a
    limit (none outside a container or a limited service)."""
    def number(f: Path) -> int | None:
        try:
            text = f.read_text().strip()
        except OSError:
            return None
        return None if text == "max" or not text.isdigit() else int(text)

    def reclaimable(stat: Path, key: str) -> int:
        try:
            return next((int(v) for k, v in (line.split() for line in stat.open()) if k == key), 0)
        except (OSError, ValueError):
            return 0

    out = []
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, limit, usage, stat, cache = cgroups, "memory.max", "memory.current", "memory.stat", "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit, usage = cgroups / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            stat, cache = "memory.stat", "total_inactive_file"
        else:
            continue
        d = base / path.lstrip("/")
        for folder in [d, *d.parents]:  # a parent's limit binds its children too
            cap = number(folder / limit)
            if cap is not None and cap < NO_LIMIT:
                used = (number(folder / usage) or 0) - reclaimable(folder / stat, cache)
                out.append((max(cap - max(used, 0), 0), cap))
            if folder == base:
                break
    return out


def headroom(device: torch.device) -> int:
    """Memory a run uses beyond its weights, caches and activations: CUDA graph pools, NCCL buffers, attention
    scratch, allocator slack. Peaks under tensor parallelism ran gigabytes over the estimate (results/tp); one run
    that the estimate alone let through ran out of memory."""
    return headroom_for(memory(device)[1])


def headroom_for(total: int) -> int:
    """headroom() of a device of `total` bytes (a device named by its size only: `magicdec plan`'s profile)."""
    return max(2 << 30, int(0.06 * total))


def release_memory(device: torch.device) -> None:
    """Collect now (a Decoder and its CUDA graphs form a reference cycle) and give cached GPU blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated on the GPU, or the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """The git commit this code is at, and whether the working tree differed from it (None outside a checkout).
    MAGICDEC_CODE_COMMIT (and MAGICDEC_CODE_DIRTY=1) name it where the code travelled without its git history, or
    with a stale one (a copy of the tree sent to a GPU machine)."""
    import os

    if os.environ.get("MAGICDEC_CODE_COMMIT"):
        return {"commit": os.environ["MAGICDEC_CODE_COMMIT"], "dirty": os.environ.get("MAGICDEC_CODE_DIRTY") == "1"}

    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return {"commit": None, "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "host": platform.node(), "code": code_version(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_count"] = torch.cuda.device_count()
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env
