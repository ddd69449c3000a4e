"""Op benchmark of ppma's fused attention ops on a GPU (docs/design.md §6): the table of issue 9.

For each case, on the same inputs and in one process: the eager reference (``ppma.ops.reference``), the reference
under ``torch.compile``, FlexAttention with the same bias as a ``score_mod`` (``polyline_attention`` only: two
compiled passes, one per softmax), and ppma's fused op (for ``polyline_attention`` on CUDA also with its tensor-core
kernels switched off, the internal option ``cuda_tensor_cores`` = 0). Forward and forward + backward (every input gradient);
median time after warm-up (``ppma.timing.measure_time``, on ``torch.utils.benchmark``) and peak memory above the
inputs; ratios reference / fused.

Cases: ``polyline_attention`` bf16, 4 heads, head dim 32 and 64, at 32x32 to 128x128 tokens (1024-16384; batch 8 up to
4096 tokens, then 2 and 1);
``criss_cross_attention`` bf16 at the PPMA-T stage 1 and 2 shapes with batch 64 (56x56, 4 heads of 16; 28x28,
4 heads of 32); ``polyline_linear_attention`` bf16 (non-negative q, k; normalised) at 64x64, 128x128 and 256x256
tokens, 4 heads of 32, also against the softmax ``polyline_attention`` on the same inputs. Writes ``<out>.md`` and
``<out>.json``; the default is ``benchmarks/results/ops_gpu_<machine>`` (``ops_gpu_quick_<machine>`` with ``--quick``;
``<machine>``: :func:`ppma.timing.machine_tag`, e.g. ``H200``), one stable name per machine that the next run
overwrites; the torch and CUDA versions are in the header::

    python3 benchmarks/bench_gpu.py                 # the whole table (a few minutes on an H100)
    python3 benchmarks/bench_gpu.py --quick         # one shape per op
    python3 benchmarks/bench_gpu.py --device cpu --quick --out /tmp/ops-smoke   # smoke run: tiny shapes, CPU clock

``--next`` adds the rows "ppma fused, next kernel" for the ops whose CUDA launcher has a next kernel (the internal
option ``cuda_next_<op>`` = 1, docs/configuration.md), ``--no-compile`` leaves out the compiled implementations.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

# The checkout's ppma (this script's parent folder), before any installed one, as the other benchmarks do.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import ppma  # noqa: E402
import ppma.ops as ops  # noqa: E402
from ppma.ops import reference as ref  # noqa: E402
from ppma.timing import machine_tag, measure_time  # noqa: E402

# This benchmark measures the CUDA kernels (the default; PPMA_CUDA_KERNELS=0 in the shell would switch them off).
ops.set_impl("fused", cuda_kernels=True)

# (name, [B, H, W, heads, d]) per op; quick and CPU smoke sizes below
PA_SHAPES = [(8, 32, 32, 4, 32), (8, 48, 48, 4, 32), (8, 64, 64, 4, 32), (2, 96, 96, 4, 32), (1, 128, 128, 4, 32),
             (8, 32, 32, 4, 64), (8, 64, 64, 4, 64), (1, 128, 128, 4, 64)]
CC_SHAPES = [(64, 56, 56, 4, 16), (64, 28, 28, 4, 32)]
LA_SHAPES = [(8, 64, 64, 4, 32), (2, 128, 128, 4, 32), (1, 256, 256, 4, 32)]
CPU_PA_SHAPES = [(1, 6, 7, 2, 16)]
CPU_CC_SHAPES = [(2, 7, 7, 2, 16)]
CPU_LA_SHAPES = [(1, 6, 7, 2, 16)]


def bench(fn, device: torch.device, warmup: int, reps: int):
    """Median milliseconds of fn() and its peak memory (MiB) above what was allocated before (CUDA only), by
    ``ppma.timing.measure_time``."""
    t = measure_time(fn, repeat=reps, warmup=warmup, device=device, track_memory=True)
    return t.median_ms, t.peak_mib


def make_inputs(shape, dtype, device, grad: bool, seed: int = 0, nonneg_qk: bool = False):
    B, H, W, G, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, W, G, d, generator=g).to(device, dtype) for _ in range(3))
    if nonneg_qk:  # the features of linear attention (already mapped)
        q, k = q.abs(), k.abs()
    la = -torch.rand(B, H, W, G, generator=g).to(device)
    lb = -torch.rand(B, H, W, G, generator=g).to(device)
    return [t.requires_grad_(grad) for t in (q, k, v, la, lb)]


def _flex_two_pass(qf, kf, vf, cr, cc, W: int, scale: float):
    """Both softmaxes of polyline_attention as FlexAttention passes: score_mod adds M (first pass) and M^T
    (second) from the prefix sums cr, cc [B, heads, N], M[p, s] = R_i(j, l) + C_l(i, k) with
    R_i(j, l) = -|cr(i, j) - cr(i, l)|, C_l(i, k) = -|cc(k, l) - cc(i, l)| (docs/model.md §1.5; abs() is exact for
    log-decays <= 0, the benchmark's inputs)."""
    from torch.nn.attention.flex_attention import flex_attention

    def bias(b, h, p, s):
        il = (p // W) * W + s % W  # token (query row, key column)
        return -((cr[b, h, p] - cr[b, h, il]).abs() + (cc[b, h, s] - cc[b, h, il]).abs())

    def m1(score, b, h, p, s):
        return score + bias(b, h, p, s)

    def m2(score, b, h, p, s):
        return score + bias(b, h, s, p)

    # the average is taken outside: Inductor's CPU template of flex_attention takes no fused epilogue
    return flex_attention(qf, kf, vf, score_mod=m1, scale=scale), flex_attention(qf, kf, vf, score_mod=m2, scale=scale)


_flex_compiled = None


def flex_polyline(q, k, v, la, lb, scale):
    """polyline_attention through compiled FlexAttention; layouts and prefix sums outside the compiled region, so
    that the captured tensors are graph inputs (which Inductor's CPU lowering of flex_attention requires)."""
    global _flex_compiled
    if _flex_compiled is None:
        _flex_compiled = torch.compile(_flex_two_pass)
    B, H, W, G, d = q.shape
    cr = ref.prefix_sum_excl_first(la.float(), dim=2).permute(0, 3, 1, 2).reshape(B, G, H * W).contiguous()
    cc = ref.prefix_sum_excl_first(lb.float(), dim=1).permute(0, 3, 1, 2).reshape(B, G, H * W).contiguous()
    qf, kf, vf = (t.reshape(B, H * W, G, -1).transpose(1, 2).contiguous() for t in (q, k, v))
    o1, o2 = _flex_compiled(qf, kf, vf, cr, cc, W, scale)
    return (0.5 * (o1 + o2)).transpose(1, 2).reshape(B, H, W, G, -1)


def cuda_core_kernels():
    """The internal option cuda_tensor_cores = 0 for the duration (read by the CUDA launcher at each call)."""
    return ppma.config.internal_option("cuda_tensor_cores", 0)


def _linear_ref(q, k, v, la, lb, scale):
    return ref.polyline_linear_attention_ref(q, k, v, la, lb)


def _with_next_kernel(op: str, fn):
    """fn run with the op's next CUDA kernel (the internal option ``cuda_next_<op>`` = 1 for the call)."""

    def call(*a):
        old = ppma.config.set_internal_option(f"cuda_next_{op}", 1)
        try:
            return fn(*a)
        finally:
            ppma.config.set_internal_option(f"cuda_next_{op}", old)

    return call


def next_kernel_present(op: str) -> bool:
    """Whether the op's CUDA launcher has a next kernel (benchmarks/gpu_run.py, ``next_kernel_status``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from gpu_run import next_kernel_status
    finally:
        sys.path.pop(0)
    return next_kernel_status(op)[0]


def impls(op: str, device: torch.device, compiled: bool = True, next_kernel: bool = False):
    """name -> callable(q, k, v, la, lb, scale) for one op; ``compiled=False`` leaves out the compiled
    implementations (a smoke run), ``next_kernel`` adds "ppma fused, next kernel" (the option ``cuda_next_<op>``)."""
    if op == "polyline_attention":
        res = {
            "eager reference": ref.polyline_attention_ref,
            "compiled reference": torch.compile(ref.polyline_attention_ref),
            "compiled flex (2 passes)": flex_polyline,
            "ppma fused": ops.polyline_attention,
        }
        if device.type == "cuda":
            def cuda_cores(*a):
                with cuda_core_kernels():
                    return ops.polyline_attention(*a)

            res["ppma fused, CUDA cores"] = cuda_cores
    elif op == "polyline_linear_attention":  # no scale; normalised, eps 1e-6
        res = {
            "eager reference": _linear_ref,
            "compiled reference": torch.compile(_linear_ref),
            "ppma polyline_attention (softmax)": ops.polyline_attention,
            "ppma fused": lambda q, k, v, la, lb, scale: ops.polyline_linear_attention(q, k, v, la, lb),
        }
    else:
        res = {
            "eager reference": ref.criss_cross_attention_ref,
            "compiled reference": torch.compile(ref.criss_cross_attention_ref),
            "ppma fused": ops.criss_cross_attention,
        }
    if next_kernel:
        res["ppma fused, next kernel"] = _with_next_kernel(op, res["ppma fused"])
    if not compiled:
        res = {k: v for k, v in res.items() if not k.startswith("compiled")}
    return res


def run_case(op, shape, dtype, device, warmup, reps, rows, compiled=True, next_kernel=False):
    for mode in ("fwd", "fwd+bwd"):
        for name, fn in impls(op, device, compiled, next_kernel).items():
            ins = make_inputs(shape, dtype, device, grad=mode != "fwd", nonneg_qk=op == "polyline_linear_attention")
            scale = shape[4] ** -0.5
            note = ""

            def step(fn=fn, ins=ins):
                out = fn(*ins, scale)
                if mode != "fwd":
                    out.float().sum().backward()
                    for t in ins:
                        t.grad = None

            try:
                t, m = bench(step, device, warmup, reps)
            except Exception as e:  # out of memory, or a path that cannot run: recorded, and the table goes on
                if "flex" in name and mode != "fwd":
                    # FlexAttention versions without gradients of captured tensors: time it without decay gradients
                    ins[3].requires_grad_(False)
                    ins[4].requires_grad_(False)
                    note = "no log-decay gradients"
                    try:
                        t, m = bench(step, device, warmup, reps)
                    except Exception as e2:
                        t, m, note = float("nan"), None, f"{type(e2).__name__}: {str(e2)[:120]}"
                else:
                    t, m, note = float("nan"), None, f"{type(e).__name__}: {str(e)[:120]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row = {"op": op, "shape": list(shape), "tokens": shape[1] * shape[2], "pass": mode, "impl": name,
                   "ms": t, "peak_mib": m, "note": note}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ins
            if device.type == "cuda":
                torch.cuda.empty_cache()


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "ppma": getattr(ppma, "__version__", None), "device": str(device),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def default_out(device: torch.device, quick: bool) -> str:
    """The stable result path (without extension) of a run on ``device``: ``benchmarks/results/ops_gpu[_quick]_<machine>``."""
    return os.path.join("benchmarks", "results", f"ops_gpu{'_quick' if quick else ''}_{machine_tag(device)}")


def summary(rows) -> list[dict]:
    """Per case and pass: fused time and the ratios of every other implementation to it."""
    out = []
    keys = sorted({(r["op"], tuple(r["shape"]), r["pass"]) for r in rows}, key=str)
    for op, shape, mode in keys:
        sel = {r["impl"]: r for r in rows if r["op"] == op and tuple(r["shape"]) == shape and r["pass"] == mode}
        fused = sel.get("ppma fused")
        if fused is None:
            continue
        s = {"op": op, "shape": list(shape), "pass": mode, "fused_ms": fused["ms"], "fused_mib": fused["peak_mib"]}
        for name, r in sel.items():
            if name != "ppma fused":
                s[f"{name} / fused"] = r["ms"] / fused["ms"] if fused["ms"] == fused["ms"] else float("nan")
                if r["peak_mib"] is not None and fused["peak_mib"]:
                    s[f"{name} memory / fused"] = r["peak_mib"] / fused["peak_mib"]
        out.append(s)
    return out


def markdown(env, rows, summ, args) -> str:
    head = [f"# ppma fused ops: {env.get('gpu', 'CPU (smoke run)')}", "",
            f"torch {env['torch']}, CUDA {env['cuda']}, triton {env.get('triton', 'n/a')}, dtype {args.dtype}, "
            f"{args.warmup} warm-up + {args.reps} timed repeats, median ms"
            + (" (CUDA events)" if "gpu" in env else " (wall clock)") + "; peak MiB above the inputs"
            + (" (n/a on the CPU)" if "gpu" not in env else "") + f"; {env['date']}", "",
            "| op | B x H x W x heads x d | tokens | pass | impl | ms | peak MiB | note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mib = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        head.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['tokens']} | {r['pass']} | {r['impl']} | "
                    f"{r['ms']:.3f} | {mib} | {r['note']} |")
    head += ["", "Speed-up of ppma fused (time of the other implementation / time of ppma fused; memory likewise):", ""]
    cols = sorted({k for s in summ for k in s if k.endswith("/ fused")})
    head.append("| op | shape | pass | fused ms | " + " | ".join(cols) + " |")
    head.append("|---" * (4 + len(cols)) + "|")
    for s in summ:
        vals = " | ".join("" if c not in s or s[c] != s[c] else f"{s[c]:.2f}" for c in cols)
        head.append(f"| {s['op']} | {'x'.join(map(str, s['shape']))} | {s['pass']} | {s['fused_ms']:.3f} | {vals} |")
    return "\n".join(head) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output path without extension (default: benchmarks/results/ops_gpu_<machine>)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    ap.add_argument("--ops", nargs="+",
                    default=["polyline_attention", "criss_cross_attention", "polyline_linear_attention"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled implementations")
    ap.add_argument("--next", action="store_true",
                    help="add the next CUDA kernel of each op that has one (internal option cuda_next_<op>; "
                         "benchmarks/gpu_run.py); on the CPU the row is added anyway, for the code path")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no GPU visible; use --device cpu --quick for a smoke run")
    if not ppma.has_ext():
        raise SystemExit("bench_gpu: ppma._C is not built; the fused ops would fall back to the reference")
    dtype = getattr(torch, args.dtype)
    env = environment(device)
    if device.type == "cpu":
        pa, cc, la = CPU_PA_SHAPES, CPU_CC_SHAPES, CPU_LA_SHAPES
    else:
        pa, cc, la = (PA_SHAPES[:1], CC_SHAPES[1:], LA_SHAPES[:1]) if args.quick else (PA_SHAPES, CC_SHAPES, LA_SHAPES)
    rows: list[dict] = []
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    out = args.out or default_out(device, args.quick)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    md = ""
    for op, shapes in (("polyline_attention", pa), ("criss_cross_attention", cc), ("polyline_linear_attention", la)):
        if op in args.ops:
            nxt = args.next and (device.type != "cuda" or next_kernel_present(op))
            if args.next and not nxt:
                print(f"bench_gpu: {op} has no next CUDA kernel: no 'ppma fused, next kernel' row", flush=True)
            for shape in shapes:
                run_case(op, shape, dtype, device, args.warmup, args.reps, rows, not args.no_compile, nxt)
                # the tables so far, after every case: a run stopped early (a time limit) keeps what it measured
                md = write_tables(out, env, rows, args)
    print(md)
    print(f"written: {out}.md, {out}.json")
    return 0


def write_tables(out: str, env: dict, rows: list[dict], args) -> str:
    """Write ``<out>.json`` and ``<out>.md`` for the rows measured so far; returns the markdown."""
    summ = summary(rows)
    with open(out + ".json", "w") as f:
        json.dump({"env": env, "settings": vars(args), "rows": rows, "summary": summ}, f, indent=2)
    md = markdown(env, rows, summ, args)
    with open(out + ".md", "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    raise SystemExit(main())
