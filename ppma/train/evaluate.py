"""``ppma-eval``: top-1 / top-5 accuracy of a checkpoint on an ImageFolder (or the digits test split).

Our checkpoints (written by ``ppma-train``) carry their config, so only the data is needed::

    ppma-eval --checkpoint outputs/demo_digits/best.pth --data digits
    ppma-eval --checkpoint outputs/ppma_tiny_imagenet/best.pth --data /path/to/imagenet

Official PPMA checkpoints (spec §5.2) are converted by ``ppma.models.convert_official_state_dict``::

    ppma-eval --checkpoint PPMA_T_202502251000/best.pth --model ppma_tiny --data /path/to/imagenet

``--data`` is an ImageFolder root: its ``val/`` folder when there is one, else the root itself.
By default the EMA weights are evaluated when the checkpoint has them (the paper reports EMA accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import ppma.ops

__all__ = ["main", "load_model_from_checkpoint"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppma-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="ppma-train checkpoint or an official PPMA checkpoint")
    p.add_argument("--data", required=True, help="ImageFolder root (uses <root>/val if present), or 'digits'")
    p.add_argument("--model", help="model name for official checkpoints (ppma_tiny, ppma_small, ppma_base)")
    p.add_argument("--key", default="auto",
                   help="which weights: auto (model_ema if present, else model), model, model_ema, models, state_dict")
    p.add_argument("--num-classes", type=int, help="classes of an official checkpoint (default 1000)")
    p.add_argument("--impl", choices=["fused", "reference"], help="attention implementation")
    p.add_argument("--img-size", type=int, help="default: the checkpoint's config, else 224")
    p.add_argument("--crop-pct", type=float, help="default: the checkpoint's config, else 0.875")
    p.add_argument("--interpolation", default=None, help="default: the checkpoint's config, else bicubic")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--output", help="write the result as JSON to this file")
    return p.parse_args(argv)


def _pick_state(ckpt: dict, key: str, path: str):
    if key == "auto":
        for k in ("model_ema", "model", "models", "state_dict"):
            if isinstance(ckpt.get(k), dict):
                return k, ckpt[k]
        return "<bare>", ckpt
    if not isinstance(ckpt.get(key), dict):
        keys = [k for k, v in ckpt.items() if isinstance(v, dict)]
        raise KeyError(f"{path}: no weights under key {key!r}; dict-valued keys: {keys}")
    return key, ckpt[key]


def load_model_from_checkpoint(path: str, *, model_name=None, key="auto", num_classes=None):
    """Build the model for checkpoint ``path`` and load its weights.

    Returns ``(model, info)``; ``info`` holds ``config`` (our Config or None), ``key`` (which weights were
    loaded), ``kind`` ("ppma-train" or "official")."""
    from ppma.train.build import build_model
    from ppma.train.checkpoint import load_checkpoint
    from ppma.train.config import Config, DEFAULTS, merge

    ckpt = load_checkpoint(path)
    if isinstance(ckpt, dict) and "config" in ckpt and "version" in ckpt:  # ours
        cfg = Config(merge(DEFAULTS, ckpt["config"]))
        if model_name is not None and model_name != cfg.model.name:
            raise ValueError(f"--model {model_name!r} differs from the checkpoint's model {cfg.model.name!r}")
        cfg.model.checkpoint_path = None
        model = build_model(cfg.model, ckpt["num_classes"], ckpt["in_chans"])
        used, state = _pick_state(ckpt, key, path)
        model.load_state_dict(state)
        return model, {"config": cfg, "key": used, "kind": "ppma-train"}

    import ppma

    try:
        from ppma.models import convert_official_state_dict
    except ImportError as exc:  # the model package provides the converter
        raise ImportError("official checkpoints need ppma.models.convert_official_state_dict") from exc
    name = model_name or "ppma_tiny"
    model = ppma.create_model(name, num_classes=num_classes or 1000)
    used, _ = _pick_state(ckpt, key, path)
    state = convert_official_state_dict(ckpt, key=None if key == "auto" else key)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"{path}: converted weights do not fit {name}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    print(f"loaded official checkpoint {path} (weights: {used}) into {name}")
    return model, {"config": None, "key": used, "kind": "official"}


def main(argv=None) -> int:
    args = parse_args(argv)
    from ppma._compat import ensure_torchvision

    ensure_torchvision()
    from ppma.train.data import build_digits, build_eval_transform
    from ppma.train.engine import evaluate
    from ppma.train.main import _amp_dtype, _device

    device = _device(args.device)
    model, info = load_model_from_checkpoint(
        args.checkpoint, model_name=args.model, key=args.key, num_classes=args.num_classes
    )
    model.to(device).eval()
    cfg = info["config"]
    d = cfg.data if cfg is not None else None
    img_size = args.img_size or (d.img_size if d else 224)
    if args.data == "digits":
        _, dataset = build_digits(img_size, d.digits_test_size if d else 0.2, d.digits_split_seed if d else 0)
    else:
        from torchvision.datasets import ImageFolder

        root = os.path.join(args.data, "val") if os.path.isdir(os.path.join(args.data, "val")) else args.data
        tf = build_eval_transform(
            img_size,
            args.crop_pct or (d.crop_pct if d else 0.875),
            args.interpolation or (d.interpolation if d else "bicubic"),
            d.mean if d else (0.485, 0.456, 0.406),
            d.std if d else (0.229, 0.224, 0.225),
        )
        dataset = ImageFolder(root, tf)
    amp = _amp_dtype(args.amp, device)
    with ppma.ops.use_impl(args.impl):  # --impl: the process-wide fused/reference switch of ppma.ops
        res = evaluate(model, dataset, device, batch_size=args.batch_size, amp_dtype=amp,
                       num_workers=args.num_workers, progress=True)
    result = {"checkpoint": args.checkpoint, "weights": info["key"], "kind": info["kind"], "data": args.data,
              "images": res["n"], "top1": res["acc1"], "top5": res["acc5"], "loss": res["loss"], "img_size": img_size}
    print(f"{args.checkpoint} [{info['key']}]: top-1 {res['acc1']:.2f}%  top-5 {res['acc5']:.2f}%  "
          f"({res['n']} images)")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
