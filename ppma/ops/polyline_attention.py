"""``ppma.ops.polyline_attention``: the official "whole" mode (spec §3.4, design §2)."""

from __future__ import annotations

import torch

from ppma.ops.reference import polyline_attention_ref


def polyline_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``out = 0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v`` with ``S = scale q k^T`` and ``M`` the
    V2H polyline log-mask (spec §1.6). ``[B, H, W, heads, d]`` inputs -> ``[B, H, W, heads, dv]``.
    """
    return polyline_attention_ref(q, k, v, log_alpha, log_beta, scale)
