"""The source stamp of the compiled library (docs/configuration.md "A stale library").

``setup.py`` hashes the C++/CUDA sources it compiles into ``ppma._C`` and bakes the hash in
(``torch.ops.ppma.source_stamp()``); in a source checkout ``ppma._ext`` hashes the same files again at import and
refuses a library built from other sources, with the command that rebuilds it. Torch-free, so that ``setup.py``
can load this file on its own.
"""

from __future__ import annotations

import hashlib
import os

# The source folders each kind of build compiles (csrc/generated holds the stamp itself and is never hashed).
_DIRS = {"cpu": ("common", "cpu"), "cuda": ("common", "cpu", "cuda", "kernels")}
_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def source_stamp(csrc: str, kind: str) -> str:
    """``"<kind>:<hash>"``: the first 16 hex digits of the SHA-256 of the sources a ``kind`` build (``"cpu"`` or
    ``"cuda"``) compiles from the folder ``csrc``: ``csrc/ppma.cpp`` and the files of the folders of ``_DIRS``,
    each hashed with its path relative to ``csrc``, in sorted order."""
    if kind not in _DIRS:
        raise ValueError(f"ppma: unknown build kind {kind!r}")
    paths = [os.path.join(csrc, "ppma.cpp")]
    for d in _DIRS[kind]:
        for dirpath, _, files in os.walk(os.path.join(csrc, d)):
            paths += [os.path.join(dirpath, f) for f in files if f.endswith(_SUFFIXES)]
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: os.path.relpath(p, csrc)):
        h.update(os.path.relpath(p, csrc).replace(os.sep, "/").encode())
        with open(p, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return f"{kind}:{h.hexdigest()[:16]}"
