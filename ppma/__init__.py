"""ppma: Polyline Path Masked Attention (PPMA, NeurIPS 2025) for PyTorch.

Fused operators (``ppma.ops``), modules (``ppma.nn``) and the PPMA-T/S/B backbones (``ppma.models``).
"""

from ppma import config  # first: every setting of the environment is parsed here
from ppma._ext import has_cuda_kernels, has_ext
from ppma import backends, ops

__version__ = "0.1.0"


def create_model(name: str, *args, **kwargs):
    """Build a PPMA model by name (``ppma_tiny``, ``ppma_small``, ``ppma_base``); see
    :func:`ppma.models.create_model` for the arguments. Imports ``ppma.models`` on first use."""
    from ppma.models import create_model as _create_model

    return _create_model(name, *args, **kwargs)


__all__ = ["ops", "backends", "config", "has_ext", "has_cuda_kernels", "create_model", "__version__"]
