"""PADRe: the polynomial attention drop-in replacement (Letourneau et al., "PADRe: A Unifying Polynomial Attention
Drop-in Replacement for Efficient Vision Transformer", §3 and the instance of §4.1 / Fig. 1) as a token mixer of
:class:`ppma.nn.PPMABlock` (``mixer="padre"``).

For a degree ``d`` and input ``X`` (``N`` tokens x ``C`` channels):

* ``Y_i = K_i * (X A_i)`` for ``i = 1 .. d``: channel mixing ``A_i`` (``Linear(C, C)``) then token mixing ``K_i``
  (a ``k x k`` depthwise convolution over the ``H x W`` map; the paper's 2-D instance uses ``k = 11``);
* ``Z_1 = Y_1``, ``Z_{i+1} = (G_i * (Z_i D_i)) ⊙ Y_{i+1}``: channel mixing ``D_i`` (``Linear(C, C)``) and token
  mixing ``G_i`` (``k x k`` depthwise) of ``Z_i``, times the next ``Y`` (Hadamard product), so the entries of
  ``Z_i`` are homogeneous polynomials of degree ``i`` in ``X`` (the paper's Lemma 1);
* ``P = sum_{i=2..d} w_i ⊙ Z_i`` and ``out = proj(P)`` (``Linear(C, C)`` with bias).

The settings of the paper's instance: a single head; no degree-1 term in ``P`` (the block's skip connection
provides it) and no degree-0 term (the output projection's bias provides it); no normalisation of the ``Y_i``.
Degree 2 is the instance of all the paper's experiments but its degree ablation (PADRe-2; PADRe-3 is +2 C^2
parameters per block). Two choices are ours: the inner linear maps have no bias, so that ``Z_i`` is exactly
homogeneous (the bias of the polynomial is ``proj``'s), and the paper's per-token-and-channel weights
``W in R^{N x C x d}`` are per channel ``w_i in R^C`` (``N`` changes with the input size here).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PADReMixer"]


class PADReMixer(nn.Module):
    """PADRe's polynomial token mixer, a drop-in for :class:`ppma.nn.PPMAAttention` (see the module docstring).

    Args:
        dim: channels ``C``.
        degree: polynomial degree ``d >= 2`` (2: the paper's default instance).
        kernel_size: odd size ``k`` of the depthwise token-mixing convolutions (11: the paper's 2-D instance).

    ``forward(x: [B, H, W, C], rope=None) -> [B, H, W, C]``; ``rope`` is accepted and ignored (the block passes
    the stage's rotary tables to whichever mixer it has).
    """

    def __init__(self, dim: int, degree: int = 2, kernel_size: int = 11) -> None:
        super().__init__()
        if not isinstance(degree, int) or degree < 2:
            raise ValueError(f"PADReMixer: degree must be an int >= 2, got {degree!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"PADReMixer: kernel_size must be a positive odd int, got {kernel_size!r}")
        self.dim, self.degree, self.kernel_size = dim, degree, kernel_size
        conv = lambda: nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim, bias=False)  # noqa: E731
        self.channel_in = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(degree))  # A_i
        self.token_in = nn.ModuleList(conv() for _ in range(degree))  # K_i
        self.channel_z = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(degree - 1))  # D_i
        self.token_z = nn.ModuleList(conv() for _ in range(degree - 1))  # G_i
        self.weight = nn.Parameter(torch.ones(degree - 1, dim))  # w_2 .. w_d
        self.proj = nn.Linear(dim, dim)

    @staticmethod
    def _token_mix(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        return conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # depthwise conv on [B, C, H, W]

    def terms(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The homogeneous terms ``[Z_1, ..., Z_d]``, each ``[B, H, W, C]`` (``Z_i`` has degree ``i`` in ``x``)."""
        y = [self._token_mix(k, a(x)) for a, k in zip(self.channel_in, self.token_in)]
        z = [y[0]]
        for i in range(1, self.degree):
            z.append(self._token_mix(self.token_z[i - 1], self.channel_z[i - 1](z[-1])) * y[i])
        return z

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"PADReMixer: x must be [B, H, W, {self.dim}], got shape {tuple(x.shape)}")
        z = self.terms(x)
        p = sum(w * zi for w, zi in zip(self.weight, z[1:]))
        return self.proj(p)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, degree={self.degree}, kernel_size={self.kernel_size}"
