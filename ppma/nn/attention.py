"""PPMA attention module: projections, LePE, RoPE, path decays and the polyline attention ops (spec §3)."""

from __future__ import annotations

import torch
from torch import nn

import ppma.ops as ops
from ppma.ops import reference
from ppma.nn.decay import PathDecay
from ppma.nn.layers import DWConv2d
from ppma.nn.rope import apply_rotary, rotary_angle, rotary_sin_cos

__all__ = ["PPMAAttention", "ATTENTION_MODES", "IMPLS"]

ATTENTION_MODES = ("full", "criss_cross")
IMPLS = ("fused", "reference")


class PPMAAttention(nn.Module):
    """Polyline path masked attention (spec §3.2-§3.4).

    ``q, k, v = Linear(x)``; ``lepe = DWConv5x5(v)``; ``k = k * d**-0.5``; RoPE on ``q`` and the scaled
    ``k``; log-decays from ``x`` (``PathDecay``); then

    * ``mode="full"`` (official "whole"): ``0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v`` over all tokens;
    * ``mode="criss_cross"`` (official "chunk"): ``0.5 B(A v) + 0.5 A(B v)`` with masked row attention
      ``A`` and column attention ``B``;

    and ``out = proj(attn + lepe)``.

    Args:
        dim: channels ``C``.
        num_heads: heads; ``head_dim = C / num_heads``.
        mode: ``"full"`` or ``"criss_cross"``.
        impl: ``"fused"`` (``ppma.ops``, the compiled kernels when built) or ``"reference"``
            (``ppma.ops.reference``, pure PyTorch). Both compute the same numbers.
    """

    def __init__(self, dim: int, num_heads: int, mode: str = "full", impl: str = "fused") -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"PPMAAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
        if mode not in ATTENTION_MODES:
            raise ValueError(f"PPMAAttention: mode must be one of {ATTENTION_MODES}, got {mode!r}")
        self.dim, self.num_heads, self.head_dim, self.mode = dim, num_heads, dim // num_heads, mode
        self.scale = self.head_dim**-0.5
        self.impl = impl
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.lepe = DWConv2d(dim, 5)
        self.decay = PathDecay(dim, num_heads)
        self.proj = nn.Linear(dim, dim)

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in IMPLS:
            raise ValueError(f"PPMAAttention: impl must be one of {IMPLS}, got {value!r}")
        self._impl = value

    def _attention_fn(self):
        if self.mode == "full":
            return ops.polyline_attention if self._impl == "fused" else reference.polyline_attention_ref
        return ops.criss_cross_attention if self._impl == "fused" else reference.criss_cross_attention_ref

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x: [B, H, W, C]`` (already normalised) -> ``[B, H, W, C]``.

        ``rope``: optional precomputed ``(sin, cos)``, each ``[H, W, head_dim]``, for this ``H, W``
        (computed here when ``None``).
        """
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"PPMAAttention: x must be [B, H, W, {self.dim}], got shape {tuple(x.shape)}")
        B, H, W, C = x.shape
        if rope is None:
            angle = rotary_angle(self.head_dim, x.device).to(torch.promote_types(x.dtype, torch.float32))
            rope = rotary_sin_cos(angle, H, W)
        sin, cos = rope
        q, k, v = self.q(x), self.k(x), self.v(x)
        lepe = self.lepe(v)
        k = k * self.scale  # the official code scales k, not the logits
        shape = (B, H, W, self.num_heads, self.head_dim)
        q = apply_rotary(q.reshape(shape), sin, cos)
        k = apply_rotary(k.reshape(shape), sin, cos)
        # RoPE's fp32 tables promote low-precision q, k; return them to v's dtype, as autocast does to the
        # official q k^T matmul inputs (a no-op in fp32 / fp64).
        q, k = q.to(v.dtype), k.to(v.dtype)
        log_alpha, log_beta = self.decay(x)
        out = self._attention_fn()(q, k, v.reshape(shape), log_alpha, log_beta, 1.0)
        return self.proj(out.reshape(B, H, W, C).to(v.dtype) + lepe)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, mode={self.mode!r}, impl={self._impl!r}"
