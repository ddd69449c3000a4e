"""Loading of the compiled operator library ``ppma._C``.

Importing ``ppma._C`` runs the static ``TORCH_LIBRARY`` registrations of ``csrc/``, after which
the ops live under ``torch.ops.ppma``. Without the library every public op falls back to its pure
PyTorch reference (``ppma.ops.reference``), and one warning says so (``ppma.ops._dispatch``).
"""

from __future__ import annotations

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
    """Whether ``ppma._C`` was built with its CUDA kernels. Asks the dispatcher, which ``torch.compile``
    cannot trace: the ops read the answer decided once at import (``ppma.ops._dispatch``)."""
    import torch

    return has_ext() and torch._C._dispatch_has_kernel_for_dispatch_key("ppma::polyline_attention", "CUDA")


def load_error() -> str | None:
    """Why ``ppma._C`` could not be imported (``None`` when it was, or was not tried yet)."""
    has_ext()
    return _ERROR
