"""Parity of ``ppma.models.PPMA`` with an independent re-statement of the official model
(``tests/official_like.py``): same logits and the same gradient for every parameter, after converting the
official-named weights with ``convert_official_state_dict`` (docs/model.md §3, §4, §5)."""

from __future__ import annotations

import math
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import official_like  # noqa: E402
from conftest import FULL  # noqa: E402

import ppma.nn  # noqa: E402
import ppma.ops  # noqa: E402
from ppma.models import PPMA, MODEL_CONFIGS, convert_official_state_dict  # noqa: E402

warnings.filterwarnings("ignore", message="ppma._C is not available")


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter and buffer a non-trivial value (order-1 activations, decays far from 1,
    layer scales of order 1, BN statistics away from identity) so that parity checks see every term."""
    g = torch.Generator().manual_seed(seed)

    def n(t, s):
        return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) * s

    def u(t, lo, hi):
        return (torch.rand(t.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(t.dtype)

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or name.endswith("angle"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "running_var":
            t.copy_(u(t, 0.5, 1.5))
        elif leaf == "running_mean":
            t.copy_(n(t, 0.1))
        elif leaf == "A_log":
            t.copy_(u(t, -1.0, 1.0))
        elif leaf == "dt_bias":
            t.copy_(n(t, 1.0))
        elif leaf.startswith("gamma"):
            t.copy_(u(t, 0.5, 1.5))
        elif t.dim() == 1 and leaf == "weight":  # LayerNorm / BatchNorm scale
            t.copy_(1 + n(t, 0.1))
        elif leaf == "bias":
            t.copy_(n(t, 0.1))
        else:  # Linear / conv weights
            fan_in = math.prod(t.shape[1:])
            t.copy_(n(t, fan_in**-0.5))


def _official_kwargs(cfg) -> dict:
    return dict(
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dims=cfg.embed_dims,
        depths=cfg.depths,
        num_heads=cfg.num_heads,
        mlp_ratios=cfg.mlp_ratios,
        chunkwise_recurrents=tuple(m == "criss_cross" for m in cfg.mixer),
        layerscales=cfg.layerscale,
        layer_init_values=cfg.layer_init_values,
        projection=cfg.head_hidden_dim,
    )


def _pair(cfg, dtype, seed=0):
    torch.manual_seed(seed)
    official = official_like.PPMAViT(**_official_kwargs(cfg)).to(dtype).eval()
    randomize_(official, seed)
    ours = PPMA(cfg, drop_path_rate=0.0).to(dtype).eval()
    ours.load_state_dict(convert_official_state_dict(official.state_dict(), verbose=False), strict=True)
    return official, ours


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(cfg, size, dtype, impl, grads: bool, tol: float):
    with ppma.ops.use_impl(impl):
        _check_pair(*_pair(cfg, dtype), cfg, size, dtype, grads, tol)


def _check_pair(official, ours, cfg, size, dtype, grads: bool, tol: float):
    x = torch.randn(2, cfg.in_chans, *size, dtype=dtype, generator=torch.Generator().manual_seed(1))
    y_ref = official(x)
    y = ours(x)
    assert y.shape == y_ref.shape
    assert _rel_err(y, y_ref) < tol, f"logits differ: rel err {_rel_err(y, y_ref):.3e}"
    if not grads:
        return
    w = torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    (y_ref * w).sum().backward()
    (y * w).sum().backward()
    ref_grads = convert_official_state_dict(
        {k: p.grad for k, p in official.named_parameters()}, verbose=False
    )
    checked = 0
    for name, p in ours.named_parameters():
        g_ref = ref_grads[name]
        assert p.grad is not None, name
        err = _rel_err(p.grad, g_ref)
        assert err < tol * 10, f"grad of {name} differs: rel err {err:.3e}"
        checked += 1
    assert checked == len(ref_grads)


TINY = MODEL_CONFIGS["ppma_tiny"]
# a small config with every feature: layer scale, both modes in odd stage orders
SMALL_ALL = MODEL_CONFIGS["ppma_base"].__class__(
    embed_dims=(32, 48, 64, 96),
    depths=(1, 2, 1, 1),
    num_heads=(2, 3, 4, 4),
    mlp_ratios=(2, 3, 2.5, 2),
    mixer=("criss_cross", "full", "criss_cross", "full"),
    layerscale=(True, False, True, True),
    num_classes=17,
    head_hidden_dim=64,
)


def test_tiny_224_fp64_logits():
    _check(TINY, (224, 224), torch.float64, "fused", grads=False, tol=1e-10)


def test_tiny_224_fp32_logits_and_grads():
    _check(TINY, (224, 224), torch.float32, "fused", grads=True, tol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_tiny_nonsquare_logits_and_grads(dtype, tol):
    _check(TINY, (97, 150), dtype, "fused", grads=True, tol=tol)


def test_tiny_reference_impl_fp64_logits_and_grads():
    _check(TINY, (72, 50), torch.float64, "reference", grads=True, tol=1e-10)


@pytest.mark.parametrize("size", [(64, 64), (45, 83)])
def test_all_features_config(size):
    """Layer scale (as in PPMA-B), both attention modes in every stage position, odd head counts."""
    _check(SMALL_ALL, size, torch.float64, "fused", grads=True, tol=1e-10)


@pytest.mark.parametrize("name", ["ppma_small", "ppma_base"])
def test_small_base_logits_and_grads(name):
    """PPMA-S/B: fp64 logits and every gradient at a small non-square input (default); fp32 at 224² (full run)."""
    _check(MODEL_CONFIGS[name], (64, 96), torch.float64, "fused", grads=True, tol=1e-10)
    if FULL:
        _check(MODEL_CONFIGS[name], (224, 224), torch.float32, "fused", grads=True, tol=1e-4)


def _check_fused(cfg, size, tol, amp=False):
    """fp32 inference of the model after ``ppma.nn.fuse_for_inference`` (the path of every CPU deployment) against
    the re-statement's fp32 logits; with ``amp`` under bf16 autocast (oneDNN's bf16 kernels)."""
    official, ours = _pair(cfg, torch.float32)
    x = torch.randn(1, cfg.in_chans, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_ref = official(x)
    ppma.nn.fuse_for_inference(ours)
    assert ppma.nn.is_fused(ours) and ours.stem.fused
    assert all(b.fused and b.attn.fused and b.mlp.fused for s in ours.stages for b in s.blocks)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = ours(x)
    assert y.shape == y_ref.shape and y.dtype == (torch.bfloat16 if amp else torch.float32)
    err = _rel_err(y.float(), y_ref)
    assert err < tol, f"fused logits differ: rel err {err:.3e}"


@pytest.mark.parametrize("name", ["ppma_tiny", "ppma_small", "ppma_base"])
def test_fused_inference_fp32(name):
    """PPMA-T/S/B after the deployment step, fp32 inference, against the re-statement."""
    _check_fused(MODEL_CONFIGS[name], (64, 64), 1e-4)


@pytest.mark.parametrize("size", [(64, 64), (45, 83)])
def test_fused_inference_all_features(size):
    """The small all-features model after the deployment step, fp32 inference, against the re-statement."""
    _check_fused(SMALL_ALL, size, 1e-4)


def test_fused_inference_bf16_autocast():
    """The small all-features model after the deployment step under bf16 autocast, within bf16 rounding of the
    re-statement's fp32 logits."""
    _check_fused(SMALL_ALL, (64, 64), 3e-2, amp=True)
