"""``ppma-convert SRC DST``: an official checkpoint -> a ppma one (classification weights in our naming, or an mm
checkpoint for ``load_from``)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Sequence

import torch

from ppma.checkpoint.io import read_checkpoint
from ppma.checkpoint.load import convert_official_state_dict
from ppma.checkpoint.mm import convert_mm_checkpoint, is_mm_checkpoint

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``ppma-convert SRC DST``: official checkpoint -> ppma checkpoint (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="ppma-convert",
        description="Convert an official PPMA checkpoint. MMSegmentation 0.x / MMDetection 2.x checkpoints "
        "(UPerNet ADE20K / Cityscapes, Mask R-CNN COCO) become checkpoints that ppma's configs load with "
        "load_from=...; classification checkpoints (best.pth) become {'state_dict': ...} in ppma's naming "
        "(or a bare .safetensors file).",
    )
    parser.add_argument("src", help="a file, an http(s) URL, hf://<repo>/<path>, or the name of an official "
                        "checkpoint (ppma_tiny, upernet_ppma_tiny_512x512_160k_ade20k, ...; downloaded from the "
                        "Hugging Face hub into its cache)")
    parser.add_argument("dst", help="output file (.pth, or .safetensors for classification weights)")
    parser.add_argument("--key", default=None, help="classification: the entry to convert (model_ema, models, "
                        "model, state_dict); default model_ema when present (the weights the paper reports)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    src = args.src
    if "://" not in src and not os.path.exists(src):
        from ppma.checkpoint.hub import download_official, official_files

        if src not in official_files():
            parser.error(f"{src!r} is neither a file nor an official checkpoint name ({sorted(official_files())})")
        src = download_official(src)
    checkpoint = read_checkpoint(src)
    if is_mm_checkpoint(checkpoint):
        if args.dst.endswith(".safetensors"):
            parser.error("an mm checkpoint is written as .pth (mmengine's load_from reads torch files)")
        out = convert_mm_checkpoint(checkpoint)
        kind = "mm (load_from)"
    else:
        sd = convert_official_state_dict(checkpoint, key=args.key)
        out = sd if args.dst.endswith(".safetensors") else {"state_dict": sd}
        kind = "classification"
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    if args.dst.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in out.items()}, args.dst)
    else:
        torch.save(out, args.dst)
    n = len(out["state_dict"]) if "state_dict" in out else len(out)
    print(f"ppma-convert: wrote {args.dst} ({kind} checkpoint, {n} tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
