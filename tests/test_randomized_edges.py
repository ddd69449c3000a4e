"""Randomized edges of the CPU helper ops (``ppma.ops.cpu``) and the 3-D ops (``ppma.ops.polyline_*_3d``), with
hypothesis: empty and odd shapes, NaN patterns against the reference (entry by entry, NaN where it has NaN),
a ``meta`` tensor beside CPU ones and integer tensors (each refused with an error naming the argument, by the
wrapper and by the registered op's fake kernel), and overlapping operands of the in-place ops (refused; disjoint
views of one buffer are fine). docs/ops.md "Edges".

The examples are derandomized (the same cases in every run, so CI is reproducible) and few (a few dozen per test:
the whole file runs in well under a minute on two cores).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ppma  # noqa: E402
import ppma.ops.cpu as C  # noqa: E402
from op_utils import needs_ext  # noqa: E402
from ppma.ops import reference as R  # noqa: E402
from ppma.ops import reference_3d as R3  # noqa: E402

pytestmark = needs_ext

SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLOATS = (torch.float32, torch.float64)


def _same(a: torch.Tensor, b: torch.Tensor, what: str, tol: float) -> None:
    """NaN exactly where the reference has NaN, close elsewhere."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN at {int(a.isnan().sum())} entries, the reference's at " \
                                               f"{int(b.isnan().sum())}"
    torch.testing.assert_close(a.nan_to_num(0.0).double(), b.nan_to_num(0.0).double(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


def _with_nans(t: torch.Tensor, data, what: str) -> torch.Tensor:
    """``t`` with NaN at 0-3 positions chosen by hypothesis."""
    t = t.clone()
    if t.numel():
        n = data.draw(st.integers(0, 3), label=f"NaNs in {what}")
        for _ in range(n):
            t.view(-1)[data.draw(st.integers(0, t.numel() - 1), label=f"NaN position in {what}")] = float("nan")
    return t


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# The CPU helper ops: one builder per op, returning (call, reference call, tensor arguments by name)
# ------------------------------------------------------------------------------------------------


def _layer_norm(shape, dtype, seed):
    g = _gen(seed)
    x, w, b = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape[-1], generator=g, dtype=dtype), \
        torch.randn(shape[-1], generator=g, dtype=dtype)
    return (lambda x, weight, bias: C.layer_norm(x, weight, bias),
            lambda x, weight, bias: F.layer_norm(x, (x.shape[-1],), weight, bias), dict(x=x, weight=w, bias=b))


def _add_layer_norm(shape, dtype, seed):
    g = _gen(seed)
    x, r = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
    w, b = torch.randn(shape[-1], generator=g, dtype=dtype), torch.randn(shape[-1], generator=g, dtype=dtype)

    def fn(x, residual, weight, bias):
        x = x.clone()
        return C.add_layer_norm_(x, residual, weight, bias), x

    def ref(x, residual, weight, bias):
        s = x + residual
        return F.layer_norm(s, (s.shape[-1],), weight, bias), s

    return fn, ref, dict(x=x, residual=r, weight=w, bias=b)


def _rope(shape, dtype, seed):
    g = _gen(seed)
    B, H, W, G, d = shape[0], shape[1], shape[2], 1 + shape[3] % 2, 2 * max(1, shape[3] // 2)
    x = torch.randn(B, H, W, G, d, generator=g, dtype=dtype)
    ang = torch.randn(H, W, d, generator=g, dtype=dtype)
    return (lambda x, sin, cos: C.rope(x, sin, cos, 0.5), lambda x, sin, cos: R.rope_ref(x, sin, cos, 0.5),
            dict(x=x, sin=ang.sin(), cos=ang.cos()))


def _rope_inplace(shape, dtype, seed):
    fn, ref, args = _rope(shape, dtype, seed)
    return (lambda x, sin, cos: C.rope_(x.clone(), sin, cos, 0.5), ref, args)


def _path_decay(shape, dtype, seed):
    g = _gen(seed)
    G, hd, D = 1 + shape[3] % 3, max(1, shape[3]), 1 + seed % 3
    x = torch.randn(*shape[:3], G * hd, generator=g, dtype=dtype)
    w, dt, A = (torch.randn(D, hd, generator=g, dtype=dtype), torch.randn(G, generator=g, dtype=dtype),
                torch.randn(G, generator=g, dtype=dtype))
    return (lambda x, weight, dt_bias, A_log: C.path_decay(x, weight, dt_bias, A_log),
            lambda x, weight, dt_bias, A_log: R.path_decay_ref(x, weight, dt_bias, A_log),
            dict(x=x, weight=w, dt_bias=dt, A_log=A))


def _conv_args(shape, dtype, seed, name="x"):
    g = _gen(seed)
    Cn, k = max(1, shape[3]), (3, 5, 7)[seed % 3]
    x = torch.randn(*shape[:3], Cn, generator=g, dtype=dtype)
    return {name: x, "weight": torch.randn(Cn, 1, k, k, generator=g, dtype=dtype) * 0.2,
            "bias": torch.randn(Cn, generator=g, dtype=dtype)}


def _depthwise(shape, dtype, seed):
    from ppma.ops.cpu.depthwise_conv2d import depthwise_conv2d_ref

    return (lambda x, weight, bias: C.depthwise_conv2d(x, weight, bias),
            lambda x, weight, bias: depthwise_conv2d_ref(x, weight, bias), _conv_args(shape, dtype, seed))


def _depthwise_residual(shape, dtype, seed):
    from ppma.ops.cpu.depthwise_conv2d import depthwise_conv2d_ref

    return (lambda x, weight, bias: C.depthwise_conv2d_residual_(x.clone(), weight, bias),
            lambda x, weight, bias: x + depthwise_conv2d_ref(x, weight, bias), _conv_args(shape, dtype, seed))


def _gelu_depthwise(shape, dtype, seed):
    from ppma.ops.cpu.depthwise_conv2d import gelu_depthwise_conv2d_residual_ref

    return (lambda h, weight, bias: C.gelu_depthwise_conv2d_residual(h, weight, bias),
            lambda h, weight, bias: gelu_depthwise_conv2d_residual_ref(h, weight, bias),
            _conv_args(shape, dtype, seed, "h"))


HELPERS = {
    "layer_norm": _layer_norm,
    "add_layer_norm_": _add_layer_norm,
    "rope": _rope,
    "rope_": _rope_inplace,
    "path_decay": _path_decay,
    "depthwise_conv2d": _depthwise,
    "depthwise_conv2d_residual_": _depthwise_residual,
    "gelu_depthwise_conv2d_residual": _gelu_depthwise,
}
# the helpers with a gradient formula of their own (the others run torch's where a gradient is recorded)
DIFFERENTIABLE = ("rope", "path_decay", "depthwise_conv2d", "gelu_depthwise_conv2d_residual")

# [B, H, W, c]: empty batches and maps, 1-wide maps, odd sizes; c drives the channel / head counts
helper_shapes = st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 6), st.integers(1, 9))


def _outputs(res):
    return list(res) if isinstance(res, tuple) else [res]


@settings(max_examples=40, **SETTINGS)
@given(name=st.sampled_from(sorted(HELPERS)), shape=helper_shapes, dtype=st.sampled_from(FLOATS),
       grad=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_helper_ops_match_reference_with_nans(name, shape, dtype, grad, seed, data):
    """Every helper op on random (also empty and odd) shapes with NaN in its first input equals its reference,
    NaN where the reference has NaN; where it has a gradient formula, its gradients do too."""
    fn, ref, args = HELPERS[name](shape, dtype, seed)
    first = next(iter(args))
    args[first] = _with_nans(args[first], data, first)
    grad = grad and name in DIFFERENTIABLE
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    leaves = {k: v.clone().requires_grad_(grad) for k, v in args.items()}
    ref_leaves = {k: v.clone().requires_grad_(grad) for k, v in args.items()}
    got, want = _outputs(fn(**leaves)), _outputs(ref(**ref_leaves))
    for i, (a, b) in enumerate(zip(got, want)):
        _same(a.detach(), b.detach(), f"{name} output {i}", tol)
    if grad and got[0].numel():
        w = torch.linspace(-1, 1, got[0].numel(), dtype=got[0].dtype).view(got[0].shape)
        ga = torch.autograd.grad((got[0].nan_to_num(0.0) * w).sum(), list(leaves.values()), allow_unused=True)
        gb = torch.autograd.grad((want[0].nan_to_num(0.0) * w).sum(), list(ref_leaves.values()), allow_unused=True)
        for k, a, b in zip(leaves, ga, gb):
            if a is not None and b is not None:
                _same(a, b, f"{name} grad {k}", tol * 10)


@settings(max_examples=30, **SETTINGS)
@given(name=st.sampled_from(sorted(HELPERS)), pick=st.integers(0, 3), fault=st.sampled_from(["meta", "int"]),
       grad=st.booleans())
def test_helper_ops_name_the_bad_argument(name, pick, fault, grad):
    """A meta tensor beside CPU ones, or an integer tensor, in any argument: a ValueError naming it (never an
    unchanged input, uninitialised memory or a message of torch's that names no argument)."""
    fn, _, args = HELPERS[name]((1, 3, 4, 3), torch.float32, 0)
    bad = list(args)[pick % len(args)]
    if fault == "meta" and pick % len(args) == 0:
        # a meta first argument: the others (on cpu) are the ones named
        args = {k: (v.to("meta") if k == bad else v) for k, v in args.items()}
        match = "is on cpu but|is on meta"
    elif fault == "meta":
        args = {k: (v.to("meta") if k == bad else v) for k, v in args.items()}
        match = f"{bad} is on meta"
    else:
        args = {k: (v.round().int() if k == bad else v) for k, v in args.items()}
        match = f"{bad} must be float"
    if grad and name in DIFFERENTIABLE:
        args = {k: (v.requires_grad_() if v.is_floating_point() else v) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        fn(**args)


_FAKE_CALLS = {
    # registered op -> (arguments by name, the non-tensor arguments after them)
    "layer_norm": (("x", "weight", "bias"), (1e-5,)),
    "add_layer_norm_": (("x", "residual", "weight", "bias"), (1e-5,)),
    "rope": (("x", "sin", "cos"), (1.0, False)),
    "rope_": (("x", "sin", "cos"), (1.0, False)),
    "path_decay": (("x", "weight", "dt_bias", "A"), ()),
    "depthwise_conv2d_residual_": (("x", "weight", "bias"), ()),
    "gelu_depthwise_conv2d_residual_forward": (("h", "weight", "bias"), ()),
}


@settings(max_examples=25, **SETTINGS)
@given(op=st.sampled_from(sorted(_FAKE_CALLS)), pick=st.integers(1, 3), fault=st.sampled_from(["meta", "int"]))
def test_registered_helper_ops_refuse_meta_and_int(op, pick, fault):
    """Called directly, the registered ops refuse a meta tensor beside CPU ones (their fake kernels check the
    devices) and integer tensors, naming the argument."""
    if not hasattr(torch.ops.ppma, op):
        pytest.skip(f"ppma::{op} is not built")
    names, extra = _FAKE_CALLS[op]
    builder = {"add_layer_norm_": "add_layer_norm_", "rope_": "rope", "depthwise_conv2d_residual_":
               "depthwise_conv2d_residual_", "gelu_depthwise_conv2d_residual_forward":
               "gelu_depthwise_conv2d_residual"}.get(op, op)
    _, _, args = HELPERS[builder]((1, 3, 4, 3), torch.float32, 0)
    args = dict(args)
    if op == "path_decay":
        args["A"] = -args.pop("A_log").exp()  # the op takes A = -exp(A_log)
    bad = names[pick % len(names)] if pick % len(names) else names[1]
    args[bad] = args[bad].to("meta") if fault == "meta" else args[bad].round().int()
    # the fake kernels' message or the kernel's own check, each naming the argument
    match = rf"\b{bad}\b.*(meta|float|Int)"
    with pytest.raises(RuntimeError, match=match):
        getattr(torch.ops.ppma, op)(*[args[n] for n in names], *extra)


# ------------------------------------------------------------------------------------------------
# In-place ops: overlapping operands
# ------------------------------------------------------------------------------------------------


@settings(max_examples=30, **SETTINGS)
@given(rows=st.integers(2, 6), C_=st.integers(1, 20), shift=st.integers(-3, 3), fused=st.booleans())
def test_add_layer_norm_refuses_overlap(rows, C_, shift, fused):
    """``add_layer_norm_(x, residual)`` with views of one buffer: refused where they partly overlap, equal to the
    computation on copies where they are disjoint or the same view (``x += x``)."""
    buf = torch.randn(2 * rows + 6, C_, generator=_gen(rows * 31 + C_))
    x = buf[3 : 3 + rows]
    r = buf[3 + shift : 3 + shift + rows] if abs(shift) < rows else buf[3 + rows + 1 : 3 + 2 * rows + 1]
    w, b = torch.ones(C_), torch.zeros(C_)
    with ppma.ops.use_impl("fused" if fused else "reference"):
        if shift != 0 and abs(shift) < rows:
            with pytest.raises(ValueError, match="residual shares memory with x"):
                C.add_layer_norm_(x, r, w, b)
            return
        want_x = x + r
        want = F.layer_norm(want_x, (C_,), w, b)
        got = C.add_layer_norm_(x, r, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, want_x)


@settings(max_examples=20, **SETTINGS)
@given(op=st.sampled_from(["rope_", "depthwise_conv2d_residual_", "add_layer_norm_"]),
       which=st.integers(0, 1), fused=st.booleans())
def test_inplace_ops_refuse_parameters_inside_x(op, which, fused):
    """A parameter tensor that is a view into ``x`` (which the op writes) is refused, on every implementation."""
    buf = torch.randn(4 * 6 * 8 * 2)
    if op == "rope_":
        x = buf.view(1, 4, 6, 1, 16)
        params = [buf[: 4 * 6 * 16].view(4, 6, 16), buf[: 4 * 6 * 16].view(4, 6, 16)]
        names = ["sin", "cos"]
        call = lambda p: C.rope_(x, *p)  # noqa: E731
    elif op == "depthwise_conv2d_residual_":
        x = buf.view(1, 4, 6, 16)
        params = [buf[:16 * 9].view(16, 1, 3, 3), buf[-16:]]
        names = ["weight", "bias"]
        call = lambda p: C.depthwise_conv2d_residual_(x, *p)  # noqa: E731
    else:
        x = buf.view(24, 16)
        params = [buf[:16], buf[16:32]]
        names = ["weight", "bias"]
        call = lambda p: C.add_layer_norm_(x, torch.randn(24, 16), *p)  # noqa: E731
    params = [p if i == which else p.clone() for i, p in enumerate(params)]
    with ppma.ops.use_impl("fused" if fused else "reference"), pytest.raises(ValueError,
                                                                             match=f"{names[which]} shares memory"):
        call(params)


@needs_ext
def test_registered_inplace_ops_refuse_overlap():
    """The kernels check too (a direct call of the registered op): torch's own message for in-place overlap."""
    buf = torch.randn(5, 16)
    with pytest.raises(RuntimeError, match="residual shares memory with x"):
        torch.ops.ppma.add_layer_norm_(buf[1:], buf[:-1], torch.ones(16), torch.zeros(16), 1e-5)
    x = torch.randn(1, 3, 4, 1, 8)
    sin = x.view(3, 4, 8)
    with pytest.raises(RuntimeError, match="sin shares memory with x"):
        torch.ops.ppma.rope_(x, sin, torch.randn(3, 4, 8), 1.0, False)
    m = torch.randn(1, 3, 3, 8)
    with pytest.raises(RuntimeError, match="weight shares memory with x"):
        torch.ops.ppma.depthwise_conv2d_residual_(m, m.view(-1)[:72].view(8, 1, 3, 3), None)


# ------------------------------------------------------------------------------------------------
# The 3-D ops
# ------------------------------------------------------------------------------------------------


def _pos(t):
    """Non-negative features for the linear attention (an integer tensor is passed on, for the dtype check)."""
    return t.abs() + 0.1 if t.is_floating_point() else t


OPS_3D = {
    "polyline_attention_3d": (ppma.ops.polyline_attention_3d, R3.polyline_attention_3d_ref, ("q", "k", "v")),
    "polyline_linear_attention_3d": (
        lambda q, k, v, *d: ppma.ops.polyline_linear_attention_3d(_pos(q), _pos(k), v, *d),
        lambda q, k, v, *d: R3.polyline_linear_attention_3d_ref(_pos(q), _pos(k), v, *d), ("q", "k", "v")),
    "polyline_scan_3d": (ppma.ops.polyline_scan_3d, R3.polyline_scan_3d_ref, ("x",)),
    "polyline_scan_3d_t": (lambda x, *d: ppma.ops.polyline_scan_3d(x, *d, transpose=True),
                           lambda x, *d: R3.polyline_scan_3d_ref(x, *d, transpose=True), ("x",)),
}
DECAYS = ("log_alpha", "log_beta", "log_gamma")
# (B, T, H, W, heads, d): empty dimensions, 1-long lines, odd sizes
shapes_3d = st.tuples(st.integers(0, 2), st.integers(1, 3), st.integers(0, 3), st.integers(1, 4), st.integers(1, 2),
                      st.integers(1, 3))


def _inputs_3d(names, shape, dtype, seed):
    B, T, H, W, G, d = shape
    g = _gen(seed)
    feats = {n: torch.randn(B, T, H, W, G, d + (n == "v"), generator=g, dtype=dtype) for n in names}
    decs = {n: -2 * torch.rand(B, T, H, W, G, generator=g, dtype=dtype) for n in DECAYS}
    return {**feats, **decs}


@settings(max_examples=40, **SETTINGS)
@given(op=st.sampled_from(sorted(OPS_3D)), shape=shapes_3d, target=st.sampled_from(("feature",) + DECAYS),
       skip_nan_outputs=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_3d_ops_match_reference_with_nans(op, shape, target, skip_nan_outputs, seed, data):
    """The 3-D ops on random (also empty and odd) shapes with NaN in a feature or a log-decay: the output and
    every gradient equal the reference's entry by entry (fp64), NaN where it has NaN."""
    fn, ref, names = OPS_3D[op]
    x = _inputs_3d(names, shape, torch.float64, seed)
    key = names[0] if target == "feature" else target
    x[key] = _with_nans(x[key], data, key)
    res = []
    for f in (fn, ref):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        out = f(*leaves.values())
        w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        loss = ((out.nan_to_num(0.0) if skip_nan_outputs else out) * w).sum()
        res.append([out.detach(), *torch.autograd.grad(loss, list(leaves.values()))])
    for name, a, b in zip(("out", *x), *res):
        _same(a, b, f"{op} {name}", 1e-8)


@settings(max_examples=30, **SETTINGS)
@given(op=st.sampled_from(sorted(OPS_3D)), pick=st.integers(0, 5), fault=st.sampled_from(["meta", "int", "dtype"]))
def test_3d_ops_name_the_bad_argument(op, pick, fault):
    """A meta tensor beside CPU ones, an integer tensor, or a log-decay of another dtype than log_alpha's: a
    ValueError naming the argument, from the op and from its reference."""
    fn, ref, names = OPS_3D[op]
    x = _inputs_3d(names, (1, 2, 2, 3, 1, 2), torch.float32, 0)
    keys = list(x)
    bad = keys[pick % len(keys)]
    if fault == "meta":
        x[bad] = x[bad].to("meta")
        match = "is on cpu but" if bad == keys[0] else f"{bad} is on meta"
    elif fault == "int":
        x[bad] = x[bad].round().int()
        match = f"{bad} must be float"
    else:
        bad = DECAYS[1 + pick % 2]
        x[bad] = x[bad].double()
        match = f"{bad} has dtype"
    # the references check devices; they compute other dtypes in their compute dtype (a defined result)
    for f in (fn, ref) if fault == "meta" else (fn,):
        with pytest.raises(ValueError, match=match):
            f(*x.values())


@needs_ext
def test_polyline_attention_3d_nan_decay_gradient_stays_in_its_half():
    """The case of the report: a NaN log_beta; the kernel's log_beta gradient was NaN at more entries than the
    reference's (D2 was formed from 2 out - out_v2h, so a NaN of one half of the mask reached the other)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 2, 2, 1, 2, generator=g, dtype=torch.float64) for _ in range(3)]
    la, lb, lg = [-torch.rand(1, 2, 2, 2, 1, generator=g, dtype=torch.float64) for _ in range(3)]
    lb[0, 0, 1, 0, 0] = float("nan")
    grads = []
    for fn in (ppma.ops.polyline_attention_3d, R3.polyline_attention_3d_ref):
        xs = [t.clone().requires_grad_() for t in (q, k, v, la, lb, lg)]
        grads.append(torch.autograd.grad(fn(*xs).sum(), xs))
    for name, a, b in zip(("q", "k", "v", "log_alpha", "log_beta", "log_gamma"), *grads):
        _same(a, b, name, 1e-9)
    assert grads[0][4].isfinite().any()
