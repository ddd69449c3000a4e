"""PPMA modules: path decays, rotary embedding, attention, block and layers (docs/model.md §1.4, §3, §4), and the
deployment step for CPU inference, :func:`fuse_for_inference` (docs/design.md §2.9)."""

from ppma.nn.layers import (
    MLPS,
    ClassifierHead,
    ConvFFN,
    ConvStem,
    DropPath,
    DWConv2d,
    LayerNorm,
    LayerScale,
    PatchMerging,
)
from ppma.nn.monarch import MonarchLinear
from ppma.nn.surrogate import SurrogateAttention, surrogate_mixing
from ppma.nn.decay import PathDecay
from ppma.nn.rope import RotaryEmbedding2D, apply_rotary, rotate_every_two
from ppma.nn.attention import ATTENTION_MIXERS, MASKS, SOFTMAX_MIXERS, MaskedAttentionOp, PPMAAttention
from ppma.nn.block import MIXER_FACTORIES, MIXERS, PPMABlock
from ppma.nn.attention_3d import PathDecay3D, PPMAAttention3D
from ppma.nn.fuse import fuse_for_inference, is_fused

__all__ = [
    "PathDecay",
    "RotaryEmbedding2D",
    "PPMAAttention",
    "MaskedAttentionOp",
    "PPMABlock",
    "MASKS",
    "MIXERS",
    "MIXER_FACTORIES",
    "ATTENTION_MIXERS",
    "SOFTMAX_MIXERS",
    "MLPS",
    "MonarchLinear",
    "SurrogateAttention",
    "surrogate_mixing",
    "PathDecay3D",
    "PPMAAttention3D",
    "ConvStem",
    "PatchMerging",
    "ClassifierHead",
    "ConvFFN",
    "DWConv2d",
    "DropPath",
    "LayerScale",
    "apply_rotary",
    "rotate_every_two",
    "fuse_for_inference",
    "is_fused",
    "LayerNorm",
]
