"""PPMA-T/S/B backbones, ``create_model``, checkpoint loading (re-exported from :mod:`ppma.checkpoint`) and FLOP
counting.

When timm is importable, importing this package also registers ``ppma_tiny/small/base`` with timm
(``ppma.models.timm``); set ``PPMA_NO_TIMM=1`` to skip that. mmengine registration lives in
``ppma.models.mm`` and is imported by mm configs (``custom_imports``).
"""

import importlib.util as _util
from ppma import config as _config

from ppma.models.ppma import MODEL_CONFIGS, PPMA, PPMAConfig, PPMAStage, ppma_base, ppma_small, ppma_tiny
from ppma.models.registry import create_model, list_models
from ppma.checkpoint import (
    DOWNSTREAM_KEYS,
    EVAL_KEYS,
    convert_mm_checkpoint,
    convert_official_state_dict,
    convert_to_official_state_dict,
    load_checkpoint,
    read_checkpoint,
)
from ppma.models.flops import count_macs, register_flop_formulas
from ppma.models.video import PPMAVideo, VideoConfig, create_video_model

__all__ = [
    "PPMA",
    "PPMAConfig",
    "PPMAStage",
    "MODEL_CONFIGS",
    "ppma_tiny",
    "ppma_small",
    "ppma_base",
    "create_model",
    "list_models",
    "convert_official_state_dict",
    "convert_to_official_state_dict",
    "convert_mm_checkpoint",
    "read_checkpoint",
    "load_checkpoint",
    "EVAL_KEYS",
    "DOWNSTREAM_KEYS",
    "count_macs",
    "register_flop_formulas",
    "TIMM_REGISTERED",
    "PPMAVideo",
    "VideoConfig",
    "create_video_model",
]

register_flop_formulas()

TIMM_REGISTERED = False
if _config.register_with_timm and _util.find_spec("timm") is not None:
    try:
        from ppma._compat import ensure_torchvision as _ensure_torchvision

        _ensure_torchvision()  # timm imports torchvision, whose PyPI build may not load beside a CPU torch
        from ppma.models import timm as _timm  # noqa: F401  (the image models; the video model is not registered)

        TIMM_REGISTERED = True
    except Exception as _exc:  # timm (or its torchvision) fails to import: ppma works without it
        import warnings as _warnings

        _warnings.warn(f"ppma: timm is installed but could not be imported ({_exc!r}); "
                       "the timm registration of ppma models is skipped", RuntimeWarning, stacklevel=2)
