"""Build script for ppma: a pure-Python package plus the ``ppma._C`` operator library.

The C++ CPU kernels are always built. The CUDA kernels are built when the installed torch is a
CUDA build and a CUDA toolkit is found, or when ``FORCE_CUDA=1`` (README "Install"). ``PPMA_NO_CUDA=1``
turns them off. Install with ``pip install --no-build-isolation -e .`` after installing torch,
so that pip never downloads another torch into a build environment.
"""

import glob
import importlib.util
import os
import sys
import sysconfig

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _write_stamp(csrc: str, kind: str) -> None:
    """Write csrc/generated/stamp.h: the hash of the sources this build compiles (ppma/_stamp.py), which the
    library reports (torch.ops.ppma.source_stamp) so that a source checkout detects a stale build. Rewritten only
    when it changes, so that an unchanged tree rebuilds nothing."""
    spec = importlib.util.spec_from_file_location("_ppma_stamp", os.path.join(ROOT, "ppma", "_stamp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = f'#pragma once\n#define PPMA_SOURCE_STAMP "{mod.source_stamp(csrc, kind)}"\n'
    path = os.path.join(csrc, "generated", "stamp.h")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def _extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension
    except ImportError:  # metadata-only runs (e.g. `pip show`); the package needs torch at build time
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    csrc = os.path.join(ROOT, "csrc")
    sources = [os.path.join("csrc", "ppma.cpp")] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(csrc, "cpu", "*.cpp"))
    )
    cuda_sources = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(csrc, "cuda", "*.cu")))

    with_cuda = not _flag("PPMA_NO_CUDA") and (
        _flag("FORCE_CUDA") or (torch.version.cuda is not None and CUDA_HOME is not None)
    )
    # -Wno-psabi: GCC notes that the 8-lane vector helpers of csrc/cpu/simd.h would pass vectors in another
    # calling convention without AVX; they are always inlined into AVX functions, so no such call exists.
    # -g0: Python's own CFLAGS (which setuptools puts first) carry -g; debug information does not change the code
    # GCC generates but nearly doubled the compile time of the kernels' templates (criss_cross_attention.cpp: 149 s
    # with it, 92 s without, one core). PPMA_DEBUG=1 builds unoptimised with it.
    cxx = ["-O3", "-g0", "-std=c++17", "-fopenmp", "-Wno-psabi"]
    if _flag("PPMA_DEBUG"):
        cxx = ["-O0", "-g", "-std=c++17", "-fopenmp", "-Wno-psabi"]
    include_dirs = [csrc]
    _write_stamp(csrc, "cuda" if with_cuda and cuda_sources else "cpu")
    if with_cuda and cuda_sources:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            # No GPU is needed to build: pick the architectures we test on (Ampere, Hopper).
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        ext = CUDAExtension(
            "ppma._C",
            sources + cuda_sources,
            include_dirs=include_dirs,
            extra_compile_args={
                "cxx": cxx + ["-DPPMA_WITH_CUDA"],
                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "-DPPMA_WITH_CUDA",
                         "--expt-relaxed-constexpr"],
            },
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "ppma._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": _build_ext_class(BuildExtension)}


def _build_ext_class(base):
    """torch's BuildExtension (ninja) with one object folder for every kind of build of this tree.

    pip's editable install compiles in a temporary folder that it deletes, so each editable install, and the wheel
    built after it (scripts/check_wheel.sh), compiled every operator again. Here the objects always go to
    build/temp.<platform>-<python> beside setup.py (where `python setup.py build_ext` and `python -m build` put them
    anyway), and ninja recompiles only what changed: a source, a header or the compile command. A tree that is not
    writable keeps setuptools' choice."""

    class BuildExt(base.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            build = os.path.join(ROOT, "build")
            if os.access(ROOT, os.W_OK) and (not os.path.exists(build) or os.access(build, os.W_OK)):
                tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
                self.build_temp = os.path.join(build, f"temp.{tag}")

    return BuildExt


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["ppma", "ppma.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
