#!/usr/bin/env bash
# The GPU checks of ppma on a machine with an NVIDIA GPU, a CUDA build of torch and the CUDA toolkit (nvcc), in steps
# that can be run one by one (benchmarks/README.md gives the order and what each step needs). Run from anywhere:
#
#   bash benchmarks/gpu_check.sh env          # GPU, driver, python, torch, nvcc and the packages the tests import
#   bash benchmarks/gpu_check.sh build        # pip install --no-build-isolation -e . with the CUDA kernels, then a
#                                             # smoke test of every op on the GPU
#   bash benchmarks/gpu_check.sh test         # the CUDA cases of the op tests and tests/test_cuda_paths.py
#   bash benchmarks/gpu_check.sh test-full    # the same with PPMA_TEST_FULL=1 (the long sweeps)
#   bash benchmarks/gpu_check.sh test-cpu     # the CPU op tests with the same build
#   bash benchmarks/gpu_check.sh bench-quick  # op table, one shape per op
#   bash benchmarks/gpu_check.sh bench        # the whole op table -> <results>/ops_gpu_<gpu>.{md,json}
#   bash benchmarks/gpu_check.sh models [NAMES...]  # ppma-benchmark (default ppma_tiny ppma_small ppma_base), batch
#                                             # 64, 224^2, AMP fp16, fused vs reference, inference and training
#                                             # -> <results>/model_gpu_<gpu>_fp16_b64_224[_NAMES].{md,json}
#   bash benchmarks/gpu_check.sh all          # benchmarks/gpu_run.sh: build, next kernels against the verified
#                                             # ones, CUDA graphs, kernel times, model and op tables in <= 8 min
#                                             # -> <results>/gpu_run_<gpu>/
#
# Options (environment variables):
#   PPMA_RESULTS_DIR   where the tables and the step logs go (default: benchmarks/results; logs in <results>/logs/)
#   PYTHON             the Python to use (default: python3)
#   MAX_JOBS           parallel compile jobs of the build step (default: the number of CPU cores)
#   TORCH_CUDA_ARCH_LIST  GPU architectures to build for (default: the visible GPU's, e.g. 9.0 on an H100)
#   PPMA_BUILD_INPLACE=1  build step: python setup.py build_ext --inplace instead of an editable pip install
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${PPMA_RESULTS_DIR:-benchmarks/results}
LOGS="$RESULTS/logs"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step=${1:-}
shift || true

log() {  # log <name> <command...>: run the command, tee its output into <results>/logs/<name>.log, keep its status
  mkdir -p "$LOGS"
  "${@:2}" 2>&1 | tee "$LOGS/$1.log"
  return "${PIPESTATUS[0]}"
}

require_cuda_build() {  # the later steps need ppma._C with its CUDA kernels
  "$PY" -c "import ppma, ppma._ext as e, sys; sys.exit(0 if e.has_cuda_kernels() else 1)" || {
    echo "gpu_check: ppma._C has no CUDA kernels (or does not load): run 'bash benchmarks/gpu_check.sh build' first" >&2
    exit 1
  }
}

gpu_tag() {  # the GPU's name in the stable result file names (ppma.timing.machine_tag: "NVIDIA H200" -> H200)
  "$PY" -c "from ppma.timing import machine_tag; print(machine_tag('cuda'))"
}

case "$step" in
  env)
    log env bash -c "nvidia-smi; $PY -V; which nvcc && nvcc --version | tail -2; \
      $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'; \
      $PY -m pip list 2>/dev/null | grep -iE '^(torch|triton|timm|numpy|pyyaml|pytest|hypothesis|expecttest|safetensors|mmengine|setuptools|ninja) '"
    ;;
  build)
    if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
      # only the GPU at hand: half the device code (and compile time) of the default 8.0;9.0
      TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || exit 1
    fi
    export TORCH_CUDA_ARCH_LIST MAX_JOBS=${MAX_JOBS:-$(nproc)}
    echo "build: TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
    start=$(date +%s)
    if [ "${PPMA_BUILD_INPLACE:-0}" = 1 ]; then
      log build "$PY" setup.py build_ext --inplace || { tail -60 "$LOGS/build.log"; exit 1; }
    else
      log build "$PY" -m pip install --no-build-isolation -e . || { tail -60 "$LOGS/build.log"; exit 1; }
    fi
    echo "build: $(( $(date +%s) - start )) s" | tee -a "$LOGS/build.log"
    require_cuda_build
    # C++ errors must reach Python as exceptions: an extension linked against another C++ runtime than torch's
    # (e.g. a compiler wrapper that links libstdc++ statically) crashes on the first error instead
    if ! "$PY" -c "
import torch, ppma
q = torch.randn(1, 2, 2, 1, 16)
try:
    torch.ops.ppma.polyline_attention(q, q, q, q[..., 0, :0], q[..., 0, :0], 0.1)
except RuntimeError:
    pass
" ; then
      echo "gpu_check: ppma._C crashed on a C++ error instead of raising it: rebuild with the system compiler that" \
           "torch was built with, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++ bash benchmarks/gpu_check.sh build" >&2
      exit 1
    fi
    log build-smoke "$PY" -c "
import torch, ppma
q = torch.randn(1, 4, 5, 2, 32, device='cuda', dtype=torch.bfloat16)
la = -torch.rand(1, 4, 5, 2, device='cuda')
out = ppma.ops.polyline_attention(q, q, q, la, la)
out2 = ppma.ops.criss_cross_attention(q, q, q, la, la)
out3 = ppma.ops.polyline_linear_attention(q.abs(), q.abs(), q, la, la)
torch.cuda.synchronize()
print('smoke ok', out.shape, out2.shape, out3.shape, *(float(o.float().abs().sum()) for o in (out, out2, out3)))
"
    ;;
  test | test-full)
    require_cuda_build
    [ "$step" = test-full ] && export PPMA_TEST_FULL=1
    # the CUDA cases of the device-parametrised op tests (ids with "cuda") and every test of tests/test_cuda_paths.py
    # (tensor-core path, launch limits, packed lines)
    files=$(ls tests/test_cuda_paths.py tests/test_polyline_attention.py tests/test_criss_cross_attention.py \
      tests/test_polyline_scan.py tests/test_polyline_linear_attention.py 2>/dev/null | tr '\n' ' ')
    log "$step" "$PY" -m pytest -q -rs --durations=15 $files -k cuda
    ;;
  test-cpu)
    require_cuda_build
    files=$(ls tests/test_polyline_attention.py tests/test_criss_cross_attention.py tests/test_polyline_scan.py \
      tests/test_polyline_linear_attention.py tests/test_reference.py 2>/dev/null | tr '\n' ' ')
    log test-cpu "$PY" -m pytest -q -rs $files -k "not cuda"
    ;;
  bench-quick)
    require_cuda_build
    log bench-quick "$PY" benchmarks/bench_gpu.py --quick --out "$RESULTS/ops_gpu_quick_$(gpu_tag)"
    ;;
  bench)
    require_cuda_build
    log bench "$PY" benchmarks/bench_gpu.py --out "$RESULTS/ops_gpu_$(gpu_tag)"
    ;;
  models)
    require_cuda_build
    names=${*:-ppma_tiny ppma_small ppma_base}
    out="$RESULTS/model_gpu_$(gpu_tag)_fp16_b64_224"
    [ $# -gt 0 ] && out="${out}_$(echo "$names" | tr ' ' '-')"
    log models "$PY" -m ppma.train.cli.benchmark --model $names --amp fp16 --batch-size 64 --img-size 224 \
      --warmup 10 --iters 30 --output "$out"
    ;;
  all)
    tagname=$(gpu_tag 2>/dev/null || echo gpu)
    PYTHON="$PY" bash benchmarks/gpu_run.sh "$RESULTS/gpu_run_${tagname}"   # one stable folder per GPU, overwritten
    ;;
  *)
    sed -n '2,25p' "$0"
    exit 2
    ;;
esac
