"""Benchmark of the fused ppma operators against the pure-PyTorch reference (the official formulation).

Two levels, at the real stage shapes of PPMA-T/S/B (docs/model.md §4.1):

* ``op``: ``polyline_attention`` / ``criss_cross_attention`` (``ppma.ops``) vs ``ppma.ops.reference`` on
  the same inputs, forward and forward+backward;
* ``layer``: ``ppma.nn.PPMAAttention`` (q/k/v projections, RoPE, LePE 5x5 depthwise conv, decay module,
  output projection) with ``impl="fused"`` vs ``impl="reference"``, same weights and inputs.

Times: ``ppma.timing.measure_time`` (``torch.utils.benchmark.Timer``): median over about ``--repeat`` passes after
a warm-up, both implementations timed in this process on the same inputs.
Peak memory: every (case, implementation, pass) is run once more in a fresh subprocess, which builds the
inputs, runs a tiny warm-up, resets its resident-set high-water mark (``/proc/self/clear_refs``), runs the
pass once, and reports ``VmHWM - VmRSS(before)``, the increase of the peak resident set size. That is the extra memory the pass needed (activations, saved
tensors, temporaries), including allocator overheads; it is honest for CPU where torch has no allocator
statistics. Cases whose dense reference would need more than ``--ref-limit-gib`` (16 GiB by default) are
not run for the reference (marked "skipped" in the table).

* ``linear`` (not part of ``all``): ``polyline_linear_attention`` (PPMLA, O(N)) against the full
  ``polyline_attention`` and against its dense reference at 32x32 .. 128x128 tokens (d = dv = 32), with the
  time / memory growth from 64x64 to 128x128 tokens; and PPMA-T with linear attention in stages 3-4 against the
  standard PPMA-T, both on the fused kernels ("standard") and in the official formulation ("official": the
  reference ops, N x N masks), forward and forward+backward, batch 1, at 512x512, 1024x1024 and 1333x800 (padded
  to 1344x800) inputs. The official model is first run in a child process whose address space may grow by at
  most ``--ref-limit-gib``; where it cannot allocate within that, it is reported as out of memory, not timed.

Usage: ``python benchmarks/bench_ops.py [--quick] [--level op|layer|all|linear] [--cases substr ...] [--threads N]``.
Results go to ``benchmarks/results/ops_<level>_cpu_<machine>[_<N>t][_<tag>].md`` / ``.json`` (``linear``: 
``linear_cpu_<machine>[_<N>t][_<tag>].json``), one stable name per level and machine that the next run overwrites
(``<machine>``: :func:`ppma.timing.machine_tag`; ``<N>t`` with ``--threads N``), with the machine and torch version
in the header.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import ppma  # noqa: E402
from ppma.models import MODEL_CONFIGS  # noqa: E402
from ppma.ops import reference  # noqa: E402
from ppma.timing import machine_tag, measure_time  # noqa: E402

# docs/model.md §4.1: (channels, heads) per stage and the mixer per stage.
VARIANTS = {
    "T": dict(dims=(64, 128, 256, 512), heads=(4, 4, 8, 16), mixer=MODEL_CONFIGS["ppma_tiny"].mixer),
    "S": dict(dims=(64, 128, 256, 512), heads=(4, 4, 8, 16), mixer=MODEL_CONFIGS["ppma_small"].mixer),
    "B": dict(dims=(80, 160, 320, 512), heads=(5, 5, 10, 16), mixer=MODEL_CONFIGS["ppma_base"].mixer),
}
# Input sizes (H, W): stem /4 by two stride-2 convs, then a stride-2 conv per stage (ceil halving).
RESOLUTIONS = {"224": (224, 224), "512": (512, 512), "1333x800": (800, 1344)}  # COCO padded to 32


def stage_grids(h: int, w: int):
    grids = []
    h, w = math.ceil(math.ceil(h / 2) / 2), math.ceil(math.ceil(w / 2) / 2)
    for _ in range(4):
        grids.append((h, w))
        h, w = math.ceil(h / 2), math.ceil(w / 2)
    return grids


def op_cases(batch: int):
    """Unique (op, H, W, heads, head_dim) over T/S/B x resolutions x stages."""
    seen, cases = set(), []
    for res, (h, w) in RESOLUTIONS.items():
        for vname, cfg in VARIANTS.items():
            for s, (H, W) in enumerate(stage_grids(h, w)):
                op = "criss_cross_attention" if cfg["mixer"][s] == "criss_cross" else "polyline_attention"
                G = cfg["heads"][s]
                d = cfg["dims"][s] // G
                key = (op, H, W, G, d)
                if key in seen:
                    continue
                seen.add(key)
                cases.append(dict(level="op", op=op, B=batch, H=H, W=W, G=G, d=d, where=f"{vname}{s + 1}@{res}"))
    return cases


def layer_cases(quick: bool):
    # The two target cases first (see the README of benchmarks/), then more stages.
    cases = [
        dict(level="layer", mixer="full", B=2, H=32, W=32, C=256, G=8, where="T3@512"),
        dict(level="layer", mixer="criss_cross", B=4, H=56, W=56, C=64, G=4, where="T1@224"),
    ]
    if not quick:
        cases += [
            dict(level="layer", mixer="full", B=8, H=14, W=14, C=256, G=8, where="T3@224"),
            dict(level="layer", mixer="full", B=8, H=7, W=7, C=512, G=16, where="T4@224"),
            dict(level="layer", mixer="criss_cross", B=4, H=28, W=28, C=128, G=4, where="T2@224"),
            dict(level="layer", mixer="criss_cross", B=2, H=128, W=128, C=64, G=4, where="T1@512"),
            dict(level="layer", mixer="full", B=1, H=50, W=84, C=256, G=8, where="T3@1333x800"),
        ]
    return cases


# --level linear: the implementations compared (the first is "ours") and their cases.
LINEAR_IMPLS = {
    "linear": lambda *a: ppma.ops.polyline_linear_attention(*a),
    "full": lambda *a: ppma.ops.polyline_attention(*a),
    "dense": lambda *a: reference.polyline_linear_attention_ref(*a),
}
# Model level: (mixer per stage, ppma.ops implementation). "standard" is PPMA-T on our fused kernels, "official"
# the same model in the official formulation (the reference ops, which build the N x N masks).
MODEL_IMPLS = {
    "linear34": (("criss_cross", "criss_cross", "linear", "linear"), "fused"),
    "standard": (("criss_cross", "criss_cross", "full", "full"), "fused"),
    "official": (("criss_cross", "criss_cross", "full", "full"), "reference"),
}


def linear_cases(quick: bool):
    sides = (64, 128) if quick else (32, 64, 96, 128)
    cases = [dict(level="linear_op", B=1, H=n, W=n, G=2, d=32, where=f"{n}x{n} tokens") for n in sides]
    sizes = {"512": (512, 512), "1024": (1024, 1024), "1333x800": (800, 1344)}
    for res in ("1024",) if quick else ("512", "1024", "1333x800"):
        h, w = sizes[res]
        cases.append(dict(level="model", B=1, H=h, W=w, G=0, where=f"PPMA-T@{res}"))
    return cases


def linear_skip(case, impl: str, limit: float) -> bool:
    """The dense reference builds several N x N tensors per head: skip it beyond the memory limit."""
    return impl == "dense" and 12 * 4 * case["B"] * case["G"] * (case["H"] * case["W"]) ** 2 > limit


def run_linear(a, repeat: int, warmup: int, cases) -> list:
    """``--level linear``: every implementation of each case, forward and forward+backward; ratios other / ours,
    and for the op the growth of our time and memory from each size to the next."""
    rows = []
    limit = a.ref_limit_gib * 2**30
    for case in cases:
        impls = list(LINEAR_IMPLS) if case["level"] == "linear_op" else list(MODEL_IMPLS)
        for backward in (False, True):
            row = dict(case=label(case), pass_="fwd+bwd" if backward else "fwd", **case)
            for impl in impls:
                if linear_skip(case, impl, limit):
                    row[impl] = None
                    continue
                if case["level"] == "model" and MODEL_IMPLS[impl][1] == "reference":
                    # the official formulation's N x N masks may not fit: try it first in a child process whose
                    # address space is capped at --ref-limit-gib above its start, and time it only if it ran
                    m = child_peak(case, impl, backward, cap_gib=a.ref_limit_gib)
                    if m == "oom":
                        row[impl] = dict(oom_cap_gib=a.ref_limit_gib)
                        continue
                else:
                    m = None if a.no_memory else child_peak(case, impl, backward)
                t, tmin = time_case(case, impl, backward, warmup, repeat)
                row[impl] = dict(time_s=t, min_time_s=tmin, peak_mib=m)
            ours = row[impls[0]]
            parts = [f"{row['case']:<32} {row['pass_']:<8}"]
            for impl in impls:
                r = row[impl]
                if r is None:
                    parts.append(f"{impl} skipped (dense > limit)")
                    continue
                if "oom_cap_gib" in r:
                    parts.append(f"{impl} cannot run (out of memory under a {r['oom_cap_gib']:g} GiB cap)")
                    continue
                txt = f"{impl} {r['time_s'] * 1e3:9.1f} ms {_fmt(r['peak_mib'], '8.1f')} MiB"
                if impl != impls[0]:
                    mem = r["peak_mib"] / max(ours["peak_mib"], 1e-3) if r["peak_mib"] and ours["peak_mib"] else None
                    txt += f" (x{r['time_s'] / ours['time_s']:.2f} time, x{_fmt(mem, '.2f')} mem)"
                parts.append(txt)
            print(" | ".join(parts), flush=True)
            rows.append(row)
    # growth of the op with the number of tokens
    ops = [r for r in rows if r["level"] == "linear_op"]
    for backward in ("fwd", "fwd+bwd"):
        seq = [r for r in ops if r["pass_"] == backward]
        for r0, r1 in zip(seq, seq[1:]):
            f0, f1 = r0["linear"], r1["linear"]
            tok = (r1["H"] * r1["W"]) / (r0["H"] * r0["W"])
            mem = f1["peak_mib"] / f0["peak_mib"] if f0["peak_mib"] and f1["peak_mib"] else None
            print(f"growth {r0['where']} -> {r1['where']} ({backward}): x{tok:.2f} tokens, "
                  f"x{f1['time_s'] / f0['time_s']:.2f} time, x{_fmt(mem, '.2f')} peak memory", flush=True)
    return rows


def ref_bytes(case) -> int:
    """Rough peak of the dense reference for fwd+bwd: ~8 live fp32 score-sized tensors."""
    B, H, W = case["B"], case["H"], case["W"]
    G = case["G"]
    full = case.get("op") == "polyline_attention" or case.get("mixer") == "full"
    per_head = (H * W) ** 2 if full else H * W * W + W * H * H
    return 8 * 4 * B * G * per_head


def label(case) -> str:
    if case["level"] in ("linear_op", "model"):
        return f"{case['level']} {case['where']}"
    if case["level"] == "op":
        return f"{case['op']} {case['where']} B{case['B']} {case['H']}x{case['W']} h{case['G']} d{case['d']}"
    return f"layer {case['mixer']} {case['where']} B{case['B']} {case['H']}x{case['W']} C{case['C']} h{case['G']}"


# ------------------------------------------------------------------------------------------------
# Building and running one case
# ------------------------------------------------------------------------------------------------


def build(case, impl: str, backward: bool):
    """Returns a zero-argument callable running the pass once."""
    g = torch.Generator().manual_seed(0)
    B, H, W, G = case["B"], case["H"], case["W"], case["G"]
    if case["level"] == "linear_op":
        d = case["d"]
        q, k, v = (torch.randn(B, H, W, G, d, generator=g) for _ in range(3))
        q, k = q.abs(), k.abs()  # PPMLA takes non-negative features
        la, lb = (-0.1 * torch.rand(B, H, W, G, generator=g) for _ in range(2))
        args = [t.requires_grad_(backward) for t in (q, k, v, la, lb)]
        fn = LINEAR_IMPLS[impl]
        run = lambda: fn(*args)  # noqa: E731
    elif case["level"] == "model":
        torch.manual_seed(0)
        mixer, ops_impl = MODEL_IMPLS[impl]
        model = ppma.create_model("ppma_tiny", num_classes=1000, drop_path_rate=0.0, mixer=mixer).eval()
        x = torch.randn(B, 3, H, W, generator=g)
        args = list(model.parameters())
        if not backward:
            model.requires_grad_(False)

        def run():
            with ppma.ops.use_impl(ops_impl):  # the attention modules read the switch at call time
                return model(x)
    elif case["level"] == "op":
        d = case["d"]
        q, k, v = (torch.randn(B, H, W, G, d, generator=g) for _ in range(3))
        la, lb = (-0.1 * torch.rand(B, H, W, G, generator=g) for _ in range(2))
        args = [t.requires_grad_(backward) for t in (q, k, v, la, lb)]
        name = case["op"]
        fn = getattr(ppma.ops, name) if impl == "fused" else getattr(reference, name + "_ref")
        run = lambda: fn(*args)  # noqa: E731
    else:
        from ppma.nn import PPMAAttention

        torch.manual_seed(0)
        layer = PPMAAttention(case["C"], G, mixer=case["mixer"])
        x = torch.randn(B, H, W, case["C"], generator=g).requires_grad_(backward)
        args = [x]

        def run():
            with ppma.ops.use_impl(impl):  # the layer's ops read the switch at call time
                return layer(x)
        if not backward:
            layer.requires_grad_(False)

    if backward:

        def step():
            out = run()
            out.backward(torch.ones_like(out))
            for a in args:
                a.grad = None

        return step

    def fwd():
        with torch.no_grad():
            run()

    return fwd


def time_case(case, impl, backward, warmup, repeat):
    """Median and minimum seconds per pass (``ppma.timing.measure_time``)."""
    t = measure_time(build(case, impl, backward), repeat=repeat, warmup=warmup)
    return t.median, t.min


def child_peak(case, impl, backward, cap_gib: float | None = None) -> float | str | None:
    """Peak-RSS increase (MiB) of one pass, measured in a fresh process (same torch thread count). With
    ``cap_gib``, the child's address space may grow by at most that much after its warm-up, and ``"oom"`` is
    returned when the pass could not allocate within it."""
    spec = dict(case=case, impl=impl, bwd=backward, threads=torch.get_num_threads(), cap_gib=cap_gib)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=dict(os.environ))
        last = out.stdout.strip().splitlines()[-1]
        return "oom" if last == "oom" else float(last)
    except Exception as exc:  # report, never fake a number
        print(f"  memory measurement failed for {label(case)} {impl}: {exc}", file=sys.stderr)
        return None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(spec):
    # ru_maxrss survives exec (it would report the parent's peak), so read the high-water mark of this
    # process's own address space (VmHWM), reset to the current RSS just before the pass.
    case, impl, backward = spec["case"], spec["impl"], spec["bwd"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    tiny = dict(case, B=1, H=32, W=32) if case["level"] == "model" else dict(case, B=1, H=2, W=2)
    build(tiny, impl, backward)()  # load kernels, thread pools
    f = build(case, impl, backward)
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    if spec.get("cap_gib"):
        import resource

        cap = _status_kib("VmSize") * 1024 + int(spec["cap_gib"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    base = _status_kib("VmRSS")
    try:
        f()
    except (RuntimeError, MemoryError) as exc:
        if spec.get("cap_gib") and ("alloc" in str(exc) or isinstance(exc, MemoryError)):
            print("oom")
            return
        raise
    peak = _status_kib("VmHWM")
    print((peak - base) / 1024.0)


# ------------------------------------------------------------------------------------------------


def result_name(kind: str, a) -> str:
    """The stable result file name (without extension) of a run: ``<kind>_cpu_<machine>[_<N>t][_<tag>]``."""
    return "_".join([kind, "cpu", machine_tag("cpu")] + ([f"{a.threads}t"] if a.threads else []) + ([a.tag] if a.tag else []))


def machine_info():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        python=platform.python_version(),
        fused_kernels=ppma.has_ext(),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few cases and repeats (2-core machines)")
    p.add_argument("--level", choices=["op", "layer", "all", "linear"], default="all")
    p.add_argument("--cases", nargs="*", default=None, help="only cases whose label contains one of these")
    p.add_argument("--batch", type=int, default=1, help="batch of the op-level cases")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--ref-limit-gib", type=float, default=16.0)
    p.add_argument("--max-tokens", type=int, default=None, help="skip op cases with more tokens (quick: 4200)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="", help="a suffix of the result file name (e.g. a subset of --cases)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's); 1 is steadier on a shared machine"
    )
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        _child(json.loads(a._child))
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    if not ppma.has_ext():
        print("warning: ppma._C is not built; 'fused' runs the reference", file=sys.stderr)
    repeat = a.repeat or (3 if a.quick else 7)
    warmup = 1
    cases = []
    if a.level in ("layer", "all"):
        cases += layer_cases(a.quick)
    if a.level in ("op", "all"):
        ocs = op_cases(a.batch)
        max_tokens = a.max_tokens or (4200 if a.quick else None)
        if max_tokens:
            ocs = [c for c in ocs if c["H"] * c["W"] <= max_tokens]
        if a.quick:  # one case per (op, resolution family) shape class is enough
            ocs = [c for c in ocs if c["where"].endswith("@224") or c["where"].endswith("@512")]
        cases += ocs
    if a.level == "linear":
        cases = linear_cases(a.quick)
        if a.cases:
            cases = [c for c in cases if any(s in c["where"] for s in a.cases)]
        rows = run_linear(a, repeat, warmup, cases)
        os.makedirs(a.out, exist_ok=True)
        base = os.path.join(a.out, result_name("linear", a))
        with open(base + ".json", "w") as fh:
            json.dump(dict(machine=machine_info(), repeat=repeat, quick=a.quick, rows=rows), fh, indent=1)
        print(f"wrote {base}.json")
        return
    if a.cases:
        cases = [c for c in cases if any(s in label(c) for s in a.cases)]

    info = machine_info()
    rows = []
    limit = a.ref_limit_gib * 2**30
    for case in cases:
        for backward in (False, True):
            row = dict(case=label(case), pass_="fwd+bwd" if backward else "fwd", **case)
            for impl in ("fused", "reference"):
                if impl == "reference" and ref_bytes(case) > limit:
                    row[impl] = None
                    continue
                t, tmin = time_case(case, impl, backward, warmup, repeat)
                m = None if a.no_memory else child_peak(case, impl, backward)
                row[impl] = dict(time_s=t, min_time_s=tmin, peak_mib=m)
            f, r = row["fused"], row["reference"]
            row["speedup"] = r["time_s"] / f["time_s"] if r else None
            row["speedup_min"] = r["min_time_s"] / f["min_time_s"] if r else None
            row["mem_ratio"] = (r["peak_mib"] / max(f["peak_mib"], 1e-3)) if (r and f["peak_mib"] and r["peak_mib"]) else None
            rows.append(row)
            print(format_row(row), flush=True)

    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, result_name(f"ops_{a.level}", a))
    with open(base + ".json", "w") as fh:
        json.dump(dict(machine=info, repeat=repeat, quick=a.quick, rows=rows), fh, indent=1)
    with open(base + ".md", "w") as fh:
        fh.write(markdown(info, rows, repeat))
    print(f"wrote {base}.md and .json")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def format_row(r):
    f, ref = r["fused"], r["reference"]
    if ref is None:
        return f"{r['case']:<75} {r['pass_']:<8} fused {f['time_s'] * 1e3:9.2f} ms {_fmt(f['peak_mib'], '8.1f')} MiB | reference skipped (dense > limit)"
    return (
        f"{r['case']:<75} {r['pass_']:<8} fused {f['time_s'] * 1e3:9.2f} ms {_fmt(f['peak_mib'], '8.1f')} MiB | "
        f"ref {ref['time_s'] * 1e3:9.2f} ms {_fmt(ref['peak_mib'], '8.1f')} MiB | x{r['speedup']:.2f} time, "
        f"x{_fmt(r['mem_ratio'], '.2f')} memory (min-time x{r['speedup_min']:.2f})"
    )


def markdown(info, rows, repeat):
    lines = [
        "# ppma CPU benchmark: fused ops vs the reference (official formulation)",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads); torch {info['torch']}, "
        f"Python {info['python']}; {info['date']}. Median of about {repeat} runs after a warm-up (ppma.timing), fp32.",
        "",
        "Peak memory = increase of the peak resident set size of a fresh process running the pass once "
        "(after building the inputs), i.e. the extra memory the pass needs. Ratios: reference / fused.",
        "'skipped': the dense reference would need more than the memory limit.",
        "",
        "On a shared machine the median is disturbed by other load; 'speed-up (min)' compares the fastest runs.",
        "",
        "| case | pass | fused ms | fused peak MiB | ref ms | ref peak MiB | speed-up | speed-up (min) | memory ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f, ref = r["fused"], r["reference"]
        if ref is None:
            lines.append(
                f"| {r['case']} | {r['pass_']} | {f['time_s'] * 1e3:.2f} | {_fmt(f['peak_mib'], '.1f')} | skipped | skipped | - | - | - |"
            )
        else:
            lines.append(
                f"| {r['case']} | {r['pass_']} | {f['time_s'] * 1e3:.2f} | {_fmt(f['peak_mib'], '.1f')} | "
                f"{ref['time_s'] * 1e3:.2f} | {_fmt(ref['peak_mib'], '.1f')} | {r['speedup']:.2f}x | {r['speedup_min']:.2f}x | "
                f"{_fmt(r['mem_ratio'], '.2f')}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
