// CPU kernels of ppma::polyline_scan_3d (the 3-D Algorithm 1, paper appendix C.2; docs/video.md)
// and its backward: y = exp(M) x as three 1-D linear-time scans, along T (log_gamma), H (log_beta) and W
// (log_alpha) in that order; transpose=True applies exp(M)^T (W, H, T). Tensors keep their
// [B, T, H, W, heads, c] layout and lines are walked with strides (csrc/cpu/polyline_3d.h). Accumulation in fp32
// (fp64 for fp64 inputs). Every line is an independent task with fixed summation order: deterministic and
// independent of the thread count.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/polyline_3d.h"

namespace ppma {
namespace cpu {
namespace {

constexpr const char* kOp = "polyline_scan_3d";
constexpr const char* kOpBwd = "polyline_scan_3d_backward";

p3d::Grid3 grid_of(const at::Tensor& x) {
  return {x.size(0), x.size(1), x.size(2), x.size(3), x.size(4), x.size(5)};
}

at::Tensor polyline_scan_3d_cpu(const at::Tensor& x, const at::Tensor& log_alpha, const at::Tensor& log_beta,
                                const at::Tensor& log_gamma, bool transpose) {
  p3d::check_scan_inputs_3d(kOp, x, log_alpha, log_beta, log_gamma);
  const auto acc = acc_type(x);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(acc));
  if (y.numel() > 0) {
    at::Tensor xa = x.to(acc).contiguous(), tmp = at::empty_like(y);
    at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
    at::Tensor lg = log_gamma.to(acc).contiguous();
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_scan_3d_cpu", [&] {
      const std::array<const scalar_t*, 3> dec{lg.data_ptr<scalar_t>(), lb.data_ptr<scalar_t>(),
                                               la.data_ptr<scalar_t>()};
      p3d::scan3<scalar_t>(grid_of(x), xa.data_ptr<scalar_t>(), dec, transpose, y.data_ptr<scalar_t>(),
                           tmp.data_ptr<scalar_t>());
    });
  }
  return y.to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_scan_3d_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& log_alpha, const at::Tensor& log_beta,
    const at::Tensor& log_gamma, bool transpose) {
  p3d::check_scan_inputs_3d(kOpBwd, x, log_alpha, log_beta, log_gamma);
  check_shape(kOpBwd, "grad_y", grad_y, x.sizes(), x);
  const auto acc = acc_type(x);
  auto opts = x.options().dtype(acc);
  at::Tensor gx = at::zeros(x.sizes(), opts);
  at::Tensor gla = at::zeros(log_alpha.sizes(), opts), glb = at::zeros_like(gla), glg = at::zeros_like(gla);
  if (gx.numel() > 0) {
    at::Tensor xa = x.to(acc).contiguous(), gy = grad_y.to(acc).contiguous();
    at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
    at::Tensor lg = log_gamma.to(acc).contiguous();
    at::Tensor z1 = at::empty_like(gx), z2 = at::empty_like(gx), g = at::empty_like(gx);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_scan_3d_backward_cpu", [&] {
      const std::array<const scalar_t*, 3> dec{lg.data_ptr<scalar_t>(), lb.data_ptr<scalar_t>(),
                                               la.data_ptr<scalar_t>()};
      const std::array<scalar_t*, 3> gdec{glg.data_ptr<scalar_t>(), glb.data_ptr<scalar_t>(),
                                          gla.data_ptr<scalar_t>()};
      p3d::scan3_backward<scalar_t>(grid_of(x), xa.data_ptr<scalar_t>(), gy.data_ptr<scalar_t>(), dec, transpose,
                                    gx.data_ptr<scalar_t>(), gdec, z1.data_ptr<scalar_t>(), z2.data_ptr<scalar_t>(),
                                    g.data_ptr<scalar_t>());
    });
  }
  return {gx.to(x.scalar_type()), gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type()),
          glg.to(log_gamma.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_scan_3d", &ppma::cpu::polyline_scan_3d_cpu);
  m.impl("polyline_scan_3d_backward", &ppma::cpu::polyline_scan_3d_backward_cpu);
}
