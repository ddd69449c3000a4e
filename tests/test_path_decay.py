"""``ppma.ops.cpu.path_decay`` (PPMA's per-token log-decays, one CPU kernel each way) against ``path_decay_ref`` (the
``ppma.nn.PathDecay`` formula with torch's autograd) in float64: forward and the four gradients over swept shapes and
direction counts, gradcheck, thread-count invariance, every SIMD path, the softplus threshold and the underflow,
argument checks, opcheck, and the modules that use it. Under CPU bf16 autocast (a bf16 ``x``, float32 parameters):
the forward and the gradients against the reference under autocast and a float64 evaluation of autocast's formula,
bitwise the same on 1, 2 and 3 threads, every SIMD path, and the gate (bf16 autocast only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ppma
from op_utils import assert_close, needs_ext
from ppma import backends
from ppma.nn import PathDecay, PathDecay3D
from ppma.nn.masks import SharedDecay
from ppma.ops.cpu.path_decay import path_decay, path_decay_ref, uses_path_decay_kernel
from test_cpu_baseline import ROOT, cpu_subprocess_env

# (leading dims, heads, head_dim): head dims on and off the vector widths (16, 32; 10, 33, 1), more tokens than one
# of the kernel's 256-token chunks and one 32-token block, and PPMA-T's stage shapes.
SHAPES = [((2, 9, 11), 4, 16), ((3, 5, 7), 3, 10), ((1, 23, 17), 5, 33), ((2, 3), 2, 1), ((8, 14, 14), 8, 32),
          ((1, 1, 1), 1, 16), ((2, 20, 17), 4, 32)]


def _inputs(lead, G, hd, D, dtype=torch.float64, seed=0, bias_shift=-3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, G * hd, generator=g, dtype=torch.float64)
    w = torch.randn(D, hd, generator=g, dtype=torch.float64) * hd ** -0.5
    b = torch.randn(G, generator=g, dtype=torch.float64) * 2 + bias_shift
    a = torch.log(torch.rand(G, generator=g, dtype=torch.float64) + 0.5)
    return [t.to(dtype) for t in (x, w, b, a)]


def _run(fn, inputs, go):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    d = fn(*leaves)
    d.backward(go)
    return [d.detach()] + [t.grad for t in leaves]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs() / b.abs().clamp_min(1e-30)).max().item()


@needs_ext
def test_kernel_taken():
    x, w, b, a = _inputs((2, 3, 4), 2, 8, 2, torch.float32)
    assert uses_path_decay_kernel(x, w, b, a)
    d = path_decay(x.requires_grad_(), w, b, a)
    assert type(d.grad_fn).__name__ == "_PathDecayBackward"
    with ppma.ops.use_impl("reference"):
        assert not uses_path_decay_kernel(x, w, b, a)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_path_decay_kernel(x, w, b, a)


@needs_ext
@pytest.mark.parametrize("D", [1, 2, 3])
@pytest.mark.parametrize("lead,G,hd", SHAPES)
def test_matches_reference(lead, G, hd, D):
    """float32: the output within 4x torch's own float32 error (elementwise relative, floor 4e-6) of float64, the
    gradients of x, weight, dt_bias and A_log within 2e-5 of their largest value; float64 within 1e-12."""
    inputs = _inputs(lead, G, hd, D)
    go = torch.randn(*lead, G, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _run(path_decay_ref, inputs, go)
    torch32 = _run(path_decay_ref, [t.float() for t in inputs], go.float())
    ours32 = _run(path_decay, [t.float() for t in inputs], go.float())
    ours64 = _run(path_decay, inputs, go)
    assert ours32[0].dtype == torch.float32 and ours32[0].shape == (*lead, G, D)
    assert _max_rel(ours32[0], ref[0]) <= max(4 * _max_rel(torch32[0], ref[0]), 4e-6)
    names = ("d", "grad x", "grad weight", "grad dt_bias", "grad A_log")
    for name, o32, o64, r in zip(names, ours32, ours64, ref):
        scale = r.abs().max().item() or 1.0
        assert (o32.double() - r).abs().max().item() <= 2e-5 * scale, name
        assert (o64 - r).abs().max().item() <= 1e-12 * scale, name


@needs_ext
def test_gradcheck():
    inputs = [t.requires_grad_() for t in _inputs((2, 3, 5), 3, 4, 2, bias_shift=0.0)]
    assert torch.autograd.gradcheck(path_decay, inputs)


@needs_ext
def test_deterministic_across_threads():
    """1 and 3 threads give the same bits: the backward's sums go through fixed 256-token chunks (680 tokens: 3)."""
    inputs = [t.float() for t in _inputs((2, 20, 17), 4, 32, 2)]
    go = torch.randn(2, 20, 17, 4, 2, generator=torch.Generator().manual_seed(1))
    n = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 3, 1):
            torch.set_num_threads(threads)
            runs.append(_run(path_decay, inputs, go))
    finally:
        torch.set_num_threads(n)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


@needs_ext
def test_threshold_and_underflow():
    """Above torch's softplus threshold (z > 20) softplus(z) = z and its slope is 1, as torch's; far below 0 the
    decay is 0 (torch's is a denormal there) with zero gradients; NaN in x propagates to that token only."""
    x, w, b, a = _inputs((1, 2, 3), 3, 8, 2, torch.float32)
    b = torch.tensor([25.0, -120.0, 0.0])
    go = torch.ones(1, 2, 3, 3, 2)
    ours = _run(path_decay, [x, w, b, a], go)
    ref = _run(path_decay_ref, [x, w, b, a], go)
    torch.testing.assert_close(ours[0][..., 0, :], ref[0][..., 0, :], rtol=2e-6, atol=0)
    assert torch.all(ours[0][..., 1, :] == 0) and torch.all(ref[0][..., 1, :].abs() < 1e-40)
    for o, r in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(o, r, rtol=2e-5, atol=1e-6)
    xn = x.clone()
    xn[0, 1, 2, 0] = float("nan")  # token (0, 1, 2), head 0
    d = path_decay(xn, w, b, a)
    assert torch.isnan(d[0, 1, 2, 0]).all() and not torch.isnan(d[0, 1, 2, 1:]).any()
    assert not torch.isnan(d[0, 0]).any()


def test_argument_checks():
    x, w, b, a = _inputs((2, 3), 2, 4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., heads \* head_dim\]"):
        path_decay(x[..., :7], w, b, a)
    with pytest.raises(ValueError, match="weight must be"):
        path_decay(x, w[0], b, a)
    with pytest.raises(ValueError, match="A_log"):
        path_decay(x, w, b, a[:1])
    with pytest.raises(TypeError, match="dt_bias must be a tensor"):
        path_decay(x, w, 1.0, a)


@needs_ext
def test_op_argument_checks():
    x, w, b, a = _inputs((2, 3), 2, 4, 2, torch.float32)
    op = torch.ops.ppma.path_decay
    with pytest.raises(RuntimeError, match="heads \\* head_dim"):
        op(x[..., :7], w, b, a)
    with pytest.raises(RuntimeError, match="weight has dtype"):
        op(x, w.double(), b, a)
    with pytest.raises(RuntimeError, match="x must be float32, float64 or bfloat16"):
        op(x.half(), w.half(), b.half(), a.half())
    with pytest.raises(RuntimeError, match="weight must be a float32 tensor on x's device for a bfloat16 x"):
        op(x.bfloat16(), w.bfloat16(), b, a)
    with pytest.raises(RuntimeError, match="A must be a float32 tensor"):
        torch.ops.ppma.path_decay_backward(torch.zeros(2, 3, 2, 2), x.bfloat16(), w, b, a.double())
    with pytest.raises(RuntimeError, match="1 <= D <= 3"):
        op(x, torch.zeros(4, 4), b, a)
    with pytest.raises(RuntimeError, match="grad_out must be"):
        torch.ops.ppma.path_decay_backward(torch.zeros(2, 3, 2), x, w, b, a)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_opcheck(dtype):
    """Schema and fake kernels; bfloat16: a bf16 x with float32 parameters (float32 decays, a bf16 grad_x)."""
    x, w, b, a = _inputs((2, 3, 4), 2, 8, 2, torch.float32 if dtype == torch.bfloat16 else dtype)
    x = x.to(dtype)
    A = -torch.exp(a)
    torch.library.opcheck(torch.ops.ppma.path_decay, (x, w, b, A), test_utils=("test_schema", "test_faketensor"))
    go = torch.randn(2, 3, 4, 2, 2, dtype=A.dtype)
    torch.library.opcheck(torch.ops.ppma.path_decay_backward, (go, x, w, b, A),
                          test_utils=("test_schema", "test_faketensor"))


_PATH_CODE = """
import json, torch, ppma
from ppma import backends
from ppma.ops.cpu.path_decay import path_decay
out = {"cap": backends.cpu_capability()}
for i, (lead, G, hd, D) in enumerate(FP32_CASES):
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(*lead, G * hd, generator=gen)
    w = torch.randn(D, hd, generator=gen) * hd ** -0.5
    b = torch.linspace(-30, 30, G)
    a = torch.log(torch.rand(G, generator=gen) + 0.5)
    go = torch.randn((*lead, G, D), generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, a)]
    path_decay(*leaves).backward(go)
    results = [path_decay(x, w, b, a)] + [t.grad for t in leaves]
    out[str(i)] = {"inputs": [t.flatten().tolist() for t in (x, w, b, a, go)],
                   "results": [t.double().flatten().tolist() for t in results]}
import sys
for i, (x, w, b, a, go) in enumerate(torch.load(sys.argv[1])):  # the bf16 cases: the kernel under bf16 autocast
    leaves = [t.requires_grad_() for t in (x, w, b, a)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = path_decay(*leaves)
    out["bf16_%d" % i] = [t.double().flatten().tolist() for t in (d.detach(), *torch.autograd.grad(d, leaves, go))]
print(json.dumps(out))
"""
_PATH_CASES = [((2, 9, 11), 4, 16, 2), ((1, 5, 7), 3, 33, 3), ((2, 3), 5, 10, 1), ((1, 40, 9), 2, 32, 2)]


@needs_ext
@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_every_simd_path(capability, tmp_path):
    """Each SIMD path the machine has (a fresh process capped at it) against float64, with dt_bias from -30 to 30
    (both sides of 0 and of the threshold) and head dims off the vector widths; and the bf16-autocast cases
    (``BF16_CASES``) in the same process, held to :func:`_check_bf16`."""
    code = _PATH_CODE.replace("FP32_CASES", repr(_PATH_CASES))
    torch.save([_bf16_inputs(*case) for case in BF16_CASES], tmp_path / "bf16_inputs.pt")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bf16_inputs.pt")],
                         env=cpu_subprocess_env(capability), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cap"] == capability
    for i, (lead, G, hd, D) in enumerate(_PATH_CASES):
        shapes = ((*lead, G * hd), (D, hd), (G,), (G,), (*lead, G, D))
        x, w, b, a, go = (torch.tensor(t, dtype=torch.float64).view(sh) for t, sh in zip(got[str(i)]["inputs"], shapes))
        ref = _run(path_decay_ref, [x, w, b, a], go)  # the child's float32 inputs, in float64
        for k, (values, r) in enumerate(zip(got[str(i)]["results"], ref)):
            o = torch.tensor(values, dtype=torch.float64).view(r.shape)
            scale = r.abs().max().item() or 1.0
            assert (o - r).abs().max().item() <= 2e-5 * scale, (capability, i, k)
    for i, case in enumerate(BF16_CASES):
        inputs = _bf16_inputs(*case)
        want = _bf16_run(path_decay_ref, *inputs)
        ours = [torch.tensor(v, dtype=torch.float64).to(e.dtype).view(e.shape) for v, e in zip(got[f"bf16_{i}"], want)]
        _check_bf16(ours, want, _bf16_ref64(*inputs), f"{capability} {case}")


@needs_ext
@pytest.mark.parametrize("cls,x_shape", [(PathDecay, (2, 5, 6, 32)), (SharedDecay, (2, 5, 6, 32)),
                                          (PathDecay3D, (2, 2, 3, 4, 32))])
def test_modules(cls, x_shape):
    """The decay modules run the kernel on the CPU (fused implementation) and equal their torch formula (the
    reference implementation) up to float32 rounding, gradients of every parameter included; a forward hook on
    ``dt_linear`` sends them through the module (the hook sees its call)."""
    torch.manual_seed(0)
    m = cls(32, 4)
    x = torch.randn(x_shape)

    def run():
        m.zero_grad()
        xl = x.clone().requires_grad_()
        outs = m(xl)
        sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        return [o.detach() for o in outs] + [xl.grad] + [p.grad.clone() for p in m.parameters()]

    fused = run()
    d0 = m(x.clone().requires_grad_())[0]  # d[..., 0] of the kernel's output
    assert type(d0.grad_fn.next_functions[0][0]).__name__ == "_PathDecayBackward"
    with ppma.ops.use_impl("reference"):
        ref = run()
    for f, r in zip(fused, ref):
        torch.testing.assert_close(f, r, rtol=2e-5, atol=2e-6)
    calls = []
    h = m.dt_linear.register_forward_hook(lambda *args: calls.append(1))
    try:
        hooked = run()
    finally:
        h.remove()
    assert calls
    for f, r in zip(hooked, ref):
        torch.testing.assert_close(f, r, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# A bf16 x under CPU bf16 autocast (float32 parameters; docs/ops.md "path_decay")
# ------------------------------------------------------------------------------------------------

BF16 = torch.bfloat16
# (leading dims, heads, head_dim, D): head dims on and off the lane widths (16, 32; 10, 33), D = 1, 2 and 3, and more
# tokens than one 256-token chunk (391, 392).
BF16_CASES = [((2, 9, 11), 4, 16, 2), ((1, 23, 17), 3, 33, 3), ((3, 5), 2, 10, 1), ((2, 14, 14), 2, 32, 2)]
HALF_ULP = 2.0 ** -8  # half a bf16 unit in the last place, relative: one rounding to nearest even
ULP = 2.0 ** -7  # a bf16 unit in the last place, relative (at most)


def _bf16_inputs(lead, G, hd, D, seed=0):
    """bf16 x; float32 weight (not bf16 values: the kernel rounds it as autocast does), dt_bias (the last head's at
    21: z on both sides of softplus's threshold 20), A_log and grad_d."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, G * hd, generator=g).to(BF16)
    w = torch.randn(D, hd, generator=g) * hd ** -0.5
    b = torch.randn(G, generator=g) * 2 - 1
    b[-1] = 21.0
    a = torch.log(torch.rand(G, generator=g) + 0.5)
    go = torch.randn(*lead, G, D, generator=g)
    return x, w, b, a, go


def _bf16_run(fn, x, w, b, a, go):
    """``[d, grad x, grad weight, grad dt_bias, grad A_log]`` of ``fn`` under CPU bf16 autocast (the backward outside
    it, as a training step's)."""
    leaves = [t.clone().requires_grad_() for t in (x, w, b, a)]
    with torch.autocast("cpu", dtype=BF16):
        d = fn(*leaves)
    return [d.detach(), *torch.autograd.grad(d, leaves, go)]


def _bf16_ref64(x, w, b, a, go):
    """Autocast's formula in float64 on the same values: ``u = <x_g, bf16(weight[c])>`` rounded to bf16,
    ``z = u + dt_bias``, ``d = softplus(z) * A``; ``gu = gd * A * sigmoid(z)`` rounded to bf16 for grad x and grad
    weight (autocast's linear layer gets the bf16 gradient of its bf16 output), not for grad dt_bias. Returns
    ``([d, grad x, grad weight, grad dt_bias, grad A_log], u, z)``."""
    G, hd, D = b.shape[0], w.shape[1], w.shape[0]
    xd = x.double().reshape(*x.shape[:-1], G, hd)
    wb = w.to(BF16).double()
    u = (xd @ wb.T).to(BF16).double()
    z = u + b.double()[:, None]
    A = -torch.exp(a.double())
    sp = F.softplus(z)  # torch's threshold: z itself above 20, slope 1
    gu = go.double() * A[:, None] * torch.where(z > 20, 1.0, torch.sigmoid(z))
    gub = gu.to(BF16).double()
    grads = [(gub @ wb).reshape(x.shape), torch.einsum("...gc,...gh->ch", gub, xd), gu.reshape(-1, G, D).sum((0, 2)),
             (go.double() * sp).reshape(-1, G, D).sum((0, 2)) * A]
    return [sp * A[:, None], *grads], u, z


def _check_bf16(ours, ref, ref64, what):
    """The kernel's ``ours`` against ``ref`` (``path_decay_ref`` under autocast) and ``ref64`` (:func:`_bf16_ref64`).

    d (float32): the kernel sums u in float32 in another order than autocast's GEMM (and float64) and rounds it to
    bf16 once, so its u is theirs except where a sum lands on the other side of a rounding boundary (about 1 in 10^4),
    where it is the neighbour, at most one unit (2^-7 |u|) away. Every d is within that unit times the slope
    ``|A| sigmoid(z)`` plus float32 softplus error, and all but 1 % within the float32 error alone (1e-5 relative):
    a u left unrounded (up to half a unit off everywhere) fails the latter.
    grad x (bf16, one rounding of a float32 sum of bf16(gu) * bf16(w)): all but 1 % bitwise autocast's and within one
    rounding (2^-8 relative) of float64; all within the bf16 norm tolerance.
    grad weight (float32 sums of bf16(gu) * x): float64's within the float32 tolerance (1e-5, norm); autocast's rounds
    its sum to bf16: within one rounding of it, elementwise.
    grad dt_bias, grad A_log (float32 sums of float32 terms): a token whose u took the other neighbour moves its
    terms by up to ~1 %, so 2e-4 (relative norm) of both.
    """
    d, gx, gw, gb, ga = ours
    assert d.dtype == gw.dtype == gb.dtype == ga.dtype == torch.float32 and gx.dtype == BF16, what
    want, u, z = ref64
    slope = want[0].abs() / F.softplus(z).clamp_min(1e-300) * torch.where(z > 20, 1.0, torch.sigmoid(z))  # |A| s(z)
    for name, other in (("float64", want[0]), ("autocast", ref[0].double())):
        err = (d.double() - other).abs()
        tight = 1e-5 * other.abs() + 1e-30
        assert (err <= slope * (ULP * u.abs() + 1e-6) + tight).all(), f"{what}: d past one bf16 unit of u ({name})"
        assert (err > tight).double().mean().item() <= 0.01, f"{what}: d not autocast's rounding of u ({name})"
    scale = want[1].abs().max().item()
    near = (gx.double() - want[1]).abs() <= HALF_ULP * want[1].abs() + 1e-6 * scale
    assert near.double().mean().item() >= 0.99, f"{what}: grad x past one bf16 rounding of float64"
    assert (gx != ref[1]).double().mean().item() <= 0.01, f"{what}: grad x not autocast's"
    assert_close(gx, want[1], BF16, f"{what}: grad x", grad=True)
    assert_close(gw, want[2], torch.float32, f"{what}: grad weight", grad=True)
    scale = ref[2].abs().max().item()
    assert ((gw - ref[2]).abs() <= HALF_ULP * ref[2].abs() + 1e-5 * scale).all(), f"{what}: grad weight (autocast)"
    for name, o, r, r64 in (("grad dt_bias", gb, ref[3], want[3]), ("grad A_log", ga, ref[4], want[4])):
        assert_close(o, r64, torch.float32, f"{what}: {name}", grad=True, mult=20)
        assert_close(o, r, torch.float32, f"{what}: {name} (autocast)", grad=True, mult=20)


@needs_ext
@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_bf16_autocast_matches_reference(case):
    """Under CPU bf16 autocast the kernels give autocast's formula: the reference under autocast and float64 on the
    same values (:func:`_check_bf16`'s tolerances)."""
    inputs = _bf16_inputs(*case)
    with torch.autocast("cpu", dtype=BF16):
        assert uses_path_decay_kernel(*inputs[:4])
    ours = _bf16_run(path_decay, *inputs)
    _check_bf16(ours, _bf16_run(path_decay_ref, *inputs), _bf16_ref64(*inputs), str(case))


@needs_ext
def test_bf16_deterministic_across_threads():
    """A bf16 x of 800 tokens (4 chunks): the same bits on 1, 2 and 3 threads, forward and backward."""
    x, w, b, a, go = _bf16_inputs((2, 20, 20), 2, 32, 2, seed=3)
    A = -torch.exp(a)
    n = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append([torch.ops.ppma.path_decay(x, w, b, A), *torch.ops.ppma.path_decay_backward(go, x, w, b, A)])
    finally:
        torch.set_num_threads(n)
    for run in runs[1:]:
        for name, p, q in zip(("d", "grad x", "grad weight", "grad dt_bias", "grad A"), runs[0], run):
            assert p.dtype == q.dtype and torch.equal(p, q), name


@needs_ext
def test_bf16_gate():
    """The bf16 case only under CPU bf16 autocast with a bf16 x and float32 parameters; the modules follow."""
    x, w, b, a, _ = _bf16_inputs((2, 3, 4), 2, 8, 2)
    xf = x.float()
    assert not uses_path_decay_kernel(x, w, b, a)  # bf16 outside autocast: the reference, which wants one dtype
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        path_decay(x, w, b, a)
    with torch.autocast("cpu", dtype=BF16):
        assert uses_path_decay_kernel(x, w, b, a)
        assert not uses_path_decay_kernel(xf, w, b, a)  # float32 x under autocast
        assert not uses_path_decay_kernel(x, w.to(BF16), b, a)
        assert not uses_path_decay_kernel(x, w, b, a.double())
        with ppma.ops.use_impl("reference"):
            assert not uses_path_decay_kernel(x, w, b, a)
    with torch.autocast("cpu", dtype=torch.float16):
        for xx in (x, x.half(), xf):
            assert not uses_path_decay_kernel(xx, w, b, a)
    m = PathDecay(32, 4)
    xm = torch.randn(2, 3, 4, 32).to(BF16).requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        assert type(m.decays(xm).grad_fn).__name__ == "_PathDecayBackward"
    with torch.autocast("cpu", dtype=torch.float16):
        assert type(m.decays(xm.detach().half().requires_grad_()).grad_fn).__name__ != "_PathDecayBackward"
