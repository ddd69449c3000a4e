"""Contract tests of the ppma ops on every available backend (design §2, §5): opcheck, torch.compile
with dynamic shapes, input validation, double backward, and the fallback without ``_C``."""

from __future__ import annotations

import pytest
import torch

import ppma
from ppma import _ext
from ppma.ops import criss_cross_attention, polyline_attention, polyline_scan

needs_ext = pytest.mark.skipif(
    not ppma.has_ext(), reason="ppma._C is not built (run `python setup.py build_ext --inplace`)"
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and ppma.has_cuda_kernels() else [])


def attention_inputs(B=2, H=5, W=6, G=2, d=8, dv=8, dtype=torch.float64, device="cpu", requires_grad=True):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, W, G, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, W, G, dv, generator=g, dtype=dtype)
    la, lb = (-torch.rand(B, H, W, G, generator=g, dtype=dtype) for _ in range(2))
    return [t.to(device).requires_grad_(requires_grad) for t in (q, k, v, la, lb)]


# ------------------------------------------------------------------------------------------------
# opcheck: schema, fake kernels, autograd registration, AOT dispatch
# ------------------------------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck_attention(device, op, dtype):
    args = attention_inputs(dtype=dtype, device=device)
    torch.library.opcheck(getattr(torch.ops.ppma, op), (*args, 0.3))
    with torch.no_grad():
        outs = getattr(torch.ops.ppma, op)(*args, 0.3)
    plain = [a.detach() for a in args]
    go = torch.randn_like(outs[0])
    if op == "polyline_attention":
        bwd_args = (go, *plain, *outs, 0.3)
    else:
        bwd_args = (go, *plain, outs[1], 0.3)
    torch.library.opcheck(getattr(torch.ops.ppma, op + "_backward"), bwd_args)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True])
def test_opcheck_scan(device, transpose):
    x, _, _, la, lb = attention_inputs(device=device)
    torch.library.opcheck(torch.ops.ppma.polyline_scan, (x, la, lb, transpose))
    torch.library.opcheck(
        torch.ops.ppma.polyline_scan_backward, (torch.randn_like(x), x.detach(), la.detach(), lb.detach(), transpose)
    )


# ------------------------------------------------------------------------------------------------
# torch.compile: fullgraph, dynamic shapes, three image sizes, no recompilation
# ------------------------------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_no_recompile(device):
    import torch._dynamo

    torch._dynamo.reset()

    def f(q, k, v, la, lb):
        a = polyline_attention(q, k, v, la, lb)
        b = criss_cross_attention(q, k, v, la, lb)
        c = polyline_scan(v, la, lb, transpose=True)
        return (a + b + c).square().sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for H, W in ((5, 6), (7, 4), (9, 11)):
            args = attention_inputs(B=1, H=H, W=W, dtype=torch.float32, device=device)
            loss = cf(*args)
            grads = torch.autograd.grad(loss, args)
            ref_args = [a.detach().requires_grad_() for a in args]
            ref_loss = f(*ref_args)
            ref_grads = torch.autograd.grad(ref_loss, ref_args)
            torch.testing.assert_close(loss, ref_loss)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# Bad input: errors that name the argument and the shapes
# ------------------------------------------------------------------------------------------------

ATTENTION_FNS = [polyline_attention, criss_cross_attention]


@pytest.mark.parametrize("fn", ATTENTION_FNS, ids=lambda f: f.__name__)
def test_bad_attention_inputs(fn):
    q, k, v, la, lb = attention_inputs(requires_grad=False)
    cases = [
        ((q[0], k[0], v[0], la[0], lb[0]), "q must be"),
        ((q, k[:, :4], v, la, lb), "k must have the shape"),
        ((q, k, v[:, :, :5], la, lb), "v must be"),
        ((q, k, v, la[:, :4], lb), "log_alpha must be"),
        ((q, k, v, la, lb.unsqueeze(-1)), "log_beta must be"),
        ((q, k.float(), v, la, lb), "k has dtype"),
        ((q, k, v.float(), la, lb), "v has dtype"),
        ((q, k, v, la, lb.float()), "log_beta has dtype"),
        ((q.long(), k.long(), v.long(), la, lb), "q must be float"),
        ((q, k, v, la.to("meta"), lb), "log_alpha is on"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn(*args)


def test_bad_scan_inputs():
    x, _, _, la, lb = attention_inputs(requires_grad=False)
    with pytest.raises(ValueError, match="x must be"):
        polyline_scan(x[0], la, lb)
    with pytest.raises(ValueError, match="log_alpha must be"):
        polyline_scan(x, la[:, :, :3], lb)
    with pytest.raises(ValueError, match="log_beta is on"):
        polyline_scan(x, la, lb.to("meta"))
    with pytest.raises(ValueError, match="x must be float"):
        polyline_scan(x.int(), la, lb)


@needs_ext
@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
def test_bad_inputs_reach_cpp_checks(op):
    """The C++ host functions validate on their own (direct torch.ops calls): RuntimeError naming the argument."""
    q, k, v, la, lb = attention_inputs(requires_grad=False)
    with pytest.raises(RuntimeError, match=r"log_alpha must be \[B, H, W, heads\]"):
        getattr(torch.ops.ppma, op)(q, k, v, la[:, :3], lb, 1.0)
    with pytest.raises(RuntimeError, match="k must have the shape of q"):
        getattr(torch.ops.ppma, op)(q, k[:, :, :2], v, la, lb, 1.0)
    with pytest.raises(RuntimeError, match="v has dtype"):
        getattr(torch.ops.ppma, op)(q, k, v.float(), la, lb, 1.0)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        if op == "polyline_attention":
            out, ov, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 1.0)
            torch.ops.ppma.polyline_attention_backward(out, q, k, v, la, lb, out, ov, lse[..., :1], 1.0)
        else:
            out, lse = torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, 1.0)
            torch.ops.ppma.criss_cross_attention_backward(out, q, k, v, la, lb, lse[..., :1], 1.0)


@needs_ext
def test_bad_scan_inputs_reach_cpp_checks():
    x, _, _, la, lb = attention_inputs(requires_grad=False)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.ppma.polyline_scan(x[0], la, lb, False)
    with pytest.raises(RuntimeError, match="grad_y must have shape"):
        torch.ops.ppma.polyline_scan_backward(x[:, :2], x, la, lb, False)


# ------------------------------------------------------------------------------------------------
# Double backward, scale default, fallback
# ------------------------------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("fn", ATTENTION_FNS + [polyline_scan], ids=lambda f: f.__name__)
def test_double_backward_raises(fn):
    q, k, v, la, lb = attention_inputs()
    out = fn(v, la, lb) if fn is polyline_scan else fn(q, k, v, la, lb)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), v, create_graph=True)


@needs_ext
@pytest.mark.parametrize("fn", ATTENTION_FNS, ids=lambda f: f.__name__)
def test_default_scale(fn):
    q, k, v, la, lb = attention_inputs(d=12, requires_grad=False)
    torch.testing.assert_close(fn(q, k, v, la, lb), fn(q, k, v, la, lb, 12**-0.5))


def test_fallback_without_ext(monkeypatch):
    """Without ``_C`` the wrappers compute the reference numbers and warn once."""
    monkeypatch.setattr(_ext, "_LOADED", False)
    monkeypatch.setattr(_ext, "_WARNED", False)
    q, k, v, la, lb = attention_inputs(requires_grad=False)
    from ppma.ops import reference

    with pytest.warns(RuntimeWarning, match="reference"):
        out = polyline_attention(q, k, v, la, lb)
    torch.testing.assert_close(out, reference.polyline_attention_ref(q, k, v, la, lb))
    torch.testing.assert_close(
        criss_cross_attention(q, k, v, la, lb), reference.criss_cross_attention_ref(q, k, v, la, lb)
    )
    torch.testing.assert_close(polyline_scan(v, la, lb), reference.polyline_scan_ref(v, la, lb))
