"""
The hooks that connect offload.py's TieredStore to the emulated CUDA of cuda_emu.py (installed by its emulate()).

The store calls nothing itself; these wrappers stand around its verbs and report what a GPU would do there:
    uses_cuda(device)        -> True: the store takes its CUDA path with CPU tensors
    ThreadPoolExecutor       -> ClockedExecutor: submit/result order the worker thread against its caller
    TieredStore.__init__     names the buffers (staging slot i, host pool slot i, read/write bounce i) and hands the
                             write bounces between threads through a ClockedDeque
    TieredStore._alloc       registers every new chunk buffer (fresh memory: no history)
    TieredStore.open_chunk   a compute WRITE of the open chunk (attention writes the step's K and V into it)
    TieredStore.load         a compute READ of the chunk it returns (attention reads it before release)
    TieredStore.close        after close, no copy may still be queued on the store's copy stream
    DiskTier.read_into/write a host-thread WRITE of the bounce filled from disk / READ of the bounce written to disk
"""
import functools

import cuda_emu
import disk
import offload


def _wrap(cls, name, after=None, before=None):
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        if before:
            before(self, *args, **kwargs)
        out = orig(self, *args, **kwargs)
        if after:
            after(self, out, *args, **kwargs)
        return out
    return cls, name, wrapper


def _named(store):
    emu = cuda_emu.EMU
    if not store.cuda:
        return
    for label, kind, chunks in [("staging slot", "slot", store.slots), ("host pool slot", "host", store.host or []),
                                ("read bounce", "bounce", store.bounces),
                                ("write bounce", "write bounce", store.write_bounces)]:
        for i, t in enumerate(chunks):
            emu.det.rename(cuda_emu.span(t)[0], f"{label} {i} (store {id(store) % 10000})", kind)
    store.write_bounces = cuda_emu.ClockedDeque(store.write_bounces)


def _after_init(store, out, *args, **kwargs):
    with cuda_emu.EMU.lock:
        _named(store)


def _after_alloc(store, chunks, n, device, pin=False):
    for t in chunks[:n]:
        name = "host chunk" if pin else f"device chunk @{t.data_ptr():#x}"
        cuda_emu.EMU.register(t, name, "host" if pin else "device")


def _after_open(store, kv, layer):
    cuda_emu.EMU.compute_access(kv, True, f"{cuda_emu.caller()} (attention writes open chunk, layer {layer})")


def _after_load(store, kv, layer, j):
    for t in kv:
        cuda_emu.EMU.compute_access(t, False, f"{cuda_emu.caller()} (attention reads chunk {j} of layer {layer})")


def _after_close(store, out):
    emu = cuda_emu.EMU
    s = getattr(store, "copy_stream", None)
    if store.cuda and s is not None and s.ops:
        emu.findings.append(f"store closed with {len(s.ops)} operations still queued on {s.actor.name}: its buffers "
                            f"are freed under copies that have not run")


def _before_read_into(tier, layer, j, dst):
    cuda_emu.EMU.host_access(dst, True, f"{cuda_emu.caller()} (disk read of chunk {j}, layer {layer}, into it)")


def _before_write(tier, layer, j, src):
    cuda_emu.EMU.host_access(src, False, f"{cuda_emu.caller()} (disk write of chunk {j}, layer {layer}, from it)")


def patches():
    """(object, attribute, replacement) for cuda_emu.emulate() to install and restore."""
    S = offload.TieredStore
    return [
        (offload, "uses_cuda", lambda device: True),
        (offload, "ThreadPoolExecutor", cuda_emu.ClockedExecutor),
        _wrap(S, "__init__", after=_after_init), _wrap(S, "_alloc", after=_after_alloc),
        _wrap(S, "open_chunk", after=_after_open), _wrap(S, "load", after=_after_load),
        _wrap(S, "close", after=_after_close),
        _wrap(disk.DiskTier, "read_into", before=_before_read_into),
        _wrap(disk.DiskTier, "write", before=_before_write),
    ]
