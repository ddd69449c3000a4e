"""The reference ops against the definitions of docs/model.md (§1.3-§1.6, §2, §3.3-§3.4).

Everything here is fp64 and compares the reference with independent, literal constructions: explicit products
of decays (Eq. 3), the official tril/triu segment sums, block-diagonal row/column matrices (Theorem 1) and dense
matrix products (Algorithm 1). If these pass, the reference is the oracle the fused kernels are tested against.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from op_utils import make_attention_inputs
from ppma.ops import reference as R


@pytest.fixture(autouse=True)
def _float64_default():
    """Everything in this file is fp64; restore the default dtype for the other test files."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


GRIDS = [(1, 1), (1, 5), (4, 1), (2, 3), (3, 2), (4, 4), (5, 7)]
HEADS_DIMS = [(1, 8), (2, 4), (3, 16)]


def make_inputs(B, H, W, G, d, dv=None, seed=0, requires_grad=False):
    """fp64 ``q, k, v, log_alpha, log_beta`` from the shared builder, log-decays in [-1.5, 0]."""
    shape = (B, H, W, G, d, d if dv is None else dv)
    return make_attention_inputs(shape, torch.float64, decay_scale=1.5, seed=seed, requires_grad=requires_grad)


def explicit_v2h_mask(alpha, beta):
    """L[(i,j),(k,l)] = alpha_{i,j:l} * beta_{i:k,l} by explicit products (Eq. 3). alpha, beta: [H, W]."""
    H, W = alpha.shape
    L = torch.zeros(H * W, H * W)
    for i, j, k, l in itertools.product(range(H), range(W), range(H), range(W)):
        a = math.prod(alpha[i, n].item() for n in range(min(j, l) + 1, max(j, l) + 1))
        b = math.prod(beta[n, l].item() for n in range(min(i, k) + 1, max(i, k) + 1))
        L[i * W + j, k * W + l] = a * b
    return L


def explicit_h2v_mask(alpha, beta):
    """L~[(i,j),(k,l)] = alpha_{k,j:l} * beta_{i:k,j}: along row k first, then along column j (docs/model.md §1.3)."""
    H, W = alpha.shape
    L = torch.zeros(H * W, H * W)
    for i, j, k, l in itertools.product(range(H), range(W), range(H), range(W)):
        a = math.prod(alpha[k, n].item() for n in range(min(j, l) + 1, max(j, l) + 1))
        b = math.prod(beta[n, j].item() for n in range(min(i, k) + 1, max(i, k) + 1))
        L[i * W + j, k * W + l] = a * b
    return L


def official_segsum(d):
    """The official 1-D mask: Cs = cumsum(d) including d_0; tril(Cs_i - Cs_j) + strict triu(Cs_j - Cs_i)."""
    cs = torch.cumsum(d, dim=-1)
    diff = cs[..., :, None] - cs[..., None, :]
    return torch.tril(diff) + torch.triu(-diff, diagonal=1)


def block_rows(A):
    """Block-diagonal N x N matrix from per-row W x W blocks A [H, W, W] (mixes only within a row)."""
    H, W, _ = A.shape
    M = torch.zeros(H * W, H * W)
    for i in range(H):
        M[i * W : (i + 1) * W, i * W : (i + 1) * W] = A[i]
    return M


def block_cols(Bm):
    """N x N matrix from per-column H x H blocks Bm [W, H, H] (mixes only within a column)."""
    W, H, _ = Bm.shape
    M = torch.zeros(H * W, H * W)
    for l in range(W):
        for i, k in itertools.product(range(H), range(H)):
            M[i * W + l, k * W + l] = Bm[l, i, k]
    return M


# ------------------------------------------------------------------------------------------------
# Masks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_segsum_matches_official_and_products(n):
    d = -torch.rand(3, n) * 2
    S = R.segsum_1d(d)
    torch.testing.assert_close(S, official_segsum(d), rtol=0, atol=1e-12)
    assert torch.equal(S, S.transpose(-1, -2))
    assert torch.all(torch.diagonal(S, dim1=-2, dim2=-1) == 0)
    for t, s in itertools.product(range(n), range(n)):
        expect = d[:, min(t, s) + 1 : max(t, s) + 1].sum(-1)
        torch.testing.assert_close(S[:, t, s], expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("H,W", GRIDS)
def test_dense_mask_equals_explicit_products(H, W):
    _, _, _, la, lb = make_inputs(2, H, W, 2, 4)
    L = R.polyline_mask(la, lb)
    for b, g in itertools.product(range(2), range(2)):
        ref = explicit_v2h_mask(la[b, :, :, g].exp(), lb[b, :, :, g].exp())
        torch.testing.assert_close(L[b, g], ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("H,W", [(3, 4), (5, 3)])
def test_zero_decays_cut_paths_exactly(H, W):
    """A decay of exactly 0 (log-decay -inf) gives every path through it weight 0, as the explicit products
    do, and the masks stay finite: the reference floors log-decays at -1e4 (exp(-1e4) == 0), like the kernels."""
    _, _, _, la, lb = make_inputs(1, H, W, 2, 4, seed=14)
    la[:, :, 2], lb[:, 1] = -math.inf, -math.inf
    L = R.polyline_mask(la, lb)
    assert torch.isfinite(R.polyline_log_mask(la, lb)).all()
    for g in range(2):
        ref = explicit_v2h_mask(la[0, :, :, g].exp(), lb[0, :, :, g].exp())
        assert torch.equal(L[0, g] == 0, ref == 0)
        torch.testing.assert_close(L[0, g], ref, rtol=1e-10, atol=0)  # prefix sums of magnitude 1e4
    torch.testing.assert_close(L, R.polyline_mask(la.clamp_min(-1e4), lb.clamp_min(-1e4)), rtol=0, atol=0)


@pytest.mark.parametrize("H,W", GRIDS)
def test_transpose_is_h2v_path(H, W):
    _, _, _, la, lb = make_inputs(1, H, W, 3, 4, seed=1)
    Lt = R.polyline_mask(la, lb, transpose=True)
    for g in range(3):
        ref = explicit_h2v_mask(la[0, :, :, g].exp(), lb[0, :, :, g].exp())
        torch.testing.assert_close(Lt[0, g], ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("H,W", GRIDS)
def test_dense_mask_matches_official_repeat_permute(H, W):
    """The official 'whole' mask: repeat the row and column masks to (B,nh,H,H,W,W), permute, view (docs/model.md §1.5)."""
    _, _, _, la, lb = make_inputs(2, H, W, 2, 4, seed=2)
    mask_w = official_segsum(la.permute(0, 1, 3, 2))  # (B, H, nh, W, W)
    mask_h = official_segsum(lb.permute(0, 2, 3, 1))  # (B, W, nh, H, H)
    mw = mask_w.permute(0, 2, 1, 3, 4)[:, :, :, None, :, :].expand(-1, -1, -1, H, -1, -1)  # b g i k j l
    mh = mask_h.permute(0, 2, 3, 4, 1)[:, :, :, :, None, :].expand(-1, -1, -1, -1, W, -1)  # b g i k j l
    M_off = (mw + mh).permute(0, 1, 2, 4, 3, 5).reshape(2, 2, H * W, H * W)
    torch.testing.assert_close(R.polyline_log_mask(la, lb), M_off, rtol=0, atol=1e-12)


@pytest.mark.parametrize("H,W", GRIDS)
def test_theorem1_decomposition(H, W):
    """L = L^H x L^V (row factor times column factor), and L^T = L^V x L^H."""
    _, _, _, la, lb = make_inputs(1, H, W, 1, 4, seed=3)
    A = R.row_log_mask(la)[0, 0].exp()  # [H, W, W]
    Bm = R.col_log_mask(lb)[0, 0].exp()  # [W, H, H]
    LH, LV = block_rows(A), block_cols(Bm)
    L = R.polyline_mask(la, lb)[0, 0]
    torch.testing.assert_close(L, LH @ LV, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(L.T, LV @ LH, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# Scans (Algorithm 1)
# ------------------------------------------------------------------------------------------------


def dense_apply(Lm, x):
    B, H, W, G, c = x.shape
    xf = x.reshape(B, H * W, G, c).transpose(1, 2)
    return (Lm @ xf).transpose(1, 2).reshape(B, H, W, G, c)


@pytest.mark.parametrize("H,W", GRIDS)
@pytest.mark.parametrize("transpose", [False, True])
def test_scan_equals_dense_product(H, W, transpose):
    _, _, _, la, lb = make_inputs(2, H, W, 2, 4, seed=4)
    x = torch.randn(2, H, W, 2, 3)
    y = R.polyline_scan_ref(x, la, lb, transpose=transpose)
    torch.testing.assert_close(y, dense_apply(R.polyline_mask(la, lb, transpose=transpose), x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 6, 11])
def test_scan_1d_equals_linear_recurrences(n):
    """The dense 1-D product equals the forward/backward recurrences of docs/model.md §2."""
    d = -torch.rand(n) * 2
    x = torch.randn(n, 3)
    a = d.exp()
    f = torch.zeros(n, 3)
    g = torch.zeros(n, 3)
    for t in range(n):
        f[t] = x[t] + (a[t] * f[t - 1] if t > 0 else 0)
    for t in range(n - 2, -1, -1):
        g[t] = a[t + 1] * (g[t + 1] + x[t + 1])
    torch.testing.assert_close(R.scan_1d_ref(x, d), f + g, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,W", GRIDS)
@pytest.mark.parametrize("G,d", HEADS_DIMS)
def test_polyline_attention_definition(H, W, G, d):
    """out = 0.5 RowNorm(softmax(S) * L) v + 0.5 RowNorm(softmax(S) * L^T) v (docs/model.md §1.6), built from explicit L."""
    B = 2
    q, k, v, la, lb = make_inputs(B, H, W, G, d, dv=d + 1, seed=5)
    scale = 0.37
    out = R.polyline_attention_ref(q, k, v, la, lb, scale=scale)
    assert out.shape == (B, H, W, G, d + 1)
    for b, g in itertools.product(range(B), range(G)):
        qf, kf, vf = (t[b, :, :, g].reshape(H * W, -1) for t in (q, k, v))
        L = explicit_v2h_mask(la[b, :, :, g].exp(), lb[b, :, :, g].exp())
        P = torch.softmax(scale * qf @ kf.T, dim=-1)
        P1 = P * L
        P1 = P1 / P1.sum(-1, keepdim=True)
        P2 = P * L.T
        P2 = P2 / P2.sum(-1, keepdim=True)
        expect = (0.5 * P1 + 0.5 * P2) @ vf
        torch.testing.assert_close(out[b, :, :, g].reshape(H * W, -1), expect, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("H,W", GRIDS)
@pytest.mark.parametrize("G,d", HEADS_DIMS)
def test_criss_cross_equals_dense_block_form(H, W, G, d):
    """out = 0.5 (B_big A_big) v + 0.5 (A_big B_big) v with block-diagonal row/column attentions (docs/model.md §1.6)."""
    B = 2
    q, k, v, la, lb = make_inputs(B, H, W, G, d, seed=6)
    scale = d**-0.5
    out = R.criss_cross_attention_ref(q, k, v, la, lb)
    for b, g in itertools.product(range(B), range(G)):
        qg, kg, vg = (t[b, :, :, g] for t in (q, k, v))  # [H, W, d]
        alpha, beta = la[b, :, :, g].exp(), lb[b, :, :, g].exp()
        A = torch.zeros(H, W, W)
        for i in range(H):
            S = scale * qg[i] @ kg[i].T
            mask = torch.tensor(
                [[math.prod(alpha[i, n].item() for n in range(min(j, l) + 1, max(j, l) + 1)) for l in range(W)]
                 for j in range(W)]
            )
            P = torch.softmax(S, -1) * mask
            A[i] = P / P.sum(-1, keepdim=True)
        Bm = torch.zeros(W, H, H)
        for l in range(W):
            S = scale * qg[:, l] @ kg[:, l].T
            mask = torch.tensor(
                [[math.prod(beta[n, l].item() for n in range(min(i, kk) + 1, max(i, kk) + 1)) for kk in range(H)]
                 for i in range(H)]
            )
            P = torch.softmax(S, -1) * mask
            Bm[l] = P / P.sum(-1, keepdim=True)
        Ab, Bb = block_rows(A), block_cols(Bm)
        expect = 0.5 * (Bb @ Ab) @ vg.reshape(H * W, -1) + 0.5 * (Ab @ Bb) @ vg.reshape(H * W, -1)
        torch.testing.assert_close(out[b, :, :, g].reshape(H * W, -1), expect, rtol=1e-10, atol=1e-12)


def test_official_chunk_mode_literal():
    """The official chunk formulation (docs/model.md §3.3): qk_w/qk_h + masks, softmax, P_h @ (P_w @ v) and P_w @ (P_h @ v)."""
    B, H, W, G, d = 2, 5, 6, 2, 8
    q, k, v, la, lb = make_inputs(B, H, W, G, d, seed=7)
    scale = d**-0.5
    kr = k * scale
    qw, kw, vw = (t.permute(0, 1, 3, 2, 4) for t in (q, kr, v))  # (B, H, nh, W, d)
    qh, kh = (t.permute(0, 2, 3, 1, 4) for t in (q, kr))  # (B, W, nh, H, d)
    mask_w = official_segsum(la.permute(0, 1, 3, 2))  # (B, H, nh, W, W)
    mask_h = official_segsum(lb.permute(0, 2, 3, 1))  # (B, W, nh, H, H)
    P_w = torch.softmax(qw @ kw.transpose(-1, -2) + mask_w, -1)
    P_h = torch.softmax(qh @ kh.transpose(-1, -2) + mask_h, -1)
    # out1 = P_h @ (P_w @ v): rows first -> columns
    t = (P_w @ vw).permute(0, 3, 2, 1, 4)  # (B, W, nh, H, d)
    out1 = (P_h @ t).permute(0, 3, 1, 2, 4)  # (B, H, W, nh, d)
    t = P_h @ v.permute(0, 2, 3, 1, 4)  # (B, W, nh, H, d)
    out2 = (P_w @ t.permute(0, 3, 2, 1, 4)).permute(0, 1, 3, 2, 4)
    expect = 0.5 * out1 + 0.5 * out2
    torch.testing.assert_close(R.criss_cross_attention_ref(q, k, v, la, lb), expect, rtol=1e-10, atol=1e-12)


def test_official_whole_mode_literal():
    """The official whole formulation (docs/model.md §3.4) with the official mask (d_0 included in the cumsum)."""
    B, H, W, G, d = 2, 4, 5, 2, 8
    q, k, v, la, lb = make_inputs(B, H, W, G, d, seed=8)
    N = H * W
    mask_w = official_segsum(la.permute(0, 1, 3, 2))
    mask_h = official_segsum(lb.permute(0, 2, 3, 1))
    mw = mask_w.permute(0, 2, 1, 3, 4)[:, :, :, None].expand(-1, -1, -1, H, -1, -1)
    mh = mask_h.permute(0, 2, 3, 4, 1)[:, :, :, :, None].expand(-1, -1, -1, -1, W, -1)
    M = (mw + mh).permute(0, 1, 2, 4, 3, 5).reshape(B, G, N, N)
    qf, kf, vf = (t.reshape(B, N, G, -1).transpose(1, 2) for t in (q, k * d**-0.5, v))
    S = qf @ kf.transpose(-1, -2)
    P = 0.5 * torch.softmax(S + M, -1) + 0.5 * torch.softmax(S + M.transpose(-1, -2), -1)
    expect = (P @ vf).transpose(1, 2).reshape(B, H, W, G, d)
    torch.testing.assert_close(R.polyline_attention_ref(q, k, v, la, lb), expect, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Gradients and numerics
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["polyline", "criss_cross", "scan", "scan_t"])
@pytest.mark.parametrize("H,W", [(3, 4), (1, 3), (4, 1)])
def test_first_decays_get_exactly_zero_gradient(op, H, W):
    q, k, v, la, lb = make_inputs(2, H, W, 2, 4, seed=9, requires_grad=True)
    if op == "polyline":
        out = R.polyline_attention_ref(q, k, v, la, lb)
    elif op == "criss_cross":
        out = R.criss_cross_attention_ref(q, k, v, la, lb)
    else:
        out = R.polyline_scan_ref(v, la, lb, transpose=op == "scan_t")
    out.pow(2).sum().backward()
    assert torch.all(la.grad[:, :, 0] == 0)
    assert torch.all(lb.grad[:, 0] == 0)
    if W > 1:
        assert la.grad[:, :, 1:].abs().sum() > 0
    if H > 1:
        assert lb.grad[:, 1:].abs().sum() > 0


@pytest.mark.parametrize("fn", [R.polyline_attention_ref, R.criss_cross_attention_ref])
def test_gradcheck_attention(fn):
    inputs = make_inputs(1, 2, 3, 2, 3, seed=10, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: fn(*a, scale=0.7), inputs)


@pytest.mark.parametrize("transpose", [False, True])
def test_gradcheck_scan(transpose):
    _, _, x, la, lb = make_inputs(1, 3, 2, 2, 3, seed=11, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: R.polyline_scan_ref(*a, transpose=transpose), (x, la, lb))


@pytest.mark.parametrize("fill", [-1e4, 0.0, -math.inf])
def test_extreme_decays_are_finite(fill):
    q, k, v, la, lb = make_inputs(1, 4, 5, 2, 8, seed=12)
    la = torch.full_like(la, fill).requires_grad_()
    lb = torch.full_like(lb, fill).requires_grad_()
    for fn in (R.polyline_attention_ref, R.criss_cross_attention_ref):
        out = fn(q.float(), k.float(), v.float(), la.float(), lb.float())
        assert torch.isfinite(out).all()
        out.sum().backward()
        assert torch.isfinite(la.grad).all() and torch.isfinite(lb.grad).all()
    if fill == 0.0:  # no decay: the whole mode is plain softmax attention
        B, H, W, G, d = q.shape
        qf, kf, vf = (t.reshape(B, H * W, G, -1).transpose(1, 2) for t in (q, k, v))
        plain = F.scaled_dot_product_attention(qf, kf, vf).transpose(1, 2).reshape(v.shape)
        torch.testing.assert_close(R.polyline_attention_ref(q, k, v, la.detach(), lb.detach()), plain)
    else:  # decays ~0 cut every path: only the token itself survives
        out = R.polyline_attention_ref(q, k, v, la.detach(), lb.detach())
        torch.testing.assert_close(out, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_fp32(dtype):
    q, k, v, la, lb = make_inputs(2, 3, 4, 2, 8, seed=13)
    for fn in (R.polyline_attention_ref, R.criss_cross_attention_ref):
        ref = fn(q, k, v, la, lb)
        out = fn(*(t.to(dtype) for t in (q, k, v)), la.float(), lb.float())
        assert out.dtype == dtype
        tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_path_log_decays_formula():
    B, H, W, C, G = 2, 3, 4, 12, 3
    x = torch.randn(B, H, W, C)
    weight = torch.randn(2, C // G)
    dt_bias = torch.randn(G)
    A_log = torch.rand(G)
    la, lb = R.path_log_decays_ref(x, weight, dt_bias, A_log, G)
    assert la.shape == lb.shape == (B, H, W, G)
    for g in range(G):
        xs = x[..., g * (C // G) : (g + 1) * (C // G)]
        ea = F.softplus(xs @ weight[0] + dt_bias[g]) * -torch.exp(A_log[g])
        eb = F.softplus(xs @ weight[1] + dt_bias[g]) * -torch.exp(A_log[g])
        torch.testing.assert_close(la[..., g], ea)
        torch.testing.assert_close(lb[..., g], eb)
    assert (la <= 0).all() and (lb <= 0).all()


def test_bad_inputs_raise_named_errors():
    q, k, v, la, lb = make_inputs(1, 2, 3, 2, 4)
    with pytest.raises(ValueError, match="q must be"):
        R.polyline_attention_ref(q[0], k, v, la, lb)
    with pytest.raises(ValueError, match="k must"):
        R.criss_cross_attention_ref(q, k[:, :1], v, la, lb)
    with pytest.raises(ValueError, match="log_beta"):
        R.polyline_attention_ref(q, k, v, la, lb[..., :1])
    with pytest.raises(ValueError, match="x must be"):
        R.polyline_scan_ref(v[0], la, lb)
