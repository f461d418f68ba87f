"""
How many threads a CPU run uses when you do not say (--threads N, or OMP_NUM_THREADS): the cores
this process may use (its CPU affinity, a cgroup's CPU quota) less those other processes keep busy
while the model loads.

Why not torch's choice (every core): torch's OpenMP threads wait for each other at the end of every
parallel operation, spinning. When another process holds a core, the thread that shares it is
descheduled a time slice at a time, and every operation waits for it. Measured on this project's
2-core build machine, SmolLM2-135M's shape, fp32, 2,200 tokens, beside one busy loop: two threads
kept 12% of their quiet prefill speed and 4% of their decode speed, one thread 97% and 101% of its
own. Letting the threads sleep instead (OMP_WAIT_POLICY=PASSIVE) survives the busy loop too, but
costs 14% of prefill and 35% of decode on a quiet machine: a decode step runs hundreds of short
parallel operations, and waking a sleeping thread for each costs more than the operation. So the
threads keep spinning, and there are only as many of them as there are cores to spin on.

The count is chosen once, before the first forward pass, and kept for the whole run: a CPU splits a
product's sums by it, so it changes the output's bits. It is part of what a resumed task or a
stored KV chunk must match (task.cpu_threads).
"""
import ctypes
import math
import os
import threading
import time

import torch

MIN_WATCH_S = 0.2    # the shortest window the other processes' load is measured over
CPU_MAX = "/sys/fs/cgroup/cpu.max"                   # cgroup v2: "quota period" or "max period"
CFS_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"    # cgroup v1
CFS_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"
BUSY_CORE = 0.5      # a core another process keeps busy this much of the time is not ours


def usable_cores():
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def cgroup_quota():
    """CPUs' worth of time the cgroup grants per period (cgroup v2 cpu.max, or v1's cfs quota),
    or None when there is no limit."""
    try:
        with open(CPU_MAX) as f:
            quota, period = f.read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(CFS_QUOTA) as f:
            quota = int(f.read())
        with open(CFS_PERIOD) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def busy_ticks():
    """(CPU ticks the whole machine spent busy, ticks this process used) so far, from /proc."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    total = sum(fields[:8])       # user nice system idle iowait irq softirq steal
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return total - idle, int(own[11]) + int(own[12])  # utime + stime


class CoreWatch:
    """Started as a run begins; asked for a thread count once the model is loaded, by which time
    it has seen how busy other processes keep the machine."""

    def __init__(self):
        self.started = time.monotonic()
        try:
            self.ticks = busy_ticks()
        except (OSError, ValueError, IndexError):  # no /proc: nothing to measure
            self.ticks = None

    def threads(self):
        """(threads, why or None): the usable cores less those others keep busy; why says it
        when that is fewer than the cores the machine shows."""
        cores = usable_cores()
        others = 0.0
        if self.ticks is not None:
            time.sleep(max(0.0, MIN_WATCH_S - (time.monotonic() - self.started)))
            elapsed = time.monotonic() - self.started
            busy, own = busy_ticks()
            ticks = busy - self.ticks[0] - (own - self.ticks[1])  # other processes' busy ticks
            others = max(0.0, ticks / (elapsed * os.sysconf("SC_CLK_TCK")))
        taken = math.floor(others + (1 - BUSY_CORE))  # a core busy half the time or more
        threads = max(1, cores - taken)
        shown = os.cpu_count() or cores
        if threads == shown:
            return threads, None
        why = f"threads: {threads} of the {shown} cores this machine shows"
        if cores < shown:
            why += f" ({cores} usable: CPU affinity or the cgroup's quota)"
        if taken:
            why += (f"; other processes kept {others:.1f} busy while the model loaded, and a "
                    "thread sharing a busy core would hold up every operation")
        return threads, why + "; --threads N chooses"


# -----------------------------------------------------------------------------
# one team: the model's threads are the only OpenMP threads that run

# Every thread that runs a parallel operation gets an OpenMP team of its own, kept for the thread's
# life. Once the process has more OpenMP threads than cores, libgomp stops letting any of them spin
# and every parallel operation pays for waking its team: measured here, an 8-row bf16 linear of the
# SmolLM2-135M shape went from 62 to 150 us while one other thread's (idle) team lived, and a batch
# of 8 tasks whose threads had each run a prefill step decoded 1.5x slower. So a batch's forward
# passes all run on one thread (batcher.py), and the threads around it keep theirs to one.
_local = threading.local()


def one_thread_here():
    """This thread's parallel operations run on this thread alone (no OpenMP team of its own); the
    rest of the process keeps its threads. A no-op where torch's OpenMP runtime is not libgomp."""
    _local.threads = torch.get_num_threads()  # also binds torch's count to this thread, once
    for omp in openmp_runtimes():
        omp.omp_set_num_threads(1)  # this thread's own setting in each runtime


def compute_threads():
    """The thread count the model's operations run with, asked from any thread: a thread that
    one_thread_here() keeps to one still reports the model's."""
    return getattr(_local, "threads", None) or torch.get_num_threads()


def openmp_runtimes():
    """Every libgomp this process has loaded: torch's, and any a wheel bundles (sentencepiece's)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:  # not Linux
        return []
    runtimes = []
    for path in sorted(paths):
        try:
            runtimes.append(ctypes.CDLL(path))
        except OSError:
            continue
    return runtimes
