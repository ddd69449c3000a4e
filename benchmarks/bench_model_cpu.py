"""Whole-model CPU benchmark: PPMA-T with the fused ops (fp32 and bf16 autocast, eager and compiled with ``ppma.compile.compile_model``;
fp16 autocast on the unfused model, which ``fuse_for_inference`` does not take, on request: ``--entries "PPMA-T fp16"``)
beside the official formulation (the same model and weights with ``ppma.ops.use_impl("reference")``, i.e. the
dense-mask reference ops; "plain modules": also without the deployment step ``ppma.nn.fuse_for_inference``, i.e.
torch's modules as the official code runs them) and timm's Swin-T and ConvNeXt-T (fp32 and bf16 autocast) and
ResNet-50 (``pretrained=False``), all measured in ONE run on the same machine:

* batch 8 at 224²: inference (``eval()``, ``torch.inference_mode()``; eager PPMA-T entries other than the plain
  modules after ``ppma.nn.fuse_for_inference``, compiled ones without it) and training (forward, cross-entropy,
  backward, AdamW step: torch's fused step, as ppma's trainer takes; tables before 2026-11-29 evening ran torch's
  default step, about 30 ms more per step for PPMA-T on a 2-core CPU);
* batch 1 at 512²: the same two, with peak memory.

Every (model, case, phase) runs in a fresh subprocess with ``--threads`` threads: it builds the model (seed 0),
runs ``--warmup`` untimed iterations (compilation included), then ``--iters`` timed ones; images/s is the batch
over the median iteration time. Peak memory is the resident-set high-water mark of the iterations (warm-up
included) above the resident set before them: the subprocess resets the mark after building the model and
inputs (``/proc/self/clear_refs``) and reads ``VmHWM - VmRSS`` (Linux; elsewhere ``resource.getrusage``'s mark
above the RSS at start). It is the extra memory the iterations need (activations, saved tensors, workspaces,
optimizer state) on top of the model and inputs; for compiled entries it includes the compilation's.

Usage::

    python benchmarks/bench_model_cpu.py [--threads 2] [--quick] [--note "machine busy"] [--doc]

Writes ``benchmarks/results/model_cpu_<machine>.md`` and ``.json`` (:func:`ppma.timing.machine_tag`; the next run on
the machine overwrites them), naming the CPU and its bf16 matrix unit (``ppma.backends.cpu_summary()``), prints the
ratios with their targets (the low-precision ones by the matrix unit: :data:`LOWP_TARGETS`), and with ``--doc``
replaces the CPU table of docs/performance.md (between ``<!-- cpu-model:start -->`` and ``<!-- cpu-model:end -->``).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- cpu-model:start -->", "<!-- cpu-model:end -->"

# label -> (model name, impl, amp, compile). "timm:<name>" builds timm's model; impl "reference-plain": the reference
# ops on the unfused model (torch's modules, as the official code runs them).
ENTRIES = {
    "PPMA-T fused fp32": ("ppma_tiny", "fused", None, False),
    "PPMA-T fused bf16": ("ppma_tiny", "fused", "bf16", False),
    "PPMA-T fp16": ("ppma_tiny", "fused", "fp16", False),
    "PPMA-T fused fp32 compiled": ("ppma_tiny", "fused", None, True),
    "PPMA-T fused bf16 compiled": ("ppma_tiny", "fused", "bf16", True),
    "PPMA-T official formulation": ("ppma_tiny", "reference", None, False),
    "PPMA-T official, plain modules": ("ppma_tiny", "reference-plain", None, False),
    "Swin-T": ("timm:swin_tiny_patch4_window7_224", "fused", None, False),
    "Swin-T bf16": ("timm:swin_tiny_patch4_window7_224", "fused", "bf16", False),
    "ConvNeXt-T": ("timm:convnext_tiny", "fused", None, False),
    "ConvNeXt-T bf16": ("timm:convnext_tiny", "fused", "bf16", False),
    "ResNet-50": ("timm:resnet50", "fused", None, False),
}
# The low-precision targets by the CPU's bf16 matrix unit (ppma.backends.cpu_matrix_unit()): bf16 / fp32 inference,
# bf16 / fp32 training, PPMA-T bf16 / Swin-T bf16 and / ConvNeXt-T bf16 inference, all at b8@224. A CPU without bf16
# instructions has none (oneDNN emulates bf16 there, slower than fp32).
LOWP_TARGETS = {
    "amx": (">= 2.5", ">= 1.8", ">= 1.2", ">= 1.0"),
    "avx512_bf16": (">= 1.6", "-", "-", "-"),
}
# case -> (batch, image size, phases)
CASES = {
    "b8@224": (8, 224, ("infer", "train")),
    "b1@512": (1, 512, ("infer", "train")),
}
# Compiled entries: inference only (compiling the training graph takes minutes on 2 cores), in the cases of
# --compiled-cases (default: batch 8 at 224²).
COMPILED_PHASES = ("infer",)


# ------------------------------------------------------------------------------------------------ child
def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def run_child(spec: dict) -> dict:
    """One measurement in this (fresh) process; see the module docstring."""
    import resource

    import torch

    sys.path.insert(0, ROOT)
    import ppma
    import ppma.models  # noqa: F401  (makes timm's torchvision import work beside a CPU torch)

    torch.set_num_threads(spec["threads"])
    rss0 = _rss_kib("VmRSS")
    name, impl, amp, compiled = ENTRIES[spec["entry"]]
    batch, size, _ = CASES[spec["case"]]
    torch.manual_seed(0)
    if name.startswith("timm:"):
        import timm

        kw = {"img_size": size} if "swin" in name else {}
        model = timm.create_model(name[5:], pretrained=False, **kw)
    else:
        model = ppma.create_model(name)
    train = spec["phase"] == "train"
    model.train(train)
    if not (train or compiled or name.startswith("timm:") or impl.endswith("-plain") or amp == "fp16"):
        ppma.nn.fuse_for_inference(model)  # the deployment step for CPU inference (docs/design.md)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    fwd = model
    if compiled:  # ppma's recipe (docs/compile.md: frozen weights for inference); timm's models: torch.compile
        from ppma.compile import compile_model

        fwd = (torch.compile(model) if name.startswith("timm:") else compile_model(model, inference=not train))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    amp_ctx = (lambda: torch.autocast("cpu", dtype=amp_dtype)) if amp_dtype else None
    # torch's fused AdamW step, as ppma's trainer takes on the CPU (docs/training.md), for every model alike
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None

    def step():
        import contextlib

        with ppma.ops.use_impl(impl.split("-")[0]), (amp_ctx() if amp_ctx else contextlib.nullcontext()):
            if train:
                loss = torch.nn.functional.cross_entropy(fwd(x).float(), y)
            else:
                with torch.inference_mode():
                    fwd(x)
        if train:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    # The mark is reset before the warm-up: memory freed by an iteration stays in the allocator's heap (and in
    # the RSS), so a baseline taken after the warm-up would hide the activations.
    import gc

    gc.collect()
    exact = _reset_peak()
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    for _ in range(spec["warmup"]):
        step()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(spec["iters"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if exact and before is not None:
        peak_mib = (_rss_kib("VmHWM") - before) / 1024
    else:
        hw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hw = hw / 1024 if sys.platform == "darwin" else hw  # KiB
        peak_mib = (hw - (rss0 or 0)) / 1024
    med = statistics.median(times)
    return {"entry": spec["entry"], "case": spec["case"], "phase": spec["phase"], "img_s": batch / med,
            "ms_median": 1e3 * med, "peak_mib": max(peak_mib, 0.0), "peak_exact": exact, "warmup_s": warm_s,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


# ------------------------------------------------------------------------------------------------ parent
def _child_cmd(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]


def measure(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(_child_cmd(spec), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timeout after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    err = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {**spec, "error": err[:200]}


def combine(runs: list[dict]) -> dict:
    """One cell from its rounds (``--rounds``): the fastest round's time (the machine's noise only ever slows a
    run down) and the median of the rounds' peak memory; a cell that failed in any round is reported failed."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    best = dict(max(runs, key=lambda r: r["img_s"]))
    best["peak_mib"] = statistics.median(r["peak_mib"] for r in runs)
    best["rounds"] = [{"img_s": r["img_s"], "peak_mib": r["peak_mib"]} for r in runs]
    return best


def _find(rows, entry, case, phase):
    for r in rows:
        if r["entry"] == entry and r["case"] == case and r["phase"] == phase and "error" not in r:
            return r
    return None


def ratios(rows, matrix_unit: str | None = None) -> list[tuple[str, float | None, str]]:
    """(what, value, target) of the targets, from one run's rows; the low-precision targets are those of the CPU's
    bf16 matrix unit ``matrix_unit`` (:data:`LOWP_TARGETS`)."""
    F, R, B = "PPMA-T fused fp32", "PPMA-T official formulation", "PPMA-T fused bf16"
    bf16_infer, bf16_train, vs_swin, vs_convnext = LOWP_TARGETS.get(matrix_unit, ("-",) * 4)
    P = "PPMA-T official, plain modules"

    def speed(a, b, case, phase):
        ra, rb = _find(rows, a, case, phase), _find(rows, b, case, phase)
        return ra["img_s"] / rb["img_s"] if ra and rb else None

    def mem(a, b, case, phase):
        ra, rb = _find(rows, a, case, phase), _find(rows, b, case, phase)
        return rb["peak_mib"] / ra["peak_mib"] if ra and rb and ra["peak_mib"] > 0 else None

    return [
        ("fused / official, inference, b8@224", speed(F, R, "b8@224", "infer"), ">= 1.8"),
        ("fused / official, training, b8@224", speed(F, R, "b8@224", "train"), ">= 1.4"),
        ("fused / official, inference, b1@512", speed(F, R, "b1@512", "infer"), ">= 6"),
        ("fused / official, training, b1@512", speed(F, R, "b1@512", "train"), ">= 4"),
        ("official / fused peak memory, inference, b1@512", mem(F, R, "b1@512", "infer"), ">= 3"),
        ("official / fused peak memory, training, b1@512", mem(F, R, "b1@512", "train"), "-"),
        ("fused / official plain modules, inference, b8@224", speed(F, P, "b8@224", "infer"), "-"),
        ("fused / official plain modules, training, b8@224", speed(F, P, "b8@224", "train"), "-"),
        ("fused / official plain modules, inference, b1@512", speed(F, P, "b1@512", "infer"), "-"),
        ("fused / official plain modules, training, b1@512", speed(F, P, "b1@512", "train"), "-"),
        ("official plain modules / fused peak memory, inference, b1@512", mem(F, P, "b1@512", "infer"), "-"),
        ("bf16 / fp32, inference, b8@224", speed(B, F, "b8@224", "infer"), bf16_infer),
        ("bf16 / fp32, training, b8@224", speed(B, F, "b8@224", "train"), bf16_train),
        ("PPMA-T bf16 / Swin-T bf16, inference, b8@224", speed(B, "Swin-T bf16", "b8@224", "infer"), vs_swin),
        ("PPMA-T bf16 / ConvNeXt-T bf16, inference, b8@224", speed(B, "ConvNeXt-T bf16", "b8@224", "infer"),
         vs_convnext),
        ("compiled / eager fp32, inference, b8@224", speed("PPMA-T fused fp32 compiled", F, "b8@224", "infer"),
         ">= 1.1"),
        ("compiled / eager bf16, inference, b8@224", speed("PPMA-T fused bf16 compiled", B, "b8@224", "infer"),
         ">= 1.1"),
        ("PPMA-T fp32 eager / Swin-T, inference, b8@224", speed(F, "Swin-T", "b8@224", "infer"), ">= 1.5"),
        ("PPMA-T fp32 eager / ConvNeXt-T, inference, b8@224", speed(F, "ConvNeXt-T", "b8@224", "infer"), "-"),
        ("PPMA-T fp32 eager / ResNet-50, inference, b8@224", speed(F, "ResNet-50", "b8@224", "infer"), "-"),
    ]


def markdown(result: dict) -> str:
    e, s = result["env"], result["settings"]
    # the CPU, its bf16 matrix unit and ppma's kernels in one line (ppma.backends.cpu_summary), where the run has it
    cpu = e.get("cpu_summary") or f"{e['cpu']}, ppma kernels {e['cpu_capability'] or 'n/a'}"
    head = (f"CPU whole-model benchmark (`python benchmarks/bench_model_cpu.py`): {cpu}; {s['threads']} "
            f"threads, torch {e['torch']}, {e['date']}. "
            f"{s['warmup']} warm-up + {s['iters']} timed iterations per cell (median), each cell in a fresh process"
            + (f", {s['rounds']} rounds round-robin over the cells (each cell: its fastest round, the rounds' median "
               "peak memory); " if s.get("rounds", 1) > 1 else "; ") +
            "peak memory: RSS high-water mark of the iterations (warm-up included; compiled: compilation too) above the "
            "RSS before them. Official "
            "formulation: the same PPMA-T and weights with the reference ops (dense masks). "
            f"{s['note']}".strip())
    lines = [head, "", "| model | b8@224 infer img/s | b8@224 train img/s | b1@512 infer img/s | "
             "b1@512 infer peak MiB | b1@512 train img/s | b1@512 train peak MiB |", "|---|---:|---:|---:|---:|---:|---:|"]

    def cell(entry, case, phase, key, fmt):
        r = _find(result["rows"], entry, case, phase)
        if r is None:
            bad = [x for x in result["rows"] if x["entry"] == entry and x["case"] == case and x["phase"] == phase]
            return "error" if bad else "-"
        return format(r[key], fmt)

    for entry in result["entries"]:
        lines.append(
            f"| {entry} | {cell(entry, 'b8@224', 'infer', 'img_s', '.3g')} | {cell(entry, 'b8@224', 'train', 'img_s', '.3g')}"
            f" | {cell(entry, 'b1@512', 'infer', 'img_s', '.3g')} | {cell(entry, 'b1@512', 'infer', 'peak_mib', '.0f')}"
            f" | {cell(entry, 'b1@512', 'train', 'img_s', '.3g')} | {cell(entry, 'b1@512', 'train', 'peak_mib', '.0f')} |")
    lines += ["", "| ratio (one run) | measured | target |", "|---|---:|---:|"]
    for what, v, target in ratios(result["rows"], e.get("matrix_unit")):
        lines.append(f"| {what} | {'-' if v is None else f'{v:.2f}x'} | {target} |")
    errors = [r for r in result["rows"] if "error" in r]
    if errors:
        lines += [""] + [f"- {r['entry']} {r['case']} {r['phase']}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def update_doc(md: str) -> None:
    """Replace the CPU table of docs/performance.md (between the ``cpu-model`` markers) with ``md``."""
    path = os.path.join(ROOT, "docs", "performance.md")
    text = open(path).read()
    if START not in text or END not in text:
        raise SystemExit(f"{path} has no {START} ... {END} markers")
    a, b = text.index(START) + len(START), text.index(END)
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + md + text[b:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every cell this many times, round-robin over the cells; each cell reports its fastest "
                   "round and the median peak memory (for a noisy machine)")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 1 timed iteration (a smoke run)")
    p.add_argument("--entries", nargs="+", default=list(ENTRIES), choices=list(ENTRIES))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--phases", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    p.add_argument("--compiled-cases", nargs="*", default=["b8@224"], choices=list(CASES),
                   help="cases in which the compiled entries run (inference only)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    p.add_argument("--note", default="", help="a line for the table, e.g. 'machine busy'")
    p.add_argument("--output", default=None, help="path without extension (default results/model_cpu_<machine>)")
    p.add_argument("--doc", action="store_true", help="replace the CPU table of docs/performance.md")
    p.add_argument("--render", metavar="JSON", help="only rewrite the .md (and with --doc the table of docs/performance.md) "
                   "of an earlier run's .json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        md = markdown(result)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(md)
        print(md)
        if args.doc:
            update_doc(md)
        return 0
    warmup, iters = (1, 1) if args.quick else (args.warmup, args.iters)

    import torch

    sys.path.insert(0, ROOT)
    try:
        from ppma import backends

        capability = {"cpu_capability": backends.cpu_capability(), "matrix_unit": backends.cpu_matrix_unit(),
                      "cpu_summary": backends.cpu_summary()}
    except (ImportError, AttributeError):
        capability = {"cpu_capability": None}
    from tqdm import tqdm

    specs = [{"entry": e, "case": c, "phase": ph, "threads": args.threads, "warmup": warmup, "iters": iters}
             for c in args.cases for e in args.entries for ph in CASES[c][2] if ph in args.phases
             if not (ENTRIES[e][3] and (ph not in COMPILED_PHASES or c not in args.compiled_cases))]
    rows = []
    date = datetime.datetime.now(datetime.timezone.utc)
    from ppma.timing import machine_tag

    out = args.output or os.path.join(ROOT, "benchmarks", "results", f"model_cpu_{machine_tag('cpu')}")
    runs: list[list[dict]] = [[] for _ in specs]  # every round's measurement of each cell
    jobs = [(k, spec) for _ in range(args.rounds) for k, spec in enumerate(specs)]  # round-robin over the cells
    for i, (k, spec) in enumerate(tqdm(jobs, desc="bench_model_cpu", unit="cell")):
        r = measure(spec, args.timeout)
        tqdm.write(json.dumps(r))
        runs[k].append(r)
        rows = [combine(rs) for rs in runs if rs]
        if i + 1 < len(jobs):  # partial results after every cell, in case the run is stopped
            _write(out, _result(args, torch, capability, date, warmup, iters, rows, partial=True))
    md = _write(out, _result(args, torch, capability, date, warmup, iters, rows, partial=False))
    print(md)
    if args.doc:
        update_doc(md)
    return 0


def _write(out: str, result: dict) -> str:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    md = markdown(result)
    with open(out + ".md", "w") as f:
        f.write(md)
    return md


def _result(args, torch, capability, date, warmup, iters, rows, partial: bool) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    note = args.note + (" PARTIAL: the run was stopped before every cell was measured." if partial else "")
    return {"env": {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
                    "cores": os.cpu_count(), **capability, "date": date.isoformat(timespec="seconds")},
            "settings": {"threads": args.threads, "warmup": warmup, "iters": iters, "rounds": args.rounds, "note": note.strip()},
            "entries": args.entries, "rows": rows,
            "ratios": [list(r) for r in ratios(rows, capability.get("matrix_unit"))]}


if __name__ == "__main__":
    sys.exit(main())
