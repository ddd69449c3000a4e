"""CUDA-graph capture and replay of every op with CUDA kernels, forward and backward (docs/design.md §4.3).

``torch.compile(mode="reduce-overhead")`` (``ppma-benchmark --compile reduce-overhead``) runs the ops inside CUDA
graphs: their launchers must not synchronise with the host, allocate outside the caching allocator or read
anything per call that a replay would not see again. Each test captures the op (forward, or forward and
``backward``) once on static inputs, then copies fresh inputs into them, replays the graph and compares with an
eager call on the same inputs: equal bit for bit, as the kernels are deterministic (no atomics). Each runs with
the verified kernels and with the next ones (the internal option ``cuda_next_<op>`` = 1; the same kernel where
an op has no next one yet).

Needs a GPU and a build with the CUDA kernels (skipped elsewhere); ``benchmarks/gpu_run.sh`` runs it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ppma
import ppma.ops as ops
from ppma import _ext

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _ext.has_cuda_kernels()),
                                reason="needs a GPU and ppma._C built with its CUDA kernels")

# op -> (callable(q, k, v, la, lb) on the public API, q/k non-negative, option of its next kernel or None)
OPS = {
    "polyline_attention": (lambda q, k, v, la, lb: ops.polyline_attention(q, k, v, la, lb), False,
                           "cuda_next_polyline_attention"),
    "criss_cross_attention": (lambda q, k, v, la, lb: ops.criss_cross_attention(q, k, v, la, lb), False,
                              "cuda_next_criss_cross_attention"),
    "polyline_linear_attention": (lambda q, k, v, la, lb: ops.polyline_linear_attention(q, k, v, la, lb), True,
                                  "cuda_next_polyline_linear_attention"),
    # polyline_scan takes one feature tensor: q is x, k and v are unused
    "polyline_scan": (lambda q, k, v, la, lb: ops.polyline_scan(q, la, lb), False, None),
    "polyline_scan_transpose": (lambda q, k, v, la, lb: ops.polyline_scan(q, la, lb, transpose=True), False, None),
}
SHAPE = (2, 12, 20, 2, 32)  # W >= 16: polyline_attention's fast path; odd H


def _fresh(shape, dtype, nonneg, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    if nonneg:
        q, k = q.abs(), k.abs()
    la = -torch.rand(*shape[:4], generator=g) - 1e-3
    lb = -torch.rand(*shape[:4], generator=g) - 1e-3
    go = torch.randn(*shape, generator=g)
    return [t.to("cuda", dtype) for t in (q, k, v)] + [la.cuda(), lb.cuda()], go.to("cuda", dtype)


def _option(name, value):
    """The internal option ``name`` (None: nothing) set to ``value`` inside the block."""
    return contextlib.nullcontext() if name is None else ppma.config.internal_option(name, value)


def _params():
    for op, (_, _, opt) in OPS.items():
        for nxt in (0, 1) if opt else (0,):
            yield pytest.param(op, nxt, id=f"{op}-{'next' if nxt else 'verified'}")


@pytest.fixture(autouse=True)
def _fused():
    with ops.use_impl("fused"):
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op, nxt", list(_params()))
def test_graph_replay_forward_backward(op, nxt, dtype):
    fn, nonneg, opt = OPS[op]
    with _option(opt, nxt):
        ins, go = _fresh(SHAPE, dtype, nonneg, seed=0)
        static = [t.clone().requires_grad_(True) for t in ins]
        static_go = go.clone()
        # warm-up on a side stream (lazy initialisation, the allocator's first blocks), as torch.cuda.graph asks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*static).backward(static_go)
                for t in static:
                    t.grad = None
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(*static)
            static_out.backward(static_go)
        static_grads = [t.grad for t in static]
        assert all(g is not None for g in static_grads[:1] + static_grads[3:])
        for seed in (1, 2):
            ins, go = _fresh(SHAPE, dtype, nonneg, seed)
            with torch.no_grad():
                for s, t in zip(static, ins):
                    s.copy_(t)
                static_go.copy_(go)
            graph.replay()
            eager = [t.clone().requires_grad_(True) for t in ins]
            out = fn(*eager)
            used = [t for t, g in zip(eager, static_grads) if g is not None]
            grads = torch.autograd.grad(out, used, go)
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out, out, rtol=0, atol=0)
            for got, want in zip([g for g in static_grads if g is not None], grads):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op, nxt", list(_params()))
def test_graph_replay_inference(op, nxt):
    """The forward alone under ``torch.inference_mode`` (the path of ``model.eval()`` inference)."""
    fn, nonneg, opt = OPS[op]
    with _option(opt, nxt), torch.inference_mode():
        ins, _ = _fresh(SHAPE, torch.float16, nonneg, seed=0)
        static = [t.clone() for t in ins]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(*static)
        for seed in (3, 4):
            ins, _ = _fresh(SHAPE, torch.float16, nonneg, seed)
            for s, t in zip(static, ins):
                s.copy_(t)
            graph.replay()
            torch.testing.assert_close(static_out, fn(*ins), rtol=0, atol=0)


def test_compiled_model_with_cuda_graphs():
    """A small PPMA model under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs): its training step's loss
    and gradients match the eager model's (the same kernels; Inductor may fuse the rest differently)."""
    from ppma.models import create_model

    torch.manual_seed(0)
    model = create_model("ppma_tiny", num_classes=10, drop_path_rate=0.0, embed_dims=[16, 32, 32, 32],
                         depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2]).cuda()
    model.eval()  # batch norm on its running statistics: the same function in every call, gradients still flow
    x = torch.randn(2, 3, 64, 64, device="cuda")
    y = torch.tensor([1, 3], device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead")

    def step(m):
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions in both: the two differ by fusion order only
    try:
        want_loss, want_grads = step(model)
        for _ in range(3):  # cudagraph trees record on the second or third call, then replay
            got_loss, got_grads = step(compiled)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    assert len(got_grads) == len(want_grads)
    got, want = torch.cat([g.flatten() for g in got_grads]), torch.cat([g.flatten() for g in want_grads])
    assert torch.isfinite(got).all() and ((got - want).norm() / want.norm()).item() < 1e-3
