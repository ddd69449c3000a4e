"""Public functional API of the PPMA operators (docs/design.md §2).

``q, k: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``, ``log_alpha, log_beta: [B, H, W, heads]``.
Each function runs the fused ``torch.ops.ppma`` kernel when ``ppma._C`` is built for the tensors' device,
and the pure-PyTorch reference of ``ppma.ops.reference`` otherwise (with one warning).

The one fused/reference switch of the package lives here: ``set_impl("fused" | "reference")``,
``get_impl()`` and the context manager ``use_impl(...)`` (initial value: ``PPMA_IMPL``, default ``"fused"``).
``set_check_decays(True)`` (or ``PPMA_CHECK_DECAYS=1``) makes every op reject positive log-decays.
"""

from ppma.ops._dispatch import (
    CUDA_KERNELS_VERIFIED,
    IMPLS,
    cuda_kernels_enabled,
    get_impl,
    set_check_decays,
    set_impl,
    use_impl,
)
from ppma.ops.criss_cross_attention import criss_cross_attention
from ppma.ops.polyline_attention import polyline_attention
from ppma.ops.polyline_linear_attention import polyline_linear_attention
from ppma.ops.polyline_scan import polyline_scan
from ppma.ops.polyline_attention_3d import polyline_attention_3d
from ppma.ops.polyline_linear_attention_3d import polyline_linear_attention_3d
from ppma.ops.polyline_scan_3d import polyline_scan_3d
from ppma.ops import cpu
from ppma.ops import reference, reference_3d

__all__ = [
    "polyline_attention",
    "criss_cross_attention",
    "polyline_linear_attention",
    "polyline_scan",
    "polyline_attention_3d",
    "polyline_linear_attention_3d",
    "polyline_scan_3d",
    "reference",
    "reference_3d",
    "cpu",
    "IMPLS",
    "set_impl",
    "cuda_kernels_enabled",
    "CUDA_KERNELS_VERIFIED",
    "get_impl",
    "use_impl",
    "set_check_decays",
]
