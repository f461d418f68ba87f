"""
The buffers the store (offload.py) moves chunks between, and the small types it speaks in: where a
chunk lives (Loc), what must finish before a buffer is reused (Fence), chunk allocation with one
alignment in every tier, the host pool (pinned on CUDA by registering its exact bytes) and the
staging slots and group buffers prefetched chunks land in.
"""
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from disk import ALIGN, round_up


class OffloadError(RuntimeError):
    """The offload tiers cannot hold or move what they must; the message names the flag or path."""


def on_cuda(device):
    """Whether the store drives CUDA streams and pinned memory for `device`. The emulated CUDA
    tests patch this one function, so that the CUDA path runs (and is checked for races) on CPU
    tensors."""
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class Loc:
    """Where a sealed chunk lives: on the device, in slot `slot` of the host pool, or on disk."""
    tier: str       # "device" | "host" | "disk"
    slot: int = -1  # host pool slot, for the host tier


DEVICE = Loc("device")
DISK = Loc("disk")


@dataclass
class Fence:
    """What must finish before a buffer is reused: a copy out of it (a CUDA event) and/or a disk
    write (a future)."""
    event: Optional[object] = None
    future: Optional[Future] = None


def alloc_chunks(n, shape, dtype, device):
    """(flat buffer, n chunk tensors carved from it), each chunk starting on an ALIGN boundary, so
    that a chunk has the same alignment in every tier and every kernel sees identically laid out
    inputs."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    slot = round_up(nbytes, ALIGN)
    flat = torch.empty(max(n, 1) * slot + ALIGN, dtype=torch.uint8, device=device)
    base = (-flat.data_ptr()) % ALIGN  # the allocator's own alignment may be less than a page
    return flat, [flat[base + i * slot:base + i * slot + nbytes].view(dtype).view(shape)
                  for i in range(n)]


# the most consecutive chunks one kernel call reads (kvcache.chunk_groups): 16 x 512 positions, and
# at most 16 chunks of device memory where a group must be copied to be one tensor
GROUP_CHUNKS = 16


def group_run(n_chunks):
    """Chunks a CUDA group buffer holds for a task of n_chunks a layer: a block's run of host-pool
    chunks, and the window's chunks of the block copied in after it (prefetch.py); never the open
    chunk. The store sizes its buffers by it and the tuner counts them by it."""
    return min(GROUP_CHUNKS, n_chunks - 1)


def group_view(chunks, base):
    """Chunks [*shape] of one dtype as one tensor [n, *shape] without a copy, when they sit at one
    stride, in order, inside `base` (a flat uint8 tensor over their memory: a layer's device arena,
    the host pool, a layer's mapped disk file); None when they do not."""
    if base is None:
        return None
    first = chunks[0]
    size = first.element_size()
    step = chunks[1].data_ptr() - first.data_ptr() if len(chunks) > 1 else first.numel() * size
    start = first.data_ptr() - base.data_ptr()
    end = start + (len(chunks) - 1) * step + first.numel() * size
    if (step < first.numel() * size or step % size or start < 0 or start % size
            or end > base.numel() or not first.is_contiguous()
            or any(c.data_ptr() != first.data_ptr() + i * step for i, c in enumerate(chunks))):
        return None
    typed = base[:base.numel() // size * size].view(first.dtype)  # [bytes / size]
    return typed.as_strided((len(chunks), *first.shape), (step // size, *first.stride()),
                            typed.storage_offset() + start // size)


def chunk_runs(chunks, bases):
    """chunks (each a tensor [*shape]) cut into runs that are each one view [n, *shape]
    (group_view over the run's base, bases[i] being chunk i's buffer or None), in order. A run is
    the chunks that follow at one stride in one base, found in one pass (a decode step cuts every
    layer's groups: this is its hot loop); a run group_view refuses is its chunks one by one."""
    runs = []
    start = 0
    ptrs = [c.data_ptr() for c in chunks]
    for i in range(1, len(chunks) + 1):
        step = ptrs[start + 1] - ptrs[start] if start + 1 < len(chunks) else 0
        if (i < len(chunks) and bases[i] is bases[start] and bases[i] is not None
                and ptrs[i] == ptrs[start] + (i - start) * step):
            continue
        view = group_view(chunks[start:i], bases[start]) if i - start > 1 else None
        runs += [c[None] for c in chunks[start:i]] if view is None else [view]
        start = i
    return runs


class DeviceChunks:
    """The device tier's chunk buffers. One at a time, which the store recycles as chunks leave;
    or, with --offload none, every chunk of a layer side by side in one buffer, chunk
    j in slot j (handed out in the order the layer opens them), so that a group of consecutive
    chunks is one view for one kernel call (a layer's buffer is taken at its first chunk; on CPU
    its pages are touched only as chunks fill). And the group buffer, GROUP_CHUNKS slots that a
    group is copied into when it is not one view."""

    def __init__(self, n_layers, n_chunks, shape, dtype, device, mode, shared=None):
        self.n_chunks = n_chunks
        self.shape = shape
        self.dtype = dtype
        self.device = device
        # per layer: its arena, flat uint8
        self.flats = [None] * n_layers if mode == "none" else None
        self.chunks = [[] for _ in range(n_layers)]
        self.free = deque()  # (chunk, Fence) given back by the store: reusable once it passed
        self.made = 0  # buffers made (the arenas' count as their chunks are handed out)
        self.group = None  # [GROUP_CHUNKS, *shape], made at the first group that needs it
        self.group_slots = 0
        self.runs = chunk_runs
        self.kept_runs = {}  # (layer, first chunk, chunks) -> (their Locs, their runs)
        # (SharedArena, this task's index in it): the arenas are the batch's (mode none only)
        self.shared = shared

    def take(self, layer):
        """A chunk buffer for layer's next open chunk: one given back, else a new one."""
        if self.free:
            kv, fence = self.free.popleft()
            if fence.event is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(fence.event)  # rule 5: the copy out of it is done
            if fence.future is not None:
                fence.future.result()  # CPU: the writer has written it to disk
            return kv
        self.made += 1
        if self.flats is None:
            return alloc_chunks(1, self.shape, self.dtype, self.device)[1][0]
        if self.flats[layer] is None:
            if self.shared is None:
                self.flats[layer], chunks = alloc_chunks(self.n_chunks, self.shape, self.dtype,
                                                         self.device)
            else:  # this task's slots of the batch's arena, tasks apart
                arena, i = self.shared
                self.flats[layer], chunks = arena.task_chunks(layer, i)
            self.chunks[layer] = chunks[:self.n_chunks][::-1]  # popped from the end: slot 0 first
        return self.chunks[layer].pop()

    def runs_of(self, key, locs, cut):
        """A group's runs (key: layer, first chunk, chunks; locs: where each chunk is): the last
        step's while every chunk is where it was (device arena, host pool: the same views step
        after step, and a decode step cuts every layer's groups), else cut() afresh. A group with
        a chunk on disk is cut every time: a mapping may be remade."""
        kept = self.kept_runs.get(key)
        if kept is not None and kept[0] == locs:
            return kept[1]
        runs = cut()
        if DISK not in locs:
            self.kept_runs[key] = (locs, runs)
        return runs

    def arena(self, layer):
        """The flat buffer of layer's chunks, or None without arenas."""
        return None if self.flats is None else self.flats[layer]

    def gather(self, js, chunks, load, release):
        """Chunks js copied into the group buffer: [len(js), *shape]. chunks: those already loaded
        (in place), or None: load(j) each (staged), released once copied."""
        if self.group is None:
            flat, slots = alloc_chunks(GROUP_CHUNKS, self.shape, self.dtype, self.device)
            self.group = group_view(slots, flat)
            self.group_slots = GROUP_CHUNKS
        for i, j in enumerate(js):
            # on the compute stream: load made it wait for a staged slot's copy, release marks
            # the slot once this copy is issued
            self.group[i].copy_(chunks[i] if chunks else load(j))
            release(j)
        return self.group[:len(js)]


class SharedArena:
    """The arenas of up to `tasks` tasks that decode together (a batch's caches with --offload none
    on CPU: bench.py's batches, batcher.Batcher's tasks), one buffer per layer, task i's chunk j in
    slot j * tasks + i. A task's chunks still follow at one stride (`tasks` slots), so its groups
    are views as in an arena of its own; and chunk j of every task lies beside the others', so one
    kernel call attends the sealed chunks of the whole batch (grid; kvbatch.BatchedCaches): a
    decode step's calls per layer fall from one per task to one. A layer's buffer is made at the
    first chunk a task opens in it, its pages touched only as chunks fill; a task's index is
    taken as its store is made (join) and given back as it closes (leave), so a task that joins
    later reuses the slots of one that finished, over what that task wrote."""

    def __init__(self, tasks, n_chunks, shape, dtype, device):
        self.tasks = tasks          # task indices
        self.n_chunks = n_chunks    # chunks a layer holds per task
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.flats = {}             # layer -> (flat uint8 buffer, its chunk tensors in slot order)
        self.grids = {}             # (layer, n) -> grid(layer, n)
        self.grid_calls = 0         # layer steps attended through the grid (verify.py --batch)
        self.free = list(range(tasks - 1, -1, -1))  # indices no task holds, lowest last
        self.lock = threading.Lock()  # batch tasks make their stores on threads of their own

    def join(self, n_chunks, shape, dtype, device):
        """An index for a task whose chunks have this shape, dtype and device and that needs
        n_chunks a layer, or None: the arena is full, or its chunks are not the task's."""
        if (n_chunks > self.n_chunks or tuple(shape) != self.shape or dtype != self.dtype
                or torch.device(device) != self.device):
            return None
        with self.lock:
            return self.free.pop() if self.free else None

    def leave(self, i):
        with self.lock:
            self.free.append(i)
            self.free.sort(reverse=True)  # the lowest index next: a batch stays at the front

    def layer(self, layer):
        """(flat buffer, chunk tensors in slot order) of layer, made at its first use."""
        with self.lock:
            if layer not in self.flats:
                self.flats[layer] = alloc_chunks(self.n_chunks * self.tasks, self.shape,
                                                 self.dtype, self.device)
            return self.flats[layer]

    def task_chunks(self, layer, i):
        """(flat buffer, task i's chunk tensors of layer, chunk j at j)."""
        flat, chunks = self.layer(layer)
        return flat, chunks[i::self.tasks]

    def grid(self, layer, n):
        """Chunks 0..n-1 of every task index, one view [n * tasks, *shape]: row j * tasks + i is
        task i's chunk j (those of an index no task holds, or past a task's sealed chunks, hold
        whatever was written there last)."""
        view = self.grids.get((layer, n))
        if view is None:  # made once: every decode step of the batch asks for it
            flat, chunks = self.layer(layer)
            view = self.grids[(layer, n)] = group_view(chunks[:n * self.tasks], flat)
        return view


class HostPool:
    """`n` chunk slots in host memory, allocated once. With pin=True their exact bytes are
    page-locked by registering them with the CUDA driver, and unregistered at close(): torch's
    pinned allocator would round each request up to a power of two and keep it pinned until the
    process exits (a 9 GiB budget would pin 16 GiB, for good). A chunk keeps its slot until the
    task ends, and the chunks of one layer's block (GROUP_CHUNKS consecutive chunks, a group of
    attention's) get consecutive slots where the pool has room (take), so that on CUDA a group
    crosses to the device as one copy."""

    def __init__(self, n, shape, dtype, pin):
        self.flat, self.slots = alloc_chunks(n, shape, dtype, "cpu")
        self.free = set(range(n))  # slots no chunk has taken
        self.fresh = 0             # slots from here on: in no block's extent yet
        self.extents = {}          # block -> the first of its consecutive slots
        self.pinned_bytes = 0
        if pin and n:
            self.pinned_bytes = self.flat.numel()
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(self.flat.data_ptr(), self.pinned_bytes, 1)) != 0:
                raise OffloadError(f"cannot pin {self.pinned_bytes / 2**30:.2f} GiB of host memory "
                                   "for the host tier; lower --cpu-budget (or raise the "
                                   "locked-memory limit, ulimit -l)")

    def take(self, block, index, size):
        """A slot for the chunk at `index` of `block` (a layer's run of `size` <= GROUP_CHUNKS
        chunks): slot index of the block's extent, `size` consecutive slots reserved at its first
        chunk while that many were never reserved, else the highest free slot (a full pool, or a
        placement that sends a block's chunks elsewhere: only a copy per chunk is lost)."""
        if block not in self.extents and self.fresh + size <= len(self.slots):
            self.extents[block] = self.fresh
            self.fresh += size
        slot = self.extents[block] + index if block in self.extents else -1
        if slot not in self.free:
            slot = max(self.free)
        self.free.remove(slot)
        return slot

    def close(self):
        if self.pinned_bytes:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.pinned_bytes = 0


class GroupSlot:
    """Where a chunk staged by a group copy sits: chunk i of group buffer g, the last of its copy
    or not (its release frees the buffer)."""

    def __init__(self, g, i, last):
        self.g, self.i, self.last = g, i, last


class Staging:
    """`n` device slots that prefetched chunks land in, in attention's order, a few chunks ahead of
    it; on CUDA with a host tier also `groups` group buffers of `run` chunks each (GROUP_CHUNKS, or
    fewer where a layer offloads fewer), which a run of a layer's consecutive chunks lying side by
    side in the host pool fills with one copy
    (TieredStore._pump): two of them, so that one group crosses while attention reads the other.
    On CUDA each slot and group buffer has an event recorded when its copy is issued (ready) and
    one recorded when attention is done with it (released); both are recorded once at creation so
    that the first wait on them waits for nothing pending."""

    def __init__(self, n, shape, dtype, device, cuda, groups=0, run=GROUP_CHUNKS):
        self.flat, self.slots = alloc_chunks(n, shape, dtype, device)
        self.free = list(range(n - 1, -1, -1))
        self.queue = deque()     # (layer, j) to stage
        self.inflight = deque()  # (layer, j, slot or GroupSlot, future) staged
        self.group_flat, self.group_slots = alloc_chunks(groups * run, shape, dtype,
                                                         device) if groups else (None, [])
        # [run, *shape] each
        self.groups = [group_view(self.group_slots[g * run:(g + 1) * run], self.group_flat)
                       for g in range(groups)]
        self.group_free = deque(range(groups))
        if cuda:
            self.ready = [torch.cuda.Event() for _ in range(n)]
            self.released = [torch.cuda.Event() for _ in range(n)]
            self.group_ready = [torch.cuda.Event() for _ in range(groups)]
            self.group_released = [torch.cuda.Event() for _ in range(groups)]
            for e in self.ready + self.released + self.group_ready + self.group_released:
                e.record()  # rule 2, 3: first waits (load, refill, bounce refill) find it recorded

    def reset(self):
        """Every slot and group buffer free again (prefetch(), once nothing is in flight)."""
        self.queue.clear()
        self.free = list(range(len(self.slots) - 1, -1, -1))
        self.group_free = deque(range(len(self.groups)))
