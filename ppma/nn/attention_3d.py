"""3-D PPMA attention for video tokens (paper appendix C.2, Eq. 40; docs/video.md).

The 2-D modules of ``ppma.nn`` with a time axis: ``x: [B, T, H, W, C]``. Per-token decays along W, H and T
(:class:`PathDecay3D`, the Δ/A parametrisation of :class:`ppma.nn.PathDecay` with a third direction), RoPE over the
raster index ``(t * H + i) * W + j`` (the 2-D convention, ``ppma.nn.rope``, extended), LePE as a depthwise 3-D
convolution, and one of two forms:

* ``mixer="full"``: ``ppma.ops.polyline_attention_3d`` over all ``T H W`` tokens;
* ``mixer="linear"``: ``ppma.ops.polyline_linear_attention_3d`` of ``elu(.) + 1`` features over all tokens, O(N);
* ``mixer="axial"``: masked 1-D attentions along the lines of each axis, composed in the mask's two path orders,
  ``out = 0.5 A_W(A_H(A_T v)) + 0.5 A_T(A_H(A_W v))`` (``A_X`` the softmax attention within every line along X,
  under that line's 1-D decay mask). With ``T = 1``, ``A_T`` is the identity and this is exactly the 2-D
  criss-cross form ``0.5 A(B v) + 0.5 B(A v)`` (``ppma.ops.criss_cross_attention``): the axial form is to the 3-D
  polyline attention what criss-cross is to the 2-D one (the same line restrictions of the same mask, composed
  instead of summed over paths). Cost ``O(N (T + H + W))`` instead of ``O(N^2)``. Each ``A_X`` runs the fused
  ``polyline_attention`` on ``1 x L`` maps (a 1-D mask; docs/ops.md "Masks", 1 x N trick), and ``A_H`` is shared by
  both orders (one call on ``[A_T v, A_W v]``).

``mask="none"`` gives the same module with zero log-decays (plain softmax attention), for ablations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ppma.ops as ops
from ppma.nn.decay import PathDecay
from ppma.nn.layers import _widened_depthwise, linear, linears
from ppma.nn.rope import apply_rotary, rotary_angle

__all__ = ["PathDecay3D", "DWConv3d", "rotary_sin_cos_3d", "PPMAAttention3D", "MIXERS_3D", "MASKS_3D"]

# The token mixers of the 3-D attention (the 2-D names of docs/ops.md "Glossary"; "axial" is the 3-D criss-cross).
MIXERS_3D = ("axial", "full", "linear")
MASKS_3D = ("polyline", "none")


class PathDecay3D(PathDecay):
    """Log-decays along W, H and T of every token: :class:`ppma.nn.PathDecay` with three directions
    (``dt_linear = Linear(head_dim, 3)``, ``dt_bias`` and ``A_log`` per head, shared by the directions)."""

    directions = 3

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [B, T, H, W, C]`` -> ``(log_alpha, log_beta, log_gamma)``, each ``[B, T, H, W, heads]``, ``<= 0``,
        in fp32 (fp64 for fp64 input)."""
        if x.dim() != 5 or x.shape[-1] != self.dim:
            raise ValueError(f"PathDecay3D: x must be [B, T, H, W, {self.dim}], got shape {tuple(x.shape)}")
        d = self.decays(x)  # [B, T, H, W, heads, 3]
        return d[..., 0], d[..., 1], d[..., 2]


class DWConv3d(nn.Module):
    """Depthwise 3-D convolution on channels-last video maps: ``[B, T, H, W, C] -> [B, T, H, W, C]``."""

    def __init__(self, dim: int, kernel_size: tuple[int, int, int]) -> None:
        super().__init__()
        self.conv = nn.Conv3d(dim, dim, kernel_size, padding=tuple(k // 2 for k in kernel_size), groups=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.permute(0, 4, 1, 2, 3)
        y = _widened_depthwise(xc, self.conv)  # fp16 autocast without fp16 kernels (as ppma.nn.DWConv2d)
        if y is None:
            y = self.conv(xc)
        return y.permute(0, 2, 3, 4, 1)


def rotary_sin_cos_3d(angle: torch.Tensor, T: int, H: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sin, cos`` of ``p * angle`` for the raster index ``p = (t * H + i) * W + j``: each ``[T, H, W, d]``
    (``ppma.nn.rope.rotary_sin_cos`` with a time axis; ``T = 1`` gives the 2-D tables)."""
    index = torch.arange(T * H * W, device=angle.device).to(angle.dtype)
    phase = index[:, None] * angle[None, :]
    return phase.sin().reshape(T, H, W, -1), phase.cos().reshape(T, H, W, -1)


def _line_attention(axis: int, q, k, v, decay) -> torch.Tensor:
    """Softmax attention within every line along ``axis`` (1: T, 2: H, 3: W) of ``[B, T, H, W, heads, c]`` tensors,
    under the line's 1-D mask of ``decay`` (``[B, T, H, W, heads]``): ``polyline_attention`` on ``1 x L`` maps."""
    def to_lines(t):
        t = t.movedim(axis, 3)  # the line axis next to heads
        return t.reshape(-1, 1, t.shape[3], *t.shape[4:]), t.shape

    ql, _ = to_lines(q)
    kl, _ = to_lines(k)
    vl, vshape = to_lines(v)
    dl, _ = to_lines(decay)
    out = ops.polyline_attention(ql, kl, vl, dl, torch.zeros_like(dl), 1.0)
    return out.reshape(vshape).movedim(3, axis)


class PPMAAttention3D(nn.Module):
    """3-D polyline path masked attention (module docstring). ``q, k, v = Linear(x)``; ``lepe = DWConv3d(v)`` with
    a ``3 x 5 x 5`` kernel; ``k = k * d**-0.5``; RoPE on ``q`` and ``k``; decays from ``x``; ``out = proj(attn +
    lepe)``.

    Args:
        dim: channels ``C``; num_heads: heads (``C / num_heads`` even).
        mixer: ``"axial"``, ``"full"`` or ``"linear"`` (module docstring).
        mask: ``"polyline"`` or ``"none"`` (zero log-decays, no decay parameters).
    """

    def __init__(self, dim: int, num_heads: int, mixer: str = "full", *, mask: str = "polyline") -> None:
        super().__init__()
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"PPMAAttention3D: dim ({dim}) / num_heads ({num_heads}) must be an even integer")
        if mixer not in MIXERS_3D:
            raise ValueError(f"PPMAAttention3D: mixer must be one of {MIXERS_3D}, got {mixer!r}")
        if mask not in MASKS_3D:
            raise ValueError(f"PPMAAttention3D: mask must be one of {MASKS_3D}, got {mask!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.mixer, self.mask = mixer, mask
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.lepe = DWConv3d(dim, (3, 5, 5))
        self.decay = PathDecay3D(dim, num_heads) if mask == "polyline" else None
        self.proj = nn.Linear(dim, dim)

    def decays(self, x: torch.Tensor):
        if self.decay is not None:
            return self.decay(x)
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        z = x.new_zeros((*x.shape[:4], self.num_heads), dtype=ct)
        return z, z, z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, H, W, C]`` (already normalised) -> ``[B, T, H, W, C]``."""
        if x.dim() != 5 or x.shape[-1] != self.dim:
            raise ValueError(f"PPMAAttention3D: x must be [B, T, H, W, {self.dim}], got shape {tuple(x.shape)}")
        B, T, H, W, C = x.shape
        angle = rotary_angle(self.head_dim, x.device).to(torch.promote_types(x.dtype, torch.float32))
        sin, cos = rotary_sin_cos_3d(angle, T, H, W)
        q, k, v = linears(x, self.q, self.k, self.v)  # ppma.nn.layers.linears: one node in CPU training
        lepe = self.lepe(v)
        shape = (B, T, H, W, self.num_heads, self.head_dim)
        q = _rope(q.reshape(shape), sin, cos)
        k = _rope((k * self.scale).reshape(shape), sin, cos)
        q, k, v = q.to(v.dtype), k.to(v.dtype), v.reshape(shape)
        la, lb, lg = self.decays(x)
        if self.mixer == "linear":
            out = ops.polyline_linear_attention_3d(F.elu(q) + 1, F.elu(k) + 1, v, la, lb, lg)
        elif self.mixer == "full":
            out = ops.polyline_attention_3d(q, k, v, la, lb, lg, 1.0)
        else:
            zt = _line_attention(1, q, k, v, lg)  # A_T v
            zw = _line_attention(3, q, k, v, la)  # A_W v
            zh = _line_attention(2, q, k, torch.cat([zt, zw], -1), lb)  # A_H on both
            d = self.head_dim
            out = 0.5 * _line_attention(3, q, k, zh[..., :d], la) + 0.5 * _line_attention(1, q, k, zh[..., d:], lg)
        return linear(out.reshape(B, T, H, W, C).to(v.dtype) + lepe, self.proj)

    def extra_repr(self) -> str:
        extra = "" if self.mask == "polyline" else f", mask={self.mask!r}"
        return f"dim={self.dim}, num_heads={self.num_heads}, mixer={self.mixer!r}{extra}"


def _rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` on ``[B, T, H, W, heads, d]`` with ``[T, H, W, d]`` tables."""
    return apply_rotary(x.flatten(1, 2), sin.flatten(0, 1), cos.flatten(0, 1)).unflatten(1, x.shape[1:3])
