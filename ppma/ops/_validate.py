"""Input validation and helpers shared by the public op wrappers and the reference (docs/design.md §2).

Errors name the argument and print the shapes / dtypes / devices / values. The default checks only compare
types, shapes, dtypes and devices, so they trace under ``torch.compile`` with dynamic shapes without
data-dependent Python; the one check that reads values (positive log-decays) is opt-in
(``ppma.ops.set_check_decays``).
"""

from __future__ import annotations

import torch

from ppma.ops import _dispatch

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Log-decays below this floor (down to -inf, i.e. a decay of exactly 0) are treated as the floor by every
# backend and by the reference: exp(-1e4) is exactly 0 in every supported dtype, so a path through such an
# edge has weight 0, and the prefix sums stay finite (-inf - -inf would be NaN). docs/ops.md, "Edges".
LOG_DECAY_FLOOR = -1e4


def _check_tensor(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_floating(op: str, name: str, t: torch.Tensor) -> None:
    _check_tensor(op, name, t)
    if t.dtype not in _FLOATING:
        raise ValueError(f"{op}: {name} must be float32, float64, float16 or bfloat16, got {t.dtype}")


def check_decay_shapes(op: str, ref: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> None:
    """``log_alpha, log_beta: [B, H, W, heads]`` tensors matching ``ref.shape[:4]``, on ``ref``'s device."""
    grid = tuple(ref.shape[:4])
    for name, t in (("log_alpha", log_alpha), ("log_beta", log_beta)):
        _check_tensor(op, name, t)
        if t.dim() != 4 or tuple(t.shape) != grid:
            raise ValueError(f"{op}: {name} must be [B, H, W, heads] = {grid}, got shape {tuple(t.shape)}")
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the features are on {ref.device}")


def check_decay_values(op: str, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> None:
    """With ``ppma.ops.set_check_decays(True)``: raise if a log-decay is positive (a decay above 1)."""
    if not _dispatch.check_decays_enabled():
        return
    for name, t in (("log_alpha", log_alpha), ("log_beta", log_beta)):
        bad = t > 0
        if bool(bad.any()):
            raise ValueError(
                f"{op}: {name} must be <= 0 (log of a decay in [0, 1]); {int(bad.sum())} of {t.numel()} values "
                f"are positive, the largest {t.max().item():.4g} (set_check_decays(False) to skip this check)"
            )


def check_decay_dtypes(op: str, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> None:
    """Floating log-decays of one dtype (which may differ from the features')."""
    _check_floating(op, "log_alpha", log_alpha)
    _check_floating(op, "log_beta", log_beta)
    if log_alpha.dtype != log_beta.dtype:
        raise ValueError(f"{op}: log_alpha has dtype {log_alpha.dtype} but log_beta has dtype {log_beta.dtype}")


def check_attention_shapes(op, q, k, v, log_alpha, log_beta) -> None:
    """Types, shapes and devices: ``q, k: [B, H, W, heads, d]`` with ``d > 0``, ``v: [B, H, W, heads, dv]``,
    decays ``[B, H, W, heads]``, all on one device. Shared by the wrappers and the reference."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(op, name, t)
    if q.dim() != 5:
        raise ValueError(f"{op}: q must be [B, H, W, heads, d], got shape {tuple(q.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"{op}: k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 5 or tuple(v.shape[:4]) != tuple(q.shape[:4]):
        raise ValueError(f"{op}: v must be [B, H, W, heads, dv] matching q {tuple(q.shape)}, got {tuple(v.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"{op}: q and k must have a positive head dim d, got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    check_decay_shapes(op, q, log_alpha, log_beta)


def check_attention_inputs(op, q, k, v, log_alpha, log_beta) -> None:
    """``check_attention_shapes`` plus: floating dtypes, q/k/v share dtype and device (the decays may have
    another floating dtype, e.g. fp32 decays with bf16 features), and the opt-in decay-value check."""
    check_attention_shapes(op, q, k, v, log_alpha, log_beta)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_floating(op, name, t)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but q has dtype {q.dtype}")
    check_decay_dtypes(op, log_alpha, log_beta)
    check_decay_values(op, log_alpha, log_beta)


def check_scan_shapes(op, x, log_alpha, log_beta) -> None:
    """Types, shapes and devices: ``x: [B, H, W, heads, c]``, decays ``[B, H, W, heads]`` on ``x``'s device."""
    _check_tensor(op, "x", x)
    if x.dim() != 5:
        raise ValueError(f"{op}: x must be [B, H, W, heads, c], got shape {tuple(x.shape)}")
    check_decay_shapes(op, x, log_alpha, log_beta)


def check_scan_inputs(op, x, log_alpha, log_beta, transpose) -> None:
    """``x: [B, H, W, heads, c]``, decays ``[B, H, W, heads]`` on the same device, ``transpose`` a bool."""
    check_scan_shapes(op, x, log_alpha, log_beta)
    _check_floating(op, "x", x)
    check_decay_dtypes(op, log_alpha, log_beta)
    check_transpose(op, transpose)
    check_decay_values(op, log_alpha, log_beta)


def check_transpose(op: str, transpose) -> None:
    if not isinstance(transpose, bool):
        raise TypeError(f"{op}: transpose must be a bool, got {type(transpose).__name__} {transpose!r}")


def check_linear_options(op: str, normalize, eps) -> None:
    """``normalize`` a bool and ``eps`` a finite number >= 0 (the options of polyline_linear_attention)."""
    if not isinstance(normalize, bool):
        raise TypeError(f"{op}: normalize must be a bool, got {type(normalize).__name__} {normalize!r}")
    if isinstance(eps, (bool, str, bytes)) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__} {eps!r}")
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps!r}")


def resolve_scale(op: str, scale, head_dim: int) -> float:
    """The logit scale as a Python float: ``head_dim ** -0.5`` when ``scale`` is None. A 0-dim tensor is
    read with ``float()`` (no gradient flows to it)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise TypeError(f"{op}: scale must be a number; a tensor that requires grad would get no gradient")
    if not isinstance(scale, (bool, str, bytes)):
        try:
            return float(scale)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{op}: scale must be a real number or None, got {type(scale).__name__} {scale!r}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """All ``tensors`` (None entries skipped) floating (float32, float64, float16 or bfloat16) and on the device of
    the first one. The fake (meta) kernels call this: a call of the registered op with one input on ``meta``
    dispatches to them, and they must not return empty CPU memory, nor accept an integer tensor the kernel refuses."""
    ref = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ppma::{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATING:
            raise RuntimeError(f"ppma::{op}: {name} must be float32, float64, float16 or bfloat16, got {t.dtype}")
        if ref is None:
            first, ref = name, t
        elif t.device != ref.device:
            raise RuntimeError(f"ppma::{op}: {name} is on {t.device} but {first} is on {ref.device}")


def check_floating_on_one_device(op: str, **tensors) -> None:
    """Every tensor in ``tensors`` (None entries skipped) a floating tensor (float32, float64, float16 or bfloat16)
    on the device of the first one: the argument check of the CPU helper ops (``ppma.ops.cpu``), whose errors name
    the argument. A meta tensor beside CPU tensors is refused here, before a kernel or a torch op sees it."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        _check_floating(op, name, t)
        if first is None:
            first = (name, t)
        elif t.device != first[1].device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first[0]} is on {first[1].device}")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` bytes of a non-empty tensor's elements (its strides are >= 0)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def check_no_overlap(op: str, out_name: str, out: torch.Tensor, allow_full: tuple[str, ...] = (), **inputs) -> None:
    """The in-place ops' aliasing rule, as torch's in-place ops: no input in ``inputs`` (None entries skipped) shares
    memory with ``out``, the tensor the op writes, except the inputs named in ``allow_full`` when they are ``out``
    itself (the same start, shape and strides: every element is read before it is written). A partial overlap would
    make the result depend on the order of the writes (docs/ops.md "Edges"). Where one of the two is contiguous,
    overlapping memory ranges count as overlap (exact unless the other's elements straddle the contiguous one); where
    neither is, the pair is left to the op (the kernels write contiguous tensors only, and torch's ``add_`` checks its
    own operands)."""
    if out.numel() == 0:
        return
    for name, t in inputs.items():
        if t is None or t.numel() == 0 or t.device != out.device or t.device.type == "meta":
            continue
        if not (out.is_contiguous() or t.is_contiguous()):
            continue
        if out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            continue
        (a0, a1), (b0, b1) = _byte_range(out), _byte_range(t)
        if a1 <= b0 or b1 <= a0:
            continue
        if name in allow_full and _same_view(out, t):
            continue
        raise ValueError(
            f"{op}: {name} shares memory with {out_name}, which the op writes in place; pass a {name} that does not "
            f"overlap {out_name} (e.g. {name}.clone())"
        )


def is_empty(*tensors: torch.Tensor) -> bool:
    """Whether an op has nothing to compute (a zero-sized batch, grid, head count or value dim). The wrappers
    send such inputs to the reference, which returns empty results with a working autograd graph."""
    return any(t.numel() == 0 for t in tensors)


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record an op on ``tensors``: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def cpu_kernel_dtypes(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether ``x`` and its ``params`` (None: an absent bias) have the dtypes of ppma's CPU kernels that also run
    under bf16 autocast: float32/float64 ``x`` with the parameters in its dtype outside CPU autocast, or a bf16 ``x``
    with float32 parameters under CPU bf16 autocast (float32 math, the low-precision case of docs/ops.md
    "depthwise_conv2d", "gelu_depthwise_conv2d_residual" and "path_decay")."""
    if not torch.is_autocast_enabled("cpu"):
        return x.dtype in (torch.float32, torch.float64) and all(p is None or p.dtype == x.dtype for p in params)
    return (
        x.dtype == torch.bfloat16
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and all(p is None or p.dtype == torch.float32 for p in params)
    )


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


def fake_attention_out_lse(op, q, k, v, log_alpha, log_beta):
    """Fake (meta) results of an attention op that returns ``(out, lse)``: ``out`` shaped like ``v`` and the rows'
    two log-sum-exps ``[B, H, W, heads, 2]`` in :func:`lse_dtype`."""
    check_same_device(op, q=q, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta)
    B, H, W, G, _ = q.shape
    return v.new_empty(v.shape), q.new_empty((B, H, W, G, 2), dtype=lse_dtype(q))


def fake_attention_grads(op, grad_out, q, k, v, log_alpha, log_beta, **saved):
    """Fake (meta) results of an attention backward op: gradients shaped like its five inputs."""
    check_same_device(op, q=q, grad_out=grad_out, k=k, v=v, log_alpha=log_alpha, log_beta=log_beta, **saved)
    return tuple(t.new_empty(t.shape) for t in (q, k, v, log_alpha, log_beta))


def decay_grad_where_defined(grad: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """The gradient of a log-decay input, zeroed where the log-decay is NaN or below ``LOG_DECAY_FLOOR``.

    The reference floors the log-decays with ``clamp_min(LOG_DECAY_FLOOR)``, whose gradient is exactly 0 where
    the input is below the floor or NaN (a comparison with NaN is false); the kernels' prefix-sum and scan
    backward passes give ~0 (below the floor) or NaN (at a NaN) there instead. Applying the clamp's rule once,
    here, to every backend's decay gradients makes them match the reference (docs/ops.md, "Edges")."""
    return torch.where(log_decay >= LOG_DECAY_FLOOR, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))


def input_grads(ctx, grads, log_decays=(), trailing: int = 1):
    """Autograd results of an op whose tensor inputs are followed by ``trailing`` non-tensor arguments: the
    gradients autograd asked for, ``None`` for the others and for the trailing arguments.

    ``log_decays`` are ``(index, tensor)`` pairs naming the log-decay inputs among ``grads``: their gradients
    follow the reference's floor rule (:func:`decay_grad_where_defined`)."""
    grads = list(grads)
    for i, log_decay in log_decays:
        if ctx.needs_input_grad[i]:
            grads[i] = decay_grad_where_defined(grads[i], log_decay)
    n = len(grads)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:n])) + (None,) * trailing
