"""CUDA kernels of ``torch.ops.ppma`` against the pure-PyTorch reference and the CPU kernels (design §5).

Skipped without a GPU or without the CUDA kernels in ``ppma._C``. Forward and every gradient are checked
(the backward ops are called directly, against autograd through ``ppma.ops.reference``), plus determinism
of the backward (two runs bitwise equal), ``opcheck`` and ``torch.compile`` through the public wrappers,
and the large shapes (200x336 criss-cross, 64x64 full attention). fp16 / bf16 polyline_attention with head dims
that are multiples of 8 runs on the tensor-core kernels (compared with the CUDA-core ones on the same inputs);
the launch limits (B * heads > 65535, head dims above 128 and above 512, misaligned rows) and the packed
short-line criss-cross kernels have tests of their own. ``PPMA_TEST_FULL=1`` widens the sweep.
"""

from __future__ import annotations

import os

import pytest
import torch

import ppma  # noqa: F401  (loads ppma._C when built)
from ppma._ext import has_cuda_kernels, has_ext
from ppma.ops import reference as ref

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_ext() and has_cuda_kernels()),
    reason="needs a GPU and ppma._C built with its CUDA kernels",
)

from tolerances import TOLERANCES  # the one per-dtype table shared with the CPU tests

TOL = {dtype: fwd for dtype, (fwd, _) in TOLERANCES.items()}  # relative norm error, forward

FULL = os.environ.get("PPMA_TEST_FULL", "0") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [  # (B, H, W, heads, d, dv)
    (1, 1, 1, 1, 16, 16),
    (2, 1, 7, 2, 16, 16),
    (1, 7, 1, 1, 32, 32),
    (2, 3, 8, 2, 32, 32),
    (1, 13, 7, 3, 64, 64),
    (1, 8, 13, 2, 24, 40),  # generic head dims (padded path)
    (3, 2, 3, 1, 96, 128),
    (1, 3, 70, 2, 32, 32),  # W > 64: row segments (tensor-core tiles), lines > 64 (criss-cross generic kernels)
    (1, 14, 14, 2, 32, 32),
]
if FULL:
    SHAPES += [(2, 56, 56, 2, 16, 16), (1, 13, 70, 2, 32, 32), (1, 70, 9, 1, 64, 64), (2, 14, 14, 4, 32, 32),
               (1, 1, 300, 1, 32, 32), (2, 32, 32, 4, 32, 32), (1, 48, 48, 2, 32, 32), (1, 13, 33, 2, 128, 64)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_inputs(shape, dtype, decay_scale=1.0, seed=0, noncontig=False):
    B, H, W, G, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, W, G, d, generator=g)
    k = torch.randn(B, H, W, G, d, generator=g)
    v = torch.randn(B, H, W, G, dv, generator=g)
    la = -decay_scale * torch.rand(B, H, W, G, generator=g)
    lb = -decay_scale * torch.rand(B, H, W, G, generator=g)
    dev = "cuda"
    q, k, v = (t.to(dev, dtype) for t in (q, k, v))
    la, lb = la.to(dev), lb.to(dev)
    if noncontig:  # same values, permuted storage
        q = q.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
        k = k.transpose(3, 0).contiguous().transpose(3, 0)
    return q, k, v, la, lb


def ref_grads(fn, q, k, v, la, lb, scale, go):
    """Reference forward and gradients in float64 on the same device."""
    ins = [t.detach().double().requires_grad_(True) for t in (q, k, v, la, lb)]
    out = fn(*ins, scale)
    gs = torch.autograd.grad(out, ins, go.double())
    return out, gs


def check(name, got, want, dtype, mult=1.0):
    tol = TOL[dtype] * mult
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


# ---------------------------------------------------------------------------------------------
# polyline_attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_polyline_attention_vs_reference(shape, dtype):
    q, k, v, la, lb = make_inputs(shape, dtype, noncontig=shape[1] > 1)
    scale = shape[4] ** -0.5
    out, out_v2h, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, scale)
    go = torch.randn_like(out)
    want, wgrads = ref_grads(ref.polyline_attention_ref, q, k, v, la, lb, scale, go)
    check("out", out, want, dtype)
    grads = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, out_v2h, lse, scale)
    for n, g, w in zip(("q", "k", "v", "log_alpha", "log_beta"), grads, wgrads):
        check(f"grad_{n}", g, w, dtype, mult=2.0)
    assert grads[3][:, :, 0].abs().max() == 0 and grads[4][:, 0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32])
def test_polyline_attention_extreme_decays(dtype):
    for scale_d in (0.0, 1e4):
        q, k, v, la, lb = make_inputs((1, 5, 6, 2, 32, 32), dtype, decay_scale=scale_d)
        out, ov, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.2)
        go = torch.randn_like(out)
        want, wgrads = ref_grads(ref.polyline_attention_ref, q, k, v, la, lb, 0.2, go)
        check("out", out, want, dtype)
        grads = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.2)
        for n, g, w in zip(("q", "k", "v"), grads[:3], wgrads[:3]):
            check(f"grad_{n}", g, w, dtype, mult=2.0)
        assert all(torch.isfinite(g).all() for g in grads)


def test_polyline_attention_large_and_deterministic():
    q, k, v, la, lb = make_inputs((1, 64, 64, 2, 32, 32), torch.float32, seed=3)
    out, ov, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.18)
    go = torch.randn_like(out)
    want, wgrads = ref_grads(ref.polyline_attention_ref, q, k, v, la, lb, 0.18, go)
    check("out", out, want, torch.float32)
    g1 = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.18)
    g2 = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.18)
    for a, b, w in zip(g1, g2, wgrads):
        assert torch.equal(a, b), "backward is not deterministic"
        check("grad", a, w, torch.float32, mult=4.0)


# ---------------------------------------------------------------------------------------------
# criss_cross_attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_criss_cross_vs_reference(shape, dtype):
    q, k, v, la, lb = make_inputs(shape, dtype, noncontig=shape[1] > 1)
    scale = shape[4] ** -0.5
    out, lse = torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, scale)
    go = torch.randn_like(out)
    want, wgrads = ref_grads(ref.criss_cross_attention_ref, q, k, v, la, lb, scale, go)
    check("out", out, want, dtype)
    grads = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, scale)
    for n, g, w in zip(("q", "k", "v", "log_alpha", "log_beta"), grads, wgrads):
        check(f"grad_{n}", g, w, dtype, mult=2.0)


def test_criss_cross_large_and_deterministic():
    q, k, v, la, lb = make_inputs((1, 200, 336, 1, 32, 32), torch.float32, seed=5)
    out, lse = torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, 0.18)
    go = torch.randn_like(out)
    want, wgrads = ref_grads(ref.criss_cross_attention_ref, q, k, v, la, lb, 0.18, go)
    check("out", out, want, torch.float32)
    g1 = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, 0.18)
    g2 = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, 0.18)
    for a, b, w in zip(g1, g2, wgrads):
        assert torch.equal(a, b), "backward is not deterministic"
        check("grad", a, w, torch.float32, mult=4.0)


# ---------------------------------------------------------------------------------------------
# polyline_scan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_polyline_scan_vs_reference(shape, dtype, transpose):
    B, H, W, G, _, c = shape
    x, _, _, la, lb = make_inputs((B, H, W, G, c, c), dtype)
    y = torch.ops.ppma.polyline_scan(x, la, lb, transpose)
    gy = torch.randn_like(y)
    ins = [t.detach().double().requires_grad_(True) for t in (x, la, lb)]
    want = ref.polyline_scan_ref(*ins, transpose)
    wgrads = torch.autograd.grad(want, ins, gy.double())
    check("y", y, want, dtype)
    grads = torch.ops.ppma.polyline_scan_backward(gy, x, la, lb, transpose)
    for n, g, w in zip(("x", "log_alpha", "log_beta"), grads, wgrads):
        check(f"grad_{n}", g, w, dtype, mult=2.0)
    g2 = torch.ops.ppma.polyline_scan_backward(gy, x, la, lb, transpose)
    assert all(torch.equal(a, b) for a, b in zip(grads, g2))


# ---------------------------------------------------------------------------------------------
# CUDA vs CPU kernels, opcheck, torch.compile (through the public wrappers)
# ---------------------------------------------------------------------------------------------


def _has_cpu_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"ppma::{op}", "CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
def test_cuda_vs_cpu(op, dtype):
    if not _has_cpu_kernel(op):
        pytest.skip("CPU kernel not built")
    q, k, v, la, lb = make_inputs((2, 5, 7, 2, 32, 32), dtype)
    f = getattr(torch.ops.ppma, op)
    a = f(q, k, v, la, lb, 0.2)
    b = f(q.cpu(), k.cpu(), v.cpu(), la.cpu(), lb.cpu(), 0.2)
    for x, y in zip(a, b):
        check(op, x.cpu(), y, dtype)


def _wrapper(op):
    import ppma.ops as ops

    return getattr(ops, op)


@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
def test_opcheck(op):
    q, k, v, la, lb = make_inputs((1, 3, 4, 2, 16, 16), torch.float32)
    args = [t.requires_grad_(True) for t in (q, k, v, la, lb)] + [0.25]
    torch.library.opcheck(getattr(torch.ops.ppma, op).default, args)


def test_opcheck_scan():
    x, _, _, la, lb = make_inputs((1, 3, 4, 2, 8, 8), torch.float32)
    torch.library.opcheck(torch.ops.ppma.polyline_scan.default, (x.requires_grad_(True), la, lb, False))


@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
def test_compile(op):
    fn = _wrapper(op)
    q, k, v, la, lb = make_inputs((1, 6, 5, 2, 32, 32), torch.float32)
    ins = [t.requires_grad_(True) for t in (q, k, v, la, lb)]
    cfn = torch.compile(fn, fullgraph=True, dynamic=True)
    out = cfn(*ins, 0.2)
    want = fn(*ins, 0.2)
    check(op, out, want, torch.float32)
    out.sum().backward()


# ---------------------------------------------------------------------------------------------
# Tensor-core polyline_attention (fp16 / bf16, d and dv multiples of 8 up to 128), the launch limits, and the
# packed short-line criss-cross kernels (issue 9). The same kernels run on the CPU through the emulator in
# tests/test_cuda_emulation.py; these run them on the GPU.
# ---------------------------------------------------------------------------------------------

# fp16 / bf16 with d, dv multiples of 8 (most of SHAPES) take the tensor-core path in the tests above; this adds the
# comparison with the CUDA-core path on the same inputs.
def test_polyline_attention_tensor_cores_vs_cuda_cores(monkeypatch):
    """The two CUDA paths on the same bf16 inputs agree up to the 16-bit rounding of P and dS."""
    shape = (2, 12, 12, 2, 32, 32)
    q, k, v, la, lb = make_inputs(shape, torch.bfloat16, seed=11)
    go = torch.randn(q.shape[:4] + (32,), device="cuda", dtype=torch.bfloat16)

    def run():
        o = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.2)
        return (*o, *torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, *o, 0.2))

    tc = run()
    monkeypatch.setenv("PPMA_CUDA_TENSOR_CORES", "0")
    core = run()
    for name, a, b in zip(("out", "out_v2h", "lse", "dq", "dk", "dv", "dla", "dlb"), tc, core):
        assert rel_err(a, b) < (1e-4 if name == "lse" else 2e-2), name


@pytest.mark.parametrize("path", ["tensor_cores", "cuda_cores"])
def test_polyline_attention_deterministic_large(path, monkeypatch):
    """4096 tokens in bf16: right numbers, and two backward runs bitwise equal (no atomics anywhere)."""
    if path == "cuda_cores":
        monkeypatch.setenv("PPMA_CUDA_TENSOR_CORES", "0")
    q, k, v, la, lb = make_inputs((1, 64, 64, 2, 32, 32), torch.bfloat16, seed=7)
    out, ov, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.18)
    go = torch.randn_like(out)
    want, wgrads = ref_grads(ref.polyline_attention_ref, q, k, v, la, lb, 0.18, go)
    check("out", out, want, torch.bfloat16)
    g1 = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.18)
    g2 = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.18)
    for a, b, w in zip(g1, g2, wgrads):
        assert torch.equal(a, b), "backward is not deterministic"
        check("grad", a, w, torch.bfloat16, mult=2.0)


def test_polyline_attention_misaligned_rows():
    """Rows that are not 16-byte aligned (a storage offset of one element) go through a copy, same numbers."""
    q, k, v, la, lb = make_inputs((1, 5, 6, 2, 32, 32), torch.bfloat16, seed=2)
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    qm = buf[1:].view(q.shape).copy_(q)
    a = torch.ops.ppma.polyline_attention(qm, k, v, la, lb, 0.2)
    b = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
def test_many_batch_heads(op):
    """B * heads above 65535 (the limit of gridDim.y): the 1-D grids cover every (b, head)."""
    B, H, W, G, d = 33000, 1, 3, 2, 16
    q, k, v, la, lb = make_inputs((B, H, W, G, d, d), torch.float32, seed=4)
    f = getattr(torch.ops.ppma, op)
    outs = f(q, k, v, la, lb, 0.25)
    ref_fn = ref.polyline_attention_ref if op == "polyline_attention" else ref.criss_cross_attention_ref
    idx = torch.tensor([0, 1, B // 2, B - 1], device="cuda")  # spot-check batches spread over the grid
    want = ref_fn(q[idx].double(), k[idx].double(), v[idx].double(), la[idx].double(), lb[idx].double(), 0.25)
    check(op, outs[0][idx], want, torch.float32)
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_above_128(dtype):
    """Head dims up to 512 run on the CUDA-core kernels (zero-padded to 256 or 512)."""
    for shape in [(1, 3, 4, 1, 200, 136), (1, 2, 3, 1, 300, 512)]:
        q, k, v, la, lb = make_inputs(shape, dtype, seed=shape[4])
        scale = shape[4] ** -0.5
        for op, ref_fn in (("polyline_attention", ref.polyline_attention_ref),
                           ("criss_cross_attention", ref.criss_cross_attention_ref)):
            outs = getattr(torch.ops.ppma, op)(q, k, v, la, lb, scale)
            want = ref_fn(*(t.double() for t in (q, k, v, la, lb)), scale)
            check(op, outs[0], want, dtype)


def test_head_dim_above_512_is_refused():
    q, k, v, la, lb = make_inputs((1, 2, 2, 1, 520, 16), torch.float32)
    for op in ("polyline_attention", "criss_cross_attention"):
        with pytest.raises(RuntimeError, match="head dims up to 512"):
            getattr(torch.ops.ppma, op)(q, k, v, la, lb, 0.1)


CC_PACKED = [(2, 28, 28, 2, 32, 32), (1, 56, 56, 1, 16, 16), (2, 7, 9, 3, 16, 16), (1, 70, 5, 1, 32, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", CC_PACKED)
def test_criss_cross_packed_lines(shape, dtype):
    """Short lines (<= 64) run packed, several per block (70-long columns: the generic kernels), deterministic."""
    q, k, v, la, lb = make_inputs(shape, dtype, seed=sum(shape))
    scale = shape[4] ** -0.5
    out, lse = torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, scale)
    go = torch.randn_like(out)
    want, wgrads = ref_grads(ref.criss_cross_attention_ref, q, k, v, la, lb, scale, go)
    check("out", out, want, dtype)
    g1 = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, scale)
    g2 = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, scale)
    for n, a, b, w in zip(("q", "k", "v", "log_alpha", "log_beta"), g1, g2, wgrads):
        assert torch.equal(a, b), f"grad_{n}: backward is not deterministic"
        check(f"grad_{n}", a, w, dtype, mult=2.0)
