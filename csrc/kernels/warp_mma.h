// Warp-level tensor-core building blocks of the fp16 / bf16 attention kernels (sm_80 and newer):
// mma.sync.aligned.m16n8k16 with fp32 accumulators, ldmatrix, cp.async, and the fragment coordinates.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), lane = %laneid,
// groupID g = lane / 4, threadID_in_group t = lane % 4:
//   A (16 x 16, row major), 4 registers of 2 halves: register r, half h holds
//       (row g + 8 (r & 1), col 2 t + h + 8 (r >> 1))
//   B (16 x 8, "col" = each column contiguous in k), 2 registers: register r, half h holds (row 2 t + h + 8 r, col g)
//   C / D (16 x 8, fp32), 4 floats: element i holds (row g + 8 (i >> 1), col 2 t + (i & 1))
// So the C fragments of two neighbouring n8 tiles are, after packing to 16 bits, exactly the A fragment of one
// k16 step (the FlashAttention-2 register reuse of P: C tile 2s -> a0, a1, C tile 2s + 1 -> a2, a3).
//
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements; lanes 8m .. 8m + 7 give the row addresses of matrix
// m, and register m of lane l receives (row l / 4, cols 2 (l % 4), +1) of matrix m (.trans: rows 2 (l % 4), +1 of
// column l / 4). The helpers below give each lane's row address for the three uses of the kernels:
//   ldsm_a_*   A fragment of a 16 x 16 block of a row-major [m][k] tile (registers a0..a3);
//   ldsm_b_*   B fragments of two n8 tiles (n0, n0 + 8) x k16 from a row-major [n][k] tile (registers: b0, b1 of
//              n0, then b0, b1 of n0 + 8), e.g. K for S = Q K^T;
//   ldsm_bt_*  the same from a row-major [k][n] tile with .trans, e.g. V for O = P V.
// These helpers are unit-tested on the host against the tables above (tests/cuda_emu/test_fragments.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "../common/math.h"

namespace ppma {
namespace mma {

PPMA_HD int c_row(int lane, int i) { return (lane >> 2) + ((i >> 1) << 3); }
PPMA_HD int c_col(int lane, int i) { return ((lane & 3) << 1) + (i & 1); }
PPMA_HD int a_row(int lane, int r) { return (lane >> 2) + ((r & 1) << 3); }
PPMA_HD int a_col(int lane, int r, int h) { return ((lane & 3) << 1) + h + ((r >> 1) << 3); }
PPMA_HD int b_row(int lane, int r, int h) { return ((lane & 3) << 1) + h + (r << 3); }
PPMA_HD int b_col(int lane) { return lane >> 2; }

PPMA_HD int ldsm_a_row(int lane) { return lane & 15; }
PPMA_HD int ldsm_a_col(int lane) { return (lane >> 4) << 3; }
PPMA_HD int ldsm_b_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
PPMA_HD int ldsm_b_col(int lane) { return ((lane >> 3) & 1) << 3; }
PPMA_HD int ldsm_bt_row(int lane) { return lane & 15; }
PPMA_HD int ldsm_bt_col(int lane) { return (lane >> 4) << 3; }

// Two floats rounded to 16-bit T (__half or __nv_bfloat16), packed low | high << 16.
template <typename T>
PPMA_HD uint32_t pack2(float lo, float hi);

template <>
PPMA_HD uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
#else
  const __nv_bfloat16 a = __float2bfloat16_rn(lo), b = __float2bfloat16_rn(hi);
  uint16_t ua, ub;
  std::memcpy(&ua, &a, 2);
  std::memcpy(&ub, &b, 2);
  return uint32_t(ua) | (uint32_t(ub) << 16);
#endif
}

template <>
PPMA_HD uint32_t pack2<__half>(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
#else
  const __half a = __float2half_rn(lo), b = __float2half_rn(hi);
  uint16_t ua, ub;
  std::memcpy(&ua, &a, 2);
  std::memcpy(&ub, &b, 2);
  return uint32_t(ua) | (uint32_t(ub) << 16);
#endif
}

// d += A B for one m16n8k16 tile.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(PPMA_EMULATE)
  ::emu::mma_m16n8k16(d, a, b, d, true);
#elif defined(__CUDA_ARCH__)
  __trap();  // the launchers never select the tensor-core kernels below sm_80
#endif
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(PPMA_EMULATE)
  ::emu::mma_m16n8k16(d, a, b, d, false);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ldmatrix.x4 (optionally .trans) from the 16-byte row whose address this lane gives.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#elif defined(PPMA_EMULATE)
  ::emu::ldmatrix(r, 4, TRANS, row);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// 16-byte global -> shared copy (cp.async.cg, sm_80): `valid` false writes 16 zero bytes instead (src-size 0;
// `src` must still be a mapped address). Completed by cp_async_wait_all() and a barrier.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
#elif defined(PPMA_EMULATE)
  ::emu::cp_async(dst, src, valid);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#elif defined(PPMA_EMULATE)
  ::emu::cp_async_wait();
#endif
}

// Keeps the compiler from hoisting the shared-memory loads of later score columns above this point: without it,
// the fully unrolled per-element loops load every column's bias data first and run out of registers.
__device__ __forceinline__ void load_fence() {
#if defined(__CUDA_ARCH__)
  asm volatile("" ::: "memory");
#endif
}

// Fast 2^x (ex2.approx under --use_fast_math); the kernels fold log2(e) into the scale and prefix sums.
__device__ __forceinline__ float exp2_fast(float x) { return exp2f(x); }

}  // namespace mma
}  // namespace ppma
