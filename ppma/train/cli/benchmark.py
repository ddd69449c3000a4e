"""``ppma-benchmark``: model throughput by the paper's protocol (docs/model.md §7.5) plus training speed and memory.

Inference: batch 64, 224x224, ``model.eval()``, ``torch.inference_mode()`` (on the CPU after the deployment step
``ppma.nn.fuse_for_inference``, applied to a copy of the model; see :func:`ppma.train.benchmark.measure`),
``--warmup`` untimed iterations,
then about ``--iters`` timed ones (:func:`ppma.timing.measure_time`: ``torch.utils.benchmark``, synchronised
clocks); images/s = batch / mean time per iteration. AMP is stated in the
output (the paper does not say which precision it used). Training: forward + backward + AdamW step on
random labels, images/s and peak memory (CUDA: the allocator's peak; CPU: the RSS high-water mark from
``resource.getrusage`` above the RSS before the phase, every phase in a fresh process so that the mark starts
from there). Each attention implementation (``impl=fused`` and
``impl=reference``) is measured in the same process on the same inputs::

    ppma-benchmark --model ppma_tiny ppma_small ppma_base --amp fp16

writes ``benchmarks/results/model_<cpu|gpu>_<machine>_<amp>_b<batch>_<size>.md`` and ``.json`` unless ``--output`` says
otherwise: one stable name per setting and machine (:func:`ppma.timing.machine_tag`, e.g. ``model_gpu_H200_fp16_b64_224``)
that the next run overwrites.

``--compile [MODE]`` measures the model under ``torch.compile`` (``MODE``: ``default`` when omitted,
``reduce-overhead``: CUDA graphs on a GPU, the shapes being static; ``ppma.train.benchmark.compile_for_benchmark``;
on the CPU ppma's recipe, ``ppma.compile.compile_model``: frozen weights for inference, docs/compile.md), each
phase compiled in its untimed warm-up; the tables say which mode ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppma-benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["ppma_tiny"],
                   help="model names (ppma_tiny, ppma_small, ppma_base, or a timm name with --factory), each measured")
    p.add_argument("--impl", nargs="+", default=["fused", "reference"], choices=["fused", "reference"],
                   help="attention implementations to measure, in the same process on the same inputs "
                        "(default: both; 'reference' is the official formulation with dense masks)")
    p.add_argument("--batch-size", type=int, default=64, help="images per iteration (default: 64, the paper's)")
    p.add_argument("--img-size", type=int, default=224, help="square input side (default: 224)")
    p.add_argument("--in-chans", type=int, default=3, help="input channels (default: 3)")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier outputs (default: 1000)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before each phase (default: 10)")
    p.add_argument("--iters", type=int, default=30, help="about this many timed iterations (default: 30)")
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none",
                   help="autocast dtype for inference and training (default: none, float32); bf16 on the CPU")
    p.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda, cuda:1 ...")
    p.add_argument("--no-train", action="store_true", help="inference only")
    p.add_argument("--channels-last", action="store_true",
                   help="feed the images in channels-last memory format")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="measure the model under torch.compile with this mode (default: 'default'; "
                        "'reduce-overhead': CUDA graphs on a GPU) instead of eager")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="model override (YAML value), e.g. --override 'embed_dims=[8, 16, 16, 16]'")
    p.add_argument("--factory", help="'package.module:callable' instead of ppma.create_model")
    p.add_argument("--output", default=None,
                   help="output path without extension: writes .json and .md (default: benchmarks/results/"
                        "model_<cpu|gpu>_<machine>_<amp>_b<batch>_<size>)")
    return p.parse_args(argv)


def default_output(args: argparse.Namespace, device: torch.device) -> str:
    """The stable result path (without extension) of a run: ``benchmarks/results/model_<cpu|gpu>_<machine>_<amp>_b<batch>_<size>``."""
    from ppma.timing import machine_tag

    kind = "gpu" if device.type == "cuda" else device.type
    return os.path.join("benchmarks", "results",
                        f"model_{kind}_{machine_tag(device)}_{args.amp}_b{args.batch_size}_{args.img_size}")


def _env(device: torch.device) -> dict:
    import ppma

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "platform": platform.platform(), "ppma": getattr(ppma, "__version__", None),
           "ppma_extension": bool(getattr(ppma, "has_ext", lambda: False)()),
           "device": str(device), "cpu_threads": torch.get_num_threads(), "cpu_capability": cpu_capability(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        env.update(cpu_info())
    return env


def cpu_info() -> dict:
    """The CPU's model name and the unit its bf16 products run on (``ppma.backends.cpu_name`` and
    ``cpu_matrix_unit``, with ``cpu_summary``'s one line), ``{}`` when this build of ppma does not report them."""
    from ppma import backends

    if not hasattr(backends, "cpu_matrix_unit"):
        return {}
    return {"cpu": backends.cpu_name(), "matrix_unit": backends.cpu_matrix_unit(), "cpu_summary": backends.cpu_summary()}


def _markdown(result: dict) -> str:
    e, s = result["env"], result["settings"]
    lines = [
        f"# PPMA throughput ({e.get('gpu', e['device'])})", "",
        f"batch {s['batch_size']}, {s['img_size']}x{s['img_size']}, AMP {s['amp']}, {s['warmup']} warm-up + "
        f"about {s['iters']} timed iterations (ppma.timing); torch {e['torch']}, CUDA {e['cuda']}, ppma extension built: "
        f"{e['ppma_extension']}; {e['date']}"
        + (f"; torch.compile, mode {s['compile']}" if s.get("compile") else "; eager")
        + (f"; CPU: {e['cpu_threads']} threads, kernels {e.get('cpu_capability') or 'n/a'}; peak memory is the RSS "
           "high-water mark above the RSS before the phase, each phase in a fresh process"
           if e["device"] == "cpu" else ""), "",
        "| model | impl | params (M) | inference img/s | inference ms/batch (median) | inference peak mem (MiB) | "
        "train img/s | train peak mem (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['params_m']:.2f} | {f(r.get('infer_images_per_sec'), '.1f')} | "
            f"{f(r.get('infer_ms_median'), '.1f')} | {f(r.get('infer_peak_mem_mib'), '.0f')} | "
            f"{f(r.get('train_images_per_sec'), '.1f')} | "
            f"{f(r.get('train_peak_mem_mib'), '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def cpu_capability() -> str | None:
    """The SIMD capability the ppma CPU kernels use (``ppma.backends.cpu_capability()``), None when this build
    does not report it."""
    try:
        from ppma import backends
    except ImportError:
        return None
    fn = getattr(backends, "cpu_capability", None)
    return fn() if fn is not None else None


def _run_phase(args: argparse.Namespace, name: str, impl: str, phase: str | None) -> dict:
    """Build model ``name`` (seed 0: the same weights for every impl) and measure ``phase`` (``"infer"``,
    ``"train"``; None: both) with ``impl``."""
    from ppma.train._common import amp_dtype as resolve_amp_dtype
    from ppma.train._common import resolve_device
    from ppma.train.benchmark import measure
    from ppma.train.build import model_kwargs, resolve_factory
    from ppma.train.config import parse_assignment
    import ppma.ops

    device = resolve_device(args.device)
    amp_dtype = resolve_amp_dtype(args.amp, device)
    overrides = model_kwargs(dict(parse_assignment(item, "--override") for item in args.override))
    torch.manual_seed(0)
    model = resolve_factory(args.factory)(name, num_classes=args.num_classes, in_chans=args.in_chans, **overrides)
    row = {"model": name, "impl": impl, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    with ppma.ops.use_impl(impl):  # the ops read the switch at call time: same model, both impls
        r = measure(model, batch_size=args.batch_size, img_size=args.img_size, in_chans=args.in_chans,
                    num_classes=args.num_classes, device=device, amp_dtype=amp_dtype, warmup=args.warmup,
                    iters=args.iters, train=phase != "infer" and not args.no_train,
                    channels_last=args.channels_last, infer=phase != "train", compile_mode=args.compile)
    row.update({k: v for k, v in r.items() if v is not None or phase is None})
    return row


def _child(args, name, impl, phase, threads):
    torch.set_num_threads(threads)
    return _run_phase(args, name, impl, phase)


def _in_child(args: argparse.Namespace, name: str, impl: str, phase: str) -> dict:
    """``_run_phase`` in a fresh spawned process with this process's thread count."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_child, args, name, impl, phase, torch.get_num_threads()).result()


def main(argv=None) -> int:
    args = parse_args(argv)
    from ppma.train._common import resolve_device

    from ppma.train._common import amp_dtype as resolve_amp_dtype
    from ppma.train.config import parse_assignment

    device = resolve_device(args.device)
    resolve_amp_dtype(args.amp, device)  # a bad --amp fails here, before any model is built
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    raw_overrides = dict(parse_assignment(item, "--override") for item in args.override)
    if device.type == "cpu" and cpu_info().get("cpu_summary"):
        print(cpu_info()["cpu_summary"], flush=True)  # the CPU and its bf16 matrix unit, beside every figure
    rows = []
    for name in args.model:
        for impl in args.impl:
            if device.type == "cpu":
                # Every phase in a fresh process: the RSS high-water mark cannot be reset
                # (ppma.train.benchmark._PeakMemory).
                row = {"model": name, "impl": impl}
                for phase in ("infer",) + (() if args.no_train else ("train",)):
                    row.update(_in_child(args, name, impl, phase))
            else:
                row = _run_phase(args, name, impl, None)
            print(json.dumps(row), flush=True)
            rows.append(row)
            # the tables so far after every row: a run stopped by a time limit keeps what it measured
            md = _write_tables(args, device, raw_overrides, rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    md = _write_tables(args, device, raw_overrides, rows)
    print(md)
    return 0


def _write_tables(args: argparse.Namespace, device: torch.device, raw_overrides: dict, rows: list) -> str:
    """Write ``<output>.json`` and ``<output>.md`` for the rows measured so far; returns the markdown."""
    result = {"env": _env(device),
              "settings": {"batch_size": args.batch_size, "img_size": args.img_size, "amp": args.amp,
                           "warmup": args.warmup, "iters": args.iters, "overrides": raw_overrides,
                           "channels_last": args.channels_last, "compile": args.compile},
              "rows": rows}
    if args.output is None:
        args.output = default_output(args, device)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)) or ".", exist_ok=True)
    with open(args.output + ".json", "w") as f:
        json.dump(result, f, indent=2)
    md = _markdown(result)
    with open(args.output + ".md", "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
