"""timm registration of ppma_tiny/small/base (``ppma.models.timm``)."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="ppma._C is not available")

try:
    import timm
except Exception as exc:  # not installed, or its torchvision does not load
    pytest.skip(f"timm is not importable: {exc!r}", allow_module_level=True)

import ppma.models  # noqa: E402  (registers the models)
from ppma.models import convert_to_official_state_dict  # noqa: E402

SMALL_KW = dict(embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4))


def test_registered_and_pretrained_cfg():
    assert ppma.models.TIMM_REGISTERED
    assert {"ppma_tiny", "ppma_small", "ppma_base"} <= set(timm.list_models("ppma_*"))
    cfg = timm.models.get_pretrained_cfg("ppma_tiny").to_dict()
    assert cfg["input_size"] == (3, 224, 224) and cfg["crop_pct"] == 0.875
    assert cfg["interpolation"] == "bicubic" and cfg["num_classes"] == 1000
    assert tuple(cfg["mean"]) == timm.data.IMAGENET_DEFAULT_MEAN and cfg["classifier"] == "head.fc"
    for name, folder in (("ppma_tiny", "PPMA_T_202502251000"), ("ppma_small", "PPMA_S_202504021000"),
                         ("ppma_base", "PPMA_B_202504101400")):  # docs/model.md §5.2: the official release
        cfg = timm.models.get_pretrained_cfg(name).to_dict()
        assert cfg["hf_hub_id"] == "ZhongchenZhao/PPMA"
        assert cfg["hf_hub_filename"] == f"checkpoints/classification/{folder}/best.pth"


def test_create_model_and_data_config():
    with torch.device("meta"):
        model = timm.create_model("ppma_tiny")
    assert sum(p.numel() for p in model.parameters()) == 14_335_272
    data_cfg = timm.data.resolve_data_config({}, model=model)
    assert data_cfg["input_size"] == (3, 224, 224) and data_cfg["interpolation"] == "bicubic"
    m = timm.create_model("ppma_tiny", num_classes=7, drop_path_rate=0.0, **SMALL_KW)
    assert m(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_features_only():
    model = timm.create_model("ppma_tiny", features_only=True, **SMALL_KW).eval()
    assert model.feature_info.channels() == [32, 64, 96, 128]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    feats = model(torch.randn(1, 3, 64, 96))
    assert [tuple(f.shape) for f in feats] == [(1, 32, 16, 24), (1, 64, 8, 12), (1, 96, 4, 6), (1, 128, 2, 3)]
    model = timm.create_model("ppma_tiny", features_only=True, out_indices=(1, 2), **SMALL_KW).eval()
    assert len(model(torch.randn(1, 3, 64, 64))) == 2


def test_pretrained_from_local_official_file(tmp_path):
    torch.manual_seed(0)
    src = timm.create_model("ppma_tiny", **SMALL_KW)
    path = tmp_path / "best.pth"
    torch.save({"model": convert_to_official_state_dict(src.state_dict())}, path)
    m = timm.create_model("ppma_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **SMALL_KW)
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
