"""The Python parts of the GPU script ``benchmarks/gpu_run.sh`` (benchmarks/README.md "The GPU script"): the next
CUDA kernels against the verified ones, and their timing, each part in its own process.

New CUDA kernels are opt-in: the compiled library selects one when its internal option ``cuda_next_<op>`` is 1
(``ppma.config.set_internal_option``, docs/configuration.md "Internal options"), the verified kernel when 0. This
script toggles those options on the same inputs:

``check``
    For every op whose launcher has a next kernel (:func:`next_kernel_status`): the raw ops
    (``torch.ops.ppma.<op>`` and ``<op>_backward``) with the option 0 and 1 on the same inputs; the relative
    error ``||new - old|| / ||old||`` of every output (out, the statistics of the backward pass: lse / out_v2h /
    stats) and of the five input gradients; where the shape is small enough, both against the float64 reference
    (``ppma.ops.reference``, autograd for the gradients); NaN never passes; and two runs of the new kernel
    compared bitwise (determinism). An op whose launcher does not read its option is skipped and the table says so.
``time``
    Per op and shape, the forward launcher and the backward launcher of the verified kernel, and of the next one
    where it exists, alternated over rounds in this one process: CUDA events around each call after warm-up,
    the median and the range of the rounds' medians; then one profiled call of each (``torch.profiler``) for
    the time of every CUDA kernel the launchers start.
``summary``
    The final table of a run: every part's status (from ``<out>/parts.tsv``, written by gpu_run.sh) and the
    headline numbers of the tables in ``<out>``.

Every table (``<out>/<part>.md`` and ``.json``) names the GPU. ``--smoke`` runs the same code on the CPU with tiny
shapes (the options then change nothing: the comparisons run anyway, to exercise the code, and say so)::

    python3 benchmarks/gpu_run.py check --out /tmp/gpu-run            # on a GPU machine, after the build
    python3 benchmarks/gpu_run.py check --out /tmp/gpu-run --smoke    # anywhere
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------------ the ops


@dataclass(frozen=True)
class OpSpec:
    """One fused op as its raw launchers see it: the forward returns (out, *saved), the backward takes
    (grad_out, q, k, v, log_alpha, log_beta, [out,] *saved, *extra) and returns the five input gradients."""

    name: str
    saved: tuple[str, ...]  # names of the forward's outputs after out (the backward's saved tensors)
    nonneg_qk: bool = False  # linear attention: q, k are non-negative features
    backward_takes_out: bool = False  # polyline_attention's backward reads out too
    extra: Callable[[int], tuple] = lambda d: (d ** -0.5,)  # the scalar arguments after the tensors

    @property
    def option(self) -> str:
        return f"cuda_next_{self.name}"

    def forward(self, ins):
        return getattr(torch.ops.ppma, self.name)(*ins, *self.extra(ins[0].shape[-1]))

    def backward(self, grad_out, ins, outs):
        """The five input gradients; ``outs``: everything the forward returned."""
        saved = outs if self.backward_takes_out else outs[1:]
        return getattr(torch.ops.ppma, self.name + "_backward")(grad_out, *ins, *saved, *self.extra(ins[0].shape[-1]))

    def reference(self, ins):
        from ppma.ops import reference as ref

        if self.name == "polyline_linear_attention":
            return ref.polyline_linear_attention_ref(*ins, True, 1e-6)
        return getattr(ref, self.name + "_ref")(*ins, ins[0].shape[-1] ** -0.5)


OPS = {
    "polyline_attention": OpSpec("polyline_attention", ("out_v2h", "lse"), backward_takes_out=True),
    "criss_cross_attention": OpSpec("criss_cross_attention", ("lse",)),
    "polyline_linear_attention": OpSpec("polyline_linear_attention", ("stats",), nonneg_qk=True,
                                        extra=lambda d: (True, 1e-6)),
}
GRAD_NAMES = ("grad_q", "grad_k", "grad_v", "grad_log_alpha", "grad_log_beta")


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def next_kernel_status(op: str, root: str = ROOT) -> tuple[bool, str]:
    """Whether the CUDA launcher of ``op`` has a next kernel: it reads ``Option::kCudaNext<Op>`` (the option
    ``cuda_next_<op>``, csrc/common/options.h) in ``csrc/cuda/*.cu``, the sources the library was built from (its
    source stamp is checked at import). Returns (present, a sentence for the tables)."""
    enum = f"Option::kCudaNext{_camel(op)}"
    users = [os.path.relpath(p, root) for p in sorted(glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))
             if enum in open(p, encoding="utf-8").read()]
    if users:
        return True, f"next kernel selected by {enum} in {', '.join(users)}"
    return False, f"unchanged: no launcher in csrc/cuda reads {enum} (cuda_next_{op} = 1 runs the verified kernel)"


def option(name: str, value: int):
    """Context manager: the internal option ``name`` set to ``value`` inside the block, restored after."""
    import ppma

    return ppma.config.internal_option(name, value)


# ------------------------------------------------------------------------------------------------ cases

# (op, [B, H, W, heads, d], dtype): the shapes of PPMA-T/S/B's stages and of the op table, the general path of
# polyline_attention (W < 16), odd sizes, every dtype.
CHECK_CASES = [
    ("polyline_attention", (8, 64, 64, 4, 32), "bfloat16"),
    ("polyline_attention", (8, 48, 48, 4, 32), "bfloat16"),
    ("polyline_attention", (64, 14, 14, 8, 32), "bfloat16"),
    ("polyline_attention", (64, 28, 28, 4, 32), "bfloat16"),  # next kernels: two-row form (16 < W < 32)
    ("polyline_attention", (2, 9, 17, 2, 128), "float16"),
    ("polyline_attention", (2, 96, 96, 4, 64), "bfloat16"),
    ("polyline_attention", (2, 13, 37, 2, 24), "float16"),
    ("polyline_attention", (2, 20, 9, 2, 32), "float32"),
    ("polyline_attention", (1, 11, 7, 2, 16), "float64"),
    ("criss_cross_attention", (64, 56, 56, 4, 16), "bfloat16"),
    ("criss_cross_attention", (64, 28, 28, 4, 32), "bfloat16"),
    ("criss_cross_attention", (4, 7, 130, 2, 32), "bfloat16"),
    ("criss_cross_attention", (2, 33, 17, 2, 24), "float16"),
    ("criss_cross_attention", (2, 19, 23, 2, 32), "float32"),
    ("criss_cross_attention", (1, 9, 6, 2, 16), "float64"),
    ("polyline_linear_attention", (2, 32, 32, 4, 32), "bfloat16"),
    ("polyline_linear_attention", (8, 64, 64, 4, 32), "bfloat16"),
    ("polyline_linear_attention", (2, 13, 37, 2, 24), "float16"),
    ("polyline_linear_attention", (2, 20, 9, 2, 32), "float32"),
    ("polyline_linear_attention", (1, 11, 7, 2, 16), "float64"),
]
SMOKE_CHECK_CASES = [
    ("polyline_attention", (1, 5, 6, 2, 16), "float32"),
    ("criss_cross_attention", (1, 5, 6, 2, 16), "float32"),
    ("polyline_linear_attention", (1, 5, 6, 2, 16), "float64"),
]
# The op table's shapes where the launchers spend the model's time.
TIME_CASES = [
    ("polyline_attention", (8, 64, 64, 4, 32), "bfloat16"),
    ("polyline_attention", (8, 32, 32, 4, 32), "bfloat16"),
    ("polyline_attention", (64, 28, 28, 4, 32), "bfloat16"),
    ("polyline_attention", (64, 14, 14, 8, 32), "bfloat16"),
    ("polyline_attention", (64, 7, 7, 16, 32), "bfloat16"),
    ("criss_cross_attention", (64, 56, 56, 4, 16), "bfloat16"),
    ("criss_cross_attention", (64, 28, 28, 4, 32), "bfloat16"),
    ("polyline_linear_attention", (8, 64, 64, 4, 32), "bfloat16"),
    ("polyline_linear_attention", (1, 256, 256, 4, 32), "bfloat16"),
]
SMOKE_TIME_CASES = [(op, (1, 5, 6, 2, 16), "float32") for op in OPS]

# Relative error allowed between the next and the verified kernel (both round to the dtype).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-10}
# The float64 reference builds N x N matrices: only where B * heads * N^2 stays below this.
REF_MAX_ELEMENTS = 1 << 28


def make_inputs(spec: OpSpec, shape, dtype: torch.dtype, device: torch.device, seed: int):
    """Fresh random q, k, v, log_alpha, log_beta (log-decays in [-1, 0), never zeros) on ``device``."""
    B, H, W, G, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, W, G, d, generator=g, dtype=torch.float64) for _ in range(3))
    if spec.nonneg_qk:
        q, k = q.abs(), k.abs()
    la = -torch.rand(B, H, W, G, generator=g, dtype=torch.float64) - 1e-3
    lb = -torch.rand(B, H, W, G, generator=g, dtype=torch.float64) - 1e-3
    ld = torch.float64 if dtype == torch.float64 else torch.float32
    return [q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), la.to(device, ld), lb.to(device, ld)]


def run_kernels(spec: OpSpec, ins, grad_out):
    """Forward and backward of the raw op: {name: tensor} for out, the saved tensors and the five gradients."""
    outs = spec.forward(ins)
    grads = spec.backward(grad_out, ins, outs)
    res = {"out": outs[0]}
    res.update(zip(spec.saved, outs[1:]))
    res.update(zip(GRAD_NAMES, grads))
    return res


def reference(spec: OpSpec, ins, grad_out):
    """out and the five gradients of the float64 reference (autograd)."""
    ins64 = [t.detach().double().requires_grad_(True) for t in ins]
    out = spec.reference(ins64)
    out.backward(grad_out.double())
    res = {"out": out.detach()}
    res.update(zip(GRAD_NAMES, (t.grad for t in ins64)))
    return res


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN if either holds a NaN; 0 for two zero tensors)."""
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("nan")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        # infinities in the same places (e.g. lse of masked rows) compare as equal; NaN never does
        if torch.isnan(a).any() or torch.isnan(b).any() or not torch.equal(torch.isinf(a), torch.isinf(b)):
            return float("nan")
        keep = torch.isfinite(b)
        if not torch.equal(a[~keep], b[~keep]):
            return float("nan")
        a, b = a[keep], b[keep]
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def check_case(spec: OpSpec, shape, dtype_name: str, device: torch.device, seed: int) -> dict:
    """One comparison: the next kernel against the verified one on the same inputs (and both against the float64
    reference where affordable), and the next kernel against itself (bitwise)."""
    dtype = getattr(torch, dtype_name)
    ins = make_inputs(spec, shape, dtype, device, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    B, H, W, G, _ = shape
    grad_out = torch.randn(*shape[:4], ins[2].shape[-1], generator=g, dtype=torch.float64).to(device, dtype)
    with option(spec.option, 0):
        old = run_kernels(spec, ins, grad_out)
    with option(spec.option, 1):
        new = run_kernels(spec, ins, grad_out)
        again = run_kernels(spec, ins, grad_out)
    tol = TOLERANCE[dtype]
    row = {"op": spec.name, "shape": list(shape), "dtype": dtype_name, "seed": seed, "tol": tol, "errors": {},
           "ref_errors": {}, "deterministic": all(bitwise_equal(new[k], again[k]) for k in new),
           "bitwise_equal_to_old": all(bitwise_equal(new[k], old[k]) for k in new)}
    for k in old:
        row["errors"][k] = rel_err(new[k], old[k])
    ok = all(e == e and e <= tol for e in row["errors"].values())
    if B * G * (H * W) ** 2 <= REF_MAX_ELEMENTS:
        ref = reference(spec, ins, grad_out)
        for k in ref:
            e_old, e_new = rel_err(old[k], ref[k]), rel_err(new[k], ref[k])
            row["ref_errors"][k] = {"old": e_old, "new": e_new}
            # the next kernel may round differently, never much worse than the verified one
            ok = ok and e_new == e_new and e_new <= 2 * e_old + tol / 4
    row["ok"] = bool(ok and row["deterministic"])
    return row


def cmd_check(args) -> int:
    device = _device(args)
    env = environment(device)
    cases = SMOKE_CHECK_CASES if args.smoke else CHECK_CASES
    rows, skipped = [], {}
    for op in args.ops:
        present, why = next_kernel_status(op)
        if not present and not args.smoke:
            skipped[op] = why
            print(f"check {op}: skipped, {why}", flush=True)
            continue
        if not present:
            skipped[op] = why + "; smoke run: compared anyway"
        for case_op, shape, dt in cases:
            if case_op != op:
                continue
            t0 = time.perf_counter()
            try:
                row = check_case(OPS[op], shape, dt, device, seed=len(rows))
            except Exception as e:  # recorded: the other cases go on
                row = {"op": op, "shape": list(shape), "dtype": dt, "ok": False, "error": f"{type(e).__name__}: {e}"}
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
            _free(device)
    md = _check_markdown(env, rows, skipped, args.smoke)
    _write(args.out, "check", {"env": env, "rows": rows, "skipped": skipped, "smoke": args.smoke}, md)
    print(md)
    return 0 if all(r["ok"] for r in rows) else 1


def _fmt(e) -> str:
    return "nan" if e != e else f"{e:.1e}"


def _check_markdown(env, rows, skipped, smoke) -> str:
    lines = [f"# Next CUDA kernels against the verified ones: {env['device_name']}", "", _env_line(env), "",
             "Relative error ||new - old|| / ||old|| per output and gradient (worst shown), the float64 reference's "
             "errors of old and new (worst gradient), two runs of the new kernel bitwise equal.", ""]
    for op, why in skipped.items():
        lines.append(f"- {op}: {why}")
    lines += ["", "| op | shape | dtype | ok | worst new/old | where | ref old | ref new | deterministic | "
              "bitwise = old | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['dtype']} | FAIL | | | | | | | "
                         f"{r['seconds']:.1f} |")
            lines.append(f"|  | {r['error'][:200]} |")
            continue
        worst = max(r["errors"], key=lambda k: float("inf") if r["errors"][k] != r["errors"][k] else r["errors"][k])
        ref_old = max((v["old"] for v in r["ref_errors"].values()), default=None)
        ref_new = max((v["new"] for v in r["ref_errors"].values()), default=None)
        lines.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['dtype']} | {'ok' if r['ok'] else 'FAIL'} "
                     f"| {_fmt(r['errors'][worst])} | {worst} | {'' if ref_old is None else _fmt(ref_old)} | "
                     f"{'' if ref_new is None else _fmt(ref_new)} | {r['deterministic']} | "
                     f"{r['bitwise_equal_to_old']} | {r['seconds']:.1f} |")
    if smoke:
        lines += ["", "Smoke run on the CPU: the options select CUDA kernels only, so old and new are the same kernel."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ timing


class Clock:
    """Per-call times in ms: CUDA events on a GPU, the host clock (after synchronising) elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def times(self, fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        if self.cuda:
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            torch.cuda.synchronize()
            for start, end in pairs:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            out = [s.elapsed_time(e) for s, e in pairs]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append(1e3 * (time.perf_counter() - t0))
        return out


def profile_kernels(fn: Callable[[], object], device: torch.device, calls: int = 3) -> list[dict]:
    """The kernels one call of fn starts, with their mean time per call (torch.profiler; on the CPU the ops'
    self time): [{"kernel", "count", "us"}], longest first; empty if the profiler is not available."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    fn()
    _sync(device)
    try:
        with profile(activities=acts) as prof:
            for _ in range(calls):
                fn()
            _sync(device)
    except Exception as e:  # a profiler that cannot attach (a virtual machine) must not lose the timings
        return [{"kernel": f"profiler unavailable: {type(e).__name__}: {str(e)[:100]}", "count": 0, "us": 0.0}]
    rows = []
    for ev in prof.key_averages():
        if device.type == "cuda":
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0.0)
            if getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
                continue
        else:
            t = ev.self_cpu_time_total
        if t > 0:
            rows.append({"kernel": ev.key[:120], "count": ev.count // calls, "us": t / calls})
    return sorted(rows, key=lambda r: -r["us"])


def time_case(spec: OpSpec, shape, dtype_name: str, device: torch.device, present: bool, rounds: int,
              warmup: int, reps: int) -> dict:
    """Forward and backward launchers of the verified kernel (and of the next one when present), alternated
    over ``rounds``; medians in ms, the range of the rounds' medians, and the kernels of one profiled call."""
    dtype = getattr(torch, dtype_name)
    ins = make_inputs(spec, shape, dtype, device, seed=0)
    grad_out = torch.randn_like(ins[2])
    variants = {"old": 0, "new": 1} if present else {"old": 0}
    saved = {}
    for name, value in variants.items():
        with option(spec.option, value):
            saved[name] = spec.forward(ins)
    clock = Clock(device)
    # slow launchers (PPMLA at 256 x 256: about 0.1 s a call) get fewer calls, so that the part stays short
    slow = max(statistics.median(clock.times(lambda: spec.backward(grad_out, ins, saved["old"]), 0, 1)),
               statistics.median(clock.times(lambda: spec.forward(ins), 0, 1)))
    if slow > 20.0:
        warmup, reps = min(warmup, 2), max(3, reps // 4)
    samples = {(n, p): [] for n in variants for p in ("fwd", "bwd")}
    medians = {(n, p): [] for n in variants for p in ("fwd", "bwd")}
    for _ in range(rounds):
        for name, value in variants.items():
            with option(spec.option, value):
                for p, fn in (("fwd", lambda: spec.forward(ins)),
                              ("bwd", lambda: spec.backward(grad_out, ins, saved[name]))):
                    t = clock.times(fn, warmup, reps)
                    samples[(name, p)] += t
                    medians[(name, p)].append(statistics.median(t))
    row = {"op": spec.name, "shape": list(shape), "dtype": dtype_name, "rounds": rounds, "reps": reps, "times": {},
           "kernels": {}}
    for (name, p), t in samples.items():
        row["times"][f"{name} {p}"] = {"median_ms": statistics.median(t), "round_min_ms": min(medians[(name, p)]),
                                       "round_max_ms": max(medians[(name, p)])}
    for name, value in variants.items():
        with option(spec.option, value):
            row["kernels"][f"{name} fwd"] = profile_kernels(lambda: spec.forward(ins), device)
            row["kernels"][f"{name} bwd"] = profile_kernels(
                lambda: spec.backward(grad_out, ins, saved[name]), device)
    return row


def cmd_time(args) -> int:
    device = _device(args)
    env = environment(device)
    cases = SMOKE_TIME_CASES if args.smoke else TIME_CASES
    rounds, warmup, reps = (2, 1, 3) if args.smoke else (args.rounds, args.warmup, args.reps)
    rows, notes = [], {}
    for op in args.ops:
        present, why = next_kernel_status(op)
        if present:
            notes[op] = why
        elif args.smoke:  # both variants, to exercise the code (on the CPU they are the same kernel)
            notes[op] = why + "; smoke run: timed as old and new anyway"
        else:
            notes[op] = why + "; the verified kernel alone is timed"
        for case_op, shape, dt in cases:
            if case_op != op:
                continue
            try:
                row = time_case(OPS[op], shape, dt, device, present or args.smoke, rounds, warmup, reps)
            except Exception as e:
                row = {"op": op, "shape": list(shape), "dtype": dt, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            md = _time_markdown(env, rows, notes, args.smoke)
            _write(args.out, "time", {"env": env, "rows": rows, "notes": notes, "smoke": args.smoke}, md)
            _free(device)
    md = _time_markdown(env, rows, notes, args.smoke)
    _write(args.out, "time", {"env": env, "rows": rows, "notes": notes, "smoke": args.smoke}, md)
    print(md)
    return 0 if rows and all("error" not in r for r in rows) else 1


def _time_markdown(env, rows, notes, smoke) -> str:
    clock = "CUDA events" if env["device"].startswith("cuda") else "host clock (smoke run)"
    lines = [f"# Kernel times, verified (old) and next (new): {env['device_name']}", "", _env_line(env), "",
             f"Launcher times in ms ({clock}, median over rounds x repeats after warm-up; in brackets the range of "
             "the rounds' medians); old and new alternate in one process.", ""]
    lines += [f"- {op}: {why}" for op, why in notes.items()]
    lines += ["", "| op | shape | dtype | old fwd | new fwd | old bwd | new bwd | old / new fwd | old / new bwd |",
              "|---|---|---|---|---|---|---|---|---|"]

    def cell(t):
        return "" if t is None else f"{t['median_ms']:.3f} [{t['round_min_ms']:.3f}, {t['round_max_ms']:.3f}]"

    for r in rows:
        shp = "x".join(map(str, r["shape"]))
        if "error" in r:
            lines.append(f"| {r['op']} | {shp} | {r['dtype']} | {r['error'][:150]} | | | | | |")
            continue
        t = r["times"]
        ratios = []
        for p in ("fwd", "bwd"):
            o, n = t.get(f"old {p}"), t.get(f"new {p}")
            ratios.append(f"{o['median_ms'] / n['median_ms']:.2f}" if o and n and n["median_ms"] > 0 else "")
        lines.append(f"| {r['op']} | {shp} | {r['dtype']} | {cell(t.get('old fwd'))} | {cell(t.get('new fwd'))} | "
                     f"{cell(t.get('old bwd'))} | {cell(t.get('new bwd'))} | {ratios[0]} | {ratios[1]} |")
    lines += ["", "Kernels per launcher call (profiler; mean us per call):", ""]
    for r in rows:
        for which, ks in r.get("kernels", {}).items():
            top = "; ".join(f"{k['kernel'][:70]} x{k['count']}: {k['us']:.1f}" for k in ks[:6])
            lines.append(f"- {r['op']} {'x'.join(map(str, r['shape']))} {which}: {top}")
    if smoke:
        lines += ["", "Smoke run on the CPU: the times are the CPU kernels', for the code path only."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ summary


def cmd_summary(args) -> int:
    """The last table of a run: each part's status and seconds (parts.tsv) and the tables' headline numbers."""
    out = args.out
    parts = []
    path = os.path.join(out, "parts.tsv")
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            cells = line.rstrip("\n").split("\t")
            if len(cells) >= 4:
                parts.append(cells[:4])
    gpu = "unknown device"
    for name in ("env.json", "check.json", "time.json"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            gpu = json.load(open(p)).get("env", {}).get("device_name", gpu)
            break
    lines = [f"# GPU run summary: {gpu}", "", "| part | status | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in parts]
    lines += [""] + _headlines(out)
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def _headlines(out: str) -> list[str]:
    lines = []
    p = os.path.join(out, "check.json")
    if os.path.exists(p):
        c = json.load(open(p))
        n_ok = sum(r.get("ok", False) for r in c["rows"])
        lines.append(f"- check: {n_ok}/{len(c['rows'])} cases ok; skipped: "
                     + (", ".join(c["skipped"]) or "none"))
    p = os.path.join(out, "time.json")
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            t = r.get("times", {})
            cells = [f"{k} {v['median_ms']:.3f} ms" for k, v in t.items()]
            lines.append(f"- time {r['op']} {'x'.join(map(str, r['shape']))}: " + (", ".join(cells) or
                                                                                     r.get("error", "")[:100]))
    for p in sorted(glob.glob(os.path.join(out, "models_*.json"))):
        res = json.load(open(p))
        comp = res.get("settings", {}).get("compile") or "eager"
        for r in res.get("rows", []):
            ips = {k: "n/a" if r.get(k) is None else f"{r[k]:.0f}"
                   for k in ("infer_images_per_sec", "train_images_per_sec")}
            lines.append(f"- model {r['model']} {r['impl']} ({comp}): inference {ips['infer_images_per_sec']} img/s, "
                         f"training {ips['train_images_per_sec']} img/s")
    for name in ("graphs", "graphs_model"):  # pytest's last line: passed / failed / skipped counts
        p = os.path.join(out, name + ".log")
        if os.path.exists(p):
            tail = [ln for ln in open(p, encoding="utf-8", errors="replace").read().splitlines() if ln.strip()][-1:]
            lines.append(f"- {name} (tests/test_cuda_graphs.py): {tail[0] if tail else 'no output'}")
    return lines


# ------------------------------------------------------------------------------------------------ helpers


def _device(args) -> torch.device:
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: one thread (a thread pool on a busy machine costs more than them)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_run: no GPU visible (use --smoke for the CPU smoke run)")
    import ppma._ext as ext

    if not ext.has_cuda_kernels():
        raise SystemExit("gpu_run: ppma._C has no CUDA kernels: build it first (benchmarks/gpu_run.sh)")
    return torch.device("cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def environment(device: torch.device, smoke: bool = True) -> dict:
    """Versions, date and the device's name (the GPU's, or the CPU's: a smoke run, or a machine without a GPU)."""
    import ppma

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "ppma": getattr(ppma, "__version__", None), "device": str(device),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device_name=p.name, sm=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count)
    else:
        name = platform.processor() or "CPU"
        try:
            for line in open("/proc/cpuinfo", encoding="utf-8"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        env.update(device_name=f"CPU {name} ({'smoke run' if smoke else 'no GPU visible'})",
                   cpu_threads=torch.get_num_threads())
    return env


def _env_line(env: dict) -> str:
    extra = f", sm {env['sm']}, {env['multiprocessors']} SMs" if "sm" in env else ""
    return f"torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}{extra}; {env['date']}"


def _write(out: str, name: str, data: dict, md: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(md)


def cmd_env(args) -> int:
    """env.json / env.md: the device and versions (the name every other table repeats)."""
    device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else torch.device("cuda")
    env = environment(device, smoke=args.smoke)
    md = f"# Environment: {env['device_name']}\n\n{_env_line(env)}\n"
    _write(args.out, "env", {"env": env}, md)
    print(md)
    return 0


def tag(args) -> int:
    """Print the device's name, safe for a file name."""
    device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else torch.device("cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(re.sub(r"[^A-Za-z0-9.+-]+", "-", name))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["env", "check", "time", "summary", "tag"])
    ap.add_argument("--out", default="benchmarks/results/gpu_run", help="the output folder")
    ap.add_argument("--smoke", action="store_true", help="CPU tensors, tiny shapes: for the code path only")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    return {"env": cmd_env, "check": cmd_check, "time": cmd_time, "summary": cmd_summary, "tag": tag}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
