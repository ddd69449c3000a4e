"""``ppma.ops.polyline_scan_3d``: the linear-time 3-D polyline product ``exp(M) x`` (paper appendix C.2 with
Algorithm 1; docs/video.md).

The fused kernel is ``torch.ops.ppma.polyline_scan_3d``; its fake (meta) kernel and autograd formula are
registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._validate import check_same_device, input_grads, is_empty, no_double_backward
from ppma.ops._validate_3d import run_fused_3d, check_scan_inputs_3d
from ppma.ops.reference_3d import polyline_scan_3d_ref

_OP = "polyline_scan_3d"


def polyline_scan_3d(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, log_gamma: torch.Tensor,
                     transpose: bool = False) -> torch.Tensor:
    """``y = exp(M) x`` (``transpose=True``: ``exp(M)^T x``) with ``M`` the 3-D V2H polyline log-mask, by three 1-D
    scans (along T with ``log_gamma``, H with ``log_beta``, W with ``log_alpha``; the reverse order for the
    transpose). With ``T = 1`` it is ``ppma.ops.polyline_scan``.

    Args:
        x: ``[B, T, H, W, heads, c]``.
        log_alpha, log_beta, log_gamma: ``[B, T, H, W, heads]`` log-decays (<= 0) along W / H / T; values below
            ``-1e4`` (down to ``-inf``, a decay of 0) cut the path.
        transpose (bool): apply ``exp(M)^T`` (the reverse path) instead of ``exp(M)``.

    Returns:
        ``[B, T, H, W, heads, c]`` in the dtype of ``x``, in linear time.
    """
    check_scan_inputs_3d(_OP, x, log_alpha, log_beta, log_gamma, transpose)
    if not run_fused_3d(x) or is_empty(x):
        return polyline_scan_3d_ref(x, log_alpha, log_beta, log_gamma, transpose)
    return torch.ops.ppma.polyline_scan_3d(x, log_alpha, log_beta, log_gamma, transpose)


def _fake(x, log_alpha, log_beta, log_gamma, transpose):
    check_same_device(_OP, x=x, log_alpha=log_alpha, log_beta=log_beta, log_gamma=log_gamma)
    return x.new_empty(x.shape)


def _fake_backward(grad_y, x, log_alpha, log_beta, log_gamma, transpose):
    check_same_device(_OP + "_backward", x=x, grad_y=grad_y, log_alpha=log_alpha, log_beta=log_beta,
                      log_gamma=log_gamma)
    return (x.new_empty(x.shape),) + tuple(t.new_empty(t.shape) for t in (log_alpha, log_beta, log_gamma))


def _setup_context(ctx, inputs, output):
    x, log_alpha, log_beta, log_gamma, transpose = inputs
    ctx.transpose = transpose
    ctx.save_for_backward(x, log_alpha, log_beta, log_gamma)


def _backward(ctx, grad_y):
    no_double_backward(_OP)
    grads = torch.ops.ppma.polyline_scan_3d_backward(grad_y, *ctx.saved_tensors, ctx.transpose)
    # the reference's floor rule for the decay gradients (docs/ops.md "Edges"), as the 2-D ops
    return input_grads(ctx, grads, log_decays=tuple(zip((1, 2, 3), ctx.saved_tensors[1:4])))


if _ext.has_ext():
    torch.library.register_fake("ppma::" + _OP)(_fake)
    torch.library.register_fake("ppma::" + _OP + "_backward")(_fake_backward)
    torch.library.register_autograd("ppma::" + _OP, _backward, setup_context=_setup_context)
