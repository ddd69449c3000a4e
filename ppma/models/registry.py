"""``create_model``: build a PPMA variant by name, optionally with weights (docs/model.md §4.1, §5)."""

from __future__ import annotations

import dataclasses
import os

from ppma.models.ppma import MODEL_CONFIGS, PPMA, apply_overrides

__all__ = ["create_model", "list_models"]

_OVERRIDES = {f.name for f in dataclasses.fields(MODEL_CONFIGS["ppma_tiny"])} - {"num_classes", "drop_path_rate"}


def list_models() -> list[str]:
    """Names of the image models accepted by :func:`create_model` (the video models, ``ppma_video_tiny``, are
    listed by ``ppma.models.video.VIDEO_MODEL_CONFIGS``)."""
    return sorted(MODEL_CONFIGS)


def create_model(
    name: str,
    pretrained: bool = False,
    num_classes: int = 1000,
    drop_path_rate: float | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    checkpoint_key: str | None = None,
    revision: str | None = None,
    **overrides,
) -> PPMA:
    """Build ``ppma_tiny``, ``ppma_small`` or ``ppma_base``.

    Args:
        name: model name (see :func:`list_models`).
        pretrained: load the official ImageNet-1K weights: from ``checkpoint_path`` when given, otherwise from
            the Hugging Face hub (``ZhongchenZhao/PPMA``, :mod:`ppma.checkpoint.hub`), downloaded once into the hub
            cache; ``HF_HUB_OFFLINE=1`` reads only that cache, ``HF_ENDPOINT`` selects a mirror.
        num_classes: classifier outputs; 0 for none. A 1000-class checkpoint head is dropped when it differs.
        drop_path_rate: stochastic depth; ``None`` keeps the variant default (0.1 / 0.15 / 0.4).
        checkpoint_path: an official or ppma checkpoint: a ``.pth``/``.safetensors`` file, a URL or
            ``hf://<repo>/<path>`` (read by :func:`ppma.checkpoint.read_checkpoint`); loading it implies
            ``pretrained``.
        checkpoint_key: entry of the checkpoint to load (default: ``model_ema`` if present: ``best.pth`` is
            saved when the EMA accuracy peaks and the paper reports EMA accuracy, docs/model.md §5.2).
        revision: branch, tag or commit of the hub repository (default ``main``).
        **overrides: any :class:`~ppma.models.PPMAConfig` field: ``embed_dims``, ``depths``, ``num_heads``,
            ``mlp_ratios``, ``mixer`` (per stage, or one string: ``"criss_cross"``, ``"full"``, ``"linear"``,
            ``"padre"``; docs/ops.md, "Glossary"), ``layerscale`` (4 bools), ``mask``, ``layer_init_values``,
            ``in_chans``, ``head_hidden_dim``, ``drop_rate``. (Fused kernels or the reference: that is ``ppma.ops.set_impl`` / ``ppma.ops.use_impl``, for every model at once.)
    """
    from ppma.models.video import VIDEO_MODEL_CONFIGS, create_video_model

    if name in VIDEO_MODEL_CONFIGS:  # the 3-D video backbones (ppma.models.video)
        return create_video_model(name, pretrained, num_classes=num_classes, drop_path_rate=drop_path_rate,
                                  checkpoint_path=checkpoint_path, **overrides)
    if name not in MODEL_CONFIGS:
        raise ValueError(f"create_model: unknown model {name!r}; available: {list_models()}")
    unknown = set(overrides) - _OVERRIDES
    if unknown:
        hint = "; choose fused or reference ops with ppma.ops.set_impl / use_impl" if "impl" in unknown else ""
        raise TypeError(f"create_model: unknown arguments {sorted(unknown)}; accepted: {sorted(_OVERRIDES)}{hint}")
    cfg = apply_overrides(MODEL_CONFIGS[name], dict(overrides, num_classes=num_classes), "create_model")
    if drop_path_rate is not None:
        cfg = dataclasses.replace(cfg, drop_path_rate=drop_path_rate)
    if pretrained and checkpoint_path is None:  # before building: a missing file fails fast
        from ppma.checkpoint.hub import download_official

        checkpoint_path = download_official(name, revision=revision)
    checkpoint = None
    if checkpoint_path is not None:  # read before building: a damaged or refused file fails fast
        from ppma.checkpoint import load_weights, read_checkpoint

        checkpoint = read_checkpoint(checkpoint_path)
    model = PPMA(cfg)
    if checkpoint is not None:
        load_weights(model, checkpoint, key=checkpoint_key, strict=True, name=repr(os.fspath(checkpoint_path)))
    return model
