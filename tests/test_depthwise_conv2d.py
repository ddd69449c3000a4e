"""``ppma.ops.cpu.depthwise_conv2d`` and its CPU weight-gradient kernel ``torch.ops.ppma.depthwise_conv2d_backward``
(docs/ops.md "depthwise_conv2d"): gradients equal torch's up to rounding, gradcheck, bitwise the same for every
thread count, every SIMD path, the dispatch rules, and DWConv2d taking the kernel in training. The in-place
inference kernel ``torch.ops.ppma.depthwise_conv2d_residual_`` (``x + conv(x)`` written over ``x``): equal to
torch's convolution up to rounding on swept shapes, deterministic, every SIMD path, its dispatch rules and its
use by DWConv2d / ConvFFN in CPU inference only. The FFN's middle ``gelu_depthwise_conv2d_residual`` (GELU, then
``a + conv(a)``) and its CPU backward kernel ``torch.ops.ppma.gelu_depthwise_conv2d_residual_backward``: gradients
equal torch's autograd up to rounding on swept shapes, gradcheck, thread counts, every SIMD path, its dispatch rules
and ConvFFN taking it in training only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ppma
import ppma.nn  # noqa: F401
from op_utils import assert_close, needs_ext
from ppma import backends
from ppma.nn.layers import DWConv2d
from ppma.nn.layers import ConvFFN
from ppma.ops.cpu.depthwise_conv2d import (
    depthwise_conv2d,
    depthwise_conv2d_ref,
    depthwise_conv2d_residual_,
    gelu_depthwise_conv2d_residual,
    gelu_depthwise_conv2d_residual_ref,
    uses_gelu_kernel,
    uses_kernel,
    uses_residual_kernel,
)
from test_cpu_baseline import ROOT, cpu_subprocess_env

pytestmark = needs_ext

# (B, H, W, C, k): C below, at and above the kernel's channel block (16) and group (1024), maps smaller than the
# kernel, odd sizes; k = 3, 5 and 7 (the register-blocked rows of full blocks) and 9 (position by position).
SHAPES = [
    (2, 9, 7, 20, 5),
    (1, 3, 2, 16, 5),
    (3, 5, 11, 33, 7),
    (1, 1, 1, 4, 5),
    (2, 14, 14, 64, 5),
    (1, 4, 3, 1040, 5),
    (2, 6, 5, 8, 9),
    (2, 7, 9, 48, 3),
    (1, 2, 1, 32, 3),
    (2, 3, 4, 16, 7),
    (1, 8, 2, 32, 7),
]


def _torch_grads(g, x, k):
    """torch's weight and bias gradients of the depthwise convolution (the reference)."""
    C, p = x.shape[-1], k // 2
    w = torch.zeros(C, 1, k, k, dtype=x.dtype)
    _, gw, gb = torch.ops.aten.convolution_backward(g.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2), w, [C], [1, 1],
                                                    [p, p], [1, 1], False, [0, 0], C, [False, True, True])
    return gw, gb


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_matches_torch(shape, dtype):
    B, H, W, C, k = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, H, W, C, generator=gen, dtype=torch.float64)
    g = torch.randn(B, H, W, C, generator=gen, dtype=torch.float64)
    want_w, want_b = _torch_grads(g, x, k)
    gw, gb = torch.ops.ppma.depthwise_conv2d_backward(g.to(dtype), x.to(dtype), k)
    assert gw.dtype == dtype and gw.shape == (C, 1, k, k) and gb.shape == (C,)
    assert_close(gw, want_w, dtype, "grad_weight", grad=True)
    assert_close(gb, want_b, dtype, "grad_bias", grad=True)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(residual, bias):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1, 5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    assert uses_kernel(x, w)
    inputs = (x, w, b) if bias else (x, w)
    assert torch.autograd.gradcheck(lambda x, w, b=None: depthwise_conv2d(x, w, b, residual), inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_op_matches_reference(dtype, residual):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 7, 24, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(24, 1, 5, 5, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(24, generator=gen, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 9, 7, 24, generator=gen, dtype=dtype)
    y = depthwise_conv2d(x, w, b, residual)
    grads = torch.autograd.grad(y, (x, w, b), g)
    y_ref = depthwise_conv2d_ref(x, w, b, residual)
    grads_ref = torch.autograd.grad(y_ref, (x, w, b), g)
    assert y.is_contiguous() and torch.equal(y, y_ref)
    assert torch.equal(grads[0], grads_ref[0])  # the input gradient is torch's
    for name, a, e in zip(("weight", "bias"), grads[1:], grads_ref[1:]):
        assert_close(a, e, dtype, f"grad_{name}", grad=True)


def test_no_double_backward():
    x = torch.randn(1, 5, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(depthwise_conv2d(x, w).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def test_deterministic_across_thread_counts():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 13, 11, 72, generator=gen)
    g = torch.randn(4, 13, 11, 72, generator=gen)
    n = torch.get_num_threads()
    try:
        out = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out.append([torch.ops.ppma.depthwise_conv2d_backward(g, x, k) for k in (3, 5)])
    finally:
        torch.set_num_threads(n)
    for o in out[1:]:
        assert all(torch.equal(a, b) for ko, k0 in zip(o, out[0]) for a, b in zip(ko, k0))


_PATH_CODE = """
import json, torch, ppma
from ppma import backends
gen = torch.Generator().manual_seed(4)
x = torch.randn(2, 10, 9, 40, generator=gen, dtype=torch.float64)
g = torch.randn(2, 10, 9, 40, generator=gen, dtype=torch.float64)
out = {"cap": backends.cpu_capability()}
for k in (3, 5, 7):
    gw, gb = torch.ops.ppma.depthwise_conv2d_backward(g.float(), x.float(), k)
    out[k] = {"w": gw.double().flatten().tolist(), "b": gb.double().tolist()}
print(json.dumps(out))
"""


def _on_path(code: str, capability: str) -> dict:
    """Runs ``code`` in a fresh process capped at the SIMD path ``capability``; its last line's JSON."""
    res = subprocess.run([sys.executable, "-c", code], env=cpu_subprocess_env(capability), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cap"] == capability
    return got


@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_every_simd_path(capability):
    """Each SIMD path the machine has (a fresh process capped at it) matches torch within the fp32 tolerance, for
    k = 3, 5 and 7 (two full channel blocks and a partial one)."""
    got = _on_path(_PATH_CODE, capability)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 10, 9, 40, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 10, 9, 40, generator=gen, dtype=torch.float64)
    for k in (3, 5, 7):
        want_w, want_b = _torch_grads(g, x, k)
        w = torch.tensor(got[str(k)]["w"], dtype=torch.float64).view(40, 1, k, k)
        assert_close(w, want_w, torch.float32, f"w (k={k})", grad=True)
        b = torch.tensor(got[str(k)]["b"], dtype=torch.float64)
        assert_close(b, want_b, torch.float32, f"b (k={k})", grad=True)


def test_dispatch_rules():
    x = torch.randn(1, 4, 4, 8, requires_grad=True)
    w5 = torch.randn(8, 1, 5, 5, requires_grad=True)
    assert uses_kernel(x, w5)
    assert not uses_kernel(x, torch.randn(8, 1, 3, 3))  # torch's 3 x 3 backward is fast
    assert not uses_kernel(x.detach(), w5.detach())  # nothing to differentiate
    assert not uses_kernel(x.bfloat16(), w5.bfloat16())
    with torch.no_grad():
        assert not uses_kernel(x, w5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_kernel(x, w5)
    with ppma.ops.use_impl("reference"):
        assert not uses_kernel(x, w5)


def test_dwconv2d_takes_the_kernel_in_training():
    """DWConv2d (the LePE's 5 x 5) runs the op in training and gives the gradients of the reference."""
    torch.manual_seed(5)
    m = DWConv2d(24, 5)
    x = torch.randn(2, 7, 6, 24, requires_grad=True)
    grads = {}
    for impl in ("fused", "reference"):
        with ppma.ops.use_impl(impl):
            y = m(x, residual=True)
            assert (y.grad_fn.name() == "_DepthwiseConv2dBackward") == (impl == "fused")
            grads[impl] = torch.autograd.grad(y.square().sum(), (x, m.conv.weight, m.conv.bias))
    for name, a, e in zip(("x", "weight", "bias"), grads["fused"], grads["reference"]):
        assert_close(a, e, torch.float32, name, grad=True)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(2, 3, 4), torch.randn(4, 1, 5, 5)), "x must be a"),
        ((torch.randn(1, 3, 4, 4), torch.randn(5, 1, 5, 5)), "weight must be"),
        ((torch.randn(1, 3, 4, 4), torch.randn(4, 1, 4, 4)), "weight must be"),
        ((torch.randn(1, 3, 4, 4), torch.randn(4, 1, 5, 5), torch.randn(3)), "bias must be"),
    ],
)
def test_bad_arguments_named(args, match):
    with pytest.raises(ValueError, match=match):
        depthwise_conv2d(*args)


def test_kernel_bad_arguments_named():
    x = torch.randn(1, 3, 4, 4)
    with pytest.raises(RuntimeError, match="kernel_size"):
        torch.ops.ppma.depthwise_conv2d_backward(x, x, 4)
    with pytest.raises(RuntimeError, match="grad_out"):
        torch.ops.ppma.depthwise_conv2d_backward(x[:, :2], x, 5)
    with pytest.raises(RuntimeError, match="float32, float64 or bfloat16"):  # bf16: the maps of bf16 autocast
        torch.ops.ppma.depthwise_conv2d_backward(x.half(), x.half(), 5)


# ------------------------------------------------------------------------------------------- in-place residual
# The shapes above with the FFN's 3 x 3 kernel in place of 5 x 5 (the 7 and 9 stay), and maps of one row / column.
RESIDUAL_SHAPES = [(B, H, W, C, 3 if k == 5 else k) for B, H, W, C, k in SHAPES] + [(1, 1, 9, 24, 3), (1, 8, 1, 17, 3)]


def _residual_want(x, w, b):
    """x + conv(x) + b in float64 (torch's convolution): the reference of the in-place kernel."""
    C, k = x.shape[-1], w.shape[-1]
    y = torch.nn.functional.conv2d(x.double().permute(0, 3, 1, 2), w.double(), None if b is None else b.double(), 1,
                                   k // 2, 1, C)
    return x.double() + y.permute(0, 2, 3, 1)


@pytest.mark.parametrize("shape", RESIDUAL_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_residual_kernel_matches_torch(shape, bias):
    B, H, W, C, k = shape
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(B, H, W, C, generator=gen)
    w = torch.randn(C, 1, k, k, generator=gen)
    b = torch.randn(C, generator=gen) if bias else None
    want = _residual_want(x, w, b)
    y = x.clone()
    assert torch.ops.ppma.depthwise_conv2d_residual_(y, w, b) is None
    assert_close(y, want, torch.float32, "x + conv(x)")
    # through the wrapper: the same tensor comes back, written over
    y2 = x.clone()
    with torch.inference_mode():
        out = depthwise_conv2d_residual_(y2, w, b)
    assert out is y2 and torch.equal(y2, y)


@pytest.mark.parametrize("shape", RESIDUAL_SHAPES[:6])
def test_residual_kernel_bf16_rounds_once(shape):
    """bf16 maps: float32 math on the widened values, the result rounded to bf16 once (the float64 sum rounded to
    bf16 agrees, up to a last-place difference where the float32 sum sits next to a rounding boundary)."""
    B, H, W, C, k = shape
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, H, W, C, generator=gen).bfloat16()
    w = torch.randn(C, 1, k, k, generator=gen).bfloat16()
    b = torch.randn(C, generator=gen).bfloat16()
    want = _residual_want(x, w, b).bfloat16()  # float64 math, one rounding
    y = x.clone()
    with torch.inference_mode():
        out = depthwise_conv2d_residual_(y, w, b)
    assert out is y and y.dtype == torch.bfloat16
    diff = (y.double() - want.double()).abs()
    ulp = want.double().abs().clamp_min(1e-30) * 2.0**-7
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    assert float((y != want).float().mean()) < 0.01
    # torch's bf16 convolution followed by the addition rounds twice: further from the float64 result
    twice = x + torch.nn.functional.conv2d(x.permute(0, 3, 1, 2), w, b, 1, k // 2, 1, C).permute(0, 2, 3, 1)
    assert float((y.double() - _residual_want(x, w, b)).abs().sum()) <= float(
        (twice.double() - _residual_want(x, w, b)).abs().sum())


def test_residual_kernel_deterministic_across_thread_counts():
    """Bitwise the same for 1-4 threads, with tasks per image (small maps, at least as many images as threads) and
    per (image, channel slot) (4 threads on 3 images; a map of over 1 MiB per image)."""
    gen = torch.Generator().manual_seed(7)
    n = torch.get_num_threads()
    for shape in ((3, 13, 11, 72), (2, 40, 40, 176)):
        x = torch.randn(shape, generator=gen)
        w = torch.randn(shape[-1], 1, 3, 3, generator=gen)
        b = torch.randn(shape[-1], generator=gen)
        out = []
        try:
            for t in (1, 2, 3, 4):
                torch.set_num_threads(t)
                y = x.clone()
                torch.ops.ppma.depthwise_conv2d_residual_(y, w, b)
                out.append(y)
        finally:
            torch.set_num_threads(n)
        assert all(torch.equal(o, out[0]) for o in out[1:]), shape


_RESIDUAL_PATH_CODE = """
import json, torch, ppma
from ppma import backends
gen = torch.Generator().manual_seed(8)
x = torch.randn(2, 10, 9, 40, generator=gen)
w = torch.randn(40, 1, 3, 3, generator=gen)
b = torch.randn(40, generator=gen)
xb = x.bfloat16()
torch.ops.ppma.depthwise_conv2d_residual_(xb, w.bfloat16().float(), b.bfloat16().float())
torch.ops.ppma.depthwise_conv2d_residual_(x, w, b)
print(json.dumps({"cap": backends.cpu_capability(), "y": x.double().flatten().tolist(),
                  "yb": xb.double().flatten().tolist()}))
"""


@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_residual_kernel_every_simd_path(capability):
    got = _on_path(_RESIDUAL_PATH_CODE, capability)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 10, 9, 40, generator=gen)
    w = torch.randn(40, 1, 3, 3, generator=gen)
    b = torch.randn(40, generator=gen)
    assert_close(torch.tensor(got["y"], dtype=torch.float64).view(2, 10, 9, 40), _residual_want(x, w, b),
                 torch.float32, "x + conv(x)")
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    yb = xb.clone()
    torch.ops.ppma.depthwise_conv2d_residual_(yb, wb.float(), bb.float())  # this process's path: the same bits
    assert torch.equal(torch.tensor(got["yb"], dtype=torch.float64).view(2, 10, 9, 40), yb.double())


def test_residual_dispatch_rules():
    """The in-place kernel runs only where nothing records a gradient, in float32 CPU eager code with the fused
    implementation; elsewhere the wrapper returns a new tensor and leaves x alone."""
    x = torch.randn(1, 4, 4, 8)
    w = torch.randn(8, 1, 3, 3)
    assert uses_residual_kernel(x, w)
    assert uses_residual_kernel(x.bfloat16(), w.bfloat16())
    assert not uses_residual_kernel(x.bfloat16(), w)  # the weight in the map's dtype
    assert not uses_residual_kernel(x.double(), w.double())
    assert not uses_residual_kernel(x.transpose(1, 2), w)  # written in place: contiguous maps only
    assert not uses_residual_kernel(x, w.requires_grad_())  # a gradient would be recorded
    with torch.no_grad():
        assert uses_residual_kernel(x, w)
    w = w.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_residual_kernel(x, w)  # autocast would run a float32 map's convolution in bf16
        assert uses_residual_kernel(x.bfloat16(), w.bfloat16())
    with ppma.ops.use_impl("reference"):
        assert not uses_residual_kernel(x, w)
        x0 = x.clone()
        y = depthwise_conv2d_residual_(x, w)
        assert y is not x and torch.equal(x, x0)
        assert_close(y, _residual_want(x, w, None), torch.float32, "fallback")


def test_residual_kernel_bad_arguments_named():
    x = torch.randn(1, 3, 4, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.ppma.depthwise_conv2d_residual_(x.double(), torch.randn(4, 1, 3, 3).double(), None)
    with pytest.raises(RuntimeError, match="weight must be a float32"):
        torch.ops.ppma.depthwise_conv2d_residual_(x.bfloat16(), torch.randn(4, 1, 3, 3).bfloat16(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.ppma.depthwise_conv2d_residual_(x.transpose(1, 2), torch.randn(4, 1, 3, 3), None)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.ppma.depthwise_conv2d_residual_(x, torch.randn(4, 1, 2, 2), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.ppma.depthwise_conv2d_residual_(x, torch.randn(4, 1, 3, 3), torch.randn(3))
    with pytest.raises(ValueError, match="weight must be"):
        depthwise_conv2d_residual_(x, torch.randn(5, 1, 3, 3))


def test_ffn_writes_its_hidden_map_in_place_in_inference_only(monkeypatch):
    """ConvFFN fused for CPU inference (``ppma.nn.fuse_for_inference``) runs the in-place kernel on fc1's output (same
    output as the training graph up to rounding); unfused, never."""
    torch.manual_seed(9)
    ffn = ConvFFN(16, 48)
    x = torch.randn(2, 6, 5, 16)
    calls = []
    real = torch.ops.ppma.depthwise_conv2d_residual_

    class Spy:
        def __call__(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(torch.ops.ppma, "depthwise_conv2d_residual_", Spy())
    want = ffn(x)  # parameters require grad: the training graph, no in-place kernel
    assert calls == []
    with torch.inference_mode():
        ffn(x)
    assert calls == []  # unfused inference: the plain modules
    ppma.nn.fuse_for_inference(ffn)
    with torch.inference_mode():
        got = ffn(x)
    assert calls == [(2, 6, 5, 48)]
    assert_close(got, want.detach(), torch.float32, "ffn")
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got16 = ffn(x)  # fc1's bf16 output, written over in place
    assert calls == [(2, 6, 5, 48)] * 2
    assert ((got16.float() - want.detach()).norm() / want.detach().norm()).item() < 2e-2


def test_dwconv2d_add_in_place_in_inference():
    """DWConv2d(x, add=a, inplace=True) is a + conv(x); fused for CPU inference (float32, bf16 autocast) oneDNN
    writes it over a; with inplace=False, or unfused, a is left alone."""
    torch.manual_seed(10)
    m = DWConv2d(24, 5)
    x, a = torch.randn(2, 7, 6, 24), torch.randn(2, 7, 6, 24)
    want = (a + m(x)).detach()
    a0 = a.clone()
    with torch.no_grad():
        got = m(x, add=a0, inplace=True)
    assert got is not a0 and torch.equal(a0, a)  # unfused: nothing overwritten
    ppma.nn.fuse_for_inference(m)
    got = m(x, add=a0, inplace=False)
    assert got is not a0 and torch.equal(a0, a)
    assert_close(got, want, torch.float32, "add")
    with torch.no_grad():
        got = m(x, add=a0, inplace=True)
    assert got is a0
    assert_close(got, want, torch.float32, "add, in place")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        xb, ab = x.bfloat16(), a.bfloat16()
        got = m(xb, add=ab, inplace=True)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want, torch.bfloat16, "add, bf16")
    with pytest.raises(ValueError, match="either residual"):
        m(x, residual=True, add=a)
    with pytest.raises(ValueError, match="add must have"):
        m(x, add=a[:, :3])


# ------------------------------------------------------------------------------------------------
# gelu_depthwise_conv2d_residual: a + conv(a), a = GELU(h)
# ------------------------------------------------------------------------------------------------

# (B, H, W, C, k): k = 3, 5, 7 (the float kernel's rings) and 9 (position by position); C below, at and past the
# channel block; maps smaller than the kernel; PPMA-T's FFN at stage 3.
GELU_SHAPES = [
    (2, 9, 7, 20, 3),
    (1, 3, 2, 16, 5),
    (3, 5, 11, 33, 7),
    (2, 6, 5, 8, 9),
    (1, 1, 1, 4, 3),
    (1, 2, 3, 48, 5),
    (2, 14, 14, 96, 3),
]


def _gelu_case(shape, seed=0):
    B, H, W, C, k = shape
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, H, W, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, 1, k, k, generator=gen, dtype=torch.float64) * 0.3
    b = torch.randn(C, generator=gen, dtype=torch.float64)
    g = torch.randn(B, H, W, C, generator=gen, dtype=torch.float64)
    return h, w, b, g


def _gelu_torch_grads(h, w, b, g):
    """torch's autograd through F.gelu and the convolution, in float64 (the reference)."""
    h, w, b = (t.detach().double().requires_grad_() for t in (h, w, b))
    y = gelu_depthwise_conv2d_residual_ref(h, w, b)
    return torch.autograd.grad(y, (h, w, b), g.double())


@pytest.mark.parametrize("shape", GELU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gelu_kernel_matches_torch(shape, dtype):
    h, w, b, g = _gelu_case(shape)
    want = _gelu_torch_grads(h, w, b, g)
    got = torch.ops.ppma.gelu_depthwise_conv2d_residual_backward(g.to(dtype), h.to(dtype), w.to(dtype))
    for name, a, e in zip(("grad_h", "grad_weight", "grad_bias"), got, want):
        assert a.dtype == dtype
        assert_close(a, e, dtype, name, grad=True)


def _gelu_forward_error(got: torch.Tensor, h, w, b) -> float:
    """Max |got - reference| over max(1, |reference|), the reference a + conv(a) in float64."""
    want = gelu_depthwise_conv2d_residual_ref(h.double(), w.double(), None if b is None else b.double())
    return ((got.double() - want).abs() / want.abs().clamp(min=1.0)).max().item()


@pytest.mark.parametrize("shape", GELU_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_gelu_forward_kernel_matches_float64(shape, bias):
    """The forward kernel (GELU, then a + conv(a) + bias in one pass over h) against the float64 reference: within a
    few float32 roundings elementwise (GELU's erf by A&S 7.1.26, |error| <= 1.5e-7), as close as torch's float32
    modules are."""
    h, w, b, _ = (t.float() for t in _gelu_case(shape))
    b = b if bias else None
    got = torch.ops.ppma.gelu_depthwise_conv2d_residual_forward(h, w, b)
    assert got.dtype == torch.float32 and got.shape == h.shape and got.is_contiguous()
    torch_err = _gelu_forward_error(gelu_depthwise_conv2d_residual_ref(h, w, b), h, w, b)
    err = _gelu_forward_error(got, h, w, b)
    assert err <= max(4 * torch_err, 2e-6), f"{err:.2e} (torch's float32 modules: {torch_err:.2e})"


def test_gelu_forward_kernel_non_contiguous_and_deterministic():
    h, w, b, _ = (t.float() for t in _gelu_case((3, 11, 9, 40, 3), seed=11))
    ht = h.transpose(1, 2).contiguous().transpose(1, 2)  # the same values in another memory layout
    want = torch.ops.ppma.gelu_depthwise_conv2d_residual_forward(h, w, b)
    assert torch.equal(torch.ops.ppma.gelu_depthwise_conv2d_residual_forward(ht, w, b), want)
    n = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(torch.ops.ppma.gelu_depthwise_conv2d_residual_forward(h, w, b), want)
    finally:
        torch.set_num_threads(n)


def test_gelu_forward_kernel_rejects_bad_inputs():
    h, w, b = torch.randn(1, 4, 4, 8), torch.randn(8, 1, 3, 3), torch.randn(8)
    op = torch.ops.ppma.gelu_depthwise_conv2d_residual_forward
    with pytest.raises(RuntimeError, match="h must be float32"):
        op(h.double(), w.double(), b.double())
    with pytest.raises(RuntimeError, match="h must be \\[B, H, W, C\\]"):
        op(h[0], w, b)
    with pytest.raises(RuntimeError, match="weight must be \\[C, 1, k, k\\]"):
        op(h, torch.randn(8, 1, 2, 2), b)
    with pytest.raises(RuntimeError, match="bias must be \\[C\\]"):
        op(h, w, torch.randn(4))


@pytest.mark.parametrize("bias", [True, False])
def test_gelu_gradcheck(bias):
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(2, 5, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 1, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    assert uses_gelu_kernel(h, w, b)
    inputs = (h, w, b) if bias else (h, w)
    assert torch.autograd.gradcheck(lambda h, w, b=None: gelu_depthwise_conv2d_residual(h, w, b), inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gelu_op_matches_reference(dtype):
    h, w, b, g = _gelu_case((2, 9, 7, 40, 3), seed=7)
    h, w, b, g = (t.to(dtype) for t in (h, w, b, g))
    out = {}
    for name, fn in (("op", gelu_depthwise_conv2d_residual), ("ref", gelu_depthwise_conv2d_residual_ref)):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        y = fn(hh, ww, bb)
        out[name] = (y, *torch.autograd.grad(y, (hh, ww, bb), g))
    assert out["op"][0].is_contiguous()
    assert_close(out["op"][0], out["ref"][0], dtype, "out")
    for name, a, e in zip(("grad_h", "grad_weight", "grad_bias"), out["op"][1:], out["ref"][1:]):
        assert_close(a, e, dtype, name, grad=True)


def test_gelu_kernel_deterministic_across_thread_counts():
    h, w, _, g = (t.float() for t in _gelu_case((3, 11, 9, 40, 3), seed=8))
    n = torch.get_num_threads()
    try:
        out = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out.append(torch.ops.ppma.gelu_depthwise_conv2d_residual_backward(g, h, w))
    finally:
        torch.set_num_threads(n)
    for o in out[1:]:
        assert all(torch.equal(a, e) for a, e in zip(o, out[0]))


_GELU_PATH_CODE = """
import json, torch, ppma
from ppma import backends
gen = torch.Generator().manual_seed(9)
h = torch.randn(2, 6, 7, 40, generator=gen, dtype=torch.float64)
g = torch.randn(2, 6, 7, 40, generator=gen, dtype=torch.float64)
out = {"cap": backends.cpu_capability()}
for k in (3, 5):
    w = torch.randn(40, 1, k, k, generator=gen, dtype=torch.float64) * 0.3
    got = torch.ops.ppma.gelu_depthwise_conv2d_residual_backward(g.float(), h.float(), w.float())
    out[k] = [t.double().flatten().tolist() for t in got]
    y = torch.ops.ppma.gelu_depthwise_conv2d_residual_forward(h.float(), w.float(), None)
    out["fwd%d" % k] = y.double().flatten().tolist()
print(json.dumps(out))
"""


@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_gelu_kernel_every_simd_path(capability):
    """Each SIMD path the machine has (a fresh process capped at it) matches torch within the fp32 tolerance for
    k = 3 and 5 (two full channel blocks and a partial one)."""
    got = _on_path(_GELU_PATH_CODE, capability)
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(2, 6, 7, 40, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 6, 7, 40, generator=gen, dtype=torch.float64)
    for k in (3, 5):
        w = torch.randn(40, 1, k, k, generator=gen, dtype=torch.float64) * 0.3
        want = _gelu_torch_grads(h, w, torch.zeros(40, dtype=torch.float64), g)
        for name, a, e in zip(("grad_h", "grad_weight", "grad_bias"), got[str(k)], want):
            assert_close(torch.tensor(a, dtype=torch.float64).view(e.shape), e, torch.float32, f"{name} (k={k})",
                         grad=True)
        fwd = torch.tensor(got[f"fwd{k}"], dtype=torch.float64).view(h.shape)
        assert _gelu_forward_error(fwd, h.float(), w.float(), None) <= 2e-6, f"forward (k={k})"


def test_gelu_dispatch_rules():
    h = torch.randn(1, 4, 4, 8, requires_grad=True)
    w = torch.randn(8, 1, 3, 3, requires_grad=True)
    assert uses_gelu_kernel(h, w) and uses_gelu_kernel(h, w, torch.randn(8))
    assert not uses_gelu_kernel(h.detach(), w.detach())  # nothing to differentiate
    assert not uses_gelu_kernel(h.bfloat16(), w.bfloat16())
    assert not uses_gelu_kernel(h, w, torch.randn(8, dtype=torch.float64))
    with torch.no_grad():
        assert not uses_gelu_kernel(h, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_gelu_kernel(h, w)
    with ppma.ops.use_impl("reference"):
        assert not uses_gelu_kernel(h, w)


def test_convffn_takes_the_gelu_kernel_in_training_only():
    """ConvFFN's middle is the op in CPU training (same output, gradients of the reference up to rounding) and not
    in inference or with a hook on its convolution."""
    torch.manual_seed(10)
    ffn = ConvFFN(16, 48)
    x = torch.randn(2, 5, 6, 16, requires_grad=True)
    res = {}
    for impl in ("fused", "reference"):
        with ppma.ops.use_impl(impl):
            y = ffn(x)
            res[impl] = (y, *torch.autograd.grad(y.square().sum(), (x, ffn.fc1.weight, ffn.dwconv.conv.weight,
                                                                     ffn.dwconv.conv.bias)))
    assert_close(res["fused"][0], res["reference"][0], torch.float32, "out")
    for name, a, e in zip(("x", "fc1.weight", "dwconv.weight", "dwconv.bias"), res["fused"][1:],
                          res["reference"][1:]):
        assert_close(a, e, torch.float32, name, grad=True)

    def grad_fns(y):  # the names of the nodes of y's graph
        seen_nodes, stack = set(), [y.grad_fn]
        while stack:
            n = stack.pop()
            if n is not None and n not in seen_nodes:
                seen_nodes.add(n)
                stack.extend(f for f, _ in n.next_functions)
        return {n.name() for n in seen_nodes}

    assert "_GeluDepthwiseConv2dResidualBackward" in grad_fns(ffn(x))
    with ppma.ops.use_impl("reference"):
        assert "_GeluDepthwiseConv2dResidualBackward" not in grad_fns(ffn(x))
    handle = ffn.dwconv.register_forward_hook(lambda m, i, o: None)
    try:
        assert "_GeluDepthwiseConv2dResidualBackward" not in grad_fns(ffn(x))
    finally:
        handle.remove()
    with torch.no_grad():
        assert ffn(x).grad_fn is None  # inference: the modules' own path
