"""Shared pytest setup: the long-sweep switch and the CI rule for checks that cannot run here.

``PPMA_TEST_FULL=1`` is read here and nowhere else: tests marked ``@pytest.mark.full`` (registered in
pyproject.toml) are skipped without it, and sweeps that widen with it import ``FULL`` from this module."""

import os

import pytest

# The CUDA tests exercise the CUDA kernels (the default since ppma.ops.CUDA_KERNELS_VERIFIED): the session asks for
# them even where PPMA_CUDA_KERNELS=0 is set in the shell (before ppma is imported). CPU-only machines are unaffected.
os.environ["PPMA_CUDA_KERNELS"] = "1"

from ppma._compat import ensure_torchvision  # noqa: E402

# PyPI's torchvision is a CUDA build; beside a CPU torch its ops cannot load (see ppma._compat).
ensure_torchvision()

FULL = os.environ.get("PPMA_TEST_FULL", "0") == "1"
# CI (CI=true) must not pass a check it could not run: a missing CUDA toolchain fails there unless
# PPMA_ALLOW_NO_CUDA=1 says that this CI machine has none (.ci/run prints the skipped checks at the end).
STRICT_CUDA = os.environ.get("CI", "").lower() == "true" and os.environ.get("PPMA_ALLOW_NO_CUDA", "0") != "1"


def skip_without_cuda_toolchain(reason: str) -> None:
    """Skip a check that needs the CUDA toolkit (nvcc, cuda_fp16.h) with ``reason``; under CI (``CI=true``)
    fail instead, unless ``PPMA_ALLOW_NO_CUDA=1``."""
    if STRICT_CUDA:
        pytest.fail(f"{reason} (CI=true: set PPMA_ALLOW_NO_CUDA=1 on a CI machine without the CUDA toolkit)",
                    pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="long sweep: set PPMA_TEST_FULL=1")
    for item in items:
        # the marker itself, not item.keywords: those hold parameter ids too (a mode named "full")
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
