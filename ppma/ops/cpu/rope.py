"""``ppma.ops.cpu.rope``: the rotary position embedding of PPMA's queries and keys in one pass (paper §3).

The fused kernel is ``torch.ops.ppma.rope`` (CPU: one read and one write of ``x``, with the key scale and the
cast back to ``x``'s dtype folded in); its fake (meta) kernel and autograd formula are registered here, next to
the wrapper. The op is linear in ``x`` and its backward is the same op with ``transpose`` flipped, so it has
gradients of any order. Where no kernel is built (e.g. CUDA) the reference runs: it is elementwise, and
torch's own kernels serve it well there.

``rope_`` writes the same rotation over ``x`` (``torch.ops.ppma.rope_``, CPU inference): PPMAAttention's q and k
are its own fresh projections, so no second map of their size is needed.
"""

from __future__ import annotations

import torch

from ppma import _ext
from ppma.ops import _dispatch
from ppma.ops._validate import check_floating_on_one_device, check_no_overlap, check_same_device, records_grad
from ppma.ops.reference import rope_ref

__all__ = ["rope", "rope_", "uses_inplace_kernel"]

_OP = "rope"
# Device types with a rope kernel, decided at import (dynamo cannot trace dispatcher queries).
_HAS_OP = _ext.has_ext()
_ROPE_DEVICES: frozenset[str] = frozenset()
if _HAS_OP:
    _ROPE_DEVICES = frozenset(
        {"cpu", "meta"} | ({"cuda"} if torch._C._dispatch_has_kernel_for_dispatch_key("ppma::rope", "CUDA") else set())
    )


def _check(x, sin, cos, scale, transpose) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[-1] % 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"ppma.ops.cpu.rope: x must be a [B, H, W, heads, d] tensor with d even, got {shape}")
    want = (x.shape[1], x.shape[2], x.shape[4])
    for name, t in (("sin", sin), ("cos", cos)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"ppma.ops.cpu.rope: {name} must be [H, W, d] = {want}, got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"ppma.ops.cpu.rope: {name} must be floating point, got {t.dtype}")
    if not x.is_floating_point():
        raise ValueError(f"ppma.ops.cpu.rope: x must be floating point, got {x.dtype}")
    check_floating_on_one_device("ppma.ops.cpu.rope", x=x, sin=sin, cos=cos)
    if sin.dtype != cos.dtype:
        raise ValueError(f"ppma.ops.cpu.rope: sin and cos must have one dtype, got {sin.dtype} and {cos.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"ppma.ops.cpu.rope: scale must be a real number, got {scale!r}")
    if not isinstance(transpose, bool):
        raise ValueError(f"ppma.ops.cpu.rope: transpose must be a bool, got {transpose!r}")


def rope(
    x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, scale: float = 1.0, transpose: bool = False
) -> torch.Tensor:
    """Rotary position embedding of ``scale * x``: ``y = xs * cos + rot(xs) * sin`` with ``xs = scale * x``
    and ``rot`` mapping every channel pair ``(x_{2m}, x_{2m+1})`` to ``(-x_{2m+1}, x_{2m})`` (the official
    ``theta_shift``; ``transpose=True`` applies the adjoint map, see :func:`ppma.ops.reference.rope_ref`).

    Args:
        x: ``[B, H, W, heads, d]`` queries or keys, ``d`` even.
        sin, cos: ``[H, W, d]`` tables of one floating dtype (broadcast over batch and heads), e.g. from
            :func:`ppma.nn.rope.rotary_sin_cos`.
        scale: factor applied to ``x`` first (PPMA scales the keys by ``d ** -0.5`` before RoPE).
        transpose: apply the adjoint (inverse) rotation instead.

    Returns:
        ``[B, H, W, heads, d]`` contiguous, in ``x``'s dtype, computed in fp32 (fp64 when ``x`` or the tables
        are fp64). Runs the compiled kernel or :func:`ppma.ops.reference.rope_ref` as ``ppma.ops.set_impl``
        says (the reference on devices without a kernel); both give the same numbers up to rounding.
    """
    _check(x, sin, cos, scale, transpose)
    if _dispatch.get_impl() == "reference" or x.device.type not in _ROPE_DEVICES or x.numel() == 0:
        return rope_ref(x, sin, cos, float(scale), transpose)
    check_same_device(_OP, x=x, sin=sin, cos=cos)
    return torch.ops.ppma.rope(x, sin, cos, float(scale), transpose)


def uses_inplace_kernel(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rope_` writes over ``x`` (``torch.ops.ppma.rope_``): a built kernel, the "fused"
    implementation, a contiguous CPU ``x``, outside torch.compile, and no gradient recorded (the op overwrites
    ``x`` and has no autograd formula)."""
    return (
        _HAS_OP
        and _dispatch.get_impl() == "fused"
        and x.device.type == "cpu"
        and x.is_contiguous()
        and not records_grad(x, sin, cos)
        and not torch.compiler.is_compiling()
    )


def rope_(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, scale: float = 1.0,
          transpose: bool = False) -> torch.Tensor:
    """:func:`rope` written over ``x`` where :func:`uses_inplace_kernel` allows it (CPU inference): no second map
    of ``x``'s size is allocated, and the values are :func:`rope`'s, bit for bit (the same kernel). Elsewhere it
    returns ``rope(x, sin, cos, scale, transpose)``, a new tensor, and leaves ``x`` alone. Callers must use the
    result and must not rely on ``x`` keeping or losing its values.

    Args:
        x: ``[B, H, W, heads, d]``, a tensor the caller owns (no one else may still need its values).
        sin, cos, scale, transpose: as for :func:`rope`.

    Returns:
        ``x`` itself (overwritten) or a new tensor, as above.
    """
    _check(x, sin, cos, scale, transpose)
    check_no_overlap("ppma.ops.cpu.rope_", "x", x, sin=sin, cos=cos)  # sin and cos are read while x is written
    if not uses_inplace_kernel(x, sin, cos) or x.numel() == 0:
        return rope(x, sin, cos, scale, transpose)
    check_same_device(_OP, x=x, sin=sin, cos=cos)
    torch.ops.ppma.rope_(x, sin, cos, float(scale), transpose)
    return x


def _fake(x, sin, cos, scale, transpose):
    check_same_device(_OP, x=x, sin=sin, cos=cos)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _fake_inplace(x, sin, cos, scale, transpose):
    check_same_device(_OP, x=x, sin=sin, cos=cos)


def _setup_context(ctx, inputs, output):
    x, sin, cos, scale, transpose = inputs
    ctx.scale, ctx.transpose = scale, transpose
    # x is needed only for the (rare) gradients of the tables; nothing is saved when they need none.
    need_tables = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(sin, cos, x if need_tables else None)


def _backward(ctx, grad_y):
    sin, cos, x = ctx.saved_tensors
    grad_x = grad_sin = grad_cos = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.ppma.rope(grad_y.contiguous(), sin, cos, ctx.scale, not ctx.transpose)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        ct = torch.promote_types(torch.promote_types(x.dtype, sin.dtype), torch.float32)
        xs, g = x.to(ct) * ctx.scale, grad_y.to(ct)
        if ctx.needs_input_grad[2]:
            grad_cos = (g * xs).sum(dim=(0, 3)).to(cos.dtype)
        if ctx.needs_input_grad[1]:
            # forward: <g, rot(xs) s> -> sum rot(xs) g; transpose: <g, rot^T(xs s)> = <rot(g), xs s>
            u, v = (g, xs) if ctx.transpose else (xs, g)
            rot_u = torch.stack((-u[..., 1::2], u[..., 0::2]), dim=-1).flatten(-2)
            grad_sin = (rot_u * v).sum(dim=(0, 3)).to(sin.dtype)
    return grad_x, grad_sin, grad_cos, None, None


if _HAS_OP:
    torch.library.register_fake("ppma::rope")(_fake)
    torch.library.register_autograd("ppma::rope", _backward, setup_context=_setup_context)
    torch.library.register_fake("ppma::rope_")(_fake_inplace)
