#!/usr/bin/env bash
# The GPU script (benchmarks/README.md "The GPU script"): on a machine with one NVIDIA GPU (H100 / H200), a CUDA
# build of torch and nvcc, without network, in at most 8 minutes, from anywhere:
#
#   bash benchmarks/gpu_run.sh OUT_DIR            # build, then every part below; tables and logs into OUT_DIR
#   bash benchmarks/gpu_run.sh OUT_DIR --smoke    # CPU smoke run: no build, tiny shapes (also GPU_RUN_SMOKE=1)
#
# Parts, in this order, each a separate process under its own `timeout` (a hang loses that part only), each
# skipped when the run's time budget (GPU_RUN_BUDGET_S, default 470 s) has too little left for it:
#   env        GPU, driver, versions                                     -> env.md, env.log
#   build      python setup.py build_ext --inplace with MAX_JOBS=$(nproc) and TORCH_CUDA_ARCH_LIST of the visible GPU
#              (skipped when ppma._C already loads with its CUDA kernels and matches the sources)
#   check      next kernels (cuda_next_<op> = 1) against the verified ones: out, lse, gradients, determinism
#                                                                        -> check.md / .json (benchmarks/gpu_run.py)
#   graphs     CUDA-graph capture and replay of every op, forward and backward (tests/test_cuda_graphs.py)
#   time       per-launcher times of old and new kernels, CUDA events, and their kernels (profiler) -> time.md
#   models     PPMA-T/S/B, batch 64, 224^2, AMP fp16, fused and reference, eager (ppma-benchmark) -> models_eager.md
#   compiled   PPMA-T under torch.compile (GPU_RUN_COMPILE_MODE, default reduce-overhead: CUDA graphs), fused and
#              reference                                    -> models_compiled_ppma_tiny.md
#   ops        the op table, one shape per op, with the next kernels' rows (bench_gpu.py --quick --next) -> ops.md
#   graphs_model  a small PPMA under torch.compile(mode="reduce-overhead") against eager (tests/test_cuda_graphs.py)
#   compiled   PPMA-S, then PPMA-B, likewise, one process each, as long as the budget lasts
#   summary    every part's status and seconds, and the headline numbers -> summary.md (printed last)
#
# Every table names the GPU. Environment: PYTHON (default python3), MAX_JOBS, TORCH_CUDA_ARCH_LIST,
# GPU_RUN_BUDGET_S, GPU_RUN_COMPILE_MODE, GPU_RUN_FORCE_BUILD=1 (build even when the library is current),
# GPU_RUN_KEEP_CC=1 (build with the environment's CC / CXX instead of /usr/bin/gcc, g++).
set -uo pipefail
RUN_DIR=${1:-}
if [ -z "$RUN_DIR" ] || [ "$RUN_DIR" = --smoke ]; then
  sed -n '2,27p' "$0"
  exit 2
fi
# the output folder relative to the caller's directory, then everything from the repository root
mkdir -p "$RUN_DIR" && RUN_DIR=$(cd "$RUN_DIR" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
SMOKE=${GPU_RUN_SMOKE:-0}
[ "${2:-}" = --smoke ] && SMOKE=1
PY=${PYTHON:-python3}
BUDGET=${GPU_RUN_BUDGET_S:-470}
START=$(date +%s)
export PYTHONUNBUFFERED=1
# every part imports this checkout's ppma (built in place by the build part), whatever else is installed
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
: > "$RUN_DIR/parts.tsv"
SMOKE_ARG=()
[ "$SMOKE" = 1 ] && SMOKE_ARG=(--smoke)

elapsed() { echo $(( $(date +%s) - START )); }

# part <name> <timeout s> <least s worth starting> <command...>: run the command under `timeout` (cut to the
# budget left), its output into RUN_DIR/<name>.log (and the last lines on stdout), a row into RUN_DIR/parts.tsv.
part() {
  local name=$1 limit=$2 least=$3 left status rc t0
  shift 3
  left=$(( BUDGET - $(elapsed) ))
  if [ "$left" -lt "$least" ]; then
    printf '%s\tskipped\t0\t%s s left of the %s s budget, %s needed\n' "$name" "$left" "$BUDGET" "$least" \
      >> "$RUN_DIR/parts.tsv"
    echo "== $name: skipped ($left s left)"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most $limit s; $(elapsed) s into the run)"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$RUN_DIR/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status="failed (rc $rc)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "log: $name.log" >> "$RUN_DIR/parts.tsv"
  tail -n 15 "$RUN_DIR/$name.log"
  echo "== $name: $status"
  return 0
}

has_cuda_build() {
  "$PY" -c "import ppma, ppma._ext as e, sys; sys.exit(0 if e.has_cuda_kernels() else 1)" > /dev/null 2>&1
}

build() {
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || return 1
  fi
  export TORCH_CUDA_ARCH_LIST MAX_JOBS=${MAX_JOBS:-$(nproc)}
  # the system compiler (benchmarks/README.md: a CC / CXX wrapper that links libstdc++ statically makes the
  # extension crash on its first C++ error); GPU_RUN_KEEP_CC=1 keeps the environment's
  if [ "${GPU_RUN_KEEP_CC:-0}" != 1 ] && [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++
  fi
  echo "build: TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CC=${CC:-} CXX=${CXX:-}"
  "$PY" setup.py build_ext --inplace || return 1
  has_cuda_build || { echo "build: ppma._C does not load with its CUDA kernels"; return 1; }
  # C++ errors must reach Python as exceptions
  "$PY" -c "
import torch, ppma
q = torch.randn(1, 2, 2, 1, 16)
try:
    torch.ops.ppma.polyline_attention(q, q, q, q[..., 0, :0], q[..., 0, :0], 0.1)
except RuntimeError:
    print('build: C++ errors reach Python')
" || { echo "build: ppma._C crashed on a C++ error instead of raising it (the C++ runtime: set CC / CXX)"; return 1; }
}

compiled() {  # compiled <model>: the model table of one model under torch.compile
  part "compiled_$1" 150 60 "$PY" -m ppma.train.cli.benchmark --model "$1" --amp fp16 --batch-size 64 \
    --img-size 224 --warmup 5 --iters 20 --compile "${GPU_RUN_COMPILE_MODE:-reduce-overhead}" \
    --output "$RUN_DIR/models_compiled_$1"
}

part env 30 10 bash -c "nvidia-smi 2>&1 | head -20; command -v nvcc && nvcc --version | tail -2; nproc; \
  \"$PY\" benchmarks/gpu_run.py env --out \"$RUN_DIR\" ${SMOKE_ARG[*]}"

if [ "$SMOKE" = 1 ]; then
  printf 'build\tskipped\t0\tsmoke run\n' >> "$RUN_DIR/parts.tsv"
elif has_cuda_build && [ "${GPU_RUN_FORCE_BUILD:-0}" != 1 ]; then
  printf 'build\tskipped\t0\tppma._C already built with its CUDA kernels from these sources\n' >> "$RUN_DIR/parts.tsv"
else
  export -f build has_cuda_build
  export PY
  part build 330 120 bash -c build
fi

if [ "$SMOKE" = 1 ]; then
  part check 60 5 "$PY" benchmarks/gpu_run.py check --out "$RUN_DIR" --smoke
  part graphs 60 5 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graphs.py
  part time 60 5 "$PY" benchmarks/gpu_run.py time --out "$RUN_DIR" --smoke
  part models 90 5 "$PY" -m ppma.train.cli.benchmark --device cpu --model ppma_tiny --impl fused --batch-size 2 \
    --img-size 32 --warmup 1 --iters 1 --no-train --num-classes 10 --override 'embed_dims=[8, 16, 16, 16]' \
    --override 'depths=[1, 1, 1, 1]' --override 'num_heads=[1, 2, 2, 2]' --output "$RUN_DIR/models_eager"
  part ops 60 5 "$PY" benchmarks/bench_gpu.py --device cpu --quick --no-compile --next --warmup 1 --reps 2 \
    --ops criss_cross_attention polyline_linear_attention --out "$RUN_DIR/ops"
  printf 'compiled\tskipped\t0\tsmoke run: compiling takes minutes on a CPU\n' >> "$RUN_DIR/parts.tsv"
elif ! has_cuda_build; then
  printf 'all\tskipped\t0\tno CUDA build of ppma._C: see the build row and build.log\n' >> "$RUN_DIR/parts.tsv"
else
  part check 75 20 "$PY" benchmarks/gpu_run.py check --out "$RUN_DIR"
  part graphs 75 20 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graphs.py -k "not compiled_model"
  part time 75 20 "$PY" benchmarks/gpu_run.py time --out "$RUN_DIR"
  part models 100 30 "$PY" -m ppma.train.cli.benchmark --model ppma_tiny ppma_small ppma_base --amp fp16 \
    --batch-size 64 --img-size 224 --warmup 5 --iters 20 --output "$RUN_DIR/models_eager"
  compiled ppma_tiny
  part ops 100 30 "$PY" benchmarks/bench_gpu.py --quick --next --out "$RUN_DIR/ops"
  part graphs_model 90 40 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graphs.py -k compiled_model
  for m in ppma_small ppma_base; do
    compiled "$m"
  done
fi


"$PY" benchmarks/gpu_run.py summary --out "$RUN_DIR" > /dev/null 2>&1 || true
echo "== done in $(elapsed) s"
cat "$RUN_DIR/summary.md" 2>/dev/null || cat "$RUN_DIR/parts.tsv"
