"""Command-line tools: ppma-eval on a tiny ImageFolder, ppma-benchmark quick run, ppma-visualize PNGs."""

import json
import os

import numpy as np
import pytest
import torch

from ppma._compat import ensure_torchvision

ensure_torchvision()  # timm imports torchvision (see ppma._compat)
pytest.importorskip("timm")

from test_train import TESTS, model_args, tiny_args  # noqa: E402

from ppma.train.main import config_from_args, parse_args, train  # noqa: E402


@pytest.fixture(autouse=True)
def _standin_importable(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(config_from_args(parse_args(tiny_args(out, epochs=1))))
    return out / "checkpoint.pth"


def _write_image_folder(root, classes=4, per_class=3, size=20):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / "val" / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return classes * per_class


def test_eval_cli_on_image_folder(tmp_path, tiny_checkpoint):
    from ppma.train.evaluate import load_model_from_checkpoint, main

    n = _write_image_folder(tmp_path / "data")
    out = tmp_path / "eval.json"
    assert main(["--checkpoint", str(tiny_checkpoint), "--data", str(tmp_path / "data"), "--num-workers", "0",
                 "--batch-size", "5", "--device", "cpu", "--output", str(out), "--crop-pct", "1.0"]) == 0
    res = json.loads(out.read_text())
    assert res["images"] == n and res["weights"] == "model_ema" and res["kind"] == "ppma-train"
    assert 0.0 <= res["top1"] <= res["top5"] <= 100.0
    # the same numbers as evaluating the loaded model directly on the same tensors
    from torchvision.datasets import ImageFolder

    from ppma.train.data import build_eval_transform

    model, info = load_model_from_checkpoint(str(tiny_checkpoint))
    cfg = info["config"]
    ds = ImageFolder(str(tmp_path / "data" / "val"),
                     build_eval_transform(cfg.data.img_size, 1.0, cfg.data.interpolation, cfg.data.mean, cfg.data.std))
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.tensor(ds.targets)
    with torch.no_grad():
        top1 = 100.0 * (model.eval()(x).argmax(1) == y).float().mean().item()
    assert res["top1"] == pytest.approx(top1)


def test_eval_cli_rejects_unknown_key(tmp_path, tiny_checkpoint):
    from ppma.train.evaluate import main

    _write_image_folder(tmp_path / "data", classes=4, per_class=1)
    with pytest.raises(KeyError, match="no weights under key"):
        main(["--checkpoint", str(tiny_checkpoint), "--data", str(tmp_path / "data"), "--key", "nope",
              "--num-workers", "0", "--device", "cpu"])


def test_benchmark_cli_quick(tmp_path):
    from ppma.train.benchmark import main

    args = model_args()
    extra = []
    if "model.factory=test_train_standin:create_standin" in args:
        extra = ["--factory", "test_train_standin:create_standin"]
    else:
        extra = ["--override", "embed_dims=[8, 16, 16, 16]", "--override", "depths=[1, 1, 1, 1]",
                 "--override", "num_heads=[1, 2, 2, 2]"]
    out = tmp_path / "bench"
    assert main(["--batch-size", "2", "--img-size", "32", "--warmup", "1", "--iters", "2", "--device", "cpu",
                 "--num-classes", "10", "--output", str(out), *extra]) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert [r["impl"] for r in res["rows"]] == ["fused", "reference"]
    for r in res["rows"]:
        assert r["infer_images_per_sec"] > 0 and r["train_images_per_sec"] > 0
        assert r["infer_peak_mem_mib"] is None  # CPU: not measured
    assert res["settings"]["batch_size"] == 2 and res["env"]["torch"] == torch.__version__
    md = (tmp_path / "bench.md").read_text()
    assert "| model | impl |" in md and md.count("\n| ") >= 3
