"""Pure-PyTorch reference of every ppma operator: the test oracle, the documentation and the fallback.

Everything here follows the official PPMA code (docs/model.md §1.4-§1.6, §3.3, §3.4), not the paper's equations
where they differ (docs/model.md §9). It is written for clarity and builds the masks explicitly, as the official
code does; the fused kernels in ``csrc/`` compute the same numbers without them.

Conventions (docs/design.md §2):

* Feature maps are channels-last with heads last: ``q, k: [B, H, W, heads, d]``,
  ``v: [B, H, W, heads, dv]``, ``log_alpha, log_beta: [B, H, W, heads]``.
* Tokens are flattened row-major: token ``(i, j)`` has index ``i * W + j``.
* ``log_alpha`` is the horizontal log-decay, used along rows; ``log_beta`` the vertical one, used along
  columns. The decay of token ``n`` sits on the edge between ``n - 1`` and ``n`` (docs/model.md §1.2), so
  ``log_alpha[:, :, 0]`` and ``log_beta[:, 0]`` never enter any mask and receive exactly zero gradient.
* Log-decays below ``LOG_DECAY_FLOOR = -1e4`` (down to ``-inf``, a decay of exactly 0) count as the floor,
  as in the kernels: ``exp(-1e4)`` is 0 in every dtype, so a path through such an edge has weight 0, and
  the prefix sums stay finite (docs/ops.md, "Edges").
* Dense masks are returned per head as ``[B, heads, N, N]``; row masks as ``[B, heads, H, W, W]``
  (``[b, g, i, j, l] = log alpha_{i, j:l}``), column masks as ``[B, heads, W, H, H]``
  (``[b, g, l, i, k] = log beta_{i:k, l}``).

Low-precision inputs (fp16, bf16) are computed in fp32 and cast back, like the official code under
autocast (docs/model.md §3.5); fp64 stays fp64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ppma.ops._validate import (
    LOG_DECAY_FLOOR,
    check_attention_shapes,
    check_decay_values,
    check_linear_options,
    check_scan_shapes,
    check_transpose,
    resolve_scale,
)

__all__ = [
    "path_decay_ref",
    "path_log_decays_ref",
    "prefix_sum_excl_first",
    "segsum_1d",
    "row_log_mask",
    "col_log_mask",
    "polyline_log_mask",
    "polyline_mask",
    "polyline_attention_ref",
    "criss_cross_attention_ref",
    "polyline_linear_attention_ref",
    "polyline_scan_ref",
    "scan_1d_ref",
    "rope_ref",
]


# ----------------------------------------------------------------------------------------------
# Decays (docs/model.md §1.4)
# ----------------------------------------------------------------------------------------------


def path_decay_ref(x: torch.Tensor, weight: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
    """The log-decays of every direction (``ppma.ops.cpu.path_decay``; docs/ops.md "path_decay"):
    ``d[..., g, c] = softplus(x_g . weight[c] + dt_bias[g]) * -exp(A_log[g])`` for ``x: [..., heads * head_dim]``,
    ``weight: [D, head_dim]``, ``dt_bias, A_log: [heads]``; ``[..., heads, D]`` in fp32 (fp64 for fp64 ``x``)."""
    G, hd = dt_bias.shape[0], weight.shape[1]
    u = F.linear(x.reshape(*x.shape[:-1], G, hd), weight)  # [..., heads, D]
    ct = _compute_dtype(x)  # fp32 for fp32/fp16/bf16 (as under the official autocast), fp64 for fp64
    A = -torch.exp(A_log.to(ct))
    return F.softplus(u.to(ct) + dt_bias.to(ct)[:, None]) * A[:, None]


def path_log_decays_ref(
    x: torch.Tensor, weight: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decays of the official decay module (``PathEmbeding2D``, docs/model.md §1.4).

    Args:
        x: the attention block's normalised input, ``[B, H, W, C]``; head ``g`` reads channels
            ``[g * C/heads, (g + 1) * C/heads)``.
        weight: ``dt_linear.weight``, ``[2, C/heads]``, shared by all heads (row 0 -> alpha, row 1 -> beta).
        dt_bias: ``[heads]``, shared by alpha and beta.
        A_log: ``[heads]``; ``A = -exp(A_log)``.
        num_heads: number of heads.

    Returns:
        ``(log_alpha, log_beta)``, each ``[B, H, W, heads]`` and ``<= 0``:
        ``log_alpha = softplus(x_g . w_alpha + dt_bias[g]) * A[g]``, and the same for beta with ``w_beta``
        (:func:`path_decay_ref`'s two directions).
    """
    C = x.shape[-1]
    if C % num_heads:
        raise ValueError(f"channels ({C}) must be divisible by num_heads ({num_heads})")
    d = path_decay_ref(x, weight, dt_bias, A_log)
    return d[..., 0], d[..., 1]


# ----------------------------------------------------------------------------------------------
# 1-D segment sums and masks (docs/model.md §1.5)
# ----------------------------------------------------------------------------------------------


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def prefix_sum_excl_first(d: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Prefix sums ``c_t = sum_{1 <= n <= t} d_n`` along ``dim`` (``c_0 = 0``; ``d_0`` is never used).

    The official code includes ``d_0`` in the cumulative sum; every mask entry is a difference
    ``c_max - c_min`` in which ``d_0`` cancels, so leaving it out gives the same masks (up to rounding,
    more precisely) and makes the gradient of ``d_0`` exactly zero (docs/model.md §1.2). Values below
    ``LOG_DECAY_FLOOR`` count as the floor (NaN stays NaN).
    """
    d = d.movedim(dim, -1).clamp_min(LOG_DECAY_FLOOR)
    c = torch.cat([torch.zeros_like(d[..., :1]), torch.cumsum(d[..., 1:], dim=-1)], dim=-1)
    return c.movedim(-1, dim)


def segsum_1d(d: torch.Tensor) -> torch.Tensor:
    """Symmetric 1-D log-mask of a sequence of log-decays along the last axis (docs/model.md §1.5).

    ``S[..., t, s] = sum_{min(t,s) < n <= max(t,s)} d_n = log prod a_n`` (0 on the diagonal), built as
    ``c_max - c_min`` from the prefix sums, written in position order so that the gradient is defined
    even where a decay is exactly 1. Shape ``[..., n] -> [..., n, n]``.
    """
    c = prefix_sum_excl_first(d.to(_compute_dtype(d)))
    diff = c[..., :, None] - c[..., None, :]  # c_t - c_s
    n = d.shape[-1]
    idx = torch.arange(n, device=d.device)
    # For t >= s the segment is (s, t], i.e. c_t - c_s; for t < s it is (t, s], i.e. c_s - c_t.
    return torch.where(idx[:, None] >= idx[None, :], diff, -diff)


def row_log_mask(log_alpha: torch.Tensor) -> torch.Tensor:
    """Horizontal log-masks of every row: ``[B, H, W, heads] -> [B, heads, H, W, W]``,
    entry ``[b, g, i, j, l] = log alpha_{i, j:l}`` (code: ``structed_mask_w``)."""
    return segsum_1d(log_alpha.permute(0, 3, 1, 2))


def col_log_mask(log_beta: torch.Tensor) -> torch.Tensor:
    """Vertical log-masks of every column: ``[B, H, W, heads] -> [B, heads, W, H, H]``,
    entry ``[b, g, l, i, k] = log beta_{i:k, l}`` (code: ``structed_mask_h``)."""
    return segsum_1d(log_beta.permute(0, 3, 2, 1))


def polyline_log_mask(log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    """Dense V2H polyline log-mask ``M = log L`` (docs/model.md §1.3, Eq. 3), ``[B, heads, N, N]``.

    ``M[b, g, (i,j), (k,l)] = log alpha_{i, j:l} + log beta_{i:k, l}``: from key ``(k,l)`` go along column
    ``l`` to row ``i``, then along row ``i`` to column ``j``. Its transpose ``M^T`` is the H2V mask.
    """
    B, H, W, G = log_alpha.shape
    R = row_log_mask(log_alpha)  # [B, G, H(i), W(j), W(l)]
    C = col_log_mask(log_beta)  # [B, G, W(l), H(i), H(k)]
    # M[b, g, i, j, k, l] = R[b, g, i, j, l] + C[b, g, l, i, k]
    M = R[:, :, :, :, None, :] + C.permute(0, 1, 3, 4, 2)[:, :, :, None, :, :]
    return M.reshape(B, G, H * W, H * W)


def polyline_mask(log_alpha: torch.Tensor, log_beta: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """Dense polyline mask ``L = exp(M)`` (``transpose=True`` gives ``L^T``, the H2V mask), ``[B, heads, N, N]``."""
    M = polyline_log_mask(log_alpha, log_beta).exp()
    return M.transpose(-1, -2) if transpose else M


# ----------------------------------------------------------------------------------------------
# Attention (docs/model.md §3.3, §3.4)
# ----------------------------------------------------------------------------------------------


def polyline_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Polyline path masked attention, the official "whole" mode (docs/model.md §1.6, §3.4).

    ``S = scale * q k^T`` over all ``N = H W`` tokens of each head, ``M`` the V2H log-mask,
    ``out = (0.5 softmax(S + M) + 0.5 softmax(S + M^T)) v``. Shapes: ``q, k [B, H, W, heads, d]``,
    ``v [B, H, W, heads, dv]``, ``log_alpha, log_beta [B, H, W, heads]`` -> ``[B, H, W, heads, dv]``.
    """
    op = "polyline_attention_ref"
    check_attention_shapes(op, q, k, v, log_alpha, log_beta)
    check_decay_values(op, log_alpha, log_beta)
    B, H, W, G, D = q.shape
    scale = resolve_scale(op, scale, D)
    ct, dv = _compute_dtype(q), v.shape[-1]  # explicit sizes: a -1 cannot be inferred for empty tensors
    qf = q.to(ct).reshape(B, H * W, G, D).transpose(1, 2)  # [B, G, N, d]
    kf = k.to(ct).reshape(B, H * W, G, D).transpose(1, 2)
    vf = v.to(ct).reshape(B, H * W, G, dv).transpose(1, 2)
    M = polyline_log_mask(log_alpha.to(ct), log_beta.to(ct))
    S = scale * (qf @ kf.transpose(-1, -2))
    P = 0.5 * torch.softmax(S + M, dim=-1) + 0.5 * torch.softmax(S + M.transpose(-1, -2), dim=-1)
    out = (P @ vf).transpose(1, 2).reshape(B, H, W, G, dv)
    return out.to(v.dtype)


def criss_cross_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Criss-cross polyline attention, the official "chunk" mode (docs/model.md §1.6, §3.3).

    Row attention ``A_i = softmax(scale q_i k_i^T + log alpha-mask of row i)`` (W x W) and column attention
    ``B_l = softmax(scale q_l k_l^T + log beta-mask of column l)`` (H x H);
    ``out = 0.5 B (A v) + 0.5 A (B v)`` (the H2V and V2H orders). Shapes as in ``polyline_attention_ref``.
    """
    op = "criss_cross_attention_ref"
    check_attention_shapes(op, q, k, v, log_alpha, log_beta)
    check_decay_values(op, log_alpha, log_beta)
    B, H, W, G, D = q.shape
    scale = resolve_scale(op, scale, D)
    ct, out_dtype = _compute_dtype(q), v.dtype
    q, k, v = q.to(ct), k.to(ct), v.to(ct)
    # Rows: [B, G, H, W, d]; columns: [B, G, W, H, d].
    q_r, k_r, v_r = (t.permute(0, 3, 1, 2, 4) for t in (q, k, v))
    q_c, k_c, v_c = (t.permute(0, 3, 2, 1, 4) for t in (q, k, v))
    A = torch.softmax(scale * (q_r @ k_r.transpose(-1, -2)) + row_log_mask(log_alpha.to(ct)), dim=-1)
    Bm = torch.softmax(scale * (q_c @ k_c.transpose(-1, -2)) + col_log_mask(log_beta.to(ct)), dim=-1)
    z1 = A @ v_r  # rows first ...
    out1 = Bm @ z1.transpose(2, 3)  # ... then columns: H2V, [B, G, W, H, dv]
    z2 = Bm @ v_c  # columns first ...
    out2 = A @ z2.transpose(2, 3)  # ... then rows: V2H, [B, G, H, W, dv]
    out = 0.5 * out1.transpose(2, 3) + 0.5 * out2
    return out.permute(0, 2, 3, 1, 4).to(out_dtype)


def polyline_linear_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Polyline path masked linear attention, PPMLA (docs/model.md §2, Theorem 3 and A.7; docs/ops.md), dense.

    Per batch and head, with ``q, k`` already non-negative features (the caller maps them), ``A = q k^T``
    (no scale) and ``L = exp(M)`` the V2H polyline mask (``L^T`` the H2V mask)::

        normalize=True:  out = 0.5 (A*L) v / ((A*L) 1 + eps) + 0.5 (A*L^T) v / ((A*L^T) 1 + eps)
        normalize=False: out = 0.5 (A*L) v + 0.5 (A*L^T) v

    (``*`` elementwise, the division per query row). Shapes: ``q, k [B, H, W, heads, d]``,
    ``v [B, H, W, heads, dv]``, ``log_alpha, log_beta [B, H, W, heads]`` -> ``[B, H, W, heads, dv]``.
    Builds the ``N x N`` matrices: the oracle of the linear-time kernels.
    """
    op = "polyline_linear_attention_ref"
    check_attention_shapes(op, q, k, v, log_alpha, log_beta)
    check_linear_options(op, normalize, eps)
    check_decay_values(op, log_alpha, log_beta)
    B, H, W, G, D = q.shape
    ct, dv = _compute_dtype(q), v.shape[-1]
    qf = q.to(ct).reshape(B, H * W, G, D).transpose(1, 2)  # [B, G, N, d]
    kf = k.to(ct).reshape(B, H * W, G, D).transpose(1, 2)
    vf = v.to(ct).reshape(B, H * W, G, dv).transpose(1, 2)
    A = qf @ kf.transpose(-1, -2)
    L = polyline_mask(log_alpha.to(ct), log_beta.to(ct))
    out = 0
    for P in (A * L, A * L.transpose(-1, -2)):  # V2H, then H2V
        term = P @ vf
        if normalize:
            term = term / (P.sum(-1, keepdim=True) + eps)
        out = out + 0.5 * term
    return out.transpose(1, 2).reshape(B, H, W, G, dv).to(v.dtype)


# ----------------------------------------------------------------------------------------------
# Polyline scans (docs/model.md §2, Algorithm 1)
# ----------------------------------------------------------------------------------------------


def scan_1d_ref(x: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """Symmetric 1-semiseparable product along axis -2: ``y_t = sum_s exp(S[t, s]) x_s``.

    ``x: [..., n, c]``, ``log_decay: [..., n]`` (``S = segsum_1d(log_decay)``). Dense, O(n^2): the oracle
    for the linear-time recurrences ``f_t = a_t f_{t-1} + x_t``, ``g_t = a_{t+1}(g_{t+1} + x_{t+1})``.
    """
    return torch.exp(segsum_1d(log_decay)) @ x.to(_compute_dtype(x))


def polyline_scan_ref(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, transpose: bool = False
) -> torch.Tensor:
    """Polyline product ``y = L x`` by Algorithm 1 (docs/model.md §2): without materialising ``L``.

    ``transpose=False``: scan every column with ``log_beta`` (``Z_{:,l} = B^l X_{:,l}``), then every row
    with ``log_alpha`` (``Y_{i,:} = A^i Z_{i,:}``): ``y = L x`` with ``L`` the V2H mask.
    ``transpose=True``: rows first, then columns: ``y = L^T x`` (the H2V mask).
    ``x: [B, H, W, heads, c]``, ``log_alpha, log_beta: [B, H, W, heads]`` -> ``[B, H, W, heads, c]``.
    """
    op = "polyline_scan_ref"
    check_scan_shapes(op, x, log_alpha, log_beta)
    check_transpose(op, transpose)
    check_decay_values(op, log_alpha, log_beta)
    ct = _compute_dtype(x)
    la, lb = log_alpha.to(ct), log_beta.to(ct)

    def cols(u):  # scan along H in every column: [B, H, W, G, c]
        y = scan_1d_ref(u.permute(0, 2, 3, 1, 4), lb.permute(0, 2, 3, 1))  # [B, W, G, H, c]
        return y.permute(0, 3, 1, 2, 4)

    def rows(u):  # scan along W in every row
        y = scan_1d_ref(u.permute(0, 1, 3, 2, 4), la.permute(0, 1, 3, 2))  # [B, H, G, W, c]
        return y.permute(0, 1, 3, 2, 4)

    y = cols(rows(x.to(ct))) if transpose else rows(cols(x.to(ct)))
    return y.to(x.dtype)


def default_scale(head_dim: int) -> float:
    """The attention scale the official models use, ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(head_dim)


def rope_ref(
    x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, scale: float = 1.0, transpose: bool = False
) -> torch.Tensor:
    """Rotary position embedding of queries or keys (paper §3; the official ``theta_shift``) after a scale.

    ``transpose=False``: ``y = xs * cos + rot(xs) * sin`` with ``xs = scale * x`` and ``rot`` mapping every
    channel pair ``(x_{2m}, x_{2m+1})`` to ``(-x_{2m+1}, x_{2m})``; ``transpose=True``: the adjoint map
    ``y = xs * cos + rot^T(xs * sin)`` (``rot^T`` maps the pair to ``(x_{2m+1}, -x_{2m})``), the backward of
    the other. ``x: [B, H, W, heads, d]`` (``d`` even), ``sin, cos: [H, W, d]`` (broadcast over batch and
    heads) -> ``[B, H, W, heads, d]`` in ``x``'s dtype, computed in fp32 (fp64 when ``x`` or the tables are).
    """
    ct = torch.promote_types(torch.promote_types(x.dtype, sin.dtype), torch.float32)
    xs = x.to(ct) * scale if scale != 1.0 else x.to(ct)
    s, c = sin.to(ct)[:, :, None, :], cos.to(ct)[:, :, None, :]
    x1, x2 = xs[..., 0::2], xs[..., 1::2]
    if transpose:
        xs_s = xs * s
        y = xs * c + torch.stack((xs_s[..., 1::2], -xs_s[..., 0::2]), dim=-1).flatten(-2)
    else:
        y = xs * c + torch.stack((-x2, x1), dim=-1).flatten(-2) * s
    return y.to(x.dtype)
