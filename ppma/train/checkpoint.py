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

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_from_checkpoint", "get_rng_state", "set_rng_state",
           "unwrap"]

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


def _pick_state(ckpt: dict, key: str, path: str):
    if key == "auto":
        for k in ("model_ema", "model", "models", "state_dict"):
            if isinstance(ckpt.get(k), dict):
                return k, ckpt[k]
        return "<bare>", ckpt
    if not isinstance(ckpt.get(key), dict):
        keys = [k for k, v in ckpt.items() if isinstance(v, dict)]
        raise KeyError(f"{path}: no weights under key {key!r}; dict-valued keys: {keys}")
    return key, ckpt[key]


def load_model_from_checkpoint(path: str, *, model_name=None, key="auto", num_classes=None):
    """Build the model for checkpoint ``path`` and load its weights: a ``ppma-train`` checkpoint carries its
    config; an official PPMA checkpoint (docs/model.md §5.2) is converted by ``ppma.models.convert_official_state_dict``
    into ``model_name`` (default ``ppma_tiny``) with ``num_classes`` (default 1000). ``key`` picks the weights
    (``auto``: ``model_ema`` when present, then ``model``, ``models``, ``state_dict``).

    Returns ``(model, info)``; ``info`` holds ``config`` (our :class:`~ppma.train.config.TrainConfig` or None),
    ``key`` (which weights were loaded), ``kind`` ("ppma-train" or "official")."""
    from ppma.train.build import build_model
    from ppma.train.config import TrainConfig

    ckpt = load_checkpoint(path)
    if isinstance(ckpt, dict) and "config" in ckpt and "version" in ckpt:  # ours
        cfg = TrainConfig.from_dict(ckpt["config"], source=f"the config of checkpoint {path}")
        if model_name is not None and model_name != cfg.model.name:
            raise ValueError(f"--model {model_name!r} differs from the checkpoint's model {cfg.model.name!r}")
        cfg.model.checkpoint_path = None
        model = build_model(cfg.model, ckpt["num_classes"], ckpt["in_chans"])
        used, state = _pick_state(ckpt, key, path)
        model.load_state_dict(state)
        return model, {"config": cfg, "key": used, "kind": "ppma-train"}

    import ppma

    try:
        from ppma.models import convert_official_state_dict
    except ImportError as exc:  # the model package provides the converter
        raise ImportError("official checkpoints need ppma.models.convert_official_state_dict") from exc
    name = model_name or "ppma_tiny"
    model = ppma.create_model(name, num_classes=num_classes or 1000)
    used, _ = _pick_state(ckpt, key, path)
    state = convert_official_state_dict(ckpt, key=None if key == "auto" else key)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"{path}: converted weights do not fit {name}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    print(f"loaded official checkpoint {path} (weights: {used}) into {name}")
    return model, {"config": None, "key": used, "kind": "official"}
