"""Public functional API of the PPMA operators (design §2).

``q, k: [B, H, W, heads, d]``, ``v: [B, H, W, heads, dv]``, ``log_alpha, log_beta: [B, H, W, heads]``.
Each function runs the fused ``torch.ops.ppma`` kernel when ``ppma._C`` is built, and the pure-PyTorch
reference of ``ppma.ops.reference`` otherwise (with one warning).
"""

from ppma.ops.criss_cross_attention import criss_cross_attention
from ppma.ops.polyline_attention import polyline_attention
from ppma.ops.polyline_scan import polyline_scan
from ppma.ops import reference

__all__ = ["polyline_attention", "criss_cross_attention", "polyline_scan", "reference"]
