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
its scores, merged in that order with weights exp(lse_chunk - lse_total). No position is dropped or
approximated.

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

How K and V sit in a chunk's bytes is a layout: PlainLayout keeps them as computed; Int8Layout
(--kv-dtype int8) quantizes them as they are written into the open chunk and dequantizes each chunk
right before it is attended. The store sees only a buffer of some shape and dtype, so the int8
bytes, not the compute dtype's, cross every link.
"""
import math

import torch

from offload import TieredStore

# auto: K and V kept in the compute dtype; int8: quantized per token and kv head
KV_DTYPES = ("auto", "int8")


# Fused kernels that return the log-sum-exp an exact merge needs: one call per chunk instead of a
# handful. On CPU the flash kernel (torch >= 2.3); on CUDA flash (fp16/bf16) or memory-efficient
# attention (fp32), checked once per (device, dtype) against the matmul path below, which stays the
# fallback. Which one runs depends on the device, dtype and torch version only, never on where a
# chunk lives, so the choice cannot break bit-identity.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CUDA = {}  # (device, dtype) -> whether the fused CUDA kernel agreed with the matmul path


def fused_cuda(q, k, v):
    """One CUDA kernel for a chunk's partial: (o [B, G, R*T, D], lse [B, G, R*T, 1]) fp32; the kv
    heads act as the kernel's heads and the (r, t) query rows as its sequence, so GQA needs no copy
    of K or V."""
    aten = torch.ops.aten
    if q.dtype in (torch.float16, torch.bfloat16):
        o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=1.0)[:2]
    else:
        o, lse = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=1.0)[:2]
    # efficient attention pads lse's rows
    return o.float(), lse[..., :q.shape[2]].float().unsqueeze(-1)


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
    future keys. Returns (o [B, G, R*T, D], lse [B, G, R*T, 1]), both fp32: the chunk's output and
    log-sum-exp of its scores.
    """
    if visible is None and fused:  # the common case first: a chunk visit is the hot loop
        if q.is_cpu and _FLASH_CPU is not None:
            o, lse = _FLASH_CPU(q, k, v, scale=1.0)                # [B, G, R*T, D], [B, G, R*T]
            return (o if o.dtype == torch.float32 else o.float()), lse.unsqueeze(-1)
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
        return o / l.clamp(min=1.0), m + torch.log(l)
    return o / l, m + torch.log(l)


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
        return o.float().reshape(B, G, RT, D), lse.reshape(B, G, RT, 1)
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
    total = torch.logaddexp(lse0, lse)                             # [B, G, R*T, 1]
    # in place: o0, o are ours
    return o0.mul_(torch.exp(lse0 - total)).add_(o.mul_(torch.exp(lse - total))), total


def merge_group(parts):
    """Many partials [(o [B, G, R*T, D], lse [B, G, R*T, 1]), ...] of one query block merged at
    once, exactly. The weights come from one softmax over the group's log-sum-exps; the weighted sum
    is one stacked multiply and sum for a few query rows (a decode step: few kernels is what
    counts), and n in-place multiply-adds for many rows (a prefill chunk: no stacked copy). Never a
    matmul with n as its inner dimension: thousands of tiny GEMMs, ~10x slower. The branch depends
    on shapes only, so placement still cannot change a bit."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.cat([l for _, l in parts], dim=-1)                 # [B, G, R*T, n]
    total = torch.logsumexp(lse, dim=-1, keepdim=True)             # [B, G, R*T, 1]
    w = torch.exp(lse - total)                                     # [B, G, R*T, n]
    if lse.shape[2] <= 64:
        o = torch.stack([o for o, _ in parts])                     # [n, B, G, R*T, D]
        return (o * w.movedim(-1, 0).unsqueeze(-1)).sum(0), total  # [B, G, R*T, D]
    o = parts[0][0].mul_(w[..., :1])                               # in place: the partials are ours
    for i in range(1, len(parts)):
        o.add_(parts[i][0].mul_(w[..., i:i + 1]))
    return o, total


# -----------------------------------------------------------------------------
# chunk layouts: how K and V are laid out in a chunk's bytes; the store moves the chunk whatever
# its shape and dtype

class PlainLayout:
    """K and V as computed: a chunk [2, B, G, C, D] in the compute dtype. write and read are views,
    nothing else."""

    def __init__(self, dtype):
        self.dtype = dtype

    def shape(self, B, G, C, D):
        return (2, B, G, C, D)

    def write(self, chunk, off, k, v):
        """k, v [B, G, T, D] into positions off..off+T-1 of the chunk."""
        T = k.shape[2]
        chunk[0, :, :, off:off + T] = k
        chunk[1, :, :, off:off + T] = v

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] of the first `upto` positions of a chunk [2, B, G, C, D]."""
        if upto == chunk.shape[3]:
            # a sealed chunk: two views made in one call (a visit is the hot loop)
            return chunk.unbind(0)
        return chunk[0, :, :, :upto], chunk[1, :, :, :upto]


class Int8Layout:
    """K and V quantized symmetrically, one scale per token and kv head: a uint8 chunk
    [2, B, G, C, D + 4] whose rows are D int8 values then their fp32 scale (amax|x| / 127) as 4
    bytes. The scales live inside the chunk so that it stays one contiguous buffer that every tier
    moves as a unit; K and V cross every link at about half the bytes of bf16 (D=128: 132 bytes a
    row instead of 256). fp32 scales rather than bf16 ones: exact, so that the error stays within
    scale/2, for 2 more bytes a row; with D a multiple of 4 (every real head_dim), a row stride of
    D + 4 keeps the scales 4-byte aligned, readable as an fp32 view without a copy.
    Dequantized to the compute dtype chunk by chunk, right before attention: a function of the
    stored bytes only, so every tier stays bit-identical to --offload none with the same
    --kv-dtype."""

    S = 4  # bytes of a row's scale

    def __init__(self, compute_dtype):
        self.dtype = torch.uint8              # what the store holds
        self.compute_dtype = compute_dtype    # what attention gets

    def shape(self, B, G, C, D):
        return (2, B, G, C, D + self.S)

    def write(self, chunk, off, k, v):
        """Quantize k, v [B, G, T, D] into positions off..off+T-1 of the uint8 chunk."""
        T, D = k.shape[2], k.shape[3]
        x = torch.stack((k, v)).float()                               # [2, B, G, T, D]
        tiny = torch.finfo(torch.float32).tiny
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min_(tiny)  # [2, B, G, T, 1]
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)   # [2, B, G, T, D]
        rows = chunk[:, :, :, off:off + T]                            # [2, B, G, T, D + 4] uint8
        rows[..., :D] = q.view(torch.uint8)
        rows[..., D:] = scale.view(torch.uint8)                       # [2, B, G, T, 4]: fp32 bytes

    def read(self, chunk, upto):
        """(k, v) [B, G, upto, D] in the compute dtype, dequantized from the first `upto` positions
        of a uint8 chunk [2, B, G, C, D + 4]: K and V in one multiply."""
        kv = chunk[:, :, :, :upto]                                    # [2, B, G, upto, D + 4]
        D = kv.shape[-1] - self.S
        scale = kv[..., D:]                                           # [2, B, G, upto, 4] uint8
        aligned = D % 4 == 0 and scale.storage_offset() % 4 == 0
        scale = (scale if aligned else scale.contiguous()).view(torch.float32)  # [2, B, G, upto, 1]
        # int8 * fp32: one kernel; [2, B, G, upto, D]
        x = torch.mul(kv[..., :D].view(torch.int8), scale).to(self.compute_dtype)
        return x[0], x[1]


def chunk_layout(kv_dtype, dtype):
    """The layout for --kv-dtype (auto: the compute dtype `dtype`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return Int8Layout(dtype) if kv_dtype == "int8" else PlainLayout(dtype)


def kv_bytes_per_token(model_args, dtype, kv_dtype="auto"):
    """Bytes of K and V per position, all layers, as the chunks hold them (int8: with the scales);
    dtype is the compute dtype. What crosses a link per offloaded position."""
    layout = chunk_layout(kv_dtype, dtype)
    row = math.prod(layout.shape(1, model_args.n_kv_heads, 1, model_args.head_dim))
    return model_args.n_layers * row * torch.empty((), dtype=layout.dtype).element_size()


# partials stacked per group merge: all of a decode step's, a few of a prefill chunk's
MERGE_GROUP_BYTES = 4 << 20


class KVCache:
    """Positions, the open chunk and the attention schedule; the store (offload.py) owns every byte.

    A forward step of T tokens, as generate.forward runs it:
        cache.begin(T)                   # check the step fits in the open chunk (bookkeeping only)
        cache.store.prefetch(n_sealed)   # the store starts bringing this step's offloaded chunks
        model(tokens, cache)             # each layer calls cache.attend(layer, q, k, v)
        if cache.commit():               # advance; True when the open chunk is now full
            cache.store.seal(j)          # the full chunk joins the window; the oldest is offloaded
    A step never crosses a chunk boundary (prefill feeds at most C tokens, aligned to chunks), so
    each step's queries all sit in the open chunk.
    """

    def __init__(self, store, layout, windows=None):
        self.store = store
        # how K and V sit in a chunk's bytes (PlainLayout, Int8Layout)
        self.layout = layout
        self.chunk_size = store.chunk_size  # C
        if windows is None:
            windows = (None,) * store.n_layers
        self.windows = tuple(windows)       # per layer: W, or None for full attention
        self.length = 0                     # positions already written and committed
        self.T = 0                          # tokens of the step in flight

    @property
    def n_sealed(self):
        return self.length // self.chunk_size

    def begin(self, T):
        off = self.length % self.chunk_size
        if T < 1 or off + T > self.chunk_size:
            raise ValueError(f"a step of {T} tokens at position {self.length} crosses a chunk "
                             f"boundary (chunk size {self.chunk_size}); feed the prompt through "
                             "generate.prefill")
        if self.length + T > self.store.max_length:
            raise ValueError(f"the cache holds {self.store.max_length} positions; position "
                             f"{self.length + T} is past it")
        self.T = T

    def first_visible(self):
        """Per layer, the first sealed chunk this step can see: 0 with full attention, later with a
        sliding window. The store prefetches from there; what lies before it is never read."""
        return [first_visible_chunk(w, self.length, self.chunk_size) for w in self.windows]

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
        off = self.length % self.chunk_size
        kv = self.store.open_chunk(layer)                  # layout.shape(B, G, C, D), on the device
        self.layout.write(kv, off, k, v)
        # rows are (r, t) pairs: [B, H, T, D] -> [B, G, R*T, D]
        q = (q * (1.0 / math.sqrt(D))).view(B, G, R, T, D).reshape(B, G, R * T, D)
        C, W = self.chunk_size, self.windows[layer]
        q_pos = None  # [R*T] row positions, for a sliding window's mask
        if W is not None:
            q_pos = self.length + torch.arange(R * T, device=q.device) % T
        # partials per group merge: a function of shapes only, so placement-free
        group = max(1, MERGE_GROUP_BYTES // (q.numel() * 4))
        state = None
        parts = []
        load = self.store.load  # bound once: a chunk visit is the hot loop
        release = self.store.release
        read = self.layout.read
        # sealed chunks: every key is in the past. A row with no visible key in a chunk (the
        # window's edge) gets o 0 and lse -inf: the merge gives it weight 0
        for j in range(first_visible_chunk(W, self.length, C), self.n_sealed):
            k_j, v_j = read(load(layer, j), C)  # chunk [2, B, G, C, D] -> k, v [B, G, C, D]
            # the edge: its first key is out of the last query's window
            edge = W is not None and j * C <= self.length + T - 1 - W
            visible = (visible_keys(q_pos, j * C + torch.arange(C, device=q.device), W)
                       if edge else None)  # [R*T, C]
            parts.append(attend_chunk(q, k_j, v_j, visible))
            release(layer, j)  # its staging slot may be refilled
            if len(parts) == group:
                state, parts = merge(state, *merge_group(parts)), []
        parts.append(attend_open_chunk(q, *read(kv, off + T), off, R, W))  # k, v [B, G, off+T, D]
        o, _ = merge(state, *merge_group(parts))
        return o.to(q.dtype).view(B, G, R, T, D).reshape(B, H, T, D)  # [B, H, T, D]

    def commit(self):
        """The step's positions are written on every layer: advance. True when the open chunk is now
        full and must be sealed (the caller does that, visibly: it moves data)."""
        self.length += self.T
        self.T = 0
        return self.length % self.chunk_size == 0


def make_cache(model, cfg, chunk_size, max_length, disk_path=None, restore=None, on_durable=None,
               kv_dtype="auto"):
    """A KVCache for `model` over max_length positions, its chunks stored as `cfg` (an
    OffloadConfig) says, K and V held as kv_dtype says (KV_DTYPES). disk_path, restore and
    on_durable are the resume hooks of task.py (see TieredStore)."""
    model_args = model.args
    emb = model.tok_embeddings.weight
    layout = chunk_layout(kv_dtype, emb.dtype)
    # this rank's kv heads (all of them without tensor parallel)
    G = model.layers[0].attention.n_local_kv_heads
    store = TieredStore(shape=layout.shape(1, G, chunk_size, model_args.head_dim),
                        dtype=layout.dtype, n_layers=model_args.n_layers, max_length=max_length,
                        device=emb.device, cfg=cfg, disk_path=disk_path, restore=restore,
                        on_durable=on_durable)
    return KVCache(store, layout, model_args.layer_windows)
