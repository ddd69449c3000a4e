"""timm's model contract on ppma_tiny/small/base, the checks of timm's own model test suite that need no download:
the pretrained config agrees with ``forward_features`` / ``forward_head`` (``pool_size``, ``num_features``,
``head_hidden_size``), ``reset_classifier(0)`` and ``reset_classifier(0, "")`` (pooled pre-logits, unpooled map),
``features_only``, ``forward_intermediates``, gradient checkpointing, and FX feature extraction (forward equal to
the eager model, backward reaching every parameter).

Most checks run on ppma_tiny with narrow stages at small inputs; the default-config check runs PPMA-T itself at
its configured 224² (``PPMA_TEST_FULL=1`` adds PPMA-S and PPMA-B).
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import ppma.models  # noqa: F401  (registers the models with timm)
from ppma.models import TIMM_REGISTERED

if not TIMM_REGISTERED:
    pytest.skip("timm is not installed", allow_module_level=True)

import timm  # noqa: E402
from timm.models import FeatureInfo  # noqa: E402

FULL = os.environ.get("PPMA_TEST_FULL", "0") == "1"
warnings.filterwarnings("ignore", message="ppma._C is not available")

# ppma_tiny with narrow stages: every code path, a fraction of the cost
SMALL_KW = dict(embed_dims=(16, 32, 48, 64), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4), head_hidden_dim=40)
NAMES = ["ppma_tiny"] + (["ppma_small", "ppma_base"] if FULL else [])


def _fx_tracer_kwargs() -> dict:
    """The tracer settings of timm's FX feature extraction: its registered leaf modules and wrapped functions."""
    from timm.models._features_fx import get_notrace_functions, get_notrace_modules

    return dict(leaf_modules=list(get_notrace_modules()), autowrap_functions=list(get_notrace_functions()),
                param_shapes_constant=True)


def _fx_model(model: torch.nn.Module, train: bool):
    """A torchvision feature extractor returning the model's output node (the last node of the traced graph)."""
    fe = pytest.importorskip("torchvision.models.feature_extraction")
    kw = _fx_tracer_kwargs()
    train_nodes, eval_nodes = fe.get_graph_node_names(model, tracer_kwargs=kw)
    return fe.create_feature_extractor(model, train_return_nodes=[train_nodes[-1]],
                                       eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=kw).train(train)


@pytest.mark.parametrize("name", NAMES)
def test_default_cfg_agrees_with_forward(name):
    """At the configured input size: ``forward_features`` is the unpooled ``[B, num_features, *pool_size]``,
    ``forward_head(pre_logits=True)`` is ``[B, head_hidden_size]``; without a classifier ``forward`` returns the
    pooled pre-logits, and without pooling (``reset_classifier(0, "")`` or ``global_pool=""`` at creation) the
    unpooled ``pool_size`` map; ``classifier`` and ``first_conv`` name parameters."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    cfg = model.pretrained_cfg
    assert model.num_classes == cfg["num_classes"] == 1000
    assert model.num_features == model.cfg.embed_dims[-1] > 0 and model.head_hidden_size == 1024
    x = torch.randn(1, *cfg["input_size"])
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert feats.shape == (1, model.num_features, *cfg["pool_size"])
        assert pre.shape == (1, model.head_hidden_size)
        torch.testing.assert_close(model.forward_head(feats), model(x))

        model.reset_classifier(0)
        assert model.num_classes == 0
        pooled = model(x)
        assert pooled.shape == pre.shape
        torch.testing.assert_close(pooled, pre)

        model.reset_classifier(0, "")
        unpooled = model(x)
        assert unpooled.shape == (1, model.head_hidden_size, *cfg["pool_size"])
        torch.testing.assert_close(unpooled.mean((2, 3)), pre)  # the pooling is all that was removed
        model.reset_classifier(0, "avg")
        torch.testing.assert_close(model(x), pre)

        again = timm.create_model(name, pretrained=False, num_classes=0, global_pool="").eval()
        assert again(x).shape == (1, again.head_hidden_size, *cfg["pool_size"])
    state = model.state_dict()
    assert cfg["classifier"] + ".weight" in timm.create_model(name, pretrained=False).state_dict()
    assert cfg["first_conv"] + ".weight" in state


def test_reset_classifier_errors():
    model = timm.create_model("ppma_tiny", **SMALL_KW)
    with pytest.raises(ValueError, match="global_pool must be 'avg' or ''"):
        model.reset_classifier(0, "max")
    with pytest.raises(ValueError, match="needs num_classes=0"):
        model.reset_classifier(10, "")
    with pytest.raises(ValueError, match="needs num_classes=0"):
        timm.create_model("ppma_tiny", global_pool="", **SMALL_KW)
    model.reset_classifier(7)
    assert model.num_classes == model.cfg.num_classes == 7 and model.get_classifier().out_features == 7


def test_backward_reaches_every_parameter():
    """timm's backward check: a new 42-class head, a training step, a gradient for every parameter."""
    model = timm.create_model("ppma_tiny", num_classes=42, **SMALL_KW).train()
    out = model(torch.randn(2, 3, 64, 64))
    out.mean().backward()
    assert out.shape == (2, 42) and not out.isnan().any()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_grad_checkpointing_keeps_the_output():
    torch.manual_seed(0)
    model = timm.create_model("ppma_tiny", **SMALL_KW).eval()
    x = torch.randn(1, 3, 64, 64)
    out = model(x)
    final, _ = model.forward_intermediates(x)
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.forward_intermediates(x)[0], final, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("feature_cls", ["getter", "fx"])
def test_features_only(feature_cls):
    """``features_only``: one map per stage, channels and reductions as ``feature_info`` says (stride 4..32);
    the default ("getter", through ``forward_intermediates``) returns NCHW maps, FX extraction the stage outputs
    as they are (NHWC: a PPMA stage works channels-last)."""
    model = timm.create_model("ppma_tiny", features_only=True, feature_cls=feature_cls, **SMALL_KW).eval()
    channels, reductions = model.feature_info.channels(), model.feature_info.reduction()
    assert channels == list(SMALL_KW["embed_dims"]) and reductions == [4, 8, 16, 32]
    size = (72, 88)
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *size))
    assert len(outs) == 4
    for c, r, o in zip(channels, reductions, outs):
        if feature_cls == "fx":
            o = o.permute(0, 3, 1, 2)
        assert o.shape == (1, c, math.ceil(size[0] / r), math.ceil(size[1] / r)) and not o.isnan().any()


def test_forward_intermediates():
    """``forward_intermediates``: stage maps with ``feature_info``'s channels and reductions, the final output
    equal to ``forward_features``, ``indices`` / ``intermediates_only`` / NHWC, and pruning to the last stage
    kept."""
    torch.manual_seed(0)
    model = timm.create_model("ppma_tiny", **SMALL_KW).eval()
    info = FeatureInfo(model.feature_info, len(model.feature_info))
    size = (64, 80)
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, output_fmt="NCHW")
        assert len(inter) == len(info.channels()) == 4
        for c, r, o in zip(info.channels(), info.reduction(), inter):
            assert o.shape == (1, c, math.ceil(size[0] / r), math.ceil(size[1] / r))
        torch.testing.assert_close(final, model.forward_features(x))
        torch.testing.assert_close(inter[-1], final)
        nhwc = model.forward_intermediates(x, indices=[1, -1], output_fmt="NHWC", intermediates_only=True)
        torch.testing.assert_close(nhwc[0], inter[1].permute(0, 2, 3, 1))
        torch.testing.assert_close(nhwc[1], inter[3].permute(0, 2, 3, 1))
        assert model.prune_intermediate_layers(indices=2) == [2, 3]
        torch.testing.assert_close(model.forward_intermediates(x, intermediates_only=True)[2], inter[2])


def test_forward_fx_equals_eager():
    """FX symbolic tracing with timm's leaf modules (the attention, PADRe, RoPE tables, drop path) and the input
    check as one wrapped call: the traced graph gives exactly the eager output."""
    torch.manual_seed(0)
    model = timm.create_model("ppma_tiny", mixer=("criss_cross", "padre", "full", "linear"), **SMALL_KW).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        out = model(x)
        fx_out = torch.cat(tuple(_fx_model(model, train=False)(x).values()))
    assert torch.equal(fx_out, out) and not out.isnan().any()


def test_backward_fx_reaches_every_parameter():
    """The traced training graph (drop path active) back-propagates into every parameter."""
    torch.manual_seed(0)
    model = timm.create_model("ppma_tiny", num_classes=42, drop_path_rate=0.1, **SMALL_KW).train()
    fx = _fx_model(model, train=True)
    out = torch.cat(tuple(fx(torch.randn(2, 3, 64, 64)).values()))
    out.mean().backward()
    assert out.shape[-1] == 42 and not out.isnan().any()
    assert [n for n, p in fx.named_parameters() if p.grad is None] == []
    assert sum(p.numel() for p in fx.parameters()) == sum(p.numel() for p in model.parameters())


def test_fx_traces_the_input_check_as_one_call():
    """The input check is one wrapped call in the traced graph (FX cannot answer its shape tests), and the traced
    graph still rejects a bad input."""
    fe = pytest.importorskip("torchvision.models.feature_extraction")
    from ppma.models.ppma import _check_input

    model = timm.create_model("ppma_tiny", **SMALL_KW).eval()
    graph = fe.NodePathTracer(**_fx_tracer_kwargs()).trace(model)
    assert [n.target for n in graph.nodes if n.op == "call_function"][0] is _check_input
    with pytest.raises(ValueError, match=r"x must be \[B, 3, H, W\]"):
        _fx_model(model, train=False)(torch.randn(1, 1, 32, 32))


# every model ppma registers with timm, and the ones the checks above cover
ALL_REGISTERED = ("ppma_tiny", "ppma_small", "ppma_base")


def _ppma_registered() -> set[str]:
    """The timm model names whose entry point lives in ppma (whatever ppma registers, now or later)."""
    from timm.models import model_entrypoint

    return {n for n in timm.list_models() if model_entrypoint(n).__module__.split(".")[0] == "ppma"}


def test_every_registered_model_is_covered():
    """A model ppma registers with timm meets timm's contract or is not registered there: the registered set is
    the covered one (the video model, ppma_video_tiny, is built by ppma.create_model only; docs/video.md)."""
    assert _ppma_registered() == set(ALL_REGISTERED)


@pytest.mark.parametrize("name", ALL_REGISTERED)
def test_contract_of_every_registered_model(name):
    """Each registered model at its own widths (a small input): pretrained_cfg, num_features and
    head_hidden_size agree with forward_features / forward_head, features_only and forward_intermediates give
    the feature_info channels and reductions."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5).eval()
    cfg = model.pretrained_cfg
    assert cfg["input_size"][0] == 3 and len(cfg["input_size"]) == 3 and len(cfg["pool_size"]) == 2
    assert cfg["classifier"] + ".weight" in model.state_dict() and cfg["first_conv"] + ".weight" in model.state_dict()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (1, model.num_features, 2, 2)
        assert model.forward_head(feats, pre_logits=True).shape == (1, model.head_hidden_size)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats)
        info = model.feature_info
        assert [t.shape[1] for t in inter] == [f["num_chs"] for f in info]
        assert [64 // t.shape[-1] for t in inter] == [f["reduction"] for f in info]
    fo = timm.create_model(name, pretrained=False, features_only=True).eval()
    with torch.no_grad():
        outs = fo(x)
    assert [o.shape[1] for o in outs] == fo.feature_info.channels()
    assert [64 // o.shape[-1] for o in outs] == fo.feature_info.reduction()
