"""
The buffers the store (offload.py) moves chunks between, and the small types it speaks in: where a
chunk lives (Loc), what must finish before a buffer is reused (Fence), chunk allocation with one
alignment in every tier, the host pool (pinned on CUDA by registering its exact bytes) and the
staging slots prefetched chunks land in.
"""
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


class HostPool:
    """`n` chunk slots in host memory, allocated once. With pin=True their exact bytes are
    page-locked by registering them with the CUDA driver, and unregistered at close(): torch's
    pinned allocator would round each request up to a power of two and keep it pinned until the
    process exits (a 9 GiB budget would pin 16 GiB, for good)."""

    def __init__(self, n, shape, dtype, pin):
        self.flat, self.slots = alloc_chunks(n, shape, dtype, "cpu")
        self.free = list(range(n - 1, -1, -1))
        self.pinned_bytes = 0
        if pin and n:
            self.pinned_bytes = self.flat.numel()
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(self.flat.data_ptr(), self.pinned_bytes, 1)) != 0:
                raise OffloadError(f"cannot pin {self.pinned_bytes / 2**30:.2f} GiB of host memory "
                                   "for the host tier; lower --cpu-budget (or raise the "
                                   "locked-memory limit, ulimit -l)")

    def close(self):
        if self.pinned_bytes:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.pinned_bytes = 0


class Staging:
    """`n` device slots that prefetched chunks land in, in attention's order, a few chunks ahead of
    it. On CUDA each slot has an event recorded when its copy is issued (ready) and one recorded
    when attention is done with it (released); both are recorded once at creation so that the first
    wait on them waits for nothing pending."""

    def __init__(self, n, shape, dtype, device, cuda):
        self.flat, self.slots = alloc_chunks(n, shape, dtype, device)
        self.free = list(range(n - 1, -1, -1))
        self.queue = deque()     # (layer, j) to stage
        self.inflight = deque()  # (layer, j, slot, future) staged
        if cuda:
            self.ready = [torch.cuda.Event() for _ in range(n)]
            self.released = [torch.cuda.Event() for _ in range(n)]
            for e in self.ready + self.released:
                e.record()  # rule 2, 3: first waits (load, refill, bounce refill) find it recorded
