"""
The files of a Hugging Face checkpoint: config.json and the other JSON files, and the safetensors
weights, read one tensor at a time. Every problem is a CheckpointError naming the file and what to
do.
"""
import json
import os

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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(obj).__name__}")
    return obj


def checkpoint_files(ckpt_dir):
    """The safetensors files of a checkpoint: one model.safetensors, or the shards an index
    names."""
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(ckpt_dir, "model.safetensors")):
        files = ["model.safetensors"]
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
