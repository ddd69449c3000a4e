"""``ppma.ops.polyline_scan``: the linear-time polyline product ``L x`` (spec §2, Algorithm 1)."""

from __future__ import annotations

import torch

from ppma.ops.reference import polyline_scan_ref


def polyline_scan(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, transpose: bool = False
) -> torch.Tensor:
    """``y = L x`` (``transpose=True``: ``L^T x``) with ``L`` the V2H polyline mask, computed by 1-D scans
    along columns then rows. ``x: [B, H, W, heads, c]`` -> ``[B, H, W, heads, c]``.
    """
    return polyline_scan_ref(x, log_alpha, log_beta, transpose)
