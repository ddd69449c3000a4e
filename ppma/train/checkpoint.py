"""Atomic checkpoints with everything needed to resume a run exactly.

A checkpoint is a dict of plain tensors/containers, loadable with ``torch.load(weights_only=True)``:
``model``, ``model_ema`` (or None), ``optimizer``, ``scheduler``, ``scaler`` (or None), ``epoch`` (the
last finished epoch), ``rng`` (python, numpy, torch CPU and CUDA generator states), ``config`` (the
run's config dict), ``best`` (best accuracies so far) and ``version``.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "get_rng_state", "set_rng_state", "unwrap"]

VERSION = 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def get_rng_state() -> dict:
    """All global RNG states as tensors and plain Python values (``weights_only``-loadable)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore the states written by :func:`get_rng_state`."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder, then ``os.replace``,
    so that a crash never leaves a truncated checkpoint behind."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    return torch.load(path, map_location=map_location, weights_only=True)
