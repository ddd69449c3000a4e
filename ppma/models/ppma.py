"""The PPMA-T/S/B backbone (docs/model.md §4): stem -> 4 stages of PPMA blocks -> classification head.

Follows timm's backbone contract (``forward_features``, ``forward_head``, ``forward_intermediates``,
``feature_info``, ``reset_classifier``, ``set_grad_checkpointing``) with our own module names; official
checkpoints are mapped onto them by :func:`ppma.models.convert.convert_official_state_dict`.

Module layout (stride in brackets)::

    stem                      ConvStem (4 convs)                     [4]
    stages.0                  rope, blocks.*                         [4]
    stages.{1,2,3}            downsample (conv3x3 s2 + BN), rope, blocks.*   [8, 16, 32]
    head                      proj (Linear), norm (BN), swish, avgpool, fc

The official code downsamples at the *end* of stages 0-2; putting the same layer at the start of the next
stage (timm's convention) changes no numbers and makes every stage output a feature map.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from ppma.nn import (
    MASKS,
    MIXERS,
    MLPS,
    ClassifierHead,
    ConvStem,
    PatchMerging,
    PPMABlock,
    RotaryEmbedding2D,
)

__all__ = ["PPMAConfig", "PPMA", "PPMAStage", "MODEL_CONFIGS", "ppma_tiny", "ppma_small", "ppma_base",
           "DEFAULT_MIXER", "resolve_mixer"]

# PPMA-T's token mixers.
DEFAULT_MIXER = ("criss_cross", "criss_cross", "full", "full")


def _per_stage(name: str, value, where: str) -> tuple:
    value = (value,) * 4 if isinstance(value, (str, bool)) else tuple(value)
    if len(value) != 4:
        raise ValueError(f"{where}: {name} must have 4 entries (one per stage), got {value}")
    return value


def resolve_mixer(base: Sequence[str], mixer=None, *, where: str = "PPMAConfig") -> tuple[str, ...]:
    """The per-stage ``mixer`` tuple: ``mixer`` (one name for every stage, or 4 names), or ``base`` where it is
    None (docs/ops.md, "Glossary"). The names are checked by :class:`PPMAConfig`."""
    return _per_stage("mixer", base if mixer is None else mixer, where)


def apply_overrides(cfg: "PPMAConfig", overrides: dict, where: str) -> "PPMAConfig":
    """``dataclasses.replace(cfg, **overrides)``, with one ``mixer`` name spread over the 4 stages."""
    overrides = dict(overrides)
    if "mixer" in overrides:
        overrides["mixer"] = resolve_mixer(cfg.mixer, overrides["mixer"], where=where)
    return dataclasses.replace(cfg, **overrides)


@dataclass(frozen=True)
class PPMAConfig:
    """Architecture of a PPMA model (docs/model.md §4.1). Per-stage tuples have 4 entries.

    Attributes:
        embed_dims: channels per stage.
        depths: blocks per stage.
        num_heads: attention heads per stage.
        mlp_ratios: FFN expansion per stage.
        mixer: per stage, what mixes the tokens (``ppma.nn.MIXERS``; docs/ops.md, "Glossary"):
            ``"criss_cross"`` (polyline-masked softmax attention within each row and each column, official
            "chunk"), ``"full"`` (over all tokens, official "whole"), ``"linear"`` (PPMLA, O(N)) or
            ``"padre"`` (PADRe's polynomial mixer). One string means every stage; default PPMA-T's
            ``("criss_cross", "criss_cross", "full", "full")``.
        layerscale: per stage, whether blocks use layer scale.
        mask: the mask every attention applies (``ppma.nn.MASKS``; ``"polyline"`` is the official model).
        mlp: per stage, the FFN's two linear layers (``ppma.nn.MLPS``; ``"standard"`` is the official model,
            ``"monarch"`` the Surrogate FFN Block's Monarch matrices). One string means every stage.
        init_values, heads_ranges: per stage, RMT's decay schedule ``log g_h = log(1 - 2^(-init_value -
            heads_range h / heads))``, used by ``mask="manhattan"`` only (the official factories' values, docs/model.md
            §4.1, which the official code does not use).
        layer_init_values: initial layer-scale value.
        drop_path_rate: stochastic depth, linearly increasing from 0 over all blocks.
        head_hidden_dim: width of the head's ``proj`` layer (1024).
        in_chans, num_classes: input channels and classes.
        drop_rate: dropout before the classifier (0 in the official models).
        global_pool: ``"avg"`` (the official head) or ``""``: no pooling, the head returns the unpooled
            ``[B, head_hidden_dim, h, w]`` map (timm's contract; with ``num_classes=0`` only).

    Whether the attention runs the fused kernels or the reference is not part of the architecture:
    ``ppma.ops.set_impl`` / ``ppma.ops.use_impl`` choose it for every model.
    """

    embed_dims: tuple[int, ...] = (64, 128, 256, 512)
    depths: tuple[int, ...] = (2, 2, 8, 2)
    num_heads: tuple[int, ...] = (4, 4, 8, 16)
    mlp_ratios: tuple[float, ...] = (3.0, 3.0, 3.0, 3.0)
    mixer: tuple[str, ...] | None = None  # None: DEFAULT_MIXER
    layerscale: tuple[bool, ...] = (False, False, False, False)
    mask: str = "polyline"
    mlp: tuple[str, ...] = ("standard",) * 4
    init_values: tuple[float, ...] = (2.0, 2.0, 2.0, 2.0)
    heads_ranges: tuple[float, ...] = (4.0, 4.0, 6.0, 6.0)
    layer_init_values: float = 1e-6
    drop_path_rate: float = 0.1
    head_hidden_dim: int = 1024
    in_chans: int = 3
    num_classes: int = 1000
    drop_rate: float = 0.0
    global_pool: str = "avg"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixer", resolve_mixer(DEFAULT_MIXER, self.mixer))
        if isinstance(self.mlp, str):  # one string: every stage
            object.__setattr__(self, "mlp", (self.mlp,) * 4)
        for name in ("embed_dims", "depths", "num_heads", "mlp_ratios", "layerscale", "mixer", "mlp",
                     "init_values", "heads_ranges"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if len(value) != 4:
                raise ValueError(f"PPMAConfig.{name} must have 4 entries (one per stage), got {value}")
        for s, (c, h) in enumerate(zip(self.embed_dims, self.num_heads)):
            if c % h or (c // h) % 2:
                raise ValueError(
                    f"PPMAConfig: stage {s} embed_dim {c} must be divisible by num_heads {h} into an even head_dim"
                )
        for name, allowed in (("mixer", MIXERS), ("mlp", MLPS)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad:
                raise ValueError(f"PPMAConfig.{name}: {bad[0]!r} is not one of {allowed}")
        if self.mask not in MASKS:
            raise ValueError(f"PPMAConfig.mask: {self.mask!r} is not one of {MASKS}")
        linear = [s for s, m in enumerate(self.mixer) if m == "linear"]
        if linear and self.mask != "polyline":
            raise ValueError(f"PPMAConfig: mixer='linear' (stage {linear[0]}) supports mask='polyline' only, "
                             f"got mask={self.mask!r}")


MODEL_CONFIGS: dict[str, PPMAConfig] = {
    "ppma_tiny": PPMAConfig(),
    "ppma_small": PPMAConfig(
        depths=(3, 4, 18, 4),
        mlp_ratios=(4.0, 4.0, 3.0, 3.0),
        mixer=("criss_cross", "criss_cross", "criss_cross", "full"),
        drop_path_rate=0.15,
    ),
    "ppma_base": PPMAConfig(
        embed_dims=(80, 160, 320, 512),
        depths=(4, 8, 25, 8),
        num_heads=(5, 5, 10, 16),
        mlp_ratios=(4.0, 4.0, 3.0, 3.0),
        mixer=("criss_cross", "criss_cross", "criss_cross", "full"),
        layerscale=(False, False, True, True),
        heads_ranges=(5.0, 5.0, 6.0, 6.0),
        layer_init_values=1e-6,
        drop_path_rate=0.4,
    ),
}


def _check_input(x: torch.Tensor, in_chans: int) -> torch.Tensor:
    """``x`` if it is an image batch ``[B, in_chans, H, W]`` with ``H, W >= 1``; else ``ValueError``. Warns once per
    process on the CPU under float16 autocast where the model runs torch's slow float16 kernels
    (:func:`_warn_cpu_fp16`)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != in_chans:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"PPMA: x must be [B, {in_chans}, H, W], got {got}")
    if x.shape[2] == 0 or x.shape[3] == 0:
        raise ValueError(f"PPMA: the image must be at least 1x1, got x of shape {tuple(x.shape)}")
    if not torch.compiler.is_compiling() and not _FP16_WARNED and x.device.type == "cpu":
        _warn_cpu_fp16()
    return x


_FP16_WARNED = False  # _warn_cpu_fp16 has warned in this process, or found torch's float16 kernels fast here


def _onednn_fp16() -> bool:
    """Whether torch's oneDNN has float16 kernels on this CPU (the converse of
    ``ppma.nn.layers.fp16_products_widened``, read once)."""
    from ppma.nn.layers import fp16_products_widened

    return not fp16_products_widened()


def _warn_cpu_fp16() -> None:
    """Warns (once per process) when the CPU runs the model under float16 autocast on torch's fallback float16
    kernels: torch's oneDNN has no float16 kernels on this CPU (no AVX512-FP16 or AMX-FP16:
    ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``) and the "reference" implementation is chosen
    (``ppma.ops.set_impl``). torch then runs the convolutions and linear layers in float16 on ``_slow_conv2d_forward``
    (every depthwise convolution) and a reference GEMM: PPMA-T b8@224 inference took 4.2-5.5 s against 0.47-0.60 s in
    float32 on an AMD EPYC Zen 4 (2 threads, docs/performance.md "fp16 autocast on a CPU without fp16 kernels"). The
    "fused" implementation (the default) runs them as float32 products of the float16-rounded values there
    (``ppma.nn.layers.fp16_products_widened``) and does not warn. The numbers are right, only slow, so it warns instead
    of refusing."""
    global _FP16_WARNED
    if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16):
        return
    if _onednn_fp16():
        _FP16_WARNED = True
        return
    from ppma import ops

    if ops.get_impl() == "fused":
        return
    _FP16_WARNED = True
    import warnings

    warnings.warn(
        "PPMA: CPU autocast to float16 with the 'reference' implementation on a CPU without oneDNN's float16 kernels "
        "(no AVX512-FP16 or AMX-FP16): torch runs the convolutions and linear layers on fallback kernels, about 9x "
        "slower than float32 for PPMA-T; the 'fused' implementation (the default) runs them as float32 products of "
        "the float16-rounded values (docs/performance.md, 'fp16 autocast on a CPU without fp16 kernels').",
        RuntimeWarning, stacklevel=3)


# FX symbolic tracing (timm's FX feature extraction) records the check as one call instead of tracing into its
# Python shape tests, which a traced tensor cannot answer.
torch.fx.wrap("_check_input")


class PPMAStage(nn.Module):
    """Optional downsampling, then ``depth`` PPMA blocks sharing one rotary embedding.

    ``[B, H, W, in_dim] -> [B, H', W', dim]`` (``H' = ceil(H/2)`` when downsampling). Arguments after
    ``in_dim, dim`` are keyword-only; ``drop_path`` holds one rate per block (its length is the depth), and
    ``block_kwargs`` go to every :class:`PPMABlock` (``mlp_ratio``, ``mixer``, ``layerscale``, ...).
    """

    def __init__(
        self,
        in_dim: int,
        dim: int,
        *,
        num_heads: int,
        drop_path: Sequence[float],
        downsample: bool,
        **block_kwargs,
    ) -> None:
        super().__init__()
        self.downsample = PatchMerging(in_dim, dim) if downsample else nn.Identity()
        self.rope = RotaryEmbedding2D(dim // num_heads)
        self.blocks = nn.ModuleList(
            PPMABlock(dim, num_heads, drop_path=rate, **block_kwargs) for rate in drop_path
        )
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        rope = self.rope(x.shape[1], x.shape[2])
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        return x


def _init_weights(module: nn.Module) -> None:
    """Official effective init (docs/model.md §3.6): trunc_normal(0.02) for every Linear, bias 0; LayerNorm 1/0."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class PPMA(nn.Module):
    """PPMA vision backbone and classifier (docs/model.md §4).

    ``forward(x: [B, in_chans, H, W]) -> [B, num_classes]``; any ``H, W`` (odd sizes round up at every
    stride-2 conv). ``forward_features`` returns the last stage map ``[B, embed_dims[3], H/32, W/32]``.

    Args:
        cfg: architecture (a :class:`PPMAConfig`); keyword arguments override its fields (one ``mixer`` name
            means every stage).
    """

    def __init__(self, cfg: PPMAConfig | None = None, **overrides) -> None:
        super().__init__()
        cfg = apply_overrides(cfg or PPMAConfig(), overrides, "PPMA")
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.embed_dims = cfg.embed_dims
        self.num_features = cfg.embed_dims[-1]
        self.head_hidden_size = cfg.head_hidden_dim
        self.grad_checkpointing = False

        self.stem = ConvStem(cfg.in_chans, cfg.embed_dims[0])
        dpr = torch.linspace(0, cfg.drop_path_rate, sum(cfg.depths), device="cpu").tolist()
        stages, self.feature_info, start = [], [], 0
        for s in range(4):
            stages.append(
                PPMAStage(
                    cfg.embed_dims[s - 1] if s else cfg.embed_dims[0],
                    cfg.embed_dims[s],
                    num_heads=cfg.num_heads[s],
                    drop_path=dpr[start : start + cfg.depths[s]],
                    downsample=s > 0,
                    mlp_ratio=cfg.mlp_ratios[s],
                    mixer=cfg.mixer[s],
                    mask=cfg.mask,
                    gamma=(cfg.init_values[s], cfg.heads_ranges[s]),
                    mlp=cfg.mlp[s],
                    layerscale=cfg.layerscale[s],
                    layer_init_values=cfg.layer_init_values,
                )
            )
            start += cfg.depths[s]
            self.feature_info.append(dict(num_chs=cfg.embed_dims[s], reduction=2 ** (s + 2), module=f"stages.{s}"))
        self.stages = nn.ModuleList(stages)
        self.head = ClassifierHead(cfg.embed_dims[-1], cfg.head_hidden_dim, cfg.num_classes, cfg.drop_rate,
                                   cfg.global_pool)
        self.apply(_init_weights)

    # ------------------------------------------------------------------ configuration
    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute every block in the backward pass (activation checkpointing)."""
        self.grad_checkpointing = enable
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Names of the decay-module parameters ``dt_bias`` and ``A_log`` (1-D, which timm's optimiser
        factory skips anyway, as in the official recipe, docs/model.md §1.4)."""
        return {n for n, _ in self.named_parameters() if n.endswith((".dt_bias", ".A_log"))}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for layer-wise schedules (timm contract)."""
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)" if coarse else [(r"^stages\.(\d+)\.downsample", (0,)),
                                                                              (r"^stages\.(\d+)\.blocks\.(\d+)", None)])

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return getattr(self.head, "fc", self.head)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a new one with ``num_classes`` outputs (0: no classifier).

        ``global_pool``: ``"avg"``, or ``""`` for no pooling (with ``num_classes=0``: ``forward`` then returns the
        unpooled ``[B, head_hidden_size, h, w]`` map, timm's contract); ``None`` keeps the current one.
        """
        if not isinstance(self.head, ClassifierHead):
            raise RuntimeError("PPMA.reset_classifier: the head was pruned (prune_intermediate_layers)")
        self.head.reset(num_classes, global_pool)
        self.num_classes = num_classes
        self.cfg = dataclasses.replace(self.cfg, num_classes=num_classes, global_pool=self.head.global_pool)

    @torch.jit.ignore
    def load_pretrained(self, checkpoint_path: str, key: str | None = None) -> None:
        """Load an official or ppma checkpoint through :func:`ppma.checkpoint.load_checkpoint` (strict; a classifier
        of another size is dropped). timm calls this for ``pretrained=True`` (the configs set ``custom_load``)."""
        from ppma.checkpoint import load_checkpoint

        load_checkpoint(self, checkpoint_path, key=key, strict=True)

    # ------------------------------------------------------------------ forward
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in_chans, H, W] -> [B, embed_dims[3], H/32, W/32]`` (sizes rounded up)."""
        x = self.stem(_check_input(x, self.cfg.in_chans))
        for stage in self.stages:
            x = stage(x)
        return x.permute(0, 3, 1, 2)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``[B, C, h, w]`` -> logits ``[B, num_classes]`` (pooled ``[B, 1024]`` with ``pre_logits``)."""
        if isinstance(self.head, nn.Identity):  # pruned by prune_intermediate_layers
            return x
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ):
        """Stage outputs (timm contract).

        Args:
            x: ``[B, in_chans, H, W]``.
            indices: stage indices to return (negative allowed), or an int ``n`` for the last ``n`` stages;
                default all four.
            norm: accepted for the timm contract; PPMA has no final norm before the head, so it is a no-op.
            stop_early: stop after the last requested stage.
            output_fmt: ``"NCHW"`` or ``"NHWC"``.
            intermediates_only: return only the list of feature maps.

        Returns:
            ``list`` of ``[B, C_s, H/2**(s+2), W/2**(s+2)]`` maps (or NHWC), or ``(final, list)`` where
            ``final`` is ``forward_features(x)``.
        """
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"PPMA.forward_intermediates: output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        take = _take_indices(len(self.stages), indices)
        last = max(take)
        x = self.stem(_check_input(x, self.cfg.in_chans))
        intermediates = []
        stages = self.stages if not (stop_early or intermediates_only) else self.stages[: last + 1]
        for s, stage in enumerate(stages):
            x = stage(x)
            if s in take:
                intermediates.append(x.permute(0, 3, 1, 2) if output_fmt == "NCHW" else x)
        if intermediates_only:
            return intermediates
        return x.permute(0, 3, 1, 2), intermediates

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the stages after the last requested one (and the head). Returns the kept indices."""
        take = _take_indices(len(self.stages), indices)
        self.stages = self.stages[: max(take) + 1]
        if prune_head:  # no head: forward_head returns its input
            self.head = nn.Identity()
            self.num_classes = 0
        return take


def _take_indices(n: int, indices: int | Sequence[int] | None) -> list[int]:
    if indices is None:
        return list(range(n))
    if isinstance(indices, int):
        if not 0 < indices <= n:
            raise ValueError(f"indices as a count must be in [1, {n}], got {indices}")
        return list(range(n - indices, n))
    take = [i % n if -n <= i < n else None for i in indices]
    if None in take:
        raise ValueError(f"indices must lie in [-{n}, {n - 1}], got {list(indices)}")
    return take


def _variant(name: str, **overrides) -> PPMA:
    return PPMA(MODEL_CONFIGS[name], **overrides)


def ppma_tiny(**overrides) -> PPMA:
    """PPMA-T: 14,335,272 parameters, 2.696 GMACs at 224² (docs/model.md §4.1)."""
    return _variant("ppma_tiny", **overrides)


def ppma_small(**overrides) -> PPMA:
    """PPMA-S: 26,969,472 parameters, 4.896 GMACs at 224² (docs/model.md §4.1)."""
    return _variant("ppma_small", **overrides)


def ppma_base(**overrides) -> PPMA:
    """PPMA-B: 54,158,524 parameters, 10.593 GMACs at 224² (docs/model.md §4.1)."""
    return _variant("ppma_base", **overrides)
