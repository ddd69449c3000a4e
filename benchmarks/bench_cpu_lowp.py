"""bf16 / fp16 attention ops on the CPU: ppma's own SIMD products against torch's CPU batch-reduce GEMM on plain
operands and, where oneDNN generates it (``ppma.backends.cpu_lowp_vnni_available``), its micro-kernel on VNNI-packed
operands (the internal option ``cpu_lowp_products``, docs/performance.md "bf16 and fp16 on the CPU"), with float32 as
the baseline, at PPMA-T's stages for 224x224 inputs (the shapes from the model config): polyline_attention at its
"full" stages (stage 3: 14x14, 8 heads, d = 32; stage 4: 7x7, 16 heads, d = 32), criss_cross_attention at its
"criss_cross" stages (stage 1: 56x56, 4 heads, d = 16; stage 2: 28x28, 4 heads, d = 32).

Per case, polyline_attention: the inference op (``polyline_attention_inference``), the training forward
(``polyline_attention``: out, out_v2h, lse) and its backward (``polyline_attention_backward``), each timed alone;
criss_cross_attention: its forward (``criss_cross_attention``: out, lse) and the forward followed by its backward
(``criss_cross_attention_backward``). The configurations run in interleaved rounds in one process; every time is the
minimum over the rounds and the repeats inside them, so that a busy machine slows all configurations alike. Prints a
markdown table per op and ``ppma.backends.cpu_summary()``.

Usage: ``python benchmarks/bench_cpu_lowp.py [--ops polyline,criss_cross] [--batch 8] [--threads 1] [--rounds 3]
[--repeat 3]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from ppma import backends, config  # noqa: E402
from ppma.models.ppma import DEFAULT_MIXER, MODEL_CONFIGS  # noqa: E402

# (label, dtype, cpu_lowp_products); the VNNI micro-kernel's columns (3) only where it runs (main())
CONFIGS = [("fp32", torch.float32, 0), ("bf16 simd", torch.bfloat16, 1), ("bf16 brgemm", torch.bfloat16, 2),
           ("bf16 brgemm_vnni", torch.bfloat16, 3), ("fp16 simd", torch.float16, 1), ("fp16 brgemm", torch.float16, 2),
           ("fp16 brgemm_vnni", torch.float16, 3)]
# op -> (PPMA-T's mixer of the stages it runs, the parts timed)
OPS = {"polyline": ("full", ("inference", "forward", "backward")),
       "criss_cross": ("criss_cross", ("forward", "forward+backward"))}


def _stages(mixer: str, img: int = 224):
    """PPMA-T's stages whose token mixer is ``mixer``: (name, (H, W, heads, d, dv)) at ``img`` x ``img`` inputs."""
    cfg = MODEL_CONFIGS["ppma_tiny"]
    out = []
    for i, m in enumerate(cfg.mixer or DEFAULT_MIXER):
        if m == mixer:
            side, heads = img // 4 >> i, cfg.num_heads[i]
            d = cfg.embed_dims[i] // heads
            out.append((f"stage{i + 1}", (side, side, heads, d, d)))
    return out


def _case(B, shape, dtype):
    H, W, G, d, dv = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, W, G, d, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, H, W, G, dv, generator=gen).to(dtype)
    la, lb = (-torch.rand(B, H, W, G, generator=gen) for _ in range(2))
    go = torch.randn(B, H, W, G, dv, generator=gen).to(dtype)
    return (q, k, v, la, lb), go, d ** -0.5


def _time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _fns(op, inputs, go, scale):
    """The timed parts of ``op`` on these inputs (run under the products chosen by the caller)."""
    ops = torch.ops.ppma
    if op == "polyline":
        out, out_v2h, lse = ops.polyline_attention(*inputs, scale)
        return {
            "inference": lambda: ops.polyline_attention_inference(*inputs, scale),
            "forward": lambda: ops.polyline_attention(*inputs, scale),
            "backward": lambda: ops.polyline_attention_backward(go, *inputs, out, out_v2h, lse, scale),
        }

    def fwd_bwd():
        _, lse = ops.criss_cross_attention(*inputs, scale)
        ops.criss_cross_attention_backward(go, *inputs, lse, scale)

    return {"forward": lambda: ops.criss_cross_attention(*inputs, scale), "forward+backward": fwd_bwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="polyline,criss_cross", help="comma-separated: polyline, criss_cross")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ops = args.ops.split(",")
    if any(op not in OPS for op in ops):
        ap.error(f"--ops: choose from {', '.join(OPS)}")
    torch.set_num_threads(args.threads)
    configs = [c for c in CONFIGS if c[2] != 3 or backends.cpu_lowp_vnni_available(c[1])]
    best: dict = {}
    for _ in range(args.rounds):
        for op in ops:
            mixer, parts = OPS[op]
            for stage, shape in _stages(mixer):
                for label, dtype, products in configs:
                    inputs, go, scale = _case(args.batch, shape, dtype)
                    with config.internal_option("cpu_lowp_products", products):
                        fns = _fns(op, inputs, go, scale)  # (the polyline forward run once: a warm-up)
                        for part in parts:
                            fns[part]()
                            t = _time(fns[part], args.repeat)
                            key = (op, stage, label, part)
                            best[key] = min(best.get(key, float("inf")), t)
    print(f"{backends.cpu_summary()}; {args.threads} thread(s), batch {args.batch}; cpu_lowp_products default: "
          f"bf16 -> {backends.cpu_lowp_route(torch.bfloat16)}, fp16 -> {backends.cpu_lowp_route(torch.float16)}")
    for op in ops:
        mixer, parts = OPS[op]
        print(f"\n{op}_attention\n")
        print("| stage | part | " + " | ".join(label for label, _, _ in configs) + " | bf16 brgemm / simd |")
        print("|---|---|" + "---|" * (len(configs) + 1))
        for stage, shape in _stages(mixer):
            for part in parts:
                row = [best[op, stage, label, part] * 1e3 for label, _, _ in configs]
                ratio = best[op, stage, "bf16 brgemm", part] / best[op, stage, "bf16 simd", part]
                print(f"| {stage} {shape[0]}x{shape[1]} | {part} | " + " | ".join(f"{t:.2f} ms" for t in row)
                      + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
