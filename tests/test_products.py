"""
The products a decode step makes (rowwise.Linear, rowwise.Joint) and the merge of stacked partials
(attention.Partials): each checked against an independent reference (float64 arithmetic), and the
bit-for-bit promises they carry (the same bits whatever the thread count, however a stack of
partials arrives).
"""
import os

import pytest
import torch
import torch.nn.functional as F

import fewrows
import rowwise
from attention import Partials, attend_chunk
from rowwise import SPLIT_COLUMNS, Joint, Linear, linear, split_blocks


def test_blocks_are_a_function_of_the_rows_only():
    assert split_blocks(1536) == 16 and split_blocks(576) == 8 and split_blocks(192) == 2
    assert split_blocks(64) == 1 and split_blocks(100) == 1 and split_blocks(49152) == 16
    for n in (128, 960, 3072, 4096, 14336):
        b = split_blocks(n)
        assert n % b == 0 and n // b >= 64 and b <= 16


def test_one_row_product_is_the_product_and_the_same_at_any_thread_count():
    g = torch.Generator().manual_seed(0)
    lin = Linear(576, 1536, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 576, generator=g))
        lin.bias.copy_(torch.randn(1536, generator=g))
    x = torch.randn(1, 1, 576, generator=g)
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()            # [1, 1, 1536]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (1, 1, 1536)
    assert torch.allclose(one.double(), ref, atol=1e-3, rtol=1e-5)
    assert torch.equal(one, two)
    # up to SPLIT_COLUMNS rows: the blocked product, one column a row, row-major as F.linear's
    xs = torch.randn(SPLIT_COLUMNS, 1, 576, generator=g)
    ys = lin(xs)
    refs = xs.double() @ lin.weight.double().t() + lin.bias.double()
    assert ys.is_contiguous() and ys.shape == (SPLIT_COLUMNS, 1, 1536)
    assert torch.allclose(ys.double(), refs, atol=1e-3, rtol=1e-5)
    # more rows, and bf16, take the library's product itself (on Intel's CPUs up to BLOCKED_ROWS
    # fp32 rows go in blocks of the weight's rows: rows_in_blocks)
    xs = torch.randn(SPLIT_COLUMNS + 1, 1, 576, generator=g)
    whole = F.linear(xs, lin.weight, lin.bias)
    assert torch.equal(lin(xs), lin.rows_in_blocks(xs) if rowwise.blocked_rows(lin, xs) else whole)
    lin16 = Linear(576, 1536, bias=False).to(torch.bfloat16)
    assert torch.equal(lin16(x.bfloat16()), F.linear(x.bfloat16(), lin16.weight))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_rows_in_blocks_is_the_product(bias):
    """Linear.rows_in_blocks (a few fp32 rows on Intel's CPUs) against float64 arithmetic, for 3 to
    BLOCKED_ROWS rows and one or several positions a row: row-major [..., N] as F.linear's."""
    g = torch.Generator().manual_seed(6)
    lin = Linear(576, 1536, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 576, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(1536, generator=g))
    for shape in ((3, 1, 576), (8, 1, 576), (rowwise.BLOCKED_ROWS, 1, 576), (2, 3, 576)):
        x = torch.randn(shape, generator=g)
        ref = x.double() @ lin.weight.double().t()
        if bias:
            ref = ref + lin.bias.double()
        y = lin.rows_in_blocks(x)
        assert y.shape == (*shape[:-1], 1536) and y.is_contiguous()
        assert torch.allclose(y.double(), ref, atol=1e-3, rtol=1e-5), shape


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_groups_in_pieces_is_the_product(bias):
    """Linear.groups_in_pieces (a batch's fp32 groups of rows, the weight read a piece at a time
    for every group) against float64 arithmetic: equal groups, a smaller last group, several
    positions a row; row-major [B, T, N] as F.linear's, whatever the pieces at 1 and 2 threads."""
    g = torch.Generator().manual_seed(7)
    lin = Linear(576, 2048, bias=bias)  # 4.5 MiB: blocks of 128 rows, 16 of them
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2048, 576, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(2048, generator=g))
    threads = torch.get_num_threads()
    try:
        for n_threads, pieces in ((1, (16, 2)), (2, (16, 4))):
            torch.set_num_threads(n_threads)
            assert rowwise.pieces(lin) == pieces
            for shape, group in (((16, 1, 576), 8), ((13, 1, 576), 5), ((6, 2, 576), 4)):
                x = torch.randn(shape, generator=g)
                ref = x.double() @ lin.weight.double().t()
                if bias:
                    ref = ref + lin.bias.double()
                with torch.no_grad():
                    y = lin.groups_in_pieces(x, group)
                assert y.shape == (*shape[:-1], 2048) and y.is_contiguous()
                assert torch.allclose(y.double(), ref, atol=1e-3, rtol=1e-5), (shape, n_threads)
    finally:
        torch.set_num_threads(threads)
    # a weight of fewer than two pieces of two blocks has none: its groups go one after another
    assert rowwise.pieces(Linear(576, 256, bias=False)) is None


def test_joint_is_one_product_and_falls_back_when_a_weight_moves():
    g = torch.Generator().manual_seed(1)
    layers = [Linear(64, n, bias=True) for n in (128, 32, 32)]
    with torch.no_grad():
        for lin in layers:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
    x = torch.randn(1, 1, 64, generator=g)
    refs = [x.double() @ lin.weight.double().t() + lin.bias.double() for lin in layers]
    joint = Joint.of(layers)
    assert joint is not None
    # the layers' weights are views of the joint buffer, with the values they had
    assert layers[1].weight.data_ptr() == joint.layer.weight.data_ptr() + 128 * 64 * 4
    outs = joint(x)
    assert [o.shape[-1] for o in outs] == [128, 32, 32]
    whole = linear(joint.layer, x)
    for o, ref, part in zip(outs, refs, whole.split([128, 32, 32], -1)):
        assert torch.equal(o, part)
        assert torch.allclose(o.double(), ref, atol=1e-4, rtol=1e-5)
    # a weight replaced (tensor parallel shards in place): each layer is its own product again
    layers[0].weight = torch.nn.Parameter(layers[0].weight[:64].clone(), requires_grad=False)
    layers[0].bias = torch.nn.Parameter(layers[0].bias[:64].clone(), requires_grad=False)
    outs = joint(x)
    assert outs[0].shape[-1] == 64
    assert torch.equal(outs[0], linear(layers[0], x))
    # kinds that cannot be joined
    assert Joint.of([Linear(64, 32), Linear(32, 32)]) is None
    assert Joint.of([Linear(64, 32), Linear(64, 32, bias=False)]) is None


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_projections_join_and_keep_each_output_its_own_bits(kind):
    """Int8Linear and Int4Linear layers join (quantize.py: their weights and scales side by
    side): each output of the joint product has the bits of its own layer's product, for one row
    and for several, and the weights stay held once."""
    from quantize import Int4Linear, Int8Linear
    g = torch.Generator().manual_seed(3)
    layers = []
    for n in (128, 64, 64):  # whole blocks of the int4 kernel's packing (32 or 64 rows)
        if kind == "int8":
            lin = Int8Linear(256, n)
        else:
            lin = Int4Linear(256, n, group_size=64)
        lin.load_weight(torch.randn(n, 256, generator=g))
        layers.append(lin)
    xs = [torch.randn(rows, 1, 256, generator=g).bfloat16() for rows in (1, 3)]
    alone = [[lin(x) for lin in layers] for x in xs]
    weights = [lin.weight.clone() for lin in layers]
    joint = Joint.of(layers)
    assert joint is not None and type(joint.layer) is type(layers[0])
    assert layers[1].weight.data_ptr() == joint.layer.weight[128:].data_ptr()
    assert all(torch.equal(lin.weight, w) for lin, w in zip(layers, weights))
    for x, outs in zip(xs, alone):
        for o, ref in zip(joint(x), outs):
            assert torch.equal(o, ref)
    # int4 rows that do not fill the packing's blocks do not stack: no joint, nothing changed
    if kind == "int4":
        odd = [Int4Linear(256, n, group_size=64) for n in (48, 16)]
        for lin in odd:
            lin.load_weight(torch.randn(lin.out_features, 256, generator=g))
        if odd[0].packing == "cpu":
            ptr = odd[1].weight.data_ptr()
            assert Joint.of(odd) is None and odd[1].weight.data_ptr() == ptr


def test_partials_give_the_same_bits_however_the_stack_arrives_and_are_attention():
    g = torch.Generator().manual_seed(2)
    G, R, D, C, n = 2, 3, 16, 32, 7
    q = torch.randn(1, G, R, D, generator=g) / D ** 0.5
    k = torch.randn(n, 1, G, C, D, generator=g)
    v = torch.randn(n, 1, G, C, D, generator=g)
    parts = [attend_chunk(q, k[j], v[j]) for j in range(n)]              # one call each
    o = torch.stack([p[0] for p in parts])                              # [n, 1, G, R, D]
    lse = torch.stack([p[1] for p in parts])                            # [n, 1, G, R]
    for group in (1, 3, n, 100):
        outs = []
        for cuts in ([n], [1] * n, [2, 4, 1], [5, 2]):
            p = Partials(group)
            start = 0
            for m in cuts:
                p.add(o[start:start + m].clone(), lse[start:start + m].clone())
                start += m
            outs.append(p.output())
        assert all(torch.equal(outs[0], x) for x in outs[1:]), group
        # attention over all n * C keys, in float64
        kk = k.double().permute(1, 2, 0, 3, 4).reshape(1, G, n * C, D)
        vv = v.double().permute(1, 2, 0, 3, 4).reshape(1, G, n * C, D)
        ref = torch.softmax(q.double() @ kk.transpose(-1, -2), -1) @ vv   # [1, G, R, D]
        assert torch.allclose(outs[0].double(), ref, atol=1e-5), group


@pytest.mark.parametrize("blocked", [True, False])
def test_fp32_one_row_path_either_way_is_thread_invariant_and_a_batch_keeps_its_bits(monkeypatch,
                                                                                     blocked):
    """Both of Linear's fp32 one-row paths (blocked_fp32: the blocked product on AMD's CPUs, the
    library's own on Intel's), forced here whatever this machine is: the same bits at 1 and 2
    threads, close to a float64 reference, and rowwise.linear gives each of 5 rows its lone bits."""
    monkeypatch.setattr(rowwise, "_BLOCKED", blocked)
    monkeypatch.setattr(rowwise, "_DECIDED", {})  # decisions made under the other path
    monkeypatch.setattr(rowwise, "_LONE", {})
    g = torch.Generator().manual_seed(2)
    lin = Linear(1536, 576, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(576, 1536, generator=g))
    xs = torch.randn(5, 1, 1536, generator=g)
    # not Intel's: blocked; Intel's: blocked only where the one-row product's probes fail
    assert rowwise.blocked_fp32(lin, xs[:1]) is (blocked or not rowwise._one_row_threads_agree(lin))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [lin(xs[i:i + 1].clone()) for i in range(5)]
        torch.set_num_threads(2)
        two = [lin(xs[i:i + 1].clone()) for i in range(5)]
        both = linear(lin, xs)                                     # [5, 1, 576]
    finally:
        torch.set_num_threads(threads)
    ref = xs.double() @ lin.weight.double().t()
    for i in range(5):
        assert torch.equal(one[i], two[i])
        assert torch.equal(both[i:i + 1], two[i])
        assert torch.allclose(one[i].double(), ref[i:i + 1], atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("native", [False, True])
def test_a_prefill_product_in_half_precision_is_widened_only_where_the_cpu_lacks_the_kernel(
        monkeypatch, native):
    """rowwise.wide, forced either way whatever this machine is: on a CPU without oneDNN's
    half-precision kernel a product of WIDE_ROWS rows or more (a prefill chunk's) is the fp32
    product of the widened operands rounded once, within a rounding of a float64 reference, for
    Linear, Int8Linear and Int4Linear; fewer rows (a decode step's) keep the half-precision
    kernel; and rowwise.linear still gives each of WIDE_ROWS + 8 rows its lone bits (its probes
    see the row count that crosses over)."""
    import quantize
    monkeypatch.setattr(fewrows, "_NATIVE", {torch.bfloat16: native, torch.float16: native})
    monkeypatch.setattr(rowwise, "_DECIDED", {})
    g = torch.Generator().manual_seed(4)
    lin = Linear(256, 384, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(384, 256, generator=g))
        lin.bias.copy_(torch.randn(384, generator=g))
    lin.requires_grad_(False)
    q8 = quantize.Int8Linear(256, 384)
    q8.load_weight(torch.randn(384, 256, generator=g))
    q4 = quantize.Int4Linear(256, 384, group_size=64)
    q4.load_weight(torch.randn(384, 256, generator=g))
    many = torch.randn(1, rowwise.WIDE_ROWS, 256, generator=g).bfloat16()  # [1, T, K]: prefill
    few = many[:, :rowwise.WIDE_ROWS - 1].clone()
    unpack = quantize.unpack_cpu_kernel if q4.packing == "cpu" else quantize.unpack_int4
    q = unpack(q4.weight)                                                # [N, K] 0..15
    weights = {lin: (lin.weight.double(), lin.bias.double()),
               q8: (quantize.dequantize(q8.weight, q8.scales, torch.float64), 0),
               q4: (quantize.dequantize_int4(q, q4.scales_and_zeros).double(), 0)}
    for layer, (w, b) in weights.items():
        y = layer(many)
        assert y.dtype == torch.bfloat16 and y.shape == (1, rowwise.WIDE_ROWS, 384)
        ref = many.double() @ w.t() + b                                  # [1, T, N] float64
        if not native and layer is q8:  # widened: the int8 weight and its scales in fp32
            wide = F.linear(many.float(), q8.weight.float()) * q8.scales.float()
            assert torch.equal(y, wide.bfloat16())
        if native or layer is not lin:
            continue  # the half-precision kernel (or the scales' bf16 product): no single rounding
        # one rounding to bf16 (half a unit in the last place: at most 2^-8 of the value) of an
        # fp32 sum of K products (at most K * 2^-24 of the sum of their magnitudes)
        acc = (many.double().abs() @ w.abs().t() + b.abs()) * 256 * 2 ** -24
        bound = (ref.abs() + acc) * 2 ** -8 + acc
        assert bool(((y.double() - ref).abs() <= bound).all())
        assert torch.equal(y, F.linear(many.float(), lin.weight.float(), lin.bias.float())
                           .bfloat16())
    for layer in weights:
        ref = many.double() @ weights[layer][0].t() + weights[layer][1]
        rel = (layer(many).double() - ref).norm() / ref.norm()
        assert rel < 2 ** -7, (type(layer).__name__, float(rel))
    # a decode step's rows keep the half-precision kernel
    assert torch.equal(lin(few), F.linear(few, lin.weight, lin.bias))
    # rows of different tasks, more than WIDE_ROWS: each its lone bits
    rows = torch.randn(rowwise.WIDE_ROWS + 8, 1, 256, generator=g).bfloat16()
    for layer in weights:
        both = linear(layer, rows)
        for i in range(rows.shape[0]):
            assert torch.equal(both[i:i + 1], layer(rows[i:i + 1].clone()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_compiled_few_row_products_are_the_product_and_give_each_row_its_lone_bits(
        dtype, bias, monkeypatch):
    """--products compiled: fewrows.few_rows_product is the product (a float64 reference), eager
    and compiled; compiled, every row of up to PRODUCT_ROWS gets the bits of its own call whatever
    the rows beside it (a batch's tasks, a verify step's positions), so rowwise.linear takes a
    batch as one product; a prefill chunk's rows, fp32 and --products library keep torch's."""
    monkeypatch.setattr(fewrows, "PRODUCTS", "compiled")
    g = torch.Generator().manual_seed(5)
    lin = Linear(576, 1536, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 576, generator=g) / 8)
        if bias:
            lin.bias.copy_(torch.randn(1536, generator=g))
    lin = lin.to(dtype)
    rows = fewrows.PRODUCT_ROWS
    x = (torch.randn(rows, 1, 576, generator=g) * torch.rand(rows, 1, 1, generator=g) * 4).to(dtype)
    ref = x.double() @ lin.weight.double().t()                                 # [rows, 1, 1536]
    if bias:
        ref = ref + lin.bias.double()
    scale = ref.abs().max().item()
    eager = fewrows.few_rows_product(x.view(rows, 576), lin.weight, lin.bias)  # [rows, 1536]
    assert torch.allclose(eager.double(), ref.view(rows, 1536), rtol=1e-2, atol=1e-2 * scale)
    if fewrows.product_kernel(x, lin.weight, lin.bias) is None:
        pytest.skip("inductor cannot build the product here: torch's product runs")
    calls = []
    call = fewrows.call_product
    monkeypatch.setattr(fewrows, "call_product", lambda *a: calls.append(1) or call(*a))
    y = lin(x)                                                                 # [rows, 1, 1536]
    assert calls and y.dtype == dtype
    assert torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2 * scale)
    for i in range(rows):
        assert torch.equal(lin(x[i:i + 1].clone()), y[i:i + 1]), i
    for M in range(1, rows + 1):                                  # every row count, every offset
        assert torch.equal(lin(x[:M].clone()), y[:M]), M
        assert torch.equal(lin(x[rows - M:].clone()), y[rows - M:]), M
    assert torch.equal(lin(x.view(1, rows, 576)).view(rows, 1, 1536), y)  # positions as rows
    assert rowwise.one_product(lin, x) and torch.equal(linear(lin, x), y)
    # torch's product where the compiled one does not apply
    prefill = torch.randn(1, rows + 1, 576, generator=g).to(dtype)
    assert fewrows.product_kernel(prefill, lin.weight) is None
    assert fewrows.product_kernel(x.float(), lin.weight.float()) is None
    assert fewrows.product_kernel(x, lin.weight.t().contiguous().t()) is None  # not dense
    monkeypatch.setattr(fewrows, "PRODUCTS", "library")
    assert fewrows.product_kernel(x, lin.weight, lin.bias) is None


def test_compiled_kernels_go_to_a_private_cache_not_torchs_shared_default(monkeypatch, tmp_path):
    """Torch writes its default, $TMPDIR/torchinductor_$USER (a name another user can make first),
    into $TORCHINDUCTOR_CACHE_DIR as soon as anything asks for the cache: that value is replaced by
    ~/.cache/kvoffload/inductor, mode 700; a directory the user names is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # as torch sets it
    fewrows.private_kernel_cache()
    private = tmp_path / ".cache" / "kvoffload" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(private)
    assert private.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    fewrows.private_kernel_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_threads_that_ask_at_once_share_one_build(monkeypatch):
    """A batch's tasks make their caches at once, each in its own thread: the first builds, the
    others wait for its build and take it (two inductor builds at once failed, and the kernel a
    run used changed midway)."""
    import threading
    import time
    built = []

    def build(*args):
        built.append(threading.get_ident())
        time.sleep(0.2)  # long enough for every thread to ask meanwhile
        return object()
    monkeypatch.setattr(fewrows, "KERNEL", "compiled")
    monkeypatch.setattr(fewrows, "PRODUCTS", "compiled")
    monkeypatch.setattr(fewrows, "_FEW", {})
    monkeypatch.setattr(fewrows, "_PRODUCT", {})
    monkeypatch.setattr(fewrows, "build_few_rows", build)
    monkeypatch.setattr(fewrows, "build_product", build)
    q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 2, 16, 8)
    x, w = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    got = []
    threads = [threading.Thread(target=lambda: got.append((fewrows.few_rows_kernel(q, k),
                                                           fewrows.product_kernel(x, w))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 2 and len(set(got)) == 1, (built, got)
