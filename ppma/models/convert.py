"""Official PPMA checkpoints <-> our module names (docs/model.md §5), and checkpoint loading.

Official names (``PPMA.py:PPMAViT``, docs/model.md §5.1) map one to one onto ours::

    patch_embed.proj.{0,3,6,9}                 stem.conv{1,2,3,4}
    patch_embed.proj.{1,4,7,10}                stem.bn{1,2,3,4}
    layers.{s}.Relpos.angle                    stages.{s}.rope.angle
    layers.{s}.blocks.{b}.pos.conv             stages.{s}.blocks.{b}.cpe.conv
    ....retention_layer_norm                   ....norm1
    ....retention.{q,k,v,out}_proj             ....attn.{q,k,v,proj}
    ....retention.lepe.conv                    ....attn.lepe.conv
    ....retention.path_embed.*                 ....attn.decay.*   (dt_linear.weight, dt_bias, A_log)
    ....final_layer_norm                       ....norm2
    ....ffn.{fc1,fc2,dwconv.conv}              ....mlp.{fc1,fc2,dwconv.conv}
    ....gamma_{1,2}  [1, 1, 1, C]              ....ls{1,2}.gamma  [C]
    layers.{s}.downsample.{reduction,norm}     stages.{s+1}.downsample.{conv,norm}
    proj / norm / head                         head.proj / head.norm / head.fc
    outnorm{i}  (dense-prediction backbone)    out_norms.{i}
"""

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
from collections.abc import Mapping
from typing import Sequence

import torch

__all__ = [
    "convert_official_state_dict",
    "convert_to_official_state_dict",
    "select_state_dict",
    "convert_mm_checkpoint",
    "read_checkpoint",
    "checkpoint_safe_globals",
    "allow_checkpoint_globals",
    "load_checkpoint",
    "EVAL_KEYS",
    "DOWNSTREAM_KEYS",
]

_logger = logging.getLogger("ppma")

#: Checkpoint keys tried in order for ImageNet evaluation: the reported accuracies are EMA maxima (docs/model.md §5.2).
EVAL_KEYS = ("model_ema", "model", "models", "state_dict")
#: Keys tried in order for downstream initialisation, mirroring the official backbones' ``key='model'``.
DOWNSTREAM_KEYS = ("model", "models", "model_ema", "state_dict")

_BLOCK = r"layers\.(\d+)\.blocks\.(\d+)\."
# (official regex, our template); groups of the official regex fill the template.
_OFFICIAL_TO_OURS = [
    (r"^patch_embed\.proj\.(0|3|6|9)\.", lambda m: f"stem.conv{int(m[1]) // 3 + 1}."),
    (r"^patch_embed\.proj\.(1|4|7|10)\.", lambda m: f"stem.bn{int(m[1]) // 3 + 1}."),
    (r"^layers\.(\d+)\.Relpos\.angle$", lambda m: f"stages.{m[1]}.rope.angle"),
    (rf"^{_BLOCK}pos\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.cpe."),
    (rf"^{_BLOCK}retention_layer_norm\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.norm1."),
    (rf"^{_BLOCK}retention\.(q|k|v)_proj\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.{m[3]}."),
    (rf"^{_BLOCK}retention\.out_proj\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.proj."),
    (rf"^{_BLOCK}retention\.lepe\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.lepe."),
    (rf"^{_BLOCK}retention\.path_embed\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.decay."),
    (rf"^{_BLOCK}final_layer_norm\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.norm2."),
    (rf"^{_BLOCK}ffn\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.mlp."),
    (rf"^{_BLOCK}gamma_(1|2)$", lambda m: f"stages.{m[1]}.blocks.{m[2]}.ls{m[3]}.gamma"),
    (r"^layers\.(\d+)\.downsample\.reduction\.", lambda m: f"stages.{int(m[1]) + 1}.downsample.conv."),
    (r"^layers\.(\d+)\.downsample\.norm\.", lambda m: f"stages.{int(m[1]) + 1}.downsample.norm."),
    (r"^proj\.", lambda m: "head.proj."),
    (r"^norm\.", lambda m: "head.norm."),
    (r"^head\.", lambda m: "head.fc."),
    (r"^outnorm(\d+)\.", lambda m: f"out_norms.{m[1]}."),
]

_SBLOCK = r"stages\.(\d+)\.blocks\.(\d+)\."
_OURS_TO_OFFICIAL = [
    (r"^stem\.conv(\d)\.", lambda m: f"patch_embed.proj.{(int(m[1]) - 1) * 3}."),
    (r"^stem\.bn(\d)\.", lambda m: f"patch_embed.proj.{(int(m[1]) - 1) * 3 + 1}."),
    (r"^stages\.(\d+)\.rope\.angle$", lambda m: f"layers.{m[1]}.Relpos.angle"),
    (rf"^{_SBLOCK}cpe\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.pos."),
    (rf"^{_SBLOCK}norm1\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention_layer_norm."),
    (rf"^{_SBLOCK}attn\.(q|k|v)\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.{m[3]}_proj."),
    (rf"^{_SBLOCK}attn\.proj\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.out_proj."),
    (rf"^{_SBLOCK}attn\.lepe\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.lepe."),
    (rf"^{_SBLOCK}attn\.decay\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.path_embed."),
    (rf"^{_SBLOCK}norm2\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.final_layer_norm."),
    (rf"^{_SBLOCK}mlp\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.ffn."),
    (rf"^{_SBLOCK}ls(1|2)\.gamma$", lambda m: f"layers.{m[1]}.blocks.{m[2]}.gamma_{m[3]}"),
    (r"^stages\.(\d+)\.downsample\.conv\.", lambda m: f"layers.{int(m[1]) - 1}.downsample.reduction."),
    (r"^stages\.(\d+)\.downsample\.norm\.", lambda m: f"layers.{int(m[1]) - 1}.downsample.norm."),
    (r"^head\.proj\.", lambda m: "proj."),
    (r"^head\.norm\.", lambda m: "norm."),
    (r"^head\.fc\.", lambda m: "head."),
    (r"^out_norms\.(\d+)\.", lambda m: f"outnorm{m[1]}."),
]
_OFFICIAL_TO_OURS = [(re.compile(p), f) for p, f in _OFFICIAL_TO_OURS]
_OURS_TO_OFFICIAL = [(re.compile(p), f) for p, f in _OURS_TO_OFFICIAL]


def _rename(key: str, rules) -> str | None:
    for pattern, template in rules:
        m = pattern.match(key)
        if m:
            return template(m) + key[m.end() :]
    return None


def _is_state_dict(obj) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, torch.Tensor) for v in obj.values())


def select_state_dict(checkpoint, key: str | Sequence[str] | None = None) -> tuple[dict, str | None]:
    """Pick the weights out of a checkpoint (docs/model.md §5.2).

    Args:
        checkpoint: a bare state dict, or a dict holding one under ``model``, ``models``, ``model_ema`` or
            ``state_dict``.
        key: the key to use (``KeyError`` if absent), or a sequence of keys tried in order; ``None`` means
            :data:`EVAL_KEYS` (``model_ema`` first).

    Returns:
        ``(state_dict, chosen_key)``; ``chosen_key`` is ``None`` for a bare state dict.
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
    if _is_state_dict(checkpoint):
        if isinstance(key, str):
            raise KeyError(f"checkpoint is a bare state dict; key={key!r} cannot be selected")
        return dict(checkpoint), None
    keys = (key,) if isinstance(key, str) else tuple(key or EVAL_KEYS)
    for k in keys:
        if k in checkpoint and isinstance(checkpoint[k], Mapping):
            return dict(checkpoint[k]), k
    raise KeyError(f"none of the keys {list(keys)} holds a state dict; checkpoint keys are {sorted(checkpoint)}")


def convert_official_state_dict(
    checkpoint, key: str | Sequence[str] | None = None, verbose: bool = True
) -> dict[str, torch.Tensor]:
    """Convert an official PPMA checkpoint (classification or mmdet/mmseg) to our naming (docs/model.md §5).

    Strips ``module.`` and ``backbone.`` prefixes (keeping only ``backbone.*`` entries when an mm
    checkpoint also holds a neck and heads), renames every key (see the module docstring) and reshapes
    layer-scale ``gamma_{1,2}`` from ``[1, 1, 1, C]`` to ``[C]``. A state dict already in our naming passes
    through unchanged. Keys that match no rule are kept as they are (a strict load then reports them).

    Args:
        checkpoint: a loaded checkpoint (see :func:`select_state_dict`).
        key: which entry to use; ``None`` tries :data:`EVAL_KEYS` in order.
        verbose: log which entry was loaded and what was dropped (at WARNING level when ambiguous).

    Returns:
        A new state dict in our naming.
    """
    sd, chosen = select_state_dict(checkpoint, key)
    if verbose:
        candidates = [k for k in EVAL_KEYS if isinstance(checkpoint, Mapping) and k in checkpoint]
        msg = f"ppma: loading weights from checkpoint entry {chosen!r}" if chosen else "ppma: loading a bare state dict"
        (_logger.warning if len(candidates) > 1 else _logger.info)(
            msg + (f" (entries present: {candidates})" if len(candidates) > 1 else "")
        )
    sd = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in sd.items()}
    if any(k.startswith("backbone.") for k in sd):
        dropped = [k for k in sd if not k.startswith("backbone.")]
        sd = {k[len("backbone.") :]: v for k, v in sd.items() if k.startswith("backbone.")}
        if verbose and dropped:
            _logger.info(f"ppma: kept the {len(sd)} backbone.* entries, dropped {len(dropped)} others (neck/heads)")
    if any(k.startswith(("stem.", "stages.")) for k in sd):  # already in our naming
        return sd
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in sd.items():
        new = _rename(k, _OFFICIAL_TO_OURS)
        if new is None:
            unknown.append(k)
            out[k] = v
            continue
        if re.search(r"\.ls[12]\.gamma$", new):
            v = v.reshape(-1)
        out[new] = v
    if verbose and unknown:
        _logger.warning(f"ppma: {len(unknown)} checkpoint keys match no PPMA name, kept as is: {unknown[:8]}")
    return out


def convert_to_official_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`convert_official_state_dict`: our naming -> the official names of docs/model.md §5.1."""
    out = {}
    for k, v in state_dict.items():
        new = _rename(k, _OURS_TO_OFFICIAL)
        if new is None:
            raise KeyError(f"convert_to_official_state_dict: no official name for {k!r}")
        if re.search(r"\.gamma_[12]$", new):
            v = v.reshape(1, 1, 1, -1)
        out[new] = v
    return out


# ---------------------------------------------------------------------------------------------- reading files


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
            raise RuntimeError(
                f"read_checkpoint: {path!r} holds objects that a weights-only load does not rebuild (allowed: tensors, "
                f"plain containers, argparse.Namespace, numpy arrays, mmengine HistoryBuffer). ppma never falls back "
                f"to unrestricted unpickling; extract the state dict in a trusted environment. Details: {exc}"
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
            Face hub client and its cache, see :mod:`ppma.models.hub`); or another scheme that mmengine's
            ``CheckpointLoader`` knows (only with torch >= 2.6, whose ``torch.load`` is weights-only by default).
        map_location: as for ``torch.load``.

    Returns:
        The loaded object (a dict for every checkpoint layout of docs/model.md §5.2).
    """
    source = os.fspath(source)
    scheme = source.split("://", 1)[0] if "://" in source else ""
    if scheme in ("http", "https"):
        path = _download(source)
    elif scheme == "hf":
        from ppma.models.hub import download_hf

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

        return load_file(path, device=str(map_location))
    return _torch_load(path, map_location)


# ---------------------------------------------------------------------------------------------- loading into a model


def _matching(keys, patterns) -> list[str]:
    return [k for k in keys if any(re.match(p, k) for p in patterns)]


def load_checkpoint(
    model: torch.nn.Module,
    source: str | os.PathLike,
    key: str | Sequence[str] | None = None,
    strict: bool = True,
    map_location="cpu",
    verbose: bool = True,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
):
    """Load an official or ppma checkpoint (file, URL or ``hf://``, see :func:`read_checkpoint`) into ``model``.

    The weights are converted by :func:`convert_official_state_dict`. Missing RoPE ``angle`` buffers (a fixed
    function of the head dim) are taken from the model. A classifier ``head.fc`` of another size than the
    model's (e.g. 1000 classes into a 10-class model), or one the model does not have, is dropped and reported.

    Args:
        strict: raise ``RuntimeError`` (before anything is loaded) on any other missing key, unexpected key or
            shape mismatch, except keys matching ``allow_missing`` / ``allow_unexpected`` (regexes matched at the
            start of the key). ``strict=False`` loads what fits and only logs the rest.

    Returns:
        The ``(missing_keys, unexpected_keys)`` result of ``load_state_dict``.
    """
    checkpoint = read_checkpoint(source, map_location=map_location)
    sd = convert_official_state_dict(checkpoint, key=key, verbose=verbose)
    own = model.state_dict()
    for k, v in own.items():  # the RoPE angles are a fixed function of head_dim; tolerate checkpoints without them
        if k.endswith(".rope.angle") and k not in sd:
            sd[k] = v
    classifier = [k for k in sd if k.startswith("head.fc.") and (k not in own or own[k].shape != sd[k].shape)]
    for k in classifier:
        if verbose:
            _logger.info(f"ppma: not loading the classifier entry {k} {tuple(sd[k].shape)}: the model's "
                         f"{tuple(own[k].shape) if k in own else 'has none'}")
        del sd[k]
    mismatched = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in sd.items() if k in own and own[k].shape != v.shape}
    missing = [k for k in own if k not in sd and not (classifier and k.startswith("head.fc."))]
    unexpected = [k for k in sd if k not in own]
    if strict:
        bad_missing = sorted(set(missing) - set(_matching(missing, allow_missing)))
        bad_unexpected = sorted(set(unexpected) - set(_matching(unexpected, allow_unexpected)))
        if mismatched or bad_missing or bad_unexpected:
            raise RuntimeError(
                f"load_checkpoint: {os.fspath(source)!r} does not fit {type(model).__name__} (is it another PPMA "
                f"variant?): Missing keys {bad_missing[:10]}{' ...' if len(bad_missing) > 10 else ''} "
                f"({len(bad_missing)}); unexpected keys {bad_unexpected[:10]}"
                f"{' ...' if len(bad_unexpected) > 10 else ''} ({len(bad_unexpected)}); "
                f"shape mismatches (checkpoint, model) {dict(list(mismatched.items())[:10])} ({len(mismatched)})"
            )
    for k, (got, want) in mismatched.items():
        if verbose:
            _logger.warning(f"ppma: dropping {k}: checkpoint shape {got} != model {want}")
        del sd[k]
    result = model.load_state_dict(sd, strict=False)
    if verbose:
        _logger.info(f"ppma: loaded {len(sd)} tensors from {os.path.basename(os.fspath(source))}; "
                     f"missing {len(result.missing_keys)}, unexpected {len(result.unexpected_keys)}")
    return result


# ---------------------------------------------------------------------------------------------- mm checkpoints

_PLAIN = (str, int, float, bool, type(None))


def convert_mm_checkpoint(checkpoint: Mapping, verbose: bool = True) -> dict:
    """An official MMSegmentation 0.x / MMDetection 2.x checkpoint (docs/model.md §5.2: UPerNet ADE20K / Cityscapes
    ``iter_160000.pth``, Mask R-CNN ``epoch_12.pth`` / ``epoch_36.pth``) -> a checkpoint that ppma's
    MMSegmentation 1.x / MMDetection 3.x configs load with ``load_from``.

    - ``backbone.*`` is renamed to our naming (docs/model.md §5.1; ``outnorm{i}`` -> ``out_norms.{i}``, layer scales
      reshaped). A backbone already in our naming passes through, so converting twice changes nothing.
    - Neck and head parameters keep their names: UPerHead / FCNHead (mmseg 0.x -> 1.x) and FPN, RPNHead and
      StandardRoIHead with Shared2FCBBoxHead / FCNMaskHead (mmdet 2.x -> 3.x) did not rename any parameter; the
      1.x / 3.x model zoos serve the very 0.x / 2.x files for these models.
    - ``meta``: the class names and palette move to ``dataset_meta`` (where 1.x / 3.x read them); a few plain
      entries (epoch, iteration, versions) are kept under ``converted_from``. The optimiser state (mmcv 1.x
      layout) is dropped: ``load_from`` starts a new run or an evaluation, it does not resume.
    - Only tensors and plain Python values are written, so stock mmengine reads the file under torch >= 2.6
      (whose ``torch.load`` is weights-only by default) without any flag.

    Raises:
        ValueError: the checkpoint has no ``backbone.*`` entries, or a backbone entry matches no PPMA name.
    """
    sd, _ = select_state_dict(checkpoint, ("state_dict", "model"))
    sd = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in sd.items()}
    backbone = {k[len("backbone.") :]: v for k, v in sd.items() if k.startswith("backbone.")}
    if not backbone:
        raise ValueError(f"convert_mm_checkpoint: no backbone.* entries (keys start with "
                         f"{sorted({k.split('.')[0] for k in sd})}); not an MMSegmentation/MMDetection checkpoint")
    ours = convert_official_state_dict(backbone, verbose=False)
    unknown = [k for k in ours if not k.startswith(("stem.", "stages.", "out_norms."))]
    if unknown:
        raise ValueError(f"convert_mm_checkpoint: backbone entries that match no PPMA name: {unknown[:8]}")
    state_dict = {**{"backbone." + k: v for k, v in ours.items()},
                  **{k: v for k, v in sd.items() if not k.startswith("backbone.")}}
    meta = checkpoint.get("meta") if isinstance(checkpoint.get("meta"), Mapping) else {}
    dataset_meta = dict(meta.get("dataset_meta") or {})
    if meta.get("CLASSES") is not None:  # mmseg 0.x / mmdet 2.x
        dataset_meta.setdefault("classes", tuple(meta["CLASSES"]))
    if meta.get("PALETTE") is not None:
        dataset_meta.setdefault("palette", [list(map(int, c)) for c in meta["PALETTE"]])
    new_meta = {"converted_from": {k: v for k, v in meta.items() if isinstance(v, _PLAIN) and k != "config"}}
    if dataset_meta:
        new_meta["dataset_meta"] = dataset_meta
    if verbose:
        _logger.info(f"ppma: converted {len(ours)} backbone and {len(state_dict) - len(ours)} neck/head entries"
                     f"{'; classes ' + str(len(dataset_meta['classes'])) if 'classes' in dataset_meta else ''}")
    return {"meta": new_meta, "state_dict": state_dict}


def _is_mm_checkpoint(checkpoint) -> bool:
    sd = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
    return isinstance(sd, Mapping) and any(k.startswith(("backbone.", "module.backbone.")) for k in sd)


def main(argv: Sequence[str] | None = None) -> int:
    """``ppma-convert SRC DST``: official checkpoint -> ppma checkpoint (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="ppma-convert",
        description="Convert an official PPMA checkpoint. MMSegmentation 0.x / MMDetection 2.x checkpoints "
        "(UPerNet ADE20K / Cityscapes, Mask R-CNN COCO) become checkpoints that ppma's configs load with "
        "load_from=...; classification checkpoints (best.pth) become {'state_dict': ...} in ppma's naming "
        "(or a bare .safetensors file).",
    )
    parser.add_argument("src", help="a file, an http(s) URL, hf://<repo>/<path>, or the name of an official "
                        "checkpoint (ppma_tiny, upernet_ppma_tiny_512x512_160k_ade20k, ...; downloaded from the "
                        "Hugging Face hub into its cache)")
    parser.add_argument("dst", help="output file (.pth, or .safetensors for classification weights)")
    parser.add_argument("--key", default=None, help="classification: the entry to convert (model_ema, models, "
                        "model, state_dict); default model_ema when present (the weights the paper reports)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    src = args.src
    if "://" not in src and not os.path.exists(src):
        from ppma.models.hub import download_official, official_files

        if src not in official_files():
            parser.error(f"{src!r} is neither a file nor an official checkpoint name ({sorted(official_files())})")
        src = download_official(src)
    checkpoint = read_checkpoint(src)
    if _is_mm_checkpoint(checkpoint):
        if args.dst.endswith(".safetensors"):
            parser.error("an mm checkpoint is written as .pth (mmengine's load_from reads torch files)")
        out = convert_mm_checkpoint(checkpoint)
        kind = "mm (load_from)"
    else:
        sd = convert_official_state_dict(checkpoint, key=args.key)
        out = sd if args.dst.endswith(".safetensors") else {"state_dict": sd}
        kind = "classification"
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    if args.dst.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in out.items()}, args.dst)
    else:
        torch.save(out, args.dst)
    n = len(out["state_dict"]) if "state_dict" in out else len(out)
    print(f"ppma-convert: wrote {args.dst} ({kind} checkpoint, {n} tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
