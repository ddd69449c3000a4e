"""``ppma.ops.cpu.layer_norm`` and ``ppma.ops.cpu.add_layer_norm_``: LayerNorm over the last dimension for CPU inference,
and the block's residual sum followed by its norm in one pass (docs/ops.md "layer_norm").

The kernels (``torch.ops.ppma.layer_norm``, ``torch.ops.ppma.add_layer_norm_``; float32, contiguous ``x``) normalise
one row of ``C`` channels at a time in AVX-512/AVX2 vectors; ``add_layer_norm_`` first adds ``residual`` into ``x``
in place, reading ``x`` once for both. They have no autograd formula: where a gradient is recorded (or on other
devices and dtypes, under torch.compile, or with ``ppma.ops.set_impl("reference")``) the functions run
``torch.nn.functional.layer_norm`` (and ``x.add_(residual)``), the same numbers up to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ppma import _ext
from ppma.ops import _dispatch
from ppma.ops._validate import check_floating_on_one_device, check_no_overlap, check_same_device, records_grad

__all__ = ["layer_norm", "add_layer_norm_", "uses_kernel"]

_HAS_OP = _ext.has_ext()


def _check(x, weight, bias, eps, residual=None, op="ppma.ops.cpu.layer_norm") -> None:
    """Shapes, then floating dtypes on one device (x's), then ``eps``; errors name the argument."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: x must be a tensor with a channel dimension, got {shape}")
    C = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (C,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be [C] = ({C},) (x's last dimension), got {shape}")
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != x.shape):
        shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {shape}")
    check_floating_on_one_device(op, x=x, residual=residual, weight=weight, bias=bias)
    if weight.dtype != bias.dtype:
        raise ValueError(f"{op}: weight and bias must have one dtype, got {weight.dtype} and {bias.dtype}")
    # torch's layer norm takes parameters in x's dtype, or float32 ones for a half-precision x
    if weight.dtype != x.dtype and not (weight.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(f"{op}: weight and bias must have x's dtype {x.dtype} (or float32 for a float16 or bfloat16 x), "
                         f"got {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a number >= 0, got {eps!r}")


def uses_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None
                ) -> bool:
    """Whether :func:`layer_norm` / :func:`add_layer_norm_` run the ppma kernel on these tensors: a built kernel,
    the "fused" implementation, contiguous float32 CPU tensors and no gradient recorded; under torch.compile
    :func:`layer_norm` only (one opaque graph node, docs/compile.md), not the in-place :func:`add_layer_norm_`."""
    ts = (x, weight, bias) if residual is None else (x, weight, bias, residual)
    return (
        _HAS_OP
        and _dispatch.get_impl() == "fused"
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)
        and x.is_contiguous()
        and not records_grad(*ts)
        and (residual is None or not torch.compiler.is_compiling())
    )


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm(x, (C,), weight, bias, eps)`` over the last dimension ``C``.

    Args:
        x: ``[..., C]``.
        weight, bias: ``[C]``.
        eps: added to the variance.

    Returns:
        ``[..., C]``, a new tensor. Where :func:`uses_kernel` holds (CPU inference on float32) it comes from
        ``torch.ops.ppma.layer_norm`` (one pass over each row in vectors), elsewhere from torch; the two agree up
        to float32 rounding.
    """
    _check(x, weight, bias, eps)
    if not uses_kernel(x, weight, bias) or x.numel() == 0:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return torch.ops.ppma.layer_norm(x, weight, bias, float(eps))


def add_layer_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float = 1e-5) -> torch.Tensor:
    """``x += residual`` in place, then :func:`layer_norm` of the sum: a block's residual sum followed by its norm.

    Where :func:`uses_kernel` holds (CPU inference on float32) one kernel does both in one pass over ``x``
    (``torch.ops.ppma.add_layer_norm_``); elsewhere it is ``x.add_(residual)`` and ``F.layer_norm``. ``x`` is
    updated in place either way, so it must be the caller's own tensor.

    Args:
        x: ``[..., C]``, overwritten with ``x + residual``.
        residual: ``x``'s shape.
        weight, bias, eps: as for :func:`layer_norm`.

    Returns:
        the layer norm of the updated ``x``, a new tensor.
    """
    op = "ppma.ops.cpu.add_layer_norm_"
    _check(x, weight, bias, eps, residual, op)
    # as torch's in-place ops: x += x is fine (each element read before it is written), a partial overlap is not
    check_no_overlap(op, "x", x, allow_full=("residual",), residual=residual, weight=weight, bias=bias)
    if not uses_kernel(x, weight, bias, residual) or x.numel() == 0:
        x.add_(residual)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return torch.ops.ppma.add_layer_norm_(x, residual, weight, bias, float(eps))


def _fake(x, weight, bias, eps):
    """``ppma::layer_norm``'s fake kernel: a new tensor of ``x``'s shape, dtype and device."""
    check_same_device("layer_norm", x=x, weight=weight, bias=bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _fake_add(x, residual, weight, bias, eps):
    """``ppma::add_layer_norm_``'s fake kernel: as :func:`_fake`, after the devices and dtypes of all four."""
    check_same_device("add_layer_norm_", x=x, residual=residual, weight=weight, bias=bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


if _HAS_OP:
    torch.library.register_fake("ppma::layer_norm")(_fake)
    torch.library.register_fake("ppma::add_layer_norm_")(_fake_add)
