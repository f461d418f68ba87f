"""
--kv-dtype bf16 and fp16 under fp32 weights: the layout rounds K and V as a cast does and reads
them back exactly widened; a chunk is half of fp32's bytes; every --offload mode stays
bit-identical to --offload none with the same --kv-dtype (a sliding window's edge chunk too);
verify.py proves it; the logits stay within half precision's rounding of fp32 KV's.
"""
import json

import pytest
import torch

from attention import attend_chunk, attend_chunks, widened
from fewrows import few_rows_kernel
from kvlayout import HalfLayout, PlainLayout, chunk_layout, kv_bytes_per_token
from model import ModelArgs, Transformer
from test_kv_int8 import run
from test_offload import MODES, assert_identical, assert_tiers_used, prompt

HALVES = [("bf16", torch.bfloat16), ("fp16", torch.float16)]


@pytest.fixture(scope="module")
def llama(checkpoint):
    return Transformer.from_pretrained(checkpoint())


@pytest.mark.parametrize("kv,half", HALVES)
def test_layout_rounds_as_a_cast_and_reads_back_exactly(kv, half):
    layout = chunk_layout(kv, torch.float32)
    assert isinstance(layout, HalfLayout) and layout.dtype == half
    chunk = torch.zeros(layout.shape(1, 2, 8, 4), dtype=layout.dtype)
    k = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(1)) * 100
    layout.write(chunk, 5, k, v)
    k2, v2 = layout.read(chunk, 8)                                  # [1, 2, 8, 4] fp32
    assert k2.dtype == v2.dtype == torch.float32
    assert torch.equal(k2[:, :, 5:], k.to(half).float())
    assert torch.equal(v2[:, :, 5:], v.to(half).float())
    assert not torch.equal(k2[:, :, 5:], k)                         # it did round
    # a sealed group is read as views of the half-precision bytes (attention widens them)
    group = torch.stack([chunk, chunk])                             # [2, 2, 1, 2, 8, 4]
    kg, vg = layout.read_group(group)
    assert kg.dtype == half and kg.data_ptr() == group.data_ptr()


def test_half_kv_under_half_weights_is_the_plain_layout():
    assert type(chunk_layout("bf16", torch.bfloat16)) is PlainLayout
    assert type(chunk_layout("fp16", torch.float16)) is PlainLayout


def test_a_half_chunk_is_half_of_fp32s_bytes():
    model_args = ModelArgs(n_layers=30, n_kv_heads=3, head_dim=64)  # SmolLM2-135M's KV
    fp32 = kv_bytes_per_token(model_args, torch.float32)
    assert fp32 == 30 * 2 * 3 * 64 * 4
    for kv, _ in HALVES:
        assert kv_bytes_per_token(model_args, torch.float32, kv) * 2 == fp32


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_attention_widens_half_precision_exactly(half):
    """A group's half-precision K and V under fp32 queries (--kv-dtype under fp32 weights) reach
    the kernel widened to fp32 without a rounding: the partials are the fp32 kernel's on fp32
    copies made by .float() (bits), for groups of several lengths through the one reused scratch,
    and for the masked edge chunk; fp16 K and V under bf16 queries, neither holding the other, are
    computed in fp32 all three."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 16, generator=g) / 4                  # [B, G, R*T, D]
    other = torch.float16 if half == torch.bfloat16 else torch.bfloat16
    for n in (3, 1, 2):                                           # the scratch grows, then is cut
        k = torch.randn(n, 1, 2, 8, 16, generator=g).to(half)       # [n, B, G, C, D]
        v = torch.randn(n, 1, 2, 8, 16, generator=g).to(half)
        for q_in in (q, q.to(other)):
            o, lse = attend_chunks(q_in, k, v)
            o_ref, lse_ref = attend_chunks(q_in.float(), k.float(), v.float())
            assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
        # a bf16 model's own K and V: torch's fused kernel takes them as they are (not widened);
        # the compiled kernel computes in fp32 whatever the dtypes, so its bits are fp32's
        o, _ = attend_chunks(q.to(half), k, v)
        o_wide = attend_chunks(q.to(half).float(), k.float(), v.float())[0]
        assert torch.equal(o, o_wide) == (few_rows_kernel(q.to(half), k) is not None)
    assert torch.equal(widened(k, 0), k.float())
    visible = torch.rand(3, 8, generator=g) > 0.3                  # [R*T, L]
    o, lse = attend_chunk(q, k[0], v[0], visible)
    o_ref, lse_ref = attend_chunk(q, k[0].float(), v[0].float(), visible)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


# chunk size, prompt length (never a multiple of the chunk size), new tokens, window
SHAPES = [(7, 45, 8, 1), (16, 90, 10, 0)]


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
@pytest.mark.parametrize("chunk,n_prompt,new,window", SHAPES)
def test_every_mode_bit_identical_to_none(llama, tmp_path, kv, chunk, n_prompt, new, window):
    ids = prompt(n_prompt, llama.args.vocab_size, seed=chunk)
    base = run(llama, ids, new, chunk, kv_dtype=kv)
    plain = run(llama, ids, new, chunk, kv_dtype="auto")
    last, last_plain = base[1][-1][1], plain[1][-1][1]
    assert not torch.equal(last, last_plain), f"{kv} KV must change the logits: is it in effect?"
    # within half precision's rounding of K and V: a relative 2^-8 (bf16) of the logits' scale
    assert (last - last_plain).abs().max() < 0.05 * last_plain.abs().max()
    for mode, compress in MODES:
        label = f"{kv} {mode}+{compress} chunk {chunk}"
        other = run(llama, ids, new, chunk, mode, compress, window, tmp_path, kv_dtype=kv)
        assert_identical(base, other, label)
        assert_tiers_used(mode + ("+zstd" if compress == "zstd" else ""), other[2], label)
        assert other[2]["kv_dtype"] == kv


def test_sliding_window_edge_chunk_bit_identical(checkpoint, tmp_path):
    """Mistral's window cuts a sealed chunk: attended alone with a mask, from half precision."""
    model = Transformer.from_pretrained(checkpoint(arch="mistral", sliding_window=21))
    ids = prompt(70, model.args.vocab_size, seed=2)
    base = run(model, ids, 8, 8, kv_dtype="bf16")
    for mode, compress in MODES[:2]:
        other = run(model, ids, 8, 8, mode, compress, 1, tmp_path, kv_dtype="bf16")
        assert_identical(base, other, f"mistral bf16 KV {mode}")


def test_verify_passes_with_fp16_kv(text_ckpt, tmp_path, capsys):
    from runs import proofs
    rc = proofs.main(["--ckpt", text_ckpt, "--dtype", "fp32", "--kv-dtype", "fp16",
                      "--max-new-tokens", "8", "--chunk-size", "16", "--window", "1",
                      "--max-prompt-tokens", "150", "--offload-dir", str(tmp_path), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["ok"] and r["kv_dtype"] == "fp16", r
    assert all(m["bit_identical"] for m in r["modes"].values())
