"""``ppma.ops.polyline_linear_attention`` (PPMLA, docs/model.md §2 Theorem 3 / A.7, docs/ops.md) on every available device,
with and without normalisation: the fused op against its dense reference over the swept shapes and dtypes,
every gradient, the scan form against ``polyline_scan``, and the contract every op keeps (op_utils)."""

from __future__ import annotations

import pytest
import torch

from op_utils import (
    DEVICES,
    OpTests,
    assert_raises_cases,
    attention_shape_cases,
    check_against_reference,
    make_attention_inputs,
    needs_ext,
    shape_id,
)
from ppma.ops import polyline_linear_attention, polyline_scan
from ppma.ops.reference import polyline_linear_attention_ref


def make_linear_inputs(shape, dtype=torch.float64, device="cpu", **kw):
    """``make_attention_inputs`` with non-negative ``q, k`` (|x|: the op's contract, features already mapped)."""
    inputs = make_attention_inputs(shape, dtype, device, **kw)
    if inputs[0].device.type != "meta":
        with torch.no_grad():
            inputs[0].abs_()
            inputs[1].abs_()
    return inputs


class TestPolylineLinearAttention(OpTests):
    op = "polyline_linear_attention"
    fn = staticmethod(polyline_linear_attention)
    ref = staticmethod(polyline_linear_attention_ref)
    grad_names = ("q", "k", "v", "log_alpha", "log_beta")
    gradcheck_shapes = ((1, 2, 3, 2, 8, 8), (2, 3, 1, 1, 8, 4), (1, 1, 4, 1, 8, 8))

    @pytest.fixture(params=[True, False], ids=["normalize", "plain"])
    def variant(self, request):
        return request.param

    def inputs(self, shape, dtype=torch.float64, device="cpu", **kw):
        return make_linear_inputs(shape, dtype, device, **kw)

    def extra(self, shape, variant=None):
        return (variant is not False, 1e-6)  # normalize, eps

    def backward_args(self, inputs, outs):
        return (*inputs, outs[1])  # stats

    @needs_ext
    def test_matches_reference(self, device, shape, dtype, variant):
        """As in OpTests, except that with normalisation a one-token grid has dq, dk that cancel to ~eps
        (the output is v whatever q and k are): measured against their size without the cancellation."""
        B, H, W = shape[:3]
        if variant is not False and H * W == 1:
            inputs, extra = self.inputs(shape, dtype, device), self.extra(shape, variant)
            q, k, v = (t.detach() for t in inputs[:3])
            scale = v.norm().item() * max(q.norm(dim=-1).max().item(), k.norm(dim=-1).max().item())
            floor = scale / (q * k).sum(-1).min().item()
            check_against_reference(self.fn, self.ref, inputs, extra, names=self.grad_names, dtype=dtype,
                                    device=device, floors={"q": floor, "k": floor})
            return
        super().test_matches_reference(device, shape, dtype, variant)

    @needs_ext
    @pytest.mark.parametrize("shape", [(2, 7, 8, 2, 16, 16), (1, 13, 3, 4, 32, 32)], ids=shape_id)
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("device", DEVICES)
    def test_low_precision(self, device, shape, dtype, variant):
        check_against_reference(self.fn, self.ref, self.inputs(shape, dtype, device), self.extra(shape, variant),
                                names=self.grad_names, dtype=dtype, device=device)

    @needs_ext
    @pytest.mark.parametrize("device", DEVICES)
    def test_eps_enters_the_normaliser(self, device):
        """A large ``eps`` changes the result as the definition says (the kernel does not ignore it)."""
        shape = (1, 4, 5, 2, 8, 8)
        inputs = self.inputs(shape, torch.float64, device)
        for eps in (0.0, 3.0):
            check_against_reference(self.fn, self.ref, inputs, (True, eps), names=self.grad_names,
                                    dtype=torch.float64, device=device)

    @pytest.mark.parametrize("transpose", [False, True], ids=["V2H", "H2V"])
    def test_scan_form_matches_definition(self, transpose):
        """Theorem 3: ``((q k^T) * L) v = q^T (L (k ⊗ v))`` with ``L`` applied by ``polyline_scan`` (an independent
        op), for each direction; the reference's dense terms are recovered from it."""
        B, H, W, G, d, dv = 2, 5, 4, 2, 3, 4
        q, k, v, la, lb = self.inputs((B, H, W, G, d, dv), requires_grad=False)
        kv = (k[..., :, None] * v[..., None, :]).reshape(B, H, W, G, d * dv)
        scanned = polyline_scan(kv, la, lb, transpose).reshape(B, H, W, G, d, dv)
        term = torch.einsum("bhwgd,bhwgde->bhwge", q, scanned)
        other = polyline_scan(kv, la, lb, not transpose).reshape(B, H, W, G, d, dv)
        both = term + torch.einsum("bhwgd,bhwgde->bhwge", q, other)
        torch.testing.assert_close(self.ref(q, k, v, la, lb, False), 0.5 * both)

    def test_bad_inputs_named(self):
        q, k, v, la, lb = self.inputs((2, 5, 6, 2, 8, 8), requires_grad=False)
        cases = attention_shape_cases(q, k, v, la, lb) + [
            ((q, k, v, la, lb, 1), TypeError, "normalize must be a bool", True),
            ((q, k, v, la, lb, True, "1e-6"), TypeError, "eps must be a real number", True),
            ((q, k, v, la, lb, True, -1e-6), ValueError, "eps must be finite and >= 0", True),
            ((q, k, v, la, lb, True, float("nan")), ValueError, "eps must be finite and >= 0", True),
            ((q, k, v, la, lb, True, float("inf")), ValueError, "eps must be finite and >= 0", True),
        ]
        assert_raises_cases(cases, self.fn, self.ref)

    @needs_ext
    def test_bad_inputs_reach_cpp_checks(self):
        q, k, v, la, lb = self.inputs((2, 5, 6, 2, 8, 8), requires_grad=False)
        op = self.registered()
        with pytest.raises(RuntimeError, match=r"log_alpha must be \[B, H, W, heads\]"):
            op(q, k, v, la[:, :3], lb, True, 1e-6)
        with pytest.raises(RuntimeError, match="eps must be finite"):
            op(q, k, v, la, lb, True, -1.0)
        out, stats = op(q, k, v, la, lb, True, 1e-6)
        with pytest.raises(RuntimeError, match="stats must have shape"):
            torch.ops.ppma.polyline_linear_attention_backward(out, q, k, v, la, lb, stats, False, 1e-6)


def literal_linear_attention(q, k, v, la, lb, normalize, eps):
    """docs/ops.md "polyline_linear_attention" evaluated term by term with Python loops over tokens: the V2H mask
    ``L[p, s]`` for ``p = (i, j)``, ``s = (m, l)`` is the product of alpha over row ``i`` between columns ``j`` and
    ``l`` (the later ones) times the product of beta over column ``l`` between rows ``i`` and ``m`` (docs/ops.md
    "Prefix sums and biases"); H2V is ``L[s, p]``; ``A[p, s] = <q_p, k_s>``."""
    B, H, W, G, _ = q.shape
    alpha, beta = la.exp(), lb.exp()
    out = torch.zeros(B, H, W, G, v.shape[-1], dtype=torch.float64)
    toks = [(i, j) for i in range(H) for j in range(W)]

    def v2h(b, g, p, s):
        (i, j), (m, l) = p, s
        w = 1.0
        for n in range(min(j, l) + 1, max(j, l) + 1):
            w *= alpha[b, i, n, g].item()
        for n in range(min(i, m) + 1, max(i, m) + 1):
            w *= beta[b, n, l, g].item()
        return w

    for b in range(B):
        for g in range(G):
            for p in toks:
                for mask in (lambda s: v2h(b, g, p, s), lambda s: v2h(b, g, s, p)):  # V2H, H2V
                    num, den = torch.zeros(v.shape[-1], dtype=torch.float64), 0.0
                    for s in toks:
                        a = float(torch.dot(q[b, p[0], p[1], g], k[b, s[0], s[1], g])) * mask(s)
                        num += a * v[b, s[0], s[1], g]
                        den += a
                    out[b, p[0], p[1], g] += 0.5 * (num / (den + eps) if normalize else num)
    return out


@pytest.mark.parametrize("normalize,eps", [(True, 1e-6), (True, 0.5), (False, 1e-6)])
def test_reference_matches_the_literal_definition(normalize, eps):
    """The dense reference (the oracle of the kernels) against the definition built pair by pair, both
    directions, with and without normalisation, on a non-square map with several heads."""
    q, k, v, la, lb = make_linear_inputs((2, 3, 4, 2, 3, 2), requires_grad=False, decay_scale=1.0)
    want = literal_linear_attention(q, k, v, la, lb, normalize, eps)
    torch.testing.assert_close(polyline_linear_attention_ref(q, k, v, la, lb, normalize, eps), want,
                               rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# The backbone option: mixer="linear" (PPMAAttention, PPMAConfig, timm, mmengine)
# ------------------------------------------------------------------------------------------------

TINY_KW = dict(embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4))


@pytest.mark.parametrize("softmax_mixer", ["full", "criss_cross"])
def test_linear_attention_module(softmax_mixer):
    """Same parameters as the softmax attention of either layout; the output is the op on elu+1 features of the
    module's rotated q and scaled, rotated k (a linear layer always attends over the whole map)."""
    from ppma.nn import PPMAAttention
    from ppma.nn.attention import LinearAttentionOp

    torch.manual_seed(0)
    soft = PPMAAttention(32, 2, softmax_mixer)
    lin = PPMAAttention(32, 2, "linear")
    assert isinstance(lin.attn_op, LinearAttentionOp) and "mixer='linear'" in repr(lin)
    assert [(n, p.shape) for n, p in soft.named_parameters()] == [(n, p.shape) for n, p in lin.named_parameters()]
    lin.load_state_dict(soft.state_dict())
    seen = {}
    lin.attn_op.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    x = torch.randn(2, 5, 7, 32)
    y = lin(x)
    q, k, v, la, lb = seen["args"]
    phi = lambda t: torch.nn.functional.elu(t) + 1  # noqa: E731
    torch.testing.assert_close(seen["out"], polyline_linear_attention_ref(phi(q), phi(k), v, la, lb))
    y.square().sum().backward()
    assert all(p.grad is not None for p in lin.parameters())
    PPMAAttention(32, 2, softmax_mixer, mask="manhattan")  # an ablation mask with softmax attention
    with pytest.raises(ValueError, match="mixer='linear' supports mask='polyline' only"):
        PPMAAttention(32, 2, "linear", mask="manhattan")


def test_model_with_linear_stages():
    """``create_model(..., mixer=...)`` per stage: PPMA-T's parameter count is unchanged, fused == reference
    forward and gradients, and one string sets every stage."""
    import ppma

    full = ppma.create_model("ppma_tiny", mixer=("criss_cross", "criss_cross", "linear", "linear"), num_classes=1000)
    assert sum(p.numel() for p in full.parameters()) == 14_335_272
    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10, mixer="linear", **TINY_KW)
    assert model.cfg.mixer == ("linear",) * 4
    x = torch.randn(2, 3, 64, 80)
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with ppma.ops.use_impl("reference"):
        ref = model(x)
        ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_timm_and_mmengine_accept_linear_attention():
    timm = pytest.importorskip("timm")
    import ppma.models  # noqa: F401  (registers the models)

    m = timm.create_model("ppma_tiny", num_classes=3, mixer=["criss_cross", "full", "linear", "linear"], **TINY_KW)
    assert m.cfg.mixer == ("criss_cross", "full", "linear", "linear")
    assert m(torch.randn(1, 3, 64, 64)).shape == (1, 3)
    pytest.importorskip("mmengine")
    from mmengine.registry import MODELS

    import ppma.models.mm  # noqa: F401

    bb = MODELS.build(dict(type="PPMA", arch="tiny", mixer="linear", drop_path_rate=0.0, **TINY_KW)).eval()
    with torch.no_grad():
        outs = bb(torch.randn(1, 3, 64, 96))
    assert bb.cfg.mixer == ("linear",) * 4 and [o.shape[1] for o in outs] == [32, 64, 96, 128]
