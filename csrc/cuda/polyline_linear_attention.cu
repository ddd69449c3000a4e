// CUDA launchers of ppma::polyline_linear_attention and its backward (docs/ops.md "polyline_linear_attention"; the
// same schema, outputs and statistics as the CPU kernel). Kernels: csrc/kernels/polyline_linear_attention.cuh (the
// scan form split into channel slices, one block per (b * heads + g, direction, slice)); this file checks the
// inputs, allocates the outputs and the one workspace buffer, and launches them on the current stream. With the
// internal option cuda_next_polyline_linear_attention = 1 (read at every call) it launches the next kernels of
// csrc/kernels/polyline_linear_attention_v2.cuh instead (state in shared memory, one owner per state element;
// docs/cuda-kernels.md), not yet verified on a GPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/options.h"
#include "cuda/launch_utils.h"
#include "kernels/polyline_linear_attention.cuh"
#include "kernels/polyline_linear_attention_v2.cuh"

namespace ppma {
namespace cuda {
namespace {

// The inputs as the kernels read them, shared by forward and backward: q, k, v with a unit last stride, the
// log-decays in the accumulation dtype (any strides), sizes and the channel count C of v'. Checked first; built
// under the caller's device guard.
struct LinearInputs {
  at::Tensor q, k, v, la, lb;
  at::ScalarType acc;
  GridSizes sz;
  int64_t C;

  LinearInputs(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& log_alpha,
               const at::Tensor& log_beta, bool normalize)
      : q(last_dim_contiguous(q_in)),
        k(last_dim_contiguous(k_in)),
        v(last_dim_contiguous(v_in)),
        acc(acc_type(q_in)),
        sz(grid_sizes(q_in, v_in.size(4))),
        C(sz.dv + (normalize ? 1 : 0)) {
    la = log_alpha.to(acc);
    lb = log_beta.to(acc);
  }

  bool empty() const { return q.numel() == 0 || v.numel() == 0; }

  // Whether the next kernels run: the option, read once per call.
  bool next = get_option(Option::kCudaNextPolylineLinearAttention) == 1;

  // The next kernels' slices and state placement (they depend on the map, the head dim and the accumulation dtype
  // through the shared-memory budget).
  LinV2Plan plan(bool backward) const {
    return polyline_linear_attention_v2_plan(sz, int(C), acc == at::kDouble ? 8 : 4, backward);
  }

  // The largest grid of the kernels that run fits the launch limit.
  void check_blocks(const char* op, bool backward) const {
    const int c = int(C);
    check_grid(op,
               next ? polyline_linear_attention_v2_blocks(sz, c, plan(backward), backward)
                    : polyline_linear_attention_blocks(sz, c, polyline_linear_attention_slice(c), backward),
               sz);
  }

  // The input fields of p (sizes, channels and slices, eps, q, k, v, log-decays).
  template <typename scalar_t, typename P>
  void set(P& p, bool normalize, double eps) const {
    using A = decltype(p.eps);
    p.w.sz = sz;
    p.w.C = int(C);
    p.w.cs = polyline_linear_attention_slice(int(C));
    p.normalize = normalize;
    p.eps = A(eps);
    set_qkv<scalar_t>(p, q, k, v);
    p.log_alpha = la.data_ptr<A>();
    p.log_beta = lb.data_ptr<A>();
    p.sa = strides4(la);
    p.sb = strides4(lb);
  }
};

// The workspace of p.w (forward or backward), allocated as one acc tensor that the caller keeps alive.
template <typename A, typename P>
at::Tensor workspace(P& p, bool backward, const at::Tensor& like) {
  const int64_t n = polyline_linear_attention_workspace(p.w, backward, static_cast<A*>(nullptr));
  at::Tensor ws = at::empty({n}, like.options());
  polyline_linear_attention_workspace(p.w, backward, ws.data_ptr<A>());
  return ws;
}

// The next kernels' workspace for a plan: without the state where it fits shared memory.
template <typename A, typename P>
at::Tensor workspace_v2(P& p, bool backward, const LinV2Plan& pl, const at::Tensor& like) {
  const int64_t n = polyline_linear_attention_v2_workspace(p.w, backward, pl, static_cast<A*>(nullptr));
  at::Tensor ws = at::empty({n}, like.options());
  polyline_linear_attention_v2_workspace(p.w, backward, pl, ws.data_ptr<A>());
  return ws;
}

// Lays out the workspace of the kernels that run and launches them (forward or backward); returns the workspace,
// which the caller keeps alive until the launches are queued.
template <typename T, typename A>
at::Tensor launch_linear(LinearAttnParams<T, A>& p, bool backward, const LinearInputs& in, const at::Tensor& like,
                         cudaStream_t stream) {
  if (in.next) {
    const LinV2Plan pl = in.plan(backward);
    at::Tensor ws = workspace_v2<A>(p, backward, pl, like);
    if (backward)
      launch_polyline_linear_attention_v2_bwd(p, pl, stream);
    else
      launch_polyline_linear_attention_v2_fwd(p, pl, stream);
    return ws;
  }
  at::Tensor ws = workspace<A>(p, backward, like);
  if (backward)
    launch_polyline_linear_attention_bwd(p, stream);
  else
    launch_polyline_linear_attention_fwd(p, stream);
  return ws;
}

void check_linear(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& log_alpha, const at::Tensor& log_beta) {
  check_is_cuda(op, "q", q);
  check_inputs(op, q, k, v, log_alpha, log_beta);
}

std::tuple<at::Tensor, at::Tensor> polyline_linear_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                  const at::Tensor& v_in, const at::Tensor& log_alpha,
                                                                  const at::Tensor& log_beta, bool normalize,
                                                                  double eps) {
  const char* op = "ppma::polyline_linear_attention";
  check_linear(op, q_in, k_in, v_in, log_alpha, log_beta);
  check_eps(op, eps);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const LinearInputs in(q_in, k_in, v_in, log_alpha, log_beta, normalize);
  const GridSizes& sz = in.sz;
  at::Tensor out = at::empty(in.v.sizes(), in.v.options());
  at::Tensor stats = at::empty({sz.B, sz.H, sz.W, sz.G, 2, in.C}, in.q.options().dtype(in.acc));
  if (in.empty()) return {out.zero_(), stats.zero_()};
  in.check_blocks(op, false);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.q.scalar_type(), "polyline_linear_attention_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    LinearAttnParams<T, A> p;
    in.set<scalar_t>(p, normalize, eps);
    p.out = cptr<scalar_t>(out);
    p.w.stats = stats.data_ptr<A>();
    const at::Tensor ws = launch_linear(p, false, in, stats, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_linear_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& stats_in, bool normalize, double eps) {
  const char* op = "ppma::polyline_linear_attention_backward";
  check_linear(op, q_in, k_in, v_in, log_alpha, log_beta);
  check_shape(op, "grad_out", grad_out_in, v_in.sizes(), q_in);
  check_like(op, "grad_out", grad_out_in, "q", q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const LinearInputs in(q_in, k_in, v_in, log_alpha, log_beta, normalize);
  const GridSizes& sz = in.sz;
  check_shape(op, "stats", stats_in, {sz.B, sz.H, sz.W, sz.G, 2, in.C}, q_in);
  AttentionGrads g(in.q, in.v, log_alpha, in.acc);
  if (in.empty()) return g.zeros(log_alpha, log_beta);
  in.check_blocks(op, true);
  const at::Tensor dout = last_dim_contiguous(grad_out_in);
  const at::Tensor stats = stats_in.to(in.acc).contiguous();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.q.scalar_type(), "polyline_linear_attn_bwd_cuda", [&] {
    using T = typename CudaType<scalar_t>::type;
    using A = typename AccType<T>::type;
    LinearAttnParams<T, A> p;
    in.set<scalar_t>(p, normalize, eps);
    p.w.stats = const_cast<A*>(stats.data_ptr<A>());  // read only in the backward
    p.dout = cptr<scalar_t>(dout);
    p.sdo = strides4(dout);
    g.bind<scalar_t>(p);
    const at::Tensor ws = launch_linear(p, true, in, stats, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return g.result(log_alpha, log_beta);
}

}  // namespace
}  // namespace cuda
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CUDA, m) {
  m.impl("polyline_linear_attention", &ppma::cuda::polyline_linear_attention_cuda);
  m.impl("polyline_linear_attention_backward", &ppma::cuda::polyline_linear_attention_backward_cuda);
}
