"""Loading of the compiled operator library ``ppma._C``.

Importing ``ppma._C`` runs the static ``TORCH_LIBRARY`` registrations of ``csrc/``, after which
the ops live under ``torch.ops.ppma``. Without the library every public op falls back to its pure
PyTorch reference (``ppma.ops.reference``), and one warning says so (``ppma.ops._dispatch``).

A library built from other sources than the checkout it sits in (a stale build after a ``git pull``) is refused
once, at the first load, with the command that rebuilds it (``ppma._stamp``; docs/configuration.md "A stale
library"): a stale build would run old kernels, or miss ops, without a word.
"""

from __future__ import annotations

import os

_LOADED: bool | None = None
_ERROR: str | None = None

# The source checkout this package sits in, if it does (an editable install or an in-place build): its csrc/
# folder is what the library must have been built from.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CSRC = os.path.join(_ROOT, "csrc")

REBUILD = "pip install --no-build-isolation -e .  (or: python setup.py build_ext --inplace)"


class StaleLibraryError(RuntimeError):
    """``ppma._C`` was built from other sources than those of the checkout it is loaded from."""


def check_stamp(library_stamp: str | None, csrc: str = _CSRC) -> None:
    """Raise :class:`StaleLibraryError` when ``library_stamp`` (``torch.ops.ppma.source_stamp()``, None for a
    library too old to have one) differs from the stamp of the sources in ``csrc``. Nothing is checked where
    ``csrc`` holds no sources (an installed wheel)."""
    if not os.path.isfile(os.path.join(csrc, "ppma.cpp")):
        return
    from ppma._stamp import source_stamp

    kind = (library_stamp or "cpu:").split(":", 1)[0]
    expected = source_stamp(csrc, kind if kind in ("cpu", "cuda") else "cpu")
    if library_stamp != expected:
        raise StaleLibraryError(
            f"ppma: the compiled library ppma._C was built from other sources than those in {csrc} (library "
            f"stamp {library_stamp!r}, sources {expected!r}): it is stale. Rebuild it from the repository root "
            f"with: {REBUILD}"
        )


def has_ext() -> bool:
    """Whether the compiled ``ppma._C`` operator library is importable (the result is cached). The first call
    loads it, checks that it is not stale (raising :class:`StaleLibraryError` if it is) and hands it the kernel
    options of the environment (``ppma.config``)."""
    global _LOADED, _ERROR
    if _LOADED is None:
        try:
            from ppma import _C  # noqa: F401
        except ImportError as exc:  # not built, or built against another torch
            _LOADED, _ERROR = False, str(exc)
            return _LOADED
        import torch

        stamp = torch.ops.ppma.source_stamp() if hasattr(torch.ops.ppma, "source_stamp") else None
        try:
            check_stamp(stamp)
        except StaleLibraryError as exc:
            _LOADED, _ERROR = False, str(exc)
            raise
        from ppma import config

        _LOADED = True
        config._apply_to_library()
    return _LOADED


def has_cuda_kernels() -> bool:
    """Whether ``ppma._C`` was built with its CUDA kernels. Asks the dispatcher, which ``torch.compile``
    cannot trace: the ops read the answer decided once at import (``ppma.ops._dispatch``)."""
    import torch

    return has_ext() and torch._C._dispatch_has_kernel_for_dispatch_key("ppma::polyline_attention", "CUDA")


def load_error() -> str | None:
    """Why ``ppma._C`` could not be imported (``None`` when it was, or was not tried yet)."""
    if _LOADED is None:
        try:
            has_ext()
        except StaleLibraryError:
            pass
    return _ERROR
