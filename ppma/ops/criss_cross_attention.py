"""``ppma.ops.criss_cross_attention``: the official "chunk" mode (spec §3.3, design §2)."""

from __future__ import annotations

import torch

from ppma.ops.reference import criss_cross_attention_ref


def criss_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``out = 0.5 B (A v) + 0.5 A (B v)`` with ``A`` the decay-masked row attention and ``B`` the column
    attention (spec §1.6). ``[B, H, W, heads, d]`` inputs -> ``[B, H, W, heads, dv]``.
    """
    return criss_cross_attention_ref(q, k, v, log_alpha, log_beta, scale)
