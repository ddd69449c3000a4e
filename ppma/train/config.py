"""Training configuration: nested defaults, YAML files and command-line overrides.

A config is a plain nested ``dict`` with the sections below (``DEFAULTS``); YAML files under
``configs/classification/`` override any subset, and ``--set section.key=value`` (YAML-parsed value) or
the dedicated flags (``--epochs``, ``--batch-size``, ...) override the file. ``Config`` wraps the dict
for attribute access (``cfg.optim.lr``) and serialises back to plain types for checkpoints.

The defaults reproduce the official ImageNet-1K recipe (spec §6.1).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

__all__ = ["DEFAULTS", "Config", "load_config", "merge", "apply_overrides"]

DEFAULTS: dict[str, Any] = {
    "model": {
        "name": "ppma_tiny",
        # None: ppma.create_model. "package.module:callable": any factory with create_model's signature
        # (name, pretrained=False, num_classes=..., drop_path_rate=..., checkpoint_path=..., **overrides).
        "factory": None,
        # None: the variant's own rate (0.1 / 0.15 / 0.4 for T / S / B, spec §4.1).
        "drop_path_rate": None,
        # Any keyword of ppma.create_model: embed_dims, depths, num_heads, mlp_ratios, criss_cross,
        # layerscale, layer_init_values, in_chans (fused/reference ops: the --impl flag).
        "overrides": {},
        "checkpoint_path": None,  # initial weights (e.g. converted official ones)
    },
    "data": {
        # "imagefolder" (path/train, path/val), "digits" (scikit-learn's bundled 8x8 digits), or
        # "synthetic" (random tensors, for tests and smoke runs).
        "dataset": "imagefolder",
        "path": None,
        "num_classes": 1000,
        "img_size": 224,
        "in_chans": 3,
        "batch_size": 128,  # per process
        "eval_batch_size": 64,  # per process
        "num_workers": 8,
        "pin_memory": True,
        "crop_pct": 0.875,  # eval: Resize(224 / 0.875 = 256) + CenterCrop(224)
        "interpolation": "bicubic",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "repeated_aug": 3,  # timm RepeatAugSampler repeats (1 = off)
        "repeated_aug_round": 256,  # epoch length rounded down to a multiple of this (official)
        # digits only
        "digits_test_size": 0.2,
        "digits_split_seed": 0,
        # synthetic only
        "synthetic_train_size": 64,
        "synthetic_val_size": 32,
    },
    "aug": {
        # ImageFolder training pipeline (timm create_transform, spec §6.1)
        "scale": [0.08, 1.0],
        "hflip": 0.5,
        "color_jitter": 0.4,
        "auto_augment": "rand-m9-mstd0.5-inc1",
        "re_prob": 0.25,
        "re_mode": "pixel",
        "re_count": 1,
        # Mixup / CutMix (timm Mixup) and label smoothing
        "mixup": 0.8,
        "cutmix": 1.0,
        "mixup_prob": 1.0,
        "mixup_switch_prob": 0.5,
        "mixup_mode": "batch",
        "smoothing": 0.1,
        # Batched random affine for small tensor datasets (digits): degrees, translate (fraction of the
        # image), scale range, shear degrees; applied on the device, per sample. 0 disables.
        "affine_degrees": 0.0,
        "affine_translate": 0.0,
        "affine_scale": [1.0, 1.0],
        "affine_shear": 0.0,
    },
    "optim": {
        "opt": "adamw",
        # lr = base_lr * total_batch / base_batch (linear scaling, spec §6.1) unless lr is set.
        "base_lr": 5.0e-4,
        "base_batch": 512,
        "lr": None,
        "weight_decay": 0.05,  # not on 1-D parameters and biases
        "eps": 1.0e-8,
        "betas": [0.9, 0.999],
        "clip_grad": None,
    },
    "sched": {
        "epochs": 300,
        "warmup_epochs": 5,
        "warmup_lr": 1.0e-6,
        "min_lr": 1.0e-5,
        # False: timm CosineLRScheduler stepped once per epoch, at the end of epoch e with t = e
        # (the official DeiT-style loop, spec §6.1: epochs 0 and 1 both run at warmup_lr).
        # True: stepped every iteration on the fractional epoch (smoother, for short runs).
        "per_iteration": False,
    },
    "ema": {
        "enabled": True,
        "decay": 0.99992,  # per iteration, 0.99996 ** (1024 / 512)
        "warmup": False,
    },
    "train": {
        "output": "outputs/run",
        "resume": None,  # checkpoint path, or "auto": <output>/checkpoint.pth when it exists
        "seed": 0,
        "device": "auto",  # auto: cuda if available, else cpu
        # CPU threads for torch (None: torch's default, one per core). On a shared CPU, 1 thread avoids the
        # OpenMP oversubscription that can slow small models down by 10x.
        "num_threads": None,
        "amp": "auto",  # auto (fp16 on cuda, off on cpu) | fp16 | bf16 | none
        "sync_bn": True,  # only with several CUDA processes
        "deterministic": False,
        "channels_last": False,
        "eval_every": 1,
        "save_every": 1,
        "progress": True,
        "max_steps_per_epoch": None,  # cut epochs short (smoke tests)
        "stop_after_epoch": None,  # end the run after this epoch (the schedule still spans sched.epochs)
        "compile": False,
    },
}


def merge(base: dict, update: dict, path: str = "") -> dict:
    """Recursively merge ``update`` into a deep copy of ``base``; unknown keys raise ``KeyError``
    (so that a typo in a YAML file never passes silently), except inside free-form ``model.overrides``."""
    out = copy.deepcopy(base)
    for key, value in (update or {}).items():
        where = f"{path}.{key}" if path else key
        if key not in out and path != "model.overrides":
            raise KeyError(f"unknown config key {where!r}; known keys here: {sorted(out)}")
        if isinstance(value, dict) and isinstance(out.get(key), dict) and where != "model.overrides":
            out[key] = merge(out[key], value, where)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_overrides(cfg: dict, assignments: list[str]) -> dict:
    """Apply ``section.key=value`` strings (values parsed as YAML: ``3``, ``1e-3``, ``[1, 2]``, ``null``)."""
    for item in assignments:
        if "=" not in item:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        update: dict = {}
        cur = update
        for k in keys[:-1]:
            cur[k] = {}
            cur = cur[k]
        cur[keys[-1]] = yaml.safe_load(raw)
        cfg = merge(cfg, update)
    return cfg


class Config:
    """Attribute view of a nested dict (``cfg.optim.lr``); ``to_dict()`` returns plain types."""

    def __init__(self, data: dict):
        object.__setattr__(self, "_data", data)

    def __getattr__(self, name: str):
        try:
            value = self._data[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}; keys: {sorted(self._data)}") from None
        return Config(value) if isinstance(value, dict) and name != "overrides" else value

    def __setattr__(self, name: str, value) -> None:
        if name not in self._data:
            raise AttributeError(f"config has no key {name!r}")
        self._data[name] = value

    def __getitem__(self, name: str):
        return self.__getattr__(name)

    def to_dict(self) -> dict:
        return copy.deepcopy(self._data)

    def __repr__(self) -> str:
        return yaml.safe_dump(self._data, sort_keys=False)


def load_config(path: str | None = None, assignments: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at ``path`` (if any), then ``section.key=value`` assignments."""
    cfg = copy.deepcopy(DEFAULTS)
    if path:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path!r} must hold a mapping, got {type(loaded).__name__}")
        cfg = merge(cfg, loaded)
    if assignments:
        cfg = apply_overrides(cfg, assignments)
    return Config(cfg)
