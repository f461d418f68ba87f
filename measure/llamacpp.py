r"""
bench.py --vs-llamacpp: ours beside llama.cpp's llama-bench, the CPU user's usual peer, on the same
checkpoint, prompt lengths (--contexts), threads and decode steps, side by side in one table.

    python bench.py --ckpt DIR --modes none --contexts 6258 --repeats 3 \
        --vs-llamacpp ~/llama.cpp/build/bin/llama-bench --gguf DIR-f32.gguf

Every run, of both sides, is a fresh process (ours as --fresh-process runs it), interleaved (for
each repeat: for each context: our --modes, then llama.cpp, the order reversed on odd repeats), so
a shared machine's drift hits both alike; numbers are medians of --repeats, the spread beside them.
llama-bench runs twice a repeat: prefill `-p N -n 0`, decode `-p 0 -n NEW-1 -d N` (NEW-1 single
token steps after a prompt of N, as ours decodes after its first token), both with `-t THREADS -r 1
-o json`; everything else is llama.cpp's default (its KV in f16, its batch sizes, its choice of
flash attention), as a user runs it. --llamacpp-fa runs it with each of its flash-attention
settings listed (`auto`, its default, `on`, `off`: `-fa 1` / `-fa 0`), each a side of its own in the
interleaving and a row of its own in the table: which one is faster depends on the CPU and the
context (docs/performance.md, round twenty: on one Intel VM a native build's default took flash
attention and decoded 6,258 positions 2.6x slower than without), so a comparison names the one it
ran.
llama-bench reports a decode step's mean, so ours is compared by its mean too
(decode_tokens_per_s_mean), not the median step of the main table.

The GGUF is the user's: this checkpoint converted by llama.cpp's own convert_hf_to_gguf.py, of the
type that matches our weights (THEIR_TYPE). Before any timed run, a short llama-bench run checks
that the binary runs, that the file holds that type and as many parameters as the checkpoint.
"""
import json
import math
import os
import statistics
import subprocess
import sys

from checkpoint import header_shapes
from runs.flags import UsageError

# our weights -> the GGUF type that holds the same ones (Q4_1: groups of 32 with a scale and a
# minimum, as --quantize int4's default groups with a scale and a zero)
THEIR_TYPE = {("fp32", "none"): "F32", ("bf16", "none"): "BF16", ("fp16", "none"): "F16",
              "int8": "Q8_0", "int4": "Q4_1"}
# our --kv-dtype -> llama-bench's -ctk / -ctv, where it holds the same precision (its default is
# f16: no f32 KV, so fp32 KV, auto under fp32 weights, meets f16)
THEIR_KV = {"bf16": "bf16", "fp16": "f16"}
# a GGUF converted from the checkpoint holds its tensors, perhaps less a few small buffers
PARAMS_TOLERANCE = 0.005
# --llamacpp-fa -> llama-bench's -fa (0 and 1, which old and new builds both take; auto: no flag,
# its default)
FLASH_ATTN = {"auto": (), "on": ("-fa", "1"), "off": ("-fa", "0")}


def parse_fa(text):
    """--llamacpp-fa: 'auto', 'off' or a list such as 'auto,off' -> a tuple of settings."""
    settings = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in settings if x not in FLASH_ATTN]
    if not settings or unknown or len(set(settings)) != len(settings):
        raise UsageError(f"--llamacpp-fa {text}: give distinct settings among "
                         f"{', '.join(FLASH_ATTN)}, e.g. auto,off")
    return settings


def their_type(args):
    """The GGUF type (llama.cpp's name) that matches --dtype and --quantize."""
    if args.quantize != "none":
        return THEIR_TYPE[args.quantize]
    return THEIR_TYPE[(args.dtype, "none")]


def check_flags(args):
    """What --vs-llamacpp refuses before any heavy work: the files and the flags it cannot take."""
    parse_fa(args.llamacpp_fa or "auto")
    if not args.gguf:
        raise UsageError("--vs-llamacpp needs --gguf FILE: this checkpoint converted by "
                         f"llama.cpp's convert_hf_to_gguf.py to {their_type(args)}")
    if not os.path.isfile(args.gguf):
        raise UsageError(f"--gguf {args.gguf}: no such file")
    path = args.vs_llamacpp
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UsageError(f"--vs-llamacpp {path}: not an executable file; give the path of "
                         "llama.cpp's llama-bench (build/bin/llama-bench)")
    if args.quantize == "int4" and args.group_size not in (None, 32):
        raise UsageError("--vs-llamacpp compares --quantize int4 with Q4_1, groups of 32: use "
                         "--group-size 32")
    others = {"--vs-hf": args.vs_hf, "--batch-sizes": args.batch_sizes,
              "--contention": args.contention, "--visit-cost": args.visit_cost,
              "--kv-store": args.kv_store}
    for flag, given in others.items():
        if given:
            raise UsageError(f"--vs-llamacpp is a run of its own: drop {flag}")


def llama_bench(args, *test):
    """The one test entry of a llama-bench run (-o json) of --gguf with `test` flags."""
    kv = THEIR_KV.get(args.kv_dtype)
    cmd = [args.vs_llamacpp, "-m", args.gguf, "-t", str(args.threads), "-r", "1", "-o", "json",
           *(["-ctk", kv, "-ctv", kv] if kv else []), *map(str, test)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise UsageError(f"--vs-llamacpp {args.vs_llamacpp}: cannot run it "
                         f"({e.strerror})") from None
    if p.returncode != 0:
        said = (p.stderr.strip().splitlines() or ["no message"])[-1].strip()[-200:]
        raise UsageError(f"--vs-llamacpp {args.vs_llamacpp} failed on --gguf {args.gguf} (exit "
                         f"{p.returncode}): {said}")
    try:
        # JSON on stdout; skip anything a build prints before the array
        tests, _ = json.JSONDecoder().raw_decode(p.stdout[p.stdout.index("["):])
        entry = tests[-1]
        entry["avg_ts"] = float(entry["avg_ts"])
        entry["model_type"] = str(entry["model_type"])
    except (ValueError, IndexError, KeyError, TypeError):
        raise UsageError(f"--vs-llamacpp {args.vs_llamacpp}: its output is not llama-bench's "
                         "JSON (-o json); give the path of llama-bench") from None
    return entry


def check_gguf(args):
    """A short llama-bench run (a 16-token prefill): the binary runs, --gguf holds the weights
    that match ours and as many parameters as --ckpt. Returns that run's entry (the build, the
    backend, the KV type)."""
    entry = llama_bench(args, "-p", 16, "-n", 0)
    want = their_type(args)
    # "llama 135M all F32", "llama ?B Q8_0", maybe "(guessed)" after it
    if want not in entry["model_type"].split():
        raise UsageError(f"--gguf {args.gguf} holds {entry['model_type']!r}, and our weights "
                         f"(--dtype {args.dtype}, --quantize {args.quantize}) compare with "
                         f"{want}: convert the checkpoint to {want}")
    ours = sum(math.prod(shape) for shape in header_shapes(args.ckpt).values())
    theirs = int(entry.get("model_n_params", 0))
    if abs(theirs - ours) > PARAMS_TOLERANCE * ours:
        raise UsageError(f"--gguf {args.gguf} holds {theirs:,} parameters and --ckpt {args.ckpt} "
                         f"{ours:,}: convert this checkpoint")
    return entry


def run_llamacpp(args, ctx, fa):
    """{"prefill", "decode"} tok/s of one repeat at `ctx` with flash attention `fa` (--llamacpp-fa),
    each a fresh llama-bench process."""
    pp = llama_bench(args, "-p", ctx, "-n", 0, *FLASH_ATTN[fa])
    tg = llama_bench(args, "-p", 0, "-n", args.new_tokens - 1, "-d", ctx, *FLASH_ATTN[fa])
    return {"prefill": pp["avg_ts"], "decode": tg["avg_ts"]}


def run_matrix(args, contexts, modes, run_fresh):
    """({(context, mode): [our stats]}, {(context, flash attention setting): [their rates]}),
    interleaved; run_fresh(args, mode, ctx, new) is bench.py's fresh-process run of ours."""
    ours = {}
    theirs = {}
    # a side: one of our --modes, or llama.cpp at one --llamacpp-fa setting
    sides = [(None, mode) for mode in modes]
    sides += [("llama.cpp", fa) for fa in parse_fa(args.llamacpp_fa or "auto")]
    for rep in range(args.repeats):
        for ctx in contexts:
            for who, what in sides if rep % 2 == 0 else sides[::-1]:
                if who:
                    r = run_llamacpp(args, ctx, what)
                    theirs.setdefault((ctx, what), []).append(r)
                    rates = (r["prefill"], r["decode"])
                    name = f"llama.cpp fa={what}"
                else:
                    _, st = run_fresh(args, what, ctx, args.new_tokens)
                    ours.setdefault((ctx, what), []).append(st)
                    rates = (st["prefill_tokens_per_s"], st["decode_tokens_per_s_mean"])
                    name = what
                print(f"repeat {rep + 1}/{args.repeats} context {ctx} {name:<18} prefill "
                      f"{rates[0]:9.1f} tok/s  decode {rates[1]:8.2f} tok/s  load "
                      f"{os.getloadavg()[0]:.2f}", file=sys.stderr)
    return ours, theirs


def stat(values):
    """{"median", "min", "max"} of a list of rates."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(ours, theirs, contexts, modes):
    """A row per context, mode and llama.cpp flash-attention setting: our and their prefill and
    decode (medians, spreads), ours over theirs."""
    fas = list(dict.fromkeys(fa for _, fa in theirs))  # the settings, in the order they ran
    rows = []
    for ctx in contexts:
        for mode in modes:
            us = {"prefill": stat([r["prefill_tokens_per_s"] for r in ours[(ctx, mode)]]),
                  "decode": stat([r["decode_tokens_per_s_mean"] for r in ours[(ctx, mode)]])}
            for fa in fas:
                them = {k: stat([r[k] for r in theirs[(ctx, fa)]]) for k in ("prefill", "decode")}
                row = {"context": ctx, "mode": mode, "llamacpp_fa": fa,
                       "runs": len(ours[(ctx, mode)])}
                for k in ("prefill", "decode"):
                    row[f"ours_{k}_tokens_per_s"] = us[k]
                    row[f"llamacpp_{k}_tokens_per_s"] = them[k]
                    row[f"ours_over_llamacpp_{k}"] = us[k]["median"] / them[k]["median"]
                rows.append(row)
    return rows


def cell(s):
    """'12.3 (11.9-12.8)'."""
    return f"{s['median']:,.1f} ({s['min']:,.1f}-{s['max']:,.1f})"


def markdown(rows, args):
    """The table, in the style of --vs-hf's."""
    weights = args.dtype if args.quantize == "none" else f"--quantize {args.quantize}"
    lines = ["| context | mode | weights (ours / theirs) | their flash attention | prefill ours "
             "tok/s (min-max) | prefill llama.cpp | ours / theirs | decode ours tok/s (min-max) | "
             "decode llama.cpp | ours / theirs |", "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['mode']} | {weights} / {their_type(args)} | "
                     f"{r['llamacpp_fa']} | "
                     f"{cell(r['ours_prefill_tokens_per_s'])} | "
                     f"{cell(r['llamacpp_prefill_tokens_per_s'])} | "
                     f"{r['ours_over_llamacpp_prefill']:.2f} | "
                     f"{cell(r['ours_decode_tokens_per_s'])} | "
                     f"{cell(r['llamacpp_decode_tokens_per_s'])} | "
                     f"{r['ours_over_llamacpp_decode']:.2f} |")
    return "\n".join(lines)


def compare(args, contexts, modes, run_fresh, machine, config):
    """The whole --vs-llamacpp run: check, measure, print the table. Returns the JSON report."""
    entry = check_gguf(args)
    ours, theirs = run_matrix(args, contexts, modes, run_fresh)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = summarize(ours, theirs, contexts, modes)
    build = {k: entry.get(k) for k in ("build_commit", "build_number", "backends", "cpu_info",
                                       "model_type", "type_k", "type_v", "flash_attn",
                                       "n_batch", "n_ubatch")}
    print(f"{args.ckpt} {config['model']}, ours {args.dtype} (--quantize {args.quantize}, "
          f"--kv-dtype {args.kv_dtype}, --attention {args.attention}, --products {args.products}, "
          f"chunk {args.chunk_size}) / "
          "llama.cpp "
          f"{build['model_type']} (build {build['build_commit']}, KV {build['type_k']}), "
          f"{args.threads} threads each, {args.new_tokens - 1} decode "
          f"steps after the prompt, fresh processes, median of {args.repeats}; {machine['date']}, "
          f"{machine['cpu_count']} CPUs, load {machine['loadavg']} -> {machine['loadavg_end']}\n\n"
          f"{markdown(rows, args)}")
    return {"machine": machine, "config": config, "llamacpp": build, "results": rows}
