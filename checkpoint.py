"""
The files of a Hugging Face checkpoint: config.json and the other JSON files, and the safetensors
weights, read one tensor at a time. Every problem is a CheckpointError naming the file and what to
do. Nothing in config.json is used before it is checked: every field the model, RoPE and the
tokenizer read has a type and a range (CONFIG_FIELDS), and its sizes must agree with the weights'
own headers (read_config) before anything is built from them. The tensors' names map to the
model's (WEIGHT_MAP), and each is checked against the shape the config implies (expected).
"""
import json
import math
import os
import re

from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file, field or tensor and what to do."""


def read_json(path):
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        ckpt_dir = os.path.dirname(path) or "."
        gguf = []
        if os.path.isdir(ckpt_dir):
            gguf = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".gguf"))
        if gguf and os.path.basename(path) == "config.json":
            # a llama.cpp download: say how to get safetensors
            raise CheckpointError(
                f"{ckpt_dir} holds {gguf[0]}, a llama.cpp file; this project loads Hugging Face "
                "safetensors checkpoints: download the original model, or convert it with "
                "transformers (pip install gguf; AutoModelForCausalLM.from_pretrained("
                f"\"{ckpt_dir}\", gguf_file=\"{gguf[0]}\").save_pretrained(OUT), and the same for "
                "AutoTokenizer)") from None
        raise CheckpointError(f"{path} not found: --ckpt must be a Hugging Face model "
                              "directory") from None
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a huge number, deep nesting
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:  # a directory, a file this user may not read
        raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(obj).__name__}")
    return obj


def checkpoint_files(ckpt_dir):
    """The safetensors files of a checkpoint: one model.safetensors, or the shards an index names
    (with both, model.safetensors, as transformers loads it)."""
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(os.path.join(ckpt_dir, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no 'weight_map'")
        files = sorted(set(map(str, weight_map.values())))
        for f in files:
            # a shard lies inside the checkpoint: a relative path that does not climb out of it
            if "\0" in f or os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] == "..":
                raise CheckpointError(f"{index}: shard {f!r} is outside the checkpoint directory; "
                                      "the weight_map may name files inside it only")
    else:
        raise CheckpointError(f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json "
                              "(only safetensors checkpoints are loaded; convert .bin files with "
                              "transformers first)")
    paths = [os.path.join(ckpt_dir, f) for f in files]
    for p in paths:
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: shard named in the index is missing")
    return paths


def iter_checkpoint(ckpt_dir):
    """Yield (name, tensor, file) one tensor at a time, so only one tensor is held beyond the
    model."""
    for path in checkpoint_files(ckpt_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), path
        except CheckpointError:
            raise
        except Exception as e:
            # safetensors reports truncation and corruption with its own error types
            raise CheckpointError(f"{path}: cannot be read as safetensors ({e}); the file is "
                                  "truncated or corrupt") from None


# -----------------------------------------------------------------------------
# config.json: every field checked by type and range before it is used

def is_int(v, lo, hi=2**31):
    return type(v) is int and lo <= v < hi  # type(), not isinstance: a bool is no int here


def is_number(v, lo=-math.inf):
    finite = (type(v) is float and math.isfinite(v)) or (type(v) is int and abs(v) < 2**63)
    return finite and v >= lo


def is_positive(v):
    return is_number(v) and v > 0


def is_size(v):
    return is_int(v, 1)


def is_count(v):
    return is_int(v, 0)


def is_even_size(v):
    return is_int(v, 2) and v % 2 == 0  # RoPE rotates the two halves of a head


def is_eps(v):
    return is_number(v, 0)


def is_str(v):
    return isinstance(v, str)


def is_bool(v):
    return type(v) is bool


def is_object(v):
    return isinstance(v, dict)


def is_str_list(v):
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


SIZE = (is_size, "a positive integer")
COUNT = (is_count, "an integer >= 0")
NUMBER = (is_number, "a number")
POSITIVE = (is_positive, "a positive number")
STRING = (is_str, "a string")
BOOL = (is_bool, "true or false")
# field -> (check, what it must be, whether null means "the default"); fields not listed are not
# read, and an absent field takes its default
CONFIG_FIELDS = {
    "architectures": (is_str_list, "a list of strings", True),
    "model_type": (*STRING, True),
    "hidden_size": (*SIZE, False),
    "num_hidden_layers": (*SIZE, False),
    "num_attention_heads": (*SIZE, False),
    "num_key_value_heads": (*SIZE, True),
    "head_dim": (is_even_size, "a positive even integer", True),
    "intermediate_size": (*SIZE, False),
    "vocab_size": (*SIZE, False),
    "max_position_embeddings": (*SIZE, False),
    "original_max_position_embeddings": (*SIZE, True),
    "rms_norm_eps": (is_eps, "a number >= 0", False),
    "hidden_act": (*STRING, False),
    "num_local_experts": (*COUNT, True),
    "num_experts": (*COUNT, True),
    "n_routed_experts": (*COUNT, True),
    "partial_rotary_factor": (*NUMBER, False),
    "rope_theta": (*POSITIVE, True),
    "rope_parameters": (is_object, "an object", True),
    "rope_scaling": (is_object, "an object", True),
    "sliding_window": (*SIZE, True),
    "use_sliding_window": (*BOOL, True),
    "layer_types": (is_str_list, "a list of strings", True),
    "max_window_layers": (*COUNT, True),
    "attention_bias": (*BOOL, True),
    "mlp_bias": (*BOOL, True),
    "tie_word_embeddings": (*BOOL, True),
    "dtype": (*STRING, True),
    "torch_dtype": (*STRING, True),
}
# inside rope_parameters / rope_scaling
ROPE_FIELDS = {
    "rope_type": (*STRING, False),
    "type": (*STRING, False),
    "rope_theta": (*POSITIVE, True),
    "factor": (*POSITIVE, True),
    "original_max_position_embeddings": (*SIZE, True),
    "low_freq_factor": (*POSITIVE, False),
    "high_freq_factor": (*POSITIVE, False),
    "beta_fast": (is_eps, "a number >= 0", True),
    "beta_slow": (is_eps, "a number >= 0", True),
    "truncate": (*BOOL, False),
    "attention_factor": (*POSITIVE, True),
    "mscale": (*NUMBER, True),
    "mscale_all_dim": (*NUMBER, True),
}


def check_fields(d, table, path, prefix=""):
    """Each field of table present in d is what the table says; else one CheckpointError sentence
    naming it (prefix: where d sits in config.json)."""
    for key, (ok, what, nullable) in table.items():
        if key not in d or (d[key] is None and nullable):
            continue
        if not ok(d[key]):
            raise CheckpointError(f"{path}: field '{prefix}{key}' must be {what}, not "
                                  f"{shown(d[key])}; fix config.json")


def shown(v):
    """A value for an error message: short, and never a deep structure."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    return json.dumps(v)[:40]


def check_config(hf_config, path):
    """Every field of a config.json dict that this project reads, by type and range (ModelArgs,
    rope.py, the tokenizer's BOS and EOS ids)."""
    check_fields(hf_config, CONFIG_FIELDS, path)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(hf_config.get(key), dict):
            check_fields(hf_config[key], ROPE_FIELDS, path, prefix=f"{key}.")
    check_token_ids(hf_config, path, hf_config.get("vocab_size"))


def check_token_ids(d, path, vocab_size):
    """bos_token_id: an id or null; eos_token_id: an id, a list of ids, or null; each id below
    vocab_size (when known)."""
    top = vocab_size if is_int(vocab_size, 1) else 2**31
    bos = d.get("bos_token_id")
    if bos is not None and not is_int(bos, 0, top):
        raise CheckpointError(f"{path}: field 'bos_token_id' must be a token id below {top} or "
                              f"null, not {shown(bos)}")
    eos = d.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(is_int(i, 0, top) for i in ids):
        raise CheckpointError(f"{path}: field 'eos_token_id' must be a token id below {top}, a "
                              f"list of them, or null, not {shown(eos)}")


# the architectures this project computes, as config.json names them
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}


def architecture(hf_config, path):
    """'llama', 'mistral' or 'qwen2', from config.json's architectures, else its model_type; any
    other is refused first, by name, before fields another architecture names differently (GPT-2's
    n_embd) are missed one at a time."""
    archs = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is not None and isinstance(model_type, str) and model_type != arch:
        # transformers builds the model model_type names; the architectures list names another
        raise CheckpointError(f"{path}: architectures names {'/'.join(archs)} but model_type is "
                              f"{model_type!r}; make them agree (transformers builds what "
                              "model_type says)")
    if arch is None and model_type in ARCHITECTURES.values():
        arch = model_type
    if arch is None:
        named = model_type if isinstance(model_type, str) else None
        named = " ".join(x for x in (named, "/".join(archs)) if x) or "(none given)"
        supported = ", ".join(sorted(set(ARCHITECTURES.values())))
        raise CheckpointError(f"{path}: unsupported architecture {named}; supported: {supported} "
                              f"({', '.join(ARCHITECTURES)})")
    return arch


def read_config(ckpt_dir):
    """(config.json as a dict, its path), every field checked (check_config) and its sizes checked
    against the safetensors headers: a num_hidden_layers of 10**9 would otherwise build 10**9
    layers before the first tensor is read."""
    path = os.path.join(ckpt_dir, "config.json")
    hf_config = read_json(path)
    architecture(hf_config, path)
    check_config(hf_config, path)
    shapes = header_shapes(ckpt_dir)
    layers = set()
    for name in shapes:
        m = re.match(r"model\.layers\.(\d{1,9})\.", name)
        if m:
            layers.add(int(m.group(1)))
    # more layers than the weights hold is refused here; fewer, or a gap, names the tensor that
    # does not fit when it is loaded (expected, below)
    n = hf_config.get("num_hidden_layers")
    if not layers and any(re.match(r"layers\.\d", name) for name in shapes):
        # a base model's save (LlamaModel.save_pretrained): no "model." prefix, no lm_head
        raise CheckpointError(f"{ckpt_dir}: the weights are a base model's (their names lack "
                              "'model.', and there is no lm_head); save the ...ForCausalLM model "
                              "(AutoModelForCausalLM), which generates text")
    if is_int(n, 1) and n > len(layers):
        raise CheckpointError(f"{path}: num_hidden_layers is {n}, but the weights hold "
                              f"{len(layers)} layers; fix config.json or the checkpoint")
    sizes = {"model.embed_tokens.weight": ("vocab_size", "hidden_size"),
             "model.layers.0.mlp.gate_proj.weight": ("intermediate_size", "hidden_size")}
    for name, keys in sizes.items():
        want = [hf_config.get(k) for k in keys]
        if name in shapes and shapes[name] != want:
            raise CheckpointError(f"{path}: {keys[0]} x {keys[1]} is {want[0]} x {want[1]}, but "
                                  f"the weights' {name} is {' x '.join(map(str, shapes[name]))}; "
                                  "fix config.json or the checkpoint")
    return hf_config, path


def header_shapes(ckpt_dir):
    """{tensor name: shape} of every tensor, from the safetensors headers (no tensor is read)."""
    shapes = {}
    for path in checkpoint_files(ckpt_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = list(f.get_slice(name).get_shape())
        except Exception as e:
            # safetensors reports truncation and corruption with its own error types
            raise CheckpointError(f"{path}: cannot be read as safetensors ({e}); the file is "
                                  "truncated or corrupt") from None
    return shapes


# -----------------------------------------------------------------------------
# tensor names: the checkpoint's and the model's (model.py)

# Hugging Face module name -> ours, {} is the layer index; ".weight" / ".bias" follow unchanged.
# The layouts agree (HF stores q/k for half-split RoPE, as apply_rope rotates), so nothing is
# transposed or permuted.
WEIGHT_MAP = {
    "model.embed_tokens": "tok_embeddings",
    "model.norm": "norm",
    "lm_head": "output",
    "model.layers.{}.input_layernorm": "layers.{}.attention_norm",
    "model.layers.{}.post_attention_layernorm": "layers.{}.ffn_norm",
    "model.layers.{}.self_attn.q_proj": "layers.{}.attention.wq",
    "model.layers.{}.self_attn.k_proj": "layers.{}.attention.wk",
    "model.layers.{}.self_attn.v_proj": "layers.{}.attention.wv",
    "model.layers.{}.self_attn.o_proj": "layers.{}.attention.wo",
    "model.layers.{}.mlp.gate_proj": "layers.{}.feed_forward.w1",
    "model.layers.{}.mlp.up_proj": "layers.{}.feed_forward.w3",
    "model.layers.{}.mlp.down_proj": "layers.{}.feed_forward.w2",
}
_REVERSE_MAP = {v: k for k, v in WEIGHT_MAP.items()}


def _translate(name, table):
    """Map 'a.layers.3.b.weight' through a table keyed by 'a.layers.{}.b'; None if the table has no
    entry."""
    module, _, kind = name.rpartition(".")
    idx = re.search(r"\.(\d+)\.", module)
    key = module.replace(idx.group(0), ".{}.", 1) if idx else module
    if key not in table:
        return None
    return table[key].format(idx.group(1) if idx else "") + "." + kind


def expected(hf_name, shape, params, model_args, path):
    """Our name for a checkpoint tensor, checked against the model the config builds (None: a
    tensor we skip)."""
    name = hf_to_ours(hf_name, model_args)
    if name is None:
        return None
    if name not in params:
        raise CheckpointError(f"{path}: unexpected tensor '{hf_name}' (not part of a "
                              f"{model_args.arch} model with this config)")
    if shape != tuple(params[name].shape):
        raise CheckpointError(f"{path}: tensor '{hf_name}' has shape {shape}, config.json implies "
                              f"{tuple(params[name].shape)}")
    return name


def check_complete(params, loaded, model_args, ckpt_dir):
    tied = model_args.tie_embeddings
    missing = [n for n in params if n not in loaded and not (tied and n == "output.weight")]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: tensor '{ours_to_hf(missing[0])}' is missing from the "
                              f"checkpoint ({len(missing)} missing in all)")


def hf_to_ours(hf_name, model_args):
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # old checkpoints saved this buffer; we compute it
    if hf_name == "lm_head.weight" and model_args.tie_embeddings:
        return None  # tied: the embedding is the output matrix (some tied checkpoints carry a copy)
    # an unknown name stays as is and is reported unexpected
    return _translate(hf_name, WEIGHT_MAP) or hf_name


def ours_to_hf(name):
    return _translate(name, _REVERSE_MAP) or name
