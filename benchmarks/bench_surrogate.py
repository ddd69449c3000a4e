"""Long 1-D sequences (the time-series use of the Surrogate Attention Block): the SAB's token mixing against softmax
attention and polyline path masked linear attention, time and peak memory from 1k to 64k tokens.

Three ways to mix ``N`` tokens of ``heads x d`` channels (batch 1), on the same random inputs:

* ``sab``: ``ppma.nn.surrogate_mixing(q, k, v)``, the SAB's FFT circular convolution gated by ``v``
  (``[1, N, heads d]``; ``O(N log N)`` time, ``O(N)`` memory);
* ``softmax``: ``torch.nn.functional.scaled_dot_product_attention`` (``[1, heads, N, d]``; ``O(N^2)`` time, and
  ``O(N^2)`` or ``O(N)`` memory as the backend torch picks decides);
* ``ppmla``: ``ppma.ops.polyline_linear_attention`` on the ``N x 1`` map (the 1-D polyline mask: a bidirectional
  decayed linear attention; ``elu + 1`` features, ``O(N d^2)``), the fused kernel.

Times: median of ``--repeats`` runs after one warm-up, forward and forward+backward. Peak memory: each (method, N,
pass) once more in a fresh child process: the increase of its peak resident set (``VmHWM``, reset just before the
pass) over its resident set before the pass, with the address space capped at ``--cap-gib`` more than after its
warm-up; a pass that cannot allocate within that is reported as out of memory. Softmax is skipped (not timed) at
sizes where its time, extrapolated as ``N^2`` from the previous size, would exceed ``--max-seconds``.

    python benchmarks/bench_surrogate.py                      # 1k, 4k, 16k, 64k tokens
    python benchmarks/bench_surrogate.py --sizes 1024 4096 --no-memory

Results: ``benchmarks/results/surrogate_seq_<tag>.md`` / ``.json`` with the machine, threads and a ``--note``; the
default tag is ``<machine>_<N>t`` (:func:`ppma.timing.machine_tag`, N threads), a stable name that the next run
overwrites.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = ("sab", "softmax", "ppmla")


def build(method: str, n: int, heads: int, d: int, backward: bool, seed: int = 0):
    """A closure running one pass of ``method`` on ``n`` tokens (inputs built here, outside the timed region)."""
    from ppma.nn import surrogate_mixing
    from ppma.ops import polyline_linear_attention

    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).requires_grad_(backward)  # noqa: E731
    if method == "sab":
        q, k, v = rnd(1, n, heads * d), rnd(1, n, heads * d), rnd(1, n, heads * d)
        run = lambda: surrogate_mixing(q, k, v)  # noqa: E731
        leaves = (q, k, v)
    elif method == "softmax":
        q, k, v = rnd(1, heads, n, d), rnd(1, heads, n, d), rnd(1, heads, n, d)
        run = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        leaves = (q, k, v)
    elif method == "ppmla":
        # the N x 1 map (one column: the mask is the 1-D mask of the column decays, row decays never enter); the
        # kernel's state is one row of the map, so this is its fast layout for a sequence (1 x N: ~2.4x slower)
        q, k, v = rnd(1, n, 1, heads, d), rnd(1, n, 1, heads, d), rnd(1, n, 1, heads, d)
        la = torch.zeros(1, n, 1, heads)
        lb = (-torch.rand(1, n, 1, heads, generator=gen) * 0.1).requires_grad_(backward)
        run = lambda: polyline_linear_attention(F.elu(q) + 1, F.elu(k) + 1, v, la, lb)  # noqa: E731
        leaves = (q, k, v, lb)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")

    def step():
        out = run()
        if backward:
            out.sum().backward()
            for t in leaves:
                t.grad = None
        return out

    return step


def timed(f, repeats: int) -> float:
    f()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_peak(spec: dict) -> float | str | None:
    """Peak-RSS increase (MiB) of one pass in a fresh process, ``"oom"`` if it cannot allocate under the cap."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
        last = out.stdout.strip().splitlines()[-1]
        return "oom" if last == "oom" else float(last)
    except Exception as exc:  # report, never fake a number
        print(f"  memory measurement failed for {spec}: {exc}", file=sys.stderr)
        return None


def _child(spec: dict) -> None:
    import resource

    torch.set_num_threads(spec["threads"])
    build(spec["method"], 64, spec["heads"], spec["d"], spec["backward"])()  # load kernels, thread pools
    f = build(spec["method"], spec["n"], spec["heads"], spec["d"], spec["backward"])
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    cap = _status_kib("VmSize") * 1024 + int(spec["cap_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    base = _status_kib("VmRSS")
    try:
        f()
    except (RuntimeError, MemoryError) as exc:
        if "alloc" in str(exc) or isinstance(exc, MemoryError):
            print("oom")
            return
        raise
    print((_status_kib("VmHWM") - base) / 1024.0)


def _fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("skipped"):
        return r["skipped"]
    mem = r.get("peak_mib")
    mem_s = "oom" if mem == "oom" else ("-" if mem is None else f"{mem:.0f} MiB")
    return f"{r['time_s'] * 1e3:.1f} ms / {mem_s}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d", type=int, default=32, help="channels per head")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=20.0, help="skip softmax where it would take longer")
    p.add_argument("--cap-gib", type=float, default=8.0, help="address-space cap of the memory children")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--tag", default=None, help="result file name suffix (default <machine>_<threads>t)")
    p.add_argument("--note", default="")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        _child(json.loads(a._child))
        return 0
    torch.set_num_threads(a.threads)
    import ppma

    if "ppmla" in a.methods and not ppma.has_ext():
        print("[bench_surrogate] ppma._C is not built: ppmla would run the dense reference; dropped", file=sys.stderr)
        a.methods = [m for m in a.methods if m != "ppmla"]
    rows, last_softmax = [], None
    for n in sorted(a.sizes):
        row = {"n": n}
        for backward in (False, True):
            pass_name = "fwd+bwd" if backward else "fwd"
            for method in a.methods:
                key = f"{method}_{pass_name}"
                if method == "softmax" and last_softmax is not None:
                    prev_n, prev_t = last_softmax[pass_name]
                    est = prev_t * (n / prev_n) ** 2
                    if est > a.max_seconds:
                        why = f"est. {est:.0f} s" if est != float("inf") else "skipped at a smaller N"
                        row[key] = {"skipped": f"skipped ({why})"}
                        print(f"N={n} {key}: {row[key]['skipped']}", flush=True)
                        continue
                t = timed(build(method, n, a.heads, a.d, backward), a.repeats)
                r = {"time_s": t}
                if not a.no_memory:
                    r["peak_mib"] = child_peak(dict(method=method, n=n, heads=a.heads, d=a.d, backward=backward,
                                                    threads=a.threads, cap_gib=a.cap_gib))
                row[key] = r
                print(f"N={n} {key}: {_fmt(r)}", flush=True)
        if "softmax_fwd" in row and "time_s" in row["softmax_fwd"]:
            last_softmax = {"fwd": (n, row["softmax_fwd"]["time_s"]),
                            "fwd+bwd": (n, row.get("softmax_fwd+bwd", {}).get("time_s", float("inf")))}
        rows.append(row)

    meta = dict(machine=f"{platform.machine()} CPU, {os.cpu_count()} cores", torch=torch.__version__,
                threads=a.threads, heads=a.heads, d=a.d, repeats=a.repeats, cap_gib=a.cap_gib,
                date=datetime.date.today().isoformat(), note=a.note)
    lines = [
        f"SAB token mixing vs softmax attention vs PPMLA on 1-D sequences (batch 1, {a.heads} heads x {a.d} "
        f"channels, fp32; {meta['machine']}, torch {meta['torch']}, {a.threads} thread(s); median of {a.repeats} "
        f"after a warm-up; peak memory = peak-RSS increase of the pass in a fresh process, capped at "
        f"{a.cap_gib:g} GiB; `benchmarks/bench_surrogate.py`).",
        "",
        "| N | pass | " + " | ".join(a.methods) + " |",
        "|---|---|" + "---|" * len(a.methods),
    ]
    for row in rows:
        for pass_name in ("fwd", "fwd+bwd"):
            lines.append(f"| {row['n']} | {pass_name} | "
                         + " | ".join(_fmt(row.get(f"{m}_{pass_name}")) for m in a.methods) + " |")
    if a.note:
        lines += ["", a.note]
    text = "\n".join(lines) + "\n"
    if a.tag is None:
        from ppma.timing import machine_tag

        a.tag = f"{machine_tag('cpu')}_{a.threads}t"
    base = os.path.join(ROOT, "benchmarks", "results", f"surrogate_seq_{a.tag}")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
