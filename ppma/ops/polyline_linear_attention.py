"""``ppma.ops.polyline_linear_attention``: polyline path masked linear attention, PPMLA, in O(N)
(docs/model.md §2, Theorem 3 and A.7; docs/ops.md "polyline_linear_attention").

The fused kernel is ``torch.ops.ppma.polyline_linear_attention`` (CPU and CUDA); its fake (meta) kernel and
autograd formula are registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._dispatch import run_fused
from ppma.ops._validate import (
    check_attention_inputs,
    check_linear_options,
    check_same_device,
    fake_attention_grads,
    input_grads,
    is_empty,
    lse_dtype,
    no_double_backward,
)
from ppma.ops.reference import polyline_linear_attention_ref

_OP = "polyline_linear_attention"


def polyline_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Linear attention under the polyline mask: with ``A = q k^T`` (no scale) and ``L`` the V2H mask,
    ``out = 0.5 (A*L) v / ((A*L) 1 + eps) + 0.5 (A*L^T) v / ((A*L^T) 1 + eps)`` (per query row;
    ``normalize=False``: ``0.5 (A*L) v + 0.5 (A*L^T) v``), computed through the scan form
    ``q_p^T (L (k ⊗ v))_p`` in time and memory linear in ``N = H W``.

    Args:
        q, k: ``[B, H, W, heads, d]`` non-negative features (the caller applies the feature map, e.g.
            ``elu(x) + 1``; negative values are computed as given, but the normaliser may then vanish).
        v: ``[B, H, W, heads, dv]`` (same dtype and device).
        log_alpha, log_beta: ``[B, H, W, heads]`` log-decays (<= 0) along rows / columns; values below
            ``-1e4`` (down to ``-inf``) count as ``-1e4``, whose path weight is 0.
        normalize (bool): divide each direction by its row sum (plus ``eps``).
        eps (float): ``>= 0``, added to each normaliser.

    Returns:
        ``[B, H, W, heads, dv]`` in the dtype of ``v``. Runs the compiled kernel or the reference as
        ``ppma.ops.set_impl`` says (the reference builds ``N x N`` matrices).
    """
    check_attention_inputs(_OP, q, k, v, log_alpha, log_beta)
    check_linear_options(_OP, normalize, eps)
    if not run_fused(q) or is_empty(q, v):
        return polyline_linear_attention_ref(q, k, v, log_alpha, log_beta, normalize, eps)
    return torch.ops.ppma.polyline_linear_attention(q, k, v, log_alpha, log_beta, normalize, eps)[0]


def _fake(q, k, v, log_alpha, log_beta, normalize, eps):
    check_same_device(_OP, q=q, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta)
    B, H, W, G, dv = v.shape
    stats = q.new_empty((B, H, W, G, 2, dv + int(normalize)), dtype=lse_dtype(q))
    return v.new_empty(v.shape), stats


def _fake_backward(grad_out, q, k, v, log_alpha, log_beta, stats, normalize, eps):
    return fake_attention_grads(_OP + "_backward", grad_out, q, k, v, log_alpha, log_beta, stats=stats)


def _setup_context(ctx, inputs, output):
    q, k, v, log_alpha, log_beta, normalize, eps = inputs
    _, stats = output
    ctx.normalize, ctx.eps = normalize, eps
    ctx.save_for_backward(q, k, v, log_alpha, log_beta, stats)


def _backward(ctx, grad_out, grad_stats):
    # Only `out` is returned by the public wrapper; stats are saved for the backward pass.
    no_double_backward(_OP)
    q, k, v, log_alpha, log_beta, stats = ctx.saved_tensors
    grads = torch.ops.ppma.polyline_linear_attention_backward(
        grad_out, q, k, v, log_alpha, log_beta, stats, ctx.normalize, ctx.eps
    )
    return input_grads(ctx, grads, log_decays=((3, log_alpha), (4, log_beta)), trailing=2)


if _ext.has_ext():
    torch.library.register_fake("ppma::polyline_linear_attention")(_fake)
    torch.library.register_fake("ppma::polyline_linear_attention_backward")(_fake_backward)
    torch.library.register_autograd("ppma::polyline_linear_attention", _backward, setup_context=_setup_context)
