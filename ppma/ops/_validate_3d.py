"""Input validation of the 3-D polyline ops (paper appendix C.2; docs/video.md).

The 3-D layout is the 2-D one with a leading time axis: ``q, k: [B, T, H, W, heads, d]``,
``v: [B, T, H, W, heads, dv]``, ``log_alpha, log_beta, log_gamma: [B, T, H, W, heads]``. Errors name the
argument, as in ``ppma.ops._validate`` (whose scalar checks are reused).
"""

from __future__ import annotations

import torch

from ppma.ops import _dispatch
from ppma.ops._validate import _check_floating, _check_tensor

DECAY_NAMES = ("log_alpha", "log_beta", "log_gamma")


def check_decay_shapes_3d(op: str, ref: torch.Tensor, *decays: torch.Tensor) -> None:
    """``log_alpha, log_beta, log_gamma: [B, T, H, W, heads]`` matching ``ref.shape[:5]``, on ``ref``'s device."""
    grid = tuple(ref.shape[:5])
    for name, t in zip(DECAY_NAMES, decays):
        _check_tensor(op, name, t)
        if t.dim() != 5 or tuple(t.shape) != grid:
            raise ValueError(f"{op}: {name} must be [B, T, H, W, heads] = {grid}, got shape {tuple(t.shape)}")
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the features are on {ref.device}")


def check_decay_values_3d(op: str, *decays: torch.Tensor) -> None:
    """With ``ppma.ops.set_check_decays(True)``: raise if a log-decay is positive (a decay above 1)."""
    if not _dispatch.check_decays_enabled():
        return
    for name, t in zip(DECAY_NAMES, decays):
        bad = t > 0
        if bool(bad.any()):
            raise ValueError(
                f"{op}: {name} must be <= 0 (log of a decay in [0, 1]); {int(bad.sum())} of {t.numel()} values "
                f"are positive, the largest {t.max().item():.4g} (set_check_decays(False) to skip this check)"
            )


def check_decay_dtypes_3d(op: str, *decays: torch.Tensor) -> None:
    """Floating log-decays of one dtype (which may differ from the features')."""
    for name, t in zip(DECAY_NAMES, decays):
        _check_floating(op, name, t)
    for name, t in zip(DECAY_NAMES[1:], decays[1:]):
        if t.dtype != decays[0].dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but log_alpha has dtype {decays[0].dtype}")


def check_attention_shapes_3d(op, q, k, v, *decays) -> None:
    """Types, shapes and devices: ``q, k: [B, T, H, W, heads, d]`` with ``d > 0``, ``v: [B, T, H, W, heads, dv]``,
    decays ``[B, T, H, W, heads]``, all on one device. Shared by the wrappers and the reference."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(op, name, t)
    if q.dim() != 6:
        raise ValueError(f"{op}: q must be [B, T, H, W, heads, d], got shape {tuple(q.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"{op}: k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 6 or tuple(v.shape[:5]) != tuple(q.shape[:5]):
        raise ValueError(
            f"{op}: v must be [B, T, H, W, heads, dv] matching q {tuple(q.shape)}, got {tuple(v.shape)}"
        )
    if q.shape[-1] == 0:
        raise ValueError(f"{op}: q and k must have a positive head dim d, got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    check_decay_shapes_3d(op, q, *decays)


def check_attention_inputs_3d(op, q, k, v, *decays) -> None:
    """``check_attention_shapes_3d`` plus floating dtypes (q, k, v share one; the decays another may),
    and the opt-in decay-value check."""
    check_attention_shapes_3d(op, q, k, v, *decays)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_floating(op, name, t)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but q has dtype {q.dtype}")
    check_decay_dtypes_3d(op, *decays)
    check_decay_values_3d(op, *decays)


def check_scan_shapes_3d(op, x, *decays) -> None:
    """``x: [B, T, H, W, heads, c]``, decays ``[B, T, H, W, heads]`` on ``x``'s device."""
    _check_tensor(op, "x", x)
    if x.dim() != 6:
        raise ValueError(f"{op}: x must be [B, T, H, W, heads, c], got shape {tuple(x.shape)}")
    check_decay_shapes_3d(op, x, *decays)


def check_scan_inputs_3d(op, x, log_alpha, log_beta, log_gamma, transpose) -> None:
    """``check_scan_shapes_3d`` plus dtypes, ``transpose`` a bool and the opt-in decay-value check."""
    from ppma.ops._validate import check_transpose

    check_scan_shapes_3d(op, x, log_alpha, log_beta, log_gamma)
    _check_floating(op, "x", x)
    check_decay_dtypes_3d(op, log_alpha, log_beta, log_gamma)
    check_transpose(op, transpose)
    check_decay_values_3d(op, log_alpha, log_beta, log_gamma)


_WARNED_3D: set[str] = set()


def run_fused_3d(t: torch.Tensor) -> bool:
    """Whether a 3-D op on ``t`` runs its compiled kernel: ``ppma.ops._dispatch.run_fused``, restricted to CPU
    (and meta) tensors, the devices the 3-D kernels exist for. Other devices run the reference, with one warning
    per device type."""
    if t.device.type not in ("cpu", "meta"):
        if _dispatch.get_impl() == "fused" and t.device.type not in _WARNED_3D:
            import warnings

            _WARNED_3D.add(t.device.type)
            warnings.warn(f"ppma: the 3-D polyline ops have CPU kernels only; using the pure-PyTorch reference on "
                          f"{t.device.type} (same numbers, N x N masks)", RuntimeWarning, stacklevel=3)
        return False
    return _dispatch.run_fused(t)
