"""Official checkpoint conversion and loading (docs/model.md §5)."""

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

# docs/model.md §5.1: every official key matches one of these
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


def test_read_checkpoint_allowlist(tmp_path):
    """Official best.pth (argparse.Namespace) and numpy values load weights-only; anything else is refused
    without being run."""
    import argparse

    import numpy as np

    from ppma.models.convert import read_checkpoint

    model, official = _official_tiny()
    ckpt = {"models": official, "model_ema": official, "epoch": 299, "max_accuracy": 82.6,
            "args": argparse.Namespace(model="PPMAViT_T", lr=1e-3), "hist": np.arange(3.0), "best": np.float64(1.5)}
    torch.save(ckpt, tmp_path / "best.pth")
    back = read_checkpoint(tmp_path / "best.pth")
    assert back["args"].model == "PPMAViT_T" and back["best"] == 1.5 and back["hist"].tolist() == [0.0, 1.0, 2.0]
    m = create_model("ppma_tiny", checkpoint_path=tmp_path / "best.pth", **SMALL_KW)
    assert torch.equal(m.stem.conv1.weight, model.stem.conv1.weight)

    from ppma.models.convert import allow_checkpoint_globals

    with allow_checkpoint_globals():  # re-entrant: an inner read must not take the outer allowance away
        read_checkpoint(tmp_path / "best.pth")
        assert torch.load(tmp_path / "best.pth", weights_only=True)["args"].lr == 1e-3
    with pytest.raises(Exception, match="Namespace"):  # and nothing stays allowed after the block
        torch.load(tmp_path / "best.pth", weights_only=True)

    torch.save({"state_dict": official, "payload": _Payload()}, tmp_path / "evil.pth")
    with pytest.raises(RuntimeError, match="never falls back"):
        read_checkpoint(tmp_path / "evil.pth")
    assert not _Payload.ran


class _Payload:
    """Unpickling this would call a function: a weights-only load must refuse it."""

    ran = False

    def __reduce__(self):
        return (_Payload._run, ())

    @staticmethod
    def _run():
        _Payload.ran = True


def test_strict_loading_names_the_differences(tmp_path):
    _, official = _official_tiny()
    torch.save({"model": official}, tmp_path / "t.pth")
    wider = create_model("ppma_tiny", **dict(SMALL_KW, embed_dims=(32, 64, 96, 160)))
    before = wider.stem.conv1.weight.clone()
    with pytest.raises(RuntimeError, match="shape mismatches"):
        load_checkpoint(wider, tmp_path / "t.pth")
    assert torch.equal(wider.stem.conv1.weight, before)  # nothing loaded when the check fails
    load_checkpoint(wider, tmp_path / "t.pth", strict=False)  # lenient: loads what fits
    assert not torch.equal(wider.stem.conv1.weight, before)
    headless = create_model("ppma_tiny", num_classes=0, checkpoint_path=tmp_path / "t.pth", **SMALL_KW)
    assert not hasattr(headless.head, "fc") or not isinstance(headless.head.fc, torch.nn.Linear)


def _mm_official(official: dict, outnorms=(64, 128, 256, 512)) -> dict:
    """An mmseg 0.x-style checkpoint: backbone in the official naming (its classifier deleted, outnorms added,
    docs/model.md §4.2), neck/heads, mmcv 1.x meta, optimiser."""
    sd = {"backbone." + k: v for k, v in official.items() if not k.startswith(("proj.", "norm.", "head."))}
    sd.update({f"backbone.outnorm{i}.{p}": torch.randn(c) for i, c in enumerate(outnorms) for p in ("weight", "bias")})
    sd["decode_head.lateral_convs.0.conv.weight"] = torch.randn(8, 32, 1, 1)
    sd["decode_head.conv_seg.weight"] = torch.randn(150, 8, 1, 1)
    sd["auxiliary_head.convs.0.bn.running_var"] = torch.rand(8)
    meta = {"mmcv_version": "1.7.2", "config": "model = dict(...)", "CLASSES": ("wall", "building"),
            "PALETTE": [[120, 120, 120], [180, 120, 120]], "iter": 160000, "hook_msgs": {"last_ckpt": "x"}}
    return {"meta": meta, "state_dict": sd, "optimizer": {"state": {}, "param_groups": []}}


def test_convert_mm_checkpoint(tmp_path):
    from ppma.models import convert_mm_checkpoint

    model, official = _official_tiny()
    src = _mm_official(official, outnorms=(32, 64, 96, 128))
    out = convert_mm_checkpoint(src, verbose=False)
    sd = out["state_dict"]
    for k, v in model.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(sd["backbone." + k], v), k
    assert not any(k.startswith("backbone.head") for k in sd)
    assert torch.equal(sd["backbone.out_norms.2.weight"], src["state_dict"]["backbone.outnorm2.weight"])
    for k in ("decode_head.lateral_convs.0.conv.weight", "decode_head.conv_seg.weight",
              "auxiliary_head.convs.0.bn.running_var"):
        assert torch.equal(sd[k], src["state_dict"][k])  # neck/head names are the same in mmseg 1.x / mmdet 3.x
    assert len(sd) == len(src["state_dict"])
    assert out["meta"]["dataset_meta"] == {"classes": ("wall", "building"), "palette": [[120, 120, 120], [180, 120, 120]]}
    assert out["meta"]["converted_from"] == {"mmcv_version": "1.7.2", "iter": 160000}
    again = convert_mm_checkpoint(out, verbose=False)  # idempotent
    assert again["state_dict"].keys() == sd.keys()
    # only plain types: stock mmengine (a weights-only torch.load with no allowlist) reads it
    torch.save(out, tmp_path / "converted.pth")
    torch.load(tmp_path / "converted.pth", weights_only=True)
    with pytest.raises(ValueError, match="backbone"):
        convert_mm_checkpoint({"state_dict": {"neck.x": torch.zeros(1)}})
    bad = {"state_dict": {"backbone.layers.0.blocks.0.relative_bias": torch.zeros(1)}}
    with pytest.raises(ValueError, match="match no PPMA name"):
        convert_mm_checkpoint(bad)


def test_ppma_convert_command(tmp_path, capsys):
    from ppma.models.convert import main

    model, official = _official_tiny()
    torch.save(_mm_official(official, outnorms=(32, 64, 96, 128)), tmp_path / "iter_160000.pth")
    assert main([str(tmp_path / "iter_160000.pth"), str(tmp_path / "mm.pth")]) == 0
    out = torch.load(tmp_path / "mm.pth", weights_only=True)
    assert "backbone.stages.2.blocks.1.attn.q.weight" in out["state_dict"]
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in official.items()}
    torch.save({"models": official, "model_ema": ema}, tmp_path / "best.pth")
    assert main([str(tmp_path / "best.pth"), str(tmp_path / "cls.safetensors")]) == 0
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "cls.safetensors"))
    assert torch.equal(sd["stem.conv1.weight"], ema["patch_embed.proj.0.weight"])  # EMA by default
    assert main([str(tmp_path / "best.pth"), str(tmp_path / "raw.pth"), "--key", "models"]) == 0
    raw = torch.load(tmp_path / "raw.pth", weights_only=True)["state_dict"]
    assert torch.equal(raw["stem.conv1.weight"], official["patch_embed.proj.0.weight"])
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing.pth"), str(tmp_path / "x.pth")])
