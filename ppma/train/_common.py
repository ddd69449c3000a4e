"""Small helpers shared by the training library and the command-line tools (private to ``ppma.train``)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["resolve_device", "amp_dtype", "seed_everything", "log", "synchronize"]


def resolve_device(name: str) -> torch.device:
    """``"auto"``: CUDA (the process's ``LOCAL_RANK`` GPU) when available, else the CPU; ``"cuda"`` without an
    index also takes ``LOCAL_RANK``, so that ``torchrun`` processes spread over the GPUs."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``amp`` in {auto, fp16, bf16, none} (auto: fp16 on CUDA, off on the CPU)."""
    if amp == "auto":
        amp = "fp16" if device.type == "cuda" else "none"
    if amp == "none":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise ValueError("train.amp='fp16' needs a CUDA device; use 'bf16' or 'none' on the CPU")
        return torch.float16
    if amp == "bf16":
        return torch.bfloat16
    raise ValueError(f"train.amp must be auto, fp16, bf16 or none, got {amp!r}")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def log(msg: str) -> None:
    """Print on the main process only."""
    from ppma.train import distributed as D

    if D.is_main():
        print(msg, flush=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (clocks read after this measure finished work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
