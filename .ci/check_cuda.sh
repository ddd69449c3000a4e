#!/usr/bin/env bash
# Compile check of the CUDA code without a GPU.
#  1. every csrc/kernels/*.cuh in a translation unit of its own, with its templates explicitly instantiated for
#     float / half / bfloat16 / double and the head-dim paths, for sm_80 and sm_90;
#  2. the host launchers csrc/cuda/*.cu against the installed torch's headers (sm_90 only).
# Exits 0 with a note when nvcc is missing; non-zero on any compile error.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda: nvcc not on PATH; CUDA compile check skipped"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
JOBS=${MAX_JOBS:-2}
NVFLAGS=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -lineinfo -Icsrc/kernels -Icsrc -Werror cross-execution-space-call)
fail=0

# double is compiled by the launchers (sm_90); the kernel TUs cover the fp32/fp16/bf16 paths on both archs
DT="float __half __nv_bfloat16"
DP="16 32 64 128"
gen() {  # gen <header> -> instantiation TU on stdout
  local h=$1
  echo "#include \"$h\""
  echo "namespace ppma {"
  case "$h" in
    params.h)
      echo "static_assert(sizeof(Strides4) == 32, \"\");" ;;
    common.cuh)
      for t in float double; do
        echo "template __global__ void prefix_sums_kernel<$t>(PrefixParams<$t>);"
        echo "template __global__ void decay_grad_kernel<$t>(DecayGradParams<$t>);"
      done ;;
    polyline_attention_common.cuh)
      echo "static_assert(AttnTraits<float, 32>::BM == 64, \"\");" ;;
    polyline_attention_fwd.cuh)
      for t in $DT; do for d in $DP; do
        echo "template void launch_polyline_attention_fwd<$t, $d>(const PolylineAttnParams<$t, AccType<$t>::type>&, cudaStream_t);"
      done; done ;;
    polyline_attention_bwd.cuh)
      for t in $DT; do for d in $DP; do
        echo "template void launch_polyline_attention_bwd<$t, $d>(const PolylineAttnParams<$t, AccType<$t>::type>&, cudaStream_t);"
      done; done ;;
    criss_cross_attention.cuh)
      for t in $DT; do for d in $DP; do
        echo "template void launch_criss_cross_fwd<$t, $d>(const CrissCrossParams<$t, AccType<$t>::type>&, cudaStream_t);"
        echo "template void launch_criss_cross_bwd<$t, $d>(const CrissCrossParams<$t, AccType<$t>::type>&, cudaStream_t);"
      done; done ;;
    polyline_scan.cuh)
      for t in $DT; do
        A="AccType<$t>::type"
        echo "template void launch_polyline_scan_fwd<$t>(const GridSizes&, bool, const $t*, const Strides4&, const $A*, const $A*, const ScanScratch<$A>&, $t*, cudaStream_t);"
        echo "template void launch_polyline_scan_bwd<$t>(const GridSizes&, bool, const $t*, const Strides4&, const $t*, const Strides4&, const $A*, const $A*, const ScanScratch<$A>&, $t*, $A*, $A*, cudaStream_t);"
      done ;;
    *)
      echo "// no explicit instantiations known for $h: header compiled for syntax only" >&2 ;;
  esac
  echo "}"
}

pids=()
names=()
run() {  # run <name> <cmd...>: in the background, at most $JOBS at a time
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
  ( "${@:2}" >"$TMP/$1.log" 2>&1; echo $? >"$TMP/$1.rc" ) &
  names+=("$1")
}

start=$(date +%s)
for path in csrc/kernels/*.cuh csrc/kernels/*.h; do
  h=$(basename "$path")
  gen "$h" >"$TMP/${h}.cu"
  for arch in sm_80 sm_90; do
    run "${h}.${arch}" nvcc "${NVFLAGS[@]}" -arch="$arch" -c "$TMP/${h}.cu" -o "$TMP/${h}.${arch}.o"
  done
done

# Launchers: torch's include paths. A CPU build of torch ships c10/cuda and ATen/cuda headers but not the
# generated c10/cuda/impl/cuda_cmake_macros.h; a one-line shim stands in for it (it only sets the
# shared-library export macro), so the launchers are compiled against the real headers.
TORCH_INC=$(python -c "import torch.utils.cpp_extension as c; print(' '.join(c.include_paths()))" 2>/dev/null)
if [ -z "$TORCH_INC" ]; then
  echo "check_cuda: torch not importable; launcher check skipped"
else
  first=${TORCH_INC%% *}
  if [ ! -f "$first/c10/cuda/CUDAGuard.h" ] || [ ! -f "$first/ATen/Dispatch.h" ]; then
    echo "check_cuda: torch's headers have no c10/cuda (CPU-only headers); launcher check skipped"
  else
    INC=(-Icsrc)
    if [ ! -f "$first/c10/cuda/impl/cuda_cmake_macros.h" ]; then
      mkdir -p "$TMP/shim/c10/cuda/impl"
      printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$TMP/shim/c10/cuda/impl/cuda_cmake_macros.h"
      INC+=(-I"$TMP/shim")
      echo "check_cuda: torch has no c10/cuda/impl/cuda_cmake_macros.h (CPU build): using a shim"
    fi
    for d in $TORCH_INC; do INC+=(-I"$d"); done
    for cu in csrc/cuda/*.cu; do
      n=$(basename "$cu")
      run "$n.sm_90" nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DPPMA_WITH_CUDA -arch=sm_90 \
        -Xcompiler -fPIC -diag-suppress 3306 -Xcompiler -Wno-c++20-extensions "${INC[@]}" -c "$cu" -o "$TMP/$n.o"
    done
  fi
fi
wait

for n in "${names[@]}"; do
  rc=$(cat "$TMP/$n.rc" 2>/dev/null || echo 99)
  warn=$(grep -ciE "warning" "$TMP/$n.log" || true)
  if [ "$rc" != 0 ]; then
    echo "FAIL  $n"
    sed 's/^/      /' "$TMP/$n.log" | head -40
    fail=1
  elif [ "$warn" != 0 ]; then
    echo "WARN  $n ($warn warnings)"
    grep -iE -A3 "warning" "$TMP/$n.log" | head -20 | sed 's/^/      /'
  else
    echo "ok    $n"
  fi
done
echo "check_cuda: $(( $(date +%s) - start )) s"
exit $fail
