"""Per-token path decays of PPMA (docs/model.md §1.4; the official ``PathEmbeding2D``)."""

from __future__ import annotations

import math

import torch
from torch import nn

import torch.nn.functional as F

from ppma.nn.layers import _has_hooks
from ppma.ops.cpu.path_decay import path_decay

__all__ = ["PathDecay"]


class PathDecay(nn.Module):
    """Horizontal and vertical log-decays of every token, Mamba2's Δ/A parametrisation (docs/model.md §1.4).

    ``log_alpha = softplus(x_g . w_alpha + dt_bias[g]) * (-exp(A_log[g]))`` and the same for ``log_beta``
    with ``w_beta``, where ``x_g`` is the ``head_dim``-channel slice of head ``g``. ``dt_linear`` is one
    bias-free ``Linear(head_dim, 2)`` shared by all heads; ``dt_bias`` and ``A_log`` are per head and
    shared by both directions.

    Args:
        dim: channels ``C`` of the input.
        num_heads: number of heads; ``C`` must be divisible by it.
        A_init_range: ``A = -exp(A_log)`` is initialised from ``-U(A_init_range)`` (official: (1, 1.1)).
        dt_min, dt_max, dt_init_floor: ``softplus(dt_bias)`` is initialised log-uniformly in
            ``[dt_min, dt_max]`` and clamped below at ``dt_init_floor``.
    """

    directions = 2  # outputs of dt_linear: alpha, beta (SharedDecay: one, used for both)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        A_init_range: tuple[float, float] = (1.0, 1.1),
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"PathDecay: dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.A_init_range, self.dt_min, self.dt_max, self.dt_init_floor = A_init_range, dt_min, dt_max, dt_init_floor
        self.dt_linear = nn.Linear(self.head_dim, self.directions, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mamba2-style init (docs/model.md §1.4). ``dt_linear`` is re-initialised by the model's weight init."""
        nn.init.trunc_normal_(self.dt_linear.weight, std=0.02)
        dt = torch.exp(
            torch.rand(self.num_heads) * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min)
        ).clamp(min=self.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log.copy_(torch.log(torch.empty(self.num_heads).uniform_(*self.A_init_range)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [B, H, W, C]`` (the attention input after LayerNorm) -> ``(log_alpha, log_beta)``,
        each ``[B, H, W, heads]``, ``<= 0``, in fp32 (fp64 for fp64 input)."""
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__}: x must be [B, H, W, {self.dim}], got shape {tuple(x.shape)}")
        d = self.decays(x)
        return d[..., 0], d[..., -1]

    def decays(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., C]`` -> ``d: [..., heads, directions]``, the log-decays of every direction (float32, float64 for
        float64 ``x``). On the CPU with the fused implementation (float32/float64 outside autocast, or a bf16 ``x``
        under CPU bf16 autocast with autocast's rounding; no hooks on ``dt_linear``) one ppma kernel each way
        (``ppma.ops.cpu.path_decay``, docs/ops.md "path_decay"); elsewhere ``dt_linear``, softplus and the scaling as
        written in the class docstring."""
        lin = self.dt_linear
        if type(lin) is nn.Linear and lin.bias is None and not _has_hooks(lin):
            # the kernel where ppma.ops.cpu.path_decay.uses_path_decay_kernel says so, its reference (this formula) else
            return path_decay(x, lin.weight, self.dt_bias, self.A_log)
        u = lin(x.reshape(*x.shape[:-1], self.num_heads, self.head_dim))  # [..., heads, directions]
        # softplus/exp in fp32 (fp64 for fp64), like the official code under autocast (docs/model.md §3.5).
        ct = torch.float64 if u.dtype == torch.float64 else torch.float32
        A = -torch.exp(self.A_log.to(ct))
        return F.softplus(u.to(ct) + self.dt_bias.to(ct)[:, None]) * A[:, None]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"
