#!/usr/bin/env bash
# One call on a GPU machine (bare, no network; torch with CUDA, timm, triton preinstalled):
# build ppma with its CUDA kernels, run the CUDA and CPU op tests, then the GPU benchmark.
# Logs and results go to $OUT (default ./gpu_out) and the table to benchmarks/results/ops-<gpu>.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
python -c "import ppma, ppma._ext as e; print('cuda kernels:', e.has_cuda_kernels())" | tee -a "$OUT/env.txt"
python -m pytest -q tests/test_ops_cuda.py 2>&1 | tee "$OUT/test_ops_cuda.log" | tail -30
ls tests/test_ops*.py >/dev/null 2>&1 && python -m pytest -q $(ls tests/test_ops*.py | grep -v cuda) 2>&1 | tee "$OUT/test_ops_cpu.log" | tail -5
gpu=$(python -c "import torch; n=torch.cuda.get_device_name().lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else n.split()[-1])")
python benchmarks/bench_gpu.py --out "$OUT/ops-$gpu.md" 2>&1 | tee "$OUT/bench.log" | tail -40
mkdir -p benchmarks/results && cp "$OUT/ops-$gpu.md" "benchmarks/results/ops-$gpu.md" 2>/dev/null
echo "results in $OUT"
