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


# ------------------------------------------------------------------ the inference op (CPU, no statistics)
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from op_utils import (  # noqa: E402
    THREAD_COUNTS,
    assert_close,
    cpu_paths,
    make_attention_inputs,
    needs_ext,
    path_id,
    shape_id,
)

# (B, H, W, heads, d, dv): a tile of 64 queries split over rows (72 tokens), odd d and dv, single rows and columns,
# one token, more tokens than one tile in a (batch, head), and PPMA-T's stage-3 head shape.
INFERENCE_SHAPES = [(2, 9, 8, 3, 16, 16), (1, 5, 7, 2, 33, 7), (2, 1, 13, 2, 8, 8), (1, 11, 1, 1, 8, 16),
                    (1, 1, 1, 2, 4, 4), (1, 12, 12, 2, 32, 32), (2, 14, 14, 8, 32, 32)]


def _inference(q, k, v, la, lb, scale):
    return torch.ops.ppma.polyline_attention_inference(q, k, v, la, lb, scale)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", INFERENCE_SHAPES, ids=shape_id)
def test_inference_op_matches_reference(shape, dtype):
    """``polyline_attention_inference`` (one averaged map, one ``P v`` product, no statistics) against the float64
    reference and the training op's output, on the default SIMD path."""
    q, k, v, la, lb = make_attention_inputs(shape, dtype, requires_grad=False, decay_scale=1.0)
    scale = 0.7 * shape[4] ** -0.5
    out = _inference(q, k, v, la, lb, scale)
    assert out.dtype == v.dtype and out.shape == v.shape
    want = polyline_attention_ref(*(t.double() for t in (q, k, v, la, lb)), scale)
    assert_close(out, want, dtype, "inference op vs float64 reference")
    assert_close(out, torch.ops.ppma.polyline_attention(q, k, v, la, lb, scale)[0], dtype, "inference vs training op")
    assert torch.equal(out, _inference(q, k, v, la, lb, scale)), "not deterministic"


@needs_ext
def test_wrapper_picks_the_op_by_grad_and_dtype():
    """The public op keeps no statistics when no gradient is needed (no_grad, inference_mode, inputs without
    requires_grad) and runs an op with statistics when autograd records it: polyline_attention_lse (no out_v2h)
    for every dtype, bf16 and fp16 included (on their 16-bit products, tests/test_cpu_lowp_products.py)."""
    shape = (1, 4, 5, 2, 8, 8)

    def ops_run(requires_grad, ctx, dtype=torch.float32):
        inputs = make_attention_inputs(shape, dtype, requires_grad=requires_grad)
        with ctx, _OpNames() as m:
            polyline_attention(*inputs, 0.3)
        return [n for n in m.names if n.startswith("ppma.")]

    import contextlib

    inference, lse = ["ppma.polyline_attention_inference"], ["ppma.polyline_attention_lse"]
    assert ops_run(True, torch.no_grad()) == inference
    assert ops_run(True, torch.inference_mode()) == inference
    assert ops_run(False, contextlib.nullcontext()) == inference
    assert ops_run(True, contextlib.nullcontext()) == lse
    assert ops_run(True, contextlib.nullcontext(), torch.float64) == lse
    assert ops_run(True, contextlib.nullcontext(), torch.bfloat16) == lse
    assert ops_run(True, contextlib.nullcontext(), torch.float16) == lse


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_op_matches_the_op_with_out_v2h(dtype):
    """polyline_attention_lse: the lse of polyline_attention bit for bit, out up to rounding; its backward (D terms
    from the maps) the gradients of polyline_attention_backward (D terms from out_v2h) up to rounding; opcheck of
    both (schema, fake kernels, autograd registration)."""
    shape = (2, 5, 6, 2, 8, 8)
    q, k, v, la, lb = make_attention_inputs(shape, dtype, decay_scale=1.0, requires_grad=False)
    out, out_v2h, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.3)
    out2, lse2 = torch.ops.ppma.polyline_attention_lse(q, k, v, la, lb, 0.3)
    assert torch.equal(lse, lse2)
    tol = 2e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(out2, out, rtol=tol, atol=tol)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    g = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, out_v2h, lse, 0.3)
    g2 = torch.ops.ppma.polyline_attention_lse_backward(go, q, k, v, la, lb, lse, 0.3)
    for a, b in zip(g, g2):
        torch.testing.assert_close(b, a, rtol=10 * tol, atol=10 * tol * a.abs().max().item())
    torch.library.opcheck(torch.ops.ppma.polyline_attention_lse, (q, k, v, la, lb, 0.3))
    torch.library.opcheck(torch.ops.ppma.polyline_attention_lse_backward, (go, q, k, v, la, lb, lse, 0.3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, la, lb)]
    torch.library.opcheck(torch.ops.ppma.polyline_attention_lse, (*leaves, 0.3))


@needs_ext
def test_inference_op_backward_raises_and_opcheck():
    """Schema, fake kernel and AOT dispatch of the inference op (on inputs without grad: its registered backward
    raises, naming the op to call instead)."""
    shape = (2, 5, 6, 2, 8, 8)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        inputs = make_attention_inputs(shape, dtype, decay_scale=1.0, requires_grad=False)
        torch.library.opcheck(torch.ops.ppma.polyline_attention_inference, (*inputs, 0.3))
    out = _inference(*make_attention_inputs(shape, torch.float32), 0.3)
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


@needs_ext
def test_inference_op_meta_and_compile():
    """The fake kernel gives the shape on ``meta``; ``torch.compile(fullgraph=True, dynamic=True)`` of the public op
    under ``no_grad`` traces to the inference op and gives the eager numbers, without recompiling."""
    import torch._dynamo

    meta = [t.to("meta") for t in make_attention_inputs((1, 3, 4, 2, 8, 6), torch.float32, requires_grad=False)]
    assert _inference(*meta, 0.3).shape == (1, 3, 4, 2, 6) and _inference(*meta, 0.3).device.type == "meta"
    torch._dynamo.reset()
    cf = torch.compile(lambda *a: polyline_attention(*a, 0.3), fullgraph=True, dynamic=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for H, W in ((5, 6), (7, 4), (9, 11)):
            inputs = make_attention_inputs((1, H, W, 2, 8, 8), torch.float32, requires_grad=False)
            torch.testing.assert_close(cf(*inputs), _inference(*inputs, 0.3), rtol=0, atol=0)
    torch._dynamo.reset()


_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from op_utils import make_attention_inputs, THREAD_COUNTS
spec = json.loads(sys.argv[2])
res = {}
for dt in spec["dtypes"]:
    inputs = make_attention_inputs(tuple(spec["shape"]), getattr(torch, dt), requires_grad=False, decay_scale=1.0,
                                   seed=3)
    for n in THREAD_COUNTS:
        torch.set_num_threads(n)
        res[dt, n] = [torch.ops.ppma.polyline_attention_inference(*inputs, 0.3) for _ in range(2)]
torch.save(res, sys.argv[3])
"""


def _run_child(code: str, payload, path: dict, tmp_path):
    """Runs ``code`` in a fresh Python process on the SIMD path ``path`` (:func:`cpu_paths`) with the arguments
    ``tests_dir, json(payload), output file`` and returns what it saved there."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    out = tmp_path / "child.pt"
    env = {**os.environ, **path,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(tests_dir), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code, tests_dir, json.dumps(payload), str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"child on the {path_id(path)} path failed:\n{res.stderr[-3000:]}"
    return torch.load(out)


@needs_ext
@pytest.mark.parametrize("path", cpu_paths(), ids=path_id)
def test_inference_op_paths_deterministic(path, tmp_path):
    """Every SIMD path (in a fresh process): bit-identical across runs and thread counts (1 and 3, which does not
    divide the work), within each dtype's tolerance of the float64 reference; bf16 runs its bf16 products on the
    avx512 path of a CPU with AVX-512 BF16 and float32 arithmetic on the others."""
    spec = {"shape": [2, 9, 7, 2, 16, 16], "dtypes": ["float32", "float64", "bfloat16"]}
    runs = _run_child(_CHILD, spec, path, tmp_path)
    for dt in spec["dtypes"]:
        dtype = getattr(torch, dt)
        first = runs[dt, THREAD_COUNTS[0]][0]
        for n in THREAD_COUNTS:
            for r in runs[dt, n]:
                assert torch.equal(r, first), f"{path_id(path)}, {dt}: differs across runs or threads ({n})"
        inputs = make_attention_inputs(tuple(spec["shape"]), dtype, requires_grad=False, decay_scale=1.0, seed=3)
        want = polyline_attention_ref(*(t.double() for t in inputs), 0.3)
        assert_close(first, want, dtype, f"{path_id(path)}, {dt}: vs float64 reference")


# ------------------------------------------------------------------ key rows at the vector width (CPU)
_WIDTH_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from op_utils import make_attention_inputs, THREAD_COUNTS
res = {}
for shape in json.loads(sys.argv[2]):
    inputs = make_attention_inputs(tuple(shape), torch.float32, decay_scale=1.0, seed=5)
    for n in THREAD_COUNTS:
        torch.set_num_threads(n)
        out, out_v2h, lse = torch.ops.ppma.polyline_attention(*inputs, 0.4)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
        grads = torch.ops.ppma.polyline_attention_backward(go, *inputs, out, out_v2h, lse, 0.4)
        res[tuple(shape), n] = [out, lse, *grads, torch.ops.ppma.polyline_attention_inference(*inputs, 0.4)]
torch.save(res, sys.argv[3])
"""


@needs_ext
@pytest.mark.parametrize("path", cpu_paths(), ids=path_id)
def test_key_rows_at_the_vector_width(path, tmp_path):
    """Maps W = 15 and 16 wide (on the avx512 path each key row is one masked 16-lane vector: the forward's biases and
    the backward's regrouped prefix-sum gradients, docs/ops.md "polyline_attention"), W = 17 and 31 (a full vector and
    a tail: two vectors in the backward's sums) and W = 32 (two full vectors), with more key rows than one tile of
    queries covers: output, lse, the five gradients and the inference op against the float64 reference on every SIMD
    path (in a fresh process), bitwise the same across thread counts."""
    shapes = [[2, 6, 15, 2, 16, 8], [1, 9, 16, 3, 8, 16], [1, 5, 17, 2, 16, 16], [1, 4, 31, 2, 8, 8],
              [1, 3, 32, 2, 8, 16]]
    runs = _run_child(_WIDTH_CHILD, shapes, path, tmp_path)
    names = ["out", "lse", "dq", "dk", "dv", "dlog_alpha", "dlog_beta", "inference out"]
    for shape in shapes:
        first = runs[tuple(shape), THREAD_COUNTS[0]]
        for n in THREAD_COUNTS:
            for name, a, b in zip(names, runs[tuple(shape), n], first):
                assert torch.equal(a, b), f"{path_id(path)}, {shape}, {name}: differs across thread counts ({n})"
        inputs = make_attention_inputs(tuple(shape), torch.float64, decay_scale=1.0, seed=5)
        inputs32 = make_attention_inputs(tuple(shape), torch.float32, decay_scale=1.0, seed=5)
        assert all(torch.equal(a.double(), b) for a, b in zip(inputs32, inputs))  # the child's inputs, in float64
        want_out = polyline_attention_ref(*inputs, 0.4)
        go = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(6)).double()
        want_grads = torch.autograd.grad(want_out, inputs, go)
        what = f"{path_id(path)}, {shape}"
        assert_close(first[0], want_out, torch.float32, f"{what}: out")
        assert_close(first[7], want_out, torch.float32, f"{what}: inference out")
        for name, g, w in zip(names[2:7], first[2:7], want_grads):
            assert_close(g, w, torch.float32, f"{what}: {name}", grad=True)
