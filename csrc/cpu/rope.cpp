// CPU kernel of ppma::rope (docs/ops.md "rope"): the rotary position embedding of PPMA's queries and keys
// (paper §3, RoPE over the raster index) in one pass over x, instead of the cat/neg/mul/add chain of the
// formula. For every channel pair (x_{2m}, x_{2m+1}) of every token and head, with xs = scale * x:
//   transpose=false:  y_{2m} = xs_{2m} cos_{2m} - xs_{2m+1} sin_{2m},  y_{2m+1} = xs_{2m+1} cos_{2m+1} + xs_{2m} sin_{2m+1}
//   transpose=true:   y_{2m} = xs_{2m} cos_{2m} + xs_{2m+1} sin_{2m+1}, y_{2m+1} = xs_{2m+1} cos_{2m+1} - xs_{2m} sin_{2m}
// (transpose=true is the adjoint, i.e. the backward of transpose=false and vice versa).
// x: [B, H, W, heads, d] (d even); sin, cos: [H, W, d]. Computed in fp32 (fp64 when x or the tables are
// fp64) and written in x's dtype, so bf16/fp16 queries with fp32 tables stay bf16/fp16 without a copy.
// float32 and bf16 x with float32 tables run at the lane width of the SIMD path (rope_rows_lanes), the other
// dtypes the formula's loop (rope_rows_scalar). ppma::rope_ writes the same values over x (CPU inference).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "cpu/simd.h"
#include "cpu/overlap.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace ppma {
namespace cpu {
namespace {

// The pairs of lanes exchanged: (v1, v0, v3, v2, ...).
template <int M, size_t... E>
PPMA_SIMD_INLINE vec<M> swap_pairs(vec<M> v, std::index_sequence<E...>) {
#if defined(__clang__)
  return __builtin_shufflevector(v, v, (E ^ 1)...);
#else
  return __builtin_shuffle(v, ivec<M>{static_cast<int32_t>(E ^ 1)...});
#endif
}

// float or bf16 x (as bits) with float tables, at the lane width of the path (cpu/simd.h), M >= 4 channels at a
// time (M even: whole pairs), each pair's partner from a lane exchange:
//   y_e = xs_e cos_e + partner_e * s'_e,  s'_e = -sin_e / +sin_e (even / odd e),
// or, transposed, s'_e = +sin_{e+1} / -sin_{e-1}: the formula's products and sum ((-a) b = a (-b) exactly). A last
// pair (d % 4 == 2) runs the scalar formula. bf16 values are widened and rounded by load_map / store_map.
// The rotation of one channel pair (x0, x1) (= scale * (x_m, x_{m + 1})) with the tables s, c at m: the formula.
template <bool Transpose, typename A>
PPMA_SIMD_INLINE void rotate_pair(A x0, A x1, const A* s, const A* c, int64_t m, A& y0, A& y1) {
  if (Transpose) {
    y0 = x0 * c[m] + x1 * s[m + 1];
    y1 = x1 * c[m + 1] + (-x0) * s[m];
  } else {
    y0 = x0 * c[m] + (-x1) * s[m];
    y1 = x1 * c[m + 1] + x0 * s[m + 1];
  }
}

// f(s, c, xr, yr) for every token r in [begin, end) and head: the token's tables, the head's channels in x and y.
template <typename T, typename A, typename F>
PPMA_SIMD_INLINE void for_each_head(const T* x, const A* sin, const A* cos, T* y, int64_t begin, int64_t end,
                                    int64_t hw, int64_t heads, int64_t d, F&& f) {
  const int64_t row = heads * d;
  for (int64_t r = begin; r < end; ++r) {
    const A* s = sin + (r % hw) * d;
    const A* c = cos + (r % hw) * d;
    for (int64_t g = 0; g < heads; ++g) f(s, c, x + r * row + g * d, y + r * row + g * d);
  }
}

template <bool Transpose, int L, typename X>
PPMA_SIMD_INLINE void rope_rows_lanes(Lanes<L> ln, const X* x, const float* sin, const float* cos, X* y,
                                      int64_t begin, int64_t end, int64_t hw, int64_t heads, int64_t d, float scale) {
  for_each_head(x, sin, cos, y, begin, end, hw, heads, d, [&](const float* s, const float* c, const X* xr, X* yr) {
    for_lanes(ln, d, [&](auto lm, int64_t e) {
      constexpr int M = decltype(lm)::value;
      if constexpr (M == 1) {  // the last pair (e, e + 1), at its even e
        if (e % 2) return;
        float y0, y1;
        rotate_pair<Transpose>(load_map<1>(xr + e) * scale, load_map<1>(xr + e + 1) * scale, s, c, e, y0, y1);
        store_map<1>(yr + e, y0);
        store_map<1>(yr + e + 1, y1);
      } else {
        const auto odd = ((lane_indices<M>() + static_cast<int32_t>(e)) & 1) != 0;
        const vec<M> xs = load_map<M>(xr + e) * scale;
        const vec<M> partner = swap_pairs<M>(xs, std::make_index_sequence<M>());
        vec<M> sv = load<M>(s + e);
        if constexpr (Transpose) {
          sv = swap_pairs<M>(sv, std::make_index_sequence<M>());
          sv = odd ? -sv : sv;
        } else {
          sv = odd ? sv : -sv;
        }
        store_map<M>(yr + e, xs * load<M>(c + e) + partner * sv);
      }
    });
  });
}

// Any dtype: the formula's loop over the channel pairs, computed in A (float or double).
template <typename T, typename A, bool Transpose>
void rope_rows_scalar(const T* x, const A* sin, const A* cos, T* y, int64_t begin, int64_t end, int64_t hw,
                      int64_t heads, int64_t d, A scale) {
  for_each_head(x, sin, cos, y, begin, end, hw, heads, d, [&](const A* s, const A* c, const T* xr, T* yr) {
#pragma omp simd
    for (int64_t m = 0; m < d; m += 2) {
      A y0, y1;
      rotate_pair<Transpose>(static_cast<A>(xr[m]) * scale, static_cast<A>(xr[m + 1]) * scale, s, c, m, y0, y1);
      yr[m] = static_cast<T>(y0);
      yr[m + 1] = static_cast<T>(y1);
    }
  });
}

// float and bf16 x with float tables run rope_rows_lanes, everything else rope_rows_scalar.
template <typename T, typename A, bool Transpose>
void rope_rows(const T* x, const A* sin, const A* cos, T* y, int64_t rows, int64_t hw, int64_t heads, int64_t d,
               A scale) {
  const int64_t row = heads * d;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<A, float> && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)) {
      using X = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
      const X* xp = reinterpret_cast<const X*>(x);
      X* yp = reinterpret_cast<X*>(y);
      with_lanes([&](auto ln) {
        rope_rows_lanes<Transpose>(ln, xp, sin, cos, yp, begin, end, hw, heads, d, scale);
      });
    } else {
      rope_rows_scalar<T, A, Transpose>(x, sin, cos, y, begin, end, hw, heads, d, scale);
    }
  });
}

// Checks the arguments of ppma::rope / ppma::rope_ (op: the name in the messages).
void check_rope_args(const char* op, const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos) {
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
}

// y = the rotation of x (both contiguous, x's shape and dtype; y may be x itself: every vector and pair of
// channels is read before it is written, so the rotation runs in place too).
void rope_into(const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos, double scale, bool transpose,
               const at::Tensor& y) {
  if (y.numel() == 0) return;
  const bool wide = x.scalar_type() == at::kDouble || sin.scalar_type() == at::kDouble;
  const auto acc = wide ? at::kDouble : at::kFloat;
  const at::Tensor s = sin.to(acc).contiguous(), c = cos.to(acc).contiguous();
  const int64_t rows = x.size(0) * x.size(1) * x.size(2), hw = x.size(1) * x.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ppma_rope_cpu", [&] {
    auto run = [&](auto acc_zero) {
      using A = decltype(acc_zero);
      const auto* xp = x.data_ptr<scalar_t>();
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
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos, double scale,
                    bool transpose) {
  check_rope_args("ppma::rope", x, sin, cos);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  rope_into(xc, sin, cos, scale, transpose, y);
  return y;
}

// ppma::rope_: the rotation written over x (contiguous), the same values as ppma::rope.
void rope_inplace_cpu(const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos, double scale,
                      bool transpose) {
  constexpr const char* op = "ppma::rope_";
  check_rope_args(op, x, sin, cos);
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous (it is written in place)");
  check_no_overlap(op, "x", x, "sin", sin);
  check_no_overlap(op, "x", x, "cos", cos);
  rope_into(x, sin, cos, scale, transpose, x);
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("rope", &ppma::cpu::rope_cpu);
  m.impl("rope_", &ppma::cpu::rope_inplace_cpu);
}
