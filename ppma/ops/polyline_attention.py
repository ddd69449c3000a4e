"""``ppma.ops.polyline_attention``: the official "whole" mode (docs/model.md §3.4, docs/design.md §2).

The fused kernel is ``torch.ops.ppma.polyline_attention``; its fake (meta) kernel and autograd formula
are registered here, next to the wrapper (extension-cpp pattern).
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops._dispatch import run_fused
from ppma.ops._validate import (
    check_attention_inputs,
    check_same_device,
    fake_attention_grads,
    fake_attention_out_lse,
    input_grads,
    is_empty,
    lse_dtype,
    no_double_backward,
    records_grad,
    resolve_scale,
)
from ppma.ops.reference import polyline_attention_ref

_OP = "polyline_attention"
# The CPU training forward of float32 / float64 inputs: out and lse without out_v2h (one P v product); its backward
# forms the rows' D terms from the maps.
_LSE_OP = "polyline_attention_lse"
_HAS_LSE_OP = _ext.has_ext()


def polyline_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``out = 0.5 softmax(S + M) v + 0.5 softmax(S + M^T) v`` with ``S = scale q k^T`` and ``M`` the
    V2H polyline log-mask (docs/model.md §1.6). ``[B, H, W, heads, d]`` inputs -> ``[B, H, W, heads, dv]``.

    Args:
        q, k: ``[B, H, W, heads, d]``; v: ``[B, H, W, heads, dv]`` (same dtype and device).
        log_alpha, log_beta: ``[B, H, W, heads]`` log-decays (<= 0) along rows / columns; values below
            ``-1e4`` (down to ``-inf``, a decay of 0) count as ``-1e4``, whose path weight is 0.
        scale: logit scale (a real number), ``d ** -0.5`` when None.

    Returns:
        ``[B, H, W, heads, dv]`` in the dtype of ``v``. Never materialises an ``N x N`` tensor. Runs the
        compiled kernel or the reference as ``ppma.ops.set_impl`` says; NaN/Inf propagate as in the reference.
        On the CPU, when no gradient is needed (``torch.no_grad()``, ``torch.inference_mode()`` or inputs
        that do not require grad) it runs ``torch.ops.ppma.polyline_attention_inference``, which keeps no
        statistics for a backward pass and forms the output with one ``P v`` product (the same numbers up
        to float rounding; docs/ops.md "polyline_attention"); in training it runs
        ``torch.ops.ppma.polyline_attention_lse``, the same single product plus the softmaxes' statistics, whose
        backward takes the rows' ``D`` terms from the maps instead of a kept ``out_v2h``.
    """
    check_attention_inputs(_OP, q, k, v, log_alpha, log_beta)
    scale = resolve_scale(_OP, scale, q.shape[-1])
    if not run_fused(q) or is_empty(q, v):
        return polyline_attention_ref(q, k, v, log_alpha, log_beta, scale)
    if q.device.type == "cpu":
        if not records_grad(q, k, v, log_alpha, log_beta):
            return torch.ops.ppma.polyline_attention_inference(q, k, v, log_alpha, log_beta, scale)
        if _HAS_LSE_OP and k.dtype == q.dtype and v.dtype == q.dtype:
            return torch.ops.ppma.polyline_attention_lse(q, k, v, log_alpha, log_beta, scale)[0]
    return torch.ops.ppma.polyline_attention(q, k, v, log_alpha, log_beta, scale)[0]


def _fake(q, k, v, log_alpha, log_beta, scale):
    check_same_device(_OP, q=q, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta)
    B, H, W, G, _ = q.shape
    out = v.new_empty(v.shape)
    return out, v.new_empty(v.shape), q.new_empty((B, H, W, G, 2), dtype=lse_dtype(q))


def _fake_inference(q, k, v, log_alpha, log_beta, scale):
    check_same_device(_OP + "_inference", q=q, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta)
    return v.new_empty(v.shape)


def _fake_backward(grad_out, q, k, v, log_alpha, log_beta, out, out_v2h, lse, scale):
    return fake_attention_grads(_OP + "_backward", grad_out, q, k, v, log_alpha, log_beta, out=out, out_v2h=out_v2h,
                                lse=lse)


def _setup_context(ctx, inputs, output):
    q, k, v, log_alpha, log_beta, scale = inputs
    out, out_v2h, lse = output
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, log_alpha, log_beta, out, out_v2h, lse)


def _backward(ctx, grad_out, grad_out_v2h, grad_lse):
    # Only `out` is returned by the public wrapper; out_v2h and lse are saved statistics.
    no_double_backward(_OP)
    q, k, v, log_alpha, log_beta, out, out_v2h, lse = ctx.saved_tensors
    gscale = _fp16_grad_scale(grad_out)
    if gscale is not None:  # in fp32: the scale itself may exceed fp16's range
        grad_out = (grad_out.float() * gscale).to(grad_out.dtype)
    grads = torch.ops.ppma.polyline_attention_backward(
        grad_out, q, k, v, log_alpha, log_beta, out, out_v2h, lse, ctx.scale
    )
    if gscale is not None:
        grads = tuple((g.float() / gscale).to(g.dtype) for g in grads)
    return input_grads(ctx, grads, log_decays=((3, log_alpha), (4, log_beta)))


def _fake_lse(q, k, v, log_alpha, log_beta, scale):
    return fake_attention_out_lse(_LSE_OP, q, k, v, log_alpha, log_beta)


def _fake_lse_backward(grad_out, q, k, v, log_alpha, log_beta, lse, scale):
    return fake_attention_grads(_LSE_OP + "_backward", grad_out, q, k, v, log_alpha, log_beta, lse=lse)


def _setup_lse_context(ctx, inputs, output):
    q, k, v, log_alpha, log_beta, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, log_alpha, log_beta, output[1])


def _lse_backward(ctx, grad_out, grad_lse):
    # Only `out` is returned by the public wrapper; lse is a saved statistic.
    no_double_backward(_OP)
    q, k, v, log_alpha, log_beta, lse = ctx.saved_tensors
    grads = torch.ops.ppma.polyline_attention_lse_backward(grad_out, q, k, v, log_alpha, log_beta, lse, ctx.scale)
    return input_grads(ctx, grads, log_decays=((3, log_alpha), (4, log_beta)))


def _no_inference_backward(ctx, grad_out):
    raise RuntimeError(
        "ppma::polyline_attention_inference keeps no statistics and has no backward; call "
        "ppma.ops.polyline_attention (which runs it only when no gradient is needed)"
    )


def _fp16_grad_scale(grad_out: torch.Tensor) -> torch.Tensor | None:
    """A power of two that brings ``max |grad_out|`` into [1, 2) for fp16 on CUDA, else None.

    The tensor-core backward rounds ``dS`` to fp16 before its products (docs/ops.md "polyline_attention"); for
    output gradients much smaller than 1 (unscaled fp16 training) ``dS`` would fall below fp16's normal range and
    lose its bits. Scaling by a power of two and dividing the gradients by it afterwards is exact (no sync: the
    scale stays a device tensor); an all-zero or non-finite ``grad_out`` keeps the scale 1."""
    if grad_out.dtype != torch.float16 or grad_out.device.type != "cuda":
        return None
    e = torch.floor(torch.log2(grad_out.detach().abs().amax().float()))
    return torch.where(torch.isfinite(e), torch.exp2(-e), torch.ones_like(e))


if _ext.has_ext():
    torch.library.register_fake("ppma::polyline_attention")(_fake)
    torch.library.register_fake("ppma::polyline_attention_backward")(_fake_backward)
    torch.library.register_fake("ppma::polyline_attention_inference")(_fake_inference)
    torch.library.register_autograd("ppma::polyline_attention_inference", _no_inference_backward)
    torch.library.register_autograd("ppma::polyline_attention", _backward, setup_context=_setup_context)
if _HAS_LSE_OP:
    torch.library.register_fake("ppma::" + _LSE_OP)(_fake_lse)
    torch.library.register_fake("ppma::" + _LSE_OP + "_backward")(_fake_lse_backward)
    torch.library.register_autograd("ppma::" + _LSE_OP, _lse_backward, setup_context=_setup_lse_context)
