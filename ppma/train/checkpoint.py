"""Atomic checkpoints with everything needed to resume a run exactly.

A checkpoint is a dict of plain tensors/containers, loadable with a weights-only ``torch.load`` (and read
back, as every checkpoint ppma reads, through :func:`ppma.checkpoint.read_checkpoint`):
``model``, ``model_ema`` (or None), ``optimizer``, ``scheduler``, ``scaler`` (or None), ``epoch`` (the
last finished epoch), ``rng`` (python, numpy, torch CPU and CUDA generator states), ``config`` (the
run's config dict), ``best`` (best accuracies so far) and ``version``.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "load_training_state", "load_model_from_checkpoint", "get_rng_state",
           "set_rng_state", "unwrap"]

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
    """Read a checkpoint (ours, or any other ppma reads) through :func:`ppma.checkpoint.read_checkpoint`: a
    weights-only ``torch.load`` with the allowlist of harmless types, never unrestricted unpickling."""
    from ppma.checkpoint import read_checkpoint

    return read_checkpoint(path, map_location=map_location)


#: The entries :func:`save_checkpoint` writes and ``--resume`` needs.
TRAINING_STATE_KEYS = ("model", "optimizer", "scheduler", "epoch", "global_step", "best", "rng", "config", "version")


def load_training_state(path: str, map_location="cpu") -> dict:
    """Read a ``ppma-train`` checkpoint to resume from (:func:`load_checkpoint`), checking that it is one: an
    official ``best.pth`` or converted weights cannot be resumed from (their optimiser state belongs to another
    code base); they initialise a new run through ``model.checkpoint_path`` instead."""
    ckpt = load_checkpoint(path, map_location=map_location)
    missing = [k for k in TRAINING_STATE_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(
            f"--resume {path}: not a ppma-train checkpoint (missing {missing}); to start a run from the weights of "
            f"another checkpoint (e.g. an official best.pth) set model.checkpoint_path "
            f"(--set model.checkpoint_path=...)"
        )
    return ckpt


def load_model_from_checkpoint(path: str, *, model_name=None, key="auto", num_classes=None):
    """Build the model for checkpoint ``path`` and load its weights: a ``ppma-train`` checkpoint carries its
    config; any other checkpoint (an official ``best.pth``, ``ppma-convert`` output, a bare state dict) is loaded
    into ``model_name`` (default ``ppma_tiny``) by :func:`ppma.checkpoint.load_weights`, strictly: a checkpoint of
    another variant raises, naming the keys that do not fit. ``num_classes`` defaults to the checkpoint's
    classifier. ``key`` picks the weights (``auto``: ``model_ema`` when present, then ``model``, ``models``,
    ``state_dict``).

    Returns ``(model, info)``; ``info`` holds ``config`` (our :class:`~ppma.train.config.TrainConfig` or None),
    ``key`` (which weights were loaded), ``kind`` ("ppma-train" or "official")."""
    from ppma.checkpoint import convert_official_state_dict, load_weights, select_state_dict
    from ppma.train.build import build_model
    from ppma.train.config import TrainConfig

    ckpt = load_checkpoint(path)
    entry = None if key == "auto" else key
    if isinstance(ckpt, dict) and "config" in ckpt and "version" in ckpt:  # ours
        cfg = TrainConfig.from_dict(ckpt["config"], source=f"the config of checkpoint {path}")
        if model_name is not None and model_name != cfg.model.name:
            raise ValueError(f"--model {model_name!r} differs from the checkpoint's model {cfg.model.name!r}")
        cfg.model.checkpoint_path = None
        model = build_model(cfg.model, ckpt["num_classes"], ckpt["in_chans"])
        state, used = select_state_dict(ckpt, entry)
        model.load_state_dict(state)
        return model, {"config": cfg, "key": used, "kind": "ppma-train"}

    import ppma

    name = model_name or "ppma_tiny"
    _, used = select_state_dict(ckpt, entry)
    if num_classes is None:  # the checkpoint's classifier, else ImageNet's 1000
        fc = convert_official_state_dict(ckpt, key=entry, verbose=False).get("head.fc.weight")
        num_classes = fc.shape[0] if fc is not None else 1000
    model = ppma.create_model(name, num_classes=num_classes)
    try:
        load_weights(model, ckpt, key=entry, strict=True, drop_classifier=False, name=repr(path))
    except RuntimeError as exc:  # say which flags choose the model
        raise RuntimeError(f"{exc}. The model was {name} (--model) with {num_classes} classes (--num-classes)") from exc
    print(f"loaded checkpoint {path} (weights: {used or 'bare state dict'}) into {name}")
    return model, {"config": None, "key": used, "kind": "official"}
