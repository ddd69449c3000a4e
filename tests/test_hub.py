"""``pretrained=True`` through the Hugging Face hub (``ppma.models.hub``, docs/model.md §5.2), without network: an
official-format ``best.pth`` (written from the official-like model, ``tests/official_like.py``) is placed in a local
hub cache, and a fresh process with ``HF_HUB_OFFLINE=1`` builds the models from it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import official_like  # noqa: E402
from test_models_official import randomize_  # noqa: E402

from ppma.models import hub  # noqa: E402

warnings.filterwarnings("ignore", message="ppma._C is not available")
pytest.importorskip("huggingface_hub")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: os.PathLike, filename: str, checkpoint, repo_id: str = hub.HF_REPO_ID) -> str:
    """Lay ``checkpoint`` out as the hub client caches a download of ``main``: ``models--<owner>--<name>/``
    with ``refs/main`` holding the commit and ``snapshots/<commit>/<filename>`` the file."""
    repo = os.path.join(os.fspath(cache), "models--" + repo_id.replace("/", "--"))
    path = os.path.join(repo, "snapshots", COMMIT, *filename.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(checkpoint, path)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    return path


def official_best_pth(model: torch.nn.Module, raw: dict) -> dict:
    """The layout of the official ``best.pth`` (docs/model.md §5.2): raw weights under ``models``, EMA under
    ``model_ema``, with optimiser state, an ``argparse.Namespace`` and the accuracies beside them."""
    return {
        "models": raw,
        "model_ema": model.state_dict(),
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-5, "params": [0, 1]}]},
        "lr_scheduler": {"t_initial": 300, "warmup_t": 5, "base_values": [1e-3]},
        "epoch": 299,
        "scaler": {"scale": 65536.0, "growth_factor": 2.0},
        "args": argparse.Namespace(model="PPMAViT_T", batch_size=128, drop_path=0.05, output_dir="out"),
        "max_accuracy": 82.582,
        "max_accuracy_ema": 82.602,
    }


_CHILD = r"""
import json, sys, torch, ppma.models, timm  # ppma.models first: it lets a CUDA torchvision import beside a CPU torch
x, kw = torch.load(sys.argv[1]), json.loads(sys.argv[3])
out = {}
with torch.no_grad():
    out["timm"] = timm.create_model("ppma_tiny", pretrained=True, **kw).eval()(x)
    out["ppma"] = ppma.create_model("ppma_tiny", pretrained=True, **kw).eval()(x)
    feats = timm.create_model("ppma_tiny", pretrained=True, features_only=True, out_indices=(3,), **kw).eval()(x)
    out["features"] = feats[0]
try:  # a file that is not in the cache: offline, this must fail (and name the file), not build a random model
    ppma.create_model("ppma_small", pretrained=True)
except Exception as exc:
    out["missing"] = f"{type(exc).__name__}: {exc}"
torch.save(out, sys.argv[2])
"""


def _run_offline(cache, *args, code=_CHILD):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=os.fspath(cache), PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# the full PPMA-T (slow on 2 cores), or PPMA-T's file holding a smaller model of the same family: the hub
# mechanism is the same, and create_model's overrides describe the smaller model
SMALL_KW = dict(embed_dims=(32, 64, 96, 128), depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4))
CASES = [pytest.param({}, marks=pytest.mark.slow, id="ppma_tiny"), pytest.param(SMALL_KW, id="small_config")]


@pytest.mark.parametrize("kw", CASES)
def test_pretrained_from_offline_hub_cache(tmp_path, kw):
    """official-format best.pth in a hub cache -> pretrained=True (timm and ppma) -> the official EMA logits"""
    pytest.importorskip("timm")
    torch.manual_seed(0)
    official = official_like.PPMAViT(**{**official_like.OFFICIAL_VARIANTS["ppma_tiny"], **kw}).eval()
    randomize_(official, seed=3)
    raw = {k: v + 0.5 if v.is_floating_point() and not k.endswith("angle") else v
           for k, v in official.state_dict().items()}
    write_hub_cache(tmp_path / "hub", hub.CLASSIFICATION_FILES["ppma_tiny"], official_best_pth(official, raw))
    x = torch.randn(2, 3, 64, 80, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    proc = _run_offline(tmp_path / "hub", tmp_path / "x.pt", tmp_path / "out.pt", json.dumps(kw))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model_ema" in proc.stderr  # which entry was loaded is reported
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = official(x)  # the EMA weights: what the paper reports and what pretrained=True loads
        feats = official.patch_embed(x)
        for layer in official.layers:
            feats = layer(feats)
    for name in ("timm", "ppma"):
        assert _rel_err(out[name], expected) < 1e-5, name
    assert _rel_err(out["features"], feats.permute(0, 3, 1, 2)) < 1e-5
    assert out["missing"].startswith("FileNotFoundError") and "PPMA_S_202504021000/best.pth" in out["missing"]


def test_download_official_names_and_hf_uris(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "_hf_hub_download", lambda *a: calls.append(a) or "path")
    assert hub.download_official("ppma_base", revision="v1") == "path"
    assert calls[-1][:3] == (hub.HF_REPO_ID, "checkpoints/classification/PPMA_B_202504101400/best.pth", "v1")
    hub.download_official("mask_rcnn_ppma_base_fpn_3x_coco")
    assert calls[-1][1] == "checkpoints/detection/mask_rcnn_ppma_base_fpn_3x_coco/epoch_36.pth"
    hub.download_hf("hf://ZhongchenZhao/PPMA/checkpoints/a/b.pth@abc")
    assert calls[-1][:3] == ("ZhongchenZhao/PPMA", "checkpoints/a/b.pth", "abc")
    with pytest.raises(ValueError, match="unknown checkpoint"):
        hub.download_official("ppma_huge")
    with pytest.raises(ValueError, match="hf://"):
        hub.download_hf("hf://ZhongchenZhao/PPMA")
    for stem in hub.DOWNSTREAM_FILES:  # every downstream entry names a config of this repository
        folder = "segmentation" if stem.startswith("upernet") else "detection"
        assert os.path.isfile(os.path.join(ROOT, "configs", folder, stem + ".py")), stem


class _MirrorHandler(__import__("http.server").server.BaseHTTPRequestHandler):
    """The two requests huggingface_hub makes for a file: HEAD /<repo>/resolve/<revision>/<path> (commit, ETag and
    size in the headers), then GET for the bytes. Serves ``files`` ({path in repo: bytes}) and counts the GETs."""

    files: dict = {}
    gets: list = []

    def _file(self):
        prefix = f"/{hub.HF_REPO_ID}/resolve/main/"
        path = self.path.split("?")[0]
        return self.files.get(path[len(prefix):]) if path.startswith(prefix) else None

    def _headers(self, data):
        import hashlib

        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()

    def do_HEAD(self):  # noqa: N802
        data = self._file()
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()
            return
        self._headers(data)

    def do_GET(self):  # noqa: N802
        data = self._file()
        if data is None:
            self.send_response(404)
            self.end_headers()
            return
        type(self).gets.append(self.path)
        self._headers(data)
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_download_through_a_mirror_and_cache(tmp_path):
    """HF_ENDPOINT pointing at a local mirror: the first pretrained=True downloads into the hub cache layout,
    later ones (ppma and timm) read the cache."""
    import http.server
    import io
    import threading

    pytest.importorskip("timm")
    official = official_like.PPMAViT(**{**official_like.OFFICIAL_VARIANTS["ppma_tiny"], **SMALL_KW}).eval()
    randomize_(official, seed=4)
    buf = io.BytesIO()
    torch.save(official_best_pth(official, official.state_dict()), buf)
    _MirrorHandler.files = {hub.CLASSIFICATION_FILES["ppma_tiny"]: buf.getvalue()}
    _MirrorHandler.gets = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MirrorHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = r"""
import json, sys, torch, ppma.models, timm
kw = json.loads(sys.argv[1])
x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    a = ppma.create_model("ppma_tiny", pretrained=True, **kw).eval()(x)
    b = timm.create_model("ppma_tiny", pretrained=True, **kw).eval()(x)
torch.save({"x": x, "a": a, "b": b}, sys.argv[2])
"""
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
               HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_DISABLE_XET="1", PYTHONPATH=ROOT)
    env.pop("HF_HUB_OFFLINE", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(SMALL_KW), str(tmp_path / "out.pt")], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_MirrorHandler.gets) == 1, _MirrorHandler.gets  # downloaded once, then read from the cache
    cached = tmp_path / "hub" / "models--ZhongchenZhao--PPMA" / "snapshots" / COMMIT / hub.CLASSIFICATION_FILES["ppma_tiny"]
    assert cached.exists() and (tmp_path / "hub" / "models--ZhongchenZhao--PPMA" / "refs" / "main").read_text() == COMMIT
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = official(out["x"])
    assert _rel_err(out["a"], expected) < 1e-5 and _rel_err(out["b"], expected) < 1e-5
