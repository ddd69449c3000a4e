#!/usr/bin/env bash
# GPU checks of ppma in steps, each meant to finish well inside one 10-minute command on a bare GPU machine
# (python3 with a CUDA build of torch, nvcc, timm and triton; no network). Every step tees its log into $OUT
# (default ./gpu_out). benchmarks/README.md lists the order of the steps and how to run them.
#
#   bash benchmarks/gpu_check.sh env          # GPU, driver, python3, torch, nvcc, packages the tests import
#   bash benchmarks/gpu_check.sh build        # builds ppma._C for sm_90 (MAX_JOBS=16) in place, smoke-tests it, and
#                                             # saves the library as $OUT/ppma_C.tgz: later steps unpack
#                                             # .gpu/ppma_C.tgz when ppma/_C*.so is missing, so a later call can
#                                             # carry the archive instead of rebuilding
#   bash benchmarks/gpu_check.sh test         # the CUDA op tests (default sweep)
#   bash benchmarks/gpu_check.sh test-full    # the same with PPMA_TEST_FULL=1
#   bash benchmarks/gpu_check.sh test-cpu     # the CPU op tests on that machine (the same build)
#   bash benchmarks/gpu_check.sh bench-quick  # op table, one shape per op
#   bash benchmarks/gpu_check.sh bench        # the whole op table -> benchmarks/results/ops_<gpu>_<versions>.{md,json}
#   bash benchmarks/gpu_check.sh models [NAMES...]  # ppma-benchmark (default ppma_tiny ppma_small ppma_base), batch
#                                             # 64, 224^2, AMP fp16, fused vs reference, inference and training
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step=${1:-}
shift || true

log() {  # log <name> <command...>: run, tee into $OUT/<name>.log, keep the command's exit status
  "${@:2}" 2>&1 | tee "$OUT/$1.log"
  return "${PIPESTATUS[0]}"
}

ensure_lib() {  # ppma/_C*.so from a carried archive (the build step's $OUT/ppma_C.tgz copied to .gpu/)
  if ! ls ppma/_C*.so >/dev/null 2>&1; then
    if [ -f .gpu/ppma_C.tgz ]; then
      tar -xzf .gpu/ppma_C.tgz
    else
      echo "gpu_check: no ppma/_C*.so and no .gpu/ppma_C.tgz: run the build step first" >&2
      exit 1
    fi
  fi
  "$PY" -c "import ppma, ppma._ext as e, sys; sys.exit(0 if e.has_cuda_kernels() else 1)" || {
    echo "gpu_check: ppma._C has no CUDA kernels (or does not load)" >&2
    exit 1
  }
}

gpu_tag() {
  "$PY" -c "import re, torch; n = torch.cuda.get_device_name(); print(re.sub(r'[^A-Za-z0-9.+-]+', '-', n))"
}

case "$step" in
  env)
    log env bash -c "nvidia-smi; $PY -V; which nvcc && nvcc --version | tail -2; \
      $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'; \
      $PY -m pip list 2>/dev/null | grep -iE '^(torch|triton|timm|numpy|pyyaml|pytest|hypothesis|expecttest|safetensors|mmengine|setuptools|ninja) '"
    ;;
  build)
    # TORCH_CUDA_ARCH_LIST=9.0: only the GPU at hand (H100 / H200), half the device code of the default 8.0;9.0
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
    start=$(date +%s)
    log build "$PY" setup.py build_ext --inplace || { tail -60 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"
    strip --strip-debug ppma/_C*.so 2>/dev/null || true
    ls -l ppma/_C*.so | tee -a "$OUT/build.log"
    tar -czf "$OUT/ppma_C.tgz" ppma/_C*.so
    ls -l "$OUT/ppma_C.tgz" | tee -a "$OUT/build.log"
    ensure_lib
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
    ensure_lib
    [ "$step" = test-full ] && export PPMA_TEST_FULL=1
    # the CUDA cases of the device-parametrised op tests (ids with "cuda"), every test of tests/test_cuda_paths.py
    # (tensor-core path, launch limits, packed lines), and the models on CUDA where tests/test_models.py has them
    files=$(ls tests/test_cuda_paths.py tests/test_polyline_attention.py tests/test_criss_cross_attention.py \
      tests/test_polyline_scan.py tests/test_polyline_linear_attention.py 2>/dev/null | tr '\n' ' ')
    log "$step" "$PY" -m pytest -q -rs --durations=15 $files -k cuda
    ;;
  test-cpu)
    ensure_lib
    files=$(ls tests/test_polyline_attention.py tests/test_criss_cross_attention.py tests/test_polyline_scan.py \
      tests/test_polyline_linear_attention.py tests/test_reference.py 2>/dev/null | tr '\n' ' ')
    log test-cpu "$PY" -m pytest -q -rs $files -k "not cuda"
    ;;
  bench-quick)
    ensure_lib
    log bench-quick "$PY" benchmarks/bench_gpu.py --quick --out "$OUT/ops-quick_$(gpu_tag)"
    ;;
  bench)
    ensure_lib
    log bench "$PY" benchmarks/bench_gpu.py
    cp benchmarks/results/ops_*"$(gpu_tag)"* "$OUT/" 2>/dev/null
    ;;
  models)
    ensure_lib
    names=${*:-ppma_tiny ppma_small ppma_base}
    out="benchmarks/results/throughput_$(gpu_tag)_fp16_b64"
    [ $# -gt 0 ] && out="${out}_$(echo "$names" | tr ' ' '-')"
    log models "$PY" -m ppma.train.cli.benchmark --model $names --amp fp16 --batch-size 64 --img-size 224 \
      --warmup 10 --iters 30 --output "$out"
    cp "$out".* "$OUT/" 2>/dev/null
    ;;
  *)
    sed -n '2,21p' "$0"
    exit 2
    ;;
esac
