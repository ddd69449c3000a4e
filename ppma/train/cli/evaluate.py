"""``ppma-eval``: top-1 / top-5 accuracy of a checkpoint on an ImageFolder (or the digits test split).

Our checkpoints (written by ``ppma-train``) carry their config, so only the data is needed::

    ppma-eval --checkpoint outputs/demo_digits/best.pth --data digits
    ppma-eval --checkpoint outputs/ppma_tiny_imagenet/best.pth --data /path/to/imagenet

Official PPMA checkpoints (the ``best.pth`` of the official training script) are read by ppma's one checkpoint
reader (``ppma.checkpoint``: weights-only, with the few harmless types such files hold) and converted to our
names; a checkpoint of another variant than ``--model`` raises, naming the keys that do not fit::

    ppma-eval --checkpoint PPMA_T_202502251000/best.pth --model ppma_tiny --data /path/to/imagenet

``--data`` is an ImageFolder root: its ``val/`` folder when there is one, else the root itself.
By default the EMA weights are evaluated when the checkpoint has them (the paper reports EMA accuracy). On the CPU
(float32 or ``--amp bf16``) the model is evaluated after the deployment step ``ppma.nn.fuse_for_inference``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppma-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="ppma-train checkpoint or an official PPMA checkpoint")
    p.add_argument("--data", required=True, help="ImageFolder root (uses <root>/val if present), or 'digits'")
    p.add_argument("--model", help="model name for official checkpoints (ppma_tiny, ppma_small, ppma_base)")
    p.add_argument("--key", default="auto",
                   help="which weights: auto (model_ema if present, else model), model, model_ema, models, state_dict")
    p.add_argument("--num-classes", type=int, help="classes of an official checkpoint (default: its classifier's)")
    p.add_argument("--impl", choices=["fused", "reference"], help="attention implementation")
    p.add_argument("--img-size", type=int, help="default: the checkpoint's config, else 224")
    p.add_argument("--crop-pct", type=float, help="default: the checkpoint's config, else 0.875")
    p.add_argument("--interpolation", default=None, help="default: the checkpoint's config, else bicubic")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch (default: 64)")
    p.add_argument("--num-workers", type=int,
                   help="data loading processes (default: 4, or fewer on a machine with fewer cores)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda, cuda:1 ...")
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none",
                   help="autocast dtype (default: none, float32); bf16 on the CPU")
    p.add_argument("--output", help="write the result as JSON to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ppma._compat import ensure_torchvision

    ensure_torchvision()
    from ppma.train._common import amp_dtype, resolve_device
    from ppma.train.checkpoint import load_model_from_checkpoint
    from ppma.train.config import DataConfig
    from ppma.train.data import build_digits, build_eval_transform
    from ppma.train.engine import evaluate
    import torch

    import ppma.nn
    import ppma.ops

    device = resolve_device(args.device)
    model, info = load_model_from_checkpoint(
        args.checkpoint, model_name=args.model, key=args.key, num_classes=args.num_classes
    )
    model.to(device).eval()
    # official checkpoints carry no config: the data defaults of the ImageNet recipe
    d = info["config"].data if info["config"] is not None else DataConfig()
    img_size = args.img_size or d.img_size
    if args.data == "digits":
        _, dataset = build_digits(img_size, d.digits_test_size, d.digits_split_seed)
    else:
        from torchvision.datasets import ImageFolder

        root = os.path.join(args.data, "val") if os.path.isdir(os.path.join(args.data, "val")) else args.data
        tf = build_eval_transform(img_size, args.crop_pct or d.crop_pct, args.interpolation or d.interpolation,
                                  d.mean, d.std)
        dataset = ImageFolder(root, tf)
    amp = amp_dtype(args.amp, device)
    if device.type == "cpu" and amp in (None, torch.bfloat16):
        # CPU inference runs the deployment step (fp32, or bf16 autocast; docs/design.md §2.9)
        ppma.nn.fuse_for_inference(model)
    with ppma.ops.use_impl(args.impl):  # --impl: the process-wide fused/reference switch of ppma.ops
        res = evaluate(model, dataset, device, batch_size=args.batch_size, amp_dtype=amp,
                       num_workers=_workers(args.num_workers), progress=True)
    result = {"checkpoint": args.checkpoint, "weights": info["key"], "kind": info["kind"], "data": args.data,
              "images": res["n"], "top1": res["acc1"], "top5": res["acc5"], "loss": res["loss"], "img_size": img_size}
    print(f"{args.checkpoint} [{info['key']}]: top-1 {res['acc1']:.2f}%  top-5 {res['acc5']:.2f}%  "
          f"({res['n']} images)")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _workers(requested: int | None) -> int:
    """--num-workers, or by default 4 capped at the cores this process may run on (DataLoader warns above that)."""
    if requested is not None:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cores)


if __name__ == "__main__":
    sys.exit(main())
