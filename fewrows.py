"""
A chunk visit of a few query rows (a decode step's R rows per kv head, a verify step's few
positions) as a kernel that torch.compile builds on CPU (--attention compiled): torch's fused
kernel is compute-bound at a few rows (its products are matrix products of 3 rows), and here each
score is a dot product over D in registers, each row's softmax and weighted sum of V one loop
over the chunk, K and V read in whatever dtype they are held. Measured in docs/performance.md
(round ten).

Bits: every (chunk, kv head, row) is computed by one thread in one order, whatever the chunks,
heads or rows beside it, so a run of chunks gives each chunk the bits of its own call (a tier may
cut a group into runs), a row needs no padding, and a verify step's positions share a call
(rowwise.shared_rows still decides, on probes). Which kernel runs is decided once per process and
dtypes, before the first step, never by where a chunk lives.

The cost is dynamo's: a build takes seconds (made as the cache is made, kvcache.make_cache; its
C++ cached by inductor for later runs), each call pays its guards (tens of microseconds against
the fused kernel's ~15), and dynamo builds again for inputs it tells apart: a view (guarded on the
tensor it views: so inputs are detached), a count of 1 (so the count of chunks is unbacked), an
offset of 0, an inference tensor; the builds a run needs are made up front (build_few_rows).
"""
import itertools
import math
import os
import sys
import threading
import time

import torch

# A decode step's few query rows per kv head read a group of chunks through few_rows, compiled by
# torch.compile (inductor's C++), on CPU: torch's fused kernel is compute-bound at a few rows.
FEW_ROWS = 48    # query rows a kv head up to which a chunk visit takes it (16 positions at R 3)
KERNEL = "flash"  # --attention: "flash" (torch's fused kernels) or "compiled" (few_rows on CPU)
_THREAD = threading.local()  # whether this thread set dynamo's limits (ready_thread)
_FEW = {}        # (q dtype, K dtype) -> the compiled few_rows, or None where it did not build
BUILD_SECONDS = {}  # (q dtype, K dtype) -> seconds the build and its check took (statistics)


def few_rows(q, k, v):
    """The partials of n chunks for a few query rows, computed in fp32 in one pass per chunk and
    kv head: q [M, RT, D] (scaled; M = B*G), k, v [n, M, C, D] in any float dtype. Returns (o [n,
    M, RT, D], lse [n, M, RT]) fp32. Eager, this materialises every product (the tests' reference);
    compiled (few_rows_kernel), each score is a dot product over D in registers, each row's
    softmax and weighted sum of V one loop over the chunk, every (chunk, head, row) computed by one
    thread in the same order whatever the count of chunks, heads or rows beside it."""
    s = (q.float()[None, :, :, None, :] * k.float()[:, :, None]).sum(-1)  # [n, M, RT, C]
    m = s.amax(-1, keepdim=True)                                           # [n, M, RT, 1]
    p = torch.exp(s - m)                                                   # [n, M, RT, C]
    l = p.sum(-1, keepdim=True)                                            # [n, M, RT, 1]
    o = (p[..., None] * v.float()[:, :, None]).sum(-2)                    # [n, M, RT, D]
    return o / l, (m + torch.log(l)).squeeze(-1)


def few_rows_kernel(q, k):
    """The compiled few_rows for a chunk visit of q [B, G, RT, D] over K of k's dtype, or None
    where torch's fused kernel takes it: without --attention compiled, on CUDA, past FEW_ROWS rows
    (a prefill chunk: its products are large enough for the fused kernel), or where torch.compile
    cannot build it (no C++ compiler, an old torch). Decided once per (q dtype, K dtype) in a
    process, before the first visit, so a run never changes kernel midway; a function of device,
    shapes and dtypes only, so placement-free."""
    if KERNEL != "compiled" or not q.is_cpu or q.shape[2] > FEW_ROWS:
        return None
    key = (q.dtype, k.dtype)
    if key not in _FEW:
        start = time.perf_counter()
        _FEW[key] = build_few_rows(q, k)
        BUILD_SECONDS[key] = time.perf_counter() - start
    return _FEW[key]


def ready_thread():
    """Dynamo's limits, which are per thread (a batch's engine, a tensor-parallel rank): past them
    fail (fullgraph) rather than quietly run the eager arithmetic's bits."""
    if not getattr(_THREAD, "ready", False):
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 64)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
        config.fail_on_recompile_limit_hit = True
        torch.fx.experimental._config.use_duck_shape = False  # no guard on sizes that match
        _THREAD.ready = True


def call_few(fn, q, k, v):
    """fn (the compiled few_rows) on q [M, RT, D], k, v [n, M, C, D]. Detached first: dynamo
    guards a view on the sizes of the tensor it views (an arena's, a pool's: a new build for
    every max length), and a detached tensor is no view to it; a lone chunk given the stride of
    a run's (the build's), which its one index never uses."""
    ready_thread()
    if k.shape[0] == 1:  # a lone chunk's stride over chunks is arbitrary: the one of a run's
        k, v = (t.as_strided(t.shape, (2 * t[0].numel(), *t.stride()[1:]), t.storage_offset())
                for t in (k, v))
    return fn(q.detach(), k.detach(), v.detach())


def prepare(dtype, k_dtype, G, R, C, D):
    """Build the compiled kernel a decode step of one sequence will use (G kv heads of R query
    heads, chunks of C positions of head dim D, queries in `dtype`, K and V reaching attention in
    k_dtype), so that its build is not in the first step (kvcache.make_cache calls this)."""
    if KERNEL != "compiled":  # nothing to build
        return
    few_rows_kernel(torch.zeros(1, G, R, D, dtype=dtype), torch.zeros(2, 1, G, C, D, dtype=k_dtype))


def build_few_rows(q, k):
    """torch.compile(few_rows) for q's and k's dtypes, checked against its eager arithmetic on
    random inputs of their shapes (q [B, G, RT, D], k [n, B, G, C, D]), or None with one line on
    stderr saying why. Shapes are dynamic, the count of chunks unspecialised (one build serves a
    lone chunk and a run); the builds a run needs are made here, under inference mode as
    generation runs: K made in inference mode or not, at offset 0 of its storage or past it (dynamo
    builds apart for each). Inductor's cache (its C++ and the graphs, reused by later runs)
    goes to $TORCHINDUCTOR_CACHE_DIR, by default ~/.cache/kvoffload/inductor, mode 700."""
    why = None
    try:
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            from private import make_private_dir
            path = os.path.join(os.path.expanduser("~"), ".cache", "kvoffload", "inductor")
            make_private_dir(path, "the compiled kernels' cache")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        import torch._dynamo
        import torch.fx.experimental._config  # noqa: F401 (ready_thread sets it)
        fn = torch.compile(few_rows, dynamic=True, fullgraph=True)
        B, G, RT, D = q.shape
        M, C = B * G, k.shape[-2]
        g = torch.Generator().manual_seed(0)
        agree = True
        for made_in_inference, offset in itertools.product((False, True), (0, 2 * M * C * D)):
            # K and V as a store holds them (an arena made in a step, or a pool outside one), a
            # chunk's K then V, at the start of their storage or past it
            with torch.inference_mode(made_in_inference):
                base = torch.randn(offset + 4 * M * C * D, generator=g).to(k.dtype)
            k_in, v_in = base[offset:].view(2, 2, M, C, D).unbind(1)  # [n=2, M, C, D] each
            with torch.inference_mode():  # the queries as a step makes them
                q_in = torch.randn(M, RT, D, generator=g).to(q.dtype) / math.sqrt(D)
                # the count of chunks unbacked: the build takes a lone chunk too (no guard on it,
                # so a call needs no mark)
                q_in, k_in, v_in = q_in.detach(), k_in.detach(), v_in.detach()
                for t in (k_in, v_in):
                    torch._dynamo.decorators.mark_unbacked(t, 0)
                ready_thread()
                o, lse = fn(q_in, k_in, v_in)
                o_ref, lse_ref = few_rows(q_in, k_in, v_in)
            agree &= torch.allclose(o, o_ref, atol=1e-4) and torch.allclose(lse, lse_ref,
                                                                            atol=1e-4)
        if agree:
            return fn
        why = "its output disagreed with its eager arithmetic"
    except Exception as e:  # no compiler, an old torch, an inductor bug: the fused kernel stays
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    print(f"attention: torch.compile did not build the decode kernel ({why[:200]}); using "
          "torch's fused kernel (--attention flash)", file=sys.stderr)
    return None
