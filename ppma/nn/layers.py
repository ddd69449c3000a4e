"""Building blocks of the PPMA backbone (docs/model.md §4): depthwise convs, FFN, stem, patch merging, head.

Every module here runs its plain torch calls (the official model's) unless :func:`ppma.nn.fuse_for_inference` fused
it for CPU inference: then its ``fused`` attribute is True and its forward runs the fused pieces (oneDNN's linear and
convolution with the bias and GELU inside, BatchNorm folded into the convolutions once, ppma's in-place kernels of
``ppma.ops.cpu``) without deciding anything per call; a cheap guard raises where those pieces do not apply
(docs/design.md §2.9)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as _module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.weak import WeakIdKeyDictionary

from ppma.nn.monarch import MonarchLinear
from ppma.ops.cpu.depthwise_conv2d import depthwise_conv2d, depthwise_conv2d_residual_
from ppma.ops.cpu.depthwise_conv2d import gelu_depthwise_conv2d_residual, uses_gelu_kernel
from ppma.ops.cpu.depthwise_conv2d import uses_kernel as depthwise_conv2d_uses_kernel
from ppma.ops.cpu.layer_norm import layer_norm as _layer_norm_op
from ppma.ops.cpu.layer_norm import layer_norm_node, uses_layer_norm_node
from ppma.ops.cpu.layer_norm import uses_kernel as _layer_norm_uses_kernel
from ppma.ops import _dispatch

__all__ = ["DWConv2d", "DropPath", "LayerNorm", "LayerScale", "ConvFFN", "ConvStem", "PatchMerging", "ClassifierHead",
           "MLPS", "linear", "linears", "fold_batch_norm", "FUSED_FOR_INFERENCE"]

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


@torch.compiler.assume_constant_result  # traced: called, not traced (it reads the CPU's flags once)
def bf16_products_widened() -> bool:
    """Whether bf16 autocast runs the model's products on float32 kernels fed the bf16-rounded values: the linear
    layers and convolutions of a model fused by :func:`ppma.nn.fuse_for_inference` and of ``compile_model``'s frozen
    graphs (oneDNN's), and of the unfused model in inference and training (:func:`linear`, :func:`linears`,
    :func:`conv2d`; float32 GEMMs and convolutions; not the depthwise ones): where this CPU has no
    bf16 instructions (``ppma.backends.cpu_matrix_unit()`` is ``"avx512"`` or ``"avx2"``), oneDNN's bf16 kernels
    widen every bf16 operand to float32 inside their loops and ran 2.5-3.4x slower than its float32 kernels on
    PPMA-T's shapes (docs/performance.md "bf16 and fp16 on the CPU"). The product of two bf16 values is exact in
    float32 and both sum in float32, so the widened products compute what oneDNN's bf16 kernels compute, up to the
    order of the sums: the input and the weight rounded to bf16 (the weight once, kept), float32 products, sums,
    bias and GELU, the output rounded to bf16 once. On CPUs with AMX or AVX-512 BF16 the bf16 kernels run."""
    global _WIDENED
    if _WIDENED is None:
        from ppma import backends

        _WIDENED = backends.cpu_bf16_widened()
    return _WIDENED


_WIDENED: bool | None = None  # bf16_products_widened(), read once


@torch.compiler.assume_constant_result  # traced: called, not traced
def fp16_products_widened() -> bool:
    """Whether fp16 autocast runs the model's linear layers and convolutions (the depthwise ones too) on float32 kernels
    fed the fp16-rounded values, in inference and training (:func:`linear`, :func:`linears`, :func:`conv2d`,
    :class:`DWConv2d`): where torch's oneDNN has no fp16 kernels on this CPU (``ppma.backends.cpu_fp16_widened()``),
    torch's fp16 convolutions and linear layers run on fallback kernels, about 9x slower than float32 for PPMA-T
    (docs/performance.md "fp16 autocast on a CPU without fp16 kernels"). The product of two fp16 values is exact in
    float32 (11-bit significands, a 22-bit product) and torch's fp16 kernels sum in float32 too, so the widened
    products compute what they compute, up to the order of the sums."""
    global _WIDENED_FP16
    if _WIDENED_FP16 is None:
        from ppma import backends

        _WIDENED_FP16 = backends.cpu_fp16_widened()
    return _WIDENED_FP16


_WIDENED_FP16: bool | None = None  # fp16_products_widened(), read once

# The first words of every error of a fused module's guard (:func:`_fused_dtype`).
FUSED_FOR_INFERENCE = "this model was fused for CPU inference by ppma.nn.fuse_for_inference"


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks)


# ------------------------------------------------------------------------------------------- the fused pieces
def _fused_error(module: nn.Module, what: str) -> RuntimeError:
    return RuntimeError(
        f"{type(module).__name__}: {FUSED_FOR_INFERENCE}, which runs it in eval mode, without gradients, on "
        f"CPU tensors, in float32 or under torch.autocast('cpu', dtype=torch.bfloat16); got {what}. Train, trace, "
        "compile, export or move the model as it was before the step (build or load it again; a fused model's "
        "state_dict loads into an unfused one)")


def _fused_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The guard of a fused module's forward, and the dtype its oneDNN ops run in: float32, or bfloat16 under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` (which runs linear layers and convolutions in bf16 anyway), read
    from the autocast state of this call. Raises (never falls back) for a module in training mode, an input that
    records a gradient, a tensor that is not a plain CPU tensor (tracers' stand-ins, torch.compile's fake tensors,
    other devices), and other autocast dtypes or a CPU without oneDNN's bf16 kernels."""
    if module.training:
        raise _fused_error(module, "a module in training mode")
    if type(x) is not torch.Tensor or torch.compiler.is_compiling():
        raise _fused_error(module, f"a traced or compiled call ({type(x).__name__})")
    if x.device.type != "cpu":
        raise _fused_error(module, f"an input on {x.device}")
    if x.requires_grad and torch.is_grad_enabled():
        raise _fused_error(module, "an input that requires grad, with grad mode on")
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32
    if torch.get_autocast_dtype("cpu") != torch.bfloat16 or not _ONEDNN_BF16:
        raise _fused_error(module, f"CPU autocast to {torch.get_autocast_dtype('cpu')}"
                           + ("" if _ONEDNN_BF16 else " on a CPU without oneDNN's bf16 kernels"))
    return torch.bfloat16


# The bf16 copies of fused modules' weights (:func:`_param_as`), by weight, then by (dtype, widened, packed): an
# entry goes with its weight.
# (by identity: torch.utils.weak.WeakIdKeyDictionary, since tensors compare element-wise)
_CASTS = WeakIdKeyDictionary()


def _param_as(t: torch.Tensor | None, dt: torch.dtype, widened: bool = False,
              pack: tuple | None = None) -> torch.Tensor | None:
    """``t.to(dt)`` for a parameter or buffer ``t`` of a fused module, kept between calls: bf16 autocast inference
    rounds each weight to bf16 once, not on every call (about 1 % of PPMA-T's bf16 forward). With ``widened``,
    ``t.to(dt).float()`` (the bf16-rounded weight in float32, :func:`bf16_products_widened`). With ``pack`` (under
    bf16 autocast): that copy reordered once into oneDNN's blocked layout (:func:`_packed`), which oneDNN's linear and
    convolution ops otherwise make at every call; held instead of the plain copy, so it costs no memory. The copy is
    made again when ``t`` points to other memory or was written in place (its version counter: ``load_state_dict``,
    ``copy_``), so it always equals ``t.to(dt)``; it is held beside ``t`` (not in any module or state_dict) and freed
    with it."""
    if t is None or (t.dtype == dt and not widened and pack is None):
        return t

    def cast():
        c = t.detach().to(dt)
        return c.float() if widened else c

    if t.is_inference():  # no version counter: an in-place write could not be seen; not packed at every call
        return cast()
    kept = _CASTS.get(t)
    if kept is None:
        kept = _CASTS[t] = {}
    key = (dt, widened, pack is not None)
    hit = kept.get(key)
    if hit is not None and hit[:2] == (t.data_ptr(), t._version):
        return hit[2]
    out = cast() if pack is None else _packed(cast(), pack)
    kept[key] = (t.data_ptr(), t._version, out)
    return out


def _packed(w: torch.Tensor, pack: tuple) -> torch.Tensor:
    """The weight ``w`` of a fused linear layer (``pack = ("linear", rows)``) or convolution (``pack = ("conv",
    padding, stride, dilation, groups, input_size)``) reordered into oneDNN's blocked layout for that product
    (``torch.ops.mkldnn._reorder_linear_weight``, ``torch._C._nn.mkldnn_reorder_conv2d_weight``: what Inductor's
    frozen graphs pass to the same ops). oneDNN then runs the kernel it runs on the plain weight, so the results are
    the same bits, also for inputs of other sizes (tests/test_cpu_fast_paths.py; the convolutions' inputs are
    channels-last, as every fused caller passes them). At PPMA-T's b8@224 shapes under bf16 autocast (AMD EPYC Zen 4,
    2 threads) the linear layers ran 3-6 % faster, the convolutions 1-5 % (stem) to 14-35 % (the last two patch
    mergings, whose weights are the largest)."""
    if pack[0] == "linear":
        return torch.ops.mkldnn._reorder_linear_weight(w, pack[1])
    _, padding, stride, dilation, groups, size = pack
    return torch._C._nn.mkldnn_reorder_conv2d_weight(w.to_mkldnn(), padding, stride, dilation, groups, size)


def _attr(gelu: bool) -> tuple[str, list, str]:
    # oneDNN's post-op: the exact (erf) GELU, or none
    return ("gelu", [], "none") if gelu else ("none", [], "")


def _fused_linear(x: torch.Tensor, layer: nn.Module, dt: torch.dtype, gelu: bool = False) -> torch.Tensor:
    """``layer(x)`` (+ the exact GELU) in a fused module: oneDNN's linear for an ``nn.Linear``, which adds the bias
    (and applies the GELU, in float32 before any rounding to bf16) inside the product, in ``dt`` (the weight rounded
    to bf16 as autocast's linear rounds it, the bias float32); the products sum in another order than ATen's
    ``addmm``, so the result equals ``F.linear``'s up to rounding. Another layer (``MonarchLinear``) runs its forward."""
    if type(layer) is not nn.Linear:
        y = layer(x)
        return F.gelu(y) if gelu else y
    if dt == torch.bfloat16 and bf16_products_widened():
        # float32 products of the bf16-rounded values, the output rounded once (bf16_products_widened); traced, the
        # weight's rounding is a constant of the frozen graph
        w = (layer.weight.to(dt).float() if torch.compiler.is_compiling()
             else _param_as(layer.weight, dt, widened=True, pack=_linear_pack(x)))
        return torch.ops.mkldnn._linear_pointwise(x.to(dt).float(), w, layer.bias, *_attr(gelu)).to(dt)
    w = _param_as(layer.weight, dt, pack=_linear_pack(x) if dt != torch.float32 else None)
    return torch.ops.mkldnn._linear_pointwise(x.to(dt), w, layer.bias, *_attr(gelu))


def _linear_pack(x: torch.Tensor) -> tuple:
    """:func:`_packed`'s description of a linear layer's product with input ``x``: its rows (all of ``x``'s dimensions
    but the last)."""
    return ("linear", max(1, x.numel() // max(1, x.shape[-1])))


def _traced_cpu_inference(x: torch.Tensor, *layers: nn.Module) -> bool:
    """Whether ``torch.compile`` (not ``torch.export``: its programs keep portable ops) is tracing a CPU inference
    graph (grad mode off) with the "fused" implementation, ``layers`` being ``nn.Linear`` layers with float32
    weights and no hooks: the common gate of the compiled-inference paths (:func:`compiled_onednn_dtype`,
    :class:`ConvFFN`)."""
    return (_ONEDNN and torch.compiler.is_compiling() and not torch.compiler.is_exporting()
            and not torch.is_grad_enabled() and x.device.type == "cpu" and _dispatch.get_impl() == "fused"
            and all(type(m) is nn.Linear and m.weight.dtype == torch.float32 and not _has_hooks(m) for m in layers))


def compiled_onednn_dtype(x: torch.Tensor, *layers: nn.Module) -> torch.dtype | None:
    """The dtype in which ``layers`` run as oneDNN's float32 linear op (:func:`_fused_linear`, the eager fused
    modules' products) inside a graph that ``torch.compile`` traces, or None where they run as they are.

    Under ``torch.compile`` with frozen weights (:func:`ppma.compile.compile_model`'s inference), in CPU inference
    (the rest of :func:`_traced_cpu_inference`'s gate): ``torch.float32`` without CPU autocast; ``torch.bfloat16``
    under bf16 autocast on a CPU without bf16 instructions (:func:`bf16_products_widened`: float32 products of the
    bf16-rounded values, the weight's rounding folded into the frozen constant). Compiled, the float32 layers would
    otherwise run what Inductor makes of ``F.linear``: MKL's packed GEMM and a generated kernel for the bias and
    GELU; oneDNN's linear with the bias and GELU inside is what eager inference runs, and the faster on PPMA-T's
    shapes (docs/compile.md); the bf16 ones oneDNN's bf16 kernels, 2.5-3.4x slower there. The products sum in
    another order than ``addmm``'s, so the results equal the layers' up to rounding, as the eager fused modules'
    do. Under bf16 autocast on CPUs with bf16 instructions Inductor's frozen graphs pack the weights for oneDNN's
    bf16 linear and fuse the GELU (None); training graphs (grad mode on) keep the layers: oneDNN's op has no
    backward."""
    if not (_traced_cpu_inference(x, *layers) and _frozen_trace()):
        return None
    if not autocast_enabled("cpu"):
        return torch.float32 if x.dtype == torch.float32 else None
    if torch.get_autocast_dtype("cpu") == torch.bfloat16 and _ONEDNN_BF16 and bf16_products_widened():
        return torch.bfloat16
    return None


def conv2d(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """``conv(x)``: the dense convolutions of the unfused :class:`ConvStem` and :class:`PatchMerging`, on a CPU without
    bf16 instructions under bf16 autocast (:func:`bf16_products_widened`) and on one without fp16 kernels under fp16
    autocast (:func:`fp16_products_widened`) as float32 convolutions of the rounded values, what autocast's
    convolution computes up to the order of the float32 sums:

    - traced for frozen CPU inference (:func:`compiled_onednn_dtype`'s bf16 case): input, weight and bias rounded to
      bf16 (the weight's rounding a constant of the frozen graph), the output rounded once, as the eager fused
      modules run them (:func:`_fused_conv`);
    - else where :func:`_widened_dtype` says so (CPU inference and training, eager or traced by ``torch.compile``, not
      ``torch.export``; the "fused" implementation; an ``nn.Conv2d`` without hooks, zero-padded):
      :class:`_WidenedConv`, with autocast's roundings of the gradients too.

    Anywhere else the convolution itself runs."""
    if type(conv) is not nn.Conv2d or _has_hooks(conv):
        return conv(x)
    if compiled_onednn_dtype(x) == torch.bfloat16:
        bf16 = torch.bfloat16
        return _conv_of_rounded(x.to(bf16), conv.weight.to(bf16), conv.bias, conv.stride, conv.padding, conv.dilation,
                                conv.groups)
    return _widened_conv(x, conv)


def conv3d(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """``conv(x)`` for the dense ``nn.Conv3d`` layers of the video model (``ppma.models.video``: the tubelet embedding
    and the spatial downsampling), widened as :func:`conv2d` (:class:`_WidenedConv`) where :func:`_widened_dtype`
    says so: float32 convolutions of the bf16 (fp16) rounded values on a CPU without bf16 instructions (fp16
    kernels)."""
    return _widened_conv(x, conv)


def _widened_conv(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """:class:`_WidenedConv` of ``conv`` where :func:`_widened_conv_dtype` gives a dtype, else ``conv(x)``."""
    dt = _widened_conv_dtype(x, conv)
    if dt is None:
        return conv(x)
    return _WidenedConv.apply(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups, dt)


def _widened_depthwise(xc: torch.Tensor, conv: nn.Module) -> torch.Tensor | None:
    """The depthwise convolution ``conv(xc)`` of :class:`DWConv2d` / ``ppma.nn.attention_3d.DWConv3d`` (``xc``
    channels-first) under fp16 autocast on a CPU without fp16 kernels: the float32 convolution of the fp16-rounded
    values (:func:`fp16_products_widened`), not torch's per-channel fallback; None anywhere else. bf16 keeps autocast's
    convolution: oneDNN's bf16 depthwise kernel ran faster than the widened one even where it emulates bf16
    (docs/performance.md "bf16 and fp16 on the CPU")."""
    if _widened_conv_dtype(xc, conv) != torch.float16:
        return None
    return _WidenedConv.apply(xc, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups,
                              torch.float16)


def _widened_conv_dtype(x: torch.Tensor, conv: nn.Module) -> torch.dtype | None:
    """:func:`_widened_dtype` for a zero-padded ``nn.Conv2d`` or ``nn.Conv3d`` ``conv`` (None for other padding or
    modules)."""
    if type(conv) not in (nn.Conv2d, nn.Conv3d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    return _widened_dtype(x, conv, kind=type(conv))


def _conv_of_rounded(xb: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation,
                     groups: int = 1) -> torch.Tensor:
    """The float32 convolution (2-D, or 3-D for a 5-D weight) of bf16 (fp16) ``xb`` and ``wb`` with ``bias`` rounded
    to their dtype, the output rounded to it: what autocast's convolution computes, up to the order of the float32
    sums (:func:`bf16_products_widened`, :func:`fp16_products_widened`)."""
    lp = xb.dtype
    conv = F.conv3d if wb.dim() == 5 else F.conv2d
    with torch.autocast("cpu", enabled=False):
        y = conv(xb.float(), wb.float(), None if bias is None else bias.to(lp).float(), stride, padding, dilation,
                 groups)
    return y.to(lp)


def _frozen_trace() -> bool:
    """Whether the graph being traced is for a frozen compile (Inductor's ``freezing`` on while dynamo traces, as
    :class:`ppma.compile.FrozenInference` sets it): Inductor lowers oneDNN's linear op only with the weight a
    constant of the graph."""
    import torch._inductor.config as inductor_config  # loaded by torch.compile already; not at ppma's import

    return bool(inductor_config.freezing)


def fold_batch_norm(conv: nn.Conv2d, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight (channels-last order) and bias of one convolution equal to ``bn(conv(x))`` with the BatchNorm
    ``bn`` in eval mode on its running statistics, computed in float32: ``w * s``, ``(b - mean) * s + beta`` with
    ``s = gamma / sqrt(var + eps)``. Channels-last because oneDNN reorders the weight into its blocked layout on
    every call, which costs up to ~2 ms from OIHW for PPMA-T's last merging (256 -> 512 channels) on small maps and
    ~0.2 ms from OHWI."""
    with torch.no_grad():
        scale = torch.rsqrt(bn.running_var + bn.eps)
        shift = -bn.running_mean * scale
        if bn.affine:
            scale, shift = scale * bn.weight, shift * bn.weight + bn.bias
        weight = (conv.weight * scale[:, None, None, None]).contiguous(memory_format=torch.channels_last)
        bias = shift if conv.bias is None else conv.bias * scale + shift
    return weight.detach(), bias.detach()


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    """Whether :func:`fold_batch_norm` applies: a zero-padded ``nn.Conv2d`` and a BatchNorm with running statistics."""
    return (type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
            and isinstance(bn, _BatchNorm) and bn.running_mean is not None and bn.running_var is not None)


def _fold_into(conv: nn.Conv2d, bn: nn.Module) -> None:
    # the folded weight and bias as non-persistent buffers of the convolution: they follow .to() and stay out of
    # the state_dict, whose keys are the unfused model's
    weight, bias = fold_batch_norm(conv, bn)
    conv.register_buffer("folded_weight", weight, persistent=False)
    conv.register_buffer("folded_bias", bias, persistent=False)


def _fused_conv(x: torch.Tensor, conv: nn.Conv2d, dt: torch.dtype, gelu: bool = False) -> torch.Tensor:
    """``bn(conv(x))`` (+ the exact GELU) with the BatchNorm folded into ``conv`` (:func:`_fold_into`): oneDNN's
    convolution with the GELU fused, one pass instead of three, in ``dt`` (the bias float32; bf16 on float32 products
    of the bf16-rounded values where :func:`bf16_products_widened`)."""
    widened = dt == torch.bfloat16 and bf16_products_widened()
    pack = (None if dt == torch.float32 else
            ("conv", list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups, list(x.shape)))
    y = torch.ops.mkldnn._convolution_pointwise(x.to(dt).float() if widened else x.to(dt),
                                                _param_as(conv.folded_weight, dt, widened, pack), conv.folded_bias,
                                                conv.padding, conv.stride, conv.dilation, conv.groups, *_attr(gelu))
    return y.to(dt)


def _refuse(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook of the modules with folded pieces: a fused module folds the loaded weights again."""
    if module.fused:
        module._fuse()


def _exact_gelu(act: nn.Module) -> bool:
    return type(act) is nn.GELU and act.approximate == "none"


# --------------------------------------------------------------------------------- training choices of "fused"
def _fused_eager_cpu(x: torch.Tensor) -> bool:
    """The gate of the model-side training choices of the "fused" implementation (:func:`linears`,
    :class:`ConvStem`, :class:`PatchMerging`): the "fused" implementation (``ppma.ops.set_impl``) on an eager CPU
    tensor (not a tracer's stand-in, not under torch.compile or tracing, which see the plain modules)."""
    return (
        _dispatch.get_impl() == "fused"
        and type(x) is torch.Tensor
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``layer(x)``; for an ``nn.Linear`` without hooks where :func:`_widened_dtype` says so (CPU inference and
    training under bf16 autocast on a CPU without bf16 instructions, :func:`bf16_products_widened`, and under fp16
    autocast on a CPU without fp16 kernels, :func:`fp16_products_widened`), the same function on float32 GEMMs of the
    rounded values (:class:`_WidenedLinear`), eager or traced by ``torch.compile`` (not ``torch.export``), with the
    "fused" implementation."""
    dt = _widened_dtype(x, layer)
    if dt is not None:
        return _WidenedLinear.apply(x, layer.weight, layer.bias, dt)
    return layer(x)


def _widened_dtype(x: torch.Tensor, *layers: nn.Module, kind: type = nn.Linear) -> torch.dtype | None:
    """The CPU autocast dtype (bf16 or fp16) in which ``layers`` (of type ``kind`` exactly: :func:`linear`,
    :func:`linears`, :func:`conv2d`, and :class:`DWConv2d` for fp16) run on float32 kernels fed the rounded values,
    with or without gradients, or None: bf16 where :func:`bf16_products_widened`, fp16 where
    :func:`fp16_products_widened`; the "fused" implementation, not under ``torch.export`` or ``torch.jit.trace``,
    float32 weights without hooks, a CPU tensor ``x``. ``x`` is read last, and only as a tensor: torch.fx's symbolic
    tracing passes proxies, whose attributes cannot decide a branch."""
    if not autocast_enabled("cpu"):
        return None
    dt = torch.get_autocast_dtype("cpu")
    if not ((dt == torch.bfloat16 and bf16_products_widened()) or (dt == torch.float16 and fp16_products_widened())):
        return None
    if (_dispatch.get_impl() == "fused" and not torch.compiler.is_exporting() and not torch.jit.is_tracing()
            and all(type(m) is kind and m.weight.dtype == torch.float32 and not _has_hooks(m) for m in layers)
            and isinstance(x, torch.Tensor) and x.device.type == "cpu"):
        return dt
    return None


class _WidenedLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` as CPU autocast to ``dt`` (bf16 or fp16) computes it, on float32 GEMMs
    (:func:`bf16_products_widened`: oneDNN's bf16 kernels widen every operand in their loops on CPUs without bf16
    instructions, 2.5-3.4x slower than its float32 ones on PPMA-T's shapes; :func:`fp16_products_widened`: without
    oneDNN's fp16 kernels torch runs a reference fp16 GEMM). Autocast rounds x, weight and bias to ``dt`` and runs a
    ``dt`` GEMM with float32 sums whose output is rounded to ``dt``; its backward's GEMMs round grad_x and grad_weight
    to ``dt``, and the bias gradient's sum too, before they return to the inputs' dtypes. Here the same roundings on
    float32 products of the rounded values (exact: a product of two bf16 or two fp16 values fits in float32), so the
    results equal autocast's up to the order of the float32 sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, dt):
        xb, wb = x.to(dt), weight.to(dt)
        ctx.save_for_backward(xb, wb)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        with torch.autocast("cpu", enabled=False):
            x2 = xb.reshape(-1, xb.shape[-1]).float()
            w = wb.float().t()
            y = x2.mm(w) if bias is None else torch.addmm(bias.to(dt).float(), x2, w)
        return y.to(dt).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        xb, wb = ctx.saved_tensors
        dt = xb.dtype
        need = ctx.needs_input_grad
        with torch.autocast("cpu", enabled=False):
            g2 = g.reshape(-1, g.shape[-1]).to(dt).float()
            gx = gw = gb = None
            if need[0]:
                gx = g2.mm(wb.float()).to(dt).view(xb.shape).to(ctx.x_dtype)
            if need[1]:
                gw = g2.t().mm(xb.reshape(-1, xb.shape[-1]).float()).to(dt).to(ctx.w_dtype)
            if ctx.b_dtype is not None and need[2]:
                gb = g2.sum(0).to(dt).to(ctx.b_dtype)
        return gx, gw, gb, None


class _WidenedConv(torch.autograd.Function):
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` (``F.conv3d`` for a 5-D weight) as CPU autocast
    to ``dt`` (bf16 or fp16) computes it, on float32 convolutions (:func:`bf16_products_widened`: oneDNN's bf16
    convolutions widen every operand in their loops on CPUs without bf16 instructions; forward and backward of
    PPMA-T's stem and patch-merging convolutions ran 2.0x slower than the float32 ones at b8@224 on an Ice Lake Xeon,
    2 threads, docs/performance.md "bf16 and fp16 on the CPU"; :func:`fp16_products_widened`: without oneDNN's fp16
    kernels torch runs every fp16 depthwise convolution as one slow convolution per channel). The roundings of
    :class:`_WidenedLinear`: x, weight and bias rounded to ``dt``, the output rounded to ``dt``, and in the backward
    the output's gradient, then grad_x, grad_weight and grad_bias each rounded to ``dt`` before they return to the
    inputs' dtypes; the products of bf16 (fp16) values are exact in float32, so the results equal autocast's up to the
    order of the float32 sums. The memory format of ``x`` (channels-last in training) is kept."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, dt):
        xb, wb = x.to(dt), weight.to(dt)
        ctx.save_for_backward(xb, wb)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return _conv_of_rounded(xb, wb, bias, stride, padding, dilation, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        xb, wb = ctx.saved_tensors
        dt = xb.dtype
        stride, padding, dilation, groups = ctx.conv
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need = ctx.needs_input_grad
        mask = [need[0], need[1], b_dtype is not None and need[2]]
        with torch.autocast("cpu", enabled=False):
            gx, gw, gb = torch.ops.aten.convolution_backward(
                g.to(dt).float(), xb.float(), wb.float(), None if b_dtype is None else [wb.shape[0]], list(stride),
                list(padding), list(dilation), False, [0] * len(stride), groups, mask)
        return (None if gx is None else gx.to(dt).to(x_dtype), None if gw is None else gw.to(dt).to(w_dtype),
                None if gb is None else gb.to(dt).to(b_dtype), None, None, None, None, None)


def linears(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in layers)``: several projections of one input (the attention's q, k and v).

    In CPU training with the "fused" implementation (one gate: :func:`_fused_eager_cpu`, grad mode on, float32 or
    float64 input, no CPU autocast, ``nn.Linear`` layers with biases and no hooks) they are one autograd node: the forward is
    the layers' own ``addmm`` (the same bits as calling them), and the backward sums the input's gradient inside the
    products (``addmm`` into the first product's result) instead of autograd adding one map of ``x``'s size per
    layer: one pass over ``x``'s gradient per layer fewer. The gradients equal the separate layers' up to float
    rounding (the sum's order). Layers with forward hooks keep their calls. In frozen inference under
    ``torch.compile`` they run oneDNN's linear op (:func:`compiled_onednn_dtype`); where :func:`_widened_dtype` says
    so (bf16 autocast training on a CPU without bf16 instructions, fp16 autocast on one without fp16 kernels),
    float32 GEMMs with autocast's roundings (:func:`linear`)."""
    dt = compiled_onednn_dtype(x, *layers)
    if dt is not None:
        return tuple(_fused_linear(x, m, dt) for m in layers)
    wdt = _widened_dtype(x, *layers)
    if wdt is not None:
        return tuple(_WidenedLinear.apply(x, m.weight, m.bias, wdt) for m in layers)
    if not (torch.is_grad_enabled() and x.dtype in (torch.float32, torch.float64) and not autocast_enabled("cpu")
            and _fused_eager_cpu(x)
            and all(type(m) is nn.Linear and m.bias is not None and not _has_hooks(m) for m in layers)):
        return tuple(m(x) for m in layers)
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


class DWConv2d(nn.Module):
    """Depthwise ``k x k`` convolution (stride 1, same padding, with bias) on channels-last maps.

    ``[B, H, W, C] -> [B, H, W, C]`` (the official ``DWConv2d``; used for CPE, LePE and the FFN).
    """

    fused = False  # set by ppma.nn.fuse_for_inference (docs/design.md §2.9)

    def __init__(self, dim: int, kernel_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, kernel_size, 1, kernel_size // 2, groups=dim)
        self.register_load_state_dict_post_hook(_refuse)

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

        ``inplace=True`` lets a fused module (:func:`ppma.nn.fuse_for_inference`) write the result over the
        caller's own map instead of allocating one more: over ``x`` with ``residual=True``
        (``ppma.ops.cpu.depthwise_conv2d_residual_``, the FFN's hidden map), over ``add`` otherwise (oneDNN adds the
        convolution's output to ``add`` in place); float32, or bf16 under bf16 autocast, rounded once. The caller
        must use the returned tensor and must not need the overwritten map's values afterwards. Unfused modules
        overwrite nothing; the numbers agree up to rounding.
        """
        if add is not None:
            if residual:
                raise ValueError("DWConv2d: pass either residual=True or add, not both")
            if tuple(add.shape) != tuple(x.shape):
                raise ValueError(f"DWConv2d: add must have x's shape {tuple(x.shape)}, got {tuple(add.shape)}")
        if self.fused:
            return self._forward_fused(x, residual, add, inplace)
        conv = self.conv
        if add is not None:
            return add + self.forward(x)
        if depthwise_conv2d_uses_kernel(x, conv.weight, conv.bias):
            # CPU training (fp32/fp64, or bf16 maps under bf16 autocast), >= 5x5 kernel: weight/bias gradients from
            # ppma's kernel (docs/ops.md "depthwise_conv2d")
            return depthwise_conv2d(x, conv.weight, conv.bias, residual)
        xc = x.permute(0, 3, 1, 2)
        y = _widened_depthwise(xc, conv)  # fp16 autocast without fp16 kernels
        if y is not None:
            y = y.permute(0, 2, 3, 1).contiguous()
            return x + y if residual else y
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

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference`: the residual weight ``w + δ`` (the identity in the centre tap)
        computed once, for the fused ``residual=True`` calls that may not overwrite ``x`` (the block's CPE)."""
        conv = self.conv
        with torch.no_grad():
            weight = conv.weight.detach().clone()
            weight[:, :, conv.kernel_size[0] // 2, conv.kernel_size[1] // 2] += 1.0
        self.register_buffer("residual_weight", weight, persistent=False)
        self.fused = True

    def _forward_fused(self, x, residual, add, inplace) -> torch.Tensor:
        dt = _fused_dtype(self, x)
        conv = self.conv
        weight, bias = _param_as(conv.weight, dt), _param_as(conv.bias, dt)
        if add is not None:
            # add + conv(x) inside oneDNN's convolution (one pass, no map for conv(x)), over add itself with inplace
            out = add.to(dt).contiguous()
            if not inplace and out is add:
                out = out.clone()
            torch.ops.mkldnn._convolution_pointwise_.binary(
                out.permute(0, 3, 1, 2), x.to(dt).contiguous().permute(0, 3, 1, 2), weight, bias, conv.padding,
                conv.stride, conv.dilation, conv.groups, "add", None, None, [], None)
            return out
        if residual and inplace:
            # x <- x + conv(x) in place: computed in float32, rounded once (ppma.ops.cpu.depthwise_conv2d_residual_)
            return depthwise_conv2d_residual_(x.to(dt), weight, bias)
        x = x.to(dt)
        xc = x.permute(0, 3, 1, 2)
        if residual and dt == torch.float32:
            y = F.conv2d(xc, self.residual_weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
            return y.permute(0, 2, 3, 1).contiguous()
        y = F.conv2d(xc, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups).permute(0, 2, 3, 1)
        return x + y if residual else y.contiguous()  # bf16: 1 + w would round w to a few bits


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (the same parameters and state dict). Fused (:func:`ppma.nn.fuse_for_inference`; over the
    last dimension, with a weight and a bias) it runs ppma's kernel, :func:`ppma.ops.cpu.layer_norm` (float32; 2x
    torch's at PPMA-T's widths, docs/ops.md "layer_norm"), the same numbers up to rounding. PPMABlock's ``norm1``
    and ``norm2``; it is an FX leaf (ppma.models.timm), so a traced model computes its norms as the eager one does.
    Under ``torch.compile`` it stays one opaque graph node: that kernel without gradients (compiled inference), torch's
    own layer norm as :func:`ppma.ops.cpu.layer_norm_node` with them (compiled training); Inductor's generated layer
    norms ran slower than either (docs/compile.md)."""

    fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            _fused_dtype(self, x)
            return _layer_norm_op(x, self.weight, self.bias, self.eps)
        if torch.compiler.is_compiling() and self._last_dim_affine():
            if _layer_norm_uses_kernel(x, self.weight, self.bias):  # compiled inference: ppma's kernel
                return _layer_norm_op(x, self.weight, self.bias, self.eps)
            if uses_layer_norm_node(x, self.weight, self.bias):  # compiled training: ATen's kernels, one node
                return layer_norm_node(x, self.weight, self.bias, self.eps)
        return super().forward(x)

    def _last_dim_affine(self) -> bool:
        """A norm over the last dimension with a weight and a bias: the kernels' case."""
        return len(self.normalized_shape) == 1 and self.weight is not None and self.bias is not None

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference` (a norm over more than one dimension, or without affine
        parameters, stays unfused)."""
        self.fused = self._last_dim_affine()


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

    fused = False

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
        if self.fused:
            # oneDNN's fc1 with the GELU inside, h + dwconv(h) over fc1's output (ours alone), oneDNN's fc2
            dt = _fused_dtype(self, x)
            return _fused_linear(self.dwconv(_fused_linear(x, self.fc1, dt, gelu=True), residual=True, inplace=True),
                                 self.fc2, dt)
        if self._compiled_inference(x):
            # compiled CPU inference, as eager's fused FFN: h + dwconv(h) over fc1's output with ppma's kernel (in
            # place: nothing else reads h); frozen (compiled_onednn_dtype): oneDNN's fc1 with the GELU inside and its
            # fc2; else the layers (bf16 autocast: frozen Inductor packs them for oneDNN with the GELU fused); bf16
            # taps for bf16
            conv = self.dwconv.conv
            dt = compiled_onednn_dtype(x, self.fc1, self.fc2)
            h = _fused_linear(x, self.fc1, dt, gelu=True) if dt is not None else self.act(self.fc1(x))
            bias = None if conv.bias is None else conv.bias.to(h.dtype)
            h = depthwise_conv2d_residual_(h, conv.weight.to(h.dtype), bias)
            return _fused_linear(h, self.fc2, dt) if dt is not None else self.fc2(h)
        h = linear(x, self.fc1)
        conv = self.dwconv.conv if type(self.dwconv) is DWConv2d else None
        if (conv is not None and _exact_gelu(self.act) and uses_gelu_kernel(h, conv.weight, conv.bias)
                and not any(_has_hooks(m) for m in (self.act, self.dwconv, conv))):
            # CPU training (the op's gate): GELU and h + dwconv(h) as one op that keeps fc1's output only, one ppma
            # kernel each way (ppma.ops.cpu.gelu_depthwise_conv2d_residual; output and gradients equal to the
            # modules' up to rounding); hooks on the replaced modules must see their calls
            return linear(gelu_depthwise_conv2d_residual(h, conv.weight, conv.bias), self.fc2)
        return linear(self.dwconv(self.act(h), residual=True), self.fc2)

    def _compiled_inference(self, x: torch.Tensor) -> bool:
        # traced by torch.compile for CPU inference (_traced_cpu_inference), in float32 or under bf16 autocast,
        # with the exact GELU and a plain DWConv2d (no hooks to keep)
        return (_traced_cpu_inference(x, self.fc1, self.fc2) and _exact_gelu(self.act)
                and type(self.dwconv) is DWConv2d and not any(_has_hooks(m) for m in (self.act, self.dwconv))
                and ((x.dtype == torch.float32 and not autocast_enabled("cpu"))
                     or (autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
                         and _ONEDNN_BF16)))

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference` (an FFN whose ``act`` is not the exact GELU or whose
        ``dwconv`` is not a :class:`DWConv2d` stays unfused)."""
        self.fused = _exact_gelu(self.act) and type(self.dwconv) is DWConv2d and self.dwconv.fused


class ConvStem(nn.Module):
    """Four 3x3 convs (strides 2, 1, 2, 1) with BatchNorm and GELU between (docs/model.md §4, stride 4).

    ``[B, in_chans, H, W] -> [B, ceil(H/4), ceil(W/4), out_dim]`` (channels last).
    """

    fused = False

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
        self.register_load_state_dict_post_hook(_refuse)

    def _pairs(self):
        return ((self.conv1, self.bn1), (self.conv2, self.bn2), (self.conv3, self.bn3), (self.conv4, self.bn4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            # BatchNorms folded once, GELU fused (oneDNN), on a channels-last map, where oneDNN's convolutions run
            # 2-3x faster than on NCHW (the output is wanted channels-last anyway)
            dt = _fused_dtype(self, x)
            x = x.to(dt).contiguous(memory_format=torch.channels_last)
            for conv in (self.conv1, self.conv2, self.conv3):
                x = _fused_conv(x, conv, dt, gelu=True)
            x = _fused_conv(x, self.conv4, dt)
        else:
            if _channels_last_convs(x):
                x = x.contiguous(memory_format=torch.channels_last)
            x = self.act(self.bn1(conv2d(x, self.conv1)))
            x = self.act(self.bn2(conv2d(x, self.conv2)))
            x = self.act(self.bn3(conv2d(x, self.conv3)))
            x = self.bn4(conv2d(x, self.conv4))
        return x.permute(0, 2, 3, 1).contiguous()  # see DWConv2d

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference`: each BatchNorm folded into its convolution
        (:func:`fold_batch_norm`; a stem with other pieces in place stays unfused)."""
        if _exact_gelu(self.act) and all(_foldable(c, b) for c, b in self._pairs()):
            for conv, bn in self._pairs():
                _fold_into(conv, bn)
            self.fused = True


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous (a copy where it is not)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, with its gradient made contiguous on the way back (:class:`_ContiguousGrad`) where it needs one.

    :class:`PatchMerging` on a contiguous NCHW copy of its ``[B, H, W, C]`` input sends back the gradient of that
    copy, NCHW, seen through the permute as a strided ``[B, H, W, C]`` map. The residual sums of the stage before
    then kept that layout (an element-wise sum takes its first operand's), so the stage's whole backward ran
    strided: at PPMA-T's stage 3 (b8@224, bf16 autocast, AMD EPYC Zen 4, 2 threads) 24 sums of 0.8 ms each where a
    contiguous one takes 0.06 ms, and a copy before each LayerNorm backward. One copy here ends it.
    """
    return _ContiguousGrad.apply(x) if x.requires_grad and torch.is_grad_enabled() else x


class PatchMerging(nn.Module):
    """3x3 stride-2 conv + BatchNorm: ``[B, H, W, C_in] -> [B, ceil(H/2), ceil(W/2), C_out]``."""

    fused = False

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, out_dim, 3, 2, 1)
        self.norm = nn.BatchNorm2d(out_dim)
        self.register_load_state_dict_post_hook(_refuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            # the BatchNorm folded once (oneDNN's convolution on the channels-last view, no copies)
            x = _fused_conv(x.permute(0, 3, 1, 2), self.conv, _fused_dtype(self, x))
        elif (_channels_last_convs(x) and not torch.compiler.is_compiling()
              and x.numel() >= self.conv.weight.numel()):
            # the channels-last view as it is: no copy in, and the output's permute below is contiguous already.
            # Only where the map outweighs the weight, which each call converts to channels-last (a copy): at
            # PPMA-T's last merging (256 -> 512 channels, 14² or 32² maps) NCHW is faster (24.5 against 18.4 ms
            # forward + backward at b8@224). Not under torch.compile: the size test would be a guard on the shapes
            # (with dynamic shapes, a graph for each side of it)
            x = self.norm(conv2d(x.permute(0, 3, 1, 2), self.conv))
        else:
            # contiguous NCHW input: inductor with dynamic shapes fails on a strided conv + BN over a
            # channels-last input (torch 2.13); the copy is one stage output, three times per forward
            x = self.norm(conv2d(_contiguous_grad(x).permute(0, 3, 1, 2).contiguous(), self.conv))
        return x.permute(0, 2, 3, 1).contiguous()

    def _fuse(self) -> None:
        """Part of :func:`ppma.nn.fuse_for_inference`: the BatchNorm folded into the convolution."""
        if _foldable(self.conv, self.norm):
            _fold_into(self.conv, self.norm)
            self.fused = True


def _channels_last_convs(x: torch.Tensor) -> bool:
    """Whether the unfused :class:`ConvStem` and :class:`PatchMerging` run their convolutions and BatchNorms on
    channels-last maps (in training above all): one gate, :func:`_fused_eager_cpu`. oneDNN's CPU convolutions run
    faster on channels-last data than on NCHW (8x for the stem's first, 3-input-channel convolution), and the maps
    these modules return are channels-last anyway, so the permute copies vanish too: 1.5-3 % of a PPMA-T training
    step (README, "Whole model on the CPU"). PatchMerging does so only where its input map has at least as many elements as its
    convolution's weight, which every call converts to channels-last. The same modules and calls, so the numbers
    equal the NCHW path's up to oneDNN's rounding. Under ``torch.compile`` too (the convolutions and their backward
    stay oneDNN's ATen calls in Inductor's graphs, docs/compile.md). With the "reference" implementation they run on
    NCHW maps, as the official code does."""
    return _fused_eager_cpu(x) or (
        torch.compiler.is_compiling() and _dispatch.get_impl() == "fused" and x.device.type == "cpu")


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
        x = linear(x.permute(0, 2, 3, 1), self.proj).permute(0, 3, 1, 2)
        x = F.silu(self.norm(x))  # swish
        if self.global_pool == "avg":
            x = x.flatten(2).mean(-1)
        x = self.drop(x)
        return x if pre_logits else linear(x, self.fc)
