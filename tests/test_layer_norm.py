"""``ppma.ops.cpu.layer_norm`` and ``ppma.ops.cpu.add_layer_norm_`` (CPU inference kernels) against
``torch.nn.functional.layer_norm``: swept channel counts (vector widths, tails), every SIMD path, thread counts
bitwise, the in-place residual sum, bf16 maps with float32 parameters, the fall-backs (gradients, reference impl,
other dtypes), opcheck and the argument checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ppma.nn  # noqa: F401
import ppma
from op_utils import needs_ext
from ppma import backends
from ppma.ops.cpu.layer_norm import uses_kernel as ln_uses_kernel
from test_cpu_baseline import ROOT, cpu_subprocess_env

# Channel counts around the vector widths (4, 8, 16 lanes) and PPMA's widths (64 ... 512, 768: a hidden map).
CHANNELS = [1, 3, 4, 7, 8, 15, 16, 17, 33, 64, 100, 128, 256, 512, 768]


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = torch.randn(shape, generator=g) * 3 + 0.5
    return x, torch.randn(C, generator=g), torch.randn(C, generator=g), torch.randn(shape, generator=g)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def _close_bf16(y, ref):
    """Within one bf16 rounding: the kernel and torch both compute in float32 and round each output once, so
    they differ only where the two float32 results straddle a rounding boundary (by one bf16 unit, 2^-7 relative)."""
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-6)
    assert (y != ref).float().mean() < 0.01  # and such rows are rare


@needs_ext
@pytest.mark.parametrize("C", CHANNELS)
def test_matches_torch(C):
    """The kernels' outputs equal F.layer_norm's up to float32 rounding; add_layer_norm_ writes x + residual
    into x exactly (one float32 addition) and normalises that. bf16 maps with float32 weight and bias (CPU bf16
    autocast's layer norm): bf16 outputs within one bf16 rounding of torch's mixed-dtype F.layer_norm, x + residual
    rounded as torch's bf16 x.add_(residual) rounds it, and x += x (each element read before it is written)."""
    x, w, b, r = _inputs((2, 3, 5, C), seed=C)
    for dt, close in ((torch.float32, _close), (torch.bfloat16, _close_bf16)):
        xd, rd = x.to(dt), r.to(dt)
        for res in (rd, None):  # None: x += x
            with torch.no_grad():
                assert ln_uses_kernel(xd, w, b, rd)
                close(ppma.ops.cpu.layer_norm(xd, w, b, 1e-6), F.layer_norm(xd, (C,), w, b, 1e-6))
                xi = xd.clone()
                y = ppma.ops.cpu.add_layer_norm_(xi, xi if res is None else res, w, b, 1e-6)
            s = xd + (xd if res is None else res)
            assert torch.equal(xi, s)
            close(y, F.layer_norm(s, (C,), w, b, 1e-6))


@needs_ext
def test_constant_rows_and_large_offsets():
    """A constant row normalises to the bias (variance 0, eps only); with a large common offset the two-pass
    formula is as close to the float64 result as torch's float32 kernel."""
    C = 64
    w, b = torch.randn(C), torch.randn(C)
    x = torch.full((4, C), 3.0)
    with torch.no_grad():
        torch.testing.assert_close(ppma.ops.cpu.layer_norm(x, w, b, 1e-5), b.expand(4, C), rtol=0, atol=1e-6)
        x = torch.randn(4, C) + 1e4
        exact = F.layer_norm(x.double(), (C,), w.double(), b.double(), 1e-5)
        ours = (ppma.ops.cpu.layer_norm(x, w, b, 1e-5).double() - exact).abs().max()
        torchs = (F.layer_norm(x, (C,), w, b, 1e-5).double() - exact).abs().max()
        assert ours <= 2 * torchs + 1e-5, (ours, torchs)


@needs_ext
def test_thread_counts_bitwise():
    """Rows do not depend on how they are split over the threads."""
    x, w, b, r = _inputs((8, 14, 14, 256), seed=3)
    prev = torch.get_num_threads()
    out = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            with torch.no_grad():
                res = []
                for xd, rd in ((x, r), (x.bfloat16(), r.bfloat16())):
                    xi = xd.clone()
                    res += [ppma.ops.cpu.layer_norm(xd, w, b, 1e-6), ppma.ops.cpu.add_layer_norm_(xi, rd, w, b, 1e-6)]
                out.append(res)
    finally:
        torch.set_num_threads(prev)
    for res in out[1:]:
        assert all(torch.equal(a, c) for a, c in zip(res, out[0]))


@needs_ext
def test_falls_back_to_torch():
    """With a gradient recorded, float64, a non-contiguous x or the reference implementation the functions run
    torch's layer_norm (and x.add_): the same numbers as F.layer_norm, gradients included."""
    x, w, b, r = _inputs((2, 4, 16))
    wg = w.clone().requires_grad_(True)
    assert not ln_uses_kernel(x, wg, b)
    y = ppma.ops.cpu.layer_norm(x, wg, b, 1e-6)
    assert torch.equal(y, F.layer_norm(x, (16,), wg, b, 1e-6))
    y.sum().backward()
    assert wg.grad is not None
    xd = x.double()
    with torch.no_grad():
        assert not ln_uses_kernel(xd, w.double(), b.double())
        wd, bd = w.double(), b.double()
        assert torch.equal(ppma.ops.cpu.layer_norm(xd, wd, bd), F.layer_norm(xd, (16,), wd, bd))
        for xl, wl in ((x.bfloat16(), w.bfloat16()), (x.half(), w)):
            assert not ln_uses_kernel(xl, wl, wl)  # bf16 parameters, fp16 maps: torch's layer norm
            assert torch.equal(ppma.ops.cpu.layer_norm(xl, wl, wl), F.layer_norm(xl, (16,), wl, wl))
        assert not ln_uses_kernel(x.bfloat16(), w, b, r)  # a float32 residual beside a bf16 x
        xt = x.transpose(0, 1)
        assert not ln_uses_kernel(xt, w, b)
        assert torch.equal(ppma.ops.cpu.layer_norm(xt, w, b), F.layer_norm(xt, (16,), w, b))
        with ppma.ops.use_impl("reference"):
            xi = x.clone()
            y = ppma.ops.cpu.add_layer_norm_(xi, r, w, b, 1e-6)
        assert torch.equal(xi, x + r) and torch.equal(y, F.layer_norm(x + r, (16,), w, b, 1e-6))


@needs_ext
def test_opcheck():
    x, w, b, r = _inputs((2, 3, 4, 24))
    torch.library.opcheck(torch.ops.ppma.layer_norm, (x, w, b, 1e-6))
    torch.library.opcheck(torch.ops.ppma.add_layer_norm_, (x.clone(), r, w, b, 1e-6))


@needs_ext
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, w, b, r: ppma.ops.cpu.layer_norm(x, w[:-1], b), r"weight must be \[C\] = \(16,\)"),
        (lambda x, w, b, r: ppma.ops.cpu.layer_norm(x, w, b[None]), r"bias must be \[C\] = \(16,\)"),
        (lambda x, w, b, r: ppma.ops.cpu.layer_norm(x, w, b, -1.0), "eps must be a number >= 0"),
        (lambda x, w, b, r: ppma.ops.cpu.add_layer_norm_(x, r[:1], w, b), "residual must have x's shape"),
    ],
)
def test_bad_arguments_named(call, match):
    x, w, b, r = _inputs((2, 4, 16))
    with pytest.raises(ValueError, match=match):
        call(x, w, b, r)


@needs_ext
def test_kernel_checks():
    """The ops themselves reject what the kernels do not handle, with the argument named."""
    x, w, b, r = _inputs((2, 4, 16))
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.ppma.layer_norm(x.double(), w, b, 1e-6)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        torch.ops.ppma.layer_norm(x.transpose(0, 1), w, b, 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be \[C\]"):
        torch.ops.ppma.layer_norm(x, w[:3], b, 1e-6)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        torch.ops.ppma.add_layer_norm_(x, r[:1], w, b, 1e-6)
    with pytest.raises(RuntimeError, match="residual must have x's dtype Float"):
        torch.ops.ppma.add_layer_norm_(x, r.bfloat16(), w, b, 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \(for a bfloat16 x too\)"):
        torch.ops.ppma.layer_norm(x.bfloat16(), w.bfloat16(), b, 1e-6)


_PATH_CODE = r"""
import json, torch, ppma
from ppma import backends
out = {"cap": backends.cpu_capability()}
for C in (3, 7, 16, 17, 64, 100, 768):
    g = torch.Generator().manual_seed(C)
    x = torch.randn(3, 5, C, generator=g) * 3 + 0.5
    w, b, r = torch.randn(C, generator=g), torch.randn(C, generator=g), torch.randn(3, 5, C, generator=g)
    with torch.no_grad():
        y = ppma.ops.cpu.layer_norm(x, w, b, 1e-6)
        xi = x.clone()
        z = ppma.ops.cpu.add_layer_norm_(xi, r, w, b, 1e-6)
        yb = ppma.ops.cpu.layer_norm(x.bfloat16(), w, b, 1e-6)
        xb = x.bfloat16()
        zb = ppma.ops.cpu.add_layer_norm_(xb, r.bfloat16(), w, b, 1e-6)
    out[str(C)] = [y.flatten().tolist(), z.flatten().tolist(), torch.equal(xi, x + r),
                   yb.float().flatten().tolist(), zb.float().flatten().tolist(),
                   torch.equal(xb, x.bfloat16() + r.bfloat16())]
print(json.dumps(out))
"""


@needs_ext
@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_every_simd_path(capability):
    """Each SIMD path the machine has (a fresh process capped at it) matches F.layer_norm, with channel counts that
    leave tails of every width."""
    res = subprocess.run([sys.executable, "-c", _PATH_CODE], env=cpu_subprocess_env(capability), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cap"] == capability
    for C in (3, 7, 16, 17, 64, 100, 768):
        g = torch.Generator().manual_seed(C)
        x = torch.randn(3, 5, C, generator=g) * 3 + 0.5
        w, b, r = torch.randn(C, generator=g), torch.randn(C, generator=g), torch.randn(3, 5, C, generator=g)
        y, z, added, yb, zb, added_bf16 = got[str(C)]
        assert added is True and added_bf16 is True
        _close(torch.tensor(y).view(3, 5, C), F.layer_norm(x, (C,), w, b, 1e-6))
        _close(torch.tensor(z).view(3, 5, C), F.layer_norm(x + r, (C,), w, b, 1e-6))
        xb, rb = x.bfloat16(), r.bfloat16()
        torch.testing.assert_close(torch.tensor(yb).view(3, 5, C), F.layer_norm(xb, (C,), w, b, 1e-6).float(),
                                   rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(torch.tensor(zb).view(3, 5, C),
                                   F.layer_norm(xb + rb, (C,), w, b, 1e-6).float(), rtol=2**-7, atol=1e-6)


@needs_ext
def test_layer_norm_module():
    """``ppma.nn.LayerNorm``: nn.LayerNorm's parameters and state dict, and nn.LayerNorm's forward exactly unless
    fused; fused (``ppma.nn.fuse_for_inference``) its forward is the kernel (bit for bit ``ppma.ops.cpu.layer_norm``,
    and ``add_layer_norm_`` with its parameters is bit for bit the module on the sum)."""
    ref = torch.nn.LayerNorm(32, eps=1e-6)
    torch.nn.init.normal_(ref.weight), torch.nn.init.normal_(ref.bias)
    mod = ppma.nn.LayerNorm(32, eps=1e-6)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == list(ref.state_dict()) and isinstance(mod, torch.nn.LayerNorm)
    x, _, _, r = _inputs((2, 5, 6, 32))
    assert torch.equal(mod(x), ref(x))
    with torch.inference_mode():
        assert torch.equal(mod(x), ref(x))
        ppma.nn.fuse_for_inference(mod)
        assert mod.fused
        y = mod(x)
        assert torch.equal(y, ppma.ops.cpu.layer_norm(x, mod.weight, mod.bias, 1e-6))
        _close(y, ref(x))
        xi = x.clone()
        assert torch.equal(ppma.ops.cpu.add_layer_norm_(xi, r, mod.weight, mod.bias, 1e-6), mod(x + r))
    assert list(mod.state_dict()) == list(ref.state_dict())
    two = ppma.nn.fuse_for_inference(ppma.nn.LayerNorm((5, 32)))  # over two dimensions: stays unfused
    assert not two.fused


def test_layer_norm_node():
    """``ppma.ops.cpu.layer_norm_node`` (torch's layer norm as one opaque op, for compiled training): bit for bit
    ``F.layer_norm`` and its gradients, fp64 gradcheck, the op checks (fake kernel, autograd registration), argument
    errors, and its gate (only while torch.compile traces, with a gradient recorded, float32 / float64 on the CPU)."""
    from ppma.ops.cpu.layer_norm import layer_norm_node, uses_layer_norm_node

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 24, generator=g, requires_grad=True)
    w = torch.randn(24, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True)
    go = torch.randn(2, 3, 5, 24, generator=g)
    y = layer_norm_node(x, w, b, 1e-6)
    grads = torch.autograd.grad(y, (x, w, b), go)
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    yr = F.layer_norm(xr, (24,), wr, br, 1e-6)
    assert torch.equal(y, yr)
    for a, e in zip(grads, torch.autograd.grad(yr, (xr, wr, br), go)):
        assert torch.equal(a, e)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda *t: layer_norm_node(*t, 1e-6), (xd, wd, bd))
    torch.library.opcheck(torch.ops.ppma.layer_norm_node, (xd, wd, bd, 1e-6))
    with pytest.raises(ValueError, match=r"weight must be \[C\] = \(24,\)"):
        layer_norm_node(x, w[:-1], b)
    assert not uses_layer_norm_node(x, w, b)  # eager: not traced
    seen = []
    torch.compile(lambda t: seen.append(uses_layer_norm_node(t, w, b)) or t, backend="eager", fullgraph=True)(x)
    torch.compile(lambda t: seen.append(uses_layer_norm_node(t, w.detach(), b.detach())) or t, backend="eager",
                  fullgraph=True)(x.detach())
    assert seen == [True, False]
