"""The one checkpoint reader: every file, URL and ``hf://`` path that ppma loads goes through
:func:`read_checkpoint`, a weights-only ``torch.load`` that also rebuilds the few harmless types real checkpoints
hold (:func:`checkpoint_safe_globals`). Nothing is ever unpickled without that restriction, so no code stored in a
file runs."""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import os
import pickle
import re
import urllib.parse

import torch

__all__ = ["read_checkpoint", "checkpoint_safe_globals", "allow_checkpoint_globals", "route_mmengine_local_files"]

_logger = logging.getLogger("ppma")


def _torch_version() -> tuple[int, int]:
    major, minor = re.findall(r"\d+", torch.__version__)[:2]
    return int(major), int(minor)


def _numpy_safe_globals() -> list:
    """The numpy objects a pickled array or scalar refers to (mm checkpoints keep numpy values in their logs)."""
    try:
        import numpy as np
    except ImportError:
        return []
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    allowed: list = [np.ndarray, np.dtype]
    allowed += [type(np.dtype(t)) for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                                            np.int64, np.uint8, np.bool_)]
    for name in ("_reconstruct", "scalar"):
        fn = getattr(multiarray, name)
        if _torch_version() >= (2, 6):  # (object, path) pairs: files written by numpy 1.x and 2.x name the module differently
            allowed += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
        else:
            allowed.append(fn)
    return allowed


@functools.lru_cache(maxsize=None)
def _safe_globals() -> tuple:
    return (argparse.Namespace, *_numpy_safe_globals(), *_mmengine_safe_globals())


def checkpoint_safe_globals() -> list:
    """What :func:`read_checkpoint` allows ``torch.load(weights_only=True)`` to rebuild besides tensors and plain
    Python containers: ``argparse.Namespace`` (the ``args`` of the official classification ``best.pth``), numpy
    arrays, scalars and dtypes, and mmengine's ``HistoryBuffer`` (the logs inside MMEngine ``iter_*.pth`` /
    ``epoch_*.pth``). Nothing that can run code when it is rebuilt."""
    return list(_safe_globals())


def _mmengine_safe_globals() -> list:
    try:
        from mmengine.logging import HistoryBuffer
    except Exception:  # mmengine not installed: its checkpoints cannot hold anything we could rebuild anyway
        return []
    allowed: list = [HistoryBuffer]
    if _torch_version() >= (2, 6):
        names = {"min", "max", "current", "mean", *getattr(HistoryBuffer, "_statistics_methods", {})}

        def history_buffer_method(obj, name):
            """The ``getattr(HistoryBuffer, name)`` that a pickled HistoryBuffer uses to refer to its statistics
            methods; any other attribute lookup is refused."""
            if obj is HistoryBuffer and name in names:
                return getattr(HistoryBuffer, name)
            raise pickle.UnpicklingError(f"checkpoint asks for getattr({obj!r}, {name!r}), which is not allowed")

        allowed.append((history_buffer_method, "builtins.getattr"))
    return allowed


@contextlib.contextmanager
def allow_checkpoint_globals():
    """Within the block, every weights-only ``torch.load`` (ours, and mmengine's under torch >= 2.6, where
    weights-only is the default) may rebuild :func:`checkpoint_safe_globals` too."""
    allowed = checkpoint_safe_globals()
    if hasattr(torch.serialization, "safe_globals"):
        # re-entrant: torch's context removes on exit what it added on entry, so an inner block must add only what
        # is not allowed yet, or it would take the outer block's allowances away when it ends
        current = torch.serialization.get_safe_globals()
        with torch.serialization.safe_globals([g for g in allowed if g not in current]):
            yield
    else:  # torch 2.4: no context manager; the allowlist stays for the process
        torch.serialization.add_safe_globals(allowed)
        yield


def _torch_load(path: str, map_location) -> dict:
    if os.path.getsize(path) == 0:  # torch.load would raise a bare EOFError
        raise ValueError(f"read_checkpoint: the checkpoint file {path!r} is empty")
    with allow_checkpoint_globals():
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            if "Unsupported operand" in str(exc):  # not a refused object: bytes that are no pickle (a damaged file)
                raise ValueError(f"read_checkpoint: {path!r} is not a readable checkpoint ({exc})") from exc
            refused = re.findall(r"GLOBAL ([\w.]+)", str(exc))
            what = f"refused to rebuild {', '.join(sorted(set(refused)))}" if refused else "refused an object"
            raise RuntimeError(
                f"read_checkpoint: {path!r} is not a plain checkpoint: the weights-only load {what}, which could "
                f"run code. Allowed besides tensors and plain containers: argparse.Namespace, numpy arrays, scalars "
                f"and dtypes, mmengine's HistoryBuffer. ppma never falls back to unrestricted unpickling; extract the "
                f"state dict in a trusted environment. Details: {exc}"
            ) from exc
        except (EOFError, RuntimeError) as exc:  # truncated or not a torch file
            raise ValueError(
                f"read_checkpoint: {path!r} is not a readable checkpoint ({type(exc).__name__}: {exc})"
            ) from exc


def _download(url: str) -> str:
    """Download ``url`` once into ``<torch hub dir>/checkpoints`` (rank 0 first when distributed) and return the
    path. The file name gets a hash of the URL, because the official files all share names (``best.pth``)."""
    name = os.path.basename(urllib.parse.urlparse(url).path) or "checkpoint.pth"
    cache_dir = os.path.join(torch.hub.get_dir(), "checkpoints")
    path = os.path.join(cache_dir, f"{hashlib.sha256(url.encode()).hexdigest()[:8]}-{name}")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if (not distributed or torch.distributed.get_rank() == 0) and not os.path.isfile(path):
        os.makedirs(cache_dir, exist_ok=True)
        _logger.info(f"ppma: downloading {url} to {path}")
        torch.hub.download_url_to_file(url, path, progress=False)
    if distributed:
        torch.distributed.barrier()
    return path


def read_checkpoint(source: str | os.PathLike, map_location="cpu") -> dict:
    """Read a checkpoint safely: ``torch.load(weights_only=True)`` with :func:`checkpoint_safe_globals` allowed.

    Args:
        source: a local ``.pth``/``.pt``/``.safetensors`` file; an ``http(s)://`` URL (downloaded once into
            ``<torch hub dir>/checkpoints``); ``hf://<repo id>/<path in repo>[@revision]`` (through the Hugging
            Face hub client and its cache, see :mod:`ppma.checkpoint.hub`); or another scheme that mmengine's
            ``CheckpointLoader`` knows (only with torch >= 2.6, whose ``torch.load`` is weights-only by default).
        map_location: as for ``torch.load``.

    Returns:
        The loaded object (a dict for every checkpoint layout ppma reads).
    """
    source = os.fspath(source)
    scheme = source.split("://", 1)[0] if "://" in source else ""
    if scheme in ("http", "https"):
        path = _download(source)
    elif scheme == "hf":
        from ppma.checkpoint.hub import download_hf

        path = download_hf(source)
    elif scheme:
        forced_off = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")
        if _torch_version() < (2, 6) or forced_off:  # mmengine calls torch.load without weights_only
            raise RuntimeError(f"read_checkpoint: {source!r}: mmengine's loaders would unpickle without restriction "
                               f"here (torch {torch.__version__}, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD={int(forced_off)}); "
                               f"download the file and pass its path")
        from mmengine.runner import CheckpointLoader

        with allow_checkpoint_globals():
            return CheckpointLoader.load_checkpoint(source, map_location=map_location)
    else:
        path = source
        if not os.path.isfile(path):
            raise FileNotFoundError(f"read_checkpoint: no checkpoint file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path, device=str(map_location))
        except Exception as exc:  # safetensors' own error type for a damaged header or truncated data
            raise ValueError(f"read_checkpoint: {path!r} is not a readable safetensors file ({exc})") from exc
    return _torch_load(path, map_location)


def _mmengine_local_loader(filename: str, map_location=None) -> dict:
    return read_checkpoint(os.path.expanduser(filename), map_location=map_location)


def route_mmengine_local_files() -> None:
    """Make MMEngine's ``CheckpointLoader`` read local files with :func:`read_checkpoint` (replacing its
    ``load_from_local``, which calls ``torch.load`` with torch's default: unrestricted before torch 2.6).
    ``ppma-mm`` calls this, so that ``load_from``, ``resume`` and ``init_cfg`` of any module in a runner go through
    the one reader too. Affects the whole process."""
    from mmengine.runner import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes="", force=True)(_mmengine_local_loader)
