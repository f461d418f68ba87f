"""
model.py judged against transformers: tiny random checkpoints that transformers builds and loads
itself, our fp32 logits against its fp32 logits, our greedy tokens against its generate(), our bf16
and fp16 logits within the dtype's own rounding of its; then bad checkpoints, each refused with a
CheckpointError that names the file, field or tensor at fault.
"""
import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint import CheckpointError
from ckpt import build_checkpoint, edit_config
from model import ModelArgs, Transformer, rope_inv_freq

ATOL = 1e-4  # max abs logit difference allowed against transformers, everything in fp32
N_NEW = 16   # greedy tokens that must agree
# with D=16 this hits all three bands
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}

# name -> build_checkpoint kwargs
CASES = {
    "llama-gqa": dict(),
    "qwen2-tied-bias": dict(arch="qwen2", tie_word_embeddings=True),
    "mistral": dict(arch="mistral"),
    "bf16": dict(dtype=torch.bfloat16),
    "sharded": dict(shard_size="100KB"),
    "rope-llama3": dict(rope_parameters=LLAMA3),
    "rope-linear": dict(rope_parameters=LINEAR),
    "head-dim-32": dict(head_dim=32),
    "old-style-4x": dict(old_style=True,
                         rope_parameters={**LINEAR, "rope_theta": 1e5, "factor": 2.0}),
    "old-style-4x-llama3": dict(old_style="rope_type",
                                rope_parameters={**LLAMA3, "rope_theta": 5e5}),
    "llama-bias": dict(attention_bias=True, mlp_bias=True),
    "llama-tied": dict(tie_word_embeddings=True),  # Llama 3.2 1B / 3B style
    # Ministral 8B style: transformers reads a Mistral config with layer_types as Ministral's,
    # whose full_attention layers do not slide
    "mistral-layer-types": dict(arch="mistral", sliding_window=12,
                                layer_types=["full_attention", "sliding_attention"]),
}


def load_reference(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def random_tokens(vocab_size, B=2, T=40, seed=1):
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def greedy(model, tokens, n):
    """Our greedy loop: the whole sequence through the model each step, no cache."""
    for _ in range(n):
        nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, -n:]


def top2_margin(logits):
    top = logits.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).min().item()


@pytest.fixture(scope="module")
def pair(checkpoint):
    """case name -> (our model, transformers model, path), loaded once per module."""
    loaded = {}

    def get(case):
        if case not in loaded:
            path = checkpoint(**CASES[case])
            loaded[case] = Transformer.from_pretrained(path), load_reference(path), path
        return loaded[case]
    return get


# -----------------------------------------------------------------------------
# parity with transformers

@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(pair, case):
    ours, ref, _ = pair(case)
    tokens = random_tokens(ours.args.vocab_size)
    with torch.no_grad():
        got = ours(tokens)
        want = ref(tokens).logits.float()
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 40, ours.args.vocab_size)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, (f"{case}: max abs logit difference {diff:.3g} > {ATOL} "
                          f"(logit scale {want.abs().max():.3g})")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_generate(pair, case):
    ours, ref, _ = pair(case)
    tokens = random_tokens(ours.args.vocab_size, seed=2)
    # random weights may pick the eos id; we want all N_NEW tokens
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        got = greedy(ours, tokens, N_NEW)
        want = ref.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                            max_new_tokens=N_NEW, pad_token_id=0)[:, -N_NEW:]
        margin = top2_margin(ref(torch.cat([tokens, want], 1)).logits[:, tokens.shape[1] - 1:-1])
    assert torch.equal(got, want), (f"{case}: greedy tokens differ (smallest top-2 logit gap "
                                    f"{margin:.3g})\n{got}\n{want}")


def ignore_rope_scaling(model):
    model.inv_freq = rope_inv_freq(dataclasses.replace(model.args, rope_scaling={}))


def drop_k_bias(model):
    model.layers[0].attention.wk.bias.zero_()


def swap_norms(model):
    model.layers[1].ffn_norm.weight.copy_(model.layers[1].attention_norm.weight)


@pytest.mark.parametrize("case, mutate", [
    ("rope-llama3", ignore_rope_scaling),
    ("qwen2-tied-bias", drop_k_bias),
    ("llama-gqa", swap_norms),
])
def test_parity_check_can_fail(checkpoint, case, mutate):
    """The tolerance above is tight enough to see one wrong detail: ignored RoPE scaling, a dropped
    k bias, the two norms of a layer swapped for each other."""
    path = checkpoint(**CASES[case])
    ours = Transformer.from_pretrained(path)
    ref = load_reference(path)
    tokens = random_tokens(ours.args.vocab_size)
    with torch.no_grad():
        mutate(ours)
        diff = (ours(tokens) - ref(tokens).logits).abs().max().item()
    assert diff > 100 * ATOL


def test_a_single_file_beside_shards_is_what_transformers_loads(tmp_path):
    """A checkpoint with both model.safetensors and an index of shards (other weights here): the
    single file, as transformers loads it (we read the shards before: logits off by 10)."""
    path = build_checkpoint(str(tmp_path / "both"), shard_size="100KB")
    other = build_checkpoint(str(tmp_path / "other"), seed=1)
    shutil.copy(os.path.join(other, "model.safetensors"), path)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ours = Transformer.from_pretrained(path)
    tokens = random_tokens(ours.args.vocab_size)
    with torch.no_grad():
        assert (ours(tokens) - load_reference(path)(tokens).logits).abs().max().item() < ATOL
        assert (ours(tokens) - load_reference(other)(tokens).logits).abs().max().item() < ATOL


def test_checkpoints_are_what_the_cases_claim(checkpoint, pair):
    """Each case exercises the feature it is named for (a builder that silently ignored an option
    would make the parity tests above prove nothing)."""
    _, ref, path = pair("sharded")
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) >= 2 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))

    _, _, path = pair("bf16")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}

    ours, _, path = pair("qwen2-tied-bias")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert "lm_head.weight" not in tensors and ours.output.weight is ours.tok_embeddings.weight
    assert all(tensors[f"model.layers.0.self_attn.{p}_proj.bias"].abs().min() > 0 for p in "qkv")

    ours, _, path = pair("llama-bias")
    assert ours.layers[0].attention.wo.bias is not None
    assert ours.layers[0].feed_forward.w2.bias is not None

    ours, ref, _ = pair("head-dim-32")
    assert ours.args.head_dim == 32 != ours.args.dim // ours.args.n_heads

    for case, type_key in (("old-style-4x", "type"), ("old-style-4x-llama3", "rope_type")):
        ours, ref, path = pair(case)
        with open(os.path.join(path, "config.json")) as f:
            hf_config = json.load(f)
        assert "rope_parameters" not in hf_config and "dtype" not in hf_config
        assert hf_config["torch_dtype"] == "float32"
        assert type_key in hf_config["rope_scaling"] and hf_config["rope_theta"] != 10000.0
        rope_type = ours.args.rope_scaling["rope_type"]
        assert ref.config.rope_parameters["rope_type"] == rope_type != "default"
        assert ours.args.rope_theta == hf_config["rope_theta"]


@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-tied-bias", "bf16"])
def test_loaded_model_is_materialised(pair, case):
    """Built on the meta device and assigned: nothing may be left on meta, all in the requested
    dtype."""
    ours, _, _ = pair(case)
    for name, t in [*ours.named_parameters(), *ours.named_buffers()]:
        assert t.device.type == "cpu", f"{name} is on {t.device}"
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in ours.parameters())
    assert not ours.training


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parity_with_transformers(checkpoint, dtype):
    """Our logits in bf16/fp16 are as close to transformers' in that dtype as transformers' are to
    exact (fp32): the tolerance is the dtype's own rounding, measured, not a constant."""
    from transformers import AutoModelForCausalLM
    path = checkpoint()
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        exact = Transformer.from_pretrained(path)(tokens)[0]
        ours = Transformer.from_pretrained(path, dtype=dtype)(tokens)[0]
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()(tokens)
        theirs = theirs.logits[0].float()
    rounding = (theirs - exact).abs().max().item()
    diff = (ours - theirs).abs().max().item()
    assert rounding > 1e-3, "not computed in low precision"
    assert diff <= 2 * rounding, (diff, rounding)
    assert (ours - exact).abs().max().item() <= 2 * rounding, (diff, rounding)
    top2 = theirs.topk(2, dim=-1).values
    # positions where our difference cannot flip the greedy choice
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert clear.sum() >= len(clear) // 2
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


# -----------------------------------------------------------------------------
# bad checkpoints

@pytest.fixture
def broken(llama_ckpt, tmp_path):
    """A private copy of the tiny Llama checkpoint, free to damage."""
    path = str(tmp_path / "ckpt")
    shutil.copytree(llama_ckpt, path)
    return path


def refused(path, *names):
    """Assert loading `path` raises CheckpointError whose one-line message contains every one of
    `names`."""
    with pytest.raises(CheckpointError) as e:
        Transformer.from_pretrained(path)
    msg = str(e.value)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    for name in names:
        assert name in msg, f"{name!r} not named in: {msg}"
    return msg


def test_unmodified_copy_loads(broken):
    Transformer.from_pretrained(broken)  # so every failure below is due to the damage, not the copy


@pytest.mark.parametrize("changes, names", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     ["unsupported architecture gpt2 GPT2LMHeadModel; supported: llama, mistral, qwen2"]),
    # GPT-2's own fields (n_embd, not hidden_size; its BOS past our vocab): named as GPT-2 first
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", hidden_size=None,
          intermediate_size=None, n_embd=64, n_layer=2, bos_token_id=50256),
     ["unsupported architecture gpt2", "LlamaForCausalLM"]),
    (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "factor": 4.0}),
     ["mrope", "rope"]),
    (dict(rope_parameters=None, rope_theta=10000.0,
          rope_scaling={"type": "mrope", "factor": 4.0}),
     ["mrope", "rope"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (dict(num_local_experts=8, num_experts_per_tok=2), ["num_local_experts"]),
    (dict(hidden_size=None), ["hidden_size"]),
])
def test_unsupported_config_is_refused(broken, changes, names):
    edit_config(broken, **changes)
    refused(broken, "config.json", *names)


def test_qwen2_sliding_layers_without_a_window_are_refused(checkpoint, tmp_path):
    """transformers raises on the first forward call of such a config; we refuse it when loading."""
    path = shutil.copytree(checkpoint(**CASES["qwen2-tied-bias"]), tmp_path / "qwen2")
    edit_config(path, use_sliding_window=False, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"])
    refused(str(path), "config.json", "layer_types", "use_sliding_window")


def test_missing_config_is_refused(broken):
    os.remove(os.path.join(broken, "config.json"))
    refused(broken, "config.json")


def test_invalid_json_is_refused(broken):
    with open(os.path.join(broken, "config.json"), "w") as f:
        f.write('{"hidden_size": 64,')
    refused(broken, "config.json", "JSON")


def resave(path, put=None, drop=()):
    """Rewrite model.safetensors with the tensors named in `drop` removed and those of `put` (a
    dict) added or replaced."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in drop:
        del tensors[name]
    tensors.update(put or {})
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_refused(broken):
    resave(broken, drop=["model.layers.1.mlp.down_proj.weight"])
    refused(broken, "model.layers.1.mlp.down_proj.weight", "missing")


@pytest.mark.parametrize("extra", [
    "model.layers.0.mlp.extra_proj.weight",    # a module we do not have
    "model.layers.2.self_attn.q_proj.weight",  # a layer beyond num_hidden_layers
    "model.layers.0.self_attn.o_proj.bias",    # a bias this config does not use
])
def test_unexpected_tensor_is_refused(broken, extra):
    resave(broken, put={extra: torch.zeros(64)})
    refused(broken, "model.safetensors", extra, "unexpected")


def test_tolerated_extras_load(broken, checkpoint, tmp_path):
    """Two extras real checkpoints carry are ignored, as transformers ignores them: the old
    rotary_emb.inv_freq buffer, and a copy of the embedding as lm_head.weight in a tied model. An
    lm_head.weight that is not a copy is the output matrix, untied, as transformers reads it."""
    resave(broken, put={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    ref = Transformer.from_pretrained(checkpoint())
    tokens = random_tokens(128)
    with torch.no_grad():
        assert torch.equal(Transformer.from_pretrained(broken)(tokens), ref(tokens))
    tied = str(shutil.copytree(checkpoint(**CASES["qwen2-tied-bias"]), tmp_path / "tied"))
    embedding = load_file(os.path.join(tied, "model.safetensors"))["model.embed_tokens.weight"]
    resave(tied, put={"lm_head.weight": embedding.clone()})
    model = Transformer.from_pretrained(tied)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.abs().sum() > 0
    other = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0))
    resave(tied, put={"lm_head.weight": other})
    model = Transformer.from_pretrained(tied)
    assert not model.args.tie_embeddings and torch.equal(model.output.weight, other)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(model(tokens), ref(tokens).logits, atol=1e-4)


def test_wrongly_shaped_tensor_is_refused(broken):
    resave(broken, put={"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    refused(broken, "model.layers.0.self_attn.k_proj.weight", "(64, 64)", "(32, 64)")


def test_truncated_file_is_refused(broken):
    file = os.path.join(broken, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    refused(broken, "model.safetensors")


def test_corrupt_file_is_refused(broken):
    with open(os.path.join(broken, "model.safetensors"), "wb") as f:
        f.write(bytes(range(256)) * 16)
    refused(broken, "model.safetensors")


def test_missing_shard_is_refused(checkpoint, tmp_path):
    path = str(shutil.copytree(checkpoint(**CASES["sharded"]), tmp_path / "sharded"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(path, shard))
    refused(path, shard)


def test_pickle_only_checkpoint_is_refused(broken):
    os.remove(os.path.join(broken, "model.safetensors"))
    with open(os.path.join(broken, "pytorch_model.bin"), "wb") as f:
        f.write(b"PK\x03\x04 not loaded: we never unpickle")
    refused(broken, "model.safetensors")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_an_absent_field_means_what_transformers_takes_it_to_mean(arch):
    """Fields config.json leaves out take each family's default in transformers' config classes
    (Mistral: a window of 4096, 8 kv heads, 131,072 positions; Qwen2: 32,768 positions), not one
    default for all."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    ref = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]()
    hf = {"architectures": [type(ref).__name__.replace("Config", "ForCausalLM")],
          "model_type": arch, "hidden_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 32, "intermediate_size": 64, "vocab_size": 128}
    args = ModelArgs.from_config(hf)
    assert args.max_seq_len == ref.max_position_embeddings
    assert args.n_kv_heads == (ref.num_key_value_heads or 32)
    window = getattr(ref, "sliding_window", None)  # Qwen2's is None without use_sliding_window
    assert args.sliding_window == window


def test_disagreeing_config_fields_are_refused(tmp_path):
    """What transformers would read another way than the fields say is refused in one sentence:
    architectures against model_type, rope_parameters against rope_scaling; and pre-quantized
    weights (quantization_config), which only looked unexpected tensor by tensor."""
    hf = {"architectures": ["MistralForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 64, "vocab_size": 128}
    with pytest.raises(CheckpointError, match="architectures names MistralForCausalLM but "
                                              "model_type is 'llama'"):
        ModelArgs.from_config(hf)
    hf.update(model_type="mistral", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
              rope_scaling={"type": "linear", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope_parameters and rope_scaling are both given "
                                              "and differ"):
        ModelArgs.from_config(hf)
    # the same block, as some configs carry both: transformers reads rope_scaling, and its theta
    # from the top-level rope_theta or its default, not rope_parameters' 1e6
    from transformers import MistralConfig
    hf["rope_scaling"] = {"type": "default"}
    for top in (None, 5e5):
        if top:
            hf["rope_theta"] = top
        theta = MistralConfig(**copy.deepcopy(hf)).rope_parameters["rope_theta"]  # it edits hf
        assert ModelArgs.from_config(hf).rope_theta == theta == (top or 10000.0)
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(CheckpointError, match=r"quantization_config \(fp8\) marks pre-quantized"):
        ModelArgs.from_config(hf)


def test_a_null_max_window_layers_is_refused_where_it_is_read():
    """Qwen2's max_window_layers: null with a sliding window is one sentence (a TypeError before;
    transformers fails too); without one it is never read, as in transformers."""
    hf = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
          "vocab_size": 128, "max_window_layers": None, "use_sliding_window": True,
          "sliding_window": 16}
    with pytest.raises(CheckpointError, match="field 'max_window_layers' is null"):
        ModelArgs.from_config(hf)
    hf["use_sliding_window"] = False
    assert ModelArgs.from_config(hf).sliding_window is None


def test_a_config_that_cannot_be_read_is_named(tmp_path):
    from checkpoint import read_json
    (tmp_path / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"config.json cannot be read \(Is a directory\)"):
        read_json(str(tmp_path / "config.json"))


def test_a_base_models_save_is_named(tmp_path):
    """LlamaModel.save_pretrained (no 'model.' prefix, no lm_head): said so, not as a checkpoint
    of 0 layers."""
    from transformers import LlamaConfig, LlamaModel

    from ckpt import DEFAULTS
    LlamaModel(LlamaConfig(**DEFAULTS)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="the weights are a base model's"):
        Transformer.from_pretrained(str(tmp_path))
