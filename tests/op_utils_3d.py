"""What the 3-D op tests share (paper appendix C.2; docs/video.md): input builders for the
``[B, T, H, W, heads, c]`` layout, a literal pair-by-pair construction of the 3-D mask from its definition, and the
generic 3-D op tests as a base class that ``tests/test_polyline_*_3d.py`` subclass. The comparisons, tolerances and
thread/determinism helpers are those of ``op_utils`` (the 2-D ``OpTests`` index decays as ``[B, H, W, heads]`` and
cannot run on 3-D tensors, so the same contract is restated here for the 3-D layout).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import ppma
from op_utils import assert_close, assert_thread_invariant, check_against_reference, needs_ext
from ppma.ops import _dispatch

# (B, T, H, W, heads, d, dv)
SHAPES_3D = (
    (1, 1, 1, 1, 1, 8, 8),
    (2, 3, 1, 4, 2, 8, 8),
    (1, 4, 3, 1, 1, 16, 12),
    (2, 2, 3, 4, 2, 8, 8),
    (1, 5, 4, 3, 3, 16, 16),
    (1, 8, 6, 5, 1, 32, 32),
    (1, 1, 7, 9, 2, 16, 8),
)


def sid(shape) -> str:
    return "x".join(map(str, shape))


def make_inputs_3d(shape, dtype=torch.float64, *, decay_scale=0.5, seed=0, requires_grad=True, nonneg=False,
                   device="cpu"):
    """``[q, k, v, log_alpha, log_beta, log_gamma]`` for ``shape = (B, T, H, W, heads, d, dv)``: normal features
    (``|.|`` of q, k with ``nonneg``), log-decays uniform in ``[-decay_scale, 0]`` (fp32 for low precision)."""
    B, T, H, W, G, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, W, G, d, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, W, G, dv, generator=gen)
    if nonneg:
        q, k = q.abs(), k.abs()
    decs = [-decay_scale * torch.rand(B, T, H, W, G, generator=gen) for _ in range(3)]
    ddt = torch.float64 if dtype == torch.float64 else torch.float32
    out = [t.to(device, dtype) for t in (q, k, v)] + [t.to(device, ddt) for t in decs]
    return [t.requires_grad_(requires_grad) for t in out]


def literal_mask_3d(la, lb, lg) -> torch.Tensor:
    """``M[b, g, p, s]`` pair by pair from the definition (paper appendix C.2): for query ``p = (t, i, j)`` and key
    ``s = (u, k, l)``, ``Gamma_(k,l)[t..u] + Beta_(t,l)[i..k] + Alpha_(t,i)[j..l]``, each the sum of the line's
    log-decays (floored at -1e4) at indices ``min+1 .. max``. Slow; small shapes only."""
    B, T, H, W, G = la.shape
    la, lb, lg = (x.detach().double().clamp_min(-1e4) for x in (la, lb, lg))

    def seg(line, a, b):
        lo, hi = min(a, b), max(a, b)
        return line[lo + 1 : hi + 1].sum()

    N = T * H * W
    M = torch.zeros(B, G, N, N, dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            for p in range(N):
                t, i, j = p // (H * W), (p // W) % H, p % W
                for s in range(N):
                    u, k, l = s // (H * W), (s // W) % H, s % W
                    M[b, g, p, s] = seg(lg[b, :, k, l, g], t, u) + seg(lb[b, t, :, l, g], i, k) + seg(
                        la[b, t, i, :, g], j, l)
    return M


class Op3DTests:
    """The contract of every 3-D op. A subclass sets ``op`` (the name under ``torch.ops.ppma``), ``fn`` / ``ref``
    (wrapper and reference, as ``staticmethod``), ``fn2d`` (the 2-D op it equals at ``T = 1``), ``grad_names``,
    ``nonneg`` (q, k non-negative), and implements ``extra`` and ``backward_args``; ``to_2d`` maps the 3-D inputs
    of ``T = 1`` to the 2-D op's."""

    op: str
    fn = None
    ref = None
    fn2d = None
    grad_names: tuple
    nonneg = False
    gradcheck_shapes = ((1, 2, 2, 3, 2, 4, 3), (1, 3, 1, 2, 1, 4, 2))

    @pytest.fixture
    def variant(self):
        return None

    def extra(self, variant=None) -> tuple:
        raise NotImplementedError

    def backward_args(self, inputs, outs) -> tuple:
        raise NotImplementedError

    def inputs(self, shape, dtype=torch.float64, **kw):
        return make_inputs_3d(shape, dtype, nonneg=self.nonneg, **kw)

    def to_2d(self, inputs):
        return [t[:, 0] for t in inputs[:-1]]  # drop T and log_gamma

    def registered(self):
        return getattr(torch.ops.ppma, self.op)

    @property
    def nd(self) -> int:  # tensors before the three decays
        return len(self.grad_names) - 3

    def decay_grads_zero_at_line_starts(self, grads):
        ga, gb, gg = grads[self.nd :]
        assert not ga[:, :, :, 0].any() and not gb[:, :, 0].any() and not gg[:, 0].any()

    # ---------------------------------------------------------------- against the reference
    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    @pytest.mark.parametrize("shape", SHAPES_3D, ids=sid)
    def test_matches_reference(self, shape, dtype, variant):
        inputs = self.inputs(shape, dtype, decay_scale=1.0)
        grads = check_against_reference(self.fn, self.ref, inputs, self.extra(variant), names=self.grad_names,
                                        dtype=dtype)
        self.decay_grads_zero_at_line_starts(grads)

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
    def test_low_precision(self, dtype, variant):
        """16-bit features (fp32 decays), computed in fp32 as the reference does, within the 16-bit tolerance."""
        inputs = self.inputs((2, 3, 4, 5, 2, 16, 16), dtype)
        check_against_reference(self.fn, self.ref, inputs, self.extra(variant), names=self.grad_names, dtype=dtype)

    @needs_ext
    def test_gradcheck(self, variant):
        for shape in self.gradcheck_shapes:
            inputs = self.inputs(shape, torch.float64)
            assert torch.autograd.gradcheck(lambda *a: self.fn(*a, *self.extra(variant)), inputs, eps=1e-6,
                                            atol=1e-7)

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    def test_t1_equals_2d_op(self, dtype, variant):
        """With ``T = 1`` the 3-D op is the 2-D op (forward and every gradient; gamma gets zero gradient)."""
        shape = (2, 1, 5, 6, 2, 8, 8)
        inputs = self.inputs(shape, dtype, decay_scale=1.0)
        out3 = self.fn(*inputs, *self.extra(variant))
        inputs2 = [t.detach()[:, 0].clone().requires_grad_() for t in inputs[:-1]]
        out2 = self.fn2d(*inputs2, *self.extra(variant))
        assert_close(out3[:, 0], out2, dtype, "forward")
        go = torch.randn(out2.shape, generator=torch.Generator().manual_seed(1)).to(out2)
        g3 = torch.autograd.grad(out3, inputs, go[:, None])
        g2 = torch.autograd.grad(out2, inputs2, go)
        for name, a, b in zip(self.grad_names, g3, g2):
            assert_close(a[:, 0], b, dtype, f"grad {name}", grad=True)
        assert not g3[-1].any()
        torch.testing.assert_close(self.ref(*[t.detach() for t in inputs], *self.extra(variant))[:, 0],
                                   self.fn2d(*[t.detach() for t in inputs2], *self.extra(variant)))

    @needs_ext
    def test_noncontiguous(self, variant):
        shape = (2, 3, 4, 5, 2, 8, 6)
        inputs = self.inputs(shape, torch.float64)
        strided = []
        for t in inputs:
            x = t.detach()
            x = x.transpose(1, 3).contiguous().transpose(1, 3)
            assert not x.is_contiguous()
            strided.append(x.requires_grad_())
        check_against_reference(self.fn, self.ref, strided, self.extra(variant), names=self.grad_names,
                                dtype=torch.float64, ref_fp64=False)

    @needs_ext
    @pytest.mark.parametrize("value", [-1e4, 0.0, -math.inf], ids=["-1e4", "0", "-inf"])
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    def test_extreme_decays(self, value, dtype):
        """Every other position of each axis fully decayed (``-inf``: a decay of 0), or exactly 1."""
        shape = (2, 4, 5, 4, 2, 8, 8)
        inputs = self.inputs(shape, dtype, decay_scale=1.0)
        n = self.nd
        with torch.no_grad():
            inputs[n][:, :, :, ::2] = value
            inputs[n + 1][:, :, 1::2] = value
            inputs[n + 2][:, ::2] = value
        tol_dtype = torch.bfloat16 if (value != 0.0 and dtype == torch.float32) else dtype
        check_against_reference(self.fn, self.ref, inputs, self.extra(), names=self.grad_names, dtype=dtype,
                                tol_dtype=tol_dtype, ref_fp64=tol_dtype != dtype)
        if value == -math.inf:
            plain = [t.detach() for t in inputs]
            floored = [t.clamp_min(-1e4) if i >= n else t for i, t in enumerate(plain)]
            torch.testing.assert_close(self.fn(*plain, *self.extra()), self.fn(*floored, *self.extra()), rtol=0,
                                       atol=0)

    @needs_ext
    def test_deterministic_thread_invariant_inputs_not_mutated(self, variant):
        inputs = self.inputs((1, 3, 5, 4, 2, 8, 8), torch.float32, decay_scale=1.0)
        before = [t.detach().clone() for t in inputs]
        runs = []
        for _ in range(2):
            out = self.fn(*inputs, *self.extra(variant))
            runs.append((out, torch.autograd.grad(out, inputs, torch.ones_like(out))))
        assert torch.equal(runs[0][0], runs[1][0])
        for a, b in zip(runs[0][1], runs[1][1]):
            assert torch.equal(a, b), "backward is not deterministic"
        for t, b in zip(inputs, before):
            assert torch.equal(t.detach(), b)
        assert_thread_invariant(lambda *a: self.fn(*a, *self.extra(variant)), inputs)

    def case_results(self, variant, dtype: torch.dtype, threads: int) -> list[torch.Tensor]:
        """``[out, *gradients]`` of the op on the seeded determinism case (B * heads = 4) on ``threads`` threads."""
        inputs = self.inputs((2, 3, 5, 4, 2, 8, 8), dtype, decay_scale=1.0, seed=7)
        n = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = self.fn(*inputs, *self.extra(variant))
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(out.dtype)
            return [out.detach(), *torch.autograd.grad(out, inputs, g)]
        finally:
            torch.set_num_threads(n)

    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
    def test_bitwise_across_threads_and_processes(self, dtype, variant, tmp_path):
        """The same seeded inputs give bitwise the same outputs and gradients on 1 and 3 threads and in a fresh
        child process (the kernels own fixed slices and summation orders; nothing depends on the process)."""
        here = [self.case_results(variant, dtype, t) for t in (1, 3)]
        path = tmp_path / "child.pt"
        cls = type(self)
        code = (f"import ast, importlib, torch\n"
                f"cls = getattr(importlib.import_module({cls.__module__!r}), {cls.__name__!r})\n"
                f"res = cls().case_results(ast.literal_eval({repr(variant)!r}), torch.{str(dtype).split('.')[-1]}, 3)\n"
                f"torch.save(res, {str(path)!r})\n")
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONPATH": tests_dir + os.pathsep + os.environ.get("PYTHONPATH", "")}
        res = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(tests_dir),
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        child = torch.load(path)
        names = ("out",) + tuple(self.grad_names)
        for name, a, b, c in zip(names, here[0], here[1], child):
            assert torch.equal(a, b), f"{self.op}: {name} differs between 1 and 3 threads"
            assert torch.equal(b, c), f"{self.op}: {name} differs in a child process"

    # ---------------------------------------------------------------- registration and tracing
    @needs_ext
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
    def test_opcheck(self, dtype, variant):
        inputs = self.inputs((2, 2, 3, 4, 2, 8, 8), dtype, decay_scale=1.0)
        extra = self.extra(variant)
        torch.library.opcheck(self.registered(), (*inputs, *extra))
        with torch.no_grad():
            outs = self.registered()(*inputs, *extra)
        first = outs[0] if isinstance(outs, tuple) else outs
        torch.library.opcheck(getattr(torch.ops.ppma, self.op + "_backward"),
                              (torch.randn_like(first), *self.backward_args([t.detach() for t in inputs], outs),
                               *extra))

    @needs_ext
    def test_compile_dynamic_no_recompile(self, variant):
        import torch._dynamo

        extra = self.extra(variant)

        def f(*inputs):
            return self.fn(*inputs, *extra).square().sum()

        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            for T, H, W in ((3, 5, 6), (4, 7, 3), (5, 3, 9)):
                inputs = self.inputs((1, T, H, W, 2, 8, 8), torch.float32, decay_scale=1.0)
                loss = cf(*inputs)
                grads = torch.autograd.grad(loss, inputs)
                ref_inputs = [t.detach().requires_grad_() for t in inputs]
                ref_loss = f(*ref_inputs)
                torch.testing.assert_close(loss, ref_loss)
                for g, r in zip(grads, torch.autograd.grad(ref_loss, ref_inputs)):
                    torch.testing.assert_close(g, r)
        torch._dynamo.reset()

    def test_double_backward_raises(self):
        inputs = self.inputs((1, 2, 3, 4, 2, 8, 8))
        out = self.fn(*inputs, *self.extra())
        if not _dispatch.run_fused(inputs[0]):
            pytest.skip("the reference supports double backward")
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(out.square().sum(), inputs[0], create_graph=True)

    # ---------------------------------------------------------------- edges and errors
    @needs_ext
    @pytest.mark.parametrize("impl", ["fused", "reference"])
    @pytest.mark.parametrize("dim", [0, 1, 2, 3, 4, 6], ids=["B", "T", "H", "W", "heads", "channels"])
    def test_empty_inputs(self, impl, dim):
        shape = [2, 2, 3, 4, 2, 8, 8]
        shape[dim] = 0
        inputs = self.inputs(tuple(shape), torch.float32)
        with ppma.ops.use_impl(impl):
            out = self.fn(*inputs, *self.extra())
            assert tuple(out.shape) == (*shape[:5], shape[6])
            grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        for g, t in zip(grads, inputs):
            assert g is None or (g.shape == t.shape and not g.any())

    @needs_ext
    def test_meta_inputs(self, recwarn):
        shape = (2, 2, 3, 4, 2, 8, 6)
        inputs = self.inputs(shape, torch.float32, device="meta")
        out = self.fn(*inputs, *self.extra())
        assert out.device.type == "meta" and tuple(out.shape) == (2, 2, 3, 4, 2, 6)
        grads = torch.autograd.grad(out.sum(), inputs)
        assert [g.shape for g in grads] == [t.shape for t in inputs]
        assert not [w for w in recwarn if "ppma" in str(w.message)]

    @needs_ext
    def test_registered_op_rejects_mixed_devices(self):
        inputs, extra = self.inputs((1, 2, 3, 4, 2, 8, 8), torch.float32, requires_grad=False), self.extra()
        for i, name in enumerate(self.grad_names):
            args = [t.to("meta") if j == i else t for j, t in enumerate(inputs)]
            with pytest.raises(RuntimeError, match=f"{name} is on meta|is on cpu but {name} is on meta"):
                self.registered()(*args, *extra)

    def test_positive_decays_rejected_on_request(self):
        inputs = self.inputs((1, 2, 3, 4, 2, 8, 8), torch.float32, requires_grad=False)
        inputs[-1] = inputs[-1].abs()
        try:
            ppma.ops.set_check_decays(True)
            for f in (self.fn, self.ref):
                with pytest.raises(ValueError, match="log_gamma must be <= 0"):
                    f(*inputs, *self.extra())
        finally:
            ppma.ops.set_check_decays(False)

    def test_bad_inputs_named(self):
        inputs = self.inputs((2, 2, 3, 4, 2, 8, 8), requires_grad=False)
        n = self.nd
        cases = [
            (inputs[:n] + [inputs[n][:, :, :2]] + inputs[n + 1 :], ValueError, "log_alpha must be"),
            (inputs[:n + 2] + [inputs[n + 2].float()], ValueError, "log_gamma has dtype"),
            (inputs[:n + 2] + [None], TypeError, "log_gamma must be a torch.Tensor"),
            (inputs[:n + 1] + [inputs[n + 1].to("meta")] + inputs[n + 2 :], ValueError, "log_beta is on"),
            ([t[0] for t in inputs[:n]] + inputs[n:], ValueError, "must be \\[B, T, H, W, heads"),
        ]
        for args, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                self.fn(*args, *self.extra())

    @needs_ext
    def test_bad_inputs_reach_cpp_checks(self):
        inputs = self.inputs((2, 2, 3, 4, 2, 8, 8), requires_grad=False)
        n = self.nd
        with pytest.raises(RuntimeError, match=r"log_gamma must be \[B, T, H, W, heads\]"):
            self.registered()(*inputs[: n + 2], inputs[n + 2][:, :1], *self.extra())
        with pytest.raises(RuntimeError, match="log_gamma has dtype"):
            self.registered()(*inputs[: n + 2], inputs[n + 2].float(), *self.extra())
