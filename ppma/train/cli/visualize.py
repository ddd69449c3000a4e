"""``ppma-visualize``: learned decays, polyline masks and masked attention maps (docs/model.md §2 C.1, paper B.6).

For one input (an image file or a digits test sample) and a chosen attention block and head, writes PNGs:

* ``decay_*.png``: the horizontal decay ``alpha`` and the vertical decay ``beta`` of every token (from the
  block's ``ppma.nn.PathDecay`` module, read with a forward hook); small at edges, near 1 in flat regions;
* ``mask_*.png``: the polyline mask seen from a query token: the row of ``L`` (V2H), of ``L^T`` (H2V) and
  of ``L^2D = L + L^T``, computed with ``ppma.ops.polyline_scan`` on a one-hot vector (``L[p, :] = L^T e_p``);
* ``attn_*.png``: the query's attention weights over all tokens, as the model computes them: for
  full-attention blocks ``0.5 softmax(S + M) + 0.5 softmax(S + M^T)`` (row of the query), for criss-cross
  blocks the effective 2-D weights ``0.5 A_i[j,l] B_l[i,k] + 0.5 B_j[i,k] A_k[j,l]``.

The maps come from :mod:`ppma.train.visualize`; this module picks the input, the block and the head, and plots.
Examples::

    ppma-visualize --checkpoint outputs/demo_digits/best.pth --digits-index 3 --output outputs/vis
    ppma-visualize --checkpoint best.pth --image cat.jpg --stage 0 --block 1 --head 0 --query 28 28
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from ppma.train.visualize import attention_row, capture_attention, mask_rows

__all__ = ["main", "parse_args"]


def _stage_block(name: str):
    nums = [int(n) for n in re.findall(r"\.(\d+)(?=\.|$)", "." + name)]
    return (nums[0], nums[1]) if len(nums) >= 2 else (None, None)


# ----------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppma-visualize", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", help="PNG/JPG image")
    src.add_argument("--digits-index", type=int, help="index of a digits test-split sample")
    p.add_argument("--checkpoint", help="ppma-train checkpoint (default: a randomly initialised model)")
    p.add_argument("--config", help="YAML config for the model when no checkpoint is given")
    p.add_argument("--model", default=None, help="model name when neither checkpoint nor config is given")
    p.add_argument("--img-size", type=int, help="input size (default: the config's)")
    p.add_argument("--stage", type=int, default=None, help="stage of the block (with --block)")
    p.add_argument("--block", type=int, default=None,
                   help="block within --stage, or, without --stage, the index among all attention blocks (default 0)")
    p.add_argument("--head", type=int, default=0)
    p.add_argument("--query", type=int, nargs=2, metavar=("ROW", "COL"), help="query token (default: the centre)")
    p.add_argument("--output", default="outputs/visualize")
    p.add_argument("--dpi", type=int, default=120)
    return p.parse_args(argv)


def _load(args):
    from ppma.train.build import build_model
    from ppma.train.config import load_config

    if args.checkpoint:
        from ppma.train.checkpoint import load_model_from_checkpoint

        model, info = load_model_from_checkpoint(args.checkpoint)
        cfg = info["config"]
        if cfg is None:
            cfg = load_config(args.config)
    else:
        cfg = load_config(args.config, values={"model.name": args.model} if args.model else None)
        in_chans = 1 if cfg.data.dataset == "digits" else cfg.data.in_chans
        num_classes = 10 if cfg.data.dataset == "digits" else cfg.data.num_classes
        model = build_model(cfg.model, num_classes, in_chans)
    return model.eval(), cfg


def _input(args, cfg):
    import numpy as np
    import torch.nn.functional as F
    from PIL import Image

    size = args.img_size or cfg.data.img_size
    if args.digits_index is not None:
        from ppma.train.data import build_digits

        _, test = build_digits(size, cfg.data.digits_test_size, cfg.data.digits_split_seed)
        x, y = test[args.digits_index]
        shown = x[0].numpy()
        return x[None], shown, f"digit {int(y)}"
    img = Image.open(args.image)
    in_chans = cfg.data.in_chans if cfg.data.dataset != "digits" else 1
    img = img.convert("L" if in_chans == 1 else "RGB")
    t = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
    t = t[None] if t.dim() == 2 else t.permute(2, 0, 1)
    t = F.interpolate(t[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    shown = t.permute(1, 2, 0).numpy() if t.shape[0] == 3 else t[0].numpy()
    if cfg.data.dataset == "digits":
        from ppma.train.data import build_digits

        train, _ = build_digits(size, cfg.data.digits_test_size, cfg.data.digits_split_seed)
        mean, std = train.norm
        t = (t - mean) / std
    else:
        mean = torch.tensor(cfg.data.mean[: t.shape[0]])[:, None, None]
        std = torch.tensor(cfg.data.std[: t.shape[0]])[:, None, None]
        t = (t - mean) / std
    return t[None], shown, os.path.basename(args.image)


def main(argv=None) -> int:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ppma._compat import ensure_torchvision

    ensure_torchvision()
    model, cfg = _load(args)
    x, shown, label = _input(args, cfg)
    with torch.no_grad(), capture_attention(model) as rec:
        logits = model(x)
    calls = rec["calls"]
    if not calls:
        raise RuntimeError("the model made no PPMA attention call (no ppma.nn.MaskedAttentionOp ran)")
    decays = rec["decays"]
    names = [d[0] for d in decays] if len(decays) == len(calls) else [f"attention.{n}" for n in range(len(calls))]
    # pick the block
    if args.stage is not None:
        if len(decays) != len(calls):
            raise ValueError("--stage needs the model's PathDecay modules; use --block INDEX alone")
        wanted = [n for n, name in enumerate(names) if _stage_block(name) == (args.stage, args.block or 0)]
        if not wanted:
            raise ValueError(f"no attention block at stage {args.stage}, block {args.block or 0}; blocks: {names}")
        idx = wanted[0]
    else:
        idx = args.block or 0
        if not 0 <= idx < len(calls):
            raise ValueError(f"--block {idx} out of range: the model has {len(calls)} attention blocks")
    call = calls[idx]
    if len(decays) == len(calls):
        la_all, lb_all = decays[idx][1], decays[idx][2]
    else:
        la_all, lb_all = call["log_alpha"], call["log_beta"]
    heads = la_all.shape[-1]
    if not 0 <= args.head < heads:
        raise ValueError(f"--head {args.head} out of range: block {names[idx]} has {heads} heads")
    g = args.head
    la, lb = la_all[0, :, :, g].double(), lb_all[0, :, :, g].double()
    H, W = la.shape
    query = tuple(args.query) if args.query else (H // 2, W // 2)
    tag = f"{names[idx].replace('.', '_')}_h{g}"
    os.makedirs(args.output, exist_ok=True)
    written = []
    cmap_img = "gray" if shown.ndim == 2 else None

    def save(fig, name):
        path = os.path.join(args.output, name)
        fig.savefig(path, dpi=args.dpi, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    def mark(ax):
        ax.plot(query[1], query[0], marker="*", color="red", markersize=10)

    pred = int(logits.argmax(1)[0])
    title = f"{label} (predicted {pred}) — {names[idx]} ({call['kind']}), head {g}, {H}x{W} tokens"
    if call["mask"] != "polyline":
        title += f", mask {call['mask']}"

    # 1. decays
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    axes[0].imshow(shown, cmap=cmap_img)
    axes[0].set_title("input")
    for ax, t, name in ((axes[1], la, "horizontal decay alpha"), (axes[2], lb, "vertical decay beta")):
        a = t.exp()
        # colour range of the data: decays start near 1 and move little in short runs
        im = ax.imshow(a.numpy(), cmap="viridis")
        ax.set_title(f"{name}\n[{a.min().item():.4f}, {a.max().item():.4f}]", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    for ax in axes:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    save(fig, f"decay_{tag}.png")

    # 2. masks seen from the query
    mask = call["mask"]
    m_a, m_b, names_ab = mask_rows(mask, la, lb, query)  # from the decays the attention received
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, t, name in ((axes[0], m_a, names_ab[0]), (axes[1], m_b, names_ab[1]), (axes[2], m_a + m_b, names_ab[2])):
        im = ax.imshow(t.numpy(), cmap="magma")
        mark(ax)
        ax.set_title(name)
        ax.axis("off")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title + f", query {query}", fontsize=9)
    save(fig, f"mask_{tag}_q{query[0]}_{query[1]}.png")

    # 3. attention of the query
    q, k = call["q"][0, :, :, g], call["k"][0, :, :, g]
    attn = attention_row(q, k, call["log_alpha"][0, :, :, g], call["log_beta"][0, :, :, g], query,
                         mixer=call["kind"], scale=call["scale"], mask=mask)
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.6))
    axes[0].imshow(shown, cmap=cmap_img)
    axes[0].set_title("input")
    im = axes[1].imshow(attn.numpy(), cmap="inferno")
    mark(axes[1])
    axes[1].set_title("masked attention of the query")
    fig.colorbar(im, ax=axes[1], fraction=0.046)
    for ax in axes:
        ax.axis("off")
    fig.suptitle(title + f", query {query}", fontsize=9)
    save(fig, f"attn_{tag}_q{query[0]}_{query[1]}.png")

    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
