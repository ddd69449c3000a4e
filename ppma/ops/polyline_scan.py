"""``ppma.ops.polyline_scan``: the linear-time polyline product ``L x`` (spec §2, Algorithm 1).

The fused kernel is ``torch.ops.ppma.polyline_scan``; its fake (meta) kernel and autograd formula are
registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._validate import check_scan_inputs, input_grads, no_double_backward, use_fused
from ppma.ops.reference import polyline_scan_ref

_OP = "polyline_scan"


def polyline_scan(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, transpose: bool = False
) -> torch.Tensor:
    """``y = L x`` (``transpose=True``: ``L^T x``) with ``L`` the V2H polyline mask, computed by 1-D scans
    along columns then rows. ``x: [B, H, W, heads, c]`` -> ``[B, H, W, heads, c]``.

    Args:
        x: ``[B, H, W, heads, c]``.
        log_alpha, log_beta: ``[B, H, W, heads]`` log-decays (<= 0) along rows / columns.
        transpose: apply ``L^T`` (rows first, then columns; the H2V mask) instead of ``L``.

    Returns:
        ``[B, H, W, heads, c]`` in the dtype of ``x``, in linear time.
    """
    check_scan_inputs(_OP, x, log_alpha, log_beta)
    if not use_fused(x):
        return polyline_scan_ref(x, log_alpha, log_beta, transpose)
    return torch.ops.ppma.polyline_scan(x, log_alpha, log_beta, bool(transpose))


def _fake(x, log_alpha, log_beta, transpose):
    return x.new_empty(x.shape)


def _fake_backward(grad_y, x, log_alpha, log_beta, transpose):
    return x.new_empty(x.shape), log_alpha.new_empty(log_alpha.shape), log_beta.new_empty(log_beta.shape)


def _setup_context(ctx, inputs, output):
    x, log_alpha, log_beta, transpose = inputs
    ctx.transpose = transpose
    ctx.save_for_backward(x, log_alpha, log_beta)


def _backward(ctx, grad_y):
    no_double_backward(_OP)
    x, log_alpha, log_beta = ctx.saved_tensors
    grads = torch.ops.ppma.polyline_scan_backward(grad_y, x, log_alpha, log_beta, ctx.transpose)
    return input_grads(ctx, grads)


if _ext.has_ext():
    torch.library.register_fake("ppma::polyline_scan")(_fake)
    torch.library.register_fake("ppma::polyline_scan_backward")(_fake_backward)
    torch.library.register_autograd("ppma::polyline_scan", _backward, setup_context=_setup_context)
