"""NaN and floored log-decays: every fused op's outputs and gradients match the reference's, entry by entry.

docs/ops.md ("Edges"): NaN propagates as in the reference, and the gradient of a log-decay that is NaN or below
the floor (-1e4, down to -inf) is exactly 0, as the reference's ``clamp_min`` gives. Random NaN positions in
the log-decays (and in q, k, v), fp64, small maps of every shape class (1-wide, 1-high, square, ragged); the
loss either skips the NaN outputs (``nan_to_num``: finite gradients stay checkable) or takes them.
"""

from __future__ import annotations

import pytest
import torch

import ppma
from ppma.ops import reference as R

from op_utils import needs_ext

pytestmark = needs_ext


def _pos(t):
    return t.abs() + 0.1  # linear attention needs non-negative features


OPS = {
    "polyline_attention": (ppma.ops.polyline_attention, R.polyline_attention_ref, ("q", "k", "v")),
    "criss_cross_attention": (ppma.ops.criss_cross_attention, R.criss_cross_attention_ref, ("q", "k", "v")),
    "polyline_scan": (ppma.ops.polyline_scan, R.polyline_scan_ref, ("v",)),
    "polyline_scan_t": (
        lambda x, a, b: ppma.ops.polyline_scan(x, a, b, transpose=True),
        lambda x, a, b: R.polyline_scan_ref(x, a, b, transpose=True),
        ("v",),
    ),
    "polyline_linear_attention": (
        lambda q, k, v, a, b: ppma.ops.polyline_linear_attention(_pos(q), _pos(k), v, a, b),
        lambda q, k, v, a, b: R.polyline_linear_attention_ref(_pos(q), _pos(k), v, a, b),
        ("q", "k", "v"),
    ),
}
SHAPES = [(1, 5), (4, 1), (3, 3), (2, 4), (5, 3)]


def _inputs(seed: int, H: int, W: int, target: str, special: float):
    g = torch.Generator().manual_seed(seed)
    B, G, d = 2, 2, 3
    x = {n: torch.randn(B, H, W, G, d, generator=g, dtype=torch.float64) for n in ("q", "k", "v")}
    for n in ("log_alpha", "log_beta"):
        x[n] = -torch.rand(B, H, W, G, generator=g, dtype=torch.float64) * 2
    flat = x[target].view(-1)
    count = int(torch.randint(1, 4, (), generator=g))
    flat[torch.randint(0, flat.numel(), (count,), generator=g)] = special
    return x


def _run(fn, names, x, skip_nan_outputs: bool):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    out = fn(*[leaves[n] for n in names], leaves["log_alpha"], leaves["log_beta"])
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    loss = ((out.nan_to_num(0.0) if skip_nan_outputs else out) * weight).sum()
    loss.backward()
    return out.detach(), {n: leaves[n].grad for n in names + ("log_alpha", "log_beta")}


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str):
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN at {a.isnan().sum()} (fused) vs {b.isnan().sum()} (ref)"
    fin = ~a.isnan()
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("skip_nan_outputs", [True, False], ids=["finite-loss", "nan-loss"])
@pytest.mark.parametrize("target", ["log_alpha", "log_beta", "q", "v"])
@pytest.mark.parametrize("op", list(OPS))
def test_nan_matches_reference(op, target, skip_nan_outputs):
    fused, ref, names = OPS[op]
    if target not in names + ("log_alpha", "log_beta"):
        pytest.skip(f"{op} has no input {target}")
    for seed, (H, W) in enumerate(SHAPES * 2):
        x = _inputs(seed, H, W, target, float("nan"))
        out_f, g_f = _run(fused, names, x, skip_nan_outputs)
        out_r, g_r = _run(ref, names, x, skip_nan_outputs)
        case = f"{op}, NaN in {target}, seed {seed}, {H}x{W}"
        _assert_same(out_f, out_r, f"{case}: out")
        for n in g_r:
            _assert_same(g_f[n], g_r[n], f"{case}: grad {n}")
        for n in ("log_alpha", "log_beta"):
            assert torch.all(g_f[n][x[n].isnan()] == 0), f"{case}: grad {n} not 0 at its NaN entries"


@pytest.mark.parametrize("special", [float("-inf"), -2e4])
@pytest.mark.parametrize("op", list(OPS))
def test_floored_decay_gradient_is_zero(op, special):
    fused, ref, names = OPS[op]
    for seed, (H, W) in enumerate(SHAPES):
        x = _inputs(100 + seed, H, W, "log_alpha", special)
        x["log_beta"].view(-1)[seed] = special
        out_f, g_f = _run(fused, names, x, True)
        out_r, g_r = _run(ref, names, x, True)
        _assert_same(out_f, out_r, f"{op} out")
        for n in ("log_alpha", "log_beta"):
            floored = x[n] < -1e4
            assert torch.all(g_f[n][floored] == 0) and torch.all(g_r[n][floored] == 0), f"{op}: grad {n} at the floor"
            torch.testing.assert_close(g_f[n], g_r[n], rtol=1e-6, atol=1e-9)
