// criss_cross_attention on tensor cores (fp16 / bf16, lines of at most 64 tokens, head dims up to 32, sm_80+): the
// same three forward and three backward line passes as criss_cross_attention.cuh (its header comment gives the
// math and the pass dataflow: rows 0 / columns 1 / rows 2 forward; BR1, BC, BR2 backward), with every product on
// mma.sync m16n8k16 (docs/design.md §4.3, "criss_cross_attention on tensor cores").
//
// Tiling. A line of L tokens is padded to Lp = L rounded up to 16 (56 -> 64, 28 -> 32); a CTA of 4 warps holds
// 64 token slots, lpb = 64 / Lp whole lines (1 line of 64 or 48, 2 of 32, 4 of 16), slot s = m * Lp + t. Warp w
// owns the 16 slots 16 w .. 16 w + 15, which lie in one line m (Lp is a multiple of 16):
//   * as queries: S = Q K^T of its 16 rows against the line's Lp keys (Lp / 8 n-tiles of 8, d / 16 k-steps), the
//     row bias c[max] - c[min] from the row's prefix sum (registers) and the key's (shared memory), padded keys
//     (u >= L) masked to P = 0, the row softmax in registers (quad shuffles), then P V with P's C fragments reused
//     as A fragments (FlashAttention-2);
//   * backward, as queries: P from the saved lse, gg = h Z^T + G v^T, D = rowsum(P gg), dS = P (gg - D) in
//     registers; P v, dS k (dq) from registers; P and dS stored once to shared memory as 16-bit values;
//   * backward, as keys: P^T h, P^T G and dS^T q (dk) with the maps read back through ldmatrix.trans.
// The prefix-sum gradient of token x, sum_y sgn(x - y) (dS[x, y] + dS[y, x]), is summed from the fp32 dS in
// registers: the row part by quad shuffles, the column part per warp by shuffles over the 8 row groups, then the
// warps of a line in a fixed order (deterministic, no atomics). BR2 folds the combine (grad = column part from BC +
// row part) into its epilogue, so the backward has no combine kernel when the row pass runs here.
// Tiles are 16-bit with rows padded by 8 elements (16 bytes): the 8 rows of an ldmatrix phase hit 8 distinct
// 16-byte bank groups. Padded and out-of-range slots load as zeros.
// Scratch: z1, z2, gz1, gz2 are only ever read as mma operands, i.e. rounded to 16 bits, so where both directions
// run here they are stored as 16-bit values (ZT = scalar_t: half the traffic, the same numbers bit for bit);
// otherwise (a direction with lines longer than 64 runs the kernels of criss_cross_attention.cuh in the same
// pipeline) they stay the launcher's fp32 buffers (ZT = float). out1 and the column parts of the gradients stay
// fp32.
#pragma once

#include <type_traits>

#include "criss_cross_attention.cuh"
#include "warp_mma.h"

namespace ppma {

constexpr int kCcTcSlots = 64;  // token slots per CTA: 4 warps x 16 rows
constexpr int kCcTcThreads = 128;

PPMA_HD int cc_tc_pad(int L) { return (L + 15) / 16 * 16; }
PPMA_HD int cc_tc_lines(int L) { return kCcTcSlots / cc_tc_pad(L); }

// Whether a direction with lines of L tokens runs on the tensor-core kernels (16-bit inputs, DPAD <= 32).
template <typename scalar_t>
PPMA_HD bool criss_cross_tc_fits(int L, int dpad) {
  return sizeof(scalar_t) == 2 && L >= 1 && L <= kCcTcSlots && dpad <= 32;
}

// The slots of a CTA: lines li0 .. li0 + nl - 1 of one direction, each padded to Lp slots.
struct CcTcPack {
  bool rows;
  int li0, nl, L, Lp, W;
  PPMA_HD bool valid(int s) const { return s / Lp < nl && s % Lp < L; }
  PPMA_HD int64_t pos(int s) const { return at(s / Lp, s % Lp); }
  PPMA_HD int64_t at(int m, int t) const { return line_token(rows, li0 + m, t, W); }  // token t of line m
};

PPMA_HD CcTcPack cc_tc_pack(bool rows, int H, int W, unsigned block, int& bg) {
  CcTcPack lp;
  lp.rows = rows;
  lp.L = rows ? W : H;
  lp.Lp = cc_tc_pad(lp.L);
  lp.W = W;
  const int nlines = rows ? H : W, lpb = cc_tc_lines(lp.L);
  const int packs = (nlines + lpb - 1) / lpb;
  bg = int(block / unsigned(packs));
  lp.li0 = int(block % unsigned(packs)) * lpb;
  lp.nl = nlines - lp.li0 < lpb ? nlines - lp.li0 : lpb;
  return lp;
}

// Shared memory of a CTA: NTILE token tiles [64][DPAD + 8] and NMAT line maps [64][64 + 8] (16-bit), per-slot
// prefix sums, lse and the prefix-sum gradient parts (fp32).
template <typename T, int DPAD, int NTILE, int NMAT>
struct CcTcSmem {
  static constexpr int LDT = DPAD + 8, LDP = kCcTcSlots + 8;
  T tile[NTILE][kCcTcSlots][LDT];
  T mat[NMAT > 0 ? NMAT : 1][NMAT > 0 ? kCcTcSlots : 1][LDP];  // the forward keeps no map: one row
  float c[kCcTcSlots], lse[kCcTcSlots], own_row[kCcTcSlots], own_col[4][kCcTcSlots];
};

// dst[s][e] = src(token of slot s)[e] * mul rounded to T, zero for e >= dim and for padded slots.
template <int DPAD, typename T, typename S, int LDT>
PPMA_D void cc_tc_load(T (*dst)[LDT], const S* base, const Strides4& st, int b, int g, const CcTcPack& lp, int dim,
                       float mul, int tid) {
  for (int e = tid; e < kCcTcSlots * DPAD; e += kCcTcThreads) {
    const int sl = e / DPAD, c = e % DPAD;
    float v = 0.f;
    if (c < dim && lp.valid(sl)) v = to_acc(token_ptr(base, st, b, g, lp.pos(sl), lp.W)[c]) * mul;
    dst[sl][c] = from_acc<T>(v);
  }
}

// ldmatrix addresses of an A fragment (16 x 16, rows m, k) read from a row-major [k][m] tile with .trans
// (matrix j = lane / 8: m block j & 1, k block j >> 1): the same lane arithmetic as the B fragments of ldsm_b_*.
PPMA_HD int cc_ldsm_at_row(int lane) { return mma::ldsm_b_row(lane); }  // k offset
PPMA_HD int cc_ldsm_at_col(int lane) { return mma::ldsm_b_col(lane); }  // m offset

PPMA_D float cc_quad_max(float x) {
  x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
PPMA_D float cc_quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// acc[j] += A B^T for the n8 tiles j < nj (nj even): A = 16 rows of a row-major [m][k] tile, B = rows of a
// row-major [n][k] tile (k = 16 KS).
template <typename T, int KS, int LDA, int LDB>
PPMA_D void cc_mma_abt(float (&acc)[8][4], const T (*A)[LDA], const T (*B)[LDB], int nj, int lane) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t a[4];
    mma::ldsm_x4<false>(a, &A[mma::ldsm_a_row(lane)][ks * 16 + mma::ldsm_a_col(lane)]);
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      if (2 * jp < nj) {
        uint32_t bb[4];
        mma::ldsm_x4<false>(bb, &B[jp * 16 + mma::ldsm_b_row(lane)][ks * 16 + mma::ldsm_b_col(lane)]);
        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
        mma::mma16816<T>(acc[2 * jp], a, b0);
        mma::mma16816<T>(acc[2 * jp + 1], a, b1);
      }
    }
  }
}

// o[n] += X V for the DPAD / 8 n8 tiles: X = 16 x Lp from C fragments in registers (x[j], j < nj), V = rows of a
// row-major [k][n] tile (ldmatrix.trans).
template <typename T, int DPAD, int LDB>
PPMA_D void cc_mma_xv(float (&o)[DPAD / 8][4], const float (&x)[8][4], const T (*V)[LDB], int nj, int lane) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (2 * s < nj) {
      uint32_t a[4];
      a[0] = mma::pack2<T>(x[2 * s][0], x[2 * s][1]);
      a[1] = mma::pack2<T>(x[2 * s][2], x[2 * s][3]);
      a[2] = mma::pack2<T>(x[2 * s + 1][0], x[2 * s + 1][1]);
      a[3] = mma::pack2<T>(x[2 * s + 1][2], x[2 * s + 1][3]);
#pragma unroll
      for (int n = 0; n < DPAD / 16; ++n) {
        uint32_t bb[4];
        mma::ldsm_x4<true>(bb, &V[s * 16 + mma::ldsm_bt_row(lane)][n * 16 + mma::ldsm_bt_col(lane)]);
        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
        mma::mma16816<T>(o[2 * n], a, b0);
        mma::mma16816<T>(o[2 * n + 1], a, b1);
      }
    }
  }
}

// o[n] += M^T V for 16 columns m0 .. m0 + 15 of a line map M (row-major [t][u], rows of the line, ldmatrix.trans
// as A) and V = rows of a row-major [t][n] tile, over the line's Lp rows (ksteps = Lp / 16).
template <typename T, int DPAD, int LDM, int LDB>
PPMA_D void cc_mma_mtv(float (&o)[DPAD / 8][4], const T (*M)[LDM], int m0, const T (*V)[LDB], int ksteps, int lane) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (s < ksteps) {
      uint32_t a[4];
      mma::ldsm_x4<true>(a, &M[s * 16 + cc_ldsm_at_row(lane)][m0 + cc_ldsm_at_col(lane)]);
#pragma unroll
      for (int n = 0; n < DPAD / 16; ++n) {
        uint32_t bb[4];
        mma::ldsm_x4<true>(bb, &V[s * 16 + mma::ldsm_bt_row(lane)][n * 16 + mma::ldsm_bt_col(lane)]);
        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
        mma::mma16816<T>(o[2 * n], a, b0);
        mma::mma16816<T>(o[2 * n + 1], a, b1);
      }
    }
  }
}

// Logits of the warp's 16 query rows (slots r0 ..) against the line's keys (slots lb ..): x = scale q.k + bias,
// -inf for padded keys.
template <typename T, int DPAD, int LDT>
PPMA_D void cc_tc_logits(float (&x)[8][4], const T (*Q)[LDT], const T (*K)[LDT], const float* c, int r0, int lb,
                         int t0, int L, int nj, float scale, int lane) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) x[j][i] = 0.f;
  cc_mma_abt<T, DPAD / 16>(x, Q + r0, K + lb, nj, lane);
  const float ct0 = c[r0 + mma::c_row(lane, 0)], ct1 = c[r0 + mma::c_row(lane, 2)];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < nj) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = t0 + mma::c_row(lane, i), u = 8 * j + mma::c_col(lane, i);
        x[j][i] = u < L ? scale * x[j][i] + line_bias(t, u, i < 2 ? ct0 : ct1, c[lb + u]) : -INFINITY;
      }
    }
  }
}

// The maps a pass reads (Z, Gm) and writes (Pv, PTh) in the scratch type ZT, and its fp32 outputs. Forward: MODE 0
// Pv = z1; MODE 1 Z = z1, Pv = z2; MODE 2 Z = z2. Backward as LineBwdIO.
template <typename ZT>
struct CcTcIO {
  const ZT* Z = nullptr;
  const ZT* Gm = nullptr;
  ZT* Pv = nullptr;
  ZT* PTh = nullptr;
  float* PTG = nullptr;
  float* dq = nullptr;
  float* dk = nullptr;
  float* own = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Forward, MODE as criss_cross_fwd_kernel: 0 rows z1 = A v; 1 columns z2 = B v, out1 = B z1; 2 rows
// out = (out1 + A z2) / 2 with A from the saved lse.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, int DPAD, int MODE, typename ZT>
__global__ void __launch_bounds__(kCcTcThreads)
    criss_cross_tc_fwd_kernel(CrissCrossParams<scalar_t, float> p, CcTcIO<ZT> io) {
  constexpr bool kRows = MODE != 1;
  using Sm = CcTcSmem<scalar_t, DPAD, MODE == 1 ? 4 : 3, 0>;
  PPMA_DYNAMIC_SMEM(Sm, sm);
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  int bg;
  const CcTcPack lp = cc_tc_pack(kRows, H, W, blockIdx.x, bg);
  const int b = bg / G, g = bg % G, L = lp.L, Lp = lp.Lp, tid = threadIdx.x;
  const float* cb = (kRows ? p.cr : p.cc) + int64_t(bg) * N;
  const Strides4 sacc = contiguous_strides(H, W, G, dv);
  const int wl = kRows ? 0 : 1;

  cc_tc_load<DPAD>(sm.tile[0], p.q, p.sq, b, g, lp, d, 1.f, tid);
  cc_tc_load<DPAD>(sm.tile[1], p.k, p.sk, b, g, lp, d, 1.f, tid);
  if (MODE == 2)
    cc_tc_load<DPAD>(sm.tile[2], io.Z, sacc, b, g, lp, dv, 1.f, tid);
  else
    cc_tc_load<DPAD>(sm.tile[2], p.v, p.sv, b, g, lp, dv, 1.f, tid);
  if (MODE == 1) cc_tc_load<DPAD>(sm.tile[MODE == 1 ? 3 : 2], io.Z, sacc, b, g, lp, dv, 1.f, tid);
  for (int s = tid; s < kCcTcSlots; s += kCcTcThreads) {
    const bool ok = lp.valid(s);
    const int64_t pt = ok ? lp.pos(s) : 0;
    sm.c[s] = ok ? cb[pt] : 0.f;
    if (MODE == 2) sm.lse[s] = ok ? p.lse[token_index(N, G, b, pt, g) * 2 + wl] : 0.f;
  }
  __syncthreads();

  const int warp = tid >> 5, lane = tid & 31, r0 = 16 * warp, m = r0 / Lp, t0 = r0 % Lp, lb = m * Lp;
  if (m >= lp.nl) return;  // no barrier follows
  const int nj = Lp / 8;
  float x[8][4];
  cc_tc_logits<scalar_t, DPAD>(x, sm.tile[0], sm.tile[1], sm.c, r0, lb, t0, L, nj, p.scale, lane);
  float lse_r[2];
  if (MODE == 2) {
    lse_r[0] = sm.lse[r0 + mma::c_row(lane, 0)];
    lse_r[1] = sm.lse[r0 + mma::c_row(lane, 2)];
  } else {
    float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nj)
#pragma unroll
        for (int i = 0; i < 4; ++i) mx[i >> 1] = max(mx[i >> 1], x[j][i]);
    mx[0] = cc_quad_max(mx[0]);
    mx[1] = cc_quad_max(mx[1]);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nj)
#pragma unroll
        for (int i = 0; i < 4; ++i) sum[i >> 1] += fast_exp(x[j][i] - mx[i >> 1]);
    sum[0] = cc_quad_sum(sum[0]);
    sum[1] = cc_quad_sum(sum[1]);
    lse_r[0] = mx[0] + fast_log(sum[0]);
    lse_r[1] = mx[1] + fast_log(sum[1]);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nj)
#pragma unroll
      for (int i = 0; i < 4; ++i)  // masked keys: exp(-inf) = 0; padded rows (unwritten) 0 as well
        x[j][i] = t0 + mma::c_row(lane, i) < L ? fast_exp(x[j][i] - lse_r[i >> 1]) : 0.f;

  float o0[DPAD / 8][4] = {}, o1[DPAD / 8][4] = {};
  cc_mma_xv<scalar_t, DPAD>(o0, x, sm.tile[2] + lb, nj, lane);
  if (MODE == 1) cc_mma_xv<scalar_t, DPAD>(o1, x, sm.tile[MODE == 1 ? 3 : 2] + lb, nj, lane);

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int t = t0 + mma::c_row(lane, 2 * hr);
    if (t >= L) continue;
    const int64_t row = token_index(N, G, b, lp.at(m, t), g);
    if (MODE != 2 && (lane & 3) == 0) p.lse[row * 2 + wl] = lse_r[hr];
#pragma unroll
    for (int n = 0; n < DPAD / 8; ++n)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int e = 8 * n + mma::c_col(lane, e2);
        if (e >= dv) continue;
        const int64_t o = row * dv + e;
        const float val = o0[n][2 * hr + e2];
        if (MODE == 0) io.Pv[o] = from_acc<ZT>(val);
        if (MODE == 1) {
          io.Pv[o] = from_acc<ZT>(val);
          p.out1[o] = o1[n][2 * hr + e2];
        }
        if (MODE == 2) p.out[o] = from_acc<scalar_t>(0.5f * (p.out1[o] + val));
      }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward of one direction (BR1 = rows, !FULL; BC = columns, FULL; BR2 = rows, FULL; io as for
// criss_cross_bwd_kernel). BR2 (ROWS && FULL) writes the final gradients: grad_q = dq_c + dq of this pass, grad_k,
// grad_v likewise, instead of io.dq / io.dk / io.PTG. The launch bound's minimum of 1 block per SM lifts ptxas' own
// register target (64 for the BR1 pass, which then spilled a predicate register across the barrier; 70 without);
// shared memory (23-51 KB per block) bounds the blocks per SM at 4-9 anyway.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, int DPAD, bool ROWS, bool FULL, typename ZT>
__global__ void __launch_bounds__(kCcTcThreads, 1)
    criss_cross_tc_bwd_kernel(CrissCrossParams<scalar_t, float> p, CcTcIO<ZT> io) {
  constexpr bool kCombine = ROWS && FULL;
  enum { kQ, kK, kV, kH, kZ, kG };
  using Sm = CcTcSmem<scalar_t, DPAD, FULL ? 6 : 4, FULL ? 2 : 1>;
  PPMA_DYNAMIC_SMEM(Sm, sm);
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  int bg;
  const CcTcPack lp = cc_tc_pack(ROWS, H, W, blockIdx.x, bg);
  const int b = bg / G, g = bg % G, L = lp.L, Lp = lp.Lp, tid = threadIdx.x;
  const float* cb = (ROWS ? p.cr : p.cc) + int64_t(bg) * N;
  const Strides4 sacc = contiguous_strides(H, W, G, dv);
  const int wl = ROWS ? 0 : 1;

  cc_tc_load<DPAD>(sm.tile[kQ], p.q, p.sq, b, g, lp, d, 1.f, tid);
  cc_tc_load<DPAD>(sm.tile[kK], p.k, p.sk, b, g, lp, d, 1.f, tid);
  cc_tc_load<DPAD>(sm.tile[kV], p.v, p.sv, b, g, lp, dv, 1.f, tid);
  cc_tc_load<DPAD>(sm.tile[kH], p.dout, p.sdo, b, g, lp, dv, 0.5f, tid);
  if (FULL) {
    cc_tc_load<DPAD>(sm.tile[FULL ? kZ : 0], io.Z, sacc, b, g, lp, dv, 1.f, tid);
    cc_tc_load<DPAD>(sm.tile[FULL ? kG : 0], io.Gm, sacc, b, g, lp, dv, 1.f, tid);
  }
  for (int s = tid; s < kCcTcSlots; s += kCcTcThreads) {
    const bool ok = lp.valid(s);
    const int64_t pt = ok ? lp.pos(s) : 0;
    sm.c[s] = ok ? cb[pt] : 0.f;
    sm.lse[s] = ok ? p.lse[token_index(N, G, b, pt, g) * 2 + wl] : 0.f;
  }
  __syncthreads();

  const int warp = tid >> 5, lane = tid & 31, r0 = 16 * warp, m = r0 / Lp, t0 = r0 % Lp, lb = m * Lp;
  const bool active = m < lp.nl;
  const int nj = Lp / 8;
  const float scale = p.scale;
  auto row_of = [&](int t) { return token_index(N, G, b, lp.at(m, t), g); };  // token t of the warp's line

  // ---- the warp's 16 slots as queries: P, dS in registers; P v, dS k, the row part of the bias gradient
  if (active) {
    float P[8][4];
    cc_tc_logits<scalar_t, DPAD>(P, sm.tile[kQ], sm.tile[kK], sm.c, r0, lb, t0, L, nj, scale, lane);
    const float lse0 = sm.lse[r0 + mma::c_row(lane, 0)], lse1 = sm.lse[r0 + mma::c_row(lane, 2)];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nj)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const bool row_ok = t0 + mma::c_row(lane, i) < L;
          P[j][i] = row_ok ? fast_exp(P[j][i] - (i < 2 ? lse0 : lse1)) : 0.f;
        }
    if (io.Pv) {
      float o[DPAD / 8][4] = {};
      cc_mma_xv<scalar_t, DPAD>(o, P, sm.tile[kV] + lb, nj, lane);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = t0 + mma::c_row(lane, 2 * hr);
        if (t >= L) continue;
        const int64_t row = row_of(t);
#pragma unroll
        for (int n = 0; n < DPAD / 8; ++n)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int e = 8 * n + mma::c_col(lane, e2);
            if (e < dv) io.Pv[row * dv + e] = from_acc<ZT>(o[n][2 * hr + e2]);
          }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nj) {
        const int u = 8 * j + mma::c_col(lane, 0);
        *reinterpret_cast<uint32_t*>(&sm.mat[0][r0 + mma::c_row(lane, 0)][u]) = mma::pack2<scalar_t>(P[j][0], P[j][1]);
        *reinterpret_cast<uint32_t*>(&sm.mat[0][r0 + mma::c_row(lane, 2)][u]) = mma::pack2<scalar_t>(P[j][2], P[j][3]);
      }
    if constexpr (FULL) {
      float dS[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) dS[j][i] = 0.f;
      cc_mma_abt<scalar_t, DPAD / 16>(dS, sm.tile[kH] + r0, sm.tile[kZ] + lb, nj, lane);  // gg = h Z^T
      cc_mma_abt<scalar_t, DPAD / 16>(dS, sm.tile[kG] + r0, sm.tile[kV] + lb, nj, lane);  //    + G v^T
      float D[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nj)
#pragma unroll
          for (int i = 0; i < 4; ++i) D[i >> 1] += P[j][i] * dS[j][i];
      D[0] = cc_quad_sum(D[0]);
      D[1] = cc_quad_sum(D[1]);
      float own_r[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nj) {
          float col[2] = {0.f, 0.f};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int t = t0 + mma::c_row(lane, i), u = 8 * j + mma::c_col(lane, i);
            dS[j][i] = P[j][i] * (dS[j][i] - D[i >> 1]);
            own_r[i >> 1] += sgn_diff<float>(t, u) * dS[j][i];
            col[i & 1] += sgn_diff<float>(u, t) * dS[j][i];
          }
          // the column part over the warp's 16 rows: sum over the 8 row groups (lane bits 2..4)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float v = col[e2];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            if (lane < 4) sm.own_col[warp][lb + 8 * j + mma::c_col(lane, e2)] = v;
          }
          const int u = 8 * j + mma::c_col(lane, 0);
          *reinterpret_cast<uint32_t*>(&sm.mat[FULL ? 1 : 0][r0 + mma::c_row(lane, 0)][u]) =
              mma::pack2<scalar_t>(dS[j][0], dS[j][1]);
          *reinterpret_cast<uint32_t*>(&sm.mat[FULL ? 1 : 0][r0 + mma::c_row(lane, 2)][u]) =
              mma::pack2<scalar_t>(dS[j][2], dS[j][3]);
        }
      own_r[0] = cc_quad_sum(own_r[0]);
      own_r[1] = cc_quad_sum(own_r[1]);
      if ((lane & 3) == 0) {
        sm.own_row[r0 + mma::c_row(lane, 0)] = own_r[0];
        sm.own_row[r0 + mma::c_row(lane, 2)] = own_r[1];
      }
      float o[DPAD / 8][4] = {};
      cc_mma_xv<scalar_t, DPAD>(o, dS, sm.tile[kK] + lb, nj, lane);  // dq = scale dS k
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = t0 + mma::c_row(lane, 2 * hr);
        if (t >= L) continue;
        const int64_t row = row_of(t);
#pragma unroll
        for (int n = 0; n < DPAD / 8; ++n)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int e = 8 * n + mma::c_col(lane, e2);
            if (e >= d) continue;
            const float val = scale * o[n][2 * hr + e2];
            if (kCombine)
              p.dq[row * d + e] = from_acc<scalar_t>(p.dq_c[row * d + e] + val);
            else
              io.dq[row * d + e] = val;
          }
      }
    }
  }
  __syncthreads();  // the maps and the bias-gradient parts of every warp

  // ---- the warp's 16 slots as keys: P^T h, P^T G, dS^T q
  if (active) {
    const int ks = Lp / 16;
    float th[DPAD / 8][4] = {};
    if (io.PTh) cc_mma_mtv<scalar_t, DPAD>(th, sm.mat[0] + lb, t0, sm.tile[kH] + lb, ks, lane);
    float tg[DPAD / 8][4] = {}, dk[DPAD / 8][4] = {};
    if constexpr (FULL) {
      cc_mma_mtv<scalar_t, DPAD>(tg, sm.mat[0] + lb, t0, sm.tile[kG] + lb, ks, lane);
      cc_mma_mtv<scalar_t, DPAD>(dk, sm.mat[FULL ? 1 : 0] + lb, t0, sm.tile[kQ] + lb, ks, lane);
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int u = t0 + mma::c_row(lane, 2 * hr);
      if (u >= L) continue;
      const int64_t row = row_of(u);
#pragma unroll
      for (int n = 0; n < DPAD / 8; ++n)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int e = 8 * n + mma::c_col(lane, e2), i = 2 * hr + e2;
          if (e < dv) {
            if (io.PTh) io.PTh[row * dv + e] = from_acc<ZT>(th[n][i]);
            if (FULL) {
              if (kCombine)
                p.dv[row * dv + e] = from_acc<scalar_t>(p.gv_c[row * dv + e] + tg[n][i]);
              else
                io.PTG[row * dv + e] = tg[n][i];
            }
          }
          if (FULL && e < d) {
            const float val = scale * dk[n][i];
            if (kCombine)
              p.dk[row * d + e] = from_acc<scalar_t>(p.dk_c[row * d + e] + val);
            else
              io.dk[row * d + e] = val;
          }
        }
    }
  }
  if (FULL) {  // prefix-sum gradient: the row part plus the column parts of the line's warps, in warp order
    for (int s = tid; s < kCcTcSlots; s += kCcTcThreads) {
      if (!lp.valid(s)) continue;
      const int ml = s / Lp, w0 = ml * Lp / 16, w1 = (ml + 1) * Lp / 16;
      float own = sm.own_row[s];
      for (int w = w0; w < w1; ++w) own += sm.own_col[w][s];
      io.own[int64_t(bg) * N + lp.pos(s)] = own;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host-side launch helpers (no torch): the pipeline of launch_criss_cross_fwd / launch_criss_cross_bwd, each
// direction on the tensor-core kernels when criss_cross_tc_fits(its line length, DPAD), else on the kernels of
// criss_cross_attention.cuh. The launchers select these under the option cuda_next_criss_cross_attention
// (fp16 / bf16, sm_80+). z16: where criss_cross_tc_scratch16 holds, the launcher may pass 16-bit scratch for
// z1, z2 (forward: 2 maps) or z1, z2, gz1, gz2 (backward: 4 maps) of B*H*W*heads*dv elements each; p.z1, p.z2,
// p.gz1, p.gz2 (and in the backward p.gv_r, p.dq_r, p.dk_r: the combine is folded) are then not used.
// ---------------------------------------------------------------------------------------------

// Whether both directions run on the tensor-core kernels (then 16-bit scratch may be used).
template <typename scalar_t>
PPMA_HD bool criss_cross_tc_scratch16(const GridSizes& sz, int dpad) {
  return criss_cross_tc_fits<scalar_t>(sz.W, dpad) && criss_cross_tc_fits<scalar_t>(sz.H, dpad);
}

template <typename scalar_t, int DPAD, int MODE, typename ZT>
inline void launch_criss_cross_tc_fwd_pass(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                           const CcTcIO<ZT>& io, cudaStream_t stream) {
  const bool rows = MODE != 1;
  const int L = rows ? p.sz.W : p.sz.H, nlines = rows ? p.sz.H : p.sz.W;
  if constexpr (sizeof(scalar_t) == 2 && DPAD <= 32) {
    if (criss_cross_tc_fits<scalar_t>(L, DPAD)) {
      const int lpb = cc_tc_lines(L);
      const int64_t blocks = int64_t((nlines + lpb - 1) / lpb) * p.sz.B * p.sz.G;
      auto kernel = criss_cross_tc_fwd_kernel<scalar_t, DPAD, MODE, ZT>;
      using Sm = CcTcSmem<scalar_t, DPAD, MODE == 1 ? 4 : 3, 0>;
      allow_dynamic_smem(kernel, sizeof(Sm));
      launch_kernel(kernel, dim3(unsigned(blocks)), dim3(kCcTcThreads), sizeof(Sm), stream, p, io);
      return;
    }
  }
  launch_criss_cross_fwd_pass<scalar_t, DPAD, MODE>(p, stream);  // fp32 / fp64 scratch here (see the callers)
}

template <typename scalar_t, int DPAD, bool ROWS, bool FULL, typename ZT>
inline bool launch_criss_cross_tc_bwd_pass(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                           const CcTcIO<ZT>& io, cudaStream_t stream) {
  const int L = ROWS ? p.sz.W : p.sz.H, nlines = ROWS ? p.sz.H : p.sz.W;
  if constexpr (sizeof(scalar_t) == 2 && DPAD <= 32) {
    if (criss_cross_tc_fits<scalar_t>(L, DPAD)) {
      const int lpb = cc_tc_lines(L);
      const int64_t blocks = int64_t((nlines + lpb - 1) / lpb) * p.sz.B * p.sz.G;
      auto kernel = criss_cross_tc_bwd_kernel<scalar_t, DPAD, ROWS, FULL, ZT>;
      using Sm = CcTcSmem<scalar_t, DPAD, FULL ? 6 : 4, FULL ? 2 : 1>;
      allow_dynamic_smem(kernel, sizeof(Sm));
      launch_kernel(kernel, dim3(unsigned(blocks)), dim3(kCcTcThreads), sizeof(Sm), stream, p, io);
      return true;
    }
  }
  using acc_t = typename AccType<scalar_t>::type;
  if constexpr (std::is_same<ZT, acc_t>::value) {  // 16-bit scratch only where every pass runs here
    LineBwdIO<acc_t> old;
    old.Z = io.Z;
    old.Gm = io.Gm;
    old.Pv = io.Pv;
    old.PTh = io.PTh;
    old.PTG = io.PTG;
    old.dq = io.dq;
    old.dk = io.dk;
    old.own = io.own;
    launch_criss_cross_bwd_pass<scalar_t, DPAD, ROWS, FULL>(p, old, stream);
  }
  return false;
}

template <typename scalar_t, int DPAD>
inline void launch_criss_cross_tc_fwd(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                      cudaStream_t stream, scalar_t* z16 = nullptr) {
  static_assert(sizeof(scalar_t) == 2, "the tensor-core criss-cross kernels take fp16 / bf16");
  auto run = [&](auto* z1, auto* z2) {
    using ZT = typename std::remove_pointer<decltype(z1)>::type;
    CcTcIO<ZT> io[3];
    io[0].Pv = z1;
    io[1].Z = z1;
    io[1].Pv = z2;
    io[2].Z = z2;
    launch_criss_cross_tc_fwd_pass<scalar_t, DPAD, 0>(p, io[0], stream);
    launch_criss_cross_tc_fwd_pass<scalar_t, DPAD, 1>(p, io[1], stream);
    launch_criss_cross_tc_fwd_pass<scalar_t, DPAD, 2>(p, io[2], stream);
  };
  if constexpr (sizeof(scalar_t) == 2) {
    if (z16 != nullptr && criss_cross_tc_scratch16<scalar_t>(p.sz, DPAD)) {
      const int64_t m = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G * p.sz.dv;
      run(z16, z16 + m);
      return;
    }
  }
  run(p.z1, p.z2);
}

template <typename scalar_t, int DPAD>
inline void launch_criss_cross_tc_bwd(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                      cudaStream_t stream, scalar_t* z16 = nullptr) {
  static_assert(sizeof(scalar_t) == 2, "the tensor-core criss-cross kernels take fp16 / bf16");
  using acc_t = typename AccType<scalar_t>::type;
  auto run = [&](auto* z1, auto* z2, auto* gz1, auto* gz2) {
    using ZT = typename std::remove_pointer<decltype(z1)>::type;
    CcTcIO<ZT> r1;
    r1.Pv = z1;
    r1.PTh = gz2;
    launch_criss_cross_tc_bwd_pass<scalar_t, DPAD, true, false>(p, r1, stream);
    CcTcIO<ZT> c;
    c.Z = z1;
    c.Gm = gz2;
    c.Pv = z2;
    c.PTh = gz1;
    c.PTG = p.gv_c;
    c.dq = p.dq_c;
    c.dk = p.dk_c;
    c.own = p.g_cc;
    launch_criss_cross_tc_bwd_pass<scalar_t, DPAD, false, true>(p, c, stream);
    CcTcIO<ZT> r2;
    r2.Z = z2;
    r2.Gm = gz1;
    r2.PTG = p.gv_r;
    r2.dq = p.dq_r;
    r2.dk = p.dk_r;
    r2.own = p.g_cr;
    return launch_criss_cross_tc_bwd_pass<scalar_t, DPAD, true, true>(p, r2, stream);
  };
  bool folded;
  if constexpr (sizeof(scalar_t) == 2) {
    if (z16 != nullptr && criss_cross_tc_scratch16<scalar_t>(p.sz, DPAD)) {
      const int64_t m = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G * p.sz.dv;
      folded = run(z16, z16 + m, z16 + 2 * m, z16 + 3 * m);
    } else {
      folded = run(p.z1, p.z2, p.gz1, p.gz2);
    }
  } else {
    folded = run(p.z1, p.z2, p.gz1, p.gz2);
  }
  if (!folded) {
    const int64_t n = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G * (p.sz.d > p.sz.dv ? p.sz.d : p.sz.dv);
    launch_kernel(criss_cross_combine_kernel<scalar_t>, dim3(unsigned((n + 255) / 256)), dim3(256), 0, stream, p);
  }
  DecayGradParams<acc_t> dg;
  dg.sz = p.sz;
  dg.own_r[0] = p.g_cr;
  dg.own_c[0] = p.g_cc;
  dg.tile_bm = 1;
  dg.g_log_alpha = p.g_log_alpha;
  dg.g_log_beta = p.g_log_beta;
  const int64_t lines = int64_t(p.sz.B) * p.sz.G * (p.sz.H + p.sz.W);
  launch_kernel(decay_grad_kernel<acc_t>, dim3(unsigned((lines + 127) / 128)), dim3(128), 0, stream, dg);
}

}  // namespace ppma
