"""
Chunks attended a group at a time (issue 33): a run of chunks in one kernel call gives each chunk
the partial a call of its own gives, bit for bit, whatever the run's stride in memory (so cutting a
group into runs changes the count of calls, never a bit); the groups are a function of positions
only; the store presents a group as one view where its chunks sit at one stride (the arena of
--offload none, the host pool, the disk file) and the same bytes otherwise; the attention a step
computes equals softmax attention written out from scratch.
"""
import importlib
import math

import pytest
import torch

import fewrows
import rowwise
from attention import QUERY_ROWS, Partials, attend_chunks, attend_few, padded_rows
from kvcache import chunk_groups
from kvlayout import Int8Layout, PlainLayout
from offload import OffloadConfig, TieredStore
from pools import alloc_chunks, chunk_runs, group_view

G, R, D, C = 3, 3, 64, 32


def chunks_at_stride(n, dtype, gap, seed=0):
    """n chunks [2, 1, G, C, D] carved from one buffer, `gap` empty slots between neighbours."""
    g = torch.Generator().manual_seed(seed)
    flat, slots = alloc_chunks(n * (gap + 1), (2, 1, G, C, D), dtype, "cpu")
    chunks = slots[::gap + 1]
    for c in chunks:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return flat, chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# a decode step, a speculative step's rows, a prefill chunk
@pytest.mark.parametrize("T", [1, 4, C])
@pytest.mark.parametrize("gap", [0, 2])   # side by side (the arena), or at a stride (the host pool)
def test_a_run_gives_each_chunk_the_bits_of_its_own_call(dtype, T, gap):
    n = 5
    flat, chunks = chunks_at_stride(n, dtype, gap)
    run = group_view(chunks, flat)                                   # [n, 2, 1, G, C, D], a view
    assert run is not None and run.data_ptr() == chunks[0].data_ptr()
    q = torch.randn(1, G, R * T, D, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.1
    k, v = PlainLayout(dtype).read_group(run)
    o_n, lse_n = attend_chunks(q, k, v)                             # the stack of n partials
    assert o_n.shape[0] == lse_n.shape[0] == n
    for o, lse, c in zip(o_n, lse_n, chunks):
        o_own, lse_own = attend_chunks(q, c[0][None], c[1][None])    # one chunk, one call
        o_own, lse_own = o_own[0], lse_own[0]
        assert torch.equal(o, o_own) and torch.equal(lse, lse_own)
        # and both are attention: the matmul path, written out
        s = (q.float() @ c[0].float().transpose(-1, -2))             # [1, G, R*T, C]
        ref = torch.softmax(s, -1) @ c[1].float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(o, ref, atol=tol, rtol=tol)
        assert torch.allclose(lse, torch.logsumexp(s, -1), atol=tol, rtol=tol)


def test_int8_group_read_equals_chunk_by_chunk():
    layout = Int8Layout(torch.float32)
    flat, slots = alloc_chunks(3, layout.shape(1, G, C, D), layout.dtype, "cpu")
    g = torch.Generator().manual_seed(4)
    for s in slots:
        k, v = (torch.randn(1, G, C, D, generator=g) for _ in range(2))
        layout.write(s, 0, k, v)
    k, v = layout.read_group(group_view(slots, flat))
    for i, s in enumerate(slots):
        k_i, v_i = layout.read(s, C)
        assert torch.equal(k[i], k_i) and torch.equal(v[i], v_i)


def test_groups_are_runs_inside_aligned_blocks():
    assert chunk_groups(list(range(0, 11)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    # a selection's gaps cut runs; the window's edge chunk stands alone
    assert chunk_groups([0, 1, 3, 4, 5, 9], 4) == [[0, 1], [3], [4, 5], [9]]
    assert chunk_groups([2, 3, 4, 5], 16, alone={2}) == [[2], [3, 4, 5]]
    assert chunk_groups([], 16) == []


def test_runs_split_where_the_stride_breaks():
    flat, chunks = chunks_at_stride(6, torch.float32, 0)
    other = torch.zeros_like(chunks[0])
    order = [chunks[0], chunks[1], other, chunks[3], chunks[4], chunks[5]]
    bases = [flat, flat, None, flat, flat, flat]
    runs = chunk_runs(order, bases)
    assert [r.shape[0] for r in runs] == [2, 1, 3]
    assert runs[0].data_ptr() == chunks[0].data_ptr() and runs[2].data_ptr() == chunks[3].data_ptr()
    assert torch.equal(torch.cat(runs), torch.stack(order))
    assert group_view([chunks[1], chunks[0]], flat) is None  # not in order: no view


def fill(store, layer, n, seed=5):
    """Seal n chunks of random K and V into store; returns them."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for j in range(n):
        for l in range(store.n_layers):
            kv = store.open_chunk(l)
            kv.copy_(torch.randn(kv.shape, generator=g))
            if l == layer:
                made.append(kv.clone())
        store.seal(j)
    return made


@pytest.mark.parametrize("mode", ["none", "cpu", "disk"])
def test_the_store_presents_a_group_as_views_of_the_same_bytes(mode, tmp_path):
    cfg = OffloadConfig(mode=mode, window=2, offload_dir=str(tmp_path))
    store = TieredStore(shape=(2, 1, G, C, D), dtype=torch.float32, n_layers=2, max_length=10 * C,
                        device="cpu", cfg=cfg)
    try:
        made = fill(store, 1, 9)
        js = list(range(9))
        store.prefetch([(1, j) for j in js])
        runs = list(store.load_group(1, js))
        assert torch.equal(torch.cat(runs), torch.stack(made))
        if mode == "none":  # the arena: one view, no copy
            assert len(runs) == 1 and runs[0].data_ptr() == store.resident[(1, 0)].data_ptr()
        else:  # offloaded chunks in place in a run or two, the window's two chunks apart
            assert len(runs) <= 4
            assert store.chunks.group is None  # nothing copied on CPU
    finally:
        store.close()


def test_a_decode_step_over_groups_is_attention(tmp_path):
    """A cache's attend over 40 sealed chunks (three groups of GROUP_CHUNKS) equals softmax
    attention over every position written out."""
    from kvcache import KVCache
    cfg = OffloadConfig(mode="none")
    store = TieredStore(shape=(2, 1, G, C, D), dtype=torch.float32, n_layers=1,
                        max_length=41 * C, device="cpu", cfg=cfg)
    cache = KVCache(store, PlainLayout(torch.float32))
    g = torch.Generator().manual_seed(6)
    keys, values = [], []
    try:
        for _ in range(40):
            cache.begin(C)
            k, v = (torch.randn(1, G, C, D, generator=g) for _ in range(2))
            cache.attend(0, torch.randn(1, G * R, C, D, generator=g), k, v)
            keys.append(k)
            values.append(v)
            if cache.commit():
                store.seal(cache.n_sealed - 1)
        cache.begin(1, decode=True)
        q, k, v = torch.randn(1, G * R, 1, D, generator=g), *(torch.randn(1, G, 1, D, generator=g)
                                                               for _ in range(2))
        out = cache.attend(0, q, k, v)
        K = torch.cat(keys + [k], 2).repeat_interleave(R, 1)           # [1, H, 40*C + 1, D]
        V = torch.cat(values + [v], 2).repeat_interleave(R, 1)
        ref = torch.softmax(q @ K.transpose(-1, -2) / math.sqrt(D), -1) @ V
        assert torch.allclose(out, ref, atol=1e-5)
    finally:
        store.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp16"])
def test_the_open_chunk_through_the_compiled_kernel_is_attention_over_its_written_keys(
        kv_dtype, monkeypatch, tmp_path):
    """--attention compiled: a decode step reads the open chunk's first off+1 positions as a
    chunk of that length through the compiled kernel (KVCache.attend_open); what lies past them
    (NaN here: a rejected guess's bytes, or a fresh buffer's) never enters, and the partial is
    the attention of those keys (float64 reference), at every offset of the chunk."""
    from kvcache import KVCache
    from kvlayout import chunk_layout
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    layout = chunk_layout(kv_dtype, torch.float32)
    if fewrows.few_rows_kernel(torch.zeros(1, G, R, D), torch.zeros(2, 1, G, C, D,
                                                                     dtype=layout.attend_dtype)
                               ) is None:
        pytest.skip("inductor cannot build the kernel here")
    store = TieredStore(shape=layout.shape(1, G, C, D), dtype=layout.dtype, n_layers=1,
                        max_length=2 * C, device="cpu", cfg=OffloadConfig(mode="none"))
    cache = KVCache(store, layout)
    g = torch.Generator().manual_seed(7)
    try:
        kv = store.open_chunk(0)
        kv.fill_(float("nan"))
        keys, values = [], []
        for off in range(C):
            cache.begin(1, decode=True)
            q, k, v = (torch.randn(1, n, 1, D, generator=g) for n in (G * R, G, G))
            out = cache.attend(0, q, k, v)                              # [1, H, 1, D]
            keys.append(k.to(layout.dtype).double())  # as held: rounded where half precision
            values.append(v.to(layout.dtype).double())
            K = torch.cat(keys, 2).repeat_interleave(R, 1)               # [1, H, off+1, D]
            V = torch.cat(values, 2).repeat_interleave(R, 1)
            ref = torch.softmax(q.double() @ K.transpose(-1, -2) / math.sqrt(D), -1) @ V
            assert torch.allclose(out.double(), ref, atol=1e-5), off
            cache.commit()
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 2, 3, 5])
def test_few_rows_padded_give_the_unpadded_attention(dtype, R):
    """attend_few pads a step's few query rows with zeros for the kernel (padded_rows) and cuts
    the partials back: the same attention (to rounding) as the rows alone, from a float64
    reference; views of the padded call that merge to the bits of contiguous copies."""
    g = torch.Generator().manual_seed(R)
    q = torch.randn(1, G, R, D, generator=g).to(dtype) / math.sqrt(D)
    k, v = (torch.randn(2, 1, G, C, D, generator=g).to(dtype) for _ in range(2))
    o, lse = attend_few(q, k, v)                                    # [2, 1, G, R, D], [2, 1, G, R]
    assert o.shape == (2, 1, G, R, D) and lse.shape == (2, 1, G, R)
    for group in (1, 2, 3):  # merged as a decode step's one group, and as a prefill's groups
        merged = []
        for dense in (False, True):
            parts = Partials(group)
            for _ in range(2):  # a merge works in place: each stack a call of its own
                stack = attend_few(q, k, v)
                parts.add(*(t.contiguous() if dense else t for t in stack))
            merged.append(parts.output())
        assert torch.equal(merged[0], merged[1])
    s = torch.einsum("bgrd,nbgcd->nbgrc", q.double(), k.double())   # [2, 1, G, R, C]
    ref_o = torch.einsum("nbgrc,nbgcd->nbgrd", s.softmax(-1), v.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(o.double(), ref_o, atol=tol)
    assert torch.allclose(lse.double(), s.logsumexp(-1), atol=tol)
    if fewrows.few_rows_kernel(q, k) is not None:  # the compiled kernel: rows as they are
        assert padded_rows(q, k) == R
    else:
        assert padded_rows(q, k) == (R if R >= 4 or (dtype == torch.float32 and R < 3) else 4)


def reordering_attention(q, k, v):
    """attend_chunks, except that rows past the first 4 of a call get their scores summed in two
    halves of D: a kernel whose many-row path sums in another order."""
    o, lse = attend_chunks(q, k, v)
    if q.shape[2] <= 4:
        return o, lse
    h = q.shape[-1] // 2
    s = (torch.einsum("bgrd,nbgcd->nbgrc", q[..., :h].float(), k[..., :h].float())
         + torch.einsum("bgrd,nbgcd->nbgrc", q[..., h:].float(), k[..., h:].float()))
    o2 = torch.einsum("nbgrc,nbgcd->nbgrd", s.softmax(-1), v.float())
    o = o.clone()
    o[..., 4:, :] = o2[..., 4:, :]
    return o, lse


def test_a_call_of_many_rows_that_reorders_is_not_shared():
    """rowwise.shared_rows (a verify step's rows in one call) says no to a kernel whose rows past
    the first block sum in another order, and yes to the real kernel where it gives every block
    its own call's bits (then the blocks are checked here, on other inputs)."""
    g = torch.Generator().manual_seed(7)
    k, v = (torch.randn(3, 1, G, C, D, generator=g) for _ in range(2))
    q = torch.randn(1, G, 3 * QUERY_ROWS, D, generator=g)           # 3 positions, padded rows
    assert not rowwise.shared_rows(reordering_attention, q, k, v, QUERY_ROWS)
    if rowwise.shared_rows(attend_chunks, q, k, v, QUERY_ROWS):
        o, lse = attend_chunks(q, k, v)
        for i in range(3):
            block = slice(i * QUERY_ROWS, (i + 1) * QUERY_ROWS)
            o_i, lse_i = attend_chunks(q[:, :, block].clone(), k, v)
            assert torch.equal(o_i, o[:, :, :, block]) and torch.equal(lse_i, lse[:, :, :, block])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_steps_unpadded_rows_get_their_padded_steps_bits(dtype):
    """A verify step's positions go into one call unpadded, R rows each, side by side
    (speculate.attend_together): shared_rows with lone=attend_few says yes only where each
    position's R rows get the bits its own step's padded call gives, and no for a kernel whose
    later rows sum in another order; where it says yes the blocks are checked on other inputs."""
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(3, 1, G, C, D, generator=g).to(dtype) for _ in range(2))
    N = 5
    q = torch.randn(1, G, N * R, D, generator=g).to(dtype) / math.sqrt(D)  # 5 positions, R rows
    assert not rowwise.shared_rows(reordering_attention, q, k, v, R, N, attend_few)
    if rowwise.shared_rows(attend_chunks, q, k, v, R, N, attend_few):
        o, lse = attend_chunks(q, k, v)
        for i in range(N):
            block = slice(i * R, (i + 1) * R)
            o_i, lse_i = attend_few(q[:, :, block].clone(), k, v)     # its own step: padded
            assert torch.equal(o_i, o[:, :, :, block]) and torch.equal(lse_i, lse[:, :, :, block])


def test_a_query_of_another_last_stride_gets_the_same_attention():
    """torch's CPU flash kernel reads a last dim of stride 2 wrongly (fewrows.flash_cpu): a
    strided q or k gives the bits of its contiguous copy."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, G, R, D, generator=g)
    k, v = (torch.randn(3, 1, G, C, D, generator=g) for _ in range(2))
    q2 = torch.empty(1, G, R, 2 * D)[..., ::2]                      # last stride 2
    q2.copy_(q)
    k2 = torch.empty(3, 1, G, C, 2 * D)[..., ::2]
    k2.copy_(k)
    o, lse = attend_chunks(q, k, v)
    for a, b in ((q2, k), (q, k2)):
        o2, lse2 = attend_chunks(a, b, v)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
    o1, lse1 = attend_chunks(q2, k2[:1], v[:1])
    assert torch.equal(o1[0], o[0]) and torch.equal(lse1[0], lse[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_few_rows_kernel_is_attention_and_gives_each_row_and_chunk_its_own_bits(dtype,
                                                                                  monkeypatch):
    """A decode step's chunk visits on CPU (fewrows.few_rows, compiled where inductor
    builds it): its eager arithmetic is attention (a float64 reference); compiled, it agrees with
    that arithmetic to rounding, and every (chunk, row) gets the bits of its own call whatever the
    rows and chunks beside it (a batch's, a verify step's), the count of chunks in a run and their
    stride (a tier's run), so no padding is needed and a run cut anywhere gives the same bits."""
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    g = torch.Generator().manual_seed(11)
    n, RT = 4, 7
    q = (torch.randn(1, G, RT, D, generator=g) / math.sqrt(D)).to(dtype)  # [B, G, R*T, D]
    flat, chunks = chunks_at_stride(n, dtype, gap=1, seed=12)
    run = group_view(chunks, flat)                                   # [n, 2, 1, G, C, D], strided
    k, v = run[:, 0], run[:, 1]                                      # [n, 1, G, C, D]
    o, lse = fewrows.few_rows(q[0], k[:, 0], v[:, 0])              # eager: [n, G, RT, D]
    s = torch.einsum("grd,ngcd->ngrc", q[0].double(), k[:, 0].double())
    ref = torch.einsum("ngrc,ngcd->ngrd", s.softmax(-1), v[:, 0].double())
    assert torch.allclose(o.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), s.logsumexp(-1), atol=1e-5)
    if fewrows.few_rows_kernel(q, k) is None:
        pytest.skip("inductor cannot build the kernel here: torch's fused kernel runs")
    o_c, lse_c = attend_chunks(q, k, v)                              # [n, 1, G, RT, D]
    assert torch.allclose(o_c[:, 0], o, atol=1e-5) and torch.allclose(lse_c[:, 0], lse, atol=1e-5)
    assert padded_rows(q, k) == RT
    for j in range(n):
        for rows in (slice(0, RT), slice(2, 3), slice(3, 6)):       # every row, one, a block
            o_j, lse_j = attend_chunks(q[:, :, rows].clone(), k[j:j + 1].clone(),
                                       v[j:j + 1].clone())
            assert torch.equal(o_j[0], o_c[j, :, :, rows]), (j, rows)
            assert torch.equal(lse_j[0], lse_c[j, :, :, rows]), (j, rows)
    wide = attend_chunks(torch.cat([q, q.flip(2)] * 3, dim=2), k, v)[0]  # 42 rows of one call
    assert torch.equal(wide[:, :, :, :RT], o_c)


def one_sum(q, k, v):
    """few_rows as it was before its V sum was cut into strips: one sum over [C, D]."""
    s = (q.float()[None, :, :, None, :] * k.float()[:, :, None]).sum(-1)  # [n, M, RT, C]
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p[..., None] * v.float()[:, :, None]).sum(-2)                    # [n, M, RT, D]
    return o / l, (m + torch.log(l)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_strips_of_vs_sum_change_no_bit(dtype):
    """fewrows.few_rows sums V a strip of 16 features at a time so that inductor fuses the strips
    into one loop with independent accumulators (docs/performance.md, round twenty); each output
    is still the same additions in the same order, so compiled alike (the same flags) the strips
    and the one sum give the same bits, for whole chunks, several rows and the open chunk's first
    positions. A strip that summed in another order (a split over positions, say) fails this."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3, 2, G, C + 5, D, generator=g).to(dtype)[:, :, :, :C]
    example = [torch.randn(G, 5, D, generator=g) / 8, base[:, 0], base[:, 1]]
    try:
        strips = fewrows.compile_traced(fewrows.few_rows, example)
        whole = fewrows.compile_traced(one_sum, example)
    except Exception as e:  # no C++ compiler: the fused kernel runs, nothing to compare
        pytest.skip(f"inductor cannot build here: {fewrows.reason(e)}")
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    isa = pick_vec_isa()
    if dtype == torch.float32 and isa.nelements() < 16:  # seen on an AVX2 CPU (AMD Zen 3)
        pytest.skip(f"with {isa} vectors of {isa.nelements()} inductor vectorizes the strips "
                    "and the one fp32 sum apart; each row's and chunk's own bits under the "
                    "strips are proven by test_the_few_rows_kernel_is_attention_and_gives_each_"
                    "row_and_chunk_its_own_bits")
    for n, rows, length in ((1, 3, C), (4, 9, C), (2, 3, 13)):
        held = torch.randn(n, 2, G, C, D, generator=g).to(dtype)
        k, v = held[:, 0, :, :length], held[:, 1, :, :length]        # [n, G, length, D]
        q = torch.randn(G, rows, D, generator=g) / 8
        o, lse = strips(q, k, v)
        o_ref, lse_ref = whole(q, k, v)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), (n, rows, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_open_chunks_first_positions_are_read_in_place_with_a_copys_bits(dtype, monkeypatch):
    """The open chunk's first L positions are a view of its C (a stride between heads of C*D, not
    L*D): the compiled kernel takes them as they are, no copy (the copy cost a decode step more
    than the kernel did, docs/performance.md round eighteen), and gives the bits that a dense copy
    of the same positions gets, so a tier that copies a chunk and one that does not agree. A view
    whose positions are not dense is still copied, never computed wrongly."""
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(1, G, R, D, generator=g) / math.sqrt(D)).to(dtype)  # [B, G, R, D]
    kv = torch.randn(1, 2, 1, G, C, D, generator=g).to(dtype)         # the open chunk, as held
    seen = []

    def spy(q_in, k_in, v_in):
        seen.append((q_in.dtype, k_in.data_ptr(), v_in.data_ptr()))
        return fewrows.few_rows(q_in, k_in, v_in)
    for L in (1, C // 2 + 3, C):
        k, v = kv[:, 0, :, :, :L], kv[:, 1, :, :, :L]                  # [1, B, G, L, D] views
        fewrows.call_few(spy, q.reshape(G, R, D), k.flatten(1, 2), v.flatten(1, 2))
        assert seen[-1] == (torch.float32, k.data_ptr(), v.data_ptr()), L  # in place, q in fp32
    wide = torch.randn(1, 1, G, C, 2 * D, generator=g).to(dtype)
    for odd in (wide[..., :D], wide[..., ::2]):                        # positions not dense
        fewrows.call_few(spy, q.reshape(G, R, D), odd.flatten(1, 2), odd.flatten(1, 2))
        assert seen[-1][1] != odd.data_ptr()
    if fewrows.few_rows_kernel(q, kv[:, 0]) is None:
        pytest.skip("inductor cannot build the kernel here: torch's fused kernel runs")
    for L in (1, 7, C // 2 + 3, C - 1):
        k, v = kv[:, 0, :, :, :L], kv[:, 1, :, :, :L]
        o, lse = attend_chunks(q, k, v)                                # [1, 1, G, R, D] in place
        o_c, lse_c = attend_chunks(q, k.contiguous(), v.contiguous())  # a dense copy's
        assert torch.equal(o, o_c) and torch.equal(lse, lse_c), L
        o_e, lse_e = fewrows.few_rows(q[0], k[:, 0], v[:, 0])          # eager arithmetic
        assert torch.allclose(o[:, 0], o_e, atol=1e-5) and torch.allclose(lse[:, 0], lse_e,
                                                                          atol=1e-5)


@pytest.mark.parametrize("native", [False, True])
def test_auto_compiles_for_fp32_and_for_half_precision_where_the_cpu_has_its_kernels(native,
                                                                                    monkeypatch):
    """--attention auto: fp32 queries take the compiled kernel on every CPU, and bf16 or fp16 ones
    only where oneDNN has that half precision's kernels (fewrows.native_half, both sides forced
    here); elsewhere the fused kernel, with nothing built. What auto takes is the very build that
    --attention compiled takes, so its bits are that kernel's; queries reach it in fp32 (call_few),
    so one build per K dtype serves queries of every dtype."""
    monkeypatch.setattr(fewrows, "_NATIVE", {torch.bfloat16: native, torch.float16: native})
    monkeypatch.setattr(fewrows, "_FEW", {})
    built = []

    def build(q, k):
        built.append((q.dtype, k.dtype))
        return ("kernel", k.dtype, len(built))
    monkeypatch.setattr(fewrows, "build_few_rows", build)
    monkeypatch.setattr(fewrows, "KERNEL", "auto")
    k = torch.zeros(2, 1, G, C, D, dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.zeros(1, G, R, D, dtype=dtype)
        got = fewrows.few_rows_kernel(q, k)
        assert fewrows.compiled_pays(dtype) == (dtype == torch.float32 or native)
        if dtype == torch.float32 or native:
            assert got == ("kernel", torch.bfloat16, 1)  # the first build, whatever q's dtype
            monkeypatch.setattr(fewrows, "KERNEL", "compiled")
            assert fewrows.few_rows_kernel(q, k) is got  # the same build, so the same bits
            monkeypatch.setattr(fewrows, "KERNEL", "auto")
        else:
            assert got is None
    assert len(built) == 1  # built once, never for the fused kernel's
    # a cache's build, made up front (kvcache.make_cache): none for the fused kernel's queries
    fewrows.prepare(torch.bfloat16, torch.float16, G, R, C, D)
    assert len(built) == (2 if native else 1)
    fewrows.prepare(torch.float32, torch.float32, G, R, C, D)
    assert len(built) == (3 if native else 2)
    # a prefill chunk's many rows stay with the fused kernel under auto too
    assert fewrows.few_rows_kernel(torch.zeros(1, G, fewrows.FEW_ROWS + 1, D), k) is None


def test_the_few_rows_kernel_is_skipped_on_request_and_where_it_cannot_be_built(monkeypatch,
                                                                                capsys):
    """--attention flash (the default) never compiles, nor does a chunk visit of many rows; a
    build that fails (no C++ compiler, an old torch) is one line on stderr and torch's fused
    kernel."""
    q = torch.zeros(1, G, R, D)
    monkeypatch.setattr(fewrows, "_FEW", {})
    assert fewrows.KERNEL == "flash" and fewrows.few_rows_kernel(q, q[None]) is None
    assert fewrows._FEW == {}  # nothing built
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    assert fewrows.few_rows_kernel(torch.zeros(1, G, fewrows.FEW_ROWS + 1, D), q) is None

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
    monkeypatch.setattr(importlib.import_module("torch._inductor.compile_fx"), "compile_fx",
                        no_compiler)
    assert fewrows.build_few_rows(q, q[None]) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no working C++ compiler" in err[0] and "--attention flash" in err[0]
