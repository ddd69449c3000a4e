"""Downstream smoke run of ppma's MMSegmentation 1.x / MMDetection 3.x configs (run through scripts/mm_smoke.sh,
which installs the mm stack first).

For every model it
1. loads the config file unchanged and overrides, as cfg-options, only: data roots (a tiny synthetic ADE20K-style
   or COCO-style dataset written here), image and crop size (scaled down), iterations, a constant learning rate, and
   the run plumbing (work dir, no loader workers, log every iteration, one checkpoint at the end without optimiser
   state, the backbone's Pretrained file: an official-format classification best.pth of a randomly initialised
   model, so the official checkpoint path is exercised too) and, for Mask R-CNN, a test score threshold of 0 (a
   barely trained model scores nothing above the configs' 0.05, and COCO evaluation needs detections);
2. trains, asserting every loss is finite and that the mean of the last third is below that of the first third;
3. evaluates once (mIoU, or COCO bbox + segm);
4. tests the saved MMEngine checkpoint through `load_from` (the ppma-mm path: a weights-only torch.load that allows
   MMEngine's HistoryBuffer) and requires the same metrics;
5. rewrites that checkpoint the way the official mmseg 0.x / mmdet 2.x checkpoints are laid out (backbone in the
   official naming, mmcv 1.x meta), converts it with ppma-convert, tests it again and requires the same metrics.

    python scripts/mm_smoke.py [--models upernet_tiny mask_rcnn_tiny_1x ...] [--summary FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODELS = {
    **{f"upernet_{a}": f"segmentation/upernet_ppma_{a}_512x512_160k_ade20k.py" for a in ("tiny", "small", "base")},
    **{f"mask_rcnn_{a}_{s}": f"detection/mask_rcnn_ppma_{a}_fpn_{s}_coco.py"
       for a in ("tiny", "small", "base") for s in ("1x", "3x")},
}


# ---------------------------------------------------------------------------------------------- synthetic data


def _blobs(rng, h, w, n):
    """n axis-aligned ellipses (class index, box x0 y0 x1 y1, boolean mask) that do not touch the border."""
    out = []
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(n):
        bw, bh = rng.integers(w // 5, w // 2), rng.integers(h // 5, h // 2)
        x0, y0 = rng.integers(1, w - bw - 1), rng.integers(1, h - bh - 1)
        cx, cy = x0 + bw / 2, y0 + bh / 2
        mask = ((xx - cx) / (bw / 2)) ** 2 + ((yy - cy) / (bh / 2)) ** 2 <= 1
        out.append((int(rng.integers(0, 4)), (int(x0), int(y0), int(x0 + bw), int(y0 + bh)), mask))
    return out


_COLOURS = np.array([[220, 40, 40], [40, 200, 60], [50, 70, 230], [230, 200, 30]], dtype=np.float32)


def _image(rng, h, w, blobs):
    img = rng.normal(110, 25, (h, w, 3)).astype(np.float32)
    for cls, _, mask in blobs:
        img[mask] = _COLOURS[cls] + rng.normal(0, 10, (int(mask.sum()), 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def write_ade20k(root, n=4, h=120, w=160, seed=0):
    """ADEChallengeData2016 layout: images/{training,validation}/*.jpg, annotations/*/*.png with labels 1..150
    (0 = other, ignored through reduce_zero_label). Blobs of 4 classes (2..5) on class 1."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split in ("training", "validation"):
        os.makedirs(os.path.join(root, "images", split))
        os.makedirs(os.path.join(root, "annotations", split))
        for i in range(n):
            blobs = _blobs(rng, h, w, 3)
            seg = np.ones((h, w), np.uint8)
            for cls, _, mask in blobs:
                seg[mask] = cls + 2
            Image.fromarray(_image(rng, h, w, blobs)).save(os.path.join(root, "images", split, f"ADE_{i:04d}.jpg"))
            Image.fromarray(seg).save(os.path.join(root, "annotations", split, f"ADE_{i:04d}.png"))


def _polygon(mask):
    """The outline of a convex blob as one COCO polygon (16 points around its bounding ellipse)."""
    ys, xs = np.nonzero(mask)
    cx, cy, rx, ry = (xs.min() + xs.max()) / 2, (ys.min() + ys.max()) / 2, (np.ptp(xs) + 1) / 2, (np.ptp(ys) + 1) / 2
    pts = []
    for t in np.linspace(0, 2 * math.pi, 16, endpoint=False):
        pts += [float(cx + rx * math.cos(t)), float(cy + ry * math.sin(t))]
    return [pts]


def write_coco(root, classes, n=4, h=128, w=160, seed=1):
    """COCO layout: {train,val}2017/*.jpg and annotations/instances_{train,val}2017.json with the 80 COCO
    categories; objects of the first 4 categories."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    categories = [{"id": i + 1, "name": name, "supercategory": "none"} for i, name in enumerate(classes)]
    os.makedirs(os.path.join(root, "annotations"))
    for split in ("train2017", "val2017"):
        os.makedirs(os.path.join(root, split))
        images, anns = [], []
        for i in range(n):
            blobs = _blobs(rng, h, w, 2)
            name = f"{i:012d}.jpg"
            Image.fromarray(_image(rng, h, w, blobs)).save(os.path.join(root, split, name))
            images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
            for cls, (x0, y0, x1, y1), mask in blobs:
                anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": cls + 1, "iscrowd": 0,
                             "bbox": [x0, y0, x1 - x0, y1 - y0], "area": float(mask.sum()),
                             "segmentation": _polygon(mask)})
        with open(os.path.join(root, "annotations", f"instances_{split}.json"), "w") as f:
            json.dump({"images": images, "annotations": anns, "categories": categories}, f)


def write_official_classification_checkpoint(arch: str, path: str):
    """The official best.pth layout (docs/model.md §5.2) for a randomly initialised PPMA of ``arch``."""
    from ppma.models import MODEL_CONFIGS, PPMA, convert_to_official_state_dict

    torch.manual_seed(0)
    sd = convert_to_official_state_dict(PPMA(MODEL_CONFIGS[f"ppma_{arch}"]).state_dict())
    torch.save({"models": sd, "model_ema": sd, "epoch": 299, "max_accuracy": 0.1,
                "args": argparse.Namespace(model=f"PPMAViT_{arch[0].upper()}")}, path)


# ---------------------------------------------------------------------------------------------- configuration


def _scaled(value, f):
    return tuple(max(1, int(round(v * f))) for v in value)


def scale_pipeline(pipeline, f):
    """A copy of ``pipeline`` with every image scale / crop size multiplied by ``f`` (nested transforms too)."""
    out = []
    for t in pipeline:
        if isinstance(t, (list, tuple)):
            out.append(scale_pipeline(t, f))
            continue
        t = copy.deepcopy(dict(t))
        for key in ("scale", "crop_size"):
            if isinstance(t.get(key), (list, tuple)):
                t[key] = _scaled(t[key], f)
        if isinstance(t.get("scales"), (list, tuple)):
            t["scales"] = [_scaled(s, f) for s in t["scales"]]
        if isinstance(t.get("transforms"), (list, tuple)):
            t["transforms"] = scale_pipeline(t["transforms"], f)
        out.append(t)
    return out


def _loaders(cfg, data_root, f):
    opts = {}
    for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
        opts[f"{name}.num_workers"] = 0
        opts[f"{name}.persistent_workers"] = False
        opts[f"{name}.dataset.data_root"] = data_root
        opts[f"{name}.dataset.pipeline"] = scale_pipeline(cfg[name]["dataset"]["pipeline"], f)
    return opts


def options(cfg, kind, data_root, crop, iters, lr, pretrained, work_dir):
    """cfg-options for one smoke run (see the module docstring for what they change, and why)."""
    opts = {
        "work_dir": work_dir,
        "model.backbone.init_cfg.checkpoint": pretrained,
        "optim_wrapper.optimizer.lr": lr,
        "param_scheduler": [],  # a constant learning rate
        "default_hooks.logger.interval": 1,
        "default_hooks.checkpoint.save_optimizer": False,
        "default_hooks.checkpoint.max_keep_ckpts": 1,
    }
    if kind == "seg":
        f = crop / cfg.crop_size[0]
        size = (crop, crop)
        stride = _scaled(cfg.model.test_cfg.stride, f)
        opts.update(_loaders(cfg, data_root, f))
        opts.update({
            "data_preprocessor.size": size,
            "model.data_preprocessor.size": size,
            "model.test_cfg.crop_size": size,
            "model.test_cfg.stride": stride,
            "train_cfg.max_iters": iters,
            "train_cfg.val_begin": iters + 1,  # no validation inside the loop (it would run at the last iteration)
            "default_hooks.checkpoint.interval": iters,
        })
    else:
        f = crop / 800  # the short side of the (1333, 800) scale
        per_epoch = 2  # 4 images, batch 2
        epochs = max(1, iters // per_epoch)
        opts.update(_loaders(cfg, data_root, f))
        opts.update({
            "train_cfg.max_epochs": epochs,
            "train_cfg.val_begin": epochs + 1,
            "default_hooks.checkpoint.interval": epochs,
            # a model trained for a few iterations scores no object above the configs' 0.05: keep every
            # detection, so that the COCO evaluation has results to compute its metrics from
            "model.test_cfg.rcnn.score_thr": 0.0,
            "val_evaluator.ann_file": os.path.join(data_root, "annotations", "instances_val2017.json"),
            "test_evaluator.ann_file": os.path.join(data_root, "annotations", "instances_val2017.json"),
        })
    return opts


# ---------------------------------------------------------------------------------------------- one model


def _metrics_close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        abs(float(a[k]) - float(b[k])) <= 1e-6 * max(1.0, abs(float(a[k]))) for k in a if _is_number(a[k]))


def _is_number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def _official_mm_checkpoint(ckpt_path: str, classes, out_path: str):
    """Lay a trained MMEngine checkpoint out as the official mmseg 0.x / mmdet 2.x files are: backbone.* in the
    official names (docs/model.md §5.1, outnorm{i}), neck and heads as they are, an mmcv 1.x style meta."""
    from ppma.models import convert_to_official_state_dict, read_checkpoint

    ckpt = read_checkpoint(ckpt_path)
    sd = ckpt["state_dict"]
    backbone = convert_to_official_state_dict({k[len("backbone."):]: v for k, v in sd.items()
                                               if k.startswith("backbone.")})
    state = {**{"backbone." + k: v for k, v in backbone.items()},
             **{k: v for k, v in sd.items() if not k.startswith("backbone.")}}
    meta = {"mmcv_version": "1.7.2", "CLASSES": tuple(classes), "config": "(official config text)", "iter": 160000}
    torch.save({"meta": meta, "state_dict": state, "optimizer": {}}, out_path)


def run_model(name, rel_config, data, args, pretrained_dir):
    from mmengine.runner import find_latest_checkpoint

    from ppma.models.convert import allow_checkpoint_globals
    from ppma.models.convert import main as ppma_convert
    from ppma.models.mm_run import build_runner, load_config

    kind = "seg" if name.startswith("upernet") else "det"
    arch = name.split("_")[-1] if kind == "seg" else name.split("_")[2]
    config = os.path.join(ROOT, "configs", rel_config)
    work_dir = os.path.join(args.work_dir, name)
    pretrained = os.path.join(pretrained_dir, f"PPMA_{arch}_best.pth")
    if not os.path.exists(pretrained):
        write_official_classification_checkpoint(arch, pretrained)
    base = load_config(config)
    crop = args.seg_crop if kind == "seg" else args.det_size
    lr = args.seg_lr if kind == "seg" else args.det_lr
    opts = options(base, kind, data[kind], crop, args.iters, lr, pretrained, work_dir)
    result = {"model": name, "config": "configs/" + rel_config, "crop": crop, "lr": lr}
    t0 = time.time()
    with allow_checkpoint_globals():
        torch.manual_seed(0)
        # mmengine keeps one visualizer per name for the process (ManagerMixin), bound to the first runner's
        # work_dir; each runner gets its own, or a later model would write into a removed directory
        runner = build_runner(load_config(config, {**opts, "visualizer.name": f"smoke_{name}"}))
        runner.train()
        losses = [float(v) for v in runner.message_hub.get_scalar("train/loss").data[0]]
        result["train_s"] = round(time.time() - t0, 1)
        metrics = runner.val()
        del runner
        gc.collect()
        reloaded = from_official = None
        if args.checkpoint_checks == "all" or arch in args.checkpoint_checks.split(","):
            ckpt = find_latest_checkpoint(work_dir)
            test_opts = {**opts, "work_dir": work_dir + "_test", "visualizer.name": f"smoke_{name}_reload"}
            reloaded = build_runner(load_config(config, test_opts, checkpoint=ckpt)).test()
            official = os.path.join(work_dir, "official_layout.pth")
            _official_mm_checkpoint(ckpt, _classes(kind), official)
            converted = os.path.join(work_dir, "converted.pth")
            ppma_convert([official, converted])
            conv_opts = {**test_opts, "work_dir": work_dir + "_conv", "visualizer.name": f"smoke_{name}_converted"}
            from_official = build_runner(load_config(config, conv_opts, checkpoint=converted)).test()
    gc.collect()
    n = max(1, len(losses) // 3)
    first, last = float(np.mean(losses[:n])), float(np.mean(losses[-n:]))
    result.update({
        "iters": len(losses), "losses": [round(v, 4) for v in losses], "first_third": round(first, 4),
        "last_third": round(last, 4), "finite": all(math.isfinite(v) for v in losses), "falls": last < first,
        "metrics": {k: round(float(v), 4) for k, v in metrics.items() if _is_number(v)},
        "reload_same_metrics": None if reloaded is None else _metrics_close(metrics, reloaded),
        "converted_official_same_metrics": None if from_official is None else _metrics_close(metrics, from_official),
        "total_s": round(time.time() - t0, 1),
    })
    if not args.keep:
        for d in (work_dir, work_dir + "_test", work_dir + "_conv"):
            shutil.rmtree(d, ignore_errors=True)
    return result


def _classes(kind):
    if kind == "seg":
        from mmseg.datasets import ADE20KDataset

        return ADE20KDataset.METAINFO["classes"]
    from mmdet.datasets import CocoDataset

    return CocoDataset.METAINFO["classes"]


# ---------------------------------------------------------------------------------------------- main


def _yes(flag) -> str:
    return "not run" if flag is None else "yes" if flag else "NO"


def summary_markdown(results, env, wall):
    lines = [
        "# Downstream smoke run (scripts/mm_smoke.sh)",
        "",
        "ppma's configs, unchanged except for cfg-options (synthetic data roots, small images, few iterations, "
        "constant learning rate; Mask R-CNN test score threshold 0), trained on a tiny synthetic ADE20K-style / "
        "COCO-style set (4 images), evaluated "
        "once, then tested again from the saved MMEngine checkpoint (`load_from`) and from that checkpoint rewritten "
        "in the official mmseg 0.x / mmdet 2.x layout and converted by `ppma-convert`. "
        "Synthetic data: the metrics only show that evaluation ran, not accuracy.",
        "",
        f"Environment: {env}. Wall time of the runs: {wall:.0f} s.",
        "",
        "| model | crop | lr | iters | loss first → last third | finite, falls | evaluation | reload = | converted official = | time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in r["metrics"].items()
                      if k.split("/")[-1] in ("mIoU", "aAcc", "bbox_mAP", "segm_mAP", "bbox_mAP_50", "segm_mAP_50"))
        lines.append(
            f"| {r['model']} | {r['crop']} | {r['lr']:g} | {r['iters']} | {r['first_third']:.3f} → {r['last_third']:.3f}"
            f" | {'yes' if r['finite'] else 'NO'}, {'yes' if r['falls'] else 'NO'} | {m or 'ran, no metric'} "
            f"| {_yes(r['reload_same_metrics'])} | {_yes(r['converted_official_same_metrics'])}"
            f" | {r['total_s']:.0f} s |")
    lines += ["", "Per-iteration training losses:", ""]
    for r in results:
        lines.append(f"- {r['model']}: " + ", ".join(f"{v:.3f}" for v in r["losses"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--iters", type=int, default=12, help="training iterations per model")
    parser.add_argument("--seg-crop", type=int, default=128, help="UPerNet crop (the configs use 512)")
    parser.add_argument("--det-size", type=int, default=128, help="Mask R-CNN short side (the configs use 800)")
    parser.add_argument("--seg-lr", type=float, default=5e-4, help="constant AdamW learning rate (UPerNet)")
    parser.add_argument("--det-lr", type=float, default=2e-4, help="constant AdamW learning rate (Mask R-CNN)")
    parser.add_argument("--checkpoint-checks", default="all", help="steps 4-5 (reload, converted official "
                        "layout) for 'all' models or for the listed sizes only, e.g. 'tiny' (they test loading, "
                        "which does not depend on the size)")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory, removed at the end")
    parser.add_argument("--keep", action="store_true", help="keep work dirs and checkpoints")
    parser.add_argument("--summary", default=None, help="write a markdown summary (and .json next to it)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import mmcv
    import mmdet
    import mmengine
    import mmseg

    import ppma

    tmp = tempfile.mkdtemp(prefix="ppma_mm_smoke_")
    args.work_dir = args.work_dir or os.path.join(tmp, "work")
    t0 = time.time()
    data = {"seg": os.path.join(tmp, "ade", "ADEChallengeData2016"), "det": os.path.join(tmp, "coco")}
    write_ade20k(data["seg"])
    write_coco(data["det"], _classes("det"))
    env = (f"Python {platform.python_version()}, torch {torch.__version__}, mmcv {mmcv.__version__}, "
           f"mmengine {mmengine.__version__}, mmseg {mmseg.__version__}, mmdet {mmdet.__version__}, "
           f"ppma {ppma.__version__} ({'fused C++ ops' if ppma.has_ext() else 'reference ops'}), "
           f"{torch.get_num_threads()} CPU threads")
    print(f"[mm_smoke] {env}", flush=True)
    results, failures = [], []
    for name in args.models:
        print(f"[mm_smoke] ---- {name}", flush=True)
        r = run_model(name, MODELS[name], data, args, tmp)
        results.append(r)
        ok = r["finite"] and r["falls"] and r["metrics"] and r["reload_same_metrics"] is not False and \
            r["converted_official_same_metrics"] is not False
        print(f"[mm_smoke] {name}: losses {r['first_third']:.3f} -> {r['last_third']:.3f} over {r['iters']} iters, "
              f"metrics {r['metrics']}, reload same {r['reload_same_metrics']}, converted official same "
              f"{r['converted_official_same_metrics']}, {r['total_s']:.0f} s: {'OK' if ok else 'FAILED'}", flush=True)
        if not ok:
            failures.append(name)
    wall = time.time() - t0
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(args.summary, "w") as f:
            f.write(summary_markdown(results, env, wall))
        with open(os.path.splitext(args.summary)[0] + ".json", "w") as f:
            json.dump({"environment": env, "wall_s": round(wall, 1), "results": results}, f, indent=1)
    if args.keep:
        print(f"[mm_smoke] kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[mm_smoke] {len(results) - len(failures)} passed, {len(failures)} failed in {wall:.0f} s"
          + (f": {failures}" if failures else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
