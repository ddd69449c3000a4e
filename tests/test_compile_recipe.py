"""``ppma.compile.compile_model`` (docs/compile.md): the compiled model equals the eager one (fp32 tight; bf16
autocast within 2e-2 of the fp32 logits), inference freezes and packs the weights, training compiles without the
frozen wrapper and gives eager's loss and gradients, the compiled graphs call ppma's CPU kernels for the model's
glue (layer norms, path decays, depthwise convolutions), and the arguments are checked."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import ppma
from op_utils import ops_called
from ppma.compile import FrozenInference, compile_model

pytestmark = pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")

# A small PPMA-T: every stage's mixer (criss-cross, full attention), the stem, patch merging and head.
KW = dict(embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), num_classes=10)


def _model():
    torch.manual_seed(0)
    return ppma.create_model("ppma_tiny", **KW)


def _images(batch=2, size=64):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def test_inference_fp32_equals_eager_and_packs_weights():
    from torch._dynamo.utils import counters
    from torch._inductor import config

    torch._dynamo.reset()
    counters.clear()
    model = _model().eval()
    x = _images()
    fast = compile_model(model)
    assert isinstance(fast, FrozenInference) and fast.module is model
    with torch.inference_mode():
        ref = model(x)
        got = fast(x)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast(_images()), ref, rtol=1e-4, atol=1e-4)  # the cached graph
        called = ops_called(lambda: fast(x))
    # the glue runs ppma's kernels as opaque graph nodes, not Inductor's generated code (docs/compile.md)
    assert {"ppma::layer_norm", "ppma::path_decay", "ppma::rope"} <= called, sorted(called)
    # the blocks' linear layers run oneDNN's linear op with the bias and GELU inside and the FFN's depthwise
    # residual ppma's in-place kernel, as eager's fused modules do (ppma.nn.layers.compiled_onednn_dtype);
    # frozen: Inductor packed the head's weights, and the global switch is back
    assert {"mkldnn::_linear_pointwise", "ppma::depthwise_conv2d_residual_"} <= called, sorted(called)
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0
    assert config.freezing is False


@pytest.mark.full  # one more Inductor compile of the model (minutes on a shared 2-core machine)
def test_inference_bf16_autocast_within_2e2_of_fp32():
    torch._dynamo.reset()
    model = _model().eval()
    x = _images()
    fast = compile_model(model)
    with torch.inference_mode():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager_bf16 = model(x).float()
            got = fast(x).float()
            called = ops_called(lambda: fast(x))
    assert "ppma::depthwise_conv2d_residual_" in called  # the FFN's h + dwconv(h) on ppma's bf16 kernel
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-2)
    torch.testing.assert_close(got, eager_bf16, rtol=0, atol=2e-2)


@pytest.mark.parametrize("widened", [True, False], ids=["widened", "bf16_kernels"])
def test_bf16_inference_of_the_convolutions_and_linears(widened, monkeypatch):
    """Frozen bf16 autocast inference of the stem (its convolutions) and an FFN (its linear layers), with the bf16
    products widened to oneDNN's float32 kernels as on CPUs without bf16 instructions or not
    (``ppma.nn.layers.bf16_products_widened``, forced either way): within bf16 rounding of the eager fused modules
    (which widen the same way) and of the plain modules under autocast."""
    from ppma.nn import layers

    monkeypatch.setattr(layers, "_WIDENED", widened)
    torch._dynamo.reset()
    torch.manual_seed(0)
    stem, ffn = layers.ConvStem(3, 16), layers.ConvFFN(16, 32)
    for bn in (stem.bn1, stem.bn2, stem.bn3, stem.bn4):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    for module, x in ((stem, _images()), (ffn, torch.randn(2, 8, 8, 16, generator=torch.Generator().manual_seed(3)))):
        module.eval()
        fast = compile_model(module)
        fused = ppma.nn.fuse_for_inference(copy.deepcopy(module))
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            got, want, plain = fast(x), fused(x), module(x)
            called = ops_called(lambda: fast(x))
        assert got.dtype == want.dtype == torch.bfloat16
        scale = plain.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(got.float(), plain.float(), rtol=2e-2, atol=2e-2 * scale)
        if module is ffn:
            assert {"mkldnn::_linear_pointwise", "ppma::depthwise_conv2d_residual_"} <= called, sorted(called)


def test_training_equals_eager_and_runs_ppma_kernels():
    """A compiled training step (forward, loss, backward) gives the eager step's loss and gradients, and its graphs
    call ppma's training kernels (path decays, the FFN's GELU + depthwise convolution, the LePE's weight gradient)
    and the block norms as one node each way (``ppma.ops.cpu.layer_norm_node``)."""
    torch._dynamo.reset()
    model = ppma.create_model("ppma_tiny", **KW, drop_path_rate=0.0).train()
    twin = copy.deepcopy(model)
    step = compile_model(twin)
    assert not isinstance(step, FrozenInference)
    x, y = _images(), torch.tensor([1, 7])

    def train_step(m):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach()

    ref = train_step(model)
    train_step(step)  # compiles
    twin.zero_grad(set_to_none=True)
    got = []
    called = ops_called(lambda: got.append(train_step(step)))
    torch.testing.assert_close(got[0], ref, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    want = {"ppma::path_decay", "ppma::path_decay_backward", "ppma::gelu_depthwise_conv2d_residual_forward",
            "ppma::gelu_depthwise_conv2d_residual_backward", "ppma::depthwise_conv2d_backward",
            "ppma::layer_norm_node", "ppma::layer_norm_node_backward"}
    assert want <= called, sorted(want - called)
    assert "mkldnn::_linear_pointwise" not in called  # compiled fp32 inference only: oneDNN's op has no backward


def test_recipe_options(monkeypatch):
    """Inductor's layout optimization is off unless the caller's ``options`` say otherwise (docs/compile.md: it
    took the ``[B, H, W, C]`` maps for NCHW ones); other options pass through."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    compile_model(_model().train())
    compile_model(_model().train(), options={"layout_optimization": True, "max_autotune": True})
    assert seen[0]["options"] == {"layout_optimization": False}
    assert seen[1]["options"] == {"layout_optimization": True, "max_autotune": True}
    assert seen[0]["fullgraph"] is True and seen[0]["dynamic"] is False


def test_arguments_are_checked():
    assert not isinstance(compile_model(_model().train()), FrozenInference)  # lazy: nothing compiles here
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        compile_model(lambda x: x)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        compile_model(_model().train(), inference=True)


def test_frozen_inference_warns_once_with_gradients():
    """A frozen-inference model called with gradients on compiles an unfrozen graph (Inductor freezes only graphs
    traced without them): one warning per model, none under ``torch.no_grad()`` / ``torch.inference_mode()``; the
    freezing switch is back to its previous value after every call."""
    from torch._inductor import config as inductor_config

    seen = []
    fast = FrozenInference(_model().eval(), lambda x: seen.append(inductor_config.freezing) or x)
    x = torch.zeros(1)
    with pytest.warns(UserWarning, match="gradients enabled"):
        fast(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(x)  # once only
        with torch.no_grad():
            fast(x)
        with torch.inference_mode():
            FrozenInference(_model().eval(), lambda t: t)(x)
    assert seen == [True, True, True] and inductor_config.freezing is False
