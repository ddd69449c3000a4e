"""Input validation and dispatch helpers shared by the public op wrappers (design §2).

Errors name the argument and print the shapes / dtypes / devices. The checks only compare shapes,
dtypes and devices, so they trace under ``torch.compile`` with dynamic shapes without data-dependent
Python.
"""

from __future__ import annotations

import torch

from ppma import _ext

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_floating(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATING:
        raise ValueError(f"{op}: {name} must be float32, float64, float16 or bfloat16, got {t.dtype}")


def check_decay_shapes(op: str, ref: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> None:
    """``log_alpha, log_beta: [B, H, W, heads]`` matching ``ref.shape[:4]``."""
    grid = tuple(ref.shape[:4])
    for name, t in (("log_alpha", log_alpha), ("log_beta", log_beta)):
        if t.dim() != 4 or tuple(t.shape) != grid:
            raise ValueError(f"{op}: {name} must be [B, H, W, heads] = {grid}, got shape {tuple(t.shape)}")


def check_decays(op: str, ref: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> None:
    """``log_alpha, log_beta: [B, H, W, heads]`` matching ``ref.shape[:4]``, same dtype and device."""
    _check_floating(op, "log_alpha", log_alpha)
    _check_floating(op, "log_beta", log_beta)
    check_decay_shapes(op, ref, log_alpha, log_beta)
    for name, t in (("log_alpha", log_alpha), ("log_beta", log_beta)):
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the features are on {ref.device}")
    if log_alpha.dtype != log_beta.dtype:
        raise ValueError(f"{op}: log_alpha has dtype {log_alpha.dtype} but log_beta has dtype {log_beta.dtype}")


def check_attention_shapes(op, q, k, v, log_alpha, log_beta) -> None:
    """Shapes only: ``q, k: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``, decays ``[B, H, W, heads]``."""
    if q.dim() != 5:
        raise ValueError(f"{op}: q must be [B, H, W, heads, d], got shape {tuple(q.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"{op}: k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 5 or tuple(v.shape[:4]) != tuple(q.shape[:4]):
        raise ValueError(f"{op}: v must be [B, H, W, heads, dv] matching q {tuple(q.shape)}, got {tuple(v.shape)}")
    check_decay_shapes(op, q, log_alpha, log_beta)


def check_attention_inputs(op, q, k, v, log_alpha, log_beta) -> None:
    """``check_attention_shapes`` plus: floating dtypes, q/k/v share dtype and device (the decays may have
    another floating dtype, e.g. fp32 decays with bf16 features)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_floating(op, name, t)
    check_attention_shapes(op, q, k, v, log_alpha, log_beta)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but q has dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    check_decays(op, q, log_alpha, log_beta)


def check_scan_shapes(op, x, log_alpha, log_beta) -> None:
    """Shapes only: ``x: [B, H, W, heads, c]``, decays ``[B, H, W, heads]``."""
    if x.dim() != 5:
        raise ValueError(f"{op}: x must be [B, H, W, heads, c], got shape {tuple(x.shape)}")
    check_decay_shapes(op, x, log_alpha, log_beta)


def check_scan_inputs(op, x, log_alpha, log_beta) -> None:
    """``x: [B, H, W, heads, c]``, decays ``[B, H, W, heads]`` on the same device."""
    _check_floating(op, "x", x)
    check_scan_shapes(op, x, log_alpha, log_beta)
    check_decays(op, x, log_alpha, log_beta)


def use_fused(t: torch.Tensor) -> bool:
    """Whether the compiled op can run on ``t``'s device; otherwise warn once and use the reference."""
    if _ext.has_ext() and (t.device.type == "cpu" or _ext.has_cuda_kernels()):
        return True
    _ext.warn_fallback()
    return False


def no_double_backward(op: str) -> None:
    """The backward ops are not differentiable: fail loudly when a graph of the gradient is requested."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"ppma.ops.{op}: double backward (create_graph=True or higher-order gradients) is not supported; "
            "use ppma.ops.reference for higher-order derivatives"
        )


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """dtype of the saved softmax statistics: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def fake_attention_grads(q, k, v, log_alpha, log_beta):
    """Fake (meta) results of an attention backward op: gradients shaped like its five inputs."""
    return tuple(t.new_empty(t.shape) for t in (q, k, v, log_alpha, log_beta))


def input_grads(ctx, grads):
    """Autograd results of an op whose tensor inputs are followed by one non-tensor argument: the gradients
    autograd asked for, ``None`` for the others and for the trailing argument."""
    n = len(grads)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:n])) + (None,)
