"""
The KV cache as attention sees it: chunks of C consecutive positions, attended one by one and merged exactly.

The KV of each layer is cut into chunks of `chunk_size` (C) positions. Chunk j holds positions [j*C, (j+1)*C).
The chunk being filled (the *open* chunk) always lives on the compute device; once full it is *sealed* and
handed to the store (offload.py), which decides where it lives: the device window, host memory or disk.

Attention of a block of queries (a prefill chunk, or one decode token) runs over
    sealed chunk 0, sealed chunk 1, ..., sealed chunk n-1, then the open chunk (causal inside it),
one partial attention per chunk, each normalised within its chunk and carrying the log-sum-exp of its scores,
merged in that order with weights exp(lse_chunk - lse_total). No position is dropped or approximated.

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
    p = torch.exp(s - m)                                           # [B, G, R*T, L]
    l = p.sum(dim=-1, keepdim=True)                                # [B, G, R*T, 1] row sum of exponentials
    o = torch.bmm(p.to(v.dtype).view(B * G, RT, L), v.reshape(B * G, L, D)).view(B, G, RT, D).float()
    return o / l, m + torch.log(l)


def attend_open_chunk(q, k, v, off, R):
    """The open chunk: queries at offsets off..off+T-1 see keys up to their own offset (causal).
    q [B, G, R*T, D] (rows are (r, t) pairs); k, v [B, G, off+T, D]. Returns (o, lse) as attend_chunk."""
    B, G, RT, D = q.shape
    T = RT // R
    if T == 1:                                                     # one query: every key is visible
        return attend_chunk(q, k, v)
    if off == 0 and _FLASH_CPU is not None and q.device.type == "cpu":  # a prefill chunk: the kernel's causal mask
        kh = k[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)  # [B, H, T, D]: one kv head per q head
        vh = v[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)
        o, lse = _FLASH_CPU(q.view(B, G * R, T, D), kh, vh, is_causal=True, scale=1.0)  # [B, H, T, D], [B, H, T]
        return o.float().reshape(B, G, RT, D), lse.reshape(B, G, RT, 1)
    t = torch.arange(RT, device=q.device) % T                      # query row (r, t) sits at offset off + t
    visible = torch.arange(off + T, device=q.device)[None, :] <= (off + t)[:, None]  # [R*T, off+T]
    return attend_chunk(q, k, v, visible)


def merge(state, o, lse):
    """Combine two normalised partial attentions exactly: weights exp(lse_i - lse_total)."""
    if state is None:
        return o, lse
    o0, lse0 = state
    total = torch.logaddexp(lse0, lse)                             # [B, G, R*T, 1]
    return o0.mul_(torch.exp(lse0 - total)).add_(o.mul_(torch.exp(lse - total))), total  # in place: o0, o are ours


def merge_group(parts):
    """Many partials [(o [B, G, R*T, D], lse [B, G, R*T, 1]), ...] of one query block merged at once, exactly. The
    weights come from one softmax over the group's log-sum-exps; the weighted sum is one stacked multiply and sum
    for a few query rows (a decode step: few kernels is what counts), and n in-place multiply-adds for many rows (a
    prefill chunk: no stacked copy). Never a matmul with n as its inner dimension: thousands of tiny GEMMs, ~10x
    slower. The branch depends on shapes only, so placement still cannot change a bit."""
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


MERGE_GROUP_BYTES = 4 << 20  # partials stacked per group merge: all of a decode step's, a few of a prefill chunk's


class KVCache:
    """Positions, the open chunk and the attention schedule; the store (offload.py) owns every byte.

    A forward step of T tokens, as generate.forward runs it:
        cache.begin(T)                   # check the step fits in the open chunk (bookkeeping only)
        cache.store.prefetch(n_sealed)   # the store starts bringing this step's offloaded chunks
        model(tokens, cache)             # each layer calls cache.attend(layer, q, k, v)
        if cache.commit():               # advance; True when the open chunk is now full
            cache.store.seal(j)          # the full chunk joins the window, the oldest window chunk is offloaded
    A step never crosses a chunk boundary (prefill feeds at most C tokens, aligned to chunks), so each
    step's queries all sit in the open chunk.
    """

    def __init__(self, store):
        self.store = store
        self.chunk_size = store.chunk_size  # C
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

    def attend(self, layer, q, k, v):
        """q [B, H, T, D], k, v [B, G, T, D] at positions [length, length+T) -> attention output [B, H, T, D]."""
        B, H, T, D = q.shape
        if T != self.T:  # model(tokens, cache) called without begin(T): give the same clear error begin gives
            self.begin(T)
            raise ValueError(f"call cache.begin({T}) before model(tokens, cache), as generate.forward does")
        G = k.shape[1]
        R = H // G
        off = self.length % self.chunk_size
        kv = self.store.open_chunk(layer)                              # [2, B, G, C, D] on the device
        kv[0, :, :, off:off + T] = k
        kv[1, :, :, off:off + T] = v
        q = (q * (1.0 / math.sqrt(D))).view(B, G, R, T, D).reshape(B, G, R * T, D)  # rows are (r, t) pairs
        group = max(1, MERGE_GROUP_BYTES // (q.numel() * 4))          # a function of shapes only: placement-free
        state, parts, load, release = None, [], self.store.load, self.store.release
        for j in range(self.n_sealed):                                 # sealed chunks: every key is in the past
            k_j, v_j = load(layer, j)                                  # [B, G, C, D] each, on the device
            parts.append(attend_chunk(q, k_j, v_j))
            release(layer, j)                                          # its staging slot may be refilled
            if len(parts) == group:
                state, parts = merge(state, *merge_group(parts)), []
        parts.append(attend_open_chunk(q, kv[0, :, :, :off + T], kv[1, :, :, :off + T], off, R))
        o, _ = merge(state, *merge_group(parts))
        return o.to(q.dtype).view(B, G, R, T, D).reshape(B, H, T, D)  # [B, H, T, D]

    def commit(self):
        """The step's positions are written on every layer: advance. True when the open chunk is now full and
        must be sealed (the caller does that, visibly: it moves data)."""
        self.length += self.T
        self.T = 0
        return self.length % self.chunk_size == 0


def make_cache(model, cfg, chunk_size, max_length, disk_path=None, restore=None, on_durable=None):
    """A KVCache for `model` over max_length positions, its chunks stored as `cfg` (an OffloadConfig) says.
    disk_path, restore and on_durable are the resume hooks of task.py (see TieredStore)."""
    a, emb = model.args, model.tok_embeddings.weight
    store = TieredStore(shape=(2, 1, a.n_kv_heads, chunk_size, a.head_dim), dtype=emb.dtype, n_layers=a.n_layers,
                        max_length=max_length, device=emb.device, cfg=cfg, disk_path=disk_path, restore=restore,
                        on_durable=on_durable)
    return KVCache(store)
