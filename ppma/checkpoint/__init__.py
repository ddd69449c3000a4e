"""Checkpoints: one reader, one weight selection, one name table, one mm conversion.

- :mod:`ppma.checkpoint.io`: :func:`read_checkpoint`, the only way ppma reads a checkpoint (files, URLs,
  ``hf://``): a weights-only ``torch.load`` with a short allowlist of harmless types; never unrestricted
  unpickling.
- :mod:`ppma.checkpoint.select`: which entry holds the weights (:data:`EVAL_KEYS`, :data:`DOWNSTREAM_KEYS`) and
  the ``module.`` / ``backbone.`` prefixes.
- :mod:`ppma.checkpoint.names`: the table of official and our parameter names, both directions.
- :mod:`ppma.checkpoint.load`: a checkpoint into a model, strict by default, naming what does not fit.
- :mod:`ppma.checkpoint.mm`: MMSegmentation 0.x / MMDetection 2.x checkpoints -> our 1.x / 3.x configs.
- :mod:`ppma.checkpoint.hub`: the official files on the Hugging Face hub.
- :mod:`ppma.checkpoint.command`: ``ppma-convert``.

Every entry point goes through this package: ``ppma.create_model(checkpoint_path=..., pretrained=True)``,
``timm.create_model("ppma_tiny", pretrained=True)``, ``ppma-eval``, ``ppma-train`` (``model.checkpoint_path`` and
``--resume``), ``ppma-convert``, the mm backbone's ``init_cfg=dict(type="Pretrained", ...)`` and, for local
files, MMEngine's own loader inside ``ppma-mm`` (:func:`route_mmengine_local_files`).
"""

from ppma.checkpoint.io import (
    allow_checkpoint_globals,
    checkpoint_safe_globals,
    read_checkpoint,
    route_mmengine_local_files,
)
from ppma.checkpoint.load import convert_official_state_dict, load_checkpoint, load_weights
from ppma.checkpoint.mm import convert_mm_checkpoint, is_mm_checkpoint
from ppma.checkpoint.names import NAME_TABLE, official_to_ours, ours_to_official, to_official, to_ours
from ppma.checkpoint.select import DOWNSTREAM_KEYS, EVAL_KEYS, select_state_dict, select_weights

__all__ = [
    "read_checkpoint",
    "checkpoint_safe_globals",
    "allow_checkpoint_globals",
    "route_mmengine_local_files",
    "select_state_dict",
    "select_weights",
    "EVAL_KEYS",
    "DOWNSTREAM_KEYS",
    "NAME_TABLE",
    "official_to_ours",
    "ours_to_official",
    "to_ours",
    "to_official",
    "convert_official_state_dict",
    "convert_to_official_state_dict",
    "load_checkpoint",
    "load_weights",
    "convert_mm_checkpoint",
    "is_mm_checkpoint",
]


def convert_to_official_state_dict(state_dict):
    """Our naming -> the official names (:func:`ppma.checkpoint.names.to_official`); ``KeyError`` on a key
    that has no official name."""
    return to_official(state_dict)
