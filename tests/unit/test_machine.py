"""How many threads the engines take: the cores in this process's affinity, at most its cgroup's CPU
quota (a pod under a 2-CPU limit on a 64-core node sees all 64 cores), read from fake cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgate import machine as machine_mod
from specgate.machine import cpu_quota, usable_cores


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_in_a_container(tmp_path: Path) -> None:
    """With a cgroup namespace the container's own cgroup is the mount's root."""
    t = _tree(tmp_path, {"self": "0::/\n", "fs/cpu.max": "200000 100000\n"})
    assert cpu_quota(t / "fs", t / "self") == 2.0
    (t / "fs/cpu.max").write_text("max 100000\n")
    assert cpu_quota(t / "fs", t / "self") is None


def test_cgroup_v2_the_smallest_limit_on_the_way_up(tmp_path: Path) -> None:
    t = _tree(tmp_path, {"self": "0::/kubepods/pod1/ctr\n", "fs/cpu.max": "max 100000\n", "fs/kubepods/pod1/cpu.max": "150000 100000\n",
                         "fs/kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert cpu_quota(t / "fs", t / "self") == 1.5
    assert usable_cores(64, 1.5) == 2


def test_cgroup_v2_path_outside_the_mount_reads_the_mounts_root(tmp_path: Path) -> None:
    t = _tree(tmp_path, {"self": "0::/system.slice/docker-abc.scope\n", "fs/cpu.max": "100000 100000\n"})
    assert cpu_quota(t / "fs", t / "self") == 1.0


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_and_hybrid_hosts(tmp_path: Path, mount: str) -> None:
    t = _tree(tmp_path, {"self": f"4:memory:/x\n3:{mount}:/kubepods/ctr\n0::/\n", f"fs/{mount}/kubepods/ctr/cpu.cfs_quota_us": "50000\n",
                         f"fs/{mount}/kubepods/ctr/cpu.cfs_period_us": "100000\n", "fs/unified/cpu.max": "400000 100000\n"})
    assert cpu_quota(t / "fs", t / "self") == 0.5  # the cpu controller is v1's on a hybrid host
    assert usable_cores(2, 0.5) == 1
    (t / f"fs/{mount}/kubepods/ctr/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(t / "fs", t / "self") is None


def test_no_cgroups_no_limit(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path / "none", tmp_path / "missing") is None
    assert usable_cores(8, None) == 8 and usable_cores(2, 16.0) == 2  # a quota above the cores changes nothing


def test_engines_take_no_more_threads_than_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine_mod.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(machine_mod, "cpu_quota", lambda: 2.0)
    machine_mod.machine.cache_clear()
    try:
        assert machine_mod.machine().cores == 2
    finally:
        machine_mod.machine.cache_clear()
