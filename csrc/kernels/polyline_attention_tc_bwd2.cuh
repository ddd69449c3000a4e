// polyline_attention backward on tensor cores, row-uniform form (docs/design.md §4.3 "The row-uniform kernels";
// opt-in through the internal option cuda_next_polyline_attention, docs/configuration.md). Same math, outputs,
// scratch buffers and ownership as the dq / dkdv kernels of polyline_attention_tc.cuh (read its header first);
// what changes is how the biases are formed and where the decay-gradient terms are reduced.
//
// Row-uniform maps. With 64-token RowTiling tiles, every warp's 16 outer tokens and every n8 block of 8 inner
// tokens lie in one map row when W is a multiple of 16 or W > 32 (polyline_attention_tc_row_uniform). For
// 16 < W < 32 the same kernels run in their two-row form (TWO = true, polyline_attention_tc_two_row: per-lane row
// select, see there); maps below 16 columns keep the kernels of polyline_attention_tc.cuh. For a (warp, n8 block)
// pair of query row i and key row k:
//   * the biases are separable: M = seg(j, l; cr(i,j), cr(i,l)) + e1[l], M' = seg(j, l; cr(k,j), cr(k,l)) + e2[j]
//     with e1[l] = seg(k, i; cc(k,l), cc(i,l)) and e2[j] = seg(i, k; cc(i,j), cc(k,j)) (seg = line_bias). A lane
//     reads its two key columns' token data, the two (query row, key column) and the two (key row, query column)
//     cross entries once per n8 block (6 shared loads per 4 score elements, against 12 per element-wise bias);
//   * the decay-gradient terms on the cross tokens (outer row, inner column) are column sums over the warp's rows
//     with the block pair's uniform sign sgn(i - k) for the cc terms: each lane adds its two columns of a block
//     pair to slots of its own in shared memory (tc_ru_col_add), over all inner tiles of one column range (all of
//     them when the inner tiles are whole rows, one segment position at a time for wide maps); then the CTA sums
//     the slots in a fixed order into a shared-memory copy of its table (tc_ru_flush). The table goes to global
//     memory once, at the end of the CTA (plain stores of every entry: no read-modify-write, no fp32 dS tile, no
//     per-tile cross-term pass and its barrier). Deterministic: fixed owners and orders, no atomics.
//   * Wider inner tiles, the largest without register spills (ptxas -v, sm_80 and sm_90; PPMA_TC_RU_BN_DQ,
//     PPMA_TC_RU_BN_DKDV): dq 64 keys up to head dim 64, 32 at 128 (was 32 / 16); dkdv 64 queries up to head dim
//     32, 32 at 64, 16 at 128 (was 16; at 128 dK and dV alone take 128 registers, and 16 spills 8 bytes on sm_80,
//     accepted in .ci/check_cuda.sh as for the verified dkdv kernel).
//   * Two inner-tile buffers up to head dim 64 (PPMA_TC_RU_STAGES): the cp.async copy of the next tile's K, V
//     (Q, dO) is in flight while the current tile is computed; one barrier per inner tile, plus one per flush.
// The inner loop visits the inner tiles of one segment position at a time (for wide maps: every row's segment s,
// then s + 1), so a lane's column accumulators always refer to the same inner columns between two flushes.
// Summation orders differ from polyline_attention_tc.cuh (dQ, dK, dV over inner tiles; the table terms), so the
// two agree up to rounding, not bitwise.
#pragma once

#include "polyline_attention_tc.cuh"

namespace ppma {

// Widest map of the row-uniform kernels: the CTA's cross-term table (2 x W floats for wide maps) lives in shared
// memory.
constexpr int kTcRuMaxWidth = 2048;

// Whether the row-uniform backward takes a map of width W (see the header comment).
PPMA_HD bool polyline_attention_tc_row_uniform(int W) { return (W % 16 == 0 || W > 32) && W <= kTcRuMaxWidth; }

// Whether the two-row form of the same kernels (TWO = true) takes W: 16 < W < 32, not a multiple of 16 (PPMA-T's
// stage 2 at 224², W = 28). A warp's 16 outer tokens and an n8 block of 8 inner tokens then lie in at most two map
// rows, and a lane's two rows (c_row 0..7 and 8..15) and two columns may lie in different ones. Each lane takes
// the row of each of its 4 score elements (per-lane row select): the bias of an element is tc_bias's, from the
// (row, column) cross entries of its own query row and key row (4 + 4 per n8 block instead of 2 + 2), its cc sign
// is sgn(i - k) of its own rows, and the column sums keep the lane's two rows apart: one slot row per outer token
// of the warp (16, against 8 row groups when a warp's rows share one map row); the flush sends each slot row to the
// map row of its token. Maps below 16 columns (a warp across up to three rows) keep polyline_attention_tc.cuh.
PPMA_HD bool polyline_attention_tc_two_row(int W) { return W > 16 && W < 32 && W % 16 != 0; }

template <int DPAD>
struct TcRuTraits {
  // Inner tiles (multiples of 16 up to BM = 64): dq keys, dkdv queries.
#ifndef PPMA_TC_RU_BN_DQ
#define PPMA_TC_RU_BN_DQ (DPAD <= 64 ? 64 : 32)
#endif
#ifndef PPMA_TC_RU_BN_DKDV
#define PPMA_TC_RU_BN_DKDV (DPAD <= 32 ? 64 : DPAD <= 64 ? 32 : 16)
#endif
  static constexpr int BNQ = PPMA_TC_RU_BN_DQ;
  static constexpr int BN2 = PPMA_TC_RU_BN_DKDV;
  // Buffers of the inner tile: 2 (the next tile's K, V or Q, dO copied by cp.async while the current one is
  // computed) where shared memory leaves 2 blocks per SM, else 1.
#ifndef PPMA_TC_RU_STAGES
#define PPMA_TC_RU_STAGES (DPAD <= 64 ? 2 : 1)
#endif
  static constexpr int NBUF = PPMA_TC_RU_STAGES;
  static_assert(NBUF == 1 || NBUF == 2, "one or two inner-tile buffers");
  static_assert(BNQ % 16 == 0 && BN2 % 16 == 0 && BNQ <= TcTraits<DPAD>::BM && BN2 <= TcTraits<DPAD>::BM,
                "inner tiles are multiples of 16 up to BM");
};

// Column sums of the cross terms (outer row, inner column), per warp, row group (lane / 4) and inner-tile slot:
// col[warp][lane / 4][slot], slot = 8 n + 2 (lane % 4) + h of n8 block n. Each lane adds its two columns of a block
// pair to its own two slots (one 8-byte shared load and store: a row stride of BN + 8 floats keeps a half warp on
// distinct banks), so the sums need neither registers across inner tiles nor shuffles; the flush below reads
// them in a fixed order and zeroes them.
// RG: slot rows per warp, 8 (row group lane / 4: both of the lane's rows are in the warp's map row) or 16 (the
// two-row kernels: slot row c_row(lane, 2 r) = lane / 4 + 8 r for the lane's row r).
template <int BN, int RG = 8>
PPMA_D void tc_ru_col_add(float* col, int warp, int rg, int lane, int n, float a, float b) {
  float2* c = reinterpret_cast<float2*>(col + ((warp * RG + rg) * (BN + 8) + 8 * n + 2 * (lane & 3)));
  float2 v = *c;
  v.x += a;
  v.y += b;
  *c = v;
}

// Adds the column sums to the CTA's shared table (entry r * W + x = token (trow0 + r, x), as TcBwdCta's) and
// zeroes them. `ti`: the first inner tile of the flushed column range (its slots c < ti.count are inner column
// ti.col0 + c % ti.ncols; whole-row inner tiles of later rows use the same slots for the same columns). The warps
// of the outer tile `to` own rows to.row0 + 16 w / to.ncols (RG = 8); with RG = 16, slot row gr of warp w is
// outer token 16 w + gr, in row to.row0 + (16 w + gr) / to.ncols. One thread per entry, warps, row groups and
// slots in a fixed order.
template <int NT, int NW, int BN, int RG = 8>
PPMA_D void tc_ru_flush(float* tab_cr, float* tab_cc, float* col_cr, float* col_cc, const TileDesc& to,
                        const TileDesc& ti, int trow0, int W, int tid) {
  const int orows = to.rows;  // row segments: 1
  for (int e = tid; e < orows * ti.ncols; e += NT) {
    const int lr = e / ti.ncols, x = e % ti.ncols;
    float a = 0.f, c = 0.f;
    for (int w = 0; w < NW; ++w) {
      if (16 * w >= to.count) continue;
      if (RG == 8 && 16 * w / to.ncols != lr) continue;  // warp w's row: to.row0 + 16 w / to.ncols
      for (int gr = 0; gr < RG; ++gr) {
        if (RG == 16 && (16 * w + gr >= to.count || (16 * w + gr) / to.ncols != lr)) continue;
        const int base = (w * RG + gr) * (BN + 8);
        for (int sl = x; sl < ti.count; sl += ti.ncols) {
          a += col_cr[base + sl];
          c += col_cc[base + sl];
          col_cr[base + sl] = 0.f;
          col_cc[base + sl] = 0.f;
        }
      }
    }
    const int idx = (to.row0 - trow0 + lr) * W + ti.col0 + x;
    tab_cr[idx] += a;
    tab_cc[idx] += c;
  }
}

// The CTA's table: zeroed at the start, written to its global slot at the end.
template <int NT>
PPMA_D void tc_ru_table_store(const TcBwdCta& c, const float* tab, int tbl, int tid) {
  for (int e = tid; e < tbl; e += NT) {
    c.tab_cr[e] = tab[e];
    c.tab_cc[e] = tab[tbl + e];
  }
}

// =============================================================================================
// Query-outer: dq, the query-owned terms and the (query row, key column) table
// =============================================================================================
template <int DPAD, bool TWO = false>
struct TcRuDqSmem {
  using Tr = TcTraits<DPAD>;
  static constexpr int BN = TcRuTraits<DPAD>::BNQ, NBUF = TcRuTraits<DPAD>::NBUF, RG = TWO ? 16 : 8;
  uint16_t q[Tr::BM * Tr::LD];  // the CTA's query tile and its dO, resident
  uint16_t dO[Tr::BM * Tr::LD];
  uint16_t k[NBUF][BN * Tr::LD];  // the inner tile (and the next one)
  uint16_t v[NBUF][BN * Tr::LD];
  TcTok key[NBUF][BN];
  float2 xq[NBUF][Tr::TBL], xk[NBUF][Tr::TBL];
  float col[2][Tr::NW * RG * (BN + 8)];  // column sums of the cross terms (cr, cc): tc_ru_col_add
};  // followed by the CTA's table: 2 x RowTiling(H, W, BM).table floats

// Grid: RowTiling(H, W, BM).num_ctas * B * heads blocks, as polyline_attention_tc_dq_kernel. TWO: the two-row
// form (polyline_attention_tc_two_row).
template <typename T, int DPAD, bool TWO = false>
__global__ void __launch_bounds__(128, PPMA_TC_MIN_BLOCKS)
    polyline_attention_tc_ru_dq_kernel(PolylineAttnParams<T, float> p) {
  using Tr = TcTraits<DPAD>;
  constexpr int NT = Tr::NT, BM = Tr::BM, BN = TcRuTraits<DPAD>::BNQ, LD = Tr::LD, KD = Tr::KD, NO = Tr::NO;
  constexpr int NW = Tr::NW, NS = BN / 8, KS = BN / 16, NBUF = TcRuTraits<DPAD>::NBUF, RG = TWO ? 16 : 8;
  using Smem = TcRuDqSmem<DPAD, TWO>;
  PPMA_DYNAMIC_SMEM(Smem, sm);
  float* tab = reinterpret_cast<float*>(&sm + 1);

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const int64_t N = int64_t(H) * W;
  const RowTiling tq_(H, W, BM), tk_(H, W, BN);
  const TcBwdCta cta(p, tq_, p.x1_cr, p.x1_cc);
  const int b = cta.b, g = cta.g, bg = cta.bg;
  const float *crb = cta.crb, *ccb = cta.ccb;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float sl2 = p.scale * kLog2e;
  const int cap_q = tq_.cap(), cap_k = tk_.cap(), tbl = tq_.table;
  const int nseg = tk_.S, krows = tk_.S == 1 ? tk_.num_tiles : H;  // segment positions; inner tiles per position
  const int nit = nseg * krows;
  // Inner tile `it`: segment position it / krows, row (or whole-row tile) it % krows.
  auto inner = [&](int it) { return tk_.tile(nseg == 1 ? it : (it % krows) * nseg + it / krows); };
  for (int e = tid; e < 2 * tbl; e += NT) tab[e] = 0.f;
  for (int e = tid; e < 2 * NW * RG * (BN + 8); e += NT) (&sm.col[0][0])[e] = 0.f;

  for (int m = 0; m < tq_.cta_count(cta.unit); ++m) {
    const TileDesc tq = tq_.tile(tq_.cta_tile(cta.unit, m));
    const bool active = 16 * warp < tq.count;
    __syncthreads();  // the previous tile's use of the shared buffers is over
    tc_load_tile<NT, BM, DPAD, LD>(sm.q, p.q, p.sq, b, g, tq, p.sz.d, tid);
    tc_load_tile<NT, BM, DPAD, LD>(sm.dO, p.dout, p.sdo, b, g, tq, p.sz.dv, tid);

    // The lane's two queries (rows beyond the tile: its last token, masked); all of the warp's in one map row
    // unless TWO.
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
    const int qrow = rq[0].row();
    float dqa[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) dqa[n][i] = 0.f;

    // K and V of inner tile `it` into buffer `bf` by cp.async (completed by a wait and a barrier), with the
    // key data and the cross tables.
    auto load = [&](int it, int bf) {
      const TileDesc t = inner(it);
      tc_load_tile<NT, BN, DPAD, LD>(sm.k[bf], p.k, p.sk, b, g, t, p.sz.d, tid);
      tc_load_tile<NT, BN, DPAD, LD>(sm.v[bf], p.v, p.sv, b, g, t, p.sz.dv, tid);
      for (int c = tid; c < BN; c += NT) sm.key[bf][c] = tc_token(t, c, false, cap_q, crb, ccb, W);
      tc_load_cross<NT>(sm.xq[bf], sm.xk[bf], tq, t, cap_q, cap_k, crb, ccb, W, tid);
    };
    if (NBUF == 2) load(0, 0);
    for (int it = 0; it < nit; ++it) {
      const int s = it / krows, bf = NBUF == 2 ? it & 1 : 0;
      const TileDesc tk = inner(it);
      if (NBUF == 1) {
        __syncthreads();  // the previous inner tile is consumed
        load(it, 0);
      }
      mma::cp_async_wait_all();
      __syncthreads();  // tile `it` is in buffer bf; the other buffer and the flushed column sums are free
      if (NBUF == 2 && it + 1 < nit) load(it + 1, bf ^ 1);  // in flight while tile `it` is computed
      if (active) {
        const int nk = tk.count;
        float sc[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
        tc_gemm_abt_s<T, KD, NS, LD>(sc, sm.q, 16 * warp, sm.k[bf], nk, lane);  // S = Q K^T
        tc_gemm_abt_s<T, KD, NS, LD>(dp, sm.dO, 16 * warp, sm.v[bf], nk, lane);  // dP = dO V^T
#pragma unroll
        for (int n = 0; n < NS; ++n) {
          if (8 * n >= nk) {  // a block beyond the tile's keys (warp-uniform): dS = 0 for the k16 step it shares
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[n][i] = 0.f;
            continue;
          }
          const int c0 = 8 * n + mma::c_col(lane, 0);
          const TcTok kt[2] = {sm.key[bf][c0], sm.key[bf][c0 + 1]};
          if constexpr (TWO) {  // per element: query row of r, key row of h
            float xcr[2][2], g1c[2][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int r = i >> 1, h = i & 1, a = 16 * warp + mma::c_row(lane, i);
              const int qj = rq[r].col(), kl = kt[h].col();
              float b1, b2;
              tc_bias(rq[r], kt[h], sm.xq[bf][rq[r].o1() + kt[h].o1()], sm.xk[bf][rq[r].o2() + kt[h].o2()], b1, b2);
              const float x = sc[n][i] * sl2;
              const float P1 = mma::exp2_fast(x + b1 - lse1[r]), P2 = mma::exp2_fast(x + b2 - lse2[r]);
              const bool ok = c0 + h < nk && a < tq.count;
              const float g1 = ok ? P1 * (0.5f * dp[n][i] - D1[r]) : 0.f;
              const float g2 = ok ? P2 * (0.5f * dp[n][i] - D2[r]) : 0.f;
              const float sjl = sgn_diff<float>(qj, kl), sig = sgn_diff<float>(rq[r].row(), kt[h].row());
              own_cr[r] += sjl * g1;  // R_i(j,l) on (i,j)
              own_cc[r] += sig * g2;  // C_j(i,k) on (i,j)
              xcr[r][h] = -sjl * g1;  // R_i(j,l) on (i,l)
              g1c[r][h] = sig * g1;   // C_l(i,k) on (i,l)
              sc[n][i] = g1 + g2;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int rg = mma::c_row(lane, 2 * r);  // the slot row of the lane's row r
              tc_ru_col_add<BN, RG>(sm.col[0], warp, rg, lane, n, xcr[r][0], xcr[r][1]);
              tc_ru_col_add<BN, RG>(sm.col[1], warp, rg, lane, n, g1c[r][0], g1c[r][1]);
            }
            continue;
          }
          const int krow = kt[0].row();  // the block's key row
          const float sig = sgn_diff<float>(qrow, krow);  // sgn(i - k), uniform over the block pair
          float2 xq[2], xk[2];
          float e1[2], e2[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            xq[h] = sm.xq[bf][rq[0].o1() + kt[h].o1()];  // (cr, cc)(query row, key column l_h)
            e1[h] = line_bias(krow, qrow, kt[h].cc, xq[h].y);  // C_l(i,k)
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            xk[r] = sm.xk[bf][rq[r].o2() + kt[0].o2()];  // (cr, cc)(key row, query column j_r)
            e2[r] = line_bias(qrow, krow, rq[r].cc, xk[r].y);  // C_j(i,k)
          }
          float g1c[2] = {0.f, 0.f}, g2r[2] = {0.f, 0.f}, xcr[2] = {0.f, 0.f};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1, h = i & 1, a = 16 * warp + mma::c_row(lane, i);
            const int qj = rq[r].col(), kl = kt[h].col();
            const float b1 = line_bias(qj, kl, rq[r].cr, xq[h].x) + e1[h];   // R_i(j,l) + C_l(i,k)
            const float b2 = line_bias(qj, kl, xk[r].x, kt[h].cr) + e2[r];   // R_k(j,l) + C_j(i,k)
            const float x = sc[n][i] * sl2;
            const float P1 = mma::exp2_fast(x + b1 - lse1[r]), P2 = mma::exp2_fast(x + b2 - lse2[r]);
            const bool ok = c0 + h < nk && a < tq.count;
            const float g1 = ok ? P1 * (0.5f * dp[n][i] - D1[r]) : 0.f;
            const float g2 = ok ? P2 * (0.5f * dp[n][i] - D2[r]) : 0.f;
            const float sjl = sgn_diff<float>(qj, kl);
            own_cr[r] += sjl * g1;   // R_i(j,l) on (i,j)
            xcr[h] -= sjl * g1;      // R_i(j,l) on (i,l)
            g2r[r] += g2;            // C_j(i,k) on (i,j), times sig
            g1c[h] += g1;            // C_l(i,k) on (i,l), times sig
            sc[n][i] = g1 + g2;      // dS
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) own_cc[r] += sig * g2r[r];
          tc_ru_col_add<BN>(sm.col[0], warp, lane >> 2, lane, n, xcr[0], xcr[1]);
          tc_ru_col_add<BN>(sm.col[1], warp, lane >> 2, lane, n, sig * g1c[0], sig * g1c[1]);  // C_l(i,k) on (i,l)
        }
        uint32_t sf[KS][4];
        tc_pack_a<T, NS>(sf, sc);
        tc_gemm_ab<T, KS, NO, LD>(dqa, sf, sm.k[bf], nk, lane);  // dQ += dS K
      }
      if (it % krows == krows - 1) {  // this column range is done: the warps' column sums into the CTA's table
        __syncthreads();
        tc_ru_flush<NT, NW, BN, RG>(tab, tab + tbl, sm.col[0], sm.col[1], tq, tk_.tile(s), cta.trow0, W, tid);
      }
    }
    if (active) {
      const float mul[2] = {p.scale, p.scale};
      tc_store_rows<T, NO>(p.dq, dqa, mul, tq, 16 * warp, lane, b, g, G, N, W, p.sz.d);
      tc_store_own(p.gq_cr, p.gq_cc, own_cr, own_cc, rq, tq, 16 * warp, lane, int64_t(bg) * N, W);
    }
  }
  __syncthreads();
  tc_ru_table_store<NT>(cta, tab, tbl, tid);
}

// =============================================================================================
// Key-outer: dk, dv, the key-owned terms and the (key row, query column) table
// =============================================================================================
template <int DPAD, bool TWO = false>
struct TcRuDkvSmem {
  using Tr = TcTraits<DPAD>;
  static constexpr int BN = TcRuTraits<DPAD>::BN2, NBUF = TcRuTraits<DPAD>::NBUF, RG = TWO ? 16 : 8;
  uint16_t k[Tr::BM * Tr::LD];  // the CTA's key tile, resident
  uint16_t v[Tr::BM * Tr::LD];
  uint16_t q[NBUF][BN * Tr::LD];  // the inner query tile (and the next one)
  uint16_t dO[NBUF][BN * Tr::LD];
  TcTok qtok[NBUF][BN];
  float4 qstat[NBUF][BN];  // lse1, lse2 (log2 units), D1, D2
  float2 xq[NBUF][Tr::TBL], xk[NBUF][Tr::TBL];
  float col[2][Tr::NW * RG * (BN + 8)];
};  // followed by the CTA's table: 2 x RowTiling(H, W, BM).table floats

template <typename T, int DPAD, bool TWO = false>
__global__ void __launch_bounds__(128, PPMA_TC_MIN_BLOCKS)
    polyline_attention_tc_ru_dkdv_kernel(PolylineAttnParams<T, float> p) {
  using Tr = TcTraits<DPAD>;
  constexpr int NT = Tr::NT, BM = Tr::BM, BN = TcRuTraits<DPAD>::BN2, LD = Tr::LD, KD = Tr::KD, NO = Tr::NO;
  constexpr int NW = Tr::NW, NS = BN / 8, KS = BN / 16, NBUF = TcRuTraits<DPAD>::NBUF, RG = TWO ? 16 : 8;
  using Smem = TcRuDkvSmem<DPAD, TWO>;
  PPMA_DYNAMIC_SMEM(Smem, sm);
  float* tab = reinterpret_cast<float*>(&sm + 1);

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const int64_t N = int64_t(H) * W;
  const RowTiling tk_(H, W, BM), tq_(H, W, BN);
  const TcBwdCta cta(p, tk_, p.x2_cr, p.x2_cc);
  const int b = cta.b, g = cta.g, bg = cta.bg;
  const float *crb = cta.crb, *ccb = cta.ccb;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float sl2 = p.scale * kLog2e;
  const int cap_q = tq_.cap(), cap_k = tk_.cap(), tbl = tk_.table;
  const int nseg = tq_.S, qrows = tq_.S == 1 ? tq_.num_tiles : H;
  const int nit = nseg * qrows;
  auto inner = [&](int it) { return tq_.tile(nseg == 1 ? it : (it % qrows) * nseg + it / qrows); };
  for (int e = tid; e < 2 * tbl; e += NT) tab[e] = 0.f;
  for (int e = tid; e < 2 * NW * RG * (BN + 8); e += NT) (&sm.col[0][0])[e] = 0.f;

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
    const int krow = rk[0].row();
    float dka[NO][4], dva[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) dka[n][i] = dva[n][i] = 0.f;

    // Q and dO of inner tile `it` into buffer `bf` by cp.async, with the query data and the cross tables.
    auto load = [&](int it, int bf) {
      const TileDesc t = inner(it);
      tc_load_tile<NT, BN, DPAD, LD>(sm.q[bf], p.q, p.sq, b, g, t, p.sz.d, tid);
      tc_load_tile<NT, BN, DPAD, LD>(sm.dO[bf], p.dout, p.sdo, b, g, t, p.sz.dv, tid);
      for (int c = tid; c < BN; c += NT) {
        const TcTok u = tc_token(t, c, true, cap_k, crb, ccb, W);
        const int64_t tok = int64_t(u.row()) * W + u.col();
        const float* l = p.lse + ((int64_t(b) * N + tok) * G + g) * 2;
        sm.qtok[bf][c] = u;
        sm.qstat[bf][c] = make_float4(l[0] * kLog2e, l[1] * kLog2e, p.delta[(int64_t(bg) * N + tok) * 2],
                                      p.delta[(int64_t(bg) * N + tok) * 2 + 1]);
      }
      tc_load_cross<NT>(sm.xq[bf], sm.xk[bf], t, tk, cap_q, cap_k, crb, ccb, W, tid);
    };
    if (NBUF == 2) load(0, 0);
    for (int it = 0; it < nit; ++it) {
      const int s = it / qrows, bf = NBUF == 2 ? it & 1 : 0;
      const TileDesc tq = inner(it);
      if (NBUF == 1) {
        __syncthreads();
        load(it, 0);
      }
      mma::cp_async_wait_all();
      __syncthreads();
      if (NBUF == 2 && it + 1 < nit) load(it + 1, bf ^ 1);
      if (active) {
        const int nq = tq.count;
        float sc[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
        tc_gemm_abt_s<T, KD, NS, LD>(sc, sm.k, 16 * warp, sm.q[bf], nq, lane);   // S^T = K Q^T
        tc_gemm_abt_s<T, KD, NS, LD>(dp, sm.v, 16 * warp, sm.dO[bf], nq, lane);  // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < NS; ++n) {
          if (8 * n >= nq) {
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
            continue;
          }
          const int c0 = 8 * n + mma::c_col(lane, 0);
          const TcTok qt[2] = {sm.qtok[bf][c0], sm.qtok[bf][c0 + 1]};
          const float4 st[2] = {sm.qstat[bf][c0], sm.qstat[bf][c0 + 1]};
          if constexpr (TWO) {  // per element: key row of r, query row of h
            float xcr[2][2], g2c[2][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int r = i >> 1, h = i & 1, a = 16 * warp + mma::c_row(lane, i);
              const int qj = qt[h].col(), kl = rk[r].col();
              float b1, b2;
              tc_bias(qt[h], rk[r], sm.xq[bf][qt[h].o1() + rk[r].o1()], sm.xk[bf][qt[h].o2() + rk[r].o2()], b1, b2);
              const float x = sc[n][i] * sl2;
              const bool ok = c0 + h < nq && a < tk.count;
              const float P1 = ok ? mma::exp2_fast(x + b1 - st[h].x) : 0.f;
              const float P2 = ok ? mma::exp2_fast(x + b2 - st[h].y) : 0.f;
              const float g1 = P1 * (0.5f * dp[n][i] - st[h].z), g2 = P2 * (0.5f * dp[n][i] - st[h].w);
              const float slj = sgn_diff<float>(kl, qj), sig = sgn_diff<float>(rk[r].row(), qt[h].row());
              own_cr[r] += slj * g2;  // R_k(j,l) on (k,l)
              own_cc[r] += sig * g1;  // C_l(i,k) on (k,l)
              xcr[r][h] = -slj * g2;  // R_k(j,l) on (k,j)
              g2c[r][h] = sig * g2;   // C_j(i,k) on (k,j)
              dp[n][i] = 0.5f * (P1 + P2);
              sc[n][i] = g1 + g2;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int rg = mma::c_row(lane, 2 * r);
              tc_ru_col_add<BN, RG>(sm.col[0], warp, rg, lane, n, xcr[r][0], xcr[r][1]);
              tc_ru_col_add<BN, RG>(sm.col[1], warp, rg, lane, n, g2c[r][0], g2c[r][1]);
            }
            continue;
          }
          const int qrow = qt[0].row();  // the block's query row
          const float sig = sgn_diff<float>(krow, qrow);  // sgn(k - i)
          float2 xq[2], xk[2];
          float e1[2], e2[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            xq[r] = sm.xq[bf][qt[0].o1() + rk[r].o1()];  // (cr, cc)(query row, key column l_r)
            e1[r] = line_bias(krow, qrow, rk[r].cc, xq[r].y);  // C_l(i,k)
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            xk[h] = sm.xk[bf][qt[h].o2() + rk[0].o2()];  // (cr, cc)(key row, query column j_h)
            e2[h] = line_bias(qrow, krow, qt[h].cc, xk[h].y);  // C_j(i,k)
          }
          float g1r[2] = {0.f, 0.f}, g2c[2] = {0.f, 0.f}, xcr[2] = {0.f, 0.f};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1, h = i & 1, a = 16 * warp + mma::c_row(lane, i);
            const int qj = qt[h].col(), kl = rk[r].col();
            const float b1 = line_bias(qj, kl, qt[h].cr, xq[r].x) + e1[r];   // R_i(j,l) + C_l(i,k)
            const float b2 = line_bias(qj, kl, xk[h].x, rk[r].cr) + e2[h];   // R_k(j,l) + C_j(i,k)
            const float x = sc[n][i] * sl2;
            const bool ok = c0 + h < nq && a < tk.count;
            const float P1 = ok ? mma::exp2_fast(x + b1 - st[h].x) : 0.f;
            const float P2 = ok ? mma::exp2_fast(x + b2 - st[h].y) : 0.f;
            const float g1 = P1 * (0.5f * dp[n][i] - st[h].z), g2 = P2 * (0.5f * dp[n][i] - st[h].w);
            const float slj = sgn_diff<float>(kl, qj);
            own_cr[r] += slj * g2;   // R_k(j,l) on (k,l)
            xcr[h] -= slj * g2;      // R_k(j,l) on (k,j)
            g1r[r] += g1;            // C_l(i,k) on (k,l), times sig
            g2c[h] += g2;            // C_j(i,k) on (k,j), times sig
            dp[n][i] = 0.5f * (P1 + P2);
            sc[n][i] = g1 + g2;
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) own_cc[r] += sig * g1r[r];
          tc_ru_col_add<BN>(sm.col[0], warp, lane >> 2, lane, n, xcr[0], xcr[1]);
          tc_ru_col_add<BN>(sm.col[1], warp, lane >> 2, lane, n, sig * g2c[0], sig * g2c[1]);  // C_j(i,k) on (k,j)
        }
        uint32_t pf[KS][4], sf[KS][4];
        tc_pack_a<T, NS>(pf, dp);
        tc_pack_a<T, NS>(sf, sc);
        tc_gemm_ab<T, KS, NO, LD>(dva, pf, sm.dO[bf], nq, lane);  // dV += (P1 + P2)^T dO / 2
        tc_gemm_ab<T, KS, NO, LD>(dka, sf, sm.q[bf], nq, lane);   // dK += dS^T Q
      }
      if (it % qrows == qrows - 1) {
        __syncthreads();
        tc_ru_flush<NT, NW, BN, RG>(tab, tab + tbl, sm.col[0], sm.col[1], tk, tq_.tile(s), cta.trow0, W, tid);
      }
    }
    if (active) {
      const float mul_k[2] = {p.scale, p.scale}, one[2] = {1.f, 1.f};
      tc_store_rows<T, NO>(p.dk, dka, mul_k, tk, 16 * warp, lane, b, g, G, N, W, p.sz.d);
      tc_store_rows<T, NO>(p.dv, dva, one, tk, 16 * warp, lane, b, g, G, N, W, p.sz.dv);
      tc_store_own(p.gk_cr, p.gk_cc, own_cr, own_cc, rk, tk, 16 * warp, lane, int64_t(bg) * N, W);
    }
  }
  __syncthreads();
  tc_ru_table_store<NT>(cta, tab, tbl, tid);
}

// =============================================================================================
// Host-side launch helper (no torch)
// =============================================================================================
template <int DPAD>
inline size_t polyline_attention_tc_ru_table_bytes(const GridSizes& sz) {
  return 2 * size_t(RowTiling(sz.H, sz.W, TcTraits<DPAD>::BM).table) * sizeof(float);
}

// The backward on the row-uniform kernels in the form TWO. Same buffers as launch_polyline_attention_tc_bwd (the
// row-uniform kernels write every entry of the x1 / x2 tables; the other kernels need them zeroed).
template <typename T, int DPAD, bool TWO>
inline void launch_polyline_attention_tc_ru_bwd(const PolylineAttnParams<T, float>& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G;
  launch_kernel(polyline_attention_delta_kernel<T>, dim3(unsigned((rows + 255) / 256)), dim3(256), 0, stream, p);
  const RowTiling t(p.sz.H, p.sz.W, TcTraits<DPAD>::BM);
  const dim3 grid(unsigned(int64_t(t.num_ctas) * p.sz.B * p.sz.G));
  const size_t tb = polyline_attention_tc_ru_table_bytes<DPAD>(p.sz);
  const size_t s_dq = sizeof(TcRuDqSmem<DPAD, TWO>) + tb, s_dkdv = sizeof(TcRuDkvSmem<DPAD, TWO>) + tb;
  auto dq = polyline_attention_tc_ru_dq_kernel<T, DPAD, TWO>;
  auto dkdv = polyline_attention_tc_ru_dkdv_kernel<T, DPAD, TWO>;
  allow_dynamic_smem(dq, s_dq);
  allow_dynamic_smem(dkdv, s_dkdv);
  launch_kernel(dq, grid, dim3(TcTraits<DPAD>::NT), s_dq, stream, p);
  launch_kernel(dkdv, grid, dim3(TcTraits<DPAD>::NT), s_dkdv, stream, p);
  launch_decay_grad(p, TcTraits<DPAD>::BM, stream);
}

// Whether the next kernels (this header's backward, the forward of polyline_attention_tc_fwd2.cuh) take a map of
// width W (W < 16: polyline_attention_tc.cuh's). The x1 / x2 tables need no zeroing then.
PPMA_HD bool polyline_attention_tc_next_covers(int W) {
  return polyline_attention_tc_row_uniform(W) || polyline_attention_tc_two_row(W);
}

// The backward under cuda_next_polyline_attention = 1: the row-uniform kernels (polyline_attention_tc_row_uniform),
// their two-row form (polyline_attention_tc_two_row), else polyline_attention_tc.cuh's.
template <typename T, int DPAD>
inline void launch_polyline_attention_tc_bwd_next(const PolylineAttnParams<T, float>& p, cudaStream_t stream) {
  if (polyline_attention_tc_row_uniform(p.sz.W))
    launch_polyline_attention_tc_ru_bwd<T, DPAD, false>(p, stream);
  else if (polyline_attention_tc_two_row(p.sz.W))
    launch_polyline_attention_tc_ru_bwd<T, DPAD, true>(p, stream);
  else
    launch_polyline_attention_tc_bwd<T, DPAD>(p, stream);
}

}  // namespace ppma
