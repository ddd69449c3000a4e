"""Which implementation the public ops run (docs/design.md §2): the fused ``torch.ops.ppma`` kernels or the
pure-PyTorch reference of ``ppma.ops.reference``, and the opt-in check of the log-decays.

One process-wide switch, owned here and read by the op wrappers at call time (not thread-local, like
``torch.backends`` flags)::

    ppma.ops.set_impl("reference")          # every op, hence every model, runs the reference
    with ppma.ops.use_impl("reference"):    # within the block only
        logits = model(x)
    ppma.ops.get_impl()                     # "fused" or "reference"

``PPMA_IMPL=reference`` in the environment sets the initial value (e.g. for MMDetection/MMSegmentation tools
that never call Python of ours). ``"fused"`` runs the compiled kernels where ``ppma._C`` has them for the
tensors' device and the reference elsewhere (one warning per device). Both give the same numbers.

The CUDA kernels run by default: they have passed their tests on a GPU (``CUDA_KERNELS_VERIFIED``; an NVIDIA
H200, benchmarks/results/gpu_tests_NVIDIA-H200.md). ``PPMA_CUDA_KERNELS=0`` in the environment or
``ppma.ops.set_impl("fused", cuda_kernels=False)`` switches them off (CUDA tensors then run the reference, with a
one-time notice), e.g. to compare the two on a new GPU. The CPU kernels are the default wherever they are built.

Everything the wrappers read on their traced path is a plain module-level value decided at import, so
``torch.compile(fullgraph=True)`` traces them; dynamo guards on the values it reads (changing the switch
recompiles, it never runs a stale graph). In particular the availability of the CUDA kernels is queried from
the dispatcher once, here, and never per call: dynamo cannot trace that query.
"""

from __future__ import annotations

import os
import warnings

import torch

from ppma import _ext

__all__ = [
    "IMPLS",
    "CUDA_KERNELS_VERIFIED",
    "set_impl",
    "get_impl",
    "use_impl",
    "cuda_kernels_enabled",
    "set_check_decays",
    "fused_available",
]

IMPLS = ("fused", "reference")


def _checked(impl) -> str:
    if impl not in IMPLS:
        raise ValueError(f"ppma.ops: impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value not in ("0", "1", "true", "false", ""):
        raise ValueError(f"ppma: environment variable {name} must be 0 or 1, got {value!r}")
    return default if value == "" else value in ("1", "true")


# Whether the CUDA kernels have passed their tests on a GPU (the default for CUDA tensors when True; while False
# they ran only when asked for). Set by the first GPU run that passed them (benchmarks/results/gpu_tests_*.md).
CUDA_KERNELS_VERIFIED = True

_impl: str = _checked(os.environ.get("PPMA_IMPL", "fused"))
_check_decays: bool = _env_flag("PPMA_CHECK_DECAYS")
_cuda_kernels: bool = _env_flag("PPMA_CUDA_KERNELS", default=CUDA_KERNELS_VERIFIED)

# Device types the compiled library serves. "meta" inputs run the registered fake kernels (shapes only).
_FUSED_DEVICES: frozenset[str] = frozenset()
if _ext.has_ext():
    _FUSED_DEVICES = frozenset(
        {"cpu", "meta"}
        | ({"cuda"} if torch._C._dispatch_has_kernel_for_dispatch_key("ppma::polyline_attention", "CUDA") else set())
    )
_WARNED: set[str] = set()


def set_impl(impl: str, *, cuda_kernels: bool | None = None) -> None:
    """Make every ``ppma.ops`` call run ``impl``: ``"fused"`` (the compiled kernels, falling back to the
    reference where none is built for the device) or ``"reference"`` (``ppma.ops.reference``, pure PyTorch).

    ``cuda_kernels=False`` switches the CUDA kernels off (CUDA tensors run the reference; ``PPMA_CUDA_KERNELS=0``
    does the same at import), ``True`` back on (the default since they passed their tests on a GPU,
    ``CUDA_KERNELS_VERIFIED``); ``None`` keeps the current choice."""
    global _impl, _cuda_kernels
    _impl = _checked(impl)
    if cuda_kernels is not None:
        _cuda_kernels = bool(cuda_kernels)


def cuda_kernels_enabled() -> bool:
    """Whether ``"fused"`` runs the CUDA kernels on CUDA tensors (else the reference runs there)."""
    return _cuda_kernels


def get_impl() -> str:
    """The implementation the ops run now: ``"fused"`` or ``"reference"``."""
    return _impl


class use_impl:
    """Context manager: run ``impl`` inside the ``with`` block and restore the previous choice on exit.

    ``with ppma.ops.use_impl("reference"): y = model(x)``. ``impl=None`` keeps the current choice (handy for
    an optional command-line flag). Traceable by ``torch.compile``."""

    def __init__(self, impl: str | None) -> None:
        self.impl = None if impl is None else _checked(impl)
        self._prev: list[str] = []

    def __enter__(self) -> "use_impl":
        global _impl
        self._prev.append(_impl)
        _impl = self.impl or _impl
        return self

    def __exit__(self, *exc) -> None:
        global _impl
        _impl = self._prev.pop()


def set_check_decays(enabled: bool) -> None:
    """Opt-in check of the log-decay contract (``log_alpha, log_beta <= 0``, i.e. decays in ``[0, 1]``):
    when on, every op raises a ``ValueError`` naming the argument if a log-decay is positive. Off by default,
    because it reads the data (a device sync, and a graph break under ``torch.compile``).
    ``PPMA_CHECK_DECAYS=1`` in the environment turns it on at import."""
    global _check_decays
    _check_decays = bool(enabled)


def check_decays_enabled() -> bool:
    return _check_decays


def fused_available(device: torch.device | str) -> bool:
    """Whether ``ppma._C`` has kernels for tensors on ``device`` (decided at import)."""
    return torch.device(device).type in _FUSED_DEVICES


def run_fused(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs the compiled kernel: the switch says ``"fused"`` and the library serves
    ``t``'s device type. Otherwise the reference runs, with one warning per device type when it is the
    missing library (not the switch) that decides."""
    if _impl == "reference":
        return False
    if t.device.type in _FUSED_DEVICES:
        if t.device.type == "cuda" and not _cuda_kernels:
            _notice_cuda_off()
            return False
        return True
    _warn_fallback(t.device.type)
    return False


def _notice_cuda_off() -> None:
    if "cuda-off" in _WARNED:
        return
    _WARNED.add("cuda-off")
    warnings.warn(
        "ppma: the CUDA kernels are switched off (PPMA_CUDA_KERNELS=0 or set_impl(\"fused\", cuda_kernels=False)), "
        "so CUDA tensors run the pure-PyTorch reference ops (same numbers, N x N masks). To run the CUDA kernels, "
        'unset PPMA_CUDA_KERNELS or call ppma.ops.set_impl("fused", cuda_kernels=True).',
        UserWarning,
        stacklevel=4,
    )


def _warn_fallback(device_type: str) -> None:
    if device_type in _WARNED:
        return
    _WARNED.add(device_type)
    if not _ext.has_ext():
        why = f"ppma._C is not available ({_ext.load_error()}); build it with `pip install --no-build-isolation -e .`"
    else:
        why = f"ppma._C has no kernels for {device_type} tensors"
    warnings.warn(
        f"{why}. Using the pure-PyTorch reference ops on {device_type}, which compute the same numbers but "
        "build N x N masks.",
        RuntimeWarning,
        stacklevel=4,
    )
