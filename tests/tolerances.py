"""The one per-dtype tolerance table of the ppma kernel tests (CPU and CUDA), design §5.

Errors are relative norm errors ``||actual - expected|| / ||expected||`` against the pure-PyTorch
reference evaluated on the same inputs (the reference computes fp16/bf16 in fp32 and casts back).
"""

from __future__ import annotations

import torch

# dtype -> (forward tolerance, gradient tolerance)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative norm error in float64; 0 when both are zero."""
    a, e = actual.detach().double(), expected.detach().double()
    den = e.norm().item()
    num = (a - e).norm().item()
    if den == 0.0:
        return num
    return num / den


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, grad: bool = False):
    """Assert the relative norm error of ``actual`` is within the table's tolerance for ``dtype``."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    tol = TOLERANCES[dtype][1 if grad else 0]
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative norm error {err:.3e} > {tol:.1e} ({dtype})"
