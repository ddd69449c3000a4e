"""FLOP formulas of the fused ppma ops for ``torch.utils.flop_counter.FlopCounterMode`` (docs/model.md §4.1).

Counting convention (the one behind the official 2.696 / 4.896 / 10.593 GMACs at 224², fvcore style):
convolutions and matrix products only (``aten.convolution``, ``aten.mm``/``addmm``/``bmm``); no softmax,
norms, activations or elementwise ops. FlopCounterMode counts ``2 * MACs`` per product, so GMACs are
``total_flops / 2``. The reference ops decompose into ``bmm`` and are counted as-is; the fused ops are
opaque to FlopCounterMode, so the formulas below count the same products:

* ``polyline_attention`` ("full"): ``q k^T`` and ``P v`` over all ``N = H W`` tokens:
  ``2 * B * heads * N^2 * (d + dv)`` FLOPs (one ``P``: the official code sums the two softmaxes
  before the single ``P v``).
* ``criss_cross_attention``: row logits ``B heads H W^2 d``, column logits ``B heads W H^2 d`` and four
  map-times-value products ``2 B heads (H W^2 + W H^2) dv``, times 2 for FLOPs.

Backward ops are counted as twice the forward products (each ``C = A B`` has two gradient products of the
same size) plus the recomputation of the logits, as torch counts its fused attention backward.

Structured-matrix blocks (``mixer="sab"``, ``mlp="monarch"``; docs/ops.md "Surrogate Attention Block"):

* ``MonarchLinear`` runs two ``bmm`` of its block-diagonal factors and is counted by FlopCounterMode as is:
  ``b q (p + s)`` MACs per token (the permutations, padding and truncation are copies, not counted).
* FFTs (``aten._fft_r2c`` / ``_fft_c2r`` / ``_fft_c2c``), which FlopCounterMode does not count by itself, are
  registered here by :func:`register_fft_flop_formulas`: a transform of ``n`` points (the product of the
  transformed sizes) counts ``2.5 n log2 n`` FLOPs when its input or output is real (the radix-2 count
  ``5 n log2 n`` of a complex FFT, halved for real data) and ``5 n log2 n`` when both are complex, times the
  number of transforms (batch and channels). A convention, not a measurement of the library's mixed-radix or
  Bluestein transforms. The spectral products are elementwise and not counted, like every elementwise op.
"""

from __future__ import annotations

import math

import torch

__all__ = ["register_flop_formulas", "register_fft_flop_formulas", "fft_flops", "polyline_attention_flops",
           "criss_cross_attention_flops", "count_macs"]

_REGISTERED = False
_FFT_REGISTERED = False


def polyline_attention_flops(q_shape, v_shape) -> int:
    """FLOPs of the full-mode products for ``q: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``."""
    B, H, W, G, d = q_shape
    dv = v_shape[-1]
    N = H * W
    return 2 * B * G * N * N * (d + dv)


def criss_cross_attention_flops(q_shape, v_shape) -> int:
    """FLOPs of the criss-cross products for ``q: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``."""
    B, H, W, G, d = q_shape
    dv = v_shape[-1]
    line_pairs = H * W * W + W * H * H  # (query, key) pairs of all row and column attentions
    return 2 * B * G * line_pairs * (d + 2 * dv)


def _logit_flops(q_shape, full: bool) -> int:
    B, H, W, G, d = q_shape
    pairs = (H * W) ** 2 if full else H * W * W + W * H * H
    return 2 * B * G * pairs * d


def fft_flops(shape, dims, real: bool) -> int:
    """FLOPs of the transforms over ``dims`` of a tensor of ``shape`` (the complex or real full-size shape):
    ``(2.5 if real else 5) n log2 n`` per transform of ``n = prod(shape[d] for d in dims)`` points."""
    n = 1
    for d in dims:
        n *= int(shape[d])
    total = 1
    for size in shape:
        total *= int(size)
    if n <= 1 or total == 0:
        return 0
    return int(round((2.5 if real else 5.0) * n * math.log2(n) * (total // n)))


def register_fft_flop_formulas() -> None:
    """Register :func:`fft_flops` for ``aten._fft_r2c``, ``_fft_c2r`` and ``_fft_c2c`` (once; module docstring)."""
    global _FFT_REGISTERED
    if _FFT_REGISTERED:
        return
    from torch.utils.flop_counter import register_flop_formula

    aten = torch.ops.aten

    @register_flop_formula(aten._fft_r2c)
    def _r2c(x_shape, dim, *args, out_shape=None, **kwargs) -> int:
        return fft_flops(x_shape, dim, real=True)  # the real input has the full size

    @register_flop_formula(aten._fft_c2r)
    def _c2r(x_shape, dim, *args, out_shape=None, **kwargs) -> int:
        return fft_flops(out_shape, dim, real=True)  # the real output has the full size

    @register_flop_formula(aten._fft_c2c)
    def _c2c(x_shape, dim, *args, out_shape=None, **kwargs) -> int:
        return fft_flops(x_shape, dim, real=False)

    _FFT_REGISTERED = True


def register_flop_formulas() -> bool:
    """Register the formulas for ``torch.ops.ppma.*`` if the compiled ops exist. Returns whether they do."""
    global _REGISTERED
    from ppma._ext import has_ext

    if _REGISTERED:
        return True
    if not has_ext():
        return False
    from torch.utils.flop_counter import register_flop_formula

    ops = torch.ops.ppma

    @register_flop_formula(ops.polyline_attention)
    def _pa(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return polyline_attention_flops(q, v)

    @register_flop_formula(ops.polyline_attention_inference)
    def _pa_inference(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return polyline_attention_flops(q, v)

    @register_flop_formula(ops.criss_cross_attention)
    def _cc(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return criss_cross_attention_flops(q, v)

    @register_flop_formula(ops.polyline_attention_backward)
    def _pa_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return 2 * polyline_attention_flops(q, v) + _logit_flops(q, True)

    @register_flop_formula(ops.criss_cross_attention_backward)
    def _cc_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return 2 * criss_cross_attention_flops(q, v) + _logit_flops(q, False)

    _REGISTERED = True
    return True


def count_macs(model: torch.nn.Module, input_size=(1, 3, 224, 224)) -> int:
    """Multiply-accumulates of one inference forward pass (``FlopCounterMode`` FLOPs / 2).

    Counts convolutions and matrix products, including the attention products of the reference and
    (with :func:`register_flop_formulas`) the fused ops, and FFTs (:func:`register_fft_flop_formulas`).
    ``input_size``: ``(B, C, H, W)``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    register_flop_formulas()
    register_fft_flop_formulas()
    p = next(model.parameters())
    x = torch.zeros(input_size, dtype=p.dtype, device=p.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    return counter.get_total_flops() // 2


