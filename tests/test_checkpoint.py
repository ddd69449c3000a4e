"""One checkpoint module (``ppma.checkpoint``) behind every entry point.

An official-format ``best.pth`` (official parameter names, taken from the independent re-statement of the official
model in ``tests/official_like.py``; ``model`` and ``model_ema`` entries, optimiser state, an ``argparse.Namespace``
under ``args``, numpy scalars) is written to a temporary folder and loaded through every way ppma offers:
``create_model(checkpoint_path=...)``, ``pretrained=True`` from an offline hub cache, timm, ``ppma-eval``,
``ppma-train``'s ``model.checkpoint_path``, ``ppma-convert`` and the mm backbone's ``init_cfg``. All must give
the official model's logits. A damaged file, a file of another variant and a malicious pickle must each fail with
an error naming the problem, at every entry point, without running anything from the file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import official_like  # noqa: E402
from test_models_official import randomize_  # noqa: E402

from ppma._compat import ensure_torchvision  # noqa: E402

ensure_torchvision()  # timm and ImageFolder import torchvision (see ppma._compat)

import ppma  # noqa: E402
from ppma.checkpoint import (  # noqa: E402
    NAME_TABLE,
    official_to_ours,
    ours_to_official,
    read_checkpoint,
    to_official,
    to_ours,
)
from ppma.checkpoint import hub  # noqa: E402

warnings.filterwarnings("ignore", message="ppma._C is not available")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = 32  # the eval transform's size: stage 4 sees 1x1, every module still runs


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _official(variant: str = "ppma_tiny", seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    model = official_like.PPMAViT(**official_like.OFFICIAL_VARIANTS[variant]).eval()
    randomize_(model, seed=seed)
    return model


def _best_pth(ema: dict, raw: dict) -> dict:
    """The layout of the official training script's ``best.pth``."""
    params = [k for k, v in raw.items() if v.is_floating_point()][:2]
    return {
        "model": raw,
        "model_ema": ema,
        "optimizer": {
            "state": {i: {"step": torch.tensor(1000.0), "exp_avg": torch.randn(raw[k].shape),
                          "exp_avg_sq": torch.rand(raw[k].shape)} for i, k in enumerate(params)},
            "param_groups": [{"lr": 1e-5, "betas": (0.9, 0.999), "weight_decay": 0.05, "params": [0, 1]}],
        },
        "lr_scheduler": {"t_initial": 300, "warmup_t": 5, "base_values": [1e-3]},
        "epoch": 299,
        "max_accuracy": np.float64(82.582),
        "max_accuracy_ema": np.float64(82.602),
        "scaler": {"scale": 65536.0, "growth_factor": 2.0},
        "args": argparse.Namespace(model="PPMAViT_T", batch_size=128, drop_path=0.05, lr=np.float32(1e-3),
                                   output_dir="out", input_size=224),
    }


def _write_image_folder(root, classes=3, per_class=2) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / "val" / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)).save(d / f"{i}.png")


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """The official-format file, the images of a tiny ImageFolder, and the official model's logits on them."""
    from torchvision.datasets import ImageFolder

    from ppma.train.data import build_eval_transform

    tmp = tmp_path_factory.mktemp("official")
    ema_model = _official()
    raw_model = copy.deepcopy(ema_model)
    with torch.no_grad():  # the raw weights differ from the EMA ones: every entry point must pick the right entry
        for name, p in raw_model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    path = tmp / "PPMA_T_202502251000" / "best.pth"
    path.parent.mkdir()
    ckpt = _best_pth(ema_model.state_dict(), raw_model.state_dict())
    torch.save(ckpt, path)
    _write_image_folder(tmp / "data")
    ds = ImageFolder(str(tmp / "data" / "val"),
                     build_eval_transform(IMG, 1.0, "bicubic", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        feats = raw_model.patch_embed(x)
        for layer in raw_model.layers:
            feats = layer(feats)
        out = dict(path=path, tmp=tmp, x=x, targets=torch.tensor(ds.targets), ckpt=ckpt, ema=ema_model(x),
                   raw=raw_model(x), raw_last_stage=feats)
    return out


def _logits(model, x):
    with torch.no_grad():
        return model.eval()(x)


# ------------------------------------------------------------------------------------------------ the name table


def test_name_table_is_written_once_and_read_both_ways():
    """Both directions come from NAME_TABLE; every official name of the re-stated official model maps to one of
    ours and back, and the result is exactly our model's parameter list."""
    assert all(len(row) == 3 for row in NAME_TABLE)
    with torch.device("meta"):
        off = official_like.PPMAViT(**official_like.OFFICIAL_VARIANTS["ppma_base"]).state_dict()  # has layer scales
        ours = ppma.models.PPMA(ppma.models.MODEL_CONFIGS["ppma_base"]).state_dict()
    converted, unknown = to_ours(off)
    assert not unknown
    assert sorted(converted) == sorted(ours)
    for k, v in converted.items():
        assert v.shape == ours[k].shape, k
    back = to_official(converted)
    assert list(back) == list(off) and all(back[k].shape == off[k].shape for k in off)
    for k in off:
        assert ours_to_official(official_to_ours(k)) == k
    assert official_to_ours("layers.2.downsample.reduction.weight") == "stages.3.downsample.conv.weight"
    assert official_to_ours("outnorm3.bias") == "out_norms.3.bias"
    assert official_to_ours("relative_position_bias_table") is None
    with pytest.raises(KeyError, match="no official name for 'extra.weight'"):
        to_official({"extra.weight": torch.zeros(1)})


# ------------------------------------------------------------------------------------------------ every entry point


def test_reader_keeps_the_official_extras(official):
    back = read_checkpoint(official["path"])
    assert isinstance(back["args"], argparse.Namespace) and back["args"].model == "PPMAViT_T"
    assert back["max_accuracy"] == pytest.approx(82.582) and back["epoch"] == 299
    assert set(back["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_create_model_checkpoint_path(official):
    model = ppma.create_model("ppma_tiny", checkpoint_path=official["path"])
    assert _rel_err(_logits(model, official["x"]), official["ema"]) < 1e-5  # model_ema by default
    raw = ppma.create_model("ppma_tiny", checkpoint_path=str(official["path"]), checkpoint_key="model")
    assert _rel_err(_logits(raw, official["x"]), official["raw"]) < 1e-5


def test_timm_pretrained_cfg_overlay_file(official):
    timm = pytest.importorskip("timm")
    model = timm.create_model("ppma_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(official["path"])))
    assert _rel_err(_logits(model, official["x"]), official["ema"]) < 1e-5


_HUB_CHILD = r"""
import sys, torch, ppma.models, timm  # ppma.models first: it lets a CUDA torchvision import beside a CPU torch
x = torch.load(sys.argv[1])
with torch.no_grad():
    out = {"ppma": ppma.create_model("ppma_tiny", pretrained=True).eval()(x),
           "timm": timm.create_model("ppma_tiny", pretrained=True).eval()(x)}
torch.save(out, sys.argv[2])
"""


def test_pretrained_from_offline_hub_cache(official, tmp_path):
    """pretrained=True (ppma and timm) with the file in a local hub cache and HF_HUB_OFFLINE=1: a fresh process,
    because the hub client reads its settings when it is imported."""
    pytest.importorskip("huggingface_hub")
    pytest.importorskip("timm")
    from test_hub import write_hub_cache

    write_hub_cache(tmp_path / "hub", hub.CLASSIFICATION_FILES["ppma_tiny"], official["ckpt"])
    torch.save(official["x"], tmp_path / "x.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _HUB_CHILD, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    for name in ("ppma", "timm"):
        assert _rel_err(out[name], official["ema"]) < 1e-5, name


def test_ppma_eval(official, tmp_path):
    """The README's command: ppma-eval --checkpoint PPMA_T_.../best.pth --model ppma_tiny --data ..."""
    from ppma.train.checkpoint import load_model_from_checkpoint
    from ppma.train.cli.evaluate import main

    model, info = load_model_from_checkpoint(str(official["path"]), model_name="ppma_tiny")
    assert info == {"config": None, "key": "model_ema", "kind": "official"}
    assert model.num_classes == 1000  # from the checkpoint's classifier
    assert _rel_err(_logits(model, official["x"]), official["ema"]) < 1e-5
    out = tmp_path / "eval.json"
    assert main(["--checkpoint", str(official["path"]), "--model", "ppma_tiny", "--data", str(official["tmp"] / "data"),
                 "--img-size", str(IMG), "--crop-pct", "1.0", "--num-workers", "0", "--device", "cpu",
                 "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    top1 = 100.0 * (official["ema"].argmax(1) == official["targets"]).float().mean().item()
    assert res["weights"] == "model_ema" and res["images"] == len(official["targets"])
    assert res["top1"] == pytest.approx(top1)


def test_ppma_train_initialises_from_the_checkpoint(official):
    """ppma-train --set model.checkpoint_path=best.pth: the model the trainer builds (build_model) has the
    official weights; with another number of classes everything but the classifier is loaded."""
    from ppma.train.build import build_model
    from ppma.train.cli.train import config_from_args, parse_args

    cfg = config_from_args(parse_args(["--model", "ppma_tiny", "--set", f"model.checkpoint_path={official['path']}"]))
    model = build_model(cfg.model, num_classes=1000)
    assert _rel_err(_logits(model, official["x"]), official["ema"]) < 1e-5
    ten = build_model(cfg.model, num_classes=10)
    assert torch.equal(ten.stem.conv1.weight, model.stem.conv1.weight) and ten.head.fc.out_features == 10


def test_ppma_train_resume_reads_through_the_reader(official, tmp_path):
    """--resume accepts only ppma-train checkpoints and says what to do with an official one."""
    from ppma.train.checkpoint import load_training_state

    with pytest.raises(ValueError, match="not a ppma-train checkpoint.*model.checkpoint_path"):
        load_training_state(str(official["path"]))


@pytest.mark.parametrize("suffix", ["pth", "safetensors"])
def test_ppma_convert_then_load(official, tmp_path, suffix):
    from ppma.models.convert import main

    dst = tmp_path / f"ppma_tiny.{suffix}"
    assert main([str(official["path"]), str(dst)]) == 0
    model = ppma.create_model("ppma_tiny", checkpoint_path=dst)
    assert _rel_err(_logits(model, official["x"]), official["ema"]) < 1e-5
    if suffix == "pth":  # plain tensors only: a stock weights-only torch.load reads it
        assert "stem.conv1.weight" in torch.load(dst, weights_only=True)["state_dict"]


def test_mm_backbone_init_cfg(official):
    """init_cfg=dict(type="Pretrained") loads the `model` entry (as the official backbones do)."""
    pytest.importorskip("mmengine")
    from ppma.models.mm import PPMABackbone

    bb = PPMABackbone(arch="tiny", init_cfg=dict(type="Pretrained", checkpoint=str(official["path"])))
    bb.init_weights()
    with torch.no_grad():
        out = bb.eval()(official["x"])[3]
    ref = torch.nn.functional.layer_norm(official["raw_last_stage"], (512,)).permute(0, 3, 1, 2)  # out_norms: new
    assert _rel_err(out, ref) < 1e-5


def test_mmengine_loader_routed_through_the_reader(official, tmp_path):
    """ppma-mm replaces MMEngine's local-file loader by the reader: load_from / resume / init_cfg of any module
    read weights-only, also under torch < 2.6 where MMEngine's own torch.load would unpickle anything."""
    pytest.importorskip("mmengine")
    from mmengine.runner import CheckpointLoader
    from mmengine.runner.checkpoint import _load_checkpoint

    from ppma.checkpoint import route_mmengine_local_files

    marker = tmp_path / "marker"
    torch.save(dict(official["ckpt"], args=_System(f"touch {marker}")), tmp_path / "evil.pth")
    before = dict(CheckpointLoader._schemes)
    try:
        route_mmengine_local_files()
        assert _load_checkpoint(str(official["path"]))["args"].model == "PPMAViT_T"
        with pytest.raises(RuntimeError, match="never falls back"):
            _load_checkpoint(str(tmp_path / "evil.pth"))
        assert not marker.exists()
    finally:
        CheckpointLoader._schemes.clear()
        CheckpointLoader._schemes.update(before)


# ------------------------------------------------------------------------------------------------ bad files


def _entry_points(path, tmp_path):
    """Every entry point, as a callable that loads ``path``."""
    from ppma.train.build import build_model
    from ppma.train.checkpoint import load_model_from_checkpoint, load_training_state
    from ppma.train.cli.evaluate import main as eval_main
    from ppma.train.config import ModelConfig

    points = {
        "create_model": lambda: ppma.create_model("ppma_tiny", checkpoint_path=path),
        "read_checkpoint": lambda: read_checkpoint(path),
        "ppma-eval": lambda: load_model_from_checkpoint(str(path), model_name="ppma_tiny"),
        "ppma-eval main": lambda: eval_main(["--checkpoint", str(path), "--model", "ppma_tiny", "--data",
                                             str(tmp_path), "--num-workers", "0", "--device", "cpu"]),
        "ppma-train init": lambda: build_model(ModelConfig(name="ppma_tiny", checkpoint_path=str(path)), 1000),
        "ppma-train resume": lambda: load_training_state(str(path)),
        "ppma-convert": lambda: __import__("ppma.models.convert", fromlist=["main"]).main(
            [str(path), str(tmp_path / "out.pth")]),
    }
    try:
        import timm

        points["timm"] = lambda: timm.create_model("ppma_tiny", pretrained=True,
                                                   pretrained_cfg_overlay=dict(file=str(path)))
    except ImportError:
        pass
    try:
        from ppma.models.mm import PPMABackbone

        points["mm init_cfg"] = lambda: PPMABackbone(
            arch="tiny", init_cfg=dict(type="Pretrained", checkpoint=str(path))).init_weights()
    except ImportError:
        pass
    return points


def test_damaged_file(official, tmp_path):
    data = official["path"].read_bytes()
    path = tmp_path / "best.pth"
    path.write_bytes(data[: len(data) // 2])  # a download cut in the middle: a truncated zip archive
    for name, load in _entry_points(path, tmp_path).items():
        with pytest.raises(ValueError, match=r"best.pth' is not a readable checkpoint"):
            load()
    (tmp_path / "w.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_checkpoint(tmp_path / "w.safetensors")


def test_file_of_another_variant(official, tmp_path):
    """A PPMA-S best.pth given for PPMA-T: the error names the keys that do not fit."""
    small = _official("ppma_small", seed=5)
    path = tmp_path / "best.pth"
    torch.save(_best_pth(small.state_dict(), small.state_dict()), path)
    points = _entry_points(path, tmp_path)
    for name in ("create_model", "ppma-eval", "ppma-train init", "timm", "mm init_cfg"):
        if name not in points:
            continue
        with pytest.raises(RuntimeError, match="another PPMA variant") as info:
            points[name]()
        msg = str(info.value)
        assert "stages.0.blocks.2." in msg and "unexpected keys" in msg, (name, msg)  # PPMA-S has 3 blocks in stage 0
    # ppma-eval's --num-classes of another size than the checkpoint's classifier: named too, not dropped silently
    from ppma.train.checkpoint import load_model_from_checkpoint

    with pytest.raises(RuntimeError, match=r"head.fc.weight"):
        load_model_from_checkpoint(str(official["path"]), model_name="ppma_tiny", num_classes=10)


class _System:
    """Unpickling this calls ``os.system(command)``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Open:
    """Unpickling this calls ``open(path, "w")``: it creates the file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("payload", ["os.system", "open"])
def test_malicious_pickle_is_never_run(official, tmp_path, payload):
    marker = tmp_path / "marker"
    evil = _System(f"touch {marker}") if payload == "os.system" else _Open(str(marker))
    ckpt = dict(official["ckpt"], args=evil)
    path = tmp_path / "best.pth"
    torch.save(ckpt, path)
    refused = {"os.system": r"refused to rebuild (posix|nt)\.system", "open": r"refused to rebuild (io|builtins)\.open"}
    for name, load in _entry_points(path, tmp_path).items():
        with pytest.raises(RuntimeError, match=refused[payload]) as info:
            load()
        assert "never falls back to unrestricted unpickling" in str(info.value), name
        assert not marker.exists(), f"{name} ran the payload"
    # the payload is live: an unrestricted load (which ppma never does) runs it
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_every_torch_load_in_ppma_is_the_reader():
    """No module of ppma calls torch.load except the reader (ppma/checkpoint/io.py)."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "ppma")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                text = open(path, encoding="utf-8").read()
                if re.search(r"torch\.load\(", text) and not path.endswith(os.path.join("checkpoint", "io.py")):
                    offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, offenders
