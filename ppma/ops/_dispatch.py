"""Which implementation the public ops run (docs/design.md §2): the fused ``torch.ops.ppma`` kernels or the
pure-PyTorch reference of ``ppma.ops.reference``.

The switches themselves live in :mod:`ppma.config` (with every other setting of the package) and are re-exported
by ``ppma.ops``::

    ppma.ops.set_impl("reference")          # every op, hence every model, runs the reference
    with ppma.ops.use_impl("reference"):    # within the block only
        logits = model(x)
    ppma.ops.get_impl()                     # "fused" or "reference"

``"fused"`` runs the compiled kernels where ``ppma._C`` has them for the tensors' device and the reference
elsewhere (one warning per device). Both give the same numbers. The CUDA kernels run by default: they have passed
their tests on a GPU (``CUDA_KERNELS_VERIFIED``; benchmarks/results, the GPU test table); ``PPMA_CUDA_KERNELS=0``
or ``ppma.ops.set_impl("fused", cuda_kernels=False)`` switches them off.

Everything the wrappers read on their traced path is a plain module-level value decided at import, so
``torch.compile(fullgraph=True)`` traces them; dynamo guards on the values it reads (changing the switch
recompiles, it never runs a stale graph). In particular the availability of the CUDA kernels is queried from
the dispatcher once, here, and never per call: dynamo cannot trace that query.
"""

from __future__ import annotations

import warnings

import torch

from ppma import _ext, config
from ppma.config import (  # noqa: F401  (the switches, re-exported for ppma.ops and the op wrappers)
    CUDA_KERNELS_VERIFIED,
    IMPLS,
    check_decays_enabled,
    cuda_kernels_enabled,
    get_impl,
    set_check_decays,
    set_impl,
    use_impl,
)

__all__ = ["fused_available", "run_fused"]

# Device types the compiled library serves. "meta" inputs run the registered fake kernels (shapes only).
_FUSED_DEVICES: frozenset[str] = frozenset()
if _ext.has_ext():
    _FUSED_DEVICES = frozenset(
        {"cpu", "meta"}
        | ({"cuda"} if torch._C._dispatch_has_kernel_for_dispatch_key("ppma::polyline_attention", "CUDA") else set())
    )
_WARNED: set[str] = set()


def fused_available(device: torch.device | str) -> bool:
    """Whether ``ppma._C`` has kernels for tensors on ``device`` (decided at import)."""
    return torch.device(device).type in _FUSED_DEVICES


def run_fused(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs the compiled kernel: the switch says ``"fused"`` and the library serves
    ``t``'s device type. Otherwise the reference runs, with one warning per device type when it is the
    missing library (not the switch) that decides."""
    if config._impl == "reference":
        return False
    if t.device.type in _FUSED_DEVICES:
        if t.device.type == "cuda" and not config._cuda_kernels:
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
