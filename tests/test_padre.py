"""PADRe's polynomial token mixer (ppma.nn.padre): shapes, gradients, the polynomial's definition, the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_utils import assert_trains_one_step
from ppma.models.ppma import PPMA
from ppma.nn import PPMABlock
from ppma.nn.padre import PADReMixer


def _randomise(m: PADReMixer, seed: int = 0) -> PADReMixer:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return m


def _literal(m: PADReMixer, x: torch.Tensor) -> torch.Tensor:
    """The paper's equations written out with explicit weights: Y_i = K_i * (X A_i), Z_1 = Y_1,
    Z_{i+1} = (G_i * (Z_i D_i)) ⊙ Y_{i+1}, P = sum_{i>=2} w_i ⊙ Z_i, out = P W_o + b_o."""
    k = m.kernel_size

    def dw(t, conv):  # depthwise k x k convolution of [B, H, W, C] with zero padding
        return F.conv2d(t.permute(0, 3, 1, 2), conv.weight, padding=k // 2, groups=t.shape[-1]).permute(0, 2, 3, 1)

    Y = [dw(x @ a.weight.T, c) for a, c in zip(m.channel_in, m.token_in)]
    Z = [Y[0]]
    for i in range(1, m.degree):
        Z.append(dw(Z[-1] @ m.channel_z[i - 1].weight.T, m.token_z[i - 1]) * Y[i])
    P = sum(m.weight[i - 1] * Z[i] for i in range(1, m.degree))
    return P @ m.proj.weight.T + m.proj.bias


@pytest.mark.parametrize("degree", [2, 3])
@pytest.mark.parametrize("hw", [(5, 6), (1, 7), (3, 1)])
def test_padre_shapes_and_definition(degree, hw):
    m = _randomise(PADReMixer(8, degree=degree, kernel_size=3).double(), seed=degree)
    x = torch.randn(2, *hw, 8, dtype=torch.float64)
    out = m(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, _literal(m, x), rtol=1e-12, atol=1e-12)


def test_padre_tiny_input_by_hand():
    """One channel, a 1 x 3 map, kernel 1 (no token mixing), degree 3: scalar arithmetic by hand."""
    m = PADReMixer(1, degree=3, kernel_size=1).double()
    a1, a2, a3, d1, d2, k1, k2, k3, g1, g2, w2, w3, wo, bo = (0.5, -1.0, 2.0, 3.0, 0.25, 2.0, 1.0, -1.0, 0.5, 4.0,
                                                               1.5, -2.0, 0.75, 0.1)
    with torch.no_grad():
        for lin, val in zip([*m.channel_in, *m.channel_z], (a1, a2, a3, d1, d2)):
            lin.weight.fill_(val)
        for conv, val in zip([*m.token_in, *m.token_z], (k1, k2, k3, g1, g2)):
            conv.weight.fill_(val)
        m.weight.copy_(torch.tensor([[w2], [w3]]))
        m.proj.weight.fill_(wo)
        m.proj.bias.fill_(bo)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64).reshape(1, 1, 3, 1)
    y1, y2, y3 = a1 * k1 * x, a2 * k2 * x, a3 * k3 * x
    z2 = g1 * d1 * y1 * y2
    z3 = g2 * d2 * z2 * y3
    torch.testing.assert_close(m(x), wo * (w2 * z2 + w3 * z3) + bo)


def test_padre_is_a_polynomial():
    """Z_i is homogeneous of degree i (Lemma 1), so out(t x) - bias = sum_i t^i w_i Z_i(x) W_o."""
    m = _randomise(PADReMixer(6, degree=3, kernel_size=5).double())
    x = torch.randn(1, 4, 5, 6, dtype=torch.float64)
    for t in (2.0, -0.5):
        for i, (zt, z) in enumerate(zip(m.terms(t * x), m.terms(x)), start=1):
            torch.testing.assert_close(zt, t**i * z)
    bias = m.proj.bias
    lhs = m(3.0 * x) - bias
    rhs = sum(3.0**i * ((w * z) @ m.proj.weight.T) for i, (w, z) in enumerate(zip(m.weight, m.terms(x)[1:]), 2))
    torch.testing.assert_close(lhs, rhs)


def test_padre_gradcheck():
    m = _randomise(PADReMixer(3, degree=3, kernel_size=3).double())
    x = torch.randn(1, 3, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m, (x,))
    out = m(x)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_padre_bad_arguments_named():
    for kw, msg in (({"degree": 1}, "degree must be"), ({"kernel_size": 4}, "kernel_size must be")):
        with pytest.raises(ValueError, match=msg):
            PADReMixer(8, **kw)
    with pytest.raises(ValueError, match=r"x must be \[B, H, W, 8\]"):
        PADReMixer(8)(torch.randn(2, 3, 4, 5))


def test_padre_as_mixer_in_block_and_model():
    """mixer="padre" puts PADReMixer in the block's ``attn`` slot (any stage); the model trains one step (every
    parameter gets a gradient and moves, the loss goes down)."""
    block = PPMABlock(16, 2, mixer="padre")
    assert isinstance(block.attn, PADReMixer)
    assert block(torch.randn(2, 5, 4, 16)).shape == (2, 5, 4, 16)
    model = PPMA(embed_dims=(16, 32, 32, 32), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2), head_hidden_dim=32,
                 num_classes=3, mixer=("padre", "criss_cross", "padre", "full"))
    kinds = [type(s.blocks[0].attn).__name__ for s in model.stages]
    assert kinds == ["PADReMixer", "PPMAAttention", "PADReMixer", "PPMAAttention"]
    assert_trains_one_step(model, torch.randn(2, 3, 40, 36), num_classes=3)
    assert model.stages[0].blocks[0].attn.channel_in[0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="mixer"):
        PPMABlock(16, 2, mixer="mlp")
