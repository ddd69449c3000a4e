"""The Surrogate Attention Block, SAB (seed paper "Enhancing Transformer-based models for Long Sequence Time Series
Forecasting via Structured Matrix", §4.1, Eq. 1-2, and appendix A.3-A.4), as a token mixer of
:class:`ppma.nn.PPMABlock` (``mixer="sab"``) and on its own for ``[B, N, C]`` sequences.

Per head ``h`` the paper writes ``SA^(h)(X) = M^2((M^1 Q^(h)) ⊙ K^(h)) ⊙ V^(h)`` with ``Q, K, V = X M_Q, X M_K,
X M_V`` (Monarch projections, Eq. 1; :class:`ppma.nn.MonarchLinear`) and ``M^1, M^2`` the ``N x N`` structured
matrices of the FFT and its inverse, ``K`` being the convolution kernel (footnote to Eq. 2: ``K * X =
FFT^-1(FFT(X) FFT(K))``). Here, per channel ``c`` (the heads only group channels, and every channel is convolved on
its own, so the result does not depend on ``num_heads``)::

    Y[n, c] = V[n, c] * (1/N) sum_m K[m, c] Q[(n - m) mod N, c]       (1-D, N tokens)
    Y[i, j, c] = V[i, j, c] * (1/(H W)) sum_{a, b} K[a, b, c] Q[(i - a) mod H, (j - b) mod W, c]   (2-D map)

computed as ``irfft(rfft(Q) rfft(K)) / N`` (``rfft2``/``irfft2`` over ``H x W`` for maps), then ``out = Y W_out +
b_out`` (a dense ``nn.Linear``, the paper's ``W_out``).

**Circular, not linear, convolution.** ``M^1`` and ``M^2`` are ``N x N``: the ``N``-point DFT and its inverse, whose
product with a pointwise spectral factor is exactly the circular convolution above, with no padding (``O(N)``
memory). It lets every token reach every other (``K[m]`` connects token ``n - m mod N`` to token ``n`` for every
``m``); a linear convolution zero-padded to ``2N - 1`` with the ``N``-entry kernel ``K`` reaches only one side
(token ``n`` sees tokens ``<= n``, the causal form), and centring the kernel would halve the reach (``|n - m| <=
N/2``). On a map the wrap-around joins the top edge to the bottom and the left to the right; the block's
depthwise position encoding (``cpe``) tells the mixer where the edges are. ``causal=True`` (sequences only) is
the linear form for forecasting, zero-padded to ``2N``: ``Y[n] = V[n] (1/N) sum_{m <= n} K[m] Q[n - m]``.

**Scale.** ``1/N`` makes ``Y`` an average over the kernel, as attention's rows are averages (softmax weights sum to
one), so the output keeps its size for any number of tokens; ``torch.fft``'s default normalisation (inverse by
``1/N``) gives the plain sum, hence the extra ``1/N``.

Costs: ``O(N log N)`` time and ``O(N)`` memory per channel for any ``N, H, W`` (``torch.fft`` uses mixed-radix
and Bluestein transforms, so sizes need not be powers of two). Half-precision inputs are transformed in float32
(``torch.fft`` on CPU has no half types, on CUDA only for power-of-two sizes) and the result is cast back.
"""

from __future__ import annotations

import torch
from torch import nn

from ppma.nn.monarch import MonarchLinear

__all__ = ["SurrogateAttention", "surrogate_mixing"]


def surrogate_mixing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The token mixing of the SAB (module docstring): ``V ⊙ (K ⊛ Q) / N``, per channel.

    Args:
        q, k, v: ``[B, N, C]`` sequences or ``[B, H, W, C]`` maps of one shape (any ``N, H, W >= 1``; ``B`` or
            ``C`` may be 0, giving an empty result).
        causal: sequences only: the causal linear convolution (token ``n`` sees tokens ``<= n``) instead of the
            circular one.

    Returns:
        ``[B, N, C]`` or ``[B, H, W, C]`` in the dtype of ``v``.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError("surrogate_mixing: q, k and v must be tensors")
    if q.dim() not in (3, 4) or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"surrogate_mixing: q, k, v must all be [B, N, C] or all [B, H, W, C], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    sizes = tuple(q.shape[1:-1])
    if min(sizes) < 1:
        raise ValueError(f"surrogate_mixing: the token dimensions must be >= 1, got shape {tuple(q.shape)}")
    if causal and q.dim() != 3:
        raise ValueError(f"surrogate_mixing: causal=True needs [B, N, C] sequences, got shape {tuple(q.shape)}")
    ct = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if q.numel() == 0:
        # an empty batch or no channels: nothing to mix, and torch.fft refuses zero-sized transforms (MKL's
        # "inconsistent configuration"); the same elementwise product of empty tensors keeps the autograd graph
        return (q.to(ct) * k.to(ct)).to(v.dtype) * v
    # channels first, so that every transform runs over contiguous memory
    qc, kc = (t.to(ct).movedim(-1, 1).contiguous() for t in (q, k))  # [B, C, *sizes]
    n = 1
    for size in sizes:
        n *= size
    if q.dim() == 3:
        nfft = 2 * sizes[0] if causal else sizes[0]
        y = torch.fft.irfft(torch.fft.rfft(qc, n=nfft) * torch.fft.rfft(kc, n=nfft), n=nfft)[..., : sizes[0]]
    else:
        y = torch.fft.irfft2(torch.fft.rfft2(qc) * torch.fft.rfft2(kc), s=sizes)
    return (y.movedim(1, -1) / n).to(v.dtype) * v


class SurrogateAttention(nn.Module):
    """The Surrogate Attention Block: Monarch ``Q, K, V`` projections, the FFT long convolution gated by ``V``,
    a dense output projection (module docstring; seed paper §4.1, Eq. 1-2).

    Args:
        dim: channels ``C``.
        num_heads: heads of ``C / num_heads`` channels (must divide ``C``); the mixing is per channel, so the
            heads only name the paper's grouping (Eq. 2) and do not change the result.
        nblocks: blocks of the Monarch projections (default ``floor(sqrt(C))``, see :class:`MonarchLinear`).
        qkv_bias: biases of the ``Q, K, V`` projections.
        causal: sequences only: causal linear instead of circular convolution (see the module docstring).

    ``forward(x: [B, N, C] or [B, H, W, C], rope=None) -> same shape``; ``rope`` is accepted and ignored (the
    block passes the stage's rotary tables to whichever mixer it has).
    """

    def __init__(self, dim: int, num_heads: int = 1, *, nblocks: int | None = None, qkv_bias: bool = True,
                 causal: bool = False) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"SurrogateAttention: dim must be a positive int, got {dim!r}")
        if not isinstance(num_heads, int) or num_heads < 1 or dim % num_heads:
            raise ValueError(f"SurrogateAttention: num_heads must be a positive int dividing dim={dim}, "
                             f"got {num_heads!r}")
        self.dim, self.num_heads, self.causal = dim, num_heads, bool(causal)
        self.q = MonarchLinear(dim, dim, nblocks, bias=qkv_bias)
        self.k = MonarchLinear(dim, dim, nblocks, bias=qkv_bias)
        self.v = MonarchLinear(dim, dim, nblocks, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"SurrogateAttention: x must be [B, N, {self.dim}] or [B, H, W, {self.dim}], got {got}")
        if self.causal and x.dim() != 3:
            raise ValueError(f"SurrogateAttention: causal=True needs [B, N, C] sequences, got shape {tuple(x.shape)}")
        return self.proj(surrogate_mixing(self.q(x), self.k(x), self.v(x), causal=self.causal))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}"
