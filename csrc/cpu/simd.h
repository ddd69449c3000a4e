// The SIMD layer of the CPU kernels, written once over the lane width L (floats per vector):
//   L = 4   capability "default": SSE2 on x86-64, NEON on arm64 (what the build targets);
//   L = 8   capability "avx2": AVX2 + FMA;
//   L = 16  capability "avx512": AVX-512 F/BW/VL/DQ (+ FMA),
// the wider ones chosen at run time by with_lanes() where the CPU has them (cpu_capability()).
// A kernel takes the lane width as a tag argument (Lanes<L>) and is instantiated once per width under
// with_lanes(), which runs it inside a function compiled for that width's target with everything it calls
// inlined (flatten). That is what makes the 8-lane code AVX code: a template is compiled for the target of the
// function it is inlined into, and an 8-lane instance compiled on its own would be baseline code working on
// pairs of 4-lane registers. So never form Lanes<8> or Lanes<16> outside with_lanes().
// PPMA_CPU_CAPABILITY=default|avx2|avx512 caps the path (like ATEN_CPU_CAPABILITY: never above what the CPU
// has), so that tests check every path the machine can run; ppma/config.py reads it and sets the option
// cpu_capability (common/options.h).
//
// Vectors are GCC/Clang vector extensions. Everything here is torch-free.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "common/options.h"

#if !defined(__GNUC__)
#error "the ppma CPU kernels need the GCC/Clang vector extensions"
#endif
#if defined(__x86_64__) || defined(__i386__)
#define PPMA_SIMD_X86 1
#endif
#define PPMA_SIMD_INLINE __attribute__((always_inline)) inline

namespace ppma {
namespace cpu {

template <int L>
using Lanes = std::integral_constant<int, L>;

// ---------------------------------------------------------------------------------------------
// Vectors of L floats (L = 1: the scalar, for the tails of the array loops), their int32 and uint32 twins, and
// vectors of L uint16 (bf16 bits).
// ---------------------------------------------------------------------------------------------
template <int L>
struct VecTypes;
template <>
struct VecTypes<1> {
  using f = float;
  using i = int32_t;
};
template <>
struct VecTypes<4> {
  typedef float f __attribute__((vector_size(16)));
  typedef int32_t i __attribute__((vector_size(16)));
  typedef uint32_t u __attribute__((vector_size(16)));
  typedef uint16_t h __attribute__((vector_size(8)));  // bf16 bits
};
template <>
struct VecTypes<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef int32_t i __attribute__((vector_size(32)));
  typedef uint32_t u __attribute__((vector_size(32)));
  typedef uint16_t h __attribute__((vector_size(16)));  // bf16 bits
};
template <>
struct VecTypes<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef int32_t i __attribute__((vector_size(64)));
  typedef uint32_t u __attribute__((vector_size(64)));
  typedef uint16_t h __attribute__((vector_size(32)));  // bf16 bits
};
template <int L>
using vec = typename VecTypes<L>::f;
template <int L>
using ivec = typename VecTypes<L>::i;

template <int L>
PPMA_SIMD_INLINE vec<L> load(const float* p) {
  vec<L> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int L>
PPMA_SIMD_INLINE void store(float* p, vec<L> v) {
  std::memcpy(p, &v, sizeof(v));
}
// The lanes' sum by a fixed pairwise tree (halves added, then their halves, ...; (v0 + v2) + (v1 + v3) at the
// last four), written out so that a result does not depend on the compiler's reduction order; log2(L) steps
// instead of a chain of L dependent additions (a row of 56 logits ends in one of these).
template <int L>
PPMA_SIMD_INLINE float hsum(vec<L> v) {
  if constexpr (L == 1) {
    return v;
  } else if constexpr (L == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    vec<L / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return hsum<L / 2>(lo + hi);
  }
}

// The range reduction and polynomial of fast_exp: for xc inside the clamps, n = round(xc / ln 2) (an integer as a
// float) and the returned p = exp(xc - n ln 2) (Cephes: ln 2 in two parts, a degree-6 polynomial in r).
template <int L>
PPMA_SIMD_INLINE vec<L> exp_reduced(vec<L> xc, vec<L>& n) {
  using V = vec<L>;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V t = xc * 1.44269504088896341f + magic;
  n = t - magic;  // round(x / ln 2)
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const V r2 = r * r;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r2 + r + 1.0f;
}

// exp(x), lane for lane and branch-free (Cephes-style range reduction and a degree-6 polynomial, exp_reduced;
// relative error ~2e-7 over the range that matters); the same formula for every width. Returns exactly 0 below
// -87.3 (and for -inf), so that a masked score of log-decay -1e4 contributes nothing, like the reference; NaN
// propagates. With FMA (the AVX instances) contraction may change the last bit.
// 16 lanes (AVX-512): 2^n is applied by vscalefps (one instruction in place of the integer conversion, the
// exponent shift and the multiplication; an exact scaling, so the same value as p * 2^n), with no lower clamp or
// NaN select (lanes below -87.3 are zeroed by the select; NaN flows through the arithmetic): six fewer vector
// operations per call, the same results up to a NaN's payload. polyline_attention inference at 32 x 32 tokens
// (1 thread, CPU time) runs 3-5 % faster with it.
template <int L>
PPMA_SIMD_INLINE vec<L> fast_exp(vec<L> x) {
  using V = vec<L>;
  using I = ivec<L>;
  const V lo = V{} - 87.33654f, hi = V{} + 88.3762626647949f;
  const I under = x < lo;
  V n;
#ifdef PPMA_SIMD_X86
  if constexpr (L == 16) {
    const V p = exp_reduced<L>(hi < x ? hi : x, n);  // a NaN lane compares false and stays NaN
    // p * 2^floor(n) (n is an integer here). Inline assembly rather than the intrinsic, like dpbf16 below: this
    // instance is only ever inlined into run_lanes16() / run_lanes16_bf16(), whose targets have AVX-512 F.
    V res;
    asm("vscalefps %[n], %[p], %[res]" : [res] "=v"(res) : [p] "v"(p), [n] "v"(n));
    return under ? V{} : res;
  }
#endif
  const I nan = x != x;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V p = exp_reduced<L>(xc, n);
  I ni;
  if constexpr (L == 1) {
    ni = static_cast<int32_t>(n);
  } else {
    ni = __builtin_convertvector(n, I);
  }
  const I bits = (ni + 127) << 23;  // 2^n as a float (n in [-126, 127] after the clamps)
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(V));
  V res = p * two_n;
  res = under ? V{} : res;
  return nan ? x : res;
}

// log1p(t) for t in [0, 1], lane for lane and branch-free (Cephes logf's degree-8 polynomial on
// [sqrt(1/2) - 1, sqrt(2) - 1]; relative error ~2e-7). 1 + t = 2^k (1 + x) with k = 0, x = t below sqrt(2) - 1 and
// k = 1, x = (t - 1) / 2 above (both exact in float), so small t keep all their bits, which log(1 + t) of a rounded
// 1 + t would lose. softplus (path_decay) is its user: softplus(z) = max(z, 0) + log1p(exp(-|z|)).
template <int L>
PPMA_SIMD_INLINE vec<L> log1p_unit(vec<L> t) {
  using V = vec<L>;
  const auto big = t > 0.41421356237f;
  const V x = big ? (t - 1.0f) * 0.5f : t;
  const V k = big ? V{} + 1.0f : V{};
  const V z = x * x;
  V y = V{} + 7.0376836292e-2f;
  y = y * x - 1.1514610310e-1f;
  y = y * x + 1.1676998740e-1f;
  y = y * x - 1.2420140846e-1f;
  y = y * x + 1.4249322787e-1f;
  y = y * x - 1.6668057665e-1f;
  y = y * x + 2.0000714765e-1f;
  y = y * x - 2.4999993993e-1f;
  y = y * x + 3.3333331174e-1f;
  y = y * x * z;
  y = y + k * -2.12194440e-4f;
  y = y - z * 0.5f;
  return (x + y) + k * 0.693359375f;
}

// {0, 1, ..., M - 1} as int32 lanes (0 for M = 1).
template <int M, size_t... E>
PPMA_SIMD_INLINE ivec<M> lane_indices(std::index_sequence<E...>) {
  return ivec<M>{static_cast<int32_t>(E)...};
}
template <int M>
PPMA_SIMD_INLINE ivec<M> lane_indices() {
  if constexpr (M == 1) {
    return 0;
  } else {
    return lane_indices<M>(std::make_index_sequence<M>());
  }
}

// Runs f(Lanes<M>{}, l) over the elements l of [0, n): vectors of L lanes, then at most one vector of each of L / 2
// ... 4 lanes, then single elements (M = 1): a loop of any length at the width of the path, without scalar
// epilogues of up to L - 1 elements. f is generic in M (a full-width call may keep vector state; the others reduce
// theirs at once).
template <int M, typename F>
PPMA_SIMD_INLINE void for_lanes_tail(int64_t n, int64_t l, F& f) {
  if constexpr (M < 4) {
    for (; l < n; ++l) f(Lanes<1>{}, l);
  } else {
    if (l + M <= n) {
      f(Lanes<M>{}, l);
      l += M;
    }
    for_lanes_tail<M / 2>(n, l, f);
  }
}
template <int L, typename F>
PPMA_SIMD_INLINE void for_lanes(Lanes<L>, int64_t n, F&& f) {
  int64_t l = 0;
  for (; l + L <= n; l += L) f(Lanes<L>{}, l);
  for_lanes_tail<L / 2>(n, l, f);
}

// The largest lane (NaN lanes ignored unless the first): of 8 or more lanes by halves (lane e against lane e + M / 2,
// keeping the lower one unless the upper is larger), then the last four in order; log2(M) vector steps instead of a
// chain of M dependent scalar maxima (every row of logits ends in one). The same value as the lanes taken in order:
// a maximum does not depend on the order, and a NaN survives a step only in the lower half, so only lane 0's
// reaches the last four, where the first lane's NaN is kept and the others' are ignored.
template <int M>
PPMA_SIMD_INLINE float lane_max(vec<M> v) {
  if constexpr (M == 1) {
    return v;
  } else if constexpr (M <= 4) {
    float m = v[0];
    for (int e = 1; e < M; ++e) m = v[e] > m ? v[e] : m;
    return m;
  } else {
    vec<M / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return lane_max<M / 2>(hi > lo ? hi : lo);
  }
}

// The first m lanes (0 <= m <= M) of M floats at p, the other lanes 0, reading nothing past p + m; and the store of
// the first m lanes of v at p, writing nothing past p + m. A line shorter than a vector in one operation instead of
// the vectors of M / 2 ... 4 lanes and single elements of for_lanes: polyline_attention's key rows at W <= 16.
// 16 lanes: AVX-512 masked moves (masked-off lanes neither fault nor write). Inline assembly rather than the
// intrinsics, like fast_exp's vscalefps: these instances are only ever inlined into run_lanes16() /
// run_lanes16_bf16(), whose targets have AVX-512 F. Other widths: element copies (correct, not fast).
// load_first(p, m, fill): the other lanes hold fill's.
// The AVX-512 write mask of the first m lanes.
PPMA_SIMD_INLINE uint16_t first_lanes(int64_t m) { return static_cast<uint16_t>((uint32_t(1) << m) - 1); }
template <int M>
PPMA_SIMD_INLINE vec<M> load_first(const float* p, int64_t m, vec<M> fill = vec<M>{}) {
#ifdef PPMA_SIMD_X86
  if constexpr (M == 16) {
    const uint16_t k = first_lanes(m);
    vec<16> v = fill;
    asm("vmovups %[src], %[v]%{%[k]%}"
        : [v] "+v"(v)
        : [src] "m"(*reinterpret_cast<const float(*)[16]>(p)), [k] "Yk"(k));
    return v;
  }
#endif
  float t[M];
  store<M>(t, fill);
  for (int64_t e = 0; e < m; ++e) t[e] = p[e];
  return load<M>(t);
}
template <int M>
PPMA_SIMD_INLINE void store_first(float* p, vec<M> v, int64_t m) {
#ifdef PPMA_SIMD_X86
  if constexpr (M == 16) {
    const uint16_t k = first_lanes(m);
    // "+m": the lanes past m keep what earlier stores wrote there (an output-only operand would let the compiler
    // drop those stores)
    asm("vmovups %[v], %[dst]%{%[k]%}" : [dst] "+m"(*reinterpret_cast<float(*)[16]>(p)) : [v] "v"(v), [k] "Yk"(k));
    return;
  }
#endif
  float t[M];
  store<M>(t, v);
  for (int64_t e = 0; e < m; ++e) p[e] = t[e];
}

// ---------------------------------------------------------------------------------------------
// Array loops. The lane-tagged ones are written with vectors; the others are plain loops that -O3 vectorises
// at the width of the function they are inlined into. double runs the plain loops (std::exp).
// ---------------------------------------------------------------------------------------------

// Tails of the exp loops below: one vector of M lanes if M more elements remain, then M / 2 ... 4 lanes.
template <int M>
PPMA_SIMD_INLINE void exp_tail_sum(int64_t n, float* __restrict x, float shift, int64_t& e, float& s) {
  if (e + M <= n) {
    const vec<M> p = fast_exp<M>(load<M>(x + e) - shift);
    store<M>(x + e, p);
    s += hsum<M>(p);
    e += M;
  }
  if constexpr (M > 4) exp_tail_sum<M / 2>(n, x, shift, e, s);
}
template <int M>
PPMA_SIMD_INLINE void exp_tail(int64_t n, float* __restrict x, float shift, int64_t& e) {
  if (e + M <= n) {
    store<M>(x + e, fast_exp<M>(load<M>(x + e) - shift));
    e += M;
  }
  if constexpr (M > 4) exp_tail<M / 2>(n, x, shift, e);
}

// x[e] = exp(x[e] - shift) for e < n; returns their sum (the lanes by hsum, then the tail).
template <int L, typename T>
PPMA_SIMD_INLINE T exp_shift_sum(Lanes<L>, int64_t n, T* __restrict x, T shift) {
  if constexpr (std::is_same<T, float>::value) {
    vec<L> acc{};
    int64_t e = 0;
    for (; e + L <= n; e += L) {
      const vec<L> p = fast_exp<L>(load<L>(x + e) - shift);
      store<L>(x + e, p);
      acc += p;
    }
    float s = hsum<L>(acc);
    // A tail of L / 2 or more: one half-width vector, its terms summed by hsum (then L / 4 ... 4 lanes).
    if constexpr (L > 4) exp_tail_sum<L / 2>(n, x, shift, e, s);
    for (; e < n; ++e) {
      const float p = fast_exp<1>(x[e] - shift);
      x[e] = p;
      s += p;
    }
    return s;
  } else {
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < n; ++e) {
      const T p = std::exp(x[e] - shift);
      x[e] = p;
      s += p;
    }
    return s;
  }
}

// x[e] = exp(x[e] - shift) for e < n.
template <int L, typename T>
PPMA_SIMD_INLINE void exp_shift(Lanes<L>, int64_t n, T* __restrict x, T shift) {
  if constexpr (std::is_same<T, float>::value) {
    int64_t e = 0;
    for (; e + L <= n; e += L) store<L>(x + e, fast_exp<L>(load<L>(x + e) - shift));
    if constexpr (L > 4) exp_tail<L / 2>(n, x, shift, e);
    for (; e < n; ++e) x[e] = fast_exp<1>(x[e] - shift);
  } else {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) x[e] = std::exp(x[e] - shift);
  }
}

template <typename T>
inline T max_of(int64_t n, const T* __restrict x) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t e = 0; e < n; ++e) m = x[e] > m ? x[e] : m;
  return m;
}

// The two softmaxes of one query row of polyline attention (docs/ops.md "polyline_attention"): x1, x2 (n logits
// each) become exp(x - max) in place; returns 1 / sum of each in inv[0], inv[1] and their log-sum-exps in lse[0],
// lse[1].
// m1, m2: the rows' maxima where the caller has them (polyline_attention's bias pass).
template <int L, typename T>
PPMA_SIMD_INLINE void softmax_pair_row(Lanes<L> ln, int64_t n, T* __restrict x1, T* __restrict x2, T m1, T m2,
                                       T* inv1, T* inv2, T* lse) {
  const T l1 = exp_shift_sum(ln, n, x1, m1), l2 = exp_shift_sum(ln, n, x2, m2);
  *inv1 = T(1) / l1;
  *inv2 = T(1) / l2;
  lse[0] = m1 + std::log(l1);
  lse[1] = m2 + std::log(l2);
}

template <int L, typename T>
PPMA_SIMD_INLINE void softmax_pair_row(Lanes<L> ln, int64_t n, T* __restrict x1, T* __restrict x2, T* inv1, T* inv2,
                                       T* lse) {
  softmax_pair_row(ln, n, x1, x2, max_of(n, x1), max_of(n, x2), inv1, inv2, lse);
}

// One output row from the two unnormalised products o1 = P1 v, o2 = P2 v (dv each): out_v2h = o1 * inv1 and
// out = 0.5 (o1 * inv1 + o2 * inv2).
template <typename T>
inline void average_pair_row(int64_t dv, const T* __restrict o1, const T* __restrict o2, T inv1, T inv2,
                             T* __restrict out_v2h, T* __restrict out) {
#pragma omp simd
  for (int64_t e = 0; e < dv; ++e) {
    const T v1 = o1[e] * inv1, v2 = o2[e] * inv2;
    out_v2h[e] = v1;
    out[e] = T(0.5) * (v1 + v2);
  }
}

template <typename T>
inline T dot(int64_t n, const T* __restrict x, const T* __restrict y) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < n; ++e) s += x[e] * y[e];
  return s;
}

// y[0:n] += a * x[0:n]
template <typename T>
inline void axpy(int64_t n, T a, const T* __restrict x, T* __restrict y) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) y[e] += a * x[e];
}

template <typename T>
inline void scale_inplace(int64_t n, T* __restrict x, T a) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) x[e] *= a;
}

// dst[e] = src[e] for e < n, for the short rows of the line kernels: 64 bytes at a time, then 32, 16, ... 1
// (fixed-size memcpys, i.e. vector and scalar moves). GCC turns a plain copy loop into a call of memcpy, which costs
// more than copying a row of a few dozen bytes; the empty asm statement keeps the index opaque so that it cannot.
template <typename T>
PPMA_SIMD_INLINE void copy_row(int64_t n, const T* __restrict src, T* __restrict dst) {
  const char* s = reinterpret_cast<const char*>(src);
  char* d = reinterpret_cast<char*>(dst);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  int64_t e = 0;
  for (; e + 64 <= bytes; e += 64) {
    std::memcpy(d + e, s + e, 64);
    asm("" : "+r"(e));
  }
  if (e + 32 <= bytes) std::memcpy(d + e, s + e, 32), e += 32;
  if (e + 16 <= bytes) std::memcpy(d + e, s + e, 16), e += 16;
  if (e + 8 <= bytes) std::memcpy(d + e, s + e, 8), e += 8;
  if (e + 4 <= bytes) std::memcpy(d + e, s + e, 4), e += 4;
  if (e + 2 <= bytes) std::memcpy(d + e, s + e, 2), e += 2;
  if (e < bytes) d[e] = s[e];
}

// Strided rows copied into a matrix: dst[r * ds + e] = a * src[r * ss + e] for r < n, e < c.
template <typename T>
inline void gather_rows(int64_t n, int64_t c, const T* src, int64_t ss, T* __restrict dst, int64_t ds, T a = T(1)) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + r * ss;
    T* o = dst + r * ds;
    if (a == T(1)) {
      copy_row(c, s, o);
    } else {
      for (int64_t e = 0; e < c; ++e) o[e] = a * s[e];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Transposed gather: dst[e * n + r] = src[r * ss + e] for r < n, e < c (an exact copy), in L x L register blocks.
// ---------------------------------------------------------------------------------------------
#if defined(__clang__)
#define PPMA_SHUFFLE(L, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PPMA_SHUFFLE(L, a, b, ...) __builtin_shuffle(a, b, ivec<L>{__VA_ARGS__})
#endif

// dst[e * ld + r] = src[r * ss + e] for r, e < L: interleave pairs of rows, then pairs of pairs (inside each
// 128-bit half, which is all of a 4-lane vector), then (8 lanes) exchange the halves. Each shuffle is one
// unpck / shufps / vperm2f128 instruction.
template <int L>
PPMA_SIMD_INLINE void transpose_block(const float* src, int64_t ss, float* dst, int64_t ld) {
  vec<L> x[L];
  for (int r = 0; r < L; ++r) x[r] = load<L>(src + r * ss);
  if constexpr (L == 4) {
    const vec<4> t0 = PPMA_SHUFFLE(4, x[0], x[1], 0, 4, 1, 5), t1 = PPMA_SHUFFLE(4, x[0], x[1], 2, 6, 3, 7);
    const vec<4> t2 = PPMA_SHUFFLE(4, x[2], x[3], 0, 4, 1, 5), t3 = PPMA_SHUFFLE(4, x[2], x[3], 2, 6, 3, 7);
    store<4>(dst, PPMA_SHUFFLE(4, t0, t2, 0, 1, 4, 5));
    store<4>(dst + ld, PPMA_SHUFFLE(4, t0, t2, 2, 3, 6, 7));
    store<4>(dst + 2 * ld, PPMA_SHUFFLE(4, t1, t3, 0, 1, 4, 5));
    store<4>(dst + 3 * ld, PPMA_SHUFFLE(4, t1, t3, 2, 3, 6, 7));
  } else {
    static_assert(L == 8, "transpose_block: 4 or 8 lanes");
    vec<8> t[8], u[8];
    for (int r = 0; r < 8; r += 2) {
      t[r] = PPMA_SHUFFLE(8, x[r], x[r + 1], 0, 8, 1, 9, 4, 12, 5, 13);
      t[r + 1] = PPMA_SHUFFLE(8, x[r], x[r + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int r = 0; r < 8; r += 4) {
      u[r] = PPMA_SHUFFLE(8, t[r], t[r + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[r + 1] = PPMA_SHUFFLE(8, t[r], t[r + 2], 2, 3, 10, 11, 6, 7, 14, 15);
      u[r + 2] = PPMA_SHUFFLE(8, t[r + 1], t[r + 3], 0, 1, 8, 9, 4, 5, 12, 13);
      u[r + 3] = PPMA_SHUFFLE(8, t[r + 1], t[r + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int e = 0; e < 4; ++e) {
      store<8>(dst + e * ld, PPMA_SHUFFLE(8, u[e], u[e + 4], 0, 1, 2, 3, 8, 9, 10, 11));
      store<8>(dst + (e + 4) * ld, PPMA_SHUFFLE(8, u[e], u[e + 4], 4, 5, 6, 7, 12, 13, 14, 15));
    }
  }
}
#undef PPMA_SHUFFLE

// (16 lanes transpose in 8 x 8 blocks.)
template <int L0, typename T>
PPMA_SIMD_INLINE void gather_rows_t(Lanes<L0>, int64_t n, int64_t c, const T* src, int64_t ss, T* __restrict dst) {
  constexpr int L = L0 > 8 ? 8 : L0;
  int64_t r0 = 0;
  if constexpr (std::is_same<T, float>::value) {
    for (; r0 + L <= n; r0 += L) {
      int64_t e0 = 0;
      for (; e0 + L <= c; e0 += L) transpose_block<L>(src + r0 * ss + e0, ss, dst + e0 * n + r0, n);
      for (int64_t r = r0; r < r0 + L; ++r)
        for (int64_t e = e0; e < c; ++e) dst[e * n + r] = src[r * ss + e];
    }
  }
  for (int64_t r = r0; r < n; ++r)
    for (int64_t e = 0; e < c; ++e) dst[e * n + r] = src[r * ss + e];
}

// ---------------------------------------------------------------------------------------------
// small_gemm: the small dense products of the line kernels,
//   C[r * ldc + c] = alpha * sum_k A[r * ar + k * ak] * Bt[k * bs + c]      (accumulate: C += ...)
// for r < R, c < Cn, k < K. A is read through two strides (so A or A^T), Bt row-major with row stride bs.
// float: column blocks of 2L, L, L / 2, ..., 4 lanes, each in register tiles of gemm_rows<L>() rows by the
// block (4 rows at 4 lanes, 6 at 8, 8 at 16: 8, 12 or 16 independent multiply-add chains held in registers,
// oneDNN-style micro-kernels sized to the register file), the remaining rows in tiles of 4, 2 and 1 rows;
// the last Cn % 4 columns and double run the scalar loop. The sum over k runs in order for every element, so
// the result does not depend on the blocking.
// ---------------------------------------------------------------------------------------------
template <typename T>
PPMA_SIMD_INLINE void gemm_scalar(int64_t R, int64_t c0, int64_t Cn, int64_t K, const T* A, int64_t ar, int64_t ak,
                                  const T* Bt, int64_t bs, T* C, int64_t ldc, bool accumulate, T alpha) {
  for (int64_t r = 0; r < R; ++r) {
    T* cr = C + r * ldc;
    for (int64_t c = c0; c < Cn; ++c) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += A[r * ar + k * ak] * Bt[k * bs + c];
      cr[c] = accumulate ? cr[c] + alpha * acc : alpha * acc;
    }
  }
}

// RB rows by NB vectors of L columns, held in registers over the whole sum.
template <int L, int RB, int NB>
PPMA_SIMD_INLINE void gemm_tile(int64_t K, const float* A, int64_t ar, int64_t ak, const float* Bt, int64_t bs,
                                float* C, int64_t ldc, bool accumulate, float alpha) {
  vec<L> s[RB][NB] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec<L> b[NB];
    for (int c = 0; c < NB; ++c) b[c] = load<L>(Bt + k * bs + c * L);
    const float* a = A + k * ak;
    for (int r = 0; r < RB; ++r) {
      const float x = a[r * ar];
      for (int c = 0; c < NB; ++c) s[r][c] += x * b[c];
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NB; ++c) {
      float* cp = C + r * ldc + c * L;
      vec<L> t = s[r][c] * alpha;
      if (accumulate) t += load<L>(cp);
      store<L>(cp, t);
    }
  }
}

// Rows of a register tile at lane width L (the accumulators, 2 * rows vectors, plus the B row and a broadcast
// fit the register file: 16 registers below AVX-512, 32 with it).
template <int L>
constexpr int gemm_rows() {
  return L >= 16 ? 8 : (L == 8 ? 6 : 4);
}

template <int L, int NB, int RB = gemm_rows<L>()>
PPMA_SIMD_INLINE void gemm_columns(int64_t R, int64_t K, const float* A, int64_t ar, int64_t ak, const float* Bt,
                                   int64_t bs, float* C, int64_t ldc, bool accumulate, float alpha) {
  int64_t r0 = 0;
  for (; r0 + RB <= R; r0 += RB)
    gemm_tile<L, RB, NB>(K, A + r0 * ar, ar, ak, Bt, bs, C + r0 * ldc, ldc, accumulate, alpha);
  // The last R % RB rows in tiles of 4 and 2 rows before single ones (a single row is latency-bound).
  if constexpr (RB > 4) {
    if (r0 + 4 <= R) {
      gemm_tile<L, 4, NB>(K, A + r0 * ar, ar, ak, Bt, bs, C + r0 * ldc, ldc, accumulate, alpha);
      r0 += 4;
    }
  }
  if (r0 + 2 <= R) {
    gemm_tile<L, 2, NB>(K, A + r0 * ar, ar, ak, Bt, bs, C + r0 * ldc, ldc, accumulate, alpha);
    r0 += 2;
  }
  for (; r0 < R; ++r0) gemm_tile<L, 1, NB>(K, A + r0 * ar, ar, ak, Bt, bs, C + r0 * ldc, ldc, accumulate, alpha);
}

// The column blocks of M lanes (M < L), then M / 2 ... 4, at the row blocking of the full width L.
template <int L, int M>
PPMA_SIMD_INLINE void gemm_column_tail(int64_t& c0, int64_t R, int64_t Cn, int64_t K, const float* A, int64_t ar,
                                       int64_t ak, const float* Bt, int64_t bs, float* C, int64_t ldc,
                                       bool accumulate, float alpha) {
  for (; c0 + M <= Cn; c0 += M)
    gemm_columns<M, 1, gemm_rows<L>()>(R, K, A, ar, ak, Bt + c0, bs, C + c0, ldc, accumulate, alpha);
  if constexpr (M > 4) gemm_column_tail<L, M / 2>(c0, R, Cn, K, A, ar, ak, Bt, bs, C, ldc, accumulate, alpha);
}

template <int L, typename T>
PPMA_SIMD_INLINE void small_gemm(Lanes<L>, int64_t R, int64_t Cn, int64_t K, const T* A, int64_t ar, int64_t ak,
                                 const T* Bt, int64_t bs, T* C, int64_t ldc, bool accumulate, T alpha = T(1)) {
  int64_t c0 = 0;
  if constexpr (std::is_same<T, float>::value) {
    for (; c0 + 2 * L <= Cn; c0 += 2 * L)
      gemm_columns<L, 2>(R, K, A, ar, ak, Bt + c0, bs, C + c0, ldc, accumulate, alpha);
    for (; c0 + L <= Cn; c0 += L) gemm_columns<L, 1>(R, K, A, ar, ak, Bt + c0, bs, C + c0, ldc, accumulate, alpha);
    if constexpr (L > 4) gemm_column_tail<L, L / 2>(c0, R, Cn, K, A, ar, ak, Bt, bs, C, ldc, accumulate, alpha);
  }
  gemm_scalar(R, c0, Cn, K, A, ar, ak, Bt, bs, C, ldc, accumulate, alpha);
}

// ---------------------------------------------------------------------------------------------
// bf16 products (AVX-512 BF16, the "avx512" path where cpu_bf16_dot() holds; run under with_lanes_bf16()).
// bf16 values are raw 16-bit patterns (uint16_t); two of them side by side (a uint32_t, the lower one first) are
// a pair, the operand unit of vdpbf16ps: acc[c] += a.lo * b[c].lo + a.hi * b[c].hi in float32. The products of
// bf16 values are exact in float32; the sums are float32 (round to nearest even, denormals flushed).
// ---------------------------------------------------------------------------------------------

// float -> bf16, round to nearest even; NaN stays (a quiet) NaN. The same rounding as c10::BFloat16. Written
// without a branch, so that the loops calling it vectorise.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// bf16 -> float (exact).
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Rows of features as rows of pairs: dst[j][e] = src[j * ss + e] for e < d (rows of 2 ceil(d / 2) values, the last
// one 0 when d is odd): the A operand of small_gemm_bf16.
inline void gather_pair_rows(int64_t n, int64_t d, const uint16_t* src, int64_t ss, uint16_t* __restrict dst) {
  const int64_t w = d + (d & 1);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* s = src + j * ss;
    uint16_t* o = dst + j * w;
    copy_row(d, s, o);
    if (d & 1) o[d] = 0;
  }
}

// Rows transposed in pairs of features (keys as the B operand of q k^T in criss_cross_attention's bf16 lines and
// polyline_attention's packed keys): dst[p * ldb + l] = the pair (src[l * ss + 2 p], src[l * ss + 2 p + 1]) for
// l < n, p < ceil(d / 2), the second one 0 past d.
// Even d: 8 x 8 blocks of pairs moved as floats by transpose_block (above; shuffles, so the bits are kept).
inline void gather_pairs_t(int64_t n, int64_t d, const uint16_t* src, int64_t ss, uint32_t* __restrict dst,
                           int64_t ldb) {
  const int64_t full = d / 2;
  int64_t l0 = 0;
  if (d % 2 == 0) {  // pairs are then 4-byte aligned rows of full words, ss / 2 words apart
    const float* s32 = reinterpret_cast<const float*>(src);
    float* d32 = reinterpret_cast<float*>(dst);
    for (; l0 + 8 <= n; l0 += 8) {
      int64_t p0 = 0;
      for (; p0 + 8 <= full; p0 += 8) transpose_block<8>(s32 + l0 * (ss / 2) + p0, ss / 2, d32 + p0 * ldb + l0, ldb);
      for (int64_t l = l0; l < l0 + 8; ++l)
        for (int64_t p = p0; p < full; ++p) std::memcpy(dst + p * ldb + l, src + l * ss + 2 * p, sizeof(uint32_t));
    }
  }
  for (int64_t l = l0; l < n; ++l) {
    const uint16_t* s = src + l * ss;
    for (int64_t p = 0; p < full; ++p) {
      uint32_t w;
      std::memcpy(&w, s + 2 * p, sizeof(w));
      dst[p * ldb + l] = w;
    }
    if (d & 1) dst[full * ldb + l] = s[d - 1];  // (s[d - 1], 0): the lower half comes first
  }
}

// Rows in pairs of positions (values or z as the B operand of a map product; polyline_attention's packed
// values): dst[p * ldb + e] = the pair (src[2 p][e], src[2 p + 1][e]) (row r at src + r * ss) for p < ceil(n / 2),
// e < c, the second one 0 past n.
inline void gather_pairs_positions(int64_t n, int64_t c, const uint16_t* src, int64_t ss, uint32_t* __restrict dst,
                                   int64_t ldb) {
  for (int64_t p = 0; 2 * p < n; ++p) {
    const uint16_t* a = src + 2 * p * ss;
    uint32_t* o = dst + p * ldb;
    if (2 * p + 1 < n) {
      const uint16_t* b = a + ss;
#pragma omp simd
      for (int64_t e = 0; e < c; ++e) o[e] = uint32_t(a[e]) | (uint32_t(b[e]) << 16);
    } else {
#pragma omp simd
      for (int64_t e = 0; e < c; ++e) o[e] = a[e];
    }
  }
}

// M bf16 values (bits) widened to floats (exact), and M floats rounded to bf16 (float_to_bf16's rounding, NaN kept
// a quiet NaN): integer vector operations, at the width of the path that inlines them (M = 1: the scalar ones).
template <int M>
PPMA_SIMD_INLINE vec<M> load_bf16(const uint16_t* p) {
  if constexpr (M == 1) {
    return bf16_to_float(*p);
  } else {
    using h = typename VecTypes<M>::h;
    using u = typename VecTypes<M>::u;
    h v;
    std::memcpy(&v, p, sizeof(v));
    const u w = __builtin_convertvector(v, u) << 16;
    vec<M> f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
}
// gather_rows_t of bf16 rows (bits) widened to float: dst[e * n + r] = src[r * ss + e] for r < n, e < c. Blocks
// of 8 x 8 (4 x 4 on the 4-lane path) are widened into a float block and moved by transpose_block; the rest one by
// one. The same values as widening then gather_rows_t (widening is exact, the transpose moves bits).
template <int L0>
PPMA_SIMD_INLINE void gather_bf16_rows_t(Lanes<L0>, int64_t n, int64_t c, const uint16_t* src, int64_t ss,
                                         float* __restrict dst) {
  constexpr int L = L0 > 8 ? 8 : L0;
  int64_t r0 = 0;
  if constexpr (L >= 4) {
    for (; r0 + L <= n; r0 += L) {
      int64_t e0 = 0;
      for (; e0 + L <= c; e0 += L) {
        float blk[L * L];
        for (int r = 0; r < L; ++r) store<L>(blk + r * L, load_bf16<L>(src + (r0 + r) * ss + e0));
        transpose_block<L>(blk, L, dst + e0 * n + r0, n);
      }
      for (int64_t r = r0; r < r0 + L; ++r)
        for (int64_t e = e0; e < c; ++e) dst[e * n + r] = bf16_to_float(src[r * ss + e]);
    }
  }
  for (int64_t r = r0; r < n; ++r)
    for (int64_t e = 0; e < c; ++e) dst[e * n + r] = bf16_to_float(src[r * ss + e]);
}

#ifdef PPMA_SIMD_X86
// Whether the CPU has AVX-512 BF16, whose vcvtneps2bf16 rounds 16 floats to bf16 in one instruction (read once, as
// the library loads). Any path may ask: the 16-lane stores below use the instruction where it is true.
inline const bool kCpuBf16Convert = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}();
#endif

template <int M>
PPMA_SIMD_INLINE void store_bf16(uint16_t* p, vec<M> x) {
#ifdef PPMA_SIMD_X86
  if constexpr (M == 16) {
    // vcvtneps2bf16: the same rounding (to nearest even, NaN made quiet) but for denormal floats, which it
    // flushes to zero (bf16 keeps float's exponent range, so float_to_bf16 keeps them as bf16 denormals). Inline
    // assembly, like dpbf16 below, so that the 16-lane functions inlining it need no target attribute of their own.
    if (kCpuBf16Convert) {
      typename VecTypes<16>::h v;
      asm("vcvtneps2bf16 %[x], %[v]" : [v] "=v"(v) : [x] "v"(x));
      std::memcpy(p, &v, sizeof(v));
      return;
    }
  }
#endif
  if constexpr (M == 1) {
    *p = float_to_bf16(x);
  } else {
    using h = typename VecTypes<M>::h;
    using u = typename VecTypes<M>::u;
    u w;
    std::memcpy(&w, &x, sizeof(w));
    const u nan = (w & 0x7fffffffu) > 0x7f800000u;
    const u r = nan ? ((w >> 16) | 0x40u) : ((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
    const h v = __builtin_convertvector(r, h);
    std::memcpy(p, &v, sizeof(v));
  }
}

// L values of a map of floats or of bf16 bits (widened exactly), and L floats stored into one (bf16: rounded to
// nearest even): the loads and stores of kernels templated on the map's element type.
template <int L>
PPMA_SIMD_INLINE vec<L> load_map(const float* p) {
  return load<L>(p);
}
template <int L>
PPMA_SIMD_INLINE vec<L> load_map(const uint16_t* p) {
  return load_bf16<L>(p);
}
template <int L>
PPMA_SIMD_INLINE void store_map(float* p, vec<L> v) {
  store<L>(p, v);
}
template <int L>
PPMA_SIMD_INLINE void store_map(uint16_t* p, vec<L> v) {
  store_bf16<L>(p, v);
}

// <x, y> over n values: float in vectors of the path's width (two accumulators of L lanes, so that long rows are not
// bound by one chain of additions, then L / 2 ... 4 lanes, then single values; each width's products summed by
// hsum), double in a plain loop. x: T, or for float sums also bf16 bits (widened exactly as they are read). Not an
// `omp simd reduction`: GCC ends those with the lanes added one by one through memory, a chain of L dependent scalar
// additions that cost more than a short row's products.
template <int L, typename T, typename X>
PPMA_SIMD_INLINE T dot_lanes(Lanes<L>, int64_t n, const X* __restrict x, const T* __restrict y) {
  if constexpr (std::is_same_v<T, float>) {
    vec<L> acc0{}, acc1{};
    int64_t e = 0;
    for (; e + 2 * L <= n; e += 2 * L) {
      acc0 += load_map<L>(x + e) * load<L>(y + e);
      acc1 += load_map<L>(x + e + L) * load<L>(y + e + L);
    }
    if (e + L <= n) acc0 += load_map<L>(x + e) * load<L>(y + e), e += L;
    float s = hsum<L>(acc0 + acc1);
    auto tail = [&](auto lm, int64_t l) {
      constexpr int M = decltype(lm)::value;
      s += hsum<M>(load_map<M>(x + l) * load<M>(y + l));
    };
    for_lanes_tail<L / 2>(n, e, tail);
    return s;
  } else {
    static_assert(std::is_same_v<X, T>, "dot_lanes: a bf16 x takes float sums");
    T s = 0;
    for (int64_t e = 0; e < n; ++e) s += x[e] * y[e];
    return s;
  }
}

#ifdef PPMA_SIMD_X86
// The first m (< 16) lanes of v rounded to bf16 into p[0 .. m) (store_bf16<16>: rounded as whole vectors are).
PPMA_SIMD_INLINE void store_bf16_first(uint16_t* p, vec<16> v, int64_t m) {
  uint16_t h[16];
  store_bf16<16>(h, v);
  copy_row(m, h, p);
}

// dst[e] = bf16(a * x[e]) for e < n, 16 at a time (store_bf16<16>, the tail too: every value rounded alike).
PPMA_SIMD_INLINE void scaled_to_bf16(Lanes<16>, int64_t n, const float* __restrict x, float a,
                                     uint16_t* __restrict dst) {
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) store_bf16<16>(dst + e, load<16>(x + e) * a);
  if (e < n) store_bf16_first(dst + e, load_first<16>(x + e, n - e) * a, n - e);
}

// dst[e] = bf16(x[e]) for e < n (scaled_to_bf16 with a = 1).
PPMA_SIMD_INLINE void floats_to_bf16(Lanes<16> ln, int64_t n, const float* __restrict x, uint16_t* __restrict dst) {
  scaled_to_bf16(ln, n, x, 1.0f, dst);
}

// acc plus the pairwise products of a and b (vdpbf16ps). Inline assembly rather than the intrinsic, so that the
// templates calling it need no target attribute of their own: they are only ever inlined into
// run_lanes16_bf16(), whose target has AVX-512 BF16. The accumulator goes in and out by value: an asm operand
// that is an element of the caller's accumulator array kept that array on the stack (a load and a store around
// every instruction).
//
// Emulated = true: the same sums on AVX-512F alone (the internal option cpu_lowp_products=5, cpu_bf16_dot_emulated:
// tests of this path on CPUs without AVX-512 BF16). A bf16 widened is its bits << 16; each product is exact in
// float32, so each step is the product added with one rounding: the high pair first, then the low one, the order
// of the instruction's definition in Intel's manual. The instruction flushes denormal inputs and results to zero,
// the emulation does not: they differ only there.
template <bool Emulated = false>
PPMA_SIMD_INLINE vec<16> dpbf16(vec<16> acc, ivec<16> a, ivec<16> b) {
  if constexpr (Emulated) {
    const ivec<16> high = ivec<16>{} + static_cast<int32_t>(0xffff0000u);
    const ivec<16> ah = a & high, al = a << 16, bh = b & high, bl = b << 16;
    vec<16> fah, fal, fbh, fbl;
    std::memcpy(&fah, &ah, sizeof(fah));
    std::memcpy(&fal, &al, sizeof(fal));
    std::memcpy(&fbh, &bh, sizeof(fbh));
    std::memcpy(&fbl, &bl, sizeof(fbl));
    acc += fah * fbh;
    acc += fal * fbl;
  } else {
    asm("vdpbf16ps %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
  }
  return acc;
}

// RB rows by NB vectors of 16 columns, over K2 pairs:
//   C[r * ldc + c] (=|+=) alpha * sum_p A[(r * ar + p) * 2 .. +1] . Bp[(p * ldb + c) * 2 .. +1]
// A: rows of pairs, row stride ar in pairs; Bp: packed pairs [K2][ldb][2], read 16 columns at a time (pad ldb to
// a multiple of 16 with zeros: whole vectors are read). Only the first `cols` (<= 16 NB) columns of the tile
// are stored.
template <int RB, int NB, bool Emulated>
PPMA_SIMD_INLINE void gemm_bf16_tile(int64_t K2, const uint16_t* A, int64_t ar, const uint16_t* Bp, int64_t ldb,
                                     float* C, int64_t ldc, int64_t cols, bool accumulate, float alpha) {
  vec<16> s[RB][NB] = {};
  for (int64_t p = 0; p < K2; ++p) {
    ivec<16> b[NB];
    for (int c = 0; c < NB; ++c) std::memcpy(&b[c], Bp + (p * ldb + c * 16) * 2, sizeof(b[c]));
    for (int r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + (r * ar + p) * 2, sizeof(pair));
      const ivec<16> a = ivec<16>{} + pair;
      for (int c = 0; c < NB; ++c) s[r][c] = dpbf16<Emulated>(s[r][c], a, b[c]);
    }
  }
  // Unrolled, so that the accumulators are registers (an accumulator indexed in a loop kept rolled lives in memory).
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < NB; ++c) {
      float* cp = C + r * ldc + c * 16;
      vec<16> t = s[r][c] * alpha;
      const int64_t m = cols - c * 16;
      if (m >= 16) {
        if (accumulate) t += load<16>(cp);
        store<16>(cp, t);
      } else {  // the first m columns, by masked loads and stores
        if (accumulate) t += load_first<16>(cp, m);
        store_first<16>(cp, t, m);
      }
    }
  }
}

template <int NB, bool Emulated>
PPMA_SIMD_INLINE void gemm_bf16_columns(int64_t R, int64_t K2, const uint16_t* A, int64_t ar, const uint16_t* Bp,
                                        int64_t ldb, float* C, int64_t ldc, int64_t cols, bool accumulate,
                                        float alpha) {
  int64_t r0 = 0;
  for (; r0 + 8 <= R; r0 += 8)
    gemm_bf16_tile<8, NB, Emulated>(K2, A + r0 * ar * 2, ar, Bp, ldb, C + r0 * ldc, ldc, cols, accumulate, alpha);
  if (r0 + 4 <= R) {
    gemm_bf16_tile<4, NB, Emulated>(K2, A + r0 * ar * 2, ar, Bp, ldb, C + r0 * ldc, ldc, cols, accumulate, alpha);
    r0 += 4;
  }
  if (r0 + 2 <= R) {
    gemm_bf16_tile<2, NB, Emulated>(K2, A + r0 * ar * 2, ar, Bp, ldb, C + r0 * ldc, ldc, cols, accumulate, alpha);
    r0 += 2;
  }
  for (; r0 < R; ++r0)
    gemm_bf16_tile<1, NB, Emulated>(K2, A + r0 * ar * 2, ar, Bp, ldb, C + r0 * ldc, ldc, cols, accumulate, alpha);
}

inline bool cpu_bf16_dot_emulated();

template <bool Emulated>
PPMA_SIMD_INLINE void small_gemm_bf16_on(int64_t R, int64_t Cn, int64_t K2, const uint16_t* A, int64_t ar,
                                         const uint16_t* Bp, int64_t ldb, float* C, int64_t ldc, bool accumulate,
                                         float alpha) {
  int64_t c0 = 0;
  for (; c0 + 32 <= Cn; c0 += 32)
    gemm_bf16_columns<2, Emulated>(R, K2, A, ar, Bp + c0 * 2, ldb, C + c0, ldc, 32, accumulate, alpha);
  for (; c0 < Cn; c0 += 16)
    gemm_bf16_columns<1, Emulated>(R, K2, A, ar, Bp + c0 * 2, ldb, C + c0, ldc, std::min<int64_t>(16, Cn - c0),
                                   accumulate, alpha);
}

// C[r, c] (=|+=) alpha * sum_{p < K2} <A pair (r, p), B pair (p, c)> for r < R, c < Cn: A rows of pairs at stride ar
// (in pairs), B packed [K2][ldb][2] with ldb >= Cn a multiple of 16 (zero columns past Cn). Every element's sum
// runs over p in order, so the result does not depend on the blocking. On vdpbf16ps, or its emulation where
// cpu_bf16_dot_emulated() (read per call: the tests switch it in one process).
PPMA_SIMD_INLINE void small_gemm_bf16(Lanes<16>, int64_t R, int64_t Cn, int64_t K2, const uint16_t* A, int64_t ar,
                                      const uint16_t* Bp, int64_t ldb, float* C, int64_t ldc, bool accumulate,
                                      float alpha = 1.0f) {
  if (cpu_bf16_dot_emulated())
    small_gemm_bf16_on<true>(R, Cn, K2, A, ar, Bp, ldb, C, ldc, accumulate, alpha);
  else
    small_gemm_bf16_on<false>(R, Cn, K2, A, ar, Bp, ldb, C, ldc, accumulate, alpha);
}
#endif  // PPMA_SIMD_X86

// ---------------------------------------------------------------------------------------------
// The run-time dispatch, the one place that chooses the width.
// ---------------------------------------------------------------------------------------------

// The SIMD paths, in increasing order ("default" < "avx2" < "avx512"); the names of PPMA_CPU_CAPABILITY.
enum class Capability : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* capability_name(Capability c) {
  switch (c) {
    case Capability::kAvx512:
      return "avx512";
    case Capability::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

// The widest path this CPU can run, whatever the environment says.
inline Capability cpu_supported_capability() {
#ifdef PPMA_SIMD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return Capability::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Capability::kAvx2;
#endif
  return Capability::kDefault;
}

// Whether the CPU has the AVX-512 BF16 dot products (vdpbf16ps) on top of the avx512 path.
inline bool cpu_supports_avx512_bf16() {
#ifdef PPMA_SIMD_X86
  __builtin_cpu_init();
  return cpu_supported_capability() == Capability::kAvx512 && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// The cap put on the path: the option cpu_capability (common/options.h), which ppma/config.py sets from
// PPMA_CPU_CAPABILITY (default, avx2 or avx512) at import.
inline Capability capability_cap() {
  switch (get_option(Option::kCpuCapability)) {
    case 0: return Capability::kDefault;
    case 1: return Capability::kAvx2;
    default: return Capability::kAvx512;
  }
}

// The path the kernels run: what the CPU supports, capped by the option (read once per process, at the first
// kernel: ppma/config.py sets the option at import, before any kernel runs).
inline Capability cpu_capability() {
  static const Capability selected = [] {
    const Capability sup = cpu_supported_capability(), cap = capability_cap();
    return static_cast<int>(cap) < static_cast<int>(sup) ? cap : sup;
  }();
  return selected;
}

// Kept for the kernels that ask it: whether a path with at least 8 lanes (AVX2 + FMA) runs.
inline bool avx_fma_enabled() { return cpu_capability() != Capability::kDefault; }

template <typename F>
__attribute__((flatten)) auto run_lanes4(F& f) {
  return f(Lanes<4>{});
}
#ifdef PPMA_SIMD_X86
template <typename F>
__attribute__((target("avx,avx2,fma"), flatten)) auto run_lanes8(F& f) {
  return f(Lanes<8>{});
}
template <typename F>
__attribute__((target("avx,avx2,fma,avx512f,avx512bw,avx512vl,avx512dq"), flatten)) auto run_lanes16(F& f) {
  return f(Lanes<16>{});
}
template <typename F>
__attribute__((target("avx,avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"), flatten)) auto run_lanes16_bf16(
    F& f) {
  return f(Lanes<16>{});
}
#endif

// Whether the bf16 products run on vdpbf16ps's emulation (dpbf16): the internal option cpu_lowp_products is 5
// (common/options.h; tests) and the avx512 path is selected, whatever the CPU has.
inline bool cpu_bf16_dot_emulated() {
  return get_option(Option::kCpuLowpProducts) == 5 && cpu_capability() == Capability::kAvx512;
}

// Whether the bf16 products run: the avx512 path is selected and the CPU has AVX-512 BF16, or their emulation.
inline bool cpu_bf16_dot() {
  static const bool enabled = cpu_capability() == Capability::kAvx512 && cpu_supports_avx512_bf16();
  return enabled || cpu_bf16_dot_emulated();
}

#ifdef PPMA_SIMD_X86
// Returns f(Lanes<16>{}) inside a function compiled for AVX-512 with BF16; only where cpu_bf16_dot(), which the
// caller checks (small_gemm_bf16 and everything else of the avx512 path may run in f).
template <typename F>
inline auto with_lanes_bf16(F&& f) {
  return run_lanes16_bf16(f);
}
#endif

// Returns f(Lanes<16>{}), f(Lanes<8>{}) or f(Lanes<4>{}) as cpu_capability() says; f is a generic callable
// whose body (and everything it calls) is inlined into a function compiled for the chosen target.
template <typename F>
inline auto with_lanes(F&& f) {
#ifdef PPMA_SIMD_X86
  switch (cpu_capability()) {
    case Capability::kAvx512:
      return run_lanes16(f);
    case Capability::kAvx2:
      return run_lanes8(f);
    default:
      break;
  }
#endif
  return run_lanes4(f);
}

}  // namespace cpu
}  // namespace ppma
