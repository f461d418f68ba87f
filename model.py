"""
A Llama / Mistral / Qwen2 decoder from scratch, loading Hugging Face safetensors checkpoints.

Shape legend, used the same way in every file of this project:
    B batch, T positions in this call, S all positions so far, H query heads, G kv heads,
    R = H // G query heads per kv head, D head dim, E model dim, F mlp dim, V vocab, C chunk size.

`model(tokens)` runs plain causal attention (masked to each layer's sliding window, if it has one):
the reference every cached and offloaded path is checked against. `model(tokens, cache)` hands each
layer's q, k, v to the cache (kvcache.py), which stores k, v and returns the attention output; the
model itself knows nothing of chunks, tiers or transfers. RoPE frequencies (plain, linear, llama3,
YaRN) and stretching them past the trained context: rope.py.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint import (
    CheckpointError,
    architecture,
    check_complete,
    check_config,
    expected,
    iter_checkpoint,
    read_config,
)
from rope import override_block, rope_attention_factor, rope_from_config, rope_inv_freq
from rowwise import Joint, Linear, linear, rows

# -----------------------------------------------------------------------------
# config

@dataclass
class ModelArgs:
    arch: str = "llama"                # llama | mistral | qwen2
    dim: int = 4096                    # E, hidden_size
    n_layers: int = 32                 # num_hidden_layers
    n_heads: int = 32                  # H, num_attention_heads
    n_kv_heads: int = 32               # G, num_key_value_heads (G < H is grouped-query attention)
    head_dim: int = 128                # D; may differ from dim // n_heads when the config says so
    hidden_dim: int = 11008            # F, intermediate_size of the SwiGLU MLP
    vocab_size: int = 32000            # V
    norm_eps: float = 1e-6             # rms_norm_eps
    max_seq_len: int = 2048            # max_position_embeddings
    rope_theta: float = 10000.0        # RoPE base
    # {} or {"rope_type": "linear"|"llama3"|"yarn", "factor": ...}
    rope_scaling: dict = field(default_factory=dict)
    qkv_bias: bool = False             # Qwen2 (and Llama attention_bias) add biases to q, k, v
    o_bias: bool = False               # Llama attention_bias also biases o_proj
    mlp_bias: bool = False             # Llama mlp_bias
    tie_embeddings: bool = False       # lm_head shares the embedding matrix (no lm_head.weight)
    # W: a sliding layer's query sees the W latest positions, itself included
    sliding_window: Optional[int] = None
    sliding_layers: Optional[tuple] = None  # indices of the sliding layers; None = all (Mistral)
    torch_dtype: str = "float32"       # the dtype the checkpoint was saved in

    @property
    def n_rep(self):  # R: query heads sharing one kv head
        return self.n_heads // self.n_kv_heads

    @property
    def layer_windows(self):  # per layer: W, or None for full attention
        def slides(i):
            return self.sliding_layers is None or i in self.sliding_layers
        W = self.sliding_window
        return tuple(W if W and slides(i) else None for i in range(self.n_layers))

    @property
    def max_context(self):
        """Longest context we run (transformers enforces none). YaRN: factor x
        original_max_position_embeddings as vLLM derives it, or max_position_embeddings if longer
        (Qwen2.5 keeps the trained length there, DeepSeek-V3 the stretched one). Linear and llama3
        configs state the stretched length there already (LongChat, Llama 3.1)."""
        s = self.rope_scaling
        if s.get("rope_type") == "yarn":
            return max(self.max_seq_len, int(s["factor"] * s["original_max_position_embeddings"]))
        return self.max_seq_len

    def with_rope_override(self, kind, factor, orig_ctx=None):
        """These args as if config.json carried a `kind` rope_scaling block (replacing its own) that
        stretches orig_ctx positions (default: max_position_embeddings) by `factor`, and
        max_position_embeddings = factor x orig_ctx. YaRN takes transformers' defaults, llama3
        Llama 3.1's bands (see rope.override_block)."""
        orig = self.max_seq_len if orig_ctx is None else orig_ctx
        block = override_block(kind, factor, orig)
        return dataclasses.replace(self, rope_scaling=block, max_seq_len=int(factor * orig))

    @classmethod
    def from_config(cls, hf_config, path="config.json"):
        """Read a transformers config dict, 4.x style (rope_theta, rope_scaling, torch_dtype) or 5.x
        style (rope_parameters, dtype). Anything we would compute differently from transformers is
        refused."""
        def refuse(what):
            raise CheckpointError(f"{path}: {what}; this project supports plain Llama, Mistral and "
                                  "Qwen2 models only")
        arch = architecture(hf_config, path)  # another architecture is named, before its fields
        check_config(hf_config, path)  # every field we read: its type and range
        hf_config = {**FAMILY_DEFAULTS[arch], **hf_config}  # what an absent field means
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "vocab_size")
        for key in sizes:
            if not isinstance(hf_config.get(key), int) or hf_config[key] <= 0:
                raise CheckpointError(f"{path}: field '{key}' is missing or not a positive integer")
        if hf_config.get("hidden_act", "silu") not in ("silu", "swish"):  # the same function
            refuse(f"hidden_act={hf_config['hidden_act']!r} is not 'silu'")
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if hf_config.get(key):
                refuse(f"{key}={hf_config[key]} means a mixture of experts")
        quant = hf_config.get("quantization_config")
        if quant:  # FP8, GPTQ, AWQ, bitsandbytes: weights this project does not compute with
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise CheckpointError(f"{path}: quantization_config ({method}) marks pre-quantized "
                                  "weights, which this project does not load; use the model's "
                                  "full-precision checkpoint (--quantize int8 or int4 quantizes "
                                  "it as it loads)")
        if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(f"partial_rotary_factor={hf_config['partial_rotary_factor']} is not 1.0")
        try:
            theta, rope = rope_from_config(hf_config)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        window, sliding_layers = _sliding_window(hf_config, arch, path)
        n_heads = hf_config["num_attention_heads"]
        n_kv = hf_config.get("num_key_value_heads") or n_heads  # null: as many as the heads
        if n_heads % n_kv:
            raise CheckpointError(f"{path}: num_attention_heads={n_heads} is not a multiple of "
                                  f"num_key_value_heads={n_kv}")
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // n_heads
        # attention_bias, mlp_bias: Llama's (Mistral ignores them; Qwen2 has q, k, v biases)
        attention_bias = arch == "llama" and bool(hf_config.get("attention_bias", False))
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        return cls(
            arch=arch, dim=hf_config["hidden_size"], n_layers=hf_config["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            hidden_dim=hf_config["intermediate_size"], vocab_size=hf_config["vocab_size"],
            norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            max_seq_len=hf_config["max_position_embeddings"],
            rope_theta=float(theta), rope_scaling=rope,
            qkv_bias=arch == "qwen2" or attention_bias, o_bias=arch != "qwen2" and attention_bias,
            mlp_bias=arch == "llama" and bool(hf_config.get("mlp_bias", False)),
            tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            sliding_window=window, sliding_layers=sliding_layers, torch_dtype=str(dtype),
        )


# what transformers' config classes take for a field config.json leaves out (a field given as null
# is another thing: Mistral's sliding_window null is no window, num_key_value_heads null is one kv
# head a query head)
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
}


def _sliding_window(hf_config, arch, path):
    """(W, sliding layer indices or None for all) as transformers 5.x applies a config: Mistral
    masks every layer with sliding_window (null: none), or with layer_types (read as Ministral's)
    those it marks "sliding_attention"; Qwen2 slides only with use_sliding_window, on the layers
    layer_types marks or, without it, layers >= max_window_layers; Llama has no window."""
    window = hf_config.get("sliding_window")
    n_layers = hf_config["num_hidden_layers"]
    layer_types = hf_config.get("layer_types")
    if arch == "llama":
        if any(t != "full_attention" for t in layer_types or []):
            raise CheckpointError(f"{path}: layer_types={sorted(set(layer_types))} has layers "
                                  "without full attention, which a Llama model does not; use a "
                                  "Qwen2 or Mistral checkpoint for sliding windows")
        return None, None
    sliding = None  # every layer
    if arch == "qwen2" and not hf_config.get("use_sliding_window"):
        window = None
    if layer_types is not None:
        kinds = {"full_attention", "sliding_attention"}
        if len(layer_types) != n_layers or set(layer_types) - kinds:
            raise CheckpointError(f"{path}: layer_types must list 'full_attention' or "
                                  f"'sliding_attention' for each of the {n_layers} layers, "
                                  f"not {layer_types}")
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if sliding and window is None and arch == "qwen2":  # transformers raises on a forward
            raise CheckpointError(f"{path}: layer_types has sliding_attention layers but "
                                  "use_sliding_window is false or sliding_window is null; set "
                                  "both, or mark every layer full_attention")
    elif arch == "qwen2":
        first = hf_config.get("max_window_layers", 28)
        if first is None and window is not None:  # transformers compares layer indices with it
            raise CheckpointError(f"{path}: field 'max_window_layers' is null; give a number")
        sliding = tuple(range(first or 0, n_layers))
    if sliding is not None:
        window = window if sliding else None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise CheckpointError(f"{path}: field 'sliding_window' must be a positive integer or null, "
                              f"not {window!r}")
    return window, (sliding if window else None)


def sliding_mask(T, window, device):
    """[T, T] bool, True where query q may see key k: k <= q and q - k < window (transformers'
    sliding mask)."""
    q, k = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    return (k <= q) & (q - k < window)


def swiglu(gate, up):
    return F.silu(gate) * up


def apply_rope(x, cos, sin_rot):
    # x [B, heads, T, D] with cos, sin_rot [B or 1, 1, T, D], or x [B, T, heads, D] with [B or 1,
    # T, 1, D]. Rotate the two halves of D (the layout HF checkpoints are stored in): transformers'
    # x * cos + cat(-x2, x1) * sin, as x * cos + cat(x2, x1) * sin_rot with sin_rot = cat(-sin1,
    # sin2) (Transformer.rope): negation is exact, so the bits are the same, in 4 operations, not 7
    # (a decode step's calls cost more than their bytes); positional arguments parse fastest
    return torch.add(torch.mul(x, cos), torch.mul(torch.roll(x, x.shape[-1] // 2, -1), sin_rot))


# -----------------------------------------------------------------------------
# model

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()  # normalise in fp32, as transformers does
        # a sum and an rsqrt per row, which rows keeps each row's own (rowwise.py)
        inv_rms = rows(self.inv_rms, ("inv_rms", self.eps), xf)  # [B, T, 1]
        return self.weight * (xf * inv_rms).to(x.dtype)

    def inv_rms(self, xf):
        return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)


class Attention(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.args = model_args
        H = model_args.n_heads
        G = model_args.n_kv_heads
        D = model_args.head_dim
        E = model_args.dim
        self.wq = Linear(E, H * D, bias=model_args.qkv_bias)
        self.wk = Linear(E, G * D, bias=model_args.qkv_bias)
        self.wv = Linear(E, G * D, bias=model_args.qkv_bias)
        self.wo = Linear(H * D, E, bias=model_args.o_bias)
        self.qkv = None  # wq, wk, wv as one product once loaded (rowwise.Joint)

    def forward(self, x, cos, sin, layer, cache=None):
        B, T, _ = x.shape
        D = self.args.head_dim
        q, k, v = self.project(x, cos, sin)
        H = q.shape[1]
        G = k.shape[1]
        # the reference: every position attends to all earlier ones (in its window), nothing is kept
        if cache is None:
            k = k.repeat_interleave(H // G, dim=1)  # [B, H, T, D]
            v = v.repeat_interleave(H // G, dim=1)  # [B, H, T, D]
            window = self.args.layer_windows[layer]
            if window is None or T <= window:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
            else:
                mask = sliding_mask(T, window, x.device)  # [T, T]
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # the cache stores k, v at its current positions and attends over everything it holds
            y = cache.attend(layer, q, k, v)  # [B, H, T, D]
        return linear(self.wo, y.transpose(1, 2).reshape(B, T, H * D))  # [B, T, E]

    def project(self, x, cos, sin):
        """x [B, T, E] -> q [B, H, T, D], k, v [B, G, T, D], q and k rotated (RoPE). The heads are
        counted from the projections: a tensor-parallel rank holds a share of them."""
        B, T, _ = x.shape
        D = self.args.head_dim
        y = self.qkv.joint(x) if self.qkv else None               # [B, T, (H + 2G) * D]
        if y is None:
            qkv = [linear(w, x) for w in (self.wq, self.wk, self.wv)]
            q, k, v = (p.reshape(B, T, -1, D).transpose(1, 2) for p in qkv)
            cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [B or 1, 1, T, D]
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        # q and k rotated by one call of each operation (a decode step's calls cost more than their
        # bytes); element by element, so the bits are those of two calls
        G = self.wk.out_features // D
        y = y.view(B, T, -1, D)                                    # [B, T, H + 2G, D]
        qk = apply_rope(y[:, :, :-G], cos, sin)                    # [B, T, H + G, D]
        return (qk[:, :, :-G].transpose(1, 2), qk[:, :, -G:].transpose(1, 2),
                y[:, :, -G:].transpose(1, 2))


class FeedForward(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        dim, hidden_dim = model_args.dim, model_args.hidden_dim  # E, F
        bias = model_args.mlp_bias
        self.w1 = Linear(dim, hidden_dim, bias=bias)  # gate_proj
        self.w3 = Linear(dim, hidden_dim, bias=bias)  # up_proj
        self.w2 = Linear(hidden_dim, dim, bias=bias)  # down_proj
        self.gate_up = None  # w1, w3 as one product once loaded (rowwise.Joint)

    def forward(self, x):
        gate, up = self.gate_up(x) if self.gate_up else (linear(self.w1, x), linear(self.w3, x))
        gate_up = rows(swiglu, "swiglu", gate, up)  # [B, T, F]
        return linear(self.w2, gate_up)  # [B, T, E]


class Block(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.attention_norm = RMSNorm(model_args.dim, model_args.norm_eps)
        self.attention = Attention(model_args)
        self.ffn_norm = RMSNorm(model_args.dim, model_args.norm_eps)
        self.feed_forward = FeedForward(model_args)

    def forward(self, x, cos, sin, layer, cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, layer, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleList(Block(model_args) for _ in range(model_args.n_layers))
        self.norm = RMSNorm(model_args.dim, model_args.norm_eps)
        self.output = Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        inv_freq = rope_inv_freq(model_args)  # [D/2] fp32
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = rope_attention_factor(model_args)
        # "int8" or "int4-g<N>" when from_pretrained quantized the linears (quantize.py)
        self.quantize = None

    def forward(self, tokens, cache=None, last_only=False):
        """tokens [B, T] -> logits [B, T, V] ([B, 1, V] with last_only: prefill needs no more, and
        the output matrix over every position of a long prompt costs as much as attention). With a
        cache, the tokens continue where it stands: cache.starts gives the first position of every
        row (one for all rows, or one per row: kvbatch.BatchedCaches, B tasks' decode steps at once,
        generate.decode_batch)."""
        B, T = tokens.shape
        windows = self.args.layer_windows
        if cache is not None and self.args.sliding_window and cache.windows != windows:
            raise ValueError(f"this cache attends with windows {cache.windows}, the model's layers "
                             f"slide with {windows}; build the cache with "
                             "kvcache.make_cache(model, ...)")
        x = self.tok_embeddings(tokens)           # [B, T, E]
        starts = (0,) if cache is None else cache.starts
        tables = [self.rope(start, T, x.dtype) for start in starts]
        cos = torch.stack([t[0] for t in tables]).unsqueeze(2)  # [B or 1, T, 1, D]: a row's table
        sin = torch.stack([t[1] for t in tables]).unsqueeze(2)  # sin_rot (apply_rope)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, cache)
        if last_only:
            x = x[:, -1:]                         # [B, 1, E]
        return linear(self.output, self.norm(x)).float()  # [B, T, V], fp32 for sampling

    def rope(self, start, T, dtype):
        """(cos, sin_rot) [T, D] for positions start..start+T-1, in fp32 as transformers, then
        dtype; sin_rot is transformers' sin with its first half negated (apply_rope)."""
        pos = torch.arange(start, start + T, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)   # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)   # [T, D]
        a = self.attention_factor                 # YaRN's scale (else 1.0), in fp32 as transformers
        sin = (emb.sin() * a).to(dtype)
        half = sin.shape[-1] // 2
        return (emb.cos() * a).to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    @classmethod
    def from_pretrained(cls, ckpt_dir, device="cpu", dtype=torch.float32, rope_override=None,
                        quantize=None):
        """Build on the meta device, then assign tensors read by safetensors (peak memory ~1x the
        weights). rope_override: (kind, factor, orig_ctx or None) to stretch RoPE past the trained
        context, see ModelArgs.with_rope_override. quantize="int8" or "int4-g32" (64, 128): linear
        weights are quantized as they arrive (quantize.py), one tensor at a time."""
        # checked against the weights' headers before anything is built from it
        model_args = ModelArgs.from_config(*read_config(ckpt_dir))
        if rope_override is not None:
            model_args = model_args.with_rope_override(*rope_override)
        with torch.device("meta"):
            model = cls(model_args)
        # what the checkpoint must hold, and shapes
        params = dict(model.named_parameters(remove_duplicate=False))
        if quantize:  # Int8Linear or Int4Linear (still on meta) in place of nn.Linear
            from quantize import quantize_linears
            quantize_linears(model, quantize)
        model.quantize = quantize  # part of what the KV depends on: belongs in a run's fingerprint
        tied = model_args.tie_embeddings
        loaded = set()
        head = None  # a tied checkpoint's own lm_head.weight: used where it differs (below)
        for hf_name, tensor, path in iter_checkpoint(ckpt_dir):
            if tied and hf_name == "lm_head.weight":
                head = (tensor, path)
                continue
            name = expected(hf_name, tuple(tensor.shape), params, model_args, path)
            if name is None:
                continue
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            if quantize and attr == "weight" and hasattr(module, "load_weight"):
                # the full-precision tensor is dropped right after
                module.load_weight(tensor.to(device))
            else:
                setattr(module, attr, nn.Parameter(tensor.to(device, dtype), requires_grad=False))
            quantized_output = hasattr(model.output, "load_weight")
            if tied and name == "tok_embeddings.weight" and quantized_output:
                # tied: the output is a quantized copy of the embedding
                model.output.load_weight(tensor.to(device))
            loaded.add(name)
        check_complete(params, loaded, model_args, ckpt_dir)
        if head is not None and untie(model, *head, device, dtype):
            tied = False
        if tied and not hasattr(model.output, "load_weight"):
            # re-tie: the tie was made on the meta device
            model.output.weight = model.tok_embeddings.weight
        model.inv_freq = rope_inv_freq(model_args).to(device)
        return join_projections(model).eval()


def untie(model, head, path, device, dtype):
    """tie_word_embeddings, and the file holds an lm_head.weight: a copy of the embedding is
    dropped; one that differs is the output matrix, as transformers keeps it (untied). Returns
    whether the model was untied."""
    want = tuple(model.tok_embeddings.weight.shape)
    if tuple(head.shape) != want:
        raise CheckpointError(f"{path}: tensor 'lm_head.weight' has shape {tuple(head.shape)}, "
                              f"config.json implies {want}")
    head = head.to(device, dtype)
    if torch.equal(head, model.tok_embeddings.weight):
        return False
    model.args = dataclasses.replace(model.args, tie_embeddings=False)
    if hasattr(model.output, "load_weight"):
        model.output.load_weight(head)
    else:
        model.output.weight = nn.Parameter(head, requires_grad=False)
    return True


def join_projections(model):
    """q, k, v and gate, up as one product each (rowwise.Joint): one call a step, not five."""
    for block in model.layers:
        a, f = block.attention, block.feed_forward
        a.qkv = Joint.of([a.wq, a.wk, a.wv])
        f.gate_up = Joint.of([f.w1, f.w3])
    return model
