"""Model throughput by the paper's protocol (docs/model.md §7.5), plus training speed and peak memory.

Inference: ``model.eval()``, ``torch.inference_mode()``, ``warmup`` untimed iterations, then ``iters`` timed
ones with synchronised clocks; images/s = batch * iters / time. Training: forward + backward + AdamW step on
random labels. The ``ppma-benchmark`` command (:mod:`ppma.train.cli.benchmark`) runs this over models and
attention implementations and writes the tables.
"""

from __future__ import annotations

import statistics
import time

import torch

from ppma.train._common import synchronize
from ppma.train.engine import autocast, optimizer_step

__all__ = ["measure"]


def _time_loop(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def measure(model: torch.nn.Module, *, batch_size: int, img_size: int, in_chans: int, num_classes: int,
            device: torch.device, amp_dtype, warmup: int, iters: int, train: bool, channels_last: bool) -> dict:
    """Inference (and optionally training) throughput of ``model`` on random ``[batch, in_chans, S, S]`` input:
    ``infer_images_per_sec``, ``infer_ms_median``, ``infer_peak_mem_mib`` (CUDA only, else None) and, with
    ``train``, the same three for ``train_*``."""
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
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def infer():
        with torch.inference_mode(), autocast(device, amp_dtype):
            model(x)

    t = _time_loop(infer, device, warmup, iters)
    out["infer_images_per_sec"] = batch_size * iters / sum(t)
    out["infer_ms_median"] = 1e3 * statistics.median(t)
    out["infer_peak_mem_mib"] = _peak_mib(device)

    if train:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

        def step():
            with autocast(device, amp_dtype):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            optimizer_step(loss, opt, scaler)

        t = _time_loop(step, device, max(1, warmup // 2), iters)
        out["train_images_per_sec"] = batch_size * iters / sum(t)
        out["train_ms_median"] = 1e3 * statistics.median(t)
        out["train_peak_mem_mib"] = _peak_mib(device)
    return out
