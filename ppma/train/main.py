"""``ppma-train`` / ``python -m ppma.train``: image classification training (spec §6.1).

Single process::

    ppma-train --config configs/classification/demo_digits.yaml --output outputs/demo_digits

Several processes (nccl on GPUs, gloo on CPUs)::

    torchrun --nproc_per_node=8 -m ppma.train --config configs/classification/ppma_tiny_imagenet.yaml \\
        --data /path/to/imagenet --output outputs/ppma_tiny

Writes ``<output>/config.yaml``, ``<output>/metrics.jsonl`` (one JSON object per epoch),
``<output>/checkpoint.pth`` (latest, for ``--resume``) and ``<output>/best.pth``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn as nn

import ppma.ops

__all__ = ["main", "parse_args", "config_from_args", "train"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppma-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (configs/classification/*.yaml); defaults: the ImageNet recipe")
    p.add_argument("--data", help="'digits', 'synthetic', or an ImageFolder root with train/ and val/")
    p.add_argument("--model", help="model name (ppma_tiny, ppma_small, ppma_base)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="per process")
    p.add_argument("--lr", type=float, help="absolute peak lr (disables the linear scaling rule)")
    p.add_argument("--output", help="output folder")
    p.add_argument("--resume", help="checkpoint to resume from, or 'auto' (<output>/checkpoint.pth if present)")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "none"])
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--num-workers", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--impl", choices=["fused", "reference"], help="attention implementation of the model")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config entry (YAML value), e.g. --set aug.mixup=0 --set ema.enabled=false")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace):
    """The run's config: file, then ``--set``, then the dedicated flags."""
    from ppma.train.config import load_config

    cfg = load_config(args.config, args.set)
    if args.data is not None:
        if args.data in ("digits", "synthetic"):
            cfg.data.dataset = args.data
        else:
            cfg.data.dataset, cfg.data.path = "imagefolder", args.data
    for flag, (section, key) in {
        "model": ("model", "name"), "epochs": ("sched", "epochs"), "batch_size": ("data", "batch_size"),
        "lr": ("optim", "lr"), "output": ("train", "output"), "amp": ("train", "amp"),
        "device": ("train", "device"), "num_workers": ("data", "num_workers"), "seed": ("train", "seed"),
        "resume": ("train", "resume"),
    }.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(getattr(cfg, section), key, value)
    if args.no_progress:
        cfg.train.progress = False
    return cfg


def _device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def _amp_dtype(amp: str, device: torch.device):
    if amp == "auto":
        amp = "fp16" if device.type == "cuda" else "none"
    if amp == "none":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise ValueError("train.amp='fp16' needs a CUDA device; use 'bf16' or 'none' on the CPU")
        return torch.float16
    if amp == "bf16":
        return torch.bfloat16
    raise ValueError(f"train.amp must be auto, fp16, bf16 or none, got {amp!r}")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _log(msg: str) -> None:
    from ppma.train import distributed as D

    if D.is_main():
        print(msg, flush=True)


def train(cfg) -> dict:
    """Run the training described by ``cfg`` (a :class:`ppma.train.config.Config`); returns a summary dict
    with ``best_acc1``, ``best_ema_acc1``, ``best_epoch``, ``wall_time`` and ``last`` (the last epoch's metrics)."""
    from ppma._compat import ensure_torchvision

    ensure_torchvision()  # timm imports torchvision
    from timm.utils import ModelEmaV3

    import yaml

    from ppma.train import distributed as D
    from ppma.train.build import build_mixup_and_loss, build_model, build_optimizer, build_scheduler, scaled_lr
    from ppma.train.checkpoint import get_rng_state, load_checkpoint, save_checkpoint, set_rng_state
    from ppma.train.data import build_datasets
    from ppma.train.engine import evaluate, train_one_epoch

    wall_start = time.perf_counter()
    if cfg.train.num_threads:
        torch.set_num_threads(int(cfg.train.num_threads))
    device = _device(cfg.train.device)
    distributed = D.init_distributed(device)
    rank, world = D.rank(), D.world_size()
    amp_dtype = _amp_dtype(cfg.train.amp, device)
    out_dir = cfg.train.output
    if D.is_main():
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    _seed_everything(cfg.train.seed + rank)

    # ---------------------------------------------------------------- data
    train_set, val_set, batch_transform = build_datasets(cfg)
    num_classes = len(getattr(train_set, "classes", [])) or cfg.data.num_classes
    if cfg.data.dataset == "synthetic":
        num_classes = cfg.data.num_classes
    in_chans = train_set[0][0].shape[0]
    if cfg.data.repeated_aug and cfg.data.repeated_aug > 1:
        from timm.data.distributed_sampler import RepeatAugSampler

        sampler = RepeatAugSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                   num_repeats=cfg.data.repeated_aug, selected_round=cfg.data.repeated_aug_round)
    else:
        sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                                      seed=cfg.train.seed, drop_last=True)
    loader_gen = torch.Generator()
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=cfg.data.batch_size, sampler=sampler, num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda", drop_last=True, generator=loader_gen,
        persistent_workers=False,
    )
    if len(loader) == 0:
        raise ValueError(
            f"the training loader is empty: {len(sampler)} samples per process for batch size {cfg.data.batch_size}"
            " (with repeated augmentation the epoch is rounded down to data.repeated_aug_round)"
        )
    steps_per_epoch = len(loader) if cfg.train.max_steps_per_epoch is None else min(
        len(loader), cfg.train.max_steps_per_epoch)

    # ---------------------------------------------------------------- model
    model = build_model(cfg.model, num_classes, in_chans).to(device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if distributed and device.type == "cuda" and cfg.train.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    n_params = sum(p.numel() for p in model.parameters())
    custom = " (with overrides)" if cfg.model.overrides else ""
    _log(f"model {cfg.model.name}{custom}: {n_params / 1e6:.3f} M parameters; {num_classes} classes; "
         f"{len(train_set)} train / {len(val_set)} val images; device {device}, world {world}, amp {amp_dtype}"
         + (f", {torch.get_num_threads()} CPU threads" if device.type == "cpu" else ""))
    ema = None
    if cfg.ema.enabled:
        ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup)
    model_without_ddp = model
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.train.compile:
        model = torch.compile(model)

    total_batch = cfg.data.batch_size * world
    lr = scaled_lr(cfg.optim, total_batch)
    optimizer = build_optimizer(model_without_ddp, cfg.optim, lr)
    scheduler = build_scheduler(optimizer, cfg.sched, steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
    mixup_fn, criterion = build_mixup_and_loss(cfg.aug, num_classes)
    _log(f"lr {lr:.3g} (total batch {total_batch}), {steps_per_epoch} steps/epoch, {cfg.sched.epochs} epochs")

    # ---------------------------------------------------------------- resume
    start_epoch, global_step = 0, 0
    best = {"acc1": -1.0, "ema_acc1": -1.0, "epoch": -1}
    resume = cfg.train.resume
    rng_to_restore = None
    if resume == "auto":
        resume = os.path.join(out_dir, "checkpoint.pth")
        resume = resume if os.path.isfile(resume) else None
    if resume:
        ckpt = load_checkpoint(resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        if ema is not None:
            if ckpt.get("model_ema") is None:
                raise ValueError(f"{resume}: EMA is enabled but the checkpoint has no model_ema")
            ema.module.load_state_dict(ckpt["model_ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler") is not None:
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        global_step = ckpt["global_step"]
        best = ckpt["best"]
        per_rank = ckpt["rng"]
        rng_to_restore = per_rank[rank] if len(per_rank) == world else None
        _log(f"resumed from {resume} at epoch {start_epoch}"
             + ("" if rng_to_restore is not None else f" (RNG states saved by {len(per_rank)} processes, not restored)"))
        del ckpt

    # ---------------------------------------------------------------- loop
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if D.is_main() and os.path.exists(metrics_path):
        # a fresh run starts a new log; a resumed one keeps the epochs before the checkpoint's (the log may
        # be ahead of the checkpoint when a run stopped between writing the two)
        with open(metrics_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["epoch"] < start_epoch]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    if rng_to_restore is not None:
        set_rng_state(rng_to_restore)
    last = {}
    for epoch in range(start_epoch, cfg.sched.epochs):
        sampler.set_epoch(epoch)
        loader_gen.manual_seed(cfg.train.seed * 100003 + epoch * 1009 + rank)
        stats, global_step = train_one_epoch(
            model, loader, optimizer, criterion, device, epoch, amp_dtype=amp_dtype, scaler=scaler, ema=ema,
            mixup_fn=mixup_fn, batch_transform=batch_transform, scheduler=scheduler,
            per_iteration_schedule=cfg.sched.per_iteration, global_step=global_step,
            clip_grad=cfg.optim.clip_grad, max_steps=cfg.train.max_steps_per_epoch,
            channels_last=cfg.train.channels_last, progress=cfg.train.progress,
        )
        if not cfg.sched.per_iteration:
            scheduler.step(epoch)  # official loop: step(epoch) at the end of the epoch (spec §6.1)
        record = {"epoch": epoch, "train_loss": stats["train_loss"], "lr": stats["lr"]}
        is_last = epoch == cfg.sched.epochs - 1
        is_last = is_last or epoch == cfg.train.stop_after_epoch
        D.broadcast_buffers(model_without_ddp)
        if ema is not None:
            D.broadcast_buffers(ema.module)
        if (epoch + 1) % cfg.train.eval_every == 0 or is_last:
            ev = evaluate(model_without_ddp, val_set, device, batch_size=cfg.data.eval_batch_size,
                          amp_dtype=amp_dtype, channels_last=cfg.train.channels_last)
            record.update(test_loss=ev["loss"], test_acc1=ev["acc1"], test_acc5=ev["acc5"])
            if ema is not None:
                ev_ema = evaluate(ema.module, val_set, device, batch_size=cfg.data.eval_batch_size,
                                  amp_dtype=amp_dtype, channels_last=cfg.train.channels_last)
                record.update(test_ema_acc1=ev_ema["acc1"], test_ema_acc5=ev_ema["acc5"])
            else:
                record.update(test_ema_acc1=None, test_ema_acc5=None)
        else:
            record.update(test_loss=None, test_acc1=None, test_acc5=None, test_ema_acc1=None, test_ema_acc5=None)
        record.update(images_per_sec=stats["images_per_sec"], epoch_time=stats["epoch_time"],
                      wall_time=time.perf_counter() - wall_start)
        improved = False
        if record["test_acc1"] is not None:
            if record["test_acc1"] > best["acc1"]:
                best["acc1"], best["epoch"] = record["test_acc1"], epoch
                improved = ema is None
            if record["test_ema_acc1"] is not None and record["test_ema_acc1"] > best["ema_acc1"]:
                best["ema_acc1"] = record["test_ema_acc1"]
                improved = True  # like the official code: best.pth follows the EMA accuracy when EMA is on
        # RNG states of every process, gathered so a resumed run restores each one
        rng_all = [get_rng_state()]
        if distributed:
            rng_all = [None] * world
            torch.distributed.all_gather_object(rng_all, get_rng_state())
        if D.is_main():
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            state = {
                "version": 1, "model": model_without_ddp.state_dict(),
                "model_ema": ema.module.state_dict() if ema is not None else None,
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "epoch": epoch, "global_step": global_step, "rng": rng_all, "best": dict(best),
                "config": cfg.to_dict(), "num_classes": num_classes, "in_chans": in_chans,
            }
            if (epoch + 1) % cfg.train.save_every == 0 or is_last:
                save_checkpoint(os.path.join(out_dir, "checkpoint.pth"), state)
            if improved:
                save_checkpoint(os.path.join(out_dir, "best.pth"), state)
        acc = "" if record["test_acc1"] is None else f" test acc1 {record['test_acc1']:.2f} acc5 {record['test_acc5']:.2f}"
        if record["test_ema_acc1"] is not None:
            acc += f" ema acc1 {record['test_ema_acc1']:.2f}"
        _log(f"epoch {epoch}: loss {record['train_loss']:.4f} lr {record['lr']:.3g}{acc} "
             f"{record['images_per_sec']:.0f} img/s ({record['epoch_time']:.1f} s)")
        last = record
        D.barrier()
        if epoch == cfg.train.stop_after_epoch:
            break

    wall = time.perf_counter() - wall_start
    summary = {"best_acc1": best["acc1"], "best_epoch": best["epoch"],
               "best_ema_acc1": best["ema_acc1"] if ema is not None else None, "wall_time": wall, "last": last}
    ema_txt = f", best EMA test acc1 {best['ema_acc1']:.2f}%" if ema is not None else ""
    _log(f"SUMMARY: best test acc1 {best['acc1']:.2f}% (epoch {best['epoch']}){ema_txt}, "
         f"wall time {wall:.1f} s ({wall / 60:.1f} min), output {out_dir}")
    if distributed:
        # Tear down the DDP wrapper (its reducer holds process-group work) while the group still exists:
        # freeing it only when train() returns, after destroy_process_group, sometimes hung a gloo rank.
        D.barrier()
        del model
        gc.collect()
        D.barrier()
    D.cleanup()
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    with ppma.ops.use_impl(args.impl):  # --impl: the process-wide fused/reference switch of ppma.ops
        train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
