"""``ppma.ops.criss_cross_attention`` (the official "chunk" mode, docs/model.md §3.3) on every available device: the
fused op against its reference over the swept shapes and dtypes, every gradient, and its contract (op_utils
holds the tests shared by every op)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from op_utils import (_TESTS_DIR, AttentionOpTests, bf16_paths, expects_bf16_dot, make_attention_inputs, needs_ext,
                      path_id, rel_err, shape_id)
from ppma.ops import criss_cross_attention
from ppma.ops.reference import criss_cross_attention_ref


class TestCrissCrossAttention(AttentionOpTests):
    op = "criss_cross_attention"
    fn = staticmethod(criss_cross_attention)
    ref = staticmethod(criss_cross_attention_ref)
    large_case = ((1, 200, 336, 1, 32, 32), 5)

    def backward_args(self, inputs, outs):
        return (*inputs, outs[-1])  # lse


# ------------------------------------------------------------------------------------------------
# bf16 inputs on the CPU: the bf16 products where cpu_bf16_dot() (docs/ops.md "criss_cross_attention")
# ------------------------------------------------------------------------------------------------

# Odd d and dv (a zero half pair), odd line lengths (a zero half pair of positions), H != W, several heads, lines of
# one token, lines and dv past 16 and 32 columns (the column blocks and tails of the bf16 products), d = 1, and
# head dims of 8 pairs and more (the blocked key transposition) beside its scalar remainder.
BF16_SHAPES = (
    (2, 7, 9, 2, 16, 16),
    (1, 5, 11, 3, 7, 5),
    (2, 13, 6, 3, 9, 17),
    (1, 33, 17, 1, 15, 33),
    (1, 14, 14, 4, 32, 32),
    (1, 3, 56, 1, 64, 64),
    (2, 1, 7, 2, 8, 8),
    (1, 4, 3, 2, 1, 3),
    (1, 10, 12, 2, 20, 24),
)
# bf16 has 8 significant bits (unit roundoff u = 2^-8). On the bf16 products out passes through three roundings
# in series besides the inputs' (z1 or z2, the map, out itself), each a relative error of at most u and about
# u / sqrt(3) rms, independent: about u in all (measured 2e-3 .. 3.2e-3 on these shapes, against 1.6e-3 for the
# float32 kernel's result rounded to bf16). The bound is 2u.
BF16_TOL = 2.0**-7
BF16_THREADS = (1, 2, 3)

_BF16_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from ppma import backends
from ppma.ops import criss_cross_attention
from op_utils import make_attention_inputs
spec = json.loads(sys.argv[2])
res = {"capability": backends.cpu_capability(), "bf16_dot": backends.cpu_bf16_dot(), "cases": []}
for shape in spec["shapes"]:
    q, k, v, la, lb = make_attention_inputs(tuple(shape), torch.bfloat16, requires_grad=False, decay_scale=1.0,
                                            seed=5)
    la, lb = la.float(), lb.float()
    runs = {}
    for n in spec["threads"]:
        torch.set_num_threads(n)
        runs[n] = [torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, 0.3) for _ in range(2)]
    f32 = torch.ops.ppma.criss_cross_attention(q.float(), k.float(), v.float(), la, lb, 0.3)
    go = torch.randn(v.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    grads = [torch.ops.ppma.criss_cross_attention_backward(go, q, k, v, la, lb, lse, 0.3)
             for lse in (runs[1][0][1], f32[1])]
    res["cases"].append({"runs": runs, "f32": f32, "public": criss_cross_attention(q, k, v, la, lb, 0.3),
                         "grads": grads})
torch.save(res, sys.argv[3])
"""


@needs_ext
@pytest.mark.parametrize("path", bf16_paths(), ids=path_id)
def test_bf16_products(path, tmp_path):
    """bf16 q, k, v on each SIMD path, in a fresh process: where ``cpu_bf16_dot()`` (the avx512 path of a CPU with
    AVX-512 BF16, or of any CPU with the instruction emulated) the forward runs the bf16 products, so out is not the
    float32 kernel's result on the same values rounded to bf16, while lse is that kernel's up to float32 rounding (the
    float32 backward recomputes the maps from it); on the other paths out is bitwise the float32 kernel's rounded to
    bf16. Everywhere: out in bf16 within ``BF16_TOL`` of the float64 reference, bitwise the same on 1, 2 and 3 threads
    and from run to run."""
    out_file = tmp_path / "bf16.pt"
    env = {**os.environ, **path,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(_TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    spec = {"shapes": [list(s) for s in BF16_SHAPES], "threads": list(BF16_THREADS)}
    res = subprocess.run([sys.executable, "-c", _BF16_CHILD, _TESTS_DIR, json.dumps(spec), str(out_file)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"child on the {path_id(path)} path failed:\n{res.stderr[-3000:]}"
    got = torch.load(out_file)
    assert got["bf16_dot"] == expects_bf16_dot(path, got["capability"])
    for shape, case in zip(BF16_SHAPES, got["cases"]):
        what = f"{path_id(path)}, {shape_id(shape)}"
        out, lse = case["runs"][BF16_THREADS[0]][0]
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32, what
        for n, runs in case["runs"].items():
            for o, ls in runs:
                assert torch.equal(o, out) and torch.equal(ls, lse), f"{what}: differs across runs or threads ({n})"
        assert torch.equal(case["public"], out), what
        f32_out, f32_lse = case["f32"]
        if got["bf16_dot"] and shape[1] * shape[2] > 1:
            assert not torch.equal(out, f32_out.to(torch.bfloat16)), f"{what}: the bf16 products did not run"
        else:
            assert torch.equal(out, f32_out.to(torch.bfloat16)), f"{what}: not the float32 kernel's result"
        torch.testing.assert_close(lse, f32_lse, rtol=0, atol=1e-5)
        # The float32 backward recomputes the maps from lse: this forward's lse gives its gradients up to float32
        # rounding, i.e. the float32 log-decay gradients within 1e-5 and the bf16 q, k, v gradients up to a rare
        # flip of their last bit (measured <= 1e-4; an lse off by 1e-3 would move every gradient by ~1e-3).
        for name, a, b in zip(("q", "k", "v", "log_alpha", "log_beta"), *case["grads"]):
            tol = 1e-5 if a.dtype == torch.float32 else 4e-4
            assert rel_err(a, b) <= tol, f"{what}: grad {name} from this lse vs the float32 kernel's"
        q, k, v, la, lb = make_attention_inputs(shape, torch.bfloat16, requires_grad=False, decay_scale=1.0, seed=5)
        want = criss_cross_attention_ref(q.double(), k.double(), v.double(), la.float().double(),
                                         lb.float().double(), 0.3)
        err = rel_err(out, want)
        assert err <= BF16_TOL, f"{what}: relative error {err:.2e} > {BF16_TOL:.2e} against the float64 reference"


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_row_maps_groups_and_long_lines(dtype):
    """The CPU forward keeps a group of (batch, head) pairs' row maps (2 MiB) for its third phase: a pair's output
    does not depend on which pairs share its group (48 x 48 maps: 4 float32 pairs a group, so 6 pairs make a full
    and a partial group) and matches the reference; on lines too long to keep (104 x 104: one pair's maps > 2 MiB,
    float32 or bf16) the recomputed maps give the reference's numbers, the same for any thread count."""
    q, k, v, la, lb = make_attention_inputs((3, 48, 48, 2, 8, 8), dtype, requires_grad=False, seed=2)
    with torch.inference_mode():
        out = criss_cross_attention(q, k, v, la, lb, 0.4)
        for b in range(3):
            for g in range(2):
                one = criss_cross_attention(*(t[b:b + 1, :, :, g:g + 1] for t in (q, k, v, la, lb)), 0.4)
                assert torch.equal(one, out[b:b + 1, :, :, g:g + 1]), (b, g)
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL
    want = criss_cross_attention_ref(q.double(), k.double(), v.double(), la.double(), lb.double(), 0.4)
    assert rel_err(out, want) <= tol
    q, k, v, la, lb = make_attention_inputs((1, 104, 104, 1, 4, 4), dtype, requires_grad=False, seed=3)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.inference_mode():
                runs.append(criss_cross_attention(q, k, v, la, lb, 0.4))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    want = criss_cross_attention_ref(q.double(), k.double(), v.double(), la.double(), lb.double(), 0.4)
    assert rel_err(runs[0], want) <= tol
