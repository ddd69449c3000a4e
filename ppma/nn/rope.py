"""Rotary position embedding over the raster index (docs/model.md §3.1; the official ``RotaryPositionEmbedding2D``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding2D", "rotary_angle", "rotary_sin_cos", "rotate_every_two", "apply_rotary"]


def rotary_angle(head_dim: int, device=None) -> torch.Tensor:
    """``[θ0, θ0, θ1, θ1, ...]`` with ``θm = 1 / 10000 ** linspace(0, 1, head_dim/2)[m]``, ``[head_dim]`` fp32."""
    angle = 1.0 / (10000 ** torch.linspace(0, 1, head_dim // 2, device=device))
    return angle.unsqueeze(-1).repeat(1, 2).flatten()


def rotary_sin_cos(angle: torch.Tensor, H: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sin(p * angle)``, ``cos(p * angle)`` for the raster index ``p = i * W + j``: each ``[H, W, d]``."""
    index = torch.arange(H * W, device=angle.device).to(angle.dtype)
    phase = index[:, None] * angle[None, :]
    return phase.sin().reshape(H, W, -1), phase.cos().reshape(H, W, -1)


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
    """RMT-style rotary embedding over the flattened raster index ``p = i * W + j`` (docs/model.md §3.1).

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
        self.register_buffer("angle", rotary_angle(head_dim), persistent=True)

    def forward(self, H: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(sin, cos)``, each ``[H, W, head_dim]``, for an ``H x W`` feature map.

        fp32 (fp64 for an fp64 buffer): a model cast to fp16/bf16 recomputes the angles in fp32, because
        raster positions reach thousands and low-precision phases would be meaningless.
        """
        angle = self.angle
        if angle.dtype not in (torch.float32, torch.float64):
            angle = rotary_angle(self.head_dim, angle.device)
        return rotary_sin_cos(angle, H, W)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"
