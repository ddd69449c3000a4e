"""Building blocks of the PPMA backbone (docs/model.md §4): depthwise convs, FFN, stem, patch merging, head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as _module

from ppma.nn.monarch import MonarchLinear
from ppma.ops.cpu.depthwise_conv2d import depthwise_conv2d, depthwise_conv2d_residual_
from ppma.ops.cpu.depthwise_conv2d import gelu_depthwise_conv2d_residual, uses_gelu_kernel
from ppma.ops.cpu.depthwise_conv2d import uses_kernel as depthwise_conv2d_uses_kernel
from ppma.ops.cpu.layer_norm import layer_norm as _layer_norm_op
from ppma.ops import _dispatch
from ppma.ops._validate import records_grad

__all__ = ["DWConv2d", "DropPath", "LayerNorm", "LayerScale", "ConvFFN", "ConvStem", "PatchMerging", "ClassifierHead",
           "MLPS", "linear", "linears", "conv_bn", "set_inference_fast_paths", "inference_fast_paths_enabled",
           "use_inference_fast_paths"]

# The two linear layers of the FFN: "standard" is nn.Linear (the official model), "monarch" the Surrogate FFN Block's
# Monarch matrices (seed paper "... via Structured Matrix", §4.2, Eq. 5; ppma.nn.MonarchLinear).
MLPS = ("standard", "monarch")

# Device types that have an autocast state (torch.is_autocast_enabled raises for others, e.g. "meta").
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu"})


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types without autocast (``meta``)."""
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


# oneDNN's linear and convolution with a fused bias and activation (the ops inductor's CPU fusion emits), where this
# torch build has them, and whether oneDNN has bf16 kernels on this CPU.
_ONEDNN = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
           and hasattr(torch.ops.mkldnn, "_convolution_pointwise"))
_ONEDNN_BF16 = _ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks)


# Whether the CPU inference fast paths below may run.
_fast_paths: bool = True


def set_inference_fast_paths(enabled: bool) -> None:
    """Switch the model's CPU inference fast paths on (the default) or off: oneDNN's fused linear and convolution
    ops (:func:`linear`, :func:`conv_bn`, the stem on channels-last data), the FFN's in-place ``h + dwconv(h)``,
    the LePE added in place (:class:`DWConv2d`), RoPE on the attention's own q and k in place
    (:func:`ppma.ops.cpu.rope_`), the block's residual sums added into its own CPE output and its LayerNorms on
    ppma's kernels (:class:`LayerNorm`, :func:`ppma.ops.cpu.add_layer_norm_`). Off, every module runs its plain torch
    call, as in training: the numbers of the plain modules (the fast paths agree with them up to rounding), e.g. to
    compare with other code bit for bit, or the stand-in for the official code in
    ``benchmarks/bench_model_cpu.py``. The attention ops are chosen by ``ppma.ops.set_impl`` instead."""
    global _fast_paths
    _fast_paths = bool(enabled)


def inference_fast_paths_enabled() -> bool:
    """Whether the CPU inference fast paths may run (:func:`set_inference_fast_paths`)."""
    return _fast_paths


class use_inference_fast_paths:
    """Context manager: :func:`set_inference_fast_paths` inside the ``with`` block, the previous choice restored
    on exit. ``with ppma.nn.use_inference_fast_paths(False): y = model(x)``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self._prev: list[bool] = []

    def __enter__(self) -> "use_inference_fast_paths":
        global _fast_paths
        self._prev.append(_fast_paths)
        _fast_paths = self.enabled
        return self

    def __exit__(self, *exc) -> None:
        global _fast_paths
        _fast_paths = self._prev.pop()


def _eager_inference(x: torch.Tensor, *modules: nn.Module) -> bool:
    """Whether the inference fast paths of this module (oneDNN's fused ops, in-place kernels) may replace the calls
    of ``modules`` on ``x``: switched on (:func:`set_inference_fast_paths`), eager CPU float32 parameters with no
    gradient recorded (not training), and not under ``torch.compile`` (which fuses on its own), tracing or export,
    with no forward hooks on a module (they must see its call) and no active dispatch mode (observers such as FLOP
    counters see the aten ops)."""
    return (
        _fast_paths
        and type(x) is torch.Tensor  # not a tracer's stand-in (FX proxies, fake tensors)
        and x.device.type == "cpu"
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not any(_has_hooks(m) for m in modules)
        and _own_params_float32_no_grad(x, modules)
    )


def _own_params_float32_no_grad(x: torch.Tensor, modules: tuple[nn.Module, ...]) -> bool:
    """The modules' own parameters are float32 and autograd records nothing on them or ``x``. Reads
    ``_parameters`` directly: ``parameters(recurse=False)`` builds a generator and a set of seen tensors per call,
    which cost more than the checks themselves at ~150 calls a forward."""
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    for m in modules:
        for p in m._parameters.values():
            if p is not None and (p.dtype != torch.float32 or (grad and p.requires_grad)):
                return False
    return True


def _onednn_inference_dtype(x: torch.Tensor, *modules: nn.Module) -> torch.dtype | None:
    """The dtype in which :func:`linear`, :func:`conv_bn` and :class:`DWConv2d` may run oneDNN's fused inference
    ops on ``x`` through ``modules``, or None where they must run the modules themselves.

    float32 for CPU float32 inference; bfloat16 under ``torch.autocast("cpu", dtype=torch.bfloat16)``, which runs
    linear layers and convolutions in bf16 anyway, where oneDNN has bf16 kernels. None where
    :func:`_eager_inference` says no (training, ``torch.compile``, tracing and export, hooks, dispatch modes,
    other devices, weights that are not float32)."""
    if not (_ONEDNN and _eager_inference(x, *modules)):
        return None
    if autocast_enabled("cpu"):
        bf16 = torch.get_autocast_dtype("cpu") == torch.bfloat16 and _ONEDNN_BF16
        return torch.bfloat16 if bf16 and x.dtype in (torch.float32, torch.bfloat16) else None
    return torch.float32 if x.dtype == torch.float32 else None


def _attr(gelu: bool) -> tuple[str, list, str]:
    # oneDNN's post-op: the exact (erf) GELU, or none
    return ("gelu", [], "none") if gelu else ("none", [], "")


def linear(x: torch.Tensor, layer: nn.Module, gelu: bool = False) -> torch.Tensor:
    """``layer(x)``, followed by the exact (erf) GELU when ``gelu``: the projections of :class:`ConvFFN` and
    ``PPMAAttention``.

    For CPU inference of an ``nn.Linear`` in float32, or in bf16 under CPU autocast, it runs oneDNN's linear,
    which adds the bias (and applies the GELU, in float32 before any rounding to bf16) inside the product; ATen's
    ``addmm`` first copies the bias into the output and GELU is one more pass. The products then sum in another
    order: the result equals ``F.linear`` up to rounding (bf16 under autocast, as autocast's own linear). Everywhere
    else (training, ``torch.compile``, tracing and export, forward hooks, dispatch modes, other devices and dtypes;
    see :func:`_onednn_inference_dtype`) it is ``layer(x)`` and ``F.gelu``.
    """
    dt = _onednn_inference_dtype(x, layer) if type(layer) is nn.Linear else None
    if dt is not None:
        w = layer.weight if dt == torch.float32 else layer.weight.to(dt)  # the bias stays float32
        return torch.ops.mkldnn._linear_pointwise(x.to(dt), w, layer.bias, *_attr(gelu))
    y = layer(x)
    return F.gelu(y) if gelu else y


def _fused_eager_cpu(x: torch.Tensor) -> bool:
    """The "fused" implementation on an eager CPU tensor (not a tracer's stand-in, not under torch.compile or
    tracing): the condition every model-side training path below starts from."""
    return (
        _dispatch.get_impl() == "fused"
        and type(x) is torch.Tensor
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


def _shared_input_training(x: torch.Tensor, layers: tuple[nn.Module, ...]) -> bool:
    """Whether :func:`linears` runs its one autograd node: CPU training of float32/float64 ``nn.Linear`` layers with
    biases in ``x``'s dtype and the "fused" implementation, a gradient to compute, no autocast, torch.compile,
    tracing, dispatch mode or forward hooks (all of which see the separate layers)."""
    return (
        _fused_eager_cpu(x)
        and x.dtype in (torch.float32, torch.float64)
        and all(type(m) is nn.Linear and m.bias is not None and m.weight.dtype == x.dtype and m.bias.dtype == x.dtype
                for m in layers)
        and records_grad(x, *(p for m in layers for p in (m.weight, m.bias)))
        and not autocast_enabled("cpu")
        and not torch._C._len_torch_dispatch_stack()
        and not any(_has_hooks(m) for m in layers)
    )


def _channels_last_convs(x: torch.Tensor) -> bool:
    """Whether :class:`ConvStem` and :class:`PatchMerging` run their convolutions and BatchNorms on channels-last
    maps outside the inference fast paths (in training above all): CPU, the "fused" implementation, eager (not
    under torch.compile or tracing). oneDNN's CPU convolutions run faster on channels-last data than on NCHW (8x for
    the stem's first, 3-input-channel convolution), and the maps these modules return are channels-last anyway, so
    the permute copies vanish too: 1.5-3 % of a PPMA-T training step (README, "Whole model on the CPU"). PatchMerging
    does so only where its input map has at least as many elements as its convolution's weight, which every call
    converts to channels-last. The same modules and calls, so the numbers equal the NCHW path's up to oneDNN's
    rounding. With the "reference" implementation they run on NCHW maps, as the official code does."""
    return _fused_eager_cpu(x)


def linears(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x, m) for m in layers)``: several projections of one input (the attention's q, k and v).

    In CPU training with the "fused" implementation (float32/float64 ``nn.Linear`` layers with biases; see
    :func:`_shared_input_training`) they are one autograd node: the forward is the layers' own ``addmm`` (the same
    bits as calling them), and the backward sums the input's gradient inside the products (``addmm`` into the first
    product's result) instead of autograd adding one map of ``x``'s size per layer: one pass over ``x``'s gradient
    per layer fewer. The gradients equal the separate layers' up to float rounding (the sum's order). Everywhere
    else it calls :func:`linear` for each layer."""
    if not _shared_input_training(x, layers):
        return tuple(linear(x, m) for m in layers)
    return _SharedInputLinears.apply(x, *(p for m in layers for p in (m.weight, m.bias)))


class _SharedInputLinears(torch.autograd.Function):
    """``x @ W_i^T + b_i`` for each ``(W_i, b_i)``; the backward accumulates ``sum_i g_i @ W_i`` with ``addmm``."""

    @staticmethod
    def forward(ctx, x, *params):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, *params[0::2])
        ctx.x_shape = x.shape
        return tuple(torch.addmm(b, x2, w.t()).view(*x.shape[:-1], w.shape[0]) for w, b in zip(params[0::2],
                                                                                              params[1::2]))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        # every g is a tensor: autograd materialises the gradients of unused outputs as zeros
        x2, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = None
        res = []
        for i, (g, w) in enumerate(zip(grads, weights)):
            g2 = g.reshape(-1, g.shape[-1])
            if need[0]:
                gx = torch.mm(g2, w) if gx is None else gx.addmm_(g2, w)
            res += [g2.t().mm(x2) if need[1 + 2 * i] else None, g2.sum(0) if need[2 + 2 * i] else None]
        return (None if gx is None else gx.view(ctx.x_shape), *res)


def conv_bn(x: torch.Tensor, conv: nn.Conv2d, bn: nn.BatchNorm2d, gelu: bool = False) -> torch.Tensor:
    """``bn(conv(x))``, followed by the exact (erf) GELU when ``gelu``: the stem and the patch merging.

    For CPU inference (float32, or bf16 under CPU autocast; :func:`_onednn_inference_dtype`) with the BatchNorm in
    eval mode on its running statistics, the BatchNorm is folded into the convolution's weight and bias (in
    float32) and oneDNN runs the convolution with the GELU fused: one pass instead of three. Equal to the modules'
    result up to rounding. Everywhere else it calls ``conv``, ``bn`` and ``F.gelu``.
    """
    dt = _onednn_inference_dtype(x, conv, bn)
    if (
        dt is not None
        and type(conv) is nn.Conv2d
        and type(bn) is nn.BatchNorm2d
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
        and not bn.training
        and bn.running_mean is not None
        and bn.running_var is not None
    ):
        scale = torch.rsqrt(bn.running_var + bn.eps)
        shift = -bn.running_mean * scale
        if bn.affine:
            scale, shift = scale * bn.weight, shift * bn.weight + bn.bias
        # the folded weight in channels-last order: oneDNN reorders it into its blocked layout on every call, which
        # on small maps costs up to ~2 ms from OIHW for the last merging's 256 -> 512 weight, ~0.2 ms from OHWI
        # (4 x 4 maps; no difference measured at PPMA-T's 224² and 512² maps)
        weight = (conv.weight.contiguous(memory_format=torch.channels_last) * scale[:, None, None, None]).to(dt)
        bias = shift if conv.bias is None else conv.bias * scale + shift
        return torch.ops.mkldnn._convolution_pointwise(x.to(dt), weight, bias, conv.padding, conv.stride,
                                                       conv.dilation, conv.groups, *_attr(gelu))
    y = bn(conv(x))
    return F.gelu(y) if gelu else y


class DWConv2d(nn.Module):
    """Depthwise ``k x k`` convolution (stride 1, same padding, with bias) on channels-last maps.

    ``[B, H, W, C] -> [B, H, W, C]`` (the official ``DWConv2d``; used for CPE, LePE and the FFN).
    """

    def __init__(self, dim: int, kernel_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, kernel_size, 1, kernel_size // 2, groups=dim)

    def forward(
        self, x: torch.Tensor, residual: bool = False, add: torch.Tensor | None = None, inplace: bool = False
    ) -> torch.Tensor:
        """``x: [B, H, W, C]`` -> ``conv(x)``; ``x + conv(x)`` with ``residual=True``; ``add + conv(x)`` with
        ``add`` (``[B, H, W, C]``, the LePE added to the attention's output).

        The permuted view of a contiguous ``[B, H, W, C]`` map is NCHW in torch's channels-last memory format,
        which the convolution keeps, so no copy is made on the way in or out. ``residual=True`` folds the
        identity into the kernel's centre tap (``x + w * x = (w + δ) * x``), saving the separate pass of the
        addition, when the convolution runs in fp32/fp64; in low precision (a bf16/fp16 model or autocast)
        it adds ``x`` afterwards, because ``1 + w`` would round ``w`` to a few bits.

        ``inplace=True`` lets eager CPU inference (:func:`_eager_inference`) write the result over the caller's
        own map instead of allocating one more: over ``x`` with ``residual=True``
        (``ppma.ops.cpu.depthwise_conv2d_residual_``, the FFN's hidden map: float32 without autocast, or bf16 under
        bf16 autocast, computed in float32 and rounded once), over ``add`` otherwise (oneDNN adds the
        convolution's output to ``add`` in place, float32 or bf16 under autocast, rounded once). The caller must
        use the returned tensor and must not need the overwritten map's values afterwards. Everywhere else (and
        with ``inplace=False``) nothing is overwritten; the numbers agree up to rounding.
        """
        conv = self.conv
        if add is not None:
            if residual:
                raise ValueError("DWConv2d: pass either residual=True or add, not both")
            if tuple(add.shape) != tuple(x.shape):
                raise ValueError(f"DWConv2d: add must have x's shape {tuple(x.shape)}, got {tuple(add.shape)}")
            dt = _onednn_inference_dtype(x, conv, self) if inplace else None
            if dt is not None and x.dtype == dt and add.dtype == dt and add.is_contiguous():
                # add += conv(x) inside oneDNN's convolution (one pass, no map for conv(x))
                b = None if conv.bias is None else conv.bias.to(dt)
                torch.ops.mkldnn._convolution_pointwise_.binary(
                    add.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2), conv.weight.to(dt), b, conv.padding,
                    conv.stride, conv.dilation, conv.groups, "add", None, None, [], None)
                return add
            return add + self.forward(x)
        if depthwise_conv2d_uses_kernel(x, conv.weight):
            # CPU training, >= 5x5 kernel: weight/bias gradients from ppma's kernel (docs/ops.md "depthwise_conv2d")
            return depthwise_conv2d(x, conv.weight, conv.bias, residual)
        if inplace and residual and _eager_inference(x, conv, self):
            # x <- x + conv(x) in place (a new tensor where the kernel does not apply): float32, or the bf16 map of
            # CPU autocast with the weights rounded to bf16 as autocast's convolution rounds them
            if x.dtype == torch.float32 and not autocast_enabled("cpu"):
                return depthwise_conv2d_residual_(x, conv.weight, conv.bias)
            if (x.dtype == torch.bfloat16 and autocast_enabled("cpu")
                    and torch.get_autocast_dtype("cpu") == torch.bfloat16):
                b = None if conv.bias is None else conv.bias.to(x.dtype)
                return depthwise_conv2d_residual_(x, conv.weight.to(x.dtype), b)
        xc = x.permute(0, 3, 1, 2)
        if residual and x.dtype in (torch.float32, torch.float64) and not autocast_enabled(x.device.type):
            c = conv.kernel_size[0] // 2
            weight = conv.weight.clone()
            weight[:, :, c, c] += 1.0
            y = F.conv2d(xc, weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
            residual = False
        else:
            y = conv(xc)
        # contiguous(): free in eager when the conv keeps channels-last; inductor with dynamic shapes
        # fails on permuted conv outputs (torch 2.13, "ValueRangeError: Invalid ranges")
        y = y.permute(0, 2, 3, 1).contiguous()
        return x + y if residual else y


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (the same parameters, state dict and numbers up to rounding) whose eager CPU inference runs
    ppma's kernel, :func:`ppma.ops.cpu.layer_norm` (float32; 2x torch's at PPMA-T's widths, docs/ops.md "layer_norm"):
    over the last dimension, with a weight and a bias, fast paths on (:func:`set_inference_fast_paths`), no
    gradient recorded, no hooks, outside torch.compile, tracing and export. Everywhere else ``nn.LayerNorm``'s
    forward. PPMABlock's ``norm1`` and ``norm2``; it is an FX leaf (ppma.models.timm), so a traced model computes
    its norms as the eager one does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_path(x):
            return _layer_norm_op(x, self.weight, self.bias, self.eps)
        return super().forward(x)

    def fast_path(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs ppma's kernel on ``x`` (and so whether ``ppma.ops.cpu.add_layer_norm_`` with
        this module's parameters gives its numbers for a sum)."""
        return (len(self.normalized_shape) == 1 and self.weight is not None and self.bias is not None
                and _eager_inference(x, self))


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """Stochastic depth per sample: zero whole samples with probability ``drop_prob``, rescale the rest.

    ``x * mask / keep``: ``x / keep`` for a kept sample and ``x * 0`` for a dropped one. In float32 and float64
    that is one division by a per-sample ``keep`` or ``inf`` (bit for bit the same, NaN and Inf included): one pass
    over ``x`` forward and backward instead of two."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    if x.dtype in (torch.float32, torch.float64):
        return x / mask.new_full(mask.shape, float("inf")).masked_fill_(mask.bool(), keep)
    return x * mask / keep  # low precision: the scalar division runs in float32 inside the op


class DropPath(nn.Module):
    """Stochastic depth (``drop_path``) as a module."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = float(drop_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class LayerScale(nn.Module):
    """Per-channel scaling ``x * gamma`` (``gamma: [C]``, initialised to ``init_values``), channels last."""

    def __init__(self, dim: int, init_values: float = 1e-6) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ConvFFN(nn.Module):
    """``fc2(h + dwconv3x3(h))`` with ``h = GELU(fc1(x))`` (docs/model.md §4, the official ``FeedForwardNetwork``).

    ``[B, H, W, C] -> [B, H, W, C]``; hidden width ``hidden_dim``. ``mlp`` (one of :data:`MLPS`) chooses ``fc1``
    and ``fc2``: ``"standard"`` dense ``nn.Linear`` layers, ``"monarch"`` the Surrogate FFN Block's
    ``Y = GELU(X M^1) M^2`` with :class:`ppma.nn.MonarchLinear` ``M^1, M^2`` (seed paper "... via Structured
    Matrix", §4.2, Eq. 5; the depthwise conv between them is kept).
    """

    def __init__(self, dim: int, hidden_dim: int, mlp: str = "standard") -> None:
        super().__init__()
        if mlp not in MLPS:
            raise ValueError(f"ConvFFN: mlp must be one of {MLPS}, got {mlp!r}")
        linear = MonarchLinear if mlp == "monarch" else nn.Linear
        self.fc1 = linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.dwconv = DWConv2d(hidden_dim, 3)
        self.fc2 = linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.act) is nn.GELU and self.act.approximate == "none":
            conv = self.dwconv.conv if type(self.dwconv) is DWConv2d else None
            if (conv is not None and not any(_has_hooks(m) for m in (self.act, self.dwconv, conv))
                    and uses_gelu_kernel(x, conv.weight, conv.bias)):
                # CPU training: GELU and h + dwconv(h) as one op that keeps fc1's output only, one ppma kernel each
                # way (ppma.ops.cpu.gelu_depthwise_conv2d_residual; output and gradients equal to the modules' up to
                # rounding)
                return self.fc2(gelu_depthwise_conv2d_residual(self.fc1(x), conv.weight, conv.bias))
            x = linear(x, self.fc1, gelu=True)
        else:
            x = self.act(self.fc1(x))
        # x + dwconv(x), over fc1's output (ours alone) in CPU inference
        return linear(self.dwconv(x, residual=True, inplace=True), self.fc2)


class ConvStem(nn.Module):
    """Four 3x3 convs (strides 2, 1, 2, 1) with BatchNorm and GELU between (docs/model.md §4, stride 4).

    ``[B, in_chans, H, W] -> [B, ceil(H/4), ceil(W/4), out_dim]`` (channels last).
    """

    def __init__(self, in_chans: int, out_dim: int) -> None:
        super().__init__()
        mid = out_dim // 2
        self.conv1 = nn.Conv2d(in_chans, mid, 3, 2, 1)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out_dim, 3, 2, 1)
        self.bn3 = nn.BatchNorm2d(out_dim)
        self.conv4 = nn.Conv2d(out_dim, out_dim, 3, 1, 1)
        self.bn4 = nn.BatchNorm2d(out_dim)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = type(self.act) is nn.GELU and self.act.approximate == "none" and not _has_hooks(self.act)
        if gelu and _onednn_inference_dtype(x, self.conv1) is not None:
            # CPU inference: BN folded, GELU fused (conv_bn), on a channels-last map, where oneDNN's convolutions
            # run 2-3x faster than on NCHW (the output is wanted channels-last anyway)
            x = x.contiguous(memory_format=torch.channels_last)
            for conv, bn in ((self.conv1, self.bn1), (self.conv2, self.bn2), (self.conv3, self.bn3)):
                x = conv_bn(x, conv, bn, gelu=True)
            x = conv_bn(x, self.conv4, self.bn4)
        else:
            if _channels_last_convs(x):
                x = x.contiguous(memory_format=torch.channels_last)
            x = self.act(self.bn1(self.conv1(x)))
            x = self.act(self.bn2(self.conv2(x)))
            x = self.act(self.bn3(self.conv3(x)))
            x = self.bn4(self.conv4(x))
        return x.permute(0, 2, 3, 1).contiguous()  # see DWConv2d


class PatchMerging(nn.Module):
    """3x3 stride-2 conv + BatchNorm: ``[B, H, W, C_in] -> [B, ceil(H/2), ceil(W/2), C_out]``."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, out_dim, 3, 2, 1)
        self.norm = nn.BatchNorm2d(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _onednn_inference_dtype(x, self.conv) is not None:
            # CPU inference: BN folded (conv_bn) on the channels-last view, no copies
            x = conv_bn(x.permute(0, 3, 1, 2), self.conv, self.norm)
        elif _channels_last_convs(x) and x.numel() >= self.conv.weight.numel():
            # the channels-last view as it is: no copy in, and the output's permute below is contiguous already.
            # Only where the map outweighs the weight, which each call converts to channels-last (a copy): at
            # PPMA-T's last merging (256 -> 512 channels, 14² or 32² maps) NCHW is faster (24.5 against 18.4 ms
            # forward + backward at b8@224)
            x = self.norm(self.conv(x.permute(0, 3, 1, 2)))
        else:
            # contiguous NCHW input: inductor with dynamic shapes fails on a strided conv + BN over a
            # channels-last input (torch 2.13); the copy is one stage output, three times per forward
            x = self.norm(self.conv(x.permute(0, 3, 1, 2).contiguous()))
        return x.permute(0, 2, 3, 1).contiguous()


GLOBAL_POOLS = ("avg", "")


def _check_pool(global_pool: str, num_classes: int) -> None:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"ClassifierHead: global_pool must be 'avg' or '' (no pooling), got {global_pool!r}")
    if global_pool == "" and num_classes > 0:
        raise ValueError(f"ClassifierHead: global_pool='' (unpooled features) needs num_classes=0, got {num_classes}")


class ClassifierHead(nn.Module):
    """``fc(avgpool(swish(BN(proj(x)))))`` (docs/model.md §4 classification head).

    ``x: [B, C, H, W]`` -> logits ``[B, num_classes]`` (or the pooled ``[B, hidden_dim]`` with
    ``pre_logits=True``). ``num_classes=0`` makes ``fc`` the identity. ``global_pool=""`` (timm's "no pooling",
    with ``num_classes=0`` only) skips the average: the output is the unpooled ``[B, hidden_dim, H, W]``.
    """

    def __init__(self, in_dim: int, hidden_dim: int, num_classes: int, drop_rate: float = 0.0,
                 global_pool: str = "avg") -> None:
        super().__init__()
        _check_pool(global_pool, num_classes)
        self.in_dim, self.hidden_dim, self.num_features = in_dim, hidden_dim, hidden_dim
        self.global_pool = global_pool
        self.proj = nn.Linear(in_dim, hidden_dim)
        self.norm = nn.BatchNorm2d(hidden_dim)
        self.drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(hidden_dim, num_classes) if num_classes > 0 else nn.Identity()

    def reset(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace ``fc`` by a fresh ``Linear(hidden_dim, num_classes)`` (identity for 0); ``global_pool``
        (``"avg"`` or ``""``) when given."""
        global_pool = self.global_pool if global_pool is None else global_pool
        _check_pool(global_pool, num_classes)
        self.global_pool = global_pool
        self.fc = nn.Linear(self.hidden_dim, num_classes) if num_classes > 0 else nn.Identity()
        if isinstance(self.fc, nn.Linear):
            nn.init.trunc_normal_(self.fc.weight, std=0.02)
            nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.proj(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = F.silu(self.norm(x))  # swish
        if self.global_pool == "avg":
            x = x.flatten(2).mean(-1)
        x = self.drop(x)
        return x if pre_logits else self.fc(x)
