"""The Surrogate Attention Block (ppma.nn.surrogate) against its definition written as explicit loops, long-range
mixing, the model options mixer="sab" / mlp="monarch" (PPMA, timm, mmengine, training configs)."""

from __future__ import annotations

import pytest
import torch

from ppma.models.ppma import PPMA, PPMAConfig
from ppma.nn import MonarchLinear, PPMABlock, SurrogateAttention, surrogate_mixing
from ppma.nn.layers import ConvFFN


def _loops_1d(q, k, v, causal=False):
    """Y[n] = V[n] (1/N) sum_m K[m] Q[(n - m) mod N] (causal: only m <= n, no wrap), one token pair at a time."""
    N = q.shape[1]
    rows = []
    for n in range(N):
        acc = torch.zeros_like(q[:, 0])
        for m in range(N):
            if causal and m > n:
                continue
            acc = acc + k[:, m] * q[:, (n - m) % N]
        rows.append(v[:, n] * acc / N)
    return torch.stack(rows, 1)


def _loops_2d(q, k, v):
    """Y[i, j] = V[i, j] (1/(H W)) sum_{a, b} K[a, b] Q[(i - a) mod H, (j - b) mod W]."""
    H, W = q.shape[1:3]
    out = torch.zeros_like(q)
    for i in range(H):
        for j in range(W):
            acc = torch.zeros_like(q[:, 0, 0])
            for a in range(H):
                for b in range(W):
                    acc = acc + k[:, a, b] * q[:, (i - a) % H, (j - b) % W]
            out[:, i, j] = v[:, i, j] * acc / (H * W)
    return out


def _inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _check_against(fn, ref, tensors):
    out = fn(*tensors)
    expected = ref(*tensors)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, tensors, g)
    want = torch.autograd.grad(expected, tensors, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("N", [1, 2, 7, 13, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_fft_form_matches_loops_1d(N, causal):
    _check_against(lambda q, k, v: surrogate_mixing(q, k, v, causal=causal),
                   lambda q, k, v: _loops_1d(q, k, v, causal=causal), _inputs((2, N, 3), seed=N))


@pytest.mark.parametrize("hw", [(1, 1), (3, 5), (4, 7), (6, 1), (5, 5)])
def test_fft_form_matches_loops_2d(hw):
    _check_against(surrogate_mixing, _loops_2d, _inputs((2, *hw, 3), seed=hw[0] * 10 + hw[1]))


def test_gradcheck():
    assert torch.autograd.gradcheck(surrogate_mixing, tuple(_inputs((1, 5, 2), seed=1)))
    assert torch.autograd.gradcheck(surrogate_mixing, tuple(_inputs((1, 3, 4, 2), seed=2)))


def test_module_is_projections_then_mixing():
    """SurrogateAttention(x) = proj(mix(x M_Q^T + b_Q, x M_K^T + b_K, x M_V^T + b_V)) with dense Monarch matrices."""
    torch.manual_seed(0)
    m = SurrogateAttention(16, 4).double()
    for x, ref in ((torch.randn(2, 9, 16, dtype=torch.float64), _loops_1d),
                   (torch.randn(2, 3, 5, 16, dtype=torch.float64), _loops_2d)):
        q, k, v = (x @ lin.to_dense().T + lin.bias for lin in (m.q, m.k, m.v))
        torch.testing.assert_close(m(x), m.proj(ref(q, k, v)), rtol=1e-10, atol=1e-12)
    assert all(isinstance(lin, MonarchLinear) for lin in (m.q, m.k, m.v))


def test_heads_do_not_change_the_result():
    torch.manual_seed(0)
    a, b = SurrogateAttention(16, 1), SurrogateAttention(16, 8)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 11, 16)
    torch.testing.assert_close(a(x), b(x))


def test_long_range_mixing():
    """A change at token 0 changes the output at the last token (and the reverse, circular); causal: one way."""
    torch.manual_seed(0)
    m = SurrogateAttention(8, 2).double()
    x = torch.randn(1, 1001, 8, dtype=torch.float64)
    x0 = x.clone()
    x0[:, 0] += 1.0
    assert (m(x0)[:, -1] - m(x)[:, -1]).abs().max() > 1e-8
    xl = x.clone()
    xl[:, -1] += 1.0
    assert (m(xl)[:, 0] - m(x)[:, 0]).abs().max() > 1e-8
    c = SurrogateAttention(8, 2, causal=True).double()
    c.load_state_dict(m.state_dict())
    assert (c(x0)[:, -1] - c(x)[:, -1]).abs().max() > 1e-8
    torch.testing.assert_close(c(xl)[:, :-1], c(x)[:, :-1], rtol=0, atol=1e-12)  # FFT round-off only
    img = torch.randn(1, 13, 17, 8, dtype=torch.float64)
    img0 = img.clone()
    img0[:, 0, 0] += 1.0
    assert (m(img0)[:, -1, -1] - m(img)[:, -1, -1]).abs().max() > 1e-8
    # every output token depends on token (0, 0): the Jacobian column has no zero token
    diff = (m(img0) - m(img)).abs().amax(-1)
    assert (diff > 0).all()


def test_half_precision_runs_in_float32():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 33, 4) for _ in range(3))
    out = surrogate_mixing(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), surrogate_mixing(*(t.bfloat16().float() for t in (q, k, v))),
                               rtol=2e-2, atol=2e-2)


def test_bad_arguments_named():
    with pytest.raises(ValueError, match="num_heads must be a positive int dividing dim=16"):
        SurrogateAttention(16, 3)
    with pytest.raises(ValueError, match="dim must be a positive int"):
        SurrogateAttention(0)
    m = SurrogateAttention(16, 2)
    with pytest.raises(ValueError, match=r"x must be \[B, N, 16\] or \[B, H, W, 16\]"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"x must be \[B, N, 16\]"):
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match="causal=True needs"):
        SurrogateAttention(16, 2, causal=True)(torch.randn(1, 3, 4, 16))
    with pytest.raises(ValueError, match="q, k, v must all be"):
        surrogate_mixing(torch.randn(1, 4, 2), torch.randn(1, 5, 2), torch.randn(1, 4, 2))
    with pytest.raises(ValueError, match="token dimensions must be >= 1"):
        surrogate_mixing(*(torch.randn(1, 0, 2) for _ in range(3)))
    with pytest.raises(ValueError, match="mlp must be one of"):
        ConvFFN(8, 16, mlp="dense")
    with pytest.raises(ValueError, match="mlp must be one of"):
        PPMABlock(16, 2, mlp="butterfly")
    with pytest.raises(ValueError, match=r"PPMAConfig.mlp: 'x' is not one of"):
        PPMAConfig(mlp=("standard", "x", "standard", "standard"))
    with pytest.raises(ValueError, match=r"PPMAConfig.mixer: 'surrogate' is not one of"):
        PPMAConfig(mixer="surrogate")


SMALL = dict(embed_dims=(16, 32, 32, 32), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2), head_hidden_dim=32,
             num_classes=3)


@pytest.mark.parametrize("options", [
    {"mixer": "sab"},
    {"mlp": "monarch"},
    {"mixer": ("sab", "criss_cross", "sab", "padre"), "mlp": ("monarch", "standard", "standard", "monarch")},
])
def test_training_step_of_each_option(options):
    """One AdamW step at an odd image size: every parameter gets a gradient, the loss moves."""
    torch.manual_seed(0)
    model = PPMA(**SMALL, **options, drop_path_rate=0.0)
    mixers = options["mixer"] if isinstance(options.get("mixer"), tuple) else (options.get("mixer", "criss_cross"),) * 4
    mlps = options["mlp"] if isinstance(options.get("mlp"), tuple) else (options.get("mlp", "standard"),) * 4
    for s, stage in enumerate(model.stages):
        block = stage.blocks[0]
        assert (mixers[s] == "sab") == isinstance(block.attn, SurrogateAttention)
        assert (mlps[s] == "monarch") == isinstance(block.mlp.fc1, MonarchLinear) == isinstance(block.mlp.fc2,
                                                                                              MonarchLinear)
    x, y = torch.randn(4, 3, 37, 29), torch.tensor([0, 1, 2, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss0 = torch.nn.functional.cross_entropy(model(x), y)
    loss0.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        loss1 = torch.nn.functional.cross_entropy(model(x), y)
    assert torch.isfinite(loss1) and loss1.item() != loss0.item()


def test_monarch_mlp_has_fewer_parameters():
    """PPMA-T's counts of the README table (built on the meta device: shapes only, fast)."""
    import ppma

    def count(**kw):
        with torch.device("meta"):
            return sum(p.numel() for p in ppma.create_model("ppma_tiny", **kw).parameters())

    base, mon, sab = count(), count(mlp="monarch"), count(mixer="sab")
    assert (base, mon, sab) == (14_335_272, 8_291_736, 11_349_576)
    assert count(mlp=("monarch", "standard", "standard", "standard")) < base


def test_timm_and_training_config_options():
    timm = pytest.importorskip("timm")
    import ppma.models  # noqa: F401  (registers the timm entry points)

    m = timm.create_model("ppma_tiny", mixer="sab", mlp=("monarch", "standard", "standard", "standard"),
                          num_classes=4, depths=(1, 1, 1, 1))
    assert isinstance(m.stages[2].blocks[0].attn, SurrogateAttention)
    assert isinstance(m.stages[0].blocks[0].mlp.fc1, MonarchLinear)
    assert m(torch.randn(1, 3, 33, 35)).shape == (1, 4)

    from ppma.train.build import build_model
    from ppma.train.config import load_config
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "classification", "demo_digits.yaml"),
                      ["model.overrides.mixer=sab", "model.overrides.mlp=monarch"])
    model = build_model(cfg.model, cfg.data.num_classes, cfg.data.in_chans)
    assert all(isinstance(s.blocks[0].attn, SurrogateAttention) for s in model.stages)
    assert all(isinstance(s.blocks[0].mlp.fc2, MonarchLinear) for s in model.stages)


def test_mmengine_backbone_options():
    pytest.importorskip("mmengine")
    from ppma.models.mm import PPMABackbone

    bb = PPMABackbone(arch="tiny", mixer="sab", mlp="monarch", depths=(1, 1, 1, 1))
    assert isinstance(bb.stages[3].blocks[0].attn, SurrogateAttention)
    outs = bb(torch.randn(1, 3, 45, 51))
    assert [o.shape[1] for o in outs] == [64, 128, 256, 512]
    assert outs[0].shape[-2:] == (12, 13)


def test_flop_counting_of_monarch_and_fft():
    """ppma.models.flops: MonarchLinear as its two bmm (b q (p + s) MACs per token), FFTs as 2.5 n log2 n FLOPs
    per real transform, and the SAB / Monarch-FFN PPMA-T cheaper than the standard one."""
    from torch.utils.flop_counter import FlopCounterMode

    from ppma.models.flops import count_macs, register_fft_flop_formulas

    register_fft_flop_formulas()
    register_fft_flop_formulas()  # idempotent
    m = MonarchLinear(48, 144)
    b, p, q, s = m.nblocks, m.in_block, m.mid_block, m.out_block
    with FlopCounterMode(display=False) as counter:
        m(torch.randn(10, 48))
    assert counter.get_total_flops() == 2 * 10 * b * q * (p + s)
    q_, k_, v_ = (torch.randn(2, 1024, 8) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        surrogate_mixing(q_, k_, v_)
    assert counter.get_total_flops() == 3 * 2.5 * 1024 * 10 * 2 * 8  # rfft(q), rfft(k), irfft
    with FlopCounterMode(display=False) as counter:
        surrogate_mixing(*(torch.randn(1, 4, 8, 3) for _ in range(3)))
    assert counter.get_total_flops() == 3 * 2.5 * 32 * 5 * 3
    model = PPMA(**SMALL)
    assert count_macs(PPMA(**SMALL, mixer="sab", mlp="monarch"), (1, 3, 64, 64)) < count_macs(model, (1, 3, 64, 64))


@pytest.mark.parametrize("shape", [(0, 5, 4), (0, 3, 2, 4), (2, 5, 0), (2, 3, 2, 0)])
def test_empty_batch_or_channels_give_an_empty_result(shape):
    """torch.fft refuses zero-sized transforms: the mixing returns the empty result with a working graph."""
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    out = surrogate_mixing(q, k, v)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == k.grad.shape == v.grad.shape == shape


@pytest.mark.parametrize("mixer", ["sab", "criss_cross"])
def test_model_on_an_empty_batch(mixer):
    """mixer="sab" on an empty batch returns an empty result, as the default model does."""
    model = PPMA(**SMALL, mixer=mixer).eval()
    with torch.no_grad():
        assert model(torch.randn(0, 3, 32, 32)).shape == (0, 3)
