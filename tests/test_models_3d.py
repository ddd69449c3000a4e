"""The 3-D PPMA modules and video backbone (ppma.nn.attention_3d, ppma.models.video) and the moving-digits dataset
(ppma.train.data_video): shapes, registration, the axial form's relation to criss-cross attention, the ablations, and
the dataset's determinism and labels (docs/video.md)."""

from __future__ import annotations

import pytest
import torch

import ppma
import ppma.models
from op_utils import needs_ext
from ppma.nn.attention_3d import PPMAAttention3D, _line_attention, rotary_sin_cos_3d
from ppma.nn.rope import rotary_angle, rotary_sin_cos


def _small(**kw):
    return ppma.create_model("ppma_video_tiny", num_classes=4, in_chans=1, embed_dims=(16, 32, 48, 64),
                             depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2), **kw)


@needs_ext
@pytest.mark.parametrize("kw", [{}, {"mixer": "axial"}, {"mask": "none"}, {"mixer": "linear"},
                                {"frame_wise": True, "tubelet": (1, 8, 8)}],
                         ids=["default", "axial", "no-mask", "linear", "frame-wise"])
def test_video_model_forward_backward(kw):
    torch.manual_seed(0)
    m = _small(**kw)
    x = torch.randn(2, 1, 8, 32, 32)
    y = m(x)
    assert y.shape == (2, 4) and torch.isfinite(y).all()
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


@needs_ext
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_video_model_fp16_widened(grad, monkeypatch):
    """Under CPU fp16 autocast on a CPU without fp16 kernels (``ppma.nn.layers.fp16_products_widened``, forced) the
    video model's linear layers and 3-D convolutions (depthwise too) run as float32 products of the fp16-rounded
    values (torch's fp16 fallback ``slow_conv3d`` otherwise): the same logits and gradients up to the sums' order."""
    import torch.nn.functional as F

    from ppma.nn import layers

    torch.manual_seed(0)
    m = _small().train(grad)
    x = torch.randn(2, 1, 8, 32, 32)
    y = torch.tensor([1, 3])
    calls = []
    orig = layers._WidenedConv.apply
    monkeypatch.setattr(layers._WidenedConv, "apply", lambda *a: (calls.append(a[1].dim()), orig(*a))[1])

    def run(widened):
        monkeypatch.setattr(layers, "_WIDENED_FP16", widened)
        m.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.float16):
            logits = m(x)
            loss = F.cross_entropy(logits.float(), y)
        if grad:
            loss.backward()
            return logits.float().detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        return logits.float(), None

    (l0, g0), (l1, g1) = run(False), run(True)
    assert calls and set(calls) == {5}  # 3-D convolutions: the embedding, CPE, LePE, the downsamplings
    torch.testing.assert_close(l1, l0, rtol=0, atol=2e-2)
    if grad:
        assert F.cosine_similarity(g0.double(), g1.double(), dim=0).item() > 0.999


def test_create_model_lists_and_rejects():
    from ppma.models.video import VIDEO_MODEL_CONFIGS

    assert "ppma_video_tiny" in VIDEO_MODEL_CONFIGS and "ppma_video_tiny" not in ppma.models.list_models()
    with pytest.raises(TypeError, match="unknown arguments"):
        ppma.create_model("ppma_video_tiny", bogus=1)
    with pytest.raises(ValueError, match="no pretrained weights"):
        ppma.create_model("ppma_video_tiny", pretrained=True)


def test_not_registered_with_timm():
    """The video model does not meet timm's model contract (image-shaped pretrained_cfg, features_only,
    forward_intermediates), so it is not registered there (docs/video.md); ppma.create_model builds it."""
    if not ppma.models.TIMM_REGISTERED:
        pytest.skip("timm is not importable")
    import timm

    assert "ppma_video_tiny" not in timm.list_models("ppma*")
    assert {"ppma_tiny", "ppma_small", "ppma_base"} <= set(timm.list_models("ppma*"))


@pytest.mark.parametrize("shape", [(1, 1, 5, 16, 16), (1, 1, 4, 18, 16), (1, 1, 4, 16, 17), (1, 1, 1, 16, 16)])
def test_clip_that_does_not_tile_is_refused(shape):
    """A strided tubelet embedding would drop the frames and pixels past the last whole tubelet: refused instead."""
    with pytest.raises(ValueError, match="multiples of the tubelet"):
        _small()(torch.randn(shape))


def test_clip_that_tiles_runs_at_odd_sizes():
    """T, H, W multiples of the tubelet but odd after it (3 tubelets in time, 5 x 3 spatially) run, every token
    reaching the output."""
    torch.manual_seed(0)
    m = _small(mixer="axial").eval()
    x = torch.randn(1, 1, 6, 20, 12, requires_grad=True)
    m(x).sum().backward()
    assert (x.grad.abs().sum(dim=(0, 1)) > 0).all()


def test_frame_wise_model_ignores_frame_order():
    """The 2-D baseline (frame-wise attention, 1-frame tubelets) is invariant to permuting the frames."""
    torch.manual_seed(0)
    m = _small(frame_wise=True, tubelet=(1, 8, 8)).eval()
    x = torch.randn(2, 1, 8, 32, 32)
    torch.testing.assert_close(m(x), m(x.flip(2)), rtol=1e-4, atol=1e-5)


@needs_ext
def test_axial_with_one_frame_is_criss_cross():
    """``0.5 A_W(A_H(A_T v)) + 0.5 A_T(A_H(A_W v))`` with T = 1 is ``criss_cross_attention`` (A_T = identity)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 5, 6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    la, lb, lg = (-torch.rand(2, 1, 5, 6, 2, generator=g, dtype=torch.float64) for _ in range(3))
    zt, zw = _line_attention(1, q, k, v, lg), _line_attention(3, q, k, v, la)
    zh = _line_attention(2, q, k, torch.cat([zt, zw], -1), lb)
    out = 0.5 * _line_attention(3, q, k, zh[..., :4], la) + 0.5 * _line_attention(1, q, k, zh[..., 4:], lg)
    torch.testing.assert_close(out[:, 0], ppma.ops.criss_cross_attention(q[:, 0], k[:, 0], v[:, 0], la[:, 0],
                                                                         lb[:, 0], 1.0))


@needs_ext
def test_axial_module_matches_reference_composition():
    """The axial module's output equals the same composition of dense 1-D masked attentions (reference ops)."""
    torch.manual_seed(0)
    m = PPMAAttention3D(16, 2, "axial").double()
    x = torch.randn(2, 3, 4, 5, 16, dtype=torch.float64)
    with ppma.ops.use_impl("reference"):
        want = m(x)
    torch.testing.assert_close(m(x), want)


def test_rope_3d_with_one_frame_is_2d():
    a = rotary_angle(8)
    s3, c3 = rotary_sin_cos_3d(a, 1, 5, 6)
    s2, c2 = rotary_sin_cos(a, 5, 6)
    assert torch.equal(s3[0], s2) and torch.equal(c3[0], c2)


def test_module_errors_named():
    with pytest.raises(ValueError, match=r"mixer must be one of \('axial', 'full', 'linear'\), got 'diagonal'"):
        PPMAAttention3D(16, 2, "diagonal")
    with pytest.raises(ValueError, match="mask must be"):
        PPMAAttention3D(16, 2, mask="manhattan")
    with pytest.raises(ValueError, match=r"x must be \[B, T, H, W, 16\]"):
        PPMAAttention3D(16, 2)(torch.randn(2, 3, 4, 16))


def test_moving_digits_deterministic_and_labelled_by_motion():
    pytest.importorskip("sklearn")
    from ppma.train.data_video import MovingDigits, build_moving_digits

    train, test = build_moving_digits()
    assert (len(train), len(test)) == (1437 * 3, 360 * 2)
    x0, y0 = train[5]
    x1, y1 = train[5]
    assert torch.equal(x0, x1) and y0 == y1 and x0.shape == (1, 8, 48, 48)
    counts = torch.bincount(torch.tensor(train.targets), minlength=4)
    assert counts.min() > 0.2 * len(train)
    # the centroid moves in the labelled direction
    steps = {0: (0, 1), 1: (0, -1), 2: (1, 0), 3: (-1, 0)}
    ii, jj = torch.meshgrid(torch.arange(48.0), torch.arange(48.0), indexing="ij")
    for idx in range(20):
        clip, label = test[idx]
        w = clip[0] + 1  # blank = 0
        ci = (w * ii).sum((1, 2)) / w.sum((1, 2))
        cj = (w * jj).sum((1, 2)) / w.sum((1, 2))
        di, dj = float(ci[-1] - ci[0]), float(cj[-1] - cj[0])
        want = steps[label]
        assert di * want[0] + dj * want[1] > 10 and abs(di * want[1]) + abs(dj * want[0]) < 1e-3
    with pytest.raises(ValueError, match="does not fit"):
        MovingDigits(torch.zeros(2, 40, 40), 1)


@needs_ext
def test_demo_config_builds_data_and_model():
    """configs/video/demo_moving_digits.yaml: the dataset and the model the training CLI builds from it."""
    pytest.importorskip("sklearn")
    import os

    from ppma.train.build import build_model
    from ppma.train.config import load_config
    from ppma.train.data import build_datasets

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "video",
                        "demo_moving_digits.yaml")
    cfg = load_config(path)
    train, val, batch_transform = build_datasets(cfg)
    assert batch_transform is None and len(train) == 4311 and len(val) == 720
    model = build_model(cfg.model, cfg.data.num_classes, train[0][0].shape[0])
    x = torch.stack([val[i][0] for i in range(2)])
    assert model(x).shape == (2, 4)
