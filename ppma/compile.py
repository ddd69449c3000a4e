"""``torch.compile`` for PPMA models: the recipe of docs/compile.md in one call.

Compile the unfused model: the modules of ``ppma.nn.fuse_for_inference`` refuse to be traced. Under ``torch.compile``
the modules run their plain torch calls and ppma's CPU kernels (docs/compile.md lists which), and the fused attention
ops stay opaque graph nodes (``torch.ops.ppma.*`` with their fake kernels, ``ppma/ops``). With Inductor's defaults
the linear layers then become ``addmm`` / ``mm`` calls on unpacked weights, the convolutions plain ATen calls, and
the compiled model ran slower than the eager one (docs/compile.md gives the measurements). For inference the recipe
freezes the weights (Inductor's ``freezing``): they become constants of the graph, so Inductor packs the
convolution and bf16 linear weights once for oneDNN, folds the BatchNorms into the convolutions and fuses the bias
and activation into the products, as the eager fast paths do; float32 linear layers call oneDNN's linear op
themselves when traced for inference (``ppma.nn.layers.compiled_onednn_dtype``). Inductor's layout optimization
is off: it took the channels-last ``[B, H, W, C]`` maps for NCHW ones and transposed them around ppma's ops::

    model = ppma.create_model("ppma_tiny").eval()
    fast = ppma.compile.compile_model(model)               # inference: frozen weights
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = fast(images)

    train_model = ppma.compile.compile_model(model.train())  # training: Inductor's training graph
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["compile_model", "FrozenInference"]


class FrozenInference(nn.Module):
    """A module compiled for inference with frozen weights: every call runs the compiled ``model`` with Inductor's
    ``freezing`` switched on (``torch._inductor.config.freezing``), and back to its previous value after the call.

    The switch must be on while dynamo traces the call, not only while Inductor compiles: dynamo then keeps the
    parameters as constants of the graph instead of inputs, which the weight-packing passes need.
    ``torch.compile(..., options={"freezing": True})`` does not do that (torch 2.13: the graph compiles, unfrozen,
    with ``addmm`` on unpacked weights), and setting the global flag would freeze every other no-grad compile in the
    process. Made by :func:`compile_model`; ``module`` is the eager model (its parameters are this module's).

    Inductor freezes only graphs traced without gradients: a call with gradient mode on compiles (and runs) an
    unfrozen graph, the slow one of docs/compile.md, and warns once (``UserWarning``); call it under
    ``torch.inference_mode()`` or ``torch.no_grad()``."""

    def __init__(self, model: nn.Module, compiled: nn.Module) -> None:
        super().__init__()
        self.module = model
        self.__dict__["_compiled"] = compiled  # not a submodule: its parameters are ``module``'s
        self._warned = False

    def forward(self, *args, **kwargs):
        from torch._inductor import config

        if torch.is_grad_enabled() and not self._warned:
            self._warned = True
            warnings.warn("ppma.compile.FrozenInference called with gradients enabled: Inductor freezes only graphs "
                          "traced without them, so this call compiles an unfrozen graph (slower; docs/compile.md). "
                          "Call it under torch.inference_mode() or torch.no_grad().", UserWarning, stacklevel=2)

        prev = config.freezing
        config.freezing = True
        try:
            return self._compiled(*args, **kwargs)
        finally:
            config.freezing = prev


def compile_model(model: nn.Module, *, inference: bool | None = None, dynamic: bool | None = False,
                  fullgraph: bool = True, options: dict | None = None, **compile_kwargs) -> nn.Module:
    """``torch.compile(model, ...)`` with ppma's recipe (docs/compile.md): Inductor, the whole model as one graph
    (``fullgraph``: ppma's ops trace without graph breaks), static shapes by default (``dynamic=False``: one graph
    per input shape; the depthwise convolutions do not lower with dynamic shapes in torch 2.13's CPU Inductor, see
    README "Models"), Inductor's ``layout_optimization`` off and, for inference, frozen weights
    (:class:`FrozenInference`).

    Args:
        model: the module to compile (e.g. from :func:`ppma.create_model`).
        inference: compile for inference (frozen weights) or training; None: ``not model.training``. Inference
            needs ``model.eval()`` first, and the first call of the result under ``torch.no_grad()`` or
            ``torch.inference_mode()`` (Inductor freezes only such graphs).
        dynamic, fullgraph, options, compile_kwargs: passed to ``torch.compile`` (``options``: Inductor options,
            merged over the recipe's ``{"layout_optimization": False}``).

    Returns:
        Training: ``torch.compile``'s ``OptimizedModule``, sharing ``model``'s parameters. Inference: a
        :class:`FrozenInference` around it. Frozen weights are copies taken at the first call: after changing the
        weights (training steps, loading a state dict), compile again for inference.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``inference=True`` for a model in training mode (its dropout and BatchNorm statistics would be
            frozen as they are in training).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ppma.compile.compile_model: model must be a torch.nn.Module, got {type(model).__name__}")
    if inference is None:
        inference = not model.training
    if inference and model.training:
        raise ValueError("ppma.compile.compile_model: inference=True needs model.eval() first (model.training is "
                         "True)")
    options = {"layout_optimization": False, **(options or {})}
    compiled = torch.compile(model, fullgraph=fullgraph, dynamic=dynamic, options=options, **compile_kwargs)
    return FrozenInference(model, compiled) if inference else compiled
