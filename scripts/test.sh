#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
# PPMA_TEST_FULL=1 adds the long sweeps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest tests -q "$@"
