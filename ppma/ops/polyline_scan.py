"""``ppma.ops.polyline_scan``: the linear-time polyline product ``L x`` (docs/model.md §2, Algorithm 1).

The fused kernel is ``torch.ops.ppma.polyline_scan``; its fake (meta) kernel and autograd formula are
registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._dispatch import run_fused
from ppma.ops._validate import check_same_device, check_scan_inputs, input_grads, is_empty, no_double_backward
from ppma.ops.reference import polyline_scan_ref

_OP = "polyline_scan"


def polyline_scan(
    x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, transpose: bool = False
) -> torch.Tensor:
    """``y = L x`` (``transpose=True``: ``L^T x``) with ``L`` the V2H polyline mask, computed by 1-D scans
    along columns then rows. ``x: [B, H, W, heads, c]`` -> ``[B, H, W, heads, c]``.

    Args:
        x: ``[B, H, W, heads, c]``.
        log_alpha, log_beta: ``[B, H, W, heads]`` log-decays (<= 0) along rows / columns; ``-inf`` (a decay
            of 0) cuts the path, like any value below ``-1e4``.
        transpose (bool): apply ``L^T`` (rows first, then columns; the H2V mask) instead of ``L``.

    Returns:
        ``[B, H, W, heads, c]`` in the dtype of ``x``, in linear time.
    """
    check_scan_inputs(_OP, x, log_alpha, log_beta, transpose)
    if not run_fused(x) or is_empty(x):
        return polyline_scan_ref(x, log_alpha, log_beta, transpose)
    return torch.ops.ppma.polyline_scan(x, log_alpha, log_beta, transpose)


def _fake(x, log_alpha, log_beta, transpose):
    check_same_device(_OP, x=x, log_alpha=log_alpha, log_beta=log_beta)
    return x.new_empty(x.shape)


def _fake_backward(grad_y, x, log_alpha, log_beta, transpose):
    check_same_device(_OP + "_backward", x=x, grad_y=grad_y, log_alpha=log_alpha, log_beta=log_beta)
    return x.new_empty(x.shape), log_alpha.new_empty(log_alpha.shape), log_beta.new_empty(log_beta.shape)


def _setup_context(ctx, inputs, output):
    x, log_alpha, log_beta, transpose = inputs
    ctx.transpose = transpose
    ctx.save_for_backward(x, log_alpha, log_beta)


def _backward(ctx, grad_y):
    no_double_backward(_OP)
    x, log_alpha, log_beta = ctx.saved_tensors
    grads = torch.ops.ppma.polyline_scan_backward(grad_y, x, log_alpha, log_beta, ctx.transpose)
    return input_grads(ctx, grads, log_decays=((1, log_alpha), (2, log_beta)))


if _ext.has_ext():
    torch.library.register_fake("ppma::polyline_scan")(_fake)
    torch.library.register_fake("ppma::polyline_scan_backward")(_fake_backward)
    torch.library.register_autograd("ppma::polyline_scan", _backward, setup_context=_setup_context)
