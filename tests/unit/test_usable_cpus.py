"""The CPUs a server may use, read from fake cgroup files: v2 `cpu.max`, v1 CFS quota and period, limits set on a
parent cgroup, a container that sees its cgroup as the mount's root; and the torch threads chosen from them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from transformers_openai.engine import intra_op_threads
from transformers_openai.engine.intra_op_threads import cpu_threads
from transformers_openai.engine.usable_cpus import UsableCpus, cgroup_cpu_quota


def cgroups(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc_file = tmp_path / "proc-self-cgroup"
    proc_file.write_text(proc)
    return root, proc_file


def test_a_v2_quota_in_cpus(tmp_path: Path) -> None:
    root, proc = cgroups(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cgroup_cpu_quota(root, proc) == (1.5, str(root / "cpu.max"))


def test_v2_without_a_limit(tmp_path: Path) -> None:
    root, proc = cgroups(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) == (None, None)


def test_a_limit_on_a_parent_cgroup_applies(tmp_path: Path) -> None:
    files = {"kubepods/cpu.max": "200000 100000", "kubepods/pod1/cpu.max": "max 100000"}
    root, proc = cgroups(tmp_path, "0::/kubepods/pod1\n", files)
    assert cgroup_cpu_quota(root, proc)[0] == 2.0


def test_the_tightest_of_several_limits(tmp_path: Path) -> None:
    files = {"a/cpu.max": "300000 100000", "a/b/cpu.max": "50000 100000"}
    root, proc = cgroups(tmp_path, "0::/a/b\n", files)
    assert cgroup_cpu_quota(root, proc)[0] == 0.5


def test_a_v1_cfs_quota(tmp_path: Path) -> None:
    files = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"}
    root, proc = cgroups(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n", files)
    assert cgroup_cpu_quota(root, proc)[0] == 0.5


def test_v1_without_a_limit_and_a_hybrid_host(tmp_path: Path) -> None:
    files = {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000", "unified/cgroup.procs": ""}
    root, proc = cgroups(tmp_path, "1:cpu:/\n0::/\n", files)
    assert cgroup_cpu_quota(root, proc) == (None, None)


def test_a_container_seeing_its_own_cgroup_at_the_mount(tmp_path: Path) -> None:
    files = {"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}
    root, proc = cgroups(tmp_path, "1:cpu:/docker/xyz\n", files)  # the host's path, not mounted here
    assert cgroup_cpu_quota(root, proc)[0] == 3.0


def test_no_cgroup_information(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path, tmp_path / "missing") == (None, None)
    root, proc = cgroups(tmp_path, "0::/\n", {"cpu.max": "garbage"})
    assert cgroup_cpu_quota(root, proc) == (None, None)


def test_whole_cpus_rounded_down_at_least_one() -> None:
    assert UsableCpus(4, 2.5).count == 2
    assert UsableCpus(4, 0.5).count == 1
    assert UsableCpus(2).count == 2
    assert UsableCpus(2, 8.0).count == 2
    assert "cgroup quota 2.5 CPUs" in UsableCpus(4, 2.5, "/x/cpu.max").describe()


def test_torch_threads_are_capped_at_the_usable_cpus_unless_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default on a 2-core machine
    try:
        monkeypatch.setattr(intra_op_threads, "usable_cpus", lambda: UsableCpus(2, 1.5, "/x/cpu.max"))
        with caplog.at_level(logging.INFO, logger="transformers_openai.engine.intra_op_threads"):
            assert cpu_threads(None) == 1
        assert "torch threads: 1 (2 CPUs in the affinity mask, cgroup quota 1.5 CPUs" in caplog.text
        assert cpu_threads(2) == 2  # --torch-threads is taken as given
        monkeypatch.setattr(intra_op_threads, "usable_cpus", lambda: UsableCpus(8))
        assert cpu_threads(None) == 2  # never more than torch's default (OMP_NUM_THREADS, the cores)
    finally:
        torch.set_num_threads(before)
