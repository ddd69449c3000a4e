"""``ppma.ops.criss_cross_attention`` (the official "chunk" mode, docs/model.md §3.3) on every available device: the
fused op against its reference over the swept shapes and dtypes, every gradient, and its contract (op_utils
holds the tests shared by every op)."""

from __future__ import annotations

from op_utils import AttentionOpTests
from ppma.ops import criss_cross_attention
from ppma.ops.reference import criss_cross_attention_ref


class TestCrissCrossAttention(AttentionOpTests):
    op = "criss_cross_attention"
    fn = staticmethod(criss_cross_attention)
    ref = staticmethod(criss_cross_attention_ref)
    large_case = ((1, 200, 336, 1, 32, 32), 5)

    def backward_args(self, inputs, outs):
        return (*inputs, outs[-1])  # lse
