"""One training epoch and (distributed) evaluation."""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ppma.train import distributed as D
from ppma.train._common import synchronize

__all__ = ["autocast", "optimizer_step", "train_one_epoch", "evaluate", "accuracy_counts"]


def autocast(device: torch.device, amp_dtype: torch.dtype | None):
    """``torch.autocast`` for ``amp_dtype`` on ``device``, or a no-op context when ``amp_dtype`` is None."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler=None, clip_grad: float | None = None,
                   parameters=None) -> None:
    """Backward of ``loss`` and one optimiser step: through the fp16 ``scaler`` when given (gradients unscaled
    before clipping), clipping the gradient norm of ``parameters`` to ``clip_grad`` when set."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        if clip_grad:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(parameters, clip_grad)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if clip_grad:
            nn.utils.clip_grad_norm_(parameters, clip_grad)
        optimizer.step()


def train_one_epoch(
    model: nn.Module,
    loader,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    device: torch.device,
    epoch: int,
    *,
    amp_dtype: torch.dtype | None = None,
    scaler=None,
    ema=None,
    mixup_fn=None,
    batch_transform=None,
    scheduler=None,
    per_iteration_schedule: bool = False,
    global_step: int = 0,
    clip_grad: float | None = None,
    max_steps: int | None = None,
    channels_last: bool = False,
    progress: bool = True,
) -> tuple[dict, int]:
    """Train for one epoch; returns ``(stats, global_step)`` with stats ``train_loss`` (mean over the
    epoch's batches and processes), ``lr`` (at the end of the epoch), ``images_per_sec`` (all processes),
    ``epoch_time``."""
    from tqdm import tqdm

    model.train()
    steps = len(loader) if max_steps is None else min(len(loader), max_steps)
    bar = tqdm(total=steps, desc=f"epoch {epoch}", disable=not (progress and D.is_main()), dynamic_ncols=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_images = 0
    start = time.perf_counter()
    for step, (images, targets) in enumerate(loader):
        if step >= steps:
            break
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if batch_transform is not None:
            images = batch_transform(images)
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)
        if per_iteration_schedule and scheduler is not None:
            scheduler.step_update(num_updates=global_step)
        with autocast(device, amp_dtype):
            output = model(images)
            loss = criterion(output.float(), targets)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch}, step {step}; stopping")
        optimizer_step(loss, optimizer, scaler, clip_grad, model.parameters())
        global_step += 1
        if ema is not None:
            ema.update(model, step=global_step)
        loss_sum += loss.detach().double()
        n_images += images.shape[0]
        bar.update(1)
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{optimizer.param_groups[0]['lr']:.3g}")
    bar.close()
    synchronize(device)
    elapsed = time.perf_counter() - start
    totals = torch.tensor([loss_sum.item(), float(steps), float(n_images)], dtype=torch.float64, device=device)
    D.all_reduce_sum(totals)
    stats = {
        "train_loss": totals[0].item() / max(totals[1].item(), 1.0),
        "lr": optimizer.param_groups[0]["lr"],
        "images_per_sec": totals[2].item() / elapsed if elapsed > 0 else math.nan,
        "epoch_time": elapsed,
    }
    return stats, global_step


def accuracy_counts(output: torch.Tensor, target: torch.Tensor, topk=(1, 5)) -> list[int]:
    """Number of samples whose target is among the top-k logits, for each k (k capped at the classes)."""
    maxk = min(max(topk), output.shape[1])
    pred = output.topk(maxk, dim=1).indices  # [B, maxk]
    hit = pred.eq(target[:, None])
    return [int(hit[:, : min(k, maxk)].any(dim=1).sum()) for k in topk]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset,
    device: torch.device,
    *,
    batch_size: int = 64,
    amp_dtype: torch.dtype | None = None,
    num_workers: int = 0,
    channels_last: bool = False,
    progress: bool = False,
    desc: str = "eval",
) -> dict:
    """Top-1/top-5 accuracy (%) and mean cross-entropy over the whole ``dataset``.

    In a process group, rank r evaluates samples ``r, r + world, ...`` (no padding, no duplicates) and the
    counts are summed, so the result is exact for any world size."""
    from tqdm import tqdm

    model.eval()
    indices = list(range(D.rank(), len(dataset), D.world_size()))
    subset = torch.utils.data.Subset(dataset, indices)
    loader = torch.utils.data.DataLoader(
        subset, batch_size=batch_size, shuffle=False, num_workers=num_workers, pin_memory=device.type == "cuda"
    )
    counts = torch.zeros(4, dtype=torch.float64, device=device)  # top1, top5, loss sum, n
    for images, targets in tqdm(loader, desc=desc, disable=not (progress and D.is_main()), leave=False):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(device, amp_dtype):
            output = model(images)
        output = output.float()
        c1, c5 = accuracy_counts(output, targets)
        counts += torch.tensor(
            [c1, c5, F.cross_entropy(output, targets, reduction="sum").item(), targets.shape[0]],
            dtype=torch.float64,
            device=device,
        )
    D.all_reduce_sum(counts)
    n = max(counts[3].item(), 1.0)
    return {"acc1": 100.0 * counts[0].item() / n, "acc5": 100.0 * counts[1].item() / n, "loss": counts[2].item() / n,
            "n": int(counts[3].item())}
