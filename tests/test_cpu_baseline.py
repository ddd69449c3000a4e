"""The CPU kernels' lower SIMD paths (README "Install"): the widest path the CPU supports is chosen at run time,
and an environment setting forces each lower one (``op_utils.cpu_paths``: ``PPMA_CPU_BASELINE=1`` for the
baseline x86-64 code, or ``PPMA_CPU_CAPABILITY``). This reruns the CPU cases of every op's reference comparisons
(every ``tests/test_*.py`` with an ``OpTests`` subclass, so ops added later are included) in a fresh process on
each lower path. ``OpTests.test_lower_cpu_path`` adds the per-op bitwise checks on each path."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from op_utils import cpu_paths, needs_ext, path_id

HERE = os.path.dirname(os.path.abspath(__file__))


def op_test_files() -> list[str]:
    """The test files that subclass the shared op tests (``class TestX(...OpTests)``)."""
    pattern = re.compile(r"^class \w+\((\w*OpTests)\):", re.M)
    files = [f for f in sorted(glob.glob(os.path.join(HERE, "test_*.py"))) if pattern.search(open(f).read())]
    assert len(files) >= 4, files  # the four 2-D ops at least
    return files


@needs_ext
@pytest.mark.parametrize("path", cpu_paths()[1:], ids=path_id)
def test_lower_path_matches_reference(path):
    if all(os.environ.get(k) == v for k, v in path.items()):
        pytest.skip("already running on this path")
    env = {**os.environ, **path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *op_test_files(),
           "-k", "cpu and (matches_reference or low_precision or gradcheck or deterministic)"]
    res = subprocess.run(cmd, env=env, cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout


def test_op_test_files_found():
    names = {os.path.basename(f) for f in op_test_files()}
    assert {"test_polyline_attention.py", "test_criss_cross_attention.py", "test_polyline_scan.py",
            "test_polyline_linear_attention.py"} <= names
