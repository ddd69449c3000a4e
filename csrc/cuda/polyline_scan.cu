// CUDA launchers of ppma::polyline_scan and its backward (docs/ops.md "polyline_scan"). Kernels: csrc/kernels/polyline_scan.cuh
// (per-line parallel recurrence, one thread per (line, channel)).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/launch_utils.h"
#include "kernels/polyline_scan.cuh"

namespace ppma {
namespace cuda {
namespace {

void check_scan(const char* op, const at::Tensor& x, const at::Tensor& log_alpha, const at::Tensor& log_beta) {
  check_is_cuda(op, "x", x);
  check_scan_inputs(op, x, log_alpha, log_beta);
}

at::Tensor polyline_scan_cuda(const at::Tensor& x_in, const at::Tensor& log_alpha, const at::Tensor& log_beta,
                              bool transpose) {
  const char* op = "ppma::polyline_scan";
  check_scan(op, x_in, log_alpha, log_beta);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = last_dim_contiguous(x_in);
  const auto acc = acc_type(x);
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  const GridSizes sz = grid_sizes(x, x.size(4));
  const at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
  at::Tensor ws = at::empty({2, x.numel()}, x.options().dtype(acc));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "polyline_scan_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    ScanScratch<A> s;
    s.z = ws.data_ptr<A>();
    s.f = s.z + x.numel();
    launch_polyline_scan_fwd<T>(sz, transpose, cptr<scalar_t>(x), strides4(x), la.data_ptr<A>(), lb.data_ptr<A>(), s,
                                cptr<scalar_t>(y), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_scan_backward_cuda(const at::Tensor& grad_y_in,
                                                                           const at::Tensor& x_in,
                                                                           const at::Tensor& log_alpha,
                                                                           const at::Tensor& log_beta, bool transpose) {
  const char* op = "ppma::polyline_scan_backward";
  check_scan(op, x_in, log_alpha, log_beta);
  check_shape(op, "grad_y", grad_y_in, x_in.sizes(), x_in);
  check_like(op, "grad_y", grad_y_in, "x", x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = last_dim_contiguous(x_in), gy = last_dim_contiguous(grad_y_in);
  const auto acc = acc_type(x);
  at::Tensor gx = at::empty(x.sizes(), x.options());
  at::Tensor gla = at::empty(log_alpha.sizes(), x.options().dtype(acc));
  at::Tensor glb = at::empty_like(gla);
  if (x.numel() == 0)
    return {gx, gla.zero_().to(log_alpha.scalar_type()), glb.zero_().to(log_beta.scalar_type())};
  const GridSizes sz = grid_sizes(x, x.size(4));
  const at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
  at::Tensor ws = at::empty({6, x.numel()}, x.options().dtype(acc));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "polyline_scan_backward_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    ScanScratch<A> s;
    A* w = ws.data_ptr<A>();
    const int64_t n = x.numel();
    s.z = w;
    s.gz = w + n;
    s.f = w + 2 * n;
    s.fu = w + 3 * n;
    s.fg = w + 4 * n;
    s.contrib = w + 5 * n;
    launch_polyline_scan_bwd<T>(sz, transpose, cptr<scalar_t>(gy), strides4(gy), cptr<scalar_t>(x), strides4(x),
                                la.data_ptr<A>(), lb.data_ptr<A>(), s, cptr<scalar_t>(gx), gla.data_ptr<A>(),
                                glb.data_ptr<A>(), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {gx, gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cuda
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CUDA, m) {
  m.impl("polyline_scan", &ppma::cuda::polyline_scan_cuda);
  m.impl("polyline_scan_backward", &ppma::cuda::polyline_scan_backward_cuda);
}
