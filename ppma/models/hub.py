"""The official PPMA checkpoints on the Hugging Face hub (docs/model.md §5.2), fetched through the ``huggingface_hub`` client.

Downloads go through ``huggingface_hub.hf_hub_download`` and therefore its cache and settings: files land once in
``$HF_HUB_CACHE`` (default ``~/.cache/huggingface/hub``, or ``$HF_HOME/hub``) as
``models--ZhongchenZhao--PPMA/snapshots/<commit>/checkpoints/...``; ``HF_HUB_OFFLINE=1`` reads that cache without
any request (the file must be there, resolved through ``refs/main`` or the ``revision`` commit); ``HF_ENDPOINT``
points at a mirror; ``HF_TOKEN`` authenticates. ``timm.create_model("ppma_tiny", pretrained=True)`` reaches the same
files through timm's own hub support (``hf_hub_id`` / ``hf_hub_filename`` in the pretrained configs of
:mod:`ppma.models.timm`), so both share one cache.
"""

from __future__ import annotations

import os

__all__ = ["HF_REPO_ID", "CLASSIFICATION_FILES", "DOWNSTREAM_FILES", "official_files", "download_official",
           "download_hf"]

#: The official release (docs/model.md §5.2).
HF_REPO_ID = "ZhongchenZhao/PPMA"

#: ImageNet-1K classification checkpoints (``best.pth``: ``models``, ``model_ema``, optimiser state, ``args``, ...).
CLASSIFICATION_FILES = {
    "ppma_tiny": "checkpoints/classification/PPMA_T_202502251000/best.pth",
    "ppma_small": "checkpoints/classification/PPMA_S_202504021000/best.pth",
    "ppma_base": "checkpoints/classification/PPMA_B_202504101400/best.pth",
}

_ARCHS = ("tiny", "small", "base")
#: MMSegmentation 0.x / MMDetection 2.x checkpoints, by the name of the ppma config that loads them after
#: ``ppma-convert`` (``configs/segmentation/<name>.py``, ``configs/detection/<name>.py``).
DOWNSTREAM_FILES = {
    **{f"upernet_ppma_{a}_512x512_160k_ade20k":
       f"checkpoints/segmentation/upernet_ppma_{a}_512x512_160k_ade20k_ss/iter_160000.pth" for a in _ARCHS},
    **{f"upernet_ppma_{a}_1024x1024_160k_cityscapes":
       f"checkpoints/segmentation/upernet_ppma_{a}_1024x1024_160k_cityscapes_ss/iter_160000.pth" for a in _ARCHS},
    **{f"mask_rcnn_ppma_{a}_fpn_1x_coco": f"checkpoints/detection/mask_rcnn_ppma_{a}_fpn_1x_coco/epoch_12.pth"
       for a in _ARCHS},
    "mask_rcnn_ppma_base_fpn_3x_coco": "checkpoints/detection/mask_rcnn_ppma_base_fpn_3x_coco/epoch_36.pth",
}


def official_files() -> dict[str, str]:
    """Every official checkpoint by name: ``ppma_tiny`` ... and the downstream config names."""
    return {**CLASSIFICATION_FILES, **DOWNSTREAM_FILES}


def _hf_hub_download(repo_id: str, filename: str, revision: str | None, cache_dir: str | os.PathLike | None) -> str:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:
        raise ImportError(
            "downloading the official PPMA weights needs huggingface_hub: pip install huggingface_hub "
            "(or pass a local checkpoint file)"
        ) from exc
    try:
        return hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir)
    except FileNotFoundError as exc:  # huggingface_hub's LocalEntryNotFoundError (offline or unreachable) and kin
        from huggingface_hub import constants

        raise FileNotFoundError(
            f"{repo_id}/{filename} (revision {revision or 'main'}) is neither reachable nor in the hub cache "
            f"{cache_dir or constants.HF_HUB_CACHE} (HF_HUB_OFFLINE={int(constants.HF_HUB_OFFLINE)}); download it "
            f"where the hub is reachable, point HF_ENDPOINT at a mirror, or pass a local file: {exc}"
        ) from exc


def download_official(
    name: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> str:
    """Path of the official checkpoint ``name`` in the hub cache, downloaded on first use (see the module docstring
    for offline use, mirrors and the cache location).

    Args:
        name: ``ppma_tiny``, ``ppma_small``, ``ppma_base``, or a downstream config name of :data:`DOWNSTREAM_FILES`.
        revision: a branch, tag or commit of ``ZhongchenZhao/PPMA`` (default ``main``).
        cache_dir: overrides ``$HF_HUB_CACHE``.
    """
    files = official_files()
    if name not in files:
        raise ValueError(f"download_official: unknown checkpoint {name!r}; available: {sorted(files)}")
    return _hf_hub_download(HF_REPO_ID, files[name], revision, cache_dir)


def download_hf(uri: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Path of ``hf://<owner>/<repo>/<path in the repo>[@revision]`` in the hub cache, downloaded on first use."""
    if not uri.startswith("hf://"):
        raise ValueError(f"download_hf: expected hf://<owner>/<repo>/<path>[@revision], got {uri!r}")
    rest, _, revision = uri[len("hf://"):].partition("@")
    parts = rest.split("/", 2)
    if len(parts) < 3 or not all(parts):
        raise ValueError(f"download_hf: expected hf://<owner>/<repo>/<path>[@revision], got {uri!r}")
    return _hf_hub_download(f"{parts[0]}/{parts[1]}", parts[2], revision or None, cache_dir)
