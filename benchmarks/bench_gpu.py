"""GPU benchmark of the ppma CUDA ops against the reference (eager and torch.compile) and FlexAttention.

Median time over repeats (CUDA events, after warm-up) and peak memory, forward and forward+backward.
Writes a markdown table (``--out``) with the GPU name, torch and CUDA versions (design §6).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import ppma  # noqa: F401
from ppma.ops import reference as ref


def bench(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def inputs(B, H, W, G, d, dtype, grad):
    t = [torch.randn(B, H, W, G, d, device="cuda", dtype=dtype) for _ in range(3)]
    la = -torch.rand(B, H, W, G, device="cuda")
    lb = -torch.rand(B, H, W, G, device="cuda")
    return [x.requires_grad_(grad) for x in (*t, la, lb)]


class PAFn(torch.autograd.Function):
    """Autograd over the raw ops (independent of the Python wrappers)."""

    @staticmethod
    def forward(ctx, q, k, v, la, lb, scale):
        out, ov, lse = torch.ops.ppma.polyline_attention(q, k, v, la, lb, scale)
        ctx.save_for_backward(q, k, v, la, lb, out, ov, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, go):
        g = torch.ops.ppma.polyline_attention_backward(go.contiguous(), *ctx.saved_tensors, ctx.scale)
        return (*g, None)


class CCFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, la, lb, scale):
        out, lse = torch.ops.ppma.criss_cross_attention(q, k, v, la, lb, scale)
        ctx.save_for_backward(q, k, v, la, lb, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, go):
        g = torch.ops.ppma.criss_cross_attention_backward(go.contiguous(), *ctx.saved_tensors, ctx.scale)
        return (*g, None)


def flex_polyline(q, k, v, la, lb, scale):
    """Two FlexAttention passes with score_mods computing M and M^T from captured prefix sums."""
    from torch.nn.attention.flex_attention import flex_attention

    B, H, W, G, d = q.shape
    cr = ref.prefix_sum_excl_first(la.float(), dim=2).permute(0, 3, 1, 2).reshape(B, G, H * W)
    cc = ref.prefix_sum_excl_first(lb.float(), dim=1).permute(0, 3, 1, 2).reshape(B, G, H * W)

    def bias(b, h, p, s):  # M[p, s] = R_i(j, l) + C_l(i, k)
        i, j, k, l = p // W, p % W, s // W, s % W
        r = (cr[b, h, i * W + l] - cr[b, h, p]).abs()
        c = (cc[b, h, s] - cc[b, h, i * W + l]).abs()
        return -(r + c)

    def m1(score, b, h, p, s):
        return score + bias(b, h, p, s)

    def m2(score, b, h, p, s):
        return score + bias(b, h, s, p)

    qf, kf, vf = (t.reshape(B, H * W, G, -1).transpose(1, 2) for t in (q, k, v))
    o1 = flex_attention(qf, kf, vf, score_mod=m1, scale=scale)
    o2 = flex_attention(qf, kf, vf, score_mod=m2, scale=scale)
    return (0.5 * (o1 + o2)).transpose(1, 2).reshape(B, H, W, G, -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ops-gpu.md")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    rows = []
    compiled_ref_pa = torch.compile(ref.polyline_attention_ref)
    compiled_ref_cc = torch.compile(ref.criss_cross_attention_ref)
    compiled_flex = torch.compile(flex_polyline)

    def run_case(name, shape, impls):
        B, H, W, G, d = shape
        for mode in ("fwd", "fwd+bwd"):
            res = {}
            for iname, f in impls.items():
                ins = inputs(B, H, W, G, d, dtype, mode != "fwd")
                scale = d**-0.5

                def step():
                    out = f(*ins, scale)
                    if mode != "fwd":
                        out.float().sum().backward()

                try:
                    res[iname] = bench(step)
                except Exception as e:  # OOM or unsupported: record and go on
                    res[iname] = (float("nan"), float("nan"))
                    print(f"{name} {shape} {iname} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    torch.cuda.empty_cache()
            for iname, (t, m) in res.items():
                rows.append((name, "x".join(map(str, shape)), mode, iname, t, m, res["eager ref"][0] / t))
                print(rows[-1], flush=True)

    tokens = [(32, 32), (48, 48), (64, 64)] if not a.quick else [(32, 32)]
    for H, W in tokens:
        run_case("polyline_attention", (8, H, W, 4, 32), {
            "eager ref": ref.polyline_attention_ref,
            "compiled ref": compiled_ref_pa,
            "compiled flex (2 passes)": compiled_flex,
            "ppma cuda": PAFn.apply,
        })
    for shape in [(64, 56, 56, 4, 16), (64, 28, 28, 4, 32)]:
        run_case("criss_cross_attention", shape, {
            "eager ref": ref.criss_cross_attention_ref,
            "compiled ref": compiled_ref_cc,
            "ppma cuda": CCFn.apply,
        })
    head = (f"# ppma CUDA ops\n\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, dtype {a.dtype}. Median ms (CUDA events, 3 warm-up, 10 reps), peak extra "
            f"memory MiB, speed-up vs eager reference.\n\n| op | B x H x W x heads x d | pass | impl | ms | MiB | "
            f"x eager |\n|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]:.0f} | {r[6]:.2f} |\n" for r in rows)
    with open(a.out, "w") as f:
        f.write(head + body)
    print(head + body)


if __name__ == "__main__":
    main()
