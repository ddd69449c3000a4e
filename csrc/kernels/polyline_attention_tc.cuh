// polyline_attention on tensor cores: fp16 / bf16 inputs, head dims up to 128 (d, dv multiples of 8), sm_80+.
// FlashAttention-2 style; the math is that of polyline_attention_{fwd,bwd}.cuh (docs/ops.md), the layout of the
// fragments is in warp_mma.h.
//
// Tiles. A CTA of 4 warps owns BM = 64 queries (16 per warp, the m16 of mma.m16n8k16) and loops over key tiles
// of BN keys. Both are row-aligned (RowTiling): whole rows of the map when W <= tile, else one segment of a row.
// So the biases of a (query tile, key tile) pair need, besides each token's own prefix sums, only two small
// "cross" tables of prefix sums, staged in shared memory per key tile:
//   XQ[i_loc * cap_k + l_loc] = (cr, cc)(query row i, key column l)   rows of the query tile x columns of the key tile
//   XK[k_loc * cap_q + j_loc] = (cr, cc)(key row k, query column j)   rows of the key tile x columns of the query tile
// (cap = the tiling's column capacity, at most max(BM, BN) entries each; see TcTok for the offsets). Per score
// element the kernel reads one float2 of each:
//   M [p,s] = R_i(j,l) + C_l(i,k) = seg(j, l, cr(i,j), XQ.cr) + seg(k, i, cc(k,l), XQ.cc)
//   M'[p,s] = R_k(j,l) + C_j(i,k) = seg(j, l, XK.cr, cr(k,l)) + seg(i, k, cc(i,j), XK.cc)
// with seg = line_bias (common/math.h). Prefix sums are staged times log2(e) and the score scale is
// scale * log2(e), so both softmaxes run on exp2; lse is stored in natural log like the CUDA-core kernels.
//
// Forward: per key tile, S = Q K^T on tensor cores once, then both logit tiles S + M and S + M' from the one S in
// registers, two online softmaxes, P1 and P2 packed to 16 bits in registers (C fragments -> A fragments) and
// O1 += P1 V, O2 += P2 V sharing the V fragments.
// Backward (deterministic: fixed owners and orders, no atomics, no N x N buffer):
//   * delta kernel (polyline_attention_bwd.cuh): D1, D2 per query;
//   * dq kernel (query-outer): S = Q K^T and dP = dO V^T, dS1 = P1 (dP/2 - D1), dS2 = P2 (dP/2 - D2), dQ += dS K;
//     the query-owned bias terms reduced per row in registers; the cross terms on tokens (query row, key column)
//     from dS1 reduced per tile from a shared-memory copy of the dS1 tile into the CTA's table;
//   * dkdv kernel (key-outer, K and V resident in shared memory): S^T = K Q^T, dP^T = V dO^T, dV += P^T dO / 2
//     (P = P1 + P2), dK += dS^T Q; key-owned terms per row, cross terms (key row, query column) from dS2;
//   * decay_grad_kernel (common.cuh) adds the parts per token and takes the reverse cumsums.
// Head dims are zero-padded to DPAD in shared memory (exact: padded q/k columns add 0 to S, padded v columns
// produce outputs that are not written).
#pragma once

#include "polyline_attention_bwd.cuh"
#include "warp_mma.h"

namespace ppma {

// Blocks per SM that ptxas must fit in registers (__launch_bounds__). 2 lets every kernel use up to 255 registers
// without spilling (except the d = 128 dkdv kernel: 28 bytes); 3 (168 registers) gives more warps but spills
// 16-32 bytes in most backward kernels. Which is faster is for a GPU to say: rebuild with
// -DPPMA_TC_MIN_BLOCKS=3 to compare.
#ifndef PPMA_TC_MIN_BLOCKS
#define PPMA_TC_MIN_BLOCKS 2
#endif

template <int DPAD>
struct TcTraits {
  static_assert(DPAD == 16 || DPAD == 32 || DPAD == 64 || DPAD == 128, "DPAD must be 16, 32, 64 or 128");
  static constexpr int NW = 4, NT = 32 * NW, BM = 16 * NW;  // 16 query (or key) rows per warp
  // Inner tiles: the largest that compile without register spills for 128 threads (ptxas -v, sm_80 / sm_90;
  // .ci/check_cuda.sh fails on a spill): forward keys, dq keys, dkdv queries. Multiples of 16 up to BM; the
  // PPMA_TC_BN* macros let a GPU session time other sizes without editing the code.
#ifndef PPMA_TC_BN_FWD
#define PPMA_TC_BN_FWD (DPAD <= 64 ? 64 : 16)
#endif
#ifndef PPMA_TC_BN_DQ
#define PPMA_TC_BN_DQ (DPAD <= 64 ? 32 : 16)
#endif
#ifndef PPMA_TC_BN_DKDV
#define PPMA_TC_BN_DKDV 16
#endif
  static constexpr int BN = PPMA_TC_BN_FWD;
  static constexpr int BNQ = PPMA_TC_BN_DQ;
  static constexpr int BN2 = PPMA_TC_BN_DKDV;
  static_assert(BN % 16 == 0 && BNQ % 16 == 0 && BN2 % 16 == 0, "inner tiles are multiples of 16");
  static constexpr int LD = DPAD + 8;  // shared row stride in elements: 16 B of padding, conflict-free ldmatrix
  static constexpr int KD = DPAD / 16; // k16 steps over the head dim (= pairs of n8 tiles over the head dim)
  static constexpr int NO = DPAD / 8;  // n8 tiles of an output block
  static constexpr int TBL = BM;       // cross-table entries (BM >= every inner tile)
  static_assert(BN <= BM && BNQ <= BM && BN2 <= BM, "");
};

// A token of a tile, as the kernels see it: prefix sums (log2 units), map position, and its offsets into the
// cross tables: a query of local index a (row il = a / ncols, column jl = a % ncols of its tile) has
// o1 = il * cap_k, o2 = jl; a key of local index c (kl, ll) has o1 = ll, o2 = kl * cap_q. Then
// XQ[q.o1 + k.o1] = (cr, cc)(query row, key column) and XK[q.o2 + k.o2] = (cr, cc)(key row, query column).
// Positions and offsets are packed in 16 bits each (the launcher takes this path for H, W < 2^15 only): four
// words, one 16-byte shared load per key, few registers.
struct TcTok {
  float cr, cc;
  int rc;  // row | col << 16
  int oo;  // o1 | o2 << 16
  PPMA_HD int row() const { return rc & 0xffff; }
  PPMA_HD int col() const { return rc >> 16; }
  PPMA_HD int o1() const { return oo & 0xffff; }
  PPMA_HD int o2() const { return oo >> 16; }
};
constexpr int kTcMaxSide = 32767;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

PPMA_HD TcTok tc_token(const TileDesc& t, int a, bool is_query, int cap_other, const float* crb,
                                const float* ccb, int W) {
  const int aa = a < t.count ? a : t.count - 1;  // rows / columns beyond the tile: its last token (masked later)
  const int il = aa / t.ncols, jl = aa % t.ncols;
  const int row = t.row0 + il, col = t.col0 + jl;
  const int64_t p = int64_t(row) * W + col;
  TcTok k;
  k.cr = crb[p] * kLog2e;
  k.cc = ccb[p] * kLog2e;
  k.rc = row | (col << 16);
  k.oo = is_query ? (il * cap_other) | (jl << 16) : jl | ((il * cap_other) << 16);
  return k;
}

// The two biases of query q and key k (log2 units), from the cross-table entries xq, xk.
PPMA_HD void tc_bias(const TcTok& q, const TcTok& k, float2 xq, float2 xk, float& m1, float& m2) {
  const int qi = q.row(), qj = q.col(), kk = k.row(), kl = k.col();
  m1 = line_bias(qj, kl, q.cr, xq.x) + line_bias(kk, qi, k.cc, xq.y);  // R_i(j,l) + C_l(i,k)
  m2 = line_bias(qj, kl, xk.x, k.cr) + line_bias(qi, kk, q.cc, xk.y);  // R_k(j,l) + C_j(i,k)
}

// Cross tables of a (query tile, key tile) pair (log2 units); see the header comment.
PPMA_HD void tc_cross_entry_q(const TileDesc& tq, const TileDesc& tk, int cap_k, int e, const float* crb,
                                       const float* ccb, int W, int& idx, float2& v) {
  const int il = e / tk.ncols, ll = e % tk.ncols;
  const int64_t p = int64_t(tq.row0 + il) * W + tk.col0 + ll;
  idx = il * cap_k + ll;
  v = make_float2(crb[p] * kLog2e, ccb[p] * kLog2e);
}
PPMA_HD void tc_cross_entry_k(const TileDesc& tq, const TileDesc& tk, int cap_q, int e, const float* crb,
                                       const float* ccb, int W, int& idx, float2& v) {
  const int kl = e / tq.ncols, jl = e % tq.ncols;
  const int64_t p = int64_t(tk.row0 + kl) * W + tq.col0 + jl;
  idx = kl * cap_q + jl;
  v = make_float2(crb[p] * kLog2e, ccb[p] * kLog2e);
}

template <int NT>
__device__ __forceinline__ void tc_load_cross(float2* xq, float2* xk, const TileDesc& tq, const TileDesc& tk,
                                              int cap_q, int cap_k, const float* crb, const float* ccb, int W,
                                              int tid) {
  for (int e = tid; e < tq.rows * tk.ncols; e += NT) {
    int idx;
    float2 v;
    tc_cross_entry_q(tq, tk, cap_k, e, crb, ccb, W, idx, v);
    xq[idx] = v;
  }
  for (int e = tid; e < tk.rows * tq.ncols; e += NT) {
    int idx;
    float2 v;
    tc_cross_entry_k(tq, tk, cap_q, e, crb, ccb, W, idx, v);
    xk[idx] = v;
  }
}

// cp.async of the tokens of tile `t` of a [B, H, W, heads, dim] tensor (unit last stride, 16-byte aligned rows)
// into a shared [ROWS][LD] 16-bit tile; rows >= t.count and columns >= dim (a multiple of 8) are zero-filled.
template <int NT, int ROWS, int DPAD, int LD, typename T>
__device__ __forceinline__ void tc_load_tile(uint16_t* dst, const T* base, const Strides4& s, int b, int g,
                                             const TileDesc& t, int dim, int tid) {
  constexpr int CPR = DPAD / 8;  // 16-byte chunks per row
  for (int e = tid; e < ROWS * CPR; e += NT) {
    const int r = e / CPR, ch = e % CPR;
    const bool valid = r < t.count && ch * 8 < dim;
    const int rr = r < t.count ? r : t.count - 1;
    const int i = t.row0 + rr / t.ncols, j = t.col0 + rr % t.ncols;
    const T* src = base + b * s.b + i * s.h + j * s.w + g * s.g + ch * 8;
    mma::cp_async_16(dst + r * LD + ch * 8, valid ? static_cast<const void*>(src) : static_cast<const void*>(base),
                     valid);
  }
}

// Reductions over the 4 lanes of a quad (the lanes that hold one row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One k16 step of acc[n] += A B_n, n over the NS n8 tiles of a tile: B from a row-major [n][k] shared tile
// (ldmatrix, two n8 tiles per x4); n8 tiles at or beyond `n_valid` are skipped.
template <typename T, int NS, int LD>
__device__ __forceinline__ void tc_mma_abt_step(float (&acc)[NS][4], const uint32_t (&af)[4], const uint16_t* bs,
                                                int kd, int n_valid, int lane) {
#pragma unroll
  for (int np = 0; np < NS / 2; ++np) {
    if (16 * np < n_valid) {
      uint32_t bf[4];
      mma::ldsm_x4<false>(bf, bs + (16 * np + mma::ldsm_b_row(lane)) * LD + 16 * kd + mma::ldsm_b_col(lane));
      const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
      mma::mma16816<T>(acc[2 * np], af, b0);
      mma::mma16816<T>(acc[2 * np + 1], af, b1);
    }
  }
}

// acc[n] += A B_n over the head dim (KD k16 steps), A from registers.
template <typename T, int KD, int NS, int LD>
__device__ __forceinline__ void tc_gemm_abt(float (&acc)[NS][4], const uint32_t (&af)[KD][4], const uint16_t* bs,
                                            int n_valid, int lane) {
#pragma unroll
  for (int kd = 0; kd < KD; ++kd) tc_mma_abt_step<T, NS, LD>(acc, af[kd], bs, kd, n_valid, lane);
}

// The same with A from rows [row0, row0 + 16) of a row-major [m][k] shared tile, one k16 step at a time (keeps
// 4 registers of A live instead of 4 KD).
template <typename T, int KD, int NS, int LD>
__device__ __forceinline__ void tc_gemm_abt_s(float (&acc)[NS][4], const uint16_t* as, int row0, const uint16_t* bs,
                                              int n_valid, int lane) {
#pragma unroll
  for (int kd = 0; kd < KD; ++kd) {
    uint32_t af[4];
    mma::ldsm_x4<false>(af, as + (row0 + mma::ldsm_a_row(lane)) * LD + 16 * kd + mma::ldsm_a_col(lane));
    tc_mma_abt_step<T, NS, LD>(acc, af, bs, kd, n_valid, lane);
  }
}

// acc[o] += P V_o: P from registers (KS k16 steps over the tile's keys), V from a row-major [k][n] shared tile
// (ldmatrix .trans), NO n8 tiles over the head dim. k16 steps at or beyond `k_valid` are skipped (P is 0 there).
template <typename T, int KS, int NO, int LD>
__device__ __forceinline__ void tc_gemm_ab(float (&acc)[NO][4], const uint32_t (&pf)[KS][4], const uint16_t* vs,
                                           int k_valid, int lane) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (16 * ks < k_valid) {
#pragma unroll
      for (int np = 0; np < NO / 2; ++np) {
        uint32_t bf[4];
        mma::ldsm_x4<true>(bf, vs + (16 * ks + mma::ldsm_bt_row(lane)) * LD + 16 * np + mma::ldsm_bt_col(lane));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        mma::mma16816<T>(acc[2 * np], pf[ks], b0);
        mma::mma16816<T>(acc[2 * np + 1], pf[ks], b1);
      }
    }
  }
}

// Two P V products sharing the V fragments.
template <typename T, int KS, int NO, int LD>
__device__ __forceinline__ void tc_gemm_ab2(float (&acc1)[NO][4], float (&acc2)[NO][4], const uint32_t (&pf1)[KS][4],
                                            const uint32_t (&pf2)[KS][4], const uint16_t* vs, int k_valid, int lane) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (16 * ks < k_valid) {
#pragma unroll
      for (int np = 0; np < NO / 2; ++np) {
        uint32_t bf[4];
        mma::ldsm_x4<true>(bf, vs + (16 * ks + mma::ldsm_bt_row(lane)) * LD + 16 * np + mma::ldsm_bt_col(lane));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        mma::mma16816<T>(acc1[2 * np], pf1[ks], b0);
        mma::mma16816<T>(acc1[2 * np + 1], pf1[ks], b1);
        mma::mma16816<T>(acc2[2 * np], pf2[ks], b0);
        mma::mma16816<T>(acc2[2 * np + 1], pf2[ks], b1);
      }
    }
  }
}

// C fragments of NS n8 tiles (fp32) -> A fragments of NS / 2 k16 steps (16 bits).
template <typename T, int NS>
__device__ __forceinline__ void tc_pack_a(uint32_t (&pf)[NS / 2][4], const float (&c)[NS][4]) {
#pragma unroll
  for (int ks = 0; ks < NS / 2; ++ks) {
    pf[ks][0] = mma::pack2<T>(c[2 * ks][0], c[2 * ks][1]);
    pf[ks][1] = mma::pack2<T>(c[2 * ks][2], c[2 * ks][3]);
    pf[ks][2] = mma::pack2<T>(c[2 * ks + 1][0], c[2 * ks + 1][1]);
    pf[ks][3] = mma::pack2<T>(c[2 * ks + 1][2], c[2 * ks + 1][3]);
  }
}

// A fragments of the 16 rows [row0, row0 + 16) of a row-major [m][k] shared tile.
template <int KD, int LD>
__device__ __forceinline__ void tc_load_a(uint32_t (&af)[KD][4], const uint16_t* s, int row0, int lane) {
#pragma unroll
  for (int kd = 0; kd < KD; ++kd)
    mma::ldsm_x4<false>(af[kd], s + (row0 + mma::ldsm_a_row(lane)) * LD + 16 * kd + mma::ldsm_a_col(lane));
}

// Stores the C fragments of rows [row0, row0 + 16) of an output block (scaled) into a contiguous
// [B, H, W, heads, dim] tensor; rows beyond the tile and columns beyond dim are not written.
template <typename T, int NO>
__device__ __forceinline__ void tc_store_rows(T* out, const float (&acc)[NO][4], const float (&mul)[2],
                                              const TileDesc& t, int row0, int lane, int b, int g, int G,
                                              int64_t N, int W, int dim) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int a = row0 + mma::c_row(lane, 2 * r);
    if (a >= t.count) continue;
    const int64_t tok = int64_t(t.row0 + a / t.ncols) * W + t.col0 + a % t.ncols;
    T* o = out + ((int64_t(b) * N + tok) * G + g) * dim;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      const int e = 8 * n + mma::c_col(lane, 0);  // dim % 8 == 0: both e and e + 1 are in range or neither
      if (e < dim) {
        o[e] = from_acc<T>(acc[n][2 * r] * mul[r]);
        o[e + 1] = from_acc<T>(acc[n][2 * r + 1] * mul[r]);
      }
    }
  }
}

// =============================================================================================
// Forward
// =============================================================================================
template <int DPAD>
struct TcFwdSmem {
  using Tr = TcTraits<DPAD>;
  uint16_t q[Tr::BM * Tr::LD];
  uint16_t k[Tr::BN * Tr::LD];
  uint16_t v[Tr::BN * Tr::LD];
  TcTok key[Tr::BN];
  float2 xq[Tr::TBL], xk[Tr::TBL];
};

// Grid: RowTiling(H, W, BM).num_tiles * B * heads blocks (tile fastest); 128 threads.
template <typename T, int DPAD>
__global__ void __launch_bounds__(128, PPMA_TC_MIN_BLOCKS) polyline_attention_tc_fwd_kernel(PolylineAttnParams<T, float> p) {
  using Tr = TcTraits<DPAD>;
  constexpr int NT = Tr::NT, BM = Tr::BM, BN = Tr::BN, LD = Tr::LD, KD = Tr::KD, NO = Tr::NO;
  constexpr int NS = BN / 8, KS = BN / 16;
  PPMA_DYNAMIC_SMEM(TcFwdSmem<DPAD>, sm);

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const int64_t N = int64_t(H) * W;
  const RowTiling tq_(H, W, BM), tk_(H, W, BN);
  const int tile = int(blockIdx.x % unsigned(tq_.num_tiles));
  const int bg = int(blockIdx.x / unsigned(tq_.num_tiles)), b = bg / G, g = bg % G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const TileDesc tq = tq_.tile(tile);
  const float* crb = p.cr + bg * N;
  const float* ccb = p.cc + bg * N;
  const float sl2 = p.scale * kLog2e;
  const int cap_q = tq_.cap(), cap_k = tk_.cap();
  const bool active = 16 * warp < tq.count;  // warp-uniform: a warp whose 16 rows are all beyond the tile idles

  tc_load_tile<NT, BM, DPAD, LD>(sm.q, p.q, p.sq, b, g, tq, p.sz.d, tid);
  mma::cp_async_wait_all();
  __syncthreads();
  // Q fragments stay in registers up to DPAD 64; at 128 they are re-read from shared memory per key tile, which
  // leaves the registers to the two output accumulators.
  constexpr bool kQRegs = DPAD <= 64;
  uint32_t qf[kQRegs ? KD : 1][4];
  if constexpr (kQRegs) tc_load_a<KD, LD>(qf, sm.q, 16 * warp, lane);
  TcTok rq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) rq[r] = tc_token(tq, 16 * warp + mma::c_row(lane, 2 * r), true, cap_k, crb, ccb, W);

  float o1[NO][4], o2[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o1[n][i] = o2[n][i] = 0.f;
  float m1[2] = {-INFINITY, -INFINITY}, m2[2] = {-INFINITY, -INFINITY}, l1[2] = {0.f, 0.f}, l2[2] = {0.f, 0.f};

  for (int kt = 0; kt < tk_.num_tiles; ++kt) {
    const TileDesc tk = tk_.tile(kt);
    __syncthreads();  // the previous key tile is consumed
    tc_load_tile<NT, BN, DPAD, LD>(sm.k, p.k, p.sk, b, g, tk, p.sz.d, tid);
    tc_load_tile<NT, BN, DPAD, LD>(sm.v, p.v, p.sv, b, g, tk, p.sz.dv, tid);
    for (int c = tid; c < BN; c += NT) sm.key[c] = tc_token(tk, c, false, cap_q, crb, ccb, W);
    tc_load_cross<NT>(sm.xq, sm.xk, tq, tk, cap_q, cap_k, crb, ccb, W, tid);
    mma::cp_async_wait_all();
    __syncthreads();
    if (!active) continue;
    const int nk = tk.count;

    float s1[NS][4], s2[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) s1[n][i] = 0.f;
    if constexpr (kQRegs)
      tc_gemm_abt<T, KD, NS, LD>(s1, qf, sm.k, nk, lane);
    else
      tc_gemm_abt_s<T, KD, NS, LD>(s1, sm.q, 16 * warp, sm.k, nk, lane);

    // Both logit tiles from the one score tile: s1 = S + M, s2 = S + M' (log2 units), -inf beyond the keys.
    float mx1[2] = {-INFINITY, -INFINITY}, mx2[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1, c = 8 * n + mma::c_col(lane, i);
        const TcTok kk = sm.key[c];
        float b1, b2;
        tc_bias(rq[r], kk, sm.xq[rq[r].o1() + kk.o1()], sm.xk[rq[r].o2() + kk.o2()], b1, b2);
        const float x = s1[n][i] * sl2;
        const bool ok = c < nk;
        s1[n][i] = ok ? x + b1 : -INFINITY;
        s2[n][i] = ok ? x + b2 : -INFINITY;
        mx1[r] = max(mx1[r], s1[n][i]);
        mx2[r] = max(mx2[r], s2[n][i]);
      }
      mma::load_fence();
    }
    // Online softmax: new row maxima (every tile has a real key, so they are finite), rescale, exponentiate.
    float a1[2], a2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float n1 = max(m1[r], quad_max(mx1[r])), n2 = max(m2[r], quad_max(mx2[r]));
      a1[r] = mma::exp2_fast(m1[r] - n1);  // 0 on the first tile (m = -inf)
      a2[r] = mma::exp2_fast(m2[r] - n2);
      m1[r] = n1;
      m2[r] = n2;
      l1[r] *= a1[r];
      l2[r] *= a2[r];
    }
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o1[n][i] *= a1[i >> 1];
        o2[n][i] *= a2[i >> 1];
      }
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1;
        s1[n][i] = mma::exp2_fast(s1[n][i] - m1[r]);
        s2[n][i] = mma::exp2_fast(s2[n][i] - m2[r]);
        l1[r] += s1[n][i];  // this lane's part of the row sum; the quad is summed once at the end
        l2[r] += s2[n][i];
      }
    uint32_t pf1[KS][4], pf2[KS][4];
    tc_pack_a<T, NS>(pf1, s1);
    tc_pack_a<T, NS>(pf2, s2);
    tc_gemm_ab2<T, KS, NO, LD>(o1, o2, pf1, pf2, sm.v, nk, lane);
  }
  if (!active) return;

  float inv1[2], inv2[2], half1[2], half2[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l1[r] = quad_sum(l1[r]);
    l2[r] = quad_sum(l2[r]);
    inv1[r] = 1.f / l1[r];
    inv2[r] = 1.f / l2[r];
    half1[r] = 0.5f * inv1[r];
    half2[r] = 0.5f * inv2[r];
  }
  // out = (o1 / l1 + o2 / l2) / 2, out_v2h = o1 / l1
  float oo[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) oo[n][i] = o1[n][i] * half1[i >> 1] + o2[n][i] * half2[i >> 1];
  const float one[2] = {1.f, 1.f};
  tc_store_rows<T, NO>(p.out, oo, one, tq, 16 * warp, lane, b, g, G, N, W, p.sz.dv);
  tc_store_rows<T, NO>(p.out_v2h, o1, inv1, tq, 16 * warp, lane, b, g, G, N, W, p.sz.dv);
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int a = 16 * warp + mma::c_row(lane, 2 * r);
      if (a >= tq.count) continue;
      const int64_t tok = int64_t(tq.row0 + a / tq.ncols) * W + tq.col0 + a % tq.ncols;
      float* l = p.lse + ((int64_t(b) * N + tok) * G + g) * 2;
      l[0] = (m1[r] + log2f(l1[r])) * kLn2;
      l[1] = (m2[r] + log2f(l2[r])) * kLn2;
    }
  }
}

// =============================================================================================
// Backward: pieces shared by the dq kernel (outer tiles of queries) and the dkdv kernel (outer tiles of keys)
// =============================================================================================

// A backward CTA: its unit of the outer RowTiling (one tile, or a group of segments of one row), its (b, head),
// the prefix sums of that (b, head), and its cross-term tables (entry r * W + x = token (trow0 + r, x)).
struct TcBwdCta {
  int unit, bg, b, g, trow0;  // unit: the CTA's unit of the outer RowTiling
  const float* crb;
  const float* ccb;
  float* tab_cr;
  float* tab_cc;
  template <typename T>
  PPMA_D TcBwdCta(const PolylineAttnParams<T, float>& p, const RowTiling& outer, float* x_cr, float* x_cc) {
    const int64_t N = int64_t(p.sz.H) * p.sz.W;
    unit = int(blockIdx.x % unsigned(outer.num_ctas));
    bg = int(blockIdx.x / unsigned(outer.num_ctas));
    b = bg / p.sz.G;
    g = bg % p.sz.G;
    trow0 = outer.cta_row0(unit);
    crb = p.cr + bg * N;
    ccb = p.cc + bg * N;
    tab_cr = x_cr + (int64_t(bg) * outer.num_ctas + unit) * outer.table;
    tab_cc = x_cc + (int64_t(bg) * outer.num_ctas + unit) * outer.table;
  }
};

// Cross terms of one (outer tile, inner tile) pair from the pair's score-gradient tile ds[o * ld + n] (o: outer
// token, n: inner token) in shared memory: token (row of o, column of n) gets the sum over the outer tokens of its
// row and the inner tokens of its column of sgn(col(n) - col(o)) ds (cr) and sgn(row(o) - row(n)) ds (cc). For the
// dq kernel (outer = queries, ds = dS1) that is token (i, l); for the dkdv kernel (outer = keys, ds = dS2) token
// (k, j). One thread per entry, fixed order, and the entry belongs to this CTA's table alone.
template <int NT>
PPMA_D void tc_cross_terms(const float* ds, int ld, const TileDesc& to, const TileDesc& ti, const TcBwdCta& c,
                           int W, int tid) {
  for (int e = tid; e < to.rows * ti.ncols; e += NT) {
    const int r = e / ti.ncols, x = e % ti.ncols;
    const int orow = to.row0 + r, icol = ti.col0 + x;
    float scr = 0.f, scc = 0.f;
    for (int ir = 0; ir < ti.rows; ++ir) {
      const float* col = ds + ir * ti.ncols + x;
      float sum = 0.f, sgn_sum = 0.f;
      for (int oc = 0; oc < to.ncols; ++oc) {
        const float v = col[(r * to.ncols + oc) * ld];
        sum += v;
        sgn_sum += sgn_diff<float>(icol, to.col0 + oc) * v;
      }
      scr += sgn_sum;
      scc += sgn_diff<float>(orow, ti.row0 + ir) * sum;
    }
    const int64_t ti_ = int64_t(orow - c.trow0) * W + icol;
    c.tab_cr[ti_] += scr;
    c.tab_cc[ti_] += scc;
  }
}

// The bias terms a warp's 16 outer tokens own (summed by each lane over its columns), quad-summed and written to
// own_cr / own_cc ([BG][N]) for the tokens of the tile.
PPMA_D void tc_store_own(float* own_cr, float* own_cc, float (&cr)[2], float (&cc)[2], const TcTok (&tok)[2],
                         const TileDesc& t, int row0, int lane, int64_t base, int W) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float gcr = quad_sum(cr[r]), gcc = quad_sum(cc[r]);
    const int a = row0 + mma::c_row(lane, 2 * r);
    if ((lane & 3) == 0 && a < t.count) {
      const int64_t tok_ = base + int64_t(tok[r].row()) * W + tok[r].col();
      own_cr[tok_] = gcr;
      own_cc[tok_] = gcc;
    }
  }
}

// =============================================================================================
// Backward, query-outer: dq and the query-owned / (query row, key column) bias terms
// =============================================================================================
template <int DPAD>
struct TcDqSmem {
  using Tr = TcTraits<DPAD>;
  uint16_t q[Tr::BM * Tr::LD];  // the CTA's query tile and its dO, resident (A operands read per k16 step)
  uint16_t dO[Tr::BM * Tr::LD];
  float ds1[Tr::BM * (Tr::BNQ + 1)];  // the dS1 tile of the current key tile, for the cross terms
  uint16_t k[Tr::BNQ * Tr::LD];
  uint16_t v[Tr::BNQ * Tr::LD];
  TcTok key[Tr::BNQ];
  float2 xq[Tr::TBL], xk[Tr::TBL];
};

// Grid: RowTiling(H, W, BM).num_ctas * B * heads blocks; a CTA owns the tiles of its RowTiling unit and
// accumulates that unit's table of x1 cross terms.
template <typename T, int DPAD>
__global__ void __launch_bounds__(128, PPMA_TC_MIN_BLOCKS) polyline_attention_tc_dq_kernel(PolylineAttnParams<T, float> p) {
  using Tr = TcTraits<DPAD>;
  constexpr int NT = Tr::NT, BM = Tr::BM, BN = Tr::BNQ, LD = Tr::LD, KD = Tr::KD, NO = Tr::NO;
  constexpr int NS = BN / 8, KS = BN / 16, DSLD = BN + 1;
  PPMA_DYNAMIC_SMEM(TcDqSmem<DPAD>, sm);

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const int64_t N = int64_t(H) * W;
  const RowTiling tq_(H, W, BM), tk_(H, W, BN);
  const TcBwdCta cta(p, tq_, p.x1_cr, p.x1_cc);
  const int b = cta.b, g = cta.g, bg = cta.bg;
  const float *crb = cta.crb, *ccb = cta.ccb;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float sl2 = p.scale * kLog2e;
  const int cap_q = tq_.cap(), cap_k = tk_.cap();

  for (int m = 0; m < tq_.cta_count(cta.unit); ++m) {
    const TileDesc tq = tq_.tile(tq_.cta_tile(cta.unit, m));
    const bool active = 16 * warp < tq.count;
    __syncthreads();  // the previous tile's use of the shared buffers is over
    tc_load_tile<NT, BM, DPAD, LD>(sm.q, p.q, p.sq, b, g, tq, p.sz.d, tid);
    tc_load_tile<NT, BM, DPAD, LD>(sm.dO, p.dout, p.sdo, b, g, tq, p.sz.dv, tid);

    TcTok rq[2];
    float lse1[2], lse2[2], D1[2], D2[2], own_cr[2] = {0.f, 0.f}, own_cc[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rq[r] = tc_token(tq, 16 * warp + mma::c_row(lane, 2 * r), true, cap_k, crb, ccb, W);
      const int64_t tok = int64_t(rq[r].row()) * W + rq[r].col();
      const float* l = p.lse + ((int64_t(b) * N + tok) * G + g) * 2;
      lse1[r] = l[0] * kLog2e;
      lse2[r] = l[1] * kLog2e;
      D1[r] = p.delta[(int64_t(bg) * N + tok) * 2];
      D2[r] = p.delta[(int64_t(bg) * N + tok) * 2 + 1];
    }
    float dqa[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) dqa[n][i] = 0.f;

    for (int kt = 0; kt < tk_.num_tiles; ++kt) {
      const TileDesc tk = tk_.tile(kt);
      __syncthreads();  // the previous dS1 tile and K, V are consumed
      tc_load_tile<NT, BN, DPAD, LD>(sm.k, p.k, p.sk, b, g, tk, p.sz.d, tid);
      tc_load_tile<NT, BN, DPAD, LD>(sm.v, p.v, p.sv, b, g, tk, p.sz.dv, tid);
      for (int c = tid; c < BN; c += NT) sm.key[c] = tc_token(tk, c, false, cap_q, crb, ccb, W);
      tc_load_cross<NT>(sm.xq, sm.xk, tq, tk, cap_q, cap_k, crb, ccb, W, tid);
      mma::cp_async_wait_all();
      __syncthreads();
      const int nk = tk.count;
      if (active) {
        float sc[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
        tc_gemm_abt_s<T, KD, NS, LD>(sc, sm.q, 16 * warp, sm.k, nk, lane);  // S = Q K^T
        tc_gemm_abt_s<T, KD, NS, LD>(dp, sm.dO, 16 * warp, sm.v, nk, lane);  // dP = dO V^T
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1, a = 16 * warp + mma::c_row(lane, i), c = 8 * n + mma::c_col(lane, i);
            const TcTok kk = sm.key[c];
            float b1, b2;
            tc_bias(rq[r], kk, sm.xq[rq[r].o1() + kk.o1()], sm.xk[rq[r].o2() + kk.o2()], b1, b2);
            const float x = sc[n][i] * sl2;
            const float P1 = mma::exp2_fast(x + b1 - lse1[r]), P2 = mma::exp2_fast(x + b2 - lse2[r]);
            const bool ok = c < nk && a < tq.count;
            const float g1 = ok ? P1 * (0.5f * dp[n][i] - D1[r]) : 0.f;
            const float g2 = ok ? P2 * (0.5f * dp[n][i] - D2[r]) : 0.f;
            own_cr[r] += sgn_diff<float>(rq[r].col(), kk.col()) * g1;  // R_i(j,l) on (i,j)
            own_cc[r] += sgn_diff<float>(rq[r].row(), kk.row()) * g2;  // C_j(i,k) on (i,j)
            sm.ds1[a * DSLD + c] = g1;
            sc[n][i] = g1 + g2;  // dS, the gradient of the shared logits
          }
          mma::load_fence();
        }
        uint32_t sf[KS][4];
        tc_pack_a<T, NS>(sf, sc);
        tc_gemm_ab<T, KS, NO, LD>(dqa, sf, sm.k, nk, lane);  // dQ += dS K
      }
      __syncthreads();
      tc_cross_terms<NT>(sm.ds1, DSLD, tq, tk, cta, W, tid);  // tokens (query row, key column)
    }
    if (active) {
      const float mul[2] = {p.scale, p.scale};
      tc_store_rows<T, NO>(p.dq, dqa, mul, tq, 16 * warp, lane, b, g, G, N, W, p.sz.d);
      tc_store_own(p.gq_cr, p.gq_cc, own_cr, own_cc, rq, tq, 16 * warp, lane, int64_t(bg) * N, W);
    }
  }
}

// =============================================================================================
// Backward, key-outer: dk, dv and the key-owned / (key row, query column) bias terms
// =============================================================================================
template <int DPAD>
struct TcDkvSmem {
  using Tr = TcTraits<DPAD>;
  uint16_t k[Tr::BM * Tr::LD];  // the CTA's key tile, resident
  uint16_t v[Tr::BM * Tr::LD];
  uint16_t q[Tr::BN2 * Tr::LD];  // the current query tile
  uint16_t dO[Tr::BN2 * Tr::LD];
  float ds2[Tr::BM * (Tr::BN2 + 1)];
  TcTok qtok[Tr::BN2];
  float4 qstat[Tr::BN2];  // lse1, lse2 (log2 units), D1, D2
  float2 xq[Tr::TBL], xk[Tr::TBL];
};

template <typename T, int DPAD>
__global__ void __launch_bounds__(128, PPMA_TC_MIN_BLOCKS) polyline_attention_tc_dkdv_kernel(PolylineAttnParams<T, float> p) {
  using Tr = TcTraits<DPAD>;
  constexpr int NT = Tr::NT, BM = Tr::BM, BN = Tr::BN2, LD = Tr::LD, KD = Tr::KD, NO = Tr::NO;
  constexpr int NS = BN / 8, KS = BN / 16, DSLD = BN + 1;
  PPMA_DYNAMIC_SMEM(TcDkvSmem<DPAD>, sm);

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const int64_t N = int64_t(H) * W;
  const RowTiling tk_(H, W, BM), tq_(H, W, BN);
  const TcBwdCta cta(p, tk_, p.x2_cr, p.x2_cc);
  const int b = cta.b, g = cta.g, bg = cta.bg;
  const float *crb = cta.crb, *ccb = cta.ccb;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float sl2 = p.scale * kLog2e;
  const int cap_q = tq_.cap(), cap_k = tk_.cap();

  for (int m = 0; m < tk_.cta_count(cta.unit); ++m) {
    const TileDesc tk = tk_.tile(tk_.cta_tile(cta.unit, m));
    const bool active = 16 * warp < tk.count;
    __syncthreads();
    tc_load_tile<NT, BM, DPAD, LD>(sm.k, p.k, p.sk, b, g, tk, p.sz.d, tid);
    tc_load_tile<NT, BM, DPAD, LD>(sm.v, p.v, p.sv, b, g, tk, p.sz.dv, tid);
    TcTok rk[2];
    float own_cr[2] = {0.f, 0.f}, own_cc[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) rk[r] = tc_token(tk, 16 * warp + mma::c_row(lane, 2 * r), false, cap_q, crb, ccb, W);
    float dka[NO][4], dva[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) dka[n][i] = dva[n][i] = 0.f;

    for (int qt = 0; qt < tq_.num_tiles; ++qt) {
      const TileDesc tq = tq_.tile(qt);
      __syncthreads();
      tc_load_tile<NT, BN, DPAD, LD>(sm.q, p.q, p.sq, b, g, tq, p.sz.d, tid);
      tc_load_tile<NT, BN, DPAD, LD>(sm.dO, p.dout, p.sdo, b, g, tq, p.sz.dv, tid);
      for (int c = tid; c < BN; c += NT) {
        const TcTok t = tc_token(tq, c, true, cap_k, crb, ccb, W);
        const int64_t tok = int64_t(t.row()) * W + t.col();
        const float* l = p.lse + ((int64_t(b) * N + tok) * G + g) * 2;
        sm.qtok[c] = t;
        sm.qstat[c] = make_float4(l[0] * kLog2e, l[1] * kLog2e, p.delta[(int64_t(bg) * N + tok) * 2],
                                  p.delta[(int64_t(bg) * N + tok) * 2 + 1]);
      }
      tc_load_cross<NT>(sm.xq, sm.xk, tq, tk, cap_q, cap_k, crb, ccb, W, tid);
      mma::cp_async_wait_all();
      __syncthreads();
      const int nq = tq.count;
      if (active) {
        float sc[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
        tc_gemm_abt_s<T, KD, NS, LD>(sc, sm.k, 16 * warp, sm.q, nq, lane);   // S^T = K Q^T
        tc_gemm_abt_s<T, KD, NS, LD>(dp, sm.v, 16 * warp, sm.dO, nq, lane);  // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1, a = 16 * warp + mma::c_row(lane, i), c = 8 * n + mma::c_col(lane, i);
            const TcTok qq = sm.qtok[c];
            const float4 st = sm.qstat[c];
            float b1, b2;
            tc_bias(qq, rk[r], sm.xq[qq.o1() + rk[r].o1()], sm.xk[qq.o2() + rk[r].o2()], b1, b2);
            const float x = sc[n][i] * sl2;
            const bool ok = c < nq && a < tk.count;
            const float P1 = ok ? mma::exp2_fast(x + b1 - st.x) : 0.f;
            const float P2 = ok ? mma::exp2_fast(x + b2 - st.y) : 0.f;
            const float g1 = P1 * (0.5f * dp[n][i] - st.z), g2 = P2 * (0.5f * dp[n][i] - st.w);
            own_cc[r] += sgn_diff<float>(rk[r].row(), qq.row()) * g1;  // C_l(i,k) on (k,l)
            own_cr[r] += sgn_diff<float>(rk[r].col(), qq.col()) * g2;  // R_k(j,l) on (k,l)
            sm.ds2[a * DSLD + c] = g2;
            dp[n][i] = 0.5f * (P1 + P2);  // dP is not needed any more: its registers take (P1 + P2) / 2
            sc[n][i] = g1 + g2;
          }
          mma::load_fence();
        }
        uint32_t pf[KS][4], sf[KS][4];
        tc_pack_a<T, NS>(pf, dp);
        tc_pack_a<T, NS>(sf, sc);
        tc_gemm_ab<T, KS, NO, LD>(dva, pf, sm.dO, nq, lane);  // dV += (P1 + P2)^T dO / 2
        tc_gemm_ab<T, KS, NO, LD>(dka, sf, sm.q, nq, lane);   // dK += dS^T Q
      }
      __syncthreads();
      tc_cross_terms<NT>(sm.ds2, DSLD, tk, tq, cta, W, tid);  // tokens (key row, query column)
    }
    if (active) {
      const float mul_k[2] = {p.scale, p.scale}, one[2] = {1.f, 1.f};
      tc_store_rows<T, NO>(p.dk, dka, mul_k, tk, 16 * warp, lane, b, g, G, N, W, p.sz.d);
      tc_store_rows<T, NO>(p.dv, dva, one, tk, 16 * warp, lane, b, g, G, N, W, p.sz.dv);
      tc_store_own(p.gk_cr, p.gk_cc, own_cr, own_cc, rk, tk, 16 * warp, lane, int64_t(bg) * N, W);
    }
  }
}

// =============================================================================================
// Host-side launch helpers (no torch)
// =============================================================================================
// Blocks of the forward grid and of the two backward grids (the launchers check them against the grid limit).
template <int DPAD>
inline int64_t polyline_attention_tc_blocks(const GridSizes& sz) {
  const RowTiling t(sz.H, sz.W, TcTraits<DPAD>::BM);
  const int64_t m = t.num_tiles > t.num_ctas ? t.num_tiles : t.num_ctas;
  return m * sz.B * sz.G;
}

// The tile size of the cross-term tables of the backward (RowTiling(H, W, ...)).
template <int DPAD>
constexpr int polyline_attention_tc_bwd_tile() {
  return TcTraits<DPAD>::BM;
}

template <typename T, int DPAD>
inline void launch_polyline_attention_tc_fwd(const PolylineAttnParams<T, float>& p, cudaStream_t stream) {
  const RowTiling t(p.sz.H, p.sz.W, TcTraits<DPAD>::BM);
  auto kernel = polyline_attention_tc_fwd_kernel<T, DPAD>;
  const size_t smem = sizeof(TcFwdSmem<DPAD>);
  allow_dynamic_smem(kernel, smem);
  launch_kernel(kernel, dim3(unsigned(int64_t(t.num_tiles) * p.sz.B * p.sz.G)), dim3(TcTraits<DPAD>::NT), smem,
                stream, p);
}

// Requires p.delta, gq_*, gk_* ([BG][N]), x1_*, x2_* (zeroed, [BG][num_ctas][table] of
// RowTiling(H, W, polyline_attention_tc_bwd_tile<DPAD>())), g_log_alpha / g_log_beta.
template <typename T, int DPAD>
inline void launch_polyline_attention_tc_bwd(const PolylineAttnParams<T, float>& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G;
  launch_kernel(polyline_attention_delta_kernel<T>, dim3(unsigned((rows + 255) / 256)), dim3(256), 0, stream, p);
  const RowTiling t(p.sz.H, p.sz.W, TcTraits<DPAD>::BM);
  const dim3 grid(unsigned(int64_t(t.num_ctas) * p.sz.B * p.sz.G));
  auto dq = polyline_attention_tc_dq_kernel<T, DPAD>;
  auto dkdv = polyline_attention_tc_dkdv_kernel<T, DPAD>;
  allow_dynamic_smem(dq, sizeof(TcDqSmem<DPAD>));
  allow_dynamic_smem(dkdv, sizeof(TcDkvSmem<DPAD>));
  launch_kernel(dq, grid, dim3(TcTraits<DPAD>::NT), sizeof(TcDqSmem<DPAD>), stream, p);
  launch_kernel(dkdv, grid, dim3(TcTraits<DPAD>::NT), sizeof(TcDkvSmem<DPAD>), stream, p);
  launch_decay_grad(p, TcTraits<DPAD>::BM, stream);
}

}  // namespace ppma
