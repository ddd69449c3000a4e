"""Official MMSegmentation 0.x / MMDetection 2.x checkpoints -> checkpoints that ppma's MMSegmentation 1.x /
MMDetection 3.x configs load with ``load_from`` (docs/training.md, "Pretrained backbones and the official
downstream checkpoints")."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ppma.checkpoint.names import is_ours, to_ours
from ppma.checkpoint.select import select_state_dict

__all__ = ["convert_mm_checkpoint", "is_mm_checkpoint"]

_logger = logging.getLogger("ppma")

_PLAIN = (str, int, float, bool, type(None))


def convert_mm_checkpoint(checkpoint: Mapping, verbose: bool = True) -> dict:
    """An official MMSegmentation 0.x / MMDetection 2.x checkpoint (UPerNet ADE20K / Cityscapes
    ``iter_160000.pth``, Mask R-CNN ``epoch_12.pth`` / ``epoch_36.pth``) -> a checkpoint that ppma's
    MMSegmentation 1.x / MMDetection 3.x configs load with ``load_from``.

    - ``backbone.*`` is renamed to our naming (:mod:`ppma.checkpoint.names`; ``outnorm{i}`` -> ``out_norms.{i}``,
      layer scales reshaped). A backbone already in our naming passes through, so converting twice changes nothing.
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
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    backbone = {k[len("backbone.") :]: v for k, v in sd.items() if k.startswith("backbone.")}
    if not backbone:
        raise ValueError(f"convert_mm_checkpoint: no backbone.* entries (keys start with "
                         f"{sorted({k.split('.')[0] for k in sd})}); not an MMSegmentation/MMDetection checkpoint")
    ours = backbone if is_ours(backbone) else to_ours(backbone)[0]
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


def is_mm_checkpoint(checkpoint) -> bool:
    """Whether ``checkpoint`` is an MMDetection / MMSegmentation one (a ``state_dict`` with ``backbone.*``)."""
    sd = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
    return isinstance(sd, Mapping) and any(k.startswith(("backbone.", "module.backbone.")) for k in sd)
