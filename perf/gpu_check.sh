#!/usr/bin/env bash
# One prepared GPU check for a single H100/H200 (torch + triton already installed, e.g. torch
# 2.11 / triton 3.6; no network, installs nothing; runs from the source tree via PYTHONPATH):
#
#   perf/gpu_check.sh OUTDIR              on the GPU machine
#   perf/gpu_check.sh --dry-run OUTDIR    every stage's logic on a CPU: tiny shapes, Triton's
#                                         interpreter, no GPU needed (tests/repo/test_gpu_check.py)
#
# The most valuable numbers first; each stage under its own `timeout`, writing its rows as it
# goes (a failing or slow stage never stops the next). Stage limits add up to 435 s (+ 5 s
# each to kill a stage that ignores SIGTERM); with the GPU check before (30 + 5 s at most) and
# the result tables after (20 + 5 s) even a run where everything hits its limit takes 9 minutes.
#   1. smoke (25 s)      nvidia-smi (clocks, power), python/python3, a C compiler, Python.h and
#                        one tiny Triton kernel launched and checked (perf/gpu_smoke.py): if
#                        Triton cannot launch, every later number is void: stop (exit 3)
#   2. key (60 s)        dilated LongNet fwd and fwd+bwd at N = 32K (bf16, H = 16, D = 128,
#                        causal and not) against dense SDPA under each backend (FlashAttention,
#                        cuDNN, efficient) and as torch picks it, the pick recorded
#                        (perf/gpu_key_rows.py -> key_rows.csv)
#   3. breakdown (25 s)  torch.profiler per kernel of one dilated fwd+bwd at the key shape:
#                        fwd, dQ, dK/dV, delta, rest (perf/kernel_breakdown.py -> kernel_breakdown.csv)
#   4. configs (65 s)    config A/B of the dilated forward and backward at the key shape,
#                        paired against the defaults, the kernel variant switches (dilated
#                        FLAT_LOOP, block-sparse TMA, and WARP_SPEC on sm100) included
#                        (perf/config_ab.py -> config_ab.csv)
#   5. flex (45 s)       block-sparse vs FlexAttention (compiled) and dense at 16K, ~90% sparsity
#                        (perf/block_sparse_vs_flex.py -> block_sparse_vs_flex.csv)
#   6. ringstep (15 s)   issue 4's one-GPU ring check, and issue 22's Ulysses overhead on a world of 1
#                        against the local call (perf/ring_step_vs_dense.py -> ring_step_vs_dense.txt)
#   6b. decode (35 s)    one decode step (bf16, H = 16, D = 128) at 4K, 32K, 256K and 1M tokens of
#                        context, batch 1 and 8: dilated (Triton decode kernel) vs dense SDPA on the
#                        same cache; the serving step (append + attend, dilated_attention_with_kvcache)
#                        contiguous, paged, FP8, and compiled + captured in a CUDA graph (replay
#                        timed); indexed attention's serve door (top-2048 of the context); host time per
#                        call; FP8 error (python -m triton_dilated.perf decode -> decode.csv).
#   6c. indexed (25 s)   indexed attention (DeepSeek's top-2048 per query, causal, bf16, H = 16, D = 128)
#                        fwd and fwd+bwd at N = 16K: its Triton kernels against the PyTorch gather and
#                        dense SDPA, with the efficiency (speedup x density) (python -m triton_dilated.perf
#                        sweep --ops indexed -> indexed.csv)
#   7. tests (140 s)     the test suite on CUDA with compiled kernels, bf16 included, 12 xdist
#                        workers (TRITON_DILATED_TEST_DEVICE=cuda), without the gloo-process tests
#                        (their children run the interpreter: CPU CI's) -> tests.log, tests.xml.
#                        The stages before it have limits near twice what the first H100 run took
#                        (perf/results/h100-80gb-hbm3.csv); the suite took all 80 s it had then
#   then the result tables, and every result row in one file named after the card
#   (perf/gpu_results.py -> OUTDIR/<card>.csv, e.g. h100-80gb-hbm3.csv: commit it as perf/results/<card>.csv).
#   The card's own defaults run everywhere (configs pick per arch: B200, H200, MI300 alike; ROCm: rocm-smi).
# Python: $PYTHON if set, else python, else python3 on PATH.
# Without a CUDA GPU (and without --dry-run) it stops at once: exit 2, before creating OUTDIR.
# Exit status: 0 when every stage exited 0, 3 when the smoke test failed, else 1.
# Files in OUTDIR: gpu_check.log (everything), stages.csv (stage, exit, seconds, limit), env.txt
# and the files named above.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
OUT=${1:?usage: perf/gpu_check.sh [--dry-run] OUTDIR}
PY=${PYTHON:-$(command -v python || command -v python3)} || {
  echo "gpu_check.sh: neither python nor python3 is on PATH (or set PYTHON); nothing was run." >&2
  exit 2
}
if [ "$DRY" = 0 ]; then
  # no CUDA GPU: stop before anything else (every stage would fail or time the CPU instead)
  if ! timeout -k 5 30 "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: no CUDA GPU visible to torch (torch.cuda.is_available() is False, or torch failed to import):" >&2
    echo "this script runs the tests with compiled Triton kernels and times them on a GPU; nothing was run." >&2
    echo "On a CPU: perf/gpu_check.sh --dry-run OUTDIR (the stages' logic at tiny shapes), python -m pytest tests" >&2
    echo "(interpreter), python -m triton_dilated.perf (portable-backend sweep)." >&2
    exit 2
  fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MPLBACKEND=Agg
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1            # the kernels run in Triton's interpreter on the CPU
  unset TRITON_DILATED_TEST_DEVICE
  # tiny shapes: the stages' logic, not their numbers
  SHAPE=(--seqlen 128 --heads 1 --head-dim 16 --dtype float32)
  KEY_ARGS=("${SHAPE[@]}" --quick)
  BREAKDOWN_ARGS=("${SHAPE[@]}" --iters 1)
  CONFIG_ARGS=("${SHAPE[@]}" --quick --causal yes --fwd-configs 16,16,4,1 --bwd-configs 16,16,4,1)
  FLEX_ARGS=("${SHAPE[@]}" --block-size 32 --quick)
  RING_ARGS=("${SHAPE[@]}" --worlds 2 --ulysses-backend torch)
  DECODE_ARGS=(--contexts 128 --batch 1 2 --heads 1 --head-dim 16 --dtype float32 --budget 0.05
               --providers dilated dilated_kvcache dilated_kvcache_paged_fp8 dilated_kvcache_graph indexed_kvcache
               sdpa_dense)
  INDEXED_ARGS=(--tiny --seqlens 64 --budget 0)
  TEST_ARGS=(tests/perf/test_perf.py -k "plan_cli")
  SCALE=${GPU_CHECK_DRY_SCALE:-4}      # the interpreter on a shared CPU: longer limits
else
  unset TRITON_INTERPRET
  export TRITON_DILATED_TEST_DEVICE=cuda
  KEY_ARGS=()
  BREAKDOWN_ARGS=()
  CONFIG_ARGS=()
  FLEX_ARGS=()
  RING_ARGS=()
  DECODE_ARGS=(--contexts 4096 32768 262144 1048576 --batch 1 8 --budget 0.2
               --providers dilated dilated_kvcache dilated_kvcache_paged dilated_kvcache_fp8 dilated_kvcache_paged_fp8
               dilated_kvcache_graph dilated_bounded indexed_kvcache sdpa_dense)
  INDEXED_ARGS=(--seqlens 16384 --budget 0.2)
  # CPU-only suites (the gloo ring processes, notebooks, the ahead-of-time compile) run in CI:
  # not here, where the ring children would fall back to the slow interpreter and the real
  # compiles make the AOT one redundant. The ring step kernels do run here.
  TEST_ARGS=(tests --ignore=tests/repo/test_notebooks.py --ignore=tests/perf/test_aot.py
             --ignore=tests/repo/test_gpu_check.py
             -m "not gloo" -k "not (ring_matches_oracle or memory_falls or failing_rank or sequence_parallel)")
  SCALE=1
fi
if [ -z "${TRITON_DILATED_GIT_SHA:-}" ]; then
  TRITON_DILATED_GIT_SHA=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  export TRITON_DILATED_GIT_SHA
fi
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

T_START=$(date +%s)
FAILED=0
echo "stage,exit,seconds,limit" > "$OUT/stages.csv"
# stage NAME LIMIT_SECONDS COMMAND...: run under timeout; record exit code and duration
stage() {
  local name=$1 limit=$(( $2 * SCALE ))
  shift 2
  echo
  echo "== $name (limit ${limit}s, $(( $(date +%s) - T_START ))s elapsed) =="
  local t0 rc
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@"
  rc=$?
  local note=""
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && note=" (timed out)"
  [ "$rc" -ne 0 ] && FAILED=1
  echo "$name,$rc,$(( $(date +%s) - t0 )),$limit" >> "$OUT/stages.csv"
  echo "== $name: exit $rc$note after $(( $(date +%s) - t0 ))s =="
  return "$rc"
}

smoke() {
  if [ "$DRY" = 0 ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit \
        --format=csv || true
    else   # ROCm (torch.cuda is HIP there)
      rocm-smi --showproductname --showclocks --showpower --showmeminfo vram 2>/dev/null || echo "no nvidia-smi or rocm-smi"
    fi
  fi
  echo "git sha: $TRITON_DILATED_GIT_SHA; python: $PY"
  "$PY" perf/gpu_smoke.py
}
export -f smoke
export DRY PY TRITON_DILATED_GIT_SHA
if ! stage smoke 25 bash -c 'smoke > "$0/env.txt" 2>&1; rc=$?; cat "$0/env.txt"; exit $rc' "$OUT"; then
  echo
  echo "gpu_check.sh: the toolchain smoke test failed (see above and $OUT/env.txt): Triton kernels cannot be"
  echo "launched here, so no stage after it would measure anything. Fix that and run again."
  exit 3
fi

stage key 60 "$PY" perf/gpu_key_rows.py --out "$OUT/key_rows.csv" "${KEY_ARGS[@]}"
stage breakdown 25 "$PY" perf/kernel_breakdown.py --out "$OUT/kernel_breakdown.csv" "${BREAKDOWN_ARGS[@]}"
stage configs 65 "$PY" perf/config_ab.py --out "$OUT/config_ab.csv" "${CONFIG_ARGS[@]}"
stage flex 45 "$PY" perf/block_sparse_vs_flex.py --out "$OUT/block_sparse_vs_flex.csv" "${FLEX_ARGS[@]}"
stage ringstep 15 bash -c '"$1" perf/ring_step_vs_dense.py "${@:2}" > "$0/ring_step_vs_dense.txt" 2>&1; rc=$?;
  cat "$0/ring_step_vs_dense.txt"; exit $rc' "$OUT" "$PY" "${RING_ARGS[@]}"
stage decode 35 "$PY" -m triton_dilated.perf decode --out "$OUT/decode.csv" --memory-contexts --max-call-seconds 5 \
  "${DECODE_ARGS[@]}"
stage indexed 25 "$PY" -m triton_dilated.perf sweep --ops indexed --providers triton gather sdpa_dense --no-plot \
  --overwrite --out "$OUT/indexed.csv" "${INDEXED_ARGS[@]}"

# the test suite last: its GPU-only value (compiled bf16 numerics, bounds) is real, but compile
# errors are already excluded by the ahead-of-time check in CPU CI
PYTEST_ARGS=(-q -p no:cacheprovider -o addopts= -rfEs --maxfail=25 --durations=15 --junitxml="$OUT/tests.xml")
if [ "$DRY" = 0 ]; then
  "$PY" -c "import xdist" 2>/dev/null && PYTEST_ARGS+=(-n 12)
  "$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout=100)
fi
stage tests 140 "$PY" -m pytest "${TEST_ARGS[@]}" "${PYTEST_ARGS[@]}" > "$OUT/tests.log" 2>&1
tail -40 "$OUT/tests.log"

echo
echo "== results =="
TABLE_IN=()
for f in key_rows.csv block_sparse_vs_flex.csv; do
  [ -s "$OUT/$f" ] && TABLE_IN+=("$OUT/$f")
done
if [ ${#TABLE_IN[@]} -gt 0 ]; then
  timeout -k 5 $(( 20 * SCALE )) bash -c '"$0" -m triton_dilated.perf table "${@:2}" || echo "(table failed)"
    "$0" perf/gpu_results.py "$1" || echo "(combining the result CSVs failed)"' "$PY" "$OUT" "${TABLE_IN[@]}"
else
  echo "no result CSVs were written"
fi
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -1 | sed 's/^/tests: /'
echo
column -s, -t < "$OUT/stages.csv" 2>/dev/null || cat "$OUT/stages.csv"
echo "total $(( $(date +%s) - T_START ))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
