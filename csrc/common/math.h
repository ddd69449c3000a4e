// Torch-free math shared by the CPU and CUDA kernels of ppma (design §2, semantics of the biases).
//
// Everything here is inline and usable from host and device code. The prefix sums exclude index 0
// (c_0 = 0, c_t = sum_{1 <= n <= t} d_n), so the first log-decay of a line never enters a bias.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PPMA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PPMA_HOST_DEVICE inline
#endif

namespace ppma {

// Sign of the position order of a pair (t, s): +1 when t >= s, -1 otherwise. The segment bias of the
// pair is pos_sign(t, s) * (c_t - c_s) = c_max - c_min; written this way (never with abs) so that its
// gradient w.r.t. the prefix sums is defined even where a decay is exactly 1 (log-decay 0).
template <typename T>
PPMA_HOST_DEVICE T pos_sign(long long t, long long s) {
  return t >= s ? T(1) : T(-1);
}

// Segment bias log(prod_{min(t,s) < n <= max(t,s)} a_n) = c_max - c_min (<= 0 for log-decays <= 0).
template <typename T>
PPMA_HOST_DEVICE T segment_bias(T c_t, T c_s, long long t, long long s) {
  return pos_sign<T>(t, s) * (c_t - c_s);
}

// Log-decays below -1e4 (down to -inf, a decay of exactly 0) count as -1e4 in the prefix sums (docs/ops.md,
// "Edges"; the reference does the same, ppma.ops._validate.LOG_DECAY_FLOOR): exp(-1e4) is 0 in every supported
// dtype, so a path through such an edge keeps weight 0, while the prefix sums stay finite (-inf - -inf is NaN).
// Written as a comparison so that NaN passes through (fmax would drop it).
template <typename T>
PPMA_HOST_DEVICE T floor_log_decay(T d) {
  return d < T(-1e4) ? T(-1e4) : d;
}

}  // namespace ppma
