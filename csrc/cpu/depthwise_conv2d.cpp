// CPU kernels of the depthwise k x k convolution (stride 1, padding k // 2, odd k) on channels-last maps, the
// convolution of the LePE, CPE and FFN of every PPMA block (ppma.nn.DWConv2d; docs/ops.md "depthwise_conv2d").
//
// ppma::depthwise_conv2d_residual_ (inference; float32, or bf16 maps with float32 math): x <- x + conv(x) in place,
// the FFN's hidden map (docs/model.md §4), so that no second map of the FFN's width is allocated beside it:
//   y[b, h, w, c] = (bias[c] + x[b, h, w, c]) + sum_{i, j} weight[c, i, j] * x[b, h + i - k // 2, w + j - k // 2, c]
// with x zero outside the map and the taps added in row-major order, in float32 (a bf16 map is widened as its rows
// are kept, and each output is rounded to bf16 once, to nearest even). Every task owns one batch element and a
// slot of up to kMaxSlot channels (all the slots of one element in turn where there are at least as many elements
// as threads: parallel_image_tasks, cpu/utils.h) and walks its rows top to bottom, keeping the original values of
// the k rows around the current one in a ring of zero-padded rows (per-thread scratch) before it overwrites that
// row. Each output is written by one task in one fixed order: deterministic and independent of the thread count.
//
// ppma::gelu_depthwise_conv2d_residual_forward (training; float32, or bf16 maps with float32 weight and bias under
// bf16 autocast, float32 math and each output rounded once): out = a + conv(a) + bias with a = GELU(h), the
// same ring walk from h into a new map, GELU applied to each row as it enters the ring (docs/ops.md
// "gelu_depthwise_conv2d_residual"; its backward is the last kernel of this file).
//
// ppma::depthwise_conv2d_backward: the weight and bias gradients
//   grad_weight[c, 0, i, j] = sum_{b, h, w} grad_out[b, h, w, c] * x[b, h + i - k // 2, w + j - k // 2, c]
//   grad_bias[c]            = sum_{b, h, w} grad_out[b, h, w, c]
// (x zero outside the map). One pass over grad_out and x: every task owns a group of channels and sums its
// k * k + 1 partial vectors over a fixed chunk of rows, and the chunks are added in a fixed order, so the result
// does not depend on the thread count. torch's CPU backward of a 5 x 5 depthwise convolution takes 10-35x its
// forward (PPMA-T's LePE shapes); this pass about 1.5x (row_taps: the sums of a tap row in registers). bf16 maps
// (bf16 autocast, float32 parameters) are widened as they are read; the sums and gradients are float32.
//
// Under bf16 autocast the training kernels read and write bf16 maps and keep every sum in float32 with the float32
// weight and bias (docs/ops.md "depthwise_conv2d", "gelu_depthwise_conv2d_residual"): each bf16 output (the FFN
// middle's output and its input gradient) is rounded once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "cpu/simd.h"
#include "cpu/overlap.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

// Channels per vector block: one 16-lane vector of floats (two of the 8-lane path, four of the 4-lane one).
constexpr int64_t CB = 16;
// Channels of a slot of the residual convolution's rings, at most (a multiple of CB).
constexpr int64_t kMaxSlot = 64;

// The maps' element types: float, double, or the bits of bf16 (uint16_t), which are widened to float exactly as
// they are read and rounded once (to nearest even) where an output is stored; the sums are float (double for
// double maps).
inline float widen(uint16_t v) { return bf16_to_float(v); }
inline float widen(float v) { return v; }
inline double widen(double v) { return v; }
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = float_to_bf16(v); }

// Asks the cache for the lines holding the n elements at p (software prefetch). The residual convolution's ring
// reads a slot of a position's channels (a part of its lines) from every position of a row, which the hardware
// prefetchers served late: each ring row now asks for the same slot of the next row while it is copied. PPMA-T's
// FFN convolutions (b8@224, 2 threads, AMD EPYC Zen 4, in-process alternating rounds) ran 1.4x faster on bf16 maps
// with it, 1.15x on float32 maps. (The training backward's rings, one 16-channel block a task, showed no gain.)
template <typename X>
inline void prefetch_lines(const X* p, int64_t n) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
  const uintptr_t last = reinterpret_cast<uintptr_t>(p + n) - 1;
  for (uintptr_t a = first; a <= last; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a));
}

// Adds g[c] * x[c] to acc[c] for the n <= CB channels of a block: whole vectors of the task's lane width for a
// full block of float sums (float or bf16 maps), a plain loop otherwise (double, the last block of a C that is not
// a multiple of CB).
template <int L, typename T, typename X>
PPMA_SIMD_INLINE void fma_block(Lanes<L>, int64_t n, const X* __restrict g, const X* __restrict x,
                                T* __restrict acc) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == CB) {
      for (int64_t c = 0; c < CB; c += L)
        store<L>(acc + c, load<L>(acc + c) + load_map<L>(g + c) * load_map<L>(x + c));
      return;
    }
  }
  for (int64_t c = 0; c < n; ++c) acc[c] += widen(g[c]) * widen(x[c]);
}

// Adds g[c] to acc[c] for the n <= CB channels of a block (the bias gradient).
template <int L, typename T, typename X>
PPMA_SIMD_INLINE void add_block(Lanes<L>, int64_t n, const X* __restrict g, T* __restrict acc) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == CB) {
      for (int64_t c = 0; c < CB; c += L) store<L>(acc + c, load<L>(acc + c) + load_map<L>(g + c));
      return;
    }
  }
  for (int64_t c = 0; c < n; ++c) acc[c] += widen(g[c]);
}

// Channels per task group (CG / CB blocks; the k * k + 1 sums of a group stay in L1) and the fixed number of
// row chunks the B * H rows are split into (partial sums added in chunk order afterwards): the split depends on
// the shapes only, never on the thread count.
constexpr int64_t CG = 1024;
// Floats between the sums of two taps: CG plus one block, so that the taps' sums do not share cache sets.
constexpr int64_t CS = CG + CB;
constexpr int64_t kChunks = 8;

// One row's taps for one full block of CB float channels, the sums in registers: for every tap row i whose input
// row xr[i] exists (null: outside the map), acc[(i * K + j) * ts + c] += sum_w g[w][c] * xr[i][w + j - P][c] over
// the row's W positions (x zero outside it; g and x rows at stride C per position), and ab[c] += sum_w g[w][c].
// Each vector of channels keeps its K sums of a tap row in registers while it walks the row (one load of x and one
// FMA per tap and position), instead of loading and storing the sums at every position. KC = K at compile time
// (3, 5 or 7). X: float, or bf16 bits (widened as they are loaded).
template <int KC, int L, typename X>
PPMA_SIMD_INLINE void row_taps(Lanes<L>, int64_t W, int64_t C, const X* g, const X* const* xr, float* acc,
                               int64_t ts, float* ab) {
  constexpr int64_t P = KC / 2;
  const int64_t lo = std::min<int64_t>(P, W), hi = std::max<int64_t>(lo, W - P);  // all taps inside for [lo, hi)
  for (int64_t c = 0; c < CB; c += L) {
    vec<L> sb = load<L>(ab + c);
    for (int64_t w = 0; w < W; ++w) sb += load_map<L>(g + w * C + c);
    store<L>(ab + c, sb);
    for (int64_t i = 0; i < KC; ++i) {
      if (!xr[i]) continue;
      const X* x = xr[i] + c;
      vec<L> a[KC];
      for (int64_t j = 0; j < KC; ++j) a[j] = vec<L>{};
      auto edge = [&](int64_t w) {  // a position near the row's ends: only the taps inside it
        const vec<L> gv = load_map<L>(g + w * C + c);
        for (int64_t j = 0; j < KC; ++j) {
          const int64_t u = w + j - P;
          if (u >= 0 && u < W) a[j] += gv * load_map<L>(x + u * C);
        }
      };
      for (int64_t w = 0; w < lo; ++w) edge(w);
      for (int64_t w = lo; w < hi; ++w) {
        const vec<L> gv = load_map<L>(g + w * C + c);
        const X* xw = x + (w - P) * C;
        for (int64_t j = 0; j < KC; ++j) a[j] += gv * load_map<L>(xw + j * C);
      }
      for (int64_t w = hi; w < W; ++w) edge(w);
      float* ar = acc + i * KC * ts + c;
      for (int64_t j = 0; j < KC; ++j) store<L>(ar + j * ts, load<L>(ar + j * ts) + a[j]);
    }
  }
}

// gw[c][ij] (ij < KK) and gb[c] (ij == KK) = the sum of n partial sums, added in order p = 0, 1, ...: the one of
// channel c at part[at(c) + p * ps + ij * is] (the tasks' sums of weight_grad and of the FFN-middle backward).
template <typename T, typename At>
void sum_partials(const T* part, int64_t C, int64_t KK, int64_t n, int64_t ps, int64_t is, const At& at, T* gw,
                  T* gb) {
  for (int64_t c = 0; c < C; ++c) {
    const T* pc = part + at(c);
    for (int64_t ij = 0; ij <= KK; ++ij) {
      T s = 0;
      for (int64_t p = 0; p < n; ++p) s += pc[p * ps + ij * is];
      if (ij < KK) {
        gw[c * KK + ij] = s;
      } else {
        gb[c] = s;
      }
    }
  }
}

// go, x: [B, H, W, C] contiguous, of X (T, or bf16 bits with T = float); gw: [C, K, K]; gb: [C], of T. Full float
// blocks with k = 3, 5 or 7 run row_taps; the rest (double, a last block of fewer than CB channels, other k) sums
// position by position.
template <typename T, typename X = T>
void weight_grad(const X* go, const X* x, int64_t B, int64_t H, int64_t W, int64_t C, int64_t K, T* gw, T* gb) {
  const int64_t P = K / 2, KK = K * K, ngrp = ceil_div(C, CG), R = B * H;
  const int64_t nchunk = std::min(R, kChunks), rows_per = ceil_div(R, nchunk);
  const int64_t psize = (KK + 1) * CS;
  std::vector<T> part(ngrp * nchunk * psize, T(0));
  parallel_tasks(
      ngrp * nchunk, [] { return 0; },
      [&](int64_t t, int) {
    with_lanes([&](auto ln) {
      const int64_t grp = t / nchunk, chunk = t % nchunk;
      const int64_t cg0 = grp * CG, cgn = std::min(CG, C - cg0);
      T* acc = part.data() + t * psize;  // [KK + 1][CS]: the taps, then the bias
      T* ab = acc + KK * CS;
      const int64_t r0 = chunk * rows_per, r1 = std::min(R, (chunk + 1) * rows_per);
      for (int64_t c = 0; c < cgn; c += CB) {
        const int64_t n = std::min(CB, cgn - c);
        if constexpr (std::is_same_v<T, float>) {
          if (n == CB && (K == 3 || K == 5 || K == 7)) {
            const X* xr[7];
            for (int64_t r = r0; r < r1; ++r) {
              const int64_t b = r / H, h = r % H;
              for (int64_t i = 0; i < K; ++i) {
                const int64_t hi = h + i - P;
                xr[i] = hi < 0 || hi >= H ? nullptr : x + (b * H + hi) * W * C + cg0 + c;
              }
              const X* gp = go + r * W * C + cg0 + c;
              if (K == 3) {
                row_taps<3>(ln, W, C, gp, xr, acc + c, CS, ab + c);
              } else if (K == 5) {
                row_taps<5>(ln, W, C, gp, xr, acc + c, CS, ab + c);
              } else {
                row_taps<7>(ln, W, C, gp, xr, acc + c, CS, ab + c);
              }
            }
            continue;
          }
        }
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = r / H, h = r % H;
          const int64_t i0 = std::max<int64_t>(0, P - h), i1 = std::min<int64_t>(K, H + P - h);
          for (int64_t w = 0; w < W; ++w) {
            const X* gp = go + (r * W + w) * C + cg0;
            const int64_t j0 = std::max<int64_t>(0, P - w), j1 = std::min<int64_t>(K, W + P - w);
            add_block(ln, n, gp + c, ab + c);
            for (int64_t i = i0; i < i1; ++i) {
              const X* xr = x + ((b * H + h + i - P) * W + (w - P)) * C + cg0 + c;
              T* ar = acc + i * K * CS + c;
              for (int64_t j = j0; j < j1; ++j) fma_block(ln, n, gp + c, xr + j * C, ar + j * CS);
            }
          }
        }
      }
    });
  });
  // The chunks' partial sums in chunk order.
  sum_partials(part.data(), C, KK, nchunk, psize, CS,
               [&](int64_t c) { return (c / CG) * nchunk * psize + c % CG; }, gw, gb);
}

// ---------------------------------------------------------------------------------------------------------------
// GELU(x) = x Phi(x) and GELU'(x) = Phi(x) + x phi(x) of float lanes, Phi(x) = (1 + erf(x / sqrt 2)) / 2 and
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi): erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, the formula of
// torch's vectorised CPU erf), whose exp(-z^2) is phi's exp.
template <int L>
PPMA_SIMD_INLINE void gelu_and_grad(vec<L> x, vec<L>& a, vec<L>& d) {
  using V = vec<L>;
  using I = ivec<L>;
  const V z = x * 0.70710678118654752f;
  I zb;
  std::memcpy(&zb, &z, sizeof(V));
  const I sign = zb & (I{} + int32_t(0x80000000u)), ab = zb & (I{} + 0x7fffffff);
  V az;
  std::memcpy(&az, &ab, sizeof(V));
  const V t = 1.0f / (az * 0.3275911f + 1.0f);
  V r = t * 1.061405429f - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  const V e = fast_exp<L>(V{} - z * z);  // exp(-x^2 / 2)
  const V erf_abs = 1.0f - r * t * e;
  I eb;
  std::memcpy(&eb, &erf_abs, sizeof(V));
  eb |= sign;
  V erf;
  std::memcpy(&erf, &eb, sizeof(V));
  const V phi_cdf = erf * 0.5f + 0.5f;
  a = x * phi_cdf;
  d = phi_cdf + x * e * 0.39894228040143268f;
}

// GELU and GELU' of a double (std::erf, exact to double rounding).
inline void gelu_and_grad(double x, double& a, double& d) {
  const double cdf = 0.5 * (1.0 + std::erf(x * 0.70710678118654752440));
  a = x * cdf;
  d = cdf + x * std::exp(-0.5 * x * x) * 0.39894228040143267794;
}

// GELU and GELU' of a single float (the direct path): the double values, rounded.
inline void gelu_and_grad(float x, float& a, float& d) {
  double ad, dd;
  gelu_and_grad(double(x), ad, dd);
  a = float(ad), d = float(dd);
}

// The residual convolution (in place, or from GELU(h) into another map). A task owns one batch element and a slot of
// up to kMaxSlot channels (four 64-byte lines of a position). A ring slot is one original row of the task's
// channels, zero-padded by P = k / 2 columns on each side and to cw channels: [W + 2P][cw]; row r lives in slot r % k.

// One output row: out[w * C + c] = bb[c] + centre[w][c] + sum_{i, j} wt[i * k + j][c] * rows[i][w + j][c] for the
// n <= cw channels of a slot of cw channels (a multiple of CB; rows[i]: the padded slot of input row h + i - P, or
// a zero row), stored as O (float, or the bits of bf16). KC: k when known at compile time, 0 for any k.
// Positions run in register blocks of UW (8 at 16 lanes, 4 below; 7 where W is a multiple of 7), then of 4 and 2, the
// last one alone: each tap row's UW + k - 1 input vectors are loaded once for the UW * k products (oneDNN's
// depthwise blocking). Every output adds its taps in the same order (bias + centre, then row-major), whatever the
// blocking.
template <int KC, int L, typename O>
PPMA_SIMD_INLINE void residual_row(Lanes<L>, int64_t W, int64_t C, int64_t kr, const float* const* rows,
                                   const float* centre, const float* wt, const float* bb, int64_t cw, int64_t n,
                                   O* out) {
  constexpr int UW = L >= 16 ? 8 : 4;
  const int64_t K = KC ? KC : kr;
  constexpr bool direct = std::is_same_v<O, float>;
  const bool direct_rows = n == cw;  // whole rows straight into out, float or bf16 (else staged in tmp)
  float tmp[UW * kMaxSlot];
  // The uw positions from w0 staged in tmp (row stride cw) go to out: the n < cw channels of a last, partial slot.
  auto flush = [&](int64_t w0, int64_t uw) {
    for (int64_t u = 0; u < uw; ++u) {
      const float* t = tmp + u * cw;
      O* o = out + (w0 + u) * C;
      if constexpr (direct) {
        std::memcpy(o, t, n * sizeof(float));
      } else {
        for (int64_t c = 0; c < n; ++c) o[c] = float_to_bf16(t[c]);
      }
    }
  };
  // UB positions from w0, every channel vector of the slot.
  auto block = [&](auto ub, int64_t w0) {
    constexpr int UB = decltype(ub)::value;
    for (int64_t c = 0; c < cw; c += L) {
      vec<L> acc[UB];
      for (int u = 0; u < UB; ++u) acc[u] = load<L>(bb + c) + load<L>(centre + (w0 + u) * cw + c);
      for (int64_t i = 0; i < K; ++i) {
        const float* r = rows[i] + w0 * cw + c;
        const float* t = wt + i * K * cw + c;
        if constexpr (KC > 0) {
          vec<L> x[UB + KC - 1];
          for (int m = 0; m < UB + KC - 1; ++m) x[m] = load<L>(r + m * cw);
          for (int j = 0; j < KC; ++j) {
            const vec<L> tj = load<L>(t + j * cw);
            for (int u = 0; u < UB; ++u) acc[u] += tj * x[u + j];
          }
        } else {
          for (int64_t j = 0; j < K; ++j) {
            const vec<L> tj = load<L>(t + j * cw);
            for (int u = 0; u < UB; ++u) acc[u] += tj * load<L>(r + (u + j) * cw);
          }
        }
      }
      for (int u = 0; u < UB; ++u) {
        if (direct_rows) {  // whole rows straight into out (bf16: each sum rounded as it is stored)
          store_map<L>(out + (w0 + u) * C + c, acc[u]);
        } else {
          store<L>(tmp + u * cw + c, acc[u]);
        }
      }
    }
    if (!direct_rows) flush(w0, UB);
  };
  int64_t w0 = 0;
  if (UW == 8 && W % 7 == 0) {  // PPMA's maps at 224² (56, 28, 14, 7 columns): blocks of 7, no remainder
    for (; w0 < W; w0 += 7) block(std::integral_constant<int, 7>{}, w0);
  }
  for (; w0 + UW <= W; w0 += UW) block(std::integral_constant<int, UW>{}, w0);
  if (UW > 4 && w0 + 4 <= W) block(std::integral_constant<int, 4>{}, w0), w0 += 4;
  if (w0 + 2 <= W) block(std::integral_constant<int, 2>{}, w0), w0 += 2;
  if (w0 < W) block(std::integral_constant<int, 1>{}, w0);
}

// dst = src + conv(src) + bias, or with gelu dst = a + conv(a) + bias for a = GELU(src) (the FFN's middle in
// training, gelu_depthwise_conv2d_residual_forward; a bf16 src is widened first, GELU in float32). src, dst: [B, H, W, C] contiguous (float, or bf16
// bits as uint16_t), the same map for the in-place op (the ring keeps the rows it still needs before they are
// overwritten); weight: [C, K, K]; bias: [C] or null.
template <typename X>
void residual_conv(const X* src, X* dst, const float* weight, const float* bias, int64_t B, int64_t H, int64_t W,
                   int64_t C, int64_t K, bool gelu = false) {
  const int64_t P = K / 2, cw = std::min(kMaxSlot, ceil_div(C, CB) * CB), nblk = ceil_div(C, cw);
  const int64_t slot = (W + 2 * P) * cw;
  // Task t: slot t % nblk of batch element t / nblk, grouped per element where there are enough elements
  // (parallel_image_tasks); each slot's outputs are the same either way.
  auto run_slot = [&](int64_t t, std::vector<float>& buf) {
    std::fill(buf.begin(), buf.end(), 0.0f);  // the padding columns and channels, the zero row
    const int64_t b = t / nblk, c0 = (t % nblk) * cw, n = std::min(cw, C - c0);
    float* ring = buf.data();
    const float* zero = ring + K * slot;
    float* wt = ring + (K + 1) * slot;  // [K * K][cw] the slot's taps
    float* bb = wt + K * K * cw;        // [cw] its bias
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t ij = 0; ij < K * K; ++ij) wt[ij * cw + c] = weight[(c0 + c) * K * K + ij];
      bb[c] = bias ? bias[c0 + c] : 0.0f;
    }
    const X* sb = src + b * H * W * C + c0;
    X* db = dst + b * H * W * C + c0;
    auto keep_row = [&](auto ln, int64_t r) {  // the source row r into its slot (widened to float; GELU applied)
      constexpr int L = decltype(ln)::value;
      // locals, so that the loops below keep them in registers (the stores may alias the captures)
      const int64_t Wl = W, Cl = C, cwl = cw, nl = n;
      float* __restrict s = ring + (r % K) * slot + P * cwl;
      const X* __restrict sr = sb + r * Wl * Cl;
      const bool ahead = r + 1 < H;  // the same slot of the next row, asked for while this one is copied
      for (int64_t w = 0; w < Wl; ++w) {
        if (ahead) prefetch_lines(sr + (Wl + w) * Cl, nl);
        if constexpr (std::is_same_v<X, float>) {
          if (nl == cwl) {
            for (int64_t c = 0; c < cwl; c += L) store<L>(s + w * cwl + c, load<L>(sr + w * Cl + c));
          } else {
            std::memcpy(s + w * cwl, sr + w * Cl, nl * sizeof(float));
          }
        } else if (nl == cwl) {
          for (int64_t c = 0; c < cwl; c += L) store<L>(s + w * cwl + c, load_bf16<L>(sr + w * Cl + c));
        } else {
          for (int64_t c = 0; c < nl; ++c) s[w * cwl + c] = bf16_to_float(sr[w * Cl + c]);
        }
      }
      if (gelu) {  // in the slot (padding channels: GELU(0) = 0)
        for (int64_t e = 0; e < Wl * cwl; e += L) {
          vec<L> a, d;
          gelu_and_grad<L>(load<L>(s + e), a, d);
          store<L>(s + e, a);
        }
      }
    };
    std::vector<const float*> rows(K);
    with_lanes([&](auto ln) {
      for (int64_t r = 0; r < std::min(P, H); ++r) keep_row(ln, r);
      for (int64_t h = 0; h < H; ++h) {
        if (h + P < H) keep_row(ln, h + P);  // into the slot of row h - P - 1, no longer needed
        for (int64_t i = 0; i < K; ++i) {
          const int64_t r = h + i - P;
          rows[i] = r < 0 || r >= H ? zero : ring + (r % K) * slot;
        }
        const float* centre = ring + (h % K) * slot + P * cw;
        if (K == 3) {
          residual_row<3>(ln, W, C, K, rows.data(), centre, wt, bb, cw, n, db + h * W * C);
        } else if (K == 5) {
          residual_row<5>(ln, W, C, K, rows.data(), centre, wt, bb, cw, n, db + h * W * C);
        } else {
          residual_row<0>(ln, W, C, K, rows.data(), centre, wt, bb, cw, n, db + h * W * C);
        }
      }
    });
  };
  parallel_image_tasks(B, nblk, [&] { return std::vector<float>((K + 1) * slot + (K * K + 1) * cw); }, run_slot);
}

// ---------------------------------------------------------------------------------------------------------------
// The backward of the FFN's middle, out = a + conv(a) + bias with a = GELU(h) (exact, erf) (docs/ops.md
// "gelu_depthwise_conv2d_residual"): given g = grad_out,
//   grad_h[p]     = GELU'(h[p]) * (g[p] + sum_{i, j} weight[c, i, j] * g[p - (i - P, j - P)])
//   grad_weight   = sum_p g[p] * a[p + (i - P, j - P)],   grad_bias = sum_p g[p]
// (maps zero outside), a and GELU' recomputed from h, so that the forward keeps h only. One pass over g and h,
// writing grad_h: every task owns one batch element and a block of CB channels (grouped per element:
// parallel_image_tasks, cpu/utils.h) and walks its rows top to bottom with rings of the k rows of g and of a
// around the current one (zero-padded, per-thread scratch) and of GELU';
// its weight and bias sums go to its own slot, added over the batch in a fixed order afterwards: deterministic
// and independent of the thread count.

// k = 3, 5 or 7. g, h: [B, H, W, C] of X (float, or bf16 bits: widened as their rows enter the rings); weight
// [C, K, K] float; gh: [B, H, W, C] of X (bf16: each value rounded once); part: [B][nblk][K * K + 1][CB] float.
template <int KC, typename X>
void gelu_residual_backward_rings(const X* g, const X* hx, const float* weight, int64_t B, int64_t H, int64_t W,
                                  int64_t C, X* gh, float* part) {
  constexpr int64_t K = KC, P = KC / 2, KK = KC * KC;
  const int64_t nblk = ceil_div(C, CB), slot = (W + 2 * P) * CB;
  parallel_image_tasks(
      B, nblk, [&] { return std::vector<float>((3 * K + 1) * slot + (KK + 1) * CB + W * CB); },
      [&](int64_t t, std::vector<float>& buf) {
    std::fill(buf.begin(), buf.end(), 0.0f);  // the padding columns and channels, the zero row
    const int64_t b = t / nblk, c0 = (t % nblk) * CB, n = std::min(CB, C - c0);
    float* ga = buf.data();               // K slots: rows of g
    float* ra = ga + K * slot;            // K slots: rows of a = GELU(h)
    float* rd = ra + K * slot;            // K slots: rows of GELU'(h)
    const float* zero = rd + K * slot;    // a zero row
    float* wf = rd + (K + 1) * slot;      // [K * K][CB] the block's taps flipped (the input gradient's)
    float* tmp = wf + KK * CB;            // [W][CB] a row of the input gradient before GELU'
    float* acc = part + t * (KK + 1) * CB;  // [K * K][CB] the weight sums, then [CB] the bias sums
    for (int64_t c = 0; c < n; ++c)
      for (int64_t ij = 0; ij < KK; ++ij) wf[(KK - 1 - ij) * CB + c] = weight[(c0 + c) * KK + ij];
    const X* gb = g + b * H * W * C + c0;
    const X* hb = hx + b * H * W * C + c0;
    X* ob = gh + b * H * W * C + c0;
    const float bb[CB] = {};
    with_lanes([&](auto ln) {
      constexpr int L = decltype(ln)::value;
      auto keep_row = [&](int64_t r) {  // row r of g, a and GELU' into their slots (channels past n stay 0)
        float* sg = ga + (r % K) * slot + P * CB;
        float* sa = ra + (r % K) * slot + P * CB;
        float* sd = rd + (r % K) * slot + P * CB;
        const X* gr = gb + r * W * C;
        const X* hr = hb + r * W * C;
        if (n < CB) {  // the last block: its channels into the zero-padded slots first (widened), GELU in place
          for (int64_t w = 0; w < W; ++w) {
            for (int64_t c = 0; c < n; ++c) sg[w * CB + c] = widen(gr[w * C + c]), sa[w * CB + c] = widen(hr[w * C + c]);
          }
          for (int64_t e = 0; e < W * CB; e += L) {
            vec<L> a, d;
            gelu_and_grad<L>(load<L>(sa + e), a, d);
            store<L>(sa + e, a);
            store<L>(sd + e, d);
          }
          return;
        }
        for (int64_t w = 0; w < W; ++w) {
          for (int64_t c = 0; c < CB; c += L) {
            vec<L> a, d;
            store<L>(sg + w * CB + c, load_map<L>(gr + w * C + c));
            gelu_and_grad<L>(load_map<L>(hr + w * C + c), a, d);
            store<L>(sa + w * CB + c, a);
            store<L>(sd + w * CB + c, d);
          }
        }
      };
      for (int64_t r = 0; r < std::min(P, H); ++r) keep_row(r);
      const float* rows_g[K];
      const float* rows_a[K];
      for (int64_t y = 0; y < H; ++y) {
        if (y + P < H) keep_row(y + P);  // into the slots of row y - P - 1, no longer needed
        for (int64_t i = 0; i < K; ++i) {
          const int64_t r = y + i - P;
          const bool in = r >= 0 && r < H;
          rows_g[i] = in ? ga + (r % K) * slot : zero;
          rows_a[i] = in ? ra + (r % K) * slot + P * CB : nullptr;
        }
        const float* gc = ga + (y % K) * slot + P * CB;
        // the weight and bias sums: g's row against the rows of a around it
        row_taps<KC>(ln, W, CB, gc, rows_a, acc, CB, acc + KK * CB);
        // the input gradient of a + conv(a): g + the flipped taps over the rows of g around it; times GELU'
        residual_row<KC>(ln, W, CB, K, rows_g, gc, wf, bb, CB, CB, tmp);
        const float* dr = rd + (y % K) * slot + P * CB;
        X* o = ob + y * W * C;
        for (int64_t w = 0; w < W; ++w) {
          if (n == CB) {
            for (int64_t c = 0; c < CB; c += L)
              store_map<L>(o + w * C + c, load<L>(tmp + w * CB + c) * load<L>(dr + w * CB + c));
          } else {
            for (int64_t c = 0; c < n; ++c) put(o + w * C + c, tmp[w * CB + c] * dr[w * CB + c]);
          }
        }
      }
    });
  });
}

// Any k and dtype, position by position (double; float with k other than 3, 5, 7): each task owns one channel, forms
// GELU and GELU' of its h once, and sums over its batch elements, rows and columns in that order.
template <typename T>
void gelu_residual_backward_direct(const T* g, const T* hx, const T* weight, int64_t B, int64_t H, int64_t W,
                                   int64_t C, int64_t K, T* gh, T* gw, T* gbias) {
  const int64_t P = K / 2, KK = K * K, N = H * W;
  parallel_tasks(
      C, [&] { return std::vector<T>(2 * N); },
      [&](int64_t c, std::vector<T>& ad) {  // one image's GELU(h) and GELU'(h) of channel c
    std::vector<T> acc(KK, T(0));
    T sb = 0;
    const T* wt = weight + c * KK;
    T* a = ad.data();
    T* d = a + N;
    for (int64_t b = 0; b < B; ++b) {
      const T* gp = g + b * N * C + c;
      for (int64_t p = 0; p < N; ++p) gelu_and_grad(hx[(b * N + p) * C + c], a[p], d[p]);
      for (int64_t y = 0; y < H; ++y) {
        for (int64_t x = 0; x < W; ++x) {
          const T gv = gp[(y * W + x) * C];
          T s = gv;
          for (int64_t i = 0; i < K; ++i) {
            for (int64_t j = 0; j < K; ++j) {
              const int64_t yi = y - i + P, xj = x - j + P, yo = y + i - P, xo = x + j - P;
              if (yi >= 0 && yi < H && xj >= 0 && xj < W) s += wt[i * K + j] * gp[(yi * W + xj) * C];
              if (yo >= 0 && yo < H && xo >= 0 && xo < W) acc[i * K + j] += gv * a[yo * W + xo];
            }
          }
          gh[(b * N + y * W + x) * C + c] = s * d[y * W + x];
          sb += gv;
        }
      }
    }
    for (int64_t ij = 0; ij < KK; ++ij) gw[c * KK + ij] = acc[ij];
    gbias[c] = sb;
  });
}

constexpr const char* kGeluOp = "ppma::gelu_depthwise_conv2d_residual_backward";

std::tuple<at::Tensor, at::Tensor, at::Tensor> gelu_depthwise_conv2d_residual_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& h, const at::Tensor& weight) {
  TORCH_CHECK(h.dim() == 4, kGeluOp, ": h must be [B, H, W, C], got shape ", h.sizes());
  TORCH_CHECK(grad_out.sizes() == h.sizes(), kGeluOp, ": grad_out must have h's shape ", h.sizes(), ", got ",
              grad_out.sizes());
  check_floating(kGeluOp, "h", h);
  check_like(kGeluOp, "grad_out", grad_out, "h", h);
  TORCH_CHECK(h.scalar_type() == at::kFloat || h.scalar_type() == at::kDouble || h.scalar_type() == at::kBFloat16,
              kGeluOp, ": h must be float32, float64 or bfloat16, got ", h.scalar_type());
  const bool bf16 = h.scalar_type() == at::kBFloat16;
  const int64_t B = h.size(0), H = h.size(1), W = h.size(2), C = h.size(3);
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) == weight.size(3) &&
                  weight.size(2) % 2 == 1,
              kGeluOp, ": weight must be [C, 1, k, k] with C = ", C, " and k odd, got ", weight.sizes());
  check_param_like(kGeluOp, "weight", weight, "h", h);
  const int64_t K = weight.size(2), KK = K * K;
  if (bf16 && K != 3 && K != 5 && K != 7) {  // other k: the float kernel on widened copies, rounded once
    auto r = gelu_depthwise_conv2d_residual_backward_cpu(grad_out.to(at::kFloat), h.to(at::kFloat), weight);
    return {std::get<0>(r).to(at::kBFloat16), std::get<1>(r), std::get<2>(r)};
  }
  at::Tensor gh = at::empty_like(h, at::MemoryFormat::Contiguous);
  at::Tensor gw = at::zeros({C, 1, K, K}, weight.options()), gb = at::zeros({C}, weight.options());
  if (h.numel() == 0) return {gh, gw, gb};
  const at::Tensor hc = h.contiguous(), gc = grad_out.contiguous(), wc = weight.contiguous();
  if (h.scalar_type() != at::kDouble && (K == 3 || K == 5 || K == 7)) {
    const int64_t nblk = ceil_div(C, CB);
    std::vector<float> part(B * nblk * (KK + 1) * CB);
    auto run = [&](auto kc) {
      constexpr int KC = decltype(kc)::value;
      if (bf16) {
        gelu_residual_backward_rings<KC>(elements<uint16_t>(gc), elements<uint16_t>(hc), wc.data_ptr<float>(), B, H,
                                         W, C, elements<uint16_t>(gh), part.data());
      } else {
        gelu_residual_backward_rings<KC>(gc.data_ptr<float>(), hc.data_ptr<float>(), wc.data_ptr<float>(), B, H, W,
                                         C, gh.data_ptr<float>(), part.data());
      }
    };
    if (K == 3) {
      run(std::integral_constant<int, 3>{});
    } else if (K == 5) {
      run(std::integral_constant<int, 5>{});
    } else {
      run(std::integral_constant<int, 7>{});
    }
    // the batch elements' sums in batch order
    sum_partials(part.data(), C, KK, B, nblk * (KK + 1) * CB, CB,
                 [&](int64_t c) { return (c / CB) * (KK + 1) * CB + c % CB; }, gw.data_ptr<float>(),
                 gb.data_ptr<float>());
    return {gh, gw, gb};
  }
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "ppma_gelu_depthwise_conv2d_residual_backward_cpu", [&] {
    gelu_residual_backward_direct<scalar_t>(gc.data_ptr<scalar_t>(), hc.data_ptr<scalar_t>(),
                                            wc.data_ptr<scalar_t>(), B, H, W, C, K, gh.data_ptr<scalar_t>(),
                                            gw.data_ptr<scalar_t>(), gb.data_ptr<scalar_t>());
  });
  return {gh, gw, gb};
}

constexpr const char* kResidualOp = "ppma::depthwise_conv2d_residual_";

void depthwise_conv2d_residual_cpu(at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 4, kResidualOp, ": x must be [B, H, W, C], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, kResidualOp,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), kResidualOp, ": x must be contiguous (it is written in place)");
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3);
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) == weight.size(3) &&
                  weight.size(2) % 2 == 1,
              kResidualOp, ": weight must be [C, 1, k, k] with C = ", C, " and k odd, got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.device() == x.device(), kResidualOp,
              ": weight must be a float32 tensor on x's device, got ", weight.scalar_type(), " on ", weight.device());
  const int64_t K = weight.size(2);
  at::Tensor wc = weight.contiguous(), bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C, kResidualOp, ": bias must be [C] = [", C, "], got ",
                bias->sizes());
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->device() == x.device(), kResidualOp,
                ": bias must be a float32 tensor on x's device, got ", bias->scalar_type(), " on ", bias->device());
    bc = bias->contiguous();
  }
  check_no_overlap(kResidualOp, "x", x, "weight", weight);
  if (bc.defined()) check_no_overlap(kResidualOp, "x", x, "bias", *bias);
  if (x.numel() == 0) return;
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    residual_conv(x.data_ptr<float>(), x.data_ptr<float>(), wc.data_ptr<float>(), bp, B, H, W, C, K);
  } else {
    uint16_t* xb = elements<uint16_t>(x);
    residual_conv(xb, xb, wc.data_ptr<float>(), bp, B, H, W, C, K);
  }
}

constexpr const char* kGeluFwdOp = "ppma::gelu_depthwise_conv2d_residual_forward";

// out = a + conv(a) + bias with a = GELU(h), float32 (or bf16 maps with float32 weight and bias, float32 math, each
// output rounded once): one pass over h (residual_conv with gelu), the same GELU values as the backward kernel's.
at::Tensor gelu_depthwise_conv2d_residual_forward_cpu(const at::Tensor& h, const at::Tensor& weight,
                                                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(h.dim() == 4, kGeluFwdOp, ": h must be [B, H, W, C], got shape ", h.sizes());
  TORCH_CHECK(h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16, kGeluFwdOp,
              ": h must be float32 or bfloat16, got ", h.scalar_type());
  const bool bf16 = h.scalar_type() == at::kBFloat16;
  const int64_t B = h.size(0), H = h.size(1), W = h.size(2), C = h.size(3);
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) == weight.size(3) &&
                  weight.size(2) % 2 == 1,
              kGeluFwdOp, ": weight must be [C, 1, k, k] with C = ", C, " and k odd, got ", weight.sizes());
  check_param_like(kGeluFwdOp, "weight", weight, "h", h);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C, kGeluFwdOp, ": bias must be [C] = [", C, "], got ",
                bias->sizes());
    check_param_like(kGeluFwdOp, "bias", *bias, "h", h);
    bc = bias->contiguous();
  }
  at::Tensor out = at::empty(h.sizes(), h.options());
  if (h.numel() == 0) return out;
  const at::Tensor hc = h.contiguous(), wc = weight.contiguous();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  if (bf16) {
    residual_conv(elements<uint16_t>(hc), elements<uint16_t>(out), wc.data_ptr<float>(), bp, B, H, W, C,
                  weight.size(2), /*gelu=*/true);
  } else {
    residual_conv(hc.data_ptr<float>(), out.data_ptr<float>(), wc.data_ptr<float>(), bp, B, H, W, C, weight.size(2),
                  /*gelu=*/true);
  }
  return out;
}

constexpr const char* kOp = "ppma::depthwise_conv2d_backward";

std::tuple<at::Tensor, at::Tensor> depthwise_conv2d_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                                 int64_t kernel_size) {
  TORCH_CHECK(x.dim() == 4, kOp, ": x must be [B, H, W, C], got shape ", x.sizes());
  TORCH_CHECK(grad_out.sizes() == x.sizes(), kOp, ": grad_out must have x's shape ", x.sizes(), ", got ",
              grad_out.sizes());
  TORCH_CHECK(kernel_size > 0 && kernel_size % 2 == 1, kOp, ": kernel_size must be a positive odd number, got ",
              kernel_size);
  check_floating(kOp, "x", x);
  check_like(kOp, "grad_out", grad_out, "x", x);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || x.scalar_type() == at::kBFloat16,
              kOp, ": x must be float32, float64 or bfloat16, got ", x.scalar_type());
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3), K = kernel_size;
  // bf16 maps (bf16 autocast, float32 parameters): float32 sums and gradients
  const auto opts = x.scalar_type() == at::kBFloat16 ? x.options().dtype(at::kFloat) : x.options();
  at::Tensor gw = at::zeros({C, 1, K, K}, opts), gb = at::zeros({C}, opts);
  if (B * H * W * C == 0) return {gw, gb};
  const at::Tensor xc = x.contiguous(), gc = grad_out.contiguous();
  if (x.scalar_type() == at::kBFloat16) {
    weight_grad<float>(elements<uint16_t>(gc), elements<uint16_t>(xc), B, H, W, C, K, gw.data_ptr<float>(),
                       gb.data_ptr<float>());
    return {gw, gb};
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ppma_depthwise_conv2d_backward_cpu", [&] {
    weight_grad<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), B, H, W, C, K, gw.data_ptr<scalar_t>(),
                          gb.data_ptr<scalar_t>());
  });
  return {gw, gb};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("depthwise_conv2d_residual_", &ppma::cpu::depthwise_conv2d_residual_cpu);
  m.impl("depthwise_conv2d_backward", &ppma::cpu::depthwise_conv2d_backward_cpu);
  m.impl("gelu_depthwise_conv2d_residual_forward", &ppma::cpu::gelu_depthwise_conv2d_residual_forward_cpu);
  m.impl("gelu_depthwise_conv2d_residual_backward", &ppma::cpu::gelu_depthwise_conv2d_residual_backward_cpu);
}
