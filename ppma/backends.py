"""Which SIMD path the compiled CPU kernels of ``ppma._C`` run (the run-time dispatch of ``csrc/cpu/simd.h``).

The CPU kernels are built for baseline x86-64 and carry AVX2 and AVX-512 variants chosen at run time::

    ppma.backends.cpu_capability()             # the path the kernels run: "default", "avx2" or "avx512"
    ppma.backends.cpu_capabilities_available() # every path this machine can run, e.g. ["default", "avx2", "avx512"]
    ppma.backends.cpu_bf16_dot()                # whether bf16 inputs use the AVX-512 BF16 dot products
    ppma.backends.cpu_lowp_gemm(torch.bfloat16) # whether bf16 inputs' attention products run on torch's CPU BLAS
    ppma.backends.cpu_lowp_route(torch.bfloat16) # which: "simd", "brgemm" or "brgemm_vnni" (AMX's micro-kernel)

The environment variable ``PPMA_CPU_CAPABILITY=default|avx2|avx512`` caps the path, like PyTorch's
``ATEN_CPU_CAPABILITY``: the kernels run the lower of the cap and the best path the CPU has (a cap never turns
on instructions the CPU lacks). :mod:`ppma.config` reads it at import (a value outside those three raises a
``ValueError`` there), so set it in the environment of a fresh process.

bf16: the fused ops take bf16 inputs (what they see under ``torch.autocast("cpu", dtype=torch.bfloat16)``) and
accumulate in float32 on every path; where :func:`cpu_bf16_dot` is true, the forward products of
``polyline_attention`` and ``criss_cross_attention`` multiply bf16 values with the CPU's ``vdpbf16ps``
instruction instead of converting them to float32 first (docs/ops.md says which intermediates are rounded).
Where :func:`cpu_lowp_gemm` is true for the inputs' dtype (bf16 or fp16), every product of ``polyline_attention``
and ``criss_cross_attention``, forward and backward, multiplies bf16 (fp16) operands on torch's CPU batch-reduce GEMM
instead (MKL / oneDNN: AMX tiles where the CPU has them); by default on CPUs with AMX, where the operands are packed
in VNNI order for oneDNN's batch-reduce micro-kernel as torch's own CPU flash attention packs them
(:func:`cpu_lowp_route`), forced either way by the internal option ``cpu_lowp_products`` (docs/configuration.md,
docs/performance.md "bf16 and fp16 on the CPU").

The matrix unit: under bf16 autocast the model's linear layers and convolutions run oneDNN's bf16 kernels, whose speed
depends on the unit the CPU has for bf16 products: Intel's AMX tiles, the AVX-512 BF16 dot products (AMD Zen 4,
Intel Cooper Lake), or an emulation on plain AVX-512 (bf16 widened to float32, the float32 rate)::

    ppma.backends.cpu_name()                # e.g. "Intel(R) Xeon(R) Processor @ 2.80GHz (family 6, model 106)"
    ppma.backends.cpu_matrix_unit()         # "amx", "avx512_bf16", "avx512", "avx2" or "none"
    ppma.backends.cpu_matrix_units()        # the flags behind it, and what ppma's own kernels use for bf16
    ppma.backends.cpu_summary()             # one line of all that: ppma-benchmark --device cpu prints it
    ppma.backends.cpu_fp16_widened()        # whether fp16 autocast's products run as float32 on fp16-rounded values
"""

from __future__ import annotations

import functools
import os
import platform

import torch

from ppma import _ext, config

__all__ = ["CPU_CAPABILITIES", "LOWP_ROUTES", "MATRIX_UNITS", "cpu_capability", "cpu_capability_supported",
           "cpu_capabilities_available", "cpu_bf16_dot", "cpu_bf16_dot_supported", "cpu_lowp_gemm", "cpu_lowp_route",
           "cpu_lowp_vnni_available", "cpu_bf16_widened", "cpu_fp16_widened", "cpu_name",
           "cpu_matrix_unit", "cpu_matrix_units", "cpu_summary"]

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
    Otherwise bf16 inputs are converted to float32 and take the float32 path (the same accumulation). Also true on
    the ``"avx512"`` path of any CPU under the internal option ``cpu_lowp_products=5``, which runs those kernels with
    the instruction emulated on AVX-512F (tests; docs/configuration.md "Internal options")."""
    _require_ext()
    return bool(torch.ops.ppma.cpu_bf16_dot())


def cpu_bf16_dot_supported() -> bool:
    """Whether this CPU has the AVX-512 BF16 dot products (and the avx512 path), whatever
    ``PPMA_CPU_CAPABILITY`` says: :func:`cpu_bf16_dot` is true under the avx512 path exactly then."""
    _require_ext()
    return bool(torch.ops.ppma.cpu_bf16_dot_supported())


def cpu_lowp_gemm(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the products of ``polyline_attention`` and ``criss_cross_attention`` for ``dtype`` inputs
    (``torch.bfloat16`` or ``torch.float16``), forward and backward, run on torch's CPU batch-reduce GEMM
    (``at::native::cpublas::brgemm``: bf16 / fp16 operands, float32 accumulation; MKL or oneDNN pick AMX, AVX-512
    BF16 or AVX-512). By default true where torch
    packs ``dtype`` for its batch-reduce micro-kernels (AMX, as its own CPU flash attention decides); the internal
    option ``cpu_lowp_products`` (1: never, 2: always) overrides it. Otherwise ppma's own SIMD products run
    (:func:`cpu_bf16_dot`). False for other dtypes. :func:`cpu_lowp_route` says which of torch's routes runs."""
    _require_ext()
    return bool(torch.ops.ppma.cpu_lowp_gemm(dtype))


#: The products of bf16 / fp16 attention inputs (:func:`cpu_lowp_route`).
LOWP_ROUTES: tuple[str, ...] = ("simd", "brgemm", "brgemm_vnni", "brgemm_vnni_emulated")


def cpu_lowp_route(dtype: torch.dtype = torch.bfloat16) -> str:
    """Which products ``polyline_attention`` and ``criss_cross_attention`` run for ``dtype`` inputs on the CPU, one of
    :data:`LOWP_ROUTES`:

    - ``"simd"``: ppma's own SIMD products (:func:`cpu_bf16_dot`); always for dtypes other than bf16 and fp16;
    - ``"brgemm"``: torch's CPU batch-reduce GEMM on plain row-major operands (one MKL / oneDNN GEMM call per product);
    - ``"brgemm_vnni"``: torch's batch-reduce micro-kernel (oneDNN's, on AMX tiles) on operands packed in VNNI order,
      the route torch's CPU flash attention takes on AMX; the default where torch packs ``dtype`` (AMX) and the
      route runs here (:func:`cpu_lowp_vnni_available`);
    - ``"brgemm_vnni_emulated"``: the same packing with a scalar loop for the micro-kernel (tests only).

    The internal option ``cpu_lowp_products`` (1 to 4: these in order) forces one; forcing ``"brgemm_vnni"`` where it
    does not run makes the ops raise a ``RuntimeError``, and this function too. 5 is ``"simd"`` with AVX-512 BF16's
    dot products emulated on the ``"avx512"`` path (:func:`cpu_bf16_dot`; tests)."""
    _require_ext()
    return str(torch.ops.ppma.cpu_lowp_route(dtype))


def cpu_lowp_vnni_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch's VNNI-packed batch-reduce micro-kernel (``at::native::cpublas::brgemm`` with ``is_vnni``) runs
    ``dtype`` products on this CPU: oneDNN generates it for AMX (bf16; fp16 with AMX-FP16) and, for bf16, possibly
    for AVX-512 BF16. Probed once per process with two products of known result (an error or a wrong result: False)."""
    _require_ext()
    return bool(torch.ops.ppma.cpu_lowp_vnni_available(dtype))


#: The units bf16 matrix products can run on, fastest first (see :func:`cpu_matrix_unit`).
MATRIX_UNITS: tuple[str, ...] = ("amx", "avx512_bf16", "avx512", "avx2", "none")

# oneDNN's names for the instruction-set caps of ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA in older releases), lowest
# first, and the matrix unit each cap leaves to bf16 products (oneDNN's documentation, "CPU dispatcher control").
_ONEDNN_ISA_CAPS: tuple[tuple[str, str], ...] = (
    ("SSE41", "none"), ("AVX", "none"), ("AVX2", "avx2"), ("AVX2_VNNI", "avx2"), ("AVX2_VNNI_2", "avx2"),
    ("AVX512_CORE", "avx512"), ("AVX512_CORE_VNNI", "avx512"), ("AVX512_CORE_BF16", "avx512_bf16"),
    ("AVX10_1_512", "avx512_bf16"), ("AVX512_CORE_FP16", "avx512_bf16"), ("AVX10_1_512_AMX", "amx"),
    ("AVX512_CORE_AMX", "amx"), ("AVX10_1_512_AMX_FP16", "amx"), ("AVX512_CORE_AMX_FP16", "amx"),
)


@functools.lru_cache(None)
def cpu_name() -> str:
    """The CPU's model name as the OS reports it (``/proc/cpuinfo`` on Linux, with the x86 family and model
    numbers, e.g. ``"Intel(R) Xeon(R) Processor @ 2.80GHz (family 6, model 106)"``), else the name torch's cpuinfo
    gives (``torch.cpu.get_capabilities()``) or ``platform.processor()``. For naming the CPU beside a measurement."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or _torch_capabilities().get("cpu_name") or platform.processor() or "unknown CPU"
    if fields.get("cpu family") and fields.get("model"):
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return str(name)


def _torch_capabilities() -> dict:
    """torch's cpuinfo flags (``torch.cpu.get_capabilities()``, torch >= 2.9), ``{}`` on older releases."""
    fn = getattr(torch.cpu, "get_capabilities", None)
    return dict(fn()) if fn is not None else {}


def _cpu_flags() -> dict[str, bool]:
    """The CPU flags that decide the matrix unit: torch's cpuinfo where it has them, else ``/proc/cpuinfo``'s
    ``flags`` line (same names), else none."""
    names = ("amx_tile", "amx_bf16", "amx_fp16", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512_vnni",
             "avx512_core", "avx2")
    caps = _torch_capabilities()
    if caps:
        flags = {n: bool(caps.get(n, False)) for n in names}
        flags["avx512_core"] = all(caps.get(n, False) for n in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"))
        return flags
    found: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    found = set(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    flags = {n: n in found for n in names}
    flags["avx512_core"] = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= found
    return flags


def _onednn_isa_cap() -> str | None:
    """The matrix unit ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) caps oneDNN to, None when it is unset,
    ``ALL``/``DEFAULT`` or a name this table does not know (then oneDNN's own choice is reported)."""
    value = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return dict(_ONEDNN_ISA_CAPS).get(value)


@functools.lru_cache(None)
def _amx_usable() -> bool:
    """The CPU has AMX bf16 tiles and the OS lets this process use them (Linux hands the tile state out on request;
    ``torch.cpu._init_amx`` asks, as oneDNN does before its first AMX kernel)."""
    flags = _cpu_flags()
    if not (flags["amx_tile"] and flags["amx_bf16"]):
        return False
    init = getattr(torch.cpu, "_init_amx", None)
    return bool(init()) if init is not None else True


def cpu_matrix_unit() -> str:
    """The unit that bf16 matrix products run on in this process: oneDNN's bf16 linear layers, convolutions and
    matmuls, i.e. what the model's linear layers use under ``torch.autocast("cpu", dtype=torch.bfloat16)``. One of
    :data:`MATRIX_UNITS`:

    - ``"amx"``: Intel AMX tiles (the CPU has ``amx_tile`` and ``amx_bf16`` and the OS grants the tile state);
    - ``"avx512_bf16"``: the AVX-512 BF16 dot products (``vdpbf16ps``: AMD Zen 4, Intel Cooper Lake);
    - ``"avx512"``: plain AVX-512, bf16 widened to float32 (oneDNN's emulation: about the float32 rate);
    - ``"avx2"``: AVX2 only; ``"none"``: oneDNN has no bf16 kernels here (``torch.backends.mkldnn`` off, or an
      older CPU) and ATen's own bf16 GEMM runs.

    A cap in ``ONEDNN_MAX_CPU_ISA`` (oneDNN's variable, e.g. ``AVX512_CORE_BF16``) lowers the answer as it lowers
    oneDNN's choice. ppma's own attention kernels reach AMX through torch's CPU BLAS where :func:`cpu_lowp_gemm`
    holds; :func:`cpu_bf16_dot` says whether they use the AVX-512 BF16 dot products otherwise."""
    flags = _cpu_flags()
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "none"
    if _amx_usable():
        unit = "amx"
    elif flags["avx512_bf16"]:
        unit = "avx512_bf16"
    elif flags["avx512_core"]:
        unit = "avx512"
    elif flags["avx2"]:
        unit = "avx2"
    else:
        unit = "none"
    cap = _onednn_isa_cap()
    if cap is not None and MATRIX_UNITS.index(cap) > MATRIX_UNITS.index(unit):
        unit = cap
    return unit


def cpu_bf16_widened() -> bool:
    """Whether the linear layers and convolutions of a model fused by :func:`ppma.nn.fuse_for_inference` (and of
    ``ppma.compile.compile_model``'s frozen graphs) run bf16 autocast inference on oneDNN's float32 kernels, fed the
    bf16-rounded values, and the unfused model's linear layers and convolutions bf16 autocast inference and training on
    float32 GEMMs and convolutions with autocast's roundings (``ppma.nn.layers.linear``, ``conv2d``): where bf16
    products have no instructions of their own (:func:`cpu_matrix_unit` is ``"avx512"`` or ``"avx2"``), oneDNN's bf16
    kernels widen the operands inside their loops and run 2.5-3.4x slower than its float32 ones on PPMA-T's shapes;
    the product of two bf16 values is exact in float32, so both compute the same up to the order of the float32 sums
    (docs/performance.md "bf16 and fp16 on the CPU")."""
    return cpu_matrix_unit() in ("avx512", "avx2")


def cpu_fp16_widened() -> bool:
    """Whether the model's linear layers and convolutions run fp16 autocast on float32 kernels fed the fp16-rounded
    values (``ppma.nn.layers.linear``, ``conv2d`` and the unfused ``DWConv2d``, inference and training): where torch's
    oneDNN has no fp16 kernels on this CPU (no AVX512-FP16 or AMX-FP16, ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``
    false, or oneDNN off), torch runs fp16 convolutions and linear layers on fallback kernels (``_slow_conv2d_forward``
    for every depthwise convolution, a reference GEMM), about 9x slower than float32 for PPMA-T. The product of two fp16
    values is exact in float32, so both compute the same up to the order of the float32 sums (docs/performance.md
    "bf16 and fp16 on the CPU")."""
    return not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()))


def cpu_matrix_units() -> dict:
    """What this CPU has for low-precision matrix products and what runs on it, as a dict: ``cpu`` (:func:`cpu_name`),
    ``matrix_unit`` (:func:`cpu_matrix_unit`), the flags ``amx_bf16``, ``amx_fp16``, ``amx_usable`` (AMX bf16 tiles
    granted by the OS), ``avx512_bf16``, ``avx512_fp16``, ``avx512_vnni``; ``onednn_bf16`` and ``onednn_fp16``
    (whether torch's oneDNN has bf16 / fp16 kernels on this CPU); and, where ``ppma._C`` is built,
    ``ppma_kernels`` (:func:`cpu_capability`), ``ppma_bf16_dot`` (:func:`cpu_bf16_dot`), ``ppma_lowp_gemm``
    (:func:`cpu_lowp_gemm` for bf16) and ``ppma_lowp_route`` (:func:`cpu_lowp_route` for bf16), else None; and
    ``ppma_bf16_widened`` (:func:`cpu_bf16_widened`) and ``ppma_fp16_widened`` (:func:`cpu_fp16_widened`)."""
    flags = _cpu_flags()
    mkldnn = torch.backends.mkldnn.is_available()
    info = {
        "cpu": cpu_name(),
        "matrix_unit": cpu_matrix_unit(),
        "amx_bf16": flags["amx_bf16"],
        "amx_fp16": flags["amx_fp16"],
        "amx_usable": _amx_usable(),
        "avx512_bf16": flags["avx512_bf16"],
        "avx512_fp16": flags["avx512_fp16"],
        "avx512_vnni": flags["avx512_vnni"],
        "onednn_bf16": bool(mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "onednn_fp16": bool(mkldnn and torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        "ppma_kernels": None,
        "ppma_bf16_dot": None,
        "ppma_lowp_gemm": None,
        "ppma_lowp_route": None,
        "ppma_bf16_widened": cpu_bf16_widened(),
        "ppma_fp16_widened": cpu_fp16_widened(),
    }
    if _ext.has_ext():
        info["ppma_kernels"] = cpu_capability()
        info["ppma_bf16_dot"] = cpu_bf16_dot()
        info["ppma_lowp_gemm"] = cpu_lowp_gemm(torch.bfloat16)
        info["ppma_lowp_route"] = cpu_lowp_route(torch.bfloat16)
    return info


_UNIT_WORDS = {
    "amx": "AMX tiles",
    "avx512_bf16": "AVX-512 BF16 dot products (no AMX)",
    "avx512": "AVX-512, bf16 emulated in float32 (no AMX, no AVX-512 BF16)",
    "avx2": "AVX2, bf16 emulated in float32 (no AMX, no AVX-512)",
    "none": "ATen's bf16 GEMM (oneDNN has no bf16 kernels here)",
}


def cpu_summary() -> str:
    """One line naming the CPU and its matrix unit, e.g. ``"CPU: Intel(R) Xeon(R) ... (family 6, model 106);
    bf16 products (oneDNN): AVX-512, bf16 emulated in float32 (no AMX, no AVX-512 BF16); ppma kernels: avx512,
    attention bf16 products via float32; fused bf16 linear layers and convolutions: oneDNN float32 on bf16-rounded
    values"``: what ``ppma-benchmark --device cpu`` prints beside its figures."""
    info = cpu_matrix_units()
    line = f"CPU: {info['cpu']}; bf16 products (oneDNN): {_UNIT_WORDS[info['matrix_unit']]}"
    if info["ppma_kernels"] is not None:
        vnni = info["ppma_lowp_route"].startswith("brgemm_vnni")
        emulated = " (emulated)" if config.get_internal_option("cpu_lowp_products") == 5 else ""
        dot = ("torch's CPU batch-reduce micro-kernel (VNNI-packed)" if vnni
               else "torch's CPU batch-reduce GEMM" if info["ppma_lowp_gemm"]
               else f"AVX-512 BF16 dot products{emulated}" if info["ppma_bf16_dot"] else "float32")
        line += f"; ppma kernels: {info['ppma_kernels']}, attention bf16 products via {dot}"
    if info["ppma_bf16_widened"]:
        line += "; fused bf16 linear layers and convolutions: oneDNN float32 on bf16-rounded values"
    if info["ppma_fp16_widened"]:
        line += "; fp16 autocast linear layers and convolutions: float32 on fp16-rounded values"
    return line
