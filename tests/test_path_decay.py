"""``ppma.ops.cpu.path_decay`` (PPMA's per-token log-decays, one CPU kernel each way) against ``path_decay_ref`` (the
``ppma.nn.PathDecay`` formula with torch's autograd) in float64: forward and the four gradients over swept shapes and
direction counts, gradcheck, thread-count invariance, every SIMD path, the softplus threshold and the underflow,
argument checks, opcheck, and the modules that use it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ppma
from op_utils import needs_ext
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
    with pytest.raises(RuntimeError, match="float32 or float64"):
        op(x.bfloat16(), w.bfloat16(), b.bfloat16(), a.bfloat16())
    with pytest.raises(RuntimeError, match="1 <= D <= 3"):
        op(x, torch.zeros(4, 4), b, a)
    with pytest.raises(RuntimeError, match="grad_out must be"):
        torch.ops.ppma.path_decay_backward(torch.zeros(2, 3, 2), x, w, b, a)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    x, w, b, a = _inputs((2, 3, 4), 2, 8, 2, dtype)
    A = -torch.exp(a)
    torch.library.opcheck(torch.ops.ppma.path_decay, (x, w, b, A), test_utils=("test_schema", "test_faketensor"))
    go = torch.randn(2, 3, 4, 2, 2, dtype=dtype)
    torch.library.opcheck(torch.ops.ppma.path_decay_backward, (go, x, w, b, A),
                          test_utils=("test_schema", "test_faketensor"))


_PATH_CODE = """
import json, torch, ppma
from ppma import backends
from ppma.ops.cpu.path_decay import path_decay
out = {"cap": backends.cpu_capability()}
for i, (lead, G, hd, D) in enumerate(CASES):
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
print(json.dumps(out))
"""
_PATH_CASES = [((2, 9, 11), 4, 16, 2), ((1, 5, 7), 3, 33, 3), ((2, 3), 5, 10, 1), ((1, 40, 9), 2, 32, 2)]


@needs_ext
@pytest.mark.parametrize("capability", backends.cpu_capabilities_available())
def test_every_simd_path(capability):
    """Each SIMD path the machine has (a fresh process capped at it) against float64, with dt_bias from -30 to 30
    (both sides of 0 and of the threshold) and head dims off the vector widths."""
    code = _PATH_CODE.replace("CASES", repr(_PATH_CASES))
    res = subprocess.run([sys.executable, "-c", code], env=cpu_subprocess_env(capability), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
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
