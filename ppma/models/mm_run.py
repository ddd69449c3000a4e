"""``ppma-mm``: train and test ppma's MMSegmentation 1.x / MMDetection 3.x configs with MMEngine's ``Runner``.

This does what ``tools/train.py`` and ``tools/test.py`` of an MMSegmentation / MMDetection checkout do (a pip
install keeps them under ``<package>/.mim/tools/``), for the configs in ``configs/segmentation`` and
``configs/detection``, plus one thing they cannot: under torch >= 2.6 ``torch.load`` is weights-only by default
and MMEngine 0.10.x calls it without arguments, so resuming from, or testing, its own ``iter_*.pth`` /
``epoch_*.pth`` fails (they hold MMEngine ``HistoryBuffer`` logs and numpy values). ``ppma-mm`` runs the runner
with exactly those types allowed (:func:`ppma.checkpoint.checkpoint_safe_globals`; local files are read by
:func:`ppma.checkpoint.read_checkpoint`, whatever the torch version), never with unrestricted
unpickling (what ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` would do).

    ppma-mm train configs/segmentation/upernet_ppma_tiny_512x512_160k_ade20k.py
    torchrun --nproc_per_node=8 -m ppma.models.mm_run train CONFIG --launcher pytorch
    ppma-mm test configs/segmentation/upernet_ppma_tiny_512x512_160k_ade20k.py iter_160000.pth [--tta]
"""

from __future__ import annotations

import argparse
import os

__all__ = ["load_config", "build_runner", "main"]


def load_config(
    config: str,
    cfg_options: dict | None = None,
    work_dir: str | None = None,
    launcher: str = "none",
    checkpoint: str | None = None,
    tta: bool = False,
    resume: bool = False,
    amp: bool = False,
):
    """The mmengine ``Config`` that ``tools/train.py`` / ``tools/test.py`` would run: ``cfg_options`` merged,
    ``work_dir`` defaulting to ``work_dirs/<config name>``, ``checkpoint`` as ``load_from``, and with ``tta`` the
    config's ``tta_pipeline`` / ``tta_model`` in place of the test pipeline and model."""
    from mmengine.config import Config

    cfg = Config.fromfile(config)
    cfg.launcher = launcher
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    cfg.work_dir = work_dir or cfg.get("work_dir") or os.path.join(
        "work_dirs", os.path.splitext(os.path.basename(config))[0])
    if checkpoint is not None:
        cfg.load_from = checkpoint
    if resume:
        cfg.resume = True
    if amp:
        cfg.optim_wrapper.type = "AmpOptimWrapper"
        cfg.optim_wrapper.loss_scale = "dynamic"
    if tta:
        if "tta_model" not in cfg or "tta_pipeline" not in cfg:
            raise ValueError(f"ppma-mm: {config} defines no tta_model / tta_pipeline")
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
    return cfg


def build_runner(cfg):
    """``Runner.from_cfg`` (or the config's ``runner_type``)."""
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    return RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)


def main(argv=None) -> int:
    from mmengine.config import DictAction

    from ppma.checkpoint import allow_checkpoint_globals, route_mmengine_local_files

    parser = argparse.ArgumentParser(prog="ppma-mm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("train", "test"):
        p = sub.add_parser(name)
        p.add_argument("config")
        if name == "test":
            p.add_argument("checkpoint", help="a checkpoint of the config's model (e.g. iter_160000.pth, or one "
                           "written by ppma-convert from an official checkpoint)")
            p.add_argument("--tta", action="store_true", help="multi-scale + flip test (the config's tta_pipeline)")
        else:
            p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in work_dir")
            p.add_argument("--amp", action="store_true", help="automatic mixed precision")
        p.add_argument("--work-dir", default=None)
        p.add_argument("--cfg-options", nargs="+", action=DictAction, default=None,
                       help="override config entries: key=value, e.g. train_dataloader.batch_size=4")
        p.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none")
        p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    cfg = load_config(args.config, args.cfg_options, args.work_dir, args.launcher,
                      checkpoint=getattr(args, "checkpoint", None), tta=getattr(args, "tta", False),
                      resume=getattr(args, "resume", False), amp=getattr(args, "amp", False))
    route_mmengine_local_files()  # local files: ppma's reader (weights-only whatever the torch version)
    with allow_checkpoint_globals():  # mmengine's own torch.load calls (weights-only by default in torch >= 2.6)
        runner = build_runner(cfg)
        if args.command == "train":
            runner.train()
        else:
            runner.test()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
