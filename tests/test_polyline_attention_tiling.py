"""Float64 prototype of the row-uniform tiling of the polyline_attention tensor-core backward (docs/design.md §4.3,
"the row-uniform kernels"), against the reference's gradients.

The kernels of ``csrc/kernels/polyline_attention_tc_bwd2.cuh`` rest on two facts checked here in plain PyTorch,
before any device code (docs/design.md §5.3):

* Separable biases. When a warp's 16 outer tokens lie in one map row and every n8 block of 8 inner tokens lies in
  one map row, the two biases of a (query row i, key row k) block pair need only per-token values and per-column
  vectors of that row pair: ``M = seg(j, l; cr(i,j), cr(i,l)) + e1[l]`` and ``M' = seg(j, l; cr(k,j), cr(k,l))
  + e2[j]`` with ``e1[l] = seg(k, i; cc(k,l), cc(i,l))`` and ``e2[j] = seg(i, k; cc(i,j), cc(k,j))`` (seg =
  ``line_bias``, docs/ops.md "Prefix sums and biases").
* Row-owner gradients. Every prefix-sum gradient term of a block pair lands on a token of the outer row (query row
  i in the dq kernel, key row k in the dkdv kernel): per outer token (a row sum over the block's columns) or per
  (outer row, inner column) token (a column sum over the block's rows, with the uniform sign ``sgn(i - k)`` of the
  block pair for the cc terms). Summed per row and reverse-cumsummed they give the log-decay gradients.

The block structure follows RowTiling (csrc/kernels/common.cuh) with 64-token tiles, as the kernels do; the tests
assert that each block lies in one row for the maps the fast path takes (W a multiple of 16, or W > 32), and in at
most two rows for W = 17-31 (the two-row kernels), where the blocks are split into their row parts: each pair of
parts is row-uniform, which is what the kernels' per-lane row select computes.
"""

from __future__ import annotations

import pytest
import torch

from ppma.ops import reference as ref

BM = 64  # tile of the outer and inner RowTiling (TcTraits::BM, and the 64-wide inner tiles)


def row_tiles(H: int, W: int, bm: int = BM) -> list[list[int]]:
    """Flat token indices of the tiles of RowTiling(H, W, bm): whole rows when W <= bm, else row segments."""
    if W <= bm:
        R = bm // W
        return [list(range(r0 * W, min(r0 + R, H) * W)) for r0 in range(0, H, R)]
    return [list(range(i * W + c0, i * W + min(c0 + bm, W))) for i in range(H) for c0 in range(0, W, bm)]


def fast_path(W: int) -> bool:
    """The launcher's condition for the row-uniform kernels (every 16-token warp block and 8-token n-block of a
    64-token RowTiling tile lies in one map row)."""
    return W % 16 == 0 or W > 32


def blocks(tiles: list[list[int]], size: int) -> list[list[int]]:
    return [t[o:o + size] for t in tiles for o in range(0, len(t), size)]


def line_bias(t, u, ct, cu):
    """docs/ops.md: the bias of a segment from index t to u on one line, c at the larger index minus c at the
    smaller (``csrc/common/math.h`` line_bias)."""
    return torch.where(u > t, -1.0, 1.0).to(ct.dtype) * (ct - cu)


def sgn(a):
    return torch.sign(a).to(torch.float64)


def parts(blks: list[list[int]], W: int, max_rows: int):
    """The map-row parts of each block, as (token indices, row) pairs: the whole block where it lies in one row (the
    row-uniform kernels), else one part per row it spans (the two-row kernels: a lane selects the row of each of
    its elements). Asserts that no block spans more than max_rows rows."""
    for b in blks:
        rows = sorted({t // W for t in b})
        assert len(rows) <= max_rows, f"a block spans {len(rows)} rows"
        for r in rows:
            yield torch.tensor([t for t in b if t // W == r]), r


def tiled_backward(q, k, v, la, lb, go, scale, max_rows=1):
    """out and the five gradients of polyline_attention for one (b, head) ([H, W, d] inputs), from the separable
    biases of row-uniform block pairs and the row-owner assignment of the decay-gradient terms. max_rows: the map
    rows a 16-token warp block or an 8-token n8 block may span (1: the row-uniform kernels; 2: W = 17-31, the
    two-row kernels, where each (query part, key part) pair of two blocks is row-uniform)."""
    H, W, d = q.shape
    N = H * W
    cr = ref.prefix_sum_excl_first(la, dim=1)  # [H, W]
    cc = ref.prefix_sum_excl_first(lb, dim=0)
    row = torch.arange(N) // W
    col = torch.arange(N) % W
    crf, ccf = cr.reshape(N), cc.reshape(N)
    qf, kf, vf, gof = q.reshape(N, d), k.reshape(N, d), v.reshape(N, -1), go.reshape(N, -1)
    S = scale * qf @ kf.T
    # biases, block pair by block pair, from the per-row vectors only
    M1 = torch.full((N, N), float("nan"), dtype=torch.float64)
    M2 = torch.full((N, N), float("nan"), dtype=torch.float64)
    tiles = row_tiles(H, W)
    qblocks, kblocks = blocks(tiles, 16), blocks(tiles, 8)
    for qb_, i in parts(qblocks, W, max_rows):
        j = col[qb_]
        for kb_, kr in parts(kblocks, W, max_rows):
            l = col[kb_]
            cr_il, cc_il = cr[i, l], cc[i, l]  # per column: (query row, key column)
            cr_kj, cc_kj = cr[kr, j], cc[kr, j]  # per query: (key row, query column)
            e1 = line_bias(torch.tensor(kr), torch.tensor(i), cc[kr, l], cc_il)  # [n8]
            e2 = line_bias(torch.tensor(i), torch.tensor(kr), cc[i, j], cc_kj)  # [16]
            m1 = line_bias(j[:, None], l[None, :], crf[qb_][:, None], cr_il[None, :]) + e1[None, :]
            m2 = line_bias(j[:, None], l[None, :], cr_kj[:, None], crf[kb_][None, :]) + e2[:, None]
            M1[qb_[:, None], kb_[None, :]] = m1
            M2[qb_[:, None], kb_[None, :]] = m2
    assert torch.isfinite(M1).all() and torch.isfinite(M2).all()
    P1, P2 = torch.softmax(S + M1, -1), torch.softmax(S + M2, -1)
    out = 0.5 * (P1 + P2) @ vf
    dP = gof @ vf.T
    D1 = (P1 * dP).sum(-1, keepdim=True)
    D2 = (P2 * dP).sum(-1, keepdim=True)
    G1 = P1 * (0.5 * dP - 0.5 * D1)  # dL/dM (the 1/2 of the average folded in)
    G2 = P2 * (0.5 * dP - 0.5 * D2)
    dS = G1 + G2
    dq = scale * dS @ kf
    dk = scale * dS.T @ qf
    dv = 0.5 * (P1 + P2).T @ gof
    # decay-gradient terms, owned by the outer row of each kernel
    g_cr = torch.zeros(H, W, dtype=torch.float64)
    g_cc = torch.zeros(H, W, dtype=torch.float64)
    for qb_, i in parts(qblocks, W, max_rows):  # dq kernel: query row i owns (i, j) and (i, l)
        j = col[qb_]
        for kb_, kr in parts(kblocks, W, max_rows):
            l = col[kb_]
            g1, g2 = G1[qb_[:, None], kb_[None, :]], G2[qb_[:, None], kb_[None, :]]
            s_jl = sgn(j[:, None] - l[None, :])
            sig = float(sgn(torch.tensor(i - kr)))  # uniform over the block pair
            g_cr[i, j] += (s_jl * g1).sum(1)  # R_i(j,l) on (i,j): per-row sum
            g_cc[i, j] += sig * g2.sum(1)  # C_j(i,k) on (i,j)
            g_cr[i, l] += (-s_jl * g1).sum(0)  # R_i(j,l) on (i,l): per-column sum
            g_cc[i, l] += sig * g1.sum(0)  # C_l(i,k) on (i,l)
    for kb_, kr in parts(qblocks, W, max_rows):  # dkdv kernel: key row k owns (k, l) and (k, j)
        l = col[kb_]
        for qb_, i in parts(kblocks, W, max_rows):
            j = col[qb_]
            g1, g2 = G1[qb_[:, None], kb_[None, :]].T, G2[qb_[:, None], kb_[None, :]].T  # [keys, queries]
            s_lj = sgn(l[:, None] - j[None, :])
            sig = float(sgn(torch.tensor(kr - i)))
            g_cc[kr, l] += sig * g1.sum(1)  # C_l(i,k) on (k,l)
            g_cr[kr, l] += (s_lj * g2).sum(1)  # R_k(j,l) on (k,l)
            g_cr[kr, j] += (-s_lj * g2).sum(0)  # R_k(j,l) on (k,j)
            g_cc[kr, j] += sig * g2.sum(0)  # C_j(i,k) on (k,j)
    # reverse cumsums along the lines; the first log-decay of a line enters no bias
    gla = g_cr.flip(1).cumsum(1).flip(1)
    glb = g_cc.flip(0).cumsum(0).flip(0)
    gla[:, 0] = 0
    glb[0, :] = 0
    return (out.reshape(H, W, -1), dq.reshape(H, W, d), dk.reshape(H, W, d), dv.reshape(H, W, -1), gla, glb)


# (H, W): whole-row tiles (W = 16, 32: several rows per tile; 40, 56: one partial row per tile), row segments
# (W = 70, 130: a last segment narrower than 64), odd H.
SHAPES = [(5, 16), (3, 32), (3, 40), (2, 56), (2, 70), (1, 130)]


def check_tiling(H, W, max_rows):
    g = torch.Generator().manual_seed(H * 1000 + W)
    d, dv = 8, 6
    q = torch.randn(1, H, W, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, H, W, 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, H, W, 1, dv, generator=g, dtype=torch.float64)
    la = -torch.rand(1, H, W, 1, generator=g, dtype=torch.float64)
    lb = -torch.rand(1, H, W, 1, generator=g, dtype=torch.float64)
    # a log-decay of exactly 0 on one column and one row: the sign rule at equal prefix sums
    la[:, :, W // 2] = 0.0
    lb[:, H // 2] = 0.0
    go = torch.randn(1, H, W, 1, dv, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, la, lb)]
    scale = d ** -0.5
    want = ref.polyline_attention_ref(*leaves, scale)
    wgrads = torch.autograd.grad(want, leaves, go)
    got = tiled_backward(q[0, :, :, 0], k[0, :, :, 0], v[0, :, :, 0], la[0, :, :, 0], lb[0, :, :, 0],
                         go[0, :, :, 0], scale, max_rows)
    for name, a, b in zip(("out", "q", "k", "v", "log_alpha", "log_beta"), got,
                          (want,) + tuple(wgrads)):
        b = b[0, :, :, 0]
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("H,W", SHAPES)
def test_row_uniform_tiling_matches_reference(H, W):
    assert fast_path(W)
    check_tiling(H, W, max_rows=1)


def two_row_path(W: int) -> bool:
    """The launcher's condition for the two-row kernels (csrc/kernels/polyline_attention_tc_bwd2.cuh,
    polyline_attention_tc_two_row): 16 < W < 32, not a multiple of 16."""
    return not fast_path(W) and 16 < W < 32


# (H, W): PPMA-T's stage 2 at 224² (W = 28), 3 rows per tile (17, 20), a warp block across two rows at every
# offset (31), odd H.
TWO_ROW_SHAPES = [(3, 17), (5, 20), (4, 28), (3, 31)]


@pytest.mark.parametrize("H,W", TWO_ROW_SHAPES)
def test_two_row_tiling_matches_reference(H, W):
    """W = 17-31: a 16-token warp block or an 8-token n8 block spans at most two map rows; split into its row
    parts, every (query part, key part) pair is row-uniform, so the same separable biases and row-owner sums hold
    with the query row and key row chosen per element (the kernel's per-lane row select)."""
    assert two_row_path(W)
    tiles = row_tiles(H, W)
    assert any(len({t // W for t in b}) == 2 for b in blocks(tiles, 16)), "expected a warp block across two rows"
    check_tiling(H, W, max_rows=2)


@pytest.mark.parametrize("W", [7, 9, 14])
def test_narrow_maps_take_the_general_path(W):
    """Maps below 16 columns (a warp block across two or three rows) keep the verified kernels."""
    assert not fast_path(W) and not two_row_path(W)
    tiles = row_tiles(4, W)
    spans = [b for b in blocks(tiles, 16) if len({t // W for t in b}) > 1]
    assert spans, "expected a warp block across two rows"
