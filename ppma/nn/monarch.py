"""Monarch matrices of order 2 as a linear layer (seed paper "Enhancing Transformer-based models for Long Sequence
Time Series Forecasting via Structured Matrix", §3.2, §4.1.1 Eq. 1, §4.2 Eq. 5 and appendix A.3; after Dao et al.,
"Monarch: Expressive Structured Matrices for Efficient and Accurate Training", ICML 2022).

A square Monarch matrix of order 2 and size ``n = b^2`` is ``M = P L P^T R P``: ``R`` and ``L`` are block-diagonal
with ``b`` dense ``b x b`` blocks and ``P`` is the stride permutation (write a length-``n`` vector as a ``b x b``
matrix row by row and read it column by column; ``P = P^T`` when the matrix is square). ``y = M x`` costs
``2 n sqrt(n)`` multiply-adds and ``M`` has ``2 n sqrt(n)`` parameters instead of ``n^2``.

:class:`MonarchLinear` generalises it to ``in_features -> out_features`` with ``b = nblocks`` blocks in both factors
(the rectangular Monarch layer of Dao et al.). With ``p = ceil(in / b)``, ``s = ceil(out / b)`` and
``q = min(p, s)``, for one input vector ``x``:

1. pad ``x`` with zeros to ``b p`` entries (the padding columns of ``M`` are never used);
2. ``P_in``: view it as ``[p, b]`` (row-major) and transpose to ``[b, p]``: block ``k`` sees ``x[k], x[k + b], ...``;
3. ``R``: ``b`` blocks ``[q, p]``, block ``k`` maps row ``k`` -> ``[b, q]``;
4. ``P_mid``: flatten, view as ``[q, b]`` and transpose to ``[b, q]``;
5. ``L``: ``b`` blocks ``[s, q]``, block ``k`` maps row ``k`` -> ``[b, s]``;
6. ``P_out``: transpose to ``[s, b]``, flatten to ``b s`` entries and keep the first ``out_features``.

For ``in = out = b^2`` every ``P`` is the stride permutation of the ``b x b`` square and ``M = P L P R P`` (the
paper's ``P L P^T R P``). Every output depends on every input when ``q >= b`` (each ``L`` block reads ``q``
consecutive-modulo-``b`` entries of the middle vector, so it sees every ``R`` block); the default
``nblocks = floor(sqrt(min(in, out)))`` guarantees it and a larger ``nblocks`` is refused.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["MonarchLinear", "monarch_shapes"]


def monarch_shapes(in_features: int, out_features: int, nblocks: int | None = None) -> tuple[int, int, int, int]:
    """``(b, p, q, s)`` of :class:`MonarchLinear` (see the module docstring); raises ``ValueError`` on bad shapes."""
    for name, v in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"MonarchLinear: {name} must be a positive int, got {v!r}")
    limit = math.isqrt(min(in_features, out_features))
    if nblocks is None:
        nblocks = limit
    if not isinstance(nblocks, int) or isinstance(nblocks, bool) or nblocks < 1:
        raise ValueError(f"MonarchLinear: nblocks must be a positive int or None, got {nblocks!r}")
    b = nblocks
    p, s = -(-in_features // b), -(-out_features // b)
    q = min(p, s)
    if q < b:
        raise ValueError(
            f"MonarchLinear: nblocks={b} is too large for in_features={in_features}, out_features={out_features}: "
            f"the blocks of the two factors would not connect every input to every output (needs "
            f"min(ceil(in/nblocks), ceil(out/nblocks)) >= nblocks, i.e. nblocks <= {limit} here)"
        )
    return b, p, q, s


class MonarchLinear(nn.Module):
    """``y = x M^T + bias`` with ``M`` an order-2 Monarch matrix ``[out_features, in_features]`` (module docstring).

    Args:
        in_features, out_features: sizes of the input and output (any positive ints; the input is zero-padded to
            ``nblocks * ceil(in / nblocks)`` entries, the output is truncated from ``nblocks * ceil(out /
            nblocks)`` entries, both at the end).
        nblocks: blocks ``b`` in each of the two block-diagonal factors; default ``floor(sqrt(min(in, out)))``
            (``sqrt(n)`` for a square ``n = b^2``). Must satisfy ``min(ceil(in/b), ceil(out/b)) >= b``.
        bias: add a learnable bias ``[out_features]``.

    Parameters: ``blocks_r [b, q, p]`` (``R``, applied first) and ``blocks_l [b, s, q]`` (``L``), and ``bias``:
    ``b q (p + s)`` weights instead of ``in * out``; the forward costs as many multiply-adds per token (two
    batched matrix products). Initialisation: the entries of ``M`` have the variance of ``nn.Linear``'s default
    (``1 / (3 in)``), the bias is ``U(-1/sqrt(in), 1/sqrt(in))`` like ``nn.Linear``'s.

    ``forward(x: [..., in_features]) -> [..., out_features]``; :meth:`to_dense` returns ``M`` so that
    ``forward(x) == x @ to_dense().T + bias``.
    """

    def __init__(self, in_features: int, out_features: int, nblocks: int | None = None, bias: bool = True) -> None:
        super().__init__()
        b, p, q, s = monarch_shapes(in_features, out_features, nblocks)
        self.in_features, self.out_features = in_features, out_features
        self.nblocks, self.in_block, self.mid_block, self.out_block = b, p, q, s
        self.blocks_r = nn.Parameter(torch.empty(b, q, p))
        self.blocks_l = nn.Parameter(torch.empty(b, s, q))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform factors with ``Var(M_ij) = 1 / (3 in)``; ``nn.Linear``'s bias init.

        An entry of ``M`` sums about ``q / b`` products ``L R`` (one when square: an entry of a square Monarch
        matrix is a single product), so ``Var(R) = 1 / (3 p)`` and ``Var(L) = b p / (q in)``."""
        b, p, q = self.nblocks, self.in_block, self.mid_block
        bound_r = 1.0 / math.sqrt(p)
        bound_l = math.sqrt(3.0 * b * p / (q * self.in_features))
        nn.init.uniform_(self.blocks_r, -bound_r, bound_r)
        nn.init.uniform_(self.blocks_l, -bound_l, bound_l)
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def _apply_factors(self, x: torch.Tensor) -> torch.Tensor:
        """Steps 1-6 of the module docstring on ``x: [T, in_features]`` -> ``[T, out_features]`` (no bias)."""
        b, p, q, s = self.nblocks, self.in_block, self.mid_block, self.out_block
        T = x.shape[0]
        if b * p != self.in_features:
            x = nn.functional.pad(x, (0, b * p - self.in_features))
        x = x.reshape(T, p, b).permute(2, 0, 1)  # P_in: [b, T, p], block k holds x[k + b i]
        y = torch.bmm(x, self.blocks_r.transpose(1, 2))  # R: [b, T, q]
        y = y.permute(1, 0, 2).reshape(T, q, b).permute(2, 0, 1)  # P_mid: [b, T, q]
        z = torch.bmm(y, self.blocks_l.transpose(1, 2))  # L: [b, T, s]
        z = z.permute(1, 2, 0).reshape(T, s * b)  # P_out
        return z[:, : self.out_features] if s * b != self.out_features else z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MonarchLinear: x must be [..., {self.in_features}], got {got}")
        lead = x.shape[:-1]
        y = self._apply_factors(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y

    def to_dense(self) -> torch.Tensor:
        """The Monarch matrix ``M`` as a dense ``[out_features, in_features]`` tensor (differentiable)."""
        eye = torch.eye(self.in_features, dtype=self.blocks_r.dtype, device=self.blocks_r.device)
        return self._apply_factors(eye).T  # row i of the product is M e_i, i.e. column i of M

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, nblocks={self.nblocks}, "
                f"blocks_r={tuple(self.blocks_r.shape)}, blocks_l={tuple(self.blocks_l.shape)}, "
                f"bias={self.bias is not None}")
