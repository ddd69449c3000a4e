"""``ppma-train`` / ``python -m ppma.train``: image classification training (docs/model.md §6.1).

Single process::

    ppma-train --config configs/classification/demo_digits.yaml --output outputs/demo_digits

Several processes (nccl on GPUs, gloo on CPUs)::

    torchrun --nproc_per_node=8 -m ppma.train --config configs/classification/ppma_tiny_imagenet.yaml \\
        --data /path/to/imagenet --output outputs/ppma_tiny

Writes ``<output>/config.yaml``, ``<output>/metrics.jsonl`` (one JSON object per epoch),
``<output>/checkpoint.pth`` (latest, for ``--resume``) and ``<output>/best.pth``. The training itself is
:func:`ppma.train.trainer.train`; this module only turns the command line into a config.
"""

from __future__ import annotations

import argparse
import sys

import ppma.ops
from ppma.train.config import TrainConfig, load_config
from ppma.train.trainer import AccuracyBelowBar, train

__all__ = ["main", "parse_args", "config_from_args"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppma-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (configs/classification/*.yaml); defaults: the ImageNet recipe")
    p.add_argument("--data", help="'digits', 'synthetic', or an ImageFolder root with train/ and val/")
    p.add_argument("--model", help="model name (ppma_tiny, ppma_small, ppma_base)")
    p.add_argument("--epochs", type=int, help="training epochs (default: the config's)")
    p.add_argument("--batch-size", type=int, help="per process")
    p.add_argument("--lr", type=float, help="absolute peak lr (disables the linear scaling rule)")
    p.add_argument("--output", help="output folder")
    p.add_argument("--resume", help="checkpoint to resume from, or 'auto' (<output>/checkpoint.pth if present)")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "none"],
                   help="autocast dtype (default auto: fp16 with a GradScaler on CUDA, float32 on the CPU; bf16 "
                        "also works on the CPU, fp16 needs CUDA)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--num-workers", type=int, help="data loading processes per training process")
    p.add_argument("--seed", type=int, help="seed of every generator (default: the config's, 0)")
    p.add_argument("--impl", choices=["fused", "reference"], help="attention implementation of the model")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config entry (YAML value), e.g. --set aug.mixup=0 --set ema.enabled=false")
    return p.parse_args(argv)


# dedicated flags -> the config key they set
_FLAG_KEYS = {
    "model": "model.name", "epochs": "sched.epochs", "batch_size": "data.batch_size", "lr": "optim.lr",
    "output": "train.output", "amp": "train.amp", "device": "train.device", "num_workers": "data.num_workers",
    "seed": "train.seed", "resume": "train.resume",
}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's config: file, then ``--set``, then the dedicated flags."""
    values = {key: getattr(args, flag) for flag, key in _FLAG_KEYS.items() if getattr(args, flag) is not None}
    if args.data is not None:
        if args.data in ("digits", "synthetic"):
            values["data.dataset"] = args.data
        else:
            values["data.dataset"], values["data.path"] = "imagefolder", args.data
    if args.no_progress:
        values["train.progress"] = False
    return load_config(args.config, args.set, values)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (KeyError, TypeError, ValueError) as exc:  # a bad config: its message, not a traceback
        raise SystemExit(f"ppma-train: error: {exc.args[0]}") from None
    with ppma.ops.use_impl(args.impl):  # --impl: the process-wide fused/reference switch of ppma.ops
        try:
            train(cfg)
        except AccuracyBelowBar as exc:
            raise SystemExit(f"ppma-train: error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
