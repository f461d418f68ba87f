"""
What a long job is doing: process memory, a trace with one event per step, alerts, and the closing
summary.

    --trace TRACE.jsonl   {"t", "task", "phase", "position", "device_allocated" (CUDA: the
                           allocator's; CPU: the KV bytes on the device tier), "device_peak",
                           "host_rss", "host_anon", "bytes": {h2d, d2h, disk_write, disk_read} moved
                           since the task's last event (and window_skipped: KV bytes outside every
                           sliding window, so not read at all), "chunks": {device, host, disk}},
                           plus {"alert": ...} events
    alerts (stderr + trace): a task running over 2x the time that the finished tasks' mean rates
    (seconds per prompt token, per generated token) give for the work it has done; host memory over
    80% of the machine's RAM (the job is about to swap); offload configured but no chunk leaving the
    device once the context has outgrown the window (offload is not in effect).
tools/plot_trace.py draws a trace.
"""
import json
import os
import sys
import threading
import time

import torch

from policy import SELECTIONS, plan_tiers
from private import PrivateError, open_private, what_is_wrong

STATUS_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}  # /proc/self/status -> ours
SLOW_FLOOR_S = 1.0  # the slow-task alert: how late a task must be at least, besides 2x


def host_memory():
    """Resident memory of this process in bytes: total, anonymous (what it really holds) and
    file-backed (mapped pages, e.g. the disk tier, that the OS may evict)."""
    out = {"rss": 0, "anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in STATUS_FIELDS:
                    out[STATUS_FIELDS[key]] = int(val.split()[0]) * 1024
    except OSError:  # not Linux: the peak RSS is all we can get
        import resource
        out["rss"] = out["anon"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def total_ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def mem_available():
    """Bytes the kernel says can be allocated without swapping (MemAvailable);
    0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_io():
    """Bytes this process has asked of storage so far (/proc/self/io read_bytes, write_bytes): the
    real device I/O, unlike reads through a mapping that the page cache serves. Zeros where the
    kernel does not say."""
    out = {"storage_read": 0, "storage_write": 0}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key == "read_bytes":
                    out["storage_read"] = int(val)
                elif key == "write_bytes":
                    out["storage_write"] = int(val)
    except OSError:
        pass
    return out


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def progress_line(stats, n_prompt, n_new):
    """The statistics line generate.py prints on stderr after one prompt. Prefill counts the prompt
    tokens computed (not those reused from --kv-store or restored by a resume); decode counts the
    decode steps, one fewer than the n_new tokens, since prefill's logits give the first."""
    b = stats["bytes"]
    c = stats["chunks"]
    io = stats["io"]
    computed = stats.get("prefill_tokens", n_prompt)
    prefill = f"prefill {computed} tok"
    if computed != n_prompt:
        prefill += f" of {n_prompt}"
    parts = [
        f"{prefill} {stats['prefill_s']:.2f}s ({stats['prefill_tokens_per_s']:.1f} tok/s)",
        f"new {n_new} tok, decode {stats['decoded_tokens']} tok "
        f"{stats['decode_tokens_per_s']:.1f} tok/s",
        f"peak device {fmt_bytes(stats['peak_device_bytes'])}",
        f"host rss {fmt_bytes(stats['peak_host_rss_bytes'])} "
        f"(anon {fmt_bytes(stats['peak_host_anon_bytes'])})",
        f"chunks device/host/disk {c['device']}/{c['host']}/{c['disk']}",
        f"h2d {fmt_bytes(b['h2d'])} d2h {fmt_bytes(b['d2h'])}",
        f"disk tier: write {fmt_bytes(b['disk_write'])} read {fmt_bytes(b['disk_read'])} "
        f"attended in place {fmt_bytes(b['disk_mapped_read'])}",
        f"storage I/O read {fmt_bytes(io['storage_read'])} "
        f"write {fmt_bytes(io['storage_write'])}",
    ]
    spec = stats.get("speculation")
    if spec:  # speculate.summary
        parts.append(f"{spec['speculate']}: {spec['guesses_kept']} of {spec['guesses_proposed']} "
                     f"guesses kept, {spec['tokens_per_step']:.2f} tok/step, KV "
                     f"{fmt_bytes(spec['kv_bytes_per_token'])}/tok, guessing "
                     f"{spec['draft_s']:.2f}s")
    for kind in ("attention", "products"):
        if stats.get(f"{kind}_build_s"):
            parts.append(f"decode {kind} compiled in {stats[f'{kind}_build_s']:.1f}s (before the "
                         "prompt, in none of these times; cached for later runs)")
    if stats.get("resumed_from"):
        parts.append(f"resumed from position {stats['resumed_from']}")
    return " | ".join(parts)


def open_trace(path):
    """--trace PATH for appending, line-buffered: created 0600, never through a link at its name
    (private.open_private); a path that cannot be is one ValueError sentence."""
    try:
        fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except (OSError, PrivateError) as e:
        why = what_is_wrong(e)
        raise ValueError(f"--trace {path}: cannot be opened ({why}); choose another file") from None
    return os.fdopen(fd, "a", buffering=1)


def print_to_stderr(msg):
    print(msg, file=sys.stderr, flush=True)


def gib(n):
    return f"{n / 2**30:.2f} GiB"


class Monitor:
    """Shared by all tasks of a run (thread-safe): writes the trace, raises alerts,
    keeps totals for the summary."""

    def __init__(self, trace_path=None, log=None, ram=None):
        # appended to: runs accumulate; private, as it holds the prompts' positions and timings
        self.trace = open_trace(trace_path) if trace_path else None
        self.log = log or print_to_stderr
        self.ram = total_ram() if ram is None else ram
        self.lock = threading.Lock()
        self.started = {}  # task -> (start time, prompt tokens)
        self.last = {}     # task -> bytes at its last event
        # of finished tasks
        self.rates = {"prefill_s": 0.0, "prompt_tokens": 0, "decode_s": 0.0, "decoded": 0}
        self.alerted = set()
        self.totals = {"done": 0, "failed": [], "resumed": 0, "new_tokens": 0, "decode_s": 0.0,
                       "peak_device": 0, "peak_rss": 0, "bytes": {}}
        # where a run begins
        self._emit({"t": time.time(), "run_start": {"pid": os.getpid(), "argv": sys.argv}})

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

    def task_started(self, task, prompt_tokens=0):
        with self.lock:
            self.started[task] = (time.perf_counter(), prompt_tokens)

    def expected_s(self, prompt_tokens, position):
        """How long a task should take to reach `position`, at the mean rates of the finished tasks:
        prefill seconds per prompt token and decode seconds per generated token. None before any
        task has finished."""
        done = self.rates
        if not done["prompt_tokens"] and not done["decoded"]:
            return None
        prefill = done["prefill_s"] / max(done["prompt_tokens"], 1)
        decode = done["decode_s"] / max(done["decoded"], 1)
        return min(position, prompt_tokens) * prefill + max(0, position - prompt_tokens) * decode

    def step(self, task, phase, cache):
        """After each forward step of a task: one trace event, and the alerts that fire mid-task."""
        snap = cache.store.snapshot(cache.length % cache.chunk_size)
        mem = host_memory()
        moved = snap["bytes"]
        prev = self.last.get(task, {k: 0 for k in moved})
        self.last[task] = moved
        device = cache.store.device
        if cache.store.cuda:
            allocated = torch.cuda.memory_allocated(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            allocated = snap["kv_device_bytes"]
            peak = snap["kv_device_bytes_peak"]
        self._emit({
            "t": time.time(),
            "task": task,
            "phase": phase,
            "position": cache.length,
            "device_allocated": allocated,
            "device_peak": peak,
            "host_rss": mem["rss"],
            "host_anon": mem["anon"],
            "bytes": {k: moved[k] - prev[k] for k in moved},
            "chunks": snap["chunks"],
        })
        if self.ram and mem["rss"] > 0.8 * self.ram:
            self.alert("host_memory", f"host memory {mem['rss'] / 2**30:.1f} GiB is over 80% of "
                       f"this machine's {self.ram / 2**30:.1f} GiB: the job is about to swap; "
                       "lower --batch-size or --cpu-budget")
        chunks = snap["chunks"]
        left_device = chunks["host"] + chunks["disk"]
        # where the chunks should be by now: plan_tiers counts the next position's chunk as open
        n_layers = cache.store.n_layers
        plan = plan_tiers(cache.length + 1, cache.chunk_size, snap["window"], n_layers)
        if snap["offloading"] and plan.offloaded and left_device == 0:
            self.alert("offload_not_in_effect", f"task {task}: {cache.n_sealed} chunks sealed per "
                       f"layer, window {snap['window']}: {plan.offloaded // n_layers} per layer "
                       "should have left the device, yet none did: offload is not in effect", task)
        with self.lock:
            began, prompt_tokens = self.started.get(task, (time.perf_counter(), 0))
            expected = self.expected_s(prompt_tokens, cache.length)
        elapsed = time.perf_counter() - began
        # per unit of work (a longer task is not a slow one), and a second late at least (a task of
        # milliseconds is late by noise alone)
        if expected and elapsed > max(2 * expected, expected + SLOW_FLOOR_S):
            self.alert("slow_task", f"task {task} has run {elapsed:.1f}s to position "
                       f"{cache.length}, over 2x the {expected:.1f}s that the mean rates of "
                       "finished tasks give for that much work", task)

    def context_stayed_on_device(self, task, stats, positions, chunk_size, window, n_layers):
        """Offload configured, yet the whole context fitted in the device window: say so once,
        with the fix. positions: prompt plus generated tokens (the last one is never written)."""
        c = stats["chunks"]
        if c["host"] + c["disk"] == 0:
            per_layer = plan_tiers(positions, chunk_size, window, n_layers).per_layer
            chunks = "chunk" if per_layer == 1 else "chunks"
            self.log(f"task {task}: offload is on, but the context ({per_layer} {chunks} per layer "
                     f"of {chunk_size} positions, counting the open one) fits in the device window "
                     f"(--window {window}), so nothing left the device; lower --window or "
                     "--chunk-size to offload")

    def selection_read_everything(self, task, stats, cfg, positions, chunk_size):
        """A --select configured, yet every decode step read every sealed chunk (its budget, with
        the first chunk and the window, covers the context): the output is exact attention's. Said
        once, with the fix, as context_stayed_on_device says it of offload."""
        if cfg.select == "all" or not stats["decoded_tokens"] or stats["bytes"]["select_skipped"]:
            return
        if SELECTIONS[cfg.select].reads_all:  # it reads every chunk by design, merges a choice
            return
        sealed = (positions - 1) // chunk_size  # per layer, at the last decode step
        budget = (f"the budget of {cfg.select_budget} tokens, the first chunk and the window "
                  f"(--window {cfg.window})" if cfg.select_budget else
                  f"the first chunk and the window (--window {cfg.window})")
        fix = "--select-budget" if cfg.select_budget else "--window"
        self.log(f"task {task}: --select {cfg.select} read every sealed chunk at every decode "
                 f"step: {budget} cover all {sealed} sealed chunks of {chunk_size} positions per "
                 f"layer, so the output is --select all's; lower {fix} or --chunk-size for it to "
                 "select")

    def task_finished(self, task, stats=None, error=None):
        with self.lock:
            t = self.totals
            self.started.pop(task, None)
            if error is not None:
                t["failed"].append((task, error))
                return
            # the prompt tokens this run computed (a resumed or reused prefix took no time here)
            for key, stat in (("prefill_s", "prefill_s"), ("prompt_tokens", "prefill_tokens"),
                              ("decode_s", "decode_s"), ("decoded", "decoded_tokens")):
                self.rates[key] += stats.get(stat, 0)
            t["done"] += 1
            t["resumed"] += stats.get("resumed_from", 0) > 0
            t["decode_s"] += stats["decode_s"]
            # replayed tokens of a resumed task: not decoded
            t["new_tokens"] += stats.get("decoded_tokens", 0)
            t["peak_device"] = max(t["peak_device"], stats["peak_device_bytes"])
            t["peak_rss"] = max(t["peak_rss"], stats["peak_host_rss_bytes"])
            for k, v in stats["bytes"].items():
                t["bytes"][k] = t["bytes"].get(k, 0) + v

    def summary(self, totals=None, failures=True):
        """The closing lines of a batch: this process's totals, or the `totals` given (a whole
        torchrun batch); failures: with a FAILED line for each (a replica's own summary leaves
        them to the whole batch's, so that each is said once)."""
        t = totals or self.totals
        rate = ""
        if t.get("wall_s"):
            rate = (f" at {t['new_tokens'] / t['wall_s']:.1f} tok/s over the batch's "
                    f"{t['wall_s']:.1f}s")
        # the tasks in flight decode at once: their times add up to more than the batch's
        lines = [f"tasks: {t['done']} done, {len(t['failed'])} failed, {t['resumed']} resumed",
                 f"decode: {t['new_tokens']} tokens{rate}; the tasks' decode times, added up: "
                 f"{t['decode_s']:.1f}s",
                 f"peak: device {gib(t['peak_device'])}, host rss {gib(t['peak_rss'])}",
                 "bytes: " + (", ".join(f"{k} {gib(v)}" for k, v in t["bytes"].items())
                              or "none moved (no task ran)")]
        if t.get("batched_steps"):
            per_step = t["batched_rows"] / t["batched_steps"]
            lines.append(f"batched: {t['batched_steps']} decode steps for {t['batched_rows']} "
                         f"tokens, shared by {per_step:.1f} tasks on average")
        lines += [f"FAILED {task}: {err}" for task, err in t["failed"] if failures]
        return "\n".join(lines)

    def close(self):
        if self.trace:
            self.trace.close()
