"""What CI cannot check is reported as SKIPPED, never as passed: ``.ci/check_cuda.sh`` without nvcc, the CUDA
emulator tests without the CUDA headers, and the CI=true rule that turns those into failures unless
``PPMA_ALLOW_NO_CUDA=1``."""

import os
import shutil
import subprocess

import _pytest.outcomes
import pytest

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_cuda_without_nvcc(tmp_path, **env):
    """Run .ci/check_cuda.sh with a PATH that has the tools it needs before its nvcc check, but no nvcc."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("dirname", "cat", "mktemp"):
        if shutil.which(tool) and not (bindir / tool).exists():
            (bindir / tool).symlink_to(shutil.which(tool))
    skips = tmp_path / "skips.txt"
    skips.write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "PPMA_ALLOW_NO_CUDA")}
    res = subprocess.run([shutil.which("bash"), os.path.join(ROOT, ".ci", "check_cuda.sh")], capture_output=True,
                         text=True, env={**base, "PATH": str(bindir), "PPMA_CI_SKIPS": str(skips), **env})
    return res, skips.read_text()


def test_check_cuda_reports_missing_nvcc_as_skipped(tmp_path):
    res, skips = _check_cuda_without_nvcc(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "CUDA compile check: SKIPPED (nvcc missing)" in res.stdout
    assert "passed" not in res.stdout
    assert skips.strip() == "CUDA compile check: SKIPPED (nvcc missing)"  # .ci/run lists it at the end


def test_check_cuda_fails_under_ci_without_nvcc(tmp_path):
    res, _ = _check_cuda_without_nvcc(tmp_path, CI="true")
    assert res.returncode != 0 and "SKIPPED (nvcc missing)" in res.stdout
    assert "PPMA_ALLOW_NO_CUDA=1" in res.stdout
    res, _ = _check_cuda_without_nvcc(tmp_path, CI="true", PPMA_ALLOW_NO_CUDA="1")
    assert res.returncode == 0 and "SKIPPED (nvcc missing)" in res.stdout


def test_ci_run_prints_the_skipped_checks():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    assert 'export CI=${CI:-true}' in text and "PPMA_CI_SKIPS" in text and "== skipped checks" in text


def test_missing_cuda_toolchain_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(conftest, "STRICT_CUDA", False)
    with pytest.raises(pytest.skip.Exception, match="SKIPPED"):
        conftest.skip_without_cuda_toolchain("CUDA emulator: SKIPPED (cuda_fp16.h missing)")
    monkeypatch.setattr(conftest, "STRICT_CUDA", True)
    with pytest.raises(_pytest.outcomes.Failed, match="PPMA_ALLOW_NO_CUDA=1"):
        conftest.skip_without_cuda_toolchain("CUDA emulator: SKIPPED (cuda_fp16.h missing)")
