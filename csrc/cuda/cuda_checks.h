// Host-side helpers of the CUDA launchers: argument checks that name the argument and print shapes
// (style rule 7), torch -> CUDA element types, Params strides, and the head-dim dispatch.
// (The CPU backend has its own checks; these mirror its messages so both backends fail alike.)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16, op, ": ", name,
              " must be a floating tensor (float32, float64, float16 or bfloat16), got ", st);
}

inline void check_cuda(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the first input is on ",
              ref.device());
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(), " but ",
              ref_name, " has dtype ", ref.scalar_type());
}

inline void check_decays(const char* op, const at::Tensor& ref, const at::Tensor& log_alpha,
                         const at::Tensor& log_beta) {
  const auto grid = ref.sizes().slice(0, 4);
  TORCH_CHECK(log_alpha.dim() == 4 && log_alpha.sizes() == grid, op, ": log_alpha must be [B, H, W, heads] = ",
              grid, ", got shape ", log_alpha.sizes());
  TORCH_CHECK(log_beta.dim() == 4 && log_beta.sizes() == grid, op, ": log_beta must be [B, H, W, heads] = ", grid,
              ", got shape ", log_beta.sizes());
  check_floating(op, "log_alpha", log_alpha);
  check_floating(op, "log_beta", log_beta);
  check_cuda(op, "log_alpha", log_alpha, ref);
  check_cuda(op, "log_beta", log_beta, ref);
  check_same_dtype(op, "log_beta", log_beta, "log_alpha", log_alpha);
}

// q, k: [B, H, W, heads, d]; v: [B, H, W, heads, dv]; log_alpha, log_beta: [B, H, W, heads].
inline void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& log_alpha, const at::Tensor& log_beta) {
  TORCH_CHECK(q.dim() == 5, op, ": q must be [B, H, W, heads, d], got shape ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have the shape of q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.dim() == 5 && v.sizes().slice(0, 4) == q.sizes().slice(0, 4), op,
              ": v must be [B, H, W, heads, dv] matching q ", q.sizes(), ", got shape ", v.sizes());
  check_floating(op, "q", q);
  check_cuda(op, "q", q, q);
  check_cuda(op, "k", k, q);
  check_cuda(op, "v", v, q);
  check_same_dtype(op, "k", k, "q", q);
  check_same_dtype(op, "v", v, "q", q);
  check_decays(op, q, log_alpha, log_beta);
  TORCH_CHECK(q.size(3) > 0 && q.size(4) > 0 && v.size(4) > 0, op,
              ": heads and head dims must be positive, got q ", q.sizes(), " and v ", v.sizes());
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                        const at::Tensor& ref) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  check_cuda(op, name, t, ref);
  check_floating(op, name, t);
}

inline at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
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
  GridSizes s;
  s.B = int(q.size(0));
  s.H = int(q.size(1));
  s.W = int(q.size(2));
  s.G = int(q.size(3));
  s.d = int(q.size(4));
  s.dv = int(dv);
  return s;
}

// Padded head dim of the attention kernels: 16, 32, 64 (fast paths) or 128 (zero-padded generic path).
inline int padded_head_dim(const char* op, int64_t d, int64_t dv) {
  const int64_t m = d > dv ? d : dv;
  TORCH_CHECK(m <= 128, op, ": the CUDA kernels support head dims up to 128, got d = ", d, " and dv = ", dv);
  return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
}

}  // namespace cuda
}  // namespace ppma

// Runs the lambda body with `constexpr int DPAD` set to the padded head dim.
#define PPMA_DPAD_SWITCH(DP, ...)          \
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
