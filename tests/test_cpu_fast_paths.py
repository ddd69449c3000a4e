"""The model-side CPU fast paths (docs/ops.md "rope"; README "CPU speed"): the identity folded into the
residual depthwise convolutions, bf16 autocast reaching the fused ops with fp32 log-decays, the logits under
bf16 autocast, Inductor compiling the whole model with static shapes and no graph break, and the switch that
turns the inference fast paths off (``ppma.nn.set_inference_fast_paths``)."""

from __future__ import annotations

import pytest
import torch

import ppma
from ppma.nn.layers import DWConv2d

TINY_KW = dict(embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4), num_classes=10)


def small_model(**kw):
    torch.manual_seed(0)
    return ppma.create_model("ppma_tiny", **{**TINY_KW, **kw})


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
@pytest.mark.parametrize("k", [3, 5])
def test_dwconv_residual_fold_is_x_plus_conv(dtype, tol, k):
    """``DWConv2d(x, residual=True)`` (identity folded into the centre tap) is ``x + conv(x)``, values and
    gradients of input and parameters."""
    torch.manual_seed(0)
    m = DWConv2d(6, k).to(dtype)
    x = torch.randn(2, 5, 7, 6, dtype=dtype, requires_grad=True)
    y = m(x, residual=True)
    y_ref = x + m(x)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    assert y.is_contiguous()
    gy = torch.randn_like(y)
    g = torch.autograd.grad(y, (x, m.conv.weight, m.conv.bias), gy)
    g_ref = torch.autograd.grad(y_ref, (x, m.conv.weight, m.conv.bias), gy)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_dwconv_residual_under_autocast_adds_after():
    """In bf16 autocast the residual is added after the bf16 convolution (not folded into bf16 weights)."""
    torch.manual_seed(0)
    m = DWConv2d(8, 3)
    x = torch.randn(1, 6, 6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, residual=True)
        conv = m(x)
    assert y.dtype == torch.float32 and conv.dtype == torch.bfloat16
    torch.testing.assert_close(y, x + conv, rtol=0, atol=0)


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
@pytest.mark.parametrize("criss_cross", [(True, True, False, False)])
def test_bf16_autocast_reaches_ops_and_logits_close(criss_cross):
    """Under ``torch.autocast("cpu", bfloat16)`` the attention ops receive bf16 q, k, v and fp32 log-decays,
    and the logits of a small PPMA stay within 2e-2 (relative norm) of fp32."""
    model = small_model(criss_cross=criss_cross).eval()
    seen = []

    def hook(mod, args):
        seen.append(tuple(a.dtype for a in args))

    hooks = [m.register_forward_pre_hook(hook) for n, m in model.named_modules() if n.endswith("attn_op")]
    x = torch.randn(4, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y32 = model(x)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y16 = model(x)
    for h in hooks:
        h.remove()
    assert seen and all(s == (torch.bfloat16,) * 3 + (torch.float32,) * 2 for s in seen), seen
    err = ((y16.float() - y32).norm() / y32.norm()).item()
    assert err < 2e-2, f"bf16 autocast logits: relative error {err:.3e}"


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
@pytest.mark.parametrize("amp", [False, True])
def test_dynamo_whole_model_no_graph_break(amp):
    """Dynamo traces the whole inference model (fused ops, RoPE, folded residual convs) in one graph, in fp32
    and under bf16 autocast: ``torch._dynamo.explain`` reports no graph break."""
    import torch._dynamo

    torch._dynamo.reset()
    model = small_model(depths=(1, 1, 1, 1)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()


@pytest.mark.slow  # about 4 minutes on 2 busy cores: PPMA_TEST_FULL=1
@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
def test_inductor_static_fullgraph():
    """Inductor (CPU, static shapes, ``fullgraph=True``) compiles the whole inference model; the compiled
    logits match eager."""
    import torch._dynamo

    torch._dynamo.reset()
    model = small_model(depths=(1, 1, 1, 1)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def _op_names(model, x):
    from torch.profiler import profile

    with torch.inference_mode(), profile() as prof:
        y = model(x)
    return y, {e.name for e in prof.events()}


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
def test_inference_fast_paths_switch():
    """On (the default), CPU inference runs oneDNN's fused ops, the in-place FFN and RoPE kernels and ppma's
    LayerNorms; off, the plain modules run, and with the reference ops the logits equal the training graph's bit
    for bit. The context manager restores the previous choice; the logits of the two agree up to rounding."""
    model = small_model(criss_cross=(True, True, False, False)).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    assert ppma.nn.inference_fast_paths_enabled()
    y_fast, names = _op_names(model, x)
    inplace_ops = ("ppma::depthwise_conv2d_residual_", "ppma::rope_", "ppma::layer_norm", "ppma::add_layer_norm_")
    assert {"mkldnn::_linear_pointwise", *inplace_ops} <= names, sorted(names)
    with ppma.nn.use_inference_fast_paths(False):
        assert not ppma.nn.inference_fast_paths_enabled()
        y_plain, names = _op_names(model, x)
        assert not any(n.startswith("mkldnn::") or n in inplace_ops
                       for n in names), sorted(n for n in names if n.startswith(("mkldnn::", "ppma::")))
        with ppma.ops.use_impl("reference"):
            with torch.inference_mode():
                y_ref = model(x)
            y_graph = model(x)  # gradients recorded: the training graph's modules
    assert ppma.nn.inference_fast_paths_enabled()
    assert torch.equal(y_ref, y_graph.detach())
    torch.testing.assert_close(y_fast, y_plain, rtol=1e-4, atol=1e-4)
    ppma.nn.set_inference_fast_paths(False)
    try:
        assert not ppma.nn.inference_fast_paths_enabled()
    finally:
        ppma.nn.set_inference_fast_paths(True)
