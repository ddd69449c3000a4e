"""``ppma.config`` (docs/configuration.md): one module parses the environment and holds every switch, the kernels'
internal options round-trip through the compiled library, and a stale library is refused once, with the command
that rebuilds it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ppma
from op_utils import needs_ext
from ppma import _ext, config
from ppma._stamp import source_stamp

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PPMA_")}
    full.update(env, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_only_config_reads_the_environment():
    """No module of the package but ppma/config.py reads a PPMA_* variable, and no C++ source calls getenv."""
    offenders = []
    for path in (ROOT / "ppma").rglob("*.py"):
        if path.name == "config.py" and path.parent.name == "ppma":
            continue
        text = path.read_text()
        if re.search(r"(os\.environ|getenv|env_flag\()[^\n]*PPMA_", text):
            offenders.append(str(path.relative_to(ROOT)))
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".cpp", ".h", ".cu", ".cuh") and "getenv" in path.read_text():
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"read the environment outside ppma/config.py: {offenders}"


def test_environment_table_matches_docs():
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for name in config.ENVIRONMENT:
        assert f"`{name}" in docs, f"{name} is not in docs/configuration.md"


@pytest.mark.parametrize("var,value", [("PPMA_IMPL", "fast"), ("PPMA_CHECK_DECAYS", "yes"),
                                       ("PPMA_CUDA_KERNELS", "2"), ("PPMA_CPU_CAPABILITY", "avx3"),
                                       ("PPMA_INTERNAL_OPTIONS", "cuda_tensor_cores"),
                                       ("PPMA_INTERNAL_OPTIONS", "no_such_option=1")])
def test_bad_environment_fails_at_import(var, value):
    res = _python("import ppma", **{var: value})
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and var in last, res.stderr[-2000:]


def test_environment_sets_switches():
    res = _python("import ppma\nfrom ppma import ops\n"
                  "print(ops.get_impl(), ops.cuda_kernels_enabled(), ppma.config.check_decays_enabled())",
                  PPMA_IMPL="reference", PPMA_CUDA_KERNELS="0", PPMA_CHECK_DECAYS="1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["reference", "False", "True"]


@needs_ext
def test_environment_sets_internal_options():
    res = _python("import ppma\nprint(ppma.config.get_internal_option('cuda_tensor_cores'),"
                  " ppma.config.get_internal_option('cuda_next_criss_cross_attention'))",
                  PPMA_INTERNAL_OPTIONS="cuda_tensor_cores=0, cuda_next_criss_cross_attention=1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["0", "1"]


@needs_ext
def test_internal_option_round_trip():
    old = config.set_internal_option("cuda_tensor_cores", 0)
    try:
        assert old == 1 and config.get_internal_option("cuda_tensor_cores") == 0
    finally:
        assert config.set_internal_option("cuda_tensor_cores", old) == 0
    assert config.get_internal_option("cuda_tensor_cores") == 1


@needs_ext
def test_internal_option_context_restores():
    with config.internal_option("cuda_next_polyline_attention", 1):
        assert config.get_internal_option("cuda_next_polyline_attention") == 1
        with config.internal_option("cuda_next_polyline_attention", 0):
            assert config.get_internal_option("cuda_next_polyline_attention") == 0
        assert config.get_internal_option("cuda_next_polyline_attention") == 1
    assert config.get_internal_option("cuda_next_polyline_attention") == 0


@needs_ext
def test_internal_option_errors():
    with pytest.raises(ValueError, match="unknown option 'nope'.*cuda_tensor_cores"):
        config.set_internal_option("nope", 1)
    with pytest.raises(ValueError, match="cuda_tensor_cores.*\\[0, 1\\].*got 5"):
        config.set_internal_option("cuda_tensor_cores", 5)
    with pytest.raises(ValueError, match="unknown option"):
        config.get_internal_option("nope")
    assert config.get_internal_option("cuda_tensor_cores") == 1


def test_use_impl_restores():
    assert ppma.ops.get_impl() == "fused"
    with ppma.ops.use_impl("reference"):
        assert ppma.ops.get_impl() == "reference" and config.get_impl() == "reference"
    assert ppma.ops.get_impl() == "fused"
    with pytest.raises(ValueError, match="impl must be one of"):
        ppma.ops.set_impl("fast")


@needs_ext
def test_library_is_built_from_these_sources():
    stamp = torch.ops.ppma.source_stamp()
    kind = stamp.split(":")[0]
    assert stamp == source_stamp(str(ROOT / "csrc"), kind)


def _copy_sources(tmp_path: Path) -> Path:
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc, ignore=shutil.ignore_patterns("generated"))
    return csrc


def test_stale_library_is_refused(tmp_path):
    csrc = _copy_sources(tmp_path)
    stamp = source_stamp(str(csrc), "cpu")
    _ext.check_stamp(stamp, str(csrc))  # the same sources: accepted
    with (csrc / "cpu" / "simd.h").open("a") as f:
        f.write("\n// changed after the build\n")
    with pytest.raises(_ext.StaleLibraryError, match="stale.*Rebuild.*pip install --no-build-isolation -e ."):
        _ext.check_stamp(stamp, str(csrc))
    with pytest.raises(_ext.StaleLibraryError, match="stale"):
        _ext.check_stamp(None, str(csrc))  # a library from before the stamps


def test_stamp_covers_what_the_build_compiles(tmp_path):
    """A CPU build's stamp ignores the CUDA sources (editing a kernel header does not make a CPU build stale);
    a CUDA build's stamp covers them."""
    csrc = _copy_sources(tmp_path)
    cpu, cuda = source_stamp(str(csrc), "cpu"), source_stamp(str(csrc), "cuda")
    with (csrc / "kernels" / "common.cuh").open("a") as f:
        f.write("\n// changed\n")
    assert source_stamp(str(csrc), "cpu") == cpu
    assert source_stamp(str(csrc), "cuda") != cuda


def test_installed_wheel_is_not_checked(tmp_path):
    _ext.check_stamp("cpu:0000000000000000", str(tmp_path / "csrc"))  # no sources beside the package: nothing
