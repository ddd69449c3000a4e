"""ppma: Polyline Path Masked Attention (PPMA, NeurIPS 2025) for PyTorch.

Fused operators (``ppma.ops``), modules (``ppma.nn``) and the PPMA-T/S/B backbones (``ppma.models``).
"""

from ppma._ext import has_cuda_kernels, has_ext
from ppma import ops

__version__ = "0.1.0"

__all__ = ["ops", "has_ext", "has_cuda_kernels", "__version__"]
