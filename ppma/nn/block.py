"""The PPMA transformer block (docs/model.md §4, the official ``BasicBlock``)."""

from __future__ import annotations

import torch
from torch import nn

import ppma.ops as ops
from ppma.nn.attention import PPMAAttention
from ppma.nn.masks import RMT_GAMMA
from ppma.nn.padre import PADReMixer
from ppma.nn.layers import MLPS, ConvFFN, DropPath, DWConv2d, LayerNorm, LayerScale, _fused_dtype
from ppma.nn.surrogate import SurrogateAttention

__all__ = ["PPMABlock", "MIXERS", "MIXER_FACTORIES"]


def _attention(mixer: str):
    def build(dim: int, num_heads: int, *, mask: str, gamma: tuple[float, float]) -> nn.Module:
        return PPMAAttention(dim, num_heads, mixer, mask=mask, gamma=gamma)

    return build


# What mixes the tokens of a block (its ``attn`` child), by name; docs/ops.md, "Glossary". Each entry builds the
# module from ``(dim, num_heads, *, mask, gamma)`` (a mixer that has no mask ignores ``mask`` and ``gamma``); a
# new mixer is one more entry here.
MIXER_FACTORIES = {
    # polyline-masked softmax attention within each row and each column (official "chunk" mode)
    "criss_cross": _attention("criss_cross"),
    # polyline-masked softmax attention over all tokens (official "whole" mode)
    "full": _attention("full"),
    # polyline masked linear attention (PPMLA), O(N) over all tokens
    "linear": _attention("linear"),
    # PADRe's polynomial mixer (no attention, no mask)
    "padre": lambda dim, num_heads, *, mask, gamma: PADReMixer(dim),
    # the Surrogate Attention Block: FFT long convolution with Monarch projections (ppma.nn.surrogate; no mask)
    "sab": lambda dim, num_heads, *, mask, gamma: SurrogateAttention(dim, num_heads),
}
MIXERS = tuple(MIXER_FACTORIES)


class PPMABlock(nn.Module):
    """``x += cpe(x)``; ``x += drop_path(ls1(attn(norm1(x))))``; ``x += drop_path(ls2(mlp(norm2(x))))``.

    ``cpe`` is a 3x3 depthwise conv (conditional position encoding), the norms are LayerNorm(eps=1e-6),
    ``ls1``/``ls2`` are layer scales when ``layerscale`` is on (else identity). ``[B, H, W, C]`` in and out.

    Args:
        dim, num_heads: channels and heads.
        mlp_ratio: FFN hidden width is ``int(mlp_ratio * dim)``.
        mixer: what mixes the tokens, one of :data:`MIXERS`: ``"criss_cross"``, ``"full"`` or ``"linear"``
            (:class:`PPMAAttention`), ``"padre"`` (:class:`ppma.nn.padre.PADReMixer`) or ``"sab"``
            (:class:`ppma.nn.surrogate.SurrogateAttention`), which ignore ``mask`` and ``gamma``; it is the
            ``attn`` child whichever it is.
        mask, gamma: which mask the attention applies and RMT's decay schedule of ``mask="manhattan"`` (see
            :class:`PPMAAttention`).
        mlp: the FFN's two linear layers, one of :data:`ppma.nn.layers.MLPS` (``"standard"``: ``nn.Linear``;
            ``"monarch"``: the Surrogate FFN Block's :class:`ppma.nn.MonarchLinear`), see :class:`ConvFFN`.
        drop_path: stochastic depth rate of this block.
        layerscale: whether to use layer scale; ``layer_init_values`` is its initial value.

    Everything after ``dim, num_heads`` is keyword-only.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mlp_ratio: float = 3.0,
        mixer: str = "full",
        mask: str = "polyline",
        gamma: tuple[float, float] = RMT_GAMMA,
        mlp: str = "standard",
        drop_path: float = 0.0,
        layerscale: bool = False,
        layer_init_values: float = 1e-6,
    ) -> None:
        super().__init__()
        self.cpe = DWConv2d(dim, 3)
        self.norm1 = LayerNorm(dim, eps=1e-6)
        if mixer not in MIXER_FACTORIES:
            raise ValueError(f"PPMABlock: mixer must be one of {MIXERS}, got {mixer!r}")
        if mlp not in MLPS:
            raise ValueError(f"PPMABlock: mlp must be one of {MLPS}, got {mlp!r}")
        self.attn = MIXER_FACTORIES[mixer](dim, num_heads, mask=mask, gamma=gamma)
        self.ls1 = LayerScale(dim, layer_init_values) if layerscale else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = LayerNorm(dim, eps=1e-6)
        self.mlp = ConvFFN(dim, int(mlp_ratio * dim), mlp=mlp)
        self.ls2 = LayerScale(dim, layer_init_values) if layerscale else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    fused = False  # set by ppma.nn.fuse_for_inference (docs/design.md §2.9)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x: [B, H, W, C]``, ``rope``: optional ``(sin, cos)`` ``[H, W, head_dim]`` -> ``[B, H, W, C]``."""
        if self.fused:
            return self._forward_fused(x, rope)
        y = self.cpe(x, residual=True)  # x + cpe(x)
        y = y + self.drop_path1(self.ls1(self.attn(self.norm1(y), rope)))
        return y + self.drop_path2(self.ls2(self.mlp(self.norm2(y))))

    def _forward_fused(self, x: torch.Tensor, rope) -> torch.Tensor:
        # y is the fused CPE's new map: the two residual sums are added into it in place (the same values), no new
        # map of the block's size for each; with a fused norm2 the first sum and norm2 are one pass over y
        # (ppma.ops.cpu.add_layer_norm_: bit for bit norm2(y + a))
        _fused_dtype(self, x)
        y = self.cpe(x, residual=True)
        a = self.drop_path1(self.ls1(self.attn(self.norm1(y), rope)))
        n2 = self.norm2
        if n2.fused and a.dtype == y.dtype:  # a dtype choice: a mixer's output under autocast may be float32
            h = ops.cpu.add_layer_norm_(y, a, n2.weight, n2.bias, n2.eps)
        else:
            h = n2(y.add_(a))
        del a  # not held while the FFN's hidden map lives (peak memory)
        return y.add_(self.drop_path2(self.ls2(self.mlp(h))))

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference` (after its children): the in-place residual sums need the
        CPE's fresh map (a fused :class:`DWConv2d`) and norm2 a :class:`LayerNorm`; a block with other pieces stays
        unfused."""
        self.fused = type(self.cpe) is DWConv2d and self.cpe.fused and isinstance(self.norm2, LayerNorm)
