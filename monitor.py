"""
What a long job is doing: process memory, a trace with one event per step, alerts, and the closing summary.

    --trace TRACE.jsonl   {"t", "task", "phase", "position", "device_allocated" (CUDA: the allocator's; CPU: the
                           KV bytes on the device tier), "device_peak", "host_rss",
                           "host_anon", "bytes": {h2d, d2h, disk_write, disk_read} moved since the task's last
                           event (and window_skipped: KV bytes outside every sliding window, so not read at all),
                           "chunks": {device, host, disk}}, plus {"alert": ...} events
    alerts (stderr + trace): a task running over 2x the mean time of finished tasks; host memory over 80% of the
    machine's RAM (the job is about to swap); offload configured but no chunk leaving the device once the context
    has outgrown the window (offload is not in effect).
tools/plot_trace.py draws a trace.
"""
import ctypes
import json
import os
import sys
import threading
import time

import torch


def host_memory():
    """Resident memory of this process in bytes: total, anonymous (what it really holds) and file-backed
    (mapped pages, e.g. the disk tier, that the OS may evict)."""
    out = {"rss": 0, "anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[{"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}[key]] = int(val.split()[0]) * 1024
    except OSError:  # not Linux: the peak RSS is all we can get
        import resource
        out["rss"] = out["anon"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def total_ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def return_large_frees_to_os(threshold=1 << 20):
    """glibc raises its mmap threshold after each large free; from then on big temporaries (the attention scores of
    a prefill chunk) come from the heap, which fragments and is rarely trimmed, so resident memory creeps up with
    the context although nothing holds it. A fixed threshold keeps big blocks in mmap: freed, they go back to the OS. (The price: each MiB-sized temporary is a fresh mapping, and its page faults cost prefill
    some system time; a 64 MiB threshold measured faster but let RssAnon creep again.)"""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class Monitor:
    """Shared by all tasks of a run (thread-safe): writes the trace, raises alerts, keeps totals for the summary."""

    def __init__(self, trace_path=None, log=None, ram=None):
        self.trace = open(trace_path, "a", buffering=1) if trace_path else None
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.ram = total_ram() if ram is None else ram
        self.lock = threading.Lock()
        self.durations, self.started, self.last = [], {}, {}
        self.alerted = set()
        self.totals = {"done": 0, "failed": [], "resumed": 0, "new_tokens": 0, "decode_s": 0.0, "peak_device": 0,
                       "peak_rss": 0, "bytes": {"h2d": 0, "d2h": 0, "disk_write": 0, "disk_read": 0,
                                                    "window_skipped": 0}}

    def _emit(self, event):
        if self.trace:
            with self.lock:
                self.trace.write(json.dumps(event) + "\n")

    def alert(self, key, msg, task=None):
        """Warn once per (key, task)."""
        with self.lock:
            if (key, task) in self.alerted:
                return
            self.alerted.add((key, task))
        self.log(f"ALERT: {msg}")
        self._emit({"t": time.time(), "task": task, "alert": key, "message": msg})

    def task_started(self, task):
        self.started[task] = time.perf_counter()

    def step(self, task, phase, cache):
        """After every forward step of a task: one trace event, and the alerts that can fire mid-task."""
        store, mem = cache.store, host_memory()
        cuda = store.cuda
        moved = dict(store.bytes)
        prev = self.last.get(task, {k: 0 for k in moved})
        self.last[task] = moved
        chunks = store.stats()["chunks"]
        self._emit({"t": time.time(), "task": task, "phase": phase, "position": cache.length,
                    "device_allocated": torch.cuda.memory_allocated(store.device) if cuda
                    else store.kv_bytes_on_device(cache.length % cache.chunk_size),
                    "device_peak": torch.cuda.max_memory_allocated(store.device) if cuda else store.peak_device_bytes,
                    "host_rss": mem["rss"], "host_anon": mem["anon"],
                    "bytes": {k: moved[k] - prev[k] for k in moved}, "chunks": chunks})
        if self.ram and mem["rss"] > 0.8 * self.ram:
            self.alert("host_memory", f"host memory {mem['rss'] / 2**30:.1f} GiB is over 80% of this machine's "
                       f"{self.ram / 2**30:.1f} GiB: the job is about to swap; lower --concurrency or --cpu-budget")
        if (store.cfg.mode != "none" and cache.n_sealed > store.window and chunks["host"] + chunks["disk"] == 0):
            self.alert("offload_not_in_effect", f"task {task}: {cache.n_sealed} chunks sealed, window "
                       f"{store.window}, yet none left the device: offload is not in effect", task)
        with self.lock:
            mean = sum(self.durations) / len(self.durations) if self.durations else None
        elapsed = time.perf_counter() - self.started.get(task, time.perf_counter())
        if mean and elapsed > 2 * mean:
            self.alert("slow_task", f"task {task} has run {elapsed:.1f}s, over 2x the mean {mean:.1f}s of "
                       "finished tasks", task)

    def task_finished(self, task, stats=None, error=None):
        with self.lock:
            t = self.totals
            if error is not None:
                self.started.pop(task, None)
                t["failed"].append((task, error))
            else:
                self.durations.append(time.perf_counter() - self.started.pop(task, time.perf_counter()))
                t["done"] += 1
                t["resumed"] += stats.get("resumed_from", 0) > 0
                t["decode_s"] += stats["decode_s"]
                t["new_tokens"] += stats.get("new_tokens", 0)
                t["peak_device"] = max(t["peak_device"], stats["peak_device_bytes"])
                t["peak_rss"] = max(t["peak_rss"], stats["peak_host_rss_bytes"])
                for k, v in stats["bytes"].items():
                    t["bytes"][k] += v

    def summary(self):
        t = self.totals
        gib = lambda n: f"{n / 2**30:.2f} GiB"
        lines = [f"tasks: {t['done']} done, {len(t['failed'])} failed, {t['resumed']} resumed",
                 f"decode: {t['new_tokens']} tokens in {t['decode_s']:.1f}s of decoding",
                 f"peak: device {gib(t['peak_device'])}, host rss {gib(t['peak_rss'])}",
                 "bytes: " + ", ".join(f"{k} {gib(v)}" for k, v in t["bytes"].items())]
        lines += [f"FAILED {task}: {err}" for task, err in t["failed"]]
        return "\n".join(lines)

    def close(self):
        if self.trace:
            self.trace.close()
