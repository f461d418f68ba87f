"""
A chunk visit of a few query rows (a decode step's R rows per kv head, a verify step's few
positions) as a kernel that inductor builds on CPU (--attention compiled): torch's fused kernel is
compute-bound at a few rows (its products are matrix products of 3 rows), and here each score is a
dot product over D in registers, each row's softmax and weighted sum of V one loop over the chunk,
K and V read in whatever dtype they are held. Measured in docs/performance.md (rounds ten, twelve).

Bits: every (chunk, kv head, row) is computed by one thread in one order, whatever the chunks,
heads or rows beside it, so a run of chunks gives each chunk the bits of its own call (a tier may
cut a group into runs), a row needs no padding, and a verify step's positions share a call
(rowwise.shared_rows still decides, on probes). Which kernel runs is decided once per process and
dtypes, before the first step, never by where a chunk lives.

Built without dynamo: few_rows is traced once with symbolic sizes (make_fx) and the graph compiled
by inductor (compile_fx), a few seconds (made as the cache is made, kvcache.make_cache; its C++
cached by inductor for later runs). A call is then the generated code itself: no guards to
evaluate, no cache of builds to look up (dynamo's cost a call was 100-200 us on a slow CPU, as much
as a chunk's arithmetic). What guards would check is checked by construction instead: one build
per (K dtype, kv heads, head dim), the queries in fp32, for any count of chunks, rows, positions of
a chunk and stride between chunks and heads; the generated code asserts every other size and stride
it was built for, so a caller's mistake raises rather than computes.

The few rows of a decode step meet the weights too: with --products compiled a linear of a few
rows (few_rows_product) in half precision is built the same way, each output one dot product over
the input features in fp32 in registers, rounded once. On a Zen 4 torch's own one-row
half-precision product read the weight at half its rate (docs/performance.md, round seventeen);
on an Intel Xeon with AMX torch's reads it 1.5-3.5x faster than this build (round twenty-nine), so
the library stays the default. fp32 keeps rowwise.Linear's blocked product, as fast as a build.
"""
import math
import os
import sys
import threading
import time

import torch

# A decode step's few query rows per kv head read a group of chunks through few_rows, compiled by
# inductor (C++), on CPU: torch's fused kernel is compute-bound at a few rows.
FEW_ROWS = 48    # query rows a kv head up to which a chunk visit takes it (16 positions at R 3)
STRIP = 16       # features of V a weighted sum accumulates at once: one AVX-512 register of fp32
# --attention: "flash" (torch's fused kernels), "compiled" (few_rows on CPU) or "auto" (compiled
# where it was measured the faster of the two for this kind of CPU and dtype: compiled_pays)
KERNEL = "flash"
_FEW = {}        # (K dtype, kv heads, D) -> the compiled few_rows (fp32 queries), or None
BUILD_SECONDS = {}  # the same keys -> seconds the build and its check took (statistics)
# one build at a time in a process: a batch's tasks make their caches at once, each in its own
# thread, and inductor is not thread-safe (two builds at once failed, one fell back to torch's
# kernel, the other's build replaced it midway through their decode)
_BUILDING = threading.Lock()
_NATIVE = {torch.bfloat16: None, torch.float16: None}  # dtype -> oneDNN's kernel (native_half)
# --products: "library" (torch's products) or "compiled" (few_rows_product for a few rows of half
# precision on CPU)
PRODUCTS = "library"
PRODUCT_ROWS = 16  # rows up to which a product takes it (a batch of 16 tasks, a verify step's rows)
_PRODUCT = {}      # (dtype, with a bias) -> the compiled few_rows_product, or None


def few_rows(q, k, v):
    """The partials of n chunks for a few query rows, computed in fp32 in one pass per chunk and
    kv head: q [M, RT, D] (scaled; M = B*G), k, v [n, M, C, D] in any float dtype. Returns (o [n,
    M, RT, D], lse [n, M, RT]) fp32. Eager, this materialises every product (the tests' reference);
    compiled (few_rows_kernel), each score is a dot product over D in registers, each row's
    softmax and weighted sum of V one loop over the chunk, every (chunk, head, row) computed by one
    thread in the same order whatever the count of chunks, heads or rows beside it."""
    D = q.shape[-1]
    s = (q.float()[None, :, :, None, :] * k.float()[:, :, None]).sum(-1)  # [n, M, RT, C]
    m = s.amax(-1, keepdim=True)                                           # [n, M, RT, 1]
    p = torch.exp(s - m)                                                   # [n, M, RT, C]
    l = p.sum(-1, keepdim=True)                                            # [n, M, RT, 1]
    # the weighted sum of V a strip of STRIP features at a time, each strip its own sum over the
    # chunk: compiled, the strips become one loop over the chunk's positions with D/STRIP
    # accumulators, each position's V row read once a row; as one sum over [C, D], the loop ran
    # D/STRIP times over V (a strip a pass), each pass one chain of dependent adds. Each output's
    # additions are those of the one sum, in its order: the strips alone change no bit
    # (docs/performance.md, round twenty)
    vf = v.float()[:, :, None]                                             # [n, M, 1, C, D]
    o = torch.cat([(p[..., None] * vf[..., d:d + STRIP]).sum(-2)           # [n, M, RT, STRIP]
                   for d in range(0, D, STRIP)], dim=-1)                   # [n, M, RT, D]
    return o / l, (m + torch.log(l)).squeeze(-1)


def few_rows_kernel(q, k):
    """The compiled few_rows for a chunk visit of q [B, G, RT, D] over K of k's dtype, or None
    where torch's fused kernel takes it: with --attention flash (or auto, where compiled_pays
    says no), on CUDA, past FEW_ROWS rows (a prefill chunk: its products are large enough for the
    fused kernel), or where inductor cannot build it (no C++ compiler, an old torch). Decided once
    per (K dtype, kv heads, head dim) in a process (the queries in fp32), before the first visit,
    so a run never changes kernel midway; a function of device, shapes, dtypes and the CPU only,
    so placement-free."""
    if KERNEL == "flash" or not q.is_cpu or q.shape[2] > FEW_ROWS:
        return None
    if KERNEL == "auto" and not compiled_pays(q.dtype):
        return None
    B, G, _, D = q.shape
    key = (k.dtype, B * G, D)  # the queries reach it in fp32 whatever their dtype (call_few)
    if key not in _FEW:
        with _BUILDING:  # another thread may be building it: its build is this one's
            if key not in _FEW:
                start = time.perf_counter()
                _FEW[key] = build_few_rows(q, k)
                BUILD_SECONDS[key] = time.perf_counter() - start
    return _FEW[key]


def build_seconds(kind):
    """Seconds this process spent building the compiled kernels of `kind` ("attention" or
    "products") that did build: a failed build falls back to torch's kernel and is not counted."""
    if kind == "products":
        return sum(t for k, t in BUILD_SECONDS.items()
                   if k[0] == "product" and _PRODUCT.get(k[1:]) is not None)
    return sum(t for k, t in BUILD_SECONDS.items() if k[0] != "product" and _FEW.get(k) is not None)


def few_rows_product(x, w, b=None):
    """x [M, K] times w [N, K] (and + b [N]) for a few rows in half precision: each output one dot
    product over K in fp32, rounded once to x's dtype -> [M, N]. Eager, this materialises every
    product (the tests' reference); compiled (product_kernel), every (row, output) is computed by
    one thread in one order whatever the rows beside it, so a batch's rows and a verify step's
    positions get the bits of their lone product with no probe needed (rowwise's still runs)."""
    y = (w.float()[None, :, :] * x.float()[:, None, :]).sum(-1)           # [M, N] fp32
    return (y if b is None else y + b.float()).to(x.dtype)


def product_kernel(x, w, b=None):
    """The compiled few_rows_product for x [..., K] times w [N, K] (bias b or None), or None where
    torch's product takes it: with --products library, off CPU, in fp32, past PRODUCT_ROWS rows
    (a prefill chunk's), for a weight or input that is not dense, or where inductor cannot build
    it. Decided once per (dtype, bias) in a process: a function of shapes, dtypes and the flag,
    never of where a chunk lives."""
    if PRODUCTS != "compiled" or not w.is_cpu or w.dtype not in (torch.bfloat16, torch.float16):
        return None
    if x.dtype != w.dtype or x.numel() > PRODUCT_ROWS * w.shape[1] or not w.is_contiguous():
        return None
    key = (w.dtype, b is not None)
    other = (w.dtype, b is None)
    if key not in _PRODUCT:
        with _BUILDING:  # another thread may be building it: its build is this one's
            if key not in _PRODUCT and other in _PRODUCT and _PRODUCT[other] is None:
                _PRODUCT[key] = None  # its twin failed to build: so would it (said by the twin)
            if key not in _PRODUCT:
                start = time.perf_counter()
                _PRODUCT[key] = build_product(w.dtype, b is not None)
                BUILD_SECONDS[("product", *key)] = time.perf_counter() - start
    return _PRODUCT[key]


def call_product(fn, x, w, b=None):
    """fn (the compiled few_rows_product) on x [..., K], w [N, K] -> [..., N]."""
    K = w.shape[1]
    x2 = x.reshape(-1, K)                                                  # [M, K]
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    y = fn(x2, w) if b is None else fn(x2, w, b)                           # [M, N]
    return y.view(*x.shape[:-1], w.shape[0])


def compiled_pays(dtype):
    """Whether --attention auto takes the compiled kernel for queries of this dtype: always in fp32
    (30 layers' groups at 6K from memory, an AVX2 EPYC: 35.8 ms against the fused kernel's 43.2;
    34.6 against 74.2 with fp16 KV, which the fused kernel widens first), and in half precision
    where oneDNN has this CPU's kernels for it (AVX512-BF16: bf16 8.1 ms against 18.3). On a CPU
    without them (AVX2) torch's fused kernel reads bf16 faster than inductor's loops convert it
    (30.9 ms against 41.8-50.9; a 6K step 100-109 ms against 117-129): there half-precision
    queries (bf16 weights, and --quantize's bf16 activations) keep the fused kernel
    (docs/performance.md, round fifteen). On an Intel Xeon with AMX (family 6 model 207) the two
    are within 5% of each other in a step either way (round twenty-eight): the rule stands. A
    function of dtype and machine, read once a process."""
    return dtype == torch.float32 or native_half(dtype)


def native_half(dtype):
    """Whether oneDNN computes this half precision's products on this CPU (AVX512-BF16, AMX,
    AVX512-FP16): read once a process. Where it does not (AVX2), torch's own half-precision loops
    run instead: a prefill chunk's products are then taken in fp32 (rowwise.wide), and
    --attention auto keeps half-precision queries on the fused kernel (compiled_pays)."""
    if _NATIVE[dtype] is None:
        mkldnn = torch.ops.mkldnn
        try:
            if dtype == torch.bfloat16:
                _NATIVE[dtype] = bool(mkldnn._is_mkldnn_bf16_supported())
            else:
                _NATIVE[dtype] = bool(mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            _NATIVE[dtype] = True
    return _NATIVE[dtype]


def call_few(fn, q, k, v):
    """fn (the compiled few_rows) on q [M, RT, D], k, v [n, M, L, D]. The queries are widened to
    fp32 first (few_rows' first operation, so the same values; in the kernel each K row was widened
    again for each of them: 14% of a bf16 layer's attention at 6K, docs/performance.md round
    eighteen). K and V are taken as they are wherever a position's D values are dense: any stride
    between chunks and between heads, so the open chunk's first L positions (a view of its C) are
    read in place, as every tier's runs are; anything else is copied first (the generated code
    would refuse it)."""
    q = q.float()  # itself where already fp32
    q = q if q.is_contiguous() else q.contiguous()
    k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()
            for t in (k, v))
    return fn(q, k, v)


def prepare(dtype, k_dtype, G, R, C, D, bias=False):
    """Build the compiled kernels a decode step of one sequence will use (G kv heads of R query
    heads, chunks of C positions of head dim D, queries in `dtype`, K and V reaching attention in
    k_dtype; products of `dtype`, some with a bias), so that no build is in the first step
    (kvcache.make_cache calls this)."""
    w = torch.zeros(2, 2, dtype=dtype)
    product_kernel(w[:1], w)
    if bias:
        product_kernel(w[:1], w, w[0])
    if KERNEL == "flash":  # nothing to build
        return
    few_rows_kernel(torch.zeros(1, G, R, D, dtype=dtype), torch.zeros(2, 1, G, C, D, dtype=k_dtype))


def compile_traced(fn, example):
    """fn traced on `example` (a list of tensors) with every size symbolic, sizes that happen to
    match kept apart, and compiled by inductor; its cache (its C++ and the graphs, reused by later
    runs) in $TORCHINDUCTOR_CACHE_DIR, by default ~/.cache/kvoffload/inductor, mode 700."""
    private_kernel_cache()
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx
    with torch.inference_mode():  # as generation runs
        with fx_config.patch(use_duck_shape=False):
            gm = make_fx(fn, tracing_mode="symbolic")(*example)
        with inductor_config.patch(fused_multiply_add()):
            return compile_fx(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])


def private_kernel_cache():
    """The compiled kernels' cache in ~/.cache/kvoffload/inductor (mode 700), unless the user named
    one. Not torch's default, $TMPDIR/torchinductor_$USER: a shared directory whose name another
    user can guess and make first, then swap the .so files this process loads. Torch writes its
    default into $TORCHINDUCTOR_CACHE_DIR when anything asks for the cache (building a model
    does), so a value equal to that default is torch's, not the user's."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        torch_default = os.path.abspath(default_cache_dir())
    except ImportError:  # an older torch: it sets the variable only when it compiles
        torch_default = None
    if given is not None and os.path.abspath(given) != torch_default:
        return
    from private import make_private_dir
    path = os.path.join(os.path.expanduser("~"), ".cache", "kvoffload", "inductor")
    make_private_dir(path, "the compiled kernels' cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def fused_multiply_add():
    """The inductor setting that lets the C++ compiler fuse a multiply and the add after it into one
    instruction (FMA, rounded once): half the instructions of a dot product's loop, a chunk visit
    from cache 7-12% faster (docs/performance.md, round twenty). Each output is still computed in
    one order whatever the rows or chunks beside it, so the kernels' bits stay their own; they are
    not eager arithmetic's bits, which they never were. A torch without the setting builds
    without it."""
    import torch._inductor.config as inductor_config
    current = getattr(inductor_config.cpp, "enable_floating_point_contract_flag", None)
    if isinstance(current, str):
        return {"cpp.enable_floating_point_contract_flag": "fast"}
    if isinstance(current, bool):
        return {"cpp.enable_floating_point_contract_flag": True}
    return {}


def reason(e):
    """The one line a failed build prints: the exception's type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def build_product(dtype, bias):
    """few_rows_product compiled by inductor for `dtype` (with a bias or not), traced at [3, 5] x
    [7, 5] so that rows, outputs and input features are symbolic (one build serves every linear
    of a model and every row count), checked against its eager arithmetic on random inputs, or
    None with one line on stderr saying why."""
    g = torch.Generator().manual_seed(0)

    def inputs(M, N, K):
        x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((M, K), (N, K), (N,)))
        return [x, w, b] if bias else [x, w]

    why = None
    try:
        # traced with as many arguments as a call gives
        fn = compile_traced(lambda *args: few_rows_product(*args), inputs(3, 7, 5))
        agree = True
        with torch.inference_mode():
            for M, N, K in ((1, 1, 1), (1, 33, 576), (16, 96, 1536), (2, 9, 17)):
                args = inputs(M, N, K)
                agree &= torch.allclose(fn(*args).float(), few_rows_product(*args).float(),
                                        rtol=2e-2, atol=1e-3 * K)
        if agree:
            return fn
        why = "its output disagreed with its eager arithmetic"
    except Exception as e:  # no compiler, an old torch, an inductor bug: torch's product stays
        why = reason(e)
    print(f"products: inductor did not build the few-row product ({why[:200]}); using torch's "
          "(--products library)", file=sys.stderr)
    return None


def build_few_rows(q, k):
    """few_rows compiled by inductor for fp32 queries and k's dtype and a chunk's shape (q [B, G,
    RT, D], k [n, B, G, C, D]), checked against its eager arithmetic on random inputs, or None with
    one line on stderr saying why. Traced with the count of chunks, the rows, the positions of a
    chunk and the strides between chunks and between heads symbolic (one build serves a lone chunk
    and a run, the open chunk's first positions in place, a decode step and a verify step's rows, a
    run in a tier's buffer or in the arena), every other size as a step gives it
    (compile_traced)."""
    why = None
    try:
        B, G, RT, D = q.shape
        M, C = B * G, k.shape[-2]
        g = torch.Generator().manual_seed(0)

        def inputs(n, rows, length=C, held=C):
            """q [M, rows, D] (fp32: call_few widens it) and a run of n chunks' K and V as a store
            holds them, a chunk's K then its V, [n, 2, M, held, D], of which the first `length`
            positions are viewed as k, v [n, M, length, D] (the open chunk's: held > length)."""
            base = torch.randn(n, 2, M, held, D, generator=g).to(k.dtype)[:, :, :, :length]
            q_in = (torch.randn(M, rows, D, generator=g) / math.sqrt(D)).to(q.dtype).float()
            return q_in, base[:, 0], base[:, 1]

        # traced at sizes 2 and up where a call's may vary (a size of 1 would be built in), and
        # with a stride between heads that is not its positions' (so any is taken)
        fn = compile_traced(few_rows, inputs(3, RT + 2, C, C + 5))
        agree = True
        with torch.inference_mode():
            for n, rows, length, held in ((1, 1, 1, 1), (1, RT, C // 2 + 1, C), (2, RT, C, C),
                                          (5, FEW_ROWS, C, C), (1, RT, 3, C)):
                q_in, k_in, v_in = inputs(n, rows, length, held)
                o, lse = fn(q_in, k_in, v_in)
                o_ref, lse_ref = few_rows(q_in, k_in, v_in)
                agree &= torch.allclose(o, o_ref, atol=1e-4) and torch.allclose(lse, lse_ref,
                                                                                atol=1e-4)
        if agree:
            return fn
        why = "its output disagreed with its eager arithmetic"
    except Exception as e:  # no compiler, an old torch, an inductor bug: the fused kernel stays
        why = reason(e)
    print(f"attention: inductor did not build the decode kernel ({why[:200]}); using "
          "torch's fused kernel (--attention flash)", file=sys.stderr)
    return None
