"""PPMA attention module: projections, LePE, RoPE, path decays and the polyline attention ops (docs/model.md §3)."""

from __future__ import annotations

import torch
from torch import nn

import ppma.ops as ops
from ppma.nn.layers import (DWConv2d, _fused_dtype, _fused_linear, autocast_enabled, compiled_onednn_dtype, linear,
                             linears)
from ppma.nn.masks import MASKS, RMT_GAMMA, build_decay, masked_attention
from ppma.nn.rope import rotary_angle, rotary_sin_cos

__all__ = ["PPMAAttention", "MaskedAttentionOp", "LinearAttentionOp", "SOFTMAX_MIXERS", "ATTENTION_MIXERS", "MASKS"]

# The token mixers that are attention (docs/ops.md, "Glossary"). The softmax ones, with the op each runs: "full"
# is the official "whole" mode, "criss_cross" the official "chunk" mode.
_SOFTMAX_OPS = {"full": ops.polyline_attention, "criss_cross": ops.criss_cross_attention}
SOFTMAX_MIXERS = tuple(_SOFTMAX_OPS)
# ... and "linear", the polyline masked linear attention PPMLA (docs/model.md §2 A.7), O(N) over the whole map.
ATTENTION_MIXERS = (*SOFTMAX_MIXERS, "linear")
# Which mask the attention applies (MASKS, from ppma.nn.masks; docs/ops.md "Masks"): "polyline" is the 2-D
# polyline path mask (docs/model.md §1), the others the paper's ablation masks (docs/model.md §7.4).


class MaskedAttentionOp(nn.Module):
    """The masked softmax attention operator of one mixer as a module without parameters (docs/model.md §1.6):
    ``forward(q, k, v, log_alpha, log_beta)`` is ``ppma.ops.polyline_attention`` (``mixer="full"``) or
    ``ppma.ops.criss_cross_attention`` (``mixer="criss_cross"``) with the fixed ``scale``.

    Shapes: ``q, k: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``, ``log_alpha, log_beta:
    [B, H, W, heads]`` -> ``[B, H, W, heads, dv]``. It exists so that forward hooks see exactly what the
    operator receives (``ppma-visualize`` reads the attention weights this way). Whether the compiled
    kernels or the reference run is ``ppma.ops.set_impl``'s choice, not the module's. With a ``mask`` other
    than ``"polyline"`` it runs :func:`ppma.nn.masks.masked_attention` (docs/ops.md, "Masks").
    """

    def __init__(self, mixer: str, scale: float, mask: str = "polyline") -> None:
        super().__init__()
        if mixer not in _SOFTMAX_OPS:
            raise ValueError(f"MaskedAttentionOp: mixer must be one of {SOFTMAX_MIXERS}, got {mixer!r}")
        if mask not in MASKS:
            raise ValueError(f"MaskedAttentionOp: mask must be one of {MASKS}, got {mask!r}")
        self.mixer, self.scale, self.mask = mixer, scale, mask

    def forward(self, q, k, v, log_alpha, log_beta) -> torch.Tensor:
        if self.mask != "polyline":
            return masked_attention(self.mask, self.mixer, q, k, v, log_alpha, log_beta, self.scale)
        return _SOFTMAX_OPS[self.mixer](q, k, v, log_alpha, log_beta, self.scale)

    def extra_repr(self) -> str:
        extra = "" if self.mask == "polyline" else f", mask={self.mask!r}"
        return f"mixer={self.mixer!r}, scale={self.scale}{extra}"


class LinearAttentionOp(nn.Module):
    """The polyline masked linear attention (PPMLA, docs/model.md §2 A.7) of a ``mixer="linear"`` layer as a module
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

    * ``mixer="full"`` (official "whole"): ``0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v`` over all tokens;
    * ``mixer="criss_cross"`` (official "chunk"): ``0.5 B(A v) + 0.5 A(B v)`` with masked row attention
      ``A`` and column attention ``B``;
    * ``mixer="linear"`` (PPMLA, O(N) over the whole map): ``ppma.ops.polyline_linear_attention`` of
      ``elu(q) + 1`` and ``elu(k) + 1`` (:class:`LinearAttentionOp`), with the same parameters as the softmax
      attention;

    and ``out = proj(attn + lepe)``. The operator runs in the child ``attn_op`` (a :class:`MaskedAttentionOp`
    with scale 1, since ``k`` is already scaled, or a :class:`LinearAttentionOp`); ``ppma.ops.set_impl`` picks
    fused kernels or the reference.

    Args:
        dim: channels ``C``.
        num_heads: heads; ``head_dim = C / num_heads``.
        mixer: one of :data:`ATTENTION_MIXERS`, ``"full"``, ``"criss_cross"`` (the official PPMA's softmax
            attentions) or ``"linear"`` (PPMLA, which supports ``mask="polyline"`` only).
        mask: which mask is applied, one of :data:`MASKS` (``"polyline"``: the official PPMA; the others are
            the paper's ablation masks, docs/ops.md "Masks"). It also picks the decay module ``decay``
            (:func:`ppma.nn.masks.build_decay`; ``"none"`` and ``"manhattan"`` have no parameters there).
        gamma: ``(initial_value, heads_range)`` of RMT's fixed decays, used by ``mask="manhattan"`` only.
    """

    fused = False  # set by ppma.nn.fuse_for_inference (docs/design.md §2.9)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mixer: str = "full",
        *,
        mask: str = "polyline",
        gamma: tuple[float, float] = RMT_GAMMA,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"PPMAAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
        if mixer not in ATTENTION_MIXERS:
            raise ValueError(f"PPMAAttention: mixer must be one of {ATTENTION_MIXERS}, got {mixer!r}")
        if mask not in MASKS:
            raise ValueError(f"PPMAAttention: mask must be one of {MASKS}, got {mask!r}")
        if mixer == "linear" and mask != "polyline":
            raise ValueError(f"PPMAAttention: mixer='linear' supports mask='polyline' only, got {mask!r}")
        self.dim, self.num_heads, self.head_dim, self.mixer = dim, num_heads, dim // num_heads, mixer
        self.mask = mask
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.lepe = DWConv2d(dim, 5)
        self.decay = build_decay(mask, dim, num_heads, gamma)
        self.proj = nn.Linear(dim, dim)
        if mixer == "linear":
            self.attn_op = LinearAttentionOp()
        else:
            self.attn_op = MaskedAttentionOp(mixer, scale=1.0, mask=mask)

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
        dev = x.device.type
        if autocast_enabled(dev) and x.dtype == torch.float32:
            # cast once for the four projections below, which autocast would each cast on their own
            x = x.to(torch.get_autocast_dtype(dev))
        shape = (B, H, W, self.num_heads, self.head_dim)
        fused = self.fused
        if fused:
            # oneDNN's linear for the projections; RoPE over the module's own fresh q and k in place
            # (ppma.ops.cpu.rope_, the same values), no second map of their size
            dt = _fused_dtype(self, x)
            q, k, v = _fused_linear(x, self.q, dt), _fused_linear(x, self.k, dt), _fused_linear(x, self.v, dt)
            rope_fn = ops.cpu.rope_
        else:
            q, k, v = linears(x, self.q, self.k, self.v)  # in CPU training one node (ppma.nn.layers.linears)
            rope_fn = ops.cpu.rope
        # RoPE on q and on the scaled k (the official code scales k, not the logits), one pass each
        # (ppma.ops.cpu.rope). The result keeps q's dtype: under autocast, bf16/fp16 q and k reach the attention
        # op as they reach the official q k^T matmul, while the sin/cos tables stay fp32.
        q = rope_fn(q.reshape(shape), sin, cos)
        k = rope_fn(k.reshape(shape), sin, cos, self.scale)
        log_alpha, log_beta = self.decay(x)
        out = self.attn_op(q, k, v.reshape(shape), log_alpha, log_beta).reshape(B, H, W, C).to(v.dtype)
        del x, q, k, log_alpha, log_beta  # freed before the LePE and the projection (peak memory)
        # out + LePE(v); fused, oneDNN adds the LePE into out in place, so that no map is held for it while the
        # attention runs (DWConv2d, inplace=True)
        out = self.lepe(v, add=out, inplace=fused)
        del v
        cdt = compiled_onednn_dtype(out, self.proj)
        if cdt is not None:  # compiled frozen inference: oneDNN's linear, as fused
            return _fused_linear(out, self.proj, cdt)
        return _fused_linear(out, self.proj, dt) if fused else linear(out, self.proj)

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference` (after its children; the LePE must be a fused
        :class:`DWConv2d`)."""
        self.fused = type(self.lepe) is DWConv2d and self.lepe.fused

    def extra_repr(self) -> str:
        extra = "" if self.mask == "polyline" else f", mask={self.mask!r}"
        return f"dim={self.dim}, num_heads={self.num_heads}, mixer={self.mixer!r}{extra}"
