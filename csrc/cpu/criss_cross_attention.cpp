// CPU kernels of ppma::criss_cross_attention (the official "chunk" mode, spec §3.3) and its backward.
//
// Per (batch, head): row attention A_i = softmax(S + R_i) inside every row (W x W) and column attention
// B_l = softmax(S + C_l) inside every column (H x H); out = 0.5 B (A v) + 0.5 A (B v). The maps live
// only in per-task scratch (one line at a time). Three parallel phases, each over lines:
//   forward:  rows (A, lse0, z1 = A v) -> columns (B, lse1, out1 = B z1, z2 = B v) -> rows (A from lse0,
//             out = 0.5 out1 + 0.5 A z2)
//   backward: rows (z1 = A v, dz2 = A^T g) -> columns (z2 = B v, dz1 = B^T g, dB, softmax backward,
//             column grads, grad log_beta) -> rows (dA, softmax backward, row grads, grad log_alpha)
// with g = 0.5 grad_out. Every output element is written by exactly one task per phase: deterministic.
// Memory: the inputs are read in place (each line gathered into per-thread scratch); the forward needs
// one input-sized buffer (z1, then z2), the backward two ((z1, dz2), then (z2, dz1)) besides its outputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#endif

#include "common/checks.h"
#include "common/cpu_math.h"
#include "common/cpu_utils.h"
#include "common/math.h"

namespace ppma {
namespace cpu {
namespace {

// Small dense product of the line kernels (register-blocked, four rows by eight columns):
//   C[r][c] = alpha * sum_k A[r * ar + k * ak] * Bt[k * bs + c]      (accumulate: C += ...)
// for r < R, c < Cn, k < K. A is read through two strides (so A or A^T), Bt row-major with row stride bs.
// The sum over k runs in order for every element (deterministic, independent of the blocking).
template <typename T>
inline void small_gemm(int64_t R, int64_t Cn, int64_t K, const T* A, int64_t ar, int64_t ak, const T* Bt,
                       int64_t bs, T* C, int64_t ldc, bool accumulate, T alpha = T(1)) {
  for (int64_t r = 0; r < R; ++r) {
    T* cr = C + r * ldc;
    for (int64_t c = 0; c < Cn; ++c) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += A[r * ar + k * ak] * Bt[k * bs + c];
      cr[c] = accumulate ? cr[c] + alpha * acc : alpha * acc;
    }
  }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
// The float product again for CPUs with AVX and FMA (eight lanes, fused multiply-add), chosen at run
// time: the build targets baseline x86-64. Same blocking and the same order of the sum over k.
typedef float ppma_v8f_avx __attribute__((vector_size(32)));

__attribute__((target("avx,fma"))) static void small_gemm_f32_avx(int64_t R, int64_t Cn, int64_t K,
                                                                   const float* A, int64_t ar, int64_t ak,
                                                                   const float* Bt, int64_t bs, float* C,
                                                                   int64_t ldc, bool accumulate, float alpha) {
#define PPMA_PUT8(cptr, v)                        \
  do {                                            \
    ppma_v8f_avx t_ = (v) * alpha;                \
    if (accumulate) {                             \
      ppma_v8f_avx o_;                            \
      std::memcpy(&o_, (cptr), sizeof(o_));       \
      t_ += o_;                                   \
    }                                             \
    std::memcpy((cptr), &t_, sizeof(t_));         \
  } while (0)
  int64_t c0 = 0;
  for (; c0 + 16 <= Cn; c0 += 16) {
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
      ppma_v8f_avx s00{}, s01{}, s10{}, s11{}, s20{}, s21{}, s30{}, s31{};
      const float* a0 = A + r0 * ar;
      for (int64_t k = 0; k < K; ++k) {
        ppma_v8f_avx b0, b1;
        std::memcpy(&b0, Bt + k * bs + c0, sizeof(b0));
        std::memcpy(&b1, Bt + k * bs + c0 + 8, sizeof(b1));
        const float* ak0 = a0 + k * ak;
        const float x0 = ak0[0], x1 = ak0[ar], x2 = ak0[2 * ar], x3 = ak0[3 * ar];
        s00 += x0 * b0;
        s01 += x0 * b1;
        s10 += x1 * b0;
        s11 += x1 * b1;
        s20 += x2 * b0;
        s21 += x2 * b1;
        s30 += x3 * b0;
        s31 += x3 * b1;
      }
      float* cp = C + r0 * ldc + c0;
      PPMA_PUT8(cp, s00);
      PPMA_PUT8(cp + 8, s01);
      PPMA_PUT8(cp + ldc, s10);
      PPMA_PUT8(cp + ldc + 8, s11);
      PPMA_PUT8(cp + 2 * ldc, s20);
      PPMA_PUT8(cp + 2 * ldc + 8, s21);
      PPMA_PUT8(cp + 3 * ldc, s30);
      PPMA_PUT8(cp + 3 * ldc + 8, s31);
    }
    for (; r0 < R; ++r0) {
      ppma_v8f_avx s0{}, s1{};
      for (int64_t k = 0; k < K; ++k) {
        const float x = A[r0 * ar + k * ak];
        ppma_v8f_avx b0, b1;
        std::memcpy(&b0, Bt + k * bs + c0, sizeof(b0));
        std::memcpy(&b1, Bt + k * bs + c0 + 8, sizeof(b1));
        s0 += x * b0;
        s1 += x * b1;
      }
      PPMA_PUT8(C + r0 * ldc + c0, s0);
      PPMA_PUT8(C + r0 * ldc + c0 + 8, s1);
    }
  }
  // Narrower column blocks (eight, then four lanes), still four rows at a time so that the
  // multiply-adds of a block are independent (one accumulator per row would be latency-bound).
  for (; c0 + 8 <= Cn; c0 += 8) {
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
      ppma_v8f_avx s0{}, s1{}, s2{}, s3{};
      const float* a0 = A + r0 * ar;
      for (int64_t k = 0; k < K; ++k) {
        ppma_v8f_avx b0;
        std::memcpy(&b0, Bt + k * bs + c0, sizeof(b0));
        const float* ak0 = a0 + k * ak;
        s0 += ak0[0] * b0;
        s1 += ak0[ar] * b0;
        s2 += ak0[2 * ar] * b0;
        s3 += ak0[3 * ar] * b0;
      }
      float* cp = C + r0 * ldc + c0;
      PPMA_PUT8(cp, s0);
      PPMA_PUT8(cp + ldc, s1);
      PPMA_PUT8(cp + 2 * ldc, s2);
      PPMA_PUT8(cp + 3 * ldc, s3);
    }
    for (; r0 < R; ++r0) {
      ppma_v8f_avx s0{};
      for (int64_t k = 0; k < K; ++k) {
        ppma_v8f_avx b0;
        std::memcpy(&b0, Bt + k * bs + c0, sizeof(b0));
        s0 += A[r0 * ar + k * ak] * b0;
      }
      PPMA_PUT8(C + r0 * ldc + c0, s0);
    }
  }
#undef PPMA_PUT8
  typedef float v4_avx __attribute__((vector_size(16)));
#define PPMA_PUT4(cptr, v)                        \
  do {                                            \
    v4_avx t_ = (v) * alpha;                      \
    if (accumulate) {                             \
      v4_avx o_;                                  \
      std::memcpy(&o_, (cptr), sizeof(o_));       \
      t_ += o_;                                   \
    }                                             \
    std::memcpy((cptr), &t_, sizeof(t_));         \
  } while (0)
  for (; c0 + 4 <= Cn; c0 += 4) {
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
      v4_avx s0{}, s1{}, s2{}, s3{};
      const float* a0 = A + r0 * ar;
      for (int64_t k = 0; k < K; ++k) {
        v4_avx b0;
        std::memcpy(&b0, Bt + k * bs + c0, sizeof(b0));
        const float* ak0 = a0 + k * ak;
        s0 += ak0[0] * b0;
        s1 += ak0[ar] * b0;
        s2 += ak0[2 * ar] * b0;
        s3 += ak0[3 * ar] * b0;
      }
      float* cp = C + r0 * ldc + c0;
      PPMA_PUT4(cp, s0);
      PPMA_PUT4(cp + ldc, s1);
      PPMA_PUT4(cp + 2 * ldc, s2);
      PPMA_PUT4(cp + 3 * ldc, s3);
    }
    for (; r0 < R; ++r0) {
      v4_avx s0{};
      for (int64_t k = 0; k < K; ++k) {
        v4_avx b0;
        std::memcpy(&b0, Bt + k * bs + c0, sizeof(b0));
        s0 += A[r0 * ar + k * ak] * b0;
      }
      PPMA_PUT4(C + r0 * ldc + c0, s0);
    }
  }
#undef PPMA_PUT4
  for (int64_t r = 0; r < R; ++r) {  // the last Cn % 4 columns
    float* cr = C + r * ldc;
    for (int64_t c = c0; c < Cn; ++c) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += A[r * ar + k * ak] * Bt[k * bs + c];
      cr[c] = accumulate ? cr[c] + alpha * acc : alpha * acc;
    }
  }
}

inline bool cpu_has_avx_fma() { return cpu_avx_fma_enabled(); }
#define PPMA_HAVE_AVX_GEMM 1
#endif

#ifdef PPMA_HAVE_V4
template <>
inline void small_gemm<float>(int64_t R, int64_t Cn, int64_t K, const float* A, int64_t ar, int64_t ak,
                              const float* Bt, int64_t bs, float* C, int64_t ldc, bool accumulate, float alpha) {
#ifdef PPMA_HAVE_AVX_GEMM
  if (cpu_has_avx_fma()) return small_gemm_f32_avx(R, Cn, K, A, ar, ak, Bt, bs, C, ldc, accumulate, alpha);
#endif
  auto put = [&](float* c, ppma_v4f v) {
    v = v * alpha;
    if (accumulate) v += load4(c);
    store4(c, v);
  };
  int64_t c0 = 0;
  for (; c0 + 8 <= Cn; c0 += 8) {
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
      ppma_v4f s00{}, s01{}, s10{}, s11{}, s20{}, s21{}, s30{}, s31{};
      const float* a0 = A + r0 * ar;
      for (int64_t k = 0; k < K; ++k) {
        const ppma_v4f b0 = load4(Bt + k * bs + c0), b1 = load4(Bt + k * bs + c0 + 4);
        const float* ak0 = a0 + k * ak;
        const float x0 = ak0[0], x1 = ak0[ar], x2 = ak0[2 * ar], x3 = ak0[3 * ar];
        s00 += x0 * b0;
        s01 += x0 * b1;
        s10 += x1 * b0;
        s11 += x1 * b1;
        s20 += x2 * b0;
        s21 += x2 * b1;
        s30 += x3 * b0;
        s31 += x3 * b1;
      }
      float* cp = C + r0 * ldc + c0;
      put(cp, s00), put(cp + 4, s01);
      put(cp + ldc, s10), put(cp + ldc + 4, s11);
      put(cp + 2 * ldc, s20), put(cp + 2 * ldc + 4, s21);
      put(cp + 3 * ldc, s30), put(cp + 3 * ldc + 4, s31);
    }
    for (; r0 < R; ++r0) {
      ppma_v4f s0{}, s1{};
      for (int64_t k = 0; k < K; ++k) {
        const float x = A[r0 * ar + k * ak];
        s0 += x * load4(Bt + k * bs + c0);
        s1 += x * load4(Bt + k * bs + c0 + 4);
      }
      put(C + r0 * ldc + c0, s0), put(C + r0 * ldc + c0 + 4, s1);
    }
  }
  for (; c0 + 4 <= Cn; c0 += 4) {
    for (int64_t r0 = 0; r0 < R; ++r0) {
      ppma_v4f s0{};
      for (int64_t k = 0; k < K; ++k) s0 += A[r0 * ar + k * ak] * load4(Bt + k * bs + c0);
      put(C + r0 * ldc + c0, s0);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // the last Cn % 4 columns
    float* cr = C + r * ldc;
    for (int64_t c = c0; c < Cn; ++c) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += A[r * ar + k * ak] * Bt[k * bs + c];
      cr[c] = accumulate ? cr[c] + alpha * acc : alpha * acc;
    }
  }
}
#endif

// Runs body(t, scratch) over the tasks like parallel_tasks, with every task body compiled a second
// time for AVX + FMA (flattened: the line kernels' elementwise loops, gathers and scatters inlined and
// vectorised eight lanes wide) and that copy chosen at run time where the CPU has them.
#ifdef PPMA_HAVE_AVX_GEMM
template <typename Body, typename S>
__attribute__((target("avx,fma"), flatten)) void run_task_avx(const Body& body, int64_t t, S& scratch) {
  body(t, scratch);
}
#endif

template <typename Init, typename Body>
inline void parallel_lines(int64_t ntasks, const Init& init, const Body& body) {
#ifdef PPMA_HAVE_AVX_GEMM
  if (cpu_has_avx_fma()) {
    parallel_tasks(ntasks, init, [&](int64_t t, auto& scratch) { run_task_avx(body, t, scratch); });
    return;
  }
#endif
  parallel_tasks(ntasks, init, body);
}

// X[j][l] = <Qs_j, K_l> + bias(j, l) for one line of n tokens. Qs rows have stride qs; Kt is [d][n];
// c holds the line's prefix sums; bias = c_max - c_min (position order).
template <typename T, int DC>
inline void line_logits(int64_t n, int64_t d, const T* Q, int64_t qs, const T* Kt, const T* c, T* X) {
  small_gemm<T>(n, n, d, Q, qs, 1, Kt, n, X, n, false);
  for (int64_t j = 0; j < n; ++j) {
    T* __restrict x = X + j * n;
    const T cj = c[j];
#pragma omp simd
    for (int64_t l = 0; l < j; ++l) x[l] += cj - c[l];
#pragma omp simd
    for (int64_t l = j; l < n; ++l) x[l] += c[l] - cj;
  }
}

// In-place row softmax of X [n][n]; lse[j * ls] = logsumexp of row j.
template <typename T>
inline void line_softmax(int64_t n, T* X, T* lse, int64_t ls) {
  for (int64_t j = 0; j < n; ++j) {
    T* x = X + j * n;
    const T m = max_of(n, x);
    const T s = exp_shift_sum(n, x, m);
    scale_inplace(n, x, T(1) / s);
    lse[j * ls] = m + std::log(s);
  }
}

// X[j][:] = exp(X[j][:] - lse[j * ls]): the softmax recomputed from its statistics.
template <typename T>
inline void line_softmax_from_lse(int64_t n, T* X, const T* lse, int64_t ls) {
  for (int64_t j = 0; j < n; ++j) exp_shift(n, X + j * n, lse[j * ls]);
}

// out[j] = sum_l P[j][l] V[l] (rows of V / out with strides vs / os, dv columns).
template <typename T, int DVC>
inline void line_apply(int64_t n, int64_t dv, const T* P, const T* V, int64_t vs, T* out, int64_t os) {
  small_gemm<T>(n, dv, n, P, n, 1, V, vs, out, os, false);
}

// out[l] = sum_j P[j][l] G[j] (the transposed map).
template <typename T, int DVC>
inline void line_apply_t(int64_t n, int64_t dv, const T* P, const T* Gm, int64_t gs, T* out, int64_t os) {
  small_gemm<T>(n, dv, n, P, 1, n, Gm, gs, out, os, false);
}

// Backward of one line's softmax attention, given the map P [n][n] and the gradient of the map
// dP[j][l] = <Gm_j, U_l> over 2 dv columns (Gm [n][2 dv] with row stride gs holds two operands side by
// side, Ut [2 dv][n] the two matching ones transposed and stacked: dP = G1 U1^T + G2 U2^T in one product):
//   dX = P * (dP - rowsum(P * dP)) (written into dP's scratch DX),
//   prefix-sum gradient of the line into gc (then reverse-cumsummed by the caller),
//   dq_j (=|+=) scale * sum_l dX[j][l] K_l, dk_l (=|+=) sum_j dX[j][l] Qs_j (row strides dqs / dks; written,
//   or added to what is there when accumulate).
template <typename T, int DC, int DVC>
inline void line_backward(int64_t n, int64_t d, int64_t dv, const T* P, const T* Gm, int64_t gs, const T* Ut,
                          const T* Q, int64_t qs, const T* K, int64_t ks, T scale,
                          T* DX, T* gc, T* dq, int64_t dqs, T* dk, int64_t dks, bool accumulate) {
  small_gemm<T>(n, n, 2 * dv, Gm, gs, 1, Ut, n, DX, n, false);  // dP, one product over 2 dv
  std::fill(gc, gc + n, T(0));
  for (int64_t j = 0; j < n; ++j) {
    T* __restrict x = DX + j * n;
    const T* p = P + j * n;
    const T rs = dot(n, p, x);
    T sneg = 0, spos = 0;
#pragma omp simd reduction(+ : sneg)
    for (int64_t l = 0; l < j; ++l) {  // bias = c_j - c_l
      const T v = p[l] * (x[l] - rs);
      x[l] = v;
      gc[l] -= v;
      sneg += v;
    }
#pragma omp simd reduction(+ : spos)
    for (int64_t l = j; l < n; ++l) {  // bias = c_l - c_j
      const T v = p[l] * (x[l] - rs);
      x[l] = v;
      gc[l] += v;
      spos += v;
    }
    gc[j] += sneg - spos;
  }
  small_gemm<T>(n, d, n, DX, n, 1, K, ks, dq, dqs, accumulate, scale);  // dq (+)= scale dX K
  small_gemm<T>(n, d, n, DX, 1, n, Q, qs, dk, dks, accumulate);         // dk (+)= dX^T Qs
}

// Rows of a line gathered into contiguous per-thread scratch: dst[r][e] = a * src[r * ss + e].
template <typename T>
inline void gather_rows(int64_t n, int64_t c, const T* src, int64_t ss, T* __restrict dst, T a = T(1)) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + r * ss;
    T* o = dst + r * c;
    if (a == T(1)) {
      for (int64_t e = 0; e < c; ++e) o[e] = s[e];
    } else {
      for (int64_t e = 0; e < c; ++e) o[e] = a * s[e];
    }
  }
}

#ifdef PPMA_HAVE_AVX_GEMM
// gather_rows_t for float with AVX: 8 x 8 blocks transposed in registers (an exact copy).
__attribute__((target("avx"))) static void gather_rows_t_f32_avx(int64_t n, int64_t c, const float* src,
                                                                  int64_t ss, float* __restrict dst) {
  int64_t r0 = 0;
  for (; r0 + 8 <= n; r0 += 8) {
    int64_t e0 = 0;
    for (; e0 + 8 <= c; e0 += 8) {
      __m256 x[8];
      for (int i = 0; i < 8; ++i) x[i] = _mm256_loadu_ps(src + (r0 + i) * ss + e0);
      const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
      const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
      const __m256 t4 = _mm256_unpacklo_ps(x[4], x[5]), t5 = _mm256_unpackhi_ps(x[4], x[5]);
      const __m256 t6 = _mm256_unpacklo_ps(x[6], x[7]), t7 = _mm256_unpackhi_ps(x[6], x[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
      float* o = dst + e0 * n + r0;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + n, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * n, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * n, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * n, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * n, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * n, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * n, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    for (int64_t r = r0; r < r0 + 8; ++r)
      for (int64_t e = e0; e < c; ++e) dst[e * n + r] = src[r * ss + e];
  }
  for (int64_t r = r0; r < n; ++r)
    for (int64_t e = 0; e < c; ++e) dst[e * n + r] = src[r * ss + e];
}
#endif

// gather_rows with a destination row stride: dst[r * ds + e] = a * src[r * ss + e].
template <typename T>
inline void gather_rows_ld(int64_t n, int64_t c, const T* src, int64_t ss, T* __restrict dst, int64_t ds,
                           T a = T(1)) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + r * ss;
    T* o = dst + r * ds;
    if (a == T(1)) {
      for (int64_t e = 0; e < c; ++e) o[e] = s[e];
    } else {
      for (int64_t e = 0; e < c; ++e) o[e] = a * s[e];
    }
  }
}

// Rows of a line gathered transposed: dst[e][r] = src[r * ss + e].
template <typename T>
inline void gather_rows_t(int64_t n, int64_t c, const T* src, int64_t ss, T* __restrict dst) {
#ifdef PPMA_HAVE_AVX_GEMM
  if constexpr (std::is_same<T, float>::value) {
    if (cpu_has_avx_fma()) return gather_rows_t_f32_avx(n, c, src, ss, dst);
  }
#endif
  for (int64_t r = 0; r < n; ++r)
    for (int64_t e = 0; e < c; ++e) dst[e * n + r] = src[r * ss + e];
}

// The inputs are read in their own layout [B, N, G, *] (no packed copies): a row line of head (b, g)
// starts at token b * N + i * W with row stride G * c, a column line at b * N + l with stride W * G * c.
// Every line is gathered into per-thread scratch before its products.
template <typename T>
struct CCData {
  const T* q;    // [B, N, G, d]
  const T* k;    // [B, N, G, d]
  const T* v;    // [B, N, G, dv]
  const T* cr;   // [BG, H, W] row prefix sums
  const T* cct;  // [BG, W, H] column prefix sums, transposed
  int64_t B, G, H, W, N, d, dv;
  T scale;
};

// Per-thread scratch of the line kernels (n = max(H, W)).
template <typename T>
struct LineScratch {
  std::vector<T> buf;
  T *X, *DX, *q, *k, *kt, *v, *g, *u1, *u2, *gu, *ut, *gc;
  LineScratch(int64_t n, int64_t d, int64_t dv, bool backward) {
    const int64_t nn = n * n, nd = n * d, nv = n * dv;
    buf.resize(backward ? 2 * nn + 3 * nd + 8 * nv + n : nn + 2 * nd + 3 * nv + n);
    T* p = buf.data();
    auto take = [&](int64_t m) {
      T* r = p;
      p += m;
      return r;
    };
    X = take(nn);
    q = take(nd);
    kt = take(nd);
    v = take(nv);
    u1 = take(nv);
    u2 = take(nv);
    gc = take(n);
    DX = k = g = gu = ut = nullptr;
    if (backward) {
      DX = take(nn);
      k = take(nd);
      g = take(nv);
      gu = take(2 * nv);  // [n][2 dv]: two line operands side by side
      ut = take(2 * nv);  // [2 dv][n]: two transposed line operands stacked
    }
  }
};

// Forward. Z: [B, N, G, dv] scratch (z1, then z2 in place, column by column).
template <typename T, int DC, int DVC>
void forward_kernel(const CCData<T>& D, T* out, T* lse, T* Z) {
  const int64_t B = D.B, G = D.G, H = D.H, W = D.W, N = D.N, d = D.d, dv = D.dv;
  const int64_t BG = B * G, n = std::max(H, W);
  // Phase 1: rows. A, lse0, z1 = A v.
  parallel_lines(
      BG * H, [&] { return LineScratch<T>(n, d, dv, false); }, [&](int64_t t, LineScratch<T>& S) {
    {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, tok = (b * N + i * W) * G + g;
      gather_rows(W, d, D.q + tok * d, G * d, S.q, D.scale);
      gather_rows_t(W, d, D.k + tok * d, G * d, S.kt);
      gather_rows(W, dv, D.v + tok * dv, G * dv, S.v);
      line_logits<T, DC>(W, d, S.q, d, S.kt, D.cr + (bg * H + i) * W, S.X);
      line_softmax(W, S.X, lse + tok * 2, G * 2);
      line_apply<T, DVC>(W, dv, S.X, S.v, dv, Z + tok * dv, G * dv);
    }
  });
  // Phase 2: columns. B, lse1, out = 0.5 B z1, z2 = B v (over z1).
  parallel_lines(
      BG * W, [&] { return LineScratch<T>(n, d, dv, false); }, [&](int64_t t, LineScratch<T>& S) {
    {
      const int64_t bg = t / W, l = t % W, b = bg / G, g = bg % G, tok = (b * N + l) * G + g;
      const int64_t cs = W * G;  // token stride along a column
      gather_rows(H, d, D.q + tok * d, cs * d, S.q, D.scale);
      gather_rows_t(H, d, D.k + tok * d, cs * d, S.kt);
      gather_rows(H, dv, D.v + tok * dv, cs * dv, S.v);
      gather_rows(H, dv, Z + tok * dv, cs * dv, S.u1);
      line_logits<T, DC>(H, d, S.q, d, S.kt, D.cct + (bg * W + l) * H, S.X);
      line_softmax(H, S.X, lse + tok * 2 + 1, cs * 2);
      small_gemm<T>(H, dv, H, S.X, H, 1, S.u1, dv, out + tok * dv, cs * dv, false, T(0.5));  // out = 0.5 B z1
      line_apply<T, DVC>(H, dv, S.X, S.v, dv, Z + tok * dv, cs * dv);  // z2 = B v
    }
  });
  // Phase 3: rows again, A from its statistics; out += 0.5 A z2.
  parallel_lines(
      BG * H, [&] { return LineScratch<T>(n, d, dv, false); }, [&](int64_t t, LineScratch<T>& S) {
    {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, tok = (b * N + i * W) * G + g;
      gather_rows(W, d, D.q + tok * d, G * d, S.q, D.scale);
      gather_rows_t(W, d, D.k + tok * d, G * d, S.kt);
      gather_rows(W, dv, Z + tok * dv, G * dv, S.u1);
      line_logits<T, DC>(W, d, S.q, d, S.kt, D.cr + (bg * H + i) * W, S.X);
      line_softmax_from_lse(W, S.X, lse + tok * 2, G * 2);
      small_gemm<T>(W, dv, W, S.X, W, 1, S.u1, dv, out + tok * dv, G * dv, true, T(0.5));  // out += 0.5 A z2
    }
  });
}

// Backward with g = 0.5 grad_out. ZA, ZB: [B, N, G, dv] scratch: (z1, dz2) after the rows, replaced by
// (z2, dz1) column by column. The column phase writes dq, dk, dv (column parts), the last row phase adds
// the row parts. Outputs and lse in the [B, H, W, heads, *] layout.
template <typename T, int DC, int DVC>
void backward_kernel(const CCData<T>& D, const T* go, const T* lse, T* ZA, T* ZB, T* dq, T* dk, T* dv_out, T* gla,
                     T* glb) {
  const int64_t B = D.B, G = D.G, H = D.H, W = D.W, N = D.N, d = D.d, dv = D.dv;
  const int64_t BG = B * G, n = std::max(H, W);
  const T scale = D.scale;
  // Phase 1: rows. z1 = A v, dz2 = A^T g.
  parallel_lines(
      BG * H, [&] { return LineScratch<T>(n, d, dv, true); }, [&](int64_t t, LineScratch<T>& S) {
    {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, tok = (b * N + i * W) * G + g;
      gather_rows(W, d, D.q + tok * d, G * d, S.q, scale);
      gather_rows_t(W, d, D.k + tok * d, G * d, S.kt);
      gather_rows(W, dv, D.v + tok * dv, G * dv, S.v);
      gather_rows(W, dv, go + tok * dv, G * dv, S.g, T(0.5));
      line_logits<T, DC>(W, d, S.q, d, S.kt, D.cr + (bg * H + i) * W, S.X);
      line_softmax_from_lse(W, S.X, lse + tok * 2, G * 2);
      line_apply<T, DVC>(W, dv, S.X, S.v, dv, ZA + tok * dv, G * dv);
      line_apply_t<T, DVC>(W, dv, S.X, S.g, dv, ZB + tok * dv, G * dv);
    }
  });
  // Phase 2: columns. z2 = B v, dz1 = B^T g; dB = g z1^T + dz2 v^T; column grads; grad log_beta.
  parallel_lines(
      BG * W, [&] { return LineScratch<T>(n, d, dv, true); }, [&](int64_t t, LineScratch<T>& S) {
    {
      const int64_t bg = t / W, l = t % W, b = bg / G, g = bg % G, tok = (b * N + l) * G + g;
      const int64_t cs = W * G;
      gather_rows(H, d, D.q + tok * d, cs * d, S.q, scale);
      gather_rows(H, d, D.k + tok * d, cs * d, S.k);
      gather_rows_t(H, d, D.k + tok * d, cs * d, S.kt);
      gather_rows(H, dv, D.v + tok * dv, cs * dv, S.v);
      T *gl = S.gu, *dz = S.gu + dv;                          // [g | dz2], row stride 2 dv
      gather_rows_ld(H, dv, go + tok * dv, cs * dv, gl, 2 * dv, T(0.5));
      gather_rows_ld(H, dv, ZB + tok * dv, cs * dv, dz, 2 * dv);  // dz2
      gather_rows_t(H, dv, ZA + tok * dv, cs * dv, S.ut);           // [z1^T ; v^T]
      gather_rows_t(H, dv, D.v + tok * dv, cs * dv, S.ut + dv * H);
      line_logits<T, DC>(H, d, S.q, d, S.kt, D.cct + (bg * W + l) * H, S.X);
      line_softmax_from_lse(H, S.X, lse + tok * 2 + 1, cs * 2);
      line_backward<T, DC, DVC>(H, d, dv, S.X, S.gu, 2 * dv, S.ut, S.q, d, S.k, d, scale, S.DX, S.gc,
                                dq + tok * d, cs * d, dk + tok * d, cs * d, false);
      // dv (column part) = B^T dz2
      line_apply_t<T, DVC>(H, dv, S.X, dz, 2 * dv, dv_out + tok * dv, cs * dv);
      reverse_cumsum_excl_first(H, S.gc, 1, glb + (b * N + l) * G + g, W * G);
      // z2 = B v and dz1 = B^T g replace z1 and dz2 of this column.
      line_apply<T, DVC>(H, dv, S.X, S.v, dv, ZA + tok * dv, cs * dv);
      line_apply_t<T, DVC>(H, dv, S.X, gl, 2 * dv, ZB + tok * dv, cs * dv);
    }
  });
  // Phase 3: rows. dA = dz1 v^T + g z2^T; row grads; grad log_alpha; final sums.
  parallel_lines(
      BG * H, [&] { return LineScratch<T>(n, d, dv, true); }, [&](int64_t t, LineScratch<T>& S) {
    {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, tok = (b * N + i * W) * G + g;
      gather_rows(W, d, D.q + tok * d, G * d, S.q, scale);
      gather_rows(W, d, D.k + tok * d, G * d, S.k);
      gather_rows_t(W, d, D.k + tok * d, G * d, S.kt);
      T* dz = S.gu + dv;                                    // [g | dz1], row stride 2 dv
      gather_rows_ld(W, dv, go + tok * dv, G * dv, S.gu, 2 * dv, T(0.5));
      gather_rows_ld(W, dv, ZB + tok * dv, G * dv, dz, 2 * dv);  // dz1
      gather_rows_t(W, dv, ZA + tok * dv, G * dv, S.ut);           // [z2^T ; v^T]
      gather_rows_t(W, dv, D.v + tok * dv, G * dv, S.ut + dv * W);
      line_logits<T, DC>(W, d, S.q, d, S.kt, D.cr + (bg * H + i) * W, S.X);
      line_softmax_from_lse(W, S.X, lse + tok * 2, G * 2);
      // The row parts are added to the column parts in place.
      line_backward<T, DC, DVC>(W, d, dv, S.X, S.gu, 2 * dv, S.ut, S.q, d, S.k, d, scale, S.DX, S.gc,
                                dq + tok * d, G * d, dk + tok * d, G * d, true);
      small_gemm<T>(W, dv, W, S.X, 1, W, dz, 2 * dv, dv_out + tok * dv, G * dv, true);  // dv += A^T dz1
      reverse_cumsum_excl_first(W, S.gc, 1, gla + (b * N + i * W) * G + g, G);
    }
  });
}

constexpr const char* kOp = "criss_cross_attention";
constexpr const char* kOpBwd = "criss_cross_attention_backward";

// Prefix sums of the log-decays: cr [BG, H, W] and the column sums transposed, cct [BG, W, H].
inline std::pair<at::Tensor, at::Tensor> line_sums(const at::Tensor& log_alpha, const at::Tensor& log_beta,
                                                   at::ScalarType acc) {
  auto sums = prefix_sums(log_alpha, log_beta, acc);
  return {sums.first, sums.second.transpose(-1, -2).contiguous()};
}

template <typename T>
CCData<T> make_data(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& cr,
                    const at::Tensor& cct, double scale) {
  return CCData<T>{qc.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),      cr.data_ptr<T>(), cct.data_ptr<T>(),
                   qc.size(0),       qc.size(3),       qc.size(1),            qc.size(2),       qc.size(1) * qc.size(2),
                   qc.size(4),       vc.size(4),       static_cast<T>(scale)};
}

std::tuple<at::Tensor, at::Tensor> criss_cross_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& log_alpha,
                                                             const at::Tensor& log_beta, double scale) {
  check_inputs(kOp, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor out = at::empty({B, H, W, G, dv}, opts);
  at::Tensor lse = at::empty({B, H, W, G, 2}, opts);
  if (out.numel() > 0) {
    // No-ops for contiguous inputs of the accumulation dtype.
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    auto [cr, cct] = line_sums(log_alpha, log_beta, acc);
    at::Tensor Z = at::empty({B, H, W, G, dv}, opts);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_criss_cross_attention_cpu", [&] {
      auto D = make_data<scalar_t>(qc, kc, vc, cr, cct, scale);
      dispatch_head_dims(d, dv, [&](auto dc, auto dvc) {
        forward_kernel<scalar_t, decltype(dc)::value, decltype(dvc)::value>(
            D, out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), Z.data_ptr<scalar_t>());
      });
    });
  }
  return {out.to(v.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> criss_cross_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& lse, double scale) {
  check_inputs(kOpBwd, q, k, v, log_alpha, log_beta);
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  check_shape(kOpBwd, "lse", lse, {B, H, W, G, 2}, q);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  // Every element is written by the column phase (each token lies in exactly one column).
  at::Tensor dq = at::empty({B, H, W, G, d}, opts), dk = at::empty_like(dq);
  at::Tensor dv_ = at::empty({B, H, W, G, dv}, opts);
  at::Tensor gla = at::empty({B, H, W, G}, opts), glb = at::empty_like(gla);
  if (dq.numel() > 0) {
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    at::Tensor goc = grad_out.to(acc).contiguous(), lsec = lse.to(acc).contiguous();
    auto [cr, cct] = line_sums(log_alpha, log_beta, acc);
    at::Tensor ZA = at::empty({B, H, W, G, dv}, opts), ZB = at::empty_like(ZA);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_criss_cross_attention_backward_cpu", [&] {
      auto D = make_data<scalar_t>(qc, kc, vc, cr, cct, scale);
      dispatch_head_dims(d, dv, [&](auto dc, auto dvc) {
        backward_kernel<scalar_t, decltype(dc)::value, decltype(dvc)::value>(
            D, goc.data_ptr<scalar_t>(), lsec.data_ptr<scalar_t>(), ZA.data_ptr<scalar_t>(),
            ZB.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv_.data_ptr<scalar_t>(),
            gla.data_ptr<scalar_t>(), glb.data_ptr<scalar_t>());
      });
    });
  } else {
    dq.zero_(), dk.zero_(), dv_.zero_(), gla.zero_(), glb.zero_();
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv_.to(v.scalar_type()),
          gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("criss_cross_attention", &ppma::cpu::criss_cross_attention_cpu);
  m.impl("criss_cross_attention_backward", &ppma::cpu::criss_cross_attention_backward_cpu);
}
