"""``ppma.ops.polyline_attention_3d`` (softmax attention under the 3-D polyline mask, paper appendix C.2): the fused
op against its dense reference, every gradient, ``T = 1`` against ``polyline_attention``, and the 3-D op contract
(op_utils)."""

from __future__ import annotations

import pytest
import torch

from op_utils import Op3DTests, make_inputs_3d
from ppma.ops import polyline_attention, polyline_attention_3d
from ppma.ops.reference_3d import polyline_attention_3d_ref


class TestPolylineAttention3D(Op3DTests):
    op = "polyline_attention_3d"
    fn = staticmethod(polyline_attention_3d)
    ref = staticmethod(polyline_attention_3d_ref)
    fn2d = staticmethod(polyline_attention)
    grad_names = ("q", "k", "v", "log_alpha", "log_beta", "log_gamma")

    def extra(self, variant=None):
        return (0.3,)

    def backward_args(self, inputs, outs):
        return (*inputs, *outs)

    def test_default_scale(self):
        inputs = make_inputs_3d((1, 2, 3, 4, 2, 16, 8), requires_grad=False)
        torch.testing.assert_close(polyline_attention_3d(*inputs), polyline_attention_3d(*inputs, 0.25))
        torch.testing.assert_close(polyline_attention_3d_ref(*inputs), polyline_attention_3d_ref(*inputs, 0.25))

    def test_bad_scale_named(self):
        inputs = make_inputs_3d((1, 2, 3, 4, 2, 8, 8), requires_grad=False)
        for f in (polyline_attention_3d, polyline_attention_3d_ref):
            with pytest.raises(TypeError, match="scale must be a real number"):
                f(*inputs, "0.5")
