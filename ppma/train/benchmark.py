"""Model throughput by the paper's protocol (docs/model.md §7.5), plus training speed and peak memory.

Inference: ``model.eval()``, ``torch.inference_mode()`` (eager on the CPU: a copy of the model after the deployment
step ``ppma.nn.fuse_for_inference``, in float32 or under bf16 autocast), ``warmup`` untimed iterations, then about
``iters`` timed ones (:func:`ppma.timing.measure_time`, synchronised clocks); images/s = batch / mean time per iteration. Training: forward + backward + AdamW step on
random labels; the AdamW step is torch's fused one (``fused=True``) on the CPU and CUDA, as the trainer's (docs/training.md).
``compile_mode`` measures the model under ``torch.compile(..., mode=compile_mode)`` instead of the eager model, each
phase compiled during its untimed warm-up (:func:`compile_for_benchmark`: on the CPU ppma's recipe, frozen weights for
inference, docs/compile.md); on CUDA, ``"reduce-overhead"`` runs the compiled graphs as CUDA graphs (the shapes are
static), every call marked as a new step. The ``ppma-benchmark`` command (:mod:`ppma.train.cli.benchmark`) runs
this over models and attention implementations and writes the tables.
"""

from __future__ import annotations

import copy
import gc
import os
import sys

import torch

from ppma.timing import measure_time
from ppma.train.engine import autocast, optimizer_step

__all__ = ["measure", "current_rss_mib", "peak_rss_mib", "COMPILE_MODES", "compile_for_benchmark"]

#: The modes of ``torch.compile`` that ``measure(compile_mode=...)`` takes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def current_rss_mib() -> float | None:
    """The process's resident set size now (MiB), from ``/proc/self/statm`` (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """The process's RSS high-water mark (MiB) from ``resource.getrusage`` (KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _reset_rss_peak() -> bool:
    """Reset the RSS high-water mark (``VmHWM``) to the current RSS (Linux >= 4.0); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except (OSError, ValueError, IndexError):
        return None
    return None


class _PeakMemory:
    """Peak memory of the work between ``start()`` and ``stop()``: CUDA's ``max_memory_allocated``; on the CPU
    the RSS high-water mark minus the RSS at ``start()``, i.e. the memory the work added on top of what the
    process held (model, inputs). On Linux ``start()`` resets the mark (``/proc/self/clear_refs``); elsewhere
    the mark is ``getrusage``'s, exact only when the process never reached a higher one before ``start()``
    (``ppma-benchmark --device cpu`` runs every phase in a fresh process, so it is). None where the RSS
    cannot be read."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.base, self.reset = device, None, False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            gc.collect()
            self.reset = _reset_rss_peak()
            self.base = current_rss_mib()

    def stop(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "cpu" and self.base is not None:
            peak = _vm_hwm_mib() if self.reset else None
            return max((peak if peak is not None else peak_rss_mib()) - self.base, 0.0)
        return None


def compile_for_benchmark(model: torch.nn.Module, device: torch.device, mode: str, *, inference: bool = False):
    """``model`` under ``torch.compile`` with ``mode`` (one of :data:`COMPILE_MODES`; ``"default"``: no mode
    argument). The ppma ops are custom ops with fake kernels, opaque nodes in the compiled graph (docs/design.md §5).
    On the CPU this is ppma's recipe (:func:`ppma.compile.compile_model`, docs/compile.md): the whole model as one
    graph with static shapes and, with ``inference`` (``model`` in eval mode), frozen weights that Inductor packs
    for oneDNN / MKL; elsewhere plain ``torch.compile(model, mode=mode)``.
    Returns (the compiled callable, a function to call before each step: on CUDA with CUDA graphs it marks a new
    step of the graph trees, so that a replay may reuse the previous step's outputs; elsewhere it does nothing)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"ppma-benchmark: compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    kwargs = {} if mode == "default" else {"mode": mode}
    if device.type == "cpu":
        from ppma.compile import compile_model

        return compile_model(model, inference=inference, **kwargs), lambda: None
    compiled = torch.compile(model, **kwargs)
    if device.type == "cuda":
        return compiled, _cuda_graph_step_marker(mode)
    return compiled, lambda: None


def _cuda_graph_step_marker(mode: str):
    """The per-step call of a CUDA-compiled model: ``torch.compiler.cudagraph_mark_step_begin`` for the modes
    that run CUDA graphs (``reduce-overhead``, ``max-autotune``), else nothing."""
    if mode in ("reduce-overhead", "max-autotune"):
        return torch.compiler.cudagraph_mark_step_begin
    return lambda: None


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The AdamW of the training phase, as the trainer builds it (``ppma.train.build.build_optimizer``): torch's
    fused step on the devices that have one, CPU and CUDA (one pass over each parameter group and dtype instead of
    a loop of element-wise ops per tensor; the same update up to float rounding; on a 2-core AMD EPYC Zen 4 14
    against 46 ms for PPMA-T's parameters), the default step elsewhere."""
    from ppma.train.build import fused_adam_available

    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if fused_adam_available(model) else None)


def measure(model: torch.nn.Module, *, batch_size: int, img_size: int, in_chans: int, num_classes: int,
            device: torch.device, amp_dtype, warmup: int, iters: int, train: bool, channels_last: bool,
            infer: bool = True, compile_mode: str | None = None) -> dict:
    """Inference (and optionally training) throughput of ``model`` on random ``[batch, in_chans, S, S]`` input:
    ``infer_images_per_sec``, ``infer_ms_median``, ``infer_peak_mem_mib`` and, with ``train``, the same three
    for ``train_*`` (``infer=False``: training only). Peak memory: CUDA's allocator peak; on the CPU the RSS high-water mark above the RSS at
    the start of the phase (exact in a fresh process, see ``_PeakMemory``); None where it cannot be read.
    ``compile_mode`` (one of :data:`COMPILE_MODES`): measure the model under ``torch.compile``
    (:func:`compile_for_benchmark`), compiled in the warm-up of each phase; None: eager."""
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch_size, in_chans, img_size, img_size, generator=g).to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, num_classes, (batch_size,), generator=g).to(device)
    out = {}

    model.eval()
    fwd, mark_step = model, lambda: None
    infer_fwd = fwd
    if compile_mode is not None:
        if device.type == "cpu":  # inference on frozen weights (a copy), training on the model's own parameters
            infer_fwd, mark_step = compile_for_benchmark(copy.deepcopy(model), device, compile_mode, inference=True)
            fwd, _ = compile_for_benchmark(model, device, compile_mode)
        else:
            fwd, mark_step = compile_for_benchmark(model, device, compile_mode)
            infer_fwd = fwd
    elif infer and device.type == "cpu" and amp_dtype in (None, torch.bfloat16):
        from ppma.nn import fuse_for_inference

        infer_fwd = fuse_for_inference(copy.deepcopy(model))  # CPU inference's deployment step (docs/design.md §2.9)
    peak = _PeakMemory(device)
    peak.start()

    def run_infer():
        mark_step()
        with torch.inference_mode(), autocast(device, amp_dtype):
            infer_fwd(x)

    if infer:
        t = measure_time(run_infer, repeat=iters, warmup=warmup, device=device)
        out["infer_images_per_sec"] = batch_size / t.mean
        out["infer_ms_median"] = t.median_ms
        out["infer_peak_mem_mib"] = peak.stop()
    del infer_fwd

    if train:
        model.train()
        opt = _optimizer(model)
        scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
        peak.start()

        def step():
            mark_step()
            with autocast(device, amp_dtype):
                loss = torch.nn.functional.cross_entropy(fwd(x).float(), y)
            optimizer_step(loss, opt, scaler)

        # a compiled model compiles its training graph in the first call and, with CUDA graphs, records the graph
        # in a later one: three warm-up steps at least keep both out of the timed calls
        t = measure_time(step, repeat=iters, warmup=max(3 if compile_mode else 1, warmup // 2), device=device)
        out["train_images_per_sec"] = batch_size / t.mean
        out["train_ms_median"] = t.median_ms
        out["train_peak_mem_mib"] = peak.stop()
    return out
