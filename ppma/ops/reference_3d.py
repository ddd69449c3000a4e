"""Pure-PyTorch reference of the 3-D polyline ops (paper appendix C.2, Eq. 40; docs/video.md):
the test oracle, the documentation and the fallback of ``ppma.ops.polyline_*_3d``.

Layout: ``q, k: [B, T, H, W, heads, d]``, ``v: [B, T, H, W, heads, dv]``, log-decays
``log_alpha`` (along W), ``log_beta`` (along H), ``log_gamma`` (along T): ``[B, T, H, W, heads]``, ``<= 0``.
Tokens are flattened ``(t, i, j) -> (t * H + i) * W + j``.

The 3-D V2H mask (the paper's ``L3D = LH x LV x LD`` read as a path): for a query ``p = (t, i, j)`` and a key
``s = (u, k, l)`` the path leaves the key along T (on the key's line ``(k, l)``), then runs along H (at the query's
frame ``t`` and the key's column ``l``), then along W (in the query's row ``(t, i)``)::

    M[p, s] = Gamma_(k,l)[t..u] + Beta_(t,l)[i..k] + Alpha_(t,i)[j..l]

where ``X[a..b]`` sums that line's log-decays at indices ``min(a,b)+1 .. max(a,b)`` (the decay of a token sits on
the edge from the previous token, as in 2-D). With ``T = 1`` it is the 2-D V2H mask of ``ppma.ops.reference``.
Log-decays below ``-1e4`` count as ``-1e4`` (docs/ops.md "Edges"). fp16/bf16 compute in fp32, fp64 in fp64.
"""

from __future__ import annotations

import torch

from ppma.ops._validate import check_linear_options, check_transpose, resolve_scale
from ppma.ops._validate_3d import (
    check_attention_shapes_3d,
    check_decay_values_3d,
    check_scan_shapes_3d,
)
from ppma.ops.reference import _compute_dtype, segsum_1d

__all__ = [
    "polyline_log_mask_3d",
    "polyline_mask_3d",
    "polyline_attention_3d_ref",
    "polyline_scan_3d_ref",
    "polyline_linear_attention_3d_ref",
]


def polyline_log_mask_3d(log_alpha: torch.Tensor, log_beta: torch.Tensor, log_gamma: torch.Tensor) -> torch.Tensor:
    """Dense 3-D V2H log-mask ``M`` (module docstring), ``[B, heads, N, N]`` with ``N = T H W``; ``M^T`` is the
    reverse (H2V) path. Built from 1-D segment sums (``segsum_1d``), one per line of each axis."""
    B, T, H, W, G = log_alpha.shape
    # Gamma[b, g, k, l, t, u]: along T on each (k, l) line.
    Gm = segsum_1d(log_gamma.permute(0, 4, 2, 3, 1))
    # Beta[b, g, t, l, i, k]: along H in frame t, column l.
    Bm = segsum_1d(log_beta.permute(0, 4, 1, 3, 2))
    # Alpha[b, g, t, i, j, l]: along W in frame t, row i.
    Am = segsum_1d(log_alpha.permute(0, 4, 1, 2, 3))
    # M[b, g, t, i, j, u, k, l]
    M = (
        Gm.permute(0, 1, 4, 5, 2, 3)[:, :, :, None, None, :, :, :]  # [B, G, t, 1, 1, u, k, l]
        + Bm.permute(0, 1, 2, 4, 5, 3)[:, :, :, :, None, None, :, :]  # [B, G, t, i, 1, 1, k, l]
        + Am[:, :, :, :, :, None, None, :]  # [B, G, t, i, j, 1, 1, l]
    )
    N = T * H * W
    return M.reshape(B, G, N, N)


def polyline_mask_3d(log_alpha, log_beta, log_gamma, transpose: bool = False) -> torch.Tensor:
    """Dense 3-D polyline mask ``L = exp(M)`` (``transpose=True``: ``L^T``), ``[B, heads, N, N]``."""
    L = polyline_log_mask_3d(log_alpha, log_beta, log_gamma).exp()
    return L.transpose(-1, -2) if transpose else L


def _flat(t: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """``[B, T, H, W, G, c] -> [B, G, N, c]`` in dtype ``ct``."""
    B, T, H, W, G, c = t.shape
    return t.to(ct).reshape(B, T * H * W, G, c).transpose(1, 2)


def _unflat(t: torch.Tensor, shape, dtype) -> torch.Tensor:
    B, T, H, W, G = shape[:5]
    return t.transpose(1, 2).reshape(B, T, H, W, G, t.shape[-1]).to(dtype)


def _masks(op, log_alpha, log_beta, log_gamma, ct):
    check_decay_values_3d(op, log_alpha, log_beta, log_gamma)
    return polyline_log_mask_3d(log_alpha.to(ct), log_beta.to(ct), log_gamma.to(ct))


def polyline_attention_3d_ref(q, k, v, log_alpha, log_beta, log_gamma, scale=None) -> torch.Tensor:
    """``out = 0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v``, ``S = scale q k^T`` over all ``N = T H W`` tokens
    of each head, ``M`` the 3-D V2H log-mask. ``[B, T, H, W, heads, d]`` -> ``[B, T, H, W, heads, dv]``."""
    op = "polyline_attention_3d_ref"
    check_attention_shapes_3d(op, q, k, v, log_alpha, log_beta, log_gamma)
    scale = resolve_scale(op, scale, q.shape[-1])
    ct = _compute_dtype(q)
    M = _masks(op, log_alpha, log_beta, log_gamma, ct)
    qf, kf, vf = _flat(q, ct), _flat(k, ct), _flat(v, ct)
    S = scale * (qf @ kf.transpose(-1, -2))
    P = 0.5 * torch.softmax(S + M, dim=-1) + 0.5 * torch.softmax(S + M.transpose(-1, -2), dim=-1)
    return _unflat(P @ vf, q.shape, v.dtype)


def polyline_scan_3d_ref(x, log_alpha, log_beta, log_gamma, transpose: bool = False) -> torch.Tensor:
    """``y = exp(M) x`` (``transpose=True``: ``exp(M)^T x``) with the dense 3-D mask.
    ``x: [B, T, H, W, heads, c]`` -> the same shape, in the dtype of ``x``."""
    op = "polyline_scan_3d_ref"
    check_scan_shapes_3d(op, x, log_alpha, log_beta, log_gamma)
    check_transpose(op, transpose)
    ct = _compute_dtype(x)
    L = _masks(op, log_alpha, log_beta, log_gamma, ct).exp()
    if transpose:
        L = L.transpose(-1, -2)
    return _unflat(L @ _flat(x, ct), x.shape, x.dtype)


def polyline_linear_attention_3d_ref(q, k, v, log_alpha, log_beta, log_gamma, normalize: bool = True,
                                     eps: float = 1e-6) -> torch.Tensor:
    """3-D PPMLA, dense: with ``A = q k^T`` (no scale) and ``L = exp(M)``,
    ``out = 0.5 (A*L) v / ((A*L) 1 + eps) + 0.5 (A*L^T) v / ((A*L^T) 1 + eps)`` (``normalize=False``: no division).
    ``q, k`` are non-negative features (the caller maps them)."""
    op = "polyline_linear_attention_3d_ref"
    check_attention_shapes_3d(op, q, k, v, log_alpha, log_beta, log_gamma)
    check_linear_options(op, normalize, eps)
    ct = _compute_dtype(q)
    L = _masks(op, log_alpha, log_beta, log_gamma, ct).exp()
    qf, kf, vf = _flat(q, ct), _flat(k, ct), _flat(v, ct)
    A = qf @ kf.transpose(-1, -2)
    out = 0
    for P in (A * L, A * L.transpose(-1, -2)):
        term = P @ vf
        if normalize:
            term = term / (P.sum(-1, keepdim=True) + eps)
        out = out + 0.5 * term
    return _unflat(out, q.shape, v.dtype)
