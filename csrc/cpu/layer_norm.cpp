// CPU kernels of ppma::layer_norm and ppma::add_layer_norm_ (docs/ops.md "layer_norm"): LayerNorm over the last
// dimension of a contiguous float32 map, one row of C channels at a time while it is in L1 (CPU inference: the
// block's norm1 and norm2, docs/model.md §4). add_layer_norm_ first adds a residual into x in place, x <- x + r, in
// the same pass over the row: the block's x + attn(norm1(x)) followed by norm2 reads x once instead of twice.
// Per row (the two-pass formula, in float32 like torch's kernel):
//   mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps),
//   y = (x - mean) * rstd * weight + bias.
// The sums run in vectors of the path's width (cpu/simd.h: for_lanes, lanes added by hsum's fixed tree), so a row's
// result depends on C and the path only, not on the thread count or the row's position. Equal to
// torch.nn.functional.layer_norm up to float32 rounding (torch's moments use another summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu/simd.h"
#include "cpu/overlap.h"

namespace ppma {
namespace cpu {
namespace {

// One row: x (+= r where r is given, written back), y = layer_norm(x).
template <int L>
PPMA_SIMD_INLINE void norm_row(Lanes<L> ln, int64_t C, float* x, const float* r, const float* w, const float* b,
                               float eps, float* y) {
  vec<L> acc{};
  float s = 0;
  for_lanes(ln, C, [&](auto lm, int64_t l) {
    constexpr int M = decltype(lm)::value;
    vec<M> v = load<M>(x + l);
    if (r) {
      v += load<M>(r + l);
      store<M>(x + l, v);
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
    const vec<M> d = load<M>(x + l) - mean;
    if constexpr (M == L) {
      acc2 += d * d;
    } else {
      s2 += hsum<M>(d * d);
    }
  });
  const float rstd = 1.0f / std::sqrt((hsum<L>(acc2) + s2) / static_cast<float>(C) + eps);
  for_lanes(ln, C, [&](auto lm, int64_t l) {
    constexpr int M = decltype(lm)::value;
    store<M>(y + l, (load<M>(x + l) - mean) * rstd * load<M>(w + l) + load<M>(b + l));
  });
}

void check_args(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got a scalar");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  const int64_t C = x.size(-1);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"weight", weight}, {"bias", bias}}) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must be [C] = [", C, "] (x's last dimension), got "
                "shape ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  }
}

// y = layer_norm(x) row by row (x += r first where r is given, written into x); rows split over the threads.
void norm_rows(const at::Tensor& x, const float* r, const at::Tensor& weight, const at::Tensor& bias, double eps,
               const at::Tensor& y) {
  const int64_t C = x.size(-1);
  if (C == 0 || x.numel() == 0) return;
  const int64_t rows = x.numel() / C;
  float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const at::Tensor wc = weight.contiguous(), bc = bias.contiguous();
  const float *w = wc.data_ptr<float>(), *b = bc.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 16384 / C);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    with_lanes([&](auto ln) {
      for (int64_t i = begin; i < end; ++i)
        norm_row(ln, C, xp + i * C, r ? r + i * C : nullptr, w, b, e, yp + i * C);
    });
  });
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
  TORCH_CHECK(residual.scalar_type() == at::kFloat, op, ": residual must be float32, got ", residual.scalar_type());
  TORCH_CHECK(residual.device() == x.device(), op, ": residual is on ", residual.device(), " but x is on ",
              x.device());
  check_no_overlap(op, "x", x, "residual", residual, /*allow_full=*/true);  // x += x reads each element first
  check_no_overlap(op, "x", x, "weight", weight);
  check_no_overlap(op, "x", x, "bias", bias);
  const at::Tensor rc = residual.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  norm_rows(x, rc.data_ptr<float>(), weight, bias, eps, y);
  return y;
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("layer_norm", &ppma::cpu::layer_norm_cpu);
  m.impl("add_layer_norm_", &ppma::cpu::add_layer_norm_inplace_cpu);
}
