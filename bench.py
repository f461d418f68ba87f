"""
Measure it: prefill and decode speed, memory and bytes moved for every offload mode, against transformers on the
same checkpoint, beside a prediction made from this machine's own bandwidths.

    python bench.py --ckpt DIR --contexts 1024,4096,8192 --modes none,cpu,disk,disk+zstd --vs-hf --json out.json
    python bench.py --random-model 7b-like --layers 4 --dtype bf16 --contexts 4096,16384 --modes none,disk
    python bench.py --probe --offload-dir /mnt/nvme/kv     # what this machine can move, and what offload will cost

All runs happen in one process, interleaved (for each repeat: for each context: for each mode; the mode order is
reversed on odd repeats) so that the drift of a shared machine hits every mode alike. Every number reported is
the median of --repeats runs; the spread (min-max) is printed beside the speeds. The prompt is random token ids
with a fixed seed, so EOS never stops a run early. JSON keys: "machine", "config", "calibration", "results" (one
row per context and mode: the medians, "*_spread", "prefill_vs_none", "decode_vs_none",
"predicted_decode_tokens_per_s", "prediction_error", and with --vs-hf "ours_over_hf_prefill"/"ours_over_hf_decode"),
"hf" (rows for transformers' caches). The prediction model is written out in predict_decode().
"""
import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from generate import (DEMO_CKPT, DTYPES, UsageError, check_writable_dir, host_memory, make_cache, prefill,
                      return_large_frees_to_os, run_task)
from kvcache import attend_chunk
from model import CheckpointError, ModelArgs, Transformer, ours_to_hf, read_json
from offload import OffloadConfig, OffloadError

MODE_SPECS = {"none": ("none", "none"), "cpu": ("cpu", "none"), "disk": ("disk", "none"), "disk+zstd": ("disk", "zstd")}
PRESETS = {  # --random-model NAME; key=value pairs after it override (layers=, dim=, heads=, kv_heads=, head_dim=, ...)
    "7b-like": dict(dim=4096, layers=32, heads=32, kv_heads=32, head_dim=128, hidden=11008, vocab=32000),  # Llama-2-7B
    "kv-heavy": dict(dim=1024, layers=4, heads=16, kv_heads=16, head_dim=64, hidden=2816, vocab=32000),
    "tiny": dict(dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=128, vocab=256),
}
GB = 1e9


def median_time(fn, reps=5, sync=lambda: None):
    """Median wall time of fn() over reps calls, after one warm-up call."""
    fn(), sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(), sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_sync(device):
    return (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)


# -----------------------------------------------------------------------------
# random checkpoints: our ModelArgs -> random weights -> safetensors with Hugging Face names + config.json

def parse_model_spec(spec, layers=None):
    """'7b-like' or '7b-like,layers=4' or 'dim=512,layers=4,heads=8,kv_heads=8,hidden=1376,vocab=32000'."""
    sizes, keys = {}, ("dim", "layers", "heads", "kv_heads", "head_dim", "hidden", "vocab")
    for i, part in enumerate(p.strip() for p in spec.split(",") if p.strip()):
        key, eq, val = part.partition("=")
        if not eq and i == 0 and key in PRESETS:
            sizes.update(PRESETS[key])
        elif eq and key in keys and val.isdigit() and int(val) > 0:
            sizes[key] = int(val)
        else:
            raise UsageError(f"--random-model: cannot read {part!r}; give a preset {sorted(PRESETS)} and/or "
                             f"positive key=value pairs with keys {keys}")
    if layers is not None:
        sizes["layers"] = layers
    missing = [k for k in keys if k not in sizes and k != "head_dim"]
    if missing:
        raise UsageError(f"--random-model {spec}: missing {missing} (or start with a preset: {sorted(PRESETS)})")
    if sizes["heads"] % sizes["kv_heads"]:
        raise UsageError(f"--random-model: heads={sizes['heads']} is not a multiple of kv_heads={sizes['kv_heads']}")
    sizes.setdefault("head_dim", sizes["dim"] // sizes["heads"])
    return sizes


def build_random_checkpoint(sizes, out_dir, dtype, device="cpu", max_positions=131072, seed=0):
    """Random weights (std 1/sqrt(fan in), norms at 1) saved as a LlamaForCausalLM directory that both
    Transformer.from_pretrained and transformers load. Generated on `device` (fast on a GPU), saved from the CPU."""
    from safetensors.torch import save_file
    a = ModelArgs(dim=sizes["dim"], n_layers=sizes["layers"], n_heads=sizes["heads"], n_kv_heads=sizes["kv_heads"],
                  head_dim=sizes["head_dim"], hidden_dim=sizes["hidden"], vocab_size=sizes["vocab"],
                  max_seq_len=max_positions, torch_dtype=str(dtype).removeprefix("torch."))
    with torch.device("meta"):
        model = Transformer(a)
    g = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            t = torch.ones(p.shape, dtype=dtype)
        else:  # embedding rows at std 1, linear layers at std 1/sqrt(fan in): activations stay O(1)
            std = 1.0 if name.startswith("tok_embeddings") else p.shape[1] ** -0.5
            t = (torch.randn(p.shape, generator=g, device=device) * std).to(dtype).cpu()
        tensors[ours_to_hf(name)] = t
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": a.dim, "intermediate_size": a.hidden_dim, "num_hidden_layers": a.n_layers,
              "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
              "vocab_size": a.vocab_size, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
              "torch_dtype": a.torch_dtype, "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


# -----------------------------------------------------------------------------
# probe: the software, the links, the disk, zstd on real KV

def environment(device):
    env = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_usable": torch.cuda.is_available(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device),
           "loadavg": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if env["cuda_usable"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        free, total = torch.cuda.mem_get_info(torch.device(device) if "cuda" in str(device) else 0)
        env["device_free_gib"], env["device_total_gib"] = round(free / 2**30, 1), round(total / 2**30, 1)
    return env


def link_bandwidth(device, nbytes=256 << 20):
    """GB/s. CUDA: pinned and pageable host<->device, and both directions at once (pinned, two streams).
    CPU: there is no link; host memcpy speed is what a copy between tiers would cost."""
    if torch.device(device).type != "cuda":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        return {"host_memcpy": nbytes / median_time(lambda: dst.copy_(src)) / GB}
    sync, dev, out = device_sync(device), torch.empty(nbytes, dtype=torch.uint8, device=device), {}
    for pinned in (True, False):
        host, kind = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned), "pinned" if pinned else "pageable"
        out[f"h2d_{kind}"] = nbytes / median_time(lambda: dev.copy_(host, non_blocking=pinned), sync=sync) / GB
        out[f"d2h_{kind}"] = nbytes / median_time(lambda: host.copy_(dev, non_blocking=pinned), sync=sync) / GB
    h_in, h_out = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2, s_in, s_out = torch.ones(nbytes, dtype=torch.uint8, device=device), torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both():
        with torch.cuda.stream(s_in):
            dev.copy_(h_in, non_blocking=True)
        with torch.cuda.stream(s_out):
            h_out.copy_(dev2, non_blocking=True)
    out["h2d_and_d2h_at_once_each"] = nbytes / median_time(both, sync=sync) / GB  # per direction, both running
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    out["host_memcpy"] = nbytes / median_time(lambda: dst.copy_(src)) / GB  # the disk tier's read_into on CUDA
    return out


def disk_bandwidth(dirpath, nbytes=512 << 20, block=8 << 20):
    """Sequential write then read of a scratch file in dirpath, around the page cache: O_DIRECT where the file
    system allows it, else buffered I/O + fsync + posix_fadvise(DONTNEED) so the read comes from the device."""
    path, buf = os.path.join(dirpath, f".bench-probe-{os.getpid()}"), mmap.mmap(-1, block)  # mmap: page aligned
    buf.write(os.urandom(block))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        os.write(fd, buf)  # some file systems accept O_DIRECT at open and refuse the first write
        method = "O_DIRECT"
    except OSError:
        direct, method = 0, "buffered + fsync + posix_fadvise(DONTNEED)"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        t = time.perf_counter()
        for _ in range(nbytes // block):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop the (now clean) cached pages
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | direct)
        t = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        read_s = time.perf_counter() - t
    finally:
        os.close(fd)
        os.remove(path)
    return {"write": nbytes / write_s / GB, "read": nbytes / read_s / GB, "method": method, "dir": dirpath}


def split_planes(flat_bytes, itemsize):
    # as offload's DiskTier.write: the byte planes of each element split ([itemsize, n]) before zstd
    return flat_bytes.reshape(-1, itemsize).T.copy()


def zstd_on_real_kv(model, chunk_size, n_chunks=2):
    """Compress the sealed chunks of a short prefill the way the disk tier does (byte planes, zstd level 1); time
    the compression and the decompression + un-split (what the worker does per chunk on a disk+zstd read)."""
    try:
        import zstandard
    except ImportError:
        return None
    cache = make_cache(model, OffloadConfig(), chunk_size, chunk_size * n_chunks + 1)
    ids = torch.randint(3, model.args.vocab_size, (1, chunk_size * n_chunks), generator=torch.Generator().manual_seed(1))
    try:
        prefill(model, cache, ids.to(next(model.parameters()).device))
        chunks = [torch.stack(cache.store.load(l, j)).cpu() for l in range(model.args.n_layers) for j in range(n_chunks)]
    finally:
        cache.store.close()
    zc, zd, item = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor(), chunks[0].element_size()
    raw = [c.reshape(-1).view(torch.uint8).numpy() for c in chunks]
    t = time.perf_counter()
    blobs = [zc.compress(split_planes(r, item).tobytes()) for r in raw]
    comp_s, dst, t = time.perf_counter() - t, torch.empty_like(chunks[0]), time.perf_counter()
    for b in blobs:  # as DiskTier.read_into: decompress, then put the byte planes back in place
        planes = np.frombuffer(zd.decompress(b, max_output_size=dst.numel() * item), dtype=np.uint8)
        dst.reshape(-1).view(torch.uint8).numpy().reshape(-1, item)[:] = planes.reshape(item, -1).T
    dec_s, total = time.perf_counter() - t, sum(r.nbytes for r in raw)
    return {"ratio": total / sum(map(len, blobs)), "compress_gbps": total / comp_s / GB,
            "decompress_gbps": total / dec_s / GB, "decompress_s_per_chunk": dec_s / len(blobs),
            "chunks": len(blobs), "chunk_bytes": raw[0].nbytes}


# -----------------------------------------------------------------------------
# calibration and prediction

def short_decode_s(model, chunk_size, new=16):
    """One decode step at a context inside the first chunk: weights, the open chunk, sampling, Python."""
    ids = torch.randint(3, model.args.vocab_size, (max(1, chunk_size // 4),), generator=torch.Generator().manual_seed(2))
    steps = [1 / run_task(model, None, ids.tolist(), new + 1, chunk_size, OffloadConfig())[1]["decode_tokens_per_s"]
             for _ in range(4)]
    return statistics.median(steps[1:])  # the first run warms up


def sealed_attention_s(model, n_sealed, chunk_size, cap=1 << 30):
    """One decode step's attention over n_sealed chunks per layer: L * n_sealed calls of kvcache.attend_chunk over
    chunk-shaped buffers as large as that KV (capped at 1 GiB, then cycled), so the memory traffic is real."""
    if n_sealed == 0:
        return 0.0
    a, p = model.args, next(model.parameters())
    shape = (2, 1, a.n_kv_heads, chunk_size, a.head_dim)                     # one chunk [2, B, G, C, D]
    n_buf = max(1, min(a.n_layers * n_sealed, cap // (p.element_size() * 2 * a.n_kv_heads * chunk_size * a.head_dim)))
    buf = torch.empty((n_buf, *shape), dtype=p.dtype, device=p.device).uniform_(-1, 1)
    q = torch.randn(1, a.n_kv_heads, a.n_rep, a.head_dim, device=p.device).to(p.dtype) * a.head_dim ** -0.5  # [B, G, R, D]

    def step():
        i = 0
        for _ in range(a.n_layers):
            state = None
            for _ in range(n_sealed):
                kv, i = buf[i % n_buf], i + 1
                state = attend_chunk(q, kv[0], kv[1], state)
    return median_time(step, sync=device_sync(p.device))


def per_chunk_overheads(dirpath, n=2000):
    """Seconds per chunk of the bookkeeping that only offloaded chunks pay: a zero-copy tensor over a mapped file
    (the raw disk tier's view on CPU), and a worker-thread round trip (every staged chunk: zstd, or any on CUDA)."""
    path = os.path.join(dirpath, f".bench-map-{os.getpid()}")
    mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(1 << 20,))
    try:
        t = time.perf_counter()
        for i in range(n):
            torch.from_numpy(mm[(i % 4) * 4096:(i % 4) * 4096 + 65536]).view(torch.float32).view(2, 1, 2, 64, 64)
        view_s = (time.perf_counter() - t) / n
    finally:
        del mm
        os.remove(path)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(int).result()
        t = time.perf_counter()
        for _ in range(n // 4):
            pool.submit(int).result()
        handoff_s = (time.perf_counter() - t) / (n // 4)
    return {"mapped_view_s": view_s, "worker_handoff_s": handoff_s}


def calibrate(model, args, contexts, modes, probe_disk=False):
    """Everything predict_decode needs, measured here; a few seconds."""
    cal = {"fixed_step_s": short_decode_s(model, args.chunk_size), "link_gbps": link_bandwidth(args.device)}
    cal["sealed_attention_s"] = {ctx: sealed_attention_s(model, n_sealed(ctx, args), args.chunk_size) for ctx in contexts}
    cal.update(per_chunk_overheads(args.offload_dir))
    if "disk+zstd" in modes or probe_disk:
        cal["zstd"] = zstd_on_real_kv(model, args.chunk_size)
    if probe_disk:
        cal["disk_gbps"] = disk_bandwidth(args.offload_dir)
    return cal


def n_sealed(ctx, args):
    return (ctx + args.new_tokens // 2) // args.chunk_size  # sealed chunks per layer, at the middle of decoding


def predict_decode(cal, ctx, mode, args, margs, cuda):
    """Predicted decode tokens/s. One step = fixed + attention over the sealed chunks + moving what is offloaded:
        fixed      measured decode step at a context inside one chunk (weights, open chunk, sampling, Python)
        attention  measured attend_chunk calls over L * n_sealed chunk-sized buffers (real memory traffic)
        n_off      L * (n_sealed - window) chunks not on the device (0 with --offload none)
    CPU: cpu and raw disk chunks are read in place, nothing moves; raw disk adds one mapped view per chunk.
    disk+zstd: the worker decompresses the n_off chunks while attention runs (offload.prefetch queues them all, a
    few staging slots ahead), so the step costs max(attention, n_off * (decompress + handoff)).
    CUDA: chunks cross the link on a side stream while attention runs: max(attention, n_off * chunk / H2D pinned,
    the worker's time per chunk: handoff, plus for disk a memcpy from the page cache into a pinned bounce buffer)."""
    n_off = 0 if mode == "none" else margs.n_layers * max(0, n_sealed(ctx, args) - args.window)
    attn, chunk = cal["sealed_attention_s"][ctx], margs.kv_bytes_per_token(DTYPES[args.dtype]) / margs.n_layers * args.chunk_size
    move, z = 0.0, cal.get("zstd")
    if mode == "disk+zstd" and z is None:
        return None
    if mode == "disk+zstd":
        move = n_off * (z["decompress_s_per_chunk"] * chunk / z["chunk_bytes"] + cal["worker_handoff_s"])
    if cuda and mode != "none":
        link = cal["link_gbps"]
        worker = n_off * (cal["worker_handoff_s"] + (chunk / (link["host_memcpy"] * GB) if mode == "disk" else 0))
        move = max(move, worker, n_off * chunk / (link["h2d_pinned"] * GB))
    elif mode == "disk":
        attn += n_off * cal["mapped_view_s"]
    return 1.0 / (cal["fixed_step_s"] + max(attn, move))


def verdict(cal, args, margs, contexts, cuda):
    """Plain words: will offload pay on this machine?"""
    ctx, link, out = max(contexts), cal["link_gbps"], []
    pred = {m: predict_decode(cal, ctx, m, args, margs, cuda) for m in MODE_SPECS}
    rel = {m: f"{pred[m] / pred['none']:.2f}x" for m in pred if pred[m]}
    if not cuda:
        out.append(f"CUDA is absent: 'device' and host are the same memory, so --offload cpu and raw --offload disk "
                   f"move no bytes (chunks are read in place; disk chunks from the page cache while RAM lasts). "
                   f"They cost only bookkeeping: predicted decode at {ctx} tokens vs none: cpu {rel['cpu']}, "
                   f"disk {rel['disk']}. Raw disk does move the KV out of the process's own memory (RssAnon).")
    else:
        h2d = link["h2d_pinned"]
        out.append(f"Pinned H2D {h2d:.1f} GB/s (pageable {link['h2d_pageable']:.1f}, {link['h2d_and_d2h_at_once_each']:.1f} "
                   f"each way with D2H at once). Predicted decode at {ctx} tokens vs none: cpu {rel['cpu']}, disk {rel['disk']}. "
                   + ("Below ~10 GB/s host offload costs more than it saves for most decode workloads: keep the KV on "
                      "the device when it fits." if h2d < 10 else
                      f"Host offload costs ~{2**30 / (h2d * GB) * 1e3:.0f} ms per GiB offloaded per decode step; it "
                      "pays when the KV would not fit, or for prefill-heavy work."))
    if "zstd" in cal and cal["zstd"]:
        z = cal["zstd"]
        out.append(f"zstd on this model's real KV: ratio {z['ratio']:.2f}x, decompress {z['decompress_gbps']:.2f} GB/s on "
                   f"one thread: disk+zstd predicted {rel.get('disk+zstd', '?')} of none; it pays only when the disk "
                   f"reads slower than ~{z['decompress_gbps'] / z['ratio']:.2f} GB/s.")
    if "disk_gbps" in cal:
        d = cal["disk_gbps"]
        kind = "HDD/SATA class: a cold disk tier is the bottleneck" if d["read"] < 1 else \
            "SATA/low-end NVMe class" if d["read"] < 3 else "NVMe class"
        out.append(f"Disk ({d['method']}): write {d['write']:.2f} GB/s, read {d['read']:.2f} GB/s, {kind}; cold, a decode "
                   f"step at {ctx} tokens would read {ctx * margs.kv_bytes_per_token(DTYPES[args.dtype]) / 2**30:.2f} GiB "
                   f"= {ctx * margs.kv_bytes_per_token(DTYPES[args.dtype]) / (d['read'] * GB):.2f} s.")
    return out


# -----------------------------------------------------------------------------
# the runs: ours, and transformers' on the same checkpoint, prompt and dtype

def run_ours(model, ids, args, mode, tag):
    offload, compress = MODE_SPECS[mode]
    cfg = OffloadConfig(mode=offload, window=args.window, offload_dir=args.offload_dir, compress=compress)
    return run_task(model, None, ids, args.new_tokens, args.chunk_size, cfg, task_id=f"bench_{os.getpid()}_{tag}")


def load_hf(ckpt, device, dtype):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never reach the network
    import transformers
    transformers.logging.set_verbosity_error()
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, **{key: dtype}).to(device).eval()


@torch.inference_mode()
def run_hf(hf, ids, new_tokens, device, offloaded=False):
    """Prefill in one call, then greedy decoding one token per call, with DynamicCache (offloading=True: each
    layer's KV goes to the CPU after use and is prefetched back for the next step, CUDA only)."""
    import inspect
    import transformers
    params, cuda, sync = inspect.signature(hf.forward).parameters, torch.device(device).type == "cuda", device_sync(device)
    try:
        cache = transformers.DynamicCache(config=hf.config, offloading=offloaded)
    except TypeError:  # transformers 4.x
        cache = transformers.OffloadedCache() if offloaded else transformers.DynamicCache()
    kw = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # as generate() does: no logits for the prompt
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    peak = host_memory()
    t0 = time.perf_counter()
    tok = hf(input_ids=torch.tensor([ids], device=device), **kw, **keep).logits[:, -1].argmax(-1, keepdim=True)
    out, prefill_s, t1 = [tok.item()], time.perf_counter() - t0, time.perf_counter()
    for _ in range(new_tokens - 1):
        tok = hf(input_ids=tok, **kw).logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok.item())  # .item() synchronises
        peak = {k: max(v, peak[k]) for k, v in host_memory().items()}
    decode_s = time.perf_counter() - t1
    layers = getattr(cache, "layers", None)
    kv = sum(t.numel() * t.element_size() for t in ([x for l in layers for x in (l.keys, l.values)] if layers
                                                    else list(cache.key_cache) + list(cache.value_cache)))
    weights = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    return out, {"prefill_s": prefill_s, "prefill_tokens_per_s": len(ids) / prefill_s, "ttft_s": prefill_s,
                 "decode_s": decode_s, "decode_tokens_per_s": (new_tokens - 1) / decode_s,
                 "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else weights + kv,
                 "peak_host_rss_bytes": peak["rss"], "peak_host_anon_bytes": peak["anon"]}


def run_matrix(model, hf, args, contexts, modes):
    """{(context, mode): [stats of each repeat]}, interleaved; hf modes are 'hf' and on CUDA 'hf-offloaded'."""
    runs, ids_out = {}, {}
    g = torch.Generator().manual_seed(0)
    prompts = {ctx: torch.randint(3, model.args.vocab_size, (ctx,), generator=g).tolist() for ctx in contexts}
    hf_modes = [] if hf is None else ["hf"] + (["hf-offloaded"] if torch.device(args.device).type == "cuda" else [])
    for rep in range(args.repeats):
        for ctx in contexts:
            for mode in (modes + hf_modes)[::1 if rep % 2 == 0 else -1]:  # reversed order on odd repeats
                if mode.startswith("hf"):
                    new, st = run_hf(hf, prompts[ctx], args.new_tokens, args.device, mode == "hf-offloaded")
                else:
                    new, st = run_ours(model, prompts[ctx], args, mode, f"{rep}_{ctx}_{mode}")
                runs.setdefault((ctx, mode), []).append(st)
                ids_out[(ctx, mode)] = new
                print(f"repeat {rep + 1}/{args.repeats} context {ctx} {mode:<12} prefill {st['prefill_tokens_per_s']:9.1f} "
                      f"tok/s  decode {st['decode_tokens_per_s']:8.2f} tok/s  load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return runs, ids_out


# -----------------------------------------------------------------------------
# report

def summarize(runs, ids_out, cal, args, margs, contexts, modes):
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    rows, hf_rows, cuda = [], [], torch.device(args.device).type == "cuda"
    for ctx in contexts:
        base, hf = runs[(ctx, "none")] if "none" in modes else None, runs.get((ctx, "hf"))
        for mode in [m for m in modes] + [m for m in ("hf", "hf-offloaded") if (ctx, m) in runs]:
            rs = runs[(ctx, mode)]
            row = {"context": ctx, "mode": mode, "runs": len(rs)}
            for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s", "peak_device_bytes",
                      "peak_host_rss_bytes", "peak_host_anon_bytes"):
                row[k] = med(rs, k)
            for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                row[k + "_spread"] = [min(r[k] for r in rs), max(r[k] for r in rs)]
            if mode.startswith("hf"):
                row["greedy_ids_equal_ours"] = ids_out[(ctx, mode)] == ids_out.get((ctx, "none"))
                hf_rows.append(row)
                continue
            row["bytes"] = {k: med([r["bytes"] for r in rs], k) for k in rs[0]["bytes"]}
            row["chunks"] = rs[-1]["chunks"]
            for k, ref in (("vs_none", base), ("over_hf", hf)):
                if ref:
                    for phase in ("prefill", "decode"):
                        key = f"{phase}_{k}" if k == "vs_none" else f"ours_{k}_{phase}"
                        row[key] = row[f"{phase}_tokens_per_s"] / med(ref, f"{phase}_tokens_per_s")
            pred = predict_decode(cal, ctx, mode, args, margs, cuda)
            row["predicted_decode_tokens_per_s"] = pred
            row["prediction_error"] = row["decode_tokens_per_s"] / pred - 1 if pred else None
            rows.append(row)
    return rows, hf_rows


def fmt_mib(n):
    return f"{n / 2**20:,.0f}" if n >= 2**20 else f"{n / 2**20:.2f}"


def markdown(rows, hf_rows):
    sp = lambda r, k: f"{r[k]:,.1f} ({r[k + '_spread'][0]:,.1f}-{r[k + '_spread'][1]:,.1f})"  # noqa: E731
    lines = ["| context | mode | prefill tok/s (min-max) | decode tok/s (min-max) | predicted | pred. error | "
             "vs none prefill / decode | TTFT s | peak device MiB | host RSS / anon MiB | disk write / read MiB |",
             "|" + "---|" * 11]
    for r in rows:
        p, e = r["predicted_decode_tokens_per_s"], r["prediction_error"]
        lines.append(f"| {r['context']} | {r['mode']} | {sp(r, 'prefill_tokens_per_s')} | {sp(r, 'decode_tokens_per_s')} | "
                     f"{'-' if p is None else f'{p:,.1f}'} | {'-' if e is None else f'{e:+.0%}'} | "
                     f"{r.get('prefill_vs_none', 0):.2f} / {r.get('decode_vs_none', 0):.2f} | {r['ttft_s']:.2f} | "
                     f"{fmt_mib(r['peak_device_bytes'])} | {fmt_mib(r['peak_host_rss_bytes'])} / "
                     f"{fmt_mib(r['peak_host_anon_bytes'])} | {fmt_mib(r['bytes']['disk_write'])} / "
                     f"{fmt_mib(r['bytes']['disk_read'])} |")
    if hf_rows:
        ours = {(r["context"], r["mode"]): r for r in rows}
        lines += ["", "| context | transformers cache | prefill tok/s (min-max) | decode tok/s (min-max) | "
                  "ours none / theirs prefill | ours none / theirs decode | peak device MiB | same greedy ids |",
                  "|" + "---|" * 8]
        for r in hf_rows:
            o = ours.get((r["context"], "none"))
            rp, rd = (o["prefill_tokens_per_s"] / r["prefill_tokens_per_s"], o["decode_tokens_per_s"] /
                      r["decode_tokens_per_s"]) if o else (float("nan"),) * 2
            lines.append(f"| {r['context']} | {'DynamicCache' if r['mode'] == 'hf' else 'DynamicCache(offloading=True)'} | "
                         f"{sp(r, 'prefill_tokens_per_s')} | {sp(r, 'decode_tokens_per_s')} | {rp:.2f} | {rd:.2f} | "
                         f"{fmt_mib(r['peak_device_bytes'])} | {r['greedy_ids_equal_ours']} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="Hugging Face checkpoint directory (default: the demo model in assets/); with "
                   "--random-model, where to write the random model (default: a temporary directory)")
    p.add_argument("--random-model", metavar="SPEC", help=f"build a random checkpoint: a preset {sorted(PRESETS)} "
                   "and/or dim=,layers=,heads=,kv_heads=,head_dim=,hidden=,vocab=")
    p.add_argument("--layers", type=int, help="with --random-model: cut (or set) the layer count")
    p.add_argument("--contexts", default="1024,4096,8192", help="prompt lengths, comma separated (default 1024,4096,8192)")
    p.add_argument("--modes", default="none,cpu,disk,disk+zstd", help=f"comma list of {list(MODE_SPECS)} (default: all)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per run (default 32)")
    p.add_argument("--chunk-size", type=int, default=512, help="positions per KV chunk (default 512, as generate.py)")
    p.add_argument("--window", type=int, default=1, help="sealed chunks per layer kept on the device (default 1: "
                   "nearly all the context offloaded, the worst case; generate.py's default is 4)")
    p.add_argument("--offload-dir", default="./kv_cache_offload", help="disk tier root, also what --probe measures")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="compute and KV dtype (default fp32)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's choice; on a shared "
                   "machine 1 avoids OpenMP barrier stalls)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each context and mode; medians are reported (default 3)")
    p.add_argument("--vs-hf", action="store_true", help="also run transformers (DynamicCache; on CUDA also offloaded)")
    p.add_argument("--probe", action="store_true", help="measure this machine's links, disk and zstd and predict")
    p.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")

    def one_line_error(message):
        print(f"bench.py: error: {message}", file=sys.stderr)
        sys.exit(2)
    p.error = one_line_error
    return p


def check(args):
    """Every flag, before any heavy work. Returns (contexts, modes)."""
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not contexts or min(contexts) < 1:
        raise UsageError(f"--contexts must be positive token counts, got {args.contexts!r}")
    if not modes or any(m not in MODE_SPECS for m in modes):
        raise UsageError(f"--modes: {args.modes!r} is not a comma list of {list(MODE_SPECS)}")
    if args.new_tokens < 2 or args.chunk_size < 1 or args.window < 0 or args.repeats < 1 or args.threads < 0:
        raise UsageError("--new-tokens must be >= 2, --chunk-size and --repeats >= 1, --window and --threads >= 0")
    if args.layers is not None and (args.layers < 1 or not args.random_model):
        raise UsageError("--layers goes with --random-model and must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    for name, needed in (("transformers", args.vs_hf), ("zstandard", "disk+zstd" in modes and not args.probe)):
        try:
            needed and __import__(name)
        except ImportError:
            raise UsageError(f"{'--vs-hf' if name == 'transformers' else 'mode disk+zstd'} needs {name}: "
                             f"pip install {name}") from None
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: its directory does not exist")
    check_writable_dir(args.offload_dir)  # the probe measures it; bench uses it for the disk tier and scratch files
    if args.random_model:
        args.sizes = parse_model_spec(args.random_model, args.layers)
        if args.ckpt and os.path.exists(args.ckpt) and os.listdir(args.ckpt):
            raise UsageError(f"--ckpt {args.ckpt} is not empty: with --random-model it names where to write the new "
                             "model; give a new directory, or drop --random-model to bench the model already there")
    else:
        args.ckpt = args.ckpt or DEMO_CKPT
        if not os.path.isdir(args.ckpt):
            raise UsageError(f"--ckpt {args.ckpt}: no such directory")
    return contexts, modes


def probe_report(cal, args, margs, contexts, modes, cuda):
    env, lines = cal["machine"], []
    lines.append(f"torch {env['torch']} (CUDA build {env['cuda_build']}), CUDA usable: {env['cuda_usable']}"
                 + (f", {len(env['gpus'])} device(s): {', '.join(env['gpus'])}, {env['device_free_gib']} of "
                    f"{env['device_total_gib']} GiB free" if cuda else ", no CUDA device: bench runs on the CPU")
                 + f"; {env['cpu_count']} CPUs, {env['torch_threads']} torch threads, load {env['loadavg']}")
    lines.append("links (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in cal["link_gbps"].items())
                 + ("" if cuda else " (CUDA absent: host memcpy measured instead)"))
    lines.append(f"checkpoint {args.ckpt}: {margs.n_layers} layers x {margs.n_kv_heads} kv heads x {margs.head_dim}, "
                 f"{margs.kv_bytes_per_token(DTYPES[args.dtype]) / 1024:.1f} KiB of {args.dtype} KV per token")
    lines.append(f"calibration: fixed decode step {cal['fixed_step_s'] * 1e3:.2f} ms, mapped view "
                 f"{cal['mapped_view_s'] * 1e6:.1f} us/chunk, worker handoff {cal['worker_handoff_s'] * 1e6:.1f} us/chunk, "
                 + ", ".join(f"attention at {c}: {s * 1e3:.2f} ms" for c, s in cal["sealed_attention_s"].items()))
    lines += ["", "| context | " + " | ".join(f"{m} predicted tok/s" for m in modes) + " |", "|" + "---|" * (len(modes) + 1)]
    for ctx in contexts:
        p = [predict_decode(cal, ctx, m, args, margs, cuda) for m in modes]
        lines.append(f"| {ctx} | " + " | ".join("-" if x is None else f"{x:,.1f}" for x in p) + " |")
    return "\n".join(lines + [""] + verdict(cal, args, margs, contexts, cuda))


def main(argv=None):
    args = build_parser().parse_args(argv)
    return_large_frees_to_os()
    tmp = None
    try:
        contexts, modes = check(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.random_model:
            tmp = None if args.ckpt else tempfile.mkdtemp(prefix="bench-model-")
            args.ckpt = build_random_checkpoint(args.sizes, args.ckpt or tmp, DTYPES[args.dtype], args.device)
        path = os.path.join(args.ckpt, "config.json")
        margs = ModelArgs.from_config(read_json(path), path)
        if max(contexts) + args.new_tokens > margs.max_context:
            raise UsageError(f"--contexts {max(contexts)} + --new-tokens {args.new_tokens} is past the model's "
                             f"maximum context of {margs.max_context}")
        model = Transformer.from_pretrained(args.ckpt, device=args.device, dtype=DTYPES[args.dtype])
        hf = load_hf(args.ckpt, args.device, DTYPES[args.dtype]) if args.vs_hf and not args.probe else None
        machine = environment(args.device)
        cal = calibrate(model, args, contexts, modes, probe_disk=args.probe)
        cuda = torch.device(args.device).type == "cuda"
        config = {k: v for k, v in vars(args).items() if k != "sizes"} | {
            "contexts": contexts, "modes": modes, "kv_bytes_per_token": margs.kv_bytes_per_token(DTYPES[args.dtype]),
            "model": {"layers": margs.n_layers, "dim": margs.dim, "heads": margs.n_heads, "kv_heads": margs.n_kv_heads,
                      "head_dim": margs.head_dim, "hidden": margs.hidden_dim, "vocab": margs.vocab_size}}
        if args.probe:
            cal["machine"] = machine
            print(probe_report(cal, args, margs, contexts, modes, cuda))
            report = {"machine": machine, "config": config, "calibration": cal,
                      "predicted": {str(c): {m: predict_decode(cal, c, m, args, margs, cuda) for m in modes}
                                    for c in contexts}, "verdict": verdict(cal, args, margs, contexts, cuda)}
        else:
            runs, ids_out = run_matrix(model, hf, args, contexts, modes)
            machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
            rows, hf_rows = summarize(runs, ids_out, cal, args, margs, contexts, modes)
            print(f"{args.ckpt}: {config['model']}, {args.dtype} on {args.device}, chunk {args.chunk_size}, window "
                  f"{args.window}, {args.new_tokens} new tokens, median of {args.repeats}; {machine['date']}, "
                  f"{machine['cpu_count']} CPUs, {machine['torch_threads']} threads, load {machine['loadavg']} -> "
                  f"{machine['loadavg_end']}\n")
            print(markdown(rows, hf_rows))
            report = {"machine": machine, "config": config, "calibration": cal, "results": rows, "hf": hf_rows}
    except (UsageError, CheckpointError, OffloadError) as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
