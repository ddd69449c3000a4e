"""Compatibility shims for the environments ppma is installed in."""

from __future__ import annotations

import sys
import warnings


def ensure_torchvision() -> bool:
    """Make ``import torchvision`` (and so ``import timm``) work; returns whether torchvision is importable.

    The Python package index only carries CUDA builds of torchvision. Installed beside a CPU build of torch
    (as on our test machines), its compiled ops cannot load, and torchvision's own fake-tensor registrations
    for ``torchvision::nms`` / ``qnms`` then fail at import time. Everything ppma and timm use from
    torchvision (transforms, datasets, ImageFolder) is pure Python, so in that one case we define the two op
    schemas without kernels and import again: ``torchvision.ops.nms`` raises if called, nothing else changes.
    """
    try:
        import torchvision  # noqa: F401

        return True
    except ImportError:
        return False
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    global _TV_LIB
    _TV_LIB = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        if not torch._C._dispatch_has_kernel(f"torchvision::{op}") and not _has_schema(f"torchvision::{op}"):
            _TV_LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    warnings.warn(
        "torchvision's compiled ops do not match this torch build (e.g. a CUDA torchvision beside a CPU torch); "
        "its transforms and datasets work, torchvision.ops do not.",
        RuntimeWarning,
        stacklevel=2,
    )
    import torchvision  # noqa: F401,F811

    return True


_TV_LIB = None


def _has_schema(qualname: str) -> bool:
    import torch

    try:
        torch._C._get_schema(qualname, "")
        return True
    except RuntimeError:
        return False
