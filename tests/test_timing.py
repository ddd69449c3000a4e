"""The timing helper of the benchmarks (ppma.timing): call counts, statistics and argument checks (no timing
targets: only lower bounds that any machine satisfies)."""

from __future__ import annotations

import time

import pytest
import torch

from ppma.timing import Timing, measure_time


def test_measure_time_counts_and_statistics():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.002)

    t = measure_time(slow, repeat=5, warmup=2)
    assert isinstance(t, Timing) and t.calls_per_sample >= 1 and len(t.samples) >= 1
    # warm-up, the sizing call, then timed blocks covering about `repeat` calls' worth of time
    assert len(calls) >= 2 + 1 + t.calls_per_sample * len(t.samples)
    assert t.calls_per_sample * sum(t.samples) >= 5 * 0.002 * 0.999
    assert t.min <= t.median and t.min >= 0.002 and t.median_ms == pytest.approx(1e3 * t.median)
    assert t.peak_mib is None  # memory is tracked on CUDA only


def test_measure_time_blocks_fast_calls_and_restores_threads():
    x = torch.ones(4)
    threads = torch.get_num_threads()
    t = measure_time(lambda: x.add_(1), repeat=20, warmup=0, num_threads=1, track_memory=True, device="cpu")
    assert t.calls_per_sample >= 1 and t.mean > 0 and t.peak_mib is None
    assert torch.get_num_threads() == threads


def test_measure_time_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        measure_time(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        measure_time(lambda: None, warmup=-1)


def test_machine_tag_names_the_machine_for_result_files():
    """The stable result names of benchmarks/results/ (``<kind>_<machine>.md``): file-name safe, the CPU model
    without trademarks, core counts and clock."""
    import re

    from ppma.timing import _cpu_model_tag, machine_tag

    tag = machine_tag("cpu")
    assert tag and re.fullmatch(r"[A-Za-z0-9.-]+", tag) and not tag.startswith("-")
    assert machine_tag(torch.device("cpu")) == tag
    assert _cpu_model_tag("AMD EPYC") == "AMD-EPYC"
    assert _cpu_model_tag("Intel(R) Xeon(R) Processor @ 2.80GHz") == "Intel-Xeon"
    assert _cpu_model_tag("AMD EPYC 7B13 64-Core Processor") == "AMD-EPYC-7B13"
    assert _cpu_model_tag("Intel(R) Core(TM) i7-9700K CPU @ 3.60GHz") == "Intel-Core-i7-9700K"
    assert _cpu_model_tag("  ") == ""
