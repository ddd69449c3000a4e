"""Process-group helpers: ``torchrun`` environment, rank/world size, reductions."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "is_distributed", "rank", "world_size", "is_main", "all_reduce_sum", "broadcast_buffers", "barrier", "cleanup"]


def init_distributed(device: torch.device) -> bool:
    """Join the process group announced by ``torchrun`` (``WORLD_SIZE`` > 1): nccl on CUDA, gloo on CPU.

    Returns whether the run is distributed. On CUDA the process uses GPU ``LOCAL_RANK``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if dist.is_initialized():
        return True
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    return True


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over processes (in place; a no-op without a process group)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Copy every buffer (BatchNorm running statistics) of ``module`` from rank ``src`` to all ranks, so that
    distributed evaluation runs one model: without SyncBN each process tracks its own BN statistics."""
    if is_distributed():
        for b in module.buffers():
            dist.broadcast(b, src)


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()
