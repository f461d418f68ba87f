"""
The KV cache as attention sees it: chunks of C consecutive positions, attended one by one and merged
exactly. This file is the schedule (which chunks a step reads, in what order, merged how); the
arithmetic of a chunk's partial and of the merge is attention.py.

The KV of each layer is cut into chunks of `chunk_size` (C) positions. Chunk j holds positions
[j*C, (j+1)*C). The chunk being filled (the *open* chunk) always lives on the compute device; once
full it is *sealed* and handed to the store (offload.py), which decides where it lives: the device
window, host memory or disk.

Attention of a block of queries (a prefill chunk, or one decode token) runs over
    sealed chunk 0, sealed chunk 1, ..., sealed chunk n-1, then the open chunk (causal inside it),
one partial attention per chunk, each normalised within its chunk and carrying the log-sum-exp of
its scores, merged in that order with weights exp(lse_chunk - lse_total). With the default
selection no position is dropped or approximated.

Sliding-window layers (Mistral, some Qwen2) see only the W latest positions: key k is visible from
query q iff q - k < W. A sealed chunk wholly before every query's window is skipped (neither
prefetched nor loaded, see first_visible_chunk); the chunk straddling the window's edge, and the
open chunk when it is longer than W, are attended with a mask.

Chunks are read a group at a time (chunk_groups: runs of consecutive chunks inside aligned blocks
of GROUP_CHUNKS), each group one tensor [n, 2, B, G, C, D] and one fused kernel call with the chunks
as its batch: a decode step's few query rows read a chunk in less time than a call's fixed cost, so
calls per chunk, not bytes, set the speed of long contexts (docs/performance.md).

Why offload cannot change the output: the compute schedule (which positions go into which partial,
the shapes of those partials, and the order of the merges) is a function of the positions and C
only. Where a chunk lives changes which copy brings it to the device, never the arithmetic: every
chunk reaches attention with the same bytes, whether it stayed on the device, came back from host
memory, was decompressed, or is a view of a memory-mapped file, and a chunk's partial has the same
bits whichever run of the kernel's batch it sits in (tests/test_attention.py), so a tier that
presents a group as two runs (CPU: the window's chunks beside offloaded ones) still computes the
same partials. So `--offload cpu|disk` is bit-identical to `--offload none` at the same chunk
size, by construction; verify.py checks it on every run.

Which sealed chunks a step reads is the selection's call (policy.py): every visible one by
default, fewer with --select. How K and V sit in a chunk's bytes is a layout (kvlayout.py).
"""
import math

import torch

from attention import (
    Partials,
    attend_chunk,
    attend_chunks,
    attend_few,
    attend_open_chunk,
    first_visible_chunk,
    visible_keys,
)
from fewrows import few_rows_kernel, prepare
from kvlayout import chunk_layout
from offload import TieredStore
from policy import PLACEMENTS, Exact, make_selection
from pools import GROUP_CHUNKS

EXACT = Exact()  # what every prefill step reads: every visible chunk

MERGE_GROUP_BYTES = 4 << 20


def chunk_groups(visits, size, alone=()):
    """The visited chunks (ascending) cut into the groups that one kernel call each attends: runs
    of consecutive chunks inside one aligned block of `size` chunks (chunk j in block j // size);
    a chunk in `alone` (the window's edge, which needs a mask) is a group of its own. A function of
    the positions and the selection only, never of where a chunk lives: the kernel calls of a step
    are the same in every --offload mode."""
    groups = []
    for j in visits:
        last = groups[-1] if groups else None
        if (last and j == last[-1] + 1 and j // size == last[0] // size and j not in alone
                and last[-1] not in alone):
            last.append(j)
        else:
            groups.append([j])
    return groups


class KVCache:
    """Positions, the open chunk and the attention schedule; the store (offload.py) owns every byte
    and the selection (policy.py) says which sealed chunks each layer reads.

    A forward step of T tokens, as generate.forward runs it:
        cache.begin(T)                        # the step fits in the open chunk; plan its reads
        cache.store.prefetch(cache.reads())   # the store starts bringing the planned chunks
        model(tokens, cache)                  # each layer calls cache.attend(layer, q, k, v)
        if cache.commit():                    # advance; True when the open chunk is now full
            cache.store.seal(j)               # the full chunk joins the window; one may leave
    A step never crosses a chunk boundary (prefill feeds at most C tokens, aligned to chunks), so
    each step's queries all sit in the open chunk. A selection that needs a layer's queries
    (policy.Quest) decides that layer's reads inside attend, which queues them then.
    """

    def __init__(self, store, layout, windows=None, selection=None):
        self.store = store
        # how K and V sit in a chunk's bytes (PlainLayout, Int8Layout)
        self.layout = layout
        self.chunk_size = store.chunk_size  # C
        if windows is None:
            windows = (None,) * store.n_layers
        self.windows = tuple(windows)       # per layer: W, or None for full attention
        self.selection = selection or Exact()
        self.length = 0                     # positions already written and committed
        self.T = 0                          # tokens of the step in flight
        self.decoding = False               # whether it is a decode step
        self.first = []                     # per layer: the step's first visible sealed chunk
        self.visits = []                    # per layer: the sealed chunks it reads (None: not yet)
        self.queued = 0                     # layers whose reads the store has been given
        self.step_bytes = {}                # this step's counts, handed to the store at commit
        self.step_chunks = 0                # sealed chunks this step read
        self.decode_steps = 0               # decode steps, and the sealed chunks they read
        self.decode_chunks = 0

    @property
    def n_sealed(self):
        return self.length // self.chunk_size

    @property
    def starts(self):
        """The first position of this step, for every row (model.Transformer.forward's RoPE)."""
        return (self.length,)

    def begin(self, T, decode=False):
        """Check the step fits in the open chunk, and plan what each layer reads: the visible
        chunks (sliding windows), then what the selection keeps of them (decode steps only: a
        prefill step reads every visible chunk, whatever the selection)."""
        off = self.length % self.chunk_size
        if T < 1 or off + T > self.chunk_size:
            raise ValueError(f"a step of {T} tokens at position {self.length} crosses a chunk "
                             f"boundary (chunk size {self.chunk_size}); feed the prompt through "
                             "generate.prefill")
        if self.length + T > self.store.max_length:
            raise ValueError(f"the cache holds {self.store.max_length} positions; position "
                             f"{self.length + T} is past it")
        self.T = T
        self.decoding = decode
        # counted afresh: a step that failed half-way and runs again is counted once
        self.step_bytes = {"window_skipped": 0, "select_skipped": 0, "kv_read": 0}
        self.step_chunks = 0
        n = self.n_sealed
        self.first = [first_visible_chunk(w, self.length, self.chunk_size) for w in self.windows]
        selection = self.selection if decode else EXACT
        self.visits = [selection.visits(layer, first, n, T)
                       for layer, first in enumerate(self.first)]
        self.queued = 0

    def reads(self):
        """The planned reads not yet given to the store, [(layer, j), ...] in attention's order:
        layer by layer, up to the first layer whose reads wait for its queries."""
        out = []
        while self.queued < len(self.visits) and self.visits[self.queued] is not None:
            out += [(self.queued, j) for j in self.visits[self.queued]]
            self.queued += 1
        return out

    def attend(self, layer, q, k, v):
        """q [B, H, T, D], k, v [B, G, T, D] at positions [length, length+T) -> attention output
        [B, H, T, D]."""
        B, H, T, D = q.shape
        if T != self.T:  # model(tokens, cache) called without begin(T): give begin's clear error
            self.begin(T)
            raise ValueError(f"call cache.begin({T}) before model(tokens, cache), as "
                             "generate.forward does")
        G = k.shape[1]
        R = H // G
        C = self.chunk_size
        W = self.windows[layer]
        n = self.n_sealed
        first = self.first[layer]
        off = self.length % C
        kv = self.store.open_chunk(layer)                  # layout.shape(B, G, C, D), on the device
        self.layout.write(kv, off, k, v)
        # rows are (r, t) pairs: [B, H, T, D] -> [B, G, R*T, D] (h = g*R + r: the same order)
        q = (q * (1.0 / math.sqrt(D))).reshape(B, G, R * T, D)
        visits = self.visits[layer]
        if visits is None:  # the selection needs this layer's queries: decide now, fetch now
            visits = self.selection.visits(layer, first, n, T, q)
            self.visits[layer] = visits
            self.store.prefetch_more(self.reads())
        self.count(layer, first, n, len(visits))
        parts = self.attend_sealed(layer, q, visits)
        parts.add_one(*self.attend_open(q, kv, off, R, W))
        o = parts.output()                                 # [B, G, R*T, D] fp32
        return (o if o.dtype == q.dtype else o.to(q.dtype)).reshape(B, H, T, D)  # [B, H, T, D]

    def attend_sealed(self, layer, q, visits):
        """The decode (or prefill) attention of one step's query rows q [B, G, R*T, D] (scaled)
        over the sealed chunks `visits` of layer: their partials (attention.Partials), the open
        chunk's still to add. Chunks are read a group at a time (chunk_groups), each group one
        tensor from the store and one kernel call; a group's partials are those of one chunk at a
        time bit for bit, so only the count of calls depends on the grouping. A speculative step
        of K+1 rows calls this as a one-token step does."""
        B, G, RT, D = q.shape
        C = self.chunk_size
        W = self.windows[layer]
        T = self.T
        edge = set()  # the chunks a sliding window cuts: attended alone, with a mask
        q_pos = None  # [R*T] row positions, for a sliding window's mask
        if W is not None:
            q_pos = self.length + torch.arange(RT, device=q.device) % T
            edge = {j for j in visits if j * C <= self.length + T - 1 - W}
        # chunks per kernel call: the group's partials stay within the merge's bytes (a prefill
        # step's many rows), a function of shapes only
        size = max(1, min(GROUP_CHUNKS, MERGE_GROUP_BYTES // (q.numel() * 4)))
        # partials per group merge: a function of shapes only, so placement-free
        parts = Partials(max(1, MERGE_GROUP_BYTES // (q.numel() * 4)))
        kept = [] if self.decoding and self.selection.reads_all else None  # the oracle's
        # every key of a sealed chunk is in the past. A row with no visible key in a chunk (the
        # window's edge) gets o 0 and lse -inf: the merge gives it weight 0
        for js in chunk_groups(visits, size, edge):
            for run in self.store.load_group(layer, js):  # one view, one call (CPU: a few)
                k_n, v_n = self.layout.read_group(run)  # [n, *chunk shape] -> [n, B, G, C, D]
                if js[0] in edge:
                    visible = visible_keys(q_pos, js[0] * C + torch.arange(C, device=q.device), W)
                    o, lse = attend_chunk(q, k_n[0], v_n[0], visible)
                    new = (o[None], lse[None])
                else:
                    new = attend_few(q, k_n, v_n)      # [n, B, G, R*T, D], [n, B, G, R*T]
                if kept is not None:  # the oracle merges only the chunks it keeps, once it saw all
                    kept.append(new)
                else:
                    parts.add(*new)
        if kept:  # in the groups an exact read of the same chunks makes
            first = self.first[layer]
            o = torch.cat([o for o, _ in kept])            # [n, B, G, R*T, D]
            lse = torch.cat([lse for _, lse in kept])      # [n, B, G, R*T]
            for j in self.selection.choose(layer, first, self.n_sealed, T, lse):
                parts.add(o[j - first:j - first + 1], lse[j - first:j - first + 1])
        return parts

    def attend_open(self, q, kv, off, R, W):
        """The open chunk kv's partial (o [B, G, R*T, D], lse [B, G, R*T]) for the rows q [B, G,
        R*T, D] (scaled) at offsets off..off+T-1. One position that sees every key up to its own
        (a decode step; a verify step's row, speculate.py) reads the chunk's first off+1 positions
        as a chunk of that length, through the compiled kernel where the sealed chunks' visits
        take it: K and V as held, and no fused kernel's call; else attention.attend_open_chunk,
        on what read_held gave where the layout's read gives the same (an int8 chunk dequantized
        once). A function of offsets, shapes and dtypes only, so placement-free."""
        T = q.shape[2] // R
        if T == 1 and (W is None or off < W):
            k, v = self.layout.read_held(kv, off + 1)       # [B, G, off+1, D]
            if few_rows_kernel(q, k) is not None:
                o, lse = attend_chunks(q, k[None], v[None])  # [1, B, G, R, D], [1, B, G, R]
                return o[0], lse[0]
            layout = type(self.layout)
            if layout.read_held is layout.read:  # read gives these same values: read once
                return attend_open_chunk(q, k, v, off, R, W)
        # k, v [B, G, off+T, D]
        return attend_open_chunk(q, *self.layout.read(kv, off + T), off, R, W)

    def count(self, layer, first, n, read):
        """What this layer's attention reads of the n sealed chunks, and what it skips."""
        chunk = self.store.chunk_bytes
        self.step_bytes["window_skipped"] += min(first, n) * chunk
        self.step_bytes["select_skipped"] += (n - first - read) * chunk
        self.step_bytes["kv_read"] += read * chunk
        self.step_chunks += read

    def commit(self, kept=None):
        """The step's positions are written on every layer: advance. True when the open chunk is now
        full and must be sealed (the caller does that, visibly: it moves data); its keys are
        summarised for the selection first, while it is still the open chunk. kept: advance by
        the step's first `kept` positions only (a verify step, speculate.py): the rest stay past
        the length, unread, and the next step overwrites them."""
        if kept is not None and not 1 <= kept <= self.T:
            raise ValueError(f"a step of {self.T} positions cannot keep {kept}")
        self.length += self.T if kept is None else kept
        self.T = 0
        if self.decoding:
            self.decode_steps += 1
            self.decode_chunks += self.step_chunks
        for key, nbytes in self.step_bytes.items():
            self.store.count(key, nbytes)
        self.step_bytes = {}
        full = self.length % self.chunk_size == 0
        if full and self.selection.summarizes:
            for layer in range(self.store.n_layers):
                self.summarize(layer, self.n_sealed - 1, self.store.open_chunk(layer))
        return full

    def summarize(self, layer, j, chunk):
        """Hand sealed chunk j's keys to the selection (policy.Quest keeps their digest)."""
        keys, _ = self.layout.read(chunk.to(self.store.device), self.chunk_size)  # [B, G, C, D]
        self.selection.summarize(layer, j, keys)

    def summarize_restored(self, n):
        """Chunks 0..n-1 came back from disk (a resumed task): summarise them as if they had
        sealed here. The same bytes give the same digests, so the resumed run selects what the
        first run selected."""
        if not self.selection.summarizes:
            return
        host = torch.empty(self.store.shape, dtype=self.store.dtype)
        for j in range(n):
            for layer in range(self.store.n_layers):
                self.store.read_back(layer, j, host)
                self.summarize(layer, j, host)


def chunk_spec(model, chunk_size, kv_dtype="auto"):
    """(the layout of model's chunks with K and V held as kv_dtype says, a chunk's shape): what a
    store of this model's chunks holds (make_cache) and a batch's arena (kvbatch.make_arena)."""
    layout = chunk_layout(kv_dtype, model.tok_embeddings.weight.dtype)
    # this rank's kv heads (all of them without tensor parallel)
    G = model.layers[0].attention.wk.out_features // model.args.head_dim
    return layout, layout.shape(1, G, chunk_size, model.args.head_dim)


def make_cache(model, cfg, chunk_size, max_length, disk_path=None, restore=None, on_durable=None,
               kv_dtype="auto", selection=None, arena=None):
    """A KVCache for `model` over max_length positions, its chunks stored as `cfg` (an
    OffloadConfig) says, K and V held as kv_dtype says (KV_DTYPES), read as cfg.select chooses
    (or `selection`, a policy.py selection of the caller's). disk_path, restore and on_durable
    are the resume hooks of runs/task.py (see TieredStore); arena: the batch's (make_arena), which
    the store takes where it can hold this cache's chunks (--offload none on CPU)."""
    model_args = model.args
    emb = model.tok_embeddings.weight
    layout, shape = chunk_spec(model, chunk_size, kv_dtype)
    G = shape[2]
    store = TieredStore(shape=shape, dtype=layout.dtype, n_layers=model_args.n_layers,
                        max_length=max_length, device=emb.device, cfg=cfg, disk_path=disk_path,
                        restore=restore, on_durable=on_durable, arena=arena,
                        placement=PLACEMENTS[cfg.placement]())
    try:  # the caller closes the cache it gets; until then a failure or Ctrl-C closes the store
        if selection is None:
            selection = make_selection(cfg.select, cfg.select_budget, chunk_size, cfg.window,
                                       model_args.n_layers, cfg.select_dense)
        if emb.is_cpu:  # a decode step's compiled kernels built now, before any step is timed
            R = model_args.n_heads // model_args.n_kv_heads
            bias = getattr(model.layers[0].attention.wq, "bias", None) is not None  # Qwen2
            prepare(emb.dtype, layout.attend_dtype, G, R, chunk_size, model_args.head_dim, bias)
        return KVCache(store, layout, model_args.layer_windows, selection)
    except BaseException:
        store.close()
        raise
