#!/usr/bin/env bash
# One prepared GPU check (single H100/H200; torch + triton already installed, no network):
#   perf/gpu_check.sh OUTDIR
# 1. the test suite with compiled kernels on CUDA (bf16 included), 2. the GPU benchmark
# sweep. Writes logs and CSVs to OUTDIR and prints a short table last. Runs from the source
# tree (PYTHONPATH), installs nothing. Budget: well under 8 minutes.
set -uo pipefail
OUT=${1:?usage: perf/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DILATED_TEST_DEVICE=cuda
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

echo "== tests (compiled kernels) =="
timeout 300 python -m pytest tests -q -x -p no:cacheprovider -o addopts="" \
  --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -25
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tests.log"

echo "== benchmark sweep =="
timeout 200 python -m triton_dilated.perf --out "$OUT/bench.csv" 2>&1 | tee "$OUT/bench.log" | tail -30
