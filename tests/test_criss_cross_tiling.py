"""The padded-line tiling of the tensor-core criss_cross_attention kernels, prototyped in float64 PyTorch against the
reference (docs/design.md §4.3, "criss_cross_attention on tensor cores"; csrc/kernels/criss_cross_attention_tc.cuh).

The kernels pad every line of L tokens to Lp = L rounded up to 16 and compute each pass on the padded L x L maps:
padded keys (u >= L) are masked out of the softmax, padded query rows get zero probabilities (their prefix sums and
lse are 0, their features zero), and the prefix-sum gradient of token x, sum_y sgn(x - y) (dS[x, y] + dS[y, x]),
is split into the row part of x's own warp and the column parts of the line's 16-row warps, summed in warp order.
The backward's last row pass adds the column pass's gradient parts (the folded combine). This file runs exactly
that dataflow in float64 and checks the output and all five gradients against criss_cross_attention_ref, so the
math of the tiling is settled apart from the kernels' rounding (which the CUDA emulator tests check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ppma.ops import reference as ref

WARP_ROWS = 16


def _lines(x: torch.Tensor, rows: bool, Lp: int) -> torch.Tensor:
    """[B, H, W, G, D] (or [B, H, W, G]) -> padded lines [B, G, lines, Lp, D] of one direction."""
    squeeze = x.dim() == 4
    if squeeze:
        x = x[..., None]
    t = x.permute(0, 3, 1, 2, 4) if rows else x.permute(0, 3, 2, 1, 4)
    t = F.pad(t, (0, 0, 0, Lp - t.shape[3]))
    return t[..., 0] if squeeze else t


def _unlines(t: torch.Tensor, rows: bool, L: int) -> torch.Tensor:
    """Inverse of _lines: drops the padded slots."""
    t = t[:, :, :, :L]
    return t.permute(0, 2, 3, 1, 4) if rows else t.permute(0, 3, 2, 1, 4)


def _maps(q, k, c, scale, L, lse=None):
    """P of every padded line (and its lse): logits scale q.k + c[max] - c[min], padded keys masked, padded rows
    zero; with lse given, P = exp(logits - lse) (the saved statistics)."""
    Lp = q.shape[3]
    t = torch.arange(Lp)
    ct, cu = c[..., :, None], c[..., None, :]
    bias = torch.where(t[None, :] > t[:, None], -(ct - cu), ct - cu)
    s = scale * (q @ k.transpose(-1, -2)) + bias
    s = s.masked_fill(~(t < L)[None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1)
    P = torch.exp(s - lse[..., None]) * (t < L)[:, None].to(s.dtype)
    return P, lse


def _own(dS: torch.Tensor) -> torch.Tensor:
    """Prefix-sum gradient per slot: the row part plus the 16-row blocks' column parts, in block order."""
    Lp = dS.shape[-1]
    t = torch.arange(Lp)
    sgn = torch.sign(t[:, None] - t[None, :]).to(dS.dtype)  # sgn(t - u)
    own = (sgn * dS).sum(-1)
    for r0 in range(0, Lp, WARP_ROWS):  # column part of the warp holding rows r0 .. r0 + 15: sum_t sgn(u - t) dS
        own = own + (-sgn[r0:r0 + WARP_ROWS] * dS[..., r0:r0 + WARP_ROWS, :]).sum(-2)
    return own


def tiled_criss_cross(q, k, v, la, lb, go, scale):
    """Forward and backward through the padded-line passes; returns out, grad_q, grad_k, grad_v, grad_log_alpha,
    grad_log_beta."""
    B, H, W, G, d = q.shape
    cr = ref.prefix_sum_excl_first(la, dim=2)
    cc = ref.prefix_sum_excl_first(lb, dim=1)
    Pr, Pc = (W + 15) // 16 * 16, (H + 15) // 16 * 16
    R = {n: _lines(x, True, Pr) for n, x in dict(q=q, k=k, v=v, h=0.5 * go, c=cr).items()}
    C = {n: _lines(x, False, Pc) for n, x in dict(q=q, k=k, v=v, h=0.5 * go, c=cc).items()}
    to_c = lambda x: _lines(_unlines(x, True, W), False, Pc)  # noqa: E731  row layout -> column layout
    to_r = lambda x: _lines(_unlines(x, False, H), True, Pr)  # noqa: E731

    # forward: rows z1 = A v; columns z2 = B v, out1 = B z1; rows out = (out1 + A z2) / 2 from the saved lse
    A, lse_r = _maps(R["q"], R["k"], R["c"], scale, W)
    z1 = A @ R["v"]
    Bm, lse_c = _maps(C["q"], C["k"], C["c"], scale, H)
    z2, out1 = Bm @ C["v"], Bm @ to_c(z1)
    A2, _ = _maps(R["q"], R["k"], R["c"], scale, W, lse_r)
    out = 0.5 * (to_r(out1) + A2 @ to_r(z2))

    def bwd(P, T, Z, Gm):  # one FULL pass: gg = h Z^T + G v^T, dS = P (gg - rowsum(P gg))
        gg = T["h"] @ Z.transpose(-1, -2) + Gm @ T["v"].transpose(-1, -2)
        dS = P * (gg - (P * gg).sum(-1, keepdim=True))
        dT = dS.transpose(-1, -2)
        return P.transpose(-1, -2) @ Gm, scale * dS @ T["k"], scale * dT @ T["q"], _own(dS)

    # BR1: z1 = P v, gz2 = P^T h (rows)
    P1, _ = _maps(R["q"], R["k"], R["c"], scale, W, lse_r)
    z1b, gz2 = P1 @ R["v"], P1.transpose(-1, -2) @ R["h"]
    # BC: z2 = P v, gz1 = P^T h, gv_c, dq_c, dk_c, own_c (columns; Z = z1, G = gz2)
    Pc_, _ = _maps(C["q"], C["k"], C["c"], scale, H, lse_c)
    z2b, gz1 = Pc_ @ C["v"], Pc_.transpose(-1, -2) @ C["h"]
    gv_c, dq_c, dk_c, own_c = bwd(Pc_, C, to_c(z1b), to_c(gz2))
    # BR2 with the folded combine (rows; Z = z2, G = gz1)
    P2, _ = _maps(R["q"], R["k"], R["c"], scale, W, lse_r)
    gv_r, dq_r, dk_r, own_r = bwd(P2, R, to_r(z2b), to_r(gz1))
    dq = _unlines(to_r(dq_c) + dq_r, True, W)
    dk = _unlines(to_r(dk_c) + dk_r, True, W)
    dv = _unlines(to_r(gv_c) + gv_r, True, W)
    # decay gradients: reverse cumsums of the prefix-sum gradients (the first log-decay of a line never enters)
    g_cr = _unlines(own_r[..., None], True, W)[..., 0]
    g_cc = _unlines(own_c[..., None], False, H)[..., 0]
    gla = torch.flip(torch.cumsum(torch.flip(g_cr, [2]), 2), [2])
    glb = torch.flip(torch.cumsum(torch.flip(g_cc, [1]), 1), [1])
    gla[:, :, 0] = 0
    glb[:, 0] = 0
    return _unlines(out, True, W), dq, dk, dv, gla, glb


@pytest.mark.parametrize("shape", [(2, 7, 28, 2, 16, 16), (1, 33, 17, 1, 8, 12), (1, 5, 64, 1, 4, 4),
                                   (1, 1, 3, 1, 4, 4), (1, 56, 9, 2, 16, 16)])
def test_padded_line_tiling_matches_reference(shape):
    B, H, W, G, d, dv = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k = (torch.randn(B, H, W, G, d, generator=g, dtype=torch.float64) for _ in range(2))
    v, go = (torch.randn(B, H, W, G, dv, generator=g, dtype=torch.float64) for _ in range(2))
    la, lb = (-torch.rand(B, H, W, G, generator=g, dtype=torch.float64) for _ in range(2))
    scale = d ** -0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, la, lb)]
    want = ref.criss_cross_attention_ref(*leaves, scale)
    wgrads = torch.autograd.grad(want, leaves, go)
    got = tiled_criss_cross(q, k, v, la, lb, go, scale)
    for name, a, b in zip(("out", "q", "k", "v", "log_alpha", "log_beta"), got, (want,) + wgrads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), f"{name}: max error {(a - b).abs().max():.3e}"
