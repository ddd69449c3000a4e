"""bf16 / fp16 polyline_attention on the CPU: ppma's own SIMD products against torch's CPU batch-reduce GEMM (the
internal option ``cpu_lowp_products``, docs/performance.md "bf16 and fp16 on the CPU"), with float32 as the baseline,
at PPMA-T's polyline stages for 224x224 inputs (stage 3: 14x14, 8 heads, d = 32; stage 4: 7x7, 16 heads, d = 32).

Per case: the inference op (``polyline_attention_inference``), the training forward (``polyline_attention``: out,
out_v2h, lse) and its backward (``polyline_attention_backward``), each timed alone. The configurations run in
interleaved rounds in one process; every time is the minimum over the rounds and the repeats inside them, so that a
busy machine slows all configurations alike. Prints a markdown table and ``ppma.backends.cpu_summary()``.

Usage: ``python benchmarks/bench_cpu_lowp.py [--batch 8] [--threads 1] [--rounds 3] [--repeat 3]``.
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

STAGES = [("stage3", (14, 14, 8, 32, 32)), ("stage4", (7, 7, 16, 32, 32))]
# (label, dtype, cpu_lowp_products)
CONFIGS = [("fp32", torch.float32, 0), ("bf16 simd", torch.bfloat16, 1), ("bf16 brgemm", torch.bfloat16, 2),
           ("fp16 simd", torch.float16, 1), ("fp16 brgemm", torch.float16, 2)]
PARTS = ("inference", "forward", "backward")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = torch.ops.ppma
    best: dict = {}
    for _ in range(args.rounds):
        for stage, shape in STAGES:
            for label, dtype, products in CONFIGS:
                inputs, go, scale = _case(args.batch, shape, dtype)
                with config.internal_option("cpu_lowp_products", products):
                    out, out_v2h, lse = ops.polyline_attention(*inputs, scale)  # warm-up
                    fns = {
                        "inference": lambda: ops.polyline_attention_inference(*inputs, scale),
                        "forward": lambda: ops.polyline_attention(*inputs, scale),
                        "backward": lambda: ops.polyline_attention_backward(go, *inputs, out, out_v2h, lse, scale),
                    }
                    for part in PARTS:
                        fns[part]()
                        t = _time(fns[part], args.repeat)
                        key = (stage, label, part)
                        best[key] = min(best.get(key, float("inf")), t)
    print(f"{backends.cpu_summary()}; {args.threads} thread(s), batch {args.batch}; cpu_lowp_products default: "
          f"bf16 -> {'brgemm' if torch.ops.ppma.cpu_lowp_gemm_native(torch.bfloat16) else 'simd'}")
    print()
    print("| stage | part | " + " | ".join(label for label, _, _ in CONFIGS) + " | bf16 brgemm / simd |")
    print("|---|---|" + "---|" * (len(CONFIGS) + 1))
    for stage, _ in STAGES:
        for part in PARTS:
            row = [best[stage, label, part] * 1e3 for label, _, _ in CONFIGS]
            ratio = best[stage, "bf16 brgemm", part] / best[stage, "bf16 simd", part]
            print(f"| {stage} | {part} | " + " | ".join(f"{t:.2f} ms" for t in row) + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
