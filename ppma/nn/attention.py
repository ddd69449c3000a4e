"""PPMA attention module: projections, LePE, RoPE, path decays and the polyline attention ops (docs/model.md §3)."""

from __future__ import annotations

import torch
from torch import nn

import ppma.ops as ops
from ppma.nn.layers import DWConv2d
from ppma.nn.masks import MASKS, RMT_GAMMA, build_decay, masked_attention
from ppma.nn.rope import apply_rotary, rotary_angle, rotary_sin_cos

__all__ = ["PPMAAttention", "MaskedAttentionOp", "LinearAttentionOp", "ATTENTION_MODES", "ATTENTION_KINDS", "MASKS"]

# mode -> the op it runs: "full" is the official "whole" mode, "criss_cross" the official "chunk" mode.
_MODE_OPS = {"full": ops.polyline_attention, "criss_cross": ops.criss_cross_attention}
ATTENTION_MODES = tuple(_MODE_OPS)
# What the attention computes (docs/ops.md): "softmax" is PPMA's masked softmax attention (docs/model.md §3); "linear"
# the polyline masked linear attention PPMLA (docs/model.md §2 A.7), O(N) over the whole map whatever the mode.
ATTENTION_KINDS = ("softmax", "linear")
# Which mask the attention applies (MASKS, from ppma.nn.masks; docs/ops.md "Masks"): "polyline" is the 2-D
# polyline path mask (docs/model.md §1), the others the paper's ablation masks (docs/model.md §7.4).


class MaskedAttentionOp(nn.Module):
    """The polyline attention operator of one mode as a module without parameters (docs/model.md §1.6):
    ``forward(q, k, v, log_alpha, log_beta)`` is ``ppma.ops.polyline_attention`` (``mode="full"``) or
    ``ppma.ops.criss_cross_attention`` (``mode="criss_cross"``) with the fixed ``scale``.

    Shapes: ``q, k: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``, ``log_alpha, log_beta:
    [B, H, W, heads]`` -> ``[B, H, W, heads, dv]``. It exists so that forward hooks see exactly what the
    operator receives (``ppma-visualize`` reads the attention weights this way). Whether the compiled
    kernels or the reference run is ``ppma.ops.set_impl``'s choice, not the module's. With a ``mask`` other
    than ``"polyline"`` it runs :func:`ppma.nn.masks.masked_attention` (docs/ops.md, "Masks").
    """

    def __init__(self, mode: str, scale: float, mask: str = "polyline") -> None:
        super().__init__()
        if mode not in _MODE_OPS:
            raise ValueError(f"MaskedAttentionOp: mode must be one of {ATTENTION_MODES}, got {mode!r}")
        if mask not in MASKS:
            raise ValueError(f"MaskedAttentionOp: mask must be one of {MASKS}, got {mask!r}")
        self.mode, self.scale, self.mask = mode, scale, mask

    def forward(self, q, k, v, log_alpha, log_beta) -> torch.Tensor:
        if self.mask != "polyline":
            return masked_attention(self.mask, self.mode, q, k, v, log_alpha, log_beta, self.scale)
        return _MODE_OPS[self.mode](q, k, v, log_alpha, log_beta, self.scale)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, scale={self.scale}" + ("" if self.mask == "polyline" else f", mask={self.mask!r}")


class LinearAttentionOp(nn.Module):
    """The polyline masked linear attention (PPMLA, docs/model.md §2 A.7) of a ``attention="linear"`` layer as a module
    without parameters: ``forward(q, k, v, log_alpha, log_beta)`` maps ``q`` and ``k`` to non-negative features
    with ``elu(x) + 1`` and runs ``ppma.ops.polyline_linear_attention`` (normalised) over all tokens.

    Shapes as in :class:`MaskedAttentionOp`. The feature map is applied to what the module gives it, i.e. after
    ``k`` is scaled by ``d**-0.5`` and after RoPE: RoPE rotates signed features, so it must come before the map
    that makes them non-negative (``A = q k^T`` must stay >= 0 for the normaliser), and with the scaled ``k``,
    ``phi(q) . phi(k) ~ |phi(q)|_1 + phi(q) . k`` is a first-order stand-in for the softmax weight.
    """

    def forward(self, q, k, v, log_alpha, log_beta) -> torch.Tensor:
        q, k = nn.functional.elu(q) + 1, nn.functional.elu(k) + 1
        return ops.polyline_linear_attention(q, k, v, log_alpha, log_beta)


class PPMAAttention(nn.Module):
    """Polyline path masked attention (docs/model.md §3.2-§3.4).

    ``q, k, v = Linear(x)``; ``lepe = DWConv5x5(v)``; ``k = k * d**-0.5``; RoPE on ``q`` and the scaled
    ``k``; log-decays from ``x`` (``PathDecay``); then

    * ``mode="full"`` (official "whole"): ``0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v`` over all tokens;
    * ``mode="criss_cross"`` (official "chunk"): ``0.5 B(A v) + 0.5 A(B v)`` with masked row attention
      ``A`` and column attention ``B``;
    * ``attention="linear"`` (either mode: it is O(N) over the whole map, so ``mode`` is ignored):
      ``ppma.ops.polyline_linear_attention`` of ``elu(q) + 1`` and ``elu(k) + 1`` (:class:`LinearAttentionOp`),
      with the same parameters as the softmax attention;

    and ``out = proj(attn + lepe)``. The operator runs in the child ``attn_op`` (a :class:`MaskedAttentionOp`
    with scale 1, since ``k`` is already scaled); ``ppma.ops.set_impl`` picks fused kernels or the reference.

    Args:
        dim: channels ``C``.
        num_heads: heads; ``head_dim = C / num_heads``.
        mode: ``"full"`` or ``"criss_cross"``.
        attention: what is computed, one of :data:`ATTENTION_KINDS` (``"softmax"``: the official PPMA;
            ``"linear"``: PPMLA, which supports ``mask="polyline"`` only).
        mask: which mask is applied, one of :data:`MASKS` (``"polyline"``: the official PPMA; the others are
            the paper's ablation masks, docs/ops.md "Masks"). It also picks the decay module ``decay``
            (:func:`ppma.nn.masks.build_decay`; ``"none"`` and ``"manhattan"`` have no parameters there).
        gamma: ``(initial_value, heads_range)`` of RMT's fixed decays, used by ``mask="manhattan"`` only.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mode: str = "full",
        *,
        attention: str = "softmax",
        mask: str = "polyline",
        gamma: tuple[float, float] = RMT_GAMMA,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"PPMAAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
        if mode not in ATTENTION_MODES:
            raise ValueError(f"PPMAAttention: mode must be one of {ATTENTION_MODES}, got {mode!r}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"PPMAAttention: attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if mask not in MASKS:
            raise ValueError(f"PPMAAttention: mask must be one of {MASKS}, got {mask!r}")
        if attention == "linear" and mask != "polyline":
            raise ValueError(f"PPMAAttention: attention='linear' supports mask='polyline' only, got {mask!r}")
        self.dim, self.num_heads, self.head_dim, self.mode = dim, num_heads, dim // num_heads, mode
        self.attention, self.mask = attention, mask
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.lepe = DWConv2d(dim, 5)
        self.decay = build_decay(mask, dim, num_heads, gamma)
        self.proj = nn.Linear(dim, dim)
        if attention == "linear":
            self.attn_op = LinearAttentionOp()
        else:
            self.attn_op = MaskedAttentionOp(mode, scale=1.0, mask=mask)

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
        out = self.attn_op(q, k, v.reshape(shape), log_alpha, log_beta)
        return self.proj(out.reshape(B, H, W, C).to(v.dtype) + lepe)

    def extra_repr(self) -> str:
        extra = "" if self.attention == "softmax" else f", attention={self.attention!r}"
        extra += "" if self.mask == "polyline" else f", mask={self.mask!r}"
        return f"dim={self.dim}, num_heads={self.num_heads}, mode={self.mode!r}{extra}"
