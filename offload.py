"""
Where the bytes of the KV cache live, and how they move between the tiers.

    compute device            host memory                     disk (one directory per task)
    +------------------+      +------------------------+      +-------------------------------+
    | open chunk       | seal | host pool, allocated   |      | layer{l}.kv  np.memmap, chunk |
    | window of W most |----->| once, its exact bytes  |      |   j at byte j * slot_bytes    |
    | recent chunks    | evict|  pinned on CUDA        |      | layer{l}.zst zstd blobs +     |
    | staging slots    |<-----+------------------------+      |   an index (--compress zstd)  |
    +------------------+  prefetch (copy stream / reader thread) <------------------------------+

A chunk is the K and V of C consecutive positions of one layer: a [2, B, G, C, D] tensor (K at [0],
V at [1]). The store's verbs, in the order generate.forward calls them:
    prefetch(reads) start of a step: queue the chunks it reads that are off the device, in order
    open_chunk(l)   the device buffer that layer l writes this step's K and V into
    load(l, j)      chunk j of layer l, a device tensor (waits for its prefetch if it was staged)
    load_group(l, js) consecutive chunks js of layer l as one [n, ...] tensor (one kernel call)
    release(l, j)   attention is done with it; its staging slot may be refilled
    seal(j)         chunk j is full on every layer: joins the window; the placement's victim leaves
    close()         stop the workers, give back pinned memory, close the files
The store moves bytes; which chunks a step reads is the cache's selection, which leave the device
the placement. DeviceChunks, HostPool and Staging (pools.py) hold them; a reader thread (disk
reads, zstd) and a writer thread (disk writes, syncs) move them, so that a chunk boundary never
delays the next prefetch. The staging verbs (prefetch, release: what crosses ahead of attention,
and how) are the store's Prefetcher half, in prefetch.py.

Stream ordering on CUDA. Missing synchronisation between the compute stream and a copy stream
corrupts KV silently, so every wait is marked in the code as "rule N":
    1. a device-to-host copy of a sealed chunk waits for the compute that wrote it;
    2. compute that reads a staged chunk waits for the copy that brought it;
    3. a staging slot is overwritten only after the compute that last read it has finished;
    4. a pinned host buffer is read (by the CPU or a copy) only after the copy into it has
       finished, and refilled only after the copy out of it has finished;
    5. a buffer is reused (a device buffer given back to the pool) or freed only after the copies
       using it finish.
Evictions and prefetches run on two streams, so neither queues behind the other. On CPU ("device"
and host are one memory) host and raw disk chunks are read in place (a disk chunk is a view of the
mapped file: page cache); with zstd the reader decompresses chunks into staging slots.
"""
import queue
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from disk import ALIGN, DiskTier, as_bytes, round_up
from policy import Placement, host_budget_refusal, plan_tiers
from pools import (
    DEVICE,
    DISK,
    GROUP_CHUNKS,
    DeviceChunks,
    Fence,
    GroupSlot,
    HostPool,
    Loc,
    OffloadError,
    Staging,
    group_run,
    on_cuda,
)
from prefetch import Prefetcher
from private import PrivateError, make_private_dir

MODES = ("none", "cpu", "disk")
COMPRESSIONS = ("none", "zstd")


@dataclass
class OffloadConfig:
    mode: str = "none"         # none | cpu | disk: where sealed chunks beyond the window go
    window: int = 4            # W: most recent sealed chunks per layer kept on the device
    cpu_budget_gib: Optional[float] = None  # host tier before the disk; None: all (cpu), 0: disk
    budget_note: str = ""      # said after the budget in a refusal: a batch's task holds a share
    offload_dir: str = "./kv_cache_offload"  # the disk tier lives in offload_dir/task_<id>/
    compress: str = "none"     # none | zstd (lossless: output stays bit-identical)
    staging_slots: int = 4     # chunks prefetched ahead of attention (device buffers on CUDA)
    group_buffers: int = 2     # CUDA, host tier: buffers a host-pool run crosses into as one copy
    keep_files: bool = False   # keep the task's directory after success; always kept on failure
    # what a decode step reads (policy.py): --select, --select-budget tokens, --select-dense layers
    select: str = "all"
    select_budget: Optional[int] = None
    select_dense: Optional[int] = None
    placement: str = "default"  # where a chunk that leaves the device goes (policy.PLACEMENTS)


# -----------------------------------------------------------------------------
# the store

class TieredStore(Prefetcher):
    """The chunks of one task (one sequence batch) across device, host and disk. Every keyword has
    one meaning: shape/dtype of a chunk, n_layers, max_length (positions the task may reach),
    device, cfg (OffloadConfig); disk_path (the task's directory), restore (a manifest's "chunks",
    to resume from) and on_durable(n, chunks), called on the writer thread once chunks 0..n-1 of
    every layer are on disk and synced, with their checksums; placement (policy.Placement); arena
    (a batch's pools.SharedArena, which holds the device chunks with --offload none on CPU)."""

    def __init__(self, *, shape, dtype, n_layers, max_length, device, cfg, disk_path=None,
                 restore=None, on_durable=None, placement=None, arena=None):
        C = shape[3]
        if cfg.mode not in MODES or cfg.compress not in COMPRESSIONS:
            raise OffloadError(f"--offload must be one of {MODES} and --compress one of "
                               f"{COMPRESSIONS}")
        if cfg.compress == "zstd" and cfg.mode != "disk":
            raise OffloadError("--compress zstd applies to the disk tier only; add --offload disk")
        if C < 1 or cfg.window < 0 or cfg.staging_slots < 1 or cfg.group_buffers < 0:
            raise OffloadError("--chunk-size and staging slots must be >= 1, --window and "
                               "--group-buffers >= 0")
        self.shape = shape
        self.dtype = dtype
        self.n_layers = n_layers
        self.max_length = max_length
        self.cfg = cfg
        self.chunk_size = C
        self.device = torch.device(device)
        self.cuda = on_cuda(device)
        self.chunk_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = round_up(self.chunk_bytes, ALIGN)
        self.n_chunks = -(-max_length // C)  # chunks per layer for max_length
        self.window = self.n_chunks if cfg.mode == "none" else cfg.window
        self.placement = placement or Placement()  # policy.py: which chunk leaves, and where to
        # bytes moved between tiers, and (kvcache.py counts these) bytes of sealed chunks attention
        # read, and skipped: outside every query's sliding window, or left out by a --select
        self.bytes = {"h2d": 0, "d2h": 0, "disk_write": 0, "disk_read": 0, "disk_mapped_read": 0,
                      "host_read": 0, "kv_read": 0, "window_skipped": 0, "select_skipped": 0}
        self.count_lock = threading.Lock()

        # the device tier: each layer's open chunk, the window, its buffers (self.chunks)
        self.open = [None] * n_layers
        self.resident = {}   # (layer, j) -> device chunk [2, B, G, C, D]
        self.on_device = [[] for _ in range(n_layers)]  # per layer: its resident j, ascending
        self.loc = {}        # (layer, j) -> Loc of every sealed chunk
        self.peak_device_bytes = 0
        self.chunks = DeviceChunks(n_layers, self.n_chunks, shape, dtype, device, cfg.mode)

        # the host tier, sized to what the task can need (policy.plan_tiers)
        budget_slots = None
        if cfg.cpu_budget_gib is not None:
            budget_slots = int(cfg.cpu_budget_gib * 2**30) // self.slot_bytes
        plan = plan_tiers(max_length, C, self.window, n_layers, cfg.mode, budget_slots)
        refusal = host_budget_refusal(plan, cfg.cpu_budget_gib, self.slot_bytes, cfg.budget_note)
        if refusal:
            raise OffloadError(refusal)
        self.host = HostPool(plan.host, shape, dtype, pin=self.cuda)

        # the disk tier and two threads: the reader (prefetch) and the writer (writes, then syncs)
        self.disk = None
        self.written = {}  # (layer, j) -> future of its disk write
        self.on_durable = on_durable
        self.disk_prefix = 0  # chunks < disk_prefix: on disk
        self.durable = None
        self.own_dir = None  # a directory of our own when no task gave one: removed at close()
        if cfg.mode == "disk":
            if disk_path is None:  # a private directory of our own (mkdtemp: 0700, a new name)
                try:
                    make_private_dir(cfg.offload_dir, "--offload-dir")
                except PrivateError as e:
                    raise OffloadError(str(e)) from None
                disk_path = self.own_dir = tempfile.mkdtemp(prefix="kv-", dir=cfg.offload_dir)
            try:
                self.disk = DiskTier(disk_path, n_layers, self.n_chunks, shape, dtype,
                                     cfg.compress, restore=restore)
            except BaseException:  # a full disk, or Ctrl-C while the tier's files are made: the
                if self.own_dir:   # directory of our own goes with what it holds (no close() comes)
                    shutil.rmtree(self.own_dir, ignore_errors=True)
                raise
        offloading = cfg.mode != "none"
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="kv-read") if offloading else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write") if self.disk else None

        # prefetch: CUDA stages every offloaded chunk, CPU only zstd ones (the rest: read in place)
        self.staged = offloading and (self.cuda or cfg.compress == "zstd")
        # no step reads more chunks than the task has: more slots would be memory never used
        n_slots = min(cfg.staging_slots, n_layers * self.n_chunks) if self.staged else 0
        # CUDA's group buffers (two: one crossing, one attended), each as long as a run can be
        run = group_run(self.n_chunks)
        groups = cfg.group_buffers if self.cuda and plan.host > 1 and run > 1 else 0
        self.staging = Staging(n_slots, shape, dtype, self.device, self.cuda, groups, run)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)   # host/disk -> device: prefetches
            self.evict_stream = torch.cuda.Stream(self.device)  # device -> host: evictions
            self.evicted = {}  # (layer, j) -> event: its D2H copy into the host pool
            n_read = len(self.staging.slots) if self.disk else 0
            n_write = n_layers if self.disk else 0
            self.read_bounces = HostPool(n_read, shape, dtype, pin=True)    # disk -> here -> device
            self.write_bounces = HostPool(n_write, shape, dtype, pin=True)  # device -> here -> disk
            self.bounce_free = queue.Queue()
            for b in self.write_bounces.slots:
                self.bounce_free.put(b)
        # a batch's arena (pools.SharedArena), where it can hold this task: with --offload none
        # on CPU every chunk stays in it, so the batch's chunks of a layer are one tensor
        self.arena = None
        self.arena_index = None
        if arena is not None and cfg.mode == "none" and not self.cuda:
            self.arena_index = arena.join(self.n_chunks, shape, dtype, self.device)
            if self.arena_index is not None:
                self.arena = arena
                self.chunks.shared = (arena, self.arena_index)

    def count(self, key, n):
        with self.count_lock:  # the reader, the writer and the main thread all count
            self.bytes[key] += n

    # ---- a step: prefetch, open_chunk, load, release ---------------------------------------------

    def open_chunk(self, layer):
        if self.open[layer] is None:
            self.open[layer] = self._device_buffer(layer)
        return self.open[layer]

    def load(self, layer, j):
        key = (layer, j)
        where = self.loc[key]
        if where is DEVICE:
            return self.resident[key]
        if not self.staged:  # CPU: read in place, host pool or mapped file
            if where is not DISK:
                self.count("host_read", self.chunk_bytes)  # read by attention in place
                return self.host.slots[where.slot]
            self.written[key].result()  # its write must have landed in the mapping
            # read by attention itself, page cache or disk
            self.count("disk_mapped_read", self.chunk_bytes)
            return self.disk.view(layer, j)
        inflight = self.staging.inflight  # staged (CUDA, zstd): the queue's head, or further into
        k = 0                             # the group copy at the head (its chunks load together)
        while inflight[k][:2] != key and getattr(inflight[k][2], "last", True) is False:
            k += 1
        l, jj, slot, fut = inflight[k]
        assert (l, jj) == key, f"prefetch order broken: expected {(l, jj)}, attention asked {key}"
        fut.result()  # re-raises an I/O error of the reader here, in the step that needed the chunk
        if isinstance(slot, GroupSlot):  # chunk i of a group buffer (prefetch.py)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.staging.group_ready[slot.g])  # rule 2
            return self.staging.groups[slot.g][slot.i]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.staging.ready[slot])  # rule 2
        return self.staging.slots[slot]

    def load_group(self, layer, js):
        """Consecutive chunks js of layer as runs [n, *shape] covering js, each one view for one
        call: CUDA one run (copied to the group buffer unless a view of the arena: the same calls
        in every mode); CPU: runs at one stride in one buffer, a staged chunk alone, released."""
        staged = self.staged and {self.loc[(layer, j)] for j in js} != {DEVICE}
        first = next((e[2] for e in self.staging.inflight), None) if staged else None
        if staged and (not self.cuda or isinstance(first, GroupSlot)):
            yield from self.staged_runs(layer, js)
            return
        if not staged:
            locs = tuple(self.loc[(layer, j)] for j in js)
            runs = self.chunks.runs_of((layer, js[0], len(js)), locs, lambda: self.cut(layer, js))
            if not self.cuda or len(runs) == 1:
                yield from runs
                return
        yield self.chunks.gather(js, None if staged else [self.load(layer, j) for j in js],
                                 lambda j: self.load(layer, j), lambda j: self.release(layer, j))

    def cut(self, layer, js):
        """Chunks js of layer, read in place, cut into runs of one view each (pools.chunk_runs)."""
        bases = {"device": self.chunks.arena(layer), "host": self.host.flat,
                 "disk": self.disk and not self.staged and self.disk.flat(layer)}
        return self.chunks.runs([self.load(layer, j) for j in js],
                                [bases[self.loc[(layer, j)].tier] for j in js])

    # ---- a chunk boundary: seal, offload ---------------------------------------------------------

    def seal(self, j):
        """Chunk j is full on every layer: it joins the device window; the chunk that falls out is
        offloaded."""
        if self.cuda and self.window < self.n_chunks:
            compute = torch.cuda.current_stream(self.device)
            written = torch.cuda.Event()
            written.record(compute)  # rule 1: after the compute that wrote chunk j
            self.evict_stream.wait_event(written)  # rule 1: copies out wait for that compute
        for l in range(self.n_layers):
            self.resident[(l, j)] = self.open[l]
            self.open[l] = None
            self.loc[(l, j)] = DEVICE
            self.on_device[l].append(j)
            victim = self.placement.evict(l, self.on_device[l], self.window)
            if victim is not None:
                self.offload(l, victim)
        if self.durable is not None and self.durable.done() and self.durable.exception():
            # the last manifest could not be written: the disk tier is failing
            raise self.durable.exception()
        if self.disk and all(self.loc.get((l, self.disk_prefix)) is DISK
                             for l in range(self.n_layers)):
            self.disk_prefix += 1
            if self.on_durable:
                self.durable = self.writer.submit(self._durable, self.disk_prefix)

    def offload(self, l, j):
        """Move chunk (l, j) off the device, to the tier the placement names."""
        tier = self.placement.place(l, j, bool(self.host.free), self.disk is not None)
        if tier is None:
            raise OffloadError("the host tier is full; raise --cpu-budget or use --offload disk")
        usable = {"host": bool(self.host.free), "disk": self.disk is not None}
        if not usable.get(tier):  # a placement's mistake, named
            why = {"host": "has no free slot", "disk": "is not in use (--offload disk)"}
            raise OffloadError(f"{type(self.placement).__name__}.place put chunk {j} of layer {l} "
                               f"on {tier!r}, which {why.get(tier, 'is not a tier')}")
        kv = self.resident.pop((l, j))
        self.on_device[l].remove(j)
        fence = Fence()
        if tier == "host":
            # the layer's chunks of a block side by side, so that on CUDA they cross as one copy:
            # as many slots as the block has chunks that leave the device (all but the open
            # chunk and the window, the default placement's)
            b = j // GROUP_CHUNKS
            size = max(1, min(GROUP_CHUNKS, self.n_chunks - 1 - self.window - b * GROUP_CHUNKS))
            slot = self.host.take((l, b), j % GROUP_CHUNKS, size)
            if self.cuda:
                with torch.cuda.stream(self.evict_stream):
                    self.host.slots[slot].copy_(kv, non_blocking=True)
                    # rule 4, 5: the eviction's copy (in and out) ends here
                    fence.event = self.evicted[(l, j)] = self.evict_stream.record_event()
            else:
                self.host.slots[slot].copy_(kv)
            self.loc[(l, j)] = Loc("host", slot)
            self.count("d2h", self.chunk_bytes)
        else:
            if self.cuda:
                bounce = self.bounce_free.get()  # blocks while every bounce awaits its disk write
                with torch.cuda.stream(self.evict_stream):
                    bounce.copy_(kv, non_blocking=True)
                    fence.event = self.evict_stream.record_event()  # rule 4, 5: as above
                self.count("d2h", self.chunk_bytes)
                self.written[(l, j)] = self.writer.submit(self._write_from_bounce, l, j, bounce,
                                                          fence.event)
            else:
                fence.future = self.written[(l, j)] = self.writer.submit(self._write, l, j, kv)
            self.loc[(l, j)] = DISK
        self.chunks.free.append((kv, fence))

    def _write(self, l, j, src):
        """Writer thread: store one chunk (the disk tier keeps its checksum for the manifest)."""
        self.count("disk_write", self.disk.write(l, j, src))

    def _write_from_bounce(self, l, j, bounce, copied):
        try:
            copied.synchronize()  # rule 4: the device-to-host copy into the bounce has finished
            self._write(l, j, bounce)
        finally:
            # a failed write still gives its bounce back, or the next eviction would wait forever
            self.bounce_free.put(bounce)

    def _durable(self, n):
        """Writer thread, after the writes of chunks < n (FIFO): sync them, then report them with
        checksums."""
        self.disk.flush()
        self.on_durable(n, self.disk.vouch(n))

    def restore(self, n, chunks):
        """Adopt chunks 0..n-1 left on disk by an interrupted run, checking each against its
        manifest checksum. Returns how many chunks were restored: the prefix before the first
        missing or corrupt one."""
        n = self.disk.verify_prefix(n, chunks)
        done = Future()
        done.set_result(None)
        for l in range(self.n_layers):
            for j in range(n):
                self.loc[(l, j)], self.written[(l, j)] = DISK, done
        self.disk_prefix = n
        return n

    def read_back(self, l, j, dst):
        """Copy sealed chunk (l, j) into the host tensor dst, wherever it lives, and wait for it:
        the persistent KV store (runs/kvstore.py) keeps prompt chunks this way. Synchronous, and
        never part of attention's schedule."""
        where = self.loc[(l, j)]
        if where is DEVICE:
            # to pageable memory: the copy waits for the compute that wrote it
            dst.copy_(self.resident[(l, j)])
        elif where is DISK:
            self.written[(l, j)].result()     # the write has landed (or raises its DiskError)
            self.disk.read_into(l, j, dst)
        else:
            if self.cuda:
                self.evicted[(l, j)].synchronize()  # rule 4: the eviction into host memory is done
            as_bytes(dst)[:] = as_bytes(self.host.slots[where.slot])

    def _device_buffer(self, layer):
        kv = self.chunks.take(layer)
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())
        return kv

    # ---- accounting and lifecycle ----------------------------------------------------------------

    def device_bytes(self):
        """KV bytes held on the compute device: open, window and free chunks plus staging slots."""
        st = self.staging
        slots = self.chunks.made + len(st.slots) + len(st.group_slots) + self.chunks.group_slots
        return slots * self.slot_bytes

    def snapshot(self, open_positions=0):
        """What a monitor may read, without reaching into the store: bytes moved so far, chunks per
        tier, KV bytes on the device now (window, filled part of the open chunks, busy staging
        slots) and at peak, pinned bytes."""
        tiers = {"device": sum(o is not None for o in self.open), "host": 0, "disk": 0}
        for w in self.loc.values():
            tiers[w.tier] += 1
        busy = len(self.staging.slots) - len(self.staging.free)
        open_bytes = self.n_layers * open_positions * (self.chunk_bytes // self.chunk_size)
        now = (len(self.resident) + busy) * self.chunk_bytes + open_bytes
        with self.count_lock:
            moved = dict(self.bytes)
        bounces = (self.read_bounces, self.write_bounces) if self.cuda else ()
        pinned = sum(p.pinned_bytes for p in (self.host, *bounces))
        return {"bytes": moved, "chunks": tiers, "kv_device_bytes": now,
                "kv_device_bytes_peak": self.peak_device_bytes, "pinned_bytes": pinned,
                "offloading": self.cfg.mode != "none", "window": self.window}

    def close(self):
        # Ctrl-C while the workers finish: they still write into the tiers' files, which close
        # then unmaps and removes, so they are waited for all the same; the interrupt goes on after
        interrupted = None
        for worker in filter(None, (self.reader, self.writer)):
            while True:
                try:
                    worker.shutdown(wait=True)
                    break
                except KeyboardInterrupt as e:
                    interrupted = e
        if self.cuda:
            self.copy_stream.synchronize()   # rule 5: a failed step's copies may still read bounces
            self.evict_stream.synchronize()  # rule 5: the last evictions may still write host slots
            for pool in (self.host, self.read_bounces, self.write_bounces):
                pool.close()  # unpinned: no copy may still use it
        if self.disk is not None:
            self.disk.close()
        if self.own_dir and not self.cfg.keep_files:
            shutil.rmtree(self.own_dir, ignore_errors=True)
        if self.arena is not None:  # its slots go to the next task that joins
            self.arena.leave(self.arena_index)
            self.arena = None
        if interrupted is not None:
            raise interrupted
