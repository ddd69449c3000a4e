"""``train(cfg)``: image-classification training (docs/model.md §6.1), in named steps.

:func:`train` reads as the recipe: :func:`setup` (threads, device, process group, output folder, seeds) ->
:func:`build_loaders` (datasets, sampler, loader) -> :func:`build_training` (model, EMA, DDP, optimiser,
scheduler, loss) -> :func:`resume` (a checkpoint's state) -> for each epoch, :func:`run_epoch` (train, step
the schedule, evaluate) and :func:`save_checkpoints` -> :func:`finish`. Each step takes the config and what
the earlier steps built.

Writes ``<output>/config.yaml``, ``<output>/metrics.jsonl`` (one JSON object per epoch),
``<output>/checkpoint.pth`` (latest, for ``train.resume``) and ``<output>/best.pth``.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ppma.train import distributed as D
from ppma.train._common import amp_dtype as resolve_amp_dtype
from ppma.train._common import log, resolve_device, seed_everything
from ppma.train.checkpoint import get_rng_state, load_training_state, save_checkpoint, set_rng_state
from ppma.train.config import TrainConfig

__all__ = ["train", "setup", "build_loaders", "build_training", "resume", "run_epoch", "save_checkpoints", "finish",
           "Runtime", "Loaders", "Training", "Progress"]


@dataclass
class Runtime:
    """Where the run executes (from :func:`setup`)."""

    device: torch.device
    amp_dtype: torch.dtype | None
    distributed: bool
    rank: int
    world: int
    out_dir: str
    start_time: float  # time.perf_counter() at the start, for wall_time


@dataclass
class Loaders:
    """The data (from :func:`build_loaders`); ``steps_per_epoch`` honours ``train.max_steps_per_epoch``."""

    train_set: torch.utils.data.Dataset
    val_set: torch.utils.data.Dataset
    batch_transform: nn.Module | None  # applied to each training batch on the device (digits' affine)
    sampler: torch.utils.data.Sampler
    loader: torch.utils.data.DataLoader
    generator: torch.Generator  # the loader's, reseeded every epoch
    steps_per_epoch: int
    num_classes: int
    in_chans: int


@dataclass
class Training:
    """What the optimisation updates (from :func:`build_training`)."""

    model: nn.Module  # what the steps call: DDP- and/or torch.compile-wrapped
    module: nn.Module  # the bare model (saved, evaluated)
    ema: nn.Module | None  # timm ModelEmaV3
    optimizer: torch.optim.Optimizer
    scheduler: object  # timm CosineLRScheduler
    scaler: torch.amp.GradScaler | None
    mixup_fn: object | None
    criterion: nn.Module


@dataclass
class Progress:
    """Where the run stands: set by :func:`resume`, advanced by :func:`run_epoch`."""

    start_epoch: int = 0
    global_step: int = 0
    best: dict = field(default_factory=lambda: {"acc1": -1.0, "ema_acc1": -1.0, "epoch": -1})
    rng: dict | None = None  # this process's RNG states from the checkpoint, restored before the first epoch


# ----------------------------------------------------------------------------------------------- steps


def setup(cfg: TrainConfig) -> Runtime:
    """CPU threads, device, process group (``torchrun``), autocast dtype, output folder with ``config.yaml``,
    determinism flags and the global seeds (``train.seed + rank``)."""
    from ppma._compat import ensure_torchvision

    ensure_torchvision()  # before the steps import timm, which imports torchvision
    start = time.perf_counter()
    if cfg.train.num_threads:
        torch.set_num_threads(int(cfg.train.num_threads))
    device = resolve_device(cfg.train.device)
    distributed = D.init_distributed(device)
    rt = Runtime(device=device, amp_dtype=resolve_amp_dtype(cfg.train.amp, device), distributed=distributed,
                 rank=D.rank(), world=D.world_size(), out_dir=cfg.train.output, start_time=start)
    if D.is_main():
        os.makedirs(rt.out_dir, exist_ok=True)
        with open(os.path.join(rt.out_dir, "config.yaml"), "w") as f:
            f.write(cfg.to_yaml())
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    seed_everything(cfg.train.seed + rt.rank)
    return rt


def build_loaders(cfg: TrainConfig, rt: Runtime) -> Loaders:
    """Datasets (``data.dataset``), the distributed sampler (timm's ``RepeatAugSampler`` for repeated
    augmentation) and the training loader, whose generator :func:`run_epoch` reseeds every epoch."""
    from ppma.train.data import build_datasets

    train_set, val_set, batch_transform = build_datasets(cfg)
    num_classes = len(getattr(train_set, "classes", [])) or cfg.data.num_classes
    if cfg.data.dataset == "synthetic":
        num_classes = cfg.data.num_classes
    in_chans = train_set[0][0].shape[0]
    if cfg.data.repeated_aug and cfg.data.repeated_aug > 1:
        from timm.data.distributed_sampler import RepeatAugSampler

        sampler = RepeatAugSampler(train_set, num_replicas=rt.world, rank=rt.rank, shuffle=True,
                                   num_repeats=cfg.data.repeated_aug, selected_round=cfg.data.repeated_aug_round)
    else:
        sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=rt.world, rank=rt.rank, shuffle=True,
                                                      seed=cfg.train.seed, drop_last=True)
    generator = torch.Generator()
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=cfg.data.batch_size, sampler=sampler, num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory and rt.device.type == "cuda", drop_last=True, generator=generator,
        persistent_workers=False,
    )
    if len(loader) == 0:
        raise ValueError(
            f"the training loader is empty: {len(sampler)} samples per process for batch size {cfg.data.batch_size}"
            " (with repeated augmentation the epoch is rounded down to data.repeated_aug_round)"
        )
    steps = len(loader) if cfg.train.max_steps_per_epoch is None else min(len(loader), cfg.train.max_steps_per_epoch)
    return Loaders(train_set=train_set, val_set=val_set, batch_transform=batch_transform, sampler=sampler,
                   loader=loader, generator=generator, steps_per_epoch=steps, num_classes=num_classes,
                   in_chans=in_chans)


def build_training(cfg: TrainConfig, rt: Runtime, data: Loaders) -> Training:
    """The model (channels-last, SyncBatchNorm, EMA, DDP, ``torch.compile`` as configured), the AdamW
    optimiser at the linearly scaled lr, the cosine schedule, the fp16 grad scaler, Mixup and the loss."""
    from timm.utils import ModelEmaV3

    from ppma.train.build import build_mixup_and_loss, build_model, build_optimizer, build_scheduler, scaled_lr

    module = build_model(cfg.model, data.num_classes, data.in_chans).to(rt.device)
    if cfg.train.channels_last:
        module = module.to(memory_format=torch.channels_last)
    if rt.distributed and rt.device.type == "cuda" and cfg.train.sync_bn:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    n_params = sum(p.numel() for p in module.parameters())
    custom = " (with overrides)" if cfg.model.overrides else ""
    log(f"model {cfg.model.name}{custom}: {n_params / 1e6:.3f} M parameters; {data.num_classes} classes; "
        f"{len(data.train_set)} train / {len(data.val_set)} val images; device {rt.device}, world {rt.world}, "
        f"amp {rt.amp_dtype}" + (f", {torch.get_num_threads()} CPU threads" if rt.device.type == "cpu" else ""))
    ema = ModelEmaV3(module, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) if cfg.ema.enabled else None
    model = module
    if rt.distributed:
        model = nn.parallel.DistributedDataParallel(module, device_ids=[rt.device.index] if rt.device.type == "cuda"
                                                    else None)
    if cfg.train.compile:
        if rt.device.type == "cpu":
            # ppma's CPU recipe (docs/compile.md): static shapes, Inductor's layout optimization off (it transposes
            # the channels-last maps around ppma's ops); DDP's graph splits need graph breaks
            from ppma.compile import compile_model

            model = compile_model(model, inference=False, fullgraph=not rt.distributed)
        else:
            model = torch.compile(model)

    total_batch = cfg.data.batch_size * rt.world
    lr = scaled_lr(cfg.optim, total_batch)
    optimizer = build_optimizer(module, cfg.optim, lr)
    scheduler = build_scheduler(optimizer, cfg.sched, data.steps_per_epoch)
    scaler = torch.amp.GradScaler(rt.device.type) if rt.amp_dtype == torch.float16 else None
    mixup_fn, criterion = build_mixup_and_loss(cfg.aug, data.num_classes)
    log(f"lr {lr:.3g} (total batch {total_batch}), {data.steps_per_epoch} steps/epoch, {cfg.sched.epochs} epochs")
    return Training(model=model, module=module, ema=ema, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                    mixup_fn=mixup_fn, criterion=criterion)


def resume(cfg: TrainConfig, rt: Runtime, parts: Training) -> Progress:
    """Load ``train.resume`` (a path, or ``"auto"``: ``<output>/checkpoint.pth`` when it exists) into
    ``parts``; returns where to continue. Also starts ``metrics.jsonl`` afresh, keeping only the epochs
    before the resumed one (the log may be ahead of the checkpoint when a run stopped between the two)."""
    progress = Progress()
    path = cfg.train.resume
    if path == "auto":
        path = os.path.join(rt.out_dir, "checkpoint.pth")
        path = path if os.path.isfile(path) else None
    if path:
        ckpt = load_training_state(path, map_location="cpu")
        parts.module.load_state_dict(ckpt["model"])
        if parts.ema is not None:
            if ckpt.get("model_ema") is None:
                raise ValueError(f"{path}: EMA is enabled but the checkpoint has no model_ema")
            parts.ema.module.load_state_dict(ckpt["model_ema"])
        parts.optimizer.load_state_dict(ckpt["optimizer"])
        parts.scheduler.load_state_dict(ckpt["scheduler"])
        if parts.scaler is not None and ckpt.get("scaler") is not None:
            parts.scaler.load_state_dict(ckpt["scaler"])
        per_rank = ckpt["rng"]
        progress = Progress(start_epoch=ckpt["epoch"] + 1, global_step=ckpt["global_step"], best=ckpt["best"],
                            rng=per_rank[rt.rank] if len(per_rank) == rt.world else None)
        log(f"resumed from {path} at epoch {progress.start_epoch}" + (
            "" if progress.rng is not None else f" (RNG states saved by {len(per_rank)} processes, not restored)"))
    metrics_path = os.path.join(rt.out_dir, "metrics.jsonl")
    if D.is_main() and os.path.exists(metrics_path):
        with open(metrics_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["epoch"] < progress.start_epoch]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    return progress


def run_epoch(cfg: TrainConfig, rt: Runtime, data: Loaders, parts: Training, progress: Progress,
              epoch: int) -> tuple[dict, bool]:
    """Train one epoch, step the epoch-wise schedule, evaluate the model (and its EMA) when due and update
    ``progress``; returns the epoch's ``metrics.jsonl`` record and whether it improved on the best accuracy
    (``best.pth`` is due)."""
    from ppma.train.engine import train_one_epoch

    data.sampler.set_epoch(epoch)
    data.generator.manual_seed(cfg.train.seed * 100003 + epoch * 1009 + rt.rank)
    stats, progress.global_step = train_one_epoch(
        parts.model, data.loader, parts.optimizer, parts.criterion, rt.device, epoch, amp_dtype=rt.amp_dtype,
        scaler=parts.scaler, ema=parts.ema, mixup_fn=parts.mixup_fn, batch_transform=data.batch_transform,
        scheduler=parts.scheduler, per_iteration_schedule=cfg.sched.per_iteration,
        global_step=progress.global_step, clip_grad=cfg.optim.clip_grad, max_steps=cfg.train.max_steps_per_epoch,
        channels_last=cfg.train.channels_last, progress=cfg.train.progress,
    )
    if not cfg.sched.per_iteration:
        parts.scheduler.step(epoch)  # official loop: step(epoch) at the end of the epoch (docs/model.md §6.1)
    record = {"epoch": epoch, "train_loss": stats["train_loss"], "lr": stats["lr"]}
    # without SyncBN each process tracks its own BatchNorm statistics: evaluate rank 0's everywhere
    D.broadcast_buffers(parts.module)
    if parts.ema is not None:
        D.broadcast_buffers(parts.ema.module)
    if (epoch + 1) % cfg.train.eval_every == 0 or _is_last(cfg, epoch):
        record.update(_evaluate(cfg, rt, data, parts))
    else:
        record.update(test_loss=None, test_acc1=None, test_acc5=None, test_ema_acc1=None, test_ema_acc5=None)
    record.update(images_per_sec=stats["images_per_sec"], epoch_time=stats["epoch_time"],
                  wall_time=time.perf_counter() - rt.start_time)
    improved, best = False, progress.best
    if record["test_acc1"] is not None:
        if record["test_acc1"] > best["acc1"]:
            best["acc1"], best["epoch"] = record["test_acc1"], epoch
            improved = parts.ema is None
        if record["test_ema_acc1"] is not None and record["test_ema_acc1"] > best["ema_acc1"]:
            best["ema_acc1"] = record["test_ema_acc1"]
            improved = True  # like the official code: best.pth follows the EMA accuracy when EMA is on
    return record, improved


def save_checkpoints(cfg: TrainConfig, rt: Runtime, data: Loaders, parts: Training, progress: Progress,
                     record: dict, improved: bool) -> None:
    """Append the epoch's record to ``metrics.jsonl`` and write ``checkpoint.pth`` (every ``train.save_every``
    epochs and at the end) and ``best.pth`` (when ``improved``), atomically, with the RNG states of every
    process (gathered: a collective, so every process calls this)."""
    epoch = record["epoch"]
    rng_all = [get_rng_state()]
    if rt.distributed:
        rng_all = [None] * rt.world
        torch.distributed.all_gather_object(rng_all, get_rng_state())
    if not D.is_main():
        return
    with open(os.path.join(rt.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    state = {
        "version": 1, "model": parts.module.state_dict(),
        "model_ema": parts.ema.module.state_dict() if parts.ema is not None else None,
        "optimizer": parts.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "epoch": epoch, "global_step": progress.global_step, "rng": rng_all, "best": dict(progress.best),
        "config": cfg.to_dict(), "num_classes": data.num_classes, "in_chans": data.in_chans,
    }
    if (epoch + 1) % cfg.train.save_every == 0 or _is_last(cfg, epoch):
        save_checkpoint(os.path.join(rt.out_dir, "checkpoint.pth"), state)
    if improved:
        save_checkpoint(os.path.join(rt.out_dir, "best.pth"), state)


def finish(cfg: TrainConfig, rt: Runtime, parts: Training, progress: Progress, last: dict) -> dict:
    """Log the summary, tear down the process group; returns the summary dict of :func:`train`."""
    wall = time.perf_counter() - rt.start_time
    best, has_ema = progress.best, parts.ema is not None
    summary = {"best_acc1": best["acc1"], "best_epoch": best["epoch"],
               "best_ema_acc1": best["ema_acc1"] if has_ema else None, "wall_time": wall, "last": last}
    ema_txt = f", best EMA test acc1 {best['ema_acc1']:.2f}%" if has_ema else ""
    log(f"SUMMARY: best test acc1 {best['acc1']:.2f}% (epoch {best['epoch']}){ema_txt}, "
        f"wall time {wall:.1f} s ({wall / 60:.1f} min), output {rt.out_dir}")
    if rt.distributed:
        # Tear down the DDP wrapper (its reducer holds process-group work) while the group still exists:
        # freeing it only when train() returns, after destroy_process_group, sometimes hung a gloo rank.
        D.barrier()
        parts.model = None
        gc.collect()
        D.barrier()
    D.cleanup()
    return summary


class AccuracyBelowBar(RuntimeError):
    """The run ended its schedule below ``train.min_test_acc1``; the message gives the accuracy and the bar."""


def check_accuracy_bar(cfg: TrainConfig, last: dict) -> None:
    """Raise :class:`AccuracyBelowBar` when ``train.min_test_acc1`` is set, the schedule's last epoch ran
    (``last``: its metrics) and its test acc1 is below the bar (or was not measured)."""
    bar = cfg.train.min_test_acc1
    if bar is None or not last or last.get("epoch") != cfg.sched.epochs - 1:
        return  # no bar, or a run stopped early (train.stop_after_epoch) to be resumed
    acc = last.get("test_acc1")
    if acc is None or acc < bar:
        got = "was not measured" if acc is None else f"is {acc:.2f}%"
        raise AccuracyBelowBar(f"test acc1 after the last epoch ({last['epoch']}) {got}, below the bar "
                               f"train.min_test_acc1 = {bar:.2f}%")


def train(cfg: TrainConfig) -> dict:
    """Run the training described by ``cfg``; returns a summary dict with ``best_acc1``, ``best_ema_acc1``,
    ``best_epoch``, ``wall_time`` and ``last`` (the last epoch's metrics). Raises :class:`AccuracyBelowBar`
    when the last epoch's test acc1 is below ``train.min_test_acc1``."""
    rt = setup(cfg)
    data = build_loaders(cfg, rt)
    parts = build_training(cfg, rt, data)
    progress = resume(cfg, rt, parts)
    if progress.rng is not None:
        set_rng_state(progress.rng)
    last = {}
    for epoch in range(progress.start_epoch, cfg.sched.epochs):
        last, improved = run_epoch(cfg, rt, data, parts, progress, epoch)
        save_checkpoints(cfg, rt, data, parts, progress, last, improved)
        _log_epoch(last)
        D.barrier()
        if epoch == cfg.train.stop_after_epoch:
            break
    summary = finish(cfg, rt, parts, progress, last)
    check_accuracy_bar(cfg, last)
    return summary


# ----------------------------------------------------------------------------------------------- helpers


def _is_last(cfg: TrainConfig, epoch: int) -> bool:
    return epoch == cfg.sched.epochs - 1 or epoch == cfg.train.stop_after_epoch


def _evaluate(cfg: TrainConfig, rt: Runtime, data: Loaders, parts: Training) -> dict:
    """Test metrics of the model and of its EMA, as ``metrics.jsonl`` fields."""
    from ppma.train.engine import evaluate

    def run(model):
        return evaluate(model, data.val_set, rt.device, batch_size=cfg.data.eval_batch_size, amp_dtype=rt.amp_dtype,
                        channels_last=cfg.train.channels_last)

    ev = run(parts.module)
    out = {"test_loss": ev["loss"], "test_acc1": ev["acc1"], "test_acc5": ev["acc5"],
           "test_ema_acc1": None, "test_ema_acc5": None}
    if parts.ema is not None:
        ev_ema = run(parts.ema.module)
        out.update(test_ema_acc1=ev_ema["acc1"], test_ema_acc5=ev_ema["acc5"])
    return out


def _log_epoch(record: dict) -> None:
    acc = "" if record["test_acc1"] is None else f" test acc1 {record['test_acc1']:.2f} acc5 {record['test_acc5']:.2f}"
    if record["test_ema_acc1"] is not None:
        acc += f" ema acc1 {record['test_ema_acc1']:.2f}"
    log(f"epoch {record['epoch']}: loss {record['train_loss']:.4f} lr {record['lr']:.3g}{acc} "
        f"{record['images_per_sec']:.0f} img/s ({record['epoch_time']:.1f} s)")
