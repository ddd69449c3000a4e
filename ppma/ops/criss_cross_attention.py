"""``ppma.ops.criss_cross_attention``: the official "chunk" mode (docs/model.md §3.3, docs/design.md §2).

The fused kernel is ``torch.ops.ppma.criss_cross_attention``; its fake (meta) kernel and autograd
formula are registered here, next to the wrapper.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._dispatch import run_fused
from ppma.ops._validate import (
    check_attention_inputs,
    fake_attention_grads,
    fake_attention_out_lse,
    input_grads,
    is_empty,
    no_double_backward,
    resolve_scale,
)
from ppma.ops.reference import criss_cross_attention_ref

_OP = "criss_cross_attention"


def criss_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``out = 0.5 B (A v) + 0.5 A (B v)`` with ``A`` the decay-masked row attention and ``B`` the column
    attention (docs/model.md §1.6). ``[B, H, W, heads, d]`` inputs -> ``[B, H, W, heads, dv]``.

    Args:
        q, k: ``[B, H, W, heads, d]``; v: ``[B, H, W, heads, dv]`` (same dtype and device).
        log_alpha, log_beta: ``[B, H, W, heads]`` log-decays (<= 0) along rows / columns; values below
            ``-1e4`` (down to ``-inf``, a decay of 0) count as ``-1e4``, whose path weight is 0.
        scale: logit scale (a real number), ``d ** -0.5`` when None.

    Returns:
        ``[B, H, W, heads, dv]`` in the dtype of ``v``. Runs the compiled kernel or the reference as
        ``ppma.ops.set_impl`` says; NaN/Inf propagate as in the reference.
    """
    check_attention_inputs(_OP, q, k, v, log_alpha, log_beta)
    scale = resolve_scale(_OP, scale, q.shape[-1])
    if not run_fused(q) or is_empty(q, v):
        return criss_cross_attention_ref(q, k, v, log_alpha, log_beta, scale)
    return torch.ops.ppma.criss_cross_attention(q, k, v, log_alpha, log_beta, scale)[0]


def _fake(q, k, v, log_alpha, log_beta, scale):
    return fake_attention_out_lse(_OP, q, k, v, log_alpha, log_beta)


def _fake_backward(grad_out, q, k, v, log_alpha, log_beta, lse, scale):
    return fake_attention_grads(_OP + "_backward", grad_out, q, k, v, log_alpha, log_beta, lse=lse)


def _setup_context(ctx, inputs, output):
    q, k, v, log_alpha, log_beta, scale = inputs
    _, lse = output
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, log_alpha, log_beta, lse)


def _backward(ctx, grad_out, grad_lse):
    no_double_backward(_OP)
    q, k, v, log_alpha, log_beta, lse = ctx.saved_tensors
    grads = torch.ops.ppma.criss_cross_attention_backward(grad_out, q, k, v, log_alpha, log_beta, lse, ctx.scale)
    return input_grads(ctx, grads, log_decays=((3, log_alpha), (4, log_beta)))


if _ext.has_ext():
    torch.library.register_fake("ppma::criss_cross_attention")(_fake)
    torch.library.register_fake("ppma::criss_cross_attention_backward")(_fake_backward)
    torch.library.register_autograd("ppma::criss_cross_attention", _backward, setup_context=_setup_context)
