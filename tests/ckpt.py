"""
Tiny random Hugging Face checkpoints, built offline by transformers itself, for tests that compare
against it.

    from ckpt import build_checkpoint
    path = build_checkpoint(tmp_path / "m", arch="qwen2", tie_word_embeddings=True)

Defaults are small (E=64, 2 layers, H=4, G=2, V=128, F=128) so a checkpoint takes well under a
second to build. Weights use a large init std (0.25) and random norm weights and biases, so that
greedy choices are not near-ties and a swapped or dropped tensor changes the logits visibly.
"""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network, whoever imports us first

import torch

DEFAULTS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=128,
    max_position_embeddings=8192,
    initializer_range=0.25,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_classes(arch):
    """(config class, model class) of transformers for one of our architectures."""
    import transformers
    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
    if arch not in names:
        raise ValueError(f"arch must be one of {sorted(names)}, not {arch!r}")
    n = names[arch]
    return getattr(transformers, f"{n}Config"), getattr(transformers, f"{n}ForCausalLM")


def build_checkpoint(path, arch="llama", dtype=torch.float32, shard_size=None, old_style=False,
                     seed=0, **config_overrides):
    """Save a random `arch` model to `path` (a directory, created) as safetensors and return `path`.

    shard_size: passed as max_shard_size (e.g. "100KB") to get an index and several shards.
    old_style: rewrite config.json the way transformers 4.x wrote it: top-level rope_theta,
    rope_scaling with the key "type" (or "rope_type" when old_style="rope_type"), torch_dtype
    instead of dtype.
    config_overrides: any config field, e.g. rope_parameters={...}, head_dim=32,
    tie_word_embeddings=True.
    """
    config_cls, model_cls = hf_classes(arch)
    hf_config = config_cls(**{**DEFAULTS, **config_overrides})
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = model_cls(hf_config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):      # transformers initialises biases to zero
                    p.normal_(0.0, 0.25)
                elif "norm" in name:            # and norm weights to one
                    p.normal_(1.0, 0.2)
    model = model.to(dtype)
    model.config.dtype = dtype
    os.makedirs(path, exist_ok=True)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(path, **kwargs)
    if old_style:
        type_key = "rope_type" if old_style == "rope_type" else "type"
        to_old_style(os.path.join(path, "config.json"), type_key)
    return path


def to_old_style(config_path, type_key="type"):
    """Rewrite a 5.x config.json (rope_parameters, dtype) in 4.x style (rope_theta, rope_scaling,
    torch_dtype)."""
    with open(config_path) as f:
        hf_config = json.load(f)
    rope = dict(hf_config.pop("rope_parameters", None) or {})
    hf_config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", "default")
    hf_config["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **rope}
    if "dtype" in hf_config:
        hf_config["torch_dtype"] = hf_config.pop("dtype")
    with open(config_path, "w") as f:
        json.dump(hf_config, f, indent=2)


def edit_config(ckpt_dir, **changes):
    """Set (or, with value None, remove) top-level fields of ckpt_dir/config.json."""
    config_path = os.path.join(ckpt_dir, "config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    for key, value in changes.items():
        if value is None:
            hf_config.pop(key, None)
        else:
            hf_config[key] = value
    with open(config_path, "w") as f:
        json.dump(hf_config, f, indent=2)


def add_sentencepiece(ckpt_dir, vocab_size=400):
    """Train a small sentencepiece model (byte fallback on) on Python's own documentation into
    ckpt_dir, so that generate.py and verify.py can run on the checkpoint with text. Its vocab must
    fit the model's vocab_size."""
    import pydoc_data.topics

    import sentencepiece as spm
    topics = sorted(pydoc_data.topics.topics.values())[:60]
    lines = [line for topic in topics for line in topic.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=os.path.join(ckpt_dir, "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        normalization_rule_name="identity",
        character_coverage=0.99,
        minloglevel=2,
    )
    os.remove(os.path.join(ckpt_dir, "tokenizer.vocab"))
    return ckpt_dir
