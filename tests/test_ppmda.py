"""PPMDA, the polyline path masked decomposed attention of the PPMA paper (arXiv 2506.15940, appendix A.7, Eq. 38-39;
docs/ops.md "PPMDA"): ``polyline_linear_attention(S1, S2^T, V, ..., normalize=False)`` with any real factors. The
fused op with signed ``q, k`` against ``(S1 S2 ⊙ L) V`` built densely here from the mask's definition."""

from __future__ import annotations

import pytest
import torch

import ppma
from ppma.ops import polyline_linear_attention, use_impl
from ppma.ops.reference import polyline_linear_attention_ref

needs_ext = pytest.mark.skipif(not ppma.has_ext(), reason="ppma._C is not built")


def _v2h_mask(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """L[p, s] for one (batch, head) from docs/ops.md "Prefix sums and biases": query p = (i, j), key s = (k, l);
    the path runs along column l from row k to row i (log-decays ``lb[m, l]``, m = min(i,k)+1 .. max(i,k)), then
    along row i from column l to column j (``la[i, n]``, n = min(j,l)+1 .. max(j,l))."""
    H, W = la.shape
    rows = []
    for i in range(H):
        for j in range(W):
            row = []
            for k in range(H):
                for l in range(W):
                    log = la.new_zeros(())
                    for n in range(min(j, l) + 1, max(j, l) + 1):
                        log = log + la[i, n]
                    for m in range(min(i, k) + 1, max(i, k) + 1):
                        log = log + lb[m, l]
                    row.append(log.exp())
            rows.append(torch.stack(row))
    return torch.stack(rows)


def _ppmda_dense(s1, s2t, v, la, lb):
    """0.5 ((S1 S2) ⊙ L) V + 0.5 ((S1 S2) ⊙ L^T) V per batch and head (S2 = s2t^T), on [B, H, W, heads, .]."""
    B, H, W, G, _ = s1.shape
    out = []
    for b in range(B):
        heads = []
        for g in range(G):
            S1 = s1[b, :, :, g].reshape(H * W, -1).double()
            S2 = s2t[b, :, :, g].reshape(H * W, -1).double().T
            V = v[b, :, :, g].reshape(H * W, -1).double()
            L = _v2h_mask(la[b, :, :, g].double(), lb[b, :, :, g].double())
            S = S1 @ S2
            heads.append(0.5 * (S * L) @ V + 0.5 * (S * L.T) @ V)
        out.append(torch.stack(heads, 1))
    return torch.stack(out).reshape(B, H, W, G, -1)


def _inputs(shape, dtype, seed):
    B, H, W, G, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    s1 = torch.randn(B, H, W, G, d, generator=gen, dtype=torch.float64)
    s2t = torch.randn(B, H, W, G, d, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, W, G, dv, generator=gen, dtype=torch.float64)
    la = -torch.rand(B, H, W, G, generator=gen, dtype=torch.float64)
    lb = -torch.rand(B, H, W, G, generator=gen, dtype=torch.float64)
    assert (s1 < 0).any() and (s2t < 0).any()  # signed factors
    return [t.to(dtype).requires_grad_() for t in (s1, s2t, v, la, lb)]


SHAPES = [(2, 3, 4, 2, 3, 5), (1, 5, 1, 1, 4, 2), (1, 1, 6, 2, 2, 3), (1, 4, 4, 1, 1, 1)]


@needs_ext
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_ppmda_signed_factors_fp64(shape):
    inputs = _inputs(shape, torch.float64, seed=sum(shape))
    with use_impl("fused"):
        out = polyline_linear_attention(*inputs, normalize=False)
    expected = _ppmda_dense(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-11)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(expected, inputs, g, allow_unused=True)  # W = 1: no row decay enters
    want = [torch.zeros_like(t) if w is None else w for t, w in zip(inputs, want)]
    for name, a, b in zip(("S1", "S2^T", "V", "log_alpha", "log_beta"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")
    # the reference agrees too (it is the oracle of the fused op's own tests)
    torch.testing.assert_close(polyline_linear_attention_ref(*inputs, normalize=False), expected,
                               rtol=1e-10, atol=1e-11)


@needs_ext
def test_fused_ppmda_signed_factors_fp32():
    shape = (2, 4, 3, 2, 4, 3)
    inputs = _inputs(shape, torch.float32, seed=7)
    with use_impl("fused"):
        out = polyline_linear_attention(*inputs, normalize=False)
    expected = _ppmda_dense(*inputs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(expected, inputs, g.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=1e-4)


@needs_ext
def test_ppmda_gradcheck_fused():
    inputs = _inputs((1, 2, 3, 1, 2, 2), torch.float64, seed=3)
    with use_impl("fused"):
        assert torch.autograd.gradcheck(lambda *t: polyline_linear_attention(*t, normalize=False), tuple(inputs))
