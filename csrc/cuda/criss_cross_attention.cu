// CUDA launchers of ppma::criss_cross_attention and its backward (design §2). Kernels:
// csrc/kernels/criss_cross_attention.cuh.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/cuda_checks.h"
#include "kernels/criss_cross_attention.cuh"

namespace ppma {
namespace cuda {
namespace {

template <typename A>
void cc_prefix_sums(const GridSizes& sz, const at::Tensor& la, const at::Tensor& lb, const at::Tensor& cr,
                    const at::Tensor& cc, cudaStream_t stream) {
  PrefixParams<A> pp;
  pp.sz = sz;
  pp.log_alpha = la.data_ptr<A>();
  pp.log_beta = lb.data_ptr<A>();
  pp.sa = strides4(la);
  pp.sb = strides4(lb);
  pp.cr = cr.data_ptr<A>();
  pp.cc = cc.data_ptr<A>();
  const int64_t n = int64_t(sz.B) * sz.G * (sz.H + sz.W);
  prefix_sums_kernel<A><<<unsigned((n + 127) / 128), 128, 0, stream>>>(pp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> criss_cross_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                               const at::Tensor& v_in, const at::Tensor& log_alpha,
                                                               const at::Tensor& log_beta, double scale) {
  const char* op = "ppma::criss_cross_attention";
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const auto acc = acc_type(q);
  const GridSizes sz = grid_sizes(q, v.size(4));
  at::Tensor out = at::empty({sz.B, sz.H, sz.W, sz.G, sz.dv}, q.options());
  at::Tensor lse = at::empty({sz.B, sz.H, sz.W, sz.G, 2}, q.options().dtype(acc));
  if (q.numel() == 0 || v.numel() == 0) return {out.zero_(), lse.zero_()};
  const int dpad = padded_head_dim(op, sz.d, sz.dv);
  const int64_t N = int64_t(sz.H) * sz.W, BG = int64_t(sz.B) * sz.G;
  const auto fopt = q.options().dtype(acc);
  const at::Tensor la = log_alpha.to(acc), lb = log_beta.to(acc);
  at::Tensor cr = at::empty({BG, N}, fopt), cc = at::empty({BG, N}, fopt);
  at::Tensor scratch = at::empty({3, sz.B, sz.H, sz.W, sz.G, sz.dv}, fopt);  // z1, z2, out1
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "criss_cross_attention_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    cc_prefix_sums<A>(sz, la, lb, cr, cc, stream);
    CrissCrossParams<T, A> p;
    p.sz = sz;
    p.scale = A(scale);
    p.q = cptr<scalar_t>(q);
    p.k = cptr<scalar_t>(k);
    p.v = cptr<scalar_t>(v);
    p.sq = strides4(q);
    p.sk = strides4(k);
    p.sv = strides4(v);
    p.cr = cr.data_ptr<A>();
    p.cc = cc.data_ptr<A>();
    p.out = cptr<scalar_t>(out);
    p.lse = lse.data_ptr<A>();
    A* s = scratch.data_ptr<A>();
    const int64_t m = int64_t(sz.B) * N * sz.G * sz.dv;
    p.z1 = s;
    p.z2 = s + m;
    p.out1 = s + 2 * m;
    PPMA_DPAD_SWITCH(dpad, [&] { launch_criss_cross_fwd<T, DPAD>(p, stream); });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> criss_cross_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& lse_in, double scale) {
  const char* op = "ppma::criss_cross_attention_backward";
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  check_shape(op, "grad_out", grad_out_in, v_in.sizes(), q_in);
  check_same_dtype(op, "grad_out", grad_out_in, "q", q_in);
  std::vector<int64_t> lshape(q_in.sizes().begin(), q_in.sizes().begin() + 4);
  lshape.push_back(2);
  check_shape(op, "lse", lse_in, lshape, q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const at::Tensor dout = last_dim_contiguous(grad_out_in);
  const auto acc = acc_type(q);
  const at::Tensor lse = lse_in.to(acc).contiguous();
  const GridSizes sz = grid_sizes(q, v.size(4));
  at::Tensor gq = at::empty(q.sizes(), q.options());
  at::Tensor gk = at::empty(q.sizes(), q.options());
  at::Tensor gv = at::empty(v.sizes(), v.options());
  at::Tensor gla = at::empty(log_alpha.sizes(), q.options().dtype(acc));
  at::Tensor glb = at::empty_like(gla);
  if (q.numel() == 0 || v.numel() == 0)
    return {gq.zero_(), gk.zero_(), gv.zero_(), gla.zero_().to(log_alpha.scalar_type()),
            glb.zero_().to(log_beta.scalar_type())};
  const int dpad = padded_head_dim(op, sz.d, sz.dv);
  const int64_t N = int64_t(sz.H) * sz.W, BG = int64_t(sz.B) * sz.G;
  const auto fopt = q.options().dtype(acc);
  const at::Tensor la = log_alpha.to(acc), lb = log_beta.to(acc);
  at::Tensor cr = at::empty({BG, N}, fopt), cc = at::empty({BG, N}, fopt);
  at::Tensor tok = at::empty({3, BG, N}, fopt);                                  // delta, g_cr, g_cc
  at::Tensor sv = at::empty({6, sz.B, sz.H, sz.W, sz.G, sz.dv}, fopt);           // z1 z2 gz1 gz2 gv_c gv_r
  at::Tensor sd = at::empty({4, sz.B, sz.H, sz.W, sz.G, sz.d}, fopt);            // dq_c dk_c dq_r dk_r
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "criss_cross_attention_backward_cuda",
                                  [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    cc_prefix_sums<A>(sz, la, lb, cr, cc, stream);
    CrissCrossParams<T, A> p;
    p.sz = sz;
    p.scale = A(scale);
    p.q = cptr<scalar_t>(q);
    p.k = cptr<scalar_t>(k);
    p.v = cptr<scalar_t>(v);
    p.dout = cptr<scalar_t>(dout);
    p.sq = strides4(q);
    p.sk = strides4(k);
    p.sv = strides4(v);
    p.sdo = strides4(dout);
    p.cr = cr.data_ptr<A>();
    p.cc = cc.data_ptr<A>();
    p.lse = lse.data_ptr<A>();
    const int64_t mv = int64_t(sz.B) * N * sz.G * sz.dv, md = int64_t(sz.B) * N * sz.G * sz.d;
    A* s = sv.data_ptr<A>();
    p.z1 = s;
    p.z2 = s + mv;
    p.gz1 = s + 2 * mv;
    p.gz2 = s + 3 * mv;
    p.gv_c = s + 4 * mv;
    p.gv_r = s + 5 * mv;
    A* t = sd.data_ptr<A>();
    p.dq_c = t;
    p.dk_c = t + md;
    p.dq_r = t + 2 * md;
    p.dk_r = t + 3 * md;
    A* u = tok.data_ptr<A>();
    p.delta = u;
    p.g_cr = u + BG * N;
    p.g_cc = u + 2 * BG * N;
    p.dq = cptr<scalar_t>(gq);
    p.dk = cptr<scalar_t>(gk);
    p.dv = cptr<scalar_t>(gv);
    p.g_log_alpha = gla.data_ptr<A>();
    p.g_log_beta = glb.data_ptr<A>();
    PPMA_DPAD_SWITCH(dpad, [&] { launch_criss_cross_bwd<T, DPAD>(p, stream); });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {gq, gk, gv, gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cuda
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CUDA, m) {
  m.impl("criss_cross_attention", &ppma::cuda::criss_cross_attention_cuda);
  m.impl("criss_cross_attention_backward", &ppma::cuda::criss_cross_attention_backward_cuda);
}
