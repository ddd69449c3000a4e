"""Command-line tools: ppma-eval on a tiny ImageFolder, ppma-benchmark quick run, ppma-visualize PNGs."""

import json
import os

import numpy as np
import pytest
import torch

from ppma._compat import ensure_torchvision

ensure_torchvision()  # timm imports torchvision (see ppma._compat)
pytest.importorskip("timm")

from test_train import _one_thread, tiny_args  # noqa: E402, F401 (_one_thread: an autouse fixture)
from test_train import write_image_folder as _write_image_folder  # noqa: E402

from ppma.train.cli.train import config_from_args, parse_args  # noqa: E402
from ppma.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(config_from_args(parse_args(tiny_args(out, epochs=1))))
    return out / "checkpoint.pth"


def _expected_top1(model, root, img_size, mean, std) -> float:
    """The top-1 accuracy (%) of ``model`` on the square images of ``root/val/class_<c>/*.png`` (label ``c``),
    computed here without the CLI's loader or transforms: PIL bicubic resize of each square image to
    ``img_size`` (with crop_pct 1.0 the eval pipeline's resize + centre crop is exactly that), ``/ 255``,
    ``(x - mean) / std``."""
    from PIL import Image

    xs, ys = [], []
    for cdir in sorted((root / "val").iterdir()):
        for f in sorted(cdir.glob("*.png")):
            img = Image.open(f).convert("RGB")
            assert img.size[0] == img.size[1], "square images only"
            a = np.asarray(img.resize((img_size, img_size), Image.BICUBIC), dtype=np.float32) / 255.0
            xs.append((torch.from_numpy(a).permute(2, 0, 1) - torch.tensor(mean)[:, None, None])
                      / torch.tensor(std)[:, None, None])
            ys.append(int(cdir.name.split("_")[1]))
    with torch.no_grad():
        pred = model.eval()(torch.stack(xs)).argmax(1)
    return 100.0 * (pred == torch.tensor(ys)).float().mean().item()


def test_eval_cli_on_image_folder(tmp_path, tiny_checkpoint):
    from ppma.train.checkpoint import load_model_from_checkpoint
    from ppma.train.cli.evaluate import main

    n = _write_image_folder(tmp_path / "data")
    out = tmp_path / "eval.json"
    assert main(["--checkpoint", str(tiny_checkpoint), "--data", str(tmp_path / "data"), "--num-workers", "0",
                 "--batch-size", "5", "--device", "cpu", "--output", str(out), "--crop-pct", "1.0"]) == 0
    res = json.loads(out.read_text())
    assert res["images"] == n and res["weights"] == "model_ema" and res["kind"] == "ppma-train"
    assert 0.0 <= res["top1"] <= res["top5"] <= 100.0
    # the same number as the loaded model on images decoded, resized and normalised here
    model, info = load_model_from_checkpoint(str(tiny_checkpoint))
    cfg = info["config"]
    assert cfg.data.interpolation == "bicubic"
    assert res["top1"] == pytest.approx(_expected_top1(model, tmp_path / "data", cfg.data.img_size, cfg.data.mean,
                                                       cfg.data.std))


def test_train_imagefolder_with_the_imagenet_recipe(tmp_path):
    """The ImageNet config's pipeline end to end on a tiny ImageFolder: timm transforms with RandAugment and
    random erasing, Mixup/CutMix with SoftTargetCrossEntropy, repeated augmentation, EMA."""
    from ppma.train.cli.train import main

    _write_image_folder(tmp_path / "data", classes=4, per_class=4, size=40, split="train")
    _write_image_folder(tmp_path / "data", classes=4, per_class=2, size=40, split="val")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert main(["--config", os.path.join(root, "configs", "classification", "ppma_tiny_imagenet.yaml"),
                 "--data", str(tmp_path / "data"), "--epochs", "2", "--batch-size", "4", "--amp", "none",
                 "--device", "cpu", "--num-workers", "0", "--output", str(tmp_path / "out"), "--no-progress",
                 "--set", "data.img_size=32", "--set", "data.repeated_aug_round=4",
                 "--set", "model.overrides={embed_dims: [8, 16, 16, 16], depths: [1, 1, 1, 1],"
                 " num_heads: [1, 2, 2, 2]}", "--impl", "reference"]) == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert records[0]["lr"] == pytest.approx(1e-6)  # warm-up from 1e-6, stepped at the epoch end (docs/model.md §6.1)
    assert all(r["test_ema_acc1"] is not None for r in records)


def test_eval_cli_rejects_unknown_key(tmp_path, tiny_checkpoint):
    from ppma.train.cli.evaluate import main

    _write_image_folder(tmp_path / "data", classes=4, per_class=1)
    with pytest.raises(KeyError, match="no weights under key"):
        main(["--checkpoint", str(tiny_checkpoint), "--data", str(tmp_path / "data"), "--key", "nope",
              "--num-workers", "0", "--device", "cpu"])


def test_eval_cli_official_checkpoint(tmp_path):
    """An official-format checkpoint (official key names, under 'models' and 'model_ema') goes through
    ppma.models.convert_official_state_dict; the EMA weights are used by default."""
    import ppma
    from ppma.models import convert_to_official_state_dict
    from ppma.train.cli.evaluate import main

    n = _write_image_folder(tmp_path / "data", classes=3, per_class=2, size=32)
    torch.manual_seed(0)
    raw, ema = ppma.create_model("ppma_tiny", num_classes=3), ppma.create_model("ppma_tiny", num_classes=3)
    torch.save({"models": convert_to_official_state_dict(raw.state_dict()),
                "model_ema": convert_to_official_state_dict(ema.state_dict()), "epoch": 299},
               tmp_path / "best.pth")
    out = tmp_path / "eval.json"
    assert main(["--checkpoint", str(tmp_path / "best.pth"), "--model", "ppma_tiny", "--num-classes", "3",
                 "--data", str(tmp_path / "data"), "--img-size", "32", "--crop-pct", "1.0", "--num-workers", "0",
                 "--device", "cpu", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "official" and res["weights"] == "model_ema" and res["images"] == n
    assert res["top1"] == pytest.approx(_expected_top1(ema, tmp_path / "data", 32, (0.485, 0.456, 0.406),
                                                       (0.229, 0.224, 0.225)))


def test_benchmark_cli_quick(tmp_path):
    from ppma.train.cli.benchmark import main

    extra = ["--override", "embed_dims=[8, 16, 16, 16]", "--override", "depths=[1, 1, 1, 1]",
             "--override", "num_heads=[1, 2, 2, 2]", "--override", "mixer=[criss_cross, criss_cross, full, full]"]
    out = tmp_path / "bench"
    assert main(["--batch-size", "2", "--img-size", "32", "--warmup", "1", "--iters", "2", "--device", "cpu",
                 "--num-classes", "10", "--output", str(out), *extra]) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert [r["impl"] for r in res["rows"]] == ["fused", "reference"]
    for r in res["rows"]:
        assert r["infer_images_per_sec"] > 0 and r["train_images_per_sec"] > 0
        # CPU: the RSS high-water mark above the RSS before each phase, every phase in a fresh process
        assert r["infer_peak_mem_mib"] >= 0 and r["train_peak_mem_mib"] >= 0
    assert "cpu_capability" in res["env"] and "RSS high-water mark" in (tmp_path / "bench.md").read_text()
    assert res["settings"]["batch_size"] == 2 and res["env"]["torch"] == torch.__version__
    md = (tmp_path / "bench.md").read_text()
    assert "| model | impl |" in md and md.count("\n| ") >= 3


# ------------------------------------------------------------------------------------------------ visualize


@pytest.mark.parametrize("shape", [(5, 7), (1, 4), (6, 1)])
def test_mask_row_matches_dense_polyline_mask(shape):
    from ppma.ops.reference import polyline_mask
    from ppma.train.visualize import mask_row

    H, W = shape
    g = torch.Generator().manual_seed(0)
    la = -torch.rand(H, W, generator=g, dtype=torch.float64)
    lb = -torch.rand(H, W, generator=g, dtype=torch.float64)
    L = polyline_mask(la[None, :, :, None], lb[None, :, :, None])[0, 0]  # [N, N]
    for i, j in [(0, 0), (H - 1, W - 1), (H // 2, W // 3)]:
        p = i * W + j
        torch.testing.assert_close(mask_row(la, lb, (i, j)).reshape(-1), L[p], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mask_row(la, lb, (i, j), transpose=True).reshape(-1), L[:, p], rtol=1e-12,
                                   atol=1e-12)
    with pytest.raises(ValueError, match="outside"):
        mask_row(la, lb, (H, 0))


def test_attention_row_is_the_models_attention():
    from ppma.ops.reference import criss_cross_attention_ref, polyline_attention_ref, polyline_log_mask
    from ppma.train.visualize import attention_row

    H, W, d = 4, 5, 8
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, H, W, d, generator=g, dtype=torch.float64)
    la = -torch.rand(H, W, generator=g, dtype=torch.float64)
    lb = -torch.rand(H, W, generator=g, dtype=torch.float64)
    query = (2, 3)
    p = query[0] * W + query[1]
    # full attention: 0.5 softmax(S + M) + 0.5 softmax(S + M^T), row p (docs/model.md §1.6)
    M = polyline_log_mask(la[None, :, :, None], lb[None, :, :, None])[0, 0]
    S = (q.reshape(-1, d) @ k.reshape(-1, d).T) * d**-0.5
    expect = 0.5 * torch.softmax(S[p] + M[p], -1) + 0.5 * torch.softmax(S[p] + M[:, p], -1)
    got = attention_row(q, k, la, lb, query, mixer="full")
    torch.testing.assert_close(got.reshape(-1), expect)
    # criss-cross: weights reproduce the operator's output for any v, and sum to 1
    got = attention_row(q, k, la, lb, query, mixer="criss_cross")
    v = torch.randn(1, H, W, 1, 3, generator=g, dtype=torch.float64)
    out = criss_cross_attention_ref(q[None, :, :, None], k[None, :, :, None], v, la[None, :, :, None],
                                    lb[None, :, :, None])
    torch.testing.assert_close(got.reshape(-1) @ v.reshape(-1, 3), out[0, query[0], query[1], 0])
    assert got.sum().item() == pytest.approx(1.0)
    # full attention: the weights reproduce polyline_attention_ref's output for any v
    full = attention_row(q, k, la, lb, query, mixer="full")
    out = polyline_attention_ref(q[None, :, :, None], k[None, :, :, None], v, la[None, :, :, None],
                                 lb[None, :, :, None])
    torch.testing.assert_close(full.reshape(-1) @ v.reshape(-1, 3), out[0, query[0], query[1], 0])


def scan_mask_row(log_decay, seq, query):
    """``exp(M[query, t])`` for every token ``t`` of the 1-D mask along the token sequence ``seq`` (docs/ops.md,
    "Masks"): the product of the decays of the tokens after the earlier of the two up to the later one."""
    H, W = log_decay.shape
    pos = {tok: n for n, tok in enumerate(seq)}
    row = torch.empty(H, W, dtype=log_decay.dtype)
    for tok in seq:
        lo, hi = sorted((pos[query], pos[tok]))
        prod = torch.ones((), dtype=log_decay.dtype)
        for n in range(lo + 1, hi + 1):
            prod = prod * log_decay[seq[n]].exp()
        row[tok] = prod
    return row


def assert_hilbert_like(seq, H, W):
    """A generalised Hilbert curve as ppma.nn.masks.hilbert_order documents it: every token once, from (0, 0),
    4-neighbour steps except at most one diagonal one."""
    assert sorted(seq) == [(i, j) for i in range(H) for j in range(W)] and seq[0] == (0, 0)
    steps = [(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(seq, seq[1:])]
    assert set(steps) <= {(0, 1), (1, 0), (1, 1)} and steps.count((1, 1)) <= 1, steps


@pytest.mark.parametrize("mask", ["none", "manhattan", "v2h", "shared", "cross_scan", "hilbert"])
def test_visualize_ablation_masks(mask):
    """For every ablation mask: the attention row is the row of the mask's own attention (one-hot values through
    ppma.nn.masks.masked_attention, in both modes) and sums to 1; the mask rows are the dense definition's
    (docs/ops.md "Masks")."""
    from ppma.nn.masks import hilbert_order, masked_attention
    from ppma.ops.reference import polyline_mask
    from ppma.train.visualize import attention_row, mask_rows

    H, W, d = 4, 5, 8
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, H, W, d, generator=g, dtype=torch.float64)
    la = -torch.rand(H, W, generator=g, dtype=torch.float64)
    lb = la.clone() if mask == "shared" else -torch.rand(H, W, generator=g, dtype=torch.float64)
    if mask in ("none", "manhattan"):  # what ConstantDecay gives the attention
        la = lb = torch.full((H, W), 0.0 if mask == "none" else -0.3, dtype=torch.float64)
    query = (1, 3)
    p = query[0] * W + query[1]
    v = torch.randn(1, H, W, 1, 3, generator=g, dtype=torch.float64)
    for mode in ("full", "criss_cross"):
        row = attention_row(q, k, la, lb, query, mixer=mode, mask=mask)
        out = masked_attention(mask, mode, q[None, :, :, None], k[None, :, :, None], v, la[None, :, :, None],
                               lb[None, :, :, None], d**-0.5)
        torch.testing.assert_close(row.reshape(-1) @ v.reshape(-1, 3), out[0, query[0], query[1], 0])
        assert row.sum().item() == pytest.approx(1.0)
    m_a, m_b, names = mask_rows(mask, la, lb, query)
    assert len(names) == 3
    if mask in ("cross_scan", "hilbert"):
        # the token sequences of the two scans as (i, j) lists, then the 1-D masks by explicit sums
        if mask == "cross_scan":
            seq_a = [(i, j) for i in range(H) for j in range(W)]  # row-major
            seq_b = [(i, j) for j in range(W) for i in range(H)]  # column-major
        else:
            seq_a = [divmod(int(t), W) for t in hilbert_order(H, W)]
            seq_b = [divmod(int(t), H)[::-1] for t in hilbert_order(W, H)]  # the transposed map's curve
            for seq in (seq_a, seq_b):
                assert_hilbert_like(seq, H, W)
        expect_a = scan_mask_row(la, seq_a, query).reshape(-1)
        expect_b = scan_mask_row(lb, seq_b, query).reshape(-1)
    else:
        L = polyline_mask(la[None, :, :, None], lb[None, :, :, None])[0, 0]
        expect_a, expect_b = L[p], (L[p] if mask == "v2h" else L[:, p])
        if mask == "manhattan":  # RMT's gamma^(|di| + |dj|)
            i, j = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
            dist = ((i - query[0]).abs() + (j - query[1]).abs()).reshape(-1).double()
            torch.testing.assert_close(expect_a, torch.exp(-0.3 * dist))
    torch.testing.assert_close(m_a.reshape(-1), expect_a)
    torch.testing.assert_close(m_b.reshape(-1), expect_b)


def test_visualize_cli_with_an_ablation_mask(tmp_path):
    from ppma.train.cli.visualize import main

    cfg = tmp_path / "hilbert.yaml"
    cfg.write_text("model:\n  name: ppma_tiny\n  overrides:\n    mask: hilbert\n    embed_dims: [8, 16, 16, 16]\n"
                   "    depths: [1, 1, 1, 1]\n    num_heads: [1, 2, 2, 2]\ndata:\n  dataset: digits\n  img_size: 32\n")
    out = tmp_path / "vis"
    assert main(["--digits-index", "0", "--config", str(cfg), "--output", str(out), "--block", "0"]) == 0
    assert sorted(p.name.split("_")[0] for p in out.glob("*.png")) == ["attn", "decay", "mask"]


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_capture_attention_hooks_every_layer(impl):
    """capture_attention reads each attention layer's operator inputs with forward hooks on its
    MaskedAttentionOp, whichever implementation runs, and removes the hooks afterwards."""
    import ppma
    from ppma.nn import MaskedAttentionOp
    from ppma.train.visualize import capture_attention

    model = ppma.create_model("ppma_tiny", num_classes=4, embed_dims=(8, 16, 16, 16), depths=(1, 2, 1, 1),
                              num_heads=(1, 2, 2, 2)).eval()
    ops = [m for m in model.modules() if isinstance(m, MaskedAttentionOp)]
    with torch.no_grad(), ppma.ops.use_impl(impl), capture_attention(model) as rec:
        model(torch.randn(1, 3, 40, 56))
    assert [c["kind"] for c in rec["calls"]] == [m.mixer for m in ops] == ["criss_cross"] * 3 + ["full"] * 2
    assert [c["q"].shape[1:3] for c in rec["calls"]] == [(10, 14)] + [(5, 7)] * 2 + [(3, 4), (2, 2)]
    assert all(c["scale"] == 1.0 for c in rec["calls"]) and len(rec["decays"]) == 5
    assert not any(m._forward_hooks for m in model.modules())


def test_visualize_cli_writes_pngs(tmp_path, tiny_checkpoint):
    from PIL import Image

    from ppma.train.cli.visualize import main

    img = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 30, 3), dtype=np.uint8)).save(img)
    out = tmp_path / "vis"
    assert main(["--image", str(img), "--checkpoint", str(tiny_checkpoint), "--output", str(out),
                 "--query", "1", "2"]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 3 and [n.split("_")[0] for n in pngs] == ["attn", "decay", "mask"]
    for p in out.glob("*.png"):
        assert Image.open(p).size[0] > 100
