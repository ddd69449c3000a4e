"""torch.compile against eager on the CPU: PPMA-T with ``ppma.compile.compile_model`` (docs/compile.md) beside the
same model run eagerly, in one process per case, the two alternating round by round.

Cases: fp32 and bf16 autocast, inference and training (forward, cross-entropy, backward). Eager inference runs the
deployment path (``ppma.nn.fuse_for_inference``) and, beside it, the plain model as ``create_model`` returns it in
eval mode (what a user who compiles instead of fusing would otherwise run); the compiled one freezes the weights of
an unfused copy. Eager training runs the model, compiled training a copy with the same weights. Stochastic depth is
off, so both compute the same function and the script also prints the largest logit difference of the first call.

Each round runs one eager and one compiled iteration (inference: also one of the plain model), timed in wall time
(``time.perf_counter``: what images per second mean) and in the process's CPU time (``time.process_time``, which a
busy machine disturbs less; with more than one thread it sums the threads' times, so it counts a part that runs on
one thread for less than the wall time does). The ratio is eager / compiled per round (> 1: the compiled model is
faster), reported as the median over rounds (wall and CPU time) and as the ratio of the two fastest iterations (wall).
The first call of each compiled graph (compilation, minutes for PPMA-T on 2 cores) is not timed.

Usage::

    python benchmarks/bench_compile_cpu.py [--threads 2] [--rounds 6] [--cases fp32-infer,bf16-train] [--depths 2,2,8,2]
                                           [--output FILE.md]

Prints a Markdown table naming the CPU (``ppma.backends.cpu_summary()``) and writes it to
``benchmarks/results/compile_cpu_<machine>.md`` (:func:`ppma.timing.machine_tag`), or to ``--output`` (a run of some
cases only, say, that should not replace the machine's table).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("fp32-infer", "bf16-infer", "fp32-train", "bf16-train")


def run_case(case: str, threads: int, rounds: int, depths: tuple[int, ...], batch: int, size: int) -> dict:
    """One case in this process: build PPMA-T (seed 0), compile, then ``rounds`` alternating eager / compiled
    iterations. Returns the times (s) and the first call's largest logit difference."""
    import torch

    import ppma
    from ppma.compile import compile_model

    torch.set_num_threads(threads)
    amp, phase = case.split("-")
    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", depths=depths, drop_path_rate=0.0)
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(2))

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16")

    if phase == "infer":
        model.eval()
        plain = copy.deepcopy(model)
        eager = ppma.nn.fuse_for_inference(copy.deepcopy(model))
        compiled = compile_model(model)

        def run(f):
            with torch.inference_mode(), autocast():
                return f(x).float()
    else:
        model.train()
        twin = copy.deepcopy(model)
        eager, compiled, plain = model, compile_model(twin), None

        def run(f):
            with autocast():
                out = f(x)
                loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            for p in (model if f is eager else twin).parameters():
                p.grad = None
            return out.detach().float()

    t0 = time.perf_counter()
    first = run(compiled)
    compile_s = time.perf_counter() - t0
    diff = (first - run(eager)).abs().max().item()
    runs = [(name, f) for name, f in (("eager", eager), ("compiled", compiled), ("plain", plain)) if f is not None]
    times: dict[str, list[float]] = {k: [] for name, _ in runs for k in (name, name + "_cpu")}
    for _ in range(rounds):
        for name, f in runs:
            c, w = time.process_time(), time.perf_counter()
            run(f)
            times[name].append(time.perf_counter() - w)
            times[name + "_cpu"].append(time.process_time() - c)
    return {"case": case, "compile_s": compile_s, "max_diff": diff, **times}


def _row(r: dict) -> str:
    e, c = r["eager"], r["compiled"]
    med = statistics.median(a / b for a, b in zip(e, c))
    med_cpu = statistics.median(a / b for a, b in zip(r["eager_cpu"], r["compiled_cpu"]))
    pl = r.get("plain")
    plain = (f"{min(pl) * 1e3:.0f} | {statistics.median(a / b for a, b in zip(pl, c)):.2f}x" if pl else "- | -")
    return (f"| {r['case']} | {min(e) * 1e3:.0f} | {min(c) * 1e3:.0f} | {med:.2f}x | {min(e) / min(c):.2f}x | "
            f"{med_cpu:.2f}x | {plain} | {r['compile_s']:.0f} | {r['max_diff']:.1e} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--depths", default="2,2,8,2", help="blocks per stage (PPMA-T: 2,2,8,2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--note", default="", help="a line under the table (e.g. 'machine busy')")
    p.add_argument("--output", default=None,
                   help="Markdown file to write (default benchmarks/results/compile_cpu_<machine>.md)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    depths = tuple(int(d) for d in a.depths.split(","))
    if a.child:
        print(json.dumps(run_case(a.child, a.threads, a.rounds, depths, a.batch, a.size)))
        return 0
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad or a.rounds < 1 or a.threads < 1:
        p.error(f"cases must be of {CASES} (got {bad}), rounds and threads >= 1")

    import torch

    import ppma.backends
    from ppma.timing import machine_tag

    rows = []
    for case in cases:
        print(f"[bench_compile_cpu] {case} (compiles first: minutes) ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--threads", str(a.threads),
               "--rounds", str(a.rounds), "--depths", a.depths, "--batch", str(a.batch), "--size", str(a.size)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(_row(rows[-1]), file=sys.stderr, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        f"torch.compile vs eager on the CPU (`python benchmarks/bench_compile_cpu.py`): {ppma.backends.cpu_summary()}; "
        f"torch {torch.__version__}, {a.threads} thread(s), PPMA-T depths {depths}, b{a.batch}@{a.size}, {a.rounds} "
        f"rounds (one eager and one compiled iteration each), {now}. Eager inference is the fused deployment model "
        "(`ppma.nn.fuse_for_inference`); plain eager the model as `create_model` returns it, in eval mode.",
        "",
        "| case | eager wall ms (fastest) | compiled wall ms (fastest) | eager / compiled, wall, median of rounds | "
        "eager / compiled, wall, fastest | eager / compiled, CPU time, median of rounds | "
        "plain eager wall ms (fastest) | plain eager / compiled, wall, median of rounds | compile s | "
        "max abs logit diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row(r) for r in rows),
    ]
    if a.note:
        lines += ["", a.note]
    text = "\n".join(lines) + "\n"
    print(text)
    path = a.output or os.path.join(ROOT, "benchmarks", "results", f"compile_cpu_{machine_tag('cpu')}.md")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"written: {os.path.relpath(path, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
