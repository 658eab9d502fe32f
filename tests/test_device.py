"""What a run reads of the machine (magicdec/device.py): the host memory a CPU run may use is the least of what the
machine has available, what an address-space limit (RLIMIT_AS, `ulimit -v`) leaves and what each memory cgroup up the
tree leaves (a container's limit, cgroup v2 and v1), so a run that does not fit is refused up front, not killed. The
files of /proc and /sys/fs/cgroup are written by hand here, each case's numbers chosen so one bound is the least."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from magicdec import device as dev
GIB = 1 << 30


def machine(root: Path, available_gib: float = 20, total_gib: float = 24, vm_gib: float = 3,
            cgroup: str = "0::/\n") -> tuple[Path, Path]:
    """A fake /proc (meminfo, self/status, self/cgroup) under root; returns (proc, cgroups)."""
    proc, cgroups = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    cgroups.mkdir()
    (proc / "meminfo").write_text(f"MemTotal:       {int(total_gib * 2**20)} kB\nMemFree:        1024 kB\n"
                                  f"MemAvailable:   {int(available_gib * 2**20)} kB\n")
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmPeak:\t{int(vm_gib * 2**20) + 5} kB\n"
                                          f"VmSize:\t{int(vm_gib * 2**20)} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc, cgroups


def limit(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


@pytest.fixture
def no_rlimit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def test_no_limits_is_the_machines_available_memory(tmp_path, no_rlimit):
    assert dev.host_memory(*machine(tmp_path)) == (20 * GIB, 24 * GIB)


def test_an_address_space_limit_leaves_its_size_less_the_process(tmp_path, monkeypatch):
    """`ulimit -v 8 GiB` on a process already 3 GiB in size: 5 GiB more can be allocated."""
    monkeypatch.setattr(resource, "getrlimit", lambda r: (8 * GIB, resource.RLIM_INFINITY)
                        if r == resource.RLIMIT_AS else (resource.RLIM_INFINITY,) * 2)
    assert dev.host_memory(*machine(tmp_path, vm_gib=3)) == (5 * GIB, 8 * GIB)


def test_a_cgroup_v2_limit_up_the_tree_binds(tmp_path, no_rlimit):
    """The process's own cgroup has no limit; its parent allows 6 GiB and uses 2.5 GiB, 0.5 GiB of which is page
    cache the kernel reclaims: 4 GiB left. The machine has 20 available."""
    proc, cgroups = machine(tmp_path, cgroup="0::/system.slice/job.scope\n")
    limit(cgroups / "system.slice" / "job.scope", {"memory.max": "max\n", "memory.current": f"{GIB}\n",
                                                   "memory.stat": "anon 1\ninactive_file 0\n"})
    limit(cgroups / "system.slice", {"memory.max": f"{6 * GIB}\n", "memory.current": f"{int(2.5 * GIB)}\n",
                                     "memory.stat": f"anon 7\ninactive_file {GIB // 2}\nactive_file 3\n"})
    assert dev.host_memory(proc, cgroups) == (4 * GIB, 6 * GIB)


def test_a_cgroup_v1_limit_binds_and_its_no_limit_value_does_not(tmp_path, no_rlimit):
    proc, cgroups = machine(tmp_path, cgroup="5:cpuacct,cpu:/\n4:memory:/docker/abc\n0::/\n")
    limit(cgroups / "memory" / "docker" / "abc", {"memory.limit_in_bytes": f"{3 * GIB}\n",
                                                  "memory.usage_in_bytes": f"{GIB}\n",
                                                  "memory.stat": "cache 5\ntotal_inactive_file 0\n"})
    limit(cgroups / "memory", {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "1\n"})
    assert dev.host_memory(proc, cgroups) == (2 * GIB, 3 * GIB)


def test_a_container_sees_its_own_cgroup_at_the_root(tmp_path, no_rlimit):
    """Inside a container /proc/self/cgroup says `/` and /sys/fs/cgroup is the container's own cgroup."""
    proc, cgroups = machine(tmp_path)
    limit(cgroups, {"memory.max": f"{8 * GIB}\n", "memory.current": f"{7 * GIB}\n", "memory.stat": ""})
    assert dev.host_memory(proc, cgroups) == (GIB, 8 * GIB)


def test_this_machines_memory_under_a_real_address_space_limit():
    """The real files and a real `ulimit -v`: a process limited to 4 GiB more than its size has at most that."""
    script = ("import resource, torch\nfrom magicdec import device as dev\n"
              "size = int(dict(l.split(':', 1) for l in open('/proc/self/status'))['VmSize'].split()[0]) * 1024\n"
              "resource.setrlimit(resource.RLIMIT_AS, (size + (4 << 30), resource.RLIM_INFINITY))\n"
              "free, total = dev.memory(torch.device('cpu'))\n"
              "print(free <= 4 << 30, total <= size + (4 << 30))")
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert p.stdout.split() == ["True", "True"], p.stderr
