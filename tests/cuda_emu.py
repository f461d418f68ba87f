"""
An emulated torch.cuda, on CPU tensors, so the store's CUDA path (copy stream, events, pinned pools,
staging slots, bounce buffers) runs in CI and a missing wait fails a test.

    # torch.cuda.* and offload.on_cuda patched; store verbs hooked
    with cuda_emu.emulate() as emu:
        # the store believes it runs on CUDA; its tensors are CPU tensors
        run_task(model_on_cpu, ...)
    # races, waits on nothing, copies left queued at close, pageable copies
    assert emu.problems() == []

What runs when:
  * A copy_ issued while a side stream is current is DEFERRED: queued on that stream and executed
    only when something orders it: event.synchronize / stream.synchronize / torch.cuda.synchronize
    (host waits), or a compute access after the compute stream's wait_event. That is as late as CUDA
    allows, so a read that skips its wait sees stale bytes (and the logits differ), and a buffer
    refilled too early is refilled under the pending copy.
  * Work on a thread's compute stream runs at once, in the host's program order (a simplification:
    on a GPU it runs later; the race detector still treats the compute stream as an actor of its
    own, behind the host).
Happens-before is tracked by race.py's vector clocks. The compute stream's accesses cannot be seen
op by op, so the store's verbs are hooked (see emu_store.py): open_chunk is a compute write of the
open chunk, load a compute read of the chunk it returns; DiskTier.read_into / write are host
accesses of the worker thread; the executor's submit/result and the store's queues (the write
bounces' hand-back) carry clocks between threads.
"""
import queue
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

import fewrows
from race import Actor, Detector

# the real functions, which the emulation patches over
_copy = torch.Tensor.copy_
_empty = torch.empty
EMU = None  # the emulator installed by emulate(), or None


def span(t):
    """The bytes [start, end) a tensor's elements cover (its strides' extent, for non-contiguous
    views)."""
    n = 0
    if t.numel():
        n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + n * t.element_size()


def caller():
    """The first frame outside the emulator: offload.py:196 _stage, say."""
    f = sys._getframe(1)
    emulator_files = ("cuda_emu.py", "race.py", "emu_store.py")
    while f is not None and f.f_code.co_filename.endswith(emulator_files):
        f = f.f_back
    if f is None:
        return "?"
    file_name = f.f_code.co_filename.rsplit("/", 1)[-1]
    return f"{file_name}:{f.f_lineno} {f.f_code.co_name}"


class Stream:
    """A stream: a FIFO of operations (copies, waits) that run when something orders them."""

    def __init__(self, device=None, priority=0, name=None, compute=False):
        kind = "compute" if compute else "copy"
        self.actor = Actor(name or f"copy stream #{len(EMU.streams)}", kind)
        self.compute = compute
        self.ops = deque()   # side stream: (seq, op) not run yet
        self.issued = 0      # operations issued so far; an event records this position
        self.done = 0        # operations run so far
        self.waits = []      # compute stream: (stream, position) to reach before its next operation
        EMU.streams.append(self)

    def wait_event(self, event):
        EMU.wait_event(self, event)

    def wait_stream(self, other):
        self.wait_event(other.record_event())

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        EMU.sync_stream(self)

    def query(self):
        return not self.ops

    def __repr__(self):
        return f"<emulated {self.actor.name}>"


class Event:
    """An event: the position of a stream's queue and the stream's clock when it was recorded."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.stream = None    # the stream it was last recorded on
        self.pos = 0          # that stream's position then
        self.vc = None        # and its clock
        self.where = caller()

    def record(self, stream=None):
        EMU.record(self, stream)

    def wait(self, stream=None):
        (stream or EMU.current()).wait_event(self)

    def synchronize(self):
        EMU.sync_event(self)

    def query(self):
        """True once the recorded work has run (never forces it: a spin would hang); True orders the
        host after it."""
        if self.stream is None:
            return True
        if self.stream.done < self.pos:
            return False
        EMU.join(self.vc)
        return True


class Emulator:
    """The state of one emulation: streams, pinned ranges, the race detector, and what it found."""

    def __init__(self):
        self.lock = threading.RLock()
        self.det = Detector()
        self.local = threading.local()
        self.streams = []
        self.pinned = {}      # start -> end of each pinned byte range
        self.findings = []
        self.unrecorded = {}  # event -> where it was first waited on while not yet recorded
        # True: even a first wait before the first record is a problem, not only a dead wait
        self.strict = False
        self.stats = {"deferred": 0, "forced": 0, "max_queue": 0, "waits_on_unrecorded": 0}
        self.n_threads = 0
        self.device_bytes = 0
        self.peak_bytes = 0

    # ---- the calling thread ----------------------------------------------------------------------

    def host(self):
        if not hasattr(self.local, "actor"):
            with self.lock:
                self.n_threads += 1
                name = threading.current_thread().name
                self.local.actor = Actor(f"host thread {name}#{self.n_threads}", "host")
                self.local.compute = Stream(name=f"compute stream of {name}#{self.n_threads}",
                                            compute=True)
                self.local.current = self.local.compute
        return self.local.actor

    def current(self):
        self.host()
        return self.local.current

    def compute(self):
        self.host()
        return self.local.compute

    # ---- stream operations ----------------------------------------------------------------------

    def issue(self, s):
        """The host hands an operation to stream s: s runs it after the host's earlier work."""
        if s.compute:
            self.run_waits(s)
        self.det.join(s.actor, self.det.send(self.host()))

    def run_waits(self, s):
        """Compute stream: its next operation runs now, so first whatever it waits for."""
        waits, s.waits = s.waits, []
        for other, pos in waits:
            self.run_until(other, pos)

    def run_until(self, s, pos):
        """Run stream s's queued operations up to position pos (recursively through the waits they
        carry)."""
        while s.done < pos and s.ops:
            _, op = s.ops.popleft()
            if op[0] == "copy":
                _copy(op[1], op[2])
                self.stats["forced"] += 1
            else:
                self.run_until(op[1], op[2])
            s.done += 1
        s.done = max(s.done, min(pos, s.issued))

    def record(self, event, stream=None):
        with self.lock:
            s = stream or self.current()
            self.issue(s)
            event.stream = s
            event.pos = s.issued
            event.vc = self.det.send(s.actor)
            if not self.strict:
                self.unrecorded.pop(event, None)

    def wait_event(self, s, event):
        with self.lock:
            self.issue(s)
            # CUDA returns at once: a no-op, fine for a first use, a bug if it stays one
            if event.stream is None:
                self.unrecorded.setdefault(event, f"{s.actor.name} waits at {caller()}")
                self.stats["waits_on_unrecorded"] += 1
                return
            self.det.join(s.actor, event.vc)
            if event.stream is s:
                return
            if s.compute:
                s.waits.append((event.stream, event.pos))
            else:
                s.issued += 1
                s.ops.append((s.issued, ("wait", event.stream, event.pos)))

    def sync_event(self, event):
        with self.lock:
            if event.stream is None:
                where = f"{self.host().name} synchronizes at {caller()}"
                self.unrecorded.setdefault(event, where)
                self.stats["waits_on_unrecorded"] += 1
                return
            self.run_until(event.stream, event.pos)
            self.det.join(self.host(), event.vc)

    def sync_stream(self, s):
        with self.lock:
            if s.compute:
                self.run_waits(s)
            else:
                self.run_until(s, s.issued)
            self.det.join(self.host(), self.det.send(s.actor))

    def synchronize(self, device=None):
        with self.lock:
            for s in list(self.streams):
                self.sync_stream(s)

    def copy(self, dst, src, non_blocking=False):
        with self.lock:
            s = self.current()
            self.issue(s)
            where = caller()
            self.det.access(s.actor, *span(src), False, f"{where} (copy_ source)")
            self.det.access(s.actor, *span(dst), True, f"{where} (copy_ destination)")
            if s.compute:
                return _copy(dst, src, non_blocking)
            if not (self.is_pinned(src) or self.is_pinned(dst)):
                self.findings.append(f"{where}: an asynchronous copy on {s.actor.name} with no "
                                     f"pinned side; on CUDA a pageable host buffer makes it "
                                     f"synchronous")
            s.issued += 1
            s.ops.append((s.issued, ("copy", dst, src)))
            self.stats["deferred"] += 1
            self.stats["max_queue"] = max(self.stats["max_queue"], len(s.ops))
            if not non_blocking:  # a blocking copy: the host waits for it
                self.run_until(s, s.issued)
                self.det.join(self.host(), self.det.send(s.actor))
            return dst

    # ---- accesses the store's hooks report -------------------------------------------------------

    def compute_access(self, t, write, where):
        with self.lock:
            s = self.compute()
            self.issue(s)
            self.det.access(s.actor, *span(t), write, where)

    def host_access(self, t, write, where):
        with self.lock:
            self.det.access(self.host(), *span(t), write, where)

    def send(self):
        with self.lock:
            return self.det.send(self.host())

    def join(self, snap):
        with self.lock:
            self.det.join(self.host(), snap)

    # ---- memory ---------------------------------------------------------------------------------

    def pin(self, t):
        start, end = span(t)
        with self.lock:
            self.pinned[start] = end
        return t

    def is_pinned(self, t):
        start, end = span(t)
        return any(s <= start and end <= e for s, e in self.pinned.items())

    def register(self, t, name, kind):
        with self.lock:
            self.det.register(*span(t), name, kind)
            if kind == "device":
                self.device_bytes += t.numel() * t.element_size()
                self.peak_bytes = max(self.peak_bytes, self.device_bytes)

    def rename(self, t, name, kind):
        """A registered buffer's role, once the store has said what it is (a host pool slot is no
        device memory)."""
        with self.lock:
            b = self.det.buffer_at(span(t)[0])
            if b is not None and b.kind == "device" and kind != "device":
                self.device_bytes -= t.numel() * t.element_size()
            self.det.rename(span(t)[0], name, kind)

    def problems(self):
        """Everything that would be a bug on a GPU: races, waits on events never recorded, and the
        findings."""
        never = []
        for e, w in self.unrecorded.items():
            if e.stream is None:
                when = "never recorded"
            elif self.strict:
                when = "before its first record"
            else:
                continue
            never.append(f"waits on an event {when} (created at {e.where}): {w}; "
                         f"the wait orders nothing")
        return never + list(self.det.races) + list(self.findings)


class ClockedExecutor(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose futures carry happens-before: caller -> task at submit, task ->
    caller at result() / exception()."""

    def submit(self, fn, *args, **kwargs):
        emu = EMU
        snap = emu.send()
        box = {}  # "vc": the task's clock when it ended

        def task():
            emu.join(snap)
            try:
                return fn(*args, **kwargs)
            finally:
                box["vc"] = emu.send()
        fut = super().submit(task)
        for name in ("result", "exception"):
            def waited(timeout=None, _orig=getattr(fut, name)):
                try:
                    return _orig(timeout)
                finally:
                    if "vc" in box:
                        emu.join(box["vc"])
            setattr(fut, name, waited)
        return fut


class ClockedQueue(queue.Queue):
    """A queue.Queue that hands buffers between threads: a get is ordered after the put of the item
    it returns."""

    def __init__(self, maxsize=0):
        super().__init__(maxsize)
        self.emu = EMU

    def put(self, item, block=True, timeout=None):
        super().put((self.emu.send(), item), block, timeout)

    def get(self, block=True, timeout=None):
        snap, item = super().get(block, timeout)
        self.emu.join(snap)
        return item


class _CudaRT:
    """torch.cuda.cudart(): registering ordinary host memory as pinned."""

    def cudaHostRegister(self, ptr, size, flags):
        with EMU.lock:
            EMU.pinned[ptr] = ptr + size
        return 0

    def cudaHostUnregister(self, ptr):
        with EMU.lock:
            EMU.pinned.pop(ptr, None)
        return 0


@contextmanager
def _stream_ctx(s):
    emu = EMU
    if s is None:
        yield
        return
    prev = emu.current()
    emu.local.current = s
    try:
        yield s
    finally:
        emu.local.current = prev


def _empty_pinned(*size, pin_memory=False, **kwargs):
    t = _empty(*size, **kwargs)
    return EMU.pin(t) if pin_memory and EMU is not None else t


def _copy_(self, src, non_blocking=False):
    if EMU is None:
        return _copy(self, src, non_blocking)
    return EMU.copy(self, src, non_blocking)


def _pin_memory(self, device=None):
    return EMU.pin(self.clone())


def _reset_peak_memory_stats(device=None):
    EMU.peak_bytes = EMU.device_bytes


@contextmanager
def emulate(strict_waits=False):
    """Install the emulated CUDA and the store hooks; restore everything on exit. A wait on an event
    not yet recorded is allowed if it is recorded later (a no-op, as on CUDA); strict_waits (the
    store's tests) reports every one."""
    global EMU
    import emu_store
    cuda = torch.cuda
    patches = [
        (cuda, "is_available", lambda: True),
        (cuda, "device_count", lambda: 1),
        (cuda, "Stream", Stream),
        (cuda, "Event", Event),
        (cuda, "stream", _stream_ctx),
        (cuda, "current_stream", lambda device=None: EMU.current()),
        (cuda, "default_stream", lambda device=None: EMU.compute()),
        (cuda, "synchronize", lambda device=None: EMU.synchronize(device)),
        (cuda, "memory_allocated", lambda device=None: EMU.device_bytes),
        (cuda, "max_memory_allocated", lambda device=None: EMU.peak_bytes),
        (cuda, "reset_peak_memory_stats", _reset_peak_memory_stats),
        (cuda, "cudart", lambda: _CudaRT()),
        (torch, "empty", _empty_pinned),
        (torch.Tensor, "copy_", _copy_),
        (torch.Tensor, "pin_memory", _pin_memory),
        (torch.Tensor, "is_pinned", lambda self, device=None: EMU.is_pinned(self)),
        # CUDA never runs the CPU's compiled kernel (and inductor cannot build under these
        # patches): torch's fused kernels, as on a GPU
        (fewrows, "KERNEL", "flash"),
    ] + emu_store.patches()
    # what each patch replaces; None: inherited, deleted on exit
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    EMU = Emulator()
    EMU.strict = strict_waits
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield EMU
    finally:
        for obj, name, old in reversed(saved):
            if old is not None:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        EMU = None
