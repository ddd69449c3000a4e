"""``ppma.ops.polyline_linear_attention_3d`` (3-D PPMLA, paper appendix C.2 with §4 Theorem 3), with and without
normalisation: the fused op against its dense reference, every gradient, ``T = 1`` against
``polyline_linear_attention``, the scan form against ``polyline_scan_3d``, and the 3-D op contract (op_utils)."""

from __future__ import annotations

import pytest
import torch

from op_utils import SHAPES_3D, Op3DTests, check_against_reference, make_inputs_3d, needs_ext, shape_id
from ppma.ops import polyline_linear_attention, polyline_linear_attention_3d, polyline_scan_3d
from ppma.ops.reference_3d import polyline_linear_attention_3d_ref


class TestPolylineLinearAttention3D(Op3DTests):
    op = "polyline_linear_attention_3d"
    fn = staticmethod(polyline_linear_attention_3d)
    ref = staticmethod(polyline_linear_attention_3d_ref)
    fn2d = staticmethod(polyline_linear_attention)
    grad_names = ("q", "k", "v", "log_alpha", "log_beta", "log_gamma")
    nonneg = True

    @pytest.fixture(params=[True, False], ids=["normalize", "plain"])
    def variant(self, request):
        return request.param

    def extra(self, variant=None):
        return (variant is not False, 1e-6)

    def backward_args(self, inputs, outs):
        return (*inputs, outs[1])

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    @pytest.mark.parametrize("shape", SHAPES_3D, ids=shape_id)
    def test_matches_reference(self, shape, dtype, variant):
        """As in Op3DTests, except that with normalisation a one-token clip has dq, dk that cancel to ~eps (the
        output is v whatever q and k are): measured against their size without the cancellation (as the 2-D test)."""
        if variant is not False and shape[1] * shape[2] * shape[3] == 1:
            inputs = self.inputs(shape, dtype, decay_scale=1.0)
            q, k, v = (t.detach() for t in inputs[:3])
            scale = v.norm().item() * max(q.norm(dim=-1).max().item(), k.norm(dim=-1).max().item())
            floor = scale / (q * k).sum(-1).min().item()
            check_against_reference(self.fn, self.ref, inputs, self.extra(variant), names=self.grad_names,
                                    dtype=dtype, floors={"q": floor, "k": floor})
            return
        super().test_matches_reference(shape, dtype, variant)

    def test_bad_inputs_reach_cpp_checks(self):
        super().test_bad_inputs_reach_cpp_checks()
        inputs = self.inputs((1, 2, 3, 4, 2, 8, 8), requires_grad=False)
        with pytest.raises(RuntimeError, match="eps must be finite"):
            torch.ops.ppma.polyline_linear_attention_3d(*inputs, True, -1.0)


def test_scan_form_matches_polyline_scan_3d():
    """The unnormalised op is q_p^T (L (k ⊗ v))_p + the same with L^T, halved: the scan form through the public
    polyline_scan_3d."""
    q, k, v, la, lb, lg = make_inputs_3d((2, 3, 4, 5, 2, 4, 3), requires_grad=False, nonneg=True)
    X = (k[..., :, None] * v[..., None, :]).flatten(-2)
    want = 0
    for tr in (False, True):
        Y = polyline_scan_3d(X, la, lb, lg, tr).unflatten(-1, (4, 3))
        want = want + 0.5 * (q[..., :, None] * Y).sum(-2)
    torch.testing.assert_close(polyline_linear_attention_3d(q, k, v, la, lb, lg, False), want)
