"""``ppma.ops.cpu.layer_norm`` and ``ppma.ops.cpu.add_layer_norm_``: LayerNorm over the last dimension for CPU inference,
and the block's residual sum followed by its norm in one pass (docs/ops.md "layer_norm").

The kernels (``torch.ops.ppma.layer_norm``, ``torch.ops.ppma.add_layer_norm_``; a contiguous float32 ``x``, or a
bfloat16 one with float32 weight and bias as under CPU bf16 autocast) normalise one row of ``C`` channels at a time in
AVX-512/AVX2 vectors, in float32 (a bf16 row widened as it is read, each bf16 output rounded once);
``add_layer_norm_`` first adds ``residual`` into ``x`` in place, reading ``x`` once for both. They have no autograd
formula: where a gradient is recorded (or on other devices and dtypes, or with ``ppma.ops.set_impl("reference")``)
the functions run ``torch.nn.functional.layer_norm`` (and ``x.add_(residual)``), the same numbers up to float32
rounding.

``layer_norm_node`` is torch's own layer norm (ATen's CPU kernels, forward and backward) as one opaque custom op,
``ppma::layer_norm_node``, for compiled training: Inductor would otherwise decompose the norm and its backward into
generated loops fused with the neighbouring sums, which ran slower than ATen's kernels (docs/compile.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ppma import _ext
from ppma.ops import _dispatch
from ppma.ops._validate import check_floating_on_one_device, check_no_overlap, check_same_device, records_grad

__all__ = ["layer_norm", "add_layer_norm_", "uses_kernel", "layer_norm_node", "uses_layer_norm_node"]

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
    the "fused" implementation, contiguous CPU tensors, float32 weight and bias with a float32 or bfloat16 ``x`` (and
    ``residual`` in ``x``'s dtype; bf16: the maps of CPU bf16 autocast), and no gradient recorded; under torch.compile
    :func:`layer_norm` only (one opaque graph node, docs/compile.md), not the in-place :func:`add_layer_norm_`."""
    maps = (x,) if residual is None else (x, residual)
    return (
        _HAS_OP
        and _dispatch.get_impl() == "fused"
        and x.dtype in (torch.float32, torch.bfloat16)
        and all(t.device.type == "cpu" and t.dtype == x.dtype for t in maps)
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (weight, bias))
        and x.is_contiguous()
        and not records_grad(*maps, weight, bias)
        and (residual is None or not torch.compiler.is_compiling())
    )


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm(x, (C,), weight, bias, eps)`` over the last dimension ``C``.

    Args:
        x: ``[..., C]``.
        weight, bias: ``[C]``.
        eps: added to the variance.

    Returns:
        ``[..., C]``, a new tensor in ``x``'s dtype. Where :func:`uses_kernel` holds (CPU inference on float32, or on
        bfloat16 with float32 weight and bias) it comes from ``torch.ops.ppma.layer_norm`` (one pass over each row in
        vectors), elsewhere from torch; the two agree up to float32 rounding (bf16: before the output's one rounding,
        so within one bf16 rounding).
    """
    _check(x, weight, bias, eps)
    if not uses_kernel(x, weight, bias) or x.numel() == 0:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return torch.ops.ppma.layer_norm(x, weight, bias, float(eps))


def add_layer_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float = 1e-5) -> torch.Tensor:
    """``x += residual`` in place, then :func:`layer_norm` of the sum: a block's residual sum followed by its norm.

    Where :func:`uses_kernel` holds (CPU inference on float32, or on bfloat16 maps with float32 weight and bias: the
    sum rounded to bf16 once, as ``x.add_(residual)`` rounds it, and normalised as rounded) one kernel does both in
    one pass over ``x`` (``torch.ops.ppma.add_layer_norm_``); elsewhere it is ``x.add_(residual)`` and
    ``F.layer_norm``. ``x`` is updated in place either way, so it must be the caller's own tensor.

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


# ------------------------------------------------------------------ torch's layer norm as one node (compiled training)
@torch.library.custom_op("ppma::layer_norm_node", mutates_args=())
def _layer_norm_node(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)


@_layer_norm_node.register_fake
def _layer_norm_node_fake(x, weight, bias, eps):
    stats = x.new_empty((*x.shape[:-1], 1))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("ppma::layer_norm_node_backward", mutates_args=())
def _layer_norm_node_backward(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.aten.native_layer_norm_backward(grad, x, [x.shape[-1]], mean, rstd, weight, bias,
                                                     [True, True, True])


@_layer_norm_node_backward.register_fake
def _layer_norm_node_backward_fake(grad, x, mean, rstd, weight, bias):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(bias))


def _node_setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, mean, rstd, weight, bias)
    ctx.mark_non_differentiable(mean, rstd)


def _node_backward(ctx, grad_out, grad_mean, grad_rstd):
    x, mean, rstd, weight, bias = ctx.saved_tensors
    gx, gw, gb = torch.ops.ppma.layer_norm_node_backward(grad_out, x, mean, rstd, weight, bias)
    return gx, gw, gb, None


_layer_norm_node.register_autograd(_node_backward, setup_context=_node_setup_context)


def uses_layer_norm_node(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether ``ppma.nn.LayerNorm`` runs :func:`layer_norm_node`: traced by torch.compile, the "fused"
    implementation, CPU tensors of one dtype, float32 or float64, and a gradient recorded (compiled training; compiled
    inference runs :func:`layer_norm`'s kernel)."""
    return (
        torch.compiler.is_compiling()
        and _dispatch.get_impl() == "fused"
        and all(t.device.type == "cpu" and t.dtype == x.dtype for t in (x, weight, bias))
        and x.dtype in (torch.float32, torch.float64)
        and records_grad(x, weight, bias)
    )


def layer_norm_node(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm(x, (C,), weight, bias, eps)`` over the last dimension ``C`` as one opaque
    op (``torch.ops.ppma.layer_norm_node``, ATen's ``native_layer_norm`` inside; its backward
    ``torch.ops.ppma.layer_norm_node_backward``, ATen's ``native_layer_norm_backward``), so that torch.compile keeps
    ATen's kernels instead of generating the norm (docs/compile.md). The same numbers as torch's layer norm, bit
    for bit, in eager mode too.

    Args:
        x: ``[..., C]``.
        weight, bias: ``[C]``, in ``x``'s dtype.
        eps: added to the variance.

    Returns:
        ``[..., C]``, a new contiguous tensor in ``x``'s dtype.
    """
    _check(x, weight, bias, eps, op="ppma.ops.cpu.layer_norm_node")  # shapes, floating dtypes, one device
    return _layer_norm_node(x, weight, bias, float(eps))[0]
