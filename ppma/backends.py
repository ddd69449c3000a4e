"""Which SIMD path the compiled CPU kernels of ``ppma._C`` run (the run-time dispatch of ``csrc/cpu/simd.h``).

The CPU kernels are built for baseline x86-64 and carry AVX2 and AVX-512 variants chosen at run time::

    ppma.backends.cpu_capability()             # the path the kernels run: "default", "avx2" or "avx512"
    ppma.backends.cpu_capabilities_available() # every path this machine can run, e.g. ["default", "avx2", "avx512"]
    ppma.backends.cpu_bf16_dot()                # whether bf16 inputs use the AVX-512 BF16 dot products

The environment variable ``PPMA_CPU_CAPABILITY=default|avx2|avx512`` caps the path, like PyTorch's
``ATEN_CPU_CAPABILITY``: the kernels run the lower of the cap and the best path the CPU has (a cap never turns
on instructions the CPU lacks). :mod:`ppma.config` reads it at import (a value outside those three raises a
``ValueError`` there), so set it in the environment of a fresh process.

bf16: the fused ops take bf16 inputs (what they see under ``torch.autocast("cpu", dtype=torch.bfloat16)``) and
accumulate in float32 on every path; where :func:`cpu_bf16_dot` is true, the forward products of
``polyline_attention`` and ``criss_cross_attention`` multiply bf16 values with the CPU's ``vdpbf16ps``
instruction instead of converting them to float32 first (docs/ops.md says which intermediates are rounded).
"""

from __future__ import annotations

import torch

from ppma import _ext, config

__all__ = ["CPU_CAPABILITIES", "cpu_capability", "cpu_capability_supported", "cpu_capabilities_available",
           "cpu_bf16_dot", "cpu_bf16_dot_supported"]

#: The SIMD paths of the CPU kernels, lowest first.
CPU_CAPABILITIES: tuple[str, ...] = config.CPU_CAPABILITIES


def _require_ext() -> None:
    if not _ext.has_ext():
        raise RuntimeError(f"ppma.backends: the compiled library ppma._C is not available ({_ext.load_error()}); "
                           "the ops run the pure-PyTorch reference")


def cpu_capability() -> str:
    """The SIMD path the CPU kernels run in this process: ``"default"`` (SSE2 on x86-64, NEON on arm64),
    ``"avx2"`` (AVX2 + FMA) or ``"avx512"`` (AVX-512 F/BW/VL/DQ): the best the CPU has, capped by
    ``PPMA_CPU_CAPABILITY``. Asked from the compiled library, so it is what the kernels actually use.
    Raises ``RuntimeError`` when ``ppma._C`` is not built."""
    _require_ext()
    return torch.ops.ppma.cpu_capability()


def cpu_capability_supported() -> str:
    """The best SIMD path this CPU can run, whatever ``PPMA_CPU_CAPABILITY`` says (one of
    :data:`CPU_CAPABILITIES`). Raises ``RuntimeError`` when ``ppma._C`` is not built."""
    _require_ext()
    return torch.ops.ppma.cpu_capability_supported()


def cpu_capabilities_available() -> list[str]:
    """Every SIMD path this machine can run, lowest first (``[]`` without the compiled library): the values of
    ``PPMA_CPU_CAPABILITY`` under which a fresh process runs a different path. Tests run each op once per entry."""
    if not _ext.has_ext():
        return []
    best = cpu_capability_supported()
    return list(CPU_CAPABILITIES[: CPU_CAPABILITIES.index(best) + 1])


def cpu_bf16_dot() -> bool:
    """Whether the CPU kernels multiply bf16 inputs with the AVX-512 BF16 dot-product instruction
    (``vdpbf16ps``, float32 accumulation): the ``"avx512"`` path is selected and the CPU has ``avx512_bf16``.
    Otherwise bf16 inputs are converted to float32 and take the float32 path (the same accumulation)."""
    _require_ext()
    return bool(torch.ops.ppma.cpu_bf16_dot())


def cpu_bf16_dot_supported() -> bool:
    """Whether this CPU has the AVX-512 BF16 dot products (and the avx512 path), whatever
    ``PPMA_CPU_CAPABILITY`` says: :func:`cpu_bf16_dot` is true under the avx512 path exactly then."""
    _require_ext()
    return bool(torch.ops.ppma.cpu_bf16_dot_supported())
