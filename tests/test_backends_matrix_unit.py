"""``ppma.backends`` names the CPU and the unit its bf16 matrix products run on (AMX, AVX-512 BF16, AVX-512
emulation), and ``ppma-benchmark --device cpu`` prints it (README "CPU", docs/compile.md)."""

from __future__ import annotations

import pytest
import torch

from ppma import backends

BF16_ONEDNN = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
_NO_FLAGS = {n: False for n in ("amx_tile", "amx_bf16", "amx_fp16", "amx_int8", "avx512_bf16", "avx512_fp16",
                                "avx512_vnni", "avx512_core", "avx2")}


def _proc_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    pytest.skip("no /proc/cpuinfo flags on this OS")


def test_matrix_unit_follows_the_cpu_flags():
    flags = _proc_flags()
    unit = backends.cpu_matrix_unit()
    assert unit in backends.MATRIX_UNITS
    info = backends.cpu_matrix_units()
    assert info["matrix_unit"] == unit and info["cpu"] == backends.cpu_name()
    assert info["amx_bf16"] == ("amx_bf16" in flags) and info["avx512_bf16"] == ("avx512_bf16" in flags)
    assert info["avx512_vnni"] == ("avx512_vnni" in flags)
    if not BF16_ONEDNN:
        assert unit == "none"
    elif "amx_bf16" in flags and "amx_tile" in flags and info["amx_usable"]:
        assert unit == "amx"
    elif "avx512_bf16" in flags:
        assert unit == "avx512_bf16"
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert unit == "avx512"
    if "amx_bf16" not in flags:
        assert unit != "amx" and not info["amx_usable"]


@pytest.mark.parametrize("flags, expected", [
    ({"amx_tile": True, "amx_bf16": True, "avx512_bf16": True, "avx512_core": True, "avx2": True}, "amx"),
    ({"avx512_bf16": True, "avx512_core": True, "avx2": True}, "avx512_bf16"),
    ({"avx512_core": True, "avx512_vnni": True, "avx2": True}, "avx512"),
    ({"avx2": True}, "avx2"),
    ({}, "none"),
])
def test_matrix_unit_decision(monkeypatch, flags, expected):
    # the decision on other CPUs (Sapphire Rapids, Zen 4, Ice Lake, Zen 3): flags as torch's cpuinfo reports them
    if not BF16_ONEDNN:
        pytest.skip("oneDNN has no bf16 kernels in this torch build / on this CPU")
    full = {**_NO_FLAGS, **flags}
    monkeypatch.setattr(backends, "_cpu_flags", lambda: full)
    monkeypatch.setattr(backends, "_amx_usable", lambda: full["amx_tile"] and full["amx_bf16"])
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert backends.cpu_matrix_unit() == expected
    # oneDNN's own cap lowers the unit, never raises it
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert backends.cpu_matrix_unit() == ("avx512_bf16" if expected == "amx" else expected)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert backends.cpu_matrix_unit() == expected


def test_matrix_unit_none_without_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert backends.cpu_matrix_unit() == "none"


def test_cpu_name_and_summary():
    name = backends.cpu_name()
    assert isinstance(name, str) and name and name != "unknown CPU"
    summary = backends.cpu_summary()
    assert summary.startswith(f"CPU: {name}; bf16 products (oneDNN): ")
    words = {"amx": "AMX", "avx512_bf16": "AVX-512 BF16", "avx512": "emulated", "avx2": "emulated",
             "none": "ATen"}[backends.cpu_matrix_unit()]
    assert words in summary
    if backends.cpu_matrix_units()["ppma_kernels"] is not None:
        assert f"ppma kernels: {backends.cpu_capability()}" in summary
    # bf16 products without bf16 instructions: the fused layers widen them (ppma.nn.layers.bf16_products_widened)
    assert backends.cpu_bf16_widened() == (backends.cpu_matrix_unit() in ("avx512", "avx2"))
    assert backends.cpu_matrix_units()["ppma_bf16_widened"] == backends.cpu_bf16_widened()
    assert ("oneDNN float32 on bf16-rounded values" in summary) == backends.cpu_bf16_widened()
    # fp16 autocast without oneDNN's fp16 kernels: the model widens its products (ppma.nn.layers.fp16_products_widened)
    info = backends.cpu_matrix_units()
    assert backends.cpu_fp16_widened() == (not info["onednn_fp16"]) == info["ppma_fp16_widened"]
    assert ("float32 on fp16-rounded values" in summary) == backends.cpu_fp16_widened()


def test_fp16_widened_without_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert backends.cpu_fp16_widened()



def test_benchmark_env_names_cpu_and_matrix_unit():
    from ppma.train.cli import benchmark

    env = benchmark._env(torch.device("cpu"))
    assert env["cpu"] == backends.cpu_name() and env["matrix_unit"] == backends.cpu_matrix_unit()
    assert env["cpu_summary"] == backends.cpu_summary()
