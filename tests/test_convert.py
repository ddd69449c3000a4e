"""Official checkpoint conversion and loading (spec §5)."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

from ppma.models import (
    PPMA,
    MODEL_CONFIGS,
    convert_official_state_dict,
    convert_to_official_state_dict,
    create_model,
    load_checkpoint,
)
from ppma.models.convert import select_state_dict

warnings.filterwarnings("ignore", message="ppma._C is not available")

# spec §5.1: every official key matches one of these
OFFICIAL_PATTERNS = [
    r"patch_embed\.proj\.(0|3|6|9)\.(weight|bias)",
    r"patch_embed\.proj\.(1|4|7|10)\.(weight|bias|running_mean|running_var|num_batches_tracked)",
    r"layers\.\d\.Relpos\.angle",
    r"layers\.\d\.blocks\.\d+\.pos\.conv\.(weight|bias)",
    r"layers\.\d\.blocks\.\d+\.retention_layer_norm\.(weight|bias)",
    r"layers\.\d\.blocks\.\d+\.retention\.(q_proj|k_proj|v_proj|out_proj)\.(weight|bias)",
    r"layers\.\d\.blocks\.\d+\.retention\.lepe\.conv\.(weight|bias)",
    r"layers\.\d\.blocks\.\d+\.retention\.path_embed\.(dt_bias|A_log|dt_linear\.weight)",
    r"layers\.\d\.blocks\.\d+\.final_layer_norm\.(weight|bias)",
    r"layers\.\d\.blocks\.\d+\.ffn\.(fc1|fc2|dwconv\.conv)\.(weight|bias)",
    r"layers\.[23]\.blocks\.\d+\.gamma_[12]",
    r"layers\.[012]\.downsample\.reduction\.(weight|bias)",
    r"layers\.[012]\.downsample\.norm\.(weight|bias|running_mean|running_var|num_batches_tracked)",
    r"(proj|head)\.(weight|bias)",
    r"norm\.(weight|bias|running_mean|running_var|num_batches_tracked)",
]


def _meta_model(name: str) -> PPMA:
    with torch.device("meta"):
        return PPMA(MODEL_CONFIGS[name])


@pytest.mark.parametrize("name,count", [("ppma_tiny", 412), ("ppma_small", 787), ("ppma_base", 1253)])
def test_official_names_and_counts(name, count):
    sd = _meta_model(name).state_dict()
    official = convert_to_official_state_dict(sd)
    assert len(official) == len(sd) == count
    bad = [k for k in official if not any(re.fullmatch(p, k) for p in OFFICIAL_PATTERNS)]
    assert not bad, bad[:5]
    assert official["layers.0.Relpos.angle"].shape == (16,)
    assert official["layers.0.blocks.0.retention.path_embed.dt_linear.weight"].shape == (2, 16)
    assert official["layers.2.downsample.reduction.weight"].shape[:2] == (official["proj.weight"].shape[1], 256) \
        or official["layers.2.downsample.reduction.weight"].shape[0] == 512
    assert official["head.weight"].shape == (1000, 1024)
    if name == "ppma_base":
        assert official["layers.2.blocks.0.gamma_1"].shape == (1, 1, 1, 320)
        assert not any("layers.1.blocks.0.gamma" in k for k in official)


@pytest.mark.parametrize("name", ["ppma_tiny", "ppma_base"])
def test_exact_roundtrip(name):
    torch.manual_seed(0)
    sd = PPMA(MODEL_CONFIGS[name]).state_dict() if name == "ppma_tiny" else {
        k: torch.randn(v.shape) if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype)
        for k, v in _meta_model(name).state_dict().items()
    }
    back = convert_official_state_dict(convert_to_official_state_dict(sd), verbose=False)
    assert list(back) == list(sd)
    for k, v in sd.items():
        assert back[k].shape == v.shape and torch.equal(back[k], v), k


SMALL_KW = dict(embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4))


def _official_tiny(**kw):
    """A small config (construction of the full variants is slow on 2 cores) and its official-named weights."""
    torch.manual_seed(0)
    model = create_model("ppma_tiny", **{**SMALL_KW, **kw})
    return model, convert_to_official_state_dict(model.state_dict())


def test_checkpoint_layouts(caplog):
    model, official = _official_tiny()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in official.items()}
    ckpt = {"models": official, "model_ema": ema, "optimizer": {}, "epoch": 299}
    with caplog.at_level(logging.INFO, logger="ppma"):
        sd = convert_official_state_dict(ckpt)
    assert "model_ema" in caplog.text  # reported loudly which entry was used
    assert torch.equal(sd["stem.conv1.weight"], ema["patch_embed.proj.0.weight"])  # EMA preferred by default
    sd = convert_official_state_dict(ckpt, key="models", verbose=False)
    assert torch.equal(sd["stem.conv1.weight"], official["patch_embed.proj.0.weight"])
    with pytest.raises(KeyError, match="model"):
        convert_official_state_dict(ckpt, key="model")
    # module. prefixes (DDP) and a plain `model` entry
    sd = convert_official_state_dict({"model": {"module." + k: v for k, v in official.items()}}, verbose=False)
    model.load_state_dict(sd, strict=True)
    # mm checkpoints: backbone.* with neck/heads and out-norms
    mm = {"meta": {}, "state_dict": {"backbone." + k: v for k, v in official.items()}}
    mm["state_dict"]["backbone.outnorm2.weight"] = torch.ones(256)
    mm["state_dict"]["decode_head.conv_seg.weight"] = torch.ones(1)
    sd = convert_official_state_dict(mm, verbose=False)
    assert "out_norms.2.weight" in sd and not any(k.startswith("decode_head") for k in sd)
    # our own naming passes through
    assert convert_official_state_dict(model.state_dict(), verbose=False).keys() == model.state_dict().keys()
    with pytest.raises(TypeError):
        select_state_dict([1, 2])
    with pytest.raises(KeyError):
        select_state_dict({"epoch": 1, "args": {}})


def test_unknown_keys_kept_and_reported(caplog):
    _, official = _official_tiny()
    official["relative_position_bias_table"] = torch.zeros(3)
    with caplog.at_level(logging.WARNING, logger="ppma"):
        sd = convert_official_state_dict(official)
    assert "relative_position_bias_table" in sd and "match no PPMA name" in caplog.text


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_load_checkpoint_files(tmp_path, fmt):
    model, official = _official_tiny(layerscale=(False, True, False, True))
    path = tmp_path / f"best.{fmt}"
    if fmt == "pth":
        torch.save({"model": official, "epoch": 1, "max_accuracy": 82.6}, path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in official.items()}, str(path))
    kw = dict(SMALL_KW, layerscale=(False, True, False, True))
    other = create_model("ppma_tiny", **kw)
    load_checkpoint(other, path)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    # a 10-class model: the 1000-class head is dropped, everything else loads
    ten = create_model("ppma_tiny", num_classes=10, **kw)
    fc = ten.head.fc.weight.clone()
    load_checkpoint(ten, path)
    assert torch.equal(ten.head.fc.weight, fc)
    assert torch.equal(ten.stem.conv1.weight, model.stem.conv1.weight)
    # create_model(checkpoint_path=...)
    m = create_model("ppma_tiny", checkpoint_path=path, **kw)
    assert torch.equal(m.head.fc.weight, model.head.fc.weight)
    # checkpoints without the RoPE angle buffers load too
    torch.save({k: v for k, v in official.items() if not k.endswith("Relpos.angle")}, tmp_path / "noangle.pth")
    load_checkpoint(other, tmp_path / "noangle.pth")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(other, tmp_path / "missing.pth")
    deeper = create_model("ppma_tiny", **dict(kw, depths=(1, 2, 2, 1)))
    with pytest.raises(RuntimeError, match="Missing"):
        load_checkpoint(deeper, path)  # missing blocks
    # an empty or truncated file: a message with the path (fuzzing: a bare EOFError)
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.pth' is empty"):
        load_checkpoint(other, tmp_path / "empty.pth")
    (tmp_path / "cut.pth").write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="cut.pth' is not a readable checkpoint"):
        load_checkpoint(other, tmp_path / "cut.pth")
