"""How many CPUs this process may really use: its CPU affinity and its cgroup's CPU quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), for sizing the engine's torch threads.

A container limited to 1.5 CPUs still sees every core of the host in `os.cpu_count()`; a team of threads sized to
the host's cores then has its threads throttled in turn, and every parallel region waits for the throttled one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class UsableCpus:
    """The CPUs this process may run on (`affinity`) and the CPUs' worth of time its cgroup allows (`quota`, None:
    no limit), with the file the quota was read from."""

    affinity: int
    quota: float | None = None
    quota_file: str | None = None

    @property
    def count(self) -> int:
        """The whole CPUs the process may keep busy: the smaller of the two, rounded down, at least 1."""
        limit = float(self.affinity) if self.quota is None else min(float(self.affinity), self.quota)
        return max(1, math.floor(limit))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs ({self.quota_file})"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> UsableCpus:
    """The affinity mask's size and the tightest CPU quota over this process's cgroup and its ancestors."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota, where = cgroup_cpu_quota(cgroup_root, proc_self_cgroup)
    return UsableCpus(affinity, quota, where)


def cgroup_cpu_quota(cgroup_root: Path, proc_self_cgroup: Path) -> tuple[float | None, str | None]:
    """The smallest quota / period (in CPUs) over the cgroup directories that hold this process, v2 and v1, and the
    file it came from; (None, None) where no limit is set or nothing can be read (not Linux, no cgroup mounted)."""
    best: tuple[float | None, str | None] = (None, None)
    for directory, v2 in _cgroup_dirs(cgroup_root, proc_self_cgroup):
        found = _v2_quota(directory) if v2 else _v1_quota(directory)
        if found is not None and (best[0] is None or found[0] < best[0]):
            best = found
    return best


def _cgroup_dirs(cgroup_root: Path, proc_self_cgroup: Path) -> list[tuple[Path, bool]]:
    """Every directory whose CPU limit applies to this process: its own cgroup's and those above it up to the mount
    (a container that sees its own cgroup as the mount's root finds its limit there), for v2 (the unified hierarchy,
    mounted at the root or, on a hybrid host, at `unified/`) and for v1's `cpu` controller."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[Path, bool]] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        relative = path.strip("/")
        if controllers == "":  # v2: "0::/path"
            for mount in (cgroup_root, cgroup_root / "unified"):
                found += [(d, True) for d in _up_to(mount, relative)]
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu,cpuacct", "cpu"):
                found += [(d, False) for d in _up_to(cgroup_root / name, relative)]
    return list(dict.fromkeys(found))


def _up_to(mount: Path, relative: str) -> list[Path]:
    """`mount/relative` and each directory above it up to `mount`."""
    parts = [part for part in relative.split("/") if part]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> tuple[float, str] | None:
    """`cpu.max` holds "QUOTA PERIOD" in microseconds, QUOTA "max" for no limit."""
    file = directory / "cpu.max"
    try:
        fields = file.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1], str(file))


def _v1_quota(directory: Path) -> tuple[float, str] | None:
    """`cpu.cfs_quota_us` is -1 for no limit."""
    quota_file = directory / "cpu.cfs_quota_us"
    try:
        quota, period = quota_file.read_text().strip(), (directory / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period, str(quota_file))


def _ratio(quota: str, period: str, where: str) -> tuple[float, str] | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return (q / p, where) if q > 0 and p > 0 else None
