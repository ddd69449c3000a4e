"""CPU SIMD paths of the fused ops: polyline_attention and criss_cross_attention at the PPMA-T stage shapes of a
224x224 batch-8 forward (stage 1 criss-cross 56x56, 4 heads, d = 16; stage 2 criss-cross 28x28, 4 heads, d = 32;
stage 3 polyline 14x14, 8 heads, d = 32; stage 4 polyline 7x7, 16 heads, d = 32), forward and forward+backward,
float32 and bfloat16 inputs, on every SIMD path this machine runs (``PPMA_CPU_CAPABILITY``, ``ppma.backends``),
optionally against another build of ppma (``--before ROOT``: the root of another checkout with its ``ppma/_C``
built, e.g. the main branch before the AVX-512 / micro-kernel work).

Each configuration (build, capability) runs in its own child process (one ``ppma._C`` per process), single
threaded; the children are run in interleaved rounds and every time is the minimum over the rounds and the
repeats inside them, so that a busy machine slows all configurations alike and ratios are same-run ratios.

Usage: ``python benchmarks/bench_cpu_simd.py [--before ROOT] [--rounds 3] [--repeat 3] [--out NAME]``.
Results go to ``benchmarks/results/<NAME>.md`` and ``.json``; the default NAME is ``cpu_simd_<machine>``
(:func:`ppma.timing.machine_tag`), a stable name that the next run overwrites.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (stage, op, (B, H, W, heads, d, dv))
CASES = [
    ("stage1", "criss_cross_attention", (8, 56, 56, 4, 16, 16)),
    ("stage2", "criss_cross_attention", (8, 28, 28, 4, 32, 32)),
    ("stage3", "polyline_attention", (8, 14, 14, 8, 32, 32)),
    ("stage4", "polyline_attention", (8, 7, 7, 16, 32, 32)),
]
DTYPES = ("float32", "bfloat16")


def _child(root: str, repeat: int) -> dict:
    """Time every case in this process (the ppma of ``root``), single-threaded; min over ``repeat`` runs."""
    sys.path.insert(0, root)
    import torch

    import ppma

    torch.set_num_threads(1)
    try:
        from ppma import backends

        cap = backends.cpu_capability() + ("+bf16dot" if backends.cpu_bf16_dot() else "")
    except ImportError:  # a build without ppma.backends: 8-lane AVX path unless PPMA_CPU_BASELINE=1
        cap = "default" if os.environ.get("PPMA_CPU_BASELINE") == "1" else "avx2"
    times = {}
    for stage, op, (B, H, W, G, d, dv) in CASES:
        fn = getattr(ppma.ops, op)
        gen = torch.Generator().manual_seed(0)
        for dt in DTYPES:
            dtype = getattr(torch, dt)
            q, k = (torch.randn(B, H, W, G, d, generator=gen).to(dtype) for _ in range(2))
            v = torch.randn(B, H, W, G, dv, generator=gen).to(dtype)
            la, lb = (-0.5 * torch.rand(B, H, W, G, generator=gen) for _ in range(2))
            go = torch.randn(B, H, W, G, dv, generator=gen).to(dtype)
            for mode in ("fwd", "fwd+bwd"):
                inputs = [t.detach().requires_grad_(mode != "fwd") for t in (q, k, v, la, lb)]
                best = float("inf")
                for i in range(repeat + 1):  # the first run warms up
                    t0 = time.perf_counter()
                    if mode == "fwd":
                        with torch.no_grad():
                            fn(*inputs)
                    else:
                        out = fn(*inputs)
                        torch.autograd.grad(out, inputs, go)
                    if i:
                        best = min(best, time.perf_counter() - t0)
                times[f"{stage}|{op}|{dt}|{mode}"] = best * 1e3
    return {"capability": cap, "times_ms": times}


def _configs(before: str | None) -> list[tuple[str, str, dict]]:
    """(label, root, environment changes) of every configuration."""
    sys.path.insert(0, ROOT)
    from ppma import backends

    configs = []
    if before:
        configs.append(("before", before, {"PPMA_CPU_BASELINE": "0"}))
    for cap in backends.cpu_capabilities_available():
        configs.append((f"after:{cap}", ROOT, {"PPMA_CPU_CAPABILITY": cap}))
    return configs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="root of another ppma checkout (with its ppma/_C built) to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None, help="result file name without extension (default cpu_simd_<machine>)")
    p.add_argument("--note", default="", help="a line about the conditions (e.g. a busy machine)")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        print(json.dumps(_child(a._child, a.repeat)))
        return
    configs = _configs(a.before)
    best: dict[str, dict[str, float]] = {}
    caps: dict[str, str] = {}
    for rnd in range(a.rounds):
        for label, root, env in configs:
            child_env = {k: v for k, v in os.environ.items() if k not in ("PPMA_CPU_CAPABILITY", "PPMA_CPU_BASELINE")}
            child_env.update(env)
            child_env["PYTHONPATH"] = root
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", root, "--repeat",
                                  str(a.repeat)], env=child_env, capture_output=True, text=True, cwd=root)
            if res.returncode != 0:
                raise RuntimeError(f"{label}: {res.stderr[-2000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            caps[label] = r["capability"]
            for key, ms in r["times_ms"].items():
                best.setdefault(label, {})[key] = min(best.get(label, {}).get(key, float("inf")), ms)
            print(f"round {rnd + 1}/{a.rounds}: {label} ({r['capability']}) done", file=sys.stderr)
    keys = list(next(iter(best.values())).keys())
    labels = [c[0] for c in configs]
    ref = "before" if "before" in best else labels[0]
    lines = [f"# CPU SIMD paths: PPMA-T stage shapes at 224x224, batch 8 ({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch "
             f"{__import__('torch').__version__}; 1 thread; min over {a.rounds} interleaved rounds x {a.repeat} "
             f"repeats. {a.note}", "",
             "Configurations: " + ", ".join(f"`{lb}` = {caps[lb]}" for lb in labels) + ".", "",
             "| stage | op | dtype | pass | " + " | ".join(f"{lb} ms" for lb in labels) + " | " +
             " | ".join(f"{ref}/{lb}" for lb in labels if lb != ref) + " |",
             "|" + "---|" * (4 + 2 * len(labels) - 1)]
    for key in keys:
        stage, op, dt, mode = key.split("|")
        row = [stage, op, dt, mode] + [f"{best[lb][key]:.1f}" for lb in labels]
        row += [f"{best[ref][key] / best[lb][key]:.2f}x" for lb in labels if lb != ref]
        lines.append("| " + " | ".join(row) + " |")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    if a.out is None:
        sys.path.insert(0, ROOT)
        from ppma.timing import machine_tag

        a.out = f"cpu_simd_{machine_tag('cpu')}"
    base = os.path.join(ROOT, "benchmarks", "results", a.out)
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(base + ".json", "w") as f:
        json.dump({"capabilities": caps, "times_ms": best, "rounds": a.rounds, "repeat": a.repeat,
                   "note": a.note}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
