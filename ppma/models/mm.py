"""PPMA as an mmengine backbone for MMDetection 3.x / MMSegmentation 1.x (docs/model.md §4.2).

Importing this module registers ``PPMA`` in mmengine's root ``MODELS`` registry (which the mmdet and
mmseg registries fall back to) and, when they are importable, in ``mmdet.registry.MODELS`` and
``mmseg.registry.MODELS``. Configs use it with ``custom_imports=dict(imports=["ppma.models.mm"])`` and
``backbone=dict(type="PPMA", arch="tiny", ...)``. No mmcv ops are needed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmengine.registry import MODELS
from torch import nn

from ppma.checkpoint import DOWNSTREAM_KEYS, load_checkpoint
from ppma.models.ppma import MODEL_CONFIGS, PPMA

__all__ = ["PPMABackbone"]

ARCHS = {"tiny": "ppma_tiny", "small": "ppma_small", "base": "ppma_base"}


class PPMABackbone(BaseModule):
    """Multi-scale PPMA backbone: NCHW features at strides 4, 8, 16, 32 (docs/model.md §4.2).

    Every returned stage output goes through its own LayerNorm (``out_norms.{i}``, eps 1e-5, default
    init; official ``outnorm{i}``) before it is permuted to NCHW.

    Args:
        arch: ``"tiny"``, ``"small"`` or ``"base"`` (or ``"ppma_tiny"`` etc.).
        out_indices: stages to return.
        drop_path_rate: stochastic depth; ``None`` keeps the variant default (0.1 / 0.15 / 0.4),
            as the official downstream backbones do.
        with_cp: activation checkpointing of every block.
        checkpoint_key: checkpoint entries tried in order by ``init_cfg=dict(type="Pretrained", ...)``;
            default ``("model", "models", "model_ema", "state_dict")``, mirroring the official backbones.
        init_cfg: mmengine init config; ``dict(type="Pretrained", checkpoint=...)`` loads an official
            classification checkpoint (``best.pth``), an mm checkpoint (its ``backbone.*``) or a ppma checkpoint
            through :func:`ppma.checkpoint.load_checkpoint`: a local file, an ``http(s)://`` URL, ``hf://<repo>/<path>``
            or another mmengine ``CheckpointLoader`` scheme, always read with a weights-only ``torch.load``.
        **overrides: further :class:`~ppma.models.PPMAConfig` fields (``embed_dims``, ``depths``, the token mixer
            ``mixer`` (e.g. ``"sab"``), the FFN ``mlp="monarch"``, ``mask``, ...; one string or one per stage).
    """

    def __init__(
        self,
        arch: str = "tiny",
        out_indices: Sequence[int] = (0, 1, 2, 3),
        drop_path_rate: float | None = None,
        with_cp: bool = False,
        checkpoint_key: str | Sequence[str] | None = None,
        init_cfg: dict | None = None,
        **overrides,
    ) -> None:
        super().__init__(init_cfg=init_cfg)
        name = ARCHS.get(arch, arch)
        if name not in MODEL_CONFIGS:
            raise ValueError(f"PPMA backbone: unknown arch {arch!r}; choose from {sorted(ARCHS)}")
        if drop_path_rate is not None:
            overrides["drop_path_rate"] = drop_path_rate
        net = PPMA(MODEL_CONFIGS[name], num_classes=0, **overrides)
        self.cfg = net.cfg
        self.out_indices = tuple(i % 4 for i in out_indices)
        if not self.out_indices or len(set(self.out_indices)) != len(self.out_indices):
            raise ValueError(f"PPMA backbone: out_indices must be distinct stage indices, got {out_indices}")
        self.checkpoint_key = checkpoint_key or DOWNSTREAM_KEYS
        self.stem = net.stem
        self.stages = net.stages[: max(self.out_indices) + 1]
        self.out_norms = nn.ModuleDict({str(i): nn.LayerNorm(self.cfg.embed_dims[i]) for i in self.out_indices})
        self.num_features = [self.cfg.embed_dims[i] for i in self.out_indices]
        if with_cp:
            for stage in self.stages:
                stage.grad_checkpointing = True

    def init_weights(self) -> None:
        """Load ``init_cfg=dict(type="Pretrained", checkpoint=...)`` through the PPMA converter; otherwise keep
        the official initialisation done at construction.

        Only the expected differences are accepted: the classification head (``head.*``, official
        ``proj``/``norm``/``head``) and stages or out-norms this backbone does not build may be extra, the
        out-norms (new in the dense-prediction backbone) may be missing. Anything else, such as a
        PPMA-T checkpoint given to a PPMA-S config, raises instead of training a mostly random backbone.
        """
        cfg = self.init_cfg
        if isinstance(cfg, dict) and cfg.get("type") == "Pretrained":
            source = cfg["checkpoint"]
            result = load_checkpoint(
                self,
                source,
                key=self.checkpoint_key,
                strict=True,
                allow_missing=[r"out_norms\."],
                allow_unexpected=[r"head\.", *(rf"stages\.{s}\." for s in range(len(self.stages), 4)),
                                  *(rf"out_norms\.{i}\." for i in range(4) if i not in self.out_indices)],
            )
            print_log(
                f"PPMA backbone: loaded {source}; newly initialised: {result.missing_keys}; ignored "
                f"{len(result.unexpected_keys)} entries of the classifier or of stages and out-norms not built",
                logger="current",
            )
            self._is_init = True
            return
        super().init_weights()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x: [B, in_chans, H, W]`` -> tuple of ``[B, C_i, H / 2**(i+2), W / 2**(i+2)]`` (sizes rounded up)."""
        x = self.stem(x)
        outs = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in self.out_indices:
                outs.append(self.out_norms[str(i)](x).permute(0, 3, 1, 2).contiguous())
        return tuple(outs)


# `force=True`: re-importing this module (or another copy of it) replaces the entry instead of failing.
# Registry.get() is avoided on purpose: it imports the registry's locations (mmseg.models needs mmcv ops).
MODELS.register_module(name="PPMA", module=PPMABackbone, force=True)
for _mod in ("mmdet.registry", "mmseg.registry"):
    try:
        __import__(_mod, fromlist=["MODELS"]).MODELS.register_module(name="PPMA", module=PPMABackbone, force=True)
    except Exception:  # not installed (or not importable without mmcv)
        pass
