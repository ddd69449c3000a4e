"""``ppma.ops.cpu.path_decay``: PPMA's per-token log-decays (``ppma.nn.PathDecay``; docs/ops.md "path_decay") with one CPU
kernel each way.

``d[..., g, c] = softplus(<x_g, weight[c]> + dt_bias[g]) * A[g]`` with ``A = -exp(A_log)``: the Mamba2 Δ/A
parametrisation of the decay factors (paper §3.2; docs/model.md §1.4), ``x_g`` head ``g``'s ``head_dim`` channels.
torch runs it as a linear layer with 2 outputs per head (a GEMM of a few GMAC/s), an addition, softplus and a
multiplication, and its backward as the same again plus two strided reductions: about 4 ms a step at PPMA-T's stage 1
(batch 8 at 224², 2 threads). ``torch.ops.ppma.path_decay`` and ``path_decay_backward`` do it in one pass over ``x``
each (about 1 ms). The reference (:func:`path_decay_ref`) is the module's formula with torch's autograd.

Under CPU bf16 autocast the module sees a bf16 ``x`` with its float32 parameters, and autocast runs the formula as a
bf16 linear layer (the weight rounded to bf16, the products summed in float32, ``u`` rounded to bf16 once) followed by
float32 softplus and scaling: 23.5 ms of a PPMA-T forward at batch 8, 224², on 1 thread of an Intel Ice Lake Xeon,
8.0 ms with the kernels (the 14 decay modules' sum). The kernels take that case (x bf16, the three parameters
float32, float32 math): the same ``u`` rounded to bf16 once, a float32 output, and in the backward ``grad_x`` in bf16
(rounded once), the parameter gradients float32. ``gu`` is rounded to bf16 before the products of ``grad_x`` and
``grad_weight``, as autocast's backward does; ``grad_weight`` keeps its float32 sum (autocast's is rounded to bf16).
docs/ops.md "path_decay".
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ppma import _ext
from ppma.ops import _dispatch, reference
from ppma.ops._validate import check_floating_on_one_device, check_same_device, cpu_kernel_dtypes, records_grad

__all__ = ["path_decay", "path_decay_ref", "uses_path_decay_kernel"]

_OP = "path_decay"
_HAS_OP = _ext.has_ext()
# The most directions the kernel takes (alpha and beta in 2-D, gamma too in 3-D).
MAX_DIRECTIONS = 3


def _check(x, weight, dt_bias, A_log) -> None:
    for name, t in (("x", x), ("weight", weight), ("dt_bias", dt_bias), ("A_log", A_log)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ppma.ops.cpu.path_decay: {name} must be a tensor, got {type(t).__name__}")
    if weight.dim() != 2 or dt_bias.dim() != 1 or tuple(A_log.shape) != tuple(dt_bias.shape):
        raise ValueError(
            "ppma.ops.cpu.path_decay: weight must be [D, head_dim], dt_bias and A_log [heads], got shapes "
            f"{tuple(weight.shape)}, {tuple(dt_bias.shape)} and {tuple(A_log.shape)}"
        )
    G, hd = dt_bias.shape[0], weight.shape[1]
    if x.dim() < 1 or x.shape[-1] != G * hd:
        raise ValueError(
            f"ppma.ops.cpu.path_decay: x must be [..., heads * head_dim] = [..., {G} * {hd}], got shape {tuple(x.shape)}"
        )
    check_floating_on_one_device("ppma.ops.cpu.path_decay", x=x, weight=weight, dt_bias=dt_bias, A_log=A_log)
    # the linear layer wants x's dtype, except under autocast (which casts both itself)
    if weight.dtype != x.dtype and (x.device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(x.device.type)):
        raise ValueError(f"ppma.ops.cpu.path_decay: weight must have x's dtype {x.dtype}, got {weight.dtype}")


def path_decay_ref(x: torch.Tensor, weight: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
    """The reference of :func:`path_decay` (``ppma.ops.reference.path_decay_ref``): ``ppma.nn.PathDecay``'s formula
    with torch's modules and autograd (the linear layer in ``x``'s dtype, softplus and the scaling in float32,
    float64 for float64 ``x``), after :func:`path_decay`'s argument checks."""
    _check(x, weight, dt_bias, A_log)
    return reference.path_decay_ref(x, weight, dt_bias, A_log)


def uses_path_decay_kernel(x: torch.Tensor, weight: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor) -> bool:
    """Whether :func:`path_decay` runs ``torch.ops.ppma.path_decay`` (and its backward) on these tensors: a built
    kernel, the "fused" implementation, CPU tensors, at most ``MAX_DIRECTIONS`` directions, and either all of float32
    or all of float64 outside autocast, or a bf16 ``x`` with float32 parameters under CPU bf16 autocast (whose bf16
    linear layer the kernel rounds like); no dispatch mode active (FLOP counters and tracers see torch's ops). fp16
    autocast, a float32 ``x`` under autocast and a bf16 ``x`` outside it keep the reference. Under torch.compile the
    op is one opaque graph node with its fake kernel and autograd formula (docs/compile.md)."""
    return (
        _HAS_OP
        and _dispatch.get_impl() == "fused"
        and x.device.type == "cpu"
        and all(t.device == x.device for t in (weight, dt_bias, A_log))
        and cpu_kernel_dtypes(x, weight, dt_bias, A_log)
        and 1 <= weight.shape[0] <= MAX_DIRECTIONS
        and type(x) is torch.Tensor
        and (torch.compiler.is_compiling() or not torch._C._len_torch_dispatch_stack())
    )


def path_decay(x: torch.Tensor, weight: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
    """PPMA's log-decays of every token and head (docs/ops.md "path_decay").

    Args:
        x: ``[..., heads * head_dim]``, the attention's normalised input.
        weight: ``[D, head_dim]``, the bias-free linear layer shared by the heads (``D`` directions: 2 for
            ``log_alpha, log_beta``, 1 for shared decays, 3 in 3-D).
        dt_bias, A_log: ``[heads]``.

    Returns:
        ``[..., heads, D]``: ``softplus(<x_g, weight[c]> + dt_bias[g]) * -exp(A_log[g])``, all ``<= 0``, in float32
        (float64 for float64 ``x``). Where :func:`uses_path_decay_kernel` says so (CPU, float32/float64 or a bf16
        ``x`` under CPU bf16 autocast, the "fused" implementation) the forward and the backward are one ppma kernel
        each, equal to :func:`path_decay_ref` up to float32 rounding (the dots summed in another order; softplus
        within a few roundings of torch's, 0 where torch's is a denormal below ``z = -87``); for a bf16 ``x`` up to
        the bf16 rounding of ``<x_g, weight[c]>``, which may land on the other neighbour where the float32 sums
        differ, ``grad_x`` bf16 and ``grad_weight`` a float32 sum where autocast's is rounded to bf16 (module
        docstring). Elsewhere it is :func:`path_decay_ref`. The backward is once-differentiable.
    """
    _check(x, weight, dt_bias, A_log)
    if not uses_path_decay_kernel(x, weight, dt_bias, A_log):
        return reference.path_decay_ref(x, weight, dt_bias, A_log)
    A = -torch.exp(A_log)
    if not records_grad(x, weight, dt_bias, A):
        return torch.ops.ppma.path_decay(x, weight, dt_bias, A)
    return _PathDecay.apply(x, weight, dt_bias, A)


class _PathDecay(torch.autograd.Function):
    """Forward and backward: one ppma kernel each (``A = -exp(A_log)`` stays in torch's autograd)."""

    @staticmethod
    def forward(ctx, x, weight, dt_bias, A):
        ctx.save_for_backward(x, weight, dt_bias, A)
        return torch.ops.ppma.path_decay(x, weight, dt_bias, A)

    @staticmethod
    @once_differentiable  # the kernel has no derivative of its own
    def backward(ctx, grad_d):
        x, weight, dt_bias, A = ctx.saved_tensors
        grads = torch.ops.ppma.path_decay_backward(grad_d.contiguous(), x, weight, dt_bias, A)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def _fake(x, weight, dt_bias, A):
    check_same_device(_OP, x=x, weight=weight, dt_bias=dt_bias, A=A)
    # float32 decays for a bf16 x (bf16 autocast), x's dtype otherwise
    dtype = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
    return x.new_empty((*x.shape[:-1], dt_bias.shape[0], weight.shape[0]), dtype=dtype)


def _fake_backward(grad_out, x, weight, dt_bias, A):
    check_same_device(_OP + "_backward", x=x, grad_out=grad_out, weight=weight, dt_bias=dt_bias, A=A)
    # grad_x in x's dtype (bf16 for a bf16 x), the parameters' gradients in theirs (float32 under bf16 autocast)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), dt_bias.new_empty(dt_bias.shape), A.new_empty(A.shape)


if _HAS_OP:
    torch.library.register_fake("ppma::" + _OP)(_fake)
    torch.library.register_fake("ppma::" + _OP + "_backward")(_fake_backward)
