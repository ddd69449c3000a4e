"""MonarchLinear (ppma.nn.monarch): the order-2 Monarch matrix M = P_out L P_mid R P_in against the product of its
factors built here as explicit permutation and block-diagonal matrices, gradients, shapes, errors."""

from __future__ import annotations

import math

import pytest
import torch

from ppma.nn import MonarchLinear
from ppma.nn.monarch import monarch_shapes

SHAPES = [(16, 16), (64, 64), (9, 9), (64, 192), (192, 64), (7, 5), (5, 7), (100, 37), (1, 1), (2, 3), (48, 144)]


def _stride_perm(rows: int, cols: int) -> torch.Tensor:
    """Permutation matrix of "view a length rows*cols vector as [rows, cols] row-major, transpose, flatten":
    (P x)[c * rows + r] = x[r * cols + c]."""
    P = torch.zeros(rows * cols, rows * cols, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            P[c * rows + r, r * cols + c] = 1.0
    return P


def _dense_from_factors(m: MonarchLinear) -> torch.Tensor:
    """M = T P_out L P_mid R P_in E (module docstring of ppma.nn.monarch, steps 1-6), from explicit matrices."""
    b, p, q, s = m.nblocks, m.in_block, m.mid_block, m.out_block
    E = torch.zeros(b * p, m.in_features, dtype=torch.float64)  # zero padding of the input
    E[: m.in_features] = torch.eye(m.in_features, dtype=torch.float64)
    T = torch.zeros(m.out_features, b * s, dtype=torch.float64)  # truncation of the output
    T[:, : m.out_features] = torch.eye(m.out_features, dtype=torch.float64)
    R = torch.block_diag(*m.blocks_r.detach().double())  # [b q, b p]
    L = torch.block_diag(*m.blocks_l.detach().double())  # [b s, b q]
    return T @ _stride_perm(b, s) @ L @ _stride_perm(q, b) @ R @ _stride_perm(p, b) @ E


def _randomise(m: MonarchLinear, seed: int = 0) -> MonarchLinear:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen, dtype=prm.dtype))
    return m


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_to_dense_match_explicit_factors(shape):
    i, o = shape
    m = _randomise(MonarchLinear(i, o).double(), seed=i * 1000 + o)
    M = _dense_from_factors(m)
    assert M.shape == (o, i)
    torch.testing.assert_close(m.to_dense(), M, rtol=1e-12, atol=1e-12)
    x = torch.randn(3, 4, i, dtype=torch.float64)
    torch.testing.assert_close(m(x), x @ M.T + m.bias, rtol=1e-12, atol=1e-12)
    # every output depends on every input (q >= b): no structural zero in M
    assert (M != 0).all()


@pytest.mark.parametrize("nblocks", [1, 2, 3, 4])
def test_explicit_nblocks_and_no_bias(nblocks):
    m = _randomise(MonarchLinear(20, 33, nblocks=nblocks, bias=False).double(), seed=nblocks)
    assert m.bias is None and m.nblocks == nblocks
    x = torch.randn(5, 20, dtype=torch.float64)
    torch.testing.assert_close(m(x), x @ _dense_from_factors(m).T, rtol=1e-12, atol=1e-12)


def test_square_is_p_l_p_r_p():
    """n = b^2: the three permutations are one symmetric stride permutation, M = P L P^T R P (seed paper A.3)."""
    b = 4
    m = _randomise(MonarchLinear(b * b, b * b).double())
    assert (m.nblocks, m.in_block, m.mid_block, m.out_block) == (b, b, b, b)
    P = _stride_perm(b, b)
    torch.testing.assert_close(P, P.T)
    L, R = torch.block_diag(*m.blocks_l.detach()), torch.block_diag(*m.blocks_r.detach())
    torch.testing.assert_close(m.to_dense(), P @ L @ P.T @ R @ P, rtol=1e-12, atol=1e-12)
    # an entry of a square Monarch matrix is one product L_ij R_kl: rank-1 b x b blocks after permuting
    M = (P @ m.to_dense() @ P).reshape(b, b, b, b).permute(0, 2, 1, 3)
    assert all(torch.linalg.matrix_rank(M[i, j]) == 1 for i in range(b) for j in range(b))


def test_gradients_match_dense_product():
    m = _randomise(MonarchLinear(13, 21).double(), seed=3)
    x = torch.randn(6, 13, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 21, dtype=torch.float64)
    (m(x) * g).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    # the same through the dense matrix built from differentiable explicit factors
    b, p, q, s = m.nblocks, m.in_block, m.mid_block, m.out_block
    E = torch.eye(b * p, 13, dtype=torch.float64)
    T = torch.eye(21, b * s, dtype=torch.float64)
    M = (T @ _stride_perm(b, s) @ torch.block_diag(*m.blocks_l) @ _stride_perm(q, b) @ torch.block_diag(*m.blocks_r)
         @ _stride_perm(p, b) @ E)
    ((x @ M.T + m.bias) * g).sum().backward()
    for a, ref in zip(grads, [x.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: m(t), (torch.randn(2, 13, dtype=torch.float64, requires_grad=True),))


def test_parameter_count_and_init_scale():
    m = MonarchLinear(256, 768)
    b, p, q, s = monarch_shapes(256, 768)
    assert (b, p, q, s) == (16, 16, 16, 48)
    n = sum(t.numel() for t in m.parameters())
    assert n == b * q * (p + s) + 768 and n < 256 * 768 / 10
    # the entries of M have nn.Linear's default variance 1 / (3 in)
    torch.manual_seed(0)
    var = MonarchLinear(256, 256).to_dense().var().item()
    assert abs(var * 3 * 256 - 1) < 0.15


def test_any_leading_shape_and_dtype():
    m = MonarchLinear(10, 6)
    assert m(torch.randn(10)).shape == (6,)
    assert m(torch.randn(2, 3, 4, 10)).shape == (2, 3, 4, 6)
    assert m(torch.randn(0, 10)).shape == (0, 6)
    mb = MonarchLinear(10, 6).to(torch.bfloat16)
    assert mb(torch.randn(4, 10, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_shapes_raise_named_errors():
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        MonarchLinear(0, 4)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        MonarchLinear(4, 2.5)
    with pytest.raises(ValueError, match="nblocks must be a positive int"):
        MonarchLinear(16, 16, nblocks=0)
    with pytest.raises(ValueError, match=r"nblocks=5 is too large .* nblocks <= 4"):
        MonarchLinear(16, 16, nblocks=5)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 16\]"):
        MonarchLinear(16, 16)(torch.randn(3, 15))
    assert math.isqrt(16) == MonarchLinear(16, 100).nblocks
