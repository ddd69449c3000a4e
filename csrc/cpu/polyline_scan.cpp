// CPU kernels of ppma::polyline_scan (docs/model.md §2, Algorithm 1; docs/ops.md "polyline_scan") and its backward: linear-time first-order
// recurrences along the columns (log_beta) and rows (log_alpha) of every (batch, head).
//
// One line of n positions with log-decays a_0..a_{n-1} (a_0 unused) and A_ts = exp(c_max - c_min):
//   y = A x:  f_0 = x_0, f_t = e^{a_t} f_{t-1} + x_t;  g_{n-1} = 0, g_t = e^{a_{t+1}} (g_{t+1} + x_{t+1});
//             y = f + g.
//   backward: A is symmetric, so grad_x = A grad_y; with F_t(u) = sum_{i >= t} A_ti u_i,
//             grad a_s = e^{a_s} (f_{s-1}(x) . F_s(gy) + f_{s-1}(gy) . F_s(x)) for s >= 1, grad a_0 = 0.
// Tensors keep their [B, H, W, heads, c] layout; lines are walked with strides. Accumulation in fp32
// (fp64 for fp64 inputs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/checks.h"
#include "common/math.h"
#include "cpu/line_scan.h"
#include "cpu/simd.h"

namespace ppma {
namespace cpu {
namespace {

// Geometry of the [B, H, W, heads, c] layout: line `idx` of a direction -> offsets and strides.
struct Lines {
  int64_t B, H, W, G, c;
  // rows: B * G * H lines of W positions; columns: B * G * W lines of H positions.
  int64_t count(bool rows) const { return B * G * (rows ? H : W); }
  int64_t length(bool rows) const { return rows ? W : H; }
  // token index (of the decay tensor [B, H, W, heads]) of the line's first position, and the step between positions
  int64_t start(bool rows, int64_t idx) const {
    const int64_t per = rows ? H : W;
    const int64_t bg = idx / per, li = idx % per;
    return token_index(H * W, G, bg / G, line_token(rows, li, 0, W), bg % G);
  }
  int64_t step(bool rows) const { return line_stride(rows, W) * G; }
};

template <typename T>
void scan_pass(const Lines& L, bool rows, const T* x, const T* a, T* y) {
  const int64_t n = L.length(rows), c = L.c, st = L.step(rows);
  at::parallel_for(0, L.count(rows), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> e(n), g(c);
    // The lines' loops vectorise at the lane width with_lanes() picks (cpu/simd.h).
    with_lanes([&](auto) {
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t s = L.start(rows, idx);
        scan_line(n, c, x + s * c, st * c, a + s, st, y + s * c, st * c, e.data(), g.data());
      }
    });
  });
}

template <typename T>
void scan_backward_pass(const Lines& L, bool rows, const T* z, const T* gy, const T* a, T* gz, T* ga) {
  const int64_t n = L.length(rows), c = L.c, st = L.step(rows);
  at::parallel_for(0, L.count(rows), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> e(n), fz(n * c), fg(n * c), Fz(c), Fg(c);
    with_lanes([&](auto) {
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t s = L.start(rows, idx);
        scan_line_backward(n, c, z + s * c, st * c, gy + s * c, st * c, a + s, st, gz + s * c, st * c, ga + s, st,
                           e.data(), fz.data(), fg.data(), Fz.data(), Fg.data());
      }
    });
  });
}

constexpr const char* kOp = "polyline_scan";
constexpr const char* kOpBwd = "polyline_scan_backward";

at::Tensor polyline_scan_cpu(const at::Tensor& x, const at::Tensor& log_alpha, const at::Tensor& log_beta,
                             bool transpose) {
  check_scan_inputs(kOp, x, log_alpha, log_beta);
  const auto acc = acc_type(x);
  at::Tensor xa = x.to(acc).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(acc));
  if (y.numel() > 0) {
    at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
    at::Tensor z = at::empty_like(y);
    const Lines L{x.size(0), x.size(1), x.size(2), x.size(3), x.size(4)};
    // transpose=False: L x = rows(cols(x)); transpose=True: L^T x = cols(rows(x)).
    const bool first_rows = transpose;
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_scan_cpu", [&] {
      const scalar_t* a1 = (first_rows ? la : lb).data_ptr<scalar_t>();
      const scalar_t* a2 = (first_rows ? lb : la).data_ptr<scalar_t>();
      scan_pass<scalar_t>(L, first_rows, xa.data_ptr<scalar_t>(), a1, z.data_ptr<scalar_t>());
      scan_pass<scalar_t>(L, !first_rows, z.data_ptr<scalar_t>(), a2, y.data_ptr<scalar_t>());
    });
  }
  return y.to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_scan_backward_cpu(const at::Tensor& grad_y,
                                                                          const at::Tensor& x,
                                                                          const at::Tensor& log_alpha,
                                                                          const at::Tensor& log_beta,
                                                                          bool transpose) {
  check_scan_inputs(kOpBwd, x, log_alpha, log_beta);
  check_shape(kOpBwd, "grad_y", grad_y, x.sizes(), x);
  const auto acc = acc_type(x);
  auto opts = x.options().dtype(acc);
  at::Tensor gx = at::zeros(x.sizes(), opts);
  at::Tensor gla = at::zeros(log_alpha.sizes(), opts), glb = at::zeros(log_beta.sizes(), opts);
  if (gx.numel() > 0) {
    at::Tensor xa = x.to(acc).contiguous(), gy = grad_y.to(acc).contiguous();
    at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
    at::Tensor z = at::empty_like(gx), gz = at::empty_like(gx);
    const Lines L{x.size(0), x.size(1), x.size(2), x.size(3), x.size(4)};
    const bool first_rows = transpose;  // direction of the first factor applied to x
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_scan_backward_cpu", [&] {
      auto* a_first = (first_rows ? la : lb).data_ptr<scalar_t>();
      auto* a_second = (first_rows ? lb : la).data_ptr<scalar_t>();
      auto* g_first = (first_rows ? gla : glb).data_ptr<scalar_t>();
      auto* g_second = (first_rows ? glb : gla).data_ptr<scalar_t>();
      // z = first(x); y = second(z).
      scan_pass<scalar_t>(L, first_rows, xa.data_ptr<scalar_t>(), a_first, z.data_ptr<scalar_t>());
      scan_backward_pass<scalar_t>(L, !first_rows, z.data_ptr<scalar_t>(), gy.data_ptr<scalar_t>(), a_second,
                                   gz.data_ptr<scalar_t>(), g_second);
      scan_backward_pass<scalar_t>(L, first_rows, xa.data_ptr<scalar_t>(), gz.data_ptr<scalar_t>(), a_first,
                                   gx.data_ptr<scalar_t>(), g_first);
    });
  }
  return {gx.to(x.scalar_type()), gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_scan", &ppma::cpu::polyline_scan_cpu);
  m.impl("polyline_scan_backward", &ppma::cpu::polyline_scan_backward_cpu);
}
