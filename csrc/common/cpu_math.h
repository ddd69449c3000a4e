// CPU-only inner-loop helpers of the ppma kernels: a branch-free exp that the compiler vectorises,
// and small array loops written so that -O3 turns them into SIMD code. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace ppma {
namespace cpu {

// exp(x) for float, branch-free (Cephes-style range reduction and a degree-6 polynomial; relative
// error ~2e-7 over the range that matters). Returns exactly 0 below -87.3 (and for -inf), so a masked
// score of log-decay -1e4 contributes nothing, like the reference. Written without calls so that loops
// over it vectorise.
inline float fast_exp(float x) {
  const float lo = -87.33654f;
  const bool under = x < lo;
  float xc = x < lo ? lo : x;
  xc = xc > 88.3762626647949f ? 88.3762626647949f : xc;
  // n = round(x / ln 2)
  const float magic = 12582912.0f;  // 1.5 * 2^23
  float t = xc * 1.44269504088896341f + magic;
  float n = t - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  int32_t ni = static_cast<int32_t>(n);
  // 2^n as a float (n in [-126, 127] after the clamps)
  int32_t bits = (ni + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  float res = p * two_n;
  res = under ? 0.0f : res;
  return x != x ? x : res;  // NaN propagates
}

inline double fast_exp(double x) { return std::exp(x); }

template <typename T>
inline T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// y[0:n] += a * x[0:n]
template <typename T>
inline void axpy(int64_t n, T a, const T* __restrict x, T* __restrict y) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) y[e] += a * x[e];
}

template <typename T>
inline T dot(int64_t n, const T* __restrict x, const T* __restrict y) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < n; ++e) s += x[e] * y[e];
  return s;
}

template <typename T>
inline T max_of(int64_t n, const T* __restrict x) {
  T m = neg_inf<T>();
#pragma omp simd reduction(max : m)
  for (int64_t e = 0; e < n; ++e) m = x[e] > m ? x[e] : m;
  return m;
}

#if defined(__GNUC__)
// Four-lane fast_exp with GCC/Clang vector extensions (lowered to SSE2 on baseline x86-64, NEON on
// arm64): the same formula as the scalar fast_exp, lane for lane, written without branches so that it
// runs vectorised (the scalar version does not, its selects stay branches).
typedef float ppma_v4f __attribute__((vector_size(16)));
typedef int32_t ppma_v4i __attribute__((vector_size(16)));

__attribute__((always_inline)) inline ppma_v4f fast_exp4(ppma_v4f x) {
  const ppma_v4f lo = ppma_v4f{} - 87.33654f, hi = ppma_v4f{} + 88.3762626647949f;
  const ppma_v4i under = x < lo;
  const ppma_v4i nan = x != x;
  ppma_v4f xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float magic = 12582912.0f;
  ppma_v4f t = xc * 1.44269504088896341f + magic;
  ppma_v4f n = t - magic;
  ppma_v4f r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  ppma_v4f r2 = r * r;
  ppma_v4f p = ppma_v4f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const ppma_v4i ni = __builtin_convertvector(n, ppma_v4i);
  const ppma_v4i bits = (ni + 127) << 23;
  ppma_v4f res = p * (ppma_v4f)bits;
  res = under ? ppma_v4f{} : res;
  return nan ? x : res;
}

__attribute__((always_inline)) inline ppma_v4f load4(const float* p) {
  ppma_v4f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void store4(float* p, ppma_v4f v) { std::memcpy(p, &v, sizeof(v)); }
#define PPMA_HAVE_V4 1
#endif

// x[e] = exp(x[e] - shift); returns the sum.
template <typename T>
inline T exp_shift_sum(int64_t n, T* __restrict x, T shift) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < n; ++e) {
    const T p = fast_exp(x[e] - shift);
    x[e] = p;
    s += p;
  }
  return s;
}

// x[e] = exp(x[e] - shift)
template <typename T>
inline void exp_shift(int64_t n, T* __restrict x, T shift) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) x[e] = fast_exp(x[e] - shift);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
// Eight-lane AVX + FMA variant of fast_exp over arrays, chosen at run time (the build targets baseline
// x86-64). Same formula; FMA contraction may change the last bit.
typedef float ppma_v8f_x86 __attribute__((vector_size(32)));
typedef int32_t ppma_v8i_x86 __attribute__((vector_size(32)));

__attribute__((target("avx,fma"), always_inline)) inline ppma_v8f_x86 fast_exp8_avx(ppma_v8f_x86 x) {
  const ppma_v8f_x86 lo = ppma_v8f_x86{} - 87.33654f, hi = ppma_v8f_x86{} + 88.3762626647949f;
  const ppma_v8i_x86 under = x < lo;
  const ppma_v8i_x86 nan = x != x;
  ppma_v8f_x86 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float magic = 12582912.0f;
  ppma_v8f_x86 t = xc * 1.44269504088896341f + magic;
  ppma_v8f_x86 n = t - magic;
  ppma_v8f_x86 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  ppma_v8f_x86 r2 = r * r;
  ppma_v8f_x86 p = ppma_v8f_x86{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const ppma_v8i_x86 ni = __builtin_convertvector(n, ppma_v8i_x86);
  const ppma_v8i_x86 bits = (ni + 127) << 23;
  ppma_v8f_x86 res = p * (ppma_v8f_x86)bits;
  res = under ? ppma_v8f_x86{} : res;
  return nan ? x : res;
}

// Returns the number of leading elements done (a multiple of 8); acc gets their sum when non-null.
__attribute__((target("avx,fma"))) inline int64_t exp_shift_avx(int64_t n, float* __restrict x, float shift,
                                                                 float* sum) {
  ppma_v8f_x86 acc{};
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    ppma_v8f_x86 v;
    std::memcpy(&v, x + e, sizeof(v));
    v = fast_exp8_avx(v - shift);
    std::memcpy(x + e, &v, sizeof(v));
    acc += v;
  }
  if (sum) {
    float s = 0;
    for (int l = 0; l < 8; ++l) s += acc[l];
    *sum = s;
  }
  return e;
}

// Whether the AVX+FMA kernel variants may run: the CPU supports them and PPMA_CPU_BASELINE is not set
// (PPMA_CPU_BASELINE=1 forces the baseline x86-64 code, so tests can check it on AVX machines too).
inline bool cpu_avx_fma_enabled() {
  static const bool enabled = __builtin_cpu_supports("avx") && __builtin_cpu_supports("fma") &&
                              !(std::getenv("PPMA_CPU_BASELINE") && std::getenv("PPMA_CPU_BASELINE")[0] == '1');
  return enabled;
}

inline bool cpu_math_has_avx_fma() { return cpu_avx_fma_enabled(); }
#define PPMA_HAVE_AVX_EXP 1
#endif

#ifdef PPMA_HAVE_V4
// float versions: vectorised (four lanes), the tail with the scalar fast_exp (the same numbers).
template <>
inline float exp_shift_sum<float>(int64_t n, float* __restrict x, float shift) {
#ifdef PPMA_HAVE_AVX_EXP
  if (cpu_math_has_avx_fma()) {
    float s = 0;
    int64_t e = exp_shift_avx(n, x, shift, &s);
    for (; e < n; ++e) {
      const float p = fast_exp(x[e] - shift);
      x[e] = p;
      s += p;
    }
    return s;
  }
#endif
  ppma_v4f acc{};
  int64_t e = 0;
  for (; e + 4 <= n; e += 4) {
    const ppma_v4f p = fast_exp4(load4(x + e) - shift);
    store4(x + e, p);
    acc += p;
  }
  float s = 0;
  for (int l = 0; l < 4; ++l) s += acc[l];
  for (; e < n; ++e) {
    const float p = fast_exp(x[e] - shift);
    x[e] = p;
    s += p;
  }
  return s;
}

template <>
inline void exp_shift<float>(int64_t n, float* __restrict x, float shift) {
  int64_t e = 0;
#ifdef PPMA_HAVE_AVX_EXP
  if (cpu_math_has_avx_fma()) e = exp_shift_avx(n, x, shift, nullptr);
#endif
  for (; e + 4 <= n; e += 4) store4(x + e, fast_exp4(load4(x + e) - shift));
  for (; e < n; ++e) x[e] = fast_exp(x[e] - shift);
}
#endif

template <typename T>
inline void scale_inplace(int64_t n, T* __restrict x, T a) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) x[e] *= a;
}

// Reverse cumulative sum of a line of prefix-sum gradients into log-decay gradients:
// out[n] = sum_{t >= n} g[t] for n >= 1 and out[0] = 0 exactly (d_0 never enters a bias).
// g and out are strided (element strides gs and os).
template <typename T, typename O>
inline void reverse_cumsum_excl_first(int64_t n, const T* g, int64_t gs, O* out, int64_t os) {
  T run = 0;
  for (int64_t t = n - 1; t >= 1; --t) {
    run += g[t * gs];
    out[t * os] = static_cast<O>(run);
  }
  out[0] = O(0);
}

}  // namespace cpu
}  // namespace ppma
