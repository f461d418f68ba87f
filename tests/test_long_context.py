"""
Contexts longer than plain RoPE and full attention allow, judged against transformers on tiny local
checkpoints: YaRN (5.x rope_parameters and 4.x rope_scaling), sliding-window layers (Mistral; Qwen2
by max_window_layers or by layer_types) without a cache and through the chunked, offloaded one, a
RoPE override against transformers loading the same rope_scaling block from config.json, and the
refusals of dynamic and longrope RoPE.
"""
import dataclasses
import os
import shutil

import pytest
import torch

import kvcache
from attention import first_visible_chunk
from checkpoint import CheckpointError
from ckpt import build_checkpoint, edit_config
from generate import Sampling
from kvcache import KVCache
from kvlayout import PlainLayout
from model import Transformer
from offload import OffloadConfig, TieredStore
from rope import context_refusal, rope_inv_freq, rope_override_note
from runs import task

ATOL = 1e-4  # max abs logit difference allowed against transformers, everything in fp32
# past original_max_position_embeddings (64), the sliding window (21) and the override's 128
N_PROMPT = 200
N_NEW = 12  # greedy tokens that must agree

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9,
        "mscale_all_dim": 0.5, "truncate": False}
YARN_FACTOR = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
               "original_max_position_embeddings": 64, "beta_fast": 8.0, "attention_factor": 1.3}

# name -> (build_checkpoint kwargs, config.json edits made after building)
CASES = {
    "yarn-5x": (dict(rope_parameters=YARN, max_position_embeddings=256), {}),
    "yarn-4x-type": (dict(old_style=True, rope_parameters=YARN_FACTOR,
                          max_position_embeddings=256), {}),
    "yarn-4x-rope_type": (dict(old_style="rope_type", rope_parameters=YARN,
                               max_position_embeddings=256), {}),
    # a top-level original_max_position_embeddings overrides the block's in transformers (Phi-3
    # keeps it there)
    "yarn-top-level-orig": (dict(rope_parameters=YARN, max_position_embeddings=256),
                            {"original_max_position_embeddings": 16}),
    "mistral-window": (dict(arch="mistral", sliding_window=21), {}),
    # 4.x: no layer_types, so layers >= max_window_layers slide (layer 1 here, layer 0 is full)
    "qwen2-max-window-layers": (dict(arch="qwen2", use_sliding_window=True, sliding_window=21,
                                     max_window_layers=1),
                                {"layer_types": None}),
    # 5.x: layer_types wins over max_window_layers (which alone would make no layer slide)
    "qwen2-layer-types": (dict(arch="qwen2", use_sliding_window=True, sliding_window=21,
                               max_window_layers=28,
                               layer_types=["sliding_attention", "full_attention"]), {}),
    # Qwen2.5 style: a sliding_window is filled in, but use_sliding_window is false, so no layer
    # slides
    "qwen2-window-unused": (dict(arch="qwen2", max_window_layers=1),
                            {"use_sliding_window": False, "sliding_window": 21,
                             "layer_types": None}),
}
YARN_CASES = [c for c in CASES if c.startswith("yarn")]
WINDOW_CASES = [c for c in CASES if not c.startswith("yarn") and c != "qwen2-window-unused"]
EXPECTED_WINDOWS = {"mistral-window": (21, 21),
                    "qwen2-max-window-layers": (None, 21),
                    "qwen2-layer-types": (21, None)}


def load_reference(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def prompt(n, vocab, seed=0):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """case name -> (our model, transformers model, path), built and loaded once per module."""
    loaded = {}

    def get(case):
        if case not in loaded:
            kwargs, edits = CASES[case]
            path = str(build_checkpoint(tmp_path_factory.mktemp(case), **kwargs))
            if edits:
                edit_config(path, **edits)
            loaded[case] = Transformer.from_pretrained(path), load_reference(path), path
        return loaded[case]
    return get


@pytest.fixture
def windowed_make_cache():
    """run_task builds its cache with kvcache.make_cache, which hands the cache the model's sliding
    windows."""
    assert task.make_cache is kvcache.make_cache


def run(model, ids, new, chunk, mode="none", tmp=None, compress="none"):
    """run_task with offload window 1, so that sealed chunks leave the device; returns (ids,
    [(pos, logits)], stats)."""
    steps = []

    def on_step(phase, logits, cache):
        steps.append((cache.length, logits.clone()))
    cfg = OffloadConfig(mode=mode, window=1, offload_dir=str(tmp or "/nonexistent"),
                        compress=compress)
    out, stats = task.run_task(model, ids, new, chunk_size=chunk, cfg=cfg, sampling=Sampling(),
                               on_step=on_step)
    return out, steps, stats


def max_step_diff(steps, ref_logits):
    """Largest |ours - transformers| over every step; the logits of a step at length n are those of
    position n-1."""
    return max((logits[0] - ref_logits[pos - 1]).abs().max().item() for pos, logits in steps)


def ref_greedy(ref, ids, n):
    # random weights may pick the eos id; we want all n tokens
    ref.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


# -----------------------------------------------------------------------------
# YaRN

@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_logits_match_transformers(pair, case):
    ours, ref, _ = pair(case)
    assert ours.args.rope_scaling["rope_type"] == ref.config.rope_parameters["rope_type"] == "yarn"
    assert ref.model.rotary_emb.attention_scaling == ours.attention_factor != 1.0
    orig = ref.config.rope_parameters["original_max_position_embeddings"]
    expected_orig = 16 if "top-level" in case else 64
    assert ours.args.rope_scaling["original_max_position_embeddings"] == orig == expected_orig
    assert ours.args.max_context == 256 == ours.args.max_seq_len  # max(256, 4 x orig)
    tokens = torch.tensor([prompt(N_PROMPT, ours.args.vocab_size)])
    with torch.no_grad():
        got = ours(tokens)
        want = ref(tokens).logits
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"{case}: max abs logit difference {diff:.3g} > {ATOL}"


def test_yarn_cached_matches_transformers(pair, windowed_make_cache, tmp_path):
    ours, ref, _ = pair("yarn-5x")
    ids = prompt(N_PROMPT, ours.args.vocab_size, seed=1)
    out, steps, _ = run(ours, ids, 4, 16, "disk", tmp_path)
    with torch.no_grad():
        want = ref(torch.tensor([ids + out])).logits[0]
    assert max_step_diff(steps, want) <= ATOL


def forget_attention_factor(model):
    """YaRN's cos/sin scale forgotten."""
    model.attention_factor = 1.0


def ignore_betas(model):
    """beta_fast and beta_slow ignored."""
    scaling = {**model.args.rope_scaling, "beta_fast": 32, "beta_slow": 1}
    model.inv_freq = rope_inv_freq(dataclasses.replace(model.args, rope_scaling=scaling))


@pytest.mark.parametrize("mutate", [forget_attention_factor, ignore_betas])
def test_yarn_parity_can_fail(pair, mutate):
    ours, ref, path = pair("yarn-5x")
    model = Transformer.from_pretrained(path)  # a private copy to damage
    mutate(model)
    tokens = torch.tensor([prompt(N_PROMPT, model.args.vocab_size)])
    with torch.no_grad():
        assert (model(tokens) - ref(tokens).logits).abs().max().item() > 100 * ATOL


# -----------------------------------------------------------------------------
# sliding windows

@pytest.mark.parametrize("case", WINDOW_CASES)
def test_sliding_window_logits_match_transformers(pair, case):
    ours, ref, _ = pair(case)
    assert ours.args.layer_windows == EXPECTED_WINDOWS[case]
    tokens = torch.tensor([prompt(N_PROMPT, ours.args.vocab_size)])
    with torch.no_grad():
        want = ref(tokens).logits
        diff = (ours(tokens) - want).abs().max().item()
        # the check can fail: full attention is far off
        full = dataclasses.replace(ours.args, sliding_window=None)
        blind = Transformer(full)
        blind.load_state_dict(ours.state_dict())
        blind_diff = (blind(tokens) - want).abs().max().item()
    assert diff <= ATOL, f"{case}: max abs logit difference {diff:.3g} > {ATOL}"
    assert blind_diff > 100 * ATOL, f"{case}: the window makes no difference at {N_PROMPT} tokens"


def test_qwen2_window_unused_without_use_sliding_window(pair):
    ours, ref, path = pair("qwen2-window-unused")
    assert ours.args.layer_windows == (None, None)
    tokens = torch.tensor([prompt(N_PROMPT, ours.args.vocab_size)])
    with torch.no_grad():
        assert (ours(tokens) - ref(tokens).logits).abs().max().item() <= ATOL


# 32 > the window: the open chunk needs the window mask too
@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_sliding_window_cached_and_offloaded(pair, windowed_make_cache, monkeypatch, tmp_path, case,
                                             chunk):
    """Through run_task: logits of every step within ATOL of transformers, greedy ids equal to its
    generate(), disk (raw, and zstd: its chunks go through the prefetch queue) bit-identical to
    none, and chunks wholly outside a layer's window never loaded."""
    ours, ref, _ = pair(case)
    ids = prompt(N_PROMPT, ours.args.vocab_size, seed=2)
    loads = []  # (position of the step, layer, chunk) of every load
    at = [0]    # the position the step in flight starts at
    real_begin = KVCache.begin
    real_load_group = TieredStore.load_group

    def begin(self, T, decode=False):
        at[0] = self.length
        return real_begin(self, T, decode)

    def load_group(self, layer, js):  # attention reads every sealed chunk through it
        loads.extend((at[0], layer, j) for j in js)
        return real_load_group(self, layer, js)
    monkeypatch.setattr(KVCache, "begin", begin)
    monkeypatch.setattr(TieredStore, "load_group", load_group)

    base = run(ours, ids, N_NEW, chunk)
    loads_none = list(loads)
    disk = run(ours, ids, N_NEW, chunk, "disk", tmp_path)
    zstd = run(ours, ids, N_NEW, chunk, "disk", tmp_path, "zstd")
    with torch.no_grad():
        want = ref(torch.tensor([ids + base[0]])).logits[0]
    assert max_step_diff(base[1], want) <= ATOL
    assert base[0] == ref_greedy(ref, ids, N_NEW)

    for other in (disk, zstd):
        assert other[0] == base[0] and len(other[1]) == len(base[1])
        for (pos_a, a), (pos_b, b) in zip(base[1], other[1]):
            assert pos_a == pos_b and torch.equal(a, b), (
                f"disk differs from none at position {pos_a}")

    windows = ours.args.layer_windows
    assert loads_none and loads == loads_none * 3  # the same schedule, whatever the placement
    for pos, layer, j in loads:
        assert j >= first_visible_chunk(windows[layer], pos, chunk), (
            f"layer {layer} loaded chunk {j} at position {pos}")
    last = max(pos for pos, _, _ in loads)
    # full layers still read chunk 0 at the end; sliding ones skip it
    for layer, w in enumerate(windows):
        assert ((last, layer, 0) in loads) == (w is None)
    # counted wherever they live
    assert disk[2]["bytes"]["window_skipped"] == base[2]["bytes"]["window_skipped"] > 0
    # (with chunk 32 > window 21 on every layer, nothing is read back from disk at all: only the
    # chunk kept in the device window is ever visible)
    assert disk[2]["chunks"]["disk"] > 0


def test_first_visible_chunk_against_brute_force():
    for window in (None, 1, 5, 21, 64):
        for chunk in (1, 4, 8, 32):
            for pos in range(0, 100, 3):
                seen = [k for k in range(pos + 1) if window is None or pos - k < window]
                assert first_visible_chunk(window, pos, chunk) == min(seen) // chunk


def test_cache_without_the_windows_is_refused(pair):
    ours, _, _ = pair("mistral-window")
    model_args = ours.args
    store = TieredStore(shape=(2, 1, model_args.n_kv_heads, 8, model_args.head_dim),
                        dtype=torch.float32, n_layers=model_args.n_layers, max_length=64,
                        device="cpu", cfg=OffloadConfig())
    cache = KVCache(store, PlainLayout(torch.float32))
    cache.begin(1)
    with pytest.raises(ValueError, match="make_cache"):
        ours(torch.tensor([[5]]), cache)


# -----------------------------------------------------------------------------
# RoPE override

# what config.json would carry for --rope-scaling KIND --rope-factor 2 over 128 positions
OVERRIDE_BLOCKS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("kind", list(OVERRIDE_BLOCKS))
def test_rope_override_matches_transformers_with_the_same_block(checkpoint, windowed_make_cache,
                                                                tmp_path, kind):
    base = checkpoint(max_position_embeddings=128)
    ours = Transformer.from_pretrained(base, rope_override=(kind, 2.0, None))
    same = str(shutil.copytree(base, tmp_path / "same"))
    edit_config(same, rope_parameters={**OVERRIDE_BLOCKS[kind], "rope_theta": 10000.0})
    ref = load_reference(same)
    assert Transformer.from_pretrained(base).args.max_context == 128
    assert ours.args.rope_scaling == Transformer.from_pretrained(same).args.rope_scaling
    assert ours.args.max_context == 256 and ref.config.rope_parameters["rope_type"] == kind

    ids = prompt(N_PROMPT, ours.args.vocab_size, seed=3)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        want = ref(tokens).logits
        diff = (ours(tokens) - want).abs().max().item()
        plain_diff = (Transformer.from_pretrained(base)(tokens) - want).abs().max().item()
    assert diff <= ATOL, f"{kind}: max abs logit difference {diff:.3g} > {ATOL}"
    assert plain_diff > 100 * ATOL  # the override changes the logits visibly

    out, steps, _ = run(ours, ids, 4, 16, "disk", tmp_path / "kv")
    with torch.no_grad():
        want = ref(torch.tensor([ids + out])).logits[0]
    assert max_step_diff(steps, want) <= ATOL


def test_context_refusal_and_override_note(checkpoint):
    model_args = Transformer.from_pretrained(checkpoint(max_position_embeddings=128)).args
    msg = context_refusal(N_PROMPT, model_args)
    assert "\n" not in msg and "128" in msg and str(N_PROMPT) in msg and "not guaranteed" in msg
    for flag in ("--rope-scaling {linear,yarn,llama3}", "--rope-factor", "--rope-orig-ctx"):
        assert flag in msg
    note = rope_override_note(model_args.with_rope_override("yarn", 4.0), model_args)
    assert "\n" not in note and "yarn" in note and "512" in note and "128" in note
    # past an override's 512 positions: the example stretches the 128 trained on, not the 512
    msg = context_refusal(1000, model_args.with_rope_override("yarn", 4.0))
    assert "--rope-factor 8 --rope-orig-ctx 128" in msg, msg


@pytest.mark.parametrize("kind, factor, orig, flag", [
    ("ntk", 2.0, None, "--rope-scaling"),
    ("yarn", 1.0, None, "--rope-factor"),
    ("yarn", 2.0, 0, "--rope-orig-ctx"),
])
def test_bad_override_is_refused(checkpoint, kind, factor, orig, flag):
    with pytest.raises(ValueError, match=flag):
        Transformer.from_pretrained(checkpoint(max_position_embeddings=128),
                                    rope_override=(kind, factor, orig))


# -----------------------------------------------------------------------------
# refusals

@pytest.mark.parametrize("changes, name", [
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
     "dynamic"),
    (dict(rope_parameters=None, rope_theta=10000.0,
          rope_scaling={"type": "dynamic", "factor": 2.0}),
     "dynamic"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                           "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                           "original_max_position_embeddings": 64}),
     "longrope"),
])
def test_length_dependent_rope_is_refused(llama_ckpt, tmp_path, changes, name):
    path = str(shutil.copytree(llama_ckpt, tmp_path / "ckpt"))
    edit_config(path, **changes)
    with pytest.raises(CheckpointError) as e:
        Transformer.from_pretrained(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.count(". ") == 0, f"not one sentence: {msg!r}"
    assert os.path.join(path, "config.json") in msg and name in msg
    assert "length of each forward call" in msg
