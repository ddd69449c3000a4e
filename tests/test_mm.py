"""mmengine backbone registration and the MMDetection / MMSegmentation configs (docs/model.md §4.2, §6.2, §6.3)."""

from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch

mmengine = pytest.importorskip("mmengine")
from mmengine import Config  # noqa: E402
from mmengine.registry import MODELS  # noqa: E402

import ppma.models.mm  # noqa: E402,F401
from conftest import FULL  # noqa: E402
from ppma.models import PPMA, convert_to_official_state_dict  # noqa: E402
from ppma.models.mm import PPMABackbone  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "segmentation", "*.py"))) + sorted(
    glob.glob(os.path.join(ROOT, "configs", "detection", "*.py"))
)
warnings.filterwarnings("ignore", message="ppma._C is not available")


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    for arch in ("tiny", "small", "base"):
        assert f"upernet_ppma_{arch}_512x512_160k_ade20k.py" in names
        assert f"upernet_ppma_{arch}_1024x1024_160k_cityscapes.py" in names
        for sched in ("1x", "3x"):
            assert f"mask_rcnn_ppma_{arch}_fpn_{sched}_coco.py" in names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_backbone_builds(path):
    cfg = Config.fromfile(path)
    assert "ppma.models.mm" in cfg.custom_imports["imports"]
    assert "_base_" not in cfg
    bb = cfg.model.backbone.to_dict()
    assert bb["type"] == "PPMA" and bb["init_cfg"]["type"] == "Pretrained"
    arch = bb["arch"]
    expected_dpr = {"tiny": 0.1, "small": 0.15, "base": 0.4}[arch]
    assert bb["drop_path_rate"] == expected_dpr
    dims = [64, 128, 256, 512] if arch != "base" else [80, 160, 320, 512]
    neck_or_head = cfg.model.get("neck") or cfg.model.decode_head
    assert list(neck_or_head.in_channels) == dims
    assert cfg.optim_wrapper.optimizer.weight_decay == 0.05
    assert cfg.optim_wrapper.paramwise_cfg.custom_keys["norm"]["decay_mult"] == 0.0
    if arch != "tiny" and not FULL:
        return
    bb.pop("init_cfg")  # no checkpoint file here; Pretrained loading is tested below
    model = MODELS.build(bb).eval()
    assert isinstance(model, PPMABackbone)
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 72, 100))
    assert [tuple(o.shape) for o in outs] == [
        (1, dims[0], 18, 25), (1, dims[1], 9, 13), (1, dims[2], 5, 7), (1, dims[3], 3, 4)
    ]


@pytest.mark.parametrize("arch", ["tiny", "small", "base"])
def test_cityscapes_configs(arch):
    """docs/model.md §6.3: 19 classes, 1024x1024 crops, slide test stride 768 at (2048, 1024), batch 1 per GPU,
    evaluation every 4k of 160k iterations, the ADE20K optimiser."""
    cfg = Config.fromfile(os.path.join(ROOT, "configs", "segmentation", f"upernet_ppma_{arch}_1024x1024_160k_cityscapes.py"))
    m = cfg.model
    assert m.decode_head.num_classes == m.auxiliary_head.num_classes == 19
    assert m.auxiliary_head.in_channels == m.decode_head.in_channels[2]
    assert tuple(m.data_preprocessor.size) == (1024, 1024) and tuple(cfg.data_preprocessor.size) == (1024, 1024)
    assert m.test_cfg == dict(mode="slide", crop_size=(1024, 1024), stride=(768, 768))
    train = cfg.train_dataloader
    assert train.batch_size == 1 and train.dataset.type == "CityscapesDataset"
    crop = [t for t in train.dataset.pipeline if t["type"] == "RandomCrop"][0]
    assert tuple(crop["crop_size"]) == (1024, 1024)
    resize = [t for t in cfg.test_dataloader.dataset.pipeline if t["type"] == "Resize"][0]
    assert tuple(resize["scale"]) == (2048, 1024)
    assert cfg.train_cfg.max_iters == 160000 and cfg.train_cfg.val_interval == 4000
    assert cfg.optim_wrapper.optimizer.lr == 6e-5 and cfg.param_scheduler[1].end == 160000
    assert m.backbone.init_cfg.checkpoint.endswith(
        {"tiny": "PPMA_T_202502251000", "small": "PPMA_S_202504021000", "base": "PPMA_B_202504101400"}[arch]
        + "/best.pth")


def test_ade20k_multiscale_test_settings():
    """The official --aug-test: ratios 0.5..1.75 of the (2048, 512) test scale, each with and without flip."""
    cfg = Config.fromfile(os.path.join(ROOT, "configs", "segmentation", "upernet_ppma_tiny_512x512_160k_ade20k.py"))
    assert cfg.tta_model.type == "SegTTAModel"
    load, tta = cfg.tta_pipeline
    assert load["type"] == "LoadImageFromFile" and tta["type"] == "TestTimeAug"
    scales, flips, annotations, pack = tta["transforms"]
    assert [tuple(t["scale"]) for t in scales] == [(1024, 256), (1536, 384), (2048, 512), (2560, 640), (3072, 768),
                                                   (3584, 896)]
    assert all(t["keep_ratio"] for t in scales)
    assert [(t["prob"], t["direction"]) for t in flips] == [(0.0, "horizontal"), (1.0, "horizontal")]
    assert annotations[0]["type"] == "LoadAnnotations" and pack[0]["type"] == "PackSegInputs"
    assert cfg.model.test_cfg.mode == "slide"  # every scale is predicted with sliding windows, as the official run


def test_backbone_out_indices_norms_and_equivalence():
    torch.manual_seed(0)
    bb = MODELS.build(dict(type="PPMA", arch="tiny", out_indices=(1, 3), drop_path_rate=0.0)).eval()
    assert set(bb.out_norms.keys()) == {"1", "3"}
    assert all(n.eps == 1e-5 for n in bb.out_norms.values())
    net = PPMA(bb.cfg).eval()
    missing = net.load_state_dict({k: v for k, v in bb.state_dict().items() if not k.startswith("out_norms")},
                                  strict=False)
    assert all(k.startswith("head.") for k in missing.missing_keys)
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        outs = bb(x)
        ref = net.forward_intermediates(x, indices=[1, 3], intermediates_only=True, output_fmt="NHWC")
    for o, r, i in zip(outs, ref, (1, 3)):
        torch.testing.assert_close(o, bb.out_norms[str(i)](r).permute(0, 3, 1, 2))


def test_backbone_pretrained_from_official_checkpoint(tmp_path):
    torch.manual_seed(0)
    net = PPMA()  # ppma_tiny defaults
    official = convert_to_official_state_dict(net.state_dict())
    path = tmp_path / "best.pth"
    torch.save({"model": official, "model_ema": {k: v + 1 for k, v in official.items()}, "epoch": 3}, path)
    bb = MODELS.build(dict(type="PPMA", arch="tiny", init_cfg=dict(type="Pretrained", checkpoint=str(path))))
    bb.init_weights()
    sd = bb.state_dict()
    for k, v in net.state_dict().items():
        if not k.startswith("head."):
            torch.testing.assert_close(sd[k], v, rtol=0, atol=0)  # the `model` entry, not `model_ema`


def test_mm_style_checkpoint_roundtrip(tmp_path):
    bb = MODELS.build(dict(type="PPMA", arch="tiny"))
    official = convert_to_official_state_dict(bb.state_dict())
    assert any(k.startswith("outnorm3.") for k in official)
    ckpt = {"meta": {}, "state_dict": {**{"backbone." + k: v for k, v in official.items()},
                                        "neck.lateral_convs.0.conv.weight": torch.zeros(1)}}
    path = tmp_path / "epoch_12.pth"
    torch.save(ckpt, path)
    bb2 = MODELS.build(dict(type="PPMA", arch="tiny", init_cfg=dict(type="Pretrained", checkpoint=str(path))))
    bb2.init_weights()
    for k, v in bb.state_dict().items():
        torch.testing.assert_close(bb2.state_dict()[k], v, rtol=0, atol=0)


SMALL = dict(embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4))


def _backbone(checkpoint=None, **kw):
    cfg = dict(type="PPMA", arch="tiny", **{**SMALL, **kw})
    if checkpoint is not None:
        cfg["init_cfg"] = dict(type="Pretrained", checkpoint=str(checkpoint))
    return MODELS.build(cfg)


def _official_small():
    torch.manual_seed(0)
    net = PPMA(**SMALL)
    return net, convert_to_official_state_dict(net.state_dict())


def test_pretrained_official_best_pth_layout(tmp_path):
    """The official best.pth: `models` (raw) and `model_ema`, optimiser state and an argparse.Namespace."""
    import argparse

    net, official = _official_small()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in official.items()}
    torch.save({"models": official, "model_ema": ema, "optimizer": {"state": {}, "param_groups": []},
                "args": argparse.Namespace(model="PPMAViT_T"), "epoch": 299}, tmp_path / "best.pth")
    bb = _backbone(tmp_path / "best.pth")
    bb.init_weights()
    for k, v in net.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(bb.state_dict()[k], v), k  # `models`: the downstream keys mirror the official `model`


def test_pretrained_rejects_another_variant(tmp_path):
    """A checkpoint of another size must not silently leave most of the backbone random."""
    _, official = _official_small()
    torch.save({"model": official}, tmp_path / "best.pth")
    with pytest.raises(RuntimeError, match="Missing keys.*stages.1.blocks.1"):
        _backbone(tmp_path / "best.pth", depths=(1, 2, 2, 1)).init_weights()  # deeper (T -> S)
    with pytest.raises(RuntimeError, match="shape mismatches"):
        _backbone(tmp_path / "best.pth", embed_dims=(32, 64, 96, 160)).init_weights()  # wider (T -> B)
    torch.save({"model": convert_to_official_state_dict(PPMA(**dict(SMALL, depths=(1, 1, 3, 1))).state_dict())},
               tmp_path / "deeper.pth")
    with pytest.raises(RuntimeError, match="unexpected keys.*stages.2.blocks.2"):
        _backbone(tmp_path / "deeper.pth").init_weights()  # shallower (S -> T)
    bb = _backbone(tmp_path / "best.pth", out_indices=(0, 1))  # stages not built may be extra
    bb.init_weights()
    assert len(bb.stages) == 2


def test_pretrained_from_mmengine_checkpoint(tmp_path):
    """An MMEngine epoch_*.pth (HistoryBuffer logs, numpy values) loads weights-only."""
    import numpy as np
    from mmengine.logging import HistoryBuffer

    src = _backbone()
    logs = HistoryBuffer()
    logs.update(1.5)
    ckpt = {
        "meta": {"cfg": "model = dict()", "seed": 0, "epoch": 12, "iter": 100, "mmengine_version": "0.10.7",
                 "dataset_meta": {"classes": ("a", "b")}},
        "state_dict": {"backbone." + k: v for k, v in src.state_dict().items()},
        "message_hub": {"log_scalars": {"train/loss": logs}, "runtime_info": {"coco/bbox_mAP": np.float64(0.25)},
                        "resumed_keys": {"coco/bbox_mAP": True}},
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": []}]},
        "param_schedulers": [{"base_lrs": [1e-4], "last_step": 100}],
    }
    torch.save(ckpt, tmp_path / "epoch_12.pth")
    bb = _backbone(tmp_path / "epoch_12.pth")
    bb.init_weights()
    for k, v in src.state_dict().items():
        assert torch.equal(bb.state_dict()[k], v), k
    # the getattr that HistoryBuffer pickles need is allowed for its statistics methods only
    torch.save({"state_dict": ckpt["state_dict"], "x": _AttrLookup()}, tmp_path / "other.pth")
    with pytest.raises(RuntimeError, match="never falls back"):
        _backbone(tmp_path / "other.pth").init_weights()


class _AttrLookup:
    def __reduce__(self):
        from mmengine.logging import HistoryBuffer

        return (getattr, (HistoryBuffer, "update"))


def test_pretrained_from_url(tmp_path, monkeypatch):
    """init_cfg.checkpoint may be a URL: downloaded once into the torch hub cache (a local server here)."""
    import functools
    import http.server
    import threading

    net, official = _official_small()
    (tmp_path / "srv").mkdir()
    torch.save({"model": official}, tmp_path / "srv" / "best.pth")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "srv"))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/best.pth"
        bb = _backbone(url)
        bb.init_weights()
        (tmp_path / "srv" / "best.pth").unlink()  # cached: a second load does not download again
        _backbone(url).init_weights()
    finally:
        server.shutdown()
        server.server_close()
    assert torch.equal(bb.stem.conv1.weight, net.stem.conv1.weight)
    assert len(list((tmp_path / "torch_home" / "hub" / "checkpoints").glob("*-best.pth"))) == 1


def test_bad_arch():
    with pytest.raises(ValueError, match="arch"):
        MODELS.build(dict(type="PPMA", arch="huge"))
