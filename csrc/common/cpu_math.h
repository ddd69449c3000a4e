// CPU-only inner-loop helpers of the ppma kernels: a branch-free exp that the compiler vectorises,
// and small array loops written so that -O3 turns them into SIMD code. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>
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
