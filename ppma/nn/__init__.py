"""PPMA modules: path decays, rotary embedding, attention, block and layers (docs/model.md §1.4, §3, §4)."""

from ppma.nn.layers import ClassifierHead, ConvFFN, ConvStem, DropPath, DWConv2d, LayerScale, PatchMerging
from ppma.nn.decay import PathDecay
from ppma.nn.rope import RotaryEmbedding2D, apply_rotary, rotate_every_two
from ppma.nn.attention import ATTENTION_KINDS, MASKS, MaskedAttentionOp, PPMAAttention
from ppma.nn.block import MIXERS, PPMABlock

__all__ = [
    "PathDecay",
    "RotaryEmbedding2D",
    "PPMAAttention",
    "MaskedAttentionOp",
    "PPMABlock",
    "ATTENTION_KINDS",
    "MASKS",
    "MIXERS",
    "ConvStem",
    "PatchMerging",
    "ClassifierHead",
    "ConvFFN",
    "DWConv2d",
    "DropPath",
    "LayerScale",
    "apply_rotary",
    "rotate_every_two",
]
