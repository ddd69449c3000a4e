// Kernel math that the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/kernels) share, written once:
// the accumulation type, token addressing, the prefix-sum conventions, the segment bias and its sign rule.
// docs/ops.md is the definition; the comments name its sections. Torch-free; every function is inline and
// compiles for host and device (nvcc: __host__ __device__).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PPMA_HD __host__ __device__ __forceinline__
// The helpers that take a callable are instantiated with __device__ lambdas by the CUDA kernels; their host
// instantiation is never called, so nvcc's check of it is off (as in Thrust and Eigen).
#define PPMA_HD_TEMPLATE _Pragma("nv_exec_check_disable") template
#else
#define PPMA_HD inline
#define PPMA_HD_TEMPLATE template
#endif

namespace ppma {

// ---------------------------------------------------------------------------------------------
// Accumulation type (docs/ops.md "Numerics"): fp32 for float, half and bfloat16 inputs, fp64 for double.
// Prefix sums, biases, softmax statistics and every accumulator use it. The host code picks the same
// dtype at run time with acc_type() (common/checks.h).
// ---------------------------------------------------------------------------------------------
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

template <typename A>
PPMA_HD A neg_inf() {
  return -static_cast<A>(INFINITY);
}

// ---------------------------------------------------------------------------------------------
// Token addressing (docs/ops.md "Layout"): token p = (i, j) has the row-major index p = i * W + j of the
// N = H * W grid; the kernels' contiguous buffers are [B, H, W, heads] (times the channel count for
// features), so the element index of (b, p, g) is token_index(...) * channels + channel.
// ---------------------------------------------------------------------------------------------
PPMA_HD int64_t token_index(int64_t N, int64_t G, int64_t b, int64_t p, int64_t g) { return (b * N + p) * G + g; }

// Token index p of position t on line `li`: row li (rows) or column li. Consecutive positions are
// line_stride(rows, W) tokens apart.
PPMA_HD int64_t line_token(bool rows, int64_t li, int64_t t, int64_t W) { return rows ? li * W + t : t * W + li; }
PPMA_HD int64_t line_stride(bool rows, int64_t W) { return rows ? 1 : W; }

// Log-decays below -1e4 (down to -inf, a decay of exactly 0) count as -1e4 in the prefix sums (docs/ops.md,
// "Edges"; the reference does the same, ppma.ops._validate.LOG_DECAY_FLOOR): exp(-1e4) is 0 in every supported
// dtype, so a path through such an edge keeps weight 0, while the prefix sums stay finite (-inf - -inf is NaN).
// Written as a comparison so that NaN passes through (fmax would drop it).
template <typename T>
PPMA_HD T floor_log_decay(T d) {
  return d < T(-1e4) ? T(-1e4) : d;
}

// ---------------------------------------------------------------------------------------------
// Prefix sums (docs/ops.md "Prefix sums and biases"), excluding index 0 so that the first log-decay of a line never
// enters a bias and gets exactly zero gradient: c_0 = 0, c_t = sum_{1 <= n <= t} a_n. Sequential along the
// line (deterministic); each a_n is floored first (floor_log_decay). a and c are strided (element strides as, cs) and may be the same array.
// ---------------------------------------------------------------------------------------------
template <typename A, typename In, typename Index>
PPMA_HD void line_prefix_sums(Index n, const In* a, int64_t as, A* c, int64_t cs) {
  A run = 0;
  c[0] = A(0);
  for (Index t = 1; t < n; ++t) {
    run += floor_log_decay(static_cast<A>(a[t * as]));
    c[t * cs] = run;
  }
}

// The backward of line_prefix_sums: log-decay gradients from prefix-sum gradients,
// out[n] = sum_{t >= n} grad_c(t) for n >= 1 and out[0] = 0 exactly (a reverse cumsum). grad_c(t) returns the
// gradient of c_t; out is strided (element stride os).
PPMA_HD_TEMPLATE <typename A, typename GradC, typename Out, typename Index>
PPMA_HD void decay_grads_from_prefix(Index n, const GradC& grad_c, Out* out, int64_t os) {
  A run = 0;
  for (Index t = n - 1; t >= 1; --t) {
    run += grad_c(t);
    out[t * os] = static_cast<Out>(run);
  }
  out[0] = Out(0);
}

// The same with the prefix-sum gradients in a strided array (element stride gs).
template <typename A, typename Out, typename Index>
PPMA_HD void decay_grads_from_prefix(Index n, const A* grad_c, int64_t gs, Out* out, int64_t os) {
  decay_grads_from_prefix<A>(n, [&](Index t) { return grad_c[t * gs]; }, out, os);
}

// ---------------------------------------------------------------------------------------------
// The segment bias (docs/ops.md "Prefix sums and biases": R and C): positions t, u of one line with prefix
// sums ct = c[t], cu = c[u] have the bias log(prod_{min < n <= max} a_n) = c[max(t,u)] - c[min(t,u)] (<= 0
// for log-decays <= 0). It is written in position order, never with abs(), so that its gradient is defined
// even where a decay is exactly 1 (log-decay 0): d bias / d ct = sgn_diff(t, u), d bias / d cu = sgn_diff(u, t).
// The CPU kernels hoist the branch out of their loops (one loop over u < t, one over u >= t). Written as a sign
// times one difference (the same value bit for bit, since a - b = -(b - a) in IEEE arithmetic): the tensor-core
// forward evaluates four of these per score element, and this form fits it in the register file where the
// select-between-two-differences form spills (ptxas, sm_80 and sm_90, head dims 32 and 64).
// ---------------------------------------------------------------------------------------------
template <typename A, typename Index>
PPMA_HD A line_bias(Index t, Index u, A ct, A cu) {
  return (u > t ? A(-1) : A(1)) * (ct - cu);
}

// sign(a - b) as +1 / 0 / -1: the sign rule of the bias gradient (0 for a pair with itself).
template <typename A, typename Index>
PPMA_HD A sgn_diff(Index a, Index b) {
  return static_cast<A>((a > b) - (a < b));
}

}  // namespace ppma
