"""Model, optimiser, scheduler, loss and mixup construction from a config (docs/model.md §6.1)."""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

__all__ = ["build_model", "model_kwargs", "resolve_factory", "build_optimizer", "build_scheduler", "build_mixup_and_loss",
           "scaled_lr"]


def resolve_factory(factory: str | None):
    """``None`` -> ``ppma.create_model``; ``"package.module:callable"`` -> that callable."""
    if not factory:
        import ppma

        if not hasattr(ppma, "create_model"):
            raise ImportError("ppma.create_model is not available in this installation (ppma.models missing)")
        return ppma.create_model
    if ":" not in factory:
        raise ValueError(f"model.factory must look like 'package.module:callable', got {factory!r}")
    mod, name = factory.split(":", 1)
    return getattr(importlib.import_module(mod), name)


def model_kwargs(overrides) -> dict:
    """Model-factory keywords from config overrides: YAML gives lists, the model's config takes tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (overrides or {}).items()}


def build_model(model_cfg, num_classes: int, in_chans: int = 3) -> nn.Module:
    """Instantiate ``model_cfg.name`` with its overrides; ``in_chans`` is passed when it differs from 3
    (or when the overrides set it)."""
    overrides = model_kwargs(model_cfg.overrides)
    if in_chans != 3:
        overrides.setdefault("in_chans", in_chans)
    create = resolve_factory(model_cfg.factory)
    return create(
        model_cfg.name,
        pretrained=False,
        num_classes=num_classes,
        drop_path_rate=model_cfg.drop_path_rate,
        checkpoint_path=model_cfg.checkpoint_path,
        **overrides,
    )


def scaled_lr(optim_cfg, total_batch: int) -> float:
    """``optim.lr`` if set, else the linear scaling rule ``base_lr * total_batch / base_batch``."""
    if optim_cfg.lr is not None:
        return float(optim_cfg.lr)
    return float(optim_cfg.base_lr) * total_batch / float(optim_cfg.base_batch)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Parameter groups of the official recipe (docs/model.md §6.1, timm 0.5.4 ``add_weight_decay``): no weight decay
    on 1-D parameters (norms, ``dt_bias``, ``A_log``), biases and ``model.no_weight_decay()``; decay on everything
    else. Layer-scale ``gamma`` is 1-D here but ``[1, 1, 1, C]`` in the official model, where it is decayed: so
    it is decayed here too."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        layer_scale = name.endswith((".ls1.gamma", ".ls2.gamma"))
        if (p.ndim <= 1 or name.endswith(".bias") or name in skip) and not layer_scale:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


# Devices on which torch's Adam / AdamW have a fused step.
_FUSED_ADAM_DEVICES = ("cpu", "cuda")


def fused_adam_available(model: nn.Module) -> bool:
    """Whether torch's fused Adam / AdamW step takes every parameter of ``model``: floating tensors on a device that
    has it (``_FUSED_ADAM_DEVICES``)."""
    return all(p.is_floating_point() and p.device.type in _FUSED_ADAM_DEVICES for p in model.parameters())


def build_optimizer(model: nn.Module, optim_cfg, lr: float) -> torch.optim.Optimizer:
    """timm ``create_optimizer_v2`` over the parameter groups of ``weight_decay_groups``; Adam and AdamW take torch's
    fused step (``fused=True``) where ``optim_cfg.fused`` is True, or None and every parameter is a floating tensor on
    a device that has it (``_FUSED_ADAM_DEVICES``)."""
    from timm.optim import create_optimizer_v2

    kwargs = {}
    opt = optim_cfg.opt.lower()
    if opt in ("adamw", "adam", "lamb", "nadamw"):
        kwargs = {"eps": float(optim_cfg.eps), "betas": tuple(optim_cfg.betas)}
    fused = optim_cfg.fused
    if fused and opt not in ("adamw", "adam"):
        raise ValueError(f"optim.fused=True needs optim.opt adamw or adam, got {optim_cfg.opt!r}")
    if fused is None and opt in ("adamw", "adam"):
        fused = fused_adam_available(model)
    if fused:
        kwargs["fused"] = True
    wd = float(optim_cfg.weight_decay)
    return create_optimizer_v2(weight_decay_groups(model, wd), opt=optim_cfg.opt, lr=lr, weight_decay=wd, **kwargs)


def build_scheduler(optimizer, sched_cfg, steps_per_epoch: int):
    """timm ``CosineLRScheduler``: cosine from the peak lr to ``min_lr`` over ``epochs`` after a linear warmup
    of ``warmup_epochs`` from ``warmup_lr``; in epochs (stepped at epoch ends) or in iterations."""
    from timm.scheduler import CosineLRScheduler

    s = sched_cfg
    if s.per_iteration:
        return CosineLRScheduler(
            optimizer, t_initial=max(1, s.epochs * steps_per_epoch), lr_min=float(s.min_lr),
            warmup_t=int(round(s.warmup_epochs * steps_per_epoch)), warmup_lr_init=float(s.warmup_lr),
            t_in_epochs=False,
        )
    return CosineLRScheduler(
        optimizer, t_initial=s.epochs, lr_min=float(s.min_lr), warmup_t=int(s.warmup_epochs),
        warmup_lr_init=float(s.warmup_lr), t_in_epochs=True,
    )


def build_mixup_and_loss(aug_cfg, num_classes: int):
    """``(mixup_fn or None, train criterion)``: timm Mixup/CutMix with label smoothing folded into soft
    targets and SoftTargetCrossEntropy; else label-smoothing cross-entropy; else plain cross-entropy."""
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    a = aug_cfg
    if (a.mixup or 0) > 0 or (a.cutmix or 0) > 0:
        mixup = Mixup(
            mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, prob=a.mixup_prob, switch_prob=a.mixup_switch_prob,
            mode=a.mixup_mode, label_smoothing=a.smoothing, num_classes=num_classes,
        )
        return mixup, SoftTargetCrossEntropy()
    if (a.smoothing or 0) > 0:
        return None, LabelSmoothingCrossEntropy(smoothing=a.smoothing)
    return None, nn.CrossEntropyLoss()
