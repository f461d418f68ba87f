"""
The thread count a CPU run uses when not told (cores.py, flags.set_threads): the cores the process
may use (affinity, a cgroup quota) less those another process keeps busy; --threads and
OMP_NUM_THREADS win over it.
"""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from runs import cores, flags, generate_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_affinity_limits_the_usable_cores():
    code = ("import os, sys; sys.path.insert(0, '.'); os.sched_setaffinity(0, {min("
            "os.sched_getaffinity(0))}); from runs import cores; print(cores.usable_cores())")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "1", p.stderr


@pytest.mark.parametrize("text,quota", [("150000 100000\n", 1.5), ("max 100000\n", None),
                                        ("50000 100000", 0.5)])
def test_a_cgroup_quota_caps_the_cores(tmp_path, monkeypatch, text, quota):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    monkeypatch.setattr(cores, "CPU_MAX", str(cpu_max))
    assert cores.cgroup_quota() == quota
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if quota is None else min(affinity, max(1, -(-quota // 1)))
    assert cores.usable_cores() == expected


def test_a_core_another_process_keeps_busy_is_not_used(monkeypatch):
    monkeypatch.setattr(cores, "cgroup_quota", lambda: None)
    usable = cores.usable_cores()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the loop is running before the watch starts
        threads, why = cores.CoreWatch().threads()
    finally:
        busy.kill()
        busy.wait()
    assert threads <= max(1, usable - 1)
    if usable > 1:
        assert "other processes kept" in why and "--threads N" in why, why


def test_the_flag_and_the_environment_win(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    args = generate_cli.build_parser().parse_args(["--threads", "3"])
    flags.set_threads(args)
    assert calls == [3]
    args = generate_cli.build_parser().parse_args([])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    flags.set_threads(args)
    assert calls == [3]  # torch read OMP_NUM_THREADS itself: nothing set
    monkeypatch.delenv("OMP_NUM_THREADS")

    class Watch:
        def threads(self):
            return 1, "threads: 1 (a test)"
    said = []
    flags.set_threads(args, Watch(), said.append)
    assert calls == [3, 1] and said == ["threads: 1 (a test)"]


def test_a_thread_kept_to_one_starts_no_team_and_reports_the_models_count():
    """A batch's task threads (cores.one_thread_here): their parallel operations start no OpenMP
    team of their own (one would slow every operation of the model's), and the count they report
    for a task's identity (task.cpu_threads) is still the model's."""
    if not cores.openmp_runtimes():
        pytest.skip("torch's OpenMP runtime here is not libgomp")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = {}

    def work(keep_to_one):
        if keep_to_one:
            cores.one_thread_here()
        ids = set(os.listdir("/proc/self/task"))
        torch.randn(1 << 22).float().sum()  # big enough to run in parallel
        started = set(os.listdir("/proc/self/task")) - ids
        seen[keep_to_one] = (len(started), torch.get_num_threads(), cores.compute_threads())
    try:
        for keep_to_one in (False, True):
            t = threading.Thread(target=work, args=(keep_to_one,))
            t.start()
            t.join()
    finally:
        torch.set_num_threads(before)
    assert seen[False] == (1, 2, 2)  # the thread's own team: one more OS thread
    assert seen[True] == (0, 1, 2)
