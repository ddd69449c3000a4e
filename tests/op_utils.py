"""What every op test shares (docs/design.md §5): the devices, the swept shapes and dtypes per device, the one per-dtype
tolerance table and its error metric, the input builders, and the generic op tests as base classes that each
``tests/test_<op>.py`` subclasses (the way torchvision's ``test/test_ops.py`` does with ``RoIOpTester``); the 3-D
ops' inputs, literal mask and generic tests (``Op3DTests``) at the end, on the same comparisons and helpers.

Adding a case: a shape ``(B, H, W, heads, d, dv)`` or a dtype to ``SWEEPS[device]`` runs it through every op's
forward and gradient comparison with the reference; a new device is a new ``SWEEPS`` entry.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import uuid

import pytest
import torch

import ppma
from conftest import FULL
from ppma import _ext
from ppma.ops import _dispatch

needs_ext = pytest.mark.skipif(not ppma.has_ext(), reason="ppma._C is not built (pip install --no-build-isolation -e .)")

# CPU always (with the compiled library); CUDA when a GPU is there and ppma._C has its kernels.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _dispatch.fused_available("cuda") else [])

# ------------------------------------------------------------------------------------------------
# Tolerances: relative norm error ||actual - expected|| / max(||expected||, floor)
# ------------------------------------------------------------------------------------------------

# dtype -> (forward tolerance, gradient tolerance)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """Relative norm error in float64. ``floor`` bounds the denominator from below: for results that are
    near zero by cancellation, pass the magnitude they would have without it (0: a plain relative error;
    when both are zero the error is the absolute one)."""
    a, e = actual.detach().double(), expected.detach().double()
    den = max(e.norm().item(), floor)
    num = (a - e).norm().item()
    return num if den == 0.0 else num / den


def assert_close(actual, expected, dtype: torch.dtype, what: str, grad: bool = False, mult: float = 1.0,
                 floor: float = 0.0):
    """Assert ``rel_err`` within the table's tolerance for ``dtype`` (times ``mult``); shapes equal and the
    result finite."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    tol = TOLERANCES[dtype][1 if grad else 0] * mult
    err = rel_err(actual, expected, floor)
    assert err <= tol, f"{what}: relative norm error {err:.3e} > {tol:.1e} ({dtype})"


# ------------------------------------------------------------------------------------------------
# Sweeps per device
# ------------------------------------------------------------------------------------------------

SIZES = (1, 2, 3, 7, 8, 13, 56)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """How the ops are checked against the reference on one device.

    Attributes:
        shapes: ``(B, H, W, heads, d, dv)`` of the main sweep (``dv`` is the channel count ``c`` of the scan).
        dtypes: dtypes of the main sweep of the attention ops; ``scan_dtypes`` those of ``polyline_scan``.
        ref_fp64: compare with the reference evaluated in float64 (else in the input dtype, on the inputs).
        grad_mult: factor on the gradient tolerance.
        compile_backend: ``torch.compile`` backend of the compile tests.
        recheck_backward: run every sweep case's backward twice and require bitwise-equal gradients (GPU
            reductions; the CPU kernels have their own determinism and thread-count tests).
    """

    shapes: tuple
    dtypes: tuple
    scan_dtypes: tuple
    ref_fp64: bool
    grad_mult: float
    compile_backend: str
    recheck_backward: bool


_CPU_SHAPES = (
    (1, 1, 1, 1, 8, 8),
    (2, 1, 7, 2, 8, 8),
    (1, 7, 1, 3, 16, 16),
    (3, 2, 3, 1, 8, 12),
    (1, 8, 8, 4, 16, 16),
    (2, 13, 7, 2, 32, 32),
    (1, 3, 56, 1, 64, 64),
    (1, 14, 14, 8, 32, 32),
)
if FULL:
    _CPU_SHAPES = tuple(
        (b, h, w, g, d, d)
        for (h, w), b, (g, d) in itertools.product(
            itertools.product(SIZES, SIZES), (1, 3), ((1, 8), (4, 16), (8, 32), (2, 64))
        )
        if h * w <= 56 * 13 or b == 1
    )
# The CUDA kernels pad head dims to 16, 32, 64 or 128: one case per path, and generic (padded) dims.
_CUDA_SHAPES = (
    (1, 1, 1, 1, 16, 16),
    (2, 1, 7, 2, 16, 16),
    (1, 7, 1, 1, 32, 32),
    (2, 3, 8, 2, 32, 32),
    (1, 13, 7, 3, 64, 64),
    (1, 8, 13, 2, 24, 40),
    (3, 2, 3, 1, 96, 128),
    (1, 3, 70, 2, 32, 32),  # W > 64: row segments (tensor-core tiles), lines > 64 (criss-cross generic kernels)
    (1, 14, 14, 2, 32, 32),
)
if FULL:
    _CUDA_SHAPES += ((2, 56, 56, 2, 16, 16), (1, 13, 70, 2, 32, 32), (1, 70, 9, 1, 64, 64), (2, 14, 14, 4, 32, 32),
                     (1, 1, 300, 1, 32, 32), (2, 32, 32, 4, 32, 32), (1, 48, 48, 2, 32, 32), (1, 13, 33, 2, 128, 64))

SWEEPS: dict[str, Sweep] = {
    "cpu": Sweep(_CPU_SHAPES, (torch.float64, torch.float32), (torch.float64, torch.float32, torch.bfloat16),
                 ref_fp64=False, grad_mult=1.0, compile_backend="aot_eager", recheck_backward=False),
    # The GPU kernels are checked against the fp64 truth; their gradients sum in another order (x2).
    "cuda": Sweep(_CUDA_SHAPES, (torch.float32, torch.float16, torch.bfloat16),
                  (torch.float32, torch.float16, torch.bfloat16), ref_fp64=True, grad_mult=2.0,
                  compile_backend="inductor", recheck_backward=True),
}


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def sweep_params(scan: bool = False) -> list:
    """``(device, shape, dtype)`` pytest parameters of the main sweep of every available device."""
    out = []
    for device in DEVICES:
        sw = SWEEPS[device]
        for shape, dtype in itertools.product(sw.shapes, sw.scan_dtypes if scan else sw.dtypes):
            out.append(pytest.param(device, shape, dtype, id=f"{device}-{shape_id(shape)}-{str(dtype)[6:]}"))
    return out


def device_params(*extra: str) -> list[str]:
    """The available devices, plus ``extra`` ones (e.g. "meta")."""
    return DEVICES + list(extra)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def decay_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The models' log-decays: float64 with float64 features, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_attention_inputs(shape, dtype=torch.float64, device="cpu", *, decay_scale=0.5, decay_dtype=None, seed=0,
                          requires_grad=True, noncontig=False):
    """``[q, k, v, log_alpha, log_beta]`` for ``shape = (B, H, W, heads, d, dv)``: normal features, log-decays
    uniform in ``[-decay_scale, 0]``. ``noncontig``: q and k with permuted storage (same values)."""
    B, H, W, G, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, W, G, d, generator=gen) for _ in range(2))
    v = torch.randn(B, H, W, G, dv, generator=gen)
    la, lb = (-decay_scale * torch.rand(B, H, W, G, generator=gen) for _ in range(2))
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    la, lb = (t.to(device, decay_dtype or decay_dtype_for(dtype)) for t in (la, lb))
    if noncontig:
        q = q.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
        k = k.transpose(3, 0).contiguous().transpose(3, 0)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, la, lb)]


def make_scan_inputs(shape, dtype=torch.float64, device="cpu", *, decay_scale=1.0, seed=0, requires_grad=True,
                     noncontig=False):
    """``[x, log_alpha, log_beta]`` for ``shape = (B, H, W, heads, _, c)``."""
    B, H, W, G, _, c = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, W, G, c, generator=gen).to(device, dtype)
    la, lb = (-decay_scale * torch.rand(B, H, W, G, generator=gen) for _ in range(2))
    la, lb = (t.to(device, decay_dtype_for(dtype)) for t in (la, lb))
    if noncontig:
        x = x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    return [t.requires_grad_(requires_grad) for t in (x, la, lb)]


def strided(t: torch.Tensor) -> torch.Tensor:
    """Same values in strided storage: a slice of a wider tensor (5-D) or a transposed copy viewed back (4-D)."""
    wide = torch.cat([t, t], dim=-1)[..., : t.shape[-1]] if t.dim() == 5 else t.transpose(1, 2).contiguous().transpose(1, 2)
    assert not wide.is_contiguous() or t.numel() <= 1
    return wide.detach().requires_grad_()


def nan_at(t: torch.Tensor, index) -> torch.Tensor:
    out = t.detach().clone()
    out[index] = float("nan")
    return out


# ------------------------------------------------------------------------------------------------
# Comparison with the reference
# ------------------------------------------------------------------------------------------------


def ops_called(fn) -> set[str]:
    """The names of the ops ``fn()`` calls on this thread (the CPU profiler's events, e.g. ``"ppma::rope"``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


THREAD_COUNTS = (1, 3)  # the determinism tests' thread counts: 3 does not divide their B * heads = 4 units


def assert_thread_invariant(fn, inputs) -> None:
    """``fn(*inputs)`` and its gradients w.r.t. every input are bit-identical on each of ``THREAD_COUNTS`` CPU
    threads (the CPU kernels own fixed slices and summation orders)."""
    n = torch.get_num_threads()
    res = []
    try:
        for threads in THREAD_COUNTS:
            torch.set_num_threads(threads)
            out = fn(*inputs)
            res.append((out, torch.autograd.grad(out, inputs, torch.ones_like(out))))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(res[0][0], res[1][0])
    for a, b in zip(res[0][1], res[1][1]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# CPU SIMD paths and results computed in another process
# ------------------------------------------------------------------------------------------------

# The CPU capabilities, lowest first, that PPMA_CPU_CAPABILITY selects where ppma.backends.cpu_capability exists.
CPU_CAPABILITIES = ("default", "avx2", "avx512")


def opcheck_with_backward(case, inputs, extra) -> None:
    """``torch.library.opcheck`` of a test class's registered op on ``(*inputs, *extra)`` and of its backward op on
    the gradient arguments ``case.backward_args`` builds from that forward's outputs."""
    torch.library.opcheck(case.registered(), (*inputs, *extra))
    with torch.no_grad():
        outs = case.registered()(*inputs, *extra)
    first = outs[0] if isinstance(outs, tuple) else outs
    torch.library.opcheck(getattr(torch.ops.ppma, case.op + "_backward"),
                          (torch.randn_like(first), *case.backward_args([t.detach() for t in inputs], outs), *extra))


def assert_deterministic_unmutated(fn, inputs) -> None:
    """Two runs of ``fn(*inputs)`` give bitwise-equal outputs and input gradients, and leave the inputs as they
    were."""
    before = [t.detach().clone() for t in inputs]
    runs = []
    for _ in range(2):
        out = fn(*inputs)
        runs.append((out, torch.autograd.grad(out, inputs, torch.ones_like(out))))
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b), "backward is not deterministic"
    for t, b in zip(inputs, before):
        assert torch.equal(t.detach(), b)


def cpu_paths() -> list[dict[str, str]]:
    """The environment settings that select each SIMD path of the CPU kernels on this machine, the default
    (the best the CPU runs) first: every op's determinism and path tests run once per entry, in a fresh
    process (the kernels read the setting once).

    ``{}`` plus ``PPMA_CPU_CAPABILITY=c`` for each capability below the one in use
    (``ppma.backends.cpu_capability()``)."""
    from ppma.backends import cpu_capability

    best = str(cpu_capability()).lower()
    if best not in CPU_CAPABILITIES:
        raise AssertionError(f"ppma.backends.cpu_capability() returned {best!r}, not one of {CPU_CAPABILITIES}")
    return [{}] + [{"PPMA_CPU_CAPABILITY": c} for c in CPU_CAPABILITIES[: CPU_CAPABILITIES.index(best)]]


#: The environment that runs the avx512 path's bf16 dot-product kernels with ``vdpbf16ps`` emulated on AVX-512F
#: (the internal option ``cpu_lowp_products=5``): their tests on CPUs without AVX-512 BF16.
BF16_DOT_EMULATED = {"PPMA_INTERNAL_OPTIONS": "cpu_lowp_products=5"}


def bf16_paths() -> list[dict[str, str]]:
    """:func:`cpu_paths`, and :data:`BF16_DOT_EMULATED` where the avx512 path runs here."""
    from ppma.backends import cpu_capability

    return cpu_paths() + ([BF16_DOT_EMULATED] if cpu_capability() == "avx512" else [])


def expects_bf16_dot(env: dict, capability: str) -> bool:
    """Whether a process with the environment settings ``env`` (an entry of :func:`bf16_paths`) whose kernels run
    ``capability`` multiplies bf16 inputs with the AVX-512 BF16 dot products (``ppma.backends.cpu_bf16_dot``)."""
    from ppma.backends import cpu_bf16_dot_supported

    return capability == "avx512" and (cpu_bf16_dot_supported() or env == BF16_DOT_EMULATED)


def path_id(env: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in env.items()) or "default"


_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_op_case(cls: type, spec: dict, threads: int, runs: int = 1) -> list[list[torch.Tensor]]:
    """Evaluate ``cls``'s op on the case ``spec`` (``shape``, ``dtype`` name, ``variant``, ``seed``) in this
    process on ``threads`` CPU threads, ``runs`` times: each run is ``[out, *gradients]`` for the upstream
    gradient ``randn(seed + 1)``, the inputs built by ``cls.inputs`` from ``seed``."""
    t = cls()
    shape, dtype = tuple(spec["shape"]), getattr(torch, spec["dtype"])
    n = torch.get_num_threads()
    res = []
    try:
        torch.set_num_threads(threads)
        for _ in range(runs):
            inputs = t.inputs(shape, dtype, "cpu", seed=spec["seed"], decay_scale=1.0)
            out = t.fn(*inputs, *t.extra(shape, spec["variant"]))
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(spec["seed"] + 1)).to(out)
            res.append([out.detach(), *torch.autograd.grad(out, inputs, go)])
    finally:
        torch.set_num_threads(n)
    return res


def run_op_case_in_child(cls: type, spec: dict, env: dict, tmp_path) -> dict[tuple[str, int], list[list[torch.Tensor]]]:
    """:func:`run_op_case` in a fresh Python process with the extra environment ``env`` (a SIMD path of
    :func:`cpu_paths`), for each dtype name of ``spec["dtypes"]``, twice on each of ``THREAD_COUNTS`` threads;
    returns ``{(dtype name, threads): runs}``."""
    out = tmp_path / f"child-{uuid.uuid4().hex}.pt"
    code = ("import json, sys, importlib, torch; sys.path.insert(0, sys.argv[1]); import op_utils; "
            "spec = json.loads(sys.argv[2]); cls = getattr(importlib.import_module(spec['module']), spec['cls']); "
            "torch.save({(dt, n): op_utils.run_op_case(cls, {**spec, 'dtype': dt}, n, runs=2) "
            "for dt in spec['dtypes'] for n in op_utils.THREAD_COUNTS}, sys.argv[3])")
    full = {**spec, "module": cls.__module__, "cls": cls.__name__}
    child_env = {**os.environ, **env}
    child_env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(_TESTS_DIR), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code, _TESTS_DIR, json.dumps(full), str(out)], env=child_env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"child process on the {path_id(env)} path failed:\n{res.stderr[-3000:]}"
    return torch.load(out)


def assert_runs_equal(runs: list[list[torch.Tensor]], names, what: str) -> None:
    """Every run of ``runs`` bit-identical to the first (forward and each gradient)."""
    for i, run in enumerate(runs[1:], 1):
        for name, a, b in zip(("out", *names), runs[0], run):
            assert torch.equal(a, b), f"{what}: {name} of run {i} differs bitwise from run 0"


def attention_shape_cases(q, k, v, la, lb) -> list:
    """The named-error cases every attention-shaped op (q, k, v, log_alpha, log_beta) shares, as
    ``(arguments, exception, message, the reference raises too)`` for :func:`assert_raises_cases`."""
    return [
        ((q[0], k[0], v[0], la[0], lb[0]), ValueError, "q must be", True),
        ((q, k[:, :4], v, la, lb), ValueError, "k must have the shape", True),
        ((q, k, v[:, :, :5], la, lb), ValueError, "v must be", True),
        ((q, k, v, la[:, :4], lb), ValueError, "log_alpha must be", True),
        ((q, k.float(), v, la, lb), ValueError, "k has dtype", False),
    ]


def assert_raises_cases(cases, fn, ref) -> None:
    """Each ``(arguments, exception, message, the reference raises too)`` raises ``exception`` matching
    ``message`` from ``fn`` (and from ``ref`` where said)."""
    for args, exc, msg, ref_too in cases:
        for f in (fn, ref) if ref_too else (fn,):
            with pytest.raises(exc, match=msg):
                f(*args)


def check_against_reference(fn, ref, inputs, extra=(), *, names, dtype, device="cpu", ref_fp64=None,
                            tol_dtype=None, grad_mult=None, floors=None, only=None):
    """``fn(*inputs, *extra)`` (the public op) against ``ref`` (its reference): the forward and the gradient of
    every input for one random upstream gradient, through autograd (hence the fused backward op). Returns the
    op's gradients.

    ``ref_fp64`` (default: the device's sweep) evaluates the reference on float64 copies of the inputs;
    ``tol_dtype`` picks the tolerance row (default ``dtype``), ``grad_mult`` scales the gradient tolerance
    (default: the device's sweep); ``floors`` maps a gradient name to the floor of its relative error
    (``rel_err``); ``only`` restricts the compared gradients to these names."""
    sweep = SWEEPS[device]
    ref_fp64 = sweep.ref_fp64 if ref_fp64 is None else ref_fp64
    assert _dispatch.get_impl() == "fused" and _dispatch.run_fused(inputs[0]), "the fused kernel would not run"
    out = fn(*inputs, *extra)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs] if ref_fp64 else inputs
    expected = ref(*ref_inputs, *extra)
    if not ref_fp64:
        assert out.dtype == expected.dtype
    tol_dtype = tol_dtype or dtype
    assert_close(out, expected, tol_dtype, "forward")
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(expected)
    got = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    want = torch.autograd.grad(expected, ref_inputs, grad_out)
    for name, g, w, t in zip(names, got, want, inputs):
        assert g.dtype == t.dtype, f"grad {name}: dtype {g.dtype} != input dtype {t.dtype}"
        if only is None or name in only:
            assert_close(g, w, tol_dtype, f"grad {name}", grad=True, mult=grad_mult or sweep.grad_mult,
                         floor=(floors or {}).get(name, 0.0))
    return got


# ------------------------------------------------------------------------------------------------
# The generic op tests
# ------------------------------------------------------------------------------------------------


class OpTests:
    """Tests every ppma op passes, on every available device. A subclass ``TestX`` in ``tests/test_<op>.py``
    sets ``op`` (the name under ``torch.ops.ppma`` and ``ppma.ops``), ``fn`` and ``ref`` (the public wrapper and
    its reference, as ``staticmethod``), ``grad_names`` (its tensor inputs, the two log-decays last),
    ``gradcheck_shapes``, and implements ``inputs`` (the builder), ``extra`` (the trailing non-tensor
    arguments, from the ``variant`` fixture) and ``backward_args``. ``inputs`` must accept ``seed`` and
    ``decay_scale``: the determinism and SIMD-path tests rebuild the same inputs from a seed in a child process
    (``determinism_shape``: their input shape, overridable for another layout, e.g. a 3-D op's)."""

    op: str
    fn = None
    ref = None
    grad_names: tuple
    gradcheck_shapes: tuple
    scan = False  # sweep with the scan's dtypes

    def pytest_generate_tests(self, metafunc):
        if "shape" in metafunc.fixturenames and metafunc.function.__name__ == "test_matches_reference":
            metafunc.parametrize("device,shape,dtype", sweep_params(scan=self.scan))

    @pytest.fixture
    def variant(self):
        return None

    def inputs(self, shape, dtype=torch.float64, device="cpu", **kw) -> list:
        raise NotImplementedError

    def extra(self, shape, variant=None) -> tuple:
        raise NotImplementedError

    def backward_args(self, inputs, outs) -> tuple:
        """The tensor arguments of the backward op after ``grad_out``, from the inputs and the op's outputs."""
        raise NotImplementedError

    @property
    def ia(self) -> int:
        """Position of ``log_alpha`` among the tensor inputs (``log_beta`` follows)."""
        return len(self.grad_names) - 2

    def registered(self):
        return getattr(torch.ops.ppma, self.op)

    # ---------------------------------------------------------------- against the reference
    @needs_ext
    def test_matches_reference(self, device, shape, dtype, variant):
        inputs, extra = self.inputs(shape, dtype, device, noncontig=shape[1] > 1), self.extra(shape, variant)
        grads = check_against_reference(self.fn, self.ref, inputs, extra, names=self.grad_names, dtype=dtype,
                                        device=device)
        ga, gb = grads[self.ia :]
        assert not ga[:, :, 0].any() and not gb[:, 0].any(), "the first decays of a line must get zero gradient"
        if SWEEPS[device].recheck_backward:
            out = self.fn(*inputs, *extra)
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)  # the same dO
            for a, b in zip(grads, torch.autograd.grad(out, inputs, go)):
                assert torch.equal(a, b), "backward is not deterministic"

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_gradcheck(self, device, variant):
        for shape in self.gradcheck_shapes:
            inputs, extra = self.inputs(shape, torch.float64, device), self.extra(shape, variant)
            assert torch.autograd.gradcheck(lambda *a: self.fn(*a, *extra), inputs, eps=1e-6, atol=1e-7)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_noncontiguous(self, device, variant):
        shape = (2, 5, 7, 3, 16, 8)
        inputs = [strided(t) for t in self.inputs(shape, torch.float64, device)]
        # heads-first storage, permuted to the heads-last layout
        first = self.inputs(shape, torch.float64, device, seed=1)[0].detach()
        inputs[0] = first.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4).requires_grad_()
        check_against_reference(self.fn, self.ref, inputs, self.extra(shape, variant), names=self.grad_names,
                                dtype=torch.float64, device=device, ref_fp64=False)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("value", [-1e4, 0.0, -math.inf], ids=["-1e4", "0", "-inf"])
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
    def test_extreme_decays(self, device, value, dtype):
        """Every other column and row fully decayed (``-1e4``; ``-inf`` is a decay of exactly 0), or exactly 1."""
        shape = (2, 6, 5, 2, 8, 8)
        inputs, extra, ia = self.inputs(shape, dtype, device, decay_scale=1.0), self.extra(shape), self.ia
        with torch.no_grad():
            inputs[ia][:, :, ::2] = value
            inputs[ia + 1][:, 1::2] = value
        if value != 0.0 and dtype == torch.float32:
            # fp32 prefix sums of magnitude ~1e4 carry ~1e-3 absolute rounding, in the reference as in the
            # kernel (docs/design.md §2: fp32 prefix sums); compare both with the fp64 truth at the bf16 tolerance.
            check_against_reference(self.fn, self.ref, inputs, extra, names=self.grad_names, dtype=dtype,
                                    device=device, tol_dtype=torch.bfloat16, ref_fp64=True)
        else:
            check_against_reference(self.fn, self.ref, inputs, extra, names=self.grad_names, dtype=dtype,
                                    device=device)
        if value == -math.inf:  # the limit is the floor's result (docs/ops.md, "Edges")
            plain = [t.detach() for t in inputs]
            floored = [t.clamp_min(-1e4) if i >= ia else t for i, t in enumerate(plain)]
            torch.testing.assert_close(self.fn(*plain, *extra), self.fn(*floored, *extra), rtol=0, atol=0)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_first_decays_get_exactly_zero_grad(self, device):
        shape = (2, 5, 6, 3, 8, 8)
        inputs = self.inputs(shape, torch.float32, device, decay_scale=1.0)
        out = self.fn(*inputs, *self.extra(shape))
        ga, gb = torch.autograd.grad(out, inputs[self.ia :], torch.randn_like(out))
        assert torch.equal(ga[:, :, 0], torch.zeros_like(ga[:, :, 0])), "alpha at column 0"
        assert torch.equal(gb[:, 0], torch.zeros_like(gb[:, 0])), "beta at row 0"
        assert ga[:, :, 1:].abs().sum() > 0 and gb[:, 1:].abs().sum() > 0

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_deterministic_and_inputs_not_mutated(self, device):
        shape = (1, 9, 7, 1, 16, 16)  # one head: packing would otherwise alias the inputs
        inputs = self.inputs(shape, torch.float32, device, decay_scale=1.0)
        assert_deterministic_unmutated(lambda *a: self.fn(*a, *self.extra(shape)), inputs)

    # ---------------------------------------------------------------- bitwise reproducibility, SIMD paths (CPU)
    determinism_shape = (2, 9, 7, 2, 16, 16)  # B * heads = 4 units of the thread pool, split unevenly by 3

    determinism_dtypes = ("float32", "float64", "bfloat16")

    def determinism_spec(self, variant) -> dict:
        return dict(shape=list(self.determinism_shape), dtypes=list(self.determinism_dtypes), variant=variant, seed=3)

    @needs_ext
    def test_bitwise_reproducible_across_threads_runs_and_processes(self, variant, tmp_path):
        """README "Tests": the CPU kernels give bit-identical outputs and gradients on 1 and 3 threads, from run
        to run, and in another process from the same seeded inputs (default SIMD path), in each dtype."""
        spec = self.determinism_spec(variant)
        child = run_op_case_in_child(type(self), spec, {}, tmp_path)
        for dt in spec["dtypes"]:
            here = {n: run_op_case(type(self), {**spec, "dtype": dt}, n, runs=2) for n in THREAD_COUNTS}
            assert_runs_equal(here[1], self.grad_names, f"{dt}: run to run, 1 thread")
            assert_runs_equal([here[1][0], *here[THREAD_COUNTS[1]]], self.grad_names,
                              f"{dt}: 1 vs {THREAD_COUNTS[1]} threads")
            for n in THREAD_COUNTS:
                assert_runs_equal([here[1][0], *child[dt, n]], self.grad_names,
                                  f"{dt}: this process vs a child process, {n} threads")

    @needs_ext
    @pytest.mark.parametrize("path", cpu_paths()[1:], ids=path_id)
    def test_lower_cpu_path(self, path, variant, tmp_path):
        """Each lower SIMD path of :func:`cpu_paths` (what CPUs without the best instruction set run), in a
        fresh process: bit-identical across threads and runs on that path, and within the float32 tolerance
        of the default path and of the float64 reference."""
        spec = self.determinism_spec(variant)
        child = run_op_case_in_child(type(self), spec, path, tmp_path)
        shape = tuple(spec["shape"])
        for dt in spec["dtypes"]:
            dtype = getattr(torch, dt)
            runs = [r for n in THREAD_COUNTS for r in child[dt, n]]
            assert_runs_equal(runs, self.grad_names, f"{path_id(path)}, {dt}: threads and runs")
            default = run_op_case(type(self), {**spec, "dtype": dt}, 1)[0]
            inputs = [t.detach().double().requires_grad_()
                      for t in self.inputs(shape, dtype, seed=spec["seed"], decay_scale=1.0)]
            want = self.ref(*inputs, *self.extra(shape, variant))
            go = torch.randn(want.shape, generator=torch.Generator().manual_seed(spec["seed"] + 1)).to(want)
            truth = [want.detach(), *torch.autograd.grad(want, inputs, go)]
            for i, name in enumerate(("out", *self.grad_names)):
                assert_close(runs[0][i], default[i], dtype, f"{name}: {path_id(path)} vs default path ({dt})",
                             grad=i > 0)
                assert_close(runs[0][i], truth[i], dtype, f"{name}: {path_id(path)} vs float64 reference ({dt})",
                             grad=i > 0)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_cuda_matches_cpu_kernels(self, device, variant):
        if device != "cuda":
            pytest.skip("compares the CUDA kernels with the CPU kernels")
        shape = (2, 5, 7, 2, 32, 32)
        args = (*self.inputs(shape, torch.float32, "cuda", requires_grad=False), *self.extra(shape, variant))
        a = self.registered()(*args)
        b = self.registered()(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in args))
        for x, y in zip(*((a, b) if isinstance(a, tuple) else ((a,), (b,)))):
            assert_close(x.cpu(), y, torch.float32, self.op)

    # ---------------------------------------------------------------- registration and tracing
    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
    def test_opcheck(self, device, dtype, variant):
        """Schema, fake kernels, autograd registration and AOT dispatch of the op and of its backward op."""
        shape = (2, 5, 6, 2, 8, 8)
        inputs, extra = self.inputs(shape, dtype, device, decay_scale=1.0), self.extra(shape, variant)
        opcheck_with_backward(self, inputs, extra)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_compile_dynamic_no_recompile(self, device, variant):
        """``torch.compile(fullgraph=True, dynamic=True)`` over three map sizes: one graph, the eager numbers."""
        import torch._dynamo

        extra = self.extra((1, 5, 6, 2, 8, 8), variant)

        def f(*inputs):
            return self.fn(*inputs, *extra).square().sum()

        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, dynamic=True, backend=SWEEPS[device].compile_backend)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for H, W in ((5, 6), (7, 4), (9, 11)):
                inputs = self.inputs((1, H, W, 2, 8, 8), torch.float32, device, decay_scale=1.0)
                loss = cf(*inputs)
                grads = torch.autograd.grad(loss, inputs)
                ref_inputs = [t.detach().requires_grad_() for t in inputs]
                ref_loss = f(*ref_inputs)
                torch.testing.assert_close(loss, ref_loss)
                for g, r in zip(grads, torch.autograd.grad(ref_loss, ref_inputs)):
                    torch.testing.assert_close(g, r)
        torch._dynamo.reset()

    @needs_ext
    @pytest.mark.parametrize("device", device_params("meta"))
    def test_traced_path_queries_no_dispatcher(self, device, monkeypatch):
        """Dynamo cannot trace ``torch._C._dispatch_has_kernel_for_dispatch_key``, so ppma code on the traced
        path must decide fused vs reference from values fixed at import: a query made from ppma code fails
        here. ``meta`` inputs take the branch of every non-CPU device, the one CUDA tensors take."""
        import sys

        import torch._dynamo

        real = torch._C._dispatch_has_kernel_for_dispatch_key

        def query(*args):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("ppma"):
                raise AssertionError(f"ppma queried the dispatcher on the traced path: {args}")
            return real(*args)  # torch's own machinery may ask

        monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", query)
        shape = (1, 3, 4, 2, 8, 8)
        inputs, extra = self.inputs(shape, torch.float32, device, requires_grad=False), self.extra(shape)
        torch._dynamo.reset()
        out = torch.compile(lambda *a: self.fn(*a, *extra), fullgraph=True, backend="eager")(*inputs)
        assert out.device.type == device and out.shape == self.fn(*inputs, *extra).shape
        torch._dynamo.reset()

    # ---------------------------------------------------------------- edges and errors
    @needs_ext
    def test_double_backward_raises(self):
        shape = (2, 5, 6, 2, 8, 8)
        inputs = self.inputs(shape)
        out = self.fn(*inputs, *self.extra(shape))
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(out.square().sum(), inputs[self.ia - 1], create_graph=True)

    def test_fallback_without_ext(self, monkeypatch):
        """Without ``_C`` the wrapper computes the reference numbers and warns once, naming the cause."""
        monkeypatch.setattr(_ext, "_LOADED", False)
        monkeypatch.setattr(_ext, "_ERROR", "not built")
        monkeypatch.setattr(_dispatch, "_FUSED_DEVICES", frozenset())
        monkeypatch.setattr(_dispatch, "_WARNED", set())
        shape = (2, 5, 6, 2, 8, 8)
        inputs, extra = self.inputs(shape, requires_grad=False), self.extra(shape)
        with pytest.warns(RuntimeWarning, match=r"ppma._C is not available \(not built\).*reference"):
            out = self.fn(*inputs, *extra)
        torch.testing.assert_close(out, self.ref(*inputs, *extra))

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("impl", ["fused", "reference"])
    @pytest.mark.parametrize("dim", ["B", "H", "W", "heads", "channels"])
    def test_empty_inputs(self, device, impl, dim):
        """A zero-sized batch, map, head count or channel count gives an empty result and zero gradients with
        either implementation (fuzzing: the reference crashed on them, hence the meta path and models)."""
        shape = [2, 3, 4, 2, 8, 8]
        shape[{"B": 0, "H": 1, "W": 2, "heads": 3, "channels": 5}[dim]] = 0
        inputs = self.inputs(tuple(shape), torch.float32, device)
        with ppma.ops.use_impl(impl):
            out = self.fn(*inputs, *self.extra(tuple(shape)))
            assert tuple(out.shape) == (*shape[:4], shape[5]) and out.device.type == device
            grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        for g, t in zip(grads, inputs):
            assert g is None or (g.shape == t.shape and not g.any())

    @needs_ext
    def test_meta_inputs(self, recwarn):
        """Meta tensors run the registered fake kernels, forward and backward, with no warning about a missing
        library (fuzzing: they fell back to the reference with that misleading warning)."""
        shape = (2, 3, 4, 2, 8, 6)
        inputs = self.inputs(shape, torch.float32, "meta")
        out = self.fn(*inputs, *self.extra(shape))
        assert out.device.type == "meta" and tuple(out.shape) == (2, 3, 4, 2, 6)
        grads = torch.autograd.grad(out.sum(), inputs)
        assert [g.shape for g in grads] == [t.shape for t in inputs]
        assert not [w for w in recwarn if "ppma" in str(w.message)]

    @needs_ext
    def test_registered_op_rejects_mixed_devices(self):
        """``torch.ops.ppma.<op>`` called directly with one input on ``meta`` dispatches to the fake kernel,
        which must raise, not return uninitialised CPU memory (fuzzing: a silent wrong result)."""
        shape = (1, 3, 4, 2, 8, 8)
        inputs, extra = self.inputs(shape, torch.float32, requires_grad=False), self.extra(shape)
        outs = self.registered()(*inputs, *extra)
        grad = (outs[0] if isinstance(outs, tuple) else outs).detach()
        bwd = getattr(torch.ops.ppma, self.op + "_backward")
        for i, name in enumerate(self.grad_names):
            args = [t.to("meta") if j == i else t for j, t in enumerate(inputs)]
            with pytest.raises(RuntimeError, match=f"{name} is on meta|is on cpu but {name} is on meta"):
                self.registered()(*args, *extra)
            with pytest.raises(RuntimeError, match=f"{name} is on meta|is on cpu but {name} is on meta"):
                bwd(grad, *self.backward_args(args, outs), *extra)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_positive_decays_rejected_on_request(self, device):
        """Log-decays must be <= 0. Unchecked by default (the check reads the data); ``set_check_decays(True)``
        makes the wrapper and the reference raise, naming the argument."""
        shape = (1, 3, 4, 2, 8, 8)
        inputs, extra = self.inputs(shape, torch.float32, device, requires_grad=False), self.extra(shape)
        inputs[self.ia + 1] = inputs[self.ia + 1].abs()  # decays above 1
        torch.testing.assert_close(self.fn(*inputs, *extra), self.ref(*inputs, *extra))
        try:
            ppma.ops.set_check_decays(True)
            for f in (self.fn, self.ref):
                with pytest.raises(ValueError, match="log_beta must be <= 0"):
                    f(*inputs, *extra)
            inputs[self.ia + 1] = -inputs[self.ia + 1]
            self.fn(*inputs, *extra)
        finally:
            ppma.ops.set_check_decays(False)

    def test_non_tensor_decays_named(self):
        """Fuzzing: None, a list or a number as log-decays gave an AttributeError."""
        shape = (1, 3, 4, 2, 8, 8)
        inputs, extra = self.inputs(shape, requires_grad=False), self.extra(shape)
        for bad in (None, [0.0], -0.5):
            args = inputs[: self.ia] + [bad] + inputs[self.ia + 1 :]
            for f in (self.fn, self.ref):
                with pytest.raises(TypeError, match="log_alpha must be a torch.Tensor, got"):
                    f(*args, *extra)


class AttentionOpTests(OpTests):
    """The generic tests plus those of the two attention ops (``q, k, v, log_alpha, log_beta, scale``)."""

    grad_names = ("q", "k", "v", "log_alpha", "log_beta")
    gradcheck_shapes = ((1, 2, 3, 2, 8, 8), (2, 3, 1, 1, 8, 4), (1, 1, 4, 1, 8, 8))
    large_case: tuple  # (shape, seed) of the CUDA-only test: too large for the CPU reference in the suite

    def inputs(self, shape, dtype=torch.float64, device="cpu", **kw):
        return make_attention_inputs(shape, dtype, device, **kw)

    def extra(self, shape, variant=None):
        return (0.7 * shape[4] ** -0.5,)  # not the default scale (test_default_scale checks that one)

    @needs_ext
    @pytest.mark.parametrize("shape", [(2, 7, 8, 2, 16, 16), (1, 13, 3, 4, 32, 32)], ids=shape_id)
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("device", DEVICES)
    def test_low_precision(self, device, shape, dtype):
        check_against_reference(self.fn, self.ref, self.inputs(shape, dtype, device), self.extra(shape),
                                names=self.grad_names, dtype=dtype, device=device)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_default_scale(self, device):
        inputs = self.inputs((2, 5, 6, 2, 12, 8), torch.float64, device, requires_grad=False)
        torch.testing.assert_close(self.fn(*inputs), self.fn(*inputs, 12**-0.5))
        torch.testing.assert_close(self.ref(*inputs), self.ref(*inputs, 12**-0.5))

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("decay_scale", [0.0, 1e4])
    def test_all_paths_decayed(self, device, decay_scale):
        """Log-decays uniform in [-1e4, 0] cut nearly every path, so dq and dk nearly cancel (~1e-33 in fp64,
        ~1e-6 from an fp32 kernel): their error is measured against the magnitude they have without decays,
        scale * |dO| * max|v| * max|k| (resp. max|q|), not against their own near-zero norm."""
        shape, scale = (1, 5, 6, 2, 32, 32), 0.2
        inputs = self.inputs(shape, torch.float32, device, decay_scale=decay_scale)
        q, k, v = (t.detach() for t in inputs[:3])
        do_vmax = scale * math.sqrt(v.numel()) * v.norm(dim=-1).max().item()  # |dO| of a unit-variance dO
        floors = {"q": do_vmax * k.norm(dim=-1).max().item(), "k": do_vmax * q.norm(dim=-1).max().item()}
        grads = check_against_reference(self.fn, self.ref, inputs, (scale,), names=self.grad_names,
                                        dtype=torch.float32, device=device, ref_fp64=True,
                                        floors=floors if decay_scale else None, only=("q", "k", "v"))
        assert all(torch.isfinite(g).all() for g in grads)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_scale_zero_propagates_nan(self, device):
        """scale = 0 with a NaN in q gives NaN where the reference does (0 * NaN is NaN), in both ops
        (fuzzing: polyline_attention's CPU kernel let BLAS skip the product and returned finite numbers)."""
        q, k, v, la, lb = self.inputs((1, 3, 4, 2, 8, 8), torch.float32, device, requires_grad=False)
        q = nan_at(q, (0, 1, 2, 0, 3))
        out, want = self.fn(q, k, v, la, lb, 0.0), self.ref(q, k, v, la, lb, 0.0)
        assert want.isnan().any() and torch.equal(out.isnan(), want.isnan())
        torch.testing.assert_close(out, want, equal_nan=True)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("where", [(0, 0), (2, 17), (5, 9)])
    def test_nan_key_propagates(self, device, where):
        """A NaN in one key, first of its lines or inside them (lines of 20 tokens: a full vector and a tail on every
        SIMD path, so the row maxima's lane reduction sees it in different lanes), gives NaN where the reference
        does and the reference's numbers elsewhere."""
        q, k, v, la, lb = self.inputs((1, 6, 20, 2, 8, 8), torch.float32, device, requires_grad=False)
        k = nan_at(k, (0, *where, 1, 3))
        out, want = self.fn(q, k, v, la, lb, 0.3), self.ref(q, k, v, la, lb, 0.3)
        assert want.isnan().any() and torch.equal(out.isnan(), want.isnan())
        torch.testing.assert_close(out, want, equal_nan=True)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_large_and_deterministic(self, device):
        if device != "cuda":
            pytest.skip("the CPU reference of this size is too slow for the default suite")
        shape, seed = self.large_case
        inputs = self.inputs(shape, torch.float32, device, seed=seed, decay_scale=1.0)
        g1 = check_against_reference(self.fn, self.ref, inputs, (0.18,), names=self.grad_names,
                                     dtype=torch.float32, device=device, ref_fp64=True, grad_mult=4.0)
        out = self.fn(*inputs, 0.18)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)  # the same dO
        for a, b in zip(g1, torch.autograd.grad(out, inputs, go)):
            assert torch.equal(a, b), "backward is not deterministic"

    def test_bad_inputs_named(self):
        """Errors that name the argument and print the shapes / values, from the wrapper and, for what it
        checks (types, shapes, devices, scale; it computes any dtype mix), from the reference."""
        q, k, v, la, lb = self.inputs((2, 5, 6, 2, 8, 8), requires_grad=False)
        cases = attention_shape_cases(q, k, v, la, lb) + [
            ((q, k, v, la, lb.unsqueeze(-1)), ValueError, "log_beta must be", True),
            ((q, k, v.float(), la, lb), ValueError, "v has dtype", False),
            ((q, k, v, la, lb.float()), ValueError, "log_beta has dtype", False),
            ((q.long(), k.long(), v.long(), la, lb), ValueError, "q must be float", False),
            ((q, k, v, la.to("meta"), lb), ValueError, "log_alpha is on", True),
            ((q, k, v.to("meta"), la, lb), ValueError, "v is on", True),
            ((q[..., :0], k[..., :0], v, la, lb), ValueError, "positive head dim", True),  # default scale d**-0.5
            ((q, k, v, la, lb, "0.5"), TypeError, "scale must be a real number", True),
            ((q, k, v, la, lb, [0.5]), TypeError, "scale must be a real number", True),
            ((q, k, v, la, lb, torch.ones(2)), TypeError, "scale must be a real number", True),
            ((q, k, v, la, lb, torch.tensor(0.5, requires_grad=True)), TypeError, "scale must be a number", True),
        ]
        assert_raises_cases(cases, self.fn, self.ref)

    @needs_ext
    def test_bad_inputs_reach_cpp_checks(self):
        """The C++ host functions validate on their own (direct torch.ops calls): RuntimeError naming the
        argument."""
        q, k, v, la, lb = self.inputs((2, 5, 6, 2, 8, 8), requires_grad=False)
        op = self.registered()
        with pytest.raises(RuntimeError, match=r"log_alpha must be \[B, H, W, heads\]"):
            op(q, k, v, la[:, :3], lb, 1.0)
        with pytest.raises(RuntimeError, match="k must have the shape of q"):
            op(q, k[:, :, :2], v, la, lb, 1.0)
        with pytest.raises(RuntimeError, match="v has dtype"):
            op(q, k, v.float(), la, lb, 1.0)
        outs = op(q, k, v, la, lb, 1.0)
        bad_lse = (*outs[:-1], outs[-1][..., :1])
        with pytest.raises(RuntimeError, match="lse must have shape"):
            getattr(torch.ops.ppma, self.op + "_backward")(outs[0], *self.backward_args([q, k, v, la, lb], bad_lse),
                                                           1.0)


# ------------------------------------------------------------------------------------------------
# The 3-D ops (paper appendix C.2; docs/video.md): inputs in the [B, T, H, W, heads, c] layout, the literal 3-D
# mask, and the generic 3-D op tests that tests/test_polyline_*_3d.py subclass. The comparisons, tolerances and
# thread helpers above serve them; the 2-D OpTests index decays as [B, H, W, heads] and cannot run on 3-D tensors,
# so the same contract is restated for the 3-D layout.
# ------------------------------------------------------------------------------------------------

# (B, T, H, W, heads, d, dv)
SHAPES_3D = (
    (1, 1, 1, 1, 1, 8, 8),
    (2, 3, 1, 4, 2, 8, 8),
    (1, 4, 3, 1, 1, 16, 12),
    (2, 2, 3, 4, 2, 8, 8),
    (1, 5, 4, 3, 3, 16, 16),
    (1, 8, 6, 5, 1, 32, 32),
    (1, 1, 7, 9, 2, 16, 8),
)


def make_inputs_3d(shape, dtype=torch.float64, *, decay_scale=0.5, seed=0, requires_grad=True, nonneg=False,
                   device="cpu"):
    """``[q, k, v, log_alpha, log_beta, log_gamma]`` for ``shape = (B, T, H, W, heads, d, dv)``: normal features
    (``|.|`` of q, k with ``nonneg``), log-decays uniform in ``[-decay_scale, 0]`` (fp32 for low precision)."""
    B, T, H, W, G, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, W, G, d, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, W, G, dv, generator=gen)
    if nonneg:
        q, k = q.abs(), k.abs()
    decs = [-decay_scale * torch.rand(B, T, H, W, G, generator=gen) for _ in range(3)]
    out = [t.to(device, dtype) for t in (q, k, v)] + [t.to(device, decay_dtype_for(dtype)) for t in decs]
    return [t.requires_grad_(requires_grad) for t in out]


def literal_mask_3d(la, lb, lg) -> torch.Tensor:
    """``M[b, g, p, s]`` pair by pair from the definition (paper appendix C.2): for query ``p = (t, i, j)`` and key
    ``s = (u, k, l)``, ``Gamma_(k,l)[t..u] + Beta_(t,l)[i..k] + Alpha_(t,i)[j..l]``, each the sum of the line's
    log-decays (floored at -1e4) at indices ``min+1 .. max``. Slow; small shapes only."""
    B, T, H, W, G = la.shape
    la, lb, lg = (x.detach().double().clamp_min(-1e4) for x in (la, lb, lg))

    def seg(line, a, b):
        lo, hi = min(a, b), max(a, b)
        return line[lo + 1 : hi + 1].sum()

    N = T * H * W
    M = torch.zeros(B, G, N, N, dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            for p in range(N):
                t, i, j = p // (H * W), (p // W) % H, p % W
                for s in range(N):
                    u, k, l = s // (H * W), (s // W) % H, s % W
                    M[b, g, p, s] = seg(lg[b, :, k, l, g], t, u) + seg(lb[b, t, :, l, g], i, k) + seg(
                        la[b, t, i, :, g], j, l)
    return M


class Op3DTests:
    """The contract of every 3-D op. A subclass sets ``op`` (the name under ``torch.ops.ppma``), ``fn`` / ``ref``
    (wrapper and reference, as ``staticmethod``), ``fn2d`` (the 2-D op it equals at ``T = 1``), ``grad_names``,
    ``nonneg`` (q, k non-negative), and implements ``extra`` and ``backward_args``; ``to_2d`` maps the 3-D inputs
    of ``T = 1`` to the 2-D op's."""

    op: str
    fn = None
    ref = None
    fn2d = None
    grad_names: tuple
    nonneg = False
    gradcheck_shapes = ((1, 2, 2, 3, 2, 4, 3), (1, 3, 1, 2, 1, 4, 2))

    @pytest.fixture
    def variant(self):
        return None

    def extra(self, variant=None) -> tuple:
        raise NotImplementedError

    def backward_args(self, inputs, outs) -> tuple:
        raise NotImplementedError

    def inputs(self, shape, dtype=torch.float64, **kw):
        return make_inputs_3d(shape, dtype, nonneg=self.nonneg, **kw)

    def to_2d(self, inputs):
        return [t[:, 0] for t in inputs[:-1]]  # drop T and log_gamma

    def registered(self):
        return getattr(torch.ops.ppma, self.op)

    @property
    def nd(self) -> int:  # tensors before the three decays
        return len(self.grad_names) - 3

    def decay_grads_zero_at_line_starts(self, grads):
        ga, gb, gg = grads[self.nd :]
        assert not ga[:, :, :, 0].any() and not gb[:, :, 0].any() and not gg[:, 0].any()

    # ---------------------------------------------------------------- against the reference
    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    @pytest.mark.parametrize("shape", SHAPES_3D, ids=shape_id)
    def test_matches_reference(self, shape, dtype, variant):
        inputs = self.inputs(shape, dtype, decay_scale=1.0)
        grads = check_against_reference(self.fn, self.ref, inputs, self.extra(variant), names=self.grad_names,
                                        dtype=dtype)
        self.decay_grads_zero_at_line_starts(grads)

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
    def test_low_precision(self, dtype, variant):
        """16-bit features (fp32 decays), computed in fp32 as the reference does, within the 16-bit tolerance."""
        inputs = self.inputs((2, 3, 4, 5, 2, 16, 16), dtype)
        check_against_reference(self.fn, self.ref, inputs, self.extra(variant), names=self.grad_names, dtype=dtype)

    @needs_ext
    def test_gradcheck(self, variant):
        for shape in self.gradcheck_shapes:
            inputs = self.inputs(shape, torch.float64)
            assert torch.autograd.gradcheck(lambda *a: self.fn(*a, *self.extra(variant)), inputs, eps=1e-6,
                                            atol=1e-7)

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    def test_t1_equals_2d_op(self, dtype, variant):
        """With ``T = 1`` the 3-D op is the 2-D op (forward and every gradient; gamma gets zero gradient)."""
        shape = (2, 1, 5, 6, 2, 8, 8)
        inputs = self.inputs(shape, dtype, decay_scale=1.0)
        out3 = self.fn(*inputs, *self.extra(variant))
        inputs2 = [t.detach()[:, 0].clone().requires_grad_() for t in inputs[:-1]]
        out2 = self.fn2d(*inputs2, *self.extra(variant))
        assert_close(out3[:, 0], out2, dtype, "forward")
        go = torch.randn(out2.shape, generator=torch.Generator().manual_seed(1)).to(out2)
        g3 = torch.autograd.grad(out3, inputs, go[:, None])
        g2 = torch.autograd.grad(out2, inputs2, go)
        for name, a, b in zip(self.grad_names, g3, g2):
            assert_close(a[:, 0], b, dtype, f"grad {name}", grad=True)
        assert not g3[-1].any()
        torch.testing.assert_close(self.ref(*[t.detach() for t in inputs], *self.extra(variant))[:, 0],
                                   self.fn2d(*[t.detach() for t in inputs2], *self.extra(variant)))

    @needs_ext
    def test_noncontiguous(self, variant):
        shape = (2, 3, 4, 5, 2, 8, 6)
        inputs = self.inputs(shape, torch.float64)
        strided = []
        for t in inputs:
            x = t.detach()
            x = x.transpose(1, 3).contiguous().transpose(1, 3)
            assert not x.is_contiguous()
            strided.append(x.requires_grad_())
        check_against_reference(self.fn, self.ref, strided, self.extra(variant), names=self.grad_names,
                                dtype=torch.float64, ref_fp64=False)

    @needs_ext
    @pytest.mark.parametrize("value", [-1e4, 0.0, -math.inf], ids=["-1e4", "0", "-inf"])
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    def test_extreme_decays(self, value, dtype):
        """Every other position of each axis fully decayed (``-inf``: a decay of 0), or exactly 1."""
        shape = (2, 4, 5, 4, 2, 8, 8)
        inputs = self.inputs(shape, dtype, decay_scale=1.0)
        n = self.nd
        with torch.no_grad():
            inputs[n][:, :, :, ::2] = value
            inputs[n + 1][:, :, 1::2] = value
            inputs[n + 2][:, ::2] = value
        tol_dtype = torch.bfloat16 if (value != 0.0 and dtype == torch.float32) else dtype
        check_against_reference(self.fn, self.ref, inputs, self.extra(), names=self.grad_names, dtype=dtype,
                                tol_dtype=tol_dtype, ref_fp64=tol_dtype != dtype)
        if value == -math.inf:
            plain = [t.detach() for t in inputs]
            floored = [t.clamp_min(-1e4) if i >= n else t for i, t in enumerate(plain)]
            torch.testing.assert_close(self.fn(*plain, *self.extra()), self.fn(*floored, *self.extra()), rtol=0,
                                       atol=0)

    @needs_ext
    def test_deterministic_thread_invariant_inputs_not_mutated(self, variant):
        inputs = self.inputs((1, 3, 5, 4, 2, 8, 8), torch.float32, decay_scale=1.0)
        assert_deterministic_unmutated(lambda *a: self.fn(*a, *self.extra(variant)), inputs)
        assert_thread_invariant(lambda *a: self.fn(*a, *self.extra(variant)), inputs)

    def case_results(self, variant, dtype: torch.dtype, threads: int) -> list[torch.Tensor]:
        """``[out, *gradients]`` of the op on the seeded determinism case (B * heads = 4) on ``threads`` threads."""
        inputs = self.inputs((2, 3, 5, 4, 2, 8, 8), dtype, decay_scale=1.0, seed=7)
        n = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = self.fn(*inputs, *self.extra(variant))
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(out.dtype)
            return [out.detach(), *torch.autograd.grad(out, inputs, g)]
        finally:
            torch.set_num_threads(n)

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
    def test_bitwise_across_threads_and_processes(self, dtype, variant, tmp_path):
        """The same seeded inputs give bitwise the same outputs and gradients on 1 and 3 threads and in a fresh
        child process (the kernels own fixed slices and summation orders; nothing depends on the process)."""
        here = [self.case_results(variant, dtype, t) for t in (1, 3)]
        path = tmp_path / "child.pt"
        cls = type(self)
        code = (f"import ast, importlib, torch\n"
                f"cls = getattr(importlib.import_module({cls.__module__!r}), {cls.__name__!r})\n"
                f"res = cls().case_results(ast.literal_eval({repr(variant)!r}), torch.{str(dtype).split('.')[-1]}, 3)\n"
                f"torch.save(res, {str(path)!r})\n")
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONPATH": tests_dir + os.pathsep + os.environ.get("PYTHONPATH", "")}
        res = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(tests_dir),
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        child = torch.load(path)
        names = ("out",) + tuple(self.grad_names)
        for name, a, b, c in zip(names, here[0], here[1], child):
            assert torch.equal(a, b), f"{self.op}: {name} differs between 1 and 3 threads"
            assert torch.equal(b, c), f"{self.op}: {name} differs in a child process"

    # ---------------------------------------------------------------- registration and tracing
    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    def test_opcheck(self, dtype, variant):
        inputs = self.inputs((2, 2, 3, 4, 2, 8, 8), dtype, decay_scale=1.0)
        extra = self.extra(variant)
        opcheck_with_backward(self, inputs, extra)

    @needs_ext
    def test_compile_dynamic_no_recompile(self, variant):
        import torch._dynamo

        extra = self.extra(variant)

        def f(*inputs):
            return self.fn(*inputs, *extra).square().sum()

        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            for T, H, W in ((3, 5, 6), (4, 7, 3), (5, 3, 9)):
                inputs = self.inputs((1, T, H, W, 2, 8, 8), torch.float32, decay_scale=1.0)
                loss = cf(*inputs)
                grads = torch.autograd.grad(loss, inputs)
                ref_inputs = [t.detach().requires_grad_() for t in inputs]
                ref_loss = f(*ref_inputs)
                torch.testing.assert_close(loss, ref_loss)
                for g, r in zip(grads, torch.autograd.grad(ref_loss, ref_inputs)):
                    torch.testing.assert_close(g, r)
        torch._dynamo.reset()

    def test_double_backward_raises(self):
        inputs = self.inputs((1, 2, 3, 4, 2, 8, 8))
        out = self.fn(*inputs, *self.extra())
        if not _dispatch.run_fused(inputs[0]):
            pytest.skip("the reference supports double backward")
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(out.square().sum(), inputs[0], create_graph=True)

    # ---------------------------------------------------------------- edges and errors
    @needs_ext
    @pytest.mark.parametrize("impl", ["fused", "reference"])
    @pytest.mark.parametrize("dim", [0, 1, 2, 3, 4, 6], ids=["B", "T", "H", "W", "heads", "channels"])
    def test_empty_inputs(self, impl, dim):
        shape = [2, 2, 3, 4, 2, 8, 8]
        shape[dim] = 0
        inputs = self.inputs(tuple(shape), torch.float32)
        with ppma.ops.use_impl(impl):
            out = self.fn(*inputs, *self.extra())
            assert tuple(out.shape) == (*shape[:5], shape[6])
            grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        for g, t in zip(grads, inputs):
            assert g is None or (g.shape == t.shape and not g.any())

    @needs_ext
    @pytest.mark.parametrize("skip_nan_outputs", [True, False], ids=["finite-loss", "nan-loss"])
    @pytest.mark.parametrize("axis", [0, 1, 2], ids=["alpha", "beta", "gamma"])
    def test_nan_decays_match_reference(self, axis, skip_nan_outputs):
        """NaN log-decays (docs/ops.md "Edges"): the output and every gradient equal the reference's entry by
        entry, NaN where it has NaN and close elsewhere (fp64; the V2H and H2V halves of the mask keep their
        NaNs apart in the backward as in the reference)."""
        for seed in range(4):
            shape = ((1, 2, 2, 2, 1, 2, 2), (2, 2, 3, 2, 2, 3, 3), (1, 3, 1, 4, 2, 2, 3), (1, 2, 4, 1, 1, 3, 2))[seed]
            inputs = [t.detach() for t in self.inputs(shape, torch.float64, decay_scale=2.0, seed=seed)]
            flat = inputs[self.nd + axis].view(-1)
            g = torch.Generator().manual_seed(100 + seed)
            flat[torch.randint(0, flat.numel(), (1 + seed % 2,), generator=g)] = float("nan")
            results = []
            for f in (self.fn, self.ref):
                leaves = [t.clone().requires_grad_() for t in inputs]
                out = f(*leaves, *self.extra())
                w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
                loss = ((out.nan_to_num(0.0) if skip_nan_outputs else out) * w).sum()
                results.append([out.detach(), *torch.autograd.grad(loss, leaves)])
            for name, a, b in zip(("out", *self.grad_names), *results):
                assert torch.equal(a.isnan(), b.isnan()), (
                    f"{self.op} seed {seed}: {name} is NaN at {int(a.isnan().sum())} entries, the reference's at "
                    f"{int(b.isnan().sum())}")
                torch.testing.assert_close(a.nan_to_num(0.0), b.nan_to_num(0.0), rtol=1e-9, atol=1e-9,
                                           msg=lambda m: f"{self.op} seed {seed}, {name}: {m}")

    @needs_ext
    def test_meta_inputs(self, recwarn):
        shape = (2, 2, 3, 4, 2, 8, 6)
        inputs = self.inputs(shape, torch.float32, device="meta")
        out = self.fn(*inputs, *self.extra())
        assert out.device.type == "meta" and tuple(out.shape) == (2, 2, 3, 4, 2, 6)
        grads = torch.autograd.grad(out.sum(), inputs)
        assert [g.shape for g in grads] == [t.shape for t in inputs]
        assert not [w for w in recwarn if "ppma" in str(w.message)]

    @needs_ext
    def test_registered_op_rejects_mixed_devices(self):
        inputs, extra = self.inputs((1, 2, 3, 4, 2, 8, 8), torch.float32, requires_grad=False), self.extra()
        for i, name in enumerate(self.grad_names):
            args = [t.to("meta") if j == i else t for j, t in enumerate(inputs)]
            with pytest.raises(RuntimeError, match=f"{name} is on meta|is on cpu but {name} is on meta"):
                self.registered()(*args, *extra)

    def test_positive_decays_rejected_on_request(self):
        inputs = self.inputs((1, 2, 3, 4, 2, 8, 8), torch.float32, requires_grad=False)
        inputs[-1] = inputs[-1].abs()
        try:
            ppma.ops.set_check_decays(True)
            for f in (self.fn, self.ref):
                with pytest.raises(ValueError, match="log_gamma must be <= 0"):
                    f(*inputs, *self.extra())
        finally:
            ppma.ops.set_check_decays(False)

    def test_bad_inputs_named(self):
        inputs = self.inputs((2, 2, 3, 4, 2, 8, 8), requires_grad=False)
        n = self.nd
        cases = [
            (inputs[:n] + [inputs[n][:, :, :2]] + inputs[n + 1 :], ValueError, "log_alpha must be"),
            (inputs[:n + 2] + [inputs[n + 2].float()], ValueError, "log_gamma has dtype"),
            (inputs[:n + 2] + [None], TypeError, "log_gamma must be a torch.Tensor"),
            (inputs[:n + 1] + [inputs[n + 1].to("meta")] + inputs[n + 2 :], ValueError, "log_beta is on"),
            ([t[0] for t in inputs[:n]] + inputs[n:], ValueError, "must be \\[B, T, H, W, heads"),
        ]
        for args, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                self.fn(*args, *self.extra())

    @needs_ext
    def test_bad_inputs_reach_cpp_checks(self):
        inputs = self.inputs((2, 2, 3, 4, 2, 8, 8), requires_grad=False)
        n = self.nd
        with pytest.raises(RuntimeError, match=r"log_gamma must be \[B, T, H, W, heads\]"):
            self.registered()(*inputs[: n + 2], inputs[n + 2][:, :1], *self.extra())
        with pytest.raises(RuntimeError, match="log_gamma has dtype"):
            self.registered()(*inputs[: n + 2], inputs[n + 2].float(), *self.extra())
