"""The paper's mask ablation (docs/model.md §7.4) plus PADRe and the structured-matrix blocks, as a small-data sanity run on
the digits demo.

Trains the digits demo (``configs/classification/demo_digits.yaml``) once per mask, once with PADRe as the token
mixer of every stage, once with the Surrogate Attention Block (``sab``: ``mixer="sab"``) and once with the Monarch
FFN (``monarch-mlp``: ``mlp="monarch"``), all with the same seed, data split and budget, and writes one table:
parameters and GMACs of PPMA-T at 224² with that mask or mixer (the paper's ablation columns), parameters of the
digits model, its CPU inference and training speed, and its test accuracy.

    python benchmarks/ablation.py                      # every variant, the demo's 6 epochs
    python benchmarks/ablation.py --epochs 3 --variants polyline none padre
    python benchmarks/ablation.py --variants sab monarch-mlp --append --note "..."   # add rows to the table

The table goes to ``benchmarks/results/ablation_digits.md`` / ``.json`` (a stable name that the next run overwrites)
and between the ``ablation`` markers of docs/performance.md. It is a small-data sanity check that every variant trains, not the paper's ImageNet result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("polyline", "none", "manhattan", "v2h", "shared", "cross_scan", "hilbert", "padre", "sab", "monarch-mlp")
# Variants that change the block rather than the mask: their create_model keywords.
BLOCK_VARIANTS = {"padre": {"mixer": "padre"}, "sab": {"mixer": "sab"}, "monarch-mlp": {"mlp": "monarch"}}
# The paper's Table 4 (PPMA-T, ImageNet-1K 224²): params M / GFLOPs / top-1 %.
PAPER = {
    "none": "14.33 / 2.65 / 82.28",
    "manhattan": "14.33 / 2.65 / 82.35",
    "cross_scan": "14.34 / 2.71 / 82.44",
    "hilbert": "14.34 / 2.71 / 82.44",
    "v2h": "14.34 / 2.71 / 82.44",
    "polyline": "14.34 / 2.71 / 82.60",
    "shared": "14.33 / 2.71 / 82.37",
}
START, END = "<!-- ablation:start -->", "<!-- ablation:end -->"


def overrides_of(variant: str) -> dict:
    """The ``create_model`` keywords of a variant: a mask, or a mixer / FFN (:data:`BLOCK_VARIANTS`) in every stage."""
    return dict(BLOCK_VARIANTS[variant]) if variant in BLOCK_VARIANTS else {"mask": variant}


def paper_columns(variant: str) -> dict:
    """Parameters and GMACs (conv + matmul, ``ppma.models.flops``) of PPMA-T at 224² with this variant."""
    import ppma
    from ppma.models.flops import count_macs

    model = ppma.create_model("ppma_tiny", **overrides_of(variant))
    return {"tiny_params_m": sum(p.numel() for p in model.parameters()) / 1e6, "tiny_gmacs": count_macs(model) / 1e9}


def run_variant(variant: str, args) -> dict:
    from ppma.train.benchmark import measure
    from ppma.train.config import load_config
    from ppma.train.trainer import train

    assignments = [f"sched.epochs={args.epochs}", f"train.seed={args.seed}", f"train.num_threads={args.threads}"]
    assignments += [f"model.overrides.{k}={v}" for k, v in overrides_of(variant).items()]
    cfg = load_config(args.config, assignments, {"train.output": os.path.join(args.output, variant)})
    summary = train(cfg)
    row = {"variant": variant, "epochs": args.epochs, "seed": args.seed,
           "test_acc1": summary["last"]["test_acc1"], "best_acc1": summary["best_acc1"],
           "best_ema_acc1": summary["best_ema_acc1"], "train_wall_s": summary["wall_time"]}

    from ppma.train.build import build_model

    torch.manual_seed(args.seed)
    model = build_model(cfg.model, cfg.data.num_classes, cfg.data.in_chans)
    row["digits_params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    speed = measure(model, batch_size=cfg.data.batch_size, img_size=cfg.data.img_size, in_chans=cfg.data.in_chans,
                    num_classes=cfg.data.num_classes, device=torch.device("cpu"), amp_dtype=None,
                    warmup=args.speed_warmup, iters=args.speed_iters, train=True, channels_last=False)
    row["infer_img_s"], row["train_img_s"] = speed["infer_images_per_sec"], speed["train_images_per_sec"]
    row.update(paper_columns(variant))
    row["paper"] = PAPER.get(variant, "-")
    return row


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Digits ablation (small-data sanity run, NOT the paper's ImageNet result): the digits demo trained "
        f"{meta['epochs']} epochs per variant, seed {meta['seed']}, {meta['threads']} CPU thread(s); speeds on "
        f"random batches of {meta['batch']} at {meta['img']}² ({meta['machine']}). Parameters and GMACs are PPMA-T's "
        f"at 224² (conv + matmul, `ppma.models.flops`); the paper column is its Table 4 (PPMA-T, ImageNet-1K).",
        "",
        "| variant | PPMA-T params (M) | PPMA-T GMACs @224² | digits params (M) | CPU infer img/s | CPU train img/s "
        "| test top-1 (last) | best top-1 | paper: params / GFLOPs / top-1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['tiny_params_m']:.3f} | {r['tiny_gmacs']:.3f} | {r['digits_params_m']:.3f} "
            f"| {r['infer_img_s']:.0f} | {r['train_img_s']:.0f} | {r['test_acc1']:.2f} | {r['best_acc1']:.2f} "
            f"| {r['paper']} |"
        )
    return "\n".join(lines) + "\n"


def update_doc(text: str, path: str) -> bool:
    """Replace what lies between the ablation markers of the document ``path``; False when it has no markers."""
    with open(path) as f:
        doc_text = f.read()
    if START not in doc_text or END not in doc_text:
        return False
    head, rest = doc_text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{text}{END}{tail}")
    return True


def previous_rows(args, meta: dict) -> list[dict]:
    """``--append``: the rows of the existing results file, which must have been measured with the same budget."""
    path = args.results + ".json"
    if not os.path.exists(path):
        raise SystemExit(f"[ablation] --append: {path} does not exist")
    with open(path) as f:
        old = json.load(f)
    keys = ("epochs", "seed", "threads", "batch", "img")
    if any(old["meta"].get(k) != meta[k] for k in keys):
        raise SystemExit(f"[ablation] --append: {path} was measured with "
                         f"{ {k: old['meta'].get(k) for k in keys} }, this run with { {k: meta[k] for k in keys} }")
    return old["rows"]


def write_outputs(rows: list[dict], meta: dict, args, done: bool, keep: list[dict] | None = None) -> str:
    """Write the table (``.md``, ``.json``, docs/performance.md) of the rows so far; a partial run says so. ``keep``: rows
    of an earlier run (``--append``) that this run did not measure again, in their order, before the new ones."""
    new = {r["variant"] for r in rows}
    rows = [r for r in (keep or []) if r["variant"] not in new] + rows
    text = table(rows, meta)
    if not done:
        missing = [v for v in args.variants if v not in {r["variant"] for r in rows}]
        text += f"\nPartial run: not yet measured: {', '.join(missing)}.\n"
    if getattr(args, "note", ""):
        text += f"\n{args.note}\n"
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results + ".md", "w") as f:
        f.write(text)
    with open(args.results + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "complete": done}, f, indent=1)
    if args.doc and not update_doc(text, args.doc):
        print(f"[ablation] {args.doc} has no {START} ... {END} markers: not updated", file=sys.stderr)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "classification", "demo_digits.yaml"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--epochs", type=int, default=6, help="training budget per variant (the demo: 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads for training and timing")
    p.add_argument("--speed-iters", type=int, default=10)
    p.add_argument("--speed-warmup", type=int, default=2)
    p.add_argument("--output", default=os.path.join(ROOT, "outputs", "ablation"), help="training outputs")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "ablation_digits"),
                   help="table path without extension (.md and .json are written)")
    p.add_argument("--note", default="", help="a sentence appended to the table (e.g. the machine's load)")
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "performance.md"),
                   help="document whose ablation table to update ('' for none)")
    p.add_argument("--append", action="store_true",
                   help="keep the rows of the existing results file (same budget required) and add or replace the "
                        "measured variants; --note then replaces the table's note, so say which rows it covers")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from ppma.train.config import load_config

    data = load_config(args.config).data
    meta = {"epochs": args.epochs, "seed": args.seed, "threads": args.threads, "batch": data.batch_size,
            "img": data.img_size, "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch "
                                            f"{torch.__version__}"}
    keep = previous_rows(args, meta) if args.append else None
    rows = []
    for variant in args.variants:
        t0 = time.perf_counter()
        rows.append(run_variant(variant, args))
        print(f"[ablation] {variant}: {json.dumps(rows[-1])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        # after every variant, so that an interrupted run keeps what it measured
        text = write_outputs(rows, meta, args, done=len(rows) == len(args.variants), keep=keep)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
