"""Rotary position embedding over the raster index (spec §3.1; the official ``RotaryPositionEmbedding2D``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding2D", "rotate_every_two", "apply_rotary"]


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """Map every channel pair ``(x_{2m}, x_{2m+1})`` to ``(-x_{2m+1}, x_{2m})``. ``[..., d] -> [..., d]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_every_two(x) * sin`` (the official ``theta_shift``).

    ``x: [B, H, W, heads, d]``, ``sin, cos: [H, W, d]`` (broadcast over batch and heads).
    """
    return x * cos[:, :, None, :] + rotate_every_two(x) * sin[:, :, None, :]


class RotaryEmbedding2D(nn.Module):
    """RMT-style rotary embedding over the flattened raster index ``p = i * W + j`` (spec §3.1).

    Despite the name (kept from the paper) the positions are 1-D: ``sin(p * angle)``, ``cos(p * angle)``
    with ``angle = 1 / 10000 ** linspace(0, 1, d/2)``, each value repeated twice (interleaved pairs).
    ``angle`` is a persistent buffer, as in the official state dict.

    Args:
        head_dim: ``d``, the per-head query/key dimension (even).
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding2D: head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        angle = 1.0 / (10000 ** torch.linspace(0, 1, head_dim // 2))
        self.register_buffer("angle", angle.unsqueeze(-1).repeat(1, 2).flatten(), persistent=True)

    def forward(self, H: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(sin, cos)``, each ``[H, W, head_dim]``, for an ``H x W`` feature map."""
        index = torch.arange(H * W, device=self.angle.device).to(self.angle.dtype)
        phase = index[:, None] * self.angle[None, :]
        return phase.sin().reshape(H, W, -1), phase.cos().reshape(H, W, -1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"
