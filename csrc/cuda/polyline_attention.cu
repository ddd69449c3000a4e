// CUDA launchers of ppma::polyline_attention and its backward (docs/ops.md "polyline_attention"): argument checks, device
// guard, current stream, dtype and head-dim dispatch, Params, checked launches. Kernels:
// csrc/kernels/polyline_attention_tc.cuh (tensor cores: fp16 / bf16, d and dv multiples of 8 up to 128, sm_80+;
// see use_tensor_cores) and csrc/kernels/polyline_attention_{fwd,bwd}.cuh (CUDA cores: every other case). With the
// internal option cuda_next_polyline_attention = 1 (read on every call, so it can be toggled between calls) the
// tensor-core forward and backward take the row-uniform kernels of csrc/kernels/polyline_attention_tc_fwd2.cuh and
// _bwd2.cuh where they apply (polyline_attention_tc_next_covers: W a multiple of 16, 16 < W < 32 in their two-row
// form, or 32 < W <= 2048; docs/design.md §4.3), not yet verified on a GPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/options.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>

#include "cuda/launch_utils.h"
#include "kernels/polyline_attention_bwd.cuh"
#include "kernels/polyline_attention_fwd.cuh"
#include "kernels/polyline_attention_tc.cuh"
#include "kernels/polyline_attention_tc_bwd2.cuh"
#include "kernels/polyline_attention_tc_fwd2.cuh"

namespace ppma {
namespace cuda {
namespace {

// The tensor-core polyline_attention kernels (sm_80+) take fp16 / bf16 with d, dv multiples of 8 up to 128 (and
// H, W up to kTcMaxSide, as they pack positions in 16 bits).
// Everything else runs on the CUDA-core kernels, and the option cuda_tensor_cores = 0 forces those (comparisons);
// the two differ in rounding only (the tensor-core path rounds P and dS to 16 bits before its products).
inline bool use_tensor_cores(const at::Tensor& q, const GridSizes& sz) {
  const auto st = q.scalar_type();
  if (st != at::kHalf && st != at::kBFloat16) return false;
  if (sz.d % 8 != 0 || sz.dv % 8 != 0 || sz.d > 128 || sz.dv > 128) return false;
  if (sz.H > kTcMaxSide || sz.W > kTcMaxSide) return false;
  if (get_option(Option::kCudaTensorCores) == 0) return false;
  return compute_capability_major(q.device().index()) >= 8;
}

// Padded head dim of the tensor-core kernels: 16, 32, 64 or 128.
inline int tc_head_dim(const GridSizes& sz) {
  const int m = sz.d > sz.dv ? sz.d : sz.dv;
  return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
}

// The tensor-core kernels copy 16-byte rows with cp.async: a feature tensor whose token rows are not 16-byte
// aligned (odd strides or storage offset) is copied to a fresh contiguous tensor first.
inline at::Tensor aligned_rows(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 4; ++i)
    ok = ok && (t.size(i) == 1 || (t.stride(i) * int64_t(t.element_size())) % 16 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Calls tc_fn(D) on the tensor-core path (fp16 / bf16 only) or core_fn(D) on the CUDA-core path, D an
// std::integral_constant holding the padded head dim. The lambdas are generic, so the tensor-core one is not even
// instantiated for fp32 / fp64.
template <typename T, typename TcFn, typename CoreFn>
void with_path(bool tc, int dpad, TcFn&& tc_fn, CoreFn&& core_fn) {
  if constexpr (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value) {
    if (tc) {
      PPMA_TC_DPAD_SWITCH(dpad, [&] { tc_fn(std::integral_constant<int, DPAD>()); });
      return;
    }
  }
  PPMA_DPAD_SWITCH(dpad, [&] { core_fn(std::integral_constant<int, DPAD>()); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                       const at::Tensor& v_in,
                                                                       const at::Tensor& log_alpha,
                                                                       const at::Tensor& log_beta, double scale) {
  const char* op = "ppma::polyline_attention";
  check_is_cuda(op, "q", q_in);
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const auto acc = acc_type(q);
  const GridSizes sz = grid_sizes(q, v.size(4));
  at::Tensor out = at::empty({sz.B, sz.H, sz.W, sz.G, sz.dv}, q.options());
  at::Tensor out_v2h = at::empty_like(out);
  at::Tensor lse = at::empty({sz.B, sz.H, sz.W, sz.G, 2}, q.options().dtype(acc));
  if (q.numel() == 0 || v.numel() == 0) return {out.zero_(), out_v2h.zero_(), lse.zero_()};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool tc = use_tensor_cores(q, sz);
  const int dpad = tc ? tc_head_dim(sz) : padded_head_dim(op, sz.d, sz.dv);
  const at::Tensor qk = tc ? aligned_rows(q) : q, kk = tc ? aligned_rows(k) : k, vk = tc ? aligned_rows(v) : v;
  const bool next = tc && get_option(Option::kCudaNextPolylineAttention) != 0;
  at::Tensor cr, cc;
  std::tie(cr, cc) = prefix_sums(sz, log_alpha, log_beta, acc, stream);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "polyline_attention_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    PolylineAttnParams<T, A> p;
    set_attention_inputs<scalar_t>(p, sz, scale, qk, kk, vk, cr, cc);
    p.out = cptr<scalar_t>(out);
    p.out_v2h = cptr<scalar_t>(out_v2h);
    p.lse = lse.data_ptr<A>();
    with_path<T>(
        tc, dpad,
        [&](auto D) {
          check_grid(op, polyline_attention_tc_blocks<decltype(D)::value>(sz), sz);
          if (next)  // same grid and outputs as the verified forward
            launch_polyline_attention_tc_fwd_next<T, decltype(D)::value>(p, stream);
          else
            launch_polyline_attention_tc_fwd<T, decltype(D)::value>(p, stream);
        },
        [&](auto D) {
          check_grid(op, polyline_attention_fwd_blocks<T, decltype(D)::value>(sz), sz);
          launch_polyline_attention_fwd<T, decltype(D)::value>(p, stream);
        });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, out_v2h, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& out_in,
    const at::Tensor& out_v2h_in, const at::Tensor& lse_in, double scale) {
  const char* op = "ppma::polyline_attention_backward";
  check_is_cuda(op, "q", q_in);
  check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
  const auto vshape = v_in.sizes();
  check_shape(op, "grad_out", grad_out_in, vshape, q_in);
  check_shape(op, "out", out_in, vshape, q_in);
  check_shape(op, "out_v2h", out_v2h_in, vshape, q_in);
  check_lse(op, lse_in, q_in);
  check_like(op, "grad_out", grad_out_in, "q", q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const at::Tensor dout = last_dim_contiguous(grad_out_in);
  const at::Tensor out = out_in.to(q.scalar_type()).contiguous();
  const at::Tensor out_v2h = out_v2h_in.to(q.scalar_type()).contiguous();
  const auto acc = acc_type(q);
  const at::Tensor lse = lse_in.to(acc).contiguous();
  const GridSizes sz = grid_sizes(q, v.size(4));
  AttentionGrads g(q, v, log_alpha, acc);
  if (q.numel() == 0 || v.numel() == 0) return g.zeros(log_alpha, log_beta);
  const int64_t N = int64_t(sz.H) * sz.W, BG = int64_t(sz.B) * sz.G;
  const auto fopt = q.options().dtype(acc);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool tc = use_tensor_cores(q, sz);
  const int dpad = tc ? tc_head_dim(sz) : padded_head_dim(op, sz.d, sz.dv);
  // RowTiling tile size of the cross-term tables, and the largest grid
  int tile = 0;
  int64_t blocks = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "polyline_attention_backward_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    with_path<T>(
        tc, dpad,
        [&](auto D) {
          tile = polyline_attention_tc_bwd_tile<decltype(D)::value>();
          blocks = polyline_attention_tc_blocks<decltype(D)::value>(sz);
        },
        [&](auto D) {
          tile = polyline_attention_bwd_tile<T, decltype(D)::value>();
          blocks = polyline_attention_bwd_blocks<T, decltype(D)::value>(sz);
        });
  });
  check_grid(op, blocks, sz);
  const RowTiling tl(sz.H, sz.W, tile);
  at::Tensor cr, cc;
  std::tie(cr, cc) = prefix_sums(sz, log_alpha, log_beta, acc, stream);
  at::Tensor delta = at::empty({BG, N, 2}, fopt);
  at::Tensor own = at::empty({4, BG, N}, fopt);  // gq_cr, gq_cc, gk_cr, gk_cc (every token written)
  // x1_cr, x1_cc, x2_cr, x2_cc: [BG][num_ctas][table], at most 4 * N entries per (b, head) each (RowTiling)
  at::Tensor tabs = at::zeros({4, BG, int64_t(tl.num_ctas) * tl.table}, fopt);
  const at::Tensor qk = tc ? aligned_rows(q) : q, kk = tc ? aligned_rows(k) : k, vk = tc ? aligned_rows(v) : v;
  const at::Tensor dk_out = tc ? aligned_rows(dout) : dout;
  const bool next = tc && get_option(Option::kCudaNextPolylineAttention) != 0;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "polyline_attention_backward_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    PolylineAttnParams<T, A> p;
    set_attention_inputs<scalar_t>(p, sz, scale, qk, kk, vk, cr, cc);
    p.lse = lse.data_ptr<A>();
    p.dout = cptr<scalar_t>(dk_out);
    p.sdo = strides4(dk_out);
    p.out_c = cptr<scalar_t>(out);
    p.out_v2h_c = cptr<scalar_t>(out_v2h);
    p.delta = delta.data_ptr<A>();
    g.bind<scalar_t>(p);
    A* o = own.data_ptr<A>();
    p.gq_cr = o;
    p.gq_cc = o + BG * N;
    p.gk_cr = o + 2 * BG * N;
    p.gk_cc = o + 3 * BG * N;
    A* t = tabs.data_ptr<A>();
    const int64_t ts = BG * int64_t(tl.num_ctas) * tl.table;
    p.x1_cr = t;
    p.x1_cc = t + ts;
    p.x2_cr = t + 2 * ts;
    p.x2_cc = t + 3 * ts;
    with_path<T>(
        tc, dpad,
        [&](auto D) {
          if (next)  // same buffers and table layout (RowTiling of TcTraits<DPAD>::BM) as the verified kernels
            launch_polyline_attention_tc_bwd_next<T, decltype(D)::value>(p, stream);
          else
            launch_polyline_attention_tc_bwd<T, decltype(D)::value>(p, stream);
        },
        [&](auto D) { launch_polyline_attention_bwd<T, decltype(D)::value>(p, stream); });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return g.result(log_alpha, log_beta);
}

}  // namespace
}  // namespace cuda
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CUDA, m) {
  m.impl("polyline_attention", &ppma::cuda::polyline_attention_cuda);
  m.impl("polyline_attention_backward", &ppma::cuda::polyline_attention_backward_cuda);
}
