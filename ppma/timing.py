"""One timing helper for every benchmark of the project (``benchmarks/*.py``, ``ppma-benchmark``), built on
``torch.utils.benchmark.Timer``: it sets the torch thread count for the measurement, synchronises the accelerator
around each timed block (so CUDA kernels are timed to completion) and picks the block size that keeps the timer's
own overhead negligible.

``measure_time(fn, repeat=10)`` runs ``fn`` ``warmup`` times untimed, times one more call to size the measurement,
then lets ``Timer.blocked_autorange`` run for about ``repeat`` calls' worth of time. The timer picks the block size
(calls per sample) that makes its own overhead negligible (below 1e-4 of a block): calls of about 10 ms and more
get about ``repeat`` single-call samples, shorter ones fewer samples of several calls each (each sample is the
mean of its block).

``machine_tag(device)`` names the machine in the stable file names of ``benchmarks/results/`` (one file per
benchmark and machine, overwritten by the next run; benchmarks/results/README.md).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

__all__ = ["Timing", "machine_tag", "measure_time"]


@dataclass(frozen=True)
class Timing:
    """Times of one function, in seconds per call.

    Attributes:
        median, mean, min, iqr: statistics over the samples (each the mean call time of one block of calls).
        samples: the per-call times of every block.
        calls_per_sample: calls in each block (1 for slow functions).
        peak_mib: with ``track_memory`` on CUDA, the peak memory allocated above what was allocated before the
            first timed call, in MiB; otherwise ``None``.
    """

    median: float
    mean: float
    min: float
    iqr: float
    samples: tuple[float, ...]
    calls_per_sample: int
    peak_mib: float | None = None

    @property
    def median_ms(self) -> float:
        """The median in milliseconds."""
        return 1e3 * self.median


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_time(
    fn: Callable[[], object],
    *,
    repeat: int = 10,
    warmup: int = 1,
    device: torch.device | str | None = None,
    num_threads: int | None = None,
    track_memory: bool = False,
    label: str = "",
) -> Timing:
    """Time ``fn()`` (no arguments; its result is discarded) with ``torch.utils.benchmark.Timer``.

    Args:
        fn: the work to time, e.g. a forward pass or a forward + backward step.
        repeat: about how many calls' worth of time to measure (at least 1); see the module docstring.
        warmup: untimed calls first (caches, allocator, lazy initialisation, autotuning).
        device: the device ``fn`` runs on; for CUDA, peak memory can be tracked (``track_memory``). The timer
            synchronises any accelerator itself.
        num_threads: torch threads during the measurement (default: the current ``torch.get_num_threads()``).
        track_memory: report the CUDA peak memory of the timed calls (``Timing.peak_mib``; ``None`` elsewhere).
        label: a name for the measurement (shown in ``torch.utils.benchmark`` reprs).

    Returns:
        A :class:`Timing` (seconds per call).
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"measure_time: repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    device = torch.device(device) if isinstance(device, str) else device
    num_threads = torch.get_num_threads() if num_threads is None else num_threads
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=num_threads, label=label)
    for _ in range(warmup):
        fn()
    _synchronize(device)
    track = track_memory and device is not None and device.type == "cuda"
    if track:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    # one call sizes the measurement: blocked_autorange then runs for about `repeat` calls
    t0 = time.perf_counter()
    fn()
    _synchronize(device)
    once = time.perf_counter() - t0
    m = timer.blocked_autorange(min_run_time=max(repeat * once, 1e-6))
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if track else None
    return Timing(median=m.median, mean=m.mean, min=min(m.times), iqr=m.iqr, samples=tuple(m.times),
                  calls_per_sample=m.number_per_run, peak_mib=peak)


def machine_tag(device: str | torch.device = "cpu") -> str:
    """A short file-name-safe name of the machine a benchmark runs on, for ``benchmarks/results/<kind>_<tag>.md``.

    CPU: the processor's model name from ``/proc/cpuinfo`` without trademarks, "CPU", "Processor", core counts and
    clock ("Intel(R) Xeon(R) Processor @ 2.80GHz" -> ``Intel-Xeon``, "AMD EPYC 7B13 64-Core Processor" ->
    ``AMD-EPYC-7B13``); ``platform.machine()`` where there is none. CUDA: the device name without the vendor
    ("NVIDIA H200" -> ``H200``).
    """
    import platform

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).replace("NVIDIA", "")
    else:
        name = ""
        try:
            with open("/proc/cpuinfo") as f:
                name = next((l.split(":", 1)[1] for l in f if l.startswith("model name")), "")
        except OSError:
            pass
        name = _cpu_model_tag(name) or platform.machine() or "cpu"
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-.") or device.type


def _cpu_model_tag(model_name: str) -> str:
    """``model name`` of /proc/cpuinfo without trademarks, "CPU", "Processor", core counts and clock, spaces as
    ``-`` ("" when nothing is left)."""
    name = re.sub(r"\(R\)|\(TM\)|\bCPU\b|\bProcessor\b|@.*$|\b\d+-Core\b", " ", model_name)
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-.")
