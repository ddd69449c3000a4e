"""The CPU kernels' baseline x86-64 path (docs/design.md §5): the AVX+FMA variants are chosen at run time, and
``PPMA_CPU_BASELINE=1`` forces the baseline code (what CPUs without AVX/FMA run). This reruns the CPU cases of
the per-op reference comparisons in a fresh process on that path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from op_utils import needs_ext

OP_TESTS = ("test_polyline_attention.py", "test_criss_cross_attention.py", "test_polyline_scan.py")


@needs_ext
@pytest.mark.skipif(os.environ.get("PPMA_CPU_BASELINE") == "1", reason="already running on the baseline path")
def test_baseline_x86_64_path_matches_reference():
    env = {**os.environ, "PPMA_CPU_BASELINE": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           *(os.path.join(here, f) for f in OP_TESTS),
           "-k", "cpu and (matches_reference or low_precision or gradcheck or deterministic)"]
    res = subprocess.run(cmd, env=env, cwd=os.path.dirname(here), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout
