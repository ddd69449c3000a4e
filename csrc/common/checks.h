// Argument checks of the ppma host functions (CPU and CUDA): every message names the argument and
// prints the offending shapes, dtypes or devices (docs/design.md §2.5).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace ppma {

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16, op, ": ", name,
              " must be a floating tensor (float32, float64, float16 or bfloat16), got ", st);
}

inline void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(), " but ",
              ref_name, " has dtype ", ref.scalar_type());
}

// A parameter t of a CPU kernel that also takes bf16 data (CPU bf16 autocast: float32 parameters, float32 math):
// ref's dtype and device, or float32 on ref's device for a bfloat16 ref.
inline void check_param_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  if (ref.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device() == ref.device(), op, ": ", name, " must be a float32 "
                "tensor on ", ref_name, "'s device for a bfloat16 ", ref_name, ", got ", t.scalar_type(), " on ",
                t.device());
  } else {
    check_like(op, name, t, ref_name, ref);
  }
}

inline void check_decays(const char* op, const at::Tensor& ref, const at::Tensor& log_alpha,
                         const at::Tensor& log_beta) {
  const auto grid = ref.sizes().slice(0, 4);
  TORCH_CHECK(log_alpha.dim() == 4 && log_alpha.sizes() == grid, op,
              ": log_alpha must be [B, H, W, heads] = ", grid, ", got shape ", log_alpha.sizes());
  TORCH_CHECK(log_beta.dim() == 4 && log_beta.sizes() == grid, op, ": log_beta must be [B, H, W, heads] = ", grid,
              ", got shape ", log_beta.sizes());
  check_floating(op, "log_alpha", log_alpha);
  check_floating(op, "log_beta", log_beta);
  TORCH_CHECK(log_alpha.device() == ref.device() && log_beta.device() == ref.device(), op,
              ": log_alpha and log_beta must be on the device of the features (", ref.device(), "), got ",
              log_alpha.device(), " and ", log_beta.device());
  TORCH_CHECK(log_alpha.scalar_type() == log_beta.scalar_type(), op, ": log_alpha has dtype ",
              log_alpha.scalar_type(), " but log_beta has dtype ", log_beta.scalar_type());
}

// q, k: [B, H, W, heads, d]; v: [B, H, W, heads, dv]; log_alpha, log_beta: [B, H, W, heads].
inline void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& log_alpha, const at::Tensor& log_beta) {
  TORCH_CHECK(q.dim() == 5, op, ": q must be [B, H, W, heads, d], got shape ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have the shape of q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.dim() == 5 && v.sizes().slice(0, 4) == q.sizes().slice(0, 4), op,
              ": v must be [B, H, W, heads, dv] matching q ", q.sizes(), ", got shape ", v.sizes());
  check_floating(op, "q", q);
  check_like(op, "k", k, "q", q);
  check_like(op, "v", v, "q", q);
  check_decays(op, q, log_alpha, log_beta);
  TORCH_CHECK(q.size(3) > 0 && q.size(4) > 0 && v.size(4) > 0, op,
              ": heads and head dims must be positive, got q ", q.sizes(), " and v ", v.sizes());
}

// x: [B, H, W, heads, c]; log_alpha, log_beta: [B, H, W, heads].
inline void check_scan_inputs(const char* op, const at::Tensor& x, const at::Tensor& log_alpha,
                              const at::Tensor& log_beta) {
  TORCH_CHECK(x.dim() == 5, op, ": x must be [B, H, W, heads, c], got shape ", x.sizes());
  check_floating(op, "x", x);
  check_decays(op, x, log_alpha, log_beta);
}

// A gradient or saved tensor of the backward ops: the exact shape it must have.
inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                        const at::Tensor& ref) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device());
  check_floating(op, name, t);
}

// The eps of polyline_linear_attention: finite and >= 0.
inline void check_eps(const char* op, double eps) {
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), op, ": eps must be finite and >= 0, got ", eps);
}

// Accumulation dtype: float64 for float64 inputs, float32 otherwise (docs/ops.md "Numerics").
inline at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace ppma
