"""
What this machine can move, and what offload will cost on it: the probe, and the prediction that
bench.py prints beside every measured decode speed.

    python probe.py --offload-dir /mnt/nvme/kv --contexts 4096,32768

It measures the software (torch, CUDA, devices), the copy links (CUDA: pinned and pageable H2D and
D2H, both at once; CPU: host memcpy), the disk of the offload dir around the page cache, zstd on the
model's own KV, and a few costs of our own code: a decode step inside one chunk and one with a few
sealed chunks (on synthetic KV, so no prefill is needed), and the worker-thread round trip each
staged chunk pays. From those and the checkpoint's KV bytes per token, predict_decode() predicts
decode tokens/s for each mode and context; verdict() says in words whether offload will pay here.
"""
import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from checkpoint import CheckpointError
from disk import DiskError
from generate import decode_one_token, prefill
from kvcache import make_cache
from kvlayout import kv_bytes_per_token, kv_chunk_bytes
from measure.flags import add_measure_flags, check_measure, measured_model_args
from measure.random_model import SIZE_KEYS
from model import Transformer
from offload import OffloadConfig
from policy import plan_tiers
from pools import OffloadError
from private import create_private, open_private, write_atomic
from runs.flags import (
    DTYPES,
    MODE_SPECS,
    UsageError,
    one_line_errors,
    quantize_mode,
    remove_created_offload_dir,
    rope_override,
    set_threads,
)
from runs.taskdir import TaskDirError

GB = 1e9
ALIAS = "alias: python bench.py --probe ... runs python probe.py ..."


def is_cuda(device):
    return torch.device(device).type == "cuda"


def sync(device):
    """Wait for the work queued on CUDA, so that a clock read after it counts it; nothing on CPU."""
    if is_cuda(device):
        torch.cuda.synchronize()


def median_time(fn, device="cpu", reps=5):
    """Median wall time of fn() over reps calls (synchronised on CUDA), after one warm-up call."""
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        fn()
        sync(device)
        if i > 0:  # the first call is the warm-up
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def chunk_bytes(model_args, args, C):
    """Bytes of one chunk of one layer: K and V of C positions (with --kv-dtype int8 or int4, the
    scales too)."""
    return kv_chunk_bytes(model_args, DTYPES[args.dtype], args.kv_dtype, C)


# -----------------------------------------------------------------------------
# the software, the copy links, the disk, zstd on real KV

def environment(device):
    env = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
           "cuda_usable": torch.cuda.is_available(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "device": str(device),
           "loadavg": [round(x, 2) for x in os.getloadavg()],
           "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if env["cuda_usable"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        free, total = torch.cuda.mem_get_info(torch.device(device) if is_cuda(device) else 0)
        env["device_free_gib"] = round(free / 2**30, 1)
        env["device_total_gib"] = round(total / 2**30, 1)
    return env


def describe(args, model_args, contexts, modes):
    """The configuration a JSON report carries: every flag, the model's shape, its KV per token."""
    shape = (model_args.dim, model_args.n_layers, model_args.n_heads, model_args.n_kv_heads,
             model_args.head_dim, model_args.hidden_dim, model_args.vocab_size)
    kv_per_token = kv_bytes_per_token(model_args, DTYPES[args.dtype], args.kv_dtype,
                                      args.chunk_size)
    flags = {k: v for k, v in vars(args).items() if k != "sizes"}
    return flags | {"contexts": contexts, "modes": modes, "kv_bytes_per_token": kv_per_token,
                    "model": dict(zip(SIZE_KEYS, shape))}


def link_bandwidth(device, nbytes=256 << 20):
    """GB/s. Host memcpy always (what a disk chunk costs from the page cache into a bounce buffer);
    on CUDA also pinned and pageable host<->device, and each direction while both run at once
    (pinned, two streams)."""
    def buf(pin=False, dev="cpu"):
        return torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin, device=dev)

    src = buf()
    dst = buf()
    out = {"host_memcpy": nbytes / median_time(lambda: dst.copy_(src)) / GB}
    if not is_cuda(device):
        return out
    dev = buf(dev=device)
    dev2 = buf(dev=device)
    h_in = buf(True)
    h_out = buf(True)
    for pinned in (True, False):
        host = buf(pinned)
        kind = "pinned" if pinned else "pageable"
        h2d_s = median_time(lambda: dev.copy_(host, non_blocking=pinned), device)
        out[f"h2d_{kind}"] = nbytes / h2d_s / GB
        d2h_s = median_time(lambda: host.copy_(dev, non_blocking=pinned), device)
        out[f"d2h_{kind}"] = nbytes / d2h_s / GB
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both():
        with torch.cuda.stream(streams[0]):
            dev.copy_(h_in, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            h_out.copy_(dev2, non_blocking=True)
    out["h2d_d2h_at_once_each"] = nbytes / median_time(both, device) / GB
    return out


def read_bandwidth(device, nbytes=None):
    """GB/s at which this device reads memory as a decode step does: a matrix-vector product over
    an fp32 matrix, with the run's threads (the memory roofline's denominator). On CPU the matrix
    is twice the last-level cache, and at least 1 GiB, so that it is memory that is measured."""
    if nbytes is None:
        nbytes = 1 << 30 if is_cuda(device) else max(1 << 30, 2 * last_level_cache())
    mat = torch.ones(nbytes // 4096, 1024, device=device)   # [N, 1024] fp32
    vec = torch.ones(1024, device=device)
    return nbytes / median_time(lambda: torch.mv(mat, vec), device) / GB


def last_level_cache():
    """Bytes of this CPU's largest cache, from sysfs (0 where it does not say)."""
    sizes = [0]
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes)


def decode_read_bytes(model, ctx, kv_per_token):
    """Bytes a decode step at ctx tokens must read: every weight it multiplies by (each linear's
    weight and scales, the output matrix, the norms: not the embedding table, of which it reads
    one row, unless the output shares it) and the KV of the ctx positions before it."""
    seen = {model.tok_embeddings.weight.data_ptr()}
    read = 0
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        read += t.numel() * t.element_size()
    if model.args.tie_embeddings and model.quantize is None:  # the output reads the embedding
        read += model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    return read + ctx * kv_per_token


def disk_bandwidth(dirpath, nbytes=512 << 20, block=8 << 20):
    """Sequential write then read of a scratch file in dirpath, around the page cache: O_DIRECT
    where the file system allows it, else buffered I/O + fsync + posix_fadvise(DONTNEED), so that
    the read comes from the device."""
    buf = mmap.mmap(-1, block)  # mmap: page aligned
    buf.write(os.urandom(block))
    direct = getattr(os, "O_DIRECT", 0)
    method = "O_DIRECT"
    # a new private file under a random name (private.create_private): nothing planted is opened
    fd, path = create_private(dirpath, ".bench-probe-")
    os.close(fd)
    fd = None
    try:  # the file goes however this ends (Ctrl-C, a full disk)
        try:
            fd = open_private(path, os.O_WRONLY | direct)
            os.write(fd, buf)  # some file systems accept O_DIRECT at open, refuse the first write
        except OSError:
            if fd is not None:
                os.close(fd)
                fd = None
            direct = 0
            method = "buffered + fsync + posix_fadvise(DONTNEED)"
            fd = open_private(path, os.O_WRONLY)
        os.lseek(fd, 0, os.SEEK_SET)
        t = time.perf_counter()
        for _ in range(max(1, nbytes // block)):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t
        # drop the (now clean) cached pages before reading
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = None
        fd = open_private(path, os.O_RDONLY | direct)
        t = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        read_s = time.perf_counter() - t
    finally:
        if fd is not None:
            os.close(fd)
        os.remove(path)
    n = max(1, nbytes // block) * block
    return {"write": n / write_s / GB, "read": n / read_s / GB, "method": method, "dir": dirpath}


def zstd_on_real_kv(model, chunk_size, n_chunks=2, kv_dtype="auto"):
    """The sealed chunks of a short prefill, compressed as the disk tier's DiskTier.write does (byte
    planes split, zstd level 1), then decompressed and un-split as its read_into does on the worker
    for every disk+zstd read. With kv_dtype int8 the chunks are the uint8 ones the disk tier would
    store (one byte plane)."""
    try:
        import zstandard
    except ImportError:
        return None
    n = chunk_size * n_chunks
    cache = make_cache(model, OffloadConfig(), chunk_size, n + 1, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.args.vocab_size, (1, n), generator=g)         # [B, T]
    try:
        prefill(model, cache, ids.to(next(model.parameters()).device))
        chunks = [cache.store.load(layer, j).cpu()
                  for layer in range(model.args.n_layers) for j in range(n_chunks)]
    finally:
        cache.store.close()
    zc = zstandard.ZstdCompressor(level=1)
    zd = zstandard.ZstdDecompressor()
    item = chunks[0].element_size()
    raw = [c.reshape(-1).view(torch.uint8).numpy() for c in chunks]
    t = time.perf_counter()
    # [item, n] byte planes, each compressed as one blob
    blobs = [zc.compress(np.ascontiguousarray(r.reshape(-1, item).T).tobytes()) for r in raw]
    comp_s = time.perf_counter() - t
    dst = torch.empty_like(chunks[0])
    t = time.perf_counter()
    for b in blobs:
        data = zd.decompress(b, max_output_size=dst.numel() * item)
        planes = np.frombuffer(data, dtype=np.uint8)
        dst.reshape(-1).view(torch.uint8).numpy().reshape(-1, item)[:] = planes.reshape(item, -1).T
    dec_s = time.perf_counter() - t
    total = sum(r.nbytes for r in raw)
    return {"ratio": total / sum(map(len, blobs)), "compress_gbps": total / comp_s / GB,
            "decompress_gbps": total / dec_s / GB, "decompress_s_per_chunk": dec_s / len(blobs),
            "chunk_bytes": raw[0].nbytes}


# -----------------------------------------------------------------------------
# calibration and prediction

def filled_cache(model, ctx, chunk_size, room, kv_dtype="auto"):
    """A cache at context ctx (--offload none), filled with synthetic K and V through its own verbs
    instead of a prefill: seconds, not minutes, at any context. `room`: positions left for
    decoding. The same K and V in every call (a seeded generator), so that two trees or two paths
    can be compared bit for bit on the same cache."""
    model_args = model.args
    dev = model.tok_embeddings.weight.device
    cache = make_cache(model, OffloadConfig(), chunk_size, ctx + room, kv_dtype=kv_dtype)
    g = torch.Generator(dev).manual_seed(0)
    G = model.layers[0].attention.wk.out_features // model.args.head_dim
    while cache.length < ctx:
        off = cache.length % chunk_size
        n = min(chunk_size - off, ctx - cache.length)
        cache.begin(n)
        # what attention writes for n positions, through the cache's layout
        for layer in range(model_args.n_layers):
            # [2, B, G, n, D]: K, V
            kv = torch.rand(2, 1, G, n, model_args.head_dim, device=dev, generator=g)
            k, v = kv.sub_(0.5).mul_(2)                                      # uniform in [-1, 1)
            cache.layout.write(cache.store.open_chunk(layer), off, k, v)
        if cache.commit():  # a full chunk is sealed, as after a prefill step
            cache.store.seal(cache.n_sealed - 1)
    return cache


def decode_step_s(model, ctx, chunk_size, steps=8, kv_dtype="auto"):
    """Median decode step at context ctx on the real path (model + KVCache, --offload none)."""
    cache = filled_cache(model, ctx, chunk_size, steps + 2, kv_dtype)
    try:
        token = torch.tensor([[3]], device=cache.store.device)
        return median_time(lambda: decode_one_token(model, cache, token), cache.store.device,
                           reps=steps)
    finally:
        cache.store.close()


def visit_cost_s(model, ctx=16384, small=64, big=4096, steps=8):
    """The fixed cost of visiting one sealed chunk (a load, a partial attention, a release, its
    share of the merge, and the Python around them), apart from the bytes it attends: decode steps
    at the same context with small and big chunks attend the same keys, so their difference divided
    by the extra visits is the cost per visit."""
    t_small = decode_step_s(model, ctx, small, steps)
    t_big = decode_step_s(model, ctx, big, steps)
    return (t_small - t_big) / (model.args.n_layers * (ctx // small - ctx // big))


def kernels_per_visit(model, ctx=16384, small=64, big=4096):
    """CUDA: device kernels launched per chunk visit, counted with torch.profiler over one decode
    step at small and big chunks (the same keys attended): the difference divided by the extra
    visits."""
    from torch.profiler import ProfilerActivity, profile
    counts = []
    for C in (small, big):
        cache = filled_cache(model, ctx, C, 4)
        try:
            token = torch.tensor([[3]], device=cache.store.device)
            # warm-up: the fused kernel's one-time check, the allocator
            decode_one_token(model, cache, token)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                decode_one_token(model, cache, token)
                torch.cuda.synchronize()
            events = prof.key_averages()
            counts.append(sum(e.count for e in events if e.device_type.name == "CUDA"))
        finally:
            cache.store.close()
    return (counts[0] - counts[1]) / (model.args.n_layers * (ctx // small - ctx // big))


def prefill_step_s(model, n_sealed, chunk_size, reps=2, kv_dtype="auto"):
    """The fastest of reps prefill steps of chunk_size tokens after n_sealed sealed chunks, each on
    a fresh cache (a step seals its chunk), after one warm-up: the fastest is the one a busy machine
    disturbed least."""
    dev = model.tok_embeddings.weight.device
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.args.vocab_size, (1, chunk_size), generator=g).to(dev)  # [B, C]
    times = []
    for _ in range(reps + 1):
        cache = filled_cache(model, n_sealed * chunk_size, chunk_size, chunk_size, kv_dtype)
        try:
            sync(dev)
            t = time.perf_counter()
            prefill(model, cache, ids)
            sync(dev)
            times.append(time.perf_counter() - t)
        finally:
            cache.store.close()
    return min(times[1:])


def worker_handoff_s(n=100):
    """A round trip to a worker thread, what each staged chunk pays (zstd on CPU; every offloaded
    chunk on CUDA)."""
    with ThreadPoolExecutor(1) as pool:
        return median_time(lambda: [pool.submit(int).result() for _ in range(n)]) / n


def calibrate(model, args, contexts, modes, disk=False):
    """Everything predict_decode needs, measured here in a few seconds (the disk only for the
    probe). The decode step is measured at a context inside one chunk and at n_b sealed chunks:
    their difference is the cost of attending to L * n_b sealed chunks, from which longer contexts
    are extrapolated, one chunk at a time."""
    C = args.chunk_size
    # at least 8 chunks and 4096 positions where the context has them: a difference large enough
    # to measure
    n_b = max(1, min(max(contexts) // C, max(8, 4096 // C)))

    def step(ctx):
        return decode_step_s(model, ctx, C, kv_dtype=args.kv_dtype)

    cal = {"step_s": step(1), "link_gbps": link_bandwidth(args.device),
           "step_at_s": {n_b: step(n_b * C)}}
    cal["chunk_s"] = max(0.0, cal["step_at_s"][n_b] - cal["step_s"]) / (model.args.n_layers * n_b)
    cal["worker_handoff_s"] = worker_handoff_s()
    cal["read_gbps"] = read_bandwidth(args.device)
    cal["zstd"] = None
    if "disk+zstd" in modes or disk:
        cal["zstd"] = zstd_on_real_kv(model, C, kv_dtype=args.kv_dtype)
    if disk:
        cal["disk_gbps"] = disk_bandwidth(args.offload_dir, args.probe_mib << 20)
    return cal


def median_of(cals):
    """Element-wise median of the calibrations of each repeat (they drift with the machine, as the
    runs do)."""
    cals = [c for c in cals if c is not None] or [None]  # measured on some repeats only (zstd)
    if isinstance(cals[0], dict):
        return {k: median_of([c[k] for c in cals if k in c]) for k in cals[0]}
    if isinstance(cals[0], (int, float)):
        return statistics.median(cals)
    return cals[0]


def halfway(ctx, mode, args, model_args):
    """The chunks per tier halfway through decoding (policy.plan_tiers), when ctx +
    new_tokens // 2 positions are written: plan_tiers counts the chunk of the next position as the
    open one."""
    tier = MODE_SPECS[mode][0]
    return plan_tiers(ctx + args.new_tokens // 2 + 1, args.chunk_size, args.window,
                      model_args.n_layers, tier)


def predict_decode(cal, ctx, mode, args, model_args, cuda):
    """Predicted decode tokens/s. A step = fixed + its sealed chunks, one after another:
        fixed   the measured decode step at a context inside one chunk (weights, open chunk,
                sampling, Python)
        a       attending to one sealed chunk: (step at n_b sealed chunks - fixed) / (L * n_b),
                measured
        n_off   the chunks not on the device (policy.plan_tiers; 0 with --offload none); each
                costs instead:
    CPU, cpu and raw disk: read in place (disk through views of the mapped file made once), nothing
    moves: a.
    CPU, disk+zstd: the worker decompresses a chunk (d) a few staging slots ahead of attention:
    max(a, d + handoff), the slower end of the pipeline.
    CUDA: the worker (a handoff, plus a memcpy into a pinned bounce buffer for disk, or d for zstd)
    feeds a side stream that copies at pinned H2D speed while attention runs: max(a, worker,
    chunk / H2D)."""
    z = cal["zstd"]
    link = cal["link_gbps"]
    a = cal["chunk_s"]
    if mode == "disk+zstd" and not z:
        return None
    tiers = halfway(ctx, mode, args, model_args)
    sealed = tiers.device + tiers.offloaded
    n_off = tiers.offloaded
    chunk = chunk_bytes(model_args, args, args.chunk_size)
    worker = cal["worker_handoff_s"]
    if mode == "disk+zstd":
        worker += z["decompress_s_per_chunk"] * chunk / z["chunk_bytes"]
    elif mode == "disk":
        worker += chunk / (link["host_memcpy"] * GB)
    if cuda and mode != "none":
        per_off = max(a, worker, chunk / (link["h2d_pinned"] * GB))
    else:
        per_off = max(a, worker) if mode == "disk+zstd" else a
    return 1.0 / (cal["step_s"] + (sealed - n_off) * a + n_off * per_off)


def prefill_fit(model, ctx, chunk_size, kv_dtype="auto"):
    """(fixed, per_chunk): a prefill step of C tokens after k sealed chunks costs fixed + k *
    per_chunk, measured at k = 0 and k = n_b (up to 8, as the decode calibration does), so that the
    slope is a difference worth measuring."""
    n_b = max(1, min(8, ctx // chunk_size - 1))
    fixed = prefill_step_s(model, 0, chunk_size, kv_dtype=kv_dtype)
    at_n_b = prefill_step_s(model, n_b, chunk_size, kv_dtype=kv_dtype)
    return fixed, max(0.0, (at_n_b - fixed) / n_b)


def predict_prefill(fit, cal, ctx, mode, args, model_args):
    """Predicted prefill tokens/s: N = ctx / C steps, step k attending k sealed chunks, so N * fixed
    + per_chunk * N (N - 1) / 2 seconds; disk+zstd adds compressing each chunk that leaves the
    device (the writer thread shares the cores with the compute on a small machine). Other tiers
    move chunks off the critical path: nothing added."""
    fixed, per_chunk = fit
    N = -(-ctx // args.chunk_size)
    s = N * fixed + per_chunk * N * (N - 1) / 2
    if mode == "disk+zstd" and cal.get("zstd"):
        chunk = chunk_bytes(model_args, args, args.chunk_size)
        leaving = plan_tiers(ctx, args.chunk_size, args.window, model_args.n_layers).offloaded
        s += leaving * chunk / (cal["zstd"]["compress_gbps"] * GB)
    return ctx / s


def verdict(cal, args, model_args, contexts, modes, cuda):
    """Plain words: will offload pay on this machine?"""
    ctx = max(contexts)
    link = cal["link_gbps"]
    kv = ctx * kv_bytes_per_token(model_args, DTYPES[args.dtype], args.kv_dtype, args.chunk_size)
    pred = {m: predict_decode(cal, ctx, m, args, model_args, cuda) for m in ["none"] + modes}
    ratios = [f"{m} {pred[m] / pred['none']:.2f}x" for m in modes if m != "none" and pred[m]]
    out = [f"Predicted decode at {ctx} tokens relative to --offload none: {', '.join(ratios)}."]
    if not cuda:
        why = "CUDA is absent" if not torch.cuda.is_available() else "--device cpu"
        out.append(why + ": 'device' and host are the same memory, so --offload cpu and raw "
                   "--offload disk move no bytes (chunks are read in place, disk chunks from the "
                   "page cache while RAM lasts) and cost only bookkeeping; raw disk does take the "
                   "KV out of the process's own memory (RssAnon). Offload will not make decoding "
                   "faster on this machine: use --offload disk when the KV would not fit in RAM, "
                   "and nothing otherwise.")
    else:
        h2d = link["h2d_pinned"]
        if h2d < 10:
            advice = ("Below ~10 GB/s host offload costs more than it saves for most decode "
                      "workloads: keep the KV on the device when it fits.")
        else:
            advice = (f"Each GiB offloaded costs ~{2**30 / (h2d * GB) * 1e3:.0f} ms per decode "
                      "step: offload pays when the KV would not fit otherwise, or for "
                      "prefill-heavy work.")
        out.append(f"Pinned H2D {h2d:.1f} GB/s (pageable {link['h2d_pageable']:.1f}; "
                   f"{link['h2d_d2h_at_once_each']:.1f} each way with D2H at once). " + advice)
    if cal["zstd"]:
        z = cal["zstd"]
        out.append(f"zstd on this model's real KV: ratio {z['ratio']:.2f}x, compress "
                   f"{z['compress_gbps']:.2f} GB/s, decompress {z['decompress_gbps']:.2f} GB/s on "
                   "one thread: it pays only for a disk that reads slower than that, cold (never "
                   f"from the page cache), and then gains at most {z['ratio']:.2f}x.")
    if "disk_gbps" in cal:
        d = cal["disk_gbps"]
        if d["read"] < 1:
            kind = "HDD/SATA class: a cold disk tier is the bottleneck"
        elif d["read"] < 3:
            kind = "SATA/low-end NVMe class"
        else:
            kind = "NVMe class"
        out.append(f"Disk ({d['method']}): write {d['write']:.2f} GB/s, read {d['read']:.2f} GB/s, "
                   f"{kind}; read cold, a decode step at {ctx} tokens ({kv / 2**30:.2f} GiB of KV) "
                   f"would take {kv / (d['read'] * GB):.2f} s.")
    return out


def report(machine, cal, args, model_args, contexts, modes, cuda):
    """The probe's printout: environment, bandwidths, calibration, predictions, verdict."""
    if not machine["cuda_usable"]:
        gpus = "CUDA is absent: host memcpy measured instead of host<->device links"
    else:
        gpus = (f"{len(machine['gpus'])} device(s): {', '.join(machine['gpus'])}, "
                f"{machine['device_free_gib']} of {machine['device_total_gib']} GiB free")
        if not cuda:
            gpus += " (not used: --device cpu)"
    kv_per_token = kv_bytes_per_token(model_args, DTYPES[args.dtype], args.kv_dtype,
                                      args.chunk_size)
    links = ", ".join(f"{k} {v:.2f}" for k, v in cal["link_gbps"].items())
    steps = ", ".join(f"{s * 1e3:.2f} ms with {n} sealed chunks"
                      for n, s in cal["step_at_s"].items())
    lines = [f"torch {machine['torch']} (CUDA build {machine['cuda_build']}), CUDA usable: "
             f"{machine['cuda_usable']}, {gpus}; {machine['cpu_count']} CPUs, "
             f"{machine['torch_threads']} torch threads, load {machine['loadavg']}",
             "copy bandwidth GB/s: " + links,
             f"{args.ckpt}: {model_args.n_layers} layers x {model_args.n_kv_heads} kv heads x "
             f"{model_args.head_dim}, {kv_per_token / 1024:.1f} KiB of KV per token ({args.dtype} "
             f"compute, --kv-dtype {args.kv_dtype})",
             f"calibration: decode step {cal['step_s'] * 1e3:.2f} ms inside one chunk, " + steps
             + f" per layer: {cal['chunk_s'] * 1e6:.0f} us per sealed chunk; worker handoff "
             f"{cal['worker_handoff_s'] * 1e6:.1f} us per staged chunk",
             "",
             "| context | " + " | ".join(f"{m} decode tok/s (predicted)" for m in modes) + " |",
             "|---" * (len(modes) + 1) + "|"]
    for ctx in contexts:
        p = [predict_decode(cal, ctx, m, args, model_args, cuda) for m in modes]
        cells = ["-" if x is None else f"{x:,.1f}" for x in p]
        lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + verdict(cal, args, model_args, contexts, modes, cuda))


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(prog="probe.py", description=__doc__, epilog=ALIAS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_flags(p, "probe")
    p.add_argument("--repeats", type=int, default=3,
                   help="calibrations, element-wise medians reported; the disk is measured in the "
                   "first (default %(default)s)")
    p.add_argument("--probe-mib", type=int, default=512,
                   help="size of the probe's disk test file (default %(default)s MiB)")
    return one_line_errors(p)


def check(args):
    """Every flag, before any heavy work. Returns (contexts, modes)."""
    if min(args.new_tokens - 1, args.repeats, args.probe_mib // 8) < 1:
        raise UsageError("--new-tokens must be >= 2, --repeats >= 1 and --probe-mib >= 8")
    out = check_measure(args, "probe")  # makes --offload-dir, where the disk test file goes
    free = shutil.disk_usage(args.offload_dir).free
    if args.probe_mib << 20 > free // 2:
        raise UsageError(f"--probe-mib {args.probe_mib}: the disk test file would take more than "
                         f"half of the {free >> 20:,} MiB free in {args.offload_dir}; lower "
                         "--probe-mib or give another --offload-dir")
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)
    tmp = None
    try:
        contexts, modes = check(args)
        set_threads(args)  # cores.py: the cores this run may use
        dtype = DTYPES[args.dtype]
        if args.random_model and not args.ckpt:  # the random model's files, removed at the end
            tmp = tempfile.mkdtemp(prefix="probe-model-")
        model_args, contexts = measured_model_args(args, contexts, tmp)
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=dtype,
                                            rope_override=rope_override(args),
                                            quantize=quantize_mode(args))
        machine = environment(args.device)
        cuda = is_cuda(args.device)
        # the disk is measured once, in the first repeat
        cals = [calibrate(model, args, contexts, modes, disk=r == 0) for r in range(args.repeats)]
        cal = median_of(cals)
    except (UsageError, CheckpointError, OffloadError, DiskError, TaskDirError) as e:
        print(f"probe.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_created_offload_dir(args)
    print(report(machine, cal, args, model_args, contexts, modes, cuda))
    if args.json:
        predicted = {ctx: {m: predict_decode(cal, ctx, m, args, model_args, cuda) for m in modes}
                     for ctx in contexts}
        out = {"machine": machine, "config": describe(args, model_args, contexts, modes),
               "calibration": cal, "verdict": verdict(cal, args, model_args, contexts, modes, cuda),
               "predicted": predicted}
        # 0600, and a link at the name is replaced, never followed
        write_atomic(args.json, json.dumps(out, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
