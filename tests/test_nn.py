"""ppma.nn modules: path decays (docs/model.md §1.4), rotary embedding (docs/model.md §3.1), attention contract (docs/model.md §3.2)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import ppma.ops

from ppma.nn import PathDecay, PPMAAttention, PPMABlock, RotaryEmbedding2D, apply_rotary, rotate_every_two
from ppma.ops import reference

warnings.filterwarnings("ignore", message="ppma._C is not available")


def test_path_decay_init_and_values():
    torch.manual_seed(0)
    m = PathDecay(64, 8)
    assert m.dt_linear.weight.shape == (2, 8) and m.dt_linear.bias is None
    assert m.dt_bias.shape == m.A_log.shape == (8,)
    dt = F.softplus(m.dt_bias)
    assert torch.all((dt > 1e-3 - 1e-7) & (dt < 0.1 + 1e-7))
    assert torch.all((m.A_log >= 0) & (m.A_log <= math.log(1.1)))
    x = torch.randn(2, 5, 7, 64, dtype=torch.float64)
    m = m.double()
    la, lb = m(x)
    assert la.shape == lb.shape == (2, 5, 7, 8) and la.dtype == torch.float64
    assert torch.all(la < 0) and torch.all(lb < 0)
    # literal formula of docs/model.md §1.4: head g reads channels [g*hd, (g+1)*hd)
    xh = x.view(2, 5, 7, 8, 8)
    u = xh @ m.dt_linear.weight.T
    expect = F.softplus(u + m.dt_bias[:, None]) * -torch.exp(m.A_log)[:, None]
    torch.testing.assert_close(la, expect[..., 0], rtol=1e-12, atol=0)
    torch.testing.assert_close(lb, expect[..., 1], rtol=1e-12, atol=0)
    # same numbers as the shared reference in fp32
    m32 = m.float()
    ref = reference.path_log_decays_ref(x.float(), m32.dt_linear.weight, m32.dt_bias, m32.A_log, 8)
    for a, b in zip(m32(x.float()), ref):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="divisible"):
        PathDecay(10, 4)
    with pytest.raises(ValueError, match=r"\[B, H, W, 64\]"):
        m32(torch.randn(2, 64))


def test_rotary_embedding():
    rope = RotaryEmbedding2D(8)
    assert "angle" in rope.state_dict()
    theta = 1.0 / 10000 ** torch.linspace(0, 1, 4)
    torch.testing.assert_close(rope.angle, theta.repeat_interleave(2))
    sin, cos = rope(3, 5)
    assert sin.shape == cos.shape == (3, 5, 8)
    p = 2 * 5 + 3  # raster index of (2, 3)
    torch.testing.assert_close(sin[2, 3], torch.sin(p * rope.angle))
    x = torch.arange(8.0)
    assert rotate_every_two(x).tolist() == [-1, 0, -3, 2, -5, 4, -7, 6]
    q = torch.randn(1, 3, 5, 2, 8)
    out = apply_rotary(q, sin, cos)
    # pairs are rotated by p * theta_m: norms kept, rotation of (x_{2m}, x_{2m+1})
    torch.testing.assert_close(out.norm(dim=-1), q.norm(dim=-1))
    c, s = math.cos(p * theta[1]), math.sin(p * theta[1])
    x0, x1 = q[0, 2, 3, 1, 2], q[0, 2, 3, 1, 3]
    torch.testing.assert_close(out[0, 2, 3, 1, 2:4], torch.stack([x0 * c - x1 * s, x1 * c + x0 * s]))
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding2D(7)


@pytest.mark.parametrize("mixer", ["full", "criss_cross"])
def test_attention_contract(mixer):
    torch.manual_seed(0)
    attn = PPMAAttention(32, 2, mixer=mixer)
    x = torch.randn(2, 6, 9, 32)
    y = attn(x)
    assert y.shape == x.shape
    rope = RotaryEmbedding2D(16)(6, 9)
    torch.testing.assert_close(attn(x, rope), y)
    with ppma.ops.use_impl("reference"):
        torch.testing.assert_close(attn(x, rope), y, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mixer must be one of"):
        PPMAAttention(32, 2, mixer="chunk")  # the official name is not ours (docs/ops.md, "Glossary")
    with pytest.raises(ValueError, match="mixer must be one of"):
        PPMAAttention(32, 2, mixer="padre")  # a mixer, but not an attention
    with pytest.raises(ValueError, match=r"\[B, H, W, 32\]"):
        attn(torch.randn(2, 6, 9, 16))


@pytest.mark.parametrize("mixer", ["full", "criss_cross"])
def test_attention_matches_literal_formula(mixer):
    """q/k/v projections, LePE on v, k scaled by d^-0.5 before RoPE, out = proj(attn + lepe) (docs/model.md §3.2)."""
    torch.manual_seed(0)
    attn = PPMAAttention(16, 2, mixer=mixer).double()
    with torch.no_grad():
        attn.decay.A_log.uniform_(-1, 1)
    x = torch.randn(1, 4, 5, 16, dtype=torch.float64)
    sin, cos = RotaryEmbedding2D(8).double()(4, 5)
    q, k, v = attn.q(x), attn.k(x), attn.v(x)
    lepe = F.conv2d(v.permute(0, 3, 1, 2), attn.lepe.conv.weight, attn.lepe.conv.bias, padding=2, groups=16)
    k = k * 8**-0.5
    q, k = (apply_rotary(t.view(1, 4, 5, 2, 8), sin, cos) for t in (q, k))
    la, lb = attn.decay(x)
    fn = reference.polyline_attention_ref if mixer == "full" else reference.criss_cross_attention_ref
    o = fn(q, k, v.view(1, 4, 5, 2, 8), la, lb, 1.0).reshape(1, 4, 5, 16)
    expect = attn.proj(o + lepe.permute(0, 2, 3, 1))
    torch.testing.assert_close(attn(x, (sin, cos)), expect, rtol=1e-12, atol=1e-12)


def test_block_residual_structure():
    torch.manual_seed(0)
    blk = PPMABlock(16, 2, mlp_ratio=2.0, mixer="criss_cross", layerscale=True, layer_init_values=0.0).eval()
    x = torch.randn(1, 3, 4, 16)
    # with zero layer scale both branches vanish: only the CPE residual remains
    torch.testing.assert_close(blk(x), x + blk.cpe(x))
    assert blk.mlp.fc1.out_features == 32 and blk.norm1.eps == blk.norm2.eps == 1e-6


@pytest.mark.parametrize("mixer", ["criss_cross", "full"])
def test_fused_block_in_place(mixer):
    """A fused block adds its two residual sums into its own CPE output (the first one inside
    ppma.ops.cpu.add_layer_norm_, with norm2) and its attention rotates its own q and k in place: the unfused
    block's output up to rounding (oneDNN's linears), the input left alone; the unfused block overwrites nothing."""
    torch.manual_seed(0)
    blk = PPMABlock(16, 2, mlp_ratio=2.0, mixer=mixer).eval()
    x = torch.randn(2, 5, 6, 16)
    x0 = x.clone()

    def formula(x):
        y = blk.cpe(x, residual=True)
        y = y + blk.attn(blk.norm1(y))
        return y + blk.mlp(blk.norm2(y))

    with torch.no_grad():
        want = formula(x)
        assert torch.equal(blk(x), want)  # unfused: the formula, bit for bit
    ppma.nn.fuse_for_inference(blk)
    assert blk.fused and blk.attn.fused and blk.mlp.fused and blk.norm1.fused and blk.cpe.fused
    cpe_out = []
    cpe_forward = blk.cpe.forward
    blk.cpe.forward = lambda *a, **k: cpe_out.append(cpe_forward(*a, **k)) or cpe_out[-1]  # no hook: notes it
    with torch.inference_mode():
        got = blk(x)
    del blk.cpe.forward
    assert got is cpe_out[0]  # the sums went into the CPE's output
    assert torch.equal(x, x0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_linear_and_conv_pieces():
    """The fused pieces against torch's modules: oneDNN's linear (+ GELU) equals ``F.linear`` up to float32 rounding,
    and under bf16 autocast autocast's own linear up to bf16 rounding (another summation order; where GELU rounds);
    the BatchNorm folded into a convolution (oneDNN, GELU fused) equals ``bn(conv(x))`` in eval mode up to rounding,
    in float32 and bf16 autocast, for NCHW and channels-last inputs, strides 1 and 2."""
    from ppma.nn import layers

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40)
    x = torch.randn(2, 5, 7, 48)
    with torch.no_grad():
        for gelu in (False, True):
            want = F.gelu(lin(x)) if gelu else lin(x)
            got = layers._fused_linear(x, lin, torch.float32, gelu=gelu)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if layers._ONEDNN_BF16:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    got = layers._fused_linear(x, lin, torch.bfloat16, gelu=gelu)
                    ref = F.gelu(lin(x).float()) if gelu else lin(x).float()
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
        ident = torch.nn.Identity()  # another layer: its own forward
        assert torch.equal(layers._fused_linear(x, ident, torch.float32), x)
    for stride in (1, 2):
        conv = torch.nn.Conv2d(6, 10, 3, stride, 1)
        bn = torch.nn.BatchNorm2d(10).eval()
        with torch.no_grad():  # non-trivial statistics and affine parameters
            bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
        assert layers._foldable(conv, bn)
        assert not layers._foldable(conv, torch.nn.BatchNorm2d(10, track_running_stats=False))
        layers._fold_into(conv, bn)
        assert "folded_weight" not in conv.state_dict()  # non-persistent: the state_dict keeps its keys
        x = torch.randn(2, 6, 9, 11)
        for gelu in (False, True):
            with torch.no_grad():
                want = F.gelu(bn(conv(x))) if gelu else bn(conv(x))
                for xin in (x, x.contiguous(memory_format=torch.channels_last)):
                    got = layers._fused_conv(xin, conv, torch.float32, gelu=gelu)
                    assert got.shape == want.shape and got.dtype == torch.float32
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    if layers._ONEDNN_BF16:
                        got16 = layers._fused_conv(xin, conv, torch.bfloat16, gelu=gelu)
                        assert got16.dtype == torch.bfloat16
                        torch.testing.assert_close(got16.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("amp", [False, True])
def test_fused_dwconv_calls(amp):
    """A fused ``DWConv2d`` in its four calls (plain, ``residual=True`` out of place and in place, ``add`` in place
    and out of place) equals the unfused module up to rounding, float32 and bf16 under autocast; in place it
    returns the overwritten map, out of place it leaves its inputs alone."""
    from ppma.nn.layers import DWConv2d

    torch.manual_seed(0)
    m = DWConv2d(24, 5).eval()
    dt = torch.bfloat16 if amp else torch.float32
    tol = dict(rtol=2e-2, atol=6e-2) if amp else dict(rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 6, 7, 24).to(dt)
    add = torch.randn(2, 6, 7, 24).to(dt)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        want = {"plain": m(x), "residual": m(x, residual=True), "add": m(x, add=add)}
        ppma.nn.fuse_for_inference(m)
        x0, add0 = x.clone(), add.clone()
        got = {"plain": m(x), "residual": m(x, residual=True), "add": m(x, add=add)}
        assert torch.equal(x, x0) and torch.equal(add, add0)
        for k in want:
            assert got[k].dtype == dt and got[k].is_contiguous(), k
            torch.testing.assert_close(got[k].float(), want[k].float(), **tol, msg=k)
        out = m(x, add=add, inplace=True)
        assert out is add
        torch.testing.assert_close(out.float(), want["add"].float(), **tol)
        out = m(x, residual=True, inplace=True)
        assert out.data_ptr() == x.data_ptr()
        torch.testing.assert_close(out.float(), want["residual"].float(), **tol)


def test_fused_stem_and_merging():
    """ConvStem and PatchMerging fused (BatchNorms folded once, fused GELU, channels-last) equal their unfused
    forward in eval mode up to float32 rounding."""
    from ppma.nn.layers import ConvStem, PatchMerging

    torch.manual_seed(0)
    stem, merge = ConvStem(3, 16).eval(), PatchMerging(16, 24).eval()
    for m in (stem, merge):
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                with torch.no_grad():
                    mod.running_mean.uniform_(-0.5, 0.5), mod.running_var.uniform_(0.5, 2)
    x, y = torch.randn(2, 3, 30, 26), torch.randn(2, 7, 9, 16)
    with torch.no_grad():
        want_stem, want_merge = stem(x), merge(y)
    ppma.nn.fuse_for_inference(stem), ppma.nn.fuse_for_inference(merge)
    assert stem.fused and merge.fused
    with torch.inference_mode():
        got_stem, got_merge = stem(x), merge(y)
    assert got_stem.is_contiguous() and got_stem.shape == want_stem.shape == (2, 8, 7, 16)
    torch.testing.assert_close(got_stem, want_stem, rtol=1e-4, atol=1e-5)
    assert got_merge.is_contiguous() and got_merge.shape == want_merge.shape == (2, 4, 5, 24)
    torch.testing.assert_close(got_merge, want_merge, rtol=1e-4, atol=1e-5)


def test_stem_and_merging_channels_last_training():
    """In CPU training with the "fused" implementation ConvStem and PatchMerging run their convolutions on
    channels-last maps (``ppma.nn.layers._channels_last_convs``); with "reference" on NCHW maps, as the official
    code; PatchMerging only where its map has at least as many elements as its weight (else NCHW in both). Outputs
    and parameter gradients agree up to float32 rounding, and the outputs and input gradients are contiguous."""
    from ppma.nn.layers import ConvStem, PatchMerging

    torch.manual_seed(0)
    stem, merge = ConvStem(3, 16).train(), PatchMerging(16, 24).train()
    seen = []
    for m in (stem.conv1, merge.conv):
        m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous()))
    # (module, input, channels-last with "fused"): the merging's weight has 16 * 24 * 9 = 3456 elements
    cases = ((stem, torch.randn(2, 3, 30, 26), True), (merge, torch.randn(2, 12, 14, 16), True),
             (merge, torch.randn(2, 7, 9, 16), False))
    for module, x, channels_last in cases:
        runs = {}
        for impl in ("fused", "reference"):
            module.zero_grad()
            seen.clear()
            with ppma.ops.use_impl(impl):
                xi = x.clone().requires_grad_()
                h = xi * 1.0  # not a leaf: a leaf's .grad is made contiguous whatever arrives
                h.register_hook(lambda g: seen_grads.append(g))
                y = module(h)
            assert y.is_contiguous()
            seen_grads = []
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            # the merging's input gradient contiguous on every path (ppma.nn.layers._contiguous_grad): a strided one
            # would make every residual sum of the stage before run strided (the stem's input is the image)
            assert len(seen_grads) == 1 and (module is stem or seen_grads[0].is_contiguous())
            runs[impl] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in module.named_parameters()})
            # NCHW-contiguous input to the first convolution only with the reference implementation
            assert seen == [impl == "reference" or not channels_last]
        (y, gx, gp), (y_ref, gx_ref, gp_ref) = runs["fused"], runs["reference"]
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-5)
        for n, g in gp.items():
            if n.endswith("conv.bias") or (n.startswith("conv") and n.endswith(".bias")):
                continue  # a bias before a training-mode BatchNorm: its gradient is rounding noise around 0
            scale = float(gp_ref[n].abs().max())  # sums over the whole map: rounding relative to their size
            torch.testing.assert_close(g, gp_ref[n], rtol=1e-4, atol=1e-5 * scale, msg=n)


def test_merging_contiguous_grad_compiles():
    """PatchMerging's NCHW path (the "reference" implementation here; CUDA takes it too) traces whole under
    ``torch.compile(fullgraph=True, dynamic=True)`` with its contiguous-gradient step (an autograd.Function), and
    the compiled input gradient equals the eager one."""
    from ppma.nn.layers import PatchMerging

    torch.manual_seed(0)
    merge = PatchMerging(8, 12).train()
    x = torch.randn(2, 9, 7, 8)
    compiled = torch.compile(lambda t: merge(t * 1.0), backend="aot_eager", fullgraph=True, dynamic=True)
    grads = []
    with ppma.ops.use_impl("reference"):
        for fn in (lambda t: merge(t * 1.0), compiled):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            grads.append(xi.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_model_inference_matches_training_path():
    """PPMA-T's logits unfused under ``inference_mode`` equal those of the graph-recording forward up to float32
    rounding (the attention ops' statistics-free inference), and so do the fused model's (oneDNN's linears)."""
    import ppma

    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    want = model(x)
    with torch.inference_mode():
        got = model(x)
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    ppma.nn.fuse_for_inference(model)
    with torch.inference_mode():
        got = model(x)
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_drop_path_is_x_times_mask_over_keep_bit_for_bit(dtype):
    """``drop_path`` gives ``x * mask / keep`` exactly (the official stochastic depth), forward and backward, NaN,
    Inf and signed zeros included, for the same random mask."""
    from ppma.nn.layers import drop_path

    x = torch.randn(64, 5, 3, 7, dtype=torch.float64).to(dtype)
    x[0, 0, 0, 0], x[1, 0, 0, 1], x[2, 0, 0, 2], x[3, 0, 0, 3] = float("nan"), float("inf"), -float("inf"), -0.0
    g = torch.randn_like(x)

    def bits(t):
        return torch.nan_to_num(t, nan=7.0), t.isnan(), torch.signbit(t)

    for p in (0.1, 0.123, 0.5):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(0)
        a = drop_path(xa, p, training=True)
        torch.manual_seed(0)
        mask = x.new_empty((64, 1, 1, 1)).bernoulli_(1 - p)
        b = xb * mask / (1 - p)
        assert 0 < int(mask.sum()) < 64 or p == 0.1
        a.backward(g)
        b.backward(g)
        for u, v in ((a, b), (xa.grad, xb.grad)):
            assert u.dtype == v.dtype and all(torch.equal(s, t) for s, t in zip(bits(u), bits(v))), p


def _linears_grads(x, layers, fn, weights):
    for m in layers:
        m.zero_grad()
    xl = x.clone().requires_grad_()
    outs = fn(xl, *layers)
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs], [xl.grad] + [p.grad for m in layers for p in m.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_input_linears(dtype):
    """``ppma.nn.layers.linears`` (the attention's q, k, v): in CPU training one autograd node whose forward is the
    layers' own bits and whose input gradient is summed inside the products; gradients equal the separate layers'
    up to rounding. Frozen layers get no gradient; hooks, the reference implementation and no-grad use the layers."""
    from ppma.nn.layers import linears

    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, n).to(dtype) for n in (24, 24, 16)]
    x = torch.randn(2, 5, 6, 24, dtype=dtype)
    weights = [torch.randn(2, 5, 6, m.out_features, dtype=dtype) for m in layers]
    separate = lambda x, *ls: tuple(m(x) for m in ls)  # noqa: E731
    outs, grads = _linears_grads(x, layers, linears, weights)
    ref_outs, ref_grads = _linears_grads(x, layers, separate, weights)
    for o, r in zip(outs, ref_outs):
        assert torch.equal(o, r)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)
    assert type(linears(x.requires_grad_(), *layers)[0].grad_fn).__name__ == "_SharedInputLinearsBackward"
    with ppma.ops.use_impl("reference"):
        assert linears(x, *layers)[0].grad_fn.name() != "_SharedInputLinearsBackward"
    with torch.no_grad():  # the layers (CPU inference: oneDNN's linear, another summation order)
        for o, r in zip(linears(x, *layers), ref_outs):
            torch.testing.assert_close(o, r, rtol=tol, atol=tol)
    # a frozen layer and a detached input: no gradient where none is asked for
    for m in layers:
        m.zero_grad()
    layers[1].requires_grad_(False)
    xd = x.detach()
    outs = linears(xd, *layers)
    sum(o.sum() for o in outs).backward()
    assert layers[1].weight.grad is None and layers[0].weight.grad is not None
    layers[1].requires_grad_(True)
    # a forward hook sees its layer's call
    calls = []
    h = layers[2].register_forward_hook(lambda *a: calls.append(1))
    try:
        linears(x, *layers)
    finally:
        h.remove()
    assert calls


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_widened_bf16_training_linear(x_dtype, monkeypatch):
    """``ppma.nn.layers.linear`` in CPU training under bf16 autocast where the bf16 products are widened
    (``bf16_products_widened``, forced): float32 GEMMs of the bf16-rounded values with autocast's roundings (output,
    grad_x, grad_weight and the bias gradient each rounded to bf16), so output and gradients equal autocast's own bf16
    linear layer up to the order of the float32 sums (within one bf16 rounding), in the inputs' dtypes; off the gate
    (widening off, no autocast, the reference implementation) the layer itself runs (inference:
    test_widened_lowp_linear)."""
    from ppma.nn import layers

    monkeypatch.setattr(layers, "_WIDENED", True)
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(3, 5, 40).to(x_dtype).requires_grad_()
    go = torch.randn(3, 5, 24).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = lin(x)
        got = layers.linear(x, lin)
        q, k = layers.linears(x, lin, lin)
    assert type(got.grad_fn).__name__ == "_WidenedLinearBackward" and got.dtype == torch.bfloat16
    assert type(q.grad_fn).__name__ == "_WidenedLinearBackward" and torch.equal(q, got) and torch.equal(k, got)
    gw = torch.autograd.grad(want, [x, lin.weight, lin.bias], go)
    gg = torch.autograd.grad(got, [x, lin.weight, lin.bias], go)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-6)
    for a, b in zip(gg, gw):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(layers, "_WIDENED", False)
        assert type(layers.linear(x, lin).grad_fn).__name__ != "_WidenedLinearBackward"
        monkeypatch.setattr(layers, "_WIDENED", True)
        with ppma.ops.use_impl("reference"):
            assert type(layers.linear(x, lin).grad_fn).__name__ != "_WidenedLinearBackward"
    assert type(layers.linear(x.float(), lin).grad_fn).__name__ != "_WidenedLinearBackward"  # no autocast


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_widened_bf16_training_conv2d(x_dtype, bias, monkeypatch):
    """``ppma.nn.layers.conv2d`` (the stem's and patch merging's convolutions) in CPU training under bf16 autocast
    where the bf16 products are widened (forced): float32 convolutions with autocast's roundings, so output and
    gradients equal autocast's own bf16 convolution up to the order of the float32 sums, in the inputs' dtypes, and
    the channels-last layout is kept; off the gate (widening off, the reference implementation, a padding other than
    zeros, a hook) the convolution itself runs (inference: test_widened_lowp_conv2d)."""
    from ppma.nn import layers

    monkeypatch.setattr(layers, "_WIDENED", True)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 10, 3, 2, 1, bias=bias)
    x = torch.randn(2, 6, 9, 11).to(x_dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
    go = torch.randn(2, 10, 5, 6).bfloat16().contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = conv(x)
        got = layers.conv2d(x, conv)
    assert type(got.grad_fn).__name__ == "_WidenedConvBackward" and got.dtype == torch.bfloat16
    assert got.is_contiguous(memory_format=torch.channels_last)
    params = [x, conv.weight] + ([conv.bias] if bias else [])
    gw = torch.autograd.grad(want, params, go)
    gg = torch.autograd.grad(got, params, go)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-6)
    for a, b in zip(gg, gw):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-5)

    def widened(module=conv, inp=x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return type(layers.conv2d(inp, module).grad_fn).__name__ == "_WidenedConvBackward"

    with ppma.ops.use_impl("reference"):
        assert not widened()
    assert widened(torch.nn.Conv2d(6, 6, 3, 1, 1, groups=2))  # grouped: widened too
    assert not widened(torch.nn.Conv2d(6, 6, 3, 1, 1, padding_mode="reflect"))
    h = conv.register_forward_hook(lambda *a: None)
    try:
        assert not widened()
    finally:
        h.remove()
    monkeypatch.setattr(layers, "_WIDENED", False)
    assert not widened()
    monkeypatch.setattr(layers, "_WIDENED", True)
    assert widened()


def _spy(monkeypatch, owner, name: str = "apply") -> list:
    """Records the last argument (the dtype) of each call of ``owner.name`` (``apply`` of an autograd.Function of
    ppma.nn.layers, or a function of that module), which still runs."""
    calls, orig = [], getattr(owner, name)

    def spy(*args):
        calls.append(args[-1])
        return orig(*args)

    monkeypatch.setattr(owner, name, spy)
    return calls


# the flag that forces each dtype's widening (ppma.nn.layers.bf16_products_widened / fp16_products_widened), and one
# rounding of that dtype
_WIDEN_FLAG = {torch.bfloat16: ("_WIDENED", 2 ** -7), torch.float16: ("_WIDENED_FP16", 2 ** -10)}
_LOWP = pytest.mark.parametrize("lp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@_LOWP
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_widened_lowp_linear(grad, lp, monkeypatch):
    """``ppma.nn.layers.linear`` / ``linears`` under CPU bf16 (fp16) autocast where the CPU has no bf16 instructions
    (fp16 kernels; ``bf16_products_widened`` / ``fp16_products_widened``, forced), in training and inference: float32
    GEMMs of the rounded values with autocast's roundings, so output and gradients equal autocast's own linear layer
    up to the order of the float32 sums (within one rounding); off the gate (widening off, the reference
    implementation, a hook, no autocast) the layer itself runs."""
    from ppma.nn import layers

    flag, ulp = _WIDEN_FLAG[lp]
    monkeypatch.setattr(layers, flag, True)
    calls = _spy(monkeypatch, layers._WidenedLinear)
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(3, 5, 40).requires_grad_(grad)
    go = torch.randn(3, 5, 24).to(lp)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=lp):
        want = lin(x)
        got = layers.linear(x, lin)
        q, k = layers.linears(x, lin, lin)
    assert calls == [lp] * 3 and got.dtype == lp
    assert torch.equal(q, got) and torch.equal(k, got)
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-5)
    if grad:
        gw = torch.autograd.grad(want, [x, lin.weight, lin.bias], go)
        gg = torch.autograd.grad(got, [x, lin.weight, lin.bias], go)
        for a, b in zip(gg, gw):
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=2 * ulp, atol=1e-4)
    del calls[:]
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=lp):
        with ppma.ops.use_impl("reference"):
            layers.linear(x, lin)
        h = lin.register_forward_hook(lambda *a: None)
        try:
            layers.linear(x, lin)
        finally:
            h.remove()
        monkeypatch.setattr(layers, flag, False)
        layers.linears(x, lin)
    layers.linear(x, lin)  # no autocast
    assert calls == []


@_LOWP
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("groups", [1, 6], ids=["dense", "depthwise"])
def test_widened_lowp_conv2d(groups, grad, lp, monkeypatch):
    """``ppma.nn.layers.conv2d`` (dense and depthwise) and, for fp16, the unfused ``DWConv2d`` (plain, residual, added
    to a map) under CPU bf16 (fp16) autocast where the CPU has no bf16 instructions (fp16 kernels; forced): float32
    convolutions of the rounded values with autocast's roundings, output and gradients equal to autocast's convolution
    up to the order of the float32 sums; the channels-last layout is kept."""
    from ppma.nn import layers
    from ppma.nn.layers import DWConv2d

    flag, ulp = _WIDEN_FLAG[lp]
    monkeypatch.setattr(layers, flag, True)
    calls = _spy(monkeypatch, layers._WidenedConv)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 12 if groups == 1 else 6, 3, 2 if groups == 1 else 1, 1, groups=groups)
    x = torch.randn(2, 6, 9, 11).contiguous(memory_format=torch.channels_last).requires_grad_(grad)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=lp):
        want = conv(x)
        got = layers.conv2d(x, conv)
    assert calls == [lp] and got.dtype == lp
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-5)
    if grad:
        # against float64 sums of the same rounded values: each widened gradient is that rounded once (torch's fp16
        # fallback kernels sum in fp16 in places and are further off)
        go = torch.randn(want.shape).to(lp)
        params = [x, conv.weight, conv.bias]
        x64 = x.detach().to(lp).double().requires_grad_()
        w64 = conv.weight.detach().to(lp).double().requires_grad_()
        b64 = conv.bias.detach().to(lp).double().requires_grad_()
        exact = torch.autograd.grad(F.conv2d(x64, w64, b64, conv.stride, conv.padding, 1, groups), [x64, w64, b64],
                                    go.double())
        for a, e in zip(torch.autograd.grad(got, params, go), exact):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), e.to(lp).double(), rtol=ulp, atol=1e-6)

    dw = DWConv2d(6, 5)
    m = torch.randn(2, 7, 9, 6).to(lp).requires_grad_(grad)  # the model's maps under autocast
    add = torch.randn(2, 7, 9, 6).to(lp)

    def dw_calls():
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=lp):
            return [dw(m), dw(m, residual=True), dw(m, add=add)]

    del calls[:]
    outs = dw_calls()
    # bf16 keeps autocast's depthwise convolution (oneDNN's bf16 kernel was the faster even where it emulates bf16)
    # and, in training, ppma's depthwise kernel (ppma.ops.cpu.depthwise_conv2d)
    assert calls == ([] if lp == torch.bfloat16 else [lp] * 3)
    monkeypatch.setattr(layers, flag, False)
    refs = dw_calls()  # autocast's convolution
    monkeypatch.setattr(layers, flag, True)
    for out, ref in zip(outs, refs):
        assert out.dtype == ref.dtype and out.is_contiguous()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 * ulp, atol=16 * ulp)
    if grad:
        outs[1].float().sum().backward()
        assert dw.conv.weight.grad is not None and m.grad is not None
    del calls[:]
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=lp):
        with ppma.ops.use_impl("reference"):
            layers.conv2d(x, conv)
            dw(m)
        monkeypatch.setattr(layers, flag, False)
        layers.conv2d(x, conv)
        dw(m)
    assert calls == []


@_LOWP
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_widened_lowp_model(grad, lp, monkeypatch):
    """The tiny PPMA-T (unfused) under CPU bf16 (fp16) autocast with the widened products (forced) against autocast's
    own kernels: the same logits, loss and gradients up to rounding of the sums' order."""
    import ppma
    from ppma.nn import layers

    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10, embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1),
                              num_heads=(2, 2, 4, 4), drop_path_rate=0.0).train(grad)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([1, 3])
    flag, _ = _WIDEN_FLAG[lp]

    def run(widened):
        monkeypatch.setattr(layers, flag, widened)
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", lp):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        if not grad:
            return logits.float(), None
        loss.backward()
        return logits.float().detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    calls = _spy(monkeypatch, layers._WidenedLinear)
    (l0, g0), (l1, g1) = run(False), run(True)
    assert calls and set(calls) == {lp}
    torch.testing.assert_close(l1, l0, rtol=0, atol=2e-2 if lp == torch.float16 else 8e-2)
    if grad:
        assert F.cosine_similarity(g0.double(), g1.double(), dim=0).item() > 0.999


@_LOWP
def test_widened_lowp_model_compiles(lp, monkeypatch):
    """The widened products trace whole under ``torch.compile`` (aot_eager, fullgraph), in inference and training, and
    the compiled model equals the eager one."""
    import ppma
    from ppma.nn import layers

    torch._dynamo.reset()
    monkeypatch.setattr(layers, _WIDEN_FLAG[lp][0], True)
    calls = _spy(monkeypatch, layers._WidenedLinear)
    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10, embed_dims=(32, 64, 96, 128), depths=(1, 1, 1, 1),
                              num_heads=(2, 2, 4, 4), drop_path_rate=0.0)
    x = torch.randn(2, 3, 64, 64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for grad in (False, True):
        model.train(grad)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=lp):
            want, got = model(x), compiled(x)
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-3)
        if grad:
            got.float().sum().backward()
    assert calls and set(calls) == {lp}
    torch._dynamo.reset()


def test_widened_bf16_training_step(monkeypatch):
    """A bf16-autocast training step of the tiny PPMA-T with the widened products (forced) against the bf16 kernels:
    the same loss and gradients up to bf16 rounding of the sums' order."""
    import ppma
    from ppma.nn import layers

    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10, embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1),
                              num_heads=(2, 2, 4, 4), drop_path_rate=0.0)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([1, 3])

    def step(widened):
        monkeypatch.setattr(layers, "_WIDENED", widened)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    (l0, g0), (l1, g1) = step(False), step(True)
    assert abs(l0.item() - l1.item()) < 1e-2
    assert F.cosine_similarity(g0.double(), g1.double(), dim=0).item() > 0.999
