"""
One generation task: its cache and tiers, its directory on disk, resume after a crash, and measured statistics.
cli.py (one prompt or a --prompts batch), bench.py and verify.py all run tasks through run_task, so every number
they print is measured the same way.
"""
import time
from contextlib import nullcontext

import torch

from generate import Sampling, generate
from kvcache import make_cache
from monitor import host_memory, process_io
from offload import on_cuda
from taskdir import TaskDir


def resume_point(manifest, task, chunk_size):
    """From a manifest left by an interrupted run: (chunks to restore, generated tokens to replay, why not)."""
    if manifest is None:
        return 0, [], None
    for key, value in task.items():
        if manifest.get(key) != value:
            why = " (other weights, or a setting that changes the KV)" if key == "fingerprint" else ""
            return 0, [], f"manifest was written for another {key}{why}"
    tokens = manifest.get("tokens", [])
    P = len(task["prompt_ids"])
    if tokens[:P] != task["prompt_ids"]:
        return 0, [], "manifest tokens do not start with this prompt"
    n = min(len(manifest.get("chunks", {})), (len(tokens) - 1) // chunk_size)  # keep >= 1 position to recompute
    return n, tokens[P:], None


def run_task(model, prompt_ids, max_new_tokens, *, chunk_size, cfg, sampling=Sampling(), eos_ids=(), task_id="0",
             on_token=None, on_step=None, fingerprint=None, log=None):
    """Generate for one prompt (a list of ids) with its own cache; returns (new ids, stats), everything measured.

    cfg is an OffloadConfig. on_token(ids so far) after each sampled token; on_step(phase, logits, cache) after each
    forward step. With the disk tier the task owns offload_dir/task_<id>/ (locked; see taskdir.py). Given a
    fingerprint (of the model and everything else that shapes its KV), the disk tier doubles as a checkpoint: a
    manifest follows every synced chunk, and a rerun after a crash restores the chunks it vouches for. The
    directory is removed on success (unless cfg.keep_files) and kept on failure, for the next run to resume from."""
    device = model.tok_embeddings.weight.device
    taskdir = TaskDir(cfg.offload_dir, task_id) if cfg.mode == "disk" else None
    task = {"fingerprint": fingerprint, "dtype": str(model.tok_embeddings.weight.dtype), "device": device.type,
            "chunk_size": chunk_size, "compress": cfg.compress, "prompt_ids": list(prompt_ids),
            "max_new_tokens": max_new_tokens, "sampling": vars(sampling)}
    manifest = taskdir.read_manifest() if taskdir and fingerprint else None
    n_restore, replay, why = resume_point(manifest, task, chunk_size)
    if why and log:
        log(f"task {task_id}: {why}; not used, recomputing from the start")
    out = list(replay)  # the tokens so far; durable() reads it from the writer thread

    def durable(n, chunks):  # writer thread: chunks 0..n-1 are synced; vouch for them
        taskdir.write_manifest({**task, "tokens": list(prompt_ids) + list(out), "chunks": chunks})

    ok, cache = False, None
    # each task computes on a stream of its own, so that concurrent tasks on one GPU never wait for each other
    stream = torch.cuda.Stream(device) if on_cuda(device) else None
    try:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            cache = make_cache(model, cfg, chunk_size, len(prompt_ids) + max_new_tokens, taskdir and taskdir.path,
                               restore=manifest["chunks"] if n_restore else None,
                               on_durable=durable if taskdir and fingerprint else None)
            if n_restore:  # positions past the restored chunks are recomputed, the replayed tokens fed again
                restored = cache.store.restore(n_restore, manifest["chunks"])
                if restored < n_restore and log:
                    log(f"task {task_id}: chunk {restored} is missing or fails its checksum; recomputing from there")
                cache.length = restored * chunk_size
            resumed_from = cache.length
            new, stats = timed_generate(model, cache, prompt_ids, max_new_tokens, sampling=sampling, eos_ids=eos_ids,
                                        out=out, on_token=on_token, on_step=on_step, stream=stream)
        ok = True
    finally:
        if cache is not None:
            cache.store.close()
        if taskdir:
            taskdir.close(remove=ok and not cfg.keep_files)
    stats["resumed_from"] = resumed_from
    return new, stats


def timed_generate(model, cache, prompt_ids, max_new_tokens, *, sampling, eos_ids, out, on_token, on_step, stream):
    """generate() with the clock, memory and bytes measured at every step. `out` holds the replayed tokens on
    entry and the tokens so far as they come; stream is this task's CUDA stream (None on CPU)."""
    peak = {"anon": 0, "rss": 0, "file": 0}
    clock = {"t": time.perf_counter(), "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    replayed, io_start = list(out), process_io()

    def step(phase, logits, cache):
        if stream is not None:
            stream.synchronize()  # this task's work only: another task's steps are not ours to wait for
        now = time.perf_counter()
        clock[phase + "_s"] += now - clock["t"]
        clock["t"] = now
        clock["decode_steps"] += phase == "decode"
        for k, v in host_memory().items():
            peak[k] = max(peak[k], v)
        if on_step:
            on_step(phase, logits, cache)

    def token_cb(new):
        out[:] = new  # durable() reads it from the writer thread
        if len(new) == len(replayed) + 1:  # the first sampled token ends prefill: restart the clock for decoding
            clock["ttft_s"] = clock["prefill_s"] + time.perf_counter() - clock["t"]
            clock["t"] = time.perf_counter()
        if on_token:
            on_token(new)

    ids = torch.tensor([prompt_ids], dtype=torch.long, device=cache.store.device)
    new = generate(model, cache, ids, max_new_tokens, sampling, eos_ids, token_cb, step, replay=replayed)
    snap, io_end = cache.store.snapshot(), process_io()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return new, {
        "prefill_s": round(clock["prefill_s"], 4),
        "prefill_tokens_per_s": round(len(prompt_ids) / max(clock["prefill_s"], 1e-9), 2),
        "ttft_s": round(clock.get("ttft_s", clock["prefill_s"]), 4),
        "decode_s": round(clock["decode_s"], 4),
        "decoded_tokens": clock["decode_steps"],  # decoded in this run: a resumed task's replayed tokens are not
        "decode_tokens_per_s": round(clock["decode_steps"] / clock["decode_s"], 2) if clock["decode_s"] else 0.0,
        # this task's own accounting (CUDA and CPU alike): the weights plus the KV chunks it allocated on the device
        "peak_device_bytes": weights + snap["kv_device_bytes_peak"],
        "peak_host_rss_bytes": peak["rss"],
        "peak_host_anon_bytes": peak["anon"],
        "peak_host_file_bytes": peak["file"],
        "pinned_bytes": snap["pinned_bytes"],
        # bytes: what the store moved (h2d, d2h; disk_write / disk_read through the disk tier's files;
        # disk_mapped_read: read by attention in place through the mapping, CPU only); io: what this process asked
        # of storage while the task ran (/proc/self/io, shared by concurrent tasks), the real device I/O
        "bytes": snap["bytes"],
        "io": {k: io_end[k] - io_start[k] for k in io_end},
        "chunks": snap["chunks"],
    }
