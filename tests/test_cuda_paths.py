"""The CUDA kernel paths that only a GPU selects (issue 9): tensor-core ``polyline_attention`` (fp16 / bf16, d and
dv multiples of 8 up to 128) against the CUDA-core kernels on the same inputs, the launch limits (B * heads above
65535, head dims above 128 and above 512, misaligned rows), the packed short-line ``criss_cross_attention``
kernels, and ``polyline_linear_attention`` at sizes the sweep does not reach (4096 tokens, several channel slices,
many batch-heads). The op sweeps of ``tests/test_<op>.py`` run every op on CUDA as well; the same kernels run on the CPU
through the emulator in ``tests/test_cuda_emulation.py``. Skipped without a GPU and the CUDA kernels."""

from __future__ import annotations

import pytest
import torch

import ppma
from op_utils import DEVICES, assert_close, make_attention_inputs, rel_err
from ppma.ops import reference as ref

pytestmark = pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the CUDA kernels of ppma._C")

REFS = {"polyline_attention": ref.polyline_attention_ref, "criss_cross_attention": ref.criss_cross_attention_ref}


def cuda_core_kernels():
    """polyline_attention's CUDA-core kernels only, for the duration (the internal option cuda_tensor_cores)."""
    return ppma.config.internal_option("cuda_tensor_cores", 0)


def _inputs(shape, dtype, seed=0):
    return make_attention_inputs(shape, dtype, "cuda", seed=seed, decay_scale=1.0, requires_grad=False)


def _ref_grads(op, inputs, scale, grad_out):
    """The reference's output and gradients in float64 on the GPU."""
    ins = [t.detach().double().requires_grad_() for t in inputs]
    out = REFS[op](*ins, scale)
    return out, torch.autograd.grad(out, ins, grad_out.double())


def test_polyline_attention_tensor_cores_vs_cuda_cores():
    """The two CUDA paths on the same bf16 inputs agree up to the 16-bit rounding of P and dS."""
    q, k, v, la, lb = _inputs((2, 12, 12, 2, 32, 32), torch.bfloat16, seed=11)
    go = torch.randn(q.shape[:4] + (32,), device="cuda", dtype=torch.bfloat16)

    def run():
        o = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.2)
        return (*o, *torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, *o, 0.2))

    tc = run()
    with cuda_core_kernels():
        core = run()
    for name, a, b in zip(("out", "out_v2h", "lse", "dq", "dk", "dv", "dla", "dlb"), tc, core):
        err = rel_err(a, b)
        assert err < (1e-4 if name == "lse" else 2e-2), f"{name}: {err:.2e}"


@pytest.mark.parametrize("grad_scale", [1e-4, 1e-6, 1e3])
def test_polyline_attention_fp16_small_and_large_gradients(grad_scale):
    """fp16 on the tensor cores with small or large output gradients (the backward packs dS to 16 bits before its
    products; the autograd formula scales dO by a power of two first): every gradient within the fp16 tolerance,
    or within 2.5x the error of merely rounding the float64 gradient to its dtype where that is larger (at
    dO ~ 1e-6 the true gradients are fp16 subnormals)."""
    import ppma.ops

    q, k, v, la, lb = (t.requires_grad_() for t in _inputs((2, 16, 16, 2, 32, 32), torch.float16, seed=5))
    out = ppma.ops.polyline_attention(q, k, v, la, lb, 0.18)
    go = (torch.randn(out.shape, device="cuda") * grad_scale).half()
    grads = torch.autograd.grad(out, (q, k, v, la, lb), go)
    _, wgrads = _ref_grads("polyline_attention", (q, k, v, la, lb), 0.18, go)
    for name, a, w in zip(("q", "k", "v", "log_alpha", "log_beta"), grads, wgrads):
        floor = rel_err(w.to(a.dtype), w)
        assert torch.isfinite(a).all(), f"grad {name}: non-finite"
        err = rel_err(a, w)
        assert err <= max(2e-2, 2.5 * floor), f"grad {name} (dO ~ {grad_scale:g}): {err:.3e}, rounding {floor:.3e}"


@pytest.mark.parametrize("path", ["tensor_cores", "cuda_cores"])
def test_polyline_attention_deterministic_large(path, request):
    """4096 tokens in bf16: right numbers, and two backward runs bitwise equal (no atomics anywhere)."""
    if path == "cuda_cores":
        option = cuda_core_kernels()
        option.__enter__()
        request.addfinalizer(lambda: option.__exit__(None, None, None))
    q, k, v, la, lb = _inputs((1, 64, 64, 2, 32, 32), torch.bfloat16, seed=7)
    out, ov, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.18)
    go = torch.randn_like(out)
    want, wgrads = _ref_grads("polyline_attention", (q, k, v, la, lb), 0.18, go)
    assert_close(out, want, torch.bfloat16, "out")
    g1 = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.18)
    g2 = torch.ops.ppma.polyline_attention_backward(go, q, k, v, la, lb, out, ov, lse, 0.18)
    for name, a, b, w in zip(("q", "k", "v", "log_alpha", "log_beta"), g1, g2, wgrads):
        assert torch.equal(a, b), f"grad {name}: backward is not deterministic"
        assert_close(a, w, torch.bfloat16, f"grad {name}", grad=True, mult=2.0)


def test_polyline_attention_misaligned_rows():
    """Rows that are not 16-byte aligned (a storage offset of one element) go through a copy, same numbers."""
    q, k, v, la, lb = _inputs((1, 5, 6, 2, 32, 32), torch.bfloat16, seed=2)
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    qm = buf[1:].view(q.shape).copy_(q)
    a = torch.ops.ppma.polyline_attention(qm, k, v, la, lb, 0.2)
    b = torch.ops.ppma.polyline_attention(q, k, v, la, lb, 0.2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("op", list(REFS))
def test_many_batch_heads(op):
    """B * heads above 65535 (the limit of gridDim.y): the 1-D grids cover every (b, head)."""
    B = 33000
    q, k, v, la, lb = _inputs((B, 1, 3, 2, 16, 16), torch.float32, seed=4)
    out = getattr(torch.ops.ppma, op)(q, k, v, la, lb, 0.25)[0]
    idx = torch.tensor([0, 1, B // 2, B - 1], device="cuda")  # batches spread over the grid
    want = REFS[op](*(t[idx].double() for t in (q, k, v, la, lb)), 0.25)
    assert_close(out[idx], want, torch.float32, op)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_above_128(dtype):
    """Head dims up to 512 run on the CUDA-core kernels (zero-padded to 256 or 512)."""
    for shape in [(1, 3, 4, 1, 200, 136), (1, 2, 3, 1, 300, 512)]:
        inputs = _inputs(shape, dtype, seed=shape[4])
        scale = shape[4] ** -0.5
        for op in REFS:
            out = getattr(torch.ops.ppma, op)(*inputs, scale)[0]
            assert_close(out, REFS[op](*(t.double() for t in inputs), scale), dtype, f"{op} {shape}")


def test_head_dim_above_512_is_refused():
    inputs = _inputs((1, 2, 2, 1, 520, 16), torch.float32)
    for op in REFS:
        with pytest.raises(RuntimeError, match="head dims up to 512"):
            getattr(torch.ops.ppma, op)(*inputs, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 28, 28, 2, 32, 32), (1, 56, 56, 1, 16, 16), (2, 7, 9, 3, 16, 16),
                                   (1, 70, 5, 1, 32, 32)])
def test_criss_cross_packed_lines(shape, dtype):
    """Short lines (<= 64) run packed, several per block (70-long columns: the generic kernels), deterministic."""
    q, k, v, la, lb = _inputs(shape, dtype, seed=sum(shape))
    scale = shape[4] ** -0.5
    out, lse = torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, scale)
    go = torch.randn_like(out)
    want, wgrads = _ref_grads("criss_cross_attention", (q, k, v, la, lb), scale, go)
    assert_close(out, want, dtype, "out")
    g1 = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, scale)
    g2 = torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, scale)
    for name, a, b, w in zip(("q", "k", "v", "log_alpha", "log_beta"), g1, g2, wgrads):
        assert torch.equal(a, b), f"grad {name}: backward is not deterministic"
        assert_close(a, w, dtype, f"grad {name}", grad=True, mult=2.0)


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "plain"])
@pytest.mark.parametrize("shape,dtype", [((1, 64, 64, 2, 32, 32), torch.bfloat16),   # 4096 tokens, C = 33: 2 slices
                                         ((2, 9, 17, 2, 16, 100), torch.float32),    # C = 101: 4 slices
                                         ((20000, 1, 3, 2, 8, 8), torch.float32)])   # 40000 batch-heads
def test_polyline_linear_attention_large(shape, dtype, normalize):
    """Forward and every gradient against the fp64 reference, and two backward runs bitwise equal (the channel
    slices' partial sums are reduced in a fixed order, no atomics)."""
    q, k, v, la, lb = _inputs(shape, dtype, seed=sum(shape))
    q, k = q.abs(), k.abs()
    out, stats = torch.ops.ppma.polyline_linear_attention(q, k, v, la, lb, normalize, 1e-6)
    go = torch.randn_like(out)
    idx = torch.arange(min(shape[0], 4), device="cuda")  # the reference on a few batches only
    ins = [t[idx].detach().double().requires_grad_() for t in (q, k, v, la, lb)]
    want = ref.polyline_linear_attention_ref(*ins, normalize, 1e-6)
    wgrads = torch.autograd.grad(want, ins, go[idx].double())
    assert_close(out[idx], want, dtype, "out")
    g1 = torch.ops.ppma.polyline_linear_attention_backward(go, q, k, v, la, lb, stats, normalize, 1e-6)
    g2 = torch.ops.ppma.polyline_linear_attention_backward(go, q, k, v, la, lb, stats, normalize, 1e-6)
    for name, a, b, w in zip(("q", "k", "v", "log_alpha", "log_beta"), g1, g2, wgrads):
        assert torch.equal(a, b), f"grad {name}: backward is not deterministic"
        assert torch.isfinite(a).all(), f"grad {name}: non-finite values"
        assert_close(a[idx], w, dtype, f"grad {name}", grad=True, mult=2.0)
