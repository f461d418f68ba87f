"""
rowwise.py: every row of a shared step gets the bits of its lone call, for every operation a batched
step shares across rows (the linears: bf16, fp32, int8, int4; the norm, SiLU times up, RoPE, the
residual adds, the embedding, the fp32 logits), every row count up to 16, one and several positions
per row, 1 and 2 threads, with weights at a trained model's scale (measure/random_model.py,
trained_scale) rather than O(1). The reference of each row is its own call alone. And the check
that decides it cannot be passed by a product that reorders its sums for some row counts only:
the bug of issue 34, which a single random probe passed.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rowwise
from generate import decode_batch, decode_one_token, prefill
from kvcache import make_cache
from measure.random_model import build_random_checkpoint, parse_model_spec, trained_scales
from model import RMSNorm, Transformer, apply_rope, swiglu
from offload import OffloadConfig
from quantize import Int4Linear, Int8Linear

KINDS = ["bf16", "fp32", "int8", "int4"]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# SmolLM2-135M's down projection (the product of issue 34, K -> N) and the demo model's output
# matrix; with 2 threads the first only (the suite's time). Every row count up to 16 at both: a
# bf16 product of up to 16 rows may take rowwise.weight_first, whose columns are other calls
SHAPES = {1: [(1536, 576), (256, 4096)], 2: [(1536, 576)]}
ROWS = {1: [(B, 1) for B in range(1, 17)] + [(2, 9), (5, 3), (16, 2)],
        2: [(B, 1) for B in range(1, 17)] + [(2, 9), (16, 2)]}


def trained_weight(N, K, g):
    """[N, K] at the demo model's down projection scale, rows spread as its rows are."""
    _, scale, spread = trained_scales()["model.layers.0.mlp.down_proj.weight"]
    rows = 1 + spread * torch.randn(N, 1, generator=g)
    return torch.randn(N, K, generator=g) * rows * scale / K ** 0.5


def activations(shape, g):
    """Rows as a trained model's: mostly O(1), a few channels 30x larger (outlier features)."""
    x = torch.randn(shape, generator=g)
    x[..., torch.randint(0, shape[-1], (4,), generator=g)] *= 30
    return x


def make_layer(kind, K, N, g):
    w = trained_weight(N, K, g)
    if kind in ("bf16", "fp32"):  # the model's linear, with its own paths for few rows
        layer = rowwise.Linear(K, N, bias=False, dtype=torch.bfloat16 if kind == "bf16" else None)
        layer.weight = nn.Parameter(w.to(layer.weight.dtype), requires_grad=False)
        return layer
    layer = Int8Linear(K, N) if kind == "int8" else Int4Linear(K, N)
    layer.load_weight(w)
    return layer


def lone_rows(fn, *xs):
    return torch.cat([fn(*(x[i:i + 1].clone() for x in xs)) for i in range(xs[0].shape[0])])


@pytest.mark.parametrize("kind", KINDS)
def test_every_linear_gives_every_row_its_lone_bits(kind, threads):
    g = torch.Generator().manual_seed(3)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    for K, N in SHAPES[threads]:
        layer = make_layer(kind, K, N, g)
        for B, T in ROWS[threads]:
            x = activations((B, T, K), g).to(dtype)
            with torch.inference_mode():
                assert torch.equal(rowwise.linear(layer, x), lone_rows(layer, x)), (K, N, B, T)


class ReorderingLinear(nn.Linear):
    """A bf16 product that sums K in two halves from 7 rows up, as a kernel with another blocking
    for more rows would: the difference shows only where it crosses a bf16 rounding boundary."""

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).float()                        # [M, K]
        w = self.weight.float()
        h = x2.shape[1] // 2
        if x2.shape[0] >= 7:
            y = [r[None, :h] @ w[:, :h].T + r[None, h:] @ w[:, h:].T for r in x2]
        else:
            y = [r[None] @ w.T for r in x2]
        return torch.cat(y).to(x.dtype).view(*x.shape[:-1], -1)        # [..., N]


def test_a_product_that_reorders_for_some_row_counts_is_caught():
    """Issue 34's bug: one random probe passes such a product (the old check, 7 of 20 normal probes
    see it); the zero-sum probes see it at once, so every row still gets its lone bits."""
    g = torch.Generator().manual_seed(0)
    layer = ReorderingLinear(1536, 576, bias=False, dtype=torch.bfloat16)
    layer.weight = nn.Parameter(trained_weight(576, 1536, g).to(torch.bfloat16),
                                requires_grad=False)
    for B in range(1, 17):
        for _ in range(4):
            x = activations((B, 1, 1536), g).to(torch.bfloat16)
            assert torch.equal(rowwise.linear(layer, x), lone_rows(layer, x)), B
    decided = {rows: ok for what, rows, ok in rowwise.decisions() if "ReorderingLinear" in what}
    assert decided[(6, 1)] and not decided[(7, 1)] and not decided[(16, 1)]


class OneRowPath:
    """torch.nn.functional with a linear whose one-row product sums K in two halves, another order
    than its path for more rows (as oneDNN's bf16 product of K >= 1536 on a CPU with AVX512-BF16);
    more rows are computed a row at a time in one order. Records each call's row count."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(F, name)

    def linear(self, x, w, b=None):
        rows = x.reshape(-1, x.shape[-1]).float()                      # [M, K]
        self.calls.append(rows.shape[0])
        h = rows.shape[1] // 2
        wf = w.float()
        if rows.shape[0] == 1:
            y = rows[:, :h] @ wf[:, :h].T + rows[:, h:] @ wf[:, h:].T
        else:
            y = torch.cat([r[None] @ wf.T for r in rows])
        return y.to(x.dtype).view(*x.shape[:-1], -1)                   # [..., N]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_one_row_path_of_its_own_is_taken_as_two_rows(monkeypatch, dtype):
    """Where the one-row product sums in another order than the product of more rows, a lone row is
    computed as the row and a zero row: a batch's rows are then one product with their lone bits,
    instead of a product a row. In fp32 this is MKL's one-row product on Intel's CPUs (on other
    CPUs the blocked product takes fp32 rows, so this test says the CPU is Intel's)."""
    fake = OneRowPath()
    monkeypatch.setattr(rowwise, "F", fake)
    monkeypatch.setattr(rowwise, "_DECIDED", {})
    monkeypatch.setattr(rowwise, "_PROBES", {})
    monkeypatch.setattr(rowwise, "_LONE", {})
    monkeypatch.setattr(rowwise, "_BLOCKED", False)
    g = torch.Generator().manual_seed(2)
    layer = rowwise.Linear(1536, 576, bias=False, dtype=dtype)
    layer.weight = nn.Parameter(trained_weight(576, 1536, g).to(dtype), requires_grad=False)
    x = activations((16, 1, 1536), g).to(dtype)
    # the reference: each row's product in the multi-row path's order, computed here
    w = layer.weight.float()
    whole = torch.stack([r.float() @ w.T for r in x]).to(dtype)  # [16, 1, 576]
    with torch.inference_mode():
        assert torch.equal(lone_rows(layer, x), whole)
        fake.calls.clear()
        layer(x[:1])
        assert fake.calls == [2]  # a lone row: the row and a zero row
        assert torch.equal(rowwise.linear(layer, x), whole)  # decided on probes, then computed
        fake.calls.clear()
        assert torch.equal(rowwise.linear(layer, x), whole)
    assert fake.calls == [16]  # one product for the 16 rows


def test_a_lone_rows_path_is_decided_once_per_weight_threads_and_layout(monkeypatch):
    """A decode step's lone row takes its layer's remembered path (Linear.one_row_path): the checks
    run again only for another weight, thread count or input layout, and the remembered path gives
    the bits the checks give."""
    fake = OneRowPath()
    monkeypatch.setattr(rowwise, "F", fake)
    for table in ("_DECIDED", "_PROBES", "_LONE"):
        monkeypatch.setattr(rowwise, table, {})
    monkeypatch.setattr(rowwise, "_BLOCKED", False)
    checks = []
    lone_row_padded = rowwise.lone_row_padded
    monkeypatch.setattr(rowwise, "lone_row_padded",
                        lambda layer, x: checks.append(1) or lone_row_padded(layer, x))
    g = torch.Generator().manual_seed(3)
    layer = rowwise.Linear(1536, 576, bias=False)
    layer.weight = nn.Parameter(trained_weight(576, 1536, g), requires_grad=False)
    x = activations((1, 1, 1536), g)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            first = layer(x)
            assert checks == [1] and fake.calls[-1] == 2  # decided: the row and a zero row
            for _ in range(3):
                assert torch.equal(layer(x), first)
            assert checks == [1] and fake.calls[-3:] == [2, 2, 2]
            other = rowwise.Linear(1536, 576, bias=False)  # the same weight, nothing remembered
            other.weight = layer.weight
            assert torch.equal(other(x), first) and checks == [1, 1]
            layer.weight = nn.Parameter(layer.weight.clone(), requires_grad=False)
            assert torch.equal(layer(x), first) and len(checks) == 3  # another weight
            torch.set_num_threads(1 if threads > 1 else 2)
            layer(x)
            assert len(checks) == 4  # another thread count
            torch.set_num_threads(threads)
            assert torch.equal(layer(x), first) and len(checks) == 5
            strided = torch.zeros(1, 1, 2 * 1536)[..., ::2]
            strided.copy_(x)
            layer(strided)
            assert len(checks) == 6  # another layout
    finally:
        torch.set_num_threads(threads)


class ReordersFromRows(OneRowPath):
    """torch.nn.functional with a linear that sums K in two halves from `rows` rows up, one order
    below: as MKL's fp32 product of 16 rows against its product of 2 to 15 on Intel's CPUs."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def linear(self, x, w, b=None):
        rows = x.reshape(-1, x.shape[-1]).float()                      # [M, K]
        self.calls.append(rows.shape[0])
        h = rows.shape[1] // 2
        wf = w.float()
        if rows.shape[0] >= self.rows:
            y = rows[:, :h] @ wf[:, :h].T + rows[:, h:] @ wf[:, h:].T
        else:
            y = torch.cat([r[None] @ wf.T for r in rows])
        return y.to(x.dtype).view(*x.shape[:-1], -1)                   # [..., N]


def test_rows_that_one_product_cannot_take_go_in_the_largest_groups_that_can(monkeypatch):
    """A product that reorders from 16 rows up: 16 rows go as two products of 8 (not 16 products of
    one, nor 6 of 3), each row with its lone bits; 13 rows as one product."""
    fake = ReordersFromRows(16)
    monkeypatch.setattr(rowwise, "F", fake)
    monkeypatch.setattr(rowwise, "_DECIDED", {})
    monkeypatch.setattr(rowwise, "_PROBES", {})
    monkeypatch.setattr(rowwise, "_LONE", {})
    monkeypatch.setattr(rowwise, "_AMX", False)  # F.linear's rows, not the weight times columns
    g = torch.Generator().manual_seed(5)
    layer = rowwise.Linear(1536, 576, bias=False, dtype=torch.bfloat16)
    layer.weight = nn.Parameter(trained_weight(576, 1536, g).to(torch.bfloat16),
                                requires_grad=False)
    w = layer.weight.float()
    for B, calls in ((16, [8, 8]), (13, [13])):
        x = activations((B, 1, 1536), g).to(torch.bfloat16)
        whole = torch.stack([r.float() @ w.T for r in x]).to(torch.bfloat16)  # [B, 1, 576]
        with torch.inference_mode():
            assert torch.equal(rowwise.linear(layer, x), whole)  # decided on probes, then computed
            fake.calls.clear()
            assert torch.equal(rowwise.linear(layer, x), whole)
        assert fake.calls == calls, B


@pytest.mark.parametrize("agrees", [True, False], ids=["pieces_agree", "pieces_reorder"])
def test_groups_read_the_weight_in_pieces_only_where_every_row_keeps_its_bits(monkeypatch, agrees):
    """A batch of 16 fp32 rows that one product cannot take goes as groups of 8, and where a
    group's rows go in blocks (Intel's CPUs) the groups read the weight a piece at a time
    (Linear.groups_in_pieces): taken where the probes see every row's lone bits, refused where
    the pieces sum K in another order (its two halves apart), and each row's bits are its lone
    product's either way."""
    fake = ReordersFromRows(16)
    monkeypatch.setattr(rowwise, "F", fake)
    for table in ("_DECIDED", "_PROBES", "_LONE"):
        monkeypatch.setattr(rowwise, table, {})
    monkeypatch.setattr(rowwise, "blocked_rows", lambda layer, x: True)  # as on Intel's CPUs
    monkeypatch.setattr(rowwise, "blocked_fp32", lambda layer, x: False)  # (elsewhere a lone row
    # takes the blocked product, whose bits are not the fake's lone order: an AMD Zen 3 failed it)
    monkeypatch.setattr(rowwise.Linear, "rows_in_blocks", lambda lin, x: fake.linear(x, lin.weight))
    pieces = []

    def groups_in_pieces(self, x, g):  # the fake product's order of a few rows, or another
        pieces.append(g)
        w = self.weight
        if agrees:
            return torch.stack([r @ w.T for r in x])                   # [B, T, N]
        h = x.shape[-1] // 2
        return x[..., :h] @ w[:, :h].T + x[..., h:] @ w[:, h:].T

    monkeypatch.setattr(rowwise.Linear, "groups_in_pieces", groups_in_pieces)
    g = torch.Generator().manual_seed(8)
    layer = rowwise.Linear(576, 2048, bias=False)
    layer.weight = nn.Parameter(trained_weight(2048, 576, g), requires_grad=False)
    x = activations((16, 1, 576), g)
    w = layer.weight
    whole = torch.stack([r @ w.T for r in x])  # [16, 1, 2048], each row the fake's lone order
    with torch.inference_mode():
        assert torch.equal(rowwise.linear(layer, x), whole)  # decided on probes, then computed
        fake.calls.clear()
        pieces.clear()
        assert torch.equal(rowwise.linear(layer, x), whole)
    assert pieces == ([8] if agrees else [])
    assert fake.calls == ([] if agrees else [8, 8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_a_lone_row_of_the_real_product_is_a_row_of_a_batch(dtype):
    """The real kernels, whatever this machine decides: every row of a batch of 2 to 16 gets the
    bits of its lone product (padded or not), for a linear whose K takes oneDNN's other one-row
    path on CPUs with AVX512-BF16 (and in fp32 MKL's, on Intel's)."""
    g = torch.Generator().manual_seed(4)
    layer = rowwise.Linear(1536, 576, bias=False, dtype=dtype)
    layer.weight = nn.Parameter(trained_weight(576, 1536, g).to(dtype), requires_grad=False)
    for B in (2, 7, 15, 16):
        x = activations((B, 1, 1536), g).to(dtype)
        with torch.inference_mode():
            assert torch.equal(rowwise.linear(layer, x), lone_rows(layer, x)), B


def test_bf16_rows_are_the_weight_times_columns_only_where_their_bits_agree(monkeypatch):
    """rowwise.weight_first: where oneDNN computes bf16 on AMX tiles, a product of up to
    WEIGHT_FIRST_ROWS rows is the weight times the rows as columns (torch.mv for one, torch.mm for
    more), taken where probes show a lone row the bits of that row among others; a torch.mv that
    sums in another order (K's two halves apart) is refused, and the rows keep F.linear. Without
    AMX it is never taken. Either way a batch's rows get their lone bits in one product. The
    column products here are stand-ins of known order (the real kernels, whatever this machine
    decides, are the batch tests' above and below)."""
    real_mv = torch.mv
    calls = []

    def agreeing_mv(w, v):  # a row among others, as a column product
        calls.append("mv")
        return F.linear(torch.stack([v, torch.zeros_like(v)]), w)[0]

    def agreeing_mm(w, xt):  # [N, K] x [K, M]: the rows' product, transposed
        calls.append("mm")
        return F.linear(xt.t(), w).t()

    def halves(w, v):       # K's two halves summed apart, rounded once
        calls.append("mv")
        h = v.shape[0] // 2
        return (real_mv(w[:, :h].float(), v[:h].float())
                + real_mv(w[:, h:].float(), v[h:].float())).to(v.dtype)

    g = torch.Generator().manual_seed(5)
    layer = rowwise.Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    layer.weight = nn.Parameter(trained_weight(1536, 576, g).to(torch.bfloat16),
                                requires_grad=False)
    x = activations((16, 1, 576), g).to(torch.bfloat16)
    for amx, mv, taken in ((True, agreeing_mv, True), (True, halves, False),
                           (False, agreeing_mv, False)):
        for table in ("_LONE", "_DECIDED", "_PROBES"):
            monkeypatch.setattr(rowwise, table, {})
        monkeypatch.setattr(rowwise, "_AMX", amx)
        monkeypatch.setattr(torch, "mv", mv)
        monkeypatch.setattr(torch, "mm", agreeing_mm)
        with torch.inference_mode():
            layer(x[:1])                                  # decided here, on probes
            calls.clear()
            lone = layer(x[:1])
            assert calls == (["mv"] if taken else []), (amx, mv.__name__)
            if taken:
                assert torch.equal(lone, mv(layer.weight, x[0, 0]).view(1, 1, -1))
            assert torch.equal(rowwise.linear(layer, x), lone_rows(layer, x)), mv.__name__
            assert rowwise.one_product(layer, x), mv.__name__  # one product for the 16 rows
            calls.clear()
            layer(x)
            assert calls == (["mm"] if taken else []), (amx, mv.__name__)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_row_wise_operations_give_every_row_its_lone_bits(dtype, threads):
    """The norm, SiLU times up (at a width that is not a multiple of the vector width too), RoPE's
    rotation, the residual add, the embedding and the fp32 cast of the logits."""
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(576, 1e-5)
    norm.weight = nn.Parameter((1 + 0.05 * torch.randn(576, generator=g)).to(dtype))
    emb = nn.Embedding(4096, 576).to(dtype)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    for B, T in ROWS[threads][1:] + [(3, 9), (16, 9)]:
        x = activations((B, T, 576), g).to(dtype)
        gate, up = (activations((B, T, 1536), g).to(dtype) for _ in range(2))
        odd_gate, odd_up = (activations((B, T, 700), g).to(dtype) for _ in range(2))
        pos = torch.randint(0, 5000, (B, 1), generator=g) + torch.arange(T)  # [B, T]
        angles = torch.cat([pos[..., None] * inv_freq] * 2, -1)               # [B, T, D]
        cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
        q = activations((B, T, 9, 64), g).to(dtype).transpose(1, 2)         # [B, H, T, D]
        ids = torch.randint(0, 4096, (B, T), generator=g)
        with torch.inference_mode():
            checks = {
                "norm": (norm, x),
                "swiglu": (lambda a, b: rowwise.rows(swiglu, "swiglu", a, b), gate, up),
                "swiglu 700": (lambda a, b: rowwise.rows(swiglu, "swiglu", a, b), odd_gate,
                               odd_up),
                "rope": (apply_rope, q, cos, sin),
                "add": (torch.add, x, x.flip(-1)),
                "embedding": (emb, ids),
                "logits": (lambda a: a.float(), x),
            }
            for name, (fn, *xs) in checks.items():
                assert torch.equal(fn(*xs), lone_rows(fn, *xs)), (name, B, T)


def test_a_row_function_that_differs_in_a_batch_is_caught():
    """A row function whose last elements go another way in a batch, on some values only (as a
    vector body and a scalar tail do): rows sees it and keeps the rows apart."""
    def split(x):
        y = F.silu(x)
        if x.shape[0] >= 5:  # rows but the last: their tail in double, as another kernel might
            y[:-1, :, -5:] = F.silu(x[:-1, :, -5:].double()).to(x.dtype)
        return y
    g = torch.Generator().manual_seed(5)
    for B in range(2, 17):
        x = activations((B, 1, 700), g)
        assert torch.equal(rowwise.rows(split, "split", x), lone_rows(split, x)), B


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    """A tied model of trained-scale weights (the demo model's statistics), shapes every kernel
    takes (int4: N a multiple of 16, K of 32); a down projection of K = 1536, whose lone row takes
    oneDNN's other path on CPUs with AVX512-BF16 (rowwise.lone_row_padded)."""
    sizes = parse_model_spec("dim=128,layers=2,heads=4,kv_heads=2,hidden=1536,vocab=512")
    return build_random_checkpoint(sizes, str(tmp_path_factory.mktemp("trained")), torch.bfloat16,
                                   trained_scale=True, tied=True, max_positions=4096)


@pytest.mark.parametrize("kind", KINDS)
def test_sixteen_tasks_decoding_together_each_get_their_lone_logits(trained_ckpt, kind):
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    quantize = {"int8": "int8", "int4": "int4-g32"}.get(kind)
    model = Transformer.from_pretrained(trained_ckpt, dtype=dtype, quantize=quantize)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (1, 3 + 5 * i), generator=g) for i in range(16)]
    caches = [make_cache(model, OffloadConfig(), 16, 200) for _ in prompts]
    lone = [make_cache(model, OffloadConfig(), 16, 200) for _ in prompts]
    logits = torch.cat([prefill(model, c, p) for c, p in zip(caches, prompts)])
    for c, p in zip(lone, prompts):
        prefill(model, c, p)
    for step in range(3):
        tokens = logits.argmax(-1, keepdim=True)                               # [16, 1]
        # tasks leave: 16, 11, 6 rows share the steps
        n = 16 - 5 * step
        logits, failed = decode_batch(model, caches[:n], tokens[:n])
        assert not failed
        for i in range(n):
            alone = decode_one_token(model, lone[i], tokens[i:i + 1])
            assert torch.equal(logits[i:i + 1], alone), (kind, step, i)
    for c in caches + lone:
        c.store.close()


def test_the_proofs_summary_says_how_each_row_count_went(monkeypatch):
    """verify.py's line per operation: "one call" where a row count's rows share a product, "not
    one call" where they went in groups or one at a time, and a batch's groups that read a piece of
    the weight at a time "taken" or "not taken", never "one call" (they are many)."""
    from runs.proofs import rowwise_summary
    decided = {1: ("Linear (3072, 576) float32", (8, 1), True),
               2: ("Linear (3072, 576) float32", (16, 1), False),
               3: (f"Linear (3072, 576) float32, groups of 8 {rowwise.PIECES}", (16, 1), True),
               4: (f"Linear (576, 576) float32, groups of 8 {rowwise.PIECES}", (16, 1), False)}
    monkeypatch.setattr(rowwise, "_DECIDED", decided)
    assert rowwise_summary() == {
        "Linear (3072, 576) float32": "one call at 8x1; not one call at 16x1",
        f"Linear (3072, 576) float32, groups of 8 {rowwise.PIECES}": "taken at 16x1",
        f"Linear (576, 576) float32, groups of 8 {rowwise.PIECES}": "not taken at 16x1"}
