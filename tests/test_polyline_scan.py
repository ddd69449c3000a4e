"""``ppma.ops.polyline_scan`` (``L x`` by Algorithm 1, docs/model.md §2) on every available device, for ``L`` and ``L^T``:
the fused op against its reference over the swept shapes and dtypes, every gradient, and its contract
(op_utils holds the tests shared by every op)."""

from __future__ import annotations

import pytest
import torch

from op_utils import OpTests, make_scan_inputs, needs_ext
from ppma.ops import polyline_scan
from ppma.ops.reference import polyline_scan_ref


class TestPolylineScan(OpTests):
    op = "polyline_scan"
    fn = staticmethod(polyline_scan)
    ref = staticmethod(polyline_scan_ref)
    grad_names = ("x", "log_alpha", "log_beta")
    gradcheck_shapes = ((1, 3, 4, 2, 0, 3), (2, 1, 3, 1, 0, 2))
    scan = True

    @pytest.fixture(params=[False, True], ids=["L", "LT"])
    def variant(self, request):
        return request.param

    def inputs(self, shape, dtype=torch.float64, device="cpu", **kw):
        return make_scan_inputs(shape, dtype, device, **kw)

    def extra(self, shape, variant=None):
        return (bool(variant),)  # transpose

    def backward_args(self, inputs, outs):
        return tuple(inputs)

    def test_bad_inputs_named(self):
        x, la, lb = make_scan_inputs((2, 5, 6, 2, 0, 8), requires_grad=False)
        cases = [  # (arguments, exception, message, the reference raises too)
            ((x[0], la, lb), ValueError, "x must be", True),
            ((x, la[:, :, :3], lb), ValueError, "log_alpha must be", True),
            ((x, la, lb.to("meta")), ValueError, "log_beta is on", True),
            ((x.int(), la, lb), ValueError, "x must be float", False),
            ((x, la, lb, "yes"), TypeError, "transpose must be a bool", True),
            ((x, la, lb, 1), TypeError, "transpose must be a bool", True),
        ]
        for args, exc, msg, ref_too in cases:
            for f in (polyline_scan, polyline_scan_ref) if ref_too else (polyline_scan,):
                with pytest.raises(exc, match=msg):
                    f(*args)

    @needs_ext
    def test_bad_inputs_reach_cpp_checks(self):
        x, la, lb = make_scan_inputs((2, 5, 6, 2, 0, 8), requires_grad=False)
        with pytest.raises(RuntimeError, match="x must be"):
            torch.ops.ppma.polyline_scan(x[0], la, lb, False)
        with pytest.raises(RuntimeError, match="grad_y must have shape"):
            torch.ops.ppma.polyline_scan_backward(x[:, :2], x, la, lb, False)
