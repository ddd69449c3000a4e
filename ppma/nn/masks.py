"""The ablation masks of the PPMA paper (docs/model.md §7.4) as selectable masks of :class:`ppma.nn.PPMAAttention`.

Every mask is a pair of log-masks ``(M_a, M_b)`` over the ``N = H W`` tokens (row-major flat index) and two
direction weights ``(w_a, w_b)``, used the same way by both attention modes (docs/ops.md, "Masks"):

* full (official "whole"): ``out = w_a softmax(S + M_a) v + w_b softmax(S + M_b) v``;
* criss-cross (official "chunk"): ``A`` is the row attention with ``M_a`` restricted to the pairs inside each
  row, ``B`` the column attention with ``M_b`` restricted to the pairs inside each column, and
  ``out = w_a B (A v) + w_b A (B v)`` (rows first: the H2V order; columns first: the V2H order).

=============  ==============================  ==========================  =============================
mask           ``M_a`` / ``M_b``               decays                      path
=============  ==============================  ==========================  =============================
polyline       V2H / H2V = V2H^T               alpha, beta per token       fused (today's ops)
none           0 / 0                           none                        fused, zero log-decays
manhattan      log g_h (|di| + |dj|) twice     RMT's fixed g_h per head    fused, constant log-decays
v2h            V2H / V2H, weights (0, 1) cc    alpha, beta per token       reference composition
shared         V2H / H2V with alpha = beta     one decay per token         fused (today's ops)
cross_scan     1-D along row-major / column-   alpha / beta                fused on 1 x N maps (full);
               major order, bidirectional                                  = polyline (criss-cross)
hilbert        1-D along a Hilbert curve /     alpha / beta                fused on 1 x N maps (full);
               the transposed map's curve                                  reference (criss-cross)
=============  ==============================  ==========================  =============================

``v2h`` keeps only the V2H direction: ``softmax(S + V2H) v`` in full stages (``M_a = M_b``), ``A (B v)`` in
criss-cross stages (weights ``(0, 1)``: restricting V2H to rows and columns gives polyline's own row and column
masks, so only the order can tell V2H from H2V there).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import ppma.ops as ops
from ppma.nn.decay import PathDecay
from ppma.ops.reference import col_log_mask, polyline_log_mask, prefix_sum_excl_first, row_log_mask

__all__ = [
    "MASKS",
    "RMT_GAMMA",
    "ConstantDecay",
    "SharedDecay",
    "build_decay",
    "masked_attention",
    "rmt_log_gammas",
    "hilbert_order",
    "order_log_mask",
    "scan_orders",
]

MASKS = ("polyline", "none", "manhattan", "v2h", "shared", "cross_scan", "hilbert")
# RMT's decay schedule (initial_value, heads_range) of the PPMA-T/S stages (docs/model.md §4.1); PPMA-B: ranges 5, 5, 6, 6.
RMT_GAMMA = (2.0, 4.0)


# ----------------------------------------------------------------------------------------------
# Decay modules
# ----------------------------------------------------------------------------------------------


def rmt_log_gammas(num_heads: int, initial_value: float, heads_range: float) -> torch.Tensor:
    """RMT's fixed per-head log-decays ``log g_h = log(1 - 2^(-initial_value - heads_range * h / num_heads))``,
    ``h = 0 .. num_heads - 1`` (RMT's ``RetNetRelPos2d``), ``[num_heads]`` float64."""
    h = torch.arange(num_heads, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -initial_value - heads_range * h / num_heads))


class ConstantDecay(nn.Module):
    """Log-decays that do not depend on the input: ``log_gamma[h]`` for every token of head ``h``.

    ``mask="none"`` uses zeros, ``mask="manhattan"`` RMT's ``log g_h`` (:func:`rmt_log_gammas`). The values are
    kept as Python floats, not as a parameter or buffer: no state-dict entries, and ``model.half()`` cannot round
    them. ``forward(x: [B, H, W, C])`` returns ``(log_gamma, log_gamma)``, each ``[B, H, W, heads]`` in fp32 (fp64
    for fp64 ``x``), like :class:`PathDecay`.
    """

    def __init__(self, log_gamma: torch.Tensor) -> None:
        super().__init__()
        self.values = tuple(float(g) for g in log_gamma)

    @property
    def log_gamma(self) -> torch.Tensor:
        """``[heads]`` float64."""
        return torch.tensor(self.values, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        d = torch.tensor(self.values, dtype=ct, device=x.device).expand(*x.shape[:3], -1).contiguous()
        return d, d

    def extra_repr(self) -> str:
        return f"num_heads={len(self.values)}"


class SharedDecay(PathDecay):
    """One log-decay per token and head, used as both ``log_alpha`` and ``log_beta`` (``mask="shared"``, the
    paper's "shared decays (alpha = beta)"). Parametrised like :class:`PathDecay` with a bias-free
    ``Linear(head_dim, 1)``: ``head_dim`` fewer parameters per attention. ``forward`` returns the one
    log-decay twice."""

    directions = 1


def build_decay(mask: str, dim: int, num_heads: int, gamma: tuple[float, float] = RMT_GAMMA) -> nn.Module:
    """The decay module of a mask: :class:`PathDecay` (polyline, v2h, cross_scan, hilbert), :class:`SharedDecay`
    (shared) or a :class:`ConstantDecay` (none: zeros; manhattan: RMT's ``log g_h`` with ``gamma =
    (initial_value, heads_range)``)."""
    if mask == "none":
        return ConstantDecay(torch.zeros(num_heads, dtype=torch.float64))
    if mask == "manhattan":
        return ConstantDecay(rmt_log_gammas(num_heads, *gamma))
    if mask == "shared":
        return SharedDecay(dim, num_heads)
    if mask in MASKS:
        return PathDecay(dim, num_heads)
    raise ValueError(f"build_decay: mask must be one of {MASKS}, got {mask!r}")


# ----------------------------------------------------------------------------------------------
# Token orders and 1-D masks along them
# ----------------------------------------------------------------------------------------------


def _gilbert(x: int, y: int, ax: int, ay: int, bx: int, by: int, out: list) -> None:
    """Append the cells of the generalised Hilbert curve ("gilbert") of the rectangle spanned from ``(x, y)`` by
    the major axis ``(ax, ay)`` and the minor axis ``(bx, by)``; ``x`` is the column, ``y`` the row."""
    w, h = abs(ax + ay), abs(bx + by)
    dax, day = (ax > 0) - (ax < 0), (ay > 0) - (ay < 0)  # unit steps along the major / minor axis
    dbx, dby = (bx > 0) - (bx < 0), (by > 0) - (by < 0)
    if h == 1 or w == 1:  # a single line: walk it
        sx, sy, n = (dax, day, w) if h == 1 else (dbx, dby, h)
        out.extend((x + t * sx, y + t * sy) for t in range(n))
        return
    ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
    w2, h2 = abs(ax2 + ay2), abs(bx2 + by2)
    if 2 * w > 3 * h:  # long rectangle: split along the major axis only
        if w2 % 2 and w > 2:  # keep both halves even so the curve ends where the next half starts
            ax2, ay2 = ax2 + dax, ay2 + day
        _gilbert(x, y, ax2, ay2, bx, by, out)
        _gilbert(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by, out)
        return
    if h2 % 2 and h > 2:
        bx2, by2 = bx2 + dbx, by2 + dby
    _gilbert(x, y, bx2, by2, ax2, ay2, out)  # the three-part Hilbert step: up, across, back down
    _gilbert(x + bx2, y + by2, ax, ay, bx - bx2, by - by2, out)
    _gilbert(x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby), -bx2, -by2, -(ax - ax2), -(ay - ay2), out)


@functools.lru_cache(maxsize=64)
def _hilbert_order_cached(H: int, W: int) -> tuple[int, ...]:
    cells: list[tuple[int, int]] = []
    if W >= H:
        _gilbert(0, 0, W, 0, 0, H, cells)
    else:
        _gilbert(0, 0, 0, H, W, 0, cells)
    return tuple(y * W + x for x, y in cells)


def hilbert_order(H: int, W: int) -> torch.Tensor:
    """The row-major indices of the ``H x W`` tokens in the order of a generalised Hilbert curve ("gilbert",
    any ``H, W``), ``[H W]`` int64: ``order[t]`` is the token at curve position ``t``. Starts at ``(0, 0)``;
    consecutive tokens are 4-neighbours, except for one diagonal step when the shorter side is even and the
    longer odd."""
    if H < 1 or W < 1:
        raise ValueError(f"hilbert_order: H and W must be positive, got H={H}, W={W}")
    return torch.tensor(_hilbert_order_cached(H, W), dtype=torch.int64)


def transposed_order(order_t: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """A token order of the transposed ``W x H`` map (indices ``j * H + i``) as row-major indices ``i * W + j`` of
    the ``H x W`` map: the column-major order is ``transposed_order(arange(H W), H, W)``."""
    return (order_t % H) * W + order_t // H


def scan_orders(mask: str, H: int, W: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two token orders of a 1-D scan mask: ``M_a`` along the first (with alpha), ``M_b`` the second (beta)."""
    if mask == "cross_scan":
        a = torch.arange(H * W)
    else:
        a = hilbert_order(H, W)
    b = transposed_order(torch.arange(H * W) if mask == "cross_scan" else hilbert_order(W, H), H, W)
    return a.to(device), b.to(device)


def _order_prefix(log_decay: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix sums of ``log_decay: [B, H, W, heads]`` along ``order`` and every token's position in it, both
    back in row-major layout: ``([B, heads, N], [N])``."""
    B, H, W, G = log_decay.shape
    d = log_decay.reshape(B, H * W, G).permute(0, 2, 1)[..., order]  # [B, G, N] in scan order
    c = prefix_sum_excl_first(d)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return c[..., pos], pos


def _segment(c_u: torch.Tensor, c_v: torch.Tensor, p_u: torch.Tensor, p_v: torch.Tensor) -> torch.Tensor:
    # sum of the log-decays strictly after the earlier and up to the later position (segsum_1d's convention)
    return torch.where(p_u >= p_v, c_u - c_v, c_v - c_u)


def order_log_mask(log_decay: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Dense bidirectional 1-D log-mask along a token order: ``[B, H, W, heads] -> [B, heads, N, N]``,
    ``M[u, v] = sum of log_decay over the tokens at curve positions min(p_u, p_v) + 1 .. max(p_u, p_v)``."""
    c, pos = _order_prefix(log_decay, order)
    return _segment(c[..., :, None], c[..., None, :], pos[:, None], pos[None, :])


def _restricted_masks(log_alpha, log_beta, order_a, order_b):
    """``M_a`` restricted to the pairs of each row, ``[B, heads, H, W, W]``, and ``M_b`` to the pairs of each
    column, ``[B, heads, W, H, H]``, of two 1-D order masks (without building the ``N x N`` masks)."""
    B, H, W, G = log_alpha.shape
    ca, pa = _order_prefix(log_alpha, order_a)
    cb, pb = _order_prefix(log_beta, order_b)
    ca, pa = ca.reshape(B, G, H, W), pa.reshape(H, W)
    cb, pb = cb.reshape(B, G, H, W).transpose(-1, -2), pb.reshape(H, W).T  # [B, G, W, H], [W, H]
    rows = _segment(ca[..., :, None], ca[..., None, :], pa[:, :, None], pa[:, None, :])
    cols = _segment(cb[..., :, None], cb[..., None, :], pb[:, :, None], pb[:, None, :])
    return rows, cols


# ----------------------------------------------------------------------------------------------
# The attention of each mask
# ----------------------------------------------------------------------------------------------


def _criss_cross_masked(q, k, v, row_mask, col_mask, scale, weights=(0.5, 0.5)):
    """``w_a B (A v) + w_b A (B v)`` with row attention ``A = softmax(S_row + row_mask)`` and column attention
    ``B = softmax(S_col + col_mask)`` (masks ``[B, heads, H, W, W]`` / ``[B, heads, W, H, H]``); reference
    (PyTorch autograd), in fp32 (fp64 for fp64)."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(ct), k.to(ct), v.to(ct)
    q_r, k_r, v_r = (t.permute(0, 3, 1, 2, 4) for t in (qf, kf, vf))  # [B, G, H, W, d]
    q_c, k_c, v_c = (t.permute(0, 3, 2, 1, 4) for t in (qf, kf, vf))  # [B, G, W, H, d]
    A = torch.softmax(scale * (q_r @ k_r.transpose(-1, -2)) + row_mask.to(ct), dim=-1)
    Bm = torch.softmax(scale * (q_c @ k_c.transpose(-1, -2)) + col_mask.to(ct), dim=-1)
    out = 0
    if weights[0]:  # rows first, then columns (H2V)
        out = out + weights[0] * (Bm @ (A @ v_r).transpose(2, 3)).transpose(2, 3)
    if weights[1]:  # columns first, then rows (V2H)
        out = out + weights[1] * (A @ (Bm @ v_c).transpose(2, 3))
    return out.permute(0, 2, 3, 1, 4).to(v.dtype)


def _full_masked(q, k, v, log_mask, scale):
    """``softmax(S + log_mask) v`` over all tokens (``log_mask: [B, heads, N, N]``); reference."""
    B, H, W, G, D = q.shape
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(ct).reshape(B, H * W, G, -1).transpose(1, 2) for t in (q, k, v))
    P = torch.softmax(scale * (qf @ kf.transpose(-1, -2)) + log_mask.to(ct), dim=-1)
    return (P @ vf).transpose(1, 2).reshape(B, H, W, G, -1).to(v.dtype)


def _along_order(q, k, v, log_decay, order, scale):
    """``softmax(S + M) v`` with ``M`` the 1-D mask of ``log_decay`` along ``order``: the fused op on the
    ``1 x N`` map of the tokens in that order (its V2H mask there is the 1-D mask; the column decays never
    enter a one-row map, and the mask is symmetric, so both of its terms are this one)."""
    B, H, W, G, _ = q.shape
    line = [t.reshape(B, 1, H * W, *t.shape[3:])[:, :, order] for t in (q, k, v, log_decay)]
    out = ops.polyline_attention(*line[:3], line[3], torch.zeros_like(line[3]), scale)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return out[:, :, inv].reshape(v.shape)


def masked_attention(mask: str, mode: str, q, k, v, log_alpha, log_beta, scale: float) -> torch.Tensor:
    """The attention of ``mask`` in ``mode`` (``"full"`` / ``"criss_cross"``), see the module docstring.

    ``q, k: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``, ``log_alpha, log_beta: [B, H, W, heads]`` (the
    decay module's output) -> ``[B, H, W, heads, dv]``. ``polyline``, ``none``, ``manhattan``, ``shared`` and
    ``cross_scan`` in criss-cross stages are exactly ``ppma.ops.polyline_attention`` /
    ``criss_cross_attention``; ``cross_scan`` / ``hilbert`` in full stages run the fused op on ``1 x N`` maps;
    ``v2h`` and ``hilbert`` in criss-cross stages run the reference composition (PyTorch autograd).
    """
    full = mode == "full"
    if mask in ("polyline", "none", "manhattan", "shared") or (mask == "cross_scan" and not full):
        op = ops.polyline_attention if full else ops.criss_cross_attention
        return op(q, k, v, log_alpha, log_beta, scale)
    if mask == "v2h":
        if full:
            return _full_masked(q, k, v, polyline_log_mask(log_alpha, log_beta), scale)
        return _criss_cross_masked(q, k, v, row_log_mask(log_alpha), col_log_mask(log_beta), scale, (0.0, 1.0))
    if mask in ("cross_scan", "hilbert"):
        H, W = q.shape[1:3]
        order_a, order_b = scan_orders(mask, H, W, q.device)
        if full:
            return 0.5 * _along_order(q, k, v, log_alpha, order_a, scale) + 0.5 * _along_order(
                q, k, v, log_beta, order_b, scale
            )
        rows, cols = _restricted_masks(log_alpha, log_beta, order_a, order_b)
        return _criss_cross_masked(q, k, v, rows, cols, scale)
    raise ValueError(f"masked_attention: mask must be one of {MASKS}, got {mask!r}")

