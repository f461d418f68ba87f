"""
RoPE as transformers computes it (plain, linear, llama3, YaRN), and stretching it past a
checkpoint's trained context: the rope_scaling block an override puts in force, and the sentences
that tell the user about it.

Every variant here is a fixed function of the position, so a chunked, cached run reproduces it
exactly. "dynamic" and "longrope" are not: transformers recomputes them from the length of each
forward call (model.py refuses them).
"""
import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_OVERRIDES = ("linear", "yarn", "llama3")  # what --rope-scaling may impose on a checkpoint
# Llama 3.1's frequency bands, for a llama3 override
LLAMA3_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def rope_from_config(hf_config):
    """(theta, rope_scaling block or {}) from a transformers config dict: 5.x keeps everything in
    rope_parameters, 4.x has rope_theta plus an optional rope_scaling ("type" or "rope_type").
    ValueError for what we refuse."""
    both = [hf_config.get(k) for k in ("rope_parameters", "rope_scaling")]
    if all(both) and scaling_of(both[0]) != scaling_of(both[1]):
        # transformers 5 reads rope_scaling and drops rope_parameters (its rope_theta too)
        raise ValueError("rope_parameters and rope_scaling are both given and differ; keep one "
                         "(transformers 5.x writes rope_parameters, 4.x rope_scaling)")
    # as transformers 5: rope_scaling wins, and its theta is the top-level rope_theta's
    rope = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    if "sliding_attention" in rope or "full_attention" in rope:
        raise ValueError("per-layer-type rope_parameters are not supported")
    theta = rope.pop("rope_theta", None) or hf_config.get("rope_theta") or 10000.0
    # as transformers: rope_type wins over type
    rope_type = rope.get("rope_type", rope.pop("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope type {rope_type!r} is refused because transformers recomputes "
                         "its frequencies from the length of each forward call, which a chunked, "
                         "cached run cannot reproduce exactly")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} (rope_scaling / rope_parameters) is not one of "
                         f"{ROPE_TYPES}")
    if rope_type == "default":
        return theta, {}
    rope["rope_type"] = rope_type
    if not rope.get("factor"):
        raise ValueError(f"rope type {rope_type!r} needs a 'factor' (rope_scaling / "
                         "rope_parameters)")
    if rope_type in ("llama3", "yarn"):
        # as transformers: a top-level value wins, then the block's, then max length
        rope["original_max_position_embeddings"] = (
            hf_config.get("original_max_position_embeddings")
            or rope.get("original_max_position_embeddings")
            or hf_config.get("max_position_embeddings", 2048))
    for key in ("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ():
        if key not in rope:
            raise ValueError(f"rope type 'llama3' needs '{key}' (rope_scaling / rope_parameters)")
    return theta, rope


def scaling_of(block):
    """A rope_parameters or rope_scaling block without its theta, "type" read as "rope_type": what
    two blocks must share to say the same."""
    block = dict(block) if isinstance(block, dict) else {"rope_type": block}
    block.pop("rope_theta", None)
    block["rope_type"] = block.get("rope_type", block.pop("type", "default"))
    return block


def override_block(kind, factor, orig):
    """The rope_scaling block equivalent to --rope-scaling kind --rope-factor factor --rope-orig-ctx
    orig. YaRN keeps transformers' defaults (beta_fast 32, beta_slow 1, attention factor
    0.1 ln(factor) + 1); llama3 takes Llama 3.1's frequency bands (low_freq_factor 1,
    high_freq_factor 4)."""
    if kind not in ROPE_OVERRIDES:
        raise ValueError(f"--rope-scaling must be one of {', '.join(ROPE_OVERRIDES)}, not {kind!r}")
    if not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"--rope-factor must be a number greater than 1, not {factor!r}")
    if not isinstance(orig, int) or orig < 1:
        raise ValueError(f"--rope-orig-ctx must be a positive whole number of positions, not "
                         f"{orig!r}")
    block = {"rope_type": kind, "factor": float(factor)}
    if kind == "llama3":
        block.update(LLAMA3_BANDS)
    if kind in ("llama3", "yarn"):
        block["original_max_position_embeddings"] = orig
    return block


def rope_inv_freq(model_args):
    """Inverse frequencies [D/2] of RoPE, with linear, llama3 or YaRN scaling, as transformers
    computes them."""
    d = model_args.head_dim
    base = model_args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = model_args.rope_scaling
    if s.get("rope_type") == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s.get("rope_type") == "llama3":
        factor = s["factor"]
        lo = s["low_freq_factor"]
        hi = s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths: slow down
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # in between: interpolate
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif s.get("rope_type") == "yarn":
        inv_freq = _yarn_inv_freq(base, d, s)
    return inv_freq


def _yarn_inv_freq(base, d, s):
    """YaRN (arxiv 2309.00071): dimensions that turn more than beta_fast times over the original
    context keep their frequency (extrapolate), those turning fewer than beta_slow times are divided
    by factor (interpolate), with a linear ramp between. Same float32 operations, in the same order,
    as transformers."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    # transformers treats 0 as unset too
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension that turns `rotations` times over old_len positions
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    dims = torch.arange(d // 2, dtype=torch.float32)  # [D/2]
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)  # [D/2]
    pos_freqs = base ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolate = 1 - ramp  # 1: keep the trained frequency, 0: divide by factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_attention_factor(model_args):
    """YaRN scales cos and sin (so q.k by its square) to keep attention entropy at long range; 1.0
    otherwise."""
    s = model_args.rope_scaling
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):  # DeepSeek style: a ratio of two scales
        return float(mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"]))
    return mscale(s["factor"])


def context_refusal(n_positions, model_args):
    """The one sentence that refuses a run needing n_positions past model_args.max_context, and
    names the way out."""
    limit = model_args.max_context
    # the length the model was trained on: a scaling in force (config.json's, or --rope-scaling's)
    # stretches it; the example stretches the same length further, never the stretched one
    orig = (model_args.rope_scaling or {}).get("original_max_position_embeddings") or limit
    factor = -(-n_positions // orig)  # the smallest whole factor that reaches n_positions
    kinds = ",".join(ROPE_OVERRIDES)
    return (f"{n_positions} positions (prompt plus new tokens) are past the model's maximum "
            f"context of {limit}; to run them anyway, stretch RoPE with --rope-scaling {{{kinds}}} "
            f"--rope-factor F --rope-orig-ctx N so that F x N >= {n_positions} (for example "
            f"--rope-scaling yarn --rope-factor {factor} --rope-orig-ctx {orig}), knowing that "
            "quality past the length the model was trained on is not guaranteed")


def rope_override_note(model_args, base):
    """One line for the log: which RoPE scaling is in force, up to which length (model_args:
    overridden, base: as loaded)."""
    s = model_args.rope_scaling
    orig = s.get("original_max_position_embeddings", round(model_args.max_seq_len / s["factor"]))
    base_kind = base.rope_scaling.get("rope_type", "plain RoPE")
    return (f"RoPE {s['rope_type']} scaling x{s['factor']:g} over {orig} positions is in force "
            f"(--rope-scaling, replacing config.json's {base_kind}), up to "
            f"{model_args.max_context} positions; past {base.max_context} quality is not "
            "guaranteed")
