#!/usr/bin/env bash
# Installs torch, ppma's dependencies and ppma itself (editable, with its C++ operators) into the Python
# environment of `${PYTHON:-python3}`. Safe to run again: what is installed already is kept.
#
# torch is pinned and installed first, and ppma is built with --no-build-isolation against it, so pip
# never downloads another (multi-GB CUDA) torch. torchvision must be the release that matches torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCHVISION_VERSION=${TORCHVISION_VERSION:-0.28.0}   # the torchvision release built for torch 2.13

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
echo "[setup] installing build, test and training dependencies"
# onnx / onnxscript / onnxruntime: the ONNX export check of the test suite (torch 2.13's dynamo exporter;
# the three wheels are about 38 MB for CPython 3.11 on x86-64 Linux)
# build: `python -m build --no-isolation` (the sdist and wheel of scripts/check_wheel.sh)
pip_install "setuptools>=77" wheel ninja build numpy pyyaml tqdm pillow \
  pytest expecttest hypothesis \
  "onnx==1.23.2" "onnxscript==0.7.2" "onnxruntime==1.32.0" \
  "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" timm scikit-learn safetensors matplotlib \
  "omegaconf>=2.3,<3" \
  "mmengine>=0.10"
# The distribution is ppma-torch (pyproject); one installed under the import name's old distribution name "ppma"
# (or PyPI's unrelated "ppma") would shadow or clash with it.
if "$PY" -m pip show -q ppma >/dev/null 2>&1; then
  echo "[setup] uninstalling the distribution 'ppma' (this package is now the distribution ppma-torch)"
  "$PY" -m pip uninstall -y -q ppma
fi
# Already installed from this checkout (editable) with a library built from these very sources (the source stamp,
# docs/configuration.md "A stale library"): kept. Otherwise pip's editable install recompiles only what changed
# (setup.py keeps the compiled objects in build/, where the wheel build of scripts/check_wheel.sh finds them too).
current=$("$PY" - <<'PYEOF' 2>/dev/null || true
import json, os
from importlib import metadata
import ppma
here = "file://" + os.path.abspath(".")
urls = [json.loads(d.read_text("direct_url.json") or "{}") for d in metadata.distributions(name="ppma-torch")]
editable_here = any(u.get("url") == here and u.get("dir_info", {}).get("editable") for u in urls)
print("yes" if editable_here and ppma.has_ext() else "no")
PYEOF
)
if [ "$current" = yes ] && [ "${FORCE_CUDA:-0}" != 1 ]; then
  echo "[setup] ppma is installed from this checkout and its operators are built from these sources: kept"
else
  echo "[setup] building ppma (C++ operators$( [ "${FORCE_CUDA:-0}" = 1 ] && echo ' + CUDA'))"
  MAX_JOBS=${MAX_JOBS:-2} pip_install --no-build-isolation --no-deps -e .
fi
"$PY" -c "import ppma; assert ppma.has_ext(), 'ppma._C did not build'; print('[setup] ppma', ppma.__version__, 'with fused ops')"
