// CUDA launchers of ppma::criss_cross_attention and its backward (docs/ops.md "criss_cross_attention"). Kernels:
// csrc/kernels/criss_cross_attention.cuh (packed short lines, or the generic line kernels, per direction) and,
// under the option cuda_next_criss_cross_attention = 1, csrc/kernels/criss_cross_attention_tc.cuh (tensor cores;
// see use_next_kernels).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/options.h"
#include "cuda/launch_utils.h"
#include "kernels/criss_cross_attention.cuh"
#include "kernels/criss_cross_attention_tc.cuh"

namespace ppma {
namespace cuda {
namespace {

// The tensor-core kernels (criss_cross_attention_tc.cuh) are opt-in until a GPU run verifies them: option
// cuda_next_criss_cross_attention = 1, fp16 / bf16 inputs, head dims up to 32 (padded head dim <= 32), sm_80+.
// Within them, each direction whose lines have at most 64 tokens runs on tensor cores and a longer one on the
// verified kernels (criss_cross_tc_fits). They differ from the verified kernels in rounding only (P, dS and the
// fp32 scratch z1, z2, gz1, gz2 are rounded to 16 bits as mma operands).
inline bool use_next_kernels(const at::Tensor& q, int dpad) {
  const auto st = q.scalar_type();
  if (st != at::kHalf && st != at::kBFloat16) return false;
  if (dpad > 32 || get_option(Option::kCudaNextCrissCrossAttention) == 0) return false;
  return compute_capability_major(q.device().index()) >= 8;
}

std::tuple<at::Tensor, at::Tensor> criss_cross_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                               const at::Tensor& v_in, const at::Tensor& log_alpha,
                                                               const at::Tensor& log_beta, double scale) {
  const char* op = "ppma::criss_cross_attention";
  check_is_cuda(op, "q", q_in);
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const auto acc = acc_type(q);
  const GridSizes sz = grid_sizes(q, v.size(4));
  at::Tensor out = at::empty({sz.B, sz.H, sz.W, sz.G, sz.dv}, q.options());
  at::Tensor lse = at::empty({sz.B, sz.H, sz.W, sz.G, 2}, q.options().dtype(acc));
  if (q.numel() == 0 || v.numel() == 0) return {out.zero_(), lse.zero_()};
  const int dpad = padded_head_dim(op, sz.d, sz.dv);
  check_grid(op, criss_cross_blocks(sz), sz);
  const bool next = use_next_kernels(q, dpad);
  const int64_t N = int64_t(sz.H) * sz.W;
  const auto fopt = q.options().dtype(acc);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  at::Tensor cr, cc;
  std::tie(cr, cc) = prefix_sums(sz, log_alpha, log_beta, acc, stream);
  // z1, z2, out1 (fp32); with the tensor-core kernels on both directions z1, z2 are 16-bit (z16) and only out1 is
  // fp32 (criss_cross_attention_tc.cuh, "Scratch")
  const bool z16 = next && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) &&
                   criss_cross_tc_scratch16<__half>(sz, dpad);
  at::Tensor scratch = at::empty({z16 ? 1 : 3, sz.B, sz.H, sz.W, sz.G, sz.dv}, fopt);
  at::Tensor scratch16 = z16 ? at::empty({2, sz.B, sz.H, sz.W, sz.G, sz.dv}, q.options()) : at::Tensor();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "criss_cross_attention_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    CrissCrossParams<T, A> p;
    set_attention_inputs<scalar_t>(p, sz, scale, q, k, v, cr, cc);
    p.out = cptr<scalar_t>(out);
    p.lse = lse.data_ptr<A>();
    A* s = scratch.data_ptr<A>();
    const int64_t m = int64_t(sz.B) * N * sz.G * sz.dv;
    p.z1 = z16 ? nullptr : s;
    p.z2 = z16 ? nullptr : s + m;
    p.out1 = z16 ? s : s + 2 * m;
    T* zs = z16 ? cptr<scalar_t>(scratch16) : nullptr;
    PPMA_DPAD_SWITCH(dpad, [&] {
      if constexpr (sizeof(T) == 2) {  // the tensor-core kernels exist for fp16 / bf16 only
        if (next) return launch_criss_cross_tc_fwd<T, DPAD>(p, stream, zs);
      }
      launch_criss_cross_fwd<T, DPAD>(p, stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> criss_cross_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& lse_in, double scale) {
  const char* op = "ppma::criss_cross_attention_backward";
  check_is_cuda(op, "q", q_in);
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  check_shape(op, "grad_out", grad_out_in, v_in.sizes(), q_in);
  check_like(op, "grad_out", grad_out_in, "q", q_in);
  check_lse(op, lse_in, q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const at::Tensor dout = last_dim_contiguous(grad_out_in);
  const auto acc = acc_type(q);
  const at::Tensor lse = lse_in.to(acc).contiguous();
  const GridSizes sz = grid_sizes(q, v.size(4));
  AttentionGrads g(q, v, log_alpha, acc);
  if (q.numel() == 0 || v.numel() == 0) return g.zeros(log_alpha, log_beta);
  const int dpad = padded_head_dim(op, sz.d, sz.dv);
  check_grid(op, criss_cross_blocks(sz), sz);
  const bool next = use_next_kernels(q, dpad);
  const int64_t N = int64_t(sz.H) * sz.W, BG = int64_t(sz.B) * sz.G;
  const auto fopt = q.options().dtype(acc);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  at::Tensor cr, cc;
  std::tie(cr, cc) = prefix_sums(sz, log_alpha, log_beta, acc, stream);
  // with the tensor-core kernels on both directions: z1 z2 gz1 gz2 16-bit (z16), and no gv_r, dq_r, dk_r (the
  // last pass adds the column parts itself)
  const bool z16 = next && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) &&
                   criss_cross_tc_scratch16<__half>(sz, dpad);
  at::Tensor tok = at::empty({3, BG, N}, fopt);                                  // delta, g_cr, g_cc
  at::Tensor sv = at::empty({z16 ? 1 : 6, sz.B, sz.H, sz.W, sz.G, sz.dv}, fopt);  // z1 z2 gz1 gz2 gv_c gv_r / gv_c
  at::Tensor sd = at::empty({z16 ? 2 : 4, sz.B, sz.H, sz.W, sz.G, sz.d}, fopt);   // dq_c dk_c dq_r dk_r
  at::Tensor sv16 = z16 ? at::empty({4, sz.B, sz.H, sz.W, sz.G, sz.dv}, q.options()) : at::Tensor();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "criss_cross_attention_backward_cuda",
                                  [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    CrissCrossParams<T, A> p;
    set_attention_inputs<scalar_t>(p, sz, scale, q, k, v, cr, cc);
    p.dout = cptr<scalar_t>(dout);
    p.sdo = strides4(dout);
    p.lse = lse.data_ptr<A>();
    const int64_t mv = int64_t(sz.B) * N * sz.G * sz.dv, md = int64_t(sz.B) * N * sz.G * sz.d;
    A* s = sv.data_ptr<A>();
    A* t = sd.data_ptr<A>();
    p.dq_c = t;
    p.dk_c = t + md;
    if (z16) {
      p.gv_c = s;
    } else {
      p.z1 = s;
      p.z2 = s + mv;
      p.gz1 = s + 2 * mv;
      p.gz2 = s + 3 * mv;
      p.gv_c = s + 4 * mv;
      p.gv_r = s + 5 * mv;
      p.dq_r = t + 2 * md;
      p.dk_r = t + 3 * md;
    }
    A* u = tok.data_ptr<A>();
    p.delta = u;
    p.g_cr = u + BG * N;
    p.g_cc = u + 2 * BG * N;
    g.bind<scalar_t>(p);
    T* zs = z16 ? cptr<scalar_t>(sv16) : nullptr;
    PPMA_DPAD_SWITCH(dpad, [&] {
      if constexpr (sizeof(T) == 2) {  // the tensor-core kernels exist for fp16 / bf16 only
        if (next) return launch_criss_cross_tc_bwd<T, DPAD>(p, stream, zs);
      }
      launch_criss_cross_bwd<T, DPAD>(p, stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return g.result(log_alpha, log_beta);
}

}  // namespace
}  // namespace cuda
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CUDA, m) {
  m.impl("criss_cross_attention", &ppma::cuda::criss_cross_attention_cuda);
  m.impl("criss_cross_attention_backward", &ppma::cuda::criss_cross_attention_backward_cuda);
}
