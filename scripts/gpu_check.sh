#!/usr/bin/env bash
# The checks that need a GPU, in one go, in under 8 minutes:
#   1. the CUDA tests (stream ordering, bit-identity, peak device memory, int8 KV, int4 weights
#      and KV) and the emulated ones
#   2. probe.py: links (pinned/pageable H2D, D2H, both at once), disk, prediction, verdict
#   3. bench.py on a KV-heavy random model (Llama-2-7B shape cut to 8 layers, bf16: 128 KiB of KV
#      per token, 4 GiB at 32K) for none/cpu/disk, without and with --vs-hf (transformers'
#      DynamicCache, and offloaded)
#   4. bench.py --visit-cost: the fixed cost of a chunk visit and the CUDA kernels it launches
#   5. pinned bytes against the --cpu-budget that asked for them
#   6. summary.md: one table for the README (decode against the PCIe bound, kernels per visit,
#      pinned bytes)
#
#   bash scripts/gpu_check.sh OUT_DIR        # PYTHON=/path/to/python to choose the interpreter
#
# Needs PyTorch with CUDA, transformers, safetensors, numpy (zstandard is optional: without it the
# disk+zstd cases of test_offload.py fail with ImportError, which the log shows). Every step runs
# under its own time limit and writes OUT_DIR/<step>.log (and .json/.md); a failed step is recorded
# in OUT_DIR/status.txt and the next step still runs. Exit status: the number of failed steps (0 =
# all passed).
set -uo pipefail  # no -e: a failing step is recorded, not fatal

OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
MODEL="$SCRATCH/rand7b-8l"                  # built once by the probe step, reused by the benches
KV="$SCRATCH/kv"                            # the disk tier
FAILED=0
: > "$OUT/status.txt"

# step NAME SECONDS CMD...: run CMD under a time limit, output in NAME.log, outcome in status.txt
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/status.txt"
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && echo "   $name: TIMED OUT" | tee -a "$OUT/status.txt"
    echo "   $name: rc=$rc after $((SECONDS - start))s" | tee -a "$OUT/status.txt"
    [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
    tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
}

model_flags() {  # the built model if the probe step made it, else build it in this step
    if [ -f "$MODEL/config.json" ]; then
        echo --ckpt "$MODEL"
    else
        rm -rf "$MODEL"
        echo --random-model 7b-like --layers 8 --ckpt "$MODEL"
    fi
}

{
    date -u; hostname; nvidia-smi || echo "nvidia-smi: not found"
    "$PY" - <<'PYEOF'
import sys

import torch

print(sys.version)
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print("torch", torch.__version__, "cuda", torch.version.cuda, "usable", torch.cuda.is_available(),
      gpus)
PYEOF
    for m in transformers safetensors numpy zstandard; do
        "$PY" -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null \
            || echo "$m: NOT INSTALLED"
    done
    df -h "$SCRATCH"; free -g 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

COMMON=(--device cuda --dtype bf16 --offload-dir "$KV" --chunk-size 512 --window 1)

step pytest_cuda 90 "$PY" -m pytest -q -rs tests/test_offload.py tests/test_cuda_emulated.py \
    tests/test_kv_int8.py
# the int4 CUDA path (aten._weight_int4pack_mm), never run on the build machine
step pytest_cuda_int4 60 "$PY" -m pytest -q -rs tests/test_int4.py -k cuda

# model_flags is meant to split into words (paths have no spaces: mktemp)
# shellcheck disable=SC2046
step probe 60 "$PY" probe.py $(model_flags) "${COMMON[@]}" --contexts 4096,32768 \
    --modes none,cpu,disk --repeats 2 --probe-mib 1024 --json "$OUT/probe.json"

# shellcheck disable=SC2046
step bench 130 "$PY" bench.py $(model_flags) "${COMMON[@]}" --contexts 4096,32768 \
    --modes none,cpu,disk --new-tokens 16 --repeats 2 --json "$OUT/bench.json"

# shellcheck disable=SC2046
step bench_vs_hf 90 "$PY" bench.py $(model_flags) "${COMMON[@]}" --contexts 32768 \
    --modes none,cpu,disk --new-tokens 16 --repeats 1 --vs-hf --json "$OUT/bench_vs_hf.json"

# shellcheck disable=SC2046
step visit_cost 50 "$PY" bench.py $(model_flags) "${COMMON[@]}" --contexts 32768 --visit-cost \
    --repeats 2 --json "$OUT/visit_cost.json"

step pinned 40 "$PY" - "$MODEL" "$KV" "$OUT/pinned.json" <<'PYEOF'
import json
import sys

import torch

from model import Transformer
from offload import OffloadConfig
from runs.task import run_task

model = Transformer.from_pretrained(sys.argv[1], device="cuda", dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, model.args.vocab_size, (8192,), generator=g).tolist()
out = {}
for budget in (0.3, 1.0):  # GiB: what --cpu-budget asks for, against what the host pool pinned
    cfg = OffloadConfig(mode="disk", window=1, cpu_budget_gib=budget, offload_dir=sys.argv[2])
    _, st = run_task(model, ids, 8, chunk_size=512, cfg=cfg)
    out[budget] = {"pinned_bytes": st["pinned_bytes"], "host_chunks": st["chunks"]["host"]}
    print(f"--cpu-budget {budget} GiB: pinned {st['pinned_bytes'] / 2**30:.3f} GiB "
          f"({st['chunks']['host']} host chunks; includes the bounce buffers)")
json.dump(out, open(sys.argv[3], "w"))
PYEOF

"$PY" - "$OUT" > "$OUT/summary.md" 2>&1 <<'PYEOF'
import json
import os
import sys

out = sys.argv[1]


def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


probe = load("probe.json")
bench = load("bench.json")
visit = load("visit_cost.json")
pinned = load("pinned.json")
h2d = probe["calibration"]["link_gbps"].get("h2d_pinned") if probe else None
print("| context | mode | decode tok/s | offloaded GiB/step | PCIe-bound tok/s | efficiency |\n"
      "|---|---|---|---|---|---|")
for r in (bench or {}).get("results", []):
    kv = bench["config"]["kv_bytes_per_token"] * r["context"]
    kept = bench["config"]["window"] + 1
    on_device = kept * bench["config"]["chunk_size"] / r["context"]
    off = 0 if r["mode"] == "none" else kv * max(0, 1 - on_device)
    bound = h2d * 1e9 / off if off and h2d else None
    eff = r["decode_tokens_per_s"] / bound if bound else None
    bound_cell = "-" if bound is None else f"{bound:.1f}"
    eff_cell = "-" if eff is None else f"{eff:.0%}"
    print(f"| {r['context']} | {r['mode']} | {r['decode_tokens_per_s']:.1f} | {off / 2**30:.2f} | "
          f"{bound_cell} | {eff_cell} |")
if visit:
    print(f"\nchunk visit: {visit['visit_cost_s'] * 1e6:.1f} us fixed cost, "
          f"{visit['kernels_per_visit']} kernels")
for budget, p in (pinned or {}).items():
    print(f"--cpu-budget {budget} GiB: {p['pinned_bytes'] / 2**30:.3f} GiB pinned "
          f"({p['host_chunks']} host chunks)")
PYEOF
cat "$OUT/summary.md"

for name in probe bench bench_vs_hf; do  # the tables alone, for pasting into the README
    grep -E '^\||^(torch|copy|calibration|Predicted|Pinned|zstd|Disk|CUDA)' "$OUT/$name.log" \
        > "$OUT/$name.md" 2>/dev/null
done
echo "== $FAILED step(s) failed; results in $OUT" | tee -a "$OUT/status.txt"
exit "$FAILED"
