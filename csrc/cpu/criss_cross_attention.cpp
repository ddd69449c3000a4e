// CPU kernels of ppma::criss_cross_attention (the official "chunk" mode, docs/model.md §3.3) and its backward.
//
// Per (batch, head): row attention A_i = softmax(S + R_i) inside every row (W x W) and column attention
// B_l = softmax(S + C_l) inside every column (H x H); out = 0.5 B (A v) + 0.5 A (B v). The maps live
// in per-task scratch (one line at a time), except the row maps, kept from the first phase for the third (forward
// and backward) for a group of (batch, head) pairs at a time (kRowMapBytes). Three parallel phases, each over lines:
//   forward:  rows (A, lse0, z1 = A v) -> columns (B, lse1, out1 = B z1, z2 = B v) -> rows (A kept, or
//             recomputed from the rows' m and 1 / s; out = 0.5 out1 + 0.5 A z2)
//   backward: rows (A kept, z1 = A v, dz2 = A^T g) -> columns (z2 = B v, dz1 = B^T g, dB, softmax backward,
//             column grads, grad log_beta) -> rows (A kept or recomputed, dA, softmax backward, row grads,
//             grad log_alpha)
// with g = 0.5 grad_out. Every output element is written by exactly one task per phase: deterministic.
// Memory: the inputs are read in place (queries, values and the z buffers through their row strides, the keys
// of each line transposed into per-thread scratch; scale multiplies the products). Besides its outputs a call
// needs at most kRowMapBytes of row maps and kGroupBytes of z buffers (z1, then z2; the backward's (z1, dz2),
// then (z2, dz1)): the phases run per group of (batch, head) pairs whose scratch fits both (pair_groups).
//
// The math of the lines is docs/ops.md "criss_cross_attention"; the vector code lives in cpu/simd.h, and every
// task runs at the lane width with_lanes() chooses (line kernels take it as their first argument).
//
// bf16 / fp16 q, k, v where use_lowp_gemm() (cpu/lowp_gemm.h: by default where torch packs for its CPU batch-reduce
// GEMM, i.e. AMX; the internal option cpu_lowp_products forces either way): every line product of the forward and
// the backward multiplies bf16 (fp16) operands with float32 accumulation through torch's CPU BLAS, in the same
// phases and tasks (forward_kernel_lowp, backward_kernel_lowp; docs/performance.md "bf16 and fp16 on the CPU",
// docs/ops.md "criss_cross_attention" says what is rounded). Otherwise bf16 q, k, v where cpu_bf16_dot() (the avx512
// path on a CPU with AVX-512 BF16): the forward's line products (q k^T, and the four map applies A v, B z1, B v,
// A z2) are bf16 products with float32 accumulation (forward_kernel_bf16); the inputs are read in place, each line
// gathered into per-thread scratch in the pair layouts of small_gemm_bf16. Elsewhere (and in the backward) bf16
// inputs are read in place too and widened to float32 as each line is gathered (the float32 kernels' numbers,
// without float32 copies of q, k, v); fp16 inputs are converted to float32 (kernel_input).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <vector>

#include "common/checks.h"
#include "common/math.h"
#include "cpu/lowp_gemm.h"
#include "cpu/simd.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

// X[j][l] += bias(j, l) for one line of n tokens: c holds the line's prefix sums; the bias is line_bias(j, l)
// (common/math.h). With mx, the rows' maxima go to mx[j] (NaN ignored, as max_of). With lse (then mx is null),
// X[j][l] = exp(X[j][l] + bias(j, l) - lse[j * ls]) instead: the map recomputed from its statistics, the bias
// and the exp in one pass for float (the same values as the two passes); with inv too, that times inv[j * ls]
// (lse then holds the rows' maxima: the map line_softmax forms, recomputed bit for bit). float: each row in
// vectors (for_lanes), the branch chosen lane by lane (a - b is -(b - a) exactly: the same values as the hoisted
// loops of double). xs: X is taken as xs X (the logit scale of products that cannot apply it, lowp_gemm's; 1 is
// exact).
template <int L, typename T>
inline void add_line_bias(Lanes<L> ln, int64_t n, const T* c, T* X, T* mx, const T* lse = nullptr,
                          int64_t ls = 0, const T* inv = nullptr, T xs = T(1)) {
  for (int64_t j = 0; j < n; ++j) {
    T* __restrict x = X + j * n;
    const T cj = c[j];
    if constexpr (std::is_same<T, float>::value) {
      const int32_t j32 = static_cast<int32_t>(j);
      auto biased = [&](auto lm, int64_t l) {  // x[l ..] + bias(j, l ..), the width of lm
        constexpr int M = decltype(lm)::value;
        const vec<M> cl = load<M>(c + l);
        return load<M>(x + l) * xs + (lane_indices<M>() + static_cast<int32_t>(l) < j32 ? cj - cl : cl - cj);
      };
      if (lse) {
        const float sh = lse[j * ls];
        if (inv) {
          const float a = inv[j * ls];
          for_lanes(ln, n, [&](auto lm, int64_t l) {
            constexpr int M = decltype(lm)::value;
            store<M>(x + l, fast_exp<M>(biased(lm, l) - sh) * a);
          });
        } else {
          for_lanes(ln, n, [&](auto lm, int64_t l) {
            constexpr int M = decltype(lm)::value;
            store<M>(x + l, fast_exp<M>(biased(lm, l) - sh));
          });
        }
        continue;
      }
      vec<L> m = vec<L>{} - std::numeric_limits<float>::infinity();
      float ms = -std::numeric_limits<float>::infinity();
      for_lanes(ln, n, [&](auto lm, int64_t l) {
        constexpr int M = decltype(lm)::value;
        const vec<M> y = biased(lm, l);
        store<M>(x + l, y);
        if constexpr (M == L) {
          m = y > m ? y : m;
        } else {
          const float t = lane_max<M>(y);
          ms = t > ms ? t : ms;
        }
      });
      if (mx) {
        const float mv = lane_max<L>(m);
        mx[j] = mv > ms ? mv : ms;
      }
    } else {
#pragma omp simd
      for (int64_t l = 0; l < j; ++l) x[l] = x[l] * xs + (cj - c[l]);
#pragma omp simd
      for (int64_t l = j; l < n; ++l) x[l] = x[l] * xs + (c[l] - cj);
      if (mx) mx[j] = max_of(n, x);
      if (lse) exp_shift(ln, n, x, lse[j * ls]);
      if (inv) scale_inplace(n, x, inv[j * ls]);
    }
  }
}

// X[j][l] = scale <Q_j, K_l> + bias(j, l) for one line of n tokens (rows' maxima into mx[j] where mx is given;
// with lse, the map exp(X[j][l] - lse[j * ls]) instead, as add_line_bias). Q rows have stride qs; Kt is [d][n].
template <int L, typename T>
inline void line_logits(Lanes<L> ln, int64_t n, int64_t d, const T* Q, int64_t qs, const T* Kt, const T* c, T* X,
                        T scale, T* mx, const T* lse = nullptr, int64_t ls = 0, const T* inv = nullptr) {
  small_gemm(ln, n, n, d, Q, qs, 1, Kt, n, X, n, false, scale);
  add_line_bias(ln, n, c, X, mx, lse, ls, inv);
}

// In-place row softmax of X [n][n], exp(x - m) * (1 / s); lse[j * ls] = logsumexp of row j. mx: the rows' maxima
// (from add_line_bias), or null. st (or null): row j's m and 1 / s at st[j * ss], st[j * ss + 1], from which
// add_line_bias recomputes the map bit for bit. Rows in blocks of kSoftmaxRows: the exponentials and sums of a
// block's rows first (independent rows, whose chains of exps and lane sums overlap), then each row's 1 / s, scaling
// and log; done row by row, each row's log and division waited on its sum (the same values either way).
constexpr int64_t kSoftmaxRows = 16;
template <int L, typename T>
inline void line_softmax(Lanes<L> ln, int64_t n, T* X, T* lse, int64_t ls, const T* mx = nullptr, T* st = nullptr,
                         int64_t ss = 0) {
  for (int64_t j0 = 0; j0 < n; j0 += kSoftmaxRows) {
    const int64_t rows = std::min(kSoftmaxRows, n - j0);
    T m[kSoftmaxRows], s[kSoftmaxRows];
    for (int64_t u = 0; u < rows; ++u) {
      T* x = X + (j0 + u) * n;
      m[u] = mx ? mx[j0 + u] : max_of(n, x);
      s[u] = exp_shift_sum(ln, n, x, m[u]);
    }
    for (int64_t u = 0; u < rows; ++u) {
      const int64_t j = j0 + u;
      const T a = T(1) / s[u];
      scale_inplace(n, X + j * n, a);
      lse[j * ls] = m[u] + std::log(s[u]);
      if (st) st[j * ss] = m[u], st[j * ss + 1] = a;
    }
  }
}

// out[j] (=|+=) alpha * sum_l P[j][l] V[l] (rows of V / out with strides vs / os, dv columns).
template <int L, typename T>
inline void line_apply(Lanes<L> ln, int64_t n, int64_t dv, const T* P, const T* V, int64_t vs, T* out, int64_t os,
                       bool accumulate = false, T alpha = T(1)) {
  small_gemm(ln, n, dv, n, P, n, 1, V, vs, out, os, accumulate, alpha);
}

// out[l] (=|+=) sum_j P[j][l] G[j] (the transposed map).
template <int L, typename T>
inline void line_apply_t(Lanes<L> ln, int64_t n, int64_t dv, const T* P, const T* Gm, int64_t gs, T* out, int64_t os,
                         bool accumulate = false) {
  small_gemm(ln, n, dv, n, P, 1, n, Gm, gs, out, os, accumulate);
}

// The softmax backward of one line's map P [n][n], given dP in DX: DX = P * (dP - rowsum(P * dP)) in place, and the
// prefix-sum gradient of the line into gc (sign rule sgn_diff of common/math.h, branch hoisted).
template <int L, typename T>
inline void line_softmax_backward(Lanes<L> ln, int64_t n, const T* P, T* DX, T* gc) {
  std::fill(gc, gc + n, T(0));
  for (int64_t j = 0; j < n; ++j) {
    T* __restrict x = DX + j * n;
    const T* p = P + j * n;
    const T rs = dot_lanes(ln, n, p, x);
    if constexpr (std::is_same<T, float>::value) {
      // the two loops below in vectors (for_lanes), the sign chosen lane by lane: gc[l] += sign(l - j) v and
      // gc[j] -= sum_l sign(l - j) v (sign +1 at l = j)
      vec<L> acc{};
      float s = 0;
      const int32_t j32 = static_cast<int32_t>(j);
      for_lanes(ln, n, [&](auto lm, int64_t l) {
        constexpr int M = decltype(lm)::value;
        const vec<M> v = load<M>(p + l) * (load<M>(x + l) - rs);
        store<M>(x + l, v);
        const vec<M> sv = lane_indices<M>() + static_cast<int32_t>(l) < j32 ? -v : v;
        store<M>(gc + l, load<M>(gc + l) + sv);
        if constexpr (M == L) {
          acc += sv;
        } else {
          s += hsum<M>(sv);
        }
      });
      gc[j] -= hsum<L>(acc) + s;
    } else {
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
  }
}

// Backward of one line's softmax attention, given the map P [n][n] and the gradient of the map
// dP[j][l] = <Gm_j, U_l> over 2 dv columns (Gm [n][2 dv] with row stride gs holds two operands side by
// side, Ut [2 dv][n] the two matching ones transposed and stacked: dP = G1 U1^T + G2 U2^T in one product):
//   dX = P * (dP - rowsum(P * dP)) (written into dP's scratch DX) and the prefix-sum gradient into gc
//   (line_softmax_backward),
//   dq_j (=|+=) scale * sum_l dX[j][l] K_l, dk_l (=|+=) scale * sum_j dX[j][l] Q_j (Q, K rows at strides qs, ks; dq, dk
//   rows at strides dqs / dks; written, or added to what is there when accumulate).
template <int L, typename T>
inline void line_backward(Lanes<L> ln, int64_t n, int64_t d, int64_t dv, const T* P, const T* Gm, int64_t gs,
                          const T* Ut, const T* Q, int64_t qs, const T* K, int64_t ks, T scale, T* DX, T* gc, T* dq,
                          int64_t dqs, T* dk, int64_t dks, bool accumulate) {
  small_gemm(ln, n, n, 2 * dv, Gm, gs, 1, Ut, n, DX, n, false);  // dP, one product over 2 dv
  line_softmax_backward(ln, n, P, DX, gc);
  small_gemm(ln, n, d, n, DX, n, 1, K, ks, dq, dqs, accumulate, scale);  // dq (+)= scale dX K
  small_gemm(ln, n, d, n, DX, 1, n, Q, qs, dk, dks, accumulate, scale);  // dk (+)= scale dX^T Q
}

// The inputs are read in their own layout [B, N, G, *] (no packed copies); every line is gathered into
// per-thread scratch before its products. I: the inputs' element type, T (the accumulation type) or the bits of
// bf16 values (uint16_t), widened to float as they are gathered (exact, so the same numbers as a float32 copy).
template <typename T, typename I = T>
struct CCData {
  const I* q;    // [B, N, G, d]
  const I* k;    // [B, N, G, d]
  const I* v;    // [B, N, G, dv]
  const T* cr;   // [BG, H, W] row prefix sums
  const T* cct;  // [BG, W, H] column prefix sums, each column contiguous
  int64_t B, G, H, W, N, d, dv;
  T scale;
};

// A line's positions in a token-major tensor of `ch` channels a token: the first at at(base, ch), the next ld(ch)
// elements apart (position u is token tok + u * ts).
struct LinePositions {
  int64_t tok, ts;
  template <typename P>
  P* at(P* base, int64_t ch) const {
    return base + tok * ch;
  }
  int64_t ld(int64_t ch) const { return ts * ch; }
};

// Line t of a phase: row t % H (rows) or column t % W of (batch, head) t / H (or t / W). Its positions are tokens
// of the [B, N, G] layout (its rows of a [B, N, G, ch] tensor at at(base, ch), stride ld(ch)); c: its prefix sums.
template <typename T>
struct Line : LinePositions {
  int64_t n;
  const T* c;

  template <typename I>
  Line(const CCData<T, I>& D, bool rows, int64_t t) {
    const int64_t per = rows ? D.H : D.W, bg = t / per, li = t % per;
    n = rows ? D.W : D.H;
    tok = token_index(D.N, D.G, bg / D.G, line_token(rows, li, 0, D.W), bg % D.G);
    ts = line_stride(rows, D.W) * D.G;
    c = (rows ? D.cr : D.cct) + bg * D.N + li * n;
  }
};

// gather_rows and gather_rows_t (cpu/simd.h) from the inputs: a plain copy when I is T, bf16 bits widened to float
// otherwise.
template <typename T, typename I>
inline void gather_input_rows(int64_t n, int64_t c, const I* src, int64_t ss, T* __restrict dst, int64_t ds,
                              T a = T(1)) {
  if constexpr (std::is_same<T, I>::value) {
    gather_rows(n, c, src, ss, dst, ds, a);
  } else {
    static_assert(std::is_same<T, float>::value && std::is_same<I, uint16_t>::value, "bf16 inputs, float math");
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* s = src + r * ss;
      float* o = dst + r * ds;
#pragma omp simd
      for (int64_t e = 0; e < c; ++e) o[e] = a * bf16_to_float(s[e]);
    }
  }
}
template <int L, typename T, typename I>
inline void gather_input_rows_t(Lanes<L> ln, int64_t n, int64_t c, const I* src, int64_t ss, T* __restrict dst) {
  if constexpr (std::is_same<T, I>::value) {
    gather_rows_t(ln, n, c, src, ss, dst);
  } else {
    static_assert(std::is_same<T, float>::value && std::is_same<I, uint16_t>::value, "bf16 inputs, float math");
    gather_bf16_rows_t(ln, n, c, src, ss, dst);
  }
}

// Per-thread scratch of the line kernels (n = max(H, W)).
template <typename T>
struct LineScratch {
  std::vector<T> buf;
  T *X, *q, *kt, *v;  // maps, queries (bf16 inputs), keys transposed, values (bf16 inputs)
  T* mx;              // the rows' maxima of a map
  T *DX, *k, *gu, *ut, *gc;  // backward: map gradient, keys, [n][2 dv] and [2 dv][n] operands, prefix grads
  LineScratch(int64_t n, int64_t d, int64_t dv, bool backward) {
    const int64_t nn = n * n, nd = n * d, nv = n * dv;
    buf.resize(backward ? 2 * nn + 3 * nd + 5 * nv + 2 * n : nn + 2 * nd + nv + n);
    T* p = buf.data();
    auto take = [&](int64_t m) {
      T* r = p;
      p += m;
      return r;
    };
    X = take(nn), q = take(nd), kt = take(nd), v = take(nv), mx = take(n);
    DX = k = gu = ut = gc = nullptr;
    if (backward) DX = take(nn), k = take(nd), gu = take(2 * nv), ut = take(2 * nv), gc = take(n);
  }
};

// Runs body(lanes, t, scratch) for the lines t < ntasks like parallel_tasks (scratch: a LineScratch per
// thread), every task at the lane width with_lanes() chooses.
template <typename T, typename I, typename Body>
inline void parallel_lines(const CCData<T, I>& D, int64_t ntasks, bool backward, const Body& body) {
  parallel_tasks(
      ntasks, [&] { return LineScratch<T>(std::max(D.H, D.W), D.d, D.dv, backward); },
      [&](int64_t t, LineScratch<T>& scratch) { with_lanes([&](auto ln) { body(ln, t, scratch); }); });
}

// A line's rows of an input [B, N, G, ch]: read in place (first row and row stride) when I is T, else (bf16 bits)
// widened into scratch; copied into scratch with gather (the backward reads them several times).
template <typename T>
struct Rows {
  const T* p;
  int64_t s;
};
template <typename T, typename I>
inline Rows<T> line_rows(const Line<T>& li, const I* src, int64_t ch, T* scratch, bool gather = false) {
  if constexpr (std::is_same<T, I>::value) {
    if (gather) {
      gather_rows(li.n, ch, li.at(src, ch), li.ld(ch), scratch, ch);
      return {scratch, ch};
    }
    return {li.at(src, ch), li.ld(ch)};
  } else {
    gather_input_rows(li.n, ch, li.at(src, ch), li.ld(ch), scratch, ch);
    return {scratch, ch};
  }
}

// The logits of a line into X (S.X unless given; the keys transposed into S.kt, the queries read by line_rows), its
// rows' maxima into S.mx when maxima is set; or, given lse (row j's at lse[j * ls]), the line's map recomputed
// from its statistics, exp(logits - lse) (times inv[j * ls] where inv is given: add_line_bias). Returns the
// queries' rows (copied into S.q with gather).
template <int L, typename T, typename I>
inline Rows<T> line_scores(Lanes<L> ln, const CCData<T, I>& D, const Line<T>& li, LineScratch<T>& S,
                           bool maxima = false, bool gather = false, const T* lse = nullptr, int64_t ls = 0,
                           const T* inv = nullptr, T* X = nullptr) {
  const Rows<T> q = line_rows(li, D.q, D.d, S.q, gather);
  gather_input_rows_t(ln, li.n, D.d, li.at(D.k, D.d), li.ld(D.d), S.kt);
  line_logits(ln, li.n, D.d, q.p, q.s, S.kt, li.c, X ? X : S.X, D.scale, maxima ? S.mx : nullptr, lse, ls, inv);
  return q;
}

// out = P v (rows at stride os) for the line's map P (in X, or S.X; its values read by line_rows): z1 = A v of a
// row, z2 = B v of a column.
template <int L, typename T, typename I>
inline void line_values(Lanes<L> ln, const CCData<T, I>& D, const Line<T>& li, LineScratch<T>& S, T* out, int64_t os,
                        const T* X = nullptr) {
  const Rows<T> v = line_rows(li, D.v, D.dv, S.v);
  line_apply(ln, li.n, D.dv, X ? X : S.X, v.p, v.s, out, os);
}

// The forward keeps the row maps A of phase 1 for phase 3 (instead of recomputing them there) for as many
// (batch, head) pairs at a time as fit in kRowMapBytes, and runs its three phases once per such group of pairs.
// Where the maps of one pair do not fit, phase 3 recomputes them from the rows' maxima m and 1 / s (add_line_bias),
// bit for bit the maps phase 1 formed, so both give the same numbers; the groups depend on the shapes only.
constexpr int64_t kRowMapBytes = int64_t(2) << 20;

// (batch, head) pairs per group whose row maps (H rows of elems elements of `bytes` bytes each per pair) fit in
// kRowMapBytes, at most BG; 0 where one pair's do not.
inline int64_t pairs_kept(int64_t BG, int64_t H, int64_t elems, int64_t bytes) {
  const int64_t one = H * elems * bytes;
  return one <= kRowMapBytes ? std::min(BG, kRowMapBytes / one) : 0;
}

// Task u of a phase over a group of gn (batch, head) pairs from pair g0, per lines each: line u / gn of pair
// g0 + u % gn. The group's heads of one line run as consecutive tasks (on one thread but at a split), so the
// line's tokens, whose heads lie side by side in memory ([B, N, G, *]), are fetched from memory once for all of
// them rather than once per head.
inline int64_t group_line(int64_t g0, int64_t gn, int64_t per, int64_t u) { return (g0 + u % gn) * per + u / gn; }

// The scratch maps of a group besides its row maps (the z buffers; the bf16 forward's float32 first half of out)
// hold the group's pairs only, [N][pair][dv] (the inputs' [B, N, G, *] layout with the group's pairs in place of
// the heads: the group's heads of a line, which run as consecutive tasks, lie side by side): at most kGroupBytes
// for all of them together, so that a call's scratch stays small whatever its inputs' size (no input-sized buffer
// made and freed, and its pages faulted in, at every call).
constexpr int64_t kGroupBytes = int64_t(1) << 20;

// A phase's task u as a line of a group's scratch maps (line u / gn of pair u % gn there, as group_line).
struct GroupLine : LinePositions {
  GroupLine(int64_t W, int64_t gn, bool rows, int64_t u)
      : LinePositions{line_token(rows, u / gn, 0, W) * gn + u % gn, line_stride(rows, W) * gn} {}
};

// The pairs of a group: at most pairs_kept(...) where the row maps are kept (keep), and no more than fit
// kGroupBytes at `bytes` of scratch maps per pair (at least one).
struct Groups {
  int64_t size;
  bool keep;
};
inline Groups pair_groups(int64_t BG, int64_t H, int64_t map_elems, int64_t map_bytes, int64_t bytes) {
  const int64_t kept = pairs_kept(BG, H, map_elems, map_bytes);
  return {std::min(kept ? kept : BG, std::max<int64_t>(1, kGroupBytes / bytes)), kept > 0};
}

// An uninitialised buffer of n elements (every element is written before it is read).
template <typename T>
std::unique_ptr<T[]> uninit(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(n)]);
}

// The three phases of every kernel below, group of (batch, head) pairs by group (pair_groups, `group` pairs at a
// time): phase 1 on the group's rows, phase 2 on its columns, phase 3 on its rows again. for_lines(ntasks, task)
// runs a phase's tasks (parallel_lines or its bf16 / lowp kin, task(ln, u, scratch)); each phase body gets
// (ln, u, scratch, the task's line of the inputs, its line of the group's scratch maps).
template <typename T, typename I, typename ForLines, typename Rows1, typename Cols, typename Rows3>
void run_phases(const CCData<T, I>& D, int64_t group, const ForLines& for_lines, const Rows1& rows1,
                const Cols& cols, const Rows3& rows3) {
  const int64_t BG = D.B * D.G, H = D.H, W = D.W;
  for (int64_t g0 = 0; g0 < BG; g0 += group) {
    const int64_t gn = std::min(group, BG - g0);
    const auto phase = [&](bool rows, const auto& body) {
      const int64_t per = rows ? H : W;
      for_lines(gn * per, [&](auto ln, int64_t u, auto& S) {
        body(ln, u, S, Line<T>(D, rows, group_line(g0, gn, per, u)), GroupLine(W, gn, rows, u));
      });
    };
    phase(true, rows1);
    phase(false, cols);
    phase(true, rows3);
  }
}

// Forward. The phases run per group of (batch, head) pairs (pair_groups, run_phases). Z: the group's z1, then z2 in
// place (column by column), [N][pair][dv] (GroupLine).
template <typename T, typename I>
void forward_kernel(const CCData<T, I>& D, T* out, T* lse) {
  const int64_t BG = D.B * D.G, dv = D.dv, H = D.H, W = D.W, nn = W * W;
  const Groups gr = pair_groups(BG, H, nn, sizeof(T), D.N * dv * sizeof(T));
  const int64_t group = gr.size;
  const bool keep = gr.keep;
  auto maps = uninit<T>(keep ? group * H * nn : 0);   // the group's row maps, [pair][row][W][W]
  auto stats = uninit<T>(keep ? 0 : 2 * group * D.N);  // else the rows' m and 1 / s, [N][pair][2]
  auto Z = uninit<T>(group * D.N * dv);
  run_phases(
      D, group, [&](int64_t n, const auto& task) { parallel_lines(D, n, false, task); },
      // Phase 1: rows. A (kept, or its statistics), lse0, z1 = A v.
      [&](auto ln, int64_t u, LineScratch<T>& S, const Line<T>& r, const GroupLine& zr) {
        T* X = keep ? maps.get() + u * nn : S.X;
        line_scores(ln, D, r, S, true, false, static_cast<const T*>(nullptr), 0, static_cast<const T*>(nullptr), X);
        line_softmax(ln, r.n, X, r.at(lse, 2), r.ld(2), S.mx, keep ? nullptr : zr.at(stats.get(), 2), zr.ld(2));
        line_values(ln, D, r, S, zr.at(Z.get(), dv), zr.ld(dv), X);
      },
      // Phase 2: columns. B, lse1, out = 0.5 B z1, z2 = B v (over z1).
      [&](auto ln, int64_t, LineScratch<T>& S, const Line<T>& c, const GroupLine& zc) {
        line_scores(ln, D, c, S, true);
        line_softmax(ln, c.n, S.X, c.at(lse, 2) + 1, c.ld(2), S.mx);
        // out = 0.5 B z1, z1 read in place before z2 replaces it
        line_apply(ln, c.n, dv, S.X, zc.at(Z.get(), dv), zc.ld(dv), c.at(out, dv), c.ld(dv), false, T(0.5));
        line_values(ln, D, c, S, zc.at(Z.get(), dv), zc.ld(dv));  // z2 = B v
      },
      // Phase 3: rows again, A kept or recomputed; out += 0.5 A z2.
      [&](auto ln, int64_t u, LineScratch<T>& S, const Line<T>& r, const GroupLine& zr) {
        const T* X = keep ? maps.get() + u * nn : nullptr;
        if (!keep) {
          const T* st = zr.at(stats.get(), 2);
          line_scores(ln, D, r, S, false, false, st, zr.ld(2), st + 1);
          X = S.X;
        }
        line_apply(ln, r.n, dv, X, zr.at(Z.get(), dv), zr.ld(dv), r.at(out, dv), r.ld(dv), true, T(0.5));
      });
}

#ifdef PPMA_SIMD_X86
// ---------------------------------------------------------------------------------------------
// The forward of bf16 q, k, v on the bf16 products (cpu_bf16_dot(), cpu/simd.h): forward_kernel's three phases
// with each line's products on small_gemm_bf16 (vdpbf16ps, float32 accumulation). Biases, softmax and lse are
// float32 as on every path; the logits are scale * (q k^T) of the bf16 values (exact products, float32 sums;
// the float32 kernel scales q first, the same up to float32 rounding). Roundings to bf16, besides the inputs':
//   - each map (A in phases 1 and 3, B in phase 2; the normalised softmax, in [0, 1]) before its products;
//   - z1 = A v and z2 = B v, whose only use is as the right operand of B z1 and A z2: they are held in bf16
//     (the Z buffer is bf16), rounded once from their float32 accumulators.
// out accumulates 0.5 B z1 + 0.5 A z2 in float32 and is rounded to bf16 once, row by row in phase 3. lse is what the
// float32 kernel computes on the same bf16 values up to float32 rounding, so the float32 backward, which
// recomputes the maps from lse and its own logits, is consistent with it: its gradients from this lse and from the
// float32 kernel's differ by float32 rounding only (measured; tests/test_criss_cross_attention.py,
// test_bf16_products), so this forward also runs when a gradient is recorded, not only for inference.
// ---------------------------------------------------------------------------------------------

struct CCBf16 {
  const uint16_t* q;  // [B, N, G, d] the inputs' bf16 bits
  const uint16_t* k;  // [B, N, G, d]
  const uint16_t* v;  // [B, N, G, dv]
};

// Per-thread scratch of the bf16 line kernels, for lines of up to n tokens (n = max(H, W)). Zero-initialised:
// the padding columns of kp and vp (past the line, past dv) are read as whole vectors and stay 0.
struct LineScratchBf16 {
  std::vector<float> f;
  std::vector<uint16_t> h;
  float *X, *O, *mx, *inv;  // the logits [n][n]; a product [n][dv]; the map's row maxima and 1 / (row sums)
  uint16_t *qp, *pb;        // queries [n][d2][2]; the map in bf16 [n][n2][2]
  uint32_t *kp, *vp;        // keys [d2][np] and values or z [n2][dvp] in pairs
  int64_t dvp;              // dv rounded up to 16 (vp's row stride)
  LineScratchBf16(int64_t n, int64_t d, int64_t dv) {
    const int64_t d2 = ceil_div(d, 2), n2 = ceil_div(n, 2), np = ceil_div(n, 16) * 16;
    dvp = ceil_div(dv, 16) * 16;
    f.assign(n * n + n * dv + 2 * n, 0.0f);
    h.assign(2 * (n * d2 + n * n2 + d2 * np + n2 * dvp), 0);
    X = f.data(), O = X + n * n, mx = O + n * dv, inv = mx + n;
    qp = h.data(), pb = qp + 2 * n * d2;
    kp = reinterpret_cast<uint32_t*>(pb + 2 * n * n2);  // 4-byte aligned: every offset above is even
    vp = kp + d2 * np;
  }
};

template <typename Body>
inline void parallel_lines_bf16(const CCData<float>& D, int64_t ntasks, const Body& body) {
  parallel_tasks(
      ntasks, [&] { return LineScratchBf16(std::max(D.H, D.W), D.d, D.dv); },
      [&](int64_t t, LineScratchBf16& scratch) { with_lanes_bf16([&](auto ln) { body(ln, t, scratch); }); });
}

// The logits of a line into S.X: scale * (q k^T) + bias, the rows' maxima into S.mx; given lse (and inv), the map
// exp(logits - lse) (times inv) instead (add_line_bias; lse the rows' m: line_softmax_bf16's map before rounding).
template <int L>
inline void line_scores_bf16(Lanes<L> ln, const CCData<float>& D, const CCBf16& P, const Line<float>& li,
                             LineScratchBf16& S, const float* lse = nullptr, int64_t ls = 0,
                             const float* inv = nullptr) {
  const int64_t n = li.n, d = D.d, d2 = ceil_div(d, 2), np = ceil_div(n, 16) * 16;
  gather_pair_rows(n, d, li.at(P.q, d), li.ld(d), S.qp);
  gather_pairs_t(n, d, li.at(P.k, d), li.ld(d), S.kp, np);
  small_gemm_bf16(ln, n, n, d2, S.qp, d2, reinterpret_cast<const uint16_t*>(S.kp), np, S.X, n, false, D.scale);
  add_line_bias(ln, n, li.c, S.X, lse ? nullptr : S.mx, lse, ls, inv);
}

// The map in S.X rounded to bf16 into pb (S.pb unless given), rows of pairs of positions (the last one 0 when n is
// odd).
template <int L>
inline void map_to_bf16(Lanes<L> ln, int64_t n, LineScratchBf16& S, uint16_t* pb = nullptr) {
  const int64_t w = n + (n & 1);
  if (!pb) pb = S.pb;
  for (int64_t j = 0; j < n; ++j) {
    floats_to_bf16(ln, n, S.X + j * n, pb + j * w);
    if (n & 1) pb[j * w + n] = 0;
  }
}

// dst[l] = bf16(exp(x[l] - m)) for l < n; returns the float32 sum of the exponentials (before their rounding).
// 16 lanes at a time, the tail's other lanes read as -inf (exp 0), so that a row's sum ends in one hsum.
PPMA_SIMD_INLINE float exp_to_bf16_sum(Lanes<16>, int64_t n, const float* __restrict x, float m,
                                       uint16_t* __restrict dst) {
  vec<16> acc{};
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) {
    const vec<16> p = fast_exp<16>(load<16>(x + l) - m);
    acc += p;
    store_bf16<16>(dst + l, p);
  }
  if (l < n) {
    const vec<16> ninf = vec<16>{} - std::numeric_limits<float>::infinity();
    const vec<16> p = fast_exp<16>(load_first<16>(x + l, n - l, ninf) - m);
    acc += p;
    store_bf16_first(dst + l, p, n - l);
  }
  return hsum<16>(acc);
}

// The softmax of the line's logits in S.X (their rows' maxima in S.mx: line_scores_bf16) in the bf16 products'
// form: the unnormalised map exp(x - m), rounded to bf16 in the pass that computes it, into pb (S.pb unless given;
// map_to_bf16's layout), and each row's 1 / s into S.inv, which the products' rows are multiplied by (line_values_bf16,
// forward_kernel_bf16): one pass over the logits after the bias. lse[j * ls] = m + log s; st (or null): row j's m and
// 1 / s at st[j * ss], st[j * ss + 1], from which line_scores_bf16 recomputes the same map. Rows in blocks of
// kSoftmaxRows as line_softmax.
template <int L>
inline void line_softmax_bf16(Lanes<L> ln, int64_t n, LineScratchBf16& S, float* lse, int64_t ls,
                              uint16_t* pb = nullptr, float* st = nullptr, int64_t ss = 0) {
  const int64_t w = n + (n & 1);
  if (!pb) pb = S.pb;
  for (int64_t j0 = 0; j0 < n; j0 += kSoftmaxRows) {
    const int64_t rows = std::min(kSoftmaxRows, n - j0);
    float s[kSoftmaxRows];
    for (int64_t u = 0; u < rows; ++u) {
      const int64_t j = j0 + u;
      s[u] = exp_to_bf16_sum(ln, n, S.X + j * n, S.mx[j], pb + j * w);
      if (n & 1) pb[j * w + n] = 0;
    }
    for (int64_t u = 0; u < rows; ++u) {
      const int64_t j = j0 + u;
      S.inv[j] = 1.0f / s[u];
      lse[j * ls] = S.mx[j] + std::log(s[u]);
      if (st) st[j * ss] = S.mx[j], st[j * ss + 1] = S.inv[j];
    }
  }
}

// C (=|+=) alpha * P src for the bf16 map of a line of n tokens (pb, or S.pb) and the line's n bf16 rows of dv
// values at src, stride ss (gathered into S.vp); C rows at stride ldc.
template <int L>
inline void line_apply_bf16(Lanes<L> ln, const CCData<float>& D, int64_t n, LineScratchBf16& S, const uint16_t* src,
                            int64_t ss, float* C, int64_t ldc, bool accumulate, float alpha,
                            const uint16_t* pb = nullptr) {
  const int64_t dv = D.dv, n2 = ceil_div(n, 2);
  gather_pairs_positions(n, dv, src, ss, S.vp, S.dvp);
  small_gemm_bf16(ln, n, dv, n2, pb ? pb : S.pb, n2, reinterpret_cast<const uint16_t*>(S.vp), S.dvp, C, ldc,
                  accumulate, alpha);
}

// The line's rows z (stride zs) = bf16((P v)_j / s_j) for the unnormalised map P (pb, or S.pb) whose rows' 1 / s
// line_softmax_bf16 left in S.inv.
template <int L>
inline void line_values_bf16(Lanes<L> ln, const CCData<float>& D, const CCBf16& P, const Line<float>& li,
                             LineScratchBf16& S, uint16_t* z, int64_t zs, const uint16_t* pb = nullptr) {
  const int64_t dv = D.dv;
  line_apply_bf16(ln, D, li.n, S, li.at(P.v, dv), li.ld(dv), S.O, dv, false, 1.0f, pb);
  for (int64_t j = 0; j < li.n; ++j) scaled_to_bf16(ln, dv, S.O + j * dv, S.inv[j], z + j * zs);
}

// forward_kernel on the bf16 products. D: dimensions, prefix sums and scale (its q, k, v unused). Per group of
// pairs (pair_groups), Z: bf16 z1, then z2 in place (column by column), O1: float32 0.5 B z1 after phase 2, and the
// rows' m and 1 / s, [N][pair][*] each (GroupLine). The maps are the unnormalised exp(x - m) rounded to bf16
// (line_softmax_bf16), each product's row j then multiplied by its 1 / s; the row maps are kept for the groups of
// pairs of kRowMapBytes, else recomputed from the rows' m. Phase 3 adds 0.5 (1 / s) (A z2) to each row's O1 and
// writes the sum rounded to bf16 into outb (the float32 sum rounded once, as a float32 out's .to(bf16) would,
// without that pass).
void forward_kernel_bf16(const CCData<float>& D, const CCBf16& P, float* lse, uint16_t* outb) {
  const int64_t BG = D.B * D.G, dv = D.dv, H = D.H, W = D.W, nw = W * (W + (W & 1));
  const Groups gr = pair_groups(BG, H, nw, sizeof(uint16_t),
                                D.N * (dv * (sizeof(uint16_t) + sizeof(float)) + 2 * sizeof(float)));
  const int64_t group = gr.size;
  const bool keep = gr.keep;
  auto maps = uninit<uint16_t>(keep ? group * H * nw : 0);  // the group's row maps in bf16, [pair][row][W][W2]
  auto stats = uninit<float>(2 * group * D.N);                // the rows' m and 1 / s, [N][pair][2]
  auto Z = uninit<uint16_t>(group * D.N * dv);
  auto O1 = uninit<float>(group * D.N * dv);
  run_phases(
      D, group, [&](int64_t n, const auto& task) { parallel_lines_bf16(D, n, task); },
      // Phase 1: rows. A (kept, or recomputed in phase 3 from its statistics), lse0, z1 = A v.
      [&](auto ln, int64_t u, LineScratchBf16& S, const Line<float>& r, const GroupLine& zr) {
        uint16_t* pb = keep ? maps.get() + u * nw : S.pb;
        line_scores_bf16(ln, D, P, r, S);
        line_softmax_bf16(ln, r.n, S, r.at(lse, 2), r.ld(2), pb, zr.at(stats.get(), 2), zr.ld(2));
        line_values_bf16(ln, D, P, r, S, zr.at(Z.get(), dv), zr.ld(dv), pb);
      },
      // Phase 2: columns. B, lse1, O1 = 0.5 B z1, z2 = B v (over z1, which is gathered first).
      [&](auto ln, int64_t, LineScratchBf16& S, const Line<float>& c, const GroupLine& zc) {
        line_scores_bf16(ln, D, P, c, S);
        line_softmax_bf16(ln, c.n, S, c.at(lse, 2) + 1, c.ld(2));
        line_apply_bf16(ln, D, c.n, S, zc.at(Z.get(), dv), zc.ld(dv), S.O, dv, false, 1.0f);
        float* o1 = zc.at(O1.get(), dv);
        for (int64_t j = 0; j < c.n; ++j) {
          const float a = 0.5f * S.inv[j];
          const float* src = S.O + j * dv;
          float* dst = o1 + j * zc.ld(dv);
          for (int64_t e = 0; e < dv; ++e) dst[e] = src[e] * a;
        }
        line_values_bf16(ln, D, P, c, S, zc.at(Z.get(), dv), zc.ld(dv));  // z2 = B v
      },
      // Phase 3: rows again, A kept or recomputed; outb = bf16(O1 + 0.5 A z2).
      [&](auto ln, int64_t u, LineScratchBf16& S, const Line<float>& r, const GroupLine& zr) {
        const uint16_t* pb = keep ? maps.get() + u * nw : S.pb;
        const float* st = zr.at(stats.get(), 2);
        if (!keep) {
          line_scores_bf16(ln, D, P, r, S, st, zr.ld(2));
          map_to_bf16(ln, r.n, S);
        }
        line_apply_bf16(ln, D, r.n, S, zr.at(Z.get(), dv), zr.ld(dv), S.O, dv, false, 1.0f, pb);
        const float* o1 = zr.at(O1.get(), dv);
        uint16_t* o = r.at(outb, dv);
        for (int64_t j = 0; j < r.n; ++j) {
          const float a = 0.5f * st[j * zr.ld(2) + 1];
          const float* prev = o1 + j * zr.ld(dv);
          float* t = S.O + j * dv;  // A z2's row, summed with O1's in place
          for (int64_t e = 0; e < dv; ++e) t[e] = prev[e] + t[e] * a;
          floats_to_bf16(ln, dv, t, o + j * r.ld(dv));
        }
      });
}
#endif  // PPMA_SIMD_X86

// The gradients through one line's map P (B of a column, A of a row: the kept map X where given, else recomputed
// into S.X from lse + side), given g = 0.5 grad_out, the gradient dz of the map's own product (dz2 for a column,
// dz1 for a row) and the other product z (z1 for a column, z2 for a row; z and dz: the group's scratch maps, the
// line's rows at zl): dP = g z^T + dz v^T, then line_backward (dq, dk written or accumulated), grad v (=|+=) P^T dz
// and the line's log-decay gradients. Leaves [g | dz] in S.gu.
template <int L, typename T, typename I>
inline void line_grads(Lanes<L> ln, const CCData<T, I>& D, const Line<T>& li, LineScratch<T>& S, const T* go,
                       const T* lse, int side, const GroupLine& zl, const T* z, const T* dz, T* dq, T* dk, T* gv,
                       T* gdecay, bool accumulate, const T* X = nullptr) {
  const int64_t n = li.n, d = D.d, dv = D.dv;
  const Rows<T> q = X ? line_rows(li, D.q, d, S.q, true)
                      : line_scores(ln, D, li, S, false, true, li.at(lse, 2) + side, li.ld(2));  // the map P
  const T* P = X ? X : S.X;
  const Rows<T> k = line_rows(li, D.k, d, S.k, true);
  gather_rows(n, dv, li.at(go, dv), li.ld(dv), S.gu, 2 * dv, T(0.5));  // [g | dz], row stride 2 dv
  gather_rows(n, dv, zl.at(dz, dv), zl.ld(dv), S.gu + dv, 2 * dv);
  gather_rows_t(ln, n, dv, zl.at(z, dv), zl.ld(dv), S.ut);  // [z^T ; v^T]
  gather_input_rows_t(ln, n, dv, li.at(D.v, dv), li.ld(dv), S.ut + dv * n);
  line_backward(ln, n, d, dv, P, S.gu, 2 * dv, S.ut, q.p, q.s, k.p, k.s, D.scale, S.DX, S.gc, li.at(dq, d), li.ld(d),
                li.at(dk, d), li.ld(d), accumulate);
  line_apply_t(ln, n, dv, P, S.gu + dv, 2 * dv, li.at(gv, dv), li.ld(dv), accumulate);
  decay_grads_from_prefix(n, S.gc, 1, gdecay + li.tok, li.ts);
}

// Backward with g = 0.5 grad_out. As the forward, the phases run per group of (batch, head) pairs (pair_groups;
// the row maps A, recomputed from lse in phase 1, kept for phase 3 where they fit in kRowMapBytes, else recomputed
// there, the same bits either way). ZA, ZB: the group's (z1, dz2) after the rows, replaced by (z2, dz1) column by
// column, [N][pair][dv] each (GroupLine). The column phase writes dq, dk, dv (column parts), the last row phase adds
// the row parts. Outputs in the [B, H, W, heads, *] layout, lse [B, H, W, heads, 2].
template <typename T, typename I>
void backward_kernel(const CCData<T, I>& D, const T* go, const T* lse, T* dq, T* dk, T* dv_out, T* gla, T* glb) {
  const int64_t BG = D.B * D.G, dv = D.dv, H = D.H, W = D.W, nn = W * W;
  const Groups gr = pair_groups(BG, H, nn, sizeof(T), 2 * D.N * dv * sizeof(T));
  const int64_t group = gr.size;
  const bool keep = gr.keep;
  auto maps = uninit<T>(keep ? group * H * nn : 0);  // the group's row maps, [pair][row][W][W]
  auto ZA = uninit<T>(group * D.N * dv), ZB = uninit<T>(group * D.N * dv);
  T *za = ZA.get(), *zb = ZB.get();
  run_phases(
      D, group, [&](int64_t n, const auto& task) { parallel_lines(D, n, true, task); },
      // Phase 1: rows. A (kept where it fits), z1 = A v, dz2 = A^T g.
      [&](auto ln, int64_t u, LineScratch<T>& S, const Line<T>& r, const GroupLine& zr) {
        T* X = keep ? maps.get() + u * nn : S.X;
        line_scores(ln, D, r, S, false, false, r.at(lse, 2), r.ld(2), static_cast<const T*>(nullptr), X);
        line_values(ln, D, r, S, zr.at(za, dv), zr.ld(dv), X);
        gather_rows(r.n, dv, r.at(go, dv), r.ld(dv), S.gu, dv, T(0.5));
        line_apply_t(ln, r.n, dv, X, S.gu, dv, zr.at(zb, dv), zr.ld(dv));
      },
      // Phase 2: columns. dB = g z1^T + dz2 v^T; column grads; grad log_beta; then z2 = B v and dz1 = B^T g
      // replace z1 and dz2 of this column.
      [&](auto ln, int64_t, LineScratch<T>& S, const Line<T>& c, const GroupLine& zc) {
        line_grads(ln, D, c, S, go, lse, 1, zc, za, zb, dq, dk, dv_out, glb, false);
        line_values(ln, D, c, S, zc.at(za, dv), zc.ld(dv));
        line_apply_t(ln, c.n, dv, S.X, S.gu, 2 * dv, zc.at(zb, dv), zc.ld(dv));
      },
      // Phase 3: rows. dA = g z2^T + dz1 v^T; the row parts are added to the column parts; grad log_alpha.
      [&](auto ln, int64_t u, LineScratch<T>& S, const Line<T>& r, const GroupLine& zr) {
        line_grads(ln, D, r, S, go, lse, 0, zr, za, zb, dq, dk, dv_out, gla, true,
                   keep ? static_cast<const T*>(maps.get() + u * nn) : static_cast<const T*>(nullptr));
      });
}

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 q, k, v on torch's CPU batch-reduce GEMM (cpu/lowp_gemm.h; where use_lowp_gemm()): forward_kernel's
// and backward_kernel's three phases, with the same tasks and groups of pairs, and every product of a line on
// lowp_gemm: operands of the inputs' dtype Lp, float32 accumulation. The queries, keys, values and grad_out are read
// in place (the keys of a line transposed into scratch). Biases, softmax, lse, the softmax gradients and the
// prefix-sum gradients are float32 as on the other paths; dq, dk, dv accumulate in float32 (the column phase, then
// the row phase) before their one rounding. Roundings to Lp besides the inputs' (each once, from float32):
//   forward:  each map A, B (the normalised softmax, in [0, 1]) before its products A v, B z1, B v, A z2; z1 = A v
//             and z2 = B v, held in Lp (they only feed B z1 and A z2); out = 0.5 (B z1 + A z2), summed in float32;
//   backward: each map, and its transpose, before A v, A^T g, P^T dz, B v, B^T g; g = 0.5 grad_out (halved in
//             float32: exact); z1, z2, dz1 = B^T g, dz2 = A^T g, held in Lp (they only feed dP = g z^T + dz v^T and
//             grad v += P^T dz); scale dX before dq = (scale dX) k and dk = (scale dX)^T q.
// ---------------------------------------------------------------------------------------------

// Per-thread scratch of the lowp line kernels for lines of up to n tokens (n = max(H, W)), each buffer 64-byte
// aligned (the library then sees the same alignment of a task's operands whichever thread runs it).
template <typename Lp>
struct LineScratchLowp {
  std::vector<char> buf;
  float *X, *O, *mx;  // the map [n][n] (float32), a product [n][dv] before its rounding, the rows' maxima
  float *DX, *gc;     // backward: the map's gradient [n][n], the line's prefix-sum gradients
  Lp *kt, *pb;        // the keys as the B operand of q k^T (lowp_gemm_bt's scratch), the map rounded [n][n]
  Lp *pbt, *ds, *dst, *gu, *zv, *ut;  // backward: pb transposed, scale dX [n][n] and transposed, [g | dz] and
                                      // [z | v] [n][2 dv], [z | v] as the B operand of dP (lowp_gemm_bt's scratch)
  VnniHold hold;  // the micro-kernel's context kept over the worker's products (cpu/lowp_gemm.h)
  LineScratchLowp(int64_t n, int64_t d, int64_t dv, bool backward) {
    constexpr int64_t kAlign = 64;
    const int64_t nn = n * n, bw = backward ? 1 : 0, f = sizeof(float), h = sizeof(Lp);
    const int64_t bytes[] = {nn * f,      n * dv * f,  n * f,       bw * nn * f,          bw * n * f,
                             (d + 1) * n * h, nn * h,  bw * nn * h, bw * nn * h,          bw * nn * h,
                             bw * 2 * n * dv * h,      bw * 2 * n * dv * h,               bw * 2 * dv * n * h};
    int64_t total = kAlign;
    for (int64_t b : bytes) total += ceil_div(b, kAlign) * kAlign;
    buf.resize(total);
    char* p = buf.data() + (kAlign - reinterpret_cast<uintptr_t>(buf.data()) % kAlign) % kAlign;
    char* at[std::size(bytes)];
    for (size_t i = 0; i < std::size(bytes); ++i) {
      at[i] = p;
      p += ceil_div(bytes[i], kAlign) * kAlign;
    }
    X = reinterpret_cast<float*>(at[0]), O = reinterpret_cast<float*>(at[1]), mx = reinterpret_cast<float*>(at[2]);
    DX = reinterpret_cast<float*>(at[3]), gc = reinterpret_cast<float*>(at[4]);
    kt = reinterpret_cast<Lp*>(at[5]), pb = reinterpret_cast<Lp*>(at[6]), pbt = reinterpret_cast<Lp*>(at[7]);
    ds = reinterpret_cast<Lp*>(at[8]), dst = reinterpret_cast<Lp*>(at[9]), gu = reinterpret_cast<Lp*>(at[10]);
    zv = reinterpret_cast<Lp*>(at[11]), ut = reinterpret_cast<Lp*>(at[12]);
  }
};

// parallel_lines on the lowp line kernels' scratch.
template <typename Lp, typename Body>
inline void parallel_lines_lowp(const CCData<float, Lp>& D, int64_t ntasks, bool backward, const Body& body) {
  parallel_tasks(
      ntasks, [&] { return LineScratchLowp<Lp>(std::max(D.H, D.W), D.d, D.dv, backward); },
      [&](int64_t t, LineScratchLowp<Lp>& scratch) { with_lanes([&](auto ln) { body(ln, t, scratch); }); });
}

// The logits of a line into X: scale (q k^T) + bias, the rows' maxima into S.mx where maxima; given lse, the map
// exp(logits - lse) instead (times inv where given: add_line_bias).
template <int L, typename Lp>
inline void line_scores_lowp(Lanes<L> ln, const CCData<float, Lp>& D, const Line<float>& li, LineScratchLowp<Lp>& S,
                             float* X, bool maxima, const float* lse = nullptr, int64_t ls = 0,
                             const float* inv = nullptr) {
  const int64_t n = li.n, d = D.d;
  lowp_gemm_bt(n, n, d, li.at(D.q, d), li.ld(d), li.at(D.k, d), li.ld(d), X, n, false, S.kt);
  add_line_bias(ln, n, li.c, X, maxima ? S.mx : nullptr, lse, ls, inv, D.scale);
}

// The map X [n][n] (times a) rounded to Lp into pb, and transposed into pbt where given.
template <typename Lp>
inline void map_to_lowp(int64_t n, const float* X, Lp* pb, Lp* pbt = nullptr, float a = 1.f) {
  to_lowp(n * n, X, pb, a);
  if (pbt) to_lowp_transposed(n, n, X, n, pbt, n, a);
}

// z (n rows of dv at stride zs, Lp) = P src (P [n][n] in Lp; src: n rows at stride ss), the float32 product (in O,
// [n][dv]) rounded once.
template <typename Lp>
inline void apply_to_lowp(int64_t n, int64_t dv, const Lp* P, const Lp* src, int64_t ss, float* O, Lp* z,
                          int64_t zs) {
  lowp_gemm(n, dv, n, P, n, src, ss, O, dv, false);
  for (int64_t j = 0; j < n; ++j) to_lowp(dv, O + j * dv, z + j * zs);
}

// forward_kernel on the lowp products: lse float32, out in Lp. Per group of pairs (pair_groups), Z: z1, then z2 in
// place (column by column), in Lp, and O1: B z1 in float32, [N][pair][dv] each (GroupLine). The row maps are kept
// in Lp (as rounded for their products) for the groups of pairs of kRowMapBytes, else recomputed from the rows' m
// and 1 / s (the same logits from the same product: the same map). Phase 3 adds A z2 to each row's copy of O1 and
// writes 0.5 times the sum rounded to Lp into out.
template <typename Lp>
void forward_kernel_lowp(const CCData<float, Lp>& D, float* lse, Lp* out) {
  const int64_t BG = D.B * D.G, dv = D.dv, H = D.H, W = D.W, nn = W * W;
  const Groups gr = pair_groups(BG, H, nn, sizeof(Lp), D.N * dv * (sizeof(Lp) + sizeof(float)));
  const int64_t group = gr.size;
  const bool keep = gr.keep;
  auto maps = uninit<Lp>(keep ? group * H * nn : 0);      // the group's row maps in Lp, [pair][row][W][W]
  auto stats = uninit<float>(keep ? 0 : 2 * group * D.N);  // else the rows' m and 1 / s, [N][pair][2]
  auto Z = uninit<Lp>(group * D.N * dv);
  auto O1 = uninit<float>(group * D.N * dv);
  run_phases(
      D, group, [&](int64_t n, const auto& task) { parallel_lines_lowp(D, n, false, task); },
      // Phase 1: rows. A (kept, or its statistics), lse0, z1 = A v.
      [&](auto ln, int64_t u, LineScratchLowp<Lp>& S, const Line<float>& r, const GroupLine& zr) {
        Lp* pb = keep ? maps.get() + u * nn : S.pb;
        line_scores_lowp(ln, D, r, S, S.X, true);
        line_softmax(ln, r.n, S.X, r.at(lse, 2), r.ld(2), S.mx, keep ? nullptr : zr.at(stats.get(), 2), zr.ld(2));
        map_to_lowp(r.n, S.X, pb);
        apply_to_lowp(r.n, dv, pb, r.at(D.v, dv), r.ld(dv), S.O, zr.at(Z.get(), dv), zr.ld(dv));
      },
      // Phase 2: columns. B, lse1, O1 = B z1, then z2 = B v in place of z1.
      [&](auto ln, int64_t, LineScratchLowp<Lp>& S, const Line<float>& c, const GroupLine& zc) {
        line_scores_lowp(ln, D, c, S, S.X, true);
        line_softmax(ln, c.n, S.X, c.at(lse, 2) + 1, c.ld(2), S.mx);
        map_to_lowp(c.n, S.X, S.pb);
        lowp_gemm(c.n, dv, c.n, S.pb, c.n, zc.at(Z.get(), dv), zc.ld(dv), zc.at(O1.get(), dv), zc.ld(dv), false);
        apply_to_lowp(c.n, dv, S.pb, c.at(D.v, dv), c.ld(dv), S.O, zc.at(Z.get(), dv), zc.ld(dv));
      },
      // Phase 3: rows again, A kept or recomputed; out = Lp(0.5 (O1 + A z2)).
      [&](auto ln, int64_t u, LineScratchLowp<Lp>& S, const Line<float>& r, const GroupLine& zr) {
        const Lp* pb = keep ? maps.get() + u * nn : S.pb;
        if (!keep) {
          const float* st = zr.at(stats.get(), 2);
          line_scores_lowp(ln, D, r, S, S.X, false, st, zr.ld(2), st + 1);
          map_to_lowp(r.n, S.X, S.pb);
        }
        gather_rows(r.n, dv, zr.at(O1.get(), dv), zr.ld(dv), S.O, dv);
        lowp_gemm(r.n, dv, r.n, pb, r.n, zr.at(Z.get(), dv), zr.ld(dv), S.O, dv, true);
        for (int64_t j = 0; j < r.n; ++j) to_lowp(dv, S.O + j * dv, r.at(out, dv) + j * r.ld(dv), 0.5f);
      });
}

// g = 0.5 go for n rows of dv (go at stride gs) into dst (row stride ds), in Lp (the halving exact).
template <typename Lp>
inline void half_rows(int64_t n, int64_t dv, const Lp* go, int64_t gs, Lp* __restrict dst, int64_t ds) {
  constexpr int64_t kChunk = 64;
  float t[kChunk];
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e0 = 0; e0 < dv; e0 += kChunk) {
      const int64_t m = std::min(kChunk, dv - e0);
      const Lp* g = go + j * gs + e0;
#pragma omp simd
      for (int64_t e = 0; e < m; ++e) t[e] = 0.5f * static_cast<float>(g[e]);
      to_lowp(m, t, dst + j * ds + e0);
    }
}

// line_grads on the lowp products: the map P (the kept float32 map X where given, else recomputed into S.X from
// lse + side) rounded into S.pb and S.pbt; dP = [g | dz] [z | v]^T (one product over 2 dv), the softmax gradient
// (line_softmax_backward, float32), dq (=|+=) (scale dX) k, dk (=|+=) (scale dX)^T q, grad v (=|+=) P^T dz and the
// line's log-decay gradients. Leaves [g | dz] in S.gu.
template <int L, typename Lp>
inline void line_grads_lowp(Lanes<L> ln, const CCData<float, Lp>& D, const Line<float>& li, LineScratchLowp<Lp>& S,
                            const Lp* go, const float* lse, int side, const GroupLine& zl, const Lp* z, const Lp* dz,
                            float* dq, float* dk, float* gv, float* gdecay, bool accumulate,
                            const float* X = nullptr) {
  const int64_t n = li.n, d = D.d, dv = D.dv;
  if (!X) {
    line_scores_lowp(ln, D, li, S, S.X, false, li.at(lse, 2) + side, li.ld(2));
    X = S.X;
  }
  map_to_lowp(n, X, S.pb, S.pbt);
  half_rows(n, dv, li.at(go, dv), li.ld(dv), S.gu, 2 * dv);  // [g | dz], row stride 2 dv
  gather_rows(n, dv, zl.at(dz, dv), zl.ld(dv), S.gu + dv, 2 * dv);
  gather_rows(n, dv, zl.at(z, dv), zl.ld(dv), S.zv, 2 * dv);  // [z | v]
  gather_rows(n, dv, li.at(D.v, dv), li.ld(dv), S.zv + dv, 2 * dv);
  lowp_gemm_bt(n, n, 2 * dv, S.gu, 2 * dv, S.zv, 2 * dv, S.DX, n, false, S.ut);  // dP = [g | dz] [z | v]^T
  line_softmax_backward(ln, n, X, S.DX, S.gc);
  map_to_lowp(n, S.DX, S.ds, S.dst, D.scale);  // scale dX, and transposed
  lowp_gemm(n, d, n, S.ds, n, li.at(D.k, d), li.ld(d), li.at(dq, d), li.ld(d), accumulate);
  lowp_gemm(n, d, n, S.dst, n, li.at(D.q, d), li.ld(d), li.at(dk, d), li.ld(d), accumulate);
  lowp_gemm(n, dv, n, S.pbt, n, S.gu + dv, 2 * dv, li.at(gv, dv), li.ld(dv), accumulate);
  decay_grads_from_prefix(n, S.gc, 1, gdecay + li.tok, li.ts);
}

// backward_kernel on the lowp products (go: grad_out in Lp). The same phases, groups and kept row maps (float32, for
// the softmax gradient; rounded again for their products, the same bits); ZA, ZB: the group's (z1, dz2) after the
// rows, replaced by (z2, dz1) column by column, in Lp.
template <typename Lp>
void backward_kernel_lowp(const CCData<float, Lp>& D, const Lp* go, const float* lse, float* dq, float* dk,
                          float* dv_out, float* gla, float* glb) {
  const int64_t BG = D.B * D.G, dv = D.dv, H = D.H, W = D.W, nn = W * W;
  const Groups gr = pair_groups(BG, H, nn, sizeof(float), 2 * D.N * dv * sizeof(Lp));
  const int64_t group = gr.size;
  const bool keep = gr.keep;
  auto maps = uninit<float>(keep ? group * H * nn : 0);  // the group's row maps, [pair][row][W][W]
  auto ZA = uninit<Lp>(group * D.N * dv), ZB = uninit<Lp>(group * D.N * dv);
  Lp *za = ZA.get(), *zb = ZB.get();
  run_phases(
      D, group, [&](int64_t n, const auto& task) { parallel_lines_lowp(D, n, true, task); },
      // Phase 1: rows. A (kept where it fits), z1 = A v, dz2 = A^T g.
      [&](auto ln, int64_t u, LineScratchLowp<Lp>& S, const Line<float>& r, const GroupLine& zr) {
        float* X = keep ? maps.get() + u * nn : S.X;
        line_scores_lowp(ln, D, r, S, X, false, r.at(lse, 2), r.ld(2));
        map_to_lowp(r.n, X, S.pb, S.pbt);
        apply_to_lowp(r.n, dv, S.pb, r.at(D.v, dv), r.ld(dv), S.O, zr.at(za, dv), zr.ld(dv));
        half_rows(r.n, dv, r.at(go, dv), r.ld(dv), S.gu, dv);
        apply_to_lowp(r.n, dv, S.pbt, S.gu, dv, S.O, zr.at(zb, dv), zr.ld(dv));
      },
      // Phase 2: columns. dB = g z1^T + dz2 v^T; column grads; grad log_beta; then z2 = B v and dz1 = B^T g
      // replace z1 and dz2 of this column.
      [&](auto ln, int64_t, LineScratchLowp<Lp>& S, const Line<float>& c, const GroupLine& zc) {
        line_grads_lowp(ln, D, c, S, go, lse, 1, zc, za, zb, dq, dk, dv_out, glb, false);
        apply_to_lowp(c.n, dv, S.pb, c.at(D.v, dv), c.ld(dv), S.O, zc.at(za, dv), zc.ld(dv));
        apply_to_lowp(c.n, dv, S.pbt, S.gu, 2 * dv, S.O, zc.at(zb, dv), zc.ld(dv));
      },
      // Phase 3: rows. dA = g z2^T + dz1 v^T; the row parts are added to the column parts; grad log_alpha.
      [&](auto ln, int64_t u, LineScratchLowp<Lp>& S, const Line<float>& r, const GroupLine& zr) {
        line_grads_lowp(ln, D, r, S, go, lse, 0, zr, za, zb, dq, dk, dv_out, gla, true,
                        keep ? static_cast<const float*>(maps.get() + u * nn) : static_cast<const float*>(nullptr));
      });
}

constexpr const char* kOp = "criss_cross_attention";
constexpr const char* kOpBwd = "criss_cross_attention_backward";

// The kernels' view of the contiguous inputs qc, kc, vc: of the accumulation dtype T (I = T), bf16 read as their
// bits (I = uint16_t, T = float; widened as each line is gathered), or bf16 / fp16 for the lowp kernels (I = Lp,
// T = float).
template <typename T, typename I = T>
CCData<T, I> make_data(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& cr,
                       const at::Tensor& cct, double scale) {
  auto in = [](const at::Tensor& t) -> const I* {
    if constexpr (std::is_same<T, I>::value) {
      return t.data_ptr<T>();
    } else {
      return static_cast<const I*>(t.data_ptr());
    }
  };
  return CCData<T, I>{in(qc),     in(kc),     in(vc),     cr.data_ptr<T>(), cct.data_ptr<T>(), qc.size(0),
                      qc.size(3), qc.size(1), qc.size(2), qc.size(1) * qc.size(2), qc.size(4), vc.size(4),
                      static_cast<T>(scale)};
}

// Inputs for the float kernels: bf16 ones as they are (contiguous; read as bits and widened line by line, no
// float32 copy), others converted to the accumulation dtype (no-ops for contiguous inputs of that dtype).
at::Tensor kernel_input(const at::Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == at::kBFloat16 ? t.contiguous() : t.to(acc).contiguous();
}

std::tuple<at::Tensor, at::Tensor> criss_cross_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& log_alpha,
                                                             const at::Tensor& log_beta, double scale) {
  check_inputs(kOp, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), dv = v.size(4);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor out = at::empty({B, H, W, G, dv}, opts);
  at::Tensor lse = at::empty({B, H, W, G, 2}, opts);
  if (out.numel() > 0 && lowp_inputs(q, k, v)) {
    // bf16 / fp16 q, k, v read in place on the lowp products; out in their dtype.
    at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    auto [cr, cct] = prefix_sums(log_alpha, log_beta, acc, /*columns_major=*/true);
    at::Tensor outl = at::empty({B, H, W, G, dv}, v.options());
    dispatch_lowp(q.scalar_type(), [&](auto tag) {
      using Lp = decltype(tag);
      forward_kernel_lowp<Lp>(make_data<float, Lp>(qc, kc, vc, cr, cct, scale), lse.data_ptr<float>(),
                              static_cast<Lp*>(outl.data_ptr()));
    });
    return {outl, lse};
  }
#ifdef PPMA_SIMD_X86
  if (out.numel() > 0 && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
      v.scalar_type() == at::kBFloat16 && cpu_bf16_dot()) {
    // The bf16 inputs read in place (contiguous: a no-op for the usual layout); Z holds z1 and z2 in bf16.
    at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    auto [cr, cct] = prefix_sums(log_alpha, log_beta, acc, /*columns_major=*/true);
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    CCData<float> D{nullptr,     nullptr, nullptr, cr.data_ptr<float>(), cct.data_ptr<float>(), B, G, H, W, H * W,
                    q.size(4), dv,      static_cast<float>(scale)};
    at::Tensor outb = at::empty({B, H, W, G, dv}, q.options());
    forward_kernel_bf16(D, CCBf16{bits(qc), bits(kc), bits(vc)}, lse.data_ptr<float>(),
                        reinterpret_cast<uint16_t*>(outb.data_ptr<at::BFloat16>()));
    return {outb, lse};
  }
#endif
  if (out.numel() > 0) {
    at::Tensor qc = kernel_input(q, acc), kc = kernel_input(k, acc), vc = kernel_input(v, acc);
    auto [cr, cct] = prefix_sums(log_alpha, log_beta, acc, /*columns_major=*/true);
    if (q.scalar_type() == at::kBFloat16) {
      forward_kernel(make_data<float, uint16_t>(qc, kc, vc, cr, cct, scale), out.data_ptr<float>(),
                     lse.data_ptr<float>());
    } else {
      AT_DISPATCH_FLOATING_TYPES(acc, "ppma_criss_cross_attention_cpu", [&] {
        forward_kernel(make_data<scalar_t>(qc, kc, vc, cr, cct, scale), out.data_ptr<scalar_t>(),
                       lse.data_ptr<scalar_t>());
      });
    }
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
  // Every element is written by the column phase (each token lies in exactly one column); an empty grid
  // (heads and head dims are positive) leaves only empty outputs.
  at::Tensor dq = at::empty({B, H, W, G, d}, opts), dk = at::empty_like(dq);
  at::Tensor dv_ = at::empty({B, H, W, G, dv}, opts);
  at::Tensor gla = at::empty({B, H, W, G}, opts), glb = at::empty_like(gla);
  if (dq.numel() > 0 && lowp_inputs(q, k, v)) {
    // bf16 / fp16 q, k, v and grad_out (in their dtype) read in place on the lowp products.
    at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    at::Tensor gol = grad_out.to(q.scalar_type()).contiguous(), lsec = lse.to(acc).contiguous();
    auto [cr, cct] = prefix_sums(log_alpha, log_beta, acc, /*columns_major=*/true);
    dispatch_lowp(q.scalar_type(), [&](auto tag) {
      using Lp = decltype(tag);
      backward_kernel_lowp<Lp>(make_data<float, Lp>(qc, kc, vc, cr, cct, scale), static_cast<const Lp*>(gol.data_ptr()),
                               lsec.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(),
                               dv_.data_ptr<float>(), gla.data_ptr<float>(), glb.data_ptr<float>());
    });
  } else if (dq.numel() > 0) {
    at::Tensor qc = kernel_input(q, acc), kc = kernel_input(k, acc), vc = kernel_input(v, acc);
    at::Tensor goc = grad_out.to(acc).contiguous(), lsec = lse.to(acc).contiguous();
    auto [cr, cct] = prefix_sums(log_alpha, log_beta, acc, /*columns_major=*/true);
    if (q.scalar_type() == at::kBFloat16) {
      backward_kernel(make_data<float, uint16_t>(qc, kc, vc, cr, cct, scale), goc.data_ptr<float>(),
                      lsec.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(), dv_.data_ptr<float>(),
                      gla.data_ptr<float>(), glb.data_ptr<float>());
    } else {
      AT_DISPATCH_FLOATING_TYPES(acc, "ppma_criss_cross_attention_backward_cpu", [&] {
        backward_kernel(make_data<scalar_t>(qc, kc, vc, cr, cct, scale), goc.data_ptr<scalar_t>(),
                        lsec.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                        dv_.data_ptr<scalar_t>(), gla.data_ptr<scalar_t>(), glb.data_ptr<scalar_t>());
      });
    }
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
