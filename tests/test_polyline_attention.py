"""``ppma.ops.polyline_attention`` (the official "whole" mode, docs/model.md §3.4) on every available device: the fused
op against its reference over the swept shapes and dtypes, every gradient, and its contract (op_utils holds
the tests shared by every op)."""

from __future__ import annotations

from op_utils import AttentionOpTests
from ppma.ops import polyline_attention
from ppma.ops.reference import polyline_attention_ref


class TestPolylineAttention(AttentionOpTests):
    op = "polyline_attention"
    fn = staticmethod(polyline_attention)
    ref = staticmethod(polyline_attention_ref)
    large_case = ((1, 64, 64, 2, 32, 32), 3)

    def backward_args(self, inputs, outs):
        return (*inputs, *outs)  # out, out_v2h, lse
