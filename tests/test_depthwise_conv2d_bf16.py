"""The depthwise training kernels under CPU bf16 autocast (docs/ops.md "depthwise_conv2d",
"gelu_depthwise_conv2d_residual"): on bf16 maps with float32 weight and bias, ``gelu_depthwise_conv2d_residual``'s
output and input gradient (bf16, rounded once) and its weight and bias gradients (float32), and
``depthwise_conv2d``'s float32 weight and bias gradients, against the float64 reference on swept shapes; bitwise the
same for 1, 2 and 3 threads; every SIMD path; the gates (bf16 autocast only, never fp16 autocast); and a bf16-autocast
training step of a tiny PPMA-T on the kernel path against torch's path, the kernels seen in the profiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ppma
import ppma.nn  # noqa: F401
from op_utils import assert_close, needs_ext, ops_called
from ppma import backends
from ppma.nn import layers
from ppma.ops.cpu.depthwise_conv2d import (
    depthwise_conv2d,
    gelu_depthwise_conv2d_residual,
    uses_gelu_kernel,
    uses_kernel,
)
from test_cpu_baseline import ROOT, cpu_subprocess_env

pytestmark = needs_ext

BF16 = torch.bfloat16
# (B, H, W, C, k): odd maps, C below / not a multiple of / above the channel block (16), batch > 1, k = 3, 5, 7
# (the kernels' register-blocked rows) and 9 (any k).
SHAPES = [
    (2, 9, 7, 20, 3),
    (3, 5, 11, 33, 5),
    (2, 7, 9, 48, 7),
    (1, 3, 2, 16, 5),
    (2, 6, 5, 8, 9),
    (2, 13, 11, 72, 3),
    (1, 1, 1, 4, 3),
]
# Half a bf16 unit in the last place, relative: one rounding to nearest even.
HALF_ULP = 2.0 ** -8


def _case(shape, seed=0):
    """bf16 map h and output gradient g, float32 weight and bias (the parameters under autocast)."""
    B, H, W, C, k = shape
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, H, W, C, generator=gen).to(BF16)
    w = torch.randn(C, 1, k, k, generator=gen) * 0.3
    b = torch.randn(C, generator=gen)
    g = torch.randn(B, H, W, C, generator=gen).to(BF16)
    return h, w, b, g


def _gelu_ref64(h, w, b, g):
    """a + conv(a) + bias, a = GELU(h), and its gradients, in float64 on the same (bf16 / float32) values."""
    h, w, b = (t.detach().double().requires_grad_() for t in (h, w, b))
    a = F.gelu(h)
    y = a + F.conv2d(a.permute(0, 3, 1, 2), w, b, 1, w.shape[-1] // 2, 1, h.shape[-1]).permute(0, 2, 3, 1)
    return (y.detach(), *torch.autograd.grad(y, (h, w, b), g.double()))


def _assert_rounded_once(got, want, what, scale):
    """bf16 ``got`` within one rounding of the float64 ``want`` (plus float32 sums' error, ~1e-6 of ``scale``)."""
    assert got.dtype == BF16, f"{what}: dtype {got.dtype}"
    err = (got.double() - want).abs() - HALF_ULP * want.abs()
    assert err.max().item() <= 2e-6 * scale, f"{what}: {err.max().item():.3e} past one bf16 rounding"


def _gelu_op(h, w, b, g):
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    with torch.autocast("cpu", dtype=BF16):
        assert uses_gelu_kernel(hh, ww, bb)
        y = gelu_depthwise_conv2d_residual(hh, ww, bb)
    assert y.grad_fn.name() == "_GeluDepthwiseConv2dResidualBackward"
    return (y, *torch.autograd.grad(y, (hh, ww, bb), g))


def _check_gelu(got, want, k):
    y, gh, gw, gb = got
    _assert_rounded_once(y, want[0], f"out (k={k})", want[0].abs().max().item())
    _assert_rounded_once(gh, want[1], f"grad_h (k={k})", want[1].abs().max().item())
    assert gw.dtype == gb.dtype == torch.float32
    assert_close(gw, want[2], torch.float32, f"grad_weight (k={k})", grad=True)
    assert_close(gb, want[3], torch.float32, f"grad_bias (k={k})", grad=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_op_bf16_autocast_matches_float64(shape):
    """The FFN middle under bf16 autocast: output and grad_h bf16 within one rounding of the float64 values,
    weight and bias gradients float32 within the float32 tolerance."""
    h, w, b, g = _case(shape)
    _check_gelu(_gelu_op(h, w, b, g), _gelu_ref64(h, w, b, g), shape[-1])


def _dw_ref64(x, w, b, g):
    """conv(x) + bias and its gradients in float64; the input gradient with the weight rounded to bf16 (autocast's)."""
    C, k = x.shape[-1], w.shape[-1]
    xx, ww, bb = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = F.conv2d(xx.permute(0, 3, 1, 2), ww, bb, 1, k // 2, 1, C).permute(0, 2, 3, 1)
    _, gw, gb = torch.autograd.grad(y, (xx, ww, bb), g.double())
    xx = x.detach().double().requires_grad_()
    y = F.conv2d(xx.permute(0, 3, 1, 2), w.to(BF16).double(), None, 1, k // 2, 1, C).permute(0, 2, 3, 1)
    (gx,) = torch.autograd.grad(y, xx, g.double())
    return gx, gw, gb


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[-1] >= 5])
@pytest.mark.parametrize("residual", [False, True])
def test_depthwise_op_bf16_autocast_matches_float64(shape, residual):
    """The LePE's convolution under bf16 autocast: the forward is autocast's convolution (bitwise), the input
    gradient bf16 (torch's), the weight and bias gradients float32 from the ppma kernel."""
    x, w, b, g = _case(shape, seed=1)
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=BF16):
        assert uses_kernel(xx, ww, bb)
        y = depthwise_conv2d(xx, ww, bb, residual)
        want_y = F.conv2d(x.permute(0, 3, 1, 2), w, b, 1, w.shape[-1] // 2, 1, x.shape[-1]).permute(0, 2, 3, 1)
    want_y = x + want_y if residual else want_y
    assert y.dtype == BF16 and torch.equal(y, want_y)
    gx, gw, gb = torch.autograd.grad(y, (xx, ww, bb), g)
    ex, ew, eb = _dw_ref64(x, w, b, g)
    if residual:
        ex = ex + g.double()
    assert gx.dtype == BF16 and gw.dtype == gb.dtype == torch.float32
    assert_close(gx, ex, BF16, "grad_x", grad=True)
    assert_close(gw, ew, torch.float32, "grad_weight", grad=True)
    assert_close(gb, eb, torch.float32, "grad_bias", grad=True)


def test_bf16_kernels_deterministic_across_thread_counts():
    h, w, b, g = _case((3, 11, 9, 40, 3), seed=2)
    w5 = torch.randn(40, 1, 5, 5)
    n = torch.get_num_threads()
    try:
        out = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out.append([
                torch.ops.ppma.gelu_depthwise_conv2d_residual_forward(h, w, b),
                *torch.ops.ppma.gelu_depthwise_conv2d_residual_backward(g, h, w),
                *torch.ops.ppma.gelu_depthwise_conv2d_residual_backward(g, h, w5),
                *torch.ops.ppma.depthwise_conv2d_backward(g, h, 5),
                *torch.ops.ppma.depthwise_conv2d_backward(g, h, 7),
            ])
    finally:
        torch.set_num_threads(n)
    for o in out[1:]:
        assert all(torch.equal(a, e) for a, e in zip(o, out[0]))


_PATH_CODE = """
import json, torch, ppma
from ppma import backends
from test_depthwise_conv2d_bf16 import SHAPES, _case, _gelu_op
out = {"cap": backends.cpu_capability()}
for i, shape in enumerate(SHAPES):
    h, w, b, g = _case(shape, seed=3)
    out[i] = [t.double().flatten().tolist() for t in _gelu_op(h, w, b, g)]
    out["w%d" % i] = [t.double().flatten().tolist() for t in torch.ops.ppma.depthwise_conv2d_backward(g, h, 5)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_bf16_every_simd_path(capability):
    """Each SIMD path the machine has (a fresh process capped at it) keeps the bf16 results within one rounding of
    float64 (outputs, grad_h) and within the float32 tolerance (weight and bias gradients)."""
    env = cpu_subprocess_env(capability)
    env["PYTHONPATH"] = os.path.join(ROOT, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _PATH_CODE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cap"] == capability
    for i, shape in enumerate(SHAPES):
        h, w, b, g = _case(shape, seed=3)
        want = _gelu_ref64(h, w, b, g)
        dt = (BF16, BF16, torch.float32, torch.float32)
        _check_gelu([torch.tensor(a, dtype=torch.float64).to(d).view(e.shape) for a, d, e in zip(got[str(i)], dt, want)],
                    want, shape[-1])
        _, ew, eb = _dw_ref64(h, torch.zeros(shape[3], 1, 5, 5), torch.zeros(shape[3]), g)
        assert_close(torch.tensor(got[f"w{i}"][0], dtype=torch.float64).view(ew.shape), ew, torch.float32, "dw weight",
                     grad=True)
        assert_close(torch.tensor(got[f"w{i}"][1], dtype=torch.float64), eb, torch.float32, "dw bias", grad=True)


def test_bf16_gates():
    h = torch.randn(1, 4, 4, 8, requires_grad=True)
    hb = h.detach().to(BF16).requires_grad_()
    w3 = torch.randn(8, 1, 3, 3, requires_grad=True)
    w5 = torch.randn(8, 1, 5, 5, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    assert not uses_gelu_kernel(hb, w3, b) and not uses_kernel(hb, w5, b)  # bf16 outside autocast: torch's
    with torch.autocast("cpu", dtype=BF16):
        assert uses_gelu_kernel(hb, w3, b) and uses_gelu_kernel(hb, w3) and uses_kernel(hb, w5, b)
        assert not uses_gelu_kernel(h, w3, b) and not uses_kernel(h, w5, b)  # float32 maps under autocast
        assert not uses_gelu_kernel(hb, w3.to(BF16), b) and not uses_kernel(hb, w5.to(BF16))  # bf16 parameters
        assert not uses_gelu_kernel(hb, w3, b.double())
        assert not uses_kernel(hb, w3)  # 3 x 3: torch's backward is fast
        with torch.no_grad():
            assert not uses_gelu_kernel(hb, w3, b) and not uses_kernel(hb, w5, b)
        with ppma.ops.use_impl("reference"):
            assert not uses_gelu_kernel(hb, w3, b) and not uses_kernel(hb, w5, b)
    with torch.autocast("cpu", dtype=torch.float16):
        for x in (hb, h.detach().half().requires_grad_()):
            assert not uses_gelu_kernel(x, w3, b) and not uses_kernel(x, w5, b)


def _tiny_model():
    torch.manual_seed(0)
    return ppma.create_model("ppma_tiny", num_classes=10, embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1),
                             num_heads=(1, 2, 2, 4), drop_path_rate=0.0)


def _step(model, x, t, kernels: bool, monkeypatch):
    """Loss and parameter gradients of one bf16-autocast training step; ``kernels=False``: torch's path (the two
    gates off). Returns them and the names of the profiled ops."""
    with monkeypatch.context() as mp:
        if not kernels:
            mp.setattr(layers, "uses_gelu_kernel", lambda *a: False)
            mp.setattr(layers, "depthwise_conv2d_uses_kernel", lambda *a: False)
        model.zero_grad()
        losses = []

        def step():
            with torch.autocast("cpu", dtype=BF16):
                losses.append(F.cross_entropy(model(x), t))
            losses[0].backward()

        names = ops_called(step)
    return losses[0].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, names


def test_tiny_ppma_bf16_autocast_training_step(monkeypatch):
    """One bf16-autocast training step of a tiny PPMA-T: the kernel path runs the three ppma ops (profiler) and
    gives torch's path's loss and gradients up to bf16 rounding."""
    model = _tiny_model().train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=gen)
    t = torch.randint(0, 10, (2,), generator=gen)
    loss_k, grads_k, names_k = _step(model, x, t, True, monkeypatch)
    loss_t, grads_t, names_t = _step(model, x, t, False, monkeypatch)
    ops = {"ppma::gelu_depthwise_conv2d_residual_forward", "ppma::gelu_depthwise_conv2d_residual_backward",
           "ppma::depthwise_conv2d_backward"}
    assert ops <= names_k, ops - names_k
    assert not ops & names_t
    assert abs(loss_k.item() - loss_t.item()) <= 1e-2 * abs(loss_t.item())
    # bf16 paths drift apart by ~1-3 % (different roundings through the whole network); biases whose gradient
    # cancels (a convolution before a batch norm) are judged against 1 % of the whole gradient's norm
    flat = {k: torch.cat([g.flatten() for g in grads.values()]) for k, grads in (("k", grads_k), ("t", grads_t))}
    assert_close(flat["k"], flat["t"], BF16, "all gradients", grad=True, mult=1.5)
    floor = 1e-2 * flat["t"].norm().item()
    for n, gt in grads_t.items():
        assert grads_k[n].dtype == torch.float32
        assert_close(grads_k[n], gt, BF16, n, grad=True, mult=2.5, floor=floor)
