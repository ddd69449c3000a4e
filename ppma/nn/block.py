"""The PPMA transformer block (docs/model.md §4, the official ``BasicBlock``)."""

from __future__ import annotations

import torch
from torch import nn

from ppma.nn.attention import PPMAAttention
from ppma.nn.masks import RMT_GAMMA
from ppma.nn.padre import PADReMixer
from ppma.nn.layers import ConvFFN, DropPath, DWConv2d, LayerScale

__all__ = ["PPMABlock", "MIXERS"]

# The token mixer of a block: "attention" is PPMAAttention (docs/model.md §3), "padre" PADRe's polynomial mixer.
MIXERS = ("attention", "padre")


class PPMABlock(nn.Module):
    """``x += cpe(x)``; ``x += drop_path(ls1(attn(norm1(x))))``; ``x += drop_path(ls2(mlp(norm2(x))))``.

    ``cpe`` is a 3x3 depthwise conv (conditional position encoding), the norms are LayerNorm(eps=1e-6),
    ``ls1``/``ls2`` are layer scales when ``layerscale`` is on (else identity). ``[B, H, W, C]`` in and out.

    Args:
        dim, num_heads: channels and heads.
        mlp_ratio: FFN hidden width is ``int(mlp_ratio * dim)``.
        mode: attention mode, ``"full"`` or ``"criss_cross"``.
        attention, mask, gamma: what the attention computes, which mask it applies and RMT's decay schedule of
            ``mask="manhattan"`` (see :class:`PPMAAttention`).
        mixer: the token mixer, one of :data:`MIXERS` (``"attention"``: :class:`PPMAAttention`; ``"padre"``:
            :class:`ppma.nn.padre.PADReMixer`, which ignores ``mode``, ``attention``, ``mask`` and ``gamma``);
            it is the ``attn`` child whichever it is.
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
        mode: str = "full",
        attention: str = "softmax",
        mask: str = "polyline",
        gamma: tuple[float, float] = RMT_GAMMA,
        mixer: str = "attention",
        drop_path: float = 0.0,
        layerscale: bool = False,
        layer_init_values: float = 1e-6,
    ) -> None:
        super().__init__()
        self.cpe = DWConv2d(dim, 3)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        if mixer not in MIXERS:
            raise ValueError(f"PPMABlock: mixer must be one of {MIXERS}, got {mixer!r}")
        if mixer == "padre":
            self.attn = PADReMixer(dim)
        else:
            self.attn = PPMAAttention(dim, num_heads, mode=mode, attention=attention, mask=mask, gamma=gamma)
        self.ls1 = LayerScale(dim, layer_init_values) if layerscale else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ConvFFN(dim, int(mlp_ratio * dim))
        self.ls2 = LayerScale(dim, layer_init_values) if layerscale else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x: [B, H, W, C]``, ``rope``: optional ``(sin, cos)`` ``[H, W, head_dim]`` -> ``[B, H, W, C]``."""
        x = x + self.cpe(x)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), rope)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x
