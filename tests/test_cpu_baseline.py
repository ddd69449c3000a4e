"""The SIMD paths of the CPU kernels (``csrc/cpu/simd.h``, ``ppma.backends``): the kernels are built for
baseline x86-64 with AVX2 and AVX-512 variants chosen at run time, and ``PPMA_CPU_CAPABILITY`` caps the path.
Every path this machine can run below its best (the best one is what the rest of the suite runs) reruns the
CPU cases of every op's reference comparisons (fp64 and fp32 sweeps, bf16 / fp16 within the bf16 tolerance,
gradcheck, determinism, thread-count invariance) in a fresh process; plus the reporting and the environment
variable's rules.

``cpu_subprocess_env`` and ``run_op_tests_on_path`` are the pieces a shared op-test helper can reuse."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from op_utils import BF16_DOT_EMULATED, expects_bf16_dot, needs_ext
from ppma import backends

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def op_test_files(three_d: bool = False) -> list[str]:
    """The test files that subclass the shared op tests (``class TestX(...OpTests)``; with ``three_d``, the 3-D
    ones, ``class TestX(Op3DTests)``), so ops added later are included."""
    pattern = re.compile(r"^class \w+\((Op3DTests)\):" if three_d else r"^class \w+\((\w*OpTests)\):", re.M)
    files = [f for f in sorted(glob.glob(os.path.join(HERE, "test_*.py"))) if pattern.search(open(f).read())]
    assert len(files) >= (3 if three_d else 4), files  # the three 3-D ops, the four 2-D ops at least
    return files


# The CPU cases that compare with the reference or check determinism (the 3-D tests have no device parameter:
# they run on the CPU only).
OP_FILTER = "cpu and (matches_reference or low_precision or gradcheck or deterministic or thread_count)"
OP_FILTER_3D = "matches_reference or low_precision or gradcheck or deterministic or nan_decays or t1_equals"
PATHS = backends.cpu_capabilities_available()
BEST = PATHS[-1] if PATHS else None


def cpu_subprocess_env(capability: str | None) -> dict[str, str]:
    """The environment of a fresh process whose CPU kernels run ``capability`` (``None``: no cap)."""
    env = {k: v for k, v in os.environ.items() if k != "PPMA_CPU_CAPABILITY"}
    if capability is not None:
        env["PPMA_CPU_CAPABILITY"] = capability
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def run_op_tests_on_path(capability: str, three_d: bool = False) -> None:
    """Run the CPU reference comparisons of every op (``three_d``: of every 3-D op) in a fresh process capped at
    ``capability``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           *op_test_files(three_d), "-k", OP_FILTER_3D if three_d else OP_FILTER]
    res = subprocess.run(cmd, env=cpu_subprocess_env(capability), cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout


@needs_ext
def test_capability_reported():
    assert PATHS[0] == "default" and set(PATHS) <= set(backends.CPU_CAPABILITIES)
    assert backends.cpu_capability_supported() == BEST
    if not os.environ.get("PPMA_CPU_CAPABILITY"):
        assert backends.cpu_capability() == BEST
    assert isinstance(backends.cpu_bf16_dot(), bool)
    if backends.cpu_capability() != "avx512":
        assert not backends.cpu_bf16_dot()


@needs_ext
@pytest.mark.parametrize("capability", list(backends.CPU_CAPABILITIES))
def test_cap_selects_path(capability):
    """A cap runs min(cap, what the CPU has), and the library reports exactly that."""
    res = _python("from ppma import backends; print(backends.cpu_capability(), backends.cpu_bf16_dot())",
                  cpu_subprocess_env(capability))
    assert res.returncode == 0, res.stderr[-2000:]
    got, bf16 = res.stdout.split()
    want = capability if capability in PATHS else BEST
    assert got == want
    if got != "avx512":
        assert bf16 == "False"


@needs_ext
def test_invalid_capability_is_an_error():
    """ppma.config rejects an unknown value at import, naming the variable and the allowed values (the kernels
    never read the environment themselves)."""
    res = _python("import ppma", {**cpu_subprocess_env("avx3"), "PYTHONWARNINGS": "ignore"})
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and "PPMA_CPU_CAPABILITY" in last and "avx3" in last, res.stderr[-2000:]
    assert "avx512" in last and "default" in last


@needs_ext
@pytest.mark.parametrize("capability", [p for p in PATHS if p != BEST] or [None])
def test_lower_path_matches_reference(capability):
    """The op tests' CPU reference comparisons on each path below the best one (the best is the default run)."""
    if capability is None:
        pytest.skip("this CPU has a single SIMD path")
    if os.environ.get("PPMA_CPU_CAPABILITY"):
        pytest.skip("already running under a capped path")
    run_op_tests_on_path(capability)


@needs_ext
@pytest.mark.parametrize("capability", [p for p in PATHS if p != BEST] or [None])
def test_lower_path_matches_reference_3d(capability):
    """The same for the 3-D ops (polyline_attention_3d, polyline_scan_3d, polyline_linear_attention_3d), whose
    kernels share the SIMD helpers of the 2-D ones (csrc/cpu/simd.h): reference comparisons in fp64, fp32 and
    16-bit, gradcheck, NaN decays, T = 1 against the 2-D op, determinism, on each path below the best one."""
    if capability is None:
        pytest.skip("this CPU has a single SIMD path")
    if os.environ.get("PPMA_CPU_CAPABILITY"):
        pytest.skip("already running under a capped path")
    run_op_tests_on_path(capability, three_d=True)


_BF16_CHECK = """
import torch
from ppma import backends
from ppma.ops import polyline_attention
from ppma.ops.reference import polyline_attention_ref
from op_utils import make_attention_inputs, rel_err
print(backends.cpu_bf16_dot())
for shape in [(2, 7, 9, 2, 16, 16), (1, 5, 5, 3, 7, 5), (1, 14, 14, 2, 32, 32)]:
    q, k, v, la, lb = make_attention_inputs(shape, torch.bfloat16, requires_grad=False)
    la, lb = la.float(), lb.float()
    out = polyline_attention(q, k, v, la, lb, 0.3)
    same = polyline_attention(q.float(), k.float(), v.float(), la, lb, 0.3).to(torch.bfloat16)
    ref = polyline_attention_ref(q.double(), k.double(), v.double(), la.double(), lb.double(), 0.3)
    print(out.dtype == torch.bfloat16, torch.equal(out, same), rel_err(out, ref))
"""


@needs_ext
@pytest.mark.parametrize("capability, emulated", [(c, False) for c in PATHS or [None]]
                         + [("avx512", True)] * ("avx512" in PATHS), ids=str)
def test_bf16_products(capability, emulated):
    """bf16 polyline_attention: where ``cpu_bf16_dot()`` the forward runs the bf16 products (P rounded to bf16,
    so the output is not the float32 kernel's on the same values) within the bf16 tolerance of the float64
    reference (odd d, odd N and tails of 16 included); on the other paths bf16 inputs take the float32 kernel
    (bitwise the float32 result rounded to bf16). Never the reference. ``emulated``: the avx512 path with the
    products' instruction emulated (``cpu_lowp_products=5``), whatever the CPU has."""
    if capability is None:
        pytest.skip("no compiled library")
    env = cpu_subprocess_env(capability)
    env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]
    if emulated:
        env.update(BF16_DOT_EMULATED)
    res = _python(_BF16_CHECK, env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    bf16dot = lines[0] == "True"
    assert bf16dot == expects_bf16_dot(BF16_DOT_EMULATED if emulated else {}, capability)
    for ln in lines[1:]:
        if not ln:
            continue
        is_bf16, equal, err = ln.split()
        assert is_bf16 == "True"
        assert float(err) <= 2e-2
        assert equal == ("False" if bf16dot else "True"), ln


@needs_ext
def test_no_aten_products_inside_cpu_ops():
    """The CPU attention kernels do their products in the SIMD layer's micro-kernels, never one ATen/BLAS call
    per tile (the profiler sees no addmm / mm / bmm / matmul inside the ops, forward or backward)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the profiler records calls on the calling thread only (not in pool workers)
    try:
        _profile_ops()
    finally:
        torch.set_num_threads(threads)


def _profile_ops():
    import torch
    from torch.profiler import ProfilerActivity, profile

    import ppma

    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(2, 9, 10, 2, 16, generator=gen).requires_grad_() for _ in range(3)]
    x += [(-torch.rand(2, 9, 10, 2, generator=gen)).requires_grad_() for _ in range(2)]
    for op in (ppma.ops.polyline_attention, ppma.ops.criss_cross_attention):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            op(*x).sum().backward()
        keys = {e.key for e in prof.key_averages()}
        assert any(k.startswith("ppma::") for k in keys), keys
        assert not keys & {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul"}, (op.__name__, keys)


def test_op_test_files_found():
    names = {os.path.basename(f) for f in op_test_files()}
    assert {"test_polyline_attention.py", "test_criss_cross_attention.py", "test_polyline_scan.py",
            "test_polyline_linear_attention.py"} <= names
