#!/usr/bin/env bash
# The main job: sets up the environment, then trains a small PPMA on scikit-learn's bundled handwritten digits
# (no download) and reports the test accuracy. Extra arguments go to ppma-train.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m ppma.train --config configs/classification/demo_digits.yaml --output outputs/demo_digits "$@"
