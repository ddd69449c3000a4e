"""The fused/reference switch of ``ppma.ops`` (``set_impl``, ``get_impl``, ``use_impl``, ``PPMA_IMPL``) and the
opt-in decay check's environment variable: what the ops run, restoring, tracing under ``torch.compile``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ppma.ops
from op_utils import make_attention_inputs, needs_ext
from ppma.ops import reference


def test_set_get_use_impl():
    assert ppma.ops.get_impl() == "fused" and ppma.ops.IMPLS == ("fused", "reference")
    with pytest.raises(ValueError, match=r"impl must be one of \('fused', 'reference'\), got 'cuda'"):
        ppma.ops.set_impl("cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        ppma.ops.use_impl("triton")
    with ppma.ops.use_impl("reference"):
        assert ppma.ops.get_impl() == "reference"
        with ppma.ops.use_impl(None):  # None keeps the current choice (an unset command-line flag)
            assert ppma.ops.get_impl() == "reference"
        with ppma.ops.use_impl("fused"):
            assert ppma.ops.get_impl() == "fused"
        assert ppma.ops.get_impl() == "reference"
    assert ppma.ops.get_impl() == "fused"
    with pytest.raises(KeyError), ppma.ops.use_impl("reference"):
        raise KeyError  # restored on the way out of an exception too
    assert ppma.ops.get_impl() == "fused"
    try:
        ppma.ops.set_impl("reference")
        assert ppma.ops.get_impl() == "reference"
    finally:
        ppma.ops.set_impl("fused")


@pytest.mark.parametrize("op", ["polyline_attention", "criss_cross_attention"])
def test_reference_impl_runs_the_reference(op):
    """With ``use_impl("reference")`` every op returns exactly what its reference returns, gradients included."""
    inputs = make_attention_inputs((2, 4, 5, 2, 8, 8), torch.float32)
    fn, ref = getattr(ppma.ops, op), getattr(reference, op + "_ref")
    with ppma.ops.use_impl("reference"):
        out = fn(*inputs, 0.3)
        grads = torch.autograd.grad(out.sum(), inputs)
    want = ref(*inputs, 0.3)
    assert torch.equal(out, want)
    for g, w in zip(grads, torch.autograd.grad(want.sum(), inputs)):
        assert torch.equal(g, w)


@needs_ext
def test_compile_guards_on_the_switch():
    """The wrappers read the switch at call time; dynamo guards on it, so switching recompiles instead of
    running a stale graph, and ``use_impl`` traces inside a compiled function (fullgraph)."""
    import torch._dynamo

    q, k, v, la, lb = make_attention_inputs((1, 4, 5, 2, 8, 8), torch.float32, requires_grad=False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(" ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda *a: ppma.ops.polyline_attention(*a), backend=backend, fullgraph=True)
    fused = f(q, k, v, la, lb)
    with ppma.ops.use_impl("reference"):
        assert torch.equal(f(q, k, v, la, lb), reference.polyline_attention_ref(q, k, v, la, lb))
    torch.testing.assert_close(f(q, k, v, la, lb), fused, rtol=0, atol=0)
    assert len(graphs) == 2
    assert "ppma.polyline_attention" in graphs[0] and "ppma." not in graphs[1]

    def both(*a):
        with ppma.ops.use_impl("reference"):
            r = ppma.ops.polyline_attention(*a)
        return r, ppma.ops.polyline_attention(*a)

    torch._dynamo.reset()
    r, fz = torch.compile(both, backend="eager", fullgraph=True)(q, k, v, la, lb)
    assert torch.equal(r, reference.polyline_attention_ref(q, k, v, la, lb))
    torch.testing.assert_close(fz, fused, rtol=0, atol=0)
    assert ppma.ops.get_impl() == "fused"
    torch._dynamo.reset()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


def test_environment_variables():
    """``PPMA_IMPL`` and ``PPMA_CHECK_DECAYS`` set the initial values (for tools that never call our Python)."""
    res = _run("import ppma.ops as o, ppma.ops._dispatch as d; print(o.get_impl(), d.check_decays_enabled())",
               PPMA_IMPL="reference", PPMA_CHECK_DECAYS="1")
    assert res.returncode == 0 and res.stdout.split() == ["reference", "True"], res.stderr[-2000:]
    res = _run("import ppma.ops", PPMA_IMPL="cuda")
    assert res.returncode != 0 and "PPMA_IMPL must be one of" in res.stderr


class _OnDevice:
    """Stands in for a tensor on a device this machine may not have (run_fused reads only ``.device``)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_cuda_kernels_can_be_switched_off(monkeypatch):
    # The CUDA kernels passed their tests on a GPU (CUDA_KERNELS_VERIFIED), so "fused" runs them by default; switched
    # off, CUDA tensors run the reference with a one-time notice naming both ways back; CPU tensors keep the CPU
    # kernels either way.
    from ppma.ops import _dispatch

    assert ppma.ops.CUDA_KERNELS_VERIFIED is True
    monkeypatch.setattr(_dispatch, "_FUSED_DEVICES", frozenset({"cpu", "meta", "cuda"}))
    monkeypatch.setattr(ppma.config, "_cuda_kernels", False)
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    cuda = _OnDevice("cuda")
    with pytest.warns(UserWarning, match=r"switched off.*unset PPMA_CUDA_KERNELS.*set_impl\(\"fused\", cuda_kernels=True\)"):
        assert not _dispatch.run_fused(cuda)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the notice is given once
        assert not _dispatch.run_fused(cuda)
        if ppma.has_ext():
            assert _dispatch.run_fused(torch.zeros(1))  # the CPU kernels stay the default
    try:
        ppma.ops.set_impl("fused", cuda_kernels=True)
        assert ppma.ops.cuda_kernels_enabled() and _dispatch.run_fused(cuda)
        ppma.ops.set_impl("fused")  # None keeps the choice
        assert ppma.ops.cuda_kernels_enabled()
        ppma.ops.set_impl("reference")
        assert not _dispatch.run_fused(cuda)
    finally:
        ppma.ops.set_impl("fused", cuda_kernels=False)
    assert not _dispatch.run_fused(cuda)


@pytest.mark.parametrize("value, expected", [(None, "True"), ("", "True"), ("0", "False"), ("1", "True")])
def test_cuda_kernels_env(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "PPMA_CUDA_KERNELS"}
    if value is not None:
        env["PPMA_CUDA_KERNELS"] = value
    out = subprocess.run([sys.executable, "-c", "import ppma.ops; print(ppma.ops.cuda_kernels_enabled())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected
