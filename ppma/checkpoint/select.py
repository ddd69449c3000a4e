"""Which weights of a checkpoint to load: the entry (``model_ema``, ``model``, ``models``, ``state_dict``) and
the wrapper prefixes (``module.`` of DDP, ``backbone.`` of MMDetection / MMSegmentation)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Sequence

import torch

__all__ = ["EVAL_KEYS", "DOWNSTREAM_KEYS", "select_state_dict", "select_weights"]

_logger = logging.getLogger("ppma")

#: Entries tried in order for ImageNet evaluation: the official ``best.pth`` is written when the EMA accuracy
#: peaks, and the paper reports EMA accuracy.
EVAL_KEYS = ("model_ema", "model", "models", "state_dict")
#: Entries tried in order to initialise a downstream backbone, as the official backbones do (``key='model'``).
DOWNSTREAM_KEYS = ("model", "models", "model_ema", "state_dict")


def _is_state_dict(obj) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, torch.Tensor) for v in obj.values())


def select_state_dict(checkpoint, key: str | Sequence[str] | None = None) -> tuple[dict, str | None]:
    """The entry of ``checkpoint`` that holds the weights, without touching its keys.

    Args:
        checkpoint: a bare state dict, or a dict holding one under ``model_ema``, ``model``, ``models`` or
            ``state_dict`` (``None`` entries, e.g. ``model_ema`` of a run without EMA, are skipped).
        key: the entry to use, or a sequence of entries tried in order; ``None`` means :data:`EVAL_KEYS`.

    Returns:
        ``(state_dict, chosen_key)``; ``chosen_key`` is ``None`` for a bare state dict.

    Raises:
        TypeError: ``checkpoint`` is not a dict.
        KeyError: no entry of ``key`` holds a dict (the message lists the checkpoint's entries).
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"a checkpoint must be a dict, got {type(checkpoint).__name__}")
    if _is_state_dict(checkpoint):
        if isinstance(key, str):
            raise KeyError(f"the checkpoint is a bare state dict; no weights under key {key!r} to select")
        return dict(checkpoint), None
    keys = (key,) if isinstance(key, str) else tuple(key or EVAL_KEYS)
    for k in keys:
        if isinstance(checkpoint.get(k), Mapping):
            return dict(checkpoint[k]), k
    holding = [k for k, v in checkpoint.items() if isinstance(v, Mapping)]
    raise KeyError(f"no weights under key {' / '.join(map(repr, keys))}; entries holding a dict: {holding}; "
                   f"all entries: {sorted(map(str, checkpoint))}")


def select_weights(checkpoint, key: str | Sequence[str] | None = None, verbose: bool = True
                   ) -> tuple[dict[str, torch.Tensor], str | None]:
    """The weights to load from ``checkpoint``: :func:`select_state_dict`, then without the ``module.`` prefix
    and, when an MMDetection / MMSegmentation checkpoint holds a ``backbone.*`` next to necks and heads, only the
    backbone entries without their prefix. Names are not translated (see :mod:`ppma.checkpoint.names`).

    Args:
        checkpoint: a loaded checkpoint.
        key: as for :func:`select_state_dict`.
        verbose: log which entry is used (a warning when several candidates were present) and what was dropped.

    Returns:
        ``(state_dict, chosen_key)``.
    """
    sd, chosen = select_state_dict(checkpoint, key)
    if verbose:
        present = [k for k in EVAL_KEYS if isinstance(checkpoint.get(k), Mapping)] if chosen else []
        msg = f"ppma: loading weights from checkpoint entry {chosen!r}" if chosen else "ppma: loading a bare state dict"
        (_logger.warning if len(present) > 1 else _logger.info)(
            msg + (f" (entries present: {present})" if len(present) > 1 else ""))
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    if any(k.startswith("backbone.") for k in sd):
        dropped = [k for k in sd if not k.startswith("backbone.")]
        sd = {k.removeprefix("backbone."): v for k, v in sd.items() if k.startswith("backbone.")}
        if verbose and dropped:
            _logger.info(f"ppma: kept the {len(sd)} backbone.* entries, dropped {len(dropped)} others (neck/heads)")
    return sd, chosen
