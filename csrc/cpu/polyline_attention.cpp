// CPU kernels of ppma::polyline_attention (the official "whole" mode, docs/model.md §3.4;
// docs/ops.md "polyline_attention") and its backward.
//
// Per (batch, head) and tile of TQ queries, the logits against all N keys are computed once by the
// register-blocked products of cpu/simd.h (small_gemm; no ATen call inside the tasks) into per-thread scratch
// (TQ x N, linear in N) and shared by two exact softmaxes, one with the V2H bias M[p, s] = R_i(j, l) + C_l(i, k)
// and one with the H2V bias M'[p, s] = M[s, p] = R_k(j, l) + C_j(i, k) (query p = (i, j), key s = (k, l)).
// Biases come from the prefix sums on the fly; no N x N tensor exists, in forward or backward.
//
// bf16 / fp16 q, k, v where use_lowp_gemm() (cpu/lowp_gemm.h: by default where torch packs for its CPU batch-reduce
// GEMM, i.e. AMX; the internal option cpu_lowp_products forces either way): every product of the forward and the
// backward multiplies bf16 (fp16) operands with float32 accumulation through torch's CPU BLAS (forward_kernel_lowp,
// forward_inference_kernel_lowp, backward_kernel_lowp). Otherwise bf16 q, k, v where cpu_bf16_dot() (the avx512 path
// on a CPU with AVX-512 BF16): the forward's q k^T and P v are bf16 products with float32 accumulation
// (forward_kernel_bf16); elsewhere bf16 / fp16 inputs are converted to float32.
//
// Backward (flash-style, from lse / out / out_v2h): each task owns a query block range of one (batch,
// head) and writes dq directly; dk, dv and the prefix-sum gradients go to the task's own partial buffer,
// reduced afterwards in a fixed order (deterministic, no atomics). The number of partial buffers depends
// on the shapes only, so results do not depend on the thread count. Key rows of W <= 16 on the 16-lane path are one
// masked vector each, forward and backward (add_biases_row, bias_grads_short); the backward's sums run as vectors up to
// W = 32 (two per key row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "common/math.h"
#include "cpu/lowp_gemm.h"
#include "cpu/simd.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

// Queries per task tile: the logits of a tile against all N keys live in per-thread scratch of
// TQ x N (linear in N); the products with q / k / v are small_gemm calls (cpu/simd.h) at the task's lane width.
constexpr int64_t TQ = 64;

template <typename T>
struct PAData {
  const T* q;  // [B, N, G, d] (the input layout, contiguous), not scaled
  const T* k;  // [B, N, G, d]
  const T* v;  // [B, N, G, dv]
  const T* cr;  // [BG, N] row prefix sums
  const T* cc;  // [BG, N] column prefix sums
  int64_t B, G, H, W, N, d, dv;
  T scale;
};

// The keys (or values) of one (batch, head) transposed into scratch [c][N] (the B operand of small_gemm for
// q k^T and dO v^T), redone only when the task's (batch, head) changes (*have: the one held, -1 for none).
template <int L, typename T>
inline void transposed_rows(Lanes<L> ln, const T* src, int64_t N, int64_t c, int64_t stride, int64_t bg, int64_t* have,
                            T* dst) {
  if (*have == bg) return;
  gather_rows_t(ln, N, c, src, stride, dst);
  *have = bg;
}

// Row p of the logits: y1 holds S = scale * q_p k^T against all N keys. Adds the biases: y1[s] = S + M,
// y2[s] = S + M' (docs/ops.md: M[p, s] = R_i(j, l) + C_l(i, k), M' = M^T), one key row k at a time; returns the
// maxima of the two rows in *m1, *m2 (NaN ignored, as max_of) unless m1 is null.
// float, 16 lanes, W <= 16: each key row one vector with masked moves (load_first / store_first, cpu/simd.h), the
// query row's terms formed once (docs/ops.md "polyline_attention"; the same values as below).
// float otherwise: each key row in vectors of L lanes (then L / 2 ... 4, then single lanes), the line bias's two
// branches (keys l < j and l >= j, common/math.h line_bias) chosen lane by lane, so that a key row is one run of
// vectors whatever the query's column j (two runs split at j left short loops at W = 14 and 32). The same values as
// the plain loops below (a - b = -(b - a) exactly), up to the contraction of the last product into an FMA.
template <int M>
PPMA_SIMD_INLINE void bias_lanes(int64_t l, int32_t j, float crIj, float crKj, float sk, float ct2, const float* crI,
                                 const float* ccI, const float* crK, const float* ccK, float* __restrict y1,
                                 float* __restrict y2, vec<M>& m1, vec<M>& m2) {
  const ivec<M> before = lane_indices<M>() + static_cast<int32_t>(l) < j;  // keys left of the query's column
  const vec<M> a = load<M>(crI + l), c = load<M>(crK + l);
  const vec<M> r1 = before ? crIj - a : a - crIj;
  const vec<M> r2 = before ? crKj - c : c - crKj;
  const vec<M> sv = load<M>(y1 + l);
  const vec<M> x1 = sv + r1 + sk * (load<M>(ccK + l) - load<M>(ccI + l));
  const vec<M> x2 = sv + r2 + ct2;
  store<M>(y1 + l, x1);
  store<M>(y2 + l, x2);
  m1 = x1 > m1 ? x1 : m1;
  m2 = x2 > m2 ? x2 : m2;
}

// The member of a chain of per-width accumulators (MaxPair, SumTriple: width M, then .tail of width M / 2 ... 4, 1)
// that has width K, the vector width for_lanes passes.
template <int K, typename A>
PPMA_SIMD_INLINE auto& width_at(A& acc) {
  static_assert(K <= A::width, "no such width");
  if constexpr (K == A::width) {
    return acc;
  } else {
    return width_at<K>(acc.tail);
  }
}

// Running maxima of add_biases_row, one pair per vector width of for_lanes (a key row runs L lanes at a time, then at
// most one vector of each of L / 2 ... 4 lanes, then single lanes), kept across the key rows and reduced across lanes
// once at the end (reducing the narrow widths per key row measured 10 % slower at W = 14).
template <int M>
struct MaxPair {
  static constexpr int width = M;
  vec<M> a = vec<M>{} - std::numeric_limits<float>::infinity(), b = a;
  MaxPair<(M > 4 ? M / 2 : 1)> tail;
  PPMA_SIMD_INLINE void reduce(float& m1, float& m2) const {
    tail.reduce(m1, m2);
    const float x = lane_max<M>(a), y = lane_max<M>(b);
    m1 = x > m1 ? x : m1;
    m2 = y > m2 ? y : m2;
  }
};
template <>
struct MaxPair<1> {
  static constexpr int width = 1;
  vec<1> a = -std::numeric_limits<float>::infinity(), b = a;
  PPMA_SIMD_INLINE void reduce(float& m1, float& m2) const {
    m1 = a > m1 ? a : m1;
    m2 = b > m2 ? b : m2;
  }
};

template <int L, typename T>
inline void add_biases_row(Lanes<L> ln, const PAData<T>& D, int64_t bg, int64_t p, T* __restrict y1r,
                           T* __restrict y2r, T* m1, T* m2) {
  const int64_t N = D.N, W = D.W, H = D.H;
  const T* cr = D.cr + bg * N;
  const T* cc = D.cc + bg * N;
  const int64_t i = p / W, j = p % W;
  const T* crI = cr + i * W;
  const T* ccI = cc + i * W;
  const T crIj = crI[j];
  if constexpr (std::is_same<T, float>::value && L == 16) {
    if (W <= L) {  // each key row one vector (masked moves): the query row's terms formed once
      const ivec<L> before = lane_indices<L>() < static_cast<int32_t>(j);
      const vec<L> a = load_first<L>(crI, W), ccIv = load_first<L>(ccI, W);
      const vec<L> r1 = before ? crIj - a : a - crIj;  // R_i(j, l): the same for every key row
      const vec<L> ninf = vec<L>{} - std::numeric_limits<float>::infinity();
      vec<L> mx1 = ninf, mx2 = ninf;
      // The logits of key row k + 1 are loaded before row k is stored: their 64-byte spans overlap, and a masked
      // store does not forward to a later load (the load would wait for the store to retire). Their lanes past W
      // are -inf, so that the biased lanes there are -inf (or NaN) and never the rows' maxima.
      vec<L> sv = load_first<L>(y1r, W, ninf);
      for (int64_t k = 0; k < H; ++k) {
        float* y1 = y1r + k * W;
        float* y2 = y2r + k * W;
        const float* crK = cr + k * W;
        const float* ccK = cc + k * W;
        const float sk = sgn_diff<float>(k, i);
        const float ct2 = sk * (ccK[j] - ccI[j]);
        const float crKj = crK[j];
        const vec<L> c = load_first<L>(crK, W);
        const vec<L> r2 = before ? crKj - c : c - crKj;
        const vec<L> x1 = sv + r1 + sk * (load_first<L>(ccK, W) - ccIv);
        const vec<L> x2 = sv + r2 + ct2;
        if (k + 1 < H) sv = load_first<L>(y1 + W, W, ninf);
        store_first<L>(y1, x1, W);
        store_first<L>(y2, x2, W);
        mx1 = x1 > mx1 ? x1 : mx1;
        mx2 = x2 > mx2 ? x2 : mx2;
      }
      if (m1) *m1 = lane_max<L>(mx1), *m2 = lane_max<L>(mx2);
      return;
    }
  }
  if constexpr (std::is_same<T, float>::value) {
    MaxPair<L> m;
    for (int64_t k = 0; k < H; ++k) {
      float* __restrict y1 = y1r + k * W;
      float* __restrict y2 = y2r + k * W;
      const float* crK = cr + k * W;
      const float* ccK = cc + k * W;
      const float sk = sgn_diff<float>(k, i);  // the column bias C(i, k) = sk * (cc[k] - cc[i]) (0 on the query's row)
      const float ct2 = sk * (ccK[j] - ccI[j]);  // C_j(i, k), constant over the key row
      const float crKj = crK[j];
      for_lanes(ln, W, [&](auto lm, int64_t l) {
        auto& acc = width_at<decltype(lm)::value>(m);
        bias_lanes<decltype(lm)::value>(l, int32_t(j), crIj, crKj, sk, ct2, crI, ccI, crK, ccK, y1, y2, acc.a, acc.b);
      });
    }
    if (m1) {
      *m1 = *m2 = -std::numeric_limits<float>::infinity();
      m.reduce(*m1, *m2);
    }
  } else {
    for (int64_t k = 0; k < H; ++k) {
      T* __restrict y1 = y1r + k * W;
      T* __restrict y2 = y2r + k * W;
      const T* crK = cr + k * W;
      const T* ccK = cc + k * W;
      const T sk = sgn_diff<T>(k, i);
      const T ct2 = sk * (ccK[j] - ccI[j]);
      const T crKj = crK[j];
      // line_bias (common/math.h) with its branch hoisted: keys l < j: R = crX[j] - crX[l]; l >= j: crX[l] - crX[j]
#pragma omp simd
      for (int64_t l = 0; l < j; ++l) {
        const T sv = y1[l];
        y1[l] = sv + (crIj - crI[l]) + sk * (ccK[l] - ccI[l]);
        y2[l] = sv + (crKj - crK[l]) + ct2;
      }
#pragma omp simd
      for (int64_t l = j; l < W; ++l) {
        const T sv = y1[l];
        y1[l] = sv + (crI[l] - crIj) + sk * (ccK[l] - ccI[l]);
        y2[l] = sv + (crK[l] - crKj) + ct2;
      }
    }
    if (m1) {
      *m1 = max_of(N, y1r);
      *m2 = max_of(N, y2r);
    }
  }
}

// X1 holds S = scale * q k^T of queries p0 .. p0 + tq against all N keys (row stride N). Adds the
// biases row by row (add_biases_row): X1 = S + M, X2 = S + M'; the rows' maxima go to mx1[a], mx2[a] (tq each)
// unless mx1 is null.
template <int L, typename T>
inline void add_biases(Lanes<L> ln, const PAData<T>& D, int64_t bg, int64_t p0, int64_t tq, T* __restrict X1,
                       T* __restrict X2, T* mx1, T* mx2) {
  for (int64_t a = 0; a < tq; ++a)
    add_biases_row(ln, D, bg, p0 + a, X1 + a * D.N, X2 + a * D.N, mx1 ? mx1 + a : nullptr, mx2 ? mx2 + a : nullptr);
}

// Logits of a query tile against all keys, both biases added: X1 = S + M, X2 = S + M'. Kt: the keys of the
// (batch, head) transposed, [d][N]. S = scale (q k^T) (the product formed even for scale = 0, so that NaN / Inf
// in q or k propagate like in the reference).
template <int L, typename T>
inline void logits_block(Lanes<L> ln, const PAData<T>& D, int64_t bg, int64_t p0, int64_t tq, const T* Kt, T* X1,
                         T* X2, T* mx1, T* mx2) {
  const int64_t N = D.N, G = D.G, d = D.d, b = bg / G, g = bg % G;
  small_gemm(ln, tq, N, d, D.q + token_index(N, G, b, p0, g) * d, G * d, int64_t(1), Kt, N, X1, N, false, D.scale);
  add_biases(ln, D, bg, p0, tq, X1, X2, mx1, mx2);
}

template <typename T>
void forward_kernel(const PAData<T>& D, T* out, T* out_v2h, T* lse) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv;
  const int64_t nqb = ceil_div(N, TQ);
  struct Scratch {
    std::vector<T> buf;
    int64_t kt_bg = -1;  // the (batch, head) whose keys Kt holds
  };
  parallel_tasks(
      D.B * G * nqb, [&] { return Scratch{std::vector<T>(2 * TQ * N + 2 * TQ * dv + d * N)}; },
      [&](int64_t task, Scratch& S) {
    with_lanes([&](auto ln) {
      T* X1 = S.buf.data();
      T* X2 = X1 + TQ * N;
      T* O1 = X2 + TQ * N;
      T* O2 = O1 + TQ * dv;
      T* Kt = O2 + TQ * dv;
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const int64_t b = bg / G, g = bg % G;
      transposed_rows(ln, D.k + token_index(N, G, b, 0, g) * d, N, d, G * d, bg, &S.kt_bg, Kt);
      T mx1[TQ], mx2[TQ], inv1[TQ], inv2[TQ];
      logits_block(ln, D, bg, p0, tq, Kt, X1, X2, mx1, mx2);
      for (int64_t a = 0; a < tq; ++a)
        softmax_pair_row(ln, N, X1 + a * N, X2 + a * N, mx1[a], mx2[a], inv1 + a, inv2 + a,
                         lse + token_index(N, G, b, p0 + a, g) * 2);
      const T* vb = D.v + token_index(N, G, b, 0, g) * dv;
      small_gemm(ln, tq, dv, N, X1, N, int64_t(1), vb, G * dv, O1, dv, false);  // P1 v (unnormalised)
      small_gemm(ln, tq, dv, N, X2, N, int64_t(1), vb, G * dv, O2, dv, false);  // P2 v
      for (int64_t a = 0; a < tq; ++a) {
        const int64_t o = token_index(N, G, b, p0 + a, g);
        average_pair_row(dv, O1 + a * dv, O2 + a * dv, inv1[a], inv2[a], out_v2h + o * dv, out + o * dv);
      }
    });
  });
}

// The inference forward (polyline_attention_inference: no gradient will be asked for, so no statistics).
// Per query row p, both softmaxes are normalised and averaged into one map row,
//   P[p, :] = 0.5 softmax(S + M)[p, :] + 0.5 softmax(S + M')[p, :],
// whose product with v is the output: one P v product instead of two, and neither out_v2h nor lse is formed.
// The row is finished while it is in L1 (biases, maxima, exponentials, the average), so the H2V logits need one
// row of scratch (x2). Rounding differs from forward_kernel's 0.5 (P1 v / l1 + P2 v / l2) in the last bits.
// lse (unless null): the row's two log-sum-exps, as forward_kernel writes them (polyline_attention_lse).
template <int L, typename T>
inline void average_softmaxes_row(Lanes<L> ln, const PAData<T>& D, int64_t bg, int64_t p, T* __restrict x1,
                                  T* __restrict x2, T* lse) {
  const int64_t N = D.N;
  T m1, m2;
  add_biases_row(ln, D, bg, p, x1, x2, &m1, &m2);
  const T l1 = exp_shift_sum(ln, N, x1, m1), l2 = exp_shift_sum(ln, N, x2, m2);
  if (lse) {
    lse[0] = m1 + std::log(l1);
    lse[1] = m2 + std::log(l2);
  }
  const T c1 = T(0.5) / l1, c2 = T(0.5) / l2;
#pragma omp simd
  for (int64_t s = 0; s < N; ++s) x1[s] = c1 * x1[s] + c2 * x2[s];
}

// With lse (not null): also the rows' log-sum-exps [B, N, G, 2], the statistics of backward_kernel without out_v2h
// (polyline_attention_lse: the training forward of float32 / float64 on the CPU).
template <typename T>
void forward_inference_kernel(const PAData<T>& D, T* out, T* lse = nullptr) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv;
  const int64_t nqb = ceil_div(N, TQ);
  struct Scratch {
    std::vector<T> buf;
    int64_t kt_bg = -1;  // the (batch, head) whose keys Kt holds
  };
  parallel_tasks(
      D.B * G * nqb, [&] { return Scratch{std::vector<T>(TQ * N + N + d * N)}; },
      [&](int64_t task, Scratch& S) {
    with_lanes([&](auto ln) {
      T* X = S.buf.data();  // [tq][N]: the V2H logits, then the averaged map
      T* x2 = X + TQ * N;   // [N]: one row of H2V logits
      T* Kt = x2 + N;
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const int64_t b = bg / G, g = bg % G, row0 = token_index(N, G, b, p0, g);
      transposed_rows(ln, D.k + token_index(N, G, b, 0, g) * d, N, d, G * d, bg, &S.kt_bg, Kt);
      small_gemm(ln, tq, N, d, D.q + row0 * d, G * d, int64_t(1), Kt, N, X, N, false, D.scale);
      for (int64_t a = 0; a < tq; ++a)
        average_softmaxes_row(ln, D, bg, p0 + a, X + a * N, x2, lse ? lse + (row0 + a * G) * 2 : nullptr);
      const T* vb = D.v + token_index(N, G, b, 0, g) * dv;
      small_gemm(ln, tq, dv, N, X, N, int64_t(1), vb, G * dv, out + row0 * dv, G * dv, false);  // out = P v
    });
  });
}

#ifdef PPMA_SIMD_X86
// bf16 inputs where cpu_bf16_dot() (cpu/simd.h): q k^T and P v are bf16 products with float32 accumulation
// (small_gemm_bf16, vdpbf16ps); biases, softmax and statistics are float32 as on every path. P, the unnormalised
// softmax in [0, 1], is rounded to bf16 (the precision of the inputs) for the P v product.
struct PABf16 {
  const uint16_t* q;   // [B, N, G, d] the inputs' bf16 bits
  const uint16_t* kp;  // [BG][d2][Np][2] keys in pairs of features; d2 = ceil(d / 2), Np = N rounded up to 16
  const uint16_t* vp;  // [BG][N2][dvp][2] values in pairs of keys; N2 = ceil(N / 2), dvp = dv rounded up to 16
  int64_t d2, Np, N2, dvp;
};

// Per-thread scratch of the bf16 kernels: float logits and products, bf16 operands.
struct Bf16Scratch {
  std::vector<float> f;
  std::vector<uint16_t> h;
};

void forward_kernel_bf16(const PAData<float>& D, const PABf16& P, float* out, float* out_v2h, float* lse) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, d2 = P.d2, N2 = P.N2;
  const int64_t nqb = ceil_div(N, TQ);
  parallel_tasks(
      D.B * G * nqb,
      [&] {
        return Bf16Scratch{std::vector<float>(2 * TQ * N + 2 * TQ * dv),
                           std::vector<uint16_t>(TQ * 2 * (d2 + 2 * N2))};
      },
      [&](int64_t task, Bf16Scratch& S) {
    with_lanes_bf16([&](auto ln) {
      float* X1 = S.f.data();
      float* X2 = X1 + TQ * N;
      float* O1 = X2 + TQ * N;
      float* O2 = O1 + TQ * dv;
      uint16_t* Qp = S.h.data();          // [tq][d2][2] the tile's queries, zero padded
      uint16_t* Pb1 = Qp + TQ * 2 * d2;   // [tq][N2][2] P1 in bf16, zero padded
      uint16_t* Pb2 = Pb1 + TQ * 2 * N2;  // [tq][N2][2] P2
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const int64_t b = bg / G, g = bg % G;
      gather_pair_rows(tq, d, P.q + token_index(N, G, b, p0, g) * d, G * d, Qp);
      small_gemm_bf16(ln, tq, N, d2, Qp, d2, P.kp + bg * d2 * P.Np * 2, P.Np, X1, N, false, D.scale);
      float mx1[TQ], mx2[TQ], inv1[TQ], inv2[TQ];
      add_biases(ln, D, bg, p0, tq, X1, X2, mx1, mx2);
      for (int64_t a = 0; a < tq; ++a) {
        float* x1 = X1 + a * N;
        float* x2 = X2 + a * N;
        softmax_pair_row(ln, N, x1, x2, mx1[a], mx2[a], inv1 + a, inv2 + a, lse + token_index(N, G, b, p0 + a, g) * 2);
        floats_to_bf16(ln, N, x1, Pb1 + a * 2 * N2);
        floats_to_bf16(ln, N, x2, Pb2 + a * 2 * N2);
        if (N % 2) Pb1[a * 2 * N2 + N] = Pb2[a * 2 * N2 + N] = 0;
      }
      const uint16_t* vb = P.vp + bg * N2 * P.dvp * 2;
      small_gemm_bf16(ln, tq, dv, N2, Pb1, N2, vb, P.dvp, O1, dv, false);  // P1 v (unnormalised)
      small_gemm_bf16(ln, tq, dv, N2, Pb2, N2, vb, P.dvp, O2, dv, false);  // P2 v
      for (int64_t a = 0; a < tq; ++a) {
        const int64_t o = token_index(N, G, b, p0 + a, g);
        average_pair_row(dv, O1 + a * dv, O2 + a * dv, inv1[a], inv2[a], out_v2h + o * dv, out + o * dv);
      }
    });
  });
}

// average_softmaxes_row with the averaged map rounded to bf16 into pb, in the pass that forms it (x1 and x2
// then hold the two rows' exponentials).
template <int L>
inline void average_softmaxes_row_bf16(Lanes<L> ln, const PAData<float>& D, int64_t bg, int64_t p,
                                       float* __restrict x1, float* __restrict x2, uint16_t* __restrict pb,
                                       float* lse) {
  const int64_t N = D.N;
  float m1, m2;
  add_biases_row(ln, D, bg, p, x1, x2, &m1, &m2);
  const float l1 = exp_shift_sum(ln, N, x1, m1), l2 = exp_shift_sum(ln, N, x2, m2);
  if (lse) {
    lse[0] = m1 + std::log(l1);
    lse[1] = m2 + std::log(l2);
  }
  const float c1 = 0.5f / l1, c2 = 0.5f / l2;
  int64_t s = 0;
  for (; s + 16 <= N; s += 16) store_bf16<16>(pb + s, c1 * load<16>(x1 + s) + c2 * load<16>(x2 + s));
  if (s < N) store_bf16_first(pb + s, c1 * load_first<16>(x1 + s, N - s) + c2 * load_first<16>(x2 + s, N - s), N - s);
}

// The inference forward of bf16 q, k, v on the bf16 products (forward_inference_kernel's map P, rounded to bf16
// once for the single P v product); out: bf16 [B, N, G, dv], each row's float32 product rounded once. With lse (not
// null): also the rows' log-sum-exps [B, N, G, 2] (polyline_attention_lse's training forward).
void forward_inference_kernel_bf16(const PAData<float>& D, const PABf16& P, uint16_t* out, float* lse) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, d2 = P.d2, N2 = P.N2;
  const int64_t nqb = ceil_div(N, TQ);
  parallel_tasks(
      D.B * G * nqb,
      [&] {
        return Bf16Scratch{std::vector<float>(TQ * N + N + TQ * dv), std::vector<uint16_t>(TQ * 2 * (d2 + N2))};
      },
      [&](int64_t task, Bf16Scratch& S) {
    with_lanes_bf16([&](auto ln) {
      float* X = S.f.data();  // [tq][N]: the V2H logits, then the averaged map
      float* x2 = X + TQ * N;
      float* O = x2 + N;      // [tq][dv]: P v before its rounding
      uint16_t* Qp = S.h.data();        // [tq][d2][2] the tile's queries, zero padded
      uint16_t* Pb = Qp + TQ * 2 * d2;  // [tq][N2][2] the map in bf16, zero padded
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const int64_t b = bg / G, g = bg % G, row0 = token_index(N, G, b, p0, g);
      gather_pair_rows(tq, d, P.q + row0 * d, G * d, Qp);
      small_gemm_bf16(ln, tq, N, d2, Qp, d2, P.kp + bg * d2 * P.Np * 2, P.Np, X, N, false, D.scale);
      for (int64_t a = 0; a < tq; ++a) {
        average_softmaxes_row_bf16(ln, D, bg, p0 + a, X + a * N, x2, Pb + a * 2 * N2,
                                   lse ? lse + (row0 + a * G) * 2 : nullptr);
        if (N % 2) Pb[a * 2 * N2 + N] = 0;
      }
      small_gemm_bf16(ln, tq, dv, N2, Pb, N2, P.vp + bg * N2 * P.dvp * 2, P.dvp, O, dv, false);
      for (int64_t a = 0; a < tq; ++a) floats_to_bf16(ln, dv, O + a * dv, out + (row0 + a * G) * dv);
    });
  });
}

// n rows of c bf16 features (row stride ss) as the B operand of a product over the features (the keys of q k^T,
// the values of dO v^T): [ceil(c / 2)][ldb][2] pairs of features (gather_pairs_t: 8 x 8 blocks of pairs by
// shuffles), zero past n (ldb >= n, a multiple of 16).
PPMA_SIMD_INLINE void pack_feature_pairs(int64_t n, int64_t c, const uint16_t* src, int64_t ss, uint16_t* dst,
                                         int64_t ldb) {
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
  gather_pairs_t(n, c, src, ss, o, ldb);
  for (int64_t p = 0; p < ceil_div(c, 2); ++p) std::fill(o + p * ldb + n, o + (p + 1) * ldb, uint32_t(0));
}

// n rows of c bf16 features (row stride ss) as the B operand of a product over the rows (the values of P v, the keys
// of dS k): [ceil(n / 2)][ldb][2] pairs of rows (gather_pairs_positions; the second of an odd n's last pair 0), zero
// past c (ldb >= c, a multiple of 16).
PPMA_SIMD_INLINE void pack_position_pairs(int64_t n, int64_t c, const uint16_t* src, int64_t ss, uint16_t* dst,
                                          int64_t ldb) {
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
  gather_pairs_positions(n, c, src, ss, o, ldb);
  for (int64_t m = 0; m < ceil_div(n, 2); ++m) std::fill(o + m * ldb + c, o + (m + 1) * ldb, uint32_t(0));
}

// bf16 q, k, v packed for the bf16 products (the tensors that PABf16 points into, kept alive here).
struct PackedBf16 {
  at::Tensor qc, kp, vp;
  PABf16 P;

  PackedBf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
    const int64_t N = H * W, d2 = ceil_div(d, 2), N2 = ceil_div(N, 2), Np = ceil_div(N, 16) * 16,
                  dvp = ceil_div(dv, 16) * 16;
    qc = q.contiguous();
    const at::Tensor kc = k.contiguous(), vc = v.contiguous();
    // keys [B, N, G, d] -> [B, G, d2, Np, 2]; values [B, N, G, dv] -> [B, G, N2, dvp, 2] (zeros in the padding),
    // one pass per (batch, head)
    kp = at::empty({B, G, d2, Np, 2}, q.options());
    vp = at::empty({B, G, N2, dvp, 2}, q.options());
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    const uint16_t *ks = bits(kc), *vs = bits(vc);
    uint16_t *kd = bits(kp), *vd = bits(vp);
    at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
      // inside the AVX-512 code of the bf16 kernels, so that the shuffles of gather_pairs_t are 256-bit ones
      with_lanes_bf16([&](auto) {
        for (int64_t bg = begin; bg < end; ++bg) {
          const int64_t b = bg / G, g = bg % G;
          pack_feature_pairs(N, d, ks + (b * N * G + g) * d, G * d, kd + bg * d2 * Np * 2, Np);
          pack_position_pairs(N, dv, vs + (b * N * G + g) * dv, G * dv, vd + bg * N2 * dvp * 2, dvp);
        }
      });
    });
    P = PABf16{bits(qc), kd, vd, d2, Np, N2, dvp};
  }
};

PAData<float> bf16_data(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cr, const at::Tensor& cc,
                        double scale) {
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  return PAData<float>{nullptr, nullptr, nullptr, cr.data_ptr<float>(), cc.data_ptr<float>(), B, G, H, W, H * W, d,
                       dv, static_cast<float>(scale)};
}

// Forward of bf16 q, k, v on the bf16 products: packs k and v in pairs (host side), runs forward_kernel_bf16 (out
// float32), or forward_inference_kernel_bf16 when out_v2h is null (the inference op without lse, the lse op with it;
// out bf16).
void polyline_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cr,
                             const at::Tensor& cc, double scale, at::Tensor& out, at::Tensor* out_v2h,
                             at::Tensor* lse) {
  const PackedBf16 packed(q, k, v);
  const PAData<float> D = bf16_data(q, v, cr, cc, scale);
  if (out_v2h == nullptr) {
    forward_inference_kernel_bf16(D, packed.P, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                                  lse ? lse->data_ptr<float>() : nullptr);
  } else {
    forward_kernel_bf16(D, packed.P, out.data_ptr<float>(), out_v2h->data_ptr<float>(), lse->data_ptr<float>());
  }
}
#endif

// bf16 / fp16 q, k, v on torch's CPU batch-reduce GEMM (cpu/lowp_gemm.h; where use_lowp_gemm()): the forward's
// q k^T and P v are products of bf16 (fp16) operands with float32 accumulation; biases, softmax and statistics are
// float32 as on every path. P, the unnormalised softmax in [0, 1], is rounded to the inputs' dtype for P v. The keys
// of a (batch, head) are transposed once per task and held while the task's (batch, head) does not change; the
// second operands shared by a (batch, head)'s query tiles are LowpOperands (packed once on the VNNI routes).
template <typename Lp>
struct LowpScratch {
  std::vector<float> f;
  std::vector<Lp> h;
  int64_t kt_bg = -1;  // the (batch, head) whose keys Kt holds
  LowpOperand<Lp> kt, vals, keys;  // the keys transposed [d][N]; the values [N][dv] (backward: transposed,
                                   // [dv][N]); backward: the keys [N][d]
  VnniHold hold;  // the micro-kernel's context kept over the worker's products (cpu/lowp_gemm.h)
};

// The logits of a query tile: X1 = scale q k^T (then the biases, as logits_block); Kt: the keys [d][N].
template <int L, typename Lp>
inline void logits_block_lowp(Lanes<L> ln, const PAData<float>& D, const Lp* q, int64_t bg, int64_t p0, int64_t tq,
                              const LowpOperand<Lp>& Kt, float* X1, float* X2, float* mx1, float* mx2) {
  const int64_t N = D.N, G = D.G, d = D.d, b = bg / G, g = bg % G;
  lowp_gemm(tq, q + token_index(N, G, b, p0, g) * d, G * d, Kt, X1, N, false);
  const float scale = D.scale;
#pragma omp simd
  for (int64_t e = 0; e < tq * N; ++e) X1[e] *= scale;
  add_biases(ln, D, bg, p0, tq, X1, X2, mx1, mx2);
}

// forward_kernel on the lowp products: out, out_v2h float32 [B, N, G, dv], lse [B, N, G, 2].
template <typename Lp>
void forward_kernel_lowp(const PAData<float>& D, const Lp* q, const Lp* k, const Lp* v, float* out, float* out_v2h,
                         float* lse) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv;
  const int64_t nqb = ceil_div(N, TQ);
  parallel_tasks(
      D.B * G * nqb,
      [&] {
        return LowpScratch<Lp>{std::vector<float>(2 * TQ * N + 2 * TQ * dv), std::vector<Lp>(2 * TQ * N)};
      },
      [&](int64_t task, LowpScratch<Lp>& S) {
    with_lanes([&](auto ln) {
      float* X1 = S.f.data();
      float* X2 = X1 + TQ * N;
      float* O1 = X2 + TQ * N;
      float* O2 = O1 + TQ * dv;
      Lp* Pb1 = S.h.data();    // [tq][N] P1 rounded
      Lp* Pb2 = Pb1 + TQ * N;  // [tq][N] P2 rounded
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const int64_t b = bg / G, g = bg % G;
      if (S.kt_bg != bg) {
        S.kt.set_transposed(d, N, k + token_index(N, G, b, 0, g) * d, G * d);
        S.vals.set(N, dv, v + token_index(N, G, b, 0, g) * dv, G * dv);
        S.kt_bg = bg;
      }
      float mx1[TQ], mx2[TQ], inv1[TQ], inv2[TQ];
      logits_block_lowp(ln, D, q, bg, p0, tq, S.kt, X1, X2, mx1, mx2);
      for (int64_t a = 0; a < tq; ++a) {
        softmax_pair_row(ln, N, X1 + a * N, X2 + a * N, mx1[a], mx2[a], inv1 + a, inv2 + a,
                         lse + token_index(N, G, b, p0 + a, g) * 2);
        to_lowp(N, X1 + a * N, Pb1 + a * N);
        to_lowp(N, X2 + a * N, Pb2 + a * N);
      }
      lowp_gemm(tq, Pb1, N, S.vals, O1, dv, false);  // P1 v (unnormalised)
      lowp_gemm(tq, Pb2, N, S.vals, O2, dv, false);  // P2 v
      for (int64_t a = 0; a < tq; ++a) {
        const int64_t o = token_index(N, G, b, p0 + a, g);
        average_pair_row(dv, O1 + a * dv, O2 + a * dv, inv1[a], inv2[a], out_v2h + o * dv, out + o * dv);
      }
    });
  });
}

// forward_inference_kernel on the lowp products (the averaged map rounded once for its single P v product):
// out in Lp [B, N, G, dv], each row's float32 product rounded once.
template <typename Lp>
void forward_inference_kernel_lowp(const PAData<float>& D, const Lp* q, const Lp* k, const Lp* v, Lp* out,
                                   float* lse) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv;
  const int64_t nqb = ceil_div(N, TQ);
  parallel_tasks(
      D.B * G * nqb,
      [&] { return LowpScratch<Lp>{std::vector<float>(TQ * N + N + TQ * dv), std::vector<Lp>(TQ * N)}; },
      [&](int64_t task, LowpScratch<Lp>& S) {
    with_lanes([&](auto ln) {
      float* X = S.f.data();  // [tq][N]: the V2H logits, then the averaged map
      float* x2 = X + TQ * N;  // [N]: one row of H2V logits
      float* O = x2 + N;       // [tq][dv]: P v before its rounding
      Lp* Pb = S.h.data();     // [tq][N] the map rounded
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const int64_t b = bg / G, g = bg % G, row0 = token_index(N, G, b, p0, g);
      if (S.kt_bg != bg) {
        S.kt.set_transposed(d, N, k + token_index(N, G, b, 0, g) * d, G * d);
        S.vals.set(N, dv, v + token_index(N, G, b, 0, g) * dv, G * dv);
        S.kt_bg = bg;
      }
      lowp_gemm(tq, q + row0 * d, G * d, S.kt, X, N, false);
      const float scale = D.scale;
#pragma omp simd
      for (int64_t e = 0; e < tq * N; ++e) X[e] *= scale;
      for (int64_t a = 0; a < tq; ++a) {
        average_softmaxes_row(ln, D, bg, p0 + a, X + a * N, x2, lse ? lse + (row0 + a * G) * 2 : nullptr);
        to_lowp(N, X + a * N, Pb + a * N);
      }
      lowp_gemm(tq, Pb, N, S.vals, O, dv, false);  // P v
      for (int64_t a = 0; a < tq; ++a) to_lowp(dv, O + a * dv, out + (row0 + a * G) * dv);
    });
  });
}

PAData<float> lowp_data(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cr, const at::Tensor& cc,
                        double scale) {
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  return PAData<float>{nullptr, nullptr, nullptr, cr.data_ptr<float>(), cc.data_ptr<float>(), B, G, H, W, H * W, d,
                       dv, static_cast<float>(scale)};
}

// Forward of bf16 / fp16 q, k, v (one dtype) on the lowp products: forward_kernel_lowp (out, out_v2h, lse float32),
// or forward_inference_kernel_lowp when out_v2h and lse are null (the inference op; out in the inputs' dtype).
void polyline_attention_lowp(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cr,
                             const at::Tensor& cc, double scale, at::Tensor& out, at::Tensor* out_v2h,
                             at::Tensor* lse) {
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const PAData<float> D = lowp_data(q, v, cr, cc, scale);
  dispatch_lowp(q.scalar_type(), [&](auto tag) {
    using Lp = decltype(tag);
    const Lp* qp = static_cast<const Lp*>(qc.data_ptr());
    const Lp* kp = static_cast<const Lp*>(kc.data_ptr());
    const Lp* vp = static_cast<const Lp*>(vc.data_ptr());
    if (out_v2h == nullptr) {
      forward_inference_kernel_lowp<Lp>(D, qp, kp, vp, static_cast<Lp*>(out.data_ptr()),
                                        lse ? lse->data_ptr<float>() : nullptr);
    } else {
      forward_kernel_lowp<Lp>(D, qp, kp, vp, out.data_ptr<float>(), out_v2h->data_ptr<float>(), lse->data_ptr<float>());
    }
  });
}

// Prefix-sum gradients of one query row a against one key-row segment, k != i (rows differ, so the
// four target lines never alias). g1 = dS1 (flows to M), g2 = dS2 (flows to M').
template <typename T>
inline void bias_grad_segment(int64_t l0, int64_t ub, int64_t len, int64_t j, T sk, const T* __restrict g1,
                              const T* __restrict g2, T* __restrict gcrI, T* __restrict gccI,
                              T* __restrict gcrK, T* __restrict gccK) {
  T s1 = 0, s2 = 0, t2 = 0;
#pragma omp simd reduction(+ : s1, s2, t2)
  for (int64_t l = l0; l < l0 + ub; ++l) {  // sign(l - j) = -1
    const T a = g1[l], b = g2[l];
    gcrI[l] -= a;
    gcrK[l] -= b;
    gccK[l] += sk * a;
    gccI[l] -= sk * a;
    s1 -= a;
    s2 -= b;
    t2 += b;
  }
#pragma omp simd reduction(+ : s1, s2, t2)
  for (int64_t l = l0 + ub; l < l0 + len; ++l) {  // sign(l - j) = +1
    const T a = g1[l], b = g2[l];
    gcrI[l] += a;
    gcrK[l] += b;
    gccK[l] += sk * a;
    gccI[l] -= sk * a;
    s1 += a;
    s2 += b;
    t2 += b;
  }
  gcrI[j] -= s1;
  gcrK[j] -= s2;
  gccK[j] += sk * t2;
  gccI[j] -= sk * t2;
}

// Same row (k == i): the column terms vanish; both row terms land on row i.
template <typename T>
inline void bias_grad_segment_same_row(int64_t l0, int64_t ub, int64_t len, int64_t j, const T* __restrict g1,
                                       const T* __restrict g2, T* __restrict gcrI) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t l = l0; l < l0 + ub; ++l) {
    const T a = g1[l] + g2[l];
    gcrI[l] -= a;
    s -= a;
  }
#pragma omp simd reduction(+ : s)
  for (int64_t l = l0 + ub; l < l0 + len; ++l) {
    const T a = g1[l] + g2[l];
    gcrI[l] += a;
    s += a;
  }
  gcrI[j] -= s;
}

// float: bias_grad_segment and bias_grad_segment_same_row over a whole key row (l0 = 0, ub = j, len = W) in vectors
// (for_lanes), the sign of l - j chosen lane by lane (as add_biases_row), each width's sums kept in vectors and
// summed by hsum (cpu/simd.h) at the end of the row.
template <int M>
struct SumTriple {
  static constexpr int width = M;
  vec<M> s1{}, s2{}, t2{};
  SumTriple<(M > 4 ? M / 2 : 1)> tail;
  PPMA_SIMD_INLINE void add_to(float& a, float& b, float& c) const {
    a += hsum<M>(s1), b += hsum<M>(s2), c += hsum<M>(t2);
    tail.add_to(a, b, c);
  }
};
template <>
struct SumTriple<1> {
  static constexpr int width = 1;
  float s1 = 0, s2 = 0, t2 = 0;
  PPMA_SIMD_INLINE void add_to(float& a, float& b, float& c) const { a += s1, b += s2, c += t2; }
};

// same_row: the key row is the query's (k = i): only gcrI, from g1 + g2 (gccI, gcrK, gccK unused).
template <int M, bool same_row>
PPMA_SIMD_INLINE void bias_grad_lanes(int64_t l, int32_t j, float sk, const float* g1, const float* g2, float* gcrI,
                                      float* gccI, float* gcrK, float* gccK, SumTriple<M>& acc) {
  const ivec<M> before = lane_indices<M>() + static_cast<int32_t>(l) < j;
  const vec<M> one = vec<M>{} + 1.0f;
  const vec<M> sg = before ? -one : one;  // sign(l - j), +1 at l = j
  const vec<M> a = load<M>(g1 + l), b = load<M>(g2 + l);
  if constexpr (same_row) {
    const vec<M> ab = sg * (a + b);
    store<M>(gcrI + l, load<M>(gcrI + l) + ab);
    acc.s1 += ab;
  } else {
    const vec<M> sa = sg * a, sb = sg * b, ka = sk * a;
    store<M>(gcrI + l, load<M>(gcrI + l) + sa);
    store<M>(gcrK + l, load<M>(gcrK + l) + sb);
    store<M>(gccK + l, load<M>(gccK + l) + ka);
    store<M>(gccI + l, load<M>(gccI + l) - ka);
    acc.s1 += sa;
    acc.s2 += sb;
    acc.t2 += b;
  }
}

// The prefix-sum gradients of query (i, j) against key row k (g1, g2: the row's dS1, dS2): bias_grad_segment
// (k != i) or bias_grad_segment_same_row (k == i) over the whole row.
template <int L, typename T>
PPMA_SIMD_INLINE void bias_grad_row(Lanes<L> ln, int64_t W, int64_t j, int64_t k, int64_t i, const T* g1, const T* g2,
                                    T* gcrI, T* gccI, T* gcrK, T* gccK) {
  if constexpr (std::is_same<T, float>::value) {
    SumTriple<L> acc;
    float s1 = 0, s2 = 0, t2 = 0;
    const int32_t j32 = static_cast<int32_t>(j);
    if (k == i) {
      for_lanes(ln, W, [&](auto lm, int64_t l) {
        constexpr int M = decltype(lm)::value;
        bias_grad_lanes<M, true>(l, j32, 0.0f, g1, g2, gcrI, gccI, gcrK, gccK, width_at<M>(acc));
      });
      acc.add_to(s1, s2, t2);
      gcrI[j] -= s1;
    } else {
      const float sk = sgn_diff<float>(k, i);
      for_lanes(ln, W, [&](auto lm, int64_t l) {
        constexpr int M = decltype(lm)::value;
        bias_grad_lanes<M, false>(l, j32, sk, g1, g2, gcrI, gccI, gcrK, gccK, width_at<M>(acc));
      });
      acc.add_to(s1, s2, t2);
      gcrI[j] -= s1;
      gcrK[j] -= s2;
      gccK[j] += sk * t2;
      gccI[j] -= sk * t2;
    }
  } else if (k == i) {
    bias_grad_segment_same_row(int64_t(0), j, W, j, g1, g2, gcrI);
  } else {
    bias_grad_segment(int64_t(0), j, W, j, sgn_diff<T>(k, i), g1, g2, gcrI, gccI, gcrK, gccK);
  }
}

// The prefix-sum gradients of query (i, j) against all key rows where each key row is NV 16-lane vectors (float,
// the 16-lane path, W <= 16 NV, NV = 1 or 2; the last vector masked), bias_grad_row's sums regrouped so that no key
// row ends in a lane sum and no row of the gradients is read back right after a masked store (a masked store does
// not forward to a later load: a stall): the task accumulates them in whole aligned vectors of scratch, ShortSums,
// added to gcr and gcc once at its end (bias_grads_flush):
//   - R[k], C[k]: the terms on gcr and gcc row k: from key row k (sk g1 on gcc) and, summed over the key rows in
//     registers, from the query's own row i (sign(l - j) g1 on gcr, -sk g1 on gcc; row k = i's terms, whose column
//     terms vanish, are the same formulas with sk = 0);
//   - E[j][k], F[j][k]: sign(l - j) g2 and sk g2 of key row k summed over the task's queries of column j: gcr row k
//     gets E and gcr[k, j] minus its lane sum; gcc[k, j] gets F's lane sum;
//   - gcr[i, j] and gcc[i, j] get the query's two lane sums directly.
// The same gradients as bias_grad_row up to the order of the float32 sums (tests/test_polyline_attention.py).
// Compiled at every width; run on the 16-lane path only (L == 16 exists on x86-64 alone). At W = 32 (PPMA-T's
// stage 3 at 512^2) a task's sums take 270 KB; wider rows run bias_grad_row.
struct ShortSums {
  static constexpr int64_t L = 16;   // floats per vector: one 16-lane vector
  static constexpr int64_t MaxNV = 2;  // vectors per key row at most: W <= 32
  int64_t V;                          // floats per slot: NV vectors, NV = ceil(W / 16)
  float *R, *C, *E, *F;               // [H][V], [H][V], [W][H][V], [W][H][V]
  static int64_t slot(int64_t W) { return ceil_div(W, L) * L; }
  static bool fits(int64_t W) { return W <= MaxNV * L; }
  static int64_t floats(int64_t H, int64_t W) { return 2 * H * slot(W) * (1 + W); }
  ShortSums(float* p, int64_t H, int64_t W)
      : V(slot(W)), R(p), C(p + H * V), E(C + H * V), F(E + W * H * V) {}
};

// f(NV) with the key rows' vector count NV (1 or 2, std::integral_constant) of ShortSums' W: the templates below.
template <typename F>
PPMA_SIMD_INLINE void with_row_vectors(int64_t W, F&& f) {
  if (W <= ShortSums::L) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

// Vector v of a key row of W floats at p (the last one masked: 0 past W).
template <int NV>
PPMA_SIMD_INLINE vec<16> key_row_vec(const float* p, int v, int64_t W) {
  return v + 1 < NV ? load<16>(p + 16 * v) : load_first<16>(p + 16 * v, W - 16 * v);
}

template <int NV>
PPMA_SIMD_INLINE void bias_grads_short(int64_t H, int64_t W, int64_t i, int64_t j, const float* g1r, const float* g2r,
                                       float* gcr, float* gcc, const ShortSums& S) {
  constexpr int L = 16;
  const vec<L> one = vec<L>{} + 1.0f;
  vec<L> sg[NV], accI[NV], accC[NV], accT[NV];
  for (int v = 0; v < NV; ++v) {
    sg[v] = lane_indices<L>() + static_cast<int32_t>(L * v) < static_cast<int32_t>(j) ? -one : one;  // sign(l - j)
    accI[v] = accC[v] = accT[v] = vec<L>{};
  }
  float* Ej = S.E + j * H * S.V;
  float* Fj = S.F + j * H * S.V;
  for (int64_t k = 0; k < H; ++k) {
    const float sk = sgn_diff<float>(k, i);
    for (int v = 0; v < NV; ++v) {
      const vec<L> a = key_row_vec<NV>(g1r + k * W, v, W), b = key_row_vec<NV>(g2r + k * W, v, W);
      const vec<L> ka = sk * a, kb = sk * b;
      const int64_t o = k * S.V + L * v;
      accI[v] += sg[v] * a;
      accC[v] += ka;
      accT[v] += kb;
      store<L>(Ej + o, load<L>(Ej + o) + sg[v] * b);
      store<L>(Fj + o, load<L>(Fj + o) + kb);
      store<L>(S.C + o, load<L>(S.C + o) + ka);
    }
  }
  vec<L> sI{}, sT{};
  for (int v = 0; v < NV; ++v) {
    const int64_t o = i * S.V + L * v;
    store<L>(S.R + o, load<L>(S.R + o) + accI[v]);
    store<L>(S.C + o, load<L>(S.C + o) - accC[v]);
    sI += accI[v];
    sT += accT[v];
  }
  gcr[i * W + j] -= hsum<L>(sI);
  gcc[i * W + j] -= hsum<L>(sT);
}

// Adds a task's ShortSums to its prefix-sum gradients in a fixed order (row k, then column j) and clears them.
template <int NV>
PPMA_SIMD_INLINE void bias_grads_flush(int64_t H, int64_t W, float* gcr, float* gcc, const ShortSums& S) {
  constexpr int L = 16;
  for (int64_t k = 0; k < H; ++k) {
    vec<L> r[NV];
    float lr[NV * L] = {}, lc[NV * L] = {};  // the lane sums, lane j for gcr[k, j] and gcc[k, j]
    for (int v = 0; v < NV; ++v) r[v] = load<L>(S.R + k * S.V + L * v);
    for (int64_t j = 0; j < W; ++j) {
      float* e = S.E + (j * H + k) * S.V;
      float* f = S.F + (j * H + k) * S.V;
      vec<L> es{}, fs{};
      for (int v = 0; v < NV; ++v) {
        const vec<L> ev = load<L>(e + L * v);
        r[v] += ev;
        es += ev;
        fs += load<L>(f + L * v);
        store<L>(e + L * v, vec<L>{});
        store<L>(f + L * v, vec<L>{});
      }
      lr[j] = hsum<L>(es);
      lc[j] = hsum<L>(fs);
    }
    for (int v = 0; v < NV; ++v) {
      const int64_t o = k * S.V + L * v, n = std::min<int64_t>(L, W - L * v);
      float* gr = gcr + k * W + L * v;
      float* gc = gcc + k * W + L * v;
      store_first<L>(gr, load_first<L>(gr, n) + r[v] - load<L>(lr + L * v), n);
      store_first<L>(gc, load_first<L>(gc, n) + load<L>(S.C + o) + load<L>(lc + L * v), n);
      store<L>(S.R + o, vec<L>{});
      store<L>(S.C + o, vec<L>{});
    }
  }
}

// The prefix-sum gradients of query p (dS1 in g1, dS2 in g2, over the N keys) into gcr, gcc: bias_grads_short's
// regrouped sums where short_rows (float32 on the 16-lane path, ShortSums::fits(W)), else bias_grad_row key row by
// key row. query_bias_grads_flush adds the regrouped sums at a task's end.
template <int L, typename T>
PPMA_SIMD_INLINE void query_bias_grads(Lanes<L> ln, const PAData<T>& D, int64_t p, const T* g1, const T* g2, T* gcr,
                                       T* gcc, const ShortSums& sums, bool short_rows) {
  const int64_t W = D.W, i = p / W, j = p % W;
  if constexpr (std::is_same<T, float>::value && L == ShortSums::L) {
    if (short_rows) {
      with_row_vectors(W, [&](auto nv) {
        bias_grads_short<decltype(nv)::value>(D.H, W, i, j, g1, g2, gcr, gcc, sums);
      });
      return;
    }
  }
  for (int64_t k = 0; k < D.H; ++k)
    bias_grad_row(ln, W, j, k, i, g1 + k * W, g2 + k * W, gcr + i * W, gcc + i * W, gcr + k * W, gcc + k * W);
}

template <int L, typename T>
PPMA_SIMD_INLINE void query_bias_grads_flush(Lanes<L>, const PAData<T>& D, T* gcr, T* gcc, const ShortSums& sums,
                                             bool short_rows) {
  if constexpr (std::is_same<T, float>::value && L == ShortSums::L) {
    if (short_rows) {
      with_row_vectors(D.W, [&](auto nv) { bias_grads_flush<decltype(nv)::value>(D.H, D.W, gcr, gcc, sums); });
    }
  }
}

// The softmax gradients of one query row from its logits x1 (V2H), x2 (H2V), its lse pair (ls1, ls2) and
// dp = 0.5 dO v^T, all over the N keys, in place: P1 = exp(x1 - ls1), P2 = exp(x2 - ls2); D1 = sum P1 dp and
// D2 = sum P2 dp unless given (Dg: the pair from out and out_v2h); then g1 = dS1 = P1 (dp - D1), x2 = dS2 =
// P2 (dp - D2), dp = dS1 + dS2 (the gradient of the shared logits) and x1 = pw (P1 + P2) (dv's map; pw 1 or 0.5).
template <int L, typename T>
PPMA_SIMD_INLINE void softmax_grads_row(Lanes<L> ln, int64_t N, T ls1, T ls2, const T* Dg, T pw, T* __restrict x1,
                                        T* __restrict x2, T* __restrict dp, T* __restrict g1) {
  exp_shift(ln, N, x1, ls1);  // P1
  exp_shift(ln, N, x2, ls2);  // P2
  const T D1 = Dg ? Dg[0] : dot_lanes(ln, N, x1, dp), D2 = Dg ? Dg[1] : dot_lanes(ln, N, x2, dp);
#pragma omp simd
  for (int64_t c = 0; c < N; ++c) {
    const T p1 = x1[c], p2 = x2[c];
    const T dpc = dp[c];
    const T d1 = p1 * (dpc - D1), d2 = p2 * (dpc - D2);
    g1[c] = d1;
    x2[c] = d2;
    dp[c] = d1 + d2;
    x1[c] = pw * (p1 + p2);
  }
}

// The rows' D1 = 0.5 <dO, out_v2h> and D2 = 0.5 <dO, 2 out - out_v2h> of a query tile (tq rows from row0, G rows
// apart in the [B, N, G, dv] layouts of go, out, out_v2h) into Dr1, Dr2, in one tight loop (three rows of the large
// tensors per query: their loads overlap here). Nothing where out_v2h is null (polyline_attention_lse_backward: the
// D terms come from the maps).
template <typename T>
inline void rows_d_terms(int64_t tq, int64_t row0, int64_t G, int64_t dv, const T* go, const T* out, const T* out_v2h,
                         T* Dr1, T* Dr2) {
  for (int64_t a = 0; out_v2h && a < tq; ++a) {
    const int64_t o = row0 + a * G;
    const T* ga = go + o * dv;
    const T* oa = out + o * dv;
    const T* va = out_v2h + o * dv;
    T D1 = 0, D2 = 0;
#pragma omp simd reduction(+ : D1, D2)
    for (int64_t e = 0; e < dv; ++e) {
      D1 += ga[e] * va[e];
      D2 += ga[e] * (T(2) * oa[e] - va[e]);
    }
    Dr1[a] = T(0.5) * D1;
    Dr2[a] = T(0.5) * D2;
  }
}

// grad_out, out, out_v2h: [B, N, G, dv] (contiguous, accumulation dtype); lse: [B, N, G, 2]. out and out_v2h null
// (polyline_attention_lse_backward): the rows' D1, D2 come from the maps, sum_s P1[s] DP[s] and sum_s P2[s] DP[s].
// part: [BG, nchunk, N * (d + dv + 2)] partial sums (dk, dv, grad cr, grad cc), each task's zeroed by the task.
// Each task owns a fixed range of query tiles of one (batch, head): the split depends on the shapes only.
template <typename T>
void backward_kernel(const PAData<T>& D, const T* go, const T* out, const T* out_v2h, const T* lse,
                     int64_t nchunk, T* dq, T* part) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, W = D.W;
  const int64_t nqb = ceil_div(N, TQ), qb_per_chunk = ceil_div(nqb, nchunk);
  const int64_t part_size = N * (d + dv + 2);
  const T scale = D.scale;
  // bias_grads_short's sums (float, W <= 32 on the 16-lane path), zero between tasks
  const int64_t short_sums = std::is_same<T, float>::value && ShortSums::fits(W) ? ShortSums::floats(D.H, W) : 0;
  parallel_tasks(
      D.B * G * nchunk, [&] { return std::vector<T>(4 * TQ * N + (d + dv) * N + short_sums); },
      [&](int64_t task, std::vector<T>& buf) {
    with_lanes([&](auto ln) {
    constexpr int L = decltype(ln)::value;
    T* X1 = buf.data();
    T* X2 = X1 + TQ * N;
    T* DP = X2 + TQ * N;
    T* G1 = DP + TQ * N;
    T* Kt = G1 + TQ * N;  // the keys of the task's (batch, head) transposed, [d][N]
    T* Vt = Kt + d * N;   // its values transposed, [dv][N]
    constexpr bool masked_path = std::is_same<T, float>::value && L == ShortSums::L;
    const bool short_rows = masked_path && ShortSums::fits(W);
    const ShortSums sums(reinterpret_cast<float*>(Vt + dv * N), D.H, W);
    {
      const int64_t bg = task / nchunk, chunk = task % nchunk;
      const int64_t b = bg / G, g = bg % G;
      T* pdk = part + (bg * nchunk + chunk) * part_size;
      std::fill(pdk, pdk + part_size, T(0));  // zeroed by its task: in parallel, and in cache for the sums below
      T* pdv = pdk + N * d;
      T* gcr = pdv + N * dv;
      T* gcc = gcr + N;
      const T* kb = D.k + token_index(N, G, b, 0, g) * d;
      const T* vb = D.v + token_index(N, G, b, 0, g) * dv;
      gather_rows_t(ln, N, d, kb, G * d, Kt);
      gather_rows_t(ln, N, dv, vb, G * dv, Vt);
      const int64_t qb_end = std::min(nqb, (chunk + 1) * qb_per_chunk);
      for (int64_t qb = chunk * qb_per_chunk; qb < qb_end; ++qb) {
        const int64_t p0 = qb * TQ, tq = std::min(TQ, N - p0);
        const int64_t row0 = token_index(N, G, b, p0, g);  // first query row in the [B, N, G, .] layouts
        logits_block(ln, D, bg, p0, tq, Kt, X1, X2, static_cast<T*>(nullptr), static_cast<T*>(nullptr));  // from lse
        // DP = 0.5 dO v^T
        const T* gob = go + row0 * dv;
        small_gemm(ln, tq, N, dv, gob, G * dv, int64_t(1), Vt, N, DP, N, false, T(0.5));
        T Dr1[TQ], Dr2[TQ];
        rows_d_terms(tq, row0, G, dv, go, out, out_v2h, Dr1, Dr2);
        for (int64_t a = 0; a < tq; ++a) {
          const int64_t o = row0 + a * G;
          T* __restrict x2 = X2 + a * N;
          T* __restrict g1 = G1 + a * N;
          // Without out_v2h (polyline_attention_lse): D1 = sum_s P1[s] DP[s] = 0.5 <dO, P1 v>, and D2 likewise.
          const T Dg[2] = {out_v2h ? Dr1[a] : T(0), out_v2h ? Dr2[a] : T(0)};
          softmax_grads_row(ln, N, lse[o * 2 + 0], lse[o * 2 + 1], out_v2h ? Dg : nullptr, T(1), X1 + a * N, x2,
                            DP + a * N, g1);
          query_bias_grads(ln, D, p0 + a, g1, x2, gcr, gcc, sums, short_rows);  // prefix-sum gradients
        }
        // dq = scale * dS k; dk += scale * dS^T q; dv += (P1 + P2)^T (0.5 dO)
        small_gemm(ln, tq, d, N, DP, N, int64_t(1), kb, G * d, dq + row0 * d, G * d, false, scale);
        small_gemm(ln, N, d, tq, DP, int64_t(1), N, D.q + row0 * d, G * d, pdk, d, true, scale);
        small_gemm(ln, N, dv, tq, X1, int64_t(1), N, gob, G * dv, pdv, dv, true, T(0.5));
      }
      query_bias_grads_flush(ln, D, gcr, gcc, sums, short_rows);
    }
    });
  });
}

// backward_kernel on the lowp products (cpu/lowp_gemm.h) for bf16 / fp16 q, k, v, grad_out (go_lp): the logits
// (q k^T), DP = 0.5 dO v^T, dq = scale dS k, dk += scale dS^T q and dv += (P1 + P2)^T (0.5 dO) multiply operands of
// the inputs' dtype with float32 accumulation; dS is rounded as scale * dS and the dv operand as 0.5 (P1 + P2) (the
// factor 0.5 exact). The softmax gradients, the rows' D terms (from go, out, out_v2h in float32) and the prefix-sum
// gradients are float32, as backward_kernel<float> forms them; the same tasks and partial buffers (deterministic).
template <typename Lp>
void backward_kernel_lowp(const PAData<float>& D, const Lp* q, const Lp* k, const Lp* v, const Lp* go_lp,
                          const float* go, const float* out, const float* out_v2h, const float* lse, int64_t nchunk,
                          float* dq, float* part) {
  using T = float;
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, W = D.W;
  const int64_t nqb = ceil_div(N, TQ), qb_per_chunk = ceil_div(nqb, nchunk);
  const int64_t part_size = N * (d + dv + 2);
  const T scale = D.scale;
  const int64_t short_sums = ShortSums::fits(W) ? ShortSums::floats(D.H, W) : 0;
  parallel_tasks(
      D.B * G * nchunk,
      [&] {
        return LowpScratch<Lp>{std::vector<T>(4 * TQ * N + short_sums),
                               std::vector<Lp>(3 * TQ * N)};
      },
      [&](int64_t task, LowpScratch<Lp>& S) {
    with_lanes([&](auto ln) {
    constexpr int L = decltype(ln)::value;
    T* X1 = S.f.data();
    T* X2 = X1 + TQ * N;
    T* DP = X2 + TQ * N;
    T* G1 = DP + TQ * N;
    Lp* DS = S.h.data();      // [tq][N] scale * dS rounded
    Lp* DSt = DS + TQ * N;    // [N][TQ] the same, transposed
    Lp* PSt = DSt + TQ * N;   // [N][TQ] 0.5 (P1 + P2) rounded, transposed
    constexpr bool masked_path = L == ShortSums::L;
    const bool short_rows = masked_path && ShortSums::fits(W);
    const ShortSums sums(G1 + TQ * N, D.H, W);
    const int64_t bg = task / nchunk, chunk = task % nchunk;
    const int64_t b = bg / G, g = bg % G;
    T* pdk = part + (bg * nchunk + chunk) * part_size;
    std::fill(pdk, pdk + part_size, T(0));
    T* pdv = pdk + N * d;
    T* gcr = pdv + N * dv;
    T* gcc = gcr + N;
    const Lp* kb = k + token_index(N, G, b, 0, g) * d;
    const Lp* vb = v + token_index(N, G, b, 0, g) * dv;
    S.kt.set_transposed(d, N, kb, G * d);  // the keys of the task's (batch, head) transposed, [d][N]
    S.vals.set_transposed(dv, N, vb, G * dv);  // its values transposed, [dv][N]
    S.keys.set(N, d, kb, G * d);
    const int64_t qb_end = std::min(nqb, (chunk + 1) * qb_per_chunk);
    for (int64_t qb = chunk * qb_per_chunk; qb < qb_end; ++qb) {
      const int64_t p0 = qb * TQ, tq = std::min(TQ, N - p0);
      const int64_t row0 = token_index(N, G, b, p0, g);
      logits_block_lowp(ln, D, q, bg, p0, tq, S.kt, X1, X2, static_cast<T*>(nullptr), static_cast<T*>(nullptr));
      // DP = 0.5 dO v^T
      const Lp* gob = go_lp + row0 * dv;
      lowp_gemm(tq, gob, G * dv, S.vals, DP, N, false);
#pragma omp simd
      for (int64_t e = 0; e < tq * N; ++e) DP[e] *= T(0.5);
      T Dr1[TQ], Dr2[TQ];
      rows_d_terms(tq, row0, G, dv, go, out, out_v2h, Dr1, Dr2);
      for (int64_t a = 0; a < tq; ++a) {
        const int64_t o = row0 + a * G;
        T* __restrict x1 = X1 + a * N;
        T* __restrict x2 = X2 + a * N;
        T* __restrict dp = DP + a * N;
        T* __restrict g1 = G1 + a * N;
        Lp* __restrict ds = DS + a * N;
        const T Dg[2] = {out_v2h ? Dr1[a] : T(0), out_v2h ? Dr2[a] : T(0)};
        softmax_grads_row(ln, N, lse[o * 2 + 0], lse[o * 2 + 1], out_v2h ? Dg : nullptr, T(0.5), x1, x2, dp, g1);
        to_lowp(N, dp, ds, scale);  // scale dS
        query_bias_grads(ln, D, p0 + a, g1, x2, gcr, gcc, sums, short_rows);
      }
      transpose_rows(tq, N, DS, N, DSt, TQ);
      to_lowp_transposed(tq, N, X1, N, PSt, TQ);  // 0.5 (P1 + P2), rounded
      // dq = (scale dS) k; dk += (scale dS)^T q; dv += (0.5 (P1 + P2))^T dO
      lowp_gemm(tq, DS, N, S.keys, dq + row0 * d, G * d, false);
      lowp_gemm(N, d, tq, DSt, TQ, q + row0 * d, G * d, pdk, d, true);
      lowp_gemm(N, dv, tq, PSt, TQ, gob, G * dv, pdv, dv, true);
    }
    query_bias_grads_flush(ln, D, gcr, gcc, sums, short_rows);
    });
  });
}

#ifdef PPMA_SIMD_X86
// n rows of c bf16 values (row stride ss) transposed in pairs of rows, the A operand of a product over the rows
// (q^T dS, dO^T P): dst[(e * ld + p) * 2 + h] = src[(2 p + h) * ss + e] for e < c, p < ceil(n / 2), 0 past n.
inline void transposed_row_pairs(int64_t n, int64_t c, const uint16_t* src, int64_t ss, uint16_t* __restrict dst,
                                 int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* s = src + r * ss;
    uint16_t* o = dst + (r / 2) * 2 + (r % 2);
    for (int64_t e = 0; e < c; ++e) o[e * ld * 2] = s[e];
  }
  if (n % 2)
    for (int64_t e = 0; e < c; ++e) dst[(e * ld + n / 2) * 2 + 1] = 0;
}

// backward_kernel on the bf16 products (vdpbf16ps, small_gemm_bf16; where cpu_bf16_dot()) for bf16 q, k, v and
// grad_out (go): the logits q k^T (as forward_kernel_bf16 forms them), DP = 0.5 dO v^T, dq = (scale dS) k,
// dk^T += q^T (scale dS) and dv^T += dO^T (0.5 (P1 + P2)) multiply bf16 operands with float32 accumulation; scale dS
// and 0.5 (P1 + P2) are rounded to bf16 for their products (as backward_kernel_lowp rounds them). The softmax
// gradients, the rows' D terms (from the maps: D1 = sum_s P1[s] DP[s], as polyline_attention_lse_backward forms
// them, so neither out nor out_v2h is read) and the prefix-sum gradients are float32, as backward_kernel<float>
// forms them. dk and dv are accumulated transposed ([d][N], [dv][N] in the task's partial buffer: the large operands,
// dS and P, then only need their rows interleaved in pairs), which reduce_partials(..., transposed = true) reads.
// The same tasks as backward_kernel (deterministic). kf: the keys in pairs of features [BG][d2][Np][2] (q k^T), kr:
// in pairs of positions [BG][N2][dp][2] (dS k, dp = d rounded up to 16), vf: the values in pairs of features
// [BG][dv2][Np][2] (dO v^T).
struct PABf16Grad {
  const uint16_t *q, *go, *kf, *kr, *vf;  // q, go: [B, N, G, d] / [B, N, G, dv] the bf16 bits
  int64_t d2, dv2, Np, N2, dp;
};

void backward_kernel_bf16(const PAData<float>& D, const PABf16Grad& P, const float* lse, int64_t nchunk, float* dq,
                          float* part) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, W = D.W, d2 = P.d2, dv2 = P.dv2, Np = P.Np, N2 = P.N2;
  const int64_t nqb = ceil_div(N, TQ), qb_per_chunk = ceil_div(nqb, nchunk);
  const int64_t part_size = N * (d + dv + 2);
  constexpr int64_t TQ2 = TQ / 2;
  const float scale = D.scale;
  const int64_t short_sums = ShortSums::fits(W) ? ShortSums::floats(D.H, W) : 0;
  parallel_tasks(
      D.B * G * nchunk,
      [&] {
        return Bf16Scratch{std::vector<float>(4 * TQ * N + short_sums),
                           std::vector<uint16_t>(TQ * 2 * (d2 + dv2) + 4 * TQ * Np + 2 * TQ2 * (d + dv))};
      },
      [&](int64_t task, Bf16Scratch& S) {
    with_lanes_bf16([&](auto ln) {
    using T = float;
    T* X1 = S.f.data();
    T* X2 = X1 + TQ * N;
    T* DP = X2 + TQ * N;
    T* G1 = DP + TQ * N;
    uint16_t* Qp = S.h.data();        // [tq][d2][2] the tile's queries, zero padded
    uint16_t* Gp = Qp + TQ * 2 * d2;  // [tq][dv2][2] its output gradients
    uint16_t* DSb = Gp + TQ * 2 * dv2;  // [tq][Np] scale dS in bf16, zero past N
    uint16_t* PSb = DSb + TQ * Np;      // [tq][Np] 0.5 (P1 + P2) in bf16, zero past N
    uint16_t* DSv = PSb + TQ * Np;      // [tq2][Np][2] DSb's rows in pairs
    uint16_t* PSv = DSv + TQ * Np;      // [tq2][Np][2] PSb's
    uint16_t* Qt = PSv + TQ * Np;       // [d][TQ2][2] the tile's queries transposed, in pairs of rows
    uint16_t* Gt = Qt + 2 * TQ2 * d;    // [dv][TQ2][2] its output gradients likewise
    const bool short_rows = ShortSums::fits(W);
    const ShortSums sums(G1 + TQ * N, D.H, W);
    const int64_t bg = task / nchunk, chunk = task % nchunk;
    const int64_t b = bg / G, g = bg % G;
    T* pdk = part + (bg * nchunk + chunk) * part_size;  // [d][N] transposed
    std::fill(pdk, pdk + part_size, T(0));
    T* pdv = pdk + N * d;  // [dv][N] transposed
    T* gcr = pdv + N * dv;
    T* gcc = gcr + N;
    const uint16_t* kf = P.kf + bg * d2 * Np * 2;
    const uint16_t* kr = P.kr + bg * N2 * P.dp * 2;
    const uint16_t* vf = P.vf + bg * dv2 * Np * 2;
    const int64_t qb_end = std::min(nqb, (chunk + 1) * qb_per_chunk);
    for (int64_t qb = chunk * qb_per_chunk; qb < qb_end; ++qb) {
      const int64_t p0 = qb * TQ, tq = std::min(TQ, N - p0), tq2 = ceil_div(tq, 2);
      const int64_t row0 = token_index(N, G, b, p0, g);
      const uint16_t* qrows = P.q + row0 * d;
      const uint16_t* grows = P.go + row0 * dv;
      gather_pair_rows(tq, d, qrows, G * d, Qp);
      small_gemm_bf16(ln, tq, N, d2, Qp, d2, kf, Np, X1, N, false, scale);
      add_biases(ln, D, bg, p0, tq, X1, X2, static_cast<T*>(nullptr), static_cast<T*>(nullptr));
      // DP = 0.5 dO v^T
      gather_pair_rows(tq, dv, grows, G * dv, Gp);
      small_gemm_bf16(ln, tq, N, dv2, Gp, dv2, vf, Np, DP, N, false, 0.5f);
      for (int64_t a = 0; a < tq; ++a) {
        const int64_t o = row0 + a * G;
        T* __restrict x1 = X1 + a * N;
        T* __restrict x2 = X2 + a * N;
        T* __restrict dp = DP + a * N;
        T* __restrict g1 = G1 + a * N;
        softmax_grads_row(ln, N, lse[o * 2 + 0], lse[o * 2 + 1], static_cast<const T*>(nullptr), T(0.5), x1, x2, dp,
                          g1);
        scaled_to_bf16(ln, N, dp, scale, DSb + a * Np);
        floats_to_bf16(ln, N, x1, PSb + a * Np);
        std::fill(DSb + a * Np + N, DSb + (a + 1) * Np, uint16_t(0));
        std::fill(PSb + a * Np + N, PSb + (a + 1) * Np, uint16_t(0));
        query_bias_grads(ln, D, p0 + a, g1, x2, gcr, gcc, sums, short_rows);
      }
      // dq = (scale dS) k
      small_gemm_bf16(ln, tq, d, N2, DSb, Np / 2, kr, P.dp, dq + row0 * d, G * d, false);
      // dk^T += q^T (scale dS); dv^T += dO^T (0.5 (P1 + P2)): A the tile's rows transposed in pairs, B dS and P in
      // pairs of rows (an odd tile's last pair has a zero second row in both operands)
      gather_pairs_positions(tq, Np, DSb, Np, reinterpret_cast<uint32_t*>(DSv), Np);
      gather_pairs_positions(tq, Np, PSb, Np, reinterpret_cast<uint32_t*>(PSv), Np);
      transposed_row_pairs(tq, d, qrows, G * d, Qt, TQ2);
      transposed_row_pairs(tq, dv, grows, G * dv, Gt, TQ2);
      small_gemm_bf16(ln, d, N, tq2, Qt, TQ2, DSv, Np, pdk, N, true);
      small_gemm_bf16(ln, dv, N, tq2, Gt, TQ2, PSv, Np, pdv, N, true);
    }
    query_bias_grads_flush(ln, D, gcr, gcc, sums, short_rows);
    });
  });
}

// bf16 q, grad_out and the packed keys and values of backward_kernel_bf16 (the tensors PABf16Grad points into).
struct PackedBf16Grad {
  at::Tensor qc, goc, kf, kr, vf;
  PABf16Grad P;

  PackedBf16Grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& grad_out) {
    const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
    const int64_t N = H * W, d2 = ceil_div(d, 2), dv2 = ceil_div(dv, 2), N2 = ceil_div(N, 2),
                  Np = ceil_div(N, 16) * 16, dp = ceil_div(d, 16) * 16;
    qc = q.contiguous();
    goc = grad_out.to(at::kBFloat16).contiguous();
    const at::Tensor kc = k.contiguous(), vc = v.contiguous();
    kf = at::empty({B, G, d2, Np, 2}, q.options());
    kr = at::empty({B, G, N2, dp, 2}, q.options());
    vf = at::empty({B, G, dv2, Np, 2}, q.options());
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    const uint16_t *ks = bits(kc), *vs = bits(vc);
    uint16_t *kfd = bits(kf), *krd = bits(kr), *vfd = bits(vf);
    at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
      with_lanes_bf16([&](auto) {  // as PackedBf16
        for (int64_t bg = begin; bg < end; ++bg) {
          const int64_t b = bg / G, g = bg % G;
          const uint16_t* kb = ks + (b * N * G + g) * d;
          pack_feature_pairs(N, d, kb, G * d, kfd + bg * d2 * Np * 2, Np);
          pack_position_pairs(N, d, kb, G * d, krd + bg * N2 * dp * 2, dp);
          pack_feature_pairs(N, dv, vs + (b * N * G + g) * dv, G * dv, vfd + bg * dv2 * Np * 2, Np);
        }
      });
    });
    P = PABf16Grad{bits(qc), bits(goc), kfd, krd, vfd, d2, dv2, Np, N2, dp};
  }
};
#endif

// Sums the partial buffers in chunk order and turns prefix-sum gradients into log-decay gradients.
// transposed: the partial dk and dv are [d][N] and [dv][N] (backward_kernel_bf16), else [N][d] and [N][dv].
template <typename T>
void reduce_partials(const PAData<T>& D, int64_t nchunk, const T* part, T* dk, T* dv_out, T* gla, T* glb,
                     bool transposed = false) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, H = D.H, W = D.W;
  const int64_t part_size = N * (d + dv + 2);
  // Rows: dk, dv and grad log_alpha (reverse cumsum along the row).
  at::parallel_for(0, D.B * G * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> row(W);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / H, i = task % H, b = bg / G, g = bg % G;
      std::fill(row.begin(), row.end(), T(0));
      for (int64_t j = 0; j < W; ++j) {
        const int64_t p = i * W + j;
        T* ok = dk + token_index(N, G, b, p, g) * d;
        T* ov = dv_out + token_index(N, G, b, p, g) * dv;
        std::fill(ok, ok + d, T(0));
        std::fill(ov, ov + dv, T(0));
        for (int64_t ch = 0; ch < nchunk; ++ch) {
          const T* pp = part + (bg * nchunk + ch) * part_size;
          if (transposed) {
            for (int64_t e = 0; e < d; ++e) ok[e] += pp[e * N + p];
            for (int64_t e = 0; e < dv; ++e) ov[e] += pp[N * d + e * N + p];
          } else {
            axpy(d, T(1), pp + p * d, ok);
            axpy(dv, T(1), pp + N * d + p * dv, ov);
          }
          row[j] += pp[N * (d + dv) + p];
        }
      }
      decay_grads_from_prefix(W, row.data(), 1, gla + token_index(N, G, b, i * W, g), G);
    }
  });
  // Columns: grad log_beta (reverse cumsum along the column).
  at::parallel_for(0, D.B * G * W, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> col(H);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / W, j = task % W, b = bg / G, g = bg % G;
      std::fill(col.begin(), col.end(), T(0));
      for (int64_t ch = 0; ch < nchunk; ++ch) {
        const T* pc = part + (bg * nchunk + ch) * part_size + N * (d + dv + 1);
        for (int64_t i = 0; i < H; ++i) col[i] += pc[i * W + j];
      }
      decay_grads_from_prefix(H, col.data(), 1, glb + token_index(N, G, b, j, g), W * G);
    }
  });
}

constexpr const char* kOp = "polyline_attention";
constexpr const char* kOpBwd = "polyline_attention_backward";
constexpr const char* kOpInf = "polyline_attention_inference";
constexpr const char* kOpLse = "polyline_attention_lse";
constexpr const char* kOpLseBwd = "polyline_attention_lse_backward";

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                       const at::Tensor& v,
                                                                       const at::Tensor& log_alpha,
                                                                       const at::Tensor& log_beta, double scale) {
  check_inputs(kOp, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const auto acc = acc_type(q);
  at::Tensor out = at::empty({B, H, W, G, dv}, q.options().dtype(acc));
  at::Tensor out_v2h = at::empty_like(out);
  at::Tensor lse = at::empty({B, H, W, G, 2}, q.options().dtype(acc));
  if (out.numel() > 0 && lowp_inputs(q, k, v)) {
    auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
    polyline_attention_lowp(q, k, v, cr, cc, scale, out, &out_v2h, &lse);
    return {out.to(v.scalar_type()), out_v2h.to(v.scalar_type()), lse};
  }
#ifdef PPMA_SIMD_X86
  if (out.numel() > 0 && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
      v.scalar_type() == at::kBFloat16 && cpu_bf16_dot()) {
    auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
    polyline_attention_bf16(q, k, v, cr, cc, scale, out, &out_v2h, &lse);
    return {out.to(v.scalar_type()), out_v2h.to(v.scalar_type()), lse};
  }
#endif
  if (out.numel() > 0) {
    // The kernels read q, k, v in their own layout (no packing; a no-op for contiguous fp32 inputs).
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_cpu", [&] {
      PAData<scalar_t> D{qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                         cr.data_ptr<scalar_t>(), cc.data_ptr<scalar_t>(), B, G, H, W, H * W, d, dv,
                         static_cast<scalar_t>(scale)};
      forward_kernel<scalar_t>(D, out.data_ptr<scalar_t>(), out_v2h.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
    });
  }
  return {out.to(v.scalar_type()), out_v2h.to(v.scalar_type()), lse};
}

// forward_inference_kernel on q, k, v in the accumulation dtype (float / double): out [B, H, W, G, dv] in that dtype,
// and the rows' log-sum-exps into *lse (allocated [B, H, W, G, 2] in it) unless lse is null. Non-empty inputs.
at::Tensor averaged_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cr,
                            const at::Tensor& cc, double scale, at::Tensor* lse) {
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const auto acc = acc_type(q);
  at::Tensor out = at::empty({B, H, W, G, dv}, q.options().dtype(acc));
  at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
  AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_averaged_cpu", [&] {
    PAData<scalar_t> D{qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                       cr.data_ptr<scalar_t>(), cc.data_ptr<scalar_t>(), B, G, H, W, H * W, d, dv,
                       static_cast<scalar_t>(scale)};
    forward_inference_kernel<scalar_t>(D, out.data_ptr<scalar_t>(), lse ? lse->data_ptr<scalar_t>() : nullptr);
  });
  return out;
}

// polyline_attention without the statistics of the backward pass (docs/ops.md "polyline_attention"): what
// ppma.ops.polyline_attention runs on the CPU when no gradient is needed (no_grad / inference_mode).
at::Tensor polyline_attention_inference_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& log_alpha, const at::Tensor& log_beta, double scale) {
  check_inputs(kOpInf, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), dv = v.size(4);
  const auto acc = acc_type(q);
  if (B * H * W * G * dv == 0) return at::empty({B, H, W, G, dv}, v.options());
  auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
  if (lowp_inputs(q, k, v)) {
    at::Tensor outl = at::empty({B, H, W, G, dv}, v.options());  // written in the inputs' dtype by the kernel
    polyline_attention_lowp(q, k, v, cr, cc, scale, outl, nullptr, nullptr);
    return outl;
  }
#ifdef PPMA_SIMD_X86
  if (q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
      cpu_bf16_dot()) {
    at::Tensor outb = at::empty({B, H, W, G, dv}, v.options());  // written in bf16 by the kernel
    polyline_attention_bf16(q, k, v, cr, cc, scale, outb, nullptr, nullptr);
    return outb;
  }
#endif
  return averaged_forward(q, k, v, cr, cc, scale, nullptr).to(v.scalar_type());
}

// The backward of polyline_attention (out and out_v2h given) or of polyline_attention_lse (both null: the rows' D
// terms from the maps).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor* out, const at::Tensor* out_v2h,
    const at::Tensor& lse, double scale) {
  check_inputs(op, q, k, v, log_alpha, log_beta);
  check_shape(op, "grad_out", grad_out, v.sizes(), q);
  if (out) check_shape(op, "out", *out, v.sizes(), q);
  if (out_v2h) check_shape(op, "out_v2h", *out_v2h, v.sizes(), q);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  check_shape(op, "lse", lse, {B, H, W, G, 2}, q);
  const int64_t N = H * W;
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor dq = at::empty({B, H, W, G, d}, opts), dk = at::empty_like(dq);
  at::Tensor dv_ = at::empty({B, H, W, G, dv}, opts);
  at::Tensor gla = at::empty({B, H, W, G}, opts), glb = at::empty_like(gla);
  if (dq.numel() > 0) {
    const bool lowp = lowp_inputs(q, k, v);
    const at::Tensor lsec = lse.to(acc).contiguous();
    auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
    // Partial buffers: enough independent tasks for a multi-core machine, independent of the thread count.
    const int64_t nqb = ceil_div(N, TQ);
    const int64_t nchunk = std::max<int64_t>(1, std::min<int64_t>(nqb, ceil_div(32, B * G)));
    at::Tensor part = at::empty({B * G, nchunk, N * (d + dv + 2)}, opts);  // zeroed by the tasks
#ifdef PPMA_SIMD_X86
    if (!lowp && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
        v.scalar_type() == at::kBFloat16 && cpu_bf16_dot()) {
      // bf16 products: q, k, v and grad_out (rounded to bf16 should it come in float32) read as they are, the
      // rows' D terms from the maps (out and out_v2h not read)
      const PackedBf16Grad packed(q, k, v, grad_out);
      const PAData<float> D = bf16_data(q, v, cr, cc, scale);
      backward_kernel_bf16(D, packed.P, lsec.data_ptr<float>(), nchunk, dq.data_ptr<float>(), part.data_ptr<float>());
      reduce_partials<float>(D, nchunk, part.data_ptr<float>(), dk.data_ptr<float>(), dv_.data_ptr<float>(),
                             gla.data_ptr<float>(), glb.data_ptr<float>(), /*transposed=*/true);
      return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv_.to(v.scalar_type()),
              gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
    }
#endif
    // lowp: q, k, v and grad_out stay in their dtype for the products (grad_out also in float32 for the D terms)
    at::Tensor qc = lowp ? q.contiguous() : q.to(acc).contiguous(), kc = lowp ? k.contiguous() : k.to(acc).contiguous(),
               vc = lowp ? v.contiguous() : v.to(acc).contiguous();
    at::Tensor goc = grad_out.to(acc).contiguous();
    at::Tensor oc = out ? out->to(acc).contiguous() : at::Tensor();
    at::Tensor ovc = out_v2h ? out_v2h->to(acc).contiguous() : at::Tensor();
    if (lowp) {
      const at::Tensor gol = grad_out.to(q.scalar_type()).contiguous();
      const PAData<float> D = lowp_data(q, v, cr, cc, scale);
      dispatch_lowp(q.scalar_type(), [&](auto tag) {
        using Lp = decltype(tag);
        backward_kernel_lowp<Lp>(D, static_cast<const Lp*>(qc.data_ptr()), static_cast<const Lp*>(kc.data_ptr()),
                                 static_cast<const Lp*>(vc.data_ptr()), static_cast<const Lp*>(gol.data_ptr()),
                                 goc.data_ptr<float>(), out ? oc.data_ptr<float>() : nullptr,
                                 out_v2h ? ovc.data_ptr<float>() : nullptr, lsec.data_ptr<float>(), nchunk,
                                 dq.data_ptr<float>(), part.data_ptr<float>());
      });
      reduce_partials<float>(D, nchunk, part.data_ptr<float>(), dk.data_ptr<float>(), dv_.data_ptr<float>(),
                             gla.data_ptr<float>(), glb.data_ptr<float>());
    } else {
      AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_backward_cpu", [&] {
        PAData<scalar_t> D{qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                           cr.data_ptr<scalar_t>(), cc.data_ptr<scalar_t>(), B, G, H, W, N, d, dv,
                           static_cast<scalar_t>(scale)};
        backward_kernel<scalar_t>(D, goc.data_ptr<scalar_t>(), out ? oc.data_ptr<scalar_t>() : nullptr,
                                  out_v2h ? ovc.data_ptr<scalar_t>() : nullptr, lsec.data_ptr<scalar_t>(), nchunk,
                                  dq.data_ptr<scalar_t>(), part.data_ptr<scalar_t>());
        reduce_partials<scalar_t>(D, nchunk, part.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                  dv_.data_ptr<scalar_t>(), gla.data_ptr<scalar_t>(), glb.data_ptr<scalar_t>());
      });
    }
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv_.to(v.scalar_type()),
          gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& out, const at::Tensor& out_v2h,
    const at::Tensor& lse, double scale) {
  return backward_cpu(kOpBwd, grad_out, q, k, v, log_alpha, log_beta, &out, &out_v2h, lse, scale);
}

// polyline_attention's output and lse without out_v2h (docs/ops.md "polyline_attention"): the training forward that
// ppma.ops.polyline_attention runs for float32 / float64 CPU tensors. One P v product per query tile, as the
// inference op (the averaged map), instead of two; its backward forms the rows' D terms from the maps.
std::tuple<at::Tensor, at::Tensor> polyline_attention_lse_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& log_alpha,
                                                             const at::Tensor& log_beta, double scale) {
  check_inputs(kOpLse, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), dv = v.size(4);
  const auto acc = acc_type(q);
  at::Tensor lse = at::empty({B, H, W, G, 2}, q.options().dtype(acc));
  if (B * H * W * G * dv == 0) return {at::empty({B, H, W, G, dv}, v.options()), lse};
  auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
  // bf16 / fp16 inputs: the inference op's products (out in the inputs' dtype, written by the kernels) plus lse
  if (lowp_inputs(q, k, v)) {
    at::Tensor outl = at::empty({B, H, W, G, dv}, v.options());
    polyline_attention_lowp(q, k, v, cr, cc, scale, outl, nullptr, &lse);
    return {outl, lse};
  }
#ifdef PPMA_SIMD_X86
  if (q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
      cpu_bf16_dot()) {
    at::Tensor outb = at::empty({B, H, W, G, dv}, v.options());
    polyline_attention_bf16(q, k, v, cr, cc, scale, outb, nullptr, &lse);
    return {outb, lse};
  }
#endif
  at::Tensor out = averaged_forward(q, k, v, cr, cc, scale, &lse);
  return {out.to(v.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_attention_lse_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& lse, double scale) {
  return backward_cpu(kOpLseBwd, grad_out, q, k, v, log_alpha, log_beta, nullptr, nullptr, lse, scale);
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_attention", &ppma::cpu::polyline_attention_cpu);
  m.impl("polyline_attention_backward", &ppma::cpu::polyline_attention_backward_cpu);
  m.impl("polyline_attention_inference", &ppma::cpu::polyline_attention_inference_cpu);
  m.impl("polyline_attention_lse", &ppma::cpu::polyline_attention_lse_cpu);
  m.impl("polyline_attention_lse_backward", &ppma::cpu::polyline_attention_lse_backward_cpu);
}
