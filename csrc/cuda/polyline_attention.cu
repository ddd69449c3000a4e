// CUDA launchers of ppma::polyline_attention and its backward (design §2): argument checks, device
// guard, current stream, dtype and head-dim dispatch, Params, checked launches. Kernels:
// csrc/kernels/polyline_attention_{fwd,bwd}.cuh.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/cuda_checks.h"
#include "kernels/polyline_attention_bwd.cuh"
#include "kernels/polyline_attention_fwd.cuh"

namespace ppma {
namespace cuda {
namespace {

// Prefix sums cr, cc ([BG][N], acc dtype) of the log-decays (converted to acc dtype first).
template <typename A>
void prefix_sums(const GridSizes& sz, const at::Tensor& la, const at::Tensor& lb, const at::Tensor& cr,
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                       const at::Tensor& v_in,
                                                                       const at::Tensor& log_alpha,
                                                                       const at::Tensor& log_beta, double scale) {
  const char* op = "ppma::polyline_attention";
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const auto acc = acc_type(q);
  const GridSizes sz = grid_sizes(q, v.size(4));
  at::Tensor out = at::empty({sz.B, sz.H, sz.W, sz.G, sz.dv}, q.options());
  at::Tensor out_v2h = at::empty_like(out);
  at::Tensor lse = at::empty({sz.B, sz.H, sz.W, sz.G, 2}, q.options().dtype(acc));
  if (q.numel() == 0 || v.numel() == 0) return {out.zero_(), out_v2h.zero_(), lse.zero_()};
  const int dpad = padded_head_dim(op, sz.d, sz.dv);
  const int64_t N = int64_t(sz.H) * sz.W;
  const at::Tensor la = log_alpha.to(acc), lb = log_beta.to(acc);
  at::Tensor cr = at::empty({int64_t(sz.B) * sz.G, N}, q.options().dtype(acc));
  at::Tensor cc = at::empty_like(cr);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "polyline_attention_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    prefix_sums<A>(sz, la, lb, cr, cc, stream);
    PolylineAttnParams<T, A> p;
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
    p.out_v2h = cptr<scalar_t>(out_v2h);
    p.lse = lse.data_ptr<A>();
    PPMA_DPAD_SWITCH(dpad, [&] { launch_polyline_attention_fwd<T, DPAD>(p, stream); });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, out_v2h, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& out_in,
    const at::Tensor& out_v2h_in, const at::Tensor& lse_in, double scale) {
  const char* op = "ppma::polyline_attention_backward";
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  const auto vshape = v_in.sizes();
  check_shape(op, "grad_out", grad_out_in, vshape, q_in);
  check_shape(op, "out", out_in, vshape, q_in);
  check_shape(op, "out_v2h", out_v2h_in, vshape, q_in);
  std::vector<int64_t> lshape(q_in.sizes().begin(), q_in.sizes().begin() + 4);
  lshape.push_back(2);
  check_shape(op, "lse", lse_in, lshape, q_in);
  check_same_dtype(op, "grad_out", grad_out_in, "q", q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const at::Tensor dout = last_dim_contiguous(grad_out_in);
  const at::Tensor out = out_in.to(q.scalar_type()).contiguous();
  const at::Tensor out_v2h = out_v2h_in.to(q.scalar_type()).contiguous();
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
  const at::Tensor la = log_alpha.to(acc), lb = log_beta.to(acc);
  const auto fopt = q.options().dtype(acc);
  at::Tensor cr = at::empty({BG, N}, fopt), cc = at::empty({BG, N}, fopt);
  at::Tensor delta = at::empty({BG, N, 2}, fopt);
  at::Tensor own = at::empty({4, BG, N}, fopt);  // gq_cr, gq_cc, gk_cr, gk_cc (every token written)
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "polyline_attention_backward_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    prefix_sums<A>(sz, la, lb, cr, cc, stream);
    PPMA_DPAD_SWITCH(dpad, [&] {
      const RowTiling tl(sz.H, sz.W, polyline_attention_bwd_tile<T, DPAD>());
      at::Tensor tabs = at::zeros({4, BG, int64_t(tl.num_tiles) * tl.table}, fopt);  // x1_cr, x1_cc, x2_cr, x2_cc
      PolylineAttnParams<T, A> p;
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
      p.lse = lse.data_ptr<A>();
      p.dout = cptr<scalar_t>(dout);
      p.sdo = strides4(dout);
      p.out_c = cptr<scalar_t>(out);
      p.out_v2h_c = cptr<scalar_t>(out_v2h);
      p.delta = delta.data_ptr<A>();
      p.dq = cptr<scalar_t>(gq);
      p.dk = cptr<scalar_t>(gk);
      p.dv = cptr<scalar_t>(gv);
      A* o = own.data_ptr<A>();
      p.gq_cr = o;
      p.gq_cc = o + BG * N;
      p.gk_cr = o + 2 * BG * N;
      p.gk_cc = o + 3 * BG * N;
      A* t = tabs.data_ptr<A>();
      const int64_t ts = BG * int64_t(tl.num_tiles) * tl.table;
      p.x1_cr = t;
      p.x1_cc = t + ts;
      p.x2_cr = t + 2 * ts;
      p.x2_cc = t + 3 * ts;
      p.tile_rows = tl.R;
      p.g_log_alpha = gla.data_ptr<A>();
      p.g_log_beta = glb.data_ptr<A>();
      launch_polyline_attention_bwd<T, DPAD>(p, stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {gq, gk, gv, gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cuda
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CUDA, m) {
  m.impl("polyline_attention", &ppma::cuda::polyline_attention_cuda);
  m.impl("polyline_attention_backward", &ppma::cuda::polyline_attention_backward_cuda);
}
