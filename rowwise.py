"""
Rows of one batch that belong to different tasks (generate.decode_batch: one decode token per task)
must each get the bits they would get alone, so that no task's output depends on its neighbours.

A matmul of B rows need not give row i the bits of the 1-row product: the library may pick another
kernel, another blocking or another split of the sums for another row count. On this project's
build machine bf16 products are row-invariant (row i of a B-row product equals the 1-row product,
for B up to 32) and fp32 products are not (B = 1, 2-3 and 4+ take three different paths). Rather
than trust a list of platforms, `linear` checks each (layer shape, kind, row count, dtype, device)
once, on random rows, and uses one product for all rows only where it gave every row its lone bits.
Elsewhere it multiplies the rows one at a time, each exactly as it would be alone: the weight is
then read once per row, but from the cache for every row after the first.
"""
import torch

_ROW_INVARIANT = {}  # (kind, weight shape, dtype, device, rows) -> whether one product is safe


def linear(layer, x):
    """layer(x) for x [B, T, E] whose B rows may be different tasks: each row's result is the one
    it gets alone (B = 1: just the product)."""
    B = x.shape[0]
    if B == 1 or row_invariant(layer, x):
        return layer(x)
    return torch.cat([layer(x[i:i + 1]) for i in range(B)])  # [B, T, out], row by row


def row_invariant(layer, x):
    """Whether one product of x's row count gives every row the bits of its 1-row product, for
    this kind of layer, its weight's shape, x's dtype and device: checked once, on random rows."""
    weight = layer.weight
    key = (type(layer), tuple(weight.shape), x.dtype, x.device, x.shape[0], x.shape[1])
    if key not in _ROW_INVARIANT:
        g = torch.Generator(x.device).manual_seed(0)
        probe = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)  # [B, T, E]
        rows = torch.cat([layer(probe[i:i + 1]) for i in range(x.shape[0])])
        _ROW_INVARIANT[key] = torch.equal(layer(probe), rows)
    return _ROW_INVARIANT[key]
