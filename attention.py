"""
Attention over one chunk, and the exact merge of chunks: the arithmetic of the KV cache's schedule
(kvcache.py decides which chunks a step reads and in what order; this file computes).

A chunk's partial is its queries' attention over the chunk's keys, normalised within the chunk,
with the log-sum-exp of the scores: (o, lse). Two partials of the same queries merge exactly,
    o = o_1 * exp(lse_1 - lse) + o_2 * exp(lse_2 - lse),   lse = logaddexp(lse_1, lse_2),
so attention over a sequence cut into chunks is the attention over the whole sequence: no position
dropped, no approximation (FlashAttention's merge). Which kernel computes a partial depends on the
device, dtype and torch version only, never on where a chunk lives: placement cannot change a bit.

Shapes: B batch, G kv heads, R query heads per kv head, T queries of the step, D head dim, L keys
of a chunk. A step's queries are laid out as rows (r, t): q [B, G, R*T, D], so grouped-query
attention needs no copy of K or V.
"""
import torch

from fewrows import call_few, few_rows_kernel

# Fused kernels that return the log-sum-exp an exact merge needs: one call per chunk instead of a
# handful. On CPU the flash kernel (torch >= 2.3); on CUDA flash (fp16/bf16) or memory-efficient
# attention (fp32), checked once per (device, dtype) against the matmul path below, which stays the
# fallback. Which one runs depends on the device, dtype and torch version only, never on where a
# chunk lives, so the choice cannot break bit-identity.
# The kernel through its torch._ binding where torch has one: the same operator, its arguments
# parsed by torch's fast parser (25 us a small call here against 39-59 through torch.ops.aten, which
# resolves the overload on every call; two calls a layer in a decode step)
FLASH_CPU = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None) or getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CUDA = {}  # (device, dtype) -> whether the fused CUDA kernel agreed with the matmul path
QUERY_ROWS = 4   # a sealed chunk's visit has at least this many query rows (attend_few)
_WIDE = {}       # (K or V, its shape but the group's length, dtype, device) -> scratch (widened)


def flash_cpu(q, k, v, **kw):
    """torch's fused CPU kernel, each input's last dim made unit-stride first: given a last dim of
    another stride it returns wrong values without a word (torch 2.13: a q of strides (..., 2)
    was off by 3.6 on outputs of magnitude 1)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return FLASH_CPU(q, k, v, **kw)


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
    q, k, v = common_dtype(q, k, v)  # K and V held in half precision under wider weights
    if visible is None and fused:  # the common case first: a chunk visit is the hot loop
        if q.is_cpu and FLASH_CPU is not None:
            o, lse = flash_cpu(q, k, v, scale=1.0)                # [B, G, R*T, D], [B, G, R*T]
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


def attend_chunks(q, k, v):
    """The partials of n whole chunks in one kernel call: q [B, G, R*T, D] (scaled), or [n, B, G,
    R*T, D], queries of each chunk's own (a batch's grid of tasks' chunks, kvbatch.BatchedCaches);
    k, v [n, B, G, C, D], the chunks of one group (kvcache.chunk_groups). Returns their stack (o
    [n, B, G, R*T, D], lse [n, B, G, R*T]) fp32, in the chunks' order. The chunks are the kernel's
    batch: each batch element is computed apart from the others, so a chunk's partial has the bits
    a call of its own gives (tests/test_attention.py checks it), for a fraction of the fixed cost of
    a call (a decode step's few query rows read a chunk in about the time that cost takes)."""
    n, B, G, C, D = k.shape
    RT = q.shape[-2]
    few = few_rows_kernel(q, k) if q.dim() == 4 else None  # it takes one query block a call
    if few is not None:  # K and V read as they are held, whatever their dtype
        # [B*G, R*T, D] against [n, B*G, C, D]: flattening B and G is a view of every layout
        o, lse = call_few(few, q.reshape(B * G, RT, D), k.flatten(1, 2), v.flatten(1, 2))
        return o.view(n, B, G, RT, D), lse.view(n, B, G, RT)
    q, k, v = common_dtype(q, k, v)    # K and V held in half precision under wider weights
    qn = (q if q.dim() == 5 else q.expand(n, B, G, RT, D)).flatten(0, 1)  # [n*B, G, R*T, D]
    kn = k.flatten(0, 1)                                           # [n*B, G, C, D]
    vn = v.flatten(0, 1)
    if q.is_cpu and FLASH_CPU is not None:
        o, lse = flash_cpu(qn, kn, vn, scale=1.0)[:2]              # [n*B, G, R*T, D], [n*B, G, R*T]
        o = o if o.dtype == torch.float32 else o.float()
    elif q.is_cuda and use_fused_cuda(q):
        o, lse = fused_cuda(qn.contiguous(), kn, vn)
    else:
        o, lse = attend_chunk(qn, kn, vn, fused=False)
    return o.view(n, B, G, RT, D), lse.view(n, B, G, RT)


def common_dtype(q, k, v):
    """q, k, v in one dtype for the kernel: K and V held in another precision than q (--kv-dtype
    bf16 or fp16 under fp32 weights) widened exactly into a reused scratch, and q with them where
    neither holds the other (fp16 K and V under bf16 weights: all three fp32). A bf16 model's own
    K and V stay bf16: torch's CPU flash kernel reads bf16 at 9-12 GB/s, slower than fp32 at twice
    the bytes, and widened first a decode step's groups ran faster alone (30 layers at 6K: 16.3 ms
    against 12.1) but whole runs slower (25.4-25.7 tok/s against 26.8-27.8 at 6,258 tokens: the
    scratch's writes miss the cache once a layer's weights have streamed through it;
    docs/performance.md). A function of dtypes only, so placement-free."""
    if k.dtype == q.dtype:
        return q, k, v
    wide = torch.promote_types(q.dtype, k.dtype)
    return q.to(wide), widened(k, 0, wide), widened(v, 1, wide)


def widened(x, which, dtype=torch.float32):
    """x [n, ...] in half precision copied into a reused scratch of a wider dtype: exact (fp32
    holds every bf16 and fp16 value), and contiguous whatever x's strides, so every tier's runs
    reach the kernel in one layout, without a fresh allocation a step. The scratch is this
    process's, reused by every layer and step (one group's K and V at a time: a call reads its
    inputs before the next group overwrites them)."""
    key = (which, tuple(x.shape[1:]), dtype, x.device)
    buf = _WIDE.get(key)
    # a scratch made under inference_mode (every generation) is written in place only there
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or buf.shape[0] < x.shape[0] or stale:
        buf = torch.empty(x.shape, dtype=dtype, device=x.device)
        _WIDE[key] = buf
    return buf[:x.shape[0]].copy_(x)


def attend_few(q, k, v):
    """attend_chunks for a step of few query rows: q [B, G, R*T, D] padded with zero rows to
    padded_rows (mostly QUERY_ROWS), the stack cut back to its R*T rows (views: every merge is
    element by element or reads a concatenation, so strides change no bit). A step of
    several positions (speculate.attend_rows) can then put its positions' rows in one call and
    give each position the bits of its own step, where the kernel's rows are their own bits from
    QUERY_ROWS rows up (rowwise.shared_rows decides on probes): on this project's CPU the fused
    kernel takes one path for 1-3 rows and another, the same for every row, from 4 (measured,
    docs/speculation.md)."""
    RT = q.shape[2]
    o, lse = attend_chunks(pad_rows(q, padded_rows(q, k)), k, v)  # [n, B, G, rows, ...]
    return o[..., :RT, :], lse[..., :RT]


def padded_rows(q, k):
    """The query rows a chunk visit of q [B, G, RT, D] over K of k's dtype runs with: RT where the
    compiled kernel takes it (its rows are their own bits, and its cost grows with rows); else
    QUERY_ROWS where it has fewer, except 1-2 rows in fp32. Measured in a decode step (30 layers,
    6,144 tokens, 2 threads, steps alternating in one process, docs/speculation.md): bf16 3 rows
    padded to 4 make the step 9% faster; fp32 3 rows padded were 1-4% slower in one session and
    0% (2K) and 3% faster (6K) in the next (docs/performance.md, round nine), and padded they
    share a verify step's call (the fused kernel's rows are their own bits from 4 rows up), so
    they are padded; fp32 1-2 rows padded are far slower (a fused-kernel microbenchmark: 32% and
    65%) and stay as they are. A function of shapes and dtypes only, so placement-free."""
    RT = q.shape[2]
    if few_rows_kernel(q, k) is not None:
        return RT
    if RT >= QUERY_ROWS or (q.dtype == torch.float32 and RT < QUERY_ROWS - 1):
        return RT
    return QUERY_ROWS


def pad_rows(q, rows):
    """q [..., RT, D] with zero rows appended up to `rows` rows (q itself if it has as many)."""
    if q.shape[-2] >= rows:
        return q
    return torch.nn.functional.pad(q, (0, 0, 0, rows - q.shape[-2]))


def attend_open_chunk(q, k, v, off, R, window=None):
    """The open chunk: queries at offsets off..off+T-1 see keys up to their own offset (causal), and
    with a sliding window of W only the W latest. q [B, G, R*T, D] (rows are (r, t) pairs); k, v
    [B, G, off+T, D]."""
    B, G, RT, D = q.shape
    T = RT // R
    slides = window is not None and off + T > window  # some key here is outside some query's window
    if T == 1 and not slides:                          # one query: every key is visible
        return attend_chunk(q, k, v)
    if off == 0 and not slides and FLASH_CPU is not None and q.device.type == "cpu":
        # the kernel's causal mask; one kv head per query head
        kh = k[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)  # [B, H, T, D]
        vh = v[:, :, None].expand(B, G, R, T, D).reshape(B, G * R, T, D)  # [B, H, T, D]
        # [B, H, T, D], [B, H, T]
        o, lse = flash_cpu(q.view(B, G * R, T, D), kh, vh, is_causal=True, scale=1.0)[:2]
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


class Partials:
    """The partials of one query block, in attention's order, merged every `group` of them (a
    function of shapes only, so placement-free). Partials come as stacks (o [m, B, G, R*T, D],
    lse [m, B, G, R*T]): a group's kernel call gives m at once, a lone call one; a stack is cut
    where a merge falls, so the merges are the same however the partials came (one call, a run at a
    time, a chunk at a time: speculate.py)."""

    def __init__(self, group):
        self.group = group
        self.state = None   # the merge of the earlier groups: (o [B, G, R*T, D], lse [B, G, R*T])
        self.parts = []     # the stacks since
        self.count = 0      # the partials in them

    def add(self, o, lse):
        """A stack of partials, o [m, B, G, R*T, D], lse [m, B, G, R*T] (ours: merged in place)."""
        if self.count + o.shape[0] < self.group:  # the whole stack joins the group (a decode step)
            self.parts.append((o, lse))
            self.count += o.shape[0]
            return
        while o.shape[0]:
            take = min(o.shape[0], self.group - self.count)
            self.parts.append((o[:take], lse[:take]))
            self.count += take
            o, lse = o[take:], lse[take:]
            if self.count == self.group:
                self.state = merge(self.state, *merge_group(self.parts))
                self.parts = []
                self.count = 0

    def add_one(self, o, lse):
        """One partial, o [B, G, R*T, D], lse [B, G, R*T]."""
        self.add(o[None], lse[None])

    def output(self):
        """The attention of the block over every partial added: o [B, G, R*T, D]."""
        if self.state is None:  # one group: every decode step
            return merge_last(self.parts)
        if not self.parts:
            return self.state[0]
        return merge(self.state, *merge_group(self.parts))[0]


def merge_group(parts):
    """Stacks of partials [(o [m, B, G, R*T, D], lse [m, B, G, R*T]), ...] of one query block
    merged at once, exactly. The weights come from one softmax over the group's log-sum-exps; the
    weighted sum is one multiply and sum over the stack for a few query rows (a decode step: few
    kernels is what counts), and n in-place multiply-adds for many rows (a prefill chunk: no stacked
    copy). Never a matmul with n as its inner dimension: thousands of tiny GEMMs, ~10x slower. The
    branch depends on shapes only, so placement still cannot change a bit."""
    lse = torch.cat([l for _, l in parts])                         # [n, B, G, R*T]
    if lse.shape[0] == 1:
        return parts[0][0][0], lse[0]
    total = torch.logsumexp(lse, dim=0)                            # [B, G, R*T]
    return weighted_sum(parts, torch.exp(lse - total)), total


def merge_last(parts):
    """The output of a query block whose every partial is here (no earlier group to merge with:
    every decode step): its log-sum-exp is never needed, so the weights are one softmax."""
    lse = torch.cat([l for _, l in parts])                         # [n, B, G, R*T]
    if lse.shape[0] == 1:
        return parts[0][0][0]
    return weighted_sum(parts, torch.softmax(lse, dim=0))


def weighted_sum(parts, w):
    """sum over i of o_i * w[i], w [n, B, G, R*T]: one stacked multiply and sum for a few query
    rows, in-place multiply-adds for many (the partials are ours)."""
    if w.shape[3] <= 64:
        o = torch.cat([o for o, _ in parts])                       # [n, B, G, R*T, D]
        return (o * w.unsqueeze(-1)).sum(0)                        # [B, G, R*T, D]
    w = w.unsqueeze(-1)                                            # [n, B, G, R*T, 1]
    out = None
    i = 0
    for o, _ in parts:
        for o_i in o:
            o_i.mul_(w[i])
            out = o_i if out is None else out.add_(o_i)
            i += 1
    return out
