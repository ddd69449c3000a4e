"""The ablation masks (ppma.nn.masks, docs/ops.md "Masks") against dense constructions of their definitions.

Each mask is written here from its definition, pair by pair, as two ``N x N`` log-masks ``(M_a, M_b)`` and the
criss-cross direction weights; the attention of the definition is then built densely (criss-cross stages as
block-sparse row and column attention matrices) and compared with what the module computes.
"""

from __future__ import annotations

import math

import pytest
import torch

import ppma
from model_utils import assert_trains_one_step
from op_utils import assert_close, make_attention_inputs, needs_ext
from ppma.models.ppma import MODEL_CONFIGS, PPMA
from ppma.nn import PPMAAttention
from ppma.nn.masks import MASKS, hilbert_order, masked_attention, order_log_mask, rmt_log_gammas

SHAPES = [(1, 3, 4, 2, 8, 8), (2, 4, 3, 1, 8, 6), (1, 1, 5, 2, 8, 8), (1, 5, 1, 1, 8, 8), (1, 2, 2, 1, 4, 4)]


def _seg(seq, p, r):
    """sum of seq[min(p, r) + 1 .. max(p, r)] (the edge convention of docs/model.md §1.2)."""
    lo, hi = min(p, r), max(p, r)
    return sum((seq[n] for n in range(lo + 1, hi + 1)), torch.zeros_like(seq[0]))


def _v2h(la, lb, H, W):
    """V2H polyline log-mask of one image and head: row segment in the query's row, column segment in the
    key's column (docs/model.md §1.3, Eq. 3)."""
    M = torch.zeros(H * W, H * W, dtype=la.dtype)
    for i in range(H):
        for j in range(W):
            for k in range(H):
                for l in range(W):
                    M[i * W + j, k * W + l] = _seg(la[i, :], j, l) + _seg(lb[:, l], i, k)
    return M


def _order_mask(seq_of, pos):
    """1-D bidirectional mask along a token order: ``pos[u]`` the position of token u, ``seq_of[t]`` the decay
    at position t."""
    N = len(pos)
    M = torch.zeros(N, N, dtype=seq_of.dtype)
    for u in range(N):
        for v in range(N):
            M[u, v] = _seg(seq_of, pos[u], pos[v])
    return M


def definition(mask, la, lb, gamma=(2.0, 4.0)):
    """``(M_a, M_b, (w_a, w_b))`` of ``mask`` from its definition, ``M: [B, heads, N, N]``; ``la, lb`` are the
    decay module's outputs ``[B, H, W, heads]`` for the masks that have one."""
    B, H, W, G = la.shape
    Ma = torch.zeros(B, G, H * W, H * W, dtype=la.dtype)
    Mb = torch.zeros_like(Ma)
    weights = (0.0, 1.0) if mask == "v2h" else (0.5, 0.5)
    for b in range(B):
        for g in range(G):
            a, c = la[b, :, :, g], lb[b, :, :, g]
            if mask in ("polyline", "shared"):
                Ma[b, g] = _v2h(a, c, H, W)
                Mb[b, g] = Ma[b, g].T
            elif mask == "v2h":
                Ma[b, g] = Mb[b, g] = _v2h(a, c, H, W)
            elif mask == "manhattan":  # RMT: decay_h = log(1 - 2^(-init - range * h / heads)), times |di| + |dj|
                decay = math.log(1 - 2 ** (-gamma[0] - gamma[1] * g / G))
                for u in range(H * W):
                    for v in range(H * W):
                        Ma[b, g, u, v] = decay * (abs(u // W - v // W) + abs(u % W - v % W))
                Mb[b, g] = Ma[b, g]
            elif mask == "cross_scan":
                Ma[b, g] = _order_mask(a.reshape(-1), list(range(H * W)))  # row-major order, alpha
                col_pos = [(u % W) * H + u // W for u in range(H * W)]  # column-major position of token u
                Mb[b, g] = _order_mask(c.T.reshape(-1), col_pos)
            elif mask == "hilbert":
                order = hilbert_order(H, W).tolist()
                pos = [0] * (H * W)
                for t, u in enumerate(order):
                    pos[u] = t
                Ma[b, g] = _order_mask(a.reshape(-1)[order], pos)
                order_t = hilbert_order(W, H).tolist()  # the curve of the transposed map: token (j, i) = j * H + i
                pos_t = [0] * (H * W)
                for t, ut in enumerate(order_t):
                    pos_t[(ut % H) * W + ut // H] = t
                Mb[b, g] = _order_mask(torch.stack([c.T.reshape(-1)[ut] for ut in order_t]), pos_t)
            elif mask != "none":
                raise AssertionError(mask)
    return Ma, Mb, weights


def dense_attention(mode, q, k, v, Ma, Mb, weights, scale):
    """The attention of ``(M_a, M_b, weights)`` built densely over all ``N`` tokens (fp64)."""
    B, H, W, G, D = q.shape
    qf, kf, vf = (t.double().reshape(B, H * W, G, -1).transpose(1, 2) for t in (q, k, v))
    S = scale * qf @ kf.transpose(-1, -2)
    if mode == "full":
        P = 0.5 * torch.softmax(S + Ma, -1) + 0.5 * torch.softmax(S + Mb, -1)
        out = P @ vf
    else:
        idx = torch.arange(H * W)
        same_row = (idx[:, None] // W) == (idx[None, :] // W)
        same_col = (idx[:, None] % W) == (idx[None, :] % W)
        A = torch.softmax((S + Ma).masked_fill(~same_row, -math.inf), -1)  # row attention, block-sparse
        Bm = torch.softmax((S + Mb).masked_fill(~same_col, -math.inf), -1)  # column attention
        out = weights[0] * Bm @ (A @ vf) + weights[1] * A @ (Bm @ vf)
    return out.transpose(1, 2).reshape(B, H, W, G, -1)


def decays_for(mask, la, lb, gamma=(2.0, 4.0)):
    """What the mask's decay module gives the attention op, for the op-level tests."""
    G = la.shape[-1]
    if mask == "none":
        return torch.zeros_like(la), torch.zeros_like(lb)
    if mask == "manhattan":
        d = torch.tensor([math.log(1 - 2 ** (-gamma[0] - gamma[1] * g / G)) for g in range(G)], dtype=la.dtype)
        return d.expand_as(la).clone(), d.expand_as(lb).clone()
    if mask == "shared":
        return la, la
    return la, lb


@needs_ext
@pytest.mark.parametrize("mode", ["full", "criss_cross"])
@pytest.mark.parametrize("mask", MASKS)
def test_mask_attention_matches_definition(mask, mode):
    """Forward and gradients of every mask in both modes against the dense construction of its definition, on
    square, non-square and 1-wide maps (fp64)."""
    for shape in SHAPES:
        q, k, v, la, lb = make_attention_inputs(shape, torch.float64, seed=sum(shape))
        la, lb = decays_for(mask, la, lb)
        scale = 0.7 * shape[4] ** -0.5
        out = masked_attention(mask, mode, q, k, v, la, lb, scale)
        Ma, Mb, w = definition(mask, la, lb)  # differentiable in the decays (for their gradients)
        want = dense_attention(mode, q, k, v, Ma, Mb, w, scale)
        assert_close(out, want, torch.float64, f"{mask}/{mode} {shape} forward")
        go = torch.randn_like(want)
        leaves = [t for t in (q, k, v, la, lb) if t.requires_grad]
        got = torch.autograd.grad(out, leaves, go, allow_unused=True)
        exp = torch.autograd.grad(want, leaves, go, allow_unused=True)
        for name, g1, g2 in zip("q k v log_alpha log_beta".split(), got, exp):
            g1 = torch.zeros_like(g2) if g1 is None else g1
            g2 = torch.zeros_like(g1) if g2 is None else g2
            assert_close(g1, g2, torch.float64, f"{mask}/{mode} {shape} grad {name}", grad=True, floor=1e-12)


@pytest.mark.parametrize("hw", [(3, 4), (1, 6), (5, 1), (4, 4)])
def test_order_masks_match_definition(hw):
    """Mask values: the dense 1-D order masks (cross_scan, hilbert) and the polyline mask with RMT's constant
    decays (manhattan) against the pair-by-pair definitions."""
    H, W = hw
    _, _, _, la, lb = make_attention_inputs((2, H, W, 2, 4, 4), torch.float64, requires_grad=False)
    for mask in ("cross_scan", "hilbert"):
        Ma, Mb, _ = definition(mask, la, lb)
        order_a = torch.arange(H * W) if mask == "cross_scan" else hilbert_order(H, W)
        order_t = torch.arange(H * W) if mask == "cross_scan" else hilbert_order(W, H)
        order_b = (order_t % H) * W + order_t // H
        torch.testing.assert_close(order_log_mask(la, order_a), Ma, rtol=0, atol=1e-12)
        torch.testing.assert_close(order_log_mask(lb, order_b), Mb, rtol=0, atol=1e-12)
    da, db = decays_for("manhattan", la, lb)
    Ma, _, _ = definition("manhattan", la, lb)
    torch.testing.assert_close(ppma.ops.reference.polyline_log_mask(da, db), Ma, rtol=0, atol=1e-12)


def test_rmt_gamma_schedule():
    """RMT's formula log(1 - 2^(-init - range * h / heads)), and the per-stage schedules of the variants
    (docs/model.md §4.1: init 2, ranges 4, 4, 6, 6 for T and S, 5, 5, 6, 6 for B)."""
    want = [math.log(1 - 2 ** (-2 - 6 * h / 8)) for h in range(8)]
    torch.testing.assert_close(rmt_log_gammas(8, 2.0, 6.0), torch.tensor(want, dtype=torch.float64))
    for name, ranges in (("ppma_tiny", (4, 4, 6, 6)), ("ppma_base", (5, 5, 6, 6))):
        model = PPMA(MODEL_CONFIGS[name], mask="manhattan", depths=(1, 1, 1, 1))
        for s, stage in enumerate(model.stages):
            attn = stage.blocks[0].attn
            torch.testing.assert_close(attn.decay.log_gamma, rmt_log_gammas(attn.num_heads, 2.0, ranges[s]))


@pytest.mark.parametrize("hw", [(1, 1), (1, 7), (6, 1), (2, 2), (4, 4), (8, 8), (3, 5), (5, 3), (7, 7), (5, 12),
                                (13, 4), (6, 9), (14, 14), (16, 16)])
def test_hilbert_order_is_a_curve(hw):
    """Every token once, starting at (0, 0), each step to a 4-neighbour, except one diagonal step when the
    shorter side is even and the longer odd (the generalised curve's known exception)."""
    H, W = hw
    order = hilbert_order(H, W)
    assert sorted(order.tolist()) == list(range(H * W)) and order[0] == 0
    i, j = order // W, order % W
    di, dj = i.diff().abs(), j.diff().abs()
    diagonal = (di == 1) & (dj == 1)
    assert ((di + dj == 1) | diagonal).all()
    assert diagonal.sum() <= (1 if min(H, W) % 2 == 0 and max(H, W) % 2 == 1 else 0)
    if H == W and H & (H - 1) == 0:  # the classic Hilbert curve on 2^n squares ends at another corner
        assert order[-1].item() in (W - 1, (H - 1) * W)


@pytest.mark.parametrize("mask", MASKS)
def test_module_decays_parameters_and_state_dict(mask):
    """The decay module each mask builds: what it feeds the op, its parameters and its state-dict keys."""
    torch.manual_seed(0)
    attn = PPMAAttention(32, 2, "full", mask=mask).double()
    x = torch.randn(2, 3, 4, 32, dtype=torch.float64)
    seen = {}
    attn.attn_op.register_forward_hook(lambda m, args, out: seen.update(args=args))
    attn(x)
    la, lb = seen["args"][3:]
    keys = {k for k in attn.state_dict() if k.startswith("decay.")}
    if mask in ("none", "manhattan"):
        assert not keys and not list(attn.decay.parameters())
        gam = torch.zeros(2) if mask == "none" else rmt_log_gammas(2, 2.0, 4.0)
        torch.testing.assert_close(la, gam.double().expand_as(la)), torch.testing.assert_close(lb, la)
    elif mask == "shared":
        assert torch.equal(la, lb) and keys == {"decay.dt_linear.weight", "decay.dt_bias", "decay.A_log"}
        assert attn.decay.dt_linear.weight.shape == (1, 16)
    else:
        assert keys == {"decay.dt_linear.weight", "decay.dt_bias", "decay.A_log"} and not torch.equal(la, lb)


def test_polyline_default_unchanged():
    """mask="polyline" builds today's module: the same parameters in the same order from the same seed, and
    the op it runs is the fused polyline op itself."""
    torch.manual_seed(3)
    a = PPMAAttention(32, 2, "criss_cross")
    torch.manual_seed(3)
    b = PPMAAttention(32, 2, "criss_cross", mask="polyline")
    assert [k for k, _ in a.named_parameters()] == [k for k, _ in b.named_parameters()]
    assert all(torch.equal(p, r) for p, r in zip(a.parameters(), b.parameters()))
    assert type(a.decay).__name__ == "PathDecay" and "mask" not in repr(a)


def test_bad_mask_named():
    with pytest.raises(ValueError, match="mask must be one of"):
        PPMAAttention(32, 2, mask="diagonal")
    with pytest.raises(ValueError, match="mask must be one of"):
        masked_attention("diagonal", "full", *make_attention_inputs((1, 2, 2, 1, 4, 4)), 1.0)


def test_mask_and_mixer_through_create_model_and_timm():
    """``mask`` and ``mixer`` reach every block from ``ppma.create_model`` and from timm's registry."""
    kw = dict(depths=(1, 1, 1, 1), mask="cross_scan", mixer=("criss_cross", "padre", "full", "full"))
    models = [ppma.create_model("ppma_tiny", **kw)]
    timm = pytest.importorskip("timm")
    models.append(timm.create_model("ppma_tiny", **kw))
    for model in models:
        blocks = [s.blocks[0].attn for s in model.stages]
        assert [type(b).__name__ for b in blocks] == ["PPMAAttention", "PADReMixer", "PPMAAttention", "PPMAAttention"]
        assert all(b.mask == "cross_scan" for b in blocks if isinstance(b, PPMAAttention))


@pytest.mark.parametrize("mask", MASKS)
def test_small_model_trains_with_mask(mask):
    """A small model with each mask (criss-cross and full stages, odd map sizes) takes a training step: every
    parameter gets a gradient and moves, the loss goes down; fp64 gives the same logits as fp32 to fp32 precision
    (the constant decays are not rounded by a dtype change of the model)."""
    torch.manual_seed(0)
    model = PPMA(embed_dims=(16, 32, 32, 32), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2), head_hidden_dim=32,
                 num_classes=3, mask=mask)
    x = torch.randn(2, 3, 20, 28)  # stage maps 5 x 7, 3 x 4, 2 x 2, 1 x 1
    assert_trains_one_step(model, x, num_classes=3)
    model.eval()
    out = model(x)
    torch.testing.assert_close(model.double()(x.double()).float(), out.detach(), rtol=1e-4, atol=1e-5)
