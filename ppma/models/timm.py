"""Registration of ``ppma_tiny``, ``ppma_small`` and ``ppma_base`` with timm (imported by ``ppma.models``
when timm is importable): ``timm.create_model("ppma_tiny", features_only=True)`` and friends.

``pretrained=True`` loads the official ImageNet-1K weights through timm's Hugging Face hub support:
the pretrained configs name ``hf_hub_id="ZhongchenZhao/PPMA"`` and the ``hf_hub_filename`` of each ``best.pth``,
so the file is downloaded once into the hub cache (``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` and ``HF_ENDPOINT``
work as for any hub model). The configs set ``custom_load``: timm downloads the file (hub, URL) or takes the
local one (``pretrained_cfg_overlay=dict(file="best.pth")``) and hands its path to ``PPMA.load_pretrained``, so
it is read by ppma's one checkpoint reader (:func:`ppma.checkpoint.read_checkpoint`: weights-only, with the
numpy values and ``argparse.Namespace`` the official ``best.pth`` holds) and loaded strictly. The EMA weights
(``model_ema``) are loaded: ``best.pth`` is written when the EMA accuracy peaks and the paper reports EMA accuracy.
A state dict given as ``pretrained_cfg_overlay=dict(state_dict=...)`` goes through :func:`checkpoint_filter_fn`.
"""

from __future__ import annotations

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import register_notrace_module
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ppma.checkpoint import EVAL_KEYS, convert_official_state_dict
from ppma.checkpoint.hub import CLASSIFICATION_FILES, HF_REPO_ID
from ppma.models.ppma import MODEL_CONFIGS, PPMA
from ppma.nn import DropPath, DWConv2d, PPMAAttention, RotaryEmbedding2D
from ppma.nn.layers import ConvFFN, ConvStem, LayerNorm, PatchMerging
from ppma.nn.padre import PADReMixer
from ppma.nn.surrogate import SurrogateAttention

# Leaves of timm's FX tracing (``features_only=True, feature_cls="fx"``, ``create_feature_extractor``): these modules
# read tensor shapes or dtypes in Python (reshapes to heads, RoPE tables per map size, the per-sample drop mask,
# the depthwise convolution's folded residual), choose an inference path at run time (the stem and patch merging
# fold their BatchNorms, ConvFFN's linears run oneDNN's, the block's LayerNorms ppma's, ppma.nn.layers) or call the
# fused ops, so FX records each as one call instead of tracing into it. A new token mixer module is added here.
for _leaf in (PPMAAttention, PADReMixer, SurrogateAttention, RotaryEmbedding2D, DropPath, DWConv2d, ConvStem,
              PatchMerging, ConvFFN, LayerNorm):
    register_notrace_module(_leaf)

__all__ = ["checkpoint_filter_fn", "default_cfgs"]


def checkpoint_filter_fn(state_dict, model: PPMA):
    """Convert an official checkpoint (or a dict holding one) to our naming; from a ``best.pth``
    holding both, the EMA weights (``model_ema``, :data:`~ppma.models.EVAL_KEYS` order)."""
    if isinstance(state_dict, dict) and any(k in state_dict for k in EVAL_KEYS):
        return convert_official_state_dict(state_dict)
    return convert_official_state_dict(state_dict, verbose=False)


def _cfg(**kwargs) -> dict:
    return {
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),  # forward_features at 224²: [B, 512, 7, 7]; num_features 512, head_hidden_size 1024
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
        "custom_load": "hf",  # files (hub, URL, local) go to PPMA.load_pretrained, i.e. ppma's checkpoint reader
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {name: _cfg(hf_hub_id=HF_REPO_ID, hf_hub_filename=CLASSIFICATION_FILES[name]) for name in CLASSIFICATION_FILES}
)


def _create(variant: str, pretrained: bool = False, **kwargs) -> PPMA:
    overlay = kwargs.get("pretrained_cfg_overlay")
    if overlay and any(overlay.get(k) for k in ("file", "url", "hf_hub_id")):
        # timm clears custom_load when an overlay names another source; keep it, so that a local best.pth is
        # read by ppma's reader too (timm's own weights-only load refuses the numpy values such files hold)
        kwargs["pretrained_cfg_overlay"] = {"custom_load": "hf", **overlay}
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
