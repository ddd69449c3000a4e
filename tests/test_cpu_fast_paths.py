"""The model's CPU paths (docs/design.md §2.9): the identity folded into the residual
depthwise convolutions, bf16 autocast reaching the fused ops with fp32 log-decays, the logits under bf16 autocast,
Inductor compiling the whole (unfused) model with static shapes and no graph break, and the deployment step
``ppma.nn.fuse_for_inference``: its fused ops, its numbers against the plain modules, idempotence, the errors of a
fused model used outside CPU inference, its state_dict."""

from __future__ import annotations

import copy

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
@pytest.mark.parametrize("mixer", [("criss_cross", "criss_cross", "full", "full")])
@pytest.mark.parametrize("fused", [False, True])
def test_bf16_autocast_reaches_ops_and_logits_close(mixer, fused):
    """Under ``torch.autocast("cpu", bfloat16)`` the attention ops receive bf16 q, k, v and fp32 log-decays,
    and the logits of a small PPMA stay within 2e-2 (relative norm) of fp32, unfused and fused."""
    model = small_model(mixer=mixer).eval()
    if fused:
        ppma.nn.fuse_for_inference(model)
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


FUSED_OPS = ("mkldnn::_linear_pointwise", "mkldnn::_convolution_pointwise", "mkldnn::_convolution_pointwise_",
             "ppma::depthwise_conv2d_residual_", "ppma::rope_", "ppma::layer_norm", "ppma::add_layer_norm_")


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
@pytest.mark.parametrize("amp", [False, True])
def test_fused_model_runs_the_fused_ops_plain_model_none(amp):
    """After ``fuse_for_inference`` CPU inference runs oneDNN's fused linear and convolution ops and ppma's in-place
    kernels (fp32, and bf16 under autocast); the unfused model runs none of them (with the reference ops its
    inference logits equal the training graph's bit for bit). The logits agree up to rounding."""
    model = small_model(mixer=("criss_cross", "criss_cross", "full", "full")).eval()
    plain = small_model(mixer=("criss_cross", "criss_cross", "full", "full")).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y_plain, names = _op_names(plain, x)
        assert not any(n.startswith("mkldnn::") or n in FUSED_OPS for n in names), sorted(
            n for n in names if n.startswith(("mkldnn::", "ppma::")))
        assert ppma.nn.fuse_for_inference(model) is model and ppma.nn.is_fused(model)
        assert not ppma.nn.is_fused(plain)
        y_fused, names = _op_names(model, x)
        assert set(FUSED_OPS) <= names, sorted(set(FUSED_OPS) - names)  # bf16 maps too (layer norms included)
    tol = 2e-2 if amp else 1e-4
    torch.testing.assert_close(y_fused.float(), y_plain.float(), rtol=tol, atol=tol)
    if not amp:
        with ppma.ops.use_impl("reference"):
            with torch.inference_mode():
                y_ref = plain(x)
            y_graph = plain(x)  # gradients recorded: the training graph's modules
        assert torch.equal(y_ref, y_graph.detach())


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
def test_fused_bf16_weights_cast_once_and_follow_writes():
    """Under bf16 autocast a fused model rounds each weight to bf16 once and reuses it (no fp32 -> bf16 copy of a
    weight per call); the copy is made again after load_state_dict and after an in-place write to the weight, so
    the logits always equal those of a model fused with the new weights."""
    from ppma.nn.layers import _param_as

    model = ppma.nn.fuse_for_inference(small_model().eval())
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))

    def run(m):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    y0 = run(model)
    lin = model.stages[0].blocks[0].attn.q
    w16 = _param_as(lin.weight, torch.bfloat16)
    assert w16 is _param_as(lin.weight, torch.bfloat16) and torch.equal(w16, lin.weight.to(torch.bfloat16))
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        run(model)
    casts = {tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::_to_copy"}
    fused = (model.stages[0].blocks[0].attn.q, model.stages[0].blocks[0].mlp.fc1, model.stages[-1].blocks[0].mlp.fc2)
    weights = {tuple(m.weight.shape) for m in fused}
    assert casts and not casts & weights, (casts, weights)  # maps still convert, the fused linears' weights do not
    fresh = small_model().eval()
    for p in fresh.parameters():
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    model.load_state_dict(fresh.state_dict())
    want = run(ppma.nn.fuse_for_inference(copy.deepcopy(fresh)))
    assert torch.equal(run(model), want) and not torch.equal(want, y0)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the version counter moves
        fresh.stages[0].blocks[0].attn.q.weight.mul_(2.0)
    assert torch.equal(run(model), run(ppma.nn.fuse_for_inference(copy.deepcopy(fresh))))
    assert torch.equal(_param_as(lin.weight, torch.bfloat16), lin.weight.to(torch.bfloat16))


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
def test_fused_bf16_weights_packed_same_bits(monkeypatch):
    """Under bf16 autocast a fused model's linear layers and its stem's and patch mergings' convolutions get their
    bf16 weights reordered once into oneDNN's blocked layout (``ppma.nn.layers._packed``, for the first call's
    shapes): the logits are the bits of the plain bf16 weights', for that batch and for other input sizes."""
    import ppma.nn.layers as layers

    packed_model = ppma.nn.fuse_for_inference(small_model().eval())
    plain_model = copy.deepcopy(packed_model)  # its own weights, so its own held copies

    def run(m, x):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    xs = [torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(b)) for b, s in ((2, 64), (3, 64), (1, 96))]
    packed = [run(packed_model, x) for x in xs]
    key = (torch.bfloat16, layers.bf16_products_widened(), True)
    lin = packed_model.stages[0].blocks[0].attn.q.weight
    convs = [m.folded_weight for m in packed_model.modules() if hasattr(m, "folded_weight")]
    assert convs and all(layers._CASTS[w][key][2].is_mkldnn for w in (lin, *convs))  # what the layers ran
    monkeypatch.setattr(layers, "_packed", lambda w, pack: w)
    plain = [run(plain_model, x) for x in xs]
    assert not layers._CASTS[plain_model.stages[0].blocks[0].attn.q.weight][key][2].is_mkldnn
    assert all(torch.equal(a, b) for a, b in zip(packed, plain))


class _OpDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op name, dtype of its first tensor argument) of every op run under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.seen.append((func._schema.name, None if first is None else first.dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")
@pytest.mark.parametrize("widened", [False, True], ids=["bf16_kernels", "widened"])
def test_fused_bf16_products_widened(widened, monkeypatch):
    """Fused bf16 autocast inference on a CPU without bf16 instructions (``ppma.nn.layers.bf16_products_widened``,
    forced either way here): the linear layers and convolutions run oneDNN's float32 kernels on the bf16-rounded
    input and weight, the output rounded to bf16 once, which is what the bf16 kernels compute up to the order of the
    float32 sums: a linear layer within one bf16 rounding of the float64 product of the rounded values; the logits
    as close to the bf16 kernels' as bf16 allows; without widening the bf16 kernels run."""
    from ppma.nn import layers

    monkeypatch.setattr(layers, "_WIDENED", widened)
    assert layers.bf16_products_widened() is widened
    lin = torch.nn.Linear(40, 24).eval()
    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        y = layers._fused_linear(x, lin, torch.bfloat16, gelu=True)
    exact = torch.nn.functional.gelu(x.double() @ lin.weight.bfloat16().double().t() + lin.bias.double())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-6)  # one bf16 rounding (and float32 sums)
    model = ppma.nn.fuse_for_inference(small_model(mixer=("criss_cross", "criss_cross", "full", "full")).eval())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), _OpDtypes() as mode:
        out = model(x)
    onednn = {(n, dt) for n, dt in mode.seen if n.startswith("mkldnn::_")}
    want = torch.float32 if widened else torch.bfloat16
    assert {n for n, _ in onednn} >= {"mkldnn::_linear_pointwise", "mkldnn::_convolution_pointwise"}
    for name in ("mkldnn::_linear_pointwise", "mkldnn::_convolution_pointwise"):
        assert {dt for n, dt in onednn if n == name} == {want}, onednn
    assert out.dtype == torch.bfloat16
    monkeypatch.setattr(layers, "_WIDENED", not widened)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        other = model(x)
    torch.testing.assert_close(out.float(), other.float(), rtol=2e-2, atol=2e-2)


def test_fuse_is_idempotent_and_keeps_the_state_dict():
    """A second ``fuse_for_inference`` changes no output bit; the state_dict keeps its keys and values and loads
    into an unfused model, which then gives the unfused logits; loading weights into a fused model folds them
    again (the logits of a model fused after loading them)."""
    model = small_model().eval()
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 3, 48, 40, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y_plain = model(x)
    ppma.nn.fuse_for_inference(model)
    with torch.no_grad():
        y1 = model(x)
        ppma.nn.fuse_for_inference(model)
        y2 = model(x)
    assert torch.equal(y1, y2)
    torch.testing.assert_close(y1, y_plain, rtol=1e-4, atol=1e-5)
    sd = model.state_dict()
    assert list(sd) == list(sd0) and all(torch.equal(sd[k], sd0[k]) for k in sd)
    fresh = small_model().eval()
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), y_plain)
    # other weights (BatchNorm statistics included) loaded into the fused model: folded again
    other = small_model().eval()
    with torch.no_grad():
        for name, t in other.state_dict().items():
            if t.is_floating_point():
                t.mul_(1.1).add_(0.01)
        want = ppma.nn.fuse_for_inference(small_model().eval())
        want.load_state_dict(other.state_dict())
        ppma.nn.fuse_for_inference(want)
        model.load_state_dict(other.state_dict())
        assert torch.equal(model(x), want(x))


def test_fused_model_raises_outside_cpu_inference():
    """A fused model raises a clear error (never falls back) in training mode, on an input that records a gradient,
    under fp16 autocast, on another device, and when traced; the step refuses a model that is not float32."""
    import torch.fx

    from ppma.nn.layers import FUSED_FOR_INFERENCE

    model = ppma.nn.fuse_for_inference(small_model())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (1, 10)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert model(x).grad_fn is None  # grad mode on, nothing requires grad: inference
    with pytest.raises(RuntimeError, match="training mode") as e:
        model.train()(x)
    assert FUSED_FOR_INFERENCE in str(e.value)
    model.eval()
    with pytest.raises(RuntimeError, match="requires grad"):
        model(x.clone().requires_grad_())
    with pytest.raises(RuntimeError, match=FUSED_FOR_INFERENCE), torch.no_grad(), \
            torch.autocast("cpu", dtype=torch.float16):
        model(x)
    with pytest.raises(RuntimeError, match="on meta"), torch.no_grad():
        model.to("meta")(x.to("meta"))
    with pytest.raises(RuntimeError, match="traced or compiled"):
        torch.fx.symbolic_trace(ppma.nn.fuse_for_inference(small_model()))
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        ppma.nn.fuse_for_inference(small_model().double())


def test_fuse_inside_another_module_and_unfusable_pieces():
    """The step fuses the ppma modules inside any module (here an ``nn.Sequential`` around the model) and leaves
    a module whose pieces were replaced unfused: it runs its plain torch calls, the rest stays fused."""
    model = small_model().eval()
    model.stages[0].blocks[0].mlp.act = torch.nn.GELU(approximate="tanh")
    wrapper = torch.nn.Sequential(model)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        want = wrapper(x)
    ppma.nn.fuse_for_inference(wrapper)
    assert not model.stages[0].blocks[0].mlp.fused and model.stages[0].blocks[0].attn.fused
    assert model.stem.fused and model.stages[1].blocks[0].mlp.fused
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x), want, rtol=1e-4, atol=1e-5)
