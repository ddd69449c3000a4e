"""``ppma.ops.polyline_attention_3d``: softmax attention under the 3-D polyline mask (paper appendix C.2, Eq. 40;
docs/video.md).

The fused kernel is ``torch.ops.ppma.polyline_attention_3d``; its fake (meta) kernel and autograd formula are
registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._validate import check_same_device, input_grads, is_empty, lse_dtype, no_double_backward, resolve_scale
from ppma.ops._validate_3d import run_fused_3d, check_attention_inputs_3d
from ppma.ops.reference_3d import polyline_attention_3d_ref

_OP = "polyline_attention_3d"


def polyline_attention_3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: torch.Tensor,
                          log_beta: torch.Tensor, log_gamma: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``out = 0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v``, ``S = scale q k^T`` over the ``N = T H W`` tokens,
    ``M`` the 3-D V2H polyline log-mask (``ppma.ops.reference_3d``). With ``T = 1`` it is
    ``ppma.ops.polyline_attention``.

    Args:
        q, k: ``[B, T, H, W, heads, d]``; v: ``[B, T, H, W, heads, dv]`` (same dtype and device).
        log_alpha, log_beta, log_gamma: ``[B, T, H, W, heads]`` log-decays (<= 0) along W / H / T; values below
            ``-1e4`` (down to ``-inf``) count as ``-1e4``.
        scale: logit scale (a real number), ``d ** -0.5`` when None.

    Returns:
        ``[B, T, H, W, heads, dv]`` in the dtype of ``v``. Never materialises an ``N x N`` tensor.
    """
    check_attention_inputs_3d(_OP, q, k, v, log_alpha, log_beta, log_gamma)
    scale = resolve_scale(_OP, scale, q.shape[-1])
    if not run_fused_3d(q) or is_empty(q, v):
        return polyline_attention_3d_ref(q, k, v, log_alpha, log_beta, log_gamma, scale)
    return torch.ops.ppma.polyline_attention_3d(q, k, v, log_alpha, log_beta, log_gamma, scale)[0]


def _fake(q, k, v, log_alpha, log_beta, log_gamma, scale):
    check_same_device(_OP, q=q, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta, log_gamma=log_gamma)
    return v.new_empty(v.shape), v.new_empty(v.shape), q.new_empty((*q.shape[:5], 2), dtype=lse_dtype(q))


def _fake_backward(grad_out, q, k, v, log_alpha, log_beta, log_gamma, out, out_v2h, lse, scale):
    check_same_device(_OP + "_backward", q=q, grad_out=grad_out, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta,
                      log_gamma=log_gamma, out=out, out_v2h=out_v2h, lse=lse)
    return tuple(t.new_empty(t.shape) for t in (q, k, v, log_alpha, log_beta, log_gamma))


def _setup_context(ctx, inputs, output):
    q, k, v, log_alpha, log_beta, log_gamma, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, log_alpha, log_beta, log_gamma, *output)


def _backward(ctx, grad_out, grad_out_v2h, grad_lse):
    # Only `out` is returned by the public wrapper; out_v2h and lse are saved statistics.
    no_double_backward(_OP)
    grads = torch.ops.ppma.polyline_attention_3d_backward(grad_out, *ctx.saved_tensors, ctx.scale)
    # the reference's floor rule for the decay gradients (docs/ops.md "Edges"), as the 2-D ops
    return input_grads(ctx, grads, log_decays=tuple(zip((3, 4, 5), ctx.saved_tensors[3:6])))


if _ext.has_ext():
    torch.library.register_fake("ppma::" + _OP)(_fake)
    torch.library.register_fake("ppma::" + _OP + "_backward")(_fake_backward)
    torch.library.register_autograd("ppma::" + _OP, _backward, setup_context=_setup_context)
