// polyline_attention forward on tensor cores, row-uniform form (docs/design.md §4.3 "The row-uniform kernels";
// opt-in through the internal option cuda_next_polyline_attention, docs/configuration.md). Same math, tiles,
// grid and outputs as polyline_attention_tc_fwd_kernel (polyline_attention_tc.cuh: read its header first); what
// changes is how the biases are formed and how the key tiles arrive:
//   * row-uniform biases (maps of polyline_attention_tc_row_uniform: a warp's 16 queries and every n8 block of 8
//     keys lie in one map row each): per (warp, n8 block) pair of query row i and key row k, a lane reads its two
//     keys' token records, the two (query row, key column) and the two (key row, query column) cross entries once
//     per n8 block and forms M = seg(j, l; cr(i,j), cr(i,l)) + e1[l], M' = seg(j, l; cr(k,j), cr(k,l)) + e2[j]
//     (e1, e2 as in polyline_attention_tc_bwd2.cuh): 6 shared loads per 4 logits of a lane instead of 12;
//   * two-row maps (polyline_attention_tc_two_row, 16 < W < 32): each lane takes the rows of its 4 elements
//     (per-lane row select) and tc_bias's element-wise form with the two token records read once per n8 block
//     (10 shared loads per 4 logits);
//   * two key-tile buffers: the cp.async copy of the next tile's K and V (and the plain stores of its token
//     records and cross tables) is in flight while the current tile is computed; one barrier per key tile
//     instead of two.
// The key tiles are visited in the same order and the softmax arithmetic is the verified kernel's, so on
// row-uniform maps the outputs equal polyline_attention_tc_fwd_kernel's up to the compiler's contraction of the
// bias sums (bit for bit in the host emulator of tests/cuda_emu).
#pragma once

#include "polyline_attention_tc_bwd2.cuh"

namespace ppma {

// Keys per tile: the verified forward's by default (then the two give the same bits). With the row-uniform bias
// 32 at head dim 128 also compiles without spills (sm_90: 241 / 254 registers, TWO = false / true), half the key
// tiles of 16: a GPU session can time it with -DPPMA_TC_RU_BN_FWD=32.
#ifndef PPMA_TC_RU_BN_FWD
#define PPMA_TC_RU_BN_FWD (TcTraits<DPAD>::BN)
#endif

template <int DPAD>
struct TcRuFwdSmem {
  using Tr = TcTraits<DPAD>;
  static constexpr int BN = PPMA_TC_RU_BN_FWD;
  static_assert(BN % 16 == 0 && BN <= Tr::BM, "key tiles are multiples of 16 up to BM");
  uint16_t q[Tr::BM * Tr::LD];
  uint16_t k[2][BN * Tr::LD];  // the key tile and the next one
  uint16_t v[2][BN * Tr::LD];
  TcTok key[2][BN];
  float2 xq[2][Tr::TBL], xk[2][Tr::TBL];
};

// Grid: RowTiling(H, W, BM).num_tiles * B * heads blocks (tile fastest); 128 threads. TWO: the two-row form.
template <typename T, int DPAD, bool TWO = false>
__global__ void __launch_bounds__(128, PPMA_TC_MIN_BLOCKS)
    polyline_attention_tc_ru_fwd_kernel(PolylineAttnParams<T, float> p) {
  using Tr = TcTraits<DPAD>;
  using Smem = TcRuFwdSmem<DPAD>;
  constexpr int NT = Tr::NT, BM = Tr::BM, BN = Smem::BN, LD = Tr::LD, KD = Tr::KD, NO = Tr::NO;
  constexpr int NS = BN / 8, KS = BN / 16;
  PPMA_DYNAMIC_SMEM(Smem, sm);

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
  const int cap_q = tq_.cap(), cap_k = tk_.cap(), nt = tk_.num_tiles;
  const bool active = 16 * warp < tq.count;  // warp-uniform: a warp whose 16 rows are all beyond the tile idles

  // K and V of key tile `kt` into buffer `bf` by cp.async (completed by a wait and a barrier), with the key
  // records and the cross tables.
  auto load = [&](int kt, int bf) {
    const TileDesc tk = tk_.tile(kt);
    tc_load_tile<NT, BN, DPAD, LD>(sm.k[bf], p.k, p.sk, b, g, tk, p.sz.d, tid);
    tc_load_tile<NT, BN, DPAD, LD>(sm.v[bf], p.v, p.sv, b, g, tk, p.sz.dv, tid);
    for (int c = tid; c < BN; c += NT) sm.key[bf][c] = tc_token(tk, c, false, cap_q, crb, ccb, W);
    tc_load_cross<NT>(sm.xq[bf], sm.xk[bf], tq, tk, cap_q, cap_k, crb, ccb, W, tid);
  };
  tc_load_tile<NT, BM, DPAD, LD>(sm.q, p.q, p.sq, b, g, tq, p.sz.d, tid);
  load(0, 0);
  mma::cp_async_wait_all();
  __syncthreads();
  constexpr bool kQRegs = DPAD <= 64;  // as the verified forward
  uint32_t qf[kQRegs ? KD : 1][4];
  if constexpr (kQRegs) tc_load_a<KD, LD>(qf, sm.q, 16 * warp, lane);
  TcTok rq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) rq[r] = tc_token(tq, 16 * warp + mma::c_row(lane, 2 * r), true, cap_k, crb, ccb, W);
  const int qrow = rq[0].row();  // the warp's query row (row-uniform maps)

  float o1[NO][4], o2[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o1[n][i] = o2[n][i] = 0.f;
  float m1[2] = {-INFINITY, -INFINITY}, m2[2] = {-INFINITY, -INFINITY}, l1[2] = {0.f, 0.f}, l2[2] = {0.f, 0.f};

  for (int kt = 0; kt < nt; ++kt) {
    const int bf = kt & 1;
    if (kt > 0) {
      mma::cp_async_wait_all();
      __syncthreads();  // tile kt is in buffer bf; every warp is done with tile kt - 1 (buffer bf ^ 1)
    }
    if (kt + 1 < nt) load(kt + 1, bf ^ 1);  // in flight while tile kt is computed
    if (!active) continue;
    const int nk = tk_.tile(kt).count;

    float s1[NS][4], s2[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) s1[n][i] = 0.f;
    if constexpr (kQRegs)
      tc_gemm_abt<T, KD, NS, LD>(s1, qf, sm.k[bf], nk, lane);
    else
      tc_gemm_abt_s<T, KD, NS, LD>(s1, sm.q, 16 * warp, sm.k[bf], nk, lane);

    // Both logit tiles from the one score tile: s1 = S + M, s2 = S + M' (log2 units), -inf beyond the keys.
    float mx1[2] = {-INFINITY, -INFINITY}, mx2[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      if (8 * n >= nk) {  // a block beyond the tile's keys (warp-uniform)
#pragma unroll
        for (int i = 0; i < 4; ++i) s1[n][i] = s2[n][i] = -INFINITY;
        continue;
      }
      const int c0 = 8 * n + mma::c_col(lane, 0);
      const TcTok kt2[2] = {sm.key[bf][c0], sm.key[bf][c0 + 1]};
      float b1[4], b2[4];
      if constexpr (TWO) {  // per element: query row of r, key row of h
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1, h = i & 1;
          tc_bias(rq[r], kt2[h], sm.xq[bf][rq[r].o1() + kt2[h].o1()], sm.xk[bf][rq[r].o2() + kt2[h].o2()], b1[i],
                  b2[i]);
        }
      } else {
        const int krow = kt2[0].row();  // the block's key row
        float2 xq[2], xk[2];
        float e1[2], e2[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          xq[h] = sm.xq[bf][rq[0].o1() + kt2[h].o1()];        // (cr, cc)(query row, key column l_h)
          e1[h] = line_bias(krow, qrow, kt2[h].cc, xq[h].y);  // C_l(i,k)
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          xk[r] = sm.xk[bf][rq[r].o2() + kt2[0].o2()];        // (cr, cc)(key row, query column j_r)
          e2[r] = line_bias(qrow, krow, rq[r].cc, xk[r].y);   // C_j(i,k)
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i >> 1, h = i & 1, qj = rq[r].col(), kl = kt2[h].col();
          b1[i] = line_bias(qj, kl, rq[r].cr, xq[h].x) + e1[h];  // R_i(j,l) + C_l(i,k)
          b2[i] = line_bias(qj, kl, xk[r].x, kt2[h].cr) + e2[r];  // R_k(j,l) + C_j(i,k)
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1, h = i & 1;
        const float x = s1[n][i] * sl2;
        const bool ok = c0 + h < nk;
        s1[n][i] = ok ? x + b1[i] : -INFINITY;
        s2[n][i] = ok ? x + b2[i] : -INFINITY;
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
    tc_gemm_ab2<T, KS, NO, LD>(o1, o2, pf1, pf2, sm.v[bf], nk, lane);
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
// Host-side launch helper (no torch)
// =============================================================================================
template <typename T, int DPAD, bool TWO>
inline void launch_polyline_attention_tc_ru_fwd(const PolylineAttnParams<T, float>& p, cudaStream_t stream) {
  const RowTiling t(p.sz.H, p.sz.W, TcTraits<DPAD>::BM);
  auto kernel = polyline_attention_tc_ru_fwd_kernel<T, DPAD, TWO>;
  const size_t smem = sizeof(TcRuFwdSmem<DPAD>);
  allow_dynamic_smem(kernel, smem);
  launch_kernel(kernel, dim3(unsigned(int64_t(t.num_tiles) * p.sz.B * p.sz.G)), dim3(TcTraits<DPAD>::NT), smem,
                stream, p);
}

// The forward under cuda_next_polyline_attention = 1: the kernel above where polyline_attention_tc_next_covers(W),
// else polyline_attention_tc_fwd_kernel. Same outputs and grid-size limit (polyline_attention_tc_blocks).
template <typename T, int DPAD>
inline void launch_polyline_attention_tc_fwd_next(const PolylineAttnParams<T, float>& p, cudaStream_t stream) {
  if (polyline_attention_tc_row_uniform(p.sz.W))
    launch_polyline_attention_tc_ru_fwd<T, DPAD, false>(p, stream);
  else if (polyline_attention_tc_two_row(p.sz.W))
    launch_polyline_attention_tc_ru_fwd<T, DPAD, true>(p, stream);
  else
    launch_polyline_attention_tc_fwd<T, DPAD>(p, stream);
}

}  // namespace ppma
