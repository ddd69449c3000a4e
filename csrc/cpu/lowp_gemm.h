// The bf16 / fp16 products of the CPU attention kernels through torch's CPU batch-reduce GEMM
// (at::native::cpublas::brgemm; docs/performance.md "bf16 and fp16 on the CPU"): operands in bf16 or fp16, results
// and accumulation in float32. The kernels call it inside their own tasks, one call per product on the task's own
// operands and outputs; the results do not depend on the thread count (tests/test_cpu_lowp_products.py: bitwise the
// same for 1, 2 and 3 threads on this path, also where a single task runs outside a parallel region and the library
// may split a product over threads).
//
// The operands are plain row-major matrices (is_vnni = false): torch's brgemm then runs its bf16 / fp16 GEMM with
// float32 output (MKL or oneDNN, which use the CPU's matrix unit: AMX tiles, AVX-512 BF16 or AVX-512), on every
// CPU. torch's VNNI-packed micro-kernel route (cpublas::pack, is_vnni = true) runs on AMX CPUs only and is not used:
// this path is the one a CPU without AMX can test.
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include "common/options.h"

namespace ppma {
namespace cpu {

// C[m][n] = (C[m][n] if add else 0) + sum_k A[m][k] B[k][n]; A [m][lda], B [k][ldb] in Lp (c10::BFloat16 or
// c10::Half), C [m][ldc] float32. m, n, k > 0.
template <typename Lp>
inline void lowp_gemm(int64_t m, int64_t n, int64_t k, const Lp* a, int64_t lda, const Lp* b, int64_t ldb, float* c,
                      int64_t ldc, bool add) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/false);
}

// Whether torch packs bf16 (or fp16) operands for its batch-reduce micro-kernels on this CPU (AMX), read once.
inline bool lowp_gemm_native(at::ScalarType t) {
  static const bool bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool f16 = at::native::cpublas::could_pack(at::kHalf);
  return t == at::kBFloat16 ? bf16 : (t == at::kHalf ? f16 : false);
}

// Whether the attention kernels' products of q, k, v of dtype t (bf16 or fp16) run on lowp_gemm: the internal option
// cpu_lowp_products (common/options.h): 1 never, 2 always, 0 (default) where torch's CPU flash attention would take
// its batch-reduce micro-kernels too (lowp_gemm_native: AMX). Other dtypes: never.
inline bool use_lowp_gemm(at::ScalarType t) {
  if (t != at::kBFloat16 && t != at::kHalf) return false;
  const int o = get_option(Option::kCpuLowpProducts);
  return o == 2 || (o == 0 && lowp_gemm_native(t));
}

// Whether an attention op's products of q, k, v run on lowp_gemm: one dtype, bf16 or fp16, where use_lowp_gemm.
inline bool lowp_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() && use_lowp_gemm(q.scalar_type());
}

// f(Lp{}) for Lp the C++ type of t (bf16 or fp16; the caller checks).
template <typename F>
inline void dispatch_lowp(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    f(c10::Half{});
  }
}

// dst[c * ldd + r] = src[r * ss + c] for r < n, c < cols: rows of an [n][cols] operand transposed.
template <typename T>
inline void transpose_rows(int64_t n, int64_t cols, const T* src, int64_t ss, T* __restrict dst, int64_t ldd) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + r * ss;
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = s[c];
  }
}

// n floats rounded (to nearest even) to Lp.
template <typename Lp>
inline void to_lowp(int64_t n, const float* __restrict x, Lp* __restrict dst) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<Lp>(x[e]);
}

}  // namespace cpu
}  // namespace ppma
