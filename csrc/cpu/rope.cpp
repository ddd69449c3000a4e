// CPU kernel of ppma::rope (docs/ops.md "rope"): the rotary position embedding of PPMA's queries and keys
// (paper §3, RoPE over the raster index) in one pass over x, instead of the cat/neg/mul/add chain of the
// formula. For every channel pair (x_{2m}, x_{2m+1}) of every token and head, with xs = scale * x:
//   transpose=false:  y_{2m} = xs_{2m} cos_{2m} - xs_{2m+1} sin_{2m},  y_{2m+1} = xs_{2m+1} cos_{2m+1} + xs_{2m} sin_{2m+1}
//   transpose=true:   y_{2m} = xs_{2m} cos_{2m} + xs_{2m+1} sin_{2m+1}, y_{2m+1} = xs_{2m+1} cos_{2m+1} - xs_{2m} sin_{2m}
// (transpose=true is the adjoint, i.e. the backward of transpose=false and vice versa).
// x: [B, H, W, heads, d] (d even); sin, cos: [H, W, d]. Computed in fp32 (fp64 when x or the tables are
// fp64) and written in x's dtype, so bf16/fp16 queries with fp32 tables stay bf16/fp16 without a copy.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "cpu/simd.h"

#include <cstdint>
#include <type_traits>

namespace ppma {
namespace cpu {
namespace {

// One head's channel pairs of bf16 x (as bits) with float tables: the same float arithmetic as rope_rows' loop,
// with the conversions of cpu/simd.h, integer operations the compiler vectorises (c10::BFloat16's do not; with
// them the bf16 op took 1.6x as long at PPMA-T's stage-1 shape).
template <bool Transpose>
inline void rope_pairs_bf16(const uint16_t* __restrict xr, const float* __restrict s, const float* __restrict c,
                            uint16_t* __restrict yr, int64_t d, float scale) {
#pragma omp simd
  for (int64_t m = 0; m < d; m += 2) {
    const float x0 = bf16_to_float(xr[m]) * scale, x1 = bf16_to_float(xr[m + 1]) * scale;
    if (Transpose) {
      yr[m] = float_to_bf16(x0 * c[m] + x1 * s[m + 1]);
      yr[m + 1] = float_to_bf16(x1 * c[m + 1] + (-x0) * s[m]);
    } else {
      yr[m] = float_to_bf16(x0 * c[m] + (-x1) * s[m]);
      yr[m + 1] = float_to_bf16(x1 * c[m + 1] + x0 * s[m + 1]);
    }
  }
}

template <typename T, typename A, bool Transpose>
void rope_rows(const T* x, const A* sin, const A* cos, T* y, int64_t rows, int64_t hw, int64_t heads, int64_t d,
               A scale) {
  const int64_t row = heads * d;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const A* s = sin + (r % hw) * d;
      const A* c = cos + (r % hw) * d;
      for (int64_t g = 0; g < heads; ++g) {
        const T* xr = x + r * row + g * d;
        T* yr = y + r * row + g * d;
        if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>) {
          rope_pairs_bf16<Transpose>(reinterpret_cast<const uint16_t*>(xr), s, c, reinterpret_cast<uint16_t*>(yr), d,
                                     scale);
          continue;
        }
#pragma omp simd
        for (int64_t m = 0; m < d; m += 2) {
          const A x0 = static_cast<A>(xr[m]) * scale, x1 = static_cast<A>(xr[m + 1]) * scale;
          if (Transpose) {
            yr[m] = static_cast<T>(x0 * c[m] + x1 * s[m + 1]);
            yr[m + 1] = static_cast<T>(x1 * c[m + 1] + (-x0) * s[m]);
          } else {
            yr[m] = static_cast<T>(x0 * c[m] + (-x1) * s[m]);
            yr[m + 1] = static_cast<T>(x1 * c[m + 1] + x0 * s[m + 1]);
          }
        }
      }
    }
  });
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos, double scale,
                    bool transpose) {
  constexpr const char* op = "ppma::rope";
  TORCH_CHECK(x.dim() == 5, op, ": x must be [B, H, W, heads, d], got shape ", x.sizes());
  TORCH_CHECK(x.size(4) % 2 == 0, op, ": the head dim d of x must be even, got shape ", x.sizes());
  const auto grid = std::vector<int64_t>{x.size(1), x.size(2), x.size(4)};
  TORCH_CHECK(sin.dim() == 3 && sin.sizes() == at::IntArrayRef(grid), op, ": sin must be [H, W, d] = ", grid,
              ", got shape ", sin.sizes());
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == at::IntArrayRef(grid), op, ": cos must be [H, W, d] = ", grid,
              ", got shape ", cos.sizes());
  check_floating(op, "x", x);
  check_floating(op, "sin", sin);
  check_like(op, "cos", cos, "sin", sin);
  TORCH_CHECK(sin.device() == x.device(), op, ": sin is on ", sin.device(), " but x is on ", x.device());
  const bool wide = x.scalar_type() == at::kDouble || sin.scalar_type() == at::kDouble;
  const auto acc = wide ? at::kDouble : at::kFloat;
  const at::Tensor xc = x.contiguous();
  const at::Tensor s = sin.to(acc).contiguous(), c = cos.to(acc).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  const int64_t rows = x.size(0) * x.size(1) * x.size(2), hw = x.size(1) * x.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ppma_rope_cpu", [&] {
    auto run = [&](auto acc_zero) {
      using A = decltype(acc_zero);
      const auto* xp = xc.data_ptr<scalar_t>();
      auto* yp = y.data_ptr<scalar_t>();
      const auto* sp = s.data_ptr<A>();
      const auto* cp = c.data_ptr<A>();
      if (transpose) {
        rope_rows<scalar_t, A, true>(xp, sp, cp, yp, rows, hw, x.size(3), x.size(4), static_cast<A>(scale));
      } else {
        rope_rows<scalar_t, A, false>(xp, sp, cp, yp, rows, hw, x.size(3), x.size(4), static_cast<A>(scale));
      }
    };
    if (wide) {
      run(double(0));
    } else {
      run(float(0));
    }
  });
  return y;
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) { m.impl("rope", &ppma::cpu::rope_cpu); }
