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
def test_block_inference_in_place(mixer):
    """In CPU inference the block adds its two residual sums into its own CPE output (the first one inside
    ppma.ops.cpu.add_layer_norm_, with norm2) and the attention rotates its own q and k in place: the out-of-place
    formula's output up to rounding, the input left alone; a hook on a norm (which could keep the map it sees) or
    on the q/k layers (their outputs) switches that off."""
    torch.manual_seed(0)
    blk = PPMABlock(16, 2, mlp_ratio=2.0, mixer=mixer).eval()
    x = torch.randn(2, 5, 6, 16)
    x0 = x.clone()

    def formula(x):
        y = blk.cpe(x, residual=True)
        y = y + blk.attn(blk.norm1(y))
        return y + blk.mlp(blk.norm2(y))

    with ppma.nn.use_inference_fast_paths(False), torch.no_grad():
        want = formula(x)
    cpe_out = []
    cpe_forward = blk.cpe.forward
    blk.cpe.forward = lambda *a, **k: cpe_out.append(cpe_forward(*a, **k)) or cpe_out[-1]  # no hook: notes it
    with torch.inference_mode():
        got = blk(x)
    del blk.cpe.forward
    assert got is cpe_out[0]  # the sums went into the CPE's output
    assert torch.equal(x, x0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # oneDNN's linears: rounding
    seen = []
    handle = blk.norm1.register_forward_hook(lambda m, i, o: seen.append((i[0], i[0].clone())))
    with torch.inference_mode():
        hooked = blk(x)  # torch's LayerNorms (the hook must see norm1's call): equal up to rounding
    handle.remove()
    torch.testing.assert_close(hooked, got, rtol=1e-5, atol=1e-5)
    assert torch.equal(seen[0][0], seen[0][1])  # the map the hook kept was not written over
    outs = []
    handle = blk.attn.q.register_forward_hook(lambda m, i, o: outs.append((o, o.clone())))
    with torch.inference_mode():
        assert torch.equal(blk(x), got)  # the norms' kernels still run (no hook on them)
    handle.remove()
    assert torch.equal(outs[0][0], outs[0][1])  # q as the layer returned it, not rotated in place
    with torch.inference_mode():
        assert torch.equal(blk(x), got)  # hooks gone: the in-place path again


def test_linear_inference_path():
    """``ppma.nn.layers.linear``: the layer's own output (bit for bit) whenever autograd records it; oneDNN's fused
    bias (+ GELU) for CPU float32 inference where torch has it, equal up to float32 rounding, and for bf16 inference
    under CPU autocast where oneDNN has bf16 kernels, equal to autocast's own linear up to bf16 rounding."""
    from ppma.nn import layers

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40)
    x = torch.randn(2, 5, 7, 48)
    want, want_gelu = lin(x), F.gelu(lin(x))
    assert torch.equal(layers.linear(x, lin), want) and torch.equal(layers.linear(x, lin, gelu=True), want_gelu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layers.linear(x, lin), lin(x)), "training under autocast: the layer's own bf16 result"
        with torch.no_grad():
            bf16 = layers._onednn_inference_dtype(x, lin) == torch.bfloat16
            assert bf16 == layers._ONEDNN_BF16
            for gelu in (False, True):
                got = layers.linear(x, lin, gelu=gelu)
                ref = F.gelu(lin(x).float()) if gelu else lin(x).float()
                assert got.dtype == torch.bfloat16 and got.shape == ref.shape
                torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
                if bf16:  # oneDNN's bf16 linear and autocast's differ in summation order and in where GELU rounds
                    assert not torch.equal(got, lin(x))
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        assert torch.equal(layers.linear(x, lin), lin(x)), "fp16 autocast keeps the plain path"
    for ctx in (torch.no_grad(), torch.inference_mode()):
        with ctx:
            for gelu, ref in ((False, want), (True, want_gelu)):
                got = layers.linear(x, lin, gelu=gelu)
                assert got.shape == ref.shape and got.dtype == torch.float32
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # float64 and non-Linear modules keep the plain path
        assert torch.equal(layers.linear(x.double(), lin.double(), gelu=True), F.gelu(lin(x.double())))
        lin.float()
        ident = torch.nn.Identity()
        assert torch.equal(layers.linear(x, ident), x)
        seen = []
        handle = lin.register_forward_hook(lambda mod, inp, out: seen.append(out))
        assert torch.equal(layers.linear(x, lin), want) and len(seen) == 1, "a hooked layer must be called"
        handle.remove()


def test_conv_bn_inference_path():
    """``ppma.nn.layers.conv_bn``: ``bn(conv(x))`` (+ GELU), the modules' own result (bit for bit) in training; in CPU
    inference the BatchNorm folded into the convolution (oneDNN, GELU fused), equal up to rounding, in float32 and
    bf16 autocast, for NCHW and channels-last inputs, strides 1 and 2; an eval BN without running statistics
    (``track_running_stats=False``) and a hooked module keep the plain path."""
    from ppma.nn import layers

    torch.manual_seed(0)
    for stride in (1, 2):
        conv = torch.nn.Conv2d(6, 10, 3, stride, 1)
        bn = torch.nn.BatchNorm2d(10)
        with torch.no_grad():  # non-trivial statistics and affine parameters
            bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
        x = torch.randn(2, 6, 9, 11)
        train_out = layers.conv_bn(x, conv, bn, gelu=True)  # training mode: batch statistics, graph recorded
        assert torch.equal(train_out, F.gelu(bn(conv(x))))
        bn.eval()
        for gelu in (False, True):
            want = bn(conv(x))
            want = F.gelu(want) if gelu else want
            for xin in (x, x.contiguous(memory_format=torch.channels_last)):
                with torch.no_grad():
                    got = layers.conv_bn(xin, conv, bn, gelu=gelu)
                assert got.shape == want.shape and got.dtype == torch.float32
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    got16 = layers.conv_bn(xin, conv, bn, gelu=gelu)
                assert got16.dtype == torch.bfloat16
                torch.testing.assert_close(got16.float(), want.detach(), rtol=3e-2, atol=3e-2)
        with torch.no_grad():
            want = bn(conv(x))
            seen = []
            handle = bn.register_forward_hook(lambda mod, inp, out: seen.append(out))
            assert torch.equal(layers.conv_bn(x, conv, bn), want) and len(seen) == 1, "a hooked BN must be called"
            handle.remove()
            free = torch.nn.BatchNorm2d(10, track_running_stats=False).eval()
            assert torch.equal(layers.conv_bn(x, conv, free), free(conv(x)))


def test_dwconv_residual_bf16_inference():
    """``DWConv2d(..., residual=True)`` on bf16 input under CPU autocast inference (the FFN's hidden map): ``x +
    conv(x)`` with the addition inside oneDNN's convolution, within bf16 rounding of the float32 result; with a
    gradient recorded it is autocast's conv plus ``x`` (bit for bit)."""
    from ppma.nn.layers import DWConv2d

    torch.manual_seed(0)
    m = DWConv2d(24, 3).eval()
    x = torch.randn(2, 6, 7, 24).bfloat16()
    want = x.float() + m.conv(x.float().permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = m(x, residual=True)
        assert torch.equal(plain, x + m.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))
        with torch.no_grad():
            got = m(x, residual=True)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.detach(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(plain.float(), want.detach(), rtol=2e-2, atol=6e-2)


def test_stem_and_merging_inference_paths():
    """ConvStem and PatchMerging in CPU inference (folded BN, fused GELU, channels-last) equal their training-graph
    forward in eval mode up to float32 rounding."""
    from ppma.nn.layers import ConvStem, PatchMerging

    torch.manual_seed(0)
    stem, merge = ConvStem(3, 16).eval(), PatchMerging(16, 24).eval()
    for m in (stem, merge):
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                with torch.no_grad():
                    mod.running_mean.uniform_(-0.5, 0.5), mod.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 30, 26)
    want = stem(x)  # graph recorded: the modules' own path
    with torch.inference_mode():
        got = stem(x)
    assert got.is_contiguous() and got.shape == want.shape == (2, 8, 7, 16)
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    y = torch.randn(2, 7, 9, 16)
    want = merge(y)
    with torch.inference_mode():
        got = merge(y)
    assert got.is_contiguous() and got.shape == want.shape == (2, 4, 5, 24)
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)


def test_stem_and_merging_channels_last_training():
    """In CPU training with the "fused" implementation ConvStem and PatchMerging run their convolutions on
    channels-last maps (``ppma.nn.layers._channels_last_convs``); with "reference" on NCHW maps, as the official
    code; PatchMerging only where its map has at least as many elements as its weight (else NCHW in both). Outputs
    and parameter gradients agree up to float32 rounding, and the outputs are contiguous."""
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
                y = module(xi)
            assert y.is_contiguous()
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
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


def test_model_inference_matches_training_path():
    """PPMA-T's logits under ``inference_mode`` (oneDNN linears, the statistics-free attention op) equal those of the
    graph-recording forward up to float32 rounding."""
    import ppma

    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    want = model(x)
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
