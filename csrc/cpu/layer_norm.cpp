// CPU kernels of ppma::layer_norm and ppma::add_layer_norm_ (docs/ops.md "layer_norm"): LayerNorm over the last
// dimension of a contiguous map, one row of C channels at a time while it is in L1 (CPU inference: the block's norm1
// and norm2, docs/model.md §4). add_layer_norm_ first adds a residual into x in place, x <- x + r, in the same pass
// over the row: the block's x + attn(norm1(x)) followed by norm2 reads x once instead of twice.
// Per row (the two-pass formula, in float32 like torch's kernel):
//   mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps),
//   y = (x - mean) * rstd * weight + bias.
// The sums run in vectors of the path's width (cpu/simd.h: for_lanes, lanes added by hsum's fixed tree), so a row's
// result depends on C and the path only, not on the thread count or the row's position. Equal to
// torch.nn.functional.layer_norm up to float32 rounding (torch's moments use another summation order).
// Maps of float32, or of bf16 with float32 weight and bias (CPU bf16 autocast, torch's mixed-dtype layer norm): a
// bf16 row is widened as it is read, the math is float32, and each bf16 value stored (y, and the sum x + r) is
// rounded once to nearest even; the norm of a sum is taken over the rounded sum, as torch's x.add_(r) followed by
// its layer norm computes it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu/simd.h"
#include "cpu/overlap.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

// One row: x (+= r where r is given, written back), y = layer_norm(x). X: float, or bf16 bits.
template <int L, typename X>
PPMA_SIMD_INLINE void norm_row(Lanes<L> ln, int64_t C, X* x, const X* r, const float* w, const float* b, float eps,
                               X* y) {
  vec<L> acc{};
  float s = 0;
  for_lanes(ln, C, [&](auto lm, int64_t l) {
    constexpr int M = decltype(lm)::value;
    vec<M> v = load_map<M>(x + l);
    if (r) {
      v += load_map<M>(r + l);
      store_map<M>(x + l, v);
      if constexpr (std::is_same_v<X, uint16_t>) v = load_map<M>(x + l);  // bf16: the stats of the rounded sum
    }
    if constexpr (M == L) {
      acc += v;
    } else {
      s += hsum<M>(v);
    }
  });
  const float mean = (hsum<L>(acc) + s) / static_cast<float>(C);
  vec<L> acc2{};
  float s2 = 0;
  for_lanes(ln, C, [&](auto lm, int64_t l) {
    constexpr int M = decltype(lm)::value;
    const vec<M> d = load_map<M>(x + l) - mean;
    if constexpr (M == L) {
      acc2 += d * d;
    } else {
      s2 += hsum<M>(d * d);
    }
  });
  const float rstd = 1.0f / std::sqrt((hsum<L>(acc2) + s2) / static_cast<float>(C) + eps);
  for_lanes(ln, C, [&](auto lm, int64_t l) {
    constexpr int M = decltype(lm)::value;
    store_map<M>(y + l, (load_map<M>(x + l) - mean) * rstd * load<M>(w + l) + load<M>(b + l));
  });
}

void check_args(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got a scalar");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  const int64_t C = x.size(-1);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"weight", weight}, {"bias", bias}}) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must be [C] = [", C, "] (x's last dimension), got "
                "shape ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32 (for a bfloat16 x too), got ",
                t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  }
}

// y = layer_norm(x) row by row (x += r first where r is given, written into x); rows split over the threads. x, r, y:
// float32 maps, or bf16 ones (X = uint16_t); weight and bias float32.
template <typename X>
void norm_rows(const at::Tensor& x, const at::Tensor* r, const at::Tensor& weight, const at::Tensor& bias, double eps,
               const at::Tensor& y) {
  const int64_t C = x.size(-1);
  if (C == 0 || x.numel() == 0) return;
  const int64_t rows = x.numel() / C;
  X* xp = elements<X>(x);
  X* yp = elements<X>(y);
  const X* rp = r ? elements<X>(*r) : nullptr;
  const at::Tensor wc = weight.contiguous(), bc = bias.contiguous();
  const float *w = wc.data_ptr<float>(), *b = bc.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 16384 / C);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    with_lanes([&](auto ln) {
      for (int64_t i = begin; i < end; ++i)
        norm_row(ln, C, xp + i * C, rp ? rp + i * C : nullptr, w, b, e, yp + i * C);
    });
  });
}

void norm_rows(const at::Tensor& x, const at::Tensor* r, const at::Tensor& weight, const at::Tensor& bias, double eps,
               const at::Tensor& y) {
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows<uint16_t>(x, r, weight, bias, eps, y);
  } else {
    norm_rows<float>(x, r, weight, bias, eps, y);
  }
}

at::Tensor layer_norm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  constexpr const char* op = "ppma::layer_norm";
  check_args(op, x, weight, bias);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  norm_rows(x, nullptr, weight, bias, eps, y);  // no residual: x is only read
  return y;
}

at::Tensor add_layer_norm_inplace_cpu(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                      const at::Tensor& bias, double eps) {
  constexpr const char* op = "ppma::add_layer_norm_";
  check_args(op, x, weight, bias);
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual must have x's shape ", x.sizes(), ", got ",
              residual.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), op, ": residual must have x's dtype ", x.scalar_type(),
              ", got ", residual.scalar_type());
  TORCH_CHECK(residual.device() == x.device(), op, ": residual is on ", residual.device(), " but x is on ",
              x.device());
  check_no_overlap(op, "x", x, "residual", residual, /*allow_full=*/true);  // x += x reads each element first
  check_no_overlap(op, "x", x, "weight", weight);
  check_no_overlap(op, "x", x, "bias", bias);
  const at::Tensor rc = residual.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  norm_rows(x, &rc, weight, bias, eps, y);
  return y;
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("layer_norm", &ppma::cpu::layer_norm_cpu);
  m.impl("add_layer_norm_", &ppma::cpu::add_layer_norm_inplace_cpu);
}
