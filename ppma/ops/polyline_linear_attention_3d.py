"""``ppma.ops.polyline_linear_attention_3d``: 3-D PPMLA, linear attention under the 3-D polyline mask in linear time
and memory (paper appendix C.2 with the scan form of §4, Theorem 3; docs/video.md).

The fused kernel is ``torch.ops.ppma.polyline_linear_attention_3d``; its fake (meta) kernel and autograd formula
are registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._validate import check_linear_options, check_same_device, input_grads, is_empty, lse_dtype, no_double_backward
from ppma.ops._validate_3d import run_fused_3d, check_attention_inputs_3d
from ppma.ops.reference_3d import polyline_linear_attention_3d_ref

_OP = "polyline_linear_attention_3d"


def polyline_linear_attention_3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: torch.Tensor,
                                 log_beta: torch.Tensor, log_gamma: torch.Tensor, normalize: bool = True,
                                 eps: float = 1e-6) -> torch.Tensor:
    """With ``A = q k^T`` (no scale) and ``L = exp(M)`` the 3-D V2H mask:
    ``out = 0.5 (A*L) v / ((A*L) 1 + eps) + 0.5 (A*L^T) v / ((A*L^T) 1 + eps)`` (``normalize=False``: without the
    division), computed through the scan form ``q_p^T (L (k ⊗ [v, 1]))_p`` in time and memory linear in
    ``N = T H W``. With ``T = 1`` it is ``ppma.ops.polyline_linear_attention``.

    Args:
        q, k: ``[B, T, H, W, heads, d]`` non-negative features (the caller applies the feature map).
        v: ``[B, T, H, W, heads, dv]`` (same dtype and device).
        log_alpha, log_beta, log_gamma: ``[B, T, H, W, heads]`` log-decays (<= 0) along W / H / T.
        normalize (bool): divide each direction by its row sum (plus ``eps``).
        eps (float): ``>= 0``, added to each normaliser.

    Returns:
        ``[B, T, H, W, heads, dv]`` in the dtype of ``v``.
    """
    check_attention_inputs_3d(_OP, q, k, v, log_alpha, log_beta, log_gamma)
    check_linear_options(_OP, normalize, eps)
    if not run_fused_3d(q) or is_empty(q, v):
        return polyline_linear_attention_3d_ref(q, k, v, log_alpha, log_beta, log_gamma, normalize, eps)
    return torch.ops.ppma.polyline_linear_attention_3d(q, k, v, log_alpha, log_beta, log_gamma, normalize, eps)[0]


def _fake(q, k, v, log_alpha, log_beta, log_gamma, normalize, eps):
    check_same_device(_OP, q=q, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta, log_gamma=log_gamma)
    stats = q.new_empty((*v.shape[:5], 2, v.shape[-1] + int(normalize)), dtype=lse_dtype(q))
    return v.new_empty(v.shape), stats


def _fake_backward(grad_out, q, k, v, log_alpha, log_beta, log_gamma, stats, normalize, eps):
    check_same_device(_OP + "_backward", q=q, grad_out=grad_out, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta,
                      log_gamma=log_gamma, stats=stats)
    return tuple(t.new_empty(t.shape) for t in (q, k, v, log_alpha, log_beta, log_gamma))


def _setup_context(ctx, inputs, output):
    q, k, v, log_alpha, log_beta, log_gamma, normalize, eps = inputs
    ctx.normalize, ctx.eps = normalize, eps
    ctx.save_for_backward(q, k, v, log_alpha, log_beta, log_gamma, output[1])


def _backward(ctx, grad_out, grad_stats):
    no_double_backward(_OP)
    grads = torch.ops.ppma.polyline_linear_attention_3d_backward(grad_out, *ctx.saved_tensors, ctx.normalize,
                                                                 ctx.eps)
    # the reference's floor rule for the decay gradients (docs/ops.md "Edges"), as the 2-D ops
    return input_grads(ctx, grads, log_decays=tuple(zip((3, 4, 5), ctx.saved_tensors[3:6])), trailing=2)


if _ext.has_ext():
    torch.library.register_fake("ppma::" + _OP)(_fake)
    torch.library.register_fake("ppma::" + _OP + "_backward")(_fake_backward)
    torch.library.register_autograd("ppma::" + _OP, _backward, setup_context=_setup_context)
