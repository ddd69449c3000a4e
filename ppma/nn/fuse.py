"""The deployment step for CPU inference: :func:`fuse_for_inference` (docs/design.md §2.9)."""

from __future__ import annotations

import torch
from torch import nn

from ppma.nn import layers
from ppma.nn.attention import PPMAAttention
from ppma.nn.block import PPMABlock
from ppma.nn.layers import ConvFFN, ConvStem, DWConv2d, LayerNorm, PatchMerging

__all__ = ["fuse_for_inference", "is_fused"]

# The modules the step fuses, each by its ``_fuse()``; children before parents (a parent fuses on its fused children).
FUSABLE = (DWConv2d, LayerNorm, ConvFFN, ConvStem, PatchMerging, PPMAAttention, PPMABlock)


def fuse_for_inference(model: nn.Module) -> nn.Module:
    """Prepare ``model`` (any module containing ppma modules: a ppma model, a timm-created one, an MMDetection or
    MMSegmentation backbone) for CPU inference, in place, and return it; in the spirit of timm's
    ``reparameterize_model``.

    The step puts the model in eval mode, stops its parameters requiring gradients, and marks the ppma modules
    fused, computing their fused pieces once: each BatchNorm of the stem and of the patch merging folded into its
    convolution (:func:`ppma.nn.layers.fold_batch_norm`), the CPE's identity folded into its kernel. A fused
    module's forward then runs oneDNN's linear and convolution with the bias and the exact GELU inside
    (``torch.ops.mkldnn._linear_pointwise`` / ``_convolution_pointwise``), the LePE added into the attention's
    output in place, RoPE over q and k in place (:func:`ppma.ops.cpu.rope_`), the residual sums in place with the
    second LayerNorm (:func:`ppma.ops.cpu.add_layer_norm_`), the LayerNorms and the FFN's ``h + dwconv(h)`` on
    ppma's kernels (:func:`ppma.ops.cpu.layer_norm`, :func:`ppma.ops.cpu.depthwise_conv2d_residual_`); the attention
    operators stay those of ``ppma.ops.set_impl``. The outputs equal the unfused model's up to float rounding.

    A fused model runs in float32, or in bf16 under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (oneDNN's bf16
    kernels, the choice read from the autocast state of each call; the LayerNorms and the residual sums then run
    ppma's kernels on the bf16 maps too). In bf16 each weight is rounded to bf16 once and the copy kept beside it
    for the next calls (about 1 % of PPMA-T's bf16 forward): in-place writes to a weight (``load_state_dict``,
    ``copy_`` and other in-place ops, which move its version counter) make a new copy; writes through
    ``weight.data``, which torch does not count, are not seen. It raises a RuntimeError (never falls back)
    when it is run in training mode, on an input that records a gradient, on another device, under another
    autocast dtype, traced or compiled: those take the model as it was before the step (FX, torch.compile, export
    and training all see the plain modules). Forward hooks on a fused model's modules still run, but may see maps
    that a later step overwrites in place.

    The state_dict keeps its keys and values (the fused pieces are non-persistent buffers), so a fused model's
    state_dict loads into an unfused one; loading one into a fused model folds the loaded weights again. The step
    is idempotent (a second call folds again, from the same weights). Modules whose pieces were replaced (another
    activation, a norm over several dimensions) stay unfused and run their plain torch calls.

    Raises:
        RuntimeError: torch's oneDNN ops are missing from this torch build.
        ValueError: a parameter or buffer of a ppma module is not a float32 CPU tensor.
    """
    if not layers._ONEDNN:
        raise RuntimeError("ppma.nn.fuse_for_inference: this torch build has no oneDNN (mkldnn) linear and "
                           "convolution ops (torch.ops.mkldnn._linear_pointwise); run the unfused model")
    found = [m for m in model.modules() if isinstance(m, FUSABLE)]
    for m in found:
        for name, t in (*m.named_parameters(), *m.named_buffers()):
            if t.is_floating_point() and (t.device.type != "cpu" or t.dtype != torch.float32):
                raise ValueError(f"ppma.nn.fuse_for_inference: model must hold float32 CPU tensors, got "
                                 f"{type(m).__name__}.{name} as {t.dtype} on {t.device}")
    model.eval()
    model.requires_grad_(False)
    for m in reversed(found):  # model.modules() lists a parent before its children
        m._fuse()
    return model


def is_fused(model: nn.Module) -> bool:
    """Whether :func:`fuse_for_inference` fused any module of ``model``."""
    return any(getattr(m, "fused", False) is True for m in model.modules() if isinstance(m, FUSABLE))
