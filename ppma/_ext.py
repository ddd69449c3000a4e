"""Loading of the compiled operator library ``ppma._C``.

Importing ``ppma._C`` runs the static ``TORCH_LIBRARY`` registrations of ``csrc/``, after which
the ops live under ``torch.ops.ppma``. Without the library every public op falls back to its pure
PyTorch reference (``ppma.ops.reference``), and one warning says so.
"""

from __future__ import annotations

import warnings

_LOADED: bool | None = None
_ERROR: str | None = None


def has_ext() -> bool:
    """Whether the compiled ``ppma._C`` operator library is importable (the result is cached)."""
    global _LOADED, _ERROR
    if _LOADED is None:
        try:
            from ppma import _C  # noqa: F401

            _LOADED = True
        except ImportError as exc:  # not built, or built against another torch
            _LOADED, _ERROR = False, str(exc)
    return _LOADED


def has_cuda_kernels() -> bool:
    """Whether ``ppma._C`` was built with its CUDA kernels."""
    import torch

    return has_ext() and torch._C._dispatch_has_kernel_for_dispatch_key("ppma::polyline_attention", "CUDA")


_WARNED = False


def warn_fallback() -> None:
    """Warn once that the pure-PyTorch reference is used because ``ppma._C`` is missing."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            "ppma._C is not available (" + str(_ERROR) + "); using the pure-PyTorch reference ops, which "
            "compute the same numbers but build N x N masks. Build with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
