"""
One generation task: its cache and tiers, its directory on disk, resume after a crash, and measured statistics.
generate.py's command line (single prompt or --prompts batch) and bench.py / verify.py all run tasks through
run_task, so every number they print is measured the same way.
"""
import time

import torch

from generate import Sampling, generate
from kvcache import KVCache
from monitor import host_memory
from offload import TieredStore
from taskdir import TaskDir
from tp import Layout, agree_min


def make_cache(model, cfg, chunk_size, max_length, disk_path=None, restore=None, on_durable=None):
    a, p = model.args, next(model.parameters())
    G = model.layers[0].attention.n_local_kv_heads  # this rank's kv heads (all of them without tensor parallel)
    store = TieredStore(a.n_layers, 1, G, a.head_dim, chunk_size, max_length, p.device, p.dtype, cfg,
                        disk_path, restore, on_durable)
    return KVCache(store)


def resume_point(manifest, task, chunk_size):
    """From a manifest left by an interrupted run: (chunks to restore, generated tokens to replay, why not)."""
    if manifest is None:
        return 0, [], None
    for key, value in task.items():
        if manifest.get(key) != value:
            return 0, [], f"manifest was written for another {key}"
    tokens = manifest.get("tokens", [])
    P = len(task["prompt_ids"])
    if tokens[:P] != task["prompt_ids"]:
        return 0, [], "manifest tokens do not start with this prompt"
    n = min(len(manifest.get("chunks", {})), (len(tokens) - 1) // chunk_size)  # keep >= 1 position to recompute
    return n, tokens[P:], None


def run_task(model, tokenizer, prompt_ids, max_new_tokens, chunk_size, cfg, sampling=Sampling(), task_id="0",
             on_token=None, on_step=None, fingerprint=None, log=None, layout=None):
    """Generate for one prompt with its own cache; returns (new ids, stats) with everything measured.

    With the disk tier the task owns offload_dir/task_<id>/ (locked; see taskdir.py). Given a model fingerprint,
    the disk tier doubles as a checkpoint: a manifest follows every synced chunk, and a rerun after a crash
    restores the chunks it vouches for. The directory is removed on success (unless cfg.keep_files) and kept
    on failure, for the next run to resume from. Under tensor parallelism (layout, see tp.py) each rank keeps its
    own store in task_<id>/rank<r>/ and the ranks resume together from the shortest prefix they all vouch for."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    layout = layout or Layout.single()
    taskdir = TaskDir(cfg.offload_dir, task_id, layout.rank_dir()) if cfg.mode == "disk" else None
    if fingerprint and layout.tp > 1:  # a rank's KV depends on N and on which heads it holds
        fingerprint = f"{fingerprint}-{layout.fingerprint_part()}"
    task = {"fingerprint": fingerprint, "dtype": str(next(model.parameters()).dtype), "device": device.type,
            "chunk_size": chunk_size, "compress": cfg.compress, "prompt_ids": list(prompt_ids),
            "max_new_tokens": max_new_tokens, "sampling": vars(sampling)}
    manifest = taskdir.read_manifest() if taskdir and fingerprint else None
    n_restore, replay, why = resume_point(manifest, task, chunk_size)
    if why and log:
        log(f"task {task_id}: {why}; not used, recomputing from the start")
    n_restore = agree_min(n_restore, layout)  # the ranks of a replica step together: same prefix, same replay
    replay = replay[:agree_min(len(replay), layout)]
    out = list(replay)  # the tokens so far; durable() reads it from the worker thread

    def durable(n, chunks):  # worker thread: chunks 0..n-1 are synced; vouch for them
        taskdir.write_manifest({**task, "tokens": list(prompt_ids) + list(out), "chunks": chunks})

    ok, cache = False, None
    try:
        def open_cache(n):  # positions past the n restored chunks are recomputed, the replayed tokens fed again
            c = make_cache(model, cfg, chunk_size, len(prompt_ids) + max_new_tokens, taskdir and taskdir.path,
                           restore=manifest["chunks"] if n else None,
                           on_durable=durable if taskdir and fingerprint else None)
            return c, c.store.restore(n, manifest["chunks"]) if n else 0
        cache, restored = open_cache(n_restore)
        agreed = agree_min(restored, layout)
        if agreed < restored:  # another rank's store vouches for fewer chunks: reopen ours at that prefix
            cache.store.close()
            cache = None
            cache, restored = open_cache(agreed)
        if restored < n_restore and log:
            log(f"task {task_id}: chunk {restored} is missing or fails its checksum"
                f"{' on some rank' if layout.tp > 1 else ''}; recomputing from there")
        cache.length = restored * chunk_size
        resumed_from = cache.length
        new, stats = _timed_generate(model, cache, prompt_ids, max_new_tokens, sampling, tokenizer, cuda, device,
                                     out, on_token, on_step)
        ok = True
    finally:
        if cache is not None:
            cache.store.close()
        if taskdir:
            taskdir.close(remove=ok and not cfg.keep_files)
    stats["resumed_from"] = resumed_from
    return new, stats


def _timed_generate(model, cache, prompt_ids, max_new_tokens, sampling, tokenizer, cuda, device, out, on_token, on_step):
    peak = {"anon": 0, "rss": 0, "file": 0}
    clock = {"t": time.perf_counter(), "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    replayed = list(out)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def step(phase, logits):
        sync()
        now = time.perf_counter()
        clock[phase + "_s"] += now - clock["t"]
        clock["t"] = now
        clock["decode_steps"] += phase == "decode"
        for k, v in host_memory().items():
            peak[k] = max(peak[k], v)
        if on_step:
            on_step(phase, logits, cache)

    def token_cb(new):
        out[:] = new  # durable() reads it from the worker thread
        if len(new) == len(replayed) + 1:  # the first sampled token ends prefill: restart the clock for decoding
            clock["ttft_s"] = clock["prefill_s"] + time.perf_counter() - clock["t"]
            clock["t"] = time.perf_counter()
        if on_token:
            on_token(new)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new = generate(model, cache, ids, max_new_tokens, sampling, tokenizer.eos_ids if tokenizer else (),
                   token_cb, step, replay=replayed)
    store_stats = cache.store.stats()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return new, {
        "prefill_s": round(clock["prefill_s"], 4),
        "prefill_tokens_per_s": round(len(prompt_ids) / max(clock["prefill_s"], 1e-9), 2),
        "ttft_s": round(clock.get("ttft_s", clock["prefill_s"]), 4),
        "decode_s": round(clock["decode_s"], 4),
        "decode_tokens_per_s": round(clock["decode_steps"] / clock["decode_s"], 2) if clock["decode_s"] else 0.0,
        # CUDA: the allocator's peak. CPU: weights plus the KV chunks allocated on the "device" tier.
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else weights + store_stats["kv_device_bytes_peak"],
        "peak_host_rss_bytes": peak["rss"],
        "peak_host_anon_bytes": peak["anon"],
        "peak_host_file_bytes": peak["file"],
        "bytes": store_stats["bytes"],
        "chunks": store_stats["chunks"],
    }
