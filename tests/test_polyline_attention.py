"""``ppma.ops.polyline_attention`` (the official "whole" mode, docs/model.md §3.4) on every available device: the fused
op against its reference over the swept shapes and dtypes, every gradient, and its contract (op_utils holds
the tests shared by every op)."""

from __future__ import annotations

import pytest
import torch

from op_utils import DEVICES, AttentionOpTests, assert_thread_invariant, make_attention_inputs, needs_ext
from ppma.ops import polyline_attention
from ppma.ops.reference import polyline_attention_ref


class TestPolylineAttention(AttentionOpTests):
    op = "polyline_attention"
    fn = staticmethod(polyline_attention)
    ref = staticmethod(polyline_attention_ref)
    large_case = ((1, 64, 64, 2, 32, 32), 3)

    def backward_args(self, inputs, outs):
        return (*inputs, *outs)  # out, out_v2h, lse

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_thread_count_does_not_change_results(self, device):
        if device != "cpu":
            pytest.skip("CPU thread pool")
        assert_thread_invariant(polyline_attention, make_attention_inputs((1, 8, 9, 2, 16, 16), torch.float32))
