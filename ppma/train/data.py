"""Datasets, transforms and samplers for ``ppma-train`` / ``ppma-eval``.

* ``imagefolder``: ``<path>/train/<class>/*`` and ``<path>/val/<class>/*``, with timm's ImageNet
  pipelines (docs/model.md §6.1): RandomResizedCrop + flip + RandAugment + RandomErasing for training,
  Resize(img_size / crop_pct) + CenterCrop for evaluation.
* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download), upsampled
  bilinearly to ``img_size`` once and held as one tensor; a fixed stratified split. Augmentation is a
  batched random affine on the device (``BatchAffine``), so the data pipeline costs nothing.
* ``synthetic``: random images with a learnable class signal, for tests and smoke runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = [
    "TensorImageDataset",
    "BatchAffine",
    "build_datasets",
    "build_digits",
    "build_synthetic",
    "build_eval_transform",
    "build_train_transform",
]


class TensorImageDataset(Dataset):
    """Images held in memory: ``images [N, C, S, S]`` (already normalised), ``targets [N]`` int64."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, classes: list[str] | None = None):
        if images.dim() != 4 or targets.shape != images.shape[:1]:
            raise ValueError(
                f"images must be [N, C, S, S] and targets [N]; got {tuple(images.shape)} and {tuple(targets.shape)}"
            )
        self.images = images
        self.targets = targets
        self.classes = classes or [str(i) for i in range(int(targets.max()) + 1)]

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, idx: int):
        return self.images[idx], self.targets[idx]


def build_digits(img_size: int = 64, test_size: float = 0.2, seed: int = 0):
    """scikit-learn's digits, upsampled to ``img_size`` and normalised; stratified split.

    Returns ``(train, test)`` ``TensorImageDataset``\\ s with ``images [N, 1, img_size, img_size]``.
    The split is fixed by ``seed`` (default: 80/20, seed 0: 1437 train / 360 test images).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]  # [1797, 1, 8, 8] in [0, 1]
    y = torch.from_numpy(d.target.astype(np.int64))
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=test_size, random_state=seed, stratify=d.target
    )
    x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    # statistics of the training split only
    mean, std = x[idx_train].mean(), x[idx_train].std()
    x = (x - mean) / std
    classes = [str(i) for i in range(10)]
    train = TensorImageDataset(x[idx_train].contiguous(), y[idx_train], classes)
    test = TensorImageDataset(x[idx_test].contiguous(), y[idx_test], classes)
    train.norm = test.norm = (float(mean), float(std))
    return train, test


def build_synthetic(num_classes: int, img_size: int, in_chans: int, n_train: int, n_val: int, seed: int = 0):
    """Random images whose class is encoded as a bright patch at a class-dependent position plus noise,
    so that a small model can learn it in a few steps. ``images [N, in_chans, S, S]``."""
    g = torch.Generator().manual_seed(seed)

    def make(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        x = 0.5 * torch.randn(n, in_chans, img_size, img_size, generator=g)
        cells = max(1, int(math.ceil(math.sqrt(num_classes))))
        cs = max(1, img_size // cells)
        for i in range(n):
            r, c = divmod(int(y[i]), cells)
            x[i, :, r * cs : (r + 1) * cs, c * cs : (c + 1) * cs] += 2.0
        return TensorImageDataset(x, y, [str(i) for i in range(num_classes)])

    return make(n_train), make(n_val)


class BatchAffine(nn.Module):
    """Random affine augmentation of a whole batch ``[B, C, H, W]`` on its device (per-sample parameters):
    rotation in ``±degrees``, translation in ``±translate`` of the size, isotropic scale in ``scale``,
    shear in ``±shear`` degrees. No flips (digits are not mirror-symmetric). Uses the global torch RNG of
    the batch's device, so checkpoints that save RNG states resume it exactly. The background value is
    ``fill`` (the normalised value of a blank pixel)."""

    def __init__(self, degrees=0.0, translate=0.0, scale=(1.0, 1.0), shear=0.0, fill: float = 0.0):
        super().__init__()
        self.degrees, self.translate, self.shear = float(degrees), float(translate), float(shear)
        self.scale = (float(scale[0]), float(scale[1]))
        self.fill = float(fill)

    @property
    def active(self) -> bool:
        return bool(self.degrees or self.translate or self.shear or self.scale != (1.0, 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        B = x.shape[0]
        dev = x.device

        def u(lo, hi):
            return torch.rand(B, device=dev) * (hi - lo) + lo

        rot = u(-self.degrees, self.degrees) * math.pi / 180
        sh = u(-self.shear, self.shear) * math.pi / 180
        s = u(*self.scale)
        tx, ty = u(-self.translate, self.translate) * 2, u(-self.translate, self.translate) * 2
        # inverse map (output -> input coordinates) for grid_sample, in normalised [-1, 1] coordinates
        cos, sin = torch.cos(rot), torch.sin(rot)
        a = torch.stack([cos, -sin + torch.tan(sh) * cos, sin, cos + torch.tan(sh) * sin], 1).view(B, 2, 2)
        theta = torch.cat([a / s.view(B, 1, 1), torch.stack([tx, ty], 1).view(B, 2, 1)], 2)
        grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
        out = F.grid_sample(x - self.fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        return out + self.fill


def build_train_transform(cfg):
    """timm's training pipeline for ImageFolder data (docs/model.md §6.1)."""
    from ppma._compat import ensure_torchvision

    ensure_torchvision()
    from timm.data import create_transform

    a, d = cfg.aug, cfg.data
    return create_transform(
        d.img_size,
        is_training=True,
        scale=tuple(a.scale),
        hflip=a.hflip,
        color_jitter=a.color_jitter,
        auto_augment=a.auto_augment,
        interpolation=d.interpolation,
        re_prob=a.re_prob,
        re_mode=a.re_mode,
        re_count=a.re_count,
        mean=tuple(d.mean),
        std=tuple(d.std),
    )


def build_eval_transform(img_size: int, crop_pct: float, interpolation: str, mean, std):
    """Resize(img_size / crop_pct) + CenterCrop(img_size) + normalise (timm's eval pipeline)."""
    from ppma._compat import ensure_torchvision

    ensure_torchvision()
    from timm.data import create_transform

    return create_transform(
        img_size, is_training=False, crop_pct=crop_pct, interpolation=interpolation, mean=tuple(mean), std=tuple(std)
    )


def build_datasets(cfg, need_train: bool = True):
    """``(train_dataset or None, val_dataset, batch_transform or None)`` for ``cfg.data.dataset``.

    ``batch_transform`` is a module applied to each training batch on the device (digits' affine)."""
    d, a = cfg.data, cfg.aug
    kind = d.dataset
    if kind == "digits":
        train, val = build_digits(d.img_size, d.digits_test_size, d.digits_split_seed)
        fill = -train.norm[0] / train.norm[1]  # a blank (0) pixel after normalisation
        aug = BatchAffine(a.affine_degrees, a.affine_translate, a.affine_scale, a.affine_shear, fill=fill)
        return (train if need_train else None), val, (aug if aug.active else None)
    if kind == "moving_digits":  # video clips of moving digits, labelled by direction (ppma/train/data_video.py)
        from ppma.train.data_video import build_moving_digits

        train, val = build_moving_digits(d.img_size, d.digits_test_size, d.digits_split_seed)
        return (train if need_train else None), val, None
    if kind == "synthetic":
        train, val = build_synthetic(
            d.num_classes, d.img_size, d.in_chans, d.synthetic_train_size, d.synthetic_val_size, seed=0
        )
        return (train if need_train else None), val, None
    if kind == "imagefolder":
        import os

        if not d.path:
            raise ValueError("data.dataset is 'imagefolder' but data.path is not set (use --data PATH)")
        from ppma._compat import ensure_torchvision

        ensure_torchvision()
        from torchvision.datasets import ImageFolder

        val_dir = os.path.join(d.path, "val")
        if not os.path.isdir(val_dir):
            raise FileNotFoundError(f"ImageFolder layout expected: {val_dir!r} does not exist")
        val = ImageFolder(val_dir, build_eval_transform(d.img_size, d.crop_pct, d.interpolation, d.mean, d.std))
        train = None
        if need_train:
            train = ImageFolder(os.path.join(d.path, "train"), build_train_transform(cfg))
            if train.classes != val.classes:
                raise ValueError(
                    f"train/ and val/ have different class folders ({len(train.classes)} vs {len(val.classes)})"
                )
        return train, val, None
    raise ValueError(f"data.dataset must be 'imagefolder', 'digits', 'moving_digits' or 'synthetic', got {kind!r}")
