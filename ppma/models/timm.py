"""Registration of ``ppma_tiny``, ``ppma_small`` and ``ppma_base`` with timm (imported by ``ppma.models``
when timm is importable): ``timm.create_model("ppma_tiny", features_only=True)`` and friends.

``pretrained=True`` loads the official ImageNet-1K weights (docs/model.md §5.2) through timm's Hugging Face hub support:
the pretrained configs name ``hf_hub_id="ZhongchenZhao/PPMA"`` and the ``hf_hub_filename`` of each ``best.pth``,
so the file is downloaded once into the hub cache (``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` and ``HF_ENDPOINT``
work as for any hub model) and converted on the fly by :func:`checkpoint_filter_fn`. The EMA weights
(``model_ema``) are loaded: ``best.pth`` is written when the EMA accuracy peaks and the paper reports EMA accuracy.
A local file works too: ``pretrained_cfg_overlay=dict(file="best.pth")``.
"""

from __future__ import annotations

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ppma.models.convert import EVAL_KEYS, convert_official_state_dict
from ppma.models.hub import CLASSIFICATION_FILES, HF_REPO_ID
from ppma.models.ppma import MODEL_CONFIGS, PPMA

__all__ = ["checkpoint_filter_fn", "default_cfgs"]


def checkpoint_filter_fn(state_dict, model: PPMA):
    """Convert an official checkpoint (or a dict holding one, docs/model.md §5.2) to our naming; from a ``best.pth``
    holding both, the EMA weights (``model_ema``, :data:`~ppma.models.EVAL_KEYS` order)."""
    if isinstance(state_dict, dict) and any(k in state_dict for k in EVAL_KEYS):
        return convert_official_state_dict(state_dict)
    return convert_official_state_dict(state_dict, verbose=False)


def _cfg(**kwargs) -> dict:
    return {
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.conv1",
        "classifier": "head.fc",
        "license": "apache-2.0",
        "paper_ids": "arXiv:2506.15940",
        "paper_name": "Polyline Path Masked Attention for Vision Transformer",
        "origin_url": "https://github.com/zhongchenzhao/PPMA",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {name: _cfg(hf_hub_id=HF_REPO_ID, hf_hub_filename=CLASSIFICATION_FILES[name]) for name in CLASSIFICATION_FILES}
)


def _create(variant: str, pretrained: bool = False, **kwargs) -> PPMA:
    return build_model_with_cfg(
        PPMA,
        variant,
        pretrained,
        model_cfg=MODEL_CONFIGS[variant],
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=(0, 1, 2, 3), feature_cls="getter"),
        **kwargs,
    )


@register_model
def ppma_tiny(pretrained: bool = False, **kwargs) -> PPMA:
    """PPMA-T (14.3M params, 2.70 GMACs at 224²)."""
    return _create("ppma_tiny", pretrained, **kwargs)


@register_model
def ppma_small(pretrained: bool = False, **kwargs) -> PPMA:
    """PPMA-S (27.0M params, 4.90 GMACs at 224²)."""
    return _create("ppma_small", pretrained, **kwargs)


@register_model
def ppma_base(pretrained: bool = False, **kwargs) -> PPMA:
    """PPMA-B (54.2M params, 10.59 GMACs at 224²)."""
    return _create("ppma_base", pretrained, **kwargs)
