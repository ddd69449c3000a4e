"""``ppma.ops.polyline_scan_3d`` (the 3-D Algorithm 1, paper appendix C.2): the fused op against its dense reference,
every gradient, ``T = 1`` against ``polyline_scan``, and the 3-D op contract (op_utils); the reference's mask
against a literal pair-by-pair construction of the definition."""

from __future__ import annotations

import pytest
import torch

from op_utils import Op3DTests, literal_mask_3d, make_inputs_3d
from ppma.ops import polyline_scan, polyline_scan_3d
from ppma.ops.reference import polyline_log_mask
from ppma.ops.reference_3d import polyline_log_mask_3d, polyline_scan_3d_ref


class TestPolylineScan3D(Op3DTests):
    op = "polyline_scan_3d"
    fn = staticmethod(polyline_scan_3d)
    ref = staticmethod(polyline_scan_3d_ref)
    fn2d = staticmethod(polyline_scan)
    grad_names = ("x", "log_alpha", "log_beta", "log_gamma")

    @pytest.fixture(params=[False, True], ids=["L", "LT"])
    def variant(self, request):
        return request.param

    def inputs(self, shape, dtype=torch.float64, **kw):
        q, k, v, *decs = make_inputs_3d(shape, dtype, **kw)
        return [v] + decs

    def extra(self, variant=None):
        return (bool(variant),)

    def backward_args(self, inputs, outs):
        return tuple(inputs)

    def test_bad_transpose_named(self):
        x, la, lb, lg = self.inputs((1, 2, 3, 4, 1, 4, 4), requires_grad=False)
        for f in (polyline_scan_3d, polyline_scan_3d_ref):
            with pytest.raises(TypeError, match="transpose must be a bool"):
                f(x, la, lb, lg, 1)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 2), (1, 4, 1, 3, 1), (1, 1, 3, 3, 2), (1, 2, 3, 1, 1)])
def test_reference_mask_matches_literal_definition(shape):
    gen = torch.Generator().manual_seed(0)
    la, lb, lg = (-torch.rand(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
    lb[0, 0, 0, 0, 0] = -float("inf")  # the floor
    torch.testing.assert_close(polyline_log_mask_3d(la, lb, lg), literal_mask_3d(la, lb, lg), rtol=0, atol=1e-12)


def test_reference_mask_t1_is_2d_mask():
    gen = torch.Generator().manual_seed(1)
    la, lb, lg = (-torch.rand(2, 1, 4, 5, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(polyline_log_mask_3d(la, lb, lg), polyline_log_mask(la[:, 0], lb[:, 0]), rtol=0,
                               atol=0)
