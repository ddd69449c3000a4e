"""The GMACs of README "Models" (PPMA-T/S/B: 2.696 / 4.896 / 10.593 at 224², the paper's Table 1) derived by hand,
layer by layer, from the architecture (``PPMAConfig``), and ``ppma.models.count_macs`` (FlopCounterMode with the
fused ops' formulas of ``ppma/models/flops.py``) checked against that count and against FlopCounterMode on the
reference model (whose attention is plain ``bmm``s, counted by torch itself).

Convention (``ppma/models/flops.py``): multiply-accumulates of convolutions and matrix products; no biases,
norms, activations, softmax or elementwise ops."""

from __future__ import annotations

import pytest
import torch

import ppma
from ppma.models import MODEL_CONFIGS, count_macs
from op_utils import needs_ext

PAPER_GMACS = {"ppma_tiny": 2.696, "ppma_small": 4.896, "ppma_base": 10.593}


def macs_by_hand(cfg, img: int = 224) -> int:
    """MACs of one 224² image through a PPMA with architecture ``cfg``, layer by layer."""
    total = 0
    # stem: conv 3x3 s2 (in -> C0/2), conv 3x3 (C0/2), conv 3x3 s2 (C0/2 -> C0), conv 3x3 (C0)
    half = cfg.embed_dims[0] // 2
    r = img // 2
    total += r * r * (cfg.in_chans * half * 9 + half * half * 9)
    r //= 2
    total += r * r * (half * cfg.embed_dims[0] * 9 + cfg.embed_dims[0] ** 2 * 9)
    prev = cfg.embed_dims[0]
    for s, (C, depth, heads, ratio, mixer) in enumerate(zip(cfg.embed_dims, cfg.depths, cfg.num_heads,
                                                              cfg.mlp_ratios, cfg.mixer)):
        assert mixer in ("criss_cross", "full"), f"counted by hand for softmax attention only, got {mixer!r}"
        cc = mixer == "criss_cross"
        if s > 0:  # downsample: conv 3x3 s2 (prev -> C)
            r //= 2
            total += r * r * prev * C * 9
        N, hidden, hd = r * r, int(C * ratio), C // heads
        block = 0
        block += N * C * 9  # conditional position encoding: depthwise 3x3
        block += 4 * N * C * C  # q, k, v and output projections
        block += N * C * 25  # LePE: depthwise 5x5 on v
        block += N * heads * hd * 2  # decay projection: head_dim -> 2 directions, per head and token
        if cc:
            # per head: row logits (N queries x r keys x hd), column logits (same), and four map-times-value
            # products (V2H and H2V, each a row and a column product): N x r x hd each
            block += heads * (2 * N * r * hd + 4 * N * r * hd)
        else:
            block += heads * (N * N * hd + N * N * hd)  # q k^T and P v over all N tokens (one P: summed softmaxes)
        block += N * C * hidden + N * hidden * 9 + N * hidden * C  # ConvFFN: fc1, depthwise 3x3, fc2
        total += depth * block
        prev = C
    total += r * r * prev * cfg.head_hidden_dim  # head: per-token projection to head_hidden_dim
    total += cfg.head_hidden_dim * cfg.num_classes  # classifier
    return total


@pytest.mark.parametrize("name", sorted(PAPER_GMACS))
def test_hand_count_matches_the_paper(name):
    assert round(macs_by_hand(MODEL_CONFIGS[name]) / 1e9, 3) == PAPER_GMACS[name]


@needs_ext
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_counter_matches_the_hand_count_on_ppma_tiny(impl):
    """``count_macs`` on PPMA-T equals the hand count exactly, with the fused ops (their registered formulas) and
    with the reference (torch counting the reference's own matrix products)."""
    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny")
    with ppma.ops.use_impl(impl):
        assert count_macs(model, (1, 3, 224, 224)) == macs_by_hand(MODEL_CONFIGS["ppma_tiny"])
