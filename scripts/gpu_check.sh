#!/usr/bin/env bash
# The checks that need a GPU, in one go, in under 10 minutes (the sum of the steps' limits):
#   1. tests/test_offload.py (its CUDA tests run here: stream ordering, bit-identity, peak device memory)
#   2. bench.py --probe: links (pinned/pageable H2D, D2H, both at once), disk, prediction, verdict
#   3. bench.py on a KV-heavy random model (Llama-2-7B shape cut to 8 layers, bf16: 128 KiB of KV per token,
#      4 GiB at 32K) for none/cpu/disk, without and with --vs-hf (transformers' DynamicCache, and offloaded)
#   4. bench.py --tune on the demo model at 8K under a device budget smaller than its KV (the staging-slot step
#      runs on CUDA), and verify.py --diagnose on CUDA (pinned memory, links)
#
#   bash scripts/gpu_check.sh OUT_DIR        # PYTHON=/path/to/python to choose the interpreter
#
# Needs PyTorch with CUDA, transformers, safetensors, numpy (zstandard is optional: without it the disk+zstd
# cases of test_offload.py fail with ImportError, which the log shows). Every step runs under its own time limit
# and writes OUT_DIR/<step>.log (and .json/.md); a failed step is recorded in OUT_DIR/status.txt and the next
# step still runs. Exit status: the number of failed steps (0 = all passed).
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

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, output in NAME.log, outcome in status.txt
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
    "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda,
'usable', torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
    for m in transformers safetensors numpy zstandard; do
        "$PY" -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null || echo "$m: NOT INSTALLED"
    done
    df -h "$SCRATCH"; free -g 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

COMMON=(--device cuda --dtype bf16 --offload-dir "$KV" --chunk-size 512 --window 1)

step pytest_offload 100 "$PY" -m pytest -q -rs tests/test_offload.py

# shellcheck disable=SC2046  # model_flags is meant to split into words (paths have no spaces: mktemp)
step probe 90 "$PY" bench.py --probe $(model_flags) "${COMMON[@]}" --contexts 4096,32768 --modes none,cpu,disk \
    --repeats 2 --probe-mib 1024 --json "$OUT/probe.json"

# shellcheck disable=SC2046
step bench 160 "$PY" bench.py $(model_flags) "${COMMON[@]}" --contexts 4096,32768 --modes none,cpu,disk \
    --new-tokens 16 --repeats 2 --json "$OUT/bench.json"

# shellcheck disable=SC2046
step bench_vs_hf 120 "$PY" bench.py $(model_flags) "${COMMON[@]}" --contexts 32768 --modes none,cpu,disk \
    --new-tokens 16 --repeats 1 --vs-hf --json "$OUT/bench_vs_hf.json"

step tune 75 "$PY" bench.py --tune --device cuda --context 8192 --device-budget 0.008 --cpu-budget 0.026 \
    --offload-dir "$KV"

step diagnose 45 "$PY" verify.py --diagnose --device cuda --offload cpu --context 8192

for name in probe bench bench_vs_hf tune; do  # the tables alone, for pasting into the README
    grep -E '^\||^(torch|copy|calibration|Predicted|Pinned|zstd|Disk|CUDA)' "$OUT/$name.log" > "$OUT/$name.md" 2>/dev/null
done
echo "== $FAILED step(s) failed; results in $OUT" | tee -a "$OUT/status.txt"
exit "$FAILED"
