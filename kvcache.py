"""
The KV cache as attention sees it: chunks of C consecutive positions, attended one by one and merged
exactly.

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

Why offload cannot change the output: the compute schedule (which positions go into which kernel
call, the shapes of those calls, and the order of the merges) is a function of the positions and C
only. Where a chunk lives changes which copy brings it to the device, never the arithmetic: every
chunk reaches attention as a contiguous [B, G, C, D] tensor with the same bytes, whether it stayed
on the device, came back from host memory, was decompressed, or is a view of a memory-mapped file.
So `--offload cpu|disk` is bit-identical to `--offload none` at the same chunk size, by
construction; verify.py checks it on every run.

Which sealed chunks a step reads is the selection's call (policy.py): every visible one by
default, fewer with --select. How K and V sit in a chunk's bytes is a layout (kvlayout.py).
"""
import math

import torch

from kvlayout import chunk_layout
from offload import TieredStore
from policy import Exact, make_selection

EXACT = Exact()  # what every prefill step reads: every visible chunk

# Fused kernels that return the log-sum-exp an exact merge needs: one call per chunk instead of a
# handful. On CPU the flash kernel (torch >= 2.3); on CUDA flash (fp16/bf16) or memory-efficient
# attention (fp32), checked once per (device, dtype) against the matmul path below, which stays the
# fallback. Which one runs depends on the device, dtype and torch version only, never on where a
# chunk lives, so the choice cannot break bit-identity.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CUDA = {}  # (device, dtype) -> whether the fused CUDA kernel agreed with the matmul path


def fused_cuda(q, k, v):
    """One CUDA kernel for a chunk's partial: (o [B, G, R*T, D], lse [B, G, R*T]) fp32; the kv
    heads act as the kernel's heads and the (r, t) query rows as its sequence, so GQA needs no copy
    of K or V."""
    aten = torch.ops.aten
    if q.dtype in (torch.float16, torch.bfloat16):
        o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=1.0)[:2]
    else:
        o, lse = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=1.0)[:2]
    # efficient attention pads lse's rows
    return o.float(), lse[..., :q.shape[2]].float()


def use_fused_cuda(q):
    key = (q.device, q.dtype)
    if key not in _FUSED_CUDA:
        g = torch.Generator(q.device).manual_seed(0)
        D = q.shape[-1]
        a, b, c = (torch.randn(1, 2, n, D, device=q.device, generator=g).to(q.dtype)
                   for n in (3, 64, 64))
        try:
            o, lse = fused_cuda(a, b, c)
            o_ref, lse_ref = attend_chunk(a, b, c, fused=False)
            agree = torch.allclose(o, o_ref, atol=2e-2) and torch.allclose(lse, lse_ref, atol=2e-2)
            _FUSED_CUDA[key] = bool(agree)
        except (RuntimeError, TypeError, AttributeError):
            # an old torch, or a head dim the kernels refuse
            _FUSED_CUDA[key] = False
    return _FUSED_CUDA[key]


def attend_chunk(q, k, v, visible=None, fused=True):
    """Attention of queries over the L positions of one chunk, normalised within the chunk.

    q [B, G, R*T, D], already scaled by 1/sqrt(D); k, v [B, G, L, D]; visible [R*T, L] bool masks
    future keys. Returns (o [B, G, R*T, D], lse [B, G, R*T]), both fp32: the chunk's output and
    log-sum-exp of its scores.
    """
    if visible is None and fused:  # the common case first: a chunk visit is the hot loop
        if q.is_cpu and _FLASH_CPU is not None:
            o, lse = _FLASH_CPU(q, k, v, scale=1.0)                # [B, G, R*T, D], [B, G, R*T]
            return (o if o.dtype == torch.float32 else o.float()), lse
        if q.is_cuda and use_fused_cuda(q):
            return fused_cuda(q, k, v)
    B, G, RT, D = q.shape
    L = k.shape[2]
    # bmm over B*G flattened views: the 4-D matmul with a transposed operand takes a path that
    # stalls under CPU load
    s = torch.bmm(q.reshape(B * G, RT, D), k.reshape(B * G, L, D).transpose(1, 2))  # [B*G, R*T, L]
    s = s.view(B, G, RT, L).float()
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)    # [B, G, R*T, 1] row max
    if visible is not None:
        # a row with no visible key (the window's edge chunk) must give o = 0, lse = -inf, not NaN
        m = m.masked_fill(m == float("-inf"), 0.0)
    p = torch.exp(s - m)                # [B, G, R*T, L]
    l = p.sum(dim=-1, keepdim=True)     # [B, G, R*T, 1] row sum of exponentials
    o = torch.bmm(p.to(v.dtype).view(B * G, RT, L), v.reshape(B * G, L, D))  # [B*G, R*T, D]
    o = o.view(B, G, RT, D).float()
    if visible is not None:
        # l >= 1 where a key is visible (its max term is exp(0)): this changes empty rows only
        return o / l.clamp(min=1.0), (m + torch.log(l)).squeeze(-1)
    return o / l, (m + torch.log(l)).squeeze(-1)  # lse [B, G, R*T]


def attend_open_chunk(q, k, v, off, R, window=None):
    """The open chunk: queries at offsets off..off+T-1 see keys up to their own offset (causal), and
    with a sliding window of W only the W latest. q [B, G, R*T, D] (rows are (r, t) pairs); k, v
    [B, G, off+T, D]."""
    B, G, RT, D = q.shape
    T = RT // R
    slides = window is not None and off + T > window  # some key here is outside some query's window
    if T == 1 and not slides:                          # one query: every key is visible
        return attend_chunk(q, k, v)
    if off == 0 and not slides and _FLASH_CPU is not None and q.device.type == "cpu":
        # the kernel's causal mask; one kv head per query head
        kh = k[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)  # [B, H, T, D]
        vh = v[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)  # [B, H, T, D]
        # [B, H, T, D], [B, H, T]
        o, lse = _FLASH_CPU(q.view(B, G * R, T, D), kh, vh, is_causal=True, scale=1.0)
        return o.float().reshape(B, G, RT, D), lse.reshape(B, G, RT)
    t = torch.arange(RT, device=q.device) % T          # query row (r, t) sits at offset off + t
    visible = visible_keys(off + t, torch.arange(off + T, device=q.device), window)
    return attend_chunk(q, k, v, visible)


def visible_keys(q_pos, k_pos, window=None):
    """[len(q_pos), len(k_pos)] bool: key k is visible from query q iff k <= q, and q - k < W with a
    window."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    return visible


def first_visible_chunk(window, first_query, chunk_size):
    """The first chunk that the query at position first_query, the earliest of a step, can see
    through a window of W positions (0 with full attention, window None). Later queries of the step
    see no further back, so every chunk before it is skipped; a function of positions only, so the
    schedule stays placement-independent."""
    if window is None:
        return 0
    return max(0, first_query - window + 1) // chunk_size


def merge(state, o, lse):
    """Combine two normalised partial attentions exactly: weights exp(lse_i - lse_total)."""
    if state is None:
        return o, lse
    o0, lse0 = state
    total = torch.logaddexp(lse0, lse)                             # [B, G, R*T]
    w0 = torch.exp(lse0 - total).unsqueeze(-1)                     # [B, G, R*T, 1]
    w = torch.exp(lse - total).unsqueeze(-1)
    return o0.mul_(w0).add_(o.mul_(w)), total  # in place: o0, o are ours


def merge_group(parts):
    """Many partials [(o [B, G, R*T, D], lse [B, G, R*T]), ...] of one query block merged at
    once, exactly. The weights come from one softmax over the group's log-sum-exps; the weighted sum
    is one stacked multiply and sum for a few query rows (a decode step: few kernels is what
    counts), and n in-place multiply-adds for many rows (a prefill chunk: no stacked copy). Never a
    matmul with n as its inner dimension: thousands of tiny GEMMs, ~10x slower. The branch depends
    on shapes only, so placement still cannot change a bit."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([l for _, l in parts], dim=-1)               # [B, G, R*T, n]
    total = torch.logsumexp(lse, dim=-1)                           # [B, G, R*T]
    w = torch.exp(lse - total.unsqueeze(-1))                       # [B, G, R*T, n]
    return weighted_sum(parts, w), total


def merge_last(parts):
    """The output of a query block whose every partial is here (no earlier group to merge with:
    every decode step): its log-sum-exp is never needed, so the weights are one softmax."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([l for _, l in parts], dim=-1)               # [B, G, R*T, n]
    return weighted_sum(parts, torch.softmax(lse, dim=-1))


def weighted_sum(parts, w):
    """sum over i of o_i * w[..., i]: a stacked multiply and sum for a few query rows, in-place
    multiply-adds for many (the partials are ours)."""
    if w.shape[2] <= 64:
        o = torch.stack([o for o, _ in parts])                     # [n, B, G, R*T, D]
        return (o * w.movedim(-1, 0).unsqueeze(-1)).sum(0)         # [B, G, R*T, D]
    o = parts[0][0].mul_(w[..., :1])
    for i in range(1, len(parts)):
        o.add_(parts[i][0].mul_(w[..., i:i + 1]))
    return o


MERGE_GROUP_BYTES = 4 << 20


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
        # rows are (r, t) pairs: [B, H, T, D] -> [B, G, R*T, D]
        q = (q * (1.0 / math.sqrt(D))).view(B, G, R, T, D).reshape(B, G, R * T, D)
        visits = self.visits[layer]
        if visits is None:  # the selection needs this layer's queries: decide now, fetch now
            visits = self.selection.visits(layer, first, n, T, q)
            self.visits[layer] = visits
            self.store.prefetch_more(self.reads())
        self.count(layer, first, n, len(visits))
        q_pos = None  # [R*T] row positions, for a sliding window's mask
        if W is not None:
            q_pos = self.length + torch.arange(R * T, device=q.device) % T
        load = self.store.load  # bound once: a chunk visit is the hot loop
        release = self.store.release if self.store.staged else None  # only a staged chunk's slot
        read = self.layout.read
        # the fused CPU kernel straight from the loop when no chunk needs a mask: what
        # attend_chunk runs, without deciding it again at every visit
        flash = _FLASH_CPU if W is None and q.is_cpu else None
        fp32 = q.dtype == torch.float32

        # partials per group merge: a function of shapes only, so placement-free
        group = max(1, MERGE_GROUP_BYTES // (q.numel() * 4))
        kept = [] if self.decoding and self.selection.reads_all else None  # the oracle's
        state = None
        parts = []
        # every key of a sealed chunk is in the past. A row with no visible key in a chunk (the
        # window's edge) gets o 0 and lse -inf: the merge gives it weight 0
        for j in visits:
            k_j, v_j = read(load(layer, j), C)  # chunk [2, B, G, C, D] -> k, v [B, G, C, D]
            if flash is not None:  # the common case, as attend_chunk would run it
                o_j, lse_j = flash(q, k_j, v_j, scale=1.0)  # [B, G, R*T, D], [B, G, R*T]
                part = (o_j if fp32 else o_j.float(), lse_j)
            else:
                visible = None
                if W is not None and j * C <= self.length + T - 1 - W:  # the window's edge
                    visible = visible_keys(q_pos, j * C + torch.arange(C, device=q.device), W)
                part = attend_chunk(q, k_j, v_j, visible)
            if release:
                release(layer, j)  # its staging slot may be refilled
            if kept is not None:  # the oracle merges only the chunks it keeps, once it saw all
                kept.append(part)
                continue
            parts.append(part)
            if len(parts) == group:
                state = merge(state, *merge_group(parts))
                parts = []
        if kept:  # in the groups an exact read of the same chunks makes
            lse = torch.stack([p[1] for p in kept])        # [n, B, G, R*T]
            for j in self.selection.choose(layer, first, n, T, lse):
                parts.append(kept[j - first])
                if len(parts) == group:
                    state = merge(state, *merge_group(parts))
                    parts = []
        parts.append(attend_open_chunk(q, *read(kv, off + T), off, R, W))  # k, v [B, G, off+T, D]
        if state is None:  # one group: every decode step
            o = merge_last(parts)
        else:
            o, _ = merge(state, *merge_group(parts))
        return o.to(q.dtype).view(B, G, R, T, D).reshape(B, H, T, D)  # [B, H, T, D]

    def count(self, layer, first, n, read):
        """What this layer's attention reads of the n sealed chunks, and what it skips."""
        chunk = self.store.chunk_bytes
        self.step_bytes["window_skipped"] += min(first, n) * chunk
        self.step_bytes["select_skipped"] += (n - first - read) * chunk
        self.step_bytes["kv_read"] += read * chunk
        self.step_chunks += read

    def commit(self):
        """The step's positions are written on every layer: advance. True when the open chunk is now
        full and must be sealed (the caller does that, visibly: it moves data); its keys are
        summarised for the selection first, while it is still the open chunk."""
        self.length += self.T
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


def make_cache(model, cfg, chunk_size, max_length, disk_path=None, restore=None, on_durable=None,
               kv_dtype="auto", selection=None):
    """A KVCache for `model` over max_length positions, its chunks stored as `cfg` (an
    OffloadConfig) says, K and V held as kv_dtype says (KV_DTYPES), read as cfg.select chooses
    (or `selection`, a policy.py selection of the caller's). disk_path, restore and on_durable
    are the resume hooks of task.py (see TieredStore)."""
    model_args = model.args
    emb = model.tok_embeddings.weight
    layout = chunk_layout(kv_dtype, emb.dtype)
    # this rank's kv heads (all of them without tensor parallel)
    G = model.layers[0].attention.n_local_kv_heads
    store = TieredStore(shape=layout.shape(1, G, chunk_size, model_args.head_dim),
                        dtype=layout.dtype, n_layers=model_args.n_layers, max_length=max_length,
                        device=emb.device, cfg=cfg, disk_path=disk_path, restore=restore,
                        on_durable=on_durable)
    if selection is None:
        selection = make_selection(cfg.select, cfg.select_budget, chunk_size, cfg.window,
                                   model_args.n_layers, cfg.select_dense)
    return KVCache(store, layout, model_args.layer_windows, selection)
