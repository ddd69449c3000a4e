"""Loading a checkpoint into a model: read (:mod:`ppma.checkpoint.io`), pick the weights
(:mod:`ppma.checkpoint.select`), translate official names (:mod:`ppma.checkpoint.names`), check that they fit."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Sequence

import torch

from ppma.checkpoint.io import read_checkpoint
from ppma.checkpoint.names import is_ours, to_ours
from ppma.checkpoint.select import select_weights

__all__ = ["convert_official_state_dict", "load_checkpoint", "load_weights"]

_logger = logging.getLogger("ppma")


def convert_official_state_dict(
    checkpoint, key: str | Sequence[str] | None = None, verbose: bool = True
) -> dict[str, torch.Tensor]:
    """The weights of any checkpoint ppma reads (official classification ``best.pth``, official mm checkpoint,
    ppma-train or ppma-convert output, bare state dict) in our naming.

    :func:`~ppma.checkpoint.select.select_weights` picks the entry and strips ``module.`` / ``backbone.``; official
    names are translated by the table of :mod:`ppma.checkpoint.names` (layer scales reshaped); a state dict
    already in our naming passes through. Keys that match no name are kept as they are and reported (a strict
    load then names them).

    Args:
        checkpoint: a loaded checkpoint (see :func:`~ppma.checkpoint.read_checkpoint`).
        key: which entry to use; ``None`` tries :data:`~ppma.checkpoint.EVAL_KEYS` (``model_ema`` first).
        verbose: log which entry was loaded and what was dropped or not recognised.

    Returns:
        A new state dict in our naming.
    """
    sd, _ = select_weights(checkpoint, key, verbose=verbose)
    if is_ours(sd):
        return sd
    out, unknown = to_ours(sd)
    if verbose and unknown:
        _logger.warning(f"ppma: {len(unknown)} checkpoint keys match no PPMA name, kept as is: {unknown[:8]}")
    return out


def _matching(keys, patterns) -> list[str]:
    return [k for k in keys if any(re.match(p, k) for p in patterns)]


def _short(keys: list, n: int = 10) -> str:
    return f"{keys[:n]}{' ...' if len(keys) > n else ''} ({len(keys)})"


def load_weights(
    model: torch.nn.Module,
    checkpoint: Mapping,
    key: str | Sequence[str] | None = None,
    strict: bool = True,
    verbose: bool = True,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    drop_classifier: bool = True,
    name: str = "the checkpoint",
):
    """Load an already-read ``checkpoint`` into ``model`` (see :func:`load_checkpoint`, which reads a file first).

    Args:
        drop_classifier: a classifier ``head.fc`` of another size than the model's, or one the model lacks, is
            dropped and reported (e.g. 1000 ImageNet classes into a 10-class model). ``False`` (evaluation,
            where a random classifier would be wrong) treats it as any other mismatch.
        name: how errors and logs name the checkpoint (its path).

    The other arguments and the result are those of :func:`load_checkpoint`.
    """
    sd = convert_official_state_dict(checkpoint, key=key, verbose=verbose)
    own = model.state_dict()
    for k, v in own.items():  # the RoPE angles are a fixed function of head_dim; tolerate checkpoints without them
        if k.endswith(".rope.angle") and k not in sd:
            sd[k] = v
    classifier = []
    if drop_classifier:
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
                f"load_checkpoint: {name} does not fit {type(model).__name__} (is it another PPMA variant, or another "
                f"number of classes?): Missing keys {_short(bad_missing)}; unexpected keys {_short(bad_unexpected)}; "
                f"shape mismatches (checkpoint, model) {dict(list(mismatched.items())[:10])} ({len(mismatched)})"
            )
    for k, (got, want) in mismatched.items():
        if verbose:
            _logger.warning(f"ppma: dropping {k}: checkpoint shape {got} != model {want}")
        del sd[k]
    result = model.load_state_dict(sd, strict=False)
    if verbose:
        _logger.info(f"ppma: loaded {len(sd)} tensors from {name}; "
                     f"missing {len(result.missing_keys)}, unexpected {len(result.unexpected_keys)}")
    return result


def load_checkpoint(
    model: torch.nn.Module,
    source: str | os.PathLike,
    key: str | Sequence[str] | None = None,
    strict: bool = True,
    map_location="cpu",
    verbose: bool = True,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    drop_classifier: bool = True,
):
    """Load an official or ppma checkpoint (file, URL or ``hf://``, read by
    :func:`~ppma.checkpoint.read_checkpoint`) into ``model``.

    The weights are converted by :func:`convert_official_state_dict`. Missing RoPE ``angle`` buffers (a fixed
    function of the head dim) are taken from the model. A classifier ``head.fc`` of another size than the
    model's, or one the model does not have, is dropped and reported (unless ``drop_classifier=False``).

    Args:
        key: the checkpoint entry, or entries tried in order; default ``model_ema``, ``model``, ``models``,
            ``state_dict``.
        strict: raise ``RuntimeError`` (before anything is loaded) on any other missing key, unexpected key or
            shape mismatch, naming them, except keys matching ``allow_missing`` / ``allow_unexpected`` (regexes
            matched at the start of the key). ``strict=False`` loads what fits and only logs the rest.

    Returns:
        The ``(missing_keys, unexpected_keys)`` result of ``load_state_dict``.
    """
    checkpoint = read_checkpoint(source, map_location=map_location)
    return load_weights(model, checkpoint, key=key, strict=strict, verbose=verbose, allow_missing=allow_missing,
                        allow_unexpected=allow_unexpected, drop_classifier=drop_classifier,
                        name=repr(os.fspath(source)))
