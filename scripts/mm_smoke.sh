#!/usr/bin/env bash
# Opt-in downstream check (not part of the test suite): trains ppma's own MMSegmentation 1.x / MMDetection 3.x
# configs, unchanged, for a few iterations on a tiny synthetic ADE20K-style and COCO-style dataset, asserts that
# the losses are finite and fall, and evaluates once (mIoU, COCO bbox + segm). See docs/training.md.
#
#   bash scripts/mm_smoke.sh                       # install what is missing, then run every model
#   bash scripts/mm_smoke.sh --install-only        # only build / reuse the MMCV wheel and install the mm stack
#   bash scripts/mm_smoke.sh --models upernet_tiny mask_rcnn_tiny_1x --iters 8
#
# Installs into the active Python environment (`${PYTHON:-python3}`), next to the torch already there:
#   mmcv 2.1.0 (the newest that mmseg 1.2.2 and mmdet 3.3.0 accept). PyPI has only its source, so it is built once
#     with its C++ ops against the installed torch (about 30 minutes on 2 cores) and the wheel is cached in
#     $PPMA_WHEEL_CACHE (default ~/.cache/ppma/wheels) under a key holding the mmcv, torch, CUDA and Python versions;
#   mmengine 0.10.7, mmsegmentation 1.2.2, mmdet 3.3.0 with --no-deps, and their runtime dependencies listed below,
#     so that pip never replaces torch. The torch version is checked before and after.
# Environment: MAX_JOBS (compile jobs, default 2), NICE (niceness of the MMCV build, default 0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MMCV_VERSION=2.1.0
MMENGINE_VERSION=0.10.7
MMSEG_VERSION=1.2.2
MMDET_VERSION=3.3.0
# The runtime dependencies of mmcv, mmengine, mmsegmentation and mmdet (from their package metadata), none of which
# depends on torch. setuptools < 81: mmcv's setup.py imports pkg_resources, which setuptools 81 removed. OpenCV
# (cv2): whichever build is installed is kept; without one, the headless build (no libGL needed) is added.
MM_DEPS=("setuptools<81" wheel ninja addict yapf termcolor rich packaging pillow pyyaml numpy matplotlib scipy
         prettytable pycocotools shapely six terminaltables tqdm ftfy regex)

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
torch_version() { "$PY" -c "import torch; print(torch.__version__)"; }

install_only=0
args=()
for a in "$@"; do
  if [ "$a" = "--install-only" ]; then install_only=1; else args+=("$a"); fi
done

TORCH_BEFORE=$(torch_version)
"$PY" -c "import ppma" 2>/dev/null || { echo "[mm_smoke] ppma is not importable: run scripts/setup.sh first" >&2; exit 1; }

mm_ready() {
  "$PY" - <<EOF 2>/dev/null
import importlib.metadata as md
want = {"mmcv": "$MMCV_VERSION", "mmengine": "$MMENGINE_VERSION", "mmsegmentation": "$MMSEG_VERSION", "mmdet": "$MMDET_VERSION"}
assert all(md.version(k) == v for k, v in want.items())
import mmcv.ops  # the compiled ops (RoIAlign, NMS) that Mask R-CNN needs
EOF
}

if mm_ready; then
  echo "[mm_smoke] mmcv $MMCV_VERSION (with ops), mmengine, mmseg, mmdet already installed"
else
  t0=$(date +%s)
  echo "[mm_smoke] installing the mm runtime dependencies"
  pip_install "${MM_DEPS[@]}"
  "$PY" -c "import cv2" 2>/dev/null || pip_install opencv-python-headless
  KEY=$("$PY" -c "import sys, torch; cu = torch.version.cuda; print(f'torch{torch.__version__}-{\"cu\" + cu if cu else \"cpu\"}-cp{sys.version_info[0]}{sys.version_info[1]}')")
  CACHE=${PPMA_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ppma/wheels}
  WHEEL_DIR="$CACHE/mmcv-$MMCV_VERSION+$KEY"
  wheel=$(ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    echo "[mm_smoke] building mmcv $MMCV_VERSION with ops against $KEY (about 30 min on 2 cores) -> $WHEEL_DIR"
    tmp=$(mktemp -d)
    # --no-build-isolation: build against the installed torch (an isolated build would download another one)
    MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-2} nice -n "${NICE:-0}" \
      "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps --no-binary mmcv \
      "mmcv==$MMCV_VERSION" -w "$tmp"
    mkdir -p "$WHEEL_DIR"
    mv "$tmp"/mmcv-*.whl "$WHEEL_DIR"/
    rmdir "$tmp" 2>/dev/null || true
    wheel=$(ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl | head -n1)
    echo "[mm_smoke] built $(basename "$wheel") in $(( $(date +%s) - t0 )) s"
  else
    echo "[mm_smoke] reusing the cached $wheel"
  fi
  pip_install --no-deps "$wheel" "mmengine==$MMENGINE_VERSION" "mmsegmentation==$MMSEG_VERSION" "mmdet==$MMDET_VERSION"
  mm_ready || { echo "[mm_smoke] the mm stack does not import after installing it" >&2; exit 1; }
  echo "[mm_smoke] mm stack installed in $(( $(date +%s) - t0 )) s"
fi

TORCH_AFTER=$(torch_version)
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
  echo "[mm_smoke] torch changed from $TORCH_BEFORE to $TORCH_AFTER while installing: reinstall it" >&2
  exit 1
fi
[ "$install_only" = 1 ] && exit 0
exec "$PY" scripts/mm_smoke.py "${args[@]+"${args[@]}"}"
