"""bf16 / fp16 ``polyline_attention`` and ``criss_cross_attention`` on the CPU with each choice of products
(docs/performance.md "bf16 and fp16 on the CPU"): ppma's own SIMD products (internal option ``cpu_lowp_products=1``),
torch's CPU batch-reduce GEMM on plain operands (``=2``), its micro-kernel on VNNI-packed operands (``=3``, the default
on CPUs with AMX; only where oneDNN generates it), the same packing with the micro-kernel emulated (``=4``) and ppma's
SIMD products with AVX-512 BF16's dot products emulated (``=5``: the bf16 kernels of CPUs with AVX-512 BF16, on the
avx512 path of any CPU), each forced here so that every route this machine can run runs. polyline_attention: the
training op (out, out_v2h, lse), the inference op and the five gradients (of both
backward ops) against the float64 reference within the 16-bit tolerance, over narrow and wide maps, odd sizes, head
dims 16 / 32 / 64 and several heads. criss_cross_attention: out and the five gradients against the float64 reference
over single rows and columns, odd and unequal H and W, lines past 32 tokens, head dims 16 / 32 / 33 / 64, value dims
unlike the key dims and several heads; its groups of (batch, head) pairs and its row maps recomputed where they are
not kept. For both: bitwise the same for 1, 2 and 3 threads; and a bf16-autocast training step of a tiny PPMA-T on
those products. On the default SIMD path of the machine; ``PPMA_CPU_CAPABILITY=avx2`` / ``default`` in the environment
run the same tests on the narrower paths."""

from __future__ import annotations

import pytest
import torch

from op_utils import assert_close, make_attention_inputs, needs_ext, shape_id
from ppma import backends, config
from ppma.ops.reference import criss_cross_attention_ref, polyline_attention_ref

# option value -> route, as ppma.backends.cpu_lowp_route reports it (5: ppma's SIMD products with AVX-512 BF16's dot
# products emulated, on the avx512 path), and the name in the test ids
PRODUCTS = {1: "simd", 2: "brgemm", 3: "brgemm_vnni", 4: "brgemm_vnni_emulated", 5: "simd"}
IDS = {**PRODUCTS, 5: "simd_bf16_dot_emulated"}
DTYPES = [torch.bfloat16, torch.float16]
# every route with each dtype, but 5 (the emulated bf16 dot products) with bf16 only: fp16 inputs take route 1 there
ROUTES_AND_DTYPES = [pytest.param(p, dt, id=f"{IDS[p]}-{dt}") for p in sorted(PRODUCTS) for dt in DTYPES
                     if p != 5 or dt == torch.bfloat16]
# Tighter than the table's 16-bit tolerance (2e-2): the float32 result rounded to bf16 is ~1.7e-3 off the float64
# one, to fp16 ~2e-4; either choice of products stays within about twice that (measured: polyline_attention
# <= 2.5e-3 and 3e-4, criss_cross_attention <= 3.2e-3 and 4e-4, forward and gradients).
MULT = {torch.bfloat16: 0.25, torch.float16: 0.05}

# (B, H, W, heads, d, dv): a wide single row, a single column, odd sizes (d = 33, dv = 7), more than one query tile
# per (batch, head) (N = 65, 144), head dims 16, 32 and 64, one to four heads; W = 40, wider than the backward's
# regrouped prefix-sum gradients take (W <= 32 on the avx512 path: per-key-row sums instead).
SHAPES = [(1, 1, 23, 2, 16, 8), (1, 11, 1, 2, 32, 16), (1, 3, 17, 2, 16, 16), (2, 9, 7, 2, 32, 32),
          (1, 8, 9, 4, 33, 7), (1, 13, 5, 3, 64, 64), (1, 12, 12, 1, 64, 64), (1, 3, 40, 2, 16, 16)]


def _need_route(products, dtype):
    """Skips where ``products`` is the VNNI micro-kernel route (3) and oneDNN does not generate it for ``dtype`` here
    (it needs AMX, or AVX-512 BF16 for bf16): what the probe of ``ppma.backends.cpu_lowp_vnni_available`` says."""
    if products == 3 and not backends.cpu_lowp_vnni_available(dtype):
        pytest.skip(f"torch's VNNI-packed batch-reduce micro-kernel does not run {dtype} here")
    if products == 5 and backends.cpu_capability() != "avx512":
        pytest.skip("the emulated bf16 dot products run on the avx512 path only")


def _routes(dtype):
    """The routes besides ppma's SIMD products that run here for ``dtype``, and the SIMD products with the bf16 dot
    products emulated (5) where they run (bf16 on the avx512 path)."""
    return [p for p in (2, 3, 4) if p != 3 or backends.cpu_lowp_vnni_available(dtype)] + (
        [5] if dtype == torch.bfloat16 and backends.cpu_capability() == "avx512" else [])


def _inputs(shape, dtype, seed=0):
    return make_attention_inputs(shape, dtype, requires_grad=False, decay_scale=1.0, seed=seed)


def _reference(inputs, scale, go=None, ref=polyline_attention_ref):
    """The float64 reference ``ref`` on the 16-bit inputs' values: the output, and with ``go`` the five gradients."""
    ref_in = [t.detach().double().requires_grad_(go is not None) for t in inputs]
    out = ref(*ref_in, scale)
    if go is None:
        return out.detach(), None
    return out.detach(), torch.autograd.grad(out, ref_in, go.double())


def _run_all(inputs, scale, go):
    """The training op's out, out_v2h, lse; the five gradients of its backward; the inference op's output; the
    gradients of polyline_attention_lse_backward (the rows' D terms from the maps) on the statistics of
    polyline_attention_lse (what the public op runs in training), and that op's out and lse."""
    out, out_v2h, lse = torch.ops.ppma.polyline_attention(*inputs, scale)
    grads = torch.ops.ppma.polyline_attention_backward(go, *inputs, out, out_v2h, lse, scale)
    inf = torch.ops.ppma.polyline_attention_inference(*inputs, scale)
    lse_out, lse_only = torch.ops.ppma.polyline_attention_lse(*inputs, scale)
    lse_grads = torch.ops.ppma.polyline_attention_lse_backward(go, *inputs, lse_only, scale)
    return out, out_v2h, lse, grads, inf, lse_grads, lse_out, lse_only


@needs_ext
def test_option_selects_the_products():
    """``cpu_lowp_products``: 0 (default) follows the CPU (where torch packs for AMX: the VNNI micro-kernel, or the
    plain operands should its probe fail; ppma's SIMD products elsewhere), 1 to 4 force each route, for bf16 and fp16
    alike; other dtypes never take them; 3 where the micro-kernel does not run raises at the op's call (no silent
    fallback); out-of-range values raise."""
    assert config.get_internal_option("cpu_lowp_products") == 0
    native = {dt: bool(torch.ops.ppma.cpu_lowp_gemm_native(dt)) for dt in DTYPES}
    for dt in DTYPES:
        assert backends.cpu_lowp_gemm(dt) == native[dt]
        want = ("simd" if not native[dt] else "brgemm_vnni" if backends.cpu_lowp_vnni_available(dt) else "brgemm")
        assert backends.cpu_lowp_route(dt) == want
    with config.internal_option("cpu_lowp_products", 1):
        assert not any(backends.cpu_lowp_gemm(dt) for dt in DTYPES)
        assert "torch's CPU batch-reduce" not in backends.cpu_summary()
    for products in (2, 4):
        with config.internal_option("cpu_lowp_products", products):
            assert all(backends.cpu_lowp_gemm(dt) for dt in DTYPES)
            assert all(backends.cpu_lowp_route(dt) == PRODUCTS[products] for dt in DTYPES)
            assert not backends.cpu_lowp_gemm(torch.float32) and not backends.cpu_lowp_gemm(torch.float64)
            assert backends.cpu_lowp_route(torch.float32) == "simd"
            assert "torch's CPU batch-reduce" in backends.cpu_summary()
    with config.internal_option("cpu_lowp_products", 3):
        for dt in DTYPES:
            if backends.cpu_lowp_vnni_available(dt):
                assert backends.cpu_lowp_route(dt) == "brgemm_vnni"
            else:
                inputs = _inputs((1, 2, 3, 1, 16, 16), dt)
                with pytest.raises(RuntimeError, match="cpu_lowp_products=3"):
                    torch.ops.ppma.polyline_attention(*inputs, 0.25)
                with pytest.raises(RuntimeError, match="cpu_lowp_products=3"):
                    torch.ops.ppma.criss_cross_attention(*inputs, 0.25)
    with config.internal_option("cpu_lowp_products", 5):
        for dt in DTYPES:
            assert not backends.cpu_lowp_gemm(dt) and backends.cpu_lowp_route(dt) == "simd"
        assert backends.cpu_bf16_dot() == (backends.cpu_capability() == "avx512")
    assert backends.cpu_bf16_dot() == (backends.cpu_capability() == "avx512" and backends.cpu_bf16_dot_supported())
    with pytest.raises(ValueError):
        config.set_internal_option("cpu_lowp_products", 6)
    assert config.get_internal_option("cpu_lowp_products") == 0


@needs_ext
@pytest.mark.parametrize("products, dtype", ROUTES_AND_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(shape, products, dtype):
    """Forward (both ops), lse and gradients (both backward ops) against the float64 reference of the 16-bit
    inputs, within the 16-bit tolerance; out_v2h against the reference's V2H half (lse's exponent reproduces it)."""
    inputs = _inputs(shape, dtype)
    scale = 0.8 * shape[4] ** -0.5
    go = torch.randn(shape[:4] + (shape[5],), generator=torch.Generator().manual_seed(1)).to(dtype)
    _need_route(products, dtype)
    with config.internal_option("cpu_lowp_products", products):
        assert backends.cpu_lowp_gemm(dtype) == (products not in (1, 5))
        assert backends.cpu_lowp_route(dtype) == PRODUCTS[products]
        assert backends.cpu_bf16_dot() or products != 5
        out, out_v2h, lse, grads, inf, lse_grads, lse_out, lse_only = _run_all(inputs, scale, go)
    want, want_grads = _reference(inputs, scale, go)
    what = f"{IDS[products]}, {dtype}"
    assert out.dtype == dtype and inf.dtype == dtype and lse_out.dtype == dtype
    assert lse.dtype == torch.float32 and lse_only.dtype == torch.float32
    assert_close(out, want, dtype, f"{what}: out", mult=MULT[dtype])
    assert_close(inf, want, dtype, f"{what}: inference out", mult=MULT[dtype])
    assert_close(lse_out, want, dtype, f"{what}: polyline_attention_lse out", mult=MULT[dtype])
    # the same float32 logits and softmax sums on either op (up to the order of the sums)
    torch.testing.assert_close(lse_only, lse, rtol=1e-5, atol=1e-5)
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
    for products in [1, *_routes(dtype)]:
        with config.internal_option("cpu_lowp_products", products):
            res[products] = _run_all(inputs, scale, go)
    a = res[1]
    for products in _routes(dtype):
        b, what = res[products], IDS[products]
        torch.testing.assert_close(a[2], b[2], rtol=0, atol=2e-2)  # lse: logits of 16-bit q, k in float32 either way
        assert_close(b[0], a[0], dtype, f"{what}: out")
        assert_close(b[4], a[4], dtype, f"{what}: inference out")
        for g1, g2 in zip(a[3], b[3]):
            assert_close(g2, g1, dtype, f"{what}: gradient", grad=True)


@needs_ext
@pytest.mark.parametrize("products, dtype", ROUTES_AND_DTYPES)
@pytest.mark.parametrize("shape", [(2, 9, 13, 2, 32, 16), (1, 7, 9, 1, 64, 16)], ids=shape_id)
def test_thread_count_invariant(shape, products, dtype):
    """Bitwise the same results for 1, 2 and 3 threads and across runs (each task owns its outputs and partial
    sums; the products run inside the tasks). Shapes: B * heads = 4 (batch, head) pairs of two query tiles each,
    and a single task (one tile of one pair: the products then run outside a parallel region)."""
    _need_route(products, dtype)
    inputs = _inputs(shape, dtype, seed=7)
    go = torch.randn(shape[:4] + (shape[5],), generator=torch.Generator().manual_seed(8)).to(dtype)
    n = torch.get_num_threads()
    runs = []
    try:
        with config.internal_option("cpu_lowp_products", products):
            for threads in (1, 2, 3, 2):
                torch.set_num_threads(threads)
                out, out_v2h, lse, grads, inf, lse_grads, lse_out, lse_only = _run_all(inputs, 0.3, go)
                runs.append([out, out_v2h, lse, *grads, inf, *lse_grads, lse_out, lse_only])
    finally:
        torch.set_num_threads(n)
    for r in runs[1:]:
        for x, y in zip(r, runs[0]):
            assert torch.equal(x, y)


@needs_ext
@pytest.mark.parametrize("products", [2, 3, 4], ids=IDS.get)
@pytest.mark.parametrize("mixer", ["full", "criss_cross"])
def test_autocast_bf16_train_step_on_brgemm_products(mixer, products):
    """A training step of the tiny PPMA-T under ``torch.autocast("cpu", torch.bfloat16)`` on torch's batch-reduce
    GEMM products (each route), every stage polyline_attention (``mixer="full"``) or criss_cross_attention: finite
    gradients close to the float32 step's (the model's bf16 rounding everywhere bounds how close), and the same as the
    step on ppma's own products within bf16 rounding, but not bitwise (the forced products ran)."""
    _need_route(products, torch.bfloat16)
    import ppma

    torch.manual_seed(0)
    # small widths: the stages' maps are 16x16 down to 2x2 at 64x64
    model = ppma.create_model("ppma_tiny", num_classes=10, mixer=mixer, embed_dims=(32, 64, 96, 128),
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
    lossb, gb = step(True, products)
    losss, gs = step(True, 1)
    assert torch.isfinite(gb).all() and torch.isfinite(lossb)
    assert abs(lossb.item() - loss32.item()) < 0.05 * max(1.0, abs(loss32.item()))
    cos = torch.nn.functional.cosine_similarity(gb.double(), g32.double(), dim=0).item()
    assert cos > 0.98, f"bf16 (batch-reduce GEMM) vs float32 gradients: cosine {cos:.4f}"
    cos_s = torch.nn.functional.cosine_similarity(gb.double(), gs.double(), dim=0).item()
    assert cos_s > 0.99, f"bf16 batch-reduce GEMM vs SIMD products: cosine {cos_s:.4f}"
    assert not torch.equal(gb, gs)


# ------------------------------------------------------------------------------------------------
# criss_cross_attention
# ------------------------------------------------------------------------------------------------

# (B, H, W, heads, d, dv): one token, a single row (a single task in the row phases), a single column, odd and unequal
# H and W, head dims 16 / 32 / 64 and an odd one (33) with an odd value dim (7), dv unlike d, one to four heads, and
# lines of 40 tokens.
CC_SHAPES = [(1, 1, 1, 1, 16, 16), (1, 1, 23, 2, 16, 8), (1, 11, 1, 2, 32, 16), (1, 5, 9, 3, 16, 16),
             (2, 9, 7, 2, 32, 32), (1, 8, 9, 4, 33, 7), (1, 13, 5, 3, 64, 64), (1, 12, 12, 1, 64, 24),
             (1, 3, 40, 2, 16, 16)]
GRAD_NAMES = ["dq", "dk", "dv", "dlog_alpha", "dlog_beta"]


def _run_cc(inputs, scale, go):
    """criss_cross_attention's out and lse, and the five gradients of its backward."""
    out, lse = torch.ops.ppma.criss_cross_attention(*inputs, scale)
    grads = torch.ops.ppma.criss_cross_attention_backward(go, *inputs, lse, scale)
    return out, lse, grads


def _grad_out(shape, dtype, seed):
    return torch.randn(shape[:4] + (shape[5],), generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_ext
@pytest.mark.parametrize("products, dtype", ROUTES_AND_DTYPES)
@pytest.mark.parametrize("shape", CC_SHAPES, ids=shape_id)
def test_criss_cross_matches_reference(shape, products, dtype):
    """out and the five gradients against the float64 reference of the 16-bit inputs, within the 16-bit tolerance;
    the dtypes of the op's contract (out, dq, dk, dv in the inputs' dtype; lse and the log-decay gradients float32)."""
    inputs = _inputs(shape, dtype)
    scale = 0.8 * shape[4] ** -0.5
    go = _grad_out(shape, dtype, 1)
    _need_route(products, dtype)
    with config.internal_option("cpu_lowp_products", products):
        assert backends.cpu_lowp_gemm(dtype) == (products not in (1, 5))
        assert backends.cpu_lowp_route(dtype) == PRODUCTS[products]
        assert backends.cpu_bf16_dot() or products != 5
        out, lse, grads = _run_cc(inputs, scale, go)
    want, want_grads = _reference(inputs, scale, go, ref=criss_cross_attention_ref)
    what = f"{IDS[products]}, {dtype}"
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == shape[:4] + (2,)
    assert torch.isfinite(lse).all()
    assert_close(out, want, dtype, f"{what}: out", mult=MULT[dtype])
    for name, g, w in zip(GRAD_NAMES, grads, want_grads):
        assert g.dtype == (dtype if name in ("dq", "dk", "dv") else torch.float32), name
        assert_close(g, w, dtype, f"{what}: {name}", grad=True, mult=MULT[dtype])


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 9, 7, 2, 32, 32), (1, 12, 12, 1, 64, 24)], ids=shape_id)
def test_criss_cross_brgemm_and_simd_products_agree(shape, dtype):
    """The two choices of products differ in rounding only: lse from float32 logits of the same 16-bit q, k (up to
    the products' summation order), outputs and gradients within the 16-bit tolerance of each other."""
    inputs = _inputs(shape, dtype, seed=4)
    go = _grad_out(shape, dtype, 2)
    res = {}
    for products in [1, *_routes(dtype)]:
        with config.internal_option("cpu_lowp_products", products):
            res[products] = _run_cc(inputs, shape[4] ** -0.5, go)
    a = res[1]
    for products in _routes(dtype):
        b, what = res[products], IDS[products]
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-4)
        assert_close(b[0], a[0], dtype, f"{what}: out")
        for g1, g2 in zip(a[2], b[2]):
            assert_close(g2, g1, dtype, f"{what}: gradient", grad=True)


def _cc_threads(inputs, go, products, scale=0.3, threads=(1, 2, 3, 2)):
    """_run_cc's results (flattened) for each thread count."""
    n = torch.get_num_threads()
    runs = []
    try:
        with config.internal_option("cpu_lowp_products", products):
            for t in threads:
                torch.set_num_threads(t)
                out, lse, grads = _run_cc(inputs, scale, go)
                runs.append([out, lse, *grads])
    finally:
        torch.set_num_threads(n)
    return runs


@needs_ext
@pytest.mark.parametrize("products, dtype", ROUTES_AND_DTYPES)
@pytest.mark.parametrize("shape", [(2, 9, 13, 2, 32, 16), (1, 1, 9, 1, 64, 16), (1, 7, 1, 1, 16, 8)], ids=shape_id)
def test_criss_cross_thread_count_invariant(shape, products, dtype):
    """Bitwise the same results for 1, 2 and 3 threads and across runs (each line is a task writing its own outputs;
    the products run inside the tasks). Shapes: 4 (batch, head) pairs of several lines each; a single row and a single
    column (the row or the column phase is a single task; on the plain route a bf16 GEMM library called outside an
    active parallel region splits a product over the threads, which changed a gradient's last bit between 1 and 2
    threads on an AVX512-BF16 CPU until parallel_tasks ran single tasks inside one)."""
    _need_route(products, dtype)
    runs = _cc_threads(_inputs(shape, dtype, seed=7), _grad_out(shape, dtype, 8), products)
    for r in runs[1:]:
        for x, y in zip(r, runs[0]):
            assert torch.equal(x, y)


@needs_ext
@pytest.mark.parametrize("products, dtype", [pytest.param(p, dt, id=f"{IDS[p]}-{dt}") for p in (2, 3, 4)
                                             for dt in DTYPES]
                         + [pytest.param(p, torch.bfloat16, id=f"{IDS[p]}-bf16") for p in (1, 5)])
def test_criss_cross_groups_and_recomputed_maps(products, dtype):
    """On the batch-reduce GEMM and on ppma's SIMD products of bf16 (the forward's bf16 dot products, native or
    emulated; the backward on the widened values): the phases
    run per group of (batch, head) pairs whose row maps fit 2 MiB (64 x 64 maps: 4 pairs a group in the forward, 2 in
    the backward, whose maps are float32; 6 pairs make full and partial groups), and a pair's results do not depend
    on which pairs share its group; lines too long to keep (104 x 104: one pair's maps > 2 MiB) are recomputed from
    their statistics (forward) or from lse (backward), within the tolerance of the reference and the same for any
    thread count."""
    _need_route(products, dtype)
    shape = (3, 64, 64, 2, 8, 8)
    inputs, go = _inputs(shape, dtype, seed=2), _grad_out(shape, dtype, 3)
    with config.internal_option("cpu_lowp_products", products):
        out, lse, grads = _run_cc(inputs, 0.4, go)
        for b in range(3):
            for g in range(2):
                part = lambda t: t[b:b + 1, :, :, g:g + 1]  # noqa: E731
                o1, l1, g1 = _run_cc([part(t) for t in inputs], 0.4, part(go))
                for x, y in zip([o1, l1, *g1], [out, lse, *grads]):
                    assert torch.equal(x, part(y)), (b, g)
    shape = (1, 104, 104, 1, 4, 4)
    inputs, go = _inputs(shape, dtype, seed=3), _grad_out(shape, dtype, 4)
    runs = _cc_threads(inputs, go, products, scale=0.4, threads=(1, 2, 3))
    for r in runs[1:]:
        for x, y in zip(r, runs[0]):
            assert torch.equal(x, y)
    want, want_grads = _reference(inputs, 0.4, go, ref=criss_cross_attention_ref)
    assert_close(runs[0][0], want, dtype, "out", mult=MULT[dtype])
    for name, g, w in zip(GRAD_NAMES, runs[0][2:], want_grads):
        assert_close(g, w, dtype, name, grad=True, mult=MULT[dtype])
