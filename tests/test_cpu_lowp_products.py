"""bf16 / fp16 ``polyline_attention`` on the CPU with each choice of products (docs/performance.md "bf16 and fp16 on
the CPU"): ppma's own SIMD products (internal option ``cpu_lowp_products=1``) and torch's CPU batch-reduce GEMM
(``=2``, the default on CPUs with AMX), each forced here so that both run on every machine: the training op (out,
out_v2h, lse), the inference op and the five gradients against the float64 reference within the 16-bit tolerance,
over narrow and wide maps, odd sizes, head dims 16 / 32 / 64 and several heads; bitwise the same for 1, 2 and 3
threads; and a bf16-autocast training step of a tiny PPMA-T on those products. On the default SIMD path of the machine;
``PPMA_CPU_CAPABILITY=avx2`` / ``default`` in the environment run the same tests on the narrower paths."""

from __future__ import annotations

import pytest
import torch

from op_utils import assert_close, make_attention_inputs, needs_ext, shape_id
from ppma import backends, config
from ppma.ops.reference import polyline_attention_ref

# option value -> name in the test ids
PRODUCTS = {1: "simd", 2: "brgemm"}
DTYPES = [torch.bfloat16, torch.float16]
# Tighter than the table's 16-bit tolerance (2e-2): the float32 result rounded to bf16 is ~1.7e-3 off the float64
# one, to fp16 ~2e-4; either choice of products stays within about twice that (measured: <= 2.5e-3 and 3e-4).
MULT = {torch.bfloat16: 0.25, torch.float16: 0.05}

# (B, H, W, heads, d, dv): a wide single row, a single column, odd sizes (d = 33, dv = 7), more than one query tile
# per (batch, head) (N = 65, 144), head dims 16, 32 and 64, one to four heads; W = 40, wider than the backward's
# regrouped prefix-sum gradients take (W <= 32 on the avx512 path: per-key-row sums instead).
SHAPES = [(1, 1, 23, 2, 16, 8), (1, 11, 1, 2, 32, 16), (1, 3, 17, 2, 16, 16), (2, 9, 7, 2, 32, 32),
          (1, 8, 9, 4, 33, 7), (1, 13, 5, 3, 64, 64), (1, 12, 12, 1, 64, 64), (1, 3, 40, 2, 16, 16)]


def _inputs(shape, dtype, seed=0):
    return make_attention_inputs(shape, dtype, requires_grad=False, decay_scale=1.0, seed=seed)


def _reference(inputs, scale, go=None):
    """The float64 reference on the 16-bit inputs' values: the output, and with ``go`` the five gradients."""
    ref_in = [t.detach().double().requires_grad_(go is not None) for t in inputs]
    out = polyline_attention_ref(*ref_in, scale)
    if go is None:
        return out.detach(), None
    return out.detach(), torch.autograd.grad(out, ref_in, go.double())


def _run_all(inputs, scale, go):
    """The training op's out, out_v2h, lse; the five gradients of its backward; the inference op's output; the
    gradients of polyline_attention_lse_backward (the rows' D terms from the maps)."""
    out, out_v2h, lse = torch.ops.ppma.polyline_attention(*inputs, scale)
    grads = torch.ops.ppma.polyline_attention_backward(go, *inputs, out, out_v2h, lse, scale)
    inf = torch.ops.ppma.polyline_attention_inference(*inputs, scale)
    lse_grads = torch.ops.ppma.polyline_attention_lse_backward(go, *inputs, lse, scale)
    return out, out_v2h, lse, grads, inf, lse_grads


@needs_ext
def test_option_selects_the_products():
    """``cpu_lowp_products``: 0 (default) follows the CPU (torch's packing for AMX), 1 and 2 force each choice, for
    bf16 and fp16 alike; other dtypes never take them; out-of-range values raise."""
    assert config.get_internal_option("cpu_lowp_products") == 0
    native = {dt: bool(torch.ops.ppma.cpu_lowp_gemm_native(dt)) for dt in DTYPES}
    for dt in DTYPES:
        assert backends.cpu_lowp_gemm(dt) == native[dt]
    with config.internal_option("cpu_lowp_products", 1):
        assert not any(backends.cpu_lowp_gemm(dt) for dt in DTYPES)
    with config.internal_option("cpu_lowp_products", 2):
        assert all(backends.cpu_lowp_gemm(dt) for dt in DTYPES)
        assert not backends.cpu_lowp_gemm(torch.float32) and not backends.cpu_lowp_gemm(torch.float64)
        assert "torch's CPU batch-reduce GEMM" in backends.cpu_summary()
    with config.internal_option("cpu_lowp_products", 1):
        assert "torch's CPU batch-reduce GEMM" not in backends.cpu_summary()
    with pytest.raises(ValueError):
        config.set_internal_option("cpu_lowp_products", 3)
    assert config.get_internal_option("cpu_lowp_products") == 0


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("products", sorted(PRODUCTS), ids=PRODUCTS.get)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(shape, products, dtype):
    """Forward (both ops), lse and gradients (both backward ops) against the float64 reference of the 16-bit
    inputs, within the 16-bit tolerance; out_v2h against the reference's V2H half (lse's exponent reproduces it)."""
    inputs = _inputs(shape, dtype)
    scale = 0.8 * shape[4] ** -0.5
    go = torch.randn(shape[:4] + (shape[5],), generator=torch.Generator().manual_seed(1)).to(dtype)
    with config.internal_option("cpu_lowp_products", products):
        assert backends.cpu_lowp_gemm(dtype) == (products == 2)
        out, out_v2h, lse, grads, inf, lse_grads = _run_all(inputs, scale, go)
    want, want_grads = _reference(inputs, scale, go)
    what = f"{PRODUCTS[products]}, {dtype}"
    assert out.dtype == dtype and inf.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, want, dtype, f"{what}: out", mult=MULT[dtype])
    assert_close(inf, want, dtype, f"{what}: inference out", mult=MULT[dtype])
    assert torch.isfinite(out_v2h).all() and torch.isfinite(lse).all()
    names = ["dq", "dk", "dv", "dlog_alpha", "dlog_beta"]
    for name, g, lg, w in zip(names, grads, lse_grads, want_grads):
        assert g.dtype == (dtype if name in ("dq", "dk", "dv") else torch.float32)
        assert_close(g, w, dtype, f"{what}: {name}", grad=True, mult=MULT[dtype])
        assert_close(lg, w, dtype, f"{what}: {name} (lse backward)", grad=True, mult=MULT[dtype])


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 9, 7, 2, 32, 32), (1, 12, 12, 1, 64, 64)], ids=shape_id)
def test_brgemm_and_simd_products_agree(shape, dtype):
    """The two choices of products differ in rounding only: the same lse (float32 logits either way, up to the
    products' summation order) and outputs within the 16-bit tolerance of each other."""
    inputs = _inputs(shape, dtype, seed=4)
    scale = shape[4] ** -0.5
    go = torch.randn(shape[:4] + (shape[5],), generator=torch.Generator().manual_seed(2)).to(dtype)
    res = {}
    for products in PRODUCTS:
        with config.internal_option("cpu_lowp_products", products):
            res[products] = _run_all(inputs, scale, go)
    a, b = res[1], res[2]
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=2e-2)  # lse: logits of 16-bit q, k in float32 either way
    assert_close(b[0], a[0], dtype, "out")
    assert_close(b[4], a[4], dtype, "inference out")
    for g1, g2 in zip(a[3], b[3]):
        assert_close(g2, g1, dtype, "gradient", grad=True)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("products", sorted(PRODUCTS), ids=PRODUCTS.get)
@pytest.mark.parametrize("shape", [(2, 9, 13, 2, 32, 16), (1, 7, 9, 1, 64, 16)], ids=shape_id)
def test_thread_count_invariant(shape, products, dtype):
    """Bitwise the same results for 1, 2 and 3 threads and across runs (each task owns its outputs and partial
    sums; the products run inside the tasks). Shapes: B * heads = 4 (batch, head) pairs of two query tiles each,
    and a single task (one tile of one pair: the products then run outside a parallel region)."""
    inputs = _inputs(shape, dtype, seed=7)
    go = torch.randn(shape[:4] + (shape[5],), generator=torch.Generator().manual_seed(8)).to(dtype)
    n = torch.get_num_threads()
    runs = []
    try:
        with config.internal_option("cpu_lowp_products", products):
            for threads in (1, 2, 3, 2):
                torch.set_num_threads(threads)
                out, out_v2h, lse, grads, inf, lse_grads = _run_all(inputs, 0.3, go)
                runs.append([out, out_v2h, lse, *grads, inf, *lse_grads])
    finally:
        torch.set_num_threads(n)
    for r in runs[1:]:
        for x, y in zip(r, runs[0]):
            assert torch.equal(x, y)


@needs_ext
def test_autocast_bf16_train_step_on_brgemm_products():
    """A training step of the tiny PPMA-T under ``torch.autocast("cpu", torch.bfloat16)`` on torch's batch-reduce
    GEMM products: finite gradients close to the float32 step's (the model's bf16 rounding everywhere bounds how
    close), and the same as the step on ppma's own products within bf16 rounding."""
    import ppma

    torch.manual_seed(0)
    # every stage polyline attention (mixer "full"), small widths: the stages' maps are 16x16 down to 2x2 at 64x64
    model = ppma.create_model("ppma_tiny", num_classes=10, mixer="full", embed_dims=(32, 64, 96, 128),
                              depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([1, 3])

    def step(amp: bool, products: int):
        model.zero_grad(set_to_none=True)
        with config.internal_option("cpu_lowp_products", products), torch.autocast("cpu", torch.bfloat16,
                                                                                   enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    loss32, g32 = step(False, 0)
    lossb, gb = step(True, 2)
    losss, gs = step(True, 1)
    assert torch.isfinite(gb).all() and torch.isfinite(lossb)
    assert abs(lossb.item() - loss32.item()) < 0.05 * max(1.0, abs(loss32.item()))
    cos = torch.nn.functional.cosine_similarity(gb.double(), g32.double(), dim=0).item()
    assert cos > 0.98, f"bf16 (batch-reduce GEMM) vs float32 gradients: cosine {cos:.4f}"
    cos_s = torch.nn.functional.cosine_similarity(gb.double(), gs.double(), dim=0).item()
    assert cos_s > 0.99, f"bf16 batch-reduce GEMM vs SIMD products: cosine {cos_s:.4f}"
