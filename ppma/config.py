"""Every run-time setting of ppma, in one place (docs/configuration.md).

This module parses ppma's environment variables once, at import, and holds every process-wide switch; nothing
else in the package reads the environment or keeps a switch of its own, and the compiled kernels read the
options set here (``torch.ops.ppma.set_option``), never the environment.

The switches (not thread-local, like ``torch.backends`` flags; initial values from the environment):

==========================  ===========================================  =========================================
switch                      set with                                     environment (at import)
==========================  ===========================================  =========================================
which implementation runs   ``ppma.ops.set_impl("fused"|"reference")``,  ``PPMA_IMPL`` (default ``fused``)
                            ``ppma.ops.use_impl(...)``
CUDA kernels on / off       ``ppma.ops.set_impl("fused",                 ``PPMA_CUDA_KERNELS`` (default 1)
                            cuda_kernels=...)``
check of the log-decays     ``ppma.ops.set_check_decays(True)``          ``PPMA_CHECK_DECAYS`` (default 0)
CPU SIMD path cap           (environment only: read by the first         ``PPMA_CPU_CAPABILITY``
                            kernel)                                      (``default|avx2|avx512``, default: none)
==========================  ===========================================  =========================================

Internal options, for comparisons and for kernels not yet verified on a GPU (:func:`set_internal_option`;
environment ``PPMA_INTERNAL_OPTIONS="name=value,..."``): ``cuda_tensor_cores`` (0: polyline_attention's CUDA-core
kernels only), ``cuda_next_<op>`` (1: the next generation of that op's CUDA kernel) and ``cpu_lowp_products`` (0 to
5: which products bf16 / fp16 inputs take in the CPU kernels of polyline_attention and criss_cross_attention). Their
names and ranges are those of ``csrc/common/options.h``.

Everything the op wrappers read on their traced path is a plain module-level value, so ``torch.compile``
(fullgraph) traces them and guards on the values it read (changing a switch recompiles).
"""

from __future__ import annotations

import os

__all__ = [
    "IMPLS",
    "CPU_CAPABILITIES",
    "CUDA_KERNELS_VERIFIED",
    "set_impl",
    "get_impl",
    "use_impl",
    "cuda_kernels_enabled",
    "set_check_decays",
    "check_decays_enabled",
    "cpu_capability_cap",
    "set_internal_option",
    "get_internal_option",
    "internal_option",
    "ENVIRONMENT",
]

#: The implementations the ops can run: the compiled kernels, or the pure-PyTorch reference.
IMPLS = ("fused", "reference")

#: The SIMD paths of the CPU kernels, lowest first (the values of ``PPMA_CPU_CAPABILITY``).
CPU_CAPABILITIES: tuple[str, ...] = ("default", "avx2", "avx512")

#: Whether the CUDA kernels have passed their tests on a GPU: they are then the default for CUDA tensors. Set by
#: the first GPU run that passed them (benchmarks/results, the GPU test table).
CUDA_KERNELS_VERIFIED = True

#: The user-facing environment variables and what they set (docs/configuration.md lists the same).
ENVIRONMENT = {
    "PPMA_IMPL": "initial implementation: fused (default) or reference",
    "PPMA_CUDA_KERNELS": "0: CUDA tensors run the reference instead of the CUDA kernels (default 1)",
    "PPMA_CHECK_DECAYS": "1: every op rejects positive log-decays (default 0)",
    "PPMA_CPU_CAPABILITY": "cap on the CPU kernels' SIMD path: default, avx2 or avx512 (default: the CPU's best)",
    "PPMA_NO_TIMM": "1: do not register the models with timm on import of ppma.models (default 0)",
    "PPMA_INTERNAL_OPTIONS": "internal kernel options for comparisons, name=value,... (set_internal_option)",
}


def _checked_impl(impl) -> str:
    if impl not in IMPLS:
        raise ValueError(f"ppma: impl must be one of {IMPLS}, got {impl!r}")
    return impl


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (``0``/``1``/``true``/``false``; unset or empty: ``default``);
    anything else raises a ``ValueError`` naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if value not in ("0", "1", "true", "false", ""):
        raise ValueError(f"ppma: environment variable {name} must be 0 or 1, got {value!r}")
    return default if value == "" else value in ("1", "true")


def _env_cpu_capability() -> str | None:
    value = os.environ.get("PPMA_CPU_CAPABILITY", "").strip()
    if value and value not in CPU_CAPABILITIES:
        raise ValueError(f"ppma: environment variable PPMA_CPU_CAPABILITY must be one of {CPU_CAPABILITIES}, "
                         f"got {value!r}")
    return value or None


def _env_internal_options() -> dict[str, int]:
    text = os.environ.get("PPMA_INTERNAL_OPTIONS", "").strip()
    options: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            options[name.strip()] = int(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"ppma: environment variable PPMA_INTERNAL_OPTIONS must be name=integer,..., got {item!r}")
    return options


# The switches, parsed once at import.
def _env_impl() -> str:
    value = os.environ.get("PPMA_IMPL", "").strip() or "fused"
    if value not in IMPLS:
        raise ValueError(f"ppma: environment variable PPMA_IMPL must be one of {IMPLS}, got {value!r}")
    return value


_impl: str = _env_impl()
_cuda_kernels: bool = env_flag("PPMA_CUDA_KERNELS", default=CUDA_KERNELS_VERIFIED)
_check_decays: bool = env_flag("PPMA_CHECK_DECAYS")
_cpu_capability_cap: str | None = _env_cpu_capability()
register_with_timm: bool = not env_flag("PPMA_NO_TIMM")
_internal_options: dict[str, int] = _env_internal_options()


def set_impl(impl: str, *, cuda_kernels: bool | None = None) -> None:
    """Make every ``ppma.ops`` call run ``impl``: ``"fused"`` (the compiled kernels, falling back to the
    reference where none is built for the device, with one warning) or ``"reference"``
    (``ppma.ops.reference``, pure PyTorch). Both compute the same numbers up to rounding.

    ``cuda_kernels=False`` switches the CUDA kernels off (CUDA tensors run the reference; ``PPMA_CUDA_KERNELS=0``
    does the same at import), ``True`` back on (the default since they passed their tests on a GPU,
    :data:`CUDA_KERNELS_VERIFIED`); ``None`` keeps the current choice."""
    global _impl, _cuda_kernels
    _impl = _checked_impl(impl)
    if cuda_kernels is not None:
        _cuda_kernels = bool(cuda_kernels)


def get_impl() -> str:
    """The implementation the ops run now: ``"fused"`` or ``"reference"``."""
    return _impl


def cuda_kernels_enabled() -> bool:
    """Whether ``"fused"`` runs the CUDA kernels on CUDA tensors (else the reference runs there)."""
    return _cuda_kernels


class use_impl:
    """Context manager: run ``impl`` inside the ``with`` block and restore the previous choice on exit.

    ``with ppma.ops.use_impl("reference"): y = model(x)``. ``impl=None`` keeps the current choice (handy for
    an optional command-line flag). Traceable by ``torch.compile``."""

    def __init__(self, impl: str | None) -> None:
        self.impl = None if impl is None else _checked_impl(impl)
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
    """Whether the ops check that log-decays are <= 0 (:func:`set_check_decays`)."""
    return _check_decays


def cpu_capability_cap() -> str | None:
    """The cap ``PPMA_CPU_CAPABILITY`` puts on the CPU kernels' SIMD path (one of :data:`CPU_CAPABILITIES`), or
    None. ``ppma.backends.cpu_capability()`` says which path the kernels run."""
    return _cpu_capability_cap


def set_internal_option(name: str, value: int) -> int:
    """Set one of the compiled kernels' internal options (``csrc/common/options.h``; docs/configuration.md
    "Internal options") and return its previous value: ``cuda_tensor_cores`` (0: polyline_attention's CUDA-core
    kernels only, to compare them with the tensor-core ones), ``cuda_next_<op>`` (1: the next generation of the
    op's CUDA kernel, before it is verified on a GPU) or ``cpu_lowp_products`` (the products of bf16 / fp16 inputs in
    the CPU kernels of polyline_attention and criss_cross_attention: 0 by the CPU's matrix unit, 1 ppma's own SIMD
    products, 2 torch's CPU batch-reduce GEMM, 3 and 4 its VNNI-packed micro-kernel and that packing emulated, 5 the
    SIMD products with AVX-512 BF16's dot products emulated; ``ppma.backends.cpu_lowp_route``). Raises
    ``ValueError`` for an unknown name or a value out of range, ``RuntimeError`` without the compiled library."""
    _require_library()
    return _set_option(name, value)


def get_internal_option(name: str) -> int:
    """The current value of an internal option (:func:`set_internal_option`)."""
    import torch

    _require_library()
    try:
        return int(torch.ops.ppma.get_option(str(name)))
    except RuntimeError as exc:  # std::invalid_argument from the library: unknown name
        raise ValueError(str(exc).splitlines()[0]) from None


class internal_option:
    """Context manager: :func:`set_internal_option` inside the ``with`` block, the previous value restored on exit,
    e.g. ``with ppma.config.internal_option("cuda_tensor_cores", 0): ...`` to time polyline_attention's CUDA-core
    kernels."""

    def __init__(self, name: str, value: int) -> None:
        self.name, self.value = name, value
        self._prev: list[int] = []

    def __enter__(self) -> "internal_option":
        self._prev.append(set_internal_option(self.name, self.value))
        return self

    def __exit__(self, *exc) -> None:
        set_internal_option(self.name, self._prev.pop())


def _require_library() -> None:
    from ppma import _ext

    if not _ext.has_ext():
        raise RuntimeError(f"ppma: internal options need the compiled library ppma._C ({_ext.load_error()})")


def _set_option(name: str, value: int) -> int:
    import torch

    try:
        return int(torch.ops.ppma.set_option(str(name), int(value)))
    except RuntimeError as exc:  # std::invalid_argument from the library: unknown name, value out of range
        raise ValueError(str(exc).splitlines()[0]) from None


def _apply_to_library() -> None:
    """Hand the environment's kernel options to the compiled library (``ppma._ext`` calls this once, right after
    loading it and before any kernel runs)."""
    if _cpu_capability_cap is not None:
        _set_option("cpu_capability", CPU_CAPABILITIES.index(_cpu_capability_cap))
    for name, value in _internal_options.items():
        try:
            _set_option(name, value)
        except ValueError as exc:
            raise ValueError(f"ppma: environment variable PPMA_INTERNAL_OPTIONS: {exc}") from None
