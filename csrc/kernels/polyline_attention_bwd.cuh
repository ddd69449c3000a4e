// polyline_attention backward: flash-style recomputation, deterministic (no atomics), no N x N buffer.
//
// Math (docs/ops.md "polyline_attention"), per (b, g), query p = (i, j), key s = (k, l):
//   P1 = exp(S + M - lse0), P2 = exp(S + M' - lse1), dPv = dO_p . v_s,
//   D1 = 0.5 rowsum(dO * out_v2h), D2 = 0.5 rowsum(dO * out_h2v), out_h2v = 2 out - out_v2h,
//   dS1 = P1 (0.5 dPv - D1), dS2 = P2 (0.5 dPv - D2),
//   dq_p = scale sum_s (dS1 + dS2) k_s,  dk_s = scale sum_p (dS1 + dS2) q_p,
//   dv_s = sum_p 0.5 (P1 + P2) dO_p.
// Bias gradients go to the prefix sums: each bias c[max] - c[min] with gradient G puts +G on the token at
// the max position and -G on the token at the min position of its line. Per pair:
//   dS1 -> R_i(j,l): (i,j) sgn(j-l), (i,l) sgn(l-j);   C_l(i,k): (k,l) sgn(k-i), (i,l) sgn(i-k)
//   dS2 -> R_k(j,l): (k,l) sgn(l-j), (k,j) sgn(j-l);   C_j(i,k): (i,j) sgn(i-k), (k,j) sgn(k-i)
// Ownership (each sum is formed by one thread in a fixed order):
//   * terms on the query token p: the dq kernel (query-outer), per query thread group;
//   * terms on the key token s: the dkdv kernel (key-outer), per key thread group;
//   * terms on the cross token (i, l) (from dS1): the dq kernel, whose outer query tile is row-aligned
//     (RowTiling), so every (query row, key column) entry belongs to the tile's table; per key tile one
//     thread per entry sums the dS1 tile (kept in shared memory) over the entry's queries and keys;
//   * terms on the cross token (k, j) (from dS2): the dkdv kernel, symmetrically (key tile row-aligned).
// decay_grad_kernel (common.cuh) adds the four parts per token and takes the reverse cumsums.
#pragma once

#include "polyline_attention_common.cuh"

namespace ppma {

// delta[bg][p][0] = 0.5 rowsum(dO * out_v2h), [1] = 0.5 rowsum(dO * (2 out - out_v2h)); one thread per (b, p, g).
template <typename scalar_t>
__global__ void polyline_attention_delta_kernel(PolylineAttnParams<scalar_t, typename AccType<scalar_t>::type> p) {
  using acc_t = typename AccType<scalar_t>::type;
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // = (b * N + pos) * G + g
  if (t >= int64_t(p.sz.B) * N * G) return;
  const int g = int(t % G);
  const int64_t bp = t / G, pos = bp % N;
  const int b = int(bp / N);
  const scalar_t* dO = token_ptr(p.dout, p.sdo, b, g, pos, W);
  const scalar_t* o = p.out_c + t * dv;
  const scalar_t* ov = p.out_v2h_c + t * dv;
  acc_t s1 = 0, s2 = 0;
  for (int e = 0; e < dv; ++e) {
    const acc_t go = to_acc(dO[e]), x = to_acc(o[e]), xv = to_acc(ov[e]);
    s1 += go * xv;
    s2 += go * (acc_t(2) * x - xv);
  }
  acc_t* dst = p.delta + ((int64_t(b) * G + g) * N + pos) * 2;
  dst[0] = acc_t(0.5) * s1;
  dst[1] = acc_t(0.5) * s2;
}

// Shared-memory budget check of the backward kernels.
template <typename scalar_t, int DPAD>
struct AttnBwdSmem {
  using Tr = AttnTraits<scalar_t, DPAD>;
  using acc_t = typename Tr::acc_t;
  static constexpr size_t bytes =
      sizeof(acc_t) * (2 * Tr::BN * DPAD + Tr::BM * (Tr::BN + 1) + 6 * Tr::BN) + sizeof(int) * 2 * Tr::BN;
  static_assert(bytes <= 48 * 1024, "static shared memory of the polyline_attention backward exceeds 48 KiB");
};

// ---------------------------------------------------------------------------------------------
// dq kernel. Grid: RowTiling(H, W, BM).num_ctas * B * G blocks (1-D); one query per thread group. A CTA owns
// the tiles of its RowTiling unit (one tile, or a group of segments of one row) and that unit's table.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, int DPAD>
__global__ void __launch_bounds__(128)
    polyline_attention_bwd_dq_kernel(PolylineAttnParams<scalar_t, typename AccType<scalar_t>::type> p) {
  using Tr = AttnTraits<scalar_t, DPAD>;
  using acc_t = typename Tr::acc_t;
  constexpr int NT = Tr::NT, SW = Tr::SW, TPQ = Tr::TPQ, BM = Tr::BM, BN = Tr::BN;
  static_assert(AttnBwdSmem<scalar_t, DPAD>::bytes > 0, "");

  __shared__ __align__(16) acc_t Ks[BN][DPAD];
  __shared__ __align__(16) acc_t Vs[BN][DPAD];
  __shared__ acc_t dS1s[BM][BN + 1];
  __shared__ acc_t crk_s[BN], cck_s[BN];
  __shared__ int ki_s[BN], kj_s[BN];

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  const int tid = threadIdx.x, grp = tid / TPQ, sub = tid % TPQ, e0 = sub * SW;
  const RowTiling tl(H, W, BM);
  const int cta = int(blockIdx.x % unsigned(tl.num_ctas));
  const int bg = int(blockIdx.x / unsigned(tl.num_ctas)), b = bg / G, g = bg % G;
  // This CTA's cross-term tables ((query row, key column) entries), entry r * W + x = token (trow0 + r, x).
  acc_t* tab_cr = p.x1_cr + (int64_t(bg) * tl.num_ctas + cta) * tl.table;
  acc_t* tab_cc = p.x1_cc + (int64_t(bg) * tl.num_ctas + cta) * tl.table;
  const int trow0 = tl.cta_row0(cta);

  for (int m = 0; m < tl.cta_count(cta); ++m) {
    const TileDesc td = tl.tile(tl.cta_tile(cta, m));
    const int tok0 = td.tok0, count = td.count, row0 = td.row0, rows = td.rows, col0 = td.col0;
    const bool valid = grp < count;
    const int64_t pq = tok0 + (valid ? grp : count - 1);
    const int qi = int(pq / W), qj = int(pq % W);

    const acc_t* crb = p.cr + int64_t(bg) * N;
    const acc_t* ccb = p.cc + int64_t(bg) * N;
    const acc_t crq = crb[pq], ccq = ccb[pq];
    const int64_t row = token_index(N, G, b, pq, g);
    const acc_t lse0 = p.lse[row * 2], lse1 = p.lse[row * 2 + 1];
    const acc_t D1 = p.delta[(int64_t(bg) * N + pq) * 2], D2 = p.delta[(int64_t(bg) * N + pq) * 2 + 1];

    acc_t qr[SW], dor[SW], dqa[SW];
    load_slice<SW>(qr, token_ptr(p.q, p.sq, b, g, pq, W), e0, d, p.scale);
    load_slice<SW>(dor, token_ptr(p.dout, p.sdo, b, g, pq, W), e0, dv);
#pragma unroll
    for (int e = 0; e < SW; ++e) dqa[e] = 0;
    acc_t gcr = 0, gcc = 0;

    // Queries of tile row r: local indices [r * W, r * W + W) (S == 1) or [0, count) (segment).
    const int q_per_row = td.ncols;

    for (int64_t kt = 0; kt < N; kt += BN) {
      const int nk = N - kt < BN ? int(N - kt) : BN;
      __syncthreads();
      load_tile<NT, BN, DPAD>(Ks, p.k, p.sk, b, g, kt, nk, d, W);
      load_tile<NT, BN, DPAD>(Vs, p.v, p.sv, b, g, kt, nk, dv, W);
      for (int r = tid; r < BN; r += NT) {
        const int64_t s = kt + r < N ? kt + r : N - 1;
        crk_s[r] = crb[s];
        cck_s[r] = ccb[s];
        ki_s[r] = int(s / W);
        kj_s[r] = int(s % W);
      }
      __syncthreads();

#pragma unroll 2
      for (int kk = 0; kk < nk; ++kk) {
        acc_t sc = slice_dot<SW>(qr, &Ks[kk][e0]);
        acc_t dp = slice_dot<SW>(dor, &Vs[kk][e0]);
        sc = group_sum<TPQ>(sc);
        dp = group_sum<TPQ>(dp);
        const int k = ki_s[kk], l = kj_s[kk];
        acc_t b1, b2;
        pair_biases(qi, qj, crq, ccq, k, l, crk_s[kk], cck_s[kk], crb, ccb, W, b1, b2);
        const acc_t P1 = fast_exp(sc + b1 - lse0), P2 = fast_exp(sc + b2 - lse1);
        acc_t dS1 = P1 * (acc_t(0.5) * dp - D1), dS2 = P2 * (acc_t(0.5) * dp - D2);
        if (!valid) dS1 = dS2 = 0;
        const acc_t ds = dS1 + dS2;
        const acc_t* krow = &Ks[kk][e0];
#pragma unroll
        for (int e = 0; e < SW; ++e) dqa[e] += ds * krow[e];
        gcr += sgn_diff<acc_t>(qj, l) * dS1;  // R_i(j,l) on (i,j)
        gcc += sgn_diff<acc_t>(qi, k) * dS2;  // C_j(i,k) on (i,j)
        if (sub == 0) dS1s[grp][kk] = dS1;
      }
      __syncthreads();

      // Cross token (i, l), i = tile row r, l = key column x: + sum over the row's queries j and the tile's
      // keys (k, x) of dS1 * sgn(x - j) (cr) and dS1 * sgn(i - k) (cc). Entry (r, x) has exactly one owner
      // per key tile, and key tiles are visited in order: deterministic. Keys of column x in this tile:
      // local indices c, c + W, c + 2W, ... with c = (x - kt) mod W, i.e. x = (kt + c) mod W, c < min(nk, W).
      const int ncols = nk < W ? nk : W;
      for (int item = tid; item < rows * ncols; item += NT) {
        const int r = item / ncols, c = item % ncols;
        const int x = int((kt + c) % W);
        const int ar = row0 + r;
        const int qa = tl.S == 1 ? r * W : 0;
        acc_t scr = 0, scc = 0;
        for (int kk = c; kk < nk; kk += W) {
          acc_t colsum = 0, sgnsum = 0;
          for (int lq = 0; lq < q_per_row; ++lq) {
            const acc_t v = dS1s[qa + lq][kk];
            colsum += v;
            sgnsum += sgn_diff<acc_t>(x, col0 + lq) * v;
          }
          scr += sgnsum;
          scc += sgn_diff<acc_t>(ar, ki_s[kk]) * colsum;
        }
        tab_cr[(ar - trow0) * W + x] += scr;
        tab_cc[(ar - trow0) * W + x] += scc;
      }
    }

    if (valid) {
      scalar_t* dq = p.dq + row * d;
#pragma unroll
      for (int e = 0; e < SW; ++e)
        if (e0 + e < d) dq[e0 + e] = from_acc<scalar_t>(p.scale * dqa[e]);
      if (sub == 0) {
        p.gq_cr[int64_t(bg) * N + pq] = gcr;
        p.gq_cc[int64_t(bg) * N + pq] = gcc;
      }
    }
  }  // tiles of this CTA
}

// ---------------------------------------------------------------------------------------------
// dk/dv kernel. Grid: RowTiling(H, W, BM).num_ctas * B * G blocks; one key per thread group; inner loop over
// query tiles of BN queries.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, int DPAD>
__global__ void __launch_bounds__(128)
    polyline_attention_bwd_dkdv_kernel(PolylineAttnParams<scalar_t, typename AccType<scalar_t>::type> p) {
  using Tr = AttnTraits<scalar_t, DPAD>;
  using acc_t = typename Tr::acc_t;
  constexpr int NT = Tr::NT, SW = Tr::SW, TPQ = Tr::TPQ, BM = Tr::BM, BN = Tr::BN;
  static_assert(AttnBwdSmem<scalar_t, DPAD>::bytes > 0, "");

  __shared__ __align__(16) acc_t Qs[BN][DPAD];
  __shared__ __align__(16) acc_t dOs[BN][DPAD];
  __shared__ acc_t dS2s[BM][BN + 1];
  __shared__ acc_t lse0_s[BN], lse1_s[BN], D1_s[BN], D2_s[BN], crq_s[BN], ccq_s[BN];
  __shared__ int qi_s[BN], qj_s[BN];

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  const int tid = threadIdx.x, grp = tid / TPQ, sub = tid % TPQ, e0 = sub * SW;
  const RowTiling tl(H, W, BM);
  const int cta = int(blockIdx.x % unsigned(tl.num_ctas));
  const int bg = int(blockIdx.x / unsigned(tl.num_ctas)), b = bg / G, g = bg % G;
  acc_t* tab_cr = p.x2_cr + (int64_t(bg) * tl.num_ctas + cta) * tl.table;
  acc_t* tab_cc = p.x2_cc + (int64_t(bg) * tl.num_ctas + cta) * tl.table;
  const int trow0 = tl.cta_row0(cta);

  for (int m = 0; m < tl.cta_count(cta); ++m) {
    const TileDesc td = tl.tile(tl.cta_tile(cta, m));
    const int tok0 = td.tok0, count = td.count, row0 = td.row0, rows = td.rows, col0 = td.col0;
    const bool valid = grp < count;
    const int64_t ps = tok0 + (valid ? grp : count - 1);
    const int k = int(ps / W), l = int(ps % W);

    const acc_t* crb = p.cr + int64_t(bg) * N;
    const acc_t* ccb = p.cc + int64_t(bg) * N;
    const acc_t crk = crb[ps], cck = ccb[ps];

    acc_t kr[SW], vr[SW], dka[SW], dva[SW];
    load_slice<SW>(kr, token_ptr(p.k, p.sk, b, g, ps, W), e0, d, p.scale);  // scale folded into k
    load_slice<SW>(vr, token_ptr(p.v, p.sv, b, g, ps, W), e0, dv);
#pragma unroll
    for (int e = 0; e < SW; ++e) dka[e] = dva[e] = 0;
    acc_t gcr = 0, gcc = 0;

    const int k_per_row = td.ncols;

    for (int64_t qt = 0; qt < N; qt += BN) {
      const int nq = N - qt < BN ? int(N - qt) : BN;
      __syncthreads();
      load_tile<NT, BN, DPAD>(Qs, p.q, p.sq, b, g, qt, nq, d, W);
      load_tile<NT, BN, DPAD>(dOs, p.dout, p.sdo, b, g, qt, nq, dv, W);
      for (int r = tid; r < BN; r += NT) {
        const int64_t s = qt + r < N ? qt + r : N - 1;
        const int64_t rw = token_index(N, G, b, s, g);
        lse0_s[r] = p.lse[rw * 2];
        lse1_s[r] = p.lse[rw * 2 + 1];
        D1_s[r] = p.delta[(int64_t(bg) * N + s) * 2];
        D2_s[r] = p.delta[(int64_t(bg) * N + s) * 2 + 1];
        crq_s[r] = crb[s];
        ccq_s[r] = ccb[s];
        qi_s[r] = int(s / W);
        qj_s[r] = int(s % W);
      }
      __syncthreads();

#pragma unroll 2
      for (int qq = 0; qq < nq; ++qq) {
        acc_t sc = slice_dot<SW>(kr, &Qs[qq][e0]);
        acc_t dp = slice_dot<SW>(vr, &dOs[qq][e0]);
        sc = group_sum<TPQ>(sc);
        dp = group_sum<TPQ>(dp);
        const int i = qi_s[qq], j = qj_s[qq];
        acc_t b1, b2;
        pair_biases(i, j, crq_s[qq], ccq_s[qq], k, l, crk, cck, crb, ccb, W, b1, b2);
        const acc_t P1 = fast_exp(sc + b1 - lse0_s[qq]), P2 = fast_exp(sc + b2 - lse1_s[qq]);
        acc_t dS1 = P1 * (acc_t(0.5) * dp - D1_s[qq]), dS2 = P2 * (acc_t(0.5) * dp - D2_s[qq]);
        if (!valid) dS1 = dS2 = 0;
        const acc_t ds = dS1 + dS2, pp = acc_t(0.5) * (P1 + P2);
        const acc_t* qrow = &Qs[qq][e0];
        const acc_t* orow = &dOs[qq][e0];
#pragma unroll
        for (int e = 0; e < SW; ++e) {
          dka[e] += ds * qrow[e];
          dva[e] += pp * orow[e];
        }
        gcc += sgn_diff<acc_t>(k, i) * dS1;  // C_l(i,k) on (k,l)
        gcr += sgn_diff<acc_t>(l, j) * dS2;  // R_k(j,l) on (k,l)
        if (sub == 0) dS2s[grp][qq] = dS2;
      }
      __syncthreads();

      // Cross token (k, j), k = tile row r, j = query column x: + sum over the row's keys l and the tile's
      // queries (i, x) of dS2 * sgn(x - l) (cr) and dS2 * sgn(k - i) (cc).
      const int ncols = nq < W ? nq : W;
      for (int item = tid; item < rows * ncols; item += NT) {
        const int r = item / ncols, c = item % ncols;
        const int x = int((qt + c) % W);
        const int ar = row0 + r;
        const int ka = tl.S == 1 ? r * W : 0;
        acc_t scr = 0, scc = 0;
        for (int qq = c; qq < nq; qq += W) {
          acc_t rowsum = 0, sgnsum = 0;
          for (int lk = 0; lk < k_per_row; ++lk) {
            const acc_t v = dS2s[ka + lk][qq];
            rowsum += v;
            sgnsum += sgn_diff<acc_t>(x, col0 + lk) * v;
          }
          scr += sgnsum;
          scc += sgn_diff<acc_t>(ar, qi_s[qq]) * rowsum;
        }
        tab_cr[(ar - trow0) * W + x] += scr;
        tab_cc[(ar - trow0) * W + x] += scc;
      }
    }

    if (valid) {
      const int64_t row = token_index(N, G, b, ps, g);
      scalar_t* dk = p.dk + row * d;
      scalar_t* dvp = p.dv + row * dv;
#pragma unroll
      for (int e = 0; e < SW; ++e) {
        if (e0 + e < d) dk[e0 + e] = from_acc<scalar_t>(p.scale * dka[e]);
        if (e0 + e < dv) dvp[e0 + e] = from_acc<scalar_t>(dva[e]);
      }
      if (sub == 0) {
        p.gk_cr[int64_t(bg) * N + ps] = gcr;
        p.gk_cc[int64_t(bg) * N + ps] = gcc;
      }
    }
  }  // tiles of this CTA
}

// Log-decay gradients of a polyline_attention backward from the own terms (gq_*, gk_*) and the cross-term tables
// (x1_*, x2_*, RowTiling(H, W, tile_bm)).
template <typename scalar_t, typename acc_t>
inline void launch_decay_grad(const PolylineAttnParams<scalar_t, acc_t>& p, int tile_bm, cudaStream_t stream) {
  DecayGradParams<acc_t> dg;
  dg.sz = p.sz;
  dg.own_r[0] = p.gq_cr;
  dg.own_r[1] = p.gk_cr;
  dg.own_c[0] = p.gq_cc;
  dg.own_c[1] = p.gk_cc;
  dg.tab_r[0] = p.x1_cr;
  dg.tab_r[1] = p.x2_cr;
  dg.tab_c[0] = p.x1_cc;
  dg.tab_c[1] = p.x2_cc;
  dg.tile_bm = tile_bm;
  dg.g_log_alpha = p.g_log_alpha;
  dg.g_log_beta = p.g_log_beta;
  const int64_t lines = int64_t(p.sz.B) * p.sz.G * (p.sz.H + p.sz.W);
  launch_kernel(decay_grad_kernel<acc_t>, dim3(unsigned((lines + 127) / 128)), dim3(128), 0, stream, dg);
}

// The tile size of the cross-term tables of the backward: RowTiling(H, W, polyline_attention_bwd_tile<...>()).
template <typename scalar_t, int DPAD>
constexpr int polyline_attention_bwd_tile() {
  return AttnTraits<scalar_t, DPAD>::BM;
}

// Blocks of the largest backward grid (the launcher checks them against the grid limit).
template <typename scalar_t, int DPAD>
inline int64_t polyline_attention_bwd_blocks(const GridSizes& sz) {
  const RowTiling tl(sz.H, sz.W, AttnTraits<scalar_t, DPAD>::BM);
  const int64_t rows = (int64_t(sz.B) * sz.H * sz.W * sz.G + 255) / 256;
  const int64_t ctas = int64_t(tl.num_ctas) * sz.B * sz.G;
  return ctas > rows ? ctas : rows;
}

// Host-side launch helper (no torch). Requires: p.delta, gq_*, gk_* ([BG][N]), x1_*, x2_* (zeroed,
// [BG][num_ctas][table] of RowTiling(H, W, polyline_attention_bwd_tile<...>())), g_log_alpha / g_log_beta.
template <typename scalar_t, int DPAD>
inline void launch_polyline_attention_bwd(const PolylineAttnParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                          cudaStream_t stream) {
  using Tr = AttnTraits<scalar_t, DPAD>;
  const int64_t rows = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G;
  launch_kernel(polyline_attention_delta_kernel<scalar_t>, dim3(unsigned((rows + 255) / 256)), dim3(256), 0, stream,
                p);
  const RowTiling tl(p.sz.H, p.sz.W, Tr::BM);
  const dim3 grid(unsigned(int64_t(tl.num_ctas) * p.sz.B * p.sz.G));
  launch_kernel(polyline_attention_bwd_dq_kernel<scalar_t, DPAD>, grid, dim3(Tr::NT), 0, stream, p);
  launch_kernel(polyline_attention_bwd_dkdv_kernel<scalar_t, DPAD>, grid, dim3(Tr::NT), 0, stream, p);
  launch_decay_grad(p, Tr::BM, stream);
}

}  // namespace ppma
