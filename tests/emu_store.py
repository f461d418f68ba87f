"""
The hooks that connect offload.py's TieredStore to the emulated CUDA of cuda_emu.py (installed by
its emulate()).

The store calls nothing itself; these wrappers stand around its verbs and report what a GPU would do
there:
    offload.on_cuda(device)  -> True: the store takes its CUDA path with CPU tensors (task.py
                             imports the original by name and stays on CPU: no per-step stream
                             synchronize hides a missing wait)
    ThreadPoolExecutor       -> ClockedExecutor: submit/result order the reader and writer threads
                             against their caller
    queue.Queue              -> ClockedQueue: a write bounce handed back (put, writer thread) orders
                             its next use (get)
    pools.alloc_chunks       registers every new chunk buffer (fresh memory: no history)
    TieredStore.__init__     names the buffers: staging slot i, host pool slot i, read bounce i,
                             write bounce i
    TieredStore.open_chunk   a compute WRITE of the open chunk (attention writes the step's K and V
                             into it)
    TieredStore.load         a compute READ of the chunk [2, B, G, C, D] it returns (attention,
                             before release)
    TieredStore.read_back    a host READ of the host pool slot it copied from (numpy: the emulator
                             cannot see it)
    TieredStore.close        after close, no copy may still be queued on the store's copy or
                             eviction stream (what was queued before it is kept in
                             stats["queued_at_close"])
    DiskTier.read_into/write a host-thread WRITE of the bounce filled from disk / READ of the bounce
                             written to disk
"""
import functools
import queue
import types

import cuda_emu
import disk
import offload
import pools


def _wrap(obj, name, after=None, before=None):
    orig = getattr(obj, name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        out = orig(*args, **kwargs)
        if after:
            after(out, *args, **kwargs)
        return out
    return obj, name, wrapper


def _after_alloc(out, *args, **kwargs):
    for t in out[1]:
        cuda_emu.EMU.register(t, f"device chunk @{t.data_ptr():#x}", "device")


def _after_init(out, store, **kwargs):
    if not store.cuda:
        return
    tag = f"(store {id(store) % 10000})"
    buffers = [("staging slot", "slot", store.staging.slots),
               ("group buffer chunk", "slot", store.staging.group_slots),
               ("host pool slot", "host", store.host.slots),
               ("read bounce", "bounce", store.read_bounces.slots),
               ("write bounce", "write bounce", store.write_bounces.slots)]
    for label, kind, chunks in buffers:
        for i, t in enumerate(chunks):
            cuda_emu.EMU.rename(t, f"{label} {i} {tag}", kind)


def _after_open(kv, store, layer):
    where = f"{cuda_emu.caller()} (attention writes open chunk, layer {layer})"
    cuda_emu.EMU.compute_access(kv, True, where)


def _after_load(kv, store, layer, j):
    where = f"{cuda_emu.caller()} (attention reads chunk {j} of layer {layer})"
    cuda_emu.EMU.compute_access(kv, False, where)


def _after_read_back(out, store, layer, j, dst):
    loc = store.loc[(layer, j)]
    if loc.tier == "host":
        where = f"{cuda_emu.caller()} (read_back of chunk {j}, layer {layer}, from it)"
        cuda_emu.EMU.host_access(store.host.slots[loc.slot], False, where)


def _before_close(store):
    """What close() finds queued once its reader has stopped (close's first step, done here first so
    that the count does not depend on how far the reader got), before it drains it: a test that
    needs copies in flight checks it."""
    if store.cuda:
        if store.reader is not None:
            store.reader.shutdown(wait=True)
        queued = {"copy": len(store.copy_stream.ops), "evict": len(store.evict_stream.ops)}
        cuda_emu.EMU.stats["queued_at_close"] = queued


def _after_close(out, store):
    emu = cuda_emu.EMU
    for name in ("copy_stream", "evict_stream"):
        s = getattr(store, name, None)
        if store.cuda and s is not None and s.ops:
            emu.findings.append(f"store closed with {len(s.ops)} operations still queued on its "
                                f"{name} ({s.actor.name}): its buffers are freed or unpinned under "
                                f"copies that have not run")


def _before_read_into(tier, layer, j, dst):
    where = f"{cuda_emu.caller()} (disk read of chunk {j}, layer {layer}, into it)"
    cuda_emu.EMU.host_access(dst, True, where)


def _before_write(tier, layer, j, src):
    where = f"{cuda_emu.caller()} (disk write of chunk {j}, layer {layer}, from it)"
    cuda_emu.EMU.host_access(src, False, where)


def patches():
    """(object, attribute, replacement) for cuda_emu.emulate() to install and restore."""
    S = offload.TieredStore
    clocked_queue = types.SimpleNamespace(**vars(queue))  # the queue module, with a clocked Queue
    clocked_queue.Queue = cuda_emu.ClockedQueue
    return [
        (offload, "on_cuda", lambda device: True),
        (offload, "ThreadPoolExecutor", cuda_emu.ClockedExecutor),
        (offload, "queue", clocked_queue),
        _wrap(pools, "alloc_chunks", after=_after_alloc),
        _wrap(S, "__init__", after=_after_init),
        _wrap(S, "open_chunk", after=_after_open),
        _wrap(S, "load", after=_after_load),
        _wrap(S, "read_back", after=_after_read_back),
        _wrap(S, "close", before=_before_close, after=_after_close),
        _wrap(disk.DiskTier, "read_into", before=_before_read_into),
        _wrap(disk.DiskTier, "write", before=_before_write),
    ]
