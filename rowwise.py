"""
Rows of one forward pass that belong to different tasks (generate.decode_batch: one decode token per
task) must each get the bits they would get alone, so that no task's output depends on its
neighbours. Here "alone" is the same call on that row by itself: block b of x [B, T, ...] must get
the bits of the [1, T, ...] call (a multi-query step whose T positions must each equal a one-token
step, as speculative verification needs, passes them as rows: [T, 1, ...]).

Nothing promises it. A matmul's library picks its kernel, blocking and split of the sums from the
row count (fp32 on Intel's CPUs, MKL: one row sums in one order, 2 to 15 rows in another, 16 rows
of the larger weights in a third), and an element-wise kernel runs a vector body and a scalar
tail that need not agree (fp32 F.silu: 4% of values differ between the two), so where a row starts
inside the call, or where the threads split it, decides its bits. A difference in the fp32 sums
shows in a bf16 result only when it crosses a rounding boundary, so a product that changes its
order at 7 rows passes most random probes: measured on a product that adds the two halves of K
apart from 7 rows up, 7 of 20 normal probes saw it, and a trained model's weights make it rarer
still. One probe decides nothing.

So each operation a step shares across rows is kept row-invariant in one of three ways:
- By construction. An element-wise operation made of correctly rounded IEEE operations (add, mul,
  neg, a cast, a copy) gives an element the same bits whatever kernel, vector width or thread split
  computes it: the residual adds, RoPE's rotation (separate mul and add, no fused multiply-add), the
  norm's scaling, a linear's bias, the embedding (a gather) and the fp32 cast of the logits need
  nothing here. Attention keeps each task's chunks, open chunk and merge its own
  (kvbatch.BatchedCaches: where tasks share a kernel call, each is an element of its batch, and
  their merges share a call only where `rows` vouches for it); a speculative step's positions
  share a chunk's kernel call only where `shared_rows` vouches for it.
- A check that a reordering cannot pass (`linear`, `rows`): decided once per kind of operation,
  weight shape and layout, input shape and layout, dtype, device and thread count, on probes built
  to expose any change of summation order, every row compared with its lone call, and a single
  mismatch meaning "not invariant". A linear is probed with a weight of its kind, shape and layout
  whose every output is exactly zero: pairs of input features carry equal values of magnitudes
  from 2^-6 to 2^7 and weights of opposite signs, so the result is nothing but the rounding the
  order of the sums left behind (products are exact in fp32 for bf16, int8 and int4 operands); on
  the product above 96% of such outputs differ, so one probe of B x N outputs cannot miss it. A
  row function (the norm's statistic, SiLU times the up projection) is probed with values of
  magnitudes 2^-8 to 2^8 at every position, ROW_TRIALS times.
- Rows a few at a time, or one at a time, where the check fails: `linear` tries groups of B/2,
  B/3, ... rows down to 2 (each group size checked as above), then each row's call is exactly
  the lone one (a fresh copy of the row, so even its alignment is the lone one's). A linear then
  reads its weight once per group or row (from the cache after the first, for a layer that fits),
  except where its groups go in blocks (fp32 on Intel's CPUs): there every group reads a piece of
  the weight before the next piece (Linear.groups_in_pieces, checked as above), so a weight larger
  than the cache streams from memory once; the measured cost is in docs/batches.md.
Measured on this project's build machine (AMD EPYC, AVX2, torch 2.13, 1 and 2 threads, rows 1 to 16
and T 1, 3, 9): bf16 products (torch's own dot kernel), the int8 and int4 kernels, the norm's
statistic and SiLU times up of the model's widths pass; fp32 products of more rows than one never
do, except `Linear`'s blocked product of 2 or 3 rows (MKL's product of a few columns, column by
column), and fp32 SiLU of a width that is not a multiple of 16 fails once the threads split it. The
key includes the thread count, so each is decided for the threads it runs with.

One row alone (a decode step's product) has its own path too, `Linear`: on AMD's CPUs in fp32 MKL's
one-row product runs on one thread, at a third of the bandwidth (blocked_fp32): the weight is cut
into blocks of output rows, one batched call that the threads share (measured in
docs/performance.md); up to SPLIT_COLUMNS rows take it as as many columns. Its bits are its own, and
the same in every run, whatever the thread count: the blocks are a function of the weight's shape
only, and the rows above keep that call as "alone". In half precision on a CPU with AVX512-BF16
torch's product is oneDNN's, whose one-row path sums K >= 1536 in another order than its path for 2
to 16 rows (those agree among themselves): there `Linear` takes a lone row as the row and a zero row
(lone_row_padded, decided on probes), so that a batch or a verify step is one product of its rows
rather than a product a row. So does fp32 on Intel's CPUs, where MKL's one-row product (a threaded
GEMV) sums in another order than its product of 2 to 15 rows: the lone row padded costs 5-30% of its
read in the layers' products (by shape and minute; docs/performance.md), and a batch of 16 is two
groups of 8 (16 rows take a third order) that read each piece of a weight in turn, 3 to BLOCKED_ROWS
rows as one product of the weight's blocks of output rows (rows_in_blocks, faster than MKL's product
of the whole weight; docs/performance.md, round twenty-three). Where oneDNN computes bf16 on AMX
tiles (Intel Xeon 4th generation and later), a product of up to WEIGHT_FIRST_ROWS rows is taken the
other way round, the weight times the rows as columns (weight_first: torch.mv or torch.mm, whose
product has the weight's N rows where F.linear's has the few rows, so the tiles' 16 rows are
filled): a decode step's bf16 products read their weights 1.2-1.8x faster, and where probes show a
lone row the bits of that row among others (decided once per shape), so batches and verify steps
stay one product. On a CPU without that kernel (AVX2), a product of WIDE_ROWS rows or more (a
prefill chunk's) is taken in fp32 and rounded once (wide): torch's own half-precision GEMM is 6x
slower than MKL's fp32 there; a decode step's rows keep the half-precision kernel.
"""
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import fewrows

SPLIT_ROWS = 64  # Linear's blocks: at least this many output rows each, at most SPLIT_BLOCKS
SPLIT_BLOCKS = 16
SPLIT_COLUMNS = 3  # Linear's blocked product (blocked_fp32): up to this many rows
BLOCKED_ROWS = 15  # Linear.rows_in_blocks: up to this many fp32 rows (MKL's few-rows path)
PIECE_BYTES = 448 * 1024  # Linear.groups_in_pieces: a block of the weight at most this
PIECE_BLOCKS = 2  # and a piece this many blocks a thread (two blocks: 864 KiB of MiB-sized L2)
PIECES = "a piece of the weight at a time"  # how decisions() names groups_in_pieces
WIDE_ROWS = 32  # a half-precision product of this many rows or more may be taken in fp32 (wide)
WEIGHT_FIRST_ROWS = 16  # products of up to this many bf16 rows may take weight_first
ROW_TRIALS = 16  # probes of a row function: a vector/scalar split shows in ~half of them
_DECIDED = {}    # key -> (what, (B, T), whether one call gives every row its lone bits)
_PROBES = {}     # a weight's kind, shape and layout -> (its zero-sum probe layer, the pairs)
_LONE = {}       # key -> whether Linear takes a lone half-precision row as two (lone_row_padded)
_ZERO_ROWS = {}  # (K, dtype) -> a zero row [1, K] on CPU (zero_row)
_BLOCKED = None  # whether this CPU is not Intel's (intel, blocked_fp32), read once
_AMX = None      # whether oneDNN may compute bf16 on AMX tiles here (weight_first), read once


class Linear(nn.Linear):
    """nn.Linear whose product of M <= SPLIT_COLUMNS rows on CPU in fp32 is, where blocked_fp32,
    one batched product of the weight's blocks of output rows: [M, K] x [N, K] as [n, N/n, K] x
    [K, M], n a function of N only; and whose one-row product on CPU is that of two rows, the second
    zero, where the library's one-row path sums in another order than its path for more rows
    (lone_row_padded), or a few rows as the weight times columns where that is faster and the
    same bits (weight_first): then one product serves a batch's or a verify step's rows; and whose
    product of 3 to BLOCKED_ROWS fp32 rows on Intel's CPUs is one batched product of the weight's
    blocks of output rows (rows_in_blocks). With --products compiled, a product of up to
    fewrows.PRODUCT_ROWS rows in half precision on CPU is the compiled fewrows.few_rows_product
    instead, each row's bits its own by construction."""

    one_row = None  # (what one row's path was decided for, the path): one_row_path

    def forward(self, x):
        w = self.weight                                            # [N, K]
        N, K = w.shape
        path = self.one_row_path(x) if x.numel() == K and w.is_cpu else None
        if path == "padded":  # the row and a zero row: [2, K] (lone_row_padded)
            x2 = torch.cat([x.reshape(1, K), zero_row(K, x.dtype)])
            return F.linear(x2, w, self.bias)[:1].view(*x.shape[:-1], N)
        if path == "column":  # the weight times the row (weight_first): [N, K] x [K]
            return torch.mv(w, x.reshape(K)).view(*x.shape[:-1], N)
        few = fewrows.product_kernel(x, w, self.bias)  # --products compiled: a few half rows
        if few is not None:
            return fewrows.call_product(few, x, w, self.bias)     # [..., N]
        M = x.numel() // K                                         # rows
        if (M <= WEIGHT_FIRST_ROWS and x.dtype == w.dtype == torch.bfloat16 and w.is_cpu
                and weight_first(self, x)):
            # the weight as the product's rows (weight_first): [N, K] x [K, M] (one row: above)
            y = torch.mm(w, x.reshape(M, K).t())                     # [N, M]
            return y.t().contiguous().view(*x.shape[:-1], N)         # [..., N]
        if 2 < M <= BLOCKED_ROWS and blocked_rows(self, x):
            return self.rows_in_blocks(x)                          # [..., N]
        if w.dtype == x.dtype and wide(x):
            b = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), w.float(), b).to(x.dtype)       # [..., N], rounded once
        if (M > SPLIT_COLUMNS or w.dtype != torch.float32 or x.dtype != w.dtype
                or not w.is_cpu or not w.is_contiguous() or not x.is_contiguous()
                or not blocked_fp32(self, x)):
            return F.linear(x, w, self.bias)
        n = split_blocks(N)
        if n == 1:
            return F.linear(x, w, self.bias)
        # [n, K, M] over one copy of x, strides (0, 1, K), made as one view: M columns the library
        # reads as such (a column of strides (0, 1, 1) takes a path three times slower)
        cols = x.as_strided((n, K, M), (0, 1, K), x.storage_offset())
        y = torch.bmm(w.view(n, -1, K), cols)                      # [n, N/n, M]
        if M > 1:  # rows back to row-major: [M, n, N/n] (the kernels after expect it)
            y = y.permute(2, 0, 1).contiguous()
        y = y.view(*x.shape[:-1], N)                               # [..., N]
        return y if self.bias is None else y + self.bias

    def one_row_path(self, x):
        """How this layer takes a product of one row x [..., K] (CPU): "padded", as the row and a
        zero row (lone_row_padded); "column", the weight times the row (weight_first); or "other"
        (forward's checks: the compiled product, the blocked one, F.linear). Decided once per
        weight, x's dtype and layout, thread count and --products, then read from the layer: a
        decode step makes a hundred products, and the checks cost about a fifth of a small one's
        call (docs/performance.md, round twenty-five)."""
        w = self.weight
        # id(_LONE): the decisions it was read from (a test that clears them decides afresh)
        key = (x.dtype, x.stride(-1), x.is_contiguous(), w.data_ptr(), w.dtype, w.shape,
               w.stride(), self.bias is None, torch.get_num_threads(), fewrows.PRODUCTS, id(_LONE))
        if self.one_row is None or self.one_row[0] != key:
            library = fewrows.product_kernel(x, w, self.bias) is None  # not --products compiled's
            path = "other"
            if library and x.dtype == w.dtype == torch.bfloat16 and weight_first(self, x):
                path = "column"
            elif (library and (w.dtype != torch.float32 or not blocked_fp32(self, x))
                  and lone_row_padded(self, x)):
                path = "padded"
            self.one_row = (key, path)
        return self.one_row[1]

    def rows_in_blocks(self, x):
        """x [..., K] (3 to BLOCKED_ROWS fp32 rows, contiguous) times the weight as one batched
        product of its blocks of output rows: [n, M, K] (one view of x) x [n, K, N/n], n a
        function of N only (split_blocks). MKL's product of a few fp32 rows reads a block at a
        time faster than the whole weight: 8 rows of 3,072 x 576 in 525 against 842 us from memory
        (docs/performance.md, round twenty-three)."""
        w = self.weight                                            # [N, K]
        N, K = w.shape
        n = split_blocks(N)
        M = x.numel() // K
        rows = x.reshape(M, K).expand(n, M, K)                     # [n, M, K], one copy
        y = torch.bmm(rows, w.view(n, N // n, K).transpose(1, 2))  # [n, M, N/n]
        y = y.transpose(0, 1).reshape(*x.shape[:-1], N)            # [..., N], row-major
        return y if self.bias is None else y + self.bias

    def groups_in_pieces(self, x, g):
        """x [B, T, K] (fp32, contiguous) in groups of g rows of B, each group's product one batched
        product of the weight's blocks of output rows as in rows_in_blocks, but a piece of the
        weight at a time for every group (pieces(): PIECE_BLOCKS blocks a thread): a batch whose
        rows one product cannot take (MKL's 16 fp32 rows) then reads a weight larger than the
        cache from memory once, not once a group. 16 rows as two groups of 8, from memory, 2
        threads: SmolLM2-135M's joint gate and up (3,072 x 576) in 671 us against 909 a group at
        a time, its output matrix (49,152 x 576) in 10.6 ms against 20.9 (docs/performance.md,
        round twenty-four). rowwise.linear's probes compare every row with its lone product
        before it is taken."""
        w = self.weight                                            # [N, K]
        N, K = w.shape
        n, p = pieces(self)                                        # blocks, blocks a piece
        blocks = w.view(n, N // n, K).transpose(1, 2)              # [n, K, N/n]
        groups = [x[i:i + g].reshape(-1, K) for i in range(0, x.shape[0], g)]  # [m, K] each
        outs = [[] for _ in groups]
        for j in range(0, n, p):  # the piece's p blocks from memory for the first group only
            for rows, out in zip(groups, outs):
                out.append(torch.bmm(rows.expand(p, *rows.shape), blocks[j:j + p]))  # [p, m, N/n]
        # each group's [n, m, N/n] to [m, N], row-major
        y = torch.cat([torch.cat(out).transpose(0, 1).reshape(-1, N) for out in outs])  # [B*T, N]
        y = y.view(*x.shape[:-1], N)                               # [B, T, N]
        return y if self.bias is None else y + self.bias

    @classmethod
    def joined(cls, layers):
        """One Linear [sum N, K] of layers (rowwise.Joint), their weights and biases its views."""
        joint = cls(layers[0].in_features, sum(l.out_features for l in layers),
                    bias=layers[0].bias is not None, device="meta")
        return concatenate(layers, joint, ("weight", "bias"))


def zero_row(K, dtype):
    """A zero row [1, K] of dtype on CPU, made once and shared (a lone row's padding: read, never
    written); a normal tensor even when first asked for under inference_mode, so that products
    outside it may read it too."""
    key = (K, dtype)
    if key not in _ZERO_ROWS:
        with torch.inference_mode(False):
            _ZERO_ROWS[key] = torch.zeros(1, K, dtype=dtype)
    return _ZERO_ROWS[key]


def wide(x):
    """Whether a product of x [..., K] (WIDE_ROWS rows or more, half precision, on CPU) and a
    weight is taken in fp32 (operands widened exactly, one rounding of the result): where oneDNN
    has no kernel for that half precision on this CPU (AVX2 without AVX512-BF16), torch's own
    half-precision GEMM computes 512 rows of 1536 x 576 in 89 ms against MKL's fp32 15 ms
    (docs/performance.md, round fourteen). A function of the row count, dtype and machine: a
    prefill chunk's product; a decode step's few rows keep the half-precision kernel, which reads
    half the bytes, and rowwise.linear's probes see any row count that crosses over."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cpu:
        return False
    if x.numel() < WIDE_ROWS * x.shape[-1]:
        return False
    return not fewrows.native_half(x.dtype)


def concatenate(layers, joint, names, dim=0, share=True):
    """Give `joint` (a layer built on the meta device) each tensor `names` of `layers` side by side
    along dim, one buffer each; with share, each layer's tensor becomes its view of that buffer (so
    that the weights are held once). Returns joint."""
    for name in names:
        parts = [getattr(l, name) for l in layers]
        if parts[0] is None:
            continue
        whole = torch.cat(parts, dim)
        _set(joint, name, whole)
        start = 0
        for l, t in zip(layers, parts):
            if share:
                _set(l, name, whole.narrow(dim, start, t.shape[dim]))
            start += t.shape[dim]
    return joint


def _set(module, name, t):
    """module.name = t, a parameter where it held one (a buffer stays a buffer)."""
    if name in module._parameters:
        t = nn.Parameter(t, requires_grad=False)
    setattr(module, name, t)


class Joint:
    """Linears that read the same input (q, k, v; gate and up) as one product: their weights (and
    biases, and a quantized kind's scales) are moved side by side into one buffer [N_1 + N_2 + ...,
    K] and become views of it, so a step makes one call instead of several (a decode step's calls
    cost more than their bytes; the int8 and int4 kernels' calls cost several operations each).
    The bits are the joint product's, in every call, whatever the rows: linear() keeps its rows as
    its lone call. Once a layer's weight is no longer its view (a parameter replaced after the
    join, as `.to()` does), each layer is its own product again."""

    def __init__(self, layers, layer):
        self.layers = layers
        self.sizes = [l.out_features for l in layers]
        self.layer = layer  # one layer [sum N, K]; the layers' weights are views of its buffers
        self.views = self.placed()

    @classmethod
    def of(cls, layers):
        """A Joint of layers, or None where they cannot be one (kinds that do not join, mixed
        kinds, dtypes, devices or biases). A kind joins through its `joined(layers)`: Linear's
        above, the quantized kinds' in quantize.py."""
        kind = type(layers[0])
        if not all(type(l) is kind for l in layers) or not hasattr(kind, "joined"):
            return None
        kinds = {(l.weight.dtype, l.weight.device, l.in_features, l.bias is not None)
                 for l in layers}
        layer = kind.joined(layers) if len(kinds) == 1 else None
        return None if layer is None else cls(layers, layer)

    def placed(self):
        """Where and how large each layer's weight is: its view of the buffer, or not."""
        return [(l.weight.data_ptr(), tuple(l.weight.shape)) for l in self.layers]

    def __call__(self, x):
        """[linear(layer, x) for each layer], as one product while the weights are its views."""
        y = self.joint(x)
        if y is None:
            return [linear(l, x) for l in self.layers]
        return y.split(self.sizes, dim=-1)

    def joint(self, x):
        """The layers' outputs side by side, [..., N_1 + N_2 + ...], from one product; None once
        the weights are no longer its views."""
        return linear(self.layer, x) if self.placed() == self.views else None


def blocked_fp32(layer, x):
    """Whether layer's fp32 product of one to SPLIT_COLUMNS rows (x) on CPU takes Linear's blocked
    product: on CPUs that are not Intel's, and on Intel's where the library's one-row product is
    not the same bits at every thread count. MKL's one-row product runs on one thread on AMD's
    (AVX2 and AVX512: a third of the read bandwidth); on Intel's it is threaded (Xeon with
    AVX512-BF16, 2 threads: 26-31 GB/s against the blocked product's 10-12, docs/performance.md
    round thirteen), its threads splitting the outputs, not the sums, which zero-sum probes at 1,
    2 and the current thread count check (_one_row_threads_agree), once per weight shape and
    layout. A function of the machine and shapes, never of a run or of the thread count."""
    if not intel():
        return True
    w = layer.weight
    key = ("fp32 one row", tuple(w.shape), w.stride(), w.data_ptr() % 64, _has_bias(layer),
           x.stride()[-1])
    if key not in _LONE:
        _LONE[key] = not _one_row_threads_agree(layer)
    return _LONE[key]


def _one_row_threads_agree(layer):
    """F.linear of one row gives the same bits at 1, 2 and the current thread count, on two
    zero-sum probes (module docstring): the sums' order is the same at each."""
    g = torch.Generator().manual_seed(0)
    made = _probe_layer(layer, g)
    if made is None:
        return False
    probe, pairs = made
    threads = torch.get_num_threads()
    try:
        for _ in range(2):
            v = _magnitudes((1, pairs.shape[1]), g, -6, 7)
            xp = _paired(v, pairs, probe.weight.shape[1])               # [1, K]
            ys = []
            for n in sorted({1, 2, threads}):
                torch.set_num_threads(n)
                ys.append(F.linear(xp, probe.weight, probe.bias))  # [1, N]
            if not all(torch.equal(ys[0], y) for y in ys[1:]):
                return False
    finally:
        torch.set_num_threads(threads)
    return True


def intel():
    """Whether this CPU is Intel's (MKL's fp32 paths differ by vendor), read once."""
    global _BLOCKED
    if _BLOCKED is None:
        try:
            with open("/proc/cpuinfo") as f:
                _BLOCKED = "GenuineIntel" not in f.read(4096)
        except OSError:
            _BLOCKED = True
    return not _BLOCKED


def blocked_rows(layer, x):
    """Whether layer's product of x [..., K] (3 to BLOCKED_ROWS rows) takes Linear.rows_in_blocks:
    fp32 on an Intel CPU (not blocked_fp32's), x and the weight contiguous, a weight that splits
    into blocks. A function of shapes, layouts and the machine. A lone row (padded to two) keeps
    F.linear, which is faster for it; rowwise.linear's probes compare every row of a product in
    blocks with the lone row's, and keep a size that differs out of one call (measured on the
    Intel VM: every weight of a SmolLM2-135M layer and its output matrix agrees at every size to
    15, where F.linear's q, k, v and o took another order from 4 rows)."""
    w = layer.weight
    return (w.dtype == x.dtype == torch.float32 and w.is_cpu and w.is_contiguous()
            and x.is_contiguous() and split_blocks(w.shape[0]) > 1 and intel()
            and not blocked_fp32(layer, x))


def pieces(layer):
    """(n, p): Linear.groups_in_pieces's blocks of the weight, N halved while a block holds more
    than PIECE_BYTES, and the blocks of a piece, PIECE_BLOCKS a thread (fewer where that does not
    divide n); None where the weight makes fewer than two pieces of two blocks or more (a batched
    product of one block takes another path). Measured (Xeon, family 6 model 207, 16 rows as two
    groups of 8, from memory): pieces of 864 KiB a thread were fastest at 1 and 2 threads, 3.4 MiB
    at 2 threads 10-20% slower. A function of shapes and the thread count."""
    N, K = layer.weight.shape
    rows = N
    while rows % 2 == 0 and rows * K * layer.weight.element_size() > PIECE_BYTES:
        rows //= 2
    n = N // rows
    p = min(n, PIECE_BLOCKS * torch.get_num_threads())
    while n % p:
        p -= 1
    return (n, p) if 2 <= p and 2 * p <= n else None


def split_blocks(N):
    """Linear's blocks for N output rows: the most, up to SPLIT_BLOCKS, a power of two dividing N
    with SPLIT_ROWS rows or more each (1: no split, a small weight reads fast enough)."""
    n = 1
    while n < SPLIT_BLOCKS and N % (2 * n) == 0 and N // (2 * n) >= SPLIT_ROWS:
        n *= 2
    return n


def linear(layer, x):
    """layer(x) for x [B, T, K] whose B rows may be different tasks: each row's result is the one
    it gets alone (B = 1: just the product). Where one product of the B rows does not give it, the
    rows go in groups of the largest size that does (B/2, B/3, ... down to 2; MKL's fp32 product
    of 16 rows on Intel's CPUs: two of 8), or one at a time."""
    B = x.shape[0]
    if B == 1 or one_product(layer, x):
        return layer(x)
    for g in sorted({-(-B // k) for k in range(2, B)} | {2}, reverse=True):  # B/2, B/3, ... 2
        # groups of g rows, the largest size whose one product gives each row its bits
        x_g = x[:g].clone()
        if one_product(layer, x_g):
            if in_pieces(layer, x, g):  # the groups read each piece of the weight in turn
                return layer.groups_in_pieces(x, g)                # [B, T, N]
            return torch.cat([linear(layer, x[i:i + g].clone()) for i in range(0, B, g)])
    return torch.cat([layer(x[i:i + 1].clone()) for i in range(B)])  # [B, T, N], row by row


def rows(fn, key, *xs):
    """fn(*xs) for tensors [B, T, ...] whose B rows may be different tasks, fn working row by row
    (its result's row b depends on the inputs' row b only): each row's result is the one it gets
    alone. key names fn and what it depends on besides its inputs (e.g. ("rms", eps))."""
    B = xs[0].shape[0]
    if B == 1:
        return fn(*xs)
    full = ("rows", key, torch.get_num_threads(), *[(x.shape, x.stride(), x.dtype, x.device)
                                                    for x in xs])
    if _decide(full, lambda: _rows_agree(fn, xs), (str(key), tuple(xs[0].shape[:2]))):
        return fn(*xs)
    return torch.cat([fn(*(x[i:i + 1].clone() for x in xs)) for i in range(B)])


def lone_row_padded(layer, x):
    """Whether layer's one-row product (x [..., K], one row, CPU; in fp32 only where blocked_fp32
    does not take it) is taken as two rows, the second zero: where the library's one-row product
    gives other bits than the same row among others. Measured (AMD EPYC with AVX512-BF16, torch
    2.13, oneDNN): bf16 products of K >= 1536 (1536, 2048, 4096, 14336) give one row other bits than
    that row in 2 to 16 rows, which all agree with each other and with the row and a zero row; K <=
    1024 agree at every count. Intel Xeon (family 6 model 207, MKL), fp32: every shape of a
    SmolLM2-135M layer and its output matrix gives one row other bits than 2 to 15 rows. Decided
    once per weight shape and layout, x's layout, dtype and thread count, on zero-sum probes (module
    docstring): a function of shapes and the machine, never of where a chunk lives."""
    w = layer.weight
    key = ("lone row", tuple(w.shape), w.stride(), w.dtype, w.data_ptr() % 64, _has_bias(layer),
           x.stride()[-1], x.dtype, torch.get_num_threads())
    if key not in _LONE:
        _LONE[key] = not _lone_row_agrees(layer, x)
    return _LONE[key]


def weight_first(layer, x):
    """Whether layer's bf16 product of a few rows (x [..., K], up to WEIGHT_FIRST_ROWS rows, CPU)
    is taken as the weight times the rows as columns, [N, K] x [K] (torch.mv) or x [K, M]
    (torch.mm, transposed back): for a layer without a bias (a bias's rounding would be another
    question for the probes), where oneDNN computes bf16 on AMX tiles (amx_tiles) and probes show a
    lone row's column the bits of the same row among others (F.linear of 2 rows), so that a batch or
    a verify step stays one product (rowwise.linear's probes then compare its rows, columns too,
    with the lone row). oneDNN fills a tile's 16 rows with the product's rows: the few rows for
    F.linear, 16 of the weight's N for the columns. Measured (Xeon, family 6 model 207, 2 threads,
    docs/performance.md round twenty-one): 576 x 3072 in 95 us against 175 for one row, 1.2-1.5x
    for 2 to 16 rows from memory, a 6K decode step of a 30-layer bf16 model 14% faster; without AMX
    (AVX512-BF16 alone) one column is 2.5-3x slower, so it is not taken there. Decided once per
    weight shape and layout, x's layout and the thread count: a function of shapes and the machine,
    never of where a chunk lives."""
    if _has_bias(layer) or not amx_tiles():
        return False
    w = layer.weight
    key = ("weight first", tuple(w.shape), w.stride(), w.data_ptr() % 64, x.stride()[-1],
           torch.get_num_threads())
    if key not in _LONE:
        _LONE[key] = _weight_first_agrees(layer, x)
    return _LONE[key]


def amx_tiles():
    """Whether oneDNN may compute bf16 products on AMX tiles here: the CPU has them, the kernel
    lets this process use them (torch's _init_amx asks it once), and ONEDNN_MAX_CPU_ISA does not
    keep oneDNN below them. Read once a process."""
    global _AMX
    if _AMX is None:
        init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
        try:
            _AMX = bool(init and init()) and (isa in ("ALL", "DEFAULT", "") or "AMX" in isa)
        except RuntimeError:
            _AMX = False
    return _AMX


def _weight_first_agrees(layer, x):
    """The weight times the row as a column equals the first row of F.linear of the row and
    another, on two zero-sum probes (module docstring), each with a second row of its own."""
    g = torch.Generator().manual_seed(0)
    made = _probe_layer(layer, g)
    if made is None:
        return False
    probe, pairs = made
    K = layer.in_features
    for _ in range(2):
        xp = _paired(_magnitudes((2, pairs.shape[1]), g, -6, 7), pairs, K).to(x.dtype)  # [2, K]
        col = torch.mv(probe.weight, xp[0])                        # [N]
        if not torch.equal(col[None], F.linear(xp, probe.weight)[:1]):
            return False
    return True


def _lone_row_agrees(layer, x):
    """The one-row product equals the first row of the row and a zero row, on two zero-sum probes
    (F.linear itself: the layer's forward asks this question)."""
    g = torch.Generator().manual_seed(0)
    K = layer.in_features
    made = _probe_layer(layer, g)
    if made is None:
        return True
    probe, pairs = made
    for _ in range(2):
        v = _magnitudes((1, pairs.shape[1]), g, -6, 7)
        xp = torch.cat([_paired(v, pairs, K), torch.zeros(1, K)]).to(x.dtype)  # [2, K]: a zero row
        one = F.linear(xp[:1].clone(), probe.weight, probe.bias)   # [1, N]
        if not torch.equal(one, F.linear(xp, probe.weight, probe.bias)[:1]):
            return False
    return True


def one_product(layer, x):
    """Whether one product of x's rows gives every row the bits of its lone product, for this
    kind of layer, its weight's shape and layout, x's shape, layout, dtype and device, and the
    thread count: decided once, on probes (module docstring)."""
    w = layer.weight
    key = ("linear", type(layer), fewrows.PRODUCTS, getattr(layer, "packing", None),
           getattr(layer, "group_size", None), tuple(w.shape), w.stride(), w.dtype,
           w.data_ptr() % 64, _has_bias(layer), tuple(x.shape), x.stride(), x.dtype, x.device,
           torch.get_num_threads())
    name = f"{type(layer).__name__} {tuple(w.shape)} {str(x.dtype).removeprefix('torch.')}"
    return _decide(key, lambda: _linear_agrees(layer, x), (name, tuple(x.shape[:2])))


def in_pieces(layer, x, g):
    """Whether layer's product of x [B, T, K] in groups of g rows of B is Linear.groups_in_pieces:
    fp32 rows that go in blocks (blocked_rows), a weight of two pieces or more (pieces), and every
    row of it the bits of its lone product on probes (as one_product's), decided once per weight
    shape and layout, x's shape and layout, g and the thread count."""
    if not isinstance(layer, Linear) or not blocked_rows(layer, x) or pieces(layer) is None:
        return False
    w = layer.weight
    key = ("linear in pieces", g, tuple(w.shape), w.stride(), w.data_ptr() % 64, _has_bias(layer),
           tuple(x.shape), x.stride(), torch.get_num_threads())
    name = f"{type(layer).__name__} {tuple(w.shape)} float32, groups of {g} {PIECES}"
    return _decide(key, lambda: _linear_agrees(layer, x, lambda l, x_: l.groups_in_pieces(x_, g)),
                   (name, tuple(x.shape[:2])))


def _has_bias(layer):
    """A layer of a kind this module does not know (tp.ShardedHead) may have no bias at all."""
    return getattr(layer, "bias", None) is not None


def decisions():
    """What was decided so far, for reports: [(what, (B, T) rows, whether one call serves every
    row)]."""
    return list(_DECIDED.values())


def _decide(key, test, what):
    """what: (the operation, (B, T))."""
    if key not in _DECIDED:
        _DECIDED[key] = (*what, bool(test()))
    return _DECIDED[key][2]


def _agree(fn, xs, together=None):
    """fn on all rows at once (or together, another way of computing them) equals fn on each row
    alone, a fresh copy of it."""
    B = xs[0].shape[0]
    alone = torch.cat([fn(*(x[i:i + 1].clone() for x in xs)) for i in range(B)])
    return torch.equal((together or fn)(*xs), alone)


def _magnitudes(shape, g, lo, hi):
    """Random signs times 2^[lo, hi] times 1 + k/128: exact in bf16, fp16 and fp32. Drawn from a
    table of those values, one gather (a probe of the output matrix, 14M values, in 0.17 s here
    against 0.71 computing each: the first token of a run waits for its probes)."""
    span = hi - lo + 1
    i = torch.arange(2 * span * 128)                                 # every value, once
    table = (i % 2 * 2 - 1) * 2.0 ** (i // 2 % span + lo) * (1 + i // (2 * span) / 128)
    return table[torch.randint(0, len(table), shape, generator=g)]


def _paired(v, pairs, K):
    """Inputs [..., K]: zeros but for v [..., K/2] at both features of each pair (pairs [2, K/2]),
    which the probe layer weighs with opposite signs: every output is the rounding alone."""
    x = torch.zeros(*v.shape[:-1], K)
    x[..., pairs[0]] = v
    x[..., pairs[1]] = v
    return x


def _like(t, values):
    """values in t's dtype, shape, strides, device and data alignment (mod 64 bytes): a kernel
    choice that depends on any of them is the one t gets."""
    size = t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    buf = torch.zeros(extent + 64 // size, dtype=t.dtype, device=t.device)
    shift = (t.data_ptr() - buf.data_ptr()) % 64 // size
    out = buf[shift:].as_strided(t.shape, t.stride())
    out.copy_(values)
    return out


def _rows_agree(fn, xs):
    g = torch.Generator().manual_seed(0)
    for _ in range(ROW_TRIALS):
        probes = [_like(x, _magnitudes(x.shape, g, -8, 8)) for x in xs]
        if not _agree(fn, probes):
            return False
    return True


def _probe_layer(layer, g):
    """(a copy of layer, its weight replaced by one of the same kind, shape and layout that pairs
    input features with opposite signs; the pairs [2, K/2]), or None for a kind of layer this
    module does not know."""
    if not hasattr(layer, "out_features"):  # not a linear this module knows (tp.ShardedHead)
        return None
    N, K = layer.out_features, layer.in_features
    if isinstance(layer, nn.Linear):
        N, K = layer.weight.shape  # a weight replaced in place (tensor parallel) has its own
    pairs = torch.randperm(K - K % 2, generator=g).view(2, -1)      # [2, K/2]
    probe = copy.copy(layer)  # its own parameters and buffers, the rest shared
    probe._parameters = dict(layer._parameters)
    probe._buffers = dict(layer._buffers)
    if hasattr(layer, "scales_and_zeros"):  # quantize.Int4Linear: w = (q - 8) * scale + zero
        sign = torch.randint(0, 2, (N, K // 2), generator=g) * 2 - 1
        c = torch.randint(1, 8, (N, K // 2), generator=g) * sign
        q = torch.full((N, K), 8, dtype=torch.uint8)
        q[:, pairs[0]] = (8 + c).to(torch.uint8)
        q[:, pairs[1]] = (8 - c).to(torch.uint8)
        sz = torch.zeros(layer.scales_and_zeros.shape)               # [K/g, N, 2]
        sz[..., 0] = 1
        probe.load_quantized(q.to(layer.weight.device), _like(layer.scales_and_zeros, sz))
        if probe.packing != layer.packing:
            return None
    elif hasattr(layer, "scales"):  # quantize.Int8Linear: w = q * scale
        c = _magnitudes((N, K // 2), g, 0, 6).clamp(-127, 127).round()
        q = torch.zeros(N, K)
        q[:, pairs[0]] = c
        q[:, pairs[1]] = -c
        probe.weight = _like(layer.weight, q)
        probe.scales = _like(layer.scales, torch.ones(N))
    elif isinstance(layer, nn.Linear):
        c = _magnitudes((N, K // 2), g, -6, 7)
        w = torch.zeros(N, K)
        w[:, pairs[0]] = c
        w[:, pairs[1]] = -c
        probe.weight = nn.Parameter(_like(layer.weight, w), requires_grad=False)
    else:
        return None
    if layer.bias is not None:  # zero: the product's path with a bias, and nothing added
        probe.bias = nn.Parameter(_like(layer.bias, torch.zeros(N)), requires_grad=False)
    return probe, pairs


def _linear_agrees(layer, x, many=None):
    """Two zero-sum probes (module docstring) and one of the layer's own weights with inputs of
    magnitudes 2^-8 to 2^8: every row of one product (or of many(layer, x), another way of taking
    the rows) against its lone product."""
    g = torch.Generator().manual_seed(0)
    B, T, K = x.shape
    w = layer.weight
    key = (type(layer), getattr(layer, "packing", None), getattr(layer, "group_size", None),
           tuple(w.shape), w.stride(), w.dtype, w.data_ptr() % 64, _has_bias(layer))
    if key not in _PROBES:  # one per kind, shape and layout of weight, whatever the row count
        _PROBES[key] = _probe_layer(layer, g)
    if _PROBES[key] is None:  # a kind of layer we cannot probe: keep its rows apart
        return False
    probe, pairs = _PROBES[key]
    for _ in range(2):
        xp = _paired(_magnitudes((B, T, pairs.shape[1]), g, -6, 7), pairs, K)  # [B, T, K]
        if not _agree(probe, [_like(x, xp)], many and (lambda x_: many(probe, x_))):
            return False
    return _agree(layer, [_like(x, _magnitudes(x.shape, g, -8, 8))],
                  many and (lambda x_: many(layer, x_)))


def shared_rows(fn, q, k, v, rows, blocks=None, lone=None):
    """Whether fn(q, k, v) (attention.attend_chunks) for q [B, G, N*rows (+ padding), D], N blocks
    of `rows` query rows (a verify step's positions) and perhaps zero rows after them, over chunks
    k, v [n, B, G, C, D], gives every block the bits of its own call, lone(q_block, chunk)
    (default fn), over one chunk at a time; decided once per shapes, layouts, dtype, device,
    thread count and lone call, on probes: scores that cancel exactly (query features in equal
    pairs, key features in opposite pairs, so a score is only the rounding its order of sums
    leaves), then inputs of magnitudes 2^-8 to 2^8. blocks: N (default: as many as q holds)."""
    N = blocks or q.shape[2] // rows
    lone = lone or fn
    key = ("rows of attention", rows, N, getattr(lone, "__qualname__", repr(lone)),
           torch.get_num_threads(), fewrows.KERNEL,
           *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 64) for t in (q, k, v)])
    what = (f"attention {tuple(k.shape[1:])} {str(q.dtype).removeprefix('torch.')}", (N, 1))
    return _decide(key, lambda: _rows_attend_alone(fn, q, k, v, rows, N, lone), what)


def _rows_attend_alone(fn, q, k, v, rows, N, lone):
    g = torch.Generator().manual_seed(0)
    D = q.shape[-1]
    for trial in range(4):
        if trial % 2 == 0:
            pairs = torch.randperm(D - D % 2, generator=g).view(2, -1)      # [2, D/2]
            qv = _magnitudes((*q.shape[:-1], pairs.shape[1]), g, -3, 3)
            kv = _magnitudes((*k.shape[:-1], pairs.shape[1]), g, -3, 3)
            qp = torch.zeros(q.shape)
            kp = torch.zeros(k.shape)
            qp[..., pairs[0]], qp[..., pairs[1]] = qv, qv
            kp[..., pairs[0]], kp[..., pairs[1]] = kv, -kv
        else:
            qp = _magnitudes(q.shape, g, -8, 8) / 2 ** 8
            kp = _magnitudes(k.shape, g, -8, 8) / 2 ** 8
        qp[..., N * rows:, :] = 0               # the call's padding rows, as the caller's
        qp, kp = _like(q, qp), _like(k, kp)
        vp = _like(v, _magnitudes(v.shape, g, -8, 8))
        o, lse = fn(qp, kp, vp)                  # [n, B, G, N*rows (+ pad), D], [n, B, G, ...]
        for i in range(N):
            q_i = qp[:, :, i * rows:(i + 1) * rows].clone()
            for j in range(k.shape[0]):
                o_j, lse_j = lone(q_i, kp[j:j + 1].clone(), vp[j:j + 1].clone())
                block = slice(i * rows, (i + 1) * rows)
                if not (torch.equal(o_j[0], o[j, :, :, block])
                        and torch.equal(lse_j[0], lse[j, :, :, block])):
                    return False
    return True
