"""
The KV cache as attention sees it: chunks of C consecutive positions, attended one by one and merged exactly.

The KV of each layer is cut into chunks of `chunk_size` (C) positions. Chunk j holds positions [j*C, (j+1)*C).
The chunk being filled (the *open* chunk) always lives on the compute device; once full it is *sealed* and
handed to the store (offload.py), which decides where it lives: the device window, host memory or disk.

Attention of a block of queries (a prefill chunk, or one decode token) runs over
    sealed chunk 0, sealed chunk 1, ..., sealed chunk n-1, then the open chunk (causal inside it),
one partial attention per chunk, each normalised within its chunk and carrying the log-sum-exp of its scores,
merged in that order with weights exp(lse_chunk - lse_total). No position is dropped or approximated.

Sliding-window layers (Mistral, some Qwen2) see only the W latest positions: key k is visible from query q iff
q - k < W. A sealed chunk wholly before every query's window is skipped (neither prefetched nor loaded, see
first_visible_chunk); the chunk straddling the window's edge, and the open chunk when it is longer than W, are
attended with a mask.

Why offload cannot change the output: the compute schedule (which positions go into which kernel call, the
shapes of those calls, and the order of the merges) is a function of the positions and C only. Where a chunk
lives changes which copy brings it to the device, never the arithmetic: every chunk reaches attention as a
contiguous [B, G, C, D] tensor with the same bytes, whether it stayed on the device, came back from host
memory, was decompressed, or is a view of a memory-mapped file. So `--offload cpu|disk` is bit-identical to
`--offload none` at the same chunk size, by construction; verify.py checks it on every run.
"""
import math

import torch

from offload import TieredStore


# The fused CPU flash-attention kernel (torch >= 2.3) returns the log-sum-exp an exact merge needs; elsewhere (CUDA,
# older torch) the same partial is computed with plain matmuls. Which one runs depends on the device and torch
# version only, never on where a chunk lives, so the choice cannot break bit-identity across offload modes.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_chunk(q, k, v, visible=None):
    """Attention of queries over the L positions of one chunk, normalised within the chunk.

    q [B, G, R*T, D], already scaled by 1/sqrt(D); k, v [B, G, L, D]; visible [R*T, L] bool masks future keys.
    Returns (o [B, G, R*T, D], lse [B, G, R*T, 1]), both fp32: the chunk's output and log-sum-exp of its scores.
    """
    B, G, RT, D = q.shape
    L = k.shape[2]
    if visible is None and _FLASH_CPU is not None and q.device.type == "cpu":
        o, lse = _FLASH_CPU(q, k, v, scale=1.0)                    # [B, G, R*T, D], [B, G, R*T]
        return o.float(), lse.unsqueeze(-1)
    # bmm over B*G flattened views: the 4-D matmul with a transposed operand takes a path that stalls under CPU load
    s = torch.bmm(q.reshape(B * G, RT, D), k.reshape(B * G, L, D).transpose(1, 2)).view(B, G, RT, L).float()
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)                               # [B, G, R*T, 1] row max
    if visible is not None:  # a row with no visible key (the window's edge chunk) must give o = 0, lse = -inf, not NaN
        m = m.masked_fill(m == float("-inf"), 0.0)
    p = torch.exp(s - m)                                           # [B, G, R*T, L]
    l = p.sum(dim=-1, keepdim=True)                                # [B, G, R*T, 1] row sum of exponentials
    o = torch.bmm(p.to(v.dtype).view(B * G, RT, L), v.reshape(B * G, L, D)).view(B, G, RT, D).float()
    if visible is not None:  # l >= 1 where a key is visible (its max term is exp(0)): this changes empty rows only
        return o / l.clamp(min=1.0), m + torch.log(l)
    return o / l, m + torch.log(l)


def attend_open_chunk(q, k, v, off, R, window=None):
    """The open chunk: queries at offsets off..off+T-1 see keys up to their own offset (causal), and with a sliding
    window of W only the W latest. q [B, G, R*T, D] (rows are (r, t) pairs); k, v [B, G, off+T, D]."""
    B, G, RT, D = q.shape
    T = RT // R
    slides = window is not None and off + T > window              # some key here is outside some query's window
    if T == 1 and not slides:                                      # one query: every key is visible
        return attend_chunk(q, k, v)
    if off == 0 and not slides and _FLASH_CPU is not None and q.device.type == "cpu":  # the kernel's causal mask
        kh = k[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)  # [B, H, T, D]: one kv head per q head
        vh = v[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)
        o, lse = _FLASH_CPU(q.view(B, G * R, T, D), kh, vh, is_causal=True, scale=1.0)  # [B, H, T, D], [B, H, T]
        return o.float().reshape(B, G, RT, D), lse.reshape(B, G, RT, 1)
    t = torch.arange(RT, device=q.device) % T                      # query row (r, t) sits at offset off + t
    return attend_chunk(q, k, v, visible_keys(off + t, torch.arange(off + T, device=q.device), window))


def visible_keys(q_pos, k_pos, window=None):
    """[len(q_pos), len(k_pos)] bool: key k is visible from query q iff k <= q, and q - k < W with a window."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    return visible


def first_visible_chunk(window, first_query, chunk_size):
    """The first chunk that the query at position first_query, the earliest of a step, can see through a window of
    W positions (0 with full attention, window None). Later queries of the step see no further back, so every
    chunk before it is skipped; a function of positions only, so the schedule stays placement-independent."""
    if window is None:
        return 0
    return max(0, first_query - window + 1) // chunk_size


def merge(state, o, lse):
    """Combine two normalised partial attentions exactly: weights exp(lse_i - lse_total)."""
    if state is None:
        return o, lse
    o0, lse0 = state
    total = torch.logaddexp(lse0, lse)                             # [B, G, R*T, 1]
    return o0.mul_(torch.exp(lse0 - total)).add_(o.mul_(torch.exp(lse - total))), total  # in place: o0, o are ours


class KVCache:
    """Positions, the open chunk and the attention schedule; the store (offload.py) owns every byte.

    Use it through three calls per forward step of T tokens, as generate.forward does:
        cache.begin(T)          # check the step fits in the open chunk; the store starts prefetching
        model(tokens, cache)    # each layer calls cache.attend(layer, q, k, v)
        cache.end()             # advance; a full open chunk is sealed and placed by the store
    A step never crosses a chunk boundary (prefill feeds at most C tokens, aligned to chunks), so each
    step's queries all sit in the open chunk.
    """

    def __init__(self, store, windows=None):
        self.store = store
        self.chunk_size = store.chunk_size  # C
        self.windows = tuple(windows) if windows is not None else (None,) * store.n_layers  # per layer: W or None
        self.length = 0                     # positions already written and committed
        self.T = 0                          # tokens of the step in flight

    @property
    def n_sealed(self):
        return self.length // self.chunk_size

    def begin(self, T):
        off = self.length % self.chunk_size
        if T < 1 or off + T > self.chunk_size:
            raise ValueError(f"a step of {T} tokens at position {self.length} crosses a chunk boundary "
                             f"(chunk size {self.chunk_size}); feed the prompt through generate.prefill")
        if self.length + T > self.store.max_length:
            raise ValueError(f"the cache holds {self.store.max_length} positions; position {self.length + T} is past it")
        self.T = T
        first = [first_visible_chunk(w, self.length, self.chunk_size) for w in self.windows]  # per layer
        self.store.prefetch(self.n_sealed, first)  # queue visible sealed chunks not on the device, in attend's order

    def attend(self, layer, q, k, v):
        """q [B, H, T, D], k, v [B, G, T, D] at positions [length, length+T) -> attention output [B, H, T, D]."""
        B, H, T, D = q.shape
        G = k.shape[1]
        R = H // G
        off = self.length % self.chunk_size
        kv = self.store.open_chunk(layer)                              # [2, B, G, C, D] on the device
        kv[0, :, :, off:off + T] = k
        kv[1, :, :, off:off + T] = v
        q = (q * (1.0 / math.sqrt(D))).view(B, G, R, T, D).reshape(B, G, R * T, D)  # rows are (r, t) pairs
        C, W = self.chunk_size, self.windows[layer]
        q_pos = None if W is None else self.length + torch.arange(R * T, device=q.device) % T  # [R*T] row positions
        state = None  # only the first visible chunk can leave a row empty (o 0, lse -inf); the next one fills it
        for j in range(first_visible_chunk(W, self.length, C), self.n_sealed):  # sealed: every key is in the past
            k_j, v_j = self.store.load(layer, j)                       # [B, G, C, D] each, on the device
            edge = W is not None and j * C <= self.length + T - 1 - W  # its first key is out of the last query's window
            visible = visible_keys(q_pos, j * C + torch.arange(C, device=q.device), W) if edge else None  # [R*T, C]
            state = merge(state, *attend_chunk(q, k_j, v_j, visible))
            self.store.release(layer, j)                               # its staging slot may be refilled
        o, _ = merge(state, *attend_open_chunk(q, kv[0, :, :, :off + T], kv[1, :, :, :off + T], off, R, W))
        return o.to(q.dtype).view(B, G, R, T, D).reshape(B, H, T, D)  # [B, H, T, D]

    def end(self):
        self.length += self.T
        self.T = 0
        if self.length % self.chunk_size == 0:
            self.store.seal(self.length // self.chunk_size - 1)  # every layer's open chunk goes to the store


def make_cache(model, cfg, chunk_size, max_length, disk_path=None, restore=None, on_durable=None):
    """A KVCache for `model` (batch 1) over a TieredStore configured by cfg (offload.OffloadConfig), attending with
    the model's per-layer sliding windows."""
    a, p = model.args, next(model.parameters())
    store = TieredStore(a.n_layers, 1, a.n_kv_heads, a.head_dim, chunk_size, max_length, p.device, p.dtype, cfg,
                        disk_path, restore, on_durable)
    return KVCache(store, a.layer_windows)
