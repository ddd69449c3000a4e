#!/usr/bin/env bash
# Compile check of the CUDA code without a GPU.
#  1. every csrc/kernels/*.cuh in a translation unit of its own, with its templates explicitly instantiated for
#     float / half / bfloat16 / double and the head-dim paths, with ptxas' resource report (-Xptxas -v):
#     registers, spills and shared memory of every kernel are printed, and a register spill in a tensor-core,
#     packed or linear-attention kernel (the kernels written to fit the register file) fails the check. sm_90
#     compiles every kernel; sm_80 the register-budgeted ones only (those that must not spill), whose registers
#     differ by architecture: the others take the same code on both (no __CUDA_ARCH__ branch between 800 and 900),
#     so a second compile of them would check nothing new (PPMA_CHECK_CUDA_SM80_ALL=1 compiles them too);
#  2. the host launchers csrc/cuda/*.cu against the installed torch's headers: the whole translation unit through
#     nvcc's front end, the device code to sm_90 PTX only, unoptimised (-Xcicc -O0, no ptxas): step 1 compiled
#     those kernels already, so this step checks the host code (3.6x faster than a full sm_90 compile); the host
#     compiler checks the host code without generating it (-fsyntax-only: about 10 s less per launcher).
# Non-zero on any compile error or unexpected spill. A check that cannot run is reported as SKIPPED, never as
# passed ("CUDA compile check: SKIPPED (nvcc missing)"), and appended to the file $PPMA_CI_SKIPS when set (.ci/run
# prints those at the end); under CI=true a missing nvcc fails unless PPMA_ALLOW_NO_CUDA=1.
# PPMA_CHECK_CUDA_ONLY=<glob> restricts step 1 to matching headers (e.g. 'polyline_attention_tc*') and skips step 2.
set -uo pipefail
shopt -s extglob
cd "$(dirname "$0")/.."
skipped() {  # skipped <what> <why>: report a check that could not run
  echo "$1: SKIPPED ($2)"
  if [ -n "${PPMA_CI_SKIPS:-}" ]; then echo "$1: SKIPPED ($2)" >>"$PPMA_CI_SKIPS"; fi
}
if ! command -v nvcc >/dev/null 2>&1; then
  skipped "CUDA compile check" "nvcc missing"
  if [ "${CI:-}" = true ] && [ "${PPMA_ALLOW_NO_CUDA:-0}" != 1 ]; then
    echo "check_cuda: CI=true and nvcc is missing: failing (set PPMA_ALLOW_NO_CUDA=1 on a CI machine without CUDA)"
    exit 1
  fi
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
JOBS=${MAX_JOBS:-2}
NVFLAGS=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -lineinfo -Icsrc/kernels -Icsrc -Werror cross-execution-space-call
         -Xptxas -v)
fail=0

# double is compiled by the launchers (sm_90); the kernel TUs cover the fp32/fp16/bf16 paths on both archs
DT="float __half __nv_bfloat16"
DP="16 32 64 128 256 512"
TC_DT="__half __nv_bfloat16"
TC_DP="16 32 64 128"
# kernels that must not spill (ptxas -v), and the spills that are known and accepted (kernel-name regex)
NO_SPILL='polyline_attention_tc_|criss_cross_pack_|criss_cross_tc_|polyline_linear_attention_'
# 8-36 bytes: dK and dV accumulators of 16 x 128 (the verified dkdv kernel and the row-uniform one, both forms)
SPILL_OK='polyline_attention_tc_(ru_)?dkdv_kernel<[_a-z0-9]+, 128(, (true|false))?>'
# the headers of register-budgeted kernels, compiled for sm_80 too; budgeted_only <arch>: whether <arch> compiles
# those kernels alone
budgeted_only() { [ "$1" = sm_80 ] && [ "${PPMA_CHECK_CUDA_SM80_ALL:-0}" != 1 ]; }
SM80_HEADERS='polyline_attention_tc*.cuh|criss_cross_attention*.cuh|polyline_linear_attention*.cuh|warp_mma.h'
gen() {  # gen <header> <arch> -> instantiation TU on stdout
  local h=$1 arch=$2
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
    polyline_attention_tc.cuh)
      for t in $TC_DT; do for d in $TC_DP; do
        echo "template void launch_polyline_attention_tc_fwd<$t, $d>(const PolylineAttnParams<$t, float>&, cudaStream_t);"
        echo "template void launch_polyline_attention_tc_bwd<$t, $d>(const PolylineAttnParams<$t, float>&, cudaStream_t);"
      done; done ;;
    polyline_attention_tc_bwd2.cuh)  # the row-uniform backward (cuda_next_polyline_attention)
      for t in $TC_DT; do for d in $TC_DP; do
        echo "template void launch_polyline_attention_tc_bwd_next<$t, $d>(const PolylineAttnParams<$t, float>&, cudaStream_t);"
      done; done ;;
    polyline_attention_tc_fwd2.cuh)  # the row-uniform forward (cuda_next_polyline_attention), both forms
      for t in $TC_DT; do for d in $TC_DP; do
        for two in false true; do
          echo "template __global__ void polyline_attention_tc_ru_fwd_kernel<$t, $d, $two>(PolylineAttnParams<$t, float>);"
        done
      done; done ;;
    warp_mma.h)
      echo "static_assert(sizeof(uint32_t) == 4, \"\");" ;;
    criss_cross_attention.cuh)
      if budgeted_only "$arch"; then  # the packed kernels
        for t in $DT; do for d in 16 32; do
          for m in 0 1 2; do
            echo "template __global__ void criss_cross_pack_fwd_kernel<$t, $d, $m>(CrissCrossParams<$t, float>, int);"
          done
          for rf in "true, false" "false, true" "true, true"; do
            echo "template __global__ void criss_cross_pack_bwd_kernel<$t, $d, $rf>(CrissCrossParams<$t, float>, LineBwdIO<float>, int);"
          done
        done; done
      else
        for t in $DT; do for d in $DP; do
          echo "template void launch_criss_cross_fwd<$t, $d>(const CrissCrossParams<$t, AccType<$t>::type>&, cudaStream_t);"
          echo "template void launch_criss_cross_bwd<$t, $d>(const CrissCrossParams<$t, AccType<$t>::type>&, cudaStream_t);"
        done; done
      fi ;;
    criss_cross_attention_tc.cuh)  # the tensor-core kernels alone (their launchers fall back on the header above),
      for t in $TC_DT; do for d in 16 32; do for z in "$t" float; do  # with 16-bit and fp32 scratch
        for m in 0 1 2; do
          echo "template __global__ void criss_cross_tc_fwd_kernel<$t, $d, $m, $z>(CrissCrossParams<$t, float>, CcTcIO<$z>);"
        done
        for rf in "true, false" "false, true" "true, true"; do
          echo "template __global__ void criss_cross_tc_bwd_kernel<$t, $d, $rf, $z>(CrissCrossParams<$t, float>, CcTcIO<$z>);"
        done
      done; done; done ;;
    polyline_scan.cuh)
      for t in $DT; do
        A="AccType<$t>::type"
        echo "template void launch_polyline_scan_fwd<$t>(const GridSizes&, bool, const $t*, const Strides4&, const $A*, const $A*, const ScanScratch<$A>&, $t*, cudaStream_t);"
        echo "template void launch_polyline_scan_bwd<$t>(const GridSizes&, bool, const $t*, const Strides4&, const $t*, const Strides4&, const $A*, const $A*, const ScanScratch<$A>&, $t*, $A*, $A*, cudaStream_t);"
      done ;;
    polyline_linear_attention.cuh)  # double too: its scan kernels are reported and spill-checked like fp32's
      for t in $DT double; do
        A="AccType<$t>::type"
        echo "template void launch_polyline_linear_attention_fwd<$t, $A>(const LinearAttnParams<$t, $A>&, cudaStream_t);"
        echo "template void launch_polyline_linear_attention_bwd<$t, $A>(const LinearAttnParams<$t, $A>&, cudaStream_t);"
      done ;;
    polyline_linear_attention_v2.cuh)  # the next kernels (cuda_next_polyline_linear_attention), double too
      for t in $DT double; do
        A="AccType<$t>::type"
        echo "template void launch_polyline_linear_attention_v2_fwd<$t, $A>(const LinearAttnParams<$t, $A>&, const LinV2Plan&, cudaStream_t);"
        echo "template void launch_polyline_linear_attention_v2_bwd<$t, $A>(const LinearAttnParams<$t, $A>&, const LinV2Plan&, cudaStream_t);"
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
  ( t0=$(date +%s); "${@:2}" >"$TMP/$1.log" 2>&1; echo $? >"$TMP/$1.rc"; echo $(( $(date +%s) - t0 )) >"$TMP/$1.s" ) &
  names+=("$1")
}

start=$(date +%s)
for path in csrc/kernels/*.cuh csrc/kernels/*.h; do
  h=$(basename "$path")
  # shellcheck disable=SC2053
  [ -n "${PPMA_CHECK_CUDA_ONLY:-}" ] && [[ $h != ${PPMA_CHECK_CUDA_ONLY} ]] && continue
  for arch in sm_80 sm_90; do
    # shellcheck disable=SC2053
    if budgeted_only "$arch" && ! [[ $h == @($SM80_HEADERS) ]]; then
      continue
    fi
    gen "$h" "$arch" >"$TMP/${h}.${arch}.cu"
    run "${h}.${arch}" nvcc "${NVFLAGS[@]}" -arch="$arch" -c "$TMP/${h}.${arch}.cu" -o "$TMP/${h}.${arch}.o"
  done
done

# Launchers: torch's include paths. A CPU build of torch ships c10/cuda and ATen/cuda headers but not the
# generated c10/cuda/impl/cuda_cmake_macros.h; a one-line shim stands in for it (it only sets the
# shared-library export macro), so the launchers are compiled against the real headers.
TORCH_INC=$(python -c "import torch.utils.cpp_extension as c; print(' '.join(c.include_paths()))" 2>/dev/null)
if [ -n "${PPMA_CHECK_CUDA_ONLY:-}" ]; then
  skipped "CUDA launcher compile check" "PPMA_CHECK_CUDA_ONLY set"
elif [ -z "$TORCH_INC" ]; then
  skipped "CUDA launcher compile check" "torch not importable"
else
  first=${TORCH_INC%% *}
  if [ ! -f "$first/c10/cuda/CUDAGuard.h" ] || [ ! -f "$first/ATen/Dispatch.h" ]; then
    skipped "CUDA launcher compile check" "torch's headers have no c10/cuda"
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
      run "$n.sm_90" nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DPPMA_WITH_CUDA \
        -gencode arch=compute_90,code=compute_90 -Xcicc -O0 \
        -Xcompiler -fPIC -Xcompiler -fsyntax-only -diag-suppress 3306 -Xcompiler -Wno-c++20-extensions \
        "${INC[@]}" -c "$cu" -o "$TMP/$n.o"
    done
  fi
fi
wait

# ptxas resource report: "kernel | arch | registers | spill stores/loads | static smem"
report() {  # report <log> <arch>
  python3 - "$1" "$2" "$NO_SPILL" "$SPILL_OK" <<'PY'
import re, subprocess, sys
log, arch, no_spill, spill_ok = sys.argv[1:5]
text = open(log).read().splitlines()
names, rows, cur, spill = [], [], None, (0, 0)
for line in text:
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
        cur = m.group(1)
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        spill = (int(m.group(1)), int(m.group(2)))
        continue
    m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
    if m and cur:
        names.append(cur)
        rows.append((int(m.group(1)), spill, int(m.group(2) or 0)))
        cur, spill = None, (0, 0)
if not names:
    sys.exit(0)
dem = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
bad = 0
for raw, d, (regs, (st, ld), smem) in zip(names, dem, rows):
    d = re.sub(r"\(.*", "", d or raw).replace("ppma::", "").replace("void ", "")
    flag = ""
    if (st or ld) and re.search(no_spill, d):
        if re.search(spill_ok, d):
            flag = "  (accepted spill)"
        else:
            flag = "  SPILL"
            bad = 1
    print(f"      {d:66s} {arch} regs {regs:3d} spill {st}/{ld} smem {smem}{flag}")
sys.exit(bad)
PY
}

for n in "${names[@]}"; do
  rc=$(cat "$TMP/$n.rc" 2>/dev/null || echo 99)
  warn=$(grep -v "ptxas info" "$TMP/$n.log" | grep -ciE "warning" || true)
  if [ "$rc" != 0 ]; then
    echo "FAIL  $n"
    sed 's/^/      /' "$TMP/$n.log" | head -40
    fail=1
  elif [ "$warn" != 0 ]; then
    echo "WARN  $n ($warn warnings)"
    grep -v "ptxas info" "$TMP/$n.log" | grep -iE -A3 "warning" | head -20 | sed 's/^/      /'
  else
    echo "ok    $n ($(cat "$TMP/$n.s" 2>/dev/null || echo ?) s)"
  fi
  case "$n" in
    *.cuh.sm_*|*.h.sm_*)
      if ! report "$TMP/$n.log" "${n##*.}"; then
        echo "FAIL  $n: register spill in a kernel that must not spill"
        fail=1
      fi ;;
  esac
done
echo "check_cuda: $(( $(date +%s) - start )) s"
if [ "$fail" = 0 ]; then echo "CUDA compile check: passed"; else echo "CUDA compile check: FAILED"; fi
exit $fail
