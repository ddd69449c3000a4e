"""Shared pytest setup."""

import os

import pytest

# The CUDA kernels are opt-in until they pass on a GPU (ppma.ops.CUDA_KERNELS_VERIFIED); the CUDA tests are what
# verifies them, so the test session opts in (before ppma is imported). CPU-only machines are unaffected.
os.environ.setdefault("PPMA_CUDA_KERNELS", "1")

from ppma._compat import ensure_torchvision  # noqa: E402

# PyPI's torchvision is a CUDA build; beside a CPU torch its ops cannot load (see ppma._compat).
ensure_torchvision()

FULL = os.environ.get("PPMA_TEST_FULL", "0") == "1"


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="long sweep: set PPMA_TEST_FULL=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
