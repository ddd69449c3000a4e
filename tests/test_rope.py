"""``ppma.ops.cpu.rope`` (the fused RoPE of queries and keys) against ``ppma.ops.reference.rope_ref`` and the module
formula ``ppma.nn.rope.apply_rotary``: forward and gradients over the CPU sweep's shapes, all dtypes, gradcheck,
second derivatives, opcheck, ``torch.compile``, the argument checks, and the in-place ``rope_`` (the same values)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ppma
from op_utils import SWEEPS, TOLERANCES, assert_close, needs_ext
from ppma import backends
from test_cpu_baseline import ROOT, cpu_subprocess_env
from ppma.nn.rope import apply_rotary, rotary_angle, rotary_sin_cos
from ppma.ops.reference import rope_ref

SHAPES = sorted({(b, h, w, g, d) for b, h, w, g, d, _ in SWEEPS["cpu"].shapes} | {(2, 3, 5, 2, 6)})


def _inputs(shape, dtype, table_dtype=None, seed=0, requires_grad=False):
    B, H, W, G, d = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
    table_dtype = table_dtype or torch.promote_types(dtype, torch.float32)
    sin, cos = rotary_sin_cos(rotary_angle(d).to(table_dtype), H, W)
    return x, sin, cos


def test_reference_is_the_module_formula():
    """``rope_ref`` with scale 1 is ``apply_rotary`` (the official ``theta_shift``); the scale applies first."""
    x, sin, cos = _inputs((2, 3, 4, 2, 8), torch.float64)
    torch.testing.assert_close(rope_ref(x, sin, cos), apply_rotary(x, sin, cos), rtol=0, atol=0)
    torch.testing.assert_close(rope_ref(x, sin, cos, 0.25), apply_rotary(x * 0.25, sin, cos), rtol=0, atol=0)


def test_reference_transpose_is_the_adjoint_and_inverse():
    """``<y, T(x)> = <T^T(y), x>``, and for true sin/cos tables ``T^T`` undoes ``T`` (a rotation)."""
    x, sin, cos = _inputs((2, 3, 4, 2, 8), torch.float64)
    y = torch.randn_like(x)
    lhs = (y * rope_ref(x, sin, cos, 0.5)).sum()
    rhs = (rope_ref(y, sin, cos, 0.5, transpose=True) * x).sum()
    torch.testing.assert_close(lhs, rhs)
    torch.testing.assert_close(rope_ref(rope_ref(x, sin, cos), sin, cos, transpose=True), x)
    # general tables (sin of a pair not equal): the adjoint identity still holds
    s2, c2 = torch.randn_like(sin), torch.randn_like(cos)
    torch.testing.assert_close((y * rope_ref(x, s2, c2)).sum(), (rope_ref(y, s2, c2, transpose=True) * x).sum())


@needs_ext
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, transpose):
    """Forward and input gradient of the fused op match the reference, in the input dtype, for a non-trivial
    scale; low precision inputs with fp32 tables come back in their own dtype."""
    x, sin, cos = _inputs(shape, dtype, requires_grad=True)
    xr = x.detach().requires_grad_()
    y = ppma.ops.cpu.rope(x, sin, cos, 0.3, transpose)
    y_ref = rope_ref(xr, sin, cos, 0.3, transpose)
    assert y.dtype == dtype and y.is_contiguous()
    assert_close(y, y_ref, dtype, "rope")
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    (gx_ref,) = torch.autograd.grad(y_ref, xr, gy)
    assert gx.dtype == dtype
    assert_close(gx, gx_ref, dtype, "rope grad x", grad=True)


@needs_ext
def test_fp64_bitwise_equal_to_module_formula():
    """In fp64 the kernel computes the formula's products and sums in the formula's order: bit-exact."""
    x, sin, cos = _inputs((2, 7, 9, 3, 16), torch.float64)
    assert torch.equal(ppma.ops.cpu.rope(x, sin, cos), apply_rotary(x, sin, cos))
    assert torch.equal(ppma.ops.cpu.rope(x, sin, cos, 0.125), apply_rotary(x * 0.125, sin, cos))


@needs_ext
def test_noncontiguous_and_fp64_tables():
    x, sin, cos = _inputs((2, 4, 5, 2, 8), torch.float32, table_dtype=torch.float64)
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not xt.is_contiguous()
    y = ppma.ops.cpu.rope(xt, sin, cos, 0.5)
    assert y.dtype == torch.float32
    assert_close(y, rope_ref(x, sin, cos, 0.5), torch.float32, "rope (fp64 tables, strided x)")


@needs_ext
@pytest.mark.parametrize("transpose", [False, True])
def test_gradcheck_including_tables(transpose):
    """First and second derivatives in fp64, including those of the tables (general, unpaired values)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    sin = torch.randn(3, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    cos = torch.randn(3, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x, sin, cos):
        return ppma.ops.cpu.rope(x, sin, cos, 0.7, transpose)

    assert torch.autograd.gradcheck(f, (x, sin, cos))
    assert torch.autograd.gradgradcheck(f, (x, sin, cos))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck(dtype):
    x, sin, cos = _inputs((2, 5, 6, 2, 8), dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.ppma.rope, (x, sin, cos, 0.5, False))
    torch.library.opcheck(torch.ops.ppma.rope, (x, sin, cos, 1.0, True))


@needs_ext
def test_no_tensor_saved_without_table_grads():
    """A backward needs only the tables when they take no gradient: ``x`` is not kept alive."""
    x, sin, cos = _inputs((1, 3, 4, 2, 8), torch.float32, requires_grad=True)
    y = ppma.ops.cpu.rope(x, sin, cos)
    saved = [t for t in (getattr(y.grad_fn, name, None) for name in dir(y.grad_fn) if name.startswith("_saved"))
             if isinstance(t, torch.Tensor)]
    assert all(t.data_ptr() != x.data_ptr() for t in saved)
    with torch.inference_mode():
        assert ppma.ops.cpu.rope(x, sin, cos).grad_fn is None


@needs_ext
def test_compile_fullgraph():
    import torch._dynamo

    x, sin, cos = _inputs((2, 5, 6, 2, 8), torch.float32, requires_grad=True)

    def f(x):
        return ppma.ops.cpu.rope(x, sin, cos, 0.5).square().sum()

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = cf(x)
    (g,) = torch.autograd.grad(loss, x)
    xr = x.detach().requires_grad_()
    ref = f(xr)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, torch.autograd.grad(ref, xr)[0])
    torch._dynamo.reset()


@needs_ext
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_inplace_is_rope_bit_for_bit(dtype, transpose):
    """``rope_`` without a gradient writes ``rope``'s values over ``x`` (the same kernel), for every dtype, with
    the float32 tables of the model and with a last channel pair outside the vectors (d = 6)."""
    for shape in [(2, 5, 6, 2, 8), (1, 3, 4, 3, 6), (2, 7, 3, 2, 32)]:
        x, sin, cos = _inputs(shape, dtype, table_dtype=torch.float32)
        want = ppma.ops.cpu.rope(x, sin, cos, 0.3, transpose)
        for ctx in (torch.no_grad, torch.inference_mode):
            xi = x.clone()
            with ctx():
                y = ppma.ops.cpu.rope_(xi, sin, cos, 0.3, transpose)
            assert y is xi
            assert torch.equal(y, want), (shape, dtype, transpose)


@needs_ext
def test_inplace_falls_back_to_a_new_tensor():
    """Where the kernel may not write over ``x`` (a gradient recorded, a non-contiguous ``x``, the reference
    implementation) ``rope_`` returns ``rope``'s new tensor and leaves ``x`` alone; with a gradient, it flows."""
    x, sin, cos = _inputs((2, 3, 4, 2, 8), torch.float32, requires_grad=True)
    y = ppma.ops.cpu.rope_(x, sin, cos, 0.5)
    assert y is not x and y.grad_fn is not None
    torch.testing.assert_close(y, rope_ref(x.detach(), sin, cos, 0.5))
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, rope_ref(torch.ones_like(x), sin, cos, 0.5, transpose=True))
    base = torch.randn(2, 3, 4, 8, 2).transpose(-1, -2)  # [2, 3, 4, 2, 8], not contiguous
    keep = base.clone()
    with torch.no_grad():
        y = ppma.ops.cpu.rope_(base, sin, cos)
        assert y is not base and torch.equal(base, keep)
        assert torch.equal(y, ppma.ops.cpu.rope(keep, sin, cos))
        xr = keep.contiguous()
        with ppma.ops.use_impl("reference"):
            y = ppma.ops.cpu.rope_(xr, sin, cos)
        assert y is not xr and torch.equal(xr, keep)


@needs_ext
def test_inplace_opcheck_and_checks():
    x, sin, cos = _inputs((2, 5, 6, 2, 8), torch.float32)
    torch.library.opcheck(torch.ops.ppma.rope_, (x.clone(), sin, cos, 0.5, False))
    torch.library.opcheck(torch.ops.ppma.rope_, (x.clone(), sin, cos, 1.0, True))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.ppma.rope_(x.transpose(1, 2), sin.transpose(0, 1), cos.transpose(0, 1), 1.0, False)
    with pytest.raises(ValueError, match="sin must be"):
        ppma.ops.cpu.rope_(x, sin[:, :-1], cos)


def test_reference_impl_switch():
    """``use_impl("reference")`` runs ``rope_ref``; both give the same numbers."""
    x, sin, cos = _inputs((1, 3, 4, 2, 8), torch.float64)
    with ppma.ops.use_impl("reference"):
        y_ref = ppma.ops.cpu.rope(x, sin, cos, 0.5)
    torch.testing.assert_close(ppma.ops.cpu.rope(x, sin, cos, 0.5), y_ref, rtol=TOLERANCES[torch.float64][0], atol=0)


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(2, 3, 4, 8), torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)), "x must be"),
        ((torch.zeros(1, 3, 4, 2, 7), torch.zeros(3, 4, 7), torch.zeros(3, 4, 7)), "d even"),
        ((torch.zeros(1, 3, 4, 2, 8), torch.zeros(4, 3, 8), torch.zeros(3, 4, 8)), "sin must be"),
        ((torch.zeros(1, 3, 4, 2, 8), torch.zeros(3, 4, 8), torch.zeros(3, 4)), "cos must be"),
        ((torch.zeros(1, 3, 4, 2, 8), torch.zeros(3, 4, 8), torch.zeros(3, 4, 8, dtype=torch.float64)), "one dtype"),
        ((torch.zeros(1, 3, 4, 2, 8, dtype=torch.long), torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)), "floating"),
    ],
)
def test_bad_arguments_named(args, match):
    with pytest.raises(ValueError, match=match):
        ppma.ops.cpu.rope(*args)


def test_bad_scale_and_transpose_named():
    x, sin, cos = _inputs((1, 3, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match="scale"):
        ppma.ops.cpu.rope(x, sin, cos, "1")
    with pytest.raises(ValueError, match="transpose"):
        ppma.ops.cpu.rope(x, sin, cos, 1.0, 1)


_PATH_CODE = """
import json, torch, ppma
from ppma import backends
from ppma.nn.rope import rotary_angle, rotary_sin_cos
out = {"cap": backends.cpu_capability()}
for shape in [(2, 3, 5, 2, 16), (1, 4, 3, 3, 32), (2, 3, 4, 2, 6), (1, 2, 5, 2, 10), (1, 2, 2, 1, 2)]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    sin, cos = rotary_sin_cos(rotary_angle(shape[-1]).float(), shape[1], shape[2])
    for dtype in ("float32", "bfloat16"):
        for t in (False, True):
            y = ppma.ops.cpu.rope(x.to(getattr(torch, dtype)), sin, cos, 0.3, t)
            out[f"{shape}{dtype}{t}"] = y.double().flatten().tolist()
            with torch.no_grad():  # the in-place op: the same values
                xi = x.to(getattr(torch, dtype))
                out[f"{shape}{dtype}{t}_"] = ppma.ops.cpu.rope_(xi, sin, cos, 0.3, t) is xi and torch.equal(xi, y)
print(json.dumps(out))
"""


@needs_ext
@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_every_simd_path(capability):
    """Each SIMD path the machine has (a fresh process capped at it) matches the reference, float32 and bf16, both
    directions, with a last channel pair outside the vectors (d = 6, 10, 2); ``rope_`` writes the same values in
    place."""
    res = subprocess.run([sys.executable, "-c", _PATH_CODE], env=cpu_subprocess_env(capability), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cap"] == capability
    for shape in [(2, 3, 5, 2, 16), (1, 4, 3, 3, 32), (2, 3, 4, 2, 6), (1, 2, 5, 2, 10), (1, 2, 2, 1, 2)]:
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        sin, cos = rotary_sin_cos(rotary_angle(shape[-1]).float(), shape[1], shape[2])
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype).double()
            for t in (False, True):
                y = torch.tensor(got[f"{shape}{str(dtype)[6:]}{t}"], dtype=torch.float64).view(shape)
                assert_close(y, rope_ref(xd, sin.double(), cos.double(), 0.3, t), dtype, f"rope {shape} {t}")
                assert got[f"{shape}{str(dtype)[6:]}{t}_"] is True, (shape, dtype, t)
