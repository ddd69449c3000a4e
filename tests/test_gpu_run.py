"""The GPU script (benchmarks/gpu_run.sh, benchmarks/gpu_run.py) in its CPU smoke mode, its pieces, and
``ppma-benchmark --compile`` (ppma.train.benchmark.compile_for_benchmark): what runs here so that the script works
the first time a GPU machine runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_run  # noqa: E402

import ppma  # noqa: E402


def _parts(out) -> dict:
    rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(out, "parts.tsv"))]
    return {r[0]: r[1] for r in rows}


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_smoke_run_of_the_script(tmp_path):
    """Every Python part of the script runs on the CPU (tiny shapes, no build) and writes its table, naming the
    device; the build and the compiled models are skipped and say why; the summary comes last."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHON=sys.executable, GPU_RUN_SMOKE="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_run.sh"), str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    parts = _parts(out)
    assert {k: parts[k] for k in ("env", "check", "graphs", "time", "models", "ops")} == dict.fromkeys(
        ("env", "check", "graphs", "time", "models", "ops"), "ok"), (parts, res.stdout[-3000:])
    assert parts["build"] == "skipped" and parts["compiled"] == "skipped"
    check = json.loads((out / "check.json").read_text())
    assert {r["op"] for r in check["rows"]} == set(gpu_run.OPS) and all(r["ok"] for r in check["rows"])
    # every op is reported as without a next kernel, or compared: the smoke run compares anyway
    assert all(r["deterministic"] and r["bitwise_equal_to_old"] for r in check["rows"])
    timing = json.loads((out / "time.json").read_text())
    assert {r["op"] for r in timing["rows"]} == set(gpu_run.OPS)
    assert all(r["times"][f"{v} {p}"]["median_ms"] > 0 for r in timing["rows"] for v in ("old", "new")
               for p in ("fwd", "bwd"))
    assert all(r["kernels"]["new bwd"] for r in timing["rows"])
    ops_rows = json.loads((out / "ops.json").read_text())["rows"]
    assert "ppma fused, next kernel" in {r["impl"] for r in ops_rows}
    assert json.loads((out / "models_eager.json").read_text())["rows"][0]["infer_images_per_sec"] > 0
    summary = (out / "summary.md").read_text()
    cpu = gpu_run.environment(torch.device("cpu"))["device_name"]
    for name in ("check.md", "time.md", "env.md", "summary.md"):
        assert cpu in (out / name).read_text(), name
    assert "| check | ok |" in summary and "| build | skipped |" in summary
    assert summary in res.stdout  # printed last


def test_script_without_arguments_prints_its_usage():
    res = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_run.sh")], capture_output=True, text=True)
    assert res.returncode == 2 and "--smoke" in res.stdout


def test_next_kernel_status(tmp_path):
    """A next kernel is present when a CUDA launcher reads its option; the tables say which file, or that the op
    is unchanged."""
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "csrc" / "cuda" / "a.cu").write_text(
        "if (get_option(Option::kCudaNextCrissCrossAttention) == 1) launch_next();\n")
    present, why = gpu_run.next_kernel_status("criss_cross_attention", root=str(tmp_path))
    assert present and "csrc/cuda/a.cu" in why
    present, why = gpu_run.next_kernel_status("polyline_linear_attention", root=str(tmp_path))
    assert not present and "unchanged" in why
    # the option names the script toggles are the library's
    for op, spec in gpu_run.OPS.items():
        assert ppma.config.get_internal_option(spec.option) in (0, 1)


def test_comparisons():
    a = torch.tensor([1.0, 2.0, float("-inf")])
    assert gpu_run.rel_err(a, a.clone()) == 0.0
    assert gpu_run.rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == pytest.approx(0.5 / 7.25 ** 0.5)
    nan = torch.tensor([1.0, float("nan")])
    assert gpu_run.rel_err(nan, nan) != gpu_run.rel_err(nan, nan)  # NaN never passes
    assert gpu_run.rel_err(torch.tensor([float("inf")]), torch.tensor([1.0])) != 0
    assert gpu_run.bitwise_equal(nan, nan.clone()) and not gpu_run.bitwise_equal(a, a.half())
    assert not gpu_run.bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))


def test_benchmark_compile_option(monkeypatch):
    """``ppma-benchmark --compile [MODE]``: the mode reaches torch.compile for both phases (inference and
    training), a bad mode is refused, and the table says which mode ran."""
    from ppma.train import benchmark as bm
    from ppma.train.cli.benchmark import _markdown, parse_args

    assert parse_args(["--compile"]).compile == "default" and parse_args([]).compile is None
    assert parse_args(["--compile", "reduce-overhead"]).compile == "reduce-overhead"
    with pytest.raises(SystemExit):
        parse_args(["--compile", "fast"])
    with pytest.raises(ValueError, match="compile mode"):
        bm.compile_for_benchmark(torch.nn.Linear(2, 2), torch.device("cpu"), "fast")
    calls = []

    def fake_compile(model, mode=None, **kw):  # records the call; runs the model eagerly
        calls.append(mode)
        assert kw.get("fullgraph") and kw.get("dynamic") is False  # ppma.compile.compile_model's recipe
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 5))
    r = bm.measure(model, batch_size=2, img_size=8, in_chans=3, num_classes=5, device=torch.device("cpu"),
                   amp_dtype=None, warmup=1, iters=2, train=True, channels_last=False,
                   compile_mode="reduce-overhead")
    # on the CPU ppma's recipe: the inference phase on a frozen copy, the training phase on the model itself
    assert calls == ["reduce-overhead", "reduce-overhead"]
    assert r["infer_images_per_sec"] > 0 and r["train_images_per_sec"] > 0
    # CUDA graphs mark a step per call on CUDA only
    assert bm._cuda_graph_step_marker("reduce-overhead") is torch.compiler.cudagraph_mark_step_begin
    assert bm._cuda_graph_step_marker("max-autotune-no-cudagraphs") is not torch.compiler.cudagraph_mark_step_begin
    # the trainer's AdamW (ppma.train.build.build_optimizer): torch's fused step on the CPU too
    assert bm._optimizer(model).defaults.get("fused") is True
    result = {"env": {"device": "cpu", "torch": "t", "cuda": None, "ppma_extension": True, "date": "d",
                      "cpu_threads": 1},
              "settings": {"batch_size": 2, "img_size": 8, "amp": "none", "warmup": 1, "iters": 2,
                           "compile": "reduce-overhead"}, "rows": []}
    assert "torch.compile, mode reduce-overhead" in _markdown(result)
    result["settings"]["compile"] = None
    assert "; eager" in _markdown(result)
