#!/usr/bin/env bash
# The main job: sets up the environment, then trains a small PPMA on scikit-learn's bundled handwritten digits
# (no download) and reports the test accuracy; exits non-zero when the last epoch ends below the config's
# train.min_test_acc1 (95 %, the README's claim). Extra arguments go to ppma-train.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m ppma.train --config configs/classification/demo_digits.yaml --output outputs/demo_digits "$@"
