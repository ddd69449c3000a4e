"""The CUDA kernels of ``csrc/kernels`` run on the CPU through a host emulator, against the reference (docs/design.md §5).

No GPU is needed: ``tests/cuda_emu/emu.h`` turns the CUDA built-ins the kernels use (threads and blocks, barriers,
warp shuffles, ``mma.sync.m16n8k16``, ``ldmatrix``, ``cp.async``) into host code, with the fragment layouts taken
from the PTX ISA, and ``tests/cuda_emu/run_kernels.cpp`` runs the kernels' own launch helpers with the launchers'
scratch buffers. This checks the index math, the tiling (row-aligned tiles, wide-map segments and their groups,
bias tables), the fragment layouts of the tensor-core path and every reduction, forward and backward, for
fp32 / fp64 / fp16 / bf16 and the head-dim paths. It cannot check what only a GPU shows: races the hardware could
reorder, the inline PTX itself (compile-checked by ``.ci/check_cuda.sh``), speed. Those are checked by
``tests/test_cuda_paths.py`` and the CUDA cases of ``tests/test_<op>.py`` on a GPU.

Skipped without a host C++ compiler or the CUDA toolkit's headers (cuda_fp16.h), and reported as such; under CI
(``CI=true``) that fails unless ``PPMA_ALLOW_NO_CUDA=1`` (tests/conftest.py). ``PPMA_TEST_FULL=1`` widens the
sweep.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ppma.ops import reference as ref
from conftest import FULL, skip_without_cuda_toolchain
from op_utils import TOLERANCES, rel_err

ROOT = Path(__file__).resolve().parent.parent
EMU = ROOT / "tests" / "cuda_emu"
DTYPE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


def _cuda_include() -> Path | None:
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_fp16.h").exists() and (c / "cuda_runtime.h").exists():
            return c
    return None


def _build(name: str) -> Path:
    """Builds tests/cuda_emu/<name>.cpp once per version of the sources (about a minute); returns the program."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    inc = _cuda_include()
    if cxx is None or inc is None:
        missing = "a host C++ compiler" if cxx is None else "the CUDA toolkit's headers (cuda_fp16.h)"
        skip_without_cuda_toolchain(f"CUDA emulator: SKIPPED ({missing} missing)")
    sources = sorted(EMU.glob("*")) + sorted((ROOT / "csrc" / "kernels").glob("*")) + [ROOT / "csrc/common/math.h"]
    h = hashlib.sha256()
    for s in sources:
        h.update(s.name.encode())
        h.update(s.read_bytes())
    out = Path(tempfile.gettempdir()) / f"ppma-cuda-emu-{h.hexdigest()[:16]}" / name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}")
        cmd = [cxx, "-std=c++17", "-O1", f"-I{inc}", f"-I{EMU}", f"-I{ROOT / 'csrc' / 'kernels'}", f"-I{ROOT / 'csrc'}",
               str(EMU / f"{name}.cpp"), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"building {name} failed:\n{r.stderr[-4000:]}"
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def runner() -> Path:
    return _build("run_kernels")


def test_fragment_layouts_and_bias_tables():
    """warp_mma.h's fragment coordinates and ldmatrix addresses against the PTX ISA's tables, one mma with plain
    loops, the C -> A register reuse, and the per-tile bias tables against the direct bias definitions."""
    r = subprocess.run([str(_build("test_fragments"))], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-2000:]


def _inputs(shape, dtype, seed, decay_scale=1.0):
    B, H, W, G, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, W, G, d, generator=g).to(dtype)
    k = torch.randn(B, H, W, G, d, generator=g).to(dtype)
    v = torch.randn(B, H, W, G, dv, generator=g).to(dtype)
    la = -decay_scale * torch.rand(B, H, W, G, generator=g)
    lb = -decay_scale * torch.rand(B, H, W, G, generator=g)
    go = torch.randn(B, H, W, G, dv, generator=g).to(dtype)
    return q, k, v, la, lb, go


def emulate(runner, op, path, dtype, shape, scale, ins, layout=0, backward=True, slice_width=0):
    """Runs one op (forward, backward) in the emulator; returns the outputs as float64 tensors. op 2
    (polyline_linear_attention): path = normalize + 2 x kernels (0 verified, 1 next, 2 next with the state in global
    scratch), scale = eps, slice_width = its channel slices (0: default)."""
    B, H, W, G, d, dv = shape
    q, k, v, la, lb, go = ins
    head = struct.pack("12i", op, path, DTYPE_CODE[dtype], B, H, W, G, d, dv, int(backward), layout, slice_width)
    head += struct.pack("d", scale)
    with tempfile.TemporaryDirectory() as tmp:
        fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        fin.write_bytes(head + b"".join(t.double().contiguous().numpy().tobytes() for t in (q, k, v, la, lb, go)))
        r = subprocess.run([str(runner), str(fin), str(fout)], capture_output=True, text=True)
        assert r.returncode == 0, f"emulated kernels failed: {r.stderr[-2000:]}"
        flat = torch.from_numpy(np.fromfile(fout, dtype=np.float64))
    n = B * H * W * G
    C = dv + path % 2  # polyline_linear_attention: the channels of v' = [v, 1] (normalize) or v
    stats = [("stats", n * 2 * C)] if op == 2 else [("lse", n * 2)]
    sizes = [("out", n * dv)] + ([("out_v2h", n * dv)] if op == 0 else []) + stats
    if backward:
        sizes += [("q", n * d), ("k", n * d), ("v", n * dv), ("log_alpha", n), ("log_beta", n)]
    shapes = {"out": (B, H, W, G, dv), "out_v2h": (B, H, W, G, dv), "lse": (B, H, W, G, 2), "q": (B, H, W, G, d),
              "k": (B, H, W, G, d), "v": (B, H, W, G, dv), "log_alpha": (B, H, W, G), "log_beta": (B, H, W, G),
              "stats": (B, H, W, G, 2, C)}
    res, o = {}, 0
    for name, size in sizes:
        res[name] = flat[o:o + size].view(shapes[name])
        o += size
    assert o == flat.numel(), "unexpected output size"
    return res


def check_against_reference(res, fn, ins, scale, dtype, grad_mult=2.0):
    q, k, v, la, lb, go = ins
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, la, lb)]
    want = fn(*leaves, scale)
    wgrads = torch.autograd.grad(want, leaves, go.double())
    fwd_tol, grad_tol = TOLERANCES[dtype]
    for name, got, exp, tol in [("out", res["out"], want, fwd_tol)] + [
        (f"grad_{n}", res[n], g, grad_tol * grad_mult) for n, g in zip(("q", "k", "v", "log_alpha", "log_beta"), wgrads)
    ]:
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        err = rel_err(got, exp)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    # the first log-decay of every line never enters a bias: its gradient is exactly zero
    assert res["log_alpha"][:, :, 0].abs().max() == 0 and res["log_beta"][:, 0].abs().max() == 0


def check_lse(res, ins, scale):
    """lse against the reference's logits (polyline_attention: both softmaxes)."""
    q, k, v, la, lb, _ = ins
    B, H, W, G, d = q.shape
    qd, kd = q.double(), k.double()
    cr = ref.prefix_sum_excl_first(la.double(), dim=2)
    cc = ref.prefix_sum_excl_first(lb.double(), dim=1)
    s = scale * torch.einsum("bpgd,bsgd->bgps", qd.reshape(B, H * W, G, d), kd.reshape(B, H * W, G, d))
    i = torch.arange(H).repeat_interleave(W)
    j = torch.arange(W).repeat(H)
    crf, ccf = cr.permute(0, 3, 1, 2), cc.permute(0, 3, 1, 2)  # [B, G, H, W]
    # M[p, s] = R_i(j, l) + C_l(i, k) with R = |cr(i, j) - cr(i, l)|, C = |cc(i, l) - cc(k, l)| (negated)
    R = -(crf[:, :, i, j][..., :, None] - crf[:, :, i[:, None], j[None, :]]).abs()
    C = -(ccf[:, :, i[:, None], j[None, :]] - ccf[:, :, i[None, :], j[None, :]]).abs()
    m1 = R + C
    want = torch.stack([torch.logsumexp(s + m1, -1), torch.logsumexp(s + m1.transpose(-1, -2), -1)], -1)
    want = want.permute(0, 2, 1, 3).reshape(B, H, W, G, 2)
    # the inputs are already rounded to their dtype and S is accumulated in fp32: tight for every dtype
    err = rel_err(res["lse"], want)
    assert err < 1e-4, f"lse: relative error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# polyline_attention
# ---------------------------------------------------------------------------------------------

# (B, H, W, heads, d, dv): whole-row tiles (W <= 64), exact and partial tiles, wide maps (W > 64: row segments;
# W > 4 * 64: several segments per backward CTA), 1-wide maps, d != dv, head dims needing zero padding.
TC_CASES = [
    ((1, 8, 8, 2, 32, 32), torch.bfloat16, 0),
    ((2, 5, 7, 1, 16, 16), torch.float16, 1),
    ((1, 3, 20, 1, 64, 64), torch.bfloat16, 0),
    ((1, 4, 9, 1, 128, 128), torch.float16, 0),
    ((1, 2, 70, 1, 32, 32), torch.bfloat16, 0),
    ((1, 9, 1, 2, 24, 40), torch.bfloat16, 1),
]
if FULL:
    TC_CASES += [
        ((1, 1, 300, 1, 16, 16), torch.bfloat16, 0),
        ((1, 14, 14, 2, 32, 32), torch.float16, 1),
        ((1, 7, 33, 1, 128, 64), torch.bfloat16, 0),
        ((2, 16, 16, 1, 32, 32), torch.bfloat16, 0),
        ((1, 3, 130, 1, 64, 64), torch.float16, 0),
    ]


@pytest.mark.parametrize("shape,dtype,layout", TC_CASES)
def test_polyline_attention_tensor_cores(runner, shape, dtype, layout):
    ins = _inputs(shape, dtype, seed=sum(shape))
    scale = shape[4] ** -0.5
    res = emulate(runner, 0, 1, dtype, shape, scale, ins, layout=layout)
    check_against_reference(res, ref.polyline_attention_ref, ins, scale, dtype)
    check_lse(res, ins, scale)


# The row-uniform backward (csrc/kernels/polyline_attention_tc_bwd2.cuh, path 2 = the option
# cuda_next_polyline_attention): maps whose 64-token tiles keep every warp in one map row (W a multiple of 16, or
# W > 32: several rows per tile, one partial row per tile, row segments and their groups), and narrow maps, which
# keep the verified kernels (W = 7). W = 17-31: the two-row cases below.
NEXT_CASES = [
    ((1, 4, 16, 2, 32, 32), torch.bfloat16, 0),  # 4 rows per tile, one per warp
    ((2, 3, 32, 1, 16, 16), torch.float16, 1),   # 2 rows per tile, odd H, strided q and k
    ((1, 3, 40, 1, 64, 64), torch.bfloat16, 0),  # one partial row per tile (W % 8 != 0)
    ((1, 2, 70, 1, 24, 40), torch.float16, 0),   # row segments of 64 + 6, d != dv
    ((1, 2, 48, 1, 128, 128), torch.bfloat16, 0),  # DPAD = 128
    ((1, 5, 7, 1, 32, 32), torch.bfloat16, 0),   # general path
]
if FULL:
    NEXT_CASES += [
        ((1, 1, 300, 1, 16, 16), torch.bfloat16, 0),  # 5 segments: backward CTAs own 2 and 1 segments
        ((1, 3, 130, 1, 64, 64), torch.float16, 0),
        ((2, 4, 56, 2, 32, 32), torch.bfloat16, 1),
        ((1, 5, 20, 1, 32, 32), torch.float16, 0),   # two-row kernels (a warp across two rows)
        ((1, 9, 64, 1, 8, 8), torch.bfloat16, 0),     # DPAD = 16, one full row per tile
    ]


@pytest.mark.parametrize("shape,dtype,layout", NEXT_CASES)
def test_polyline_attention_tensor_cores_next(runner, shape, dtype, layout):
    ins = _inputs(shape, dtype, seed=sum(shape) + 7)
    scale = shape[4] ** -0.5
    res = emulate(runner, 0, 2, dtype, shape, scale, ins, layout=layout)
    check_against_reference(res, ref.polyline_attention_ref, ins, scale, dtype)
    check_lse(res, ins, scale)


def test_polyline_attention_tensor_cores_next_matches_verified(runner):
    """The row-uniform backward against the verified tensor-core backward on the same inputs (wide map: row
    segments): the same forward bit for bit, gradients equal up to summation order, and bitwise-equal reruns."""
    shape = (1, 2, 70, 1, 32, 32)
    ins = _inputs(shape, torch.bfloat16, seed=11)
    a = emulate(runner, 0, 2, torch.bfloat16, shape, 0.2, ins)
    b = emulate(runner, 0, 1, torch.bfloat16, shape, 0.2, ins)
    for name in ("out", "out_v2h", "lse"):
        assert torch.equal(a[name], b[name]), name
    for name in ("q", "k", "v", "log_alpha", "log_beta"):
        assert rel_err(a[name], b[name]) < 1e-4, name
    again = emulate(runner, 0, 2, torch.bfloat16, shape, 0.2, ins)
    for name in a:
        assert torch.equal(a[name], again[name]), f"{name}: a rerun differs"


# The next kernels on two-row maps (16 < W < 32, csrc/kernels/polyline_attention_tc_bwd2.cuh TWO = true, and the
# forward of polyline_attention_tc_fwd2.cuh), and the next forward on row-uniform maps: a lane's two rows in two
# map rows, its two columns in two map rows (odd W), 2-3 rows per tile, odd H, every head-dim path (at 128 the
# dkdv kernel's 16-query inner tiles are row segments of 16 + W - 16), d != dv, strided q and k, wide maps (row
# segments, W > 128).
TWO_ROW_CASES = [
    ((1, 3, 28, 2, 32, 32), torch.bfloat16, 0),  # PPMA-T's stage 2 width: 2 rows (56 tokens) per tile
    ((2, 5, 20, 1, 16, 16), torch.float16, 1),   # 3 rows per tile, odd H, strided q and k
    ((1, 3, 17, 1, 64, 64), torch.bfloat16, 0),  # 3 rows (51 tokens) per tile
    ((1, 3, 31, 1, 128, 128), torch.float16, 0),  # DPAD = 128
    ((1, 2, 28, 1, 24, 40), torch.bfloat16, 0),  # d != dv
    ((1, 2, 150, 1, 32, 32), torch.float16, 0),  # row-uniform, wide: segments of 64, 64, 22
]
if FULL:
    TWO_ROW_CASES += [
        ((1, 5, 20, 1, 128, 128), torch.bfloat16, 0),
        ((2, 4, 31, 1, 64, 64), torch.float16, 1),
        ((1, 3, 17, 2, 16, 16), torch.float16, 0),
        ((1, 3, 28, 1, 128, 64), torch.bfloat16, 0),
        ((1, 2, 300, 1, 64, 64), torch.bfloat16, 0),
    ]


@pytest.mark.parametrize("shape,dtype,layout", TWO_ROW_CASES)
def test_polyline_attention_tensor_cores_next_two_row(runner, shape, dtype, layout):
    ins = _inputs(shape, dtype, seed=sum(shape) + 13)
    scale = shape[4] ** -0.5
    res = emulate(runner, 0, 2, dtype, shape, scale, ins, layout=layout)
    check_against_reference(res, ref.polyline_attention_ref, ins, scale, dtype)
    check_lse(res, ins, scale)


@pytest.mark.parametrize("shape,dtype", [
    ((1, 3, 28, 1, 32, 32), torch.bfloat16),   # two-row
    ((1, 4, 17, 1, 16, 16), torch.float16),    # two-row, odd W
    ((1, 2, 31, 1, 128, 128), torch.bfloat16),  # two-row, DPAD = 128
    ((1, 3, 32, 1, 64, 64), torch.float16),    # row-uniform, 2 rows per tile
    ((1, 2, 150, 1, 32, 32), torch.bfloat16),  # row-uniform, row segments
])
def test_polyline_attention_tensor_cores_next_matches_verified_two_row(runner, shape, dtype):
    """The next kernels (forward and backward) against the verified tensor-core kernels on the same inputs: the
    forward bit for bit (same key-tile order and arithmetic), gradients equal up to summation order; two runs of
    the next kernels bitwise equal."""
    ins = _inputs(shape, dtype, seed=sum(shape) + 3)
    a = emulate(runner, 0, 2, dtype, shape, 0.2, ins)
    b = emulate(runner, 0, 1, dtype, shape, 0.2, ins)
    for name in ("out", "out_v2h", "lse"):
        assert torch.equal(a[name], b[name]), name
    # dq, dk, dv are stored in the 16-bit dtype: a different summation order flips some roundings (bf16: 2^-8)
    tol = max(1e-4, 0.05 * torch.finfo(dtype).eps)
    for name in ("q", "k", "v", "log_alpha", "log_beta"):
        assert rel_err(a[name], b[name]) < tol, name
    again = emulate(runner, 0, 2, dtype, shape, 0.2, ins)
    for name in a:
        assert torch.equal(a[name], again[name]), f"{name}: a rerun differs"


CORE_CASES = [
    ((1, 4, 8, 2, 32, 32), torch.float32, 0),
    ((2, 3, 5, 1, 16, 24), torch.float64, 1),
    ((1, 2, 140, 1, 32, 32), torch.float32, 0),  # W > BM = 64: 3 segments per row
    ((1, 3, 6, 1, 200, 136), torch.float32, 0),  # head dims above 128: the DPAD = 256 path
    ((1, 2, 5, 1, 16, 16), torch.bfloat16, 0),
]
if FULL:
    CORE_CASES += [
        ((1, 1, 300, 1, 32, 32), torch.float32, 0),  # 5 segments of 64: backward CTAs own 2 and 1 segments
        ((1, 2, 3, 1, 300, 300), torch.float32, 0),  # DPAD = 512
        ((1, 5, 9, 2, 64, 64), torch.float16, 1),
    ]


@pytest.mark.parametrize("shape,dtype,layout", CORE_CASES)
def test_polyline_attention_cuda_cores(runner, shape, dtype, layout):
    ins = _inputs(shape, dtype, seed=sum(shape))
    scale = shape[4] ** -0.5
    res = emulate(runner, 0, 0, dtype, shape, scale, ins, layout=layout)
    check_against_reference(res, ref.polyline_attention_ref, ins, scale, dtype)


def test_polyline_attention_tensor_cores_match_cuda_cores(runner):
    """The two CUDA paths on the same bf16 inputs: equal up to the 16-bit rounding of P and dS."""
    shape = (1, 6, 11, 1, 32, 32)
    ins = _inputs(shape, torch.bfloat16, seed=5)
    a = emulate(runner, 0, 1, torch.bfloat16, shape, 0.2, ins)
    b = emulate(runner, 0, 0, torch.bfloat16, shape, 0.2, ins)
    for name in ("out", "out_v2h", "q", "k", "v", "log_alpha", "log_beta"):
        assert rel_err(a[name], b[name]) < 2e-2, name
    assert rel_err(a["lse"], b["lse"]) < 1e-4


def test_polyline_attention_extreme_decays_tensor_cores(runner):
    """Log-decays of -1e4 (masks of exp(-1e4) = 0 beyond the diagonal) and 0 (no decay): finite, right numbers."""
    shape = (1, 5, 6, 1, 32, 32)
    for decay in (0.0, 1e4):
        ins = _inputs(shape, torch.bfloat16, seed=3, decay_scale=decay)
        res = emulate(runner, 0, 1, torch.bfloat16, shape, 0.2, ins)
        q, k, v, la, lb, go = ins
        leaves = [t.double().requires_grad_(True) for t in (q, k, v, la, lb)]
        want = ref.polyline_attention_ref(*leaves, 0.2)
        assert rel_err(res["out"], want) < 2e-2
        wq, wk, wv = torch.autograd.grad(want, leaves[:3], go.double())
        for name, w in (("q", wq), ("k", wk), ("v", wv)):
            assert torch.isfinite(res[name]).all()
            # near-zero gradients (strong decay): an absolute floor scaled by |dO| |k|, as in the CPU tests
            floor = 1e-2 * go.double().norm() * k.double().norm() / q.numel() ** 0.5
            assert (res[name] - w).norm() <= 4e-2 * w.norm() + floor, name


# ---------------------------------------------------------------------------------------------
# criss_cross_attention: packed short lines (L <= 64, head dims <= 32, fp32 accumulation) and generic lines
# ---------------------------------------------------------------------------------------------

CC_CASES = [
    ((2, 7, 28, 2, 16, 16), torch.float32),   # rows of 28 (2 per block), columns of 7 (9 per block)
    ((1, 5, 9, 1, 32, 32), torch.bfloat16),
    ((1, 70, 3, 1, 16, 16), torch.float32),   # columns of 70: generic kernels; rows of 3: packed
    ((1, 4, 6, 1, 48, 40), torch.float32),    # DPAD = 64: generic kernels
    ((1, 3, 4, 2, 16, 16), torch.float64),    # fp64: generic kernels
    ((1, 6, 5, 1, 24, 8), torch.float16),
]
if FULL:
    CC_CASES += [((1, 56, 56, 1, 16, 16), torch.float32), ((2, 28, 28, 2, 32, 32), torch.bfloat16),
                 ((1, 64, 1, 1, 32, 32), torch.float32), ((1, 1, 65, 1, 32, 32), torch.float32)]


@pytest.mark.parametrize("shape,dtype", CC_CASES)
def test_criss_cross(runner, shape, dtype):
    ins = _inputs(shape, dtype, seed=sum(shape) + 1)
    scale = shape[4] ** -0.5
    res = emulate(runner, 1, 0, dtype, shape, scale, ins)
    check_against_reference(res, ref.criss_cross_attention_ref, ins, scale, dtype)


# criss_cross_attention on tensor cores (path 1: criss_cross_attention_tc.cuh, fp16 / bf16, lines of at most 64
# tokens padded to a multiple of 16, 64 // Lp lines per CTA, head dims up to 32; longer lines run the path-0
# kernels in the same pipeline; path 2: the same with the 16-bit scratch the launcher allocates where both
# directions fit, the fp32 maps it replaces poisoned with NaN). Every path on the same cases, against the
# reference.
CC_TC_CASES = [
    ((2, 7, 28, 2, 16, 16), torch.bfloat16),  # rows of 28 (Lp 32, 2 per CTA), columns of 7 (Lp 16, 4 per CTA)
    ((1, 5, 9, 1, 32, 32), torch.float16),    # 5 columns: a partial pack of 4
    ((1, 70, 3, 1, 16, 16), torch.bfloat16),  # columns of 70: path-0 kernels (and the combine kernel)
    ((1, 6, 5, 1, 24, 8), torch.float16),     # d != dv, d padded to 32
    ((1, 9, 56, 1, 16, 16), torch.bfloat16),  # rows of 56 (Lp 64)
    ((1, 33, 17, 1, 32, 32), torch.bfloat16), # columns of 33 (Lp 48, warp 3 idle), rows of 17 (Lp 32)
    ((1, 3, 66, 2, 16, 16), torch.float16),   # rows of 66: path-0 row passes, tensor-core column pass
]
if FULL:
    CC_TC_CASES += [((1, 56, 56, 1, 16, 16), torch.bfloat16), ((2, 28, 28, 2, 32, 32), torch.float16),
                    ((1, 64, 1, 1, 32, 32), torch.bfloat16), ((1, 1, 64, 1, 16, 16), torch.float16),
                    ((1, 14, 14, 4, 32, 32), torch.bfloat16)]


@pytest.mark.parametrize("path", [0, 1, 2])
@pytest.mark.parametrize("shape,dtype", CC_TC_CASES)
def test_criss_cross_tensor_cores(runner, shape, dtype, path):
    ins = _inputs(shape, dtype, seed=sum(shape) + 2)
    scale = shape[4] ** -0.5
    res = emulate(runner, 1, path, dtype, shape, scale, ins)
    check_against_reference(res, ref.criss_cross_attention_ref, ins, scale, dtype)


@pytest.mark.parametrize("shape,dtype", [((2, 7, 28, 2, 16, 16), torch.bfloat16), ((1, 9, 56, 1, 32, 32),
                                                                                    torch.float16)])
def test_criss_cross_tensor_cores_deterministic(runner, shape, dtype):
    """Two runs of the tensor-core kernels give bitwise-equal outputs and gradients (no atomics; the bias
    gradient's per-warp column parts are summed in a fixed order)."""
    ins = _inputs(shape, dtype, seed=7)
    scale = shape[4] ** -0.5
    a = emulate(runner, 1, 2, dtype, shape, scale, ins)
    b = emulate(runner, 1, 2, dtype, shape, scale, ins)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: reruns differ"


@pytest.mark.parametrize("shape,dtype", [((2, 7, 28, 2, 16, 16), torch.bfloat16), ((1, 5, 9, 1, 32, 32),
                                                                                    torch.float16)])
def test_criss_cross_tensor_cores_scratch16_bitwise(runner, shape, dtype):
    """16-bit scratch (z1, z2, gz1, gz2) gives the same bits as fp32 scratch: the kernels only read those maps as
    mma operands, rounded to 16 bits either way."""
    ins = _inputs(shape, dtype, seed=11)
    scale = shape[4] ** -0.5
    a = emulate(runner, 1, 1, dtype, shape, scale, ins)
    b = emulate(runner, 1, 2, dtype, shape, scale, ins)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: 16-bit scratch differs"


def test_criss_cross_tensor_cores_rejects_fp32(runner):
    """The tensor-core path takes 16-bit inputs only (the launcher never selects it for fp32 / fp64)."""
    shape = (1, 4, 4, 1, 16, 16)
    ins = _inputs(shape, torch.float32, seed=3)
    with pytest.raises(AssertionError, match="float16 / bfloat16"):
        emulate(runner, 1, 1, torch.float32, shape, 0.25, ins)


# ---------------------------------------------------------------------------------------------
# polyline_linear_attention: channel slices of the scan form (one block per (b * head, direction, slice))
# ---------------------------------------------------------------------------------------------


def _linear_inputs(shape, dtype, seed, decay_scale=1.0):
    """Non-negative q, k (the op's features are already mapped)."""
    q, k, v, la, lb, go = _inputs(shape, dtype, seed, decay_scale)
    return q.abs(), k.abs(), v, la, lb, go


def _linear_stats_ref(ins, normalize, eps):
    """The statistics output from the dense definition: per direction (term / den, den) or the term."""
    q, k, v, la, lb, _ = (t.double() for t in ins)
    B, H, W, G, d = q.shape
    qf, kf = (t.reshape(B, H * W, G, d).transpose(1, 2) for t in (q, k))
    vf = v.reshape(B, H * W, G, -1).transpose(1, 2)
    A, L = qf @ kf.transpose(-1, -2), ref.polyline_mask(la, lb)
    dirs = []
    for P in (A * L, A * L.transpose(-1, -2)):
        term = P @ vf
        if normalize:
            den = P.sum(-1, keepdim=True) + eps
            term = torch.cat([term / den, den], -1)
        dirs.append(term)
    return torch.stack(dirs, -2).transpose(1, 2).reshape(B, H, W, G, 2, -1)


def check_linear(runner, shape, dtype, normalize, ins, slice_width=0, layout=0, eps=1e-6, kernels=0):
    res = emulate(runner, 2, int(normalize) + 2 * kernels, dtype, shape, eps, ins, layout=layout,
                  slice_width=slice_width)
    fn = lambda q, k, v, la, lb, e: ref.polyline_linear_attention_ref(q, k, v, la, lb, normalize, e)  # noqa: E731
    check_against_reference(res, fn, ins, eps, dtype)
    # the statistics are accumulated in fp32 / fp64 from the rounded inputs: the forward tolerance of fp32 at most
    err = rel_err(res["stats"], _linear_stats_ref(ins, normalize, eps))
    assert err <= max(TOLERANCES[dtype][0], TOLERANCES[torch.float32][0]), f"stats: relative error {err:.3e}"
    return res


# (B, H, W, heads, d, dv), dtype, normalize, slice width (0: the launcher's), layout of q and k: C = dv + normalize
# channels in one slice or several (a last slice narrower than the others), 1-wide and 1-high maps, d != dv,
# several heads and batches, strided q and k.
LINEAR_CASES = [
    ((1, 4, 5, 2, 8, 6), torch.float64, True, 0, 0),
    ((2, 3, 4, 1, 6, 9), torch.float64, False, 4, 1),  # C = 9: slices 4 + 4 + 1
    ((1, 5, 1, 2, 8, 8), torch.float32, True, 4, 0),   # W = 1, C = 9: 4 + 4 + 1
    ((1, 1, 6, 1, 8, 5), torch.float32, False, 0, 0),  # H = 1
    ((1, 3, 7, 1, 16, 40), torch.float32, True, 0, 1),  # C = 41: the default slices 21 + 20
    ((1, 4, 3, 2, 8, 8), torch.float16, True, 0, 0),
    ((2, 3, 4, 1, 8, 8), torch.bfloat16, False, 3, 0),
]
if FULL:
    LINEAR_CASES += [
        ((2, 9, 12, 2, 16, 16), torch.float32, True, 0, 0),
        ((1, 7, 6, 3, 32, 32), torch.bfloat16, True, 0, 1),  # C = 33: 17 + 16
        ((1, 12, 1, 1, 8, 8), torch.float64, True, 2, 0),
        ((1, 1, 13, 2, 4, 12), torch.float64, False, 5, 0),
        ((2, 5, 6, 1, 12, 70), torch.float16, False, 0, 0),  # C = 70: 24 + 23 + 23
    ]


@pytest.mark.parametrize("shape,dtype,normalize,slice_width,layout", LINEAR_CASES)
def test_polyline_linear_attention(runner, shape, dtype, normalize, slice_width, layout):
    ins = _linear_inputs(shape, dtype, seed=sum(shape) + 2)
    check_linear(runner, shape, dtype, normalize, ins, slice_width, layout)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "plain"])
def test_polyline_linear_attention_extreme_decays(runner, dtype, normalize):
    """Log-decays of -inf (a decay of exactly 0), -1e5 (below the floor) and 0 (no decay) on alternate rows and
    columns, and a large eps that enters the normaliser."""
    shape = (1, 5, 6, 2, 8, 8)
    q, k, v, la, lb, go = _linear_inputs(shape, dtype, seed=9)
    la[:, :, 1::3], la[:, :, 2::3] = -math.inf, 0.0
    lb[:, 1::3], lb[:, 2::3] = -1e5, 0.0
    check_linear(runner, shape, dtype, normalize, (q, k, v, la, lb, go), slice_width=4, eps=0.5 if normalize else 1e-6)


# The next kernels (csrc/kernels/polyline_linear_attention_v2.cuh, the option cuda_next_polyline_linear_attention):
# kernels 1 (state in shared memory where it fits, the launcher's choice) and 2 (the same kernels with the state in
# global scratch). (B, H, W, heads, d, dv), dtype, normalize, slice width (0: the next kernels' own, from the shared-
# memory budget), layout of q and k, kernels: narrow and wide maps (W = 1, 70: rows longer than the row
# recurrences' register chunks, W not a multiple of them), odd H, several slices with a narrower last one, d != dv,
# m = d x slice width not a multiple of 32, several heads and batches, strided q and k, every dtype.
LINEAR_NEXT_CASES = [
    ((1, 4, 5, 2, 8, 6), torch.float64, True, 0, 0, 1),
    ((2, 3, 4, 1, 6, 9), torch.float64, False, 4, 1, 1),   # C = 9: slices 4 + 4 + 1
    ((1, 5, 1, 2, 8, 8), torch.float32, True, 0, 0, 1),    # W = 1
    ((1, 1, 6, 1, 8, 5), torch.float32, False, 0, 0, 2),   # H = 1, global state
    ((1, 3, 19, 1, 16, 40), torch.float32, True, 0, 1, 1),  # C = 41, W = 19: full register chunks and a partial one
    ((1, 3, 70, 1, 4, 3), torch.float64, True, 0, 0, 2),   # wide map, global state
    ((1, 4, 3, 2, 8, 8), torch.float16, True, 0, 0, 1),
    ((2, 3, 4, 1, 8, 8), torch.bfloat16, False, 3, 0, 1),
    ((1, 5, 9, 1, 12, 7), torch.float32, False, 0, 0, 2),
    ((1, 2, 70, 1, 16, 5), torch.float64, True, 0, 0, 1),   # the budget binds: scans in slices of 3, mask of 2
    ((1, 2, 160, 1, 32, 4), torch.float32, True, 0, 0, 1),  # scans in shared memory, the mask kernel's state global
]
if FULL:
    LINEAR_NEXT_CASES += [
        ((2, 9, 12, 2, 16, 16), torch.float32, True, 0, 0, 1),
        ((1, 7, 6, 3, 32, 32), torch.bfloat16, True, 0, 1, 1),
        ((1, 12, 1, 1, 8, 8), torch.float64, True, 2, 0, 2),
        ((2, 5, 6, 1, 12, 70), torch.float16, False, 0, 0, 1),
        ((1, 2, 130, 1, 4, 4), torch.float32, True, 0, 0, 1),
    ]


@pytest.mark.parametrize("shape,dtype,normalize,slice_width,layout,kernels", LINEAR_NEXT_CASES)
def test_polyline_linear_attention_next(runner, shape, dtype, normalize, slice_width, layout, kernels):
    ins = _linear_inputs(shape, dtype, seed=sum(shape) + 5)
    check_linear(runner, shape, dtype, normalize, ins, slice_width, layout, kernels=kernels)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "plain"])
def test_polyline_linear_attention_next_extreme_decays(runner, dtype, normalize):
    """As test_polyline_linear_attention_extreme_decays, for the next kernels."""
    shape = (1, 5, 6, 2, 8, 8)
    q, k, v, la, lb, go = _linear_inputs(shape, dtype, seed=9)
    la[:, :, 1::3], la[:, :, 2::3] = -math.inf, 0.0
    lb[:, 1::3], lb[:, 2::3] = -1e5, 0.0
    check_linear(runner, shape, dtype, normalize, (q, k, v, la, lb, go), eps=0.5 if normalize else 1e-6, kernels=1)


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "plain"])
def test_polyline_linear_attention_next_matches_verified(runner, normalize):
    """The next kernels against the verified ones on the same inputs (fp32, W = 11: two register chunks and a
    partial one): the forward's terms are the same sums over state rows in the same order (the same bits here), the
    gradients equal up to the order of the channel slices' partial sums; shared-memory and global state give the
    same bits, and reruns are bitwise equal."""
    shape = (2, 5, 11, 2, 8, 9)
    ins = _linear_inputs(shape, torch.float32, seed=21)
    path = int(normalize)
    old = emulate(runner, 2, path, torch.float32, shape, 1e-6, ins)
    new = emulate(runner, 2, path + 2, torch.float32, shape, 1e-6, ins)
    glob = emulate(runner, 2, path + 4, torch.float32, shape, 1e-6, ins)
    again = emulate(runner, 2, path + 2, torch.float32, shape, 1e-6, ins)
    for name in old:
        assert torch.isfinite(new[name]).all(), name
        assert rel_err(new[name], old[name]) < 1e-5, f"{name}: {rel_err(new[name], old[name]):.3e}"
        assert torch.equal(new[name], again[name]), f"{name}: a rerun differs"
    # the forward's operations and their order are the verified kernel's (the state's placement and the thread that
    # owns an element change, not the arithmetic): the same bits on the host
    for name in ("out", "stats"):
        assert torch.equal(new[name], old[name]), f"{name}: the next forward differs from the verified one"
    # the same slices (a small map: the slice width is capped by the threads, not by the shared memory), so the
    # same operations in the same order wherever the state lives
    for name in new:
        assert torch.equal(new[name], glob[name]), f"{name}: shared-memory and global state differ"
