"""
Random checkpoints of a given shape, for benchmarks and the tuner: ModelArgs -> random weights ->
safetensors under Hugging Face names and a config.json that both this project and transformers load.

    # a preset and/or dim=,layers=,heads=,kv_heads=,head_dim=,...
    sizes = parse_model_spec("7b-like,layers=4")
    build_random_checkpoint(sizes, "/tmp/m", torch.bfloat16)
"""
import json
import math
import os
import re

import torch

from checkpoint import ours_to_hf
from model import ModelArgs, Transformer
from private import FILE_MODE, PrivateError, make_private_dir, write_atomic

SIZE_KEYS = ("dim", "layers", "heads", "kv_heads", "head_dim", "hidden", "vocab")
PRESETS = {  # --random-model NAME[,key=value,...]
    # Llama-2-7B
    "7b-like": dict(dim=4096, layers=32, heads=32, kv_heads=32, head_dim=128, hidden=11008,
                    vocab=32000),
    "kv-heavy": dict(dim=1024, layers=4, heads=16, kv_heads=16, head_dim=64, hidden=2816,
                     vocab=32000),
    "tiny": dict(dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=128, vocab=256),
    # 16 KiB fp32 KV/token
    "kv16k": dict(dim=256, layers=2, heads=8, kv_heads=8, head_dim=128, hidden=512, vocab=256),
    "smollm2-135m": dict(dim=576, layers=30, heads=9, kv_heads=3, head_dim=64, hidden=1536,
                         vocab=49152),
}


def parse_model_spec(spec, layers=None):
    """'7b-like', '7b-like,kv_heads=8' or
    'dim=512,layers=4,heads=8,kv_heads=8,hidden=1376,vocab=32000'."""
    sizes = {}
    for i, part in enumerate(p.strip() for p in spec.split(",") if p.strip()):
        key, eq, val = part.partition("=")
        if not eq and i == 0 and key in PRESETS:
            sizes.update(PRESETS[key])
        elif eq and key in SIZE_KEYS and val.isdigit() and int(val) > 0:
            sizes[key] = int(val)
        else:
            raise ValueError(f"--random-model: cannot read {part!r}; give a preset "
                             f"{sorted(PRESETS)} and/or key=positive integer pairs, "
                             f"keys {SIZE_KEYS}")
    if layers is not None:
        sizes["layers"] = layers
    missing = [k for k in SIZE_KEYS if k not in sizes and k != "head_dim"]
    if missing:
        raise ValueError(f"--random-model {spec}: missing {missing}")
    if sizes["heads"] % sizes["kv_heads"]:
        raise ValueError(f"--random-model {spec}: heads={sizes['heads']} is not a multiple of "
                         f"kv_heads={sizes['kv_heads']}")
    sizes.setdefault("head_dim", sizes["dim"] // sizes["heads"])
    return sizes


# the demo model, a trained one: the template of trained-scale weights
TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                        "tinyllama-pydoc")


def trained_scales(template=TEMPLATE):
    """What a trained checkpoint's tensors look like, per Hugging Face name (layer index kept):
    a norm weight's (mean, std); a linear's RMS times sqrt(fan in) (the embedding's plain RMS) and
    the spread of its rows' RMS (std / mean)."""
    from safetensors.torch import load_file
    stats = {}
    for name, t in load_file(os.path.join(template, "model.safetensors")).items():
        t = t.float()
        if t.dim() == 1:
            stats[name] = ("norm", t.mean().item(), t.std().item())
            continue
        rms = t.pow(2).mean().sqrt().item()
        rows = t.pow(2).mean(1).sqrt()  # [N]
        scale = rms if "embed_tokens" in name else rms * t.shape[1] ** 0.5
        stats[name] = ("linear", scale, (rows.std() / rows.mean()).item())
    return stats


def _trained_tensor(hf_name, shape, stats, n_layers, g, device):
    """A random tensor scaled as the template's tensor of the same role and relative depth."""
    n_template = 1 + max(int(m) for m in re.findall(r"layers\.(\d+)\.", " ".join(stats)))
    index = re.search(r"layers\.(\d+)\.", hf_name)
    key = hf_name
    if index:
        depth = int(index.group(1)) * n_template // n_layers
        key = hf_name.replace(index.group(0), f"layers.{depth}.", 1)
    kind, a, b = stats[key]
    if kind == "norm":
        return a + b * torch.randn(shape, generator=g, device=device)
    if "embed_tokens" not in hf_name:  # a linear's scale is per unit fan in
        a = a / shape[1] ** 0.5
    sigma = math.sqrt(math.log(1 + b * b))  # lognormal row scales of mean 1 and that spread
    rows = torch.exp(sigma * torch.randn(shape[0], 1, generator=g, device=device) - sigma ** 2 / 2)
    return torch.randn(shape, generator=g, device=device) * rows * a


def build_random_checkpoint(sizes, out_dir, dtype, device="cpu", max_positions=131072, seed=0,
                            trained_scale=False, tied=False):
    """A LlamaForCausalLM directory that both Transformer.from_pretrained and transformers load
    (with a byte-level tokenizer.json when the vocabulary has room for 256 bytes). Linear weights
    at std 1/sqrt(fan in), embeddings at 1, norms at 1, so activations stay O(1); drawn on `device`
    (fast on a GPU). trained_scale: every tensor scaled as the demo model's (a trained model) of
    the same role and relative depth, rows spread as its rows are (trained_scales): the
    magnitudes at which rounding decides a result, as random O(1) weights never show. tied: the
    output matrix is the embedding (tie_word_embeddings, as SmolLM2)."""
    from safetensors.torch import save_file
    model_args = ModelArgs(dim=sizes["dim"], n_layers=sizes["layers"], n_heads=sizes["heads"],
                           n_kv_heads=sizes["kv_heads"], head_dim=sizes["head_dim"],
                           hidden_dim=sizes["hidden"], vocab_size=sizes["vocab"],
                           max_seq_len=max_positions,
                           torch_dtype=str(dtype).removeprefix("torch."))
    with torch.device("meta"):
        model = Transformer(model_args)
    g = torch.Generator(device).manual_seed(seed)
    stats = trained_scales() if trained_scale else None
    tensors = {}
    for name, p in model.named_parameters():
        if tied and name == "output.weight":
            continue
        if stats:
            w = _trained_tensor(ours_to_hf(name), p.shape, stats, model_args.n_layers, g, device)
            tensors[ours_to_hf(name)] = w.to(dtype).cpu()
            continue
        if "norm" in name:
            tensors[ours_to_hf(name)] = torch.ones(p.shape, dtype=dtype)
            continue
        std = 1.0 if name.startswith("tok_embeddings") else p.shape[-1] ** -0.5
        w = torch.randn(p.shape, generator=g, device=device) * std
        tensors[ours_to_hf(name)] = w.to(dtype).cpu()
    if not os.path.isdir(out_dir):  # made private (0700), as everything this project writes
        make_private_dir(out_dir, "the random model's directory")
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    os.chmod(weights, FILE_MODE)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": model_args.dim,
        "intermediate_size": model_args.hidden_dim,
        "num_hidden_layers": model_args.n_layers,
        "num_attention_heads": model_args.n_heads,
        "num_key_value_heads": model_args.n_kv_heads,
        "head_dim": model_args.head_dim,
        "vocab_size": model_args.vocab_size,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": model_args.torch_dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    write_atomic(os.path.join(out_dir, "config.json"), json.dumps(hf_config, indent=2).encode())
    # a byte-level tokenizer (ids 0-255), so that generate.py can encode a prompt for it
    if model_args.vocab_size >= 256:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        write_atomic(os.path.join(out_dir, "tokenizer.json"), tok.to_str().encode())
    return out_dir


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(prog="python -m measure.random_model",
                                description="write a random checkpoint of a given shape")
    p.add_argument("spec", help=f"a preset {sorted(PRESETS)} and/or key=value pairs {SIZE_KEYS}")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--trained-scale", action="store_true",
                   help="tensors scaled as a trained model's (the demo model's), not O(1)")
    p.add_argument("--tied", action="store_true", help="tie the output matrix to the embedding")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    try:
        spec = parse_model_spec(a.spec)
    except ValueError as e:
        p.exit(2, f"python -m measure.random_model: error: {e}\n")
    if os.path.lexists(a.out_dir) and (os.path.islink(a.out_dir) or not os.path.isdir(a.out_dir)
                                       or os.listdir(a.out_dir)):  # never over a checkpoint
        p.exit(2, f"python -m measure.random_model: error: {a.out_dir} exists and is not an "
               "empty directory; give a new directory\n")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    try:
        print(build_random_checkpoint(spec, a.out_dir, dtype, seed=a.seed,
                                      trained_scale=a.trained_scale, tied=a.tied))
    except (PrivateError, OSError) as e:
        p.exit(2, f"python -m measure.random_model: error: {e}\n")
