// Host-side helpers of the CUDA launchers: the CUDA-specific argument check (the shape, dtype and device checks
// shared with the CPU backend are in common/checks.h), torch -> CUDA element types, Params strides and sizes,
// the head-dim dispatch, the grid-size check, and the pieces every attention launcher repeats (prefix sums of the log-decays, the
// q/k/v fields of the Params, the gradient outputs of the backward ops).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "kernels/common.cuh"
#include "kernels/params.h"

namespace ppma {
namespace cuda {

template <typename T>
struct CudaType {
  using type = T;
};
template <>
struct CudaType<at::Half> {
  using type = __half;
};
template <>
struct CudaType<at::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename T>
inline typename CudaType<T>::type* cptr(const at::Tensor& t) {
  return reinterpret_cast<typename CudaType<T>::type*>(t.data_ptr<T>());
}

// The compute capability (major) of `device`, asked of the driver once per device and kept (a launcher asks on
// every call; cudaDeviceGetAttribute per call would be a driver call each time). 0 marks "not asked yet"; two
// threads asking at once both store the same value.
constexpr int kMaxCachedDevices = 64;
inline int compute_capability_major(int device) {
  static std::atomic<int> majors[kMaxCachedDevices] = {};
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  int major = cached ? majors[device].load(std::memory_order_relaxed) : 0;
  if (major == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (cached) majors[device].store(major, std::memory_order_relaxed);
  }
  return major;
}

// The first input of a CUDA launcher must be a CUDA tensor; common/checks.h then checks that every other
// input is on its device.
inline void check_is_cuda(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
}

// lse: [B, H, W, heads, 2], the softmax statistics saved by an attention forward for q: [B, H, W, heads, d].
inline void check_lse(const char* op, const at::Tensor& lse, const at::Tensor& q) {
  std::vector<int64_t> lshape(q.sizes().begin(), q.sizes().begin() + 4);
  lshape.push_back(2);
  check_shape(op, "lse", lse, lshape, q);
}

// The kernels need a unit stride in the last dim; any strides elsewhere are passed through.
inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

inline Strides4 strides4(const at::Tensor& t) {
  Strides4 s;
  s.b = t.stride(0);
  s.h = t.stride(1);
  s.w = t.stride(2);
  s.g = t.stride(3);
  return s;
}

inline GridSizes grid_sizes(const at::Tensor& q, int64_t dv) {
  for (int i = 0; i < 4; ++i)
    TORCH_CHECK(q.size(i) <= INT32_MAX, "ppma: dimension ", i, " of ", q.sizes(), " is too large");
  // the kernels index a map's tokens (H * W) in int
  TORCH_CHECK(q.size(1) * q.size(2) <= INT32_MAX, "ppma: H * W = ", q.size(1) * q.size(2), " tokens of ", q.sizes(),
              " is more than the CUDA kernels index (2^31 - 1)");
  GridSizes s;
  s.B = int(q.size(0));
  s.H = int(q.size(1));
  s.W = int(q.size(2));
  s.G = int(q.size(3));
  s.d = int(q.size(4));
  s.dv = int(dv);
  return s;
}

// Padded head dim of the CUDA-core attention kernels: 16, 32, 64 (fast paths) or 128, 256, 512 (zero-padded
// generic paths). Head dims above 512 are refused with this message rather than computed another way.
constexpr int64_t kMaxCudaHeadDim = 512;
inline int padded_head_dim(const char* op, int64_t d, int64_t dv) {
  const int64_t m = d > dv ? d : dv;
  TORCH_CHECK(m <= kMaxCudaHeadDim, op, ": the CUDA kernels support head dims up to ", kMaxCudaHeadDim,
              ", got d = ", d, " and dv = ", dv, " (the CPU kernels take any head dim)");
  return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : m <= 128 ? 128 : m <= 256 ? 256 : 512;
}

// Every kernel grid is 1-D (blocks = tiles or lines times B * heads); its size must fit the grid limit.
inline void check_grid(const char* op, int64_t blocks, const GridSizes& sz) {
  TORCH_CHECK(grid_fits(blocks), op, ": the inputs need a grid of ", blocks, " blocks (B = ", sz.B, ", heads = ",
              sz.G, ", H = ", sz.H, ", W = ", sz.W, "), more than the CUDA limit of ", kMaxGridX);
}

// Prefix sums cr, cc ([B * heads, H * W], dtype acc) of log_alpha, log_beta ([B, H, W, heads], converted to acc
// first), launched on `stream`.
inline std::pair<at::Tensor, at::Tensor> prefix_sums(const GridSizes& sz, const at::Tensor& log_alpha,
                                                     const at::Tensor& log_beta, at::ScalarType acc,
                                                     cudaStream_t stream) {
  const at::Tensor la = log_alpha.to(acc), lb = log_beta.to(acc);
  at::Tensor cr = at::empty({int64_t(sz.B) * sz.G, int64_t(sz.H) * sz.W}, la.options());
  at::Tensor cc = at::empty_like(cr);
  AT_DISPATCH_FLOATING_TYPES(acc, "ppma_prefix_sums_cuda", [&] {
    PrefixParams<scalar_t> pp;
    pp.sz = sz;
    pp.log_alpha = la.data_ptr<scalar_t>();
    pp.log_beta = lb.data_ptr<scalar_t>();
    pp.sa = strides4(la);
    pp.sb = strides4(lb);
    pp.cr = cr.data_ptr<scalar_t>();
    pp.cc = cc.data_ptr<scalar_t>();
    const int64_t n = int64_t(sz.B) * sz.G * (sz.H + sz.W);
    prefix_sums_kernel<scalar_t><<<unsigned((n + 127) / 128), 128, 0, stream>>>(pp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {cr, cc};
}

// q, k, v ([B, H, W, heads, d|dv], unit last stride) and their strides, in the fields of every attention's Params.
template <typename scalar_t, typename P>
inline void set_qkv(P& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  p.q = cptr<scalar_t>(q);
  p.k = cptr<scalar_t>(k);
  p.v = cptr<scalar_t>(v);
  p.sq = strides4(q);
  p.sk = strides4(k);
  p.sv = strides4(v);
}

// The fields PolylineAttnParams and CrissCrossParams share: sizes, scale, q, k, v (set_qkv), and the prefix sums
// cr, cc ([B * heads, H * W], acc dtype).
template <typename scalar_t, typename P>
inline void set_attention_inputs(P& p, const GridSizes& sz, double scale, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& cr, const at::Tensor& cc) {
  using A = decltype(p.scale);
  p.sz = sz;
  p.scale = A(scale);
  set_qkv<scalar_t>(p, q, k, v);
  p.cr = cr.data_ptr<A>();
  p.cc = cc.data_ptr<A>();
}

// The outputs of an attention backward: grad q, k ([B, H, W, heads, d]) and v ([..., dv]) in the dtype of q,
// grad log_alpha and log_beta ([B, H, W, heads]) accumulated in acc and returned in the log-decays' dtypes.
struct AttentionGrads {
  at::Tensor gq, gk, gv, gla, glb;

  AttentionGrads(const at::Tensor& q, const at::Tensor& v, const at::Tensor& log_alpha, at::ScalarType acc)
      : gq(at::empty(q.sizes(), q.options())),
        gk(at::empty(q.sizes(), q.options())),
        gv(at::empty(v.sizes(), v.options())),
        gla(at::empty(log_alpha.sizes(), q.options().dtype(acc))),
        glb(at::empty_like(gla)) {}

  // The output fields of a backward's Params: dq, dk, dv, g_log_alpha, g_log_beta.
  template <typename scalar_t, typename P>
  void bind(P& p) const {
    using A = std::remove_pointer_t<decltype(p.g_log_alpha)>;
    p.dq = cptr<scalar_t>(gq);
    p.dk = cptr<scalar_t>(gk);
    p.dv = cptr<scalar_t>(gv);
    p.g_log_alpha = gla.data_ptr<A>();
    p.g_log_beta = glb.data_ptr<A>();
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> result(const at::Tensor& log_alpha,
                                                                                const at::Tensor& log_beta) const {
    return {gq, gk, gv, gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
  }

  // The result for empty inputs: all zeros.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> zeros(const at::Tensor& log_alpha,
                                                                               const at::Tensor& log_beta) {
    gq.zero_();
    gk.zero_();
    gv.zero_();
    gla.zero_();
    glb.zero_();
    return result(log_alpha, log_beta);
  }
};

}  // namespace cuda
}  // namespace ppma

// Runs the lambda body with `constexpr int DPAD` set to the padded head dim (tensor-core kernels: up to 128).
#define PPMA_TC_DPAD_SWITCH(DP, ...)       \
  [&] {                                    \
    if ((DP) == 16) {                      \
      constexpr int DPAD = 16;             \
      return __VA_ARGS__();                \
    } else if ((DP) == 32) {               \
      constexpr int DPAD = 32;             \
      return __VA_ARGS__();                \
    } else if ((DP) == 64) {               \
      constexpr int DPAD = 64;             \
      return __VA_ARGS__();                \
    } else {                               \
      constexpr int DPAD = 128;            \
      return __VA_ARGS__();                \
    }                                      \
  }()

#define PPMA_DPAD_SWITCH(DP, ...)                 \
  [&] {                                           \
    if ((DP) <= 128) {                            \
      return PPMA_TC_DPAD_SWITCH(DP, __VA_ARGS__); \
    } else if ((DP) == 256) {                     \
      constexpr int DPAD = 256;                   \
      return __VA_ARGS__();                       \
    } else {                                      \
      constexpr int DPAD = 512;                   \
      return __VA_ARGS__();                       \
    }                                             \
  }()
