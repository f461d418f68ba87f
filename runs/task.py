"""
One generation task: its cache and tiers, its directory on disk, resume after a crash, and measured
statistics. cli.py (one prompt or a --prompts batch), bench.py and verify.py all run tasks through
run_task, so every number they print is measured the same way.
"""
import functools
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch

import fewrows
import speculate
from generate import Sampling, generate
from kvcache import make_cache
from policy import SELECT_FIELDS
from pools import on_cuda
from quantize import weight_bytes
from runs.cores import compute_threads
from runs.kvstore import STALE_CLAIM_S, chunk_keys
from runs.monitor import host_memory, process_io
from runs.taskdir import (
    TaskDir,
    TaskDirError,
    chunks_problem,
    manifest_size_bound,
    run_fingerprint,
    tokens_problem,
)
from runs.tp import Layout, agree_min, broadcast_token


def resume_point(manifest, task, model_args, eos_ids=()):
    """From a manifest left by an interrupted run (its checksum checked by read_manifest):
    (chunks to restore, generated tokens to replay, why not). Every field is checked by type and
    range against this task and model before it is used (taskdir.tokens_problem, chunks_problem)."""
    if manifest is None:
        return 0, [], None
    for key, value in task.items():
        if manifest.get(key) != value:
            why = ""
            if key == "fingerprint":
                why = " (other weights, or a setting that changes the KV)"
            if key == "threads":
                why = " count (--threads: the CPU splits its sums by it, so the KV's bits change)"
            return 0, [], f"manifest was written for another {key}{why}"
    C = task["chunk_size"]
    P = len(task["prompt_ids"])
    tokens = manifest.get("tokens")
    chunks = manifest.get("chunks")
    max_chunks = -(-(P + task["max_new_tokens"]) // C)
    why = (tokens_problem(tokens, task["prompt_ids"], task["max_new_tokens"],
                          model_args.vocab_size, eos_ids)
           or chunks_problem(chunks, model_args.n_layers, max_chunks, task["compress"] == "zstd"))
    if why:
        return 0, [], f"manifest {why}"
    # keep >= 1 position to recompute
    n = min(len(chunks), (len(tokens) - 1) // C)
    return n, tokens[P:], None


def cpu_threads(device):
    """The CPU kernels' thread count (None on a GPU): how a CPU splits a product's sums depends on
    it, and so do the bits of the KV, so a manifest or a stored chunk from a run with another
    --threads is not this run's (a rerun with other threads starts over, bit-identical)."""
    return compute_threads() if torch.device(device).type == "cpu" else None


def run_task(model, prompt_ids, max_new_tokens, *, chunk_size, cfg, sampling=Sampling(),
             eos_ids=(), task_id="0", on_token=None, on_step=None, fingerprint=None, log=None,
             kv_store=None, layout=None, kv_dtype="auto", batcher=None, speculation=None,
             deliver=None, keep_other_prompts=False):
    """Generate for one prompt (a list of ids) with its own cache; returns (new ids, stats),
    everything measured.

    cfg is an OffloadConfig; kv_dtype says how K and V are held (kvcache.KV_DTYPES). on_token(ids so
    far) after each sampled token; on_step(phase, logits, cache) after each forward step. With the
    disk tier the task owns offload_dir/task_<id>/ (locked; see taskdir.py). Given a fingerprint (of
    the model and everything else that shapes its KV), the disk tier doubles as a checkpoint: a
    manifest follows every synced chunk, and a rerun after a crash restores the chunks it vouches
    for. The directory is removed on success (unless cfg.keep_files) and kept on failure, for the
    next run to resume from. kv_store (a kvstore.KVStore): adopt the longest stored prefix of this
    prompt's full chunks, and store the prompt chunks this run computes, under keys chained from
    the fingerprint (see PromptCache). Under tensor parallelism (layout, see tp.py) each rank keeps
    its own store in task_<id>/rank<r>/, the ranks resume together from the shortest prefix they all
    vouch for, and rank 0's sampled token is everyone's. batcher (a batcher.Batcher): this task is
    one of a batch whose decode steps run as one forward pass, its output unchanged.
    speculation(chunk_size, max_length): this task's guesser (speculate.Lookup, speculate.Draft),
    whose verify steps leave the output unchanged; its statistics join the task's. deliver(new,
    stats): where the output goes (a results file, stdout), before the directory is removed: if it
    fails, the directory stays, and a rerun resumes from it. keep_other_prompts: a directory whose
    manifest vouches for another prompt (a lone prompt's task_0, left by an interrupted run of
    another command) is refused (TaskDirError), never recomputed over."""
    device = model.tok_embeddings.weight.device
    layout = layout or Layout.single()
    # a chunk longer than the task is cut to it: the task fits in one chunk either way, never
    # sealed, so the output is the same, and nothing is allocated or reserved for positions that
    # cannot exist
    chunk_size = min(chunk_size, len(prompt_ids) + max_new_tokens)
    taskdir = TaskDir(cfg.offload_dir, task_id, layout.rank_dir()) if cfg.mode == "disk" else None
    if fingerprint and layout.tp > 1:  # a rank's KV depends on N and on which heads it holds
        fingerprint = f"{fingerprint}-{layout.fingerprint_part()}"
    task = {
        "fingerprint": fingerprint,
        "dtype": str(model.tok_embeddings.weight.dtype),
        "device": device.type,
        "threads": cpu_threads(device),
        "chunk_size": chunk_size,
        "kv_dtype": kv_dtype,
        "compress": cfg.compress,
        "prompt_ids": list(prompt_ids),
        "max_new_tokens": max_new_tokens,
        "sampling": vars(sampling),
    }
    # which chunks decode steps read shapes the tokens, and so their KV (None: exact, which is
    # also what a manifest written before --select existed says)
    task["select"] = None
    if cfg.select != "all":
        task["select"] = [getattr(cfg, field) for field in SELECT_FIELDS] + [cfg.window]
    manifest = None
    why = None  # a manifest that cannot be used: reported, and the task starts over
    if taskdir and fingerprint:
        n_tokens = len(prompt_ids) + max_new_tokens
        bound = manifest_size_bound(n_tokens, -(-n_tokens // chunk_size), model.args.n_layers)
        manifest, why = taskdir.read_manifest(bound)
    if why is None:
        n_restore, replay, why = resume_point(manifest, task, model.args, eos_ids)
    else:
        n_restore, replay = 0, []
    other = manifest and manifest.get("prompt_ids") != task["prompt_ids"]
    if why and keep_other_prompts and other:
        taskdir.close(remove=False)
        raise TaskDirError(f"{taskdir.top} holds the run of another prompt (interrupted, or kept "
                           "by --keep-cache), which that run's command resumes; remove it (rm -r "
                           f"{shlex.quote(taskdir.top)}) or give another --offload-dir")
    if why and log:
        log(f"task {task_id}: {why}; not used, recomputing from the start")
    # the ranks of a replica step together: same prefix, same replay
    n_restore = agree_min(n_restore, layout)
    replay = replay[:agree_min(len(replay), layout)]
    out = list(replay)  # the tokens so far; durable() reads it from the writer thread
    # the compiled kernels' builds before this task: its own are those after
    built = {kind: fewrows.build_seconds(kind) for kind in ("attention", "products")}

    def durable(n, chunks):  # writer thread: chunks 0..n-1 are synced; vouch for them
        taskdir.write_manifest({**task, "tokens": list(prompt_ids) + list(out), "chunks": chunks})

    def open_cache(n):
        """A cache with its first n chunks restored from the disk tier: the positions past them
        are recomputed, the replayed tokens fed again. Returns (cache, chunks restored)."""
        c = make_cache(model, cfg, chunk_size, len(prompt_ids) + max_new_tokens,
                       taskdir and taskdir.path, restore=manifest["chunks"] if n else None,
                       on_durable=durable if taskdir and fingerprint else None,
                       kv_dtype=kv_dtype, arena=batcher and batcher.arena)
        if not n:
            return c, 0
        return c, c.store.restore(n, manifest["chunks"])

    ok = False
    cache = None
    prompt_cache = None
    # a lone task computes on a stream of its own; a batch's tasks share their forward passes, one
    # at a time (batcher.py), on the default stream
    stream = None
    if on_cuda(device) and batcher is None:
        stream = torch.cuda.Stream(device)
    try:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            cache, restored = open_cache(n_restore)
            agreed = agree_min(restored, layout)
            # another rank's store vouches for fewer chunks: reopen ours at that prefix
            if agreed < restored:
                cache.store.close()
                cache = None
                cache, restored = open_cache(agreed)
            if restored < n_restore and log:
                where = " on some rank" if layout.tp > 1 else ""
                log(f"task {task_id}: chunk {restored} is missing or fails its checksum{where}; "
                    "recomputing from there")
            cache.length = restored * chunk_size
            cache.summarize_restored(restored)  # a selection's digests of the restored chunks
            resumed_from = cache.length
            store_read_s = 0.0
            if kv_store:
                prompt_cache = PromptCache(kv_store, cache, prompt_ids, fingerprint, model,
                                           layout)
                t = time.perf_counter()
                prompt_cache.adopt(cache)
                store_read_s = time.perf_counter() - t

            def step(phase, logits, cache):
                if prompt_cache and phase == "prefill":
                    prompt_cache.store_sealed(cache)
                if on_step:
                    on_step(phase, logits, cache)
            speculator = None
            if speculation is not None:
                speculator = speculation(chunk_size, len(prompt_ids) + max_new_tokens)
            new, stats = timed_generate(model, cache, prompt_ids, max_new_tokens,
                                        sampling=sampling, eos_ids=eos_ids, out=out,
                                        on_token=on_token, on_step=step, stream=stream,
                                        layout=layout, batcher=batcher, speculator=speculator)
            if prompt_cache:
                stats.update(prompt_cache.finish())
                # reading the stored chunks comes before the first token too
                stats["store_read_s"] = round(store_read_s, 4)
                stats["ttft_s"] = round(stats["ttft_s"] + store_read_s, 4)
        stats["resumed_from"] = resumed_from
        stats["kv_dtype"] = kv_dtype
        # seconds this task spent building the compiled decode attention and products (as its
        # cache was made, before the clock: once per process, from inductor's cache after the first)
        for kind in ("attention", "products"):
            stats[f"{kind}_build_s"] = round(fewrows.build_seconds(kind) - built[kind], 3)
        if deliver is not None:
            deliver(new, stats)
        ok = True
    finally:
        if prompt_cache is not None:
            prompt_cache.close()  # a failed task's claims end here: its waiters compute
        if cache is not None:
            cache.store.close()
        if taskdir:  # a failed task's is kept to resume from, where a manifest vouches for it
            taskdir.close(remove=not cfg.keep_files if ok else not taskdir.vouches())
    return new, stats


def timed_generate(model, cache, prompt_ids, max_new_tokens, *, sampling, eos_ids, out, on_token,
                   on_step, stream, layout=None, batcher=None, speculator=None):
    """generate() with the clock, memory and bytes measured at every step. `out` holds the replayed
    tokens on entry and the tokens so far as they come; stream is this task's CUDA stream
    (None on CPU)."""
    peak = {"anon": 0, "rss": 0, "file": 0}
    clock = {"t": time.perf_counter(), "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    replayed = list(out)
    io_start = process_io()
    # prompt positions restored (resume) or adopted (--kv-store) are not computed here
    computed = max(0, len(prompt_ids) - cache.length)

    def timed_step(phase, logits, cache):
        if stream is not None:
            # this task's work only: another task's steps are not ours to wait for
            stream.synchronize()
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
        # the first sampled token ends prefill: restart the clock for decoding
        if len(new) == len(replayed) + 1:
            clock["ttft_s"] = clock["prefill_s"] + time.perf_counter() - clock["t"]
            clock["t"] = time.perf_counter()
        if on_token:
            on_token(new)

    share = None  # under tensor parallelism rank 0's sampled token is everyone's
    if layout is not None and layout.tp > 1:
        share = functools.partial(broadcast_token, layout=layout)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=cache.store.device)
    try:
        run = generate
        if speculator is not None:  # the same tokens, checked several at a time
            run = functools.partial(speculate.generate, speculator=speculator)
        new = run(model, cache, ids, max_new_tokens, sampling, eos_ids, token_cb, timed_step,
                  replay=replayed, share=share, step=batcher.step if batcher else None)
    finally:
        if batcher:
            batcher.leave(cache)  # the batch's other tasks stop waiting for this one
    snap = cache.store.snapshot()
    io_end = process_io()
    weights = weight_bytes(model)
    decode_rate = 0.0
    if clock["decode_s"]:
        decode_rate = round(clock["decode_steps"] / clock["decode_s"], 2)
    # sealed chunks attention read per decode step, all layers together (--select reads fewer)
    read_per_step = round(cache.decode_chunks / max(1, cache.decode_steps), 2)
    return new, {
        "prefill_s": round(clock["prefill_s"], 4),
        "prefill_tokens": computed,
        "prefill_tokens_per_s": round(computed / max(clock["prefill_s"], 1e-9), 2),
        "ttft_s": round(clock.get("ttft_s", clock["prefill_s"]), 4),
        "decode_s": round(clock["decode_s"], 4),
        # decoded in this run: a resumed task's replayed tokens are not
        "decoded_tokens": clock["decode_steps"],
        "decode_tokens_per_s": decode_rate,
        "chunks_read_per_decode_step": read_per_step,
        # this task's own accounting (CUDA and CPU alike): the weights plus the KV chunks it
        # allocated on the device
        "peak_device_bytes": weights + snap["kv_device_bytes_peak"],
        "peak_host_rss_bytes": peak["rss"],
        "peak_host_anon_bytes": peak["anon"],
        "peak_host_file_bytes": peak["file"],
        "pinned_bytes": snap["pinned_bytes"],
        # bytes: what the store moved (h2d, d2h; disk_write / disk_read through the disk tier's
        # files; disk_mapped_read: read by attention in place through the mapping, CPU only); io:
        # what this process asked of storage while the task ran (/proc/self/io, shared by
        # concurrent tasks), the real device I/O
        "bytes": snap["bytes"],
        "io": {k: io_end[k] - io_start[k] for k in io_end},
        "chunks": snap["chunks"],
        **({"speculation": speculate.summary(speculator.stats)} if speculator else {}),
    }


class PromptCache:
    """A task's use of the persistent KV store (kvstore.py). Only prompt chunks qualify: chunk j,
    positions [j*C, (j+1)*C) of the prompt, is computed by prefill in one chunk-aligned step whose
    result depends only on the tokens [0, (j+1)*C) and the run's settings, so a stored copy is bit
    for bit what recomputing it gives. Chunks filled one generated token at a time (a second turn of
    a dialogue) are never stored.

    Tasks that start together compute a shared chunk once: a task claims the chunks it is about to
    compute (kvstore.KVStore.claim), and another task that needs one of them waits for its entry
    instead of computing it too. A task waits only before it has claimed anything, and a claim
    ends when its chunk is stored, its task fails, or its process dies, so no two tasks ever wait
    for each other; a wait that ends without an entry means computing the chunk here. Not under
    tensor parallelism: a rank that waits while another rank of its replica does not would split
    the replica's steps, so its ranks only adopt what is already stored."""

    def __init__(self, kv_store, cache, prompt_ids, fingerprint, model, layout=None):
        model_args = model.args
        store = cache.store
        # CPU and CUDA kernels, or torch versions, may round apart
        run = run_fingerprint(fingerprint, dtype=store.dtype, device=store.device,
                              chunk=store.shape, n_layers=model_args.n_layers,
                              torch=torch.__version__, threads=cpu_threads(store.device))
        self.kv = kv_store
        self.store = store
        self.layout = layout or Layout.single()
        self.share = self.layout.tp == 1  # claim and wait (see above)
        self.keys = chunk_keys(run, prompt_ids, cache.chunk_size)
        self.P = len(prompt_ids)
        self.adopted = 0
        self.restored = 0
        self.claimed = set()  # keys this task computes; each claim is released once stored
        self.stored = []
        self.pending = None
        # fsyncs stay off the critical path
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-store")
        self.bytes_read = 0

    def adopt(self, cache):
        """Before prefill: read the longest stored prefix of full prompt chunks into the open chunks
        and seal them, so they land where this run's --offload and --window put any chunk. At least
        one prompt token is left to compute: its logits start the decoding. The ranks of a replica
        adopt the same prefix: the longest that every rank's store holds. Then claim the chunks
        this task computes."""
        C = cache.chunk_size
        s = self.store
        n = (self.P - 1) // C
        self.restored = cache.n_sealed  # a resume's chunks: from the disk tier, not the store
        while cache.n_sealed < n:
            j = cache.n_sealed
            if s.cuda:  # read on the host, then copied into the open chunk on the device
                host = [torch.empty(s.shape, dtype=s.dtype) for _ in range(s.n_layers)]
            else:  # read straight into the open chunk
                host = [s.open_chunk(l) for l in range(s.n_layers)]
            got = self.fetch(j, host)
            # a miss here or on another rank (not stored, evicted, corrupt): compute from here on
            if not agree_min(int(got > 0), self.layout):
                break
            self.bytes_read += got
            if s.cuda:
                for l in range(s.n_layers):
                    s.open_chunk(l).copy_(host[l])
            cache.begin(C)
            cache.commit()
            s.seal(j)  # data: as after a prefill step, the window policy places it
        self.adopted = cache.n_sealed
        if self.kv.budget is not None:  # read in order: the head marked the more recent
            self.kv.mark_used(self.keys[:self.adopted])
        if not self.share:
            return
        for key in self.keys[self.adopted:]:
            # a chunk another task claimed first is computed here too: only work is lost
            if key not in self.claimed and self.kv.claim(key):
                self.claimed.add(key)

    def fetch(self, j, host):
        """Read chunk j into host: the bytes read, or 0 when this task is to compute the chunk. A
        chunk that another task is computing now is waited for, then read."""
        key = self.keys[j]
        got = self.kv.read(key, host)
        if got or not self.share:
            return got
        if self.kv.claim(key):  # nobody computes it: this task will, unless it was stored just now
            got = self.kv.read(key, host)
            if got:
                self.kv.release(key)
            else:
                self.claimed.add(key)
            return got
        if self.kv.wait_for(key, timeout_s=STALE_CLAIM_S):
            return self.kv.read(key, host)
        return 0  # its task failed or died, or hangs: compute it here

    def store_sealed(self, cache):
        """After a prefill step: a prompt chunk this run computed and has just sealed is stored,
        once the previous store write has finished (one write in flight: at most one chunk of host
        copies waits)."""
        j = cache.n_sealed - 1
        if cache.length % cache.chunk_size or j < self.adopted or j >= len(self.keys):
            return
        host = [torch.empty(self.store.shape, dtype=self.store.dtype)
                for _ in range(self.store.n_layers)]
        for l, dst in enumerate(host):
            self.store.read_back(l, j, dst)
        if j + 1 < len(self.keys) and self.keys[j + 1] in self.claimed:
            self.kv.renew(self.keys[j + 1])  # the next chunk is under way: its claim stays fresh
        if self.pending is not None:
            self.stored.append(self.pending.result())
        self.pending = self.writer.submit(self.write, self.keys[j], host, self.keys[:j])

    def write(self, key, host, before):
        """Writer thread: store one chunk (before: the keys of the chunks before it), then release
        its claim (a waiter adopts the entry, or computes the chunk itself if the write failed)."""
        try:
            return self.kv.write(key, host, before)
        finally:
            self.release(key)

    def release(self, key):
        if key in self.claimed:
            self.claimed.discard(key)
            self.kv.release(key)

    def close(self):
        """Wait for the store write in flight, then release every claim still held: a task that
        fails leaves none behind, so its waiters compute those chunks themselves."""
        self.writer.shutdown(wait=True)
        for key in list(self.claimed):
            self.release(key)

    def finish(self):
        """Wait for the last store write; the task's reuse statistics."""
        if self.pending is not None:
            self.stored.append(self.pending.result())
        self.close()
        C = self.store.chunk_size
        return {"reused_tokens": (self.adopted - self.restored) * C,
                "stored_tokens": sum(n > 0 for n in self.stored) * C,
                "store_bytes_read": self.bytes_read,
                "store_bytes_written": sum(self.stored)}
