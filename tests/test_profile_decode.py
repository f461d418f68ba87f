"""tools/profile_decode.py: the parts of a decode step it clocks, and the bytes it says each part
reads, against the sizes of a small preset worked out here by hand."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import profile_decode  # noqa: E402
from measure.random_model import PRESETS  # noqa: E402


def test_every_part_is_clocked_and_its_bytes_are_the_weights_and_kv_it_reads(capsys):
    profile_decode.main(["--random-model", "kv16k", "--context", "100", "--chunk-size", "16",
                         "--steps", "4", "--threads", "1", "--ops", "3"])
    out = capsys.readouterr().out
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^\| ([^|]+?) \| ([\d.-]+) \| [\d-]+% \| ([\d.]+) \|", out, re.M)}
    expected = {"attend", "q, k, v", "o", "gate, up", "down", "output", "norms", "rope, reshapes",
                "silu, product", "residual adds", "head norm"}
    assert expected <= set(rows), out
    assert all(ms >= 0 for ms, _ in rows.values()), out
    t = PRESETS["kv16k"]
    E, F, H, G, D, L, V = (t[k] for k in ("dim", "hidden", "heads", "kv_heads", "head_dim",
                                          "layers", "vocab"))
    fp32 = 4
    mib = 2**20
    assert rows["q, k, v"][1] == round(L * E * (H + 2 * G) * D * fp32 / mib, 1)
    assert rows["gate, up"][1] == round(L * 2 * E * F * fp32 / mib, 1)
    assert rows["output"][1] == round(V * E * fp32 / mib, 1)
    context = int(re.search(r"decode at (\d+) tokens", out).group(1))
    assert context == 100 + 4 + 2  # the prompt, the warm-up steps, half the timed ones
    # K and V of every position, every layer
    assert rows["attend"][1] == round(context * 2 * G * D * fp32 * L / mib, 1)
    assert "aten::" in out  # torch.profiler's table
    # the timed step split into the kernels' self time (profiled) and the rest
    m = re.search(r"the step's ([\d.]+) ms: the library's products ([\d.]+) ms \(\d+%\), "
                  r"attention's fused kernel ([\d.]+) ms \(\d+%\) \(their self time under "
                  r"torch.profiler\), everything else ([\d.]+ ms|not measurable)", out)
    assert m, out
    step, products, attention = (float(g) for g in m.groups()[:3])
    assert step == float(re.search(r"step ([\d.]+) ms \(median", out).group(1)), out
    # the kernels were found by their names (the rest is not measurable where a busy machine
    # slowed the profiled steps, which are not the timed ones)
    assert products > 0 and attention > 0, out


def test_half_precision_kv_halves_what_attention_reads(capsys):
    """--kv-dtype fp16 holds K and V in 2 bytes: the attend row's bytes are half fp32 KV's."""
    read = {}
    for kv in ("auto", "fp16"):
        profile_decode.main(["--random-model", "kv16k", "--context", "100", "--chunk-size", "16",
                             "--steps", "4", "--threads", "1", "--ops", "1", "--kv-dtype", kv])
        out = capsys.readouterr().out
        read[kv] = float(re.search(r"^\| attend \| [\d.-]+ \| [\d-]+% \| ([\d.]+) \|", out,
                                   re.M).group(1))
    t = PRESETS["kv16k"]
    context = 100 + 4 + 2
    assert read["auto"] == round(context * 2 * t["kv_heads"] * t["head_dim"] * 4 * t["layers"]
                                 / 2**20, 1)
    assert read["fp16"] == round(context * 2 * t["kv_heads"] * t["head_dim"] * 2 * t["layers"]
                                 / 2**20, 1)


def test_a_filled_cache_is_the_same_in_every_call(tmp_path):
    """measure.probe.filled_cache writes the same synthetic K and V every time (a seeded
    generator, whatever torch's global one did before), so two trees or two paths can be
    compared bit for bit on it."""
    import torch

    from measure.probe import filled_cache
    from measure.random_model import build_random_checkpoint, parse_model_spec
    from model import Transformer

    build_random_checkpoint(parse_model_spec("tiny"), tmp_path, torch.float32, "cpu")
    model = Transformer.from_pretrained(tmp_path)
    written = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        cache = filled_cache(model, 40, 16, 4)        # two sealed chunks, 8 open positions
        assert cache.n_sealed == 2 and cache.length == 40
        sealed = torch.empty(cache.store.shape, dtype=cache.store.dtype)
        cache.store.read_back(1, 1, sealed)           # layer 1's second chunk
        written.append((sealed, cache.store.open_chunk(0)[..., :8, :].clone()))
    for a, b in zip(*written):
        assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.mark.parametrize("flags, says", [
    (["--context", "0"], "--context 0: give at least 1"),
    (["--steps", "0"], "--steps 0: give at least 1"),
    (["--chunk-size", "-1"], "--chunk-size -1: give at least 1"),
    (["--threads", "0"], "--threads 0: give at least 1"),
    (["--random-model", "bogus"], "--random-model: cannot read 'bogus'"),
    (["--ckpt", "/nonexistent"], "--ckpt /nonexistent: not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        profile_decode.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err


def test_a_context_past_the_models_is_refused_before_any_work(checkpoint, capsys):
    ckpt = checkpoint(max_position_embeddings=256)
    with pytest.raises(SystemExit) as e:
        profile_decode.main(["--ckpt", ckpt, "--context", "250", "--steps", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "262 positions, past the model's context of 256; give a --context of at most 244" in err


def test_the_split_names_each_kernel_once_and_owns_up_to_a_slower_profiled_step():
    """kernels_and_the_rest: products and attention's kernel from their self times a profiled step
    (PROFILED_STEPS of them), other operators in neither; where they sum past the timed step (the
    profiled steps ran slower) the rest is not made up."""
    class Average:
        def __init__(self, key, us):
            self.key = key
            self.self_cpu_time_total = us * profile_decode.PROFILED_STEPS
    averages = [Average("aten::mm", 300), Average("aten::_weight_int8pack_mm", 200),
                Average("aten::_scaled_dot_product_flash_attention_for_cpu", 250),
                Average("aten::cat", 900)]
    line = profile_decode.kernels_and_the_rest(averages, 0.0015)
    assert "products 0.50 ms (33%), attention's fused kernel 0.25 ms (17%)" in line, line
    assert "everything else 0.75 ms (50%)" in line, line
    line = profile_decode.kernels_and_the_rest(averages, 0.0006)
    assert "everything else not measurable here" in line, line
