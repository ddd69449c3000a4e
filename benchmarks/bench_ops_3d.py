"""Benchmark of the 3-D polyline ops (paper appendix C.2; docs/video.md) against their dense
references at video token grids (T x H x W = 8 x 32 x 32 and 16 x 64 x 64 by default), batch 1, one head.

Every (op, grid, implementation, pass) runs in a fresh subprocess that builds the inputs, runs the pass once to warm
up, then times ``--repeats`` runs (median) and reports the increase of the peak resident set (``ru_maxrss`` after the
timed runs minus before the first run: the extra memory the pass needed, allocator overheads included). The dense
references build ``N x N`` masks (``N = T H W``); they run with an address-space limit of ``--ref-limit-gib`` and are
reported as out of memory where they cannot allocate within it. Passes that exceed ``--timeout`` seconds are
reported as such.

Usage: ``python benchmarks/bench_ops_3d.py [--grids 8x32x32 16x64x64] [--threads 1] [--quick]``.
Results go to ``benchmarks/results/ops_3d_<tag>.md`` / ``.json``, with the machine and torch version.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPS = ("polyline_scan_3d", "polyline_linear_attention_3d", "polyline_attention_3d")

_CHILD = r"""
import json, resource, statistics, sys, time
limit = {limit}
if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads({threads})
import ppma
from ppma.ops import reference_3d as R
op, impl, bwd = {op!r}, {impl!r}, {bwd!r}
T, H, W, d = {T}, {H}, {W}, {d}
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, T, H, W, 1, d, generator=g) for _ in range(3))
decs = [-torch.rand(1, T, H, W, 1, generator=g) for _ in range(3)]
if op == "polyline_linear_attention_3d":
    q, k = q.abs(), k.abs()
ins = ([v] if op == "polyline_scan_3d" else [q, k, v]) + decs
for t in ins:
    t.requires_grad_(bwd)
fn = getattr(ppma.ops, op) if impl == "fused" else getattr(R, op + "_ref")
def run():
    out = fn(*ins)
    if bwd:
        torch.autograd.grad(out, ins, torch.ones_like(out))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    run()
    times = []
    for _ in range({repeats}):
        t0 = time.perf_counter(); run(); times.append(time.perf_counter() - t0)
except (RuntimeError, MemoryError) as e:
    if "alloc" in str(e).lower() or isinstance(e, MemoryError):
        print(json.dumps({{"status": "out of memory"}})); sys.exit(0)
    raise
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({{"status": "ok", "ms": 1e3 * statistics.median(times), "peak_mib": peak / 1024}}))
"""


def run_case(op, impl, bwd, grid, args):
    T, H, W = grid
    limit = int(args.ref_limit_gib * 2**30) if impl == "reference" else 0
    code = _CHILD.format(limit=limit, root=ROOT, threads=args.threads, op=op, impl=impl, bwd=bwd, T=T, H=H, W=W,
                         d=args.d, repeats=args.repeats)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout (> {args.timeout:.0f} s)"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        if "alloc" in err.lower() or "memory" in err.lower() or p.returncode < 0:
            return {"status": "out of memory"}
        return {"status": f"error: {err[:120]}"}
    return json.loads(lines[-1])


def fmt(r):
    if r["status"] != "ok":
        return r["status"], "-"
    return f"{r['ms']:.1f}", f"{r['peak_mib']:.0f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", nargs="+", default=["8x32x32", "16x64x64"], help="T x H x W token grids")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--d", type=int, default=16, help="head dim d = dv (one head)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per (case, implementation, pass)")
    p.add_argument("--ref-limit-gib", type=float, default=16.0)
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--quick", action="store_true", help="one repeat")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--note", default="", help="conditions to record (e.g. 'busy machine')")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    grids = [tuple(int(x) for x in g.split("x")) for g in args.grids]
    rows = []
    from tqdm import tqdm

    cases = [(op, grid, bwd, impl) for op in args.ops for grid in grids for bwd in ([False] if args.no_backward
             else [False, True]) for impl in ("fused", "reference")]
    for op, grid, bwd, impl in tqdm(cases, desc="bench_ops_3d"):
        r = run_case(op, impl, bwd, grid, args)
        rows.append({"op": op, "grid": "x".join(map(str, grid)), "tokens": grid[0] * grid[1] * grid[2],
                     "pass": "fwd+bwd" if bwd else "fwd", "impl": impl, **r})
        tqdm.write(f"{op} {rows[-1]['grid']} {rows[-1]['pass']} {impl}: {r}")
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": args.threads, "d": args.d, "batch": 1, "heads": 1,
            "repeats": args.repeats, "ref_limit_gib": args.ref_limit_gib, "note": args.note}
    out = os.path.join(ROOT, "benchmarks", "results", f"ops_3d_{args.tag}")
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# 3-D polyline ops: fused CPU kernels vs dense references", "",
             f"{meta['date']}, torch {meta['torch']}, {meta['threads']} thread(s), batch 1, one head, d = dv = "
             f"{args.d}, median of {args.repeats}; reference address-space limit {args.ref_limit_gib:g} GiB. "
             f"{args.note}", "",
             "| op | T x H x W (N) | pass | fused ms | fused peak MiB | reference ms | reference peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        lines.append(f"| {a['op']} | {a['grid']} ({a['tokens']}) | {a['pass']} | {' | '.join(fmt(a))} | "
                     f"{' | '.join(fmt(b))} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
