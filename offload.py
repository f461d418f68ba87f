"""
Where the bytes of the KV cache live, and how they move between the tiers.

    compute device            host memory                     disk (one directory per task)
    +------------------+      +------------------------+      +-------------------------------+
    | open chunk       | seal | host pool, allocated   |      | layer{l}.kv  np.memmap, chunk |
    | window of W most |----->| once, pinned on CUDA   |      |   j at byte j * slot_bytes    |
    | recent chunks    | evict|  (--cpu-budget GiB)    |      | layer{l}.zst zstd blobs +     |
    | staging slots    |<-----+------------------------+      |   an index (--compress zstd)  |
    +------------------+  prefetch (copy stream / worker thread) <------------------------------+

A chunk is the K and V of C consecutive positions of one layer: a [2, B, G, C, D] tensor (K at [0], V at [1]).
The store's verbs, in the order generate.py's loop calls them (through kvcache.py):
    prefetch(n)   start of a step: queue every sealed chunk not on the device, in the order attention reads them
    open_chunk(l) the device buffer that layer l writes this step's K and V into
    load(l, j)    chunk j of layer l as device tensors (waits for its prefetch if it was staged)
    release(l, j) attention is done with it; its staging slot may be refilled
    seal(j)       chunk j is full on every layer: it joins the window; the oldest window chunk is evicted
    close()       stop the worker, remove the task's files

Stream ordering on CUDA (../DESIGN.md section 3), each marked in the code as "rule N":
    1. a device-to-host copy of a sealed chunk waits for the compute that wrote it;
    2. compute that reads a staged chunk waits for the copy that brought it;
    3. a staging slot is overwritten only after the compute that last read it has finished;
    4. a pinned bounce buffer is read or refilled by the CPU only after the copy into/out of it has finished;
    5. a device buffer given back to the pool is reused only after the copy out of it has finished.
On CPU there are no streams: "device" and host are the same memory. Without compression, host chunks and raw disk
chunks are read in place (a disk chunk is a zero-copy view of the mapped file, so its pages belong to the page
cache, not to the process) and the worker thread writes disk chunks and asks the OS to page them in ahead of use;
with zstd, the worker decompresses disk chunks (and copies host chunks) into staging slots ahead of attention.
"""
import os
import threading
from collections import deque
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from disk import ALIGN, DiskTier, as_bytes, round_up

MODES = ("none", "cpu", "disk")
COMPRESSIONS = ("none", "zstd")


def uses_cuda(device):
    """Whether the store drives CUDA streams, events and pinned pools for `device`. The one seam of the CUDA path:
    tests/cuda_emu.py replaces it to run that path on CPU tensors under an emulated torch.cuda."""
    return device.type == "cuda"


class OffloadError(RuntimeError):
    """The offload tiers cannot hold or move what they must; the message names the flag or path."""


@dataclass
class OffloadConfig:
    mode: str = "none"                   # none | cpu | disk: where sealed chunks beyond the window go
    window: int = 4                      # W: most recent sealed chunks per layer kept on the device
    cpu_budget_gib: Optional[float] = None  # host tier size; None = as much as the task needs (cpu), 0 (disk)
    offload_dir: str = "./kv_cache_offload"  # the disk tier lives in offload_dir/task_<id>/
    compress: str = "none"               # none | zstd (lossless: output stays bit-identical)
    staging_slots: int = 4               # chunks prefetched ahead of attention (device buffers on CUDA)
    keep_files: bool = False             # keep the task's directory after success (it is always kept on failure)


# -----------------------------------------------------------------------------
# the store

class TieredStore:
    """The chunks of one task (one sequence batch) across device, host and disk."""

    def __init__(self, n_layers, batch, kv_heads, head_dim, chunk_size, max_length, device, dtype, cfg,
                 disk_path=None, restore=None, on_durable=None):
        """disk_path: the task's directory for the disk tier. restore: a manifest's "chunks" to resume from
        (see restore()). on_durable(n, chunks): called on the worker thread once chunks 0..n-1 of every layer
        are on disk and synced, with their checksums, so the caller can write a manifest."""
        if cfg.mode not in MODES:
            raise OffloadError(f"--offload must be one of {MODES}, got {cfg.mode!r}")
        if cfg.compress not in COMPRESSIONS:
            raise OffloadError(f"--compress must be one of {COMPRESSIONS}, got {cfg.compress!r}")
        if cfg.compress == "zstd" and cfg.mode != "disk":
            raise OffloadError("--compress zstd applies to the disk tier only; add --offload disk")
        if chunk_size < 1 or cfg.window < 0 or cfg.staging_slots < 1:
            raise OffloadError("--chunk-size and staging slots must be >= 1 and --window >= 0")
        self.n_layers, self.chunk_size, self.max_length, self.cfg = n_layers, chunk_size, max_length, cfg
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = uses_cuda(self.device)
        self.shape = (2, batch, kv_heads, chunk_size, head_dim)                 # one chunk: K and V, [2, B, G, C, D]
        self.chunk_bytes = int(np.prod(self.shape)) * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = round_up(self.chunk_bytes, ALIGN)
        self.n_chunks = -(-max_length // chunk_size)                            # chunks per layer for max_length
        self.window = self.n_chunks if cfg.mode == "none" else cfg.window

        # host tier: one pool, allocated (and on CUDA pinned) once, sized to what the task can need
        evictable = n_layers * max(0, self.n_chunks - 1 - self.window)          # the last chunk is never sealed+evicted
        budget = cfg.cpu_budget_gib if cfg.cpu_budget_gib is not None else (None if cfg.mode == "cpu" else 0)
        host_slots = evictable if budget is None else min(evictable, int(budget * 2**30) // self.slot_bytes)
        if cfg.mode == "cpu" and host_slots < evictable:
            need = evictable * self.slot_bytes / 2**30
            raise OffloadError(f"--cpu-budget {budget} GiB holds {host_slots} of the {evictable} chunks this task "
                               f"offloads ({need:.2f} GiB); raise it, widen --window, or use --offload disk")
        self.host = self._alloc(host_slots, "cpu", pin=self.cuda) if cfg.mode != "none" else None
        self.host_free = list(range(host_slots - 1, -1, -1))
        self.disk = None
        if cfg.mode == "disk":
            blobs = {(l, int(j)): tuple(c["blob"][l]) for j, c in (restore or {}).items() if c.get("blob")
                     for l in range(n_layers)}
            self.disk = DiskTier(disk_path or os.path.join(cfg.offload_dir, "task"), n_layers, self.n_chunks,
                                 self.shape, dtype, cfg.compress, restore=blobs if restore else None)

        # device tier: the open chunk per layer, the window, and buffers returned by evictions
        self.open = [None] * n_layers
        self.resident = {}                    # (layer, j) -> device chunk [2, B, G, C, D]
        self.free = deque()                   # (device chunk, fence) that may be reused once the fence is passed
        self.where = {}                       # (layer, j) -> "device" | ("host", slot) | "disk"
        self.written = {}                     # (layer, j) -> future of its disk write
        self.checksums = {}                   # (layer, j) -> CRC32 of the chunk as stored on disk
        self.on_durable, self.disk_prefix = on_durable, 0  # chunks 0..disk_prefix-1 are on disk for every layer
        self.durable = None                   # future of the last manifest write
        self.device_buffers = 0

        # prefetch: staging slots, a FIFO worker thread (disk I/O, zstd, and on CUDA the copies it issues)
        self.staged = self.cuda or cfg.compress == "zstd"  # else host and raw-disk chunks are read in place (CPU)
        n_slots = cfg.staging_slots if (self.staged and cfg.mode != "none") else 0
        self.slots = [self._alloc(1, self.device)[0] for _ in range(n_slots)]
        self.slot_free = list(range(n_slots - 1, -1, -1))
        self.queue, self.inflight = deque(), deque()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="kv-offload") if cfg.mode != "none" else None
        self.lock = threading.Lock()
        self.bytes = {"h2d": 0, "d2h": 0, "disk_write": 0, "disk_read": 0}
        self.peak_device_bytes = 0
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.slot_ready = [torch.cuda.Event() for _ in range(n_slots)]     # recorded on the copy stream
            self.slot_released = [torch.cuda.Event() for _ in range(n_slots)]  # recorded on the compute stream
            self.bounces = [self._alloc(1, "cpu", pin=True)[0] for _ in range(n_slots)] if self.disk else []
            self.write_bounces = deque(self._alloc(1, "cpu", pin=True)[0] for _ in range(n_layers if self.disk else 0))

    def _alloc(self, n, device, pin=False):
        """n chunk tensors carved from one flat buffer, each starting on an ALIGN boundary."""
        flat = torch.empty(max(n, 1) * self.slot_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        return [flat[i * self.slot_bytes:i * self.slot_bytes + self.chunk_bytes].view(self.dtype).view(self.shape)
                for i in range(n)]

    def _count(self, key, n):
        with self.lock:
            self.bytes[key] += n

    # ---- verbs of a step -------------------------------------------------------------------------------

    def prefetch(self, n_sealed):
        """Queue every chunk of this step that must be staged, in attention's order: all chunks of layer 0,
        then layer 1, ... so that the next layer's first chunks arrive while this layer's last are attended."""
        while self.inflight:  # a step that failed half-way left copies in flight: let them land first
            self.inflight.popleft()[3].result()
        self.slot_free = list(range(len(self.slots) - 1, -1, -1))
        order = [(l, j) for l in range(self.n_layers) for j in range(n_sealed) if self.where[(l, j)] != "device"]
        if self.staged:
            self.queue = deque(order)
            self._pump()
        elif self.disk is not None and order:  # CPU, raw disk: attention reads the mapping in place; ask the OS
            self.worker.submit(self._advise, order)  # to page in, ahead of use, whatever it has evicted

    def _advise(self, order):
        """One madvise per layer over the span of its disk chunks (the file keeps them in order)."""
        span = {}
        for l, j in order:
            if self.where[(l, j)] == "disk":
                first, last = span.get(l, (j, j))
                span[l] = (min(first, j), max(last, j))
        for l, (first, last) in span.items():
            self.disk.advise(l, first, last)

    def _pump(self):
        while self.queue and self.slot_free:
            l, j = self.queue.popleft()
            slot = self.slot_free.pop()
            self.inflight.append((l, j, slot, self.worker.submit(self._stage, l, j, slot)))

    def _stage(self, l, j, slot):
        """Worker thread: bring chunk (l, j) into staging slot `slot`."""
        where, dst = self.where[(l, j)], self.slots[slot]
        if not self.cuda:  # CPU: staged only with zstd; decompress a disk chunk straight into the slot
            if where == "disk":
                self._count("disk_read", self.disk.read_into(l, j, dst))
            else:  # a host-pool chunk (--cpu-budget): attention reads the slot, so copy it there (numpy: see disk.py)
                as_bytes(dst)[:] = as_bytes(self.host[where[1]])
            return
        if where == "disk":
            bounce = self.bounces[slot]
            self.slot_ready[slot].synchronize()  # rule 4: the last host-to-device copy out of this bounce is done
            self._count("disk_read", self.disk.read_into(l, j, bounce))
            src = bounce
        else:
            src = self.host[where[1]]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.slot_released[slot])  # rule 3: attention has finished with the slot
            dst.copy_(src, non_blocking=True)
            self.slot_ready[slot].record()  # rule 2: attention waits for this before reading the slot
        self._count("h2d", self.chunk_bytes)

    def open_chunk(self, layer):
        if self.open[layer] is None:
            self.open[layer] = self._device_buffer()
        return self.open[layer]

    def load(self, layer, j):
        where = self.where[(layer, j)]
        if where == "device":
            kv = self.resident[(layer, j)]
        elif not self.staged:  # CPU: read in place, host pool or mapped file
            if where == "disk":
                self.written[(layer, j)].result()  # its write must have landed in the mapping
                kv = self.disk.view(layer, j)
                self._count("disk_read", self.chunk_bytes)
            else:
                kv = self.host[where[1]]
        else:
            l, jj, slot, fut = self.inflight[0]
            assert (l, jj) == (layer, j), f"prefetch order broken: expected {(l, jj)}, attention asked {(layer, j)}"
            fut.result()  # re-raises an I/O error of the worker here, in the step that needed the chunk
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.slot_ready[slot])  # rule 2
            kv = self.slots[slot]
        return kv[0], kv[1]

    def release(self, layer, j):
        if self.where[(layer, j)] == "device" or not self.staged:
            return
        l, jj, slot, _ = self.inflight.popleft()
        if self.cuda:
            self.slot_released[slot].record(torch.cuda.current_stream(self.device))  # rule 3
        self.slot_free.append(slot)
        self._pump()

    def seal(self, j):
        """Chunk j is full on every layer: it joins the device window; the chunk that falls out is offloaded."""
        if self.cuda and self.window < self.n_chunks:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(written)  # rule 1: copies out wait for the compute that wrote the chunks
        for l in range(self.n_layers):
            self.resident[(l, j)], self.open[l] = self.open[l], None
            self.where[(l, j)] = "device"
            if j - self.window >= 0 and self.where.get((l, j - self.window)) == "device":
                self.offload(l, j - self.window)
        if self.durable is not None and self.durable.done() and self.durable.exception():
            raise self.durable.exception()  # the last manifest could not be written: the disk tier is failing
        if self.disk and all(self.where.get((l, self.disk_prefix)) == "disk" for l in range(self.n_layers)):
            self.disk_prefix += 1
            if self.on_durable:
                self.durable = self.worker.submit(self._durable, self.disk_prefix)

    def _durable(self, n):
        """Worker thread, after the writes of chunks < n (FIFO): sync them, then report them with checksums."""
        self.disk.flush()
        chunks = {j: {"crc": [self.checksums[(l, j)] for l in range(self.n_layers)],
                      "blob": [self.disk.index[(l, j)] for l in range(self.n_layers)] if self.disk.index else None}
                  for j in range(n)}
        self.on_durable(n, chunks)

    def restore(self, n, chunks):
        """Adopt chunks 0..n-1 left on disk by an interrupted run, checking each against its manifest checksum.
        Returns how many chunks were restored: the prefix before the first missing or corrupt one."""
        for j in range(n):
            c = chunks.get(str(j)) or chunks.get(j)
            crcs = [self.disk.checksum(l, j) for l in range(self.n_layers)] if c else None
            if not c or crcs != c["crc"]:
                return self._adopt(j)
            for l, crc in enumerate(crcs):  # the next manifest vouches for the restored chunks too
                self.checksums[(l, j)] = crc
        return self._adopt(n)

    def _adopt(self, n):
        for l in range(self.n_layers):
            for j in range(n):
                self.where[(l, j)] = "disk"
                self.written[(l, j)] = self.worker.submit(lambda: None)
        self.disk_prefix = n
        return n

    def offload(self, l, j):
        """Move chunk (l, j) off the device: to the host pool while it has room, else to disk."""
        kv = self.resident.pop((l, j))
        if self.host_free:
            slot = self.host_free.pop()
            with torch.cuda.stream(self.copy_stream) if self.cuda else nullcontext():
                self.host[slot].copy_(kv, non_blocking=self.cuda)
                fence = self._event_on_copy_stream()
            self.where[(l, j)] = ("host", slot)
            self._count("d2h", self.chunk_bytes)
        elif self.disk is not None:
            if self.cuda:
                bounce = self.write_bounces.popleft() if self.write_bounces else self._wait_bounce()
                with torch.cuda.stream(self.copy_stream):
                    bounce.copy_(kv, non_blocking=True)
                    fence = self._event_on_copy_stream()
                self._count("d2h", self.chunk_bytes)
                self.written[(l, j)] = self.worker.submit(self._write_from_bounce, l, j, bounce, fence)
            else:
                fence = self.written[(l, j)] = self.worker.submit(self._write, l, j, kv)
            self.where[(l, j)] = "disk"
        else:
            raise OffloadError("the host tier is full; raise --cpu-budget or use --offload disk")
        self.free.append((kv, fence))

    def _write(self, l, j, src):
        n, self.checksums[(l, j)] = self.disk.write(l, j, src)
        self._count("disk_write", n)

    def _write_from_bounce(self, l, j, bounce, fence):
        fence.synchronize()  # rule 4: the device-to-host copy into the bounce has finished
        self._write(l, j, bounce)
        self.write_bounces.append(bounce)

    def _wait_bounce(self):
        while not self.write_bounces:  # all write bounces are queued for disk: wait for the oldest write
            next(f for f in self.written.values() if not f.done()).result()
        return self.write_bounces.popleft()

    def _event_on_copy_stream(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event()
        e.record(self.copy_stream)
        return e

    def _device_buffer(self):
        if self.free:
            kv, fence = self.free.popleft()
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(fence)  # rule 5: the copy out of it is done
            elif fence is not None:
                fence.result()  # CPU: the worker has written it to disk
            return kv
        self.device_buffers += 1
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())
        return self._alloc(1, self.device)[0]

    # ---- accounting and lifecycle -----------------------------------------------------------------------

    def device_bytes(self):
        """KV bytes held on the compute device: open, window and free chunks plus staging slots."""
        return (self.device_buffers + len(self.slots)) * self.slot_bytes

    def kv_bytes_on_device(self, open_positions):
        """KV bytes in use on the device now: window chunks, filled part of the open chunks, busy staging slots."""
        per_position = self.chunk_bytes // self.chunk_size
        busy = len(self.slots) - len(self.slot_free)
        return (len(self.resident) + busy) * self.chunk_bytes + self.n_layers * open_positions * per_position

    def stats(self):
        tiers = {"device": sum(o is not None for o in self.open), "host": 0, "disk": 0}
        for w in self.where.values():
            tiers["device" if w == "device" else "disk" if w == "disk" else "host"] += 1
        return {"bytes": dict(self.bytes), "chunks": tiers, "kv_device_bytes_peak": self.peak_device_bytes}

    def close(self):
        if self.worker is not None:
            self.worker.shutdown(wait=True)
        if self.cuda:
            self.copy_stream.synchronize()  # no copy may still read or write a buffer about to be freed
        if self.disk is not None:
            self.disk.close()

