// criss_cross_attention forward and backward: line attention within rows and within columns.
//
// Math (docs/ops.md "criss_cross_attention"), per (b, g): row attention of row i, A_i[t, u] = softmax_u(scale <q(i,t), k(i,u)>
// + R_i(t, u)); column attention of column l, B_l[t, u] = softmax_u(scale <q(t,l), k(u,l)> + C_l(t, u));
// both biases are c[max(t,u)] - c[min(t,u)] of the line's prefix sums (cr along rows, cc along columns).
//   forward:  z1 = A v, out1 = B z1 (H2V);  z2 = B v, out2 = A z2 (V2H);  out = 0.5 (out1 + out2).
//   kernels:  rows  (mode 0): z1 = A v, lse[..., 0]
//             cols  (mode 1): z2 = B v, out1 = B z1, lse[..., 1]
//             rows  (mode 2): out = 0.5 (out1 + A z2), A recomputed from lse[..., 0]
//   backward, h = 0.5 dO:  gz2 = A^T h, gz1 = B^T h; the score gradients of the maps are
//     gA[t,u] = h_t . z2_u + gz1_t . v_u,  gB[t,u] = h_t . z1_u + gz2_t . v_u;
//     softmax backward dS = P (g - D), D_t = sum_u P g = h_t . (P Z)_t + G_t . (P v)_t;
//     grad_v = A^T gz1 + B^T gz2; dq, dk from dS (times scale); bias gradient on the line's prefix sums.
//   One generic backward line kernel (block = one line, so the two phases need no atomics):
//     phase 1, query-outer: Pv = P v, [FULL] PZ = P Z, X = sum P g k, Y = sum P k, sg = sum sgn(t-u) P g,
//       s1 = sum sgn(t-u) P  ->  D = h.PZ + G.Pv, dq = scale (X - D Y), own_t = sg - D s1
//     phase 2, key-outer:  PTh = P^T h, [FULL] PTG = P^T G, dk = scale sum_t dS q_t, own_u += sum sgn(u-t) dS
//   BR1 = rows, !FULL:                 Pv -> z1,  PTh -> gz2
//   BC  = cols, FULL (Z = z1, G = gz2): Pv -> z2,  PTh -> gz1, PTG -> gv_c, dq_c, dk_c, own -> g_cc
//   BR2 = rows, FULL (Z = z2, G = gz1): PTG -> gv_r, dq_r, dk_r, own -> g_cr
//   then an elementwise kernel sums the parts and decay_grad_kernel takes the reverse cumsums.
// Grid: lines * B * G blocks (1-D, line fastest), lines = H (rows) or W (columns); a block loops over the line's
// tokens in groups of BM. Lines of at most kShortLine tokens go to the packed kernels below instead.
#pragma once

#include "polyline_attention_common.cuh"

namespace ppma {

template <typename scalar_t, int DPAD>
struct LineTraits {
  using acc_t = typename AccType<scalar_t>::type;
  static constexpr int NT = 128, SW = 16, TPQ = DPAD / SW, BM = NT / TPQ, KC = 8;
  static constexpr int BN0 = (sizeof(acc_t) == 8 ? 1024 : 2048) / DPAD;
  static constexpr int BN = BN0 > 64 ? 64 : BN0;  // keys (or queries) per shared tile
  static_assert(3 * BN * DPAD * sizeof(acc_t) + 8 * BN * sizeof(acc_t) <= 40 * 1024, "line tile too large");
};

// A line: tokens (li, t) of row li (rows) or (t, li) of column li; position t in [0, L).
struct Line {
  bool rows;
  int li, W;
  PPMA_HD int64_t pos(int t) const { return line_token(rows, li, t, W); }
};

// Contiguous [B, H, W, G, dim] strides.
PPMA_HD Strides4 contiguous_strides(int H, int W, int G, int dim) {
  Strides4 s;
  s.g = dim;
  s.w = int64_t(G) * dim;
  s.h = int64_t(W) * G * dim;
  s.b = int64_t(H) * W * G * dim;
  return s;
}

template <int NT, int ROWS, int DPAD, typename T, typename A>
PPMA_D void load_line_tile(A (*dst)[DPAD], const T* base, const Strides4& s, int b, int g, const Line& ln, int u0,
                           int n, int dim, A mul = A(1)) {
  for (int e = threadIdx.x; e < ROWS * DPAD; e += NT) {
    const int r = e / DPAD, c = e % DPAD;
    A val = 0;
    if (base != nullptr && r < n && c < dim) val = to_acc(token_ptr(base, s, b, g, ln.pos(u0 + r), ln.W)[c]) * mul;
    dst[r][c] = val;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward line kernel. MODE 0: rows, z1 = A v; MODE 1: cols, z2 = B v and out1 = B z1; MODE 2: rows,
// out = 0.5 (out1 + A z2) with A from the saved lse.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, int DPAD, int MODE>
__global__ void __launch_bounds__(128)
    criss_cross_fwd_kernel(CrissCrossParams<scalar_t, typename AccType<scalar_t>::type> p) {
  using Tr = LineTraits<scalar_t, DPAD>;
  using acc_t = typename Tr::acc_t;
  constexpr int NT = Tr::NT, SW = Tr::SW, TPQ = Tr::TPQ, BM = Tr::BM, BN = Tr::BN, KC = Tr::KC;
  constexpr bool kRows = MODE != 1;
  constexpr bool kTwo = MODE == 1;  // two value streams

  __shared__ __align__(16) acc_t Ks[BN][DPAD];
  __shared__ __align__(16) acc_t V0s[BN][DPAD];
  __shared__ __align__(16) acc_t V1s[kTwo ? BN : 1][DPAD];
  __shared__ acc_t cu_s[BN];

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  const int L = kRows ? W : H;
  const int tid = threadIdx.x, grp = tid / TPQ, sub = tid % TPQ, e0 = sub * SW;
  const int nlines = kRows ? H : W;
  const int bg = int(blockIdx.x / unsigned(nlines)), b = bg / G, g = bg % G;
  const Line ln{kRows, int(blockIdx.x % unsigned(nlines)), W};
  const acc_t* cb = (kRows ? p.cr : p.cc) + int64_t(bg) * N;
  const Strides4 sacc = contiguous_strides(H, W, G, dv);
  const int wl = kRows ? 0 : 1;  // lse slot

  for (int tb = 0; tb < L; tb += BM) {
    const bool valid = tb + grp < L;
    const int t = valid ? tb + grp : L - 1;
    const int64_t pt = ln.pos(t);
    const acc_t ct = cb[pt];
    const int64_t row = token_index(N, G, b, pt, g);
    acc_t qr[SW];
    load_slice<SW>(qr, token_ptr(p.q, p.sq, b, g, pt, W), e0, d, p.scale);
    acc_t o0[SW], o1[SW];
#pragma unroll
    for (int e = 0; e < SW; ++e) o0[e] = o1[e] = 0;
    acc_t m = neg_inf<acc_t>(), lsum = 0;
    if (MODE == 2) {
      m = p.lse[row * 2 + wl];  // fixed statistics: P = exp(s - lse)
      lsum = 1;
    }

    for (int ub = 0; ub < L; ub += BN) {
      const int nk = L - ub < BN ? L - ub : BN;
      __syncthreads();
      load_line_tile<NT, BN, DPAD>(Ks, p.k, p.sk, b, g, ln, ub, nk, d);
      if constexpr (MODE == 0 || MODE == 1) load_line_tile<NT, BN, DPAD>(V0s, p.v, p.sv, b, g, ln, ub, nk, dv);
      if constexpr (MODE == 1) load_line_tile<NT, BN, DPAD>(V1s, (const acc_t*)p.z1, sacc, b, g, ln, ub, nk, dv);
      if constexpr (MODE == 2) load_line_tile<NT, BN, DPAD>(V0s, (const acc_t*)p.z2, sacc, b, g, ln, ub, nk, dv);
      for (int r = tid; r < BN; r += NT) cu_s[r] = cb[ln.pos(ub + r < L ? ub + r : L - 1)];
      __syncthreads();

      for (int c0 = 0; c0 < nk; c0 += KC) {
        acc_t sv[KC];
        acc_t mx = neg_inf<acc_t>();
#pragma unroll
        for (int u = 0; u < KC; ++u) {
          const int kk = c0 + u;
          if (kk < nk) {
            const acc_t sc = group_sum<TPQ>(slice_dot<SW>(qr, &Ks[kk][e0]));
            sv[u] = sc + line_bias(t, ub + kk, ct, cu_s[kk]);
          } else {
            sv[u] = neg_inf<acc_t>();
          }
          mx = max(mx, sv[u]);
        }
        acc_t mn = m;
        if (MODE != 2) {
          mn = max(m, mx);
          const acc_t a = fast_exp(m - mn);
          lsum *= a;
#pragma unroll
          for (int e = 0; e < SW; ++e) {
            o0[e] *= a;
            if (kTwo) o1[e] *= a;
          }
        }
#pragma unroll
        for (int u = 0; u < KC; ++u) {
          const int kk = c0 + u;
          if (kk < nk) {
            const acc_t pr = fast_exp(sv[u] - mn);
            if (MODE != 2) lsum += pr;
#pragma unroll
            for (int e = 0; e < SW; ++e) {
              o0[e] += pr * V0s[kk][e0 + e];
              if constexpr (kTwo) o1[e] += pr * V1s[kk][e0 + e];
            }
          }
        }
        m = mn;
      }
    }

    if (valid) {
      const acc_t rl = acc_t(1) / lsum;
      if (MODE == 0) {
        acc_t* z1 = p.z1 + row * dv;
#pragma unroll
        for (int e = 0; e < SW; ++e)
          if (e0 + e < dv) z1[e0 + e] = o0[e] * rl;
      } else if (MODE == 1) {
        acc_t* z2 = p.z2 + row * dv;
        acc_t* out1 = p.out1 + row * dv;
#pragma unroll
        for (int e = 0; e < SW; ++e)
          if (e0 + e < dv) {
            z2[e0 + e] = o0[e] * rl;
            out1[e0 + e] = o1[e] * rl;
          }
      } else {
        const acc_t* out1 = p.out1 + row * dv;
        scalar_t* out = p.out + row * dv;
#pragma unroll
        for (int e = 0; e < SW; ++e)
          if (e0 + e < dv) out[e0 + e] = from_acc<scalar_t>(acc_t(0.5) * (out1[e0 + e] + o0[e]));
      }
      if (MODE != 2 && sub == 0) p.lse[row * 2 + wl] = m + fast_log(lsum);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward line kernel (see the header comment for the two phases).
// ---------------------------------------------------------------------------------------------
template <typename acc_t>
struct LineBwdIO {
  const acc_t* Z = nullptr;   // [B,H,W,G,dv] acc (FULL)
  const acc_t* Gm = nullptr;  // [B,H,W,G,dv] acc (FULL)
  acc_t* Pv = nullptr;        // out: P v
  acc_t* PTh = nullptr;       // out: P^T h
  acc_t* PTG = nullptr;       // out: P^T G (FULL)
  acc_t* dq = nullptr;        // out: [B,H,W,G,d] (FULL)
  acc_t* dk = nullptr;        // out: [B,H,W,G,d] (FULL)
  acc_t* own = nullptr;       // out: [BG][N] prefix-sum gradient (FULL)
};

template <typename scalar_t, int DPAD, bool ROWS, bool FULL>
__global__ void __launch_bounds__(128)
    criss_cross_bwd_kernel(CrissCrossParams<scalar_t, typename AccType<scalar_t>::type> p,
                           LineBwdIO<typename AccType<scalar_t>::type> io) {
  using Tr = LineTraits<scalar_t, DPAD>;
  using acc_t = typename Tr::acc_t;
  constexpr int NT = Tr::NT, SW = Tr::SW, TPQ = Tr::TPQ, BM = Tr::BM, BN = Tr::BN;

  __shared__ __align__(16) acc_t T0[BN][DPAD];  // phase 1: k     phase 2: q
  __shared__ __align__(16) acc_t T1[BN][DPAD];  // phase 1: v     phase 2: h
  __shared__ __align__(16) acc_t T2[BN][DPAD];  // phase 1: Z     phase 2: G
  __shared__ acc_t c_s[BN], lse_s[BN], D_s[BN];

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  const int L = ROWS ? W : H;
  const int tid = threadIdx.x, grp = tid / TPQ, sub = tid % TPQ, e0 = sub * SW;
  const int nlines = ROWS ? H : W;
  const int bg = int(blockIdx.x / unsigned(nlines)), b = bg / G, g = bg % G;
  const Line ln{ROWS, int(blockIdx.x % unsigned(nlines)), W};
  const acc_t* cb = (ROWS ? p.cr : p.cc) + int64_t(bg) * N;
  const Strides4 sacc = contiguous_strides(H, W, G, dv);
  const int wl = ROWS ? 0 : 1;
  const acc_t half = acc_t(0.5);

  // ---------------- phase 1: query-outer ----------------
  for (int tb = 0; tb < L; tb += BM) {
    const bool valid = tb + grp < L;
    const int t = valid ? tb + grp : L - 1;
    const int64_t pt = ln.pos(t);
    const int64_t row = token_index(N, G, b, pt, g);
    const acc_t ct = cb[pt], lse = p.lse[row * 2 + wl];
    acc_t qr[SW], hr[SW], gr[SW] = {}, pv[SW], pz[SW], xa[SW], ya[SW];
    load_slice<SW>(qr, token_ptr(p.q, p.sq, b, g, pt, W), e0, d, p.scale);
    load_slice<SW>(hr, token_ptr(p.dout, p.sdo, b, g, pt, W), e0, dv, half);
    if (FULL) load_slice<SW>(gr, io.Gm + row * dv, e0, dv);
#pragma unroll
    for (int e = 0; e < SW; ++e) pv[e] = pz[e] = xa[e] = ya[e] = 0;
    acc_t sg = 0, s1 = 0;

    for (int ub = 0; ub < L; ub += BN) {
      const int nk = L - ub < BN ? L - ub : BN;
      __syncthreads();
      load_line_tile<NT, BN, DPAD>(T0, p.k, p.sk, b, g, ln, ub, nk, d);
      load_line_tile<NT, BN, DPAD>(T1, p.v, p.sv, b, g, ln, ub, nk, dv);
      if (FULL) load_line_tile<NT, BN, DPAD>(T2, io.Z, sacc, b, g, ln, ub, nk, dv);
      for (int r = tid; r < BN; r += NT) c_s[r] = cb[ln.pos(ub + r < L ? ub + r : L - 1)];
      __syncthreads();
#pragma unroll 2
      for (int kk = 0; kk < nk; ++kk) {
        const int u = ub + kk;
        const acc_t sc = group_sum<TPQ>(slice_dot<SW>(qr, &T0[kk][e0]));
        const acc_t P = fast_exp(sc + line_bias(t, u, ct, c_s[kk]) - lse);
#pragma unroll
        for (int e = 0; e < SW; ++e) pv[e] += P * T1[kk][e0 + e];
        if (FULL) {
          const acc_t gg = group_sum<TPQ>(slice_dot<SW>(hr, &T2[kk][e0]) + slice_dot<SW>(gr, &T1[kk][e0]));
          const acc_t pg = P * gg;
#pragma unroll
          for (int e = 0; e < SW; ++e) {
            pz[e] += P * T2[kk][e0 + e];
            xa[e] += pg * T0[kk][e0 + e];
            ya[e] += P * T0[kk][e0 + e];
          }
          const acc_t sd = sgn_diff<acc_t>(t, u);
          sg += sd * pg;
          s1 += sd * P;
        }
      }
    }

    acc_t D = 0;
    if (FULL) D = group_sum<TPQ>(slice_dot<SW>(hr, pz) + slice_dot<SW>(gr, pv));
    if (valid) {
      if (io.Pv) {
#pragma unroll
        for (int e = 0; e < SW; ++e)
          if (e0 + e < dv) io.Pv[row * dv + e0 + e] = pv[e];
      }
      if (FULL) {
#pragma unroll
        for (int e = 0; e < SW; ++e)
          if (e0 + e < d) io.dq[row * d + e0 + e] = p.scale * (xa[e] - D * ya[e]);
        if (sub == 0) {
          p.delta[int64_t(bg) * N + pt] = D;
          io.own[int64_t(bg) * N + pt] = sg - D * s1;
        }
      }
    }
  }
  __syncthreads();  // phase-1 global writes (delta, own) visible to the whole block

  // ---------------- phase 2: key-outer ----------------
  for (int ubb = 0; ubb < L; ubb += BM) {
    const bool valid = ubb + grp < L;
    const int u = valid ? ubb + grp : L - 1;
    const int64_t pu = ln.pos(u);
    const int64_t row = token_index(N, G, b, pu, g);
    const acc_t cu = cb[pu];
    acc_t kr[SW], vr[SW], zr[SW] = {}, th[SW], tg[SW], dka[SW];
    load_slice<SW>(kr, token_ptr(p.k, p.sk, b, g, pu, W), e0, d, p.scale);
    load_slice<SW>(vr, token_ptr(p.v, p.sv, b, g, pu, W), e0, dv);
    if (FULL) load_slice<SW>(zr, io.Z + row * dv, e0, dv);
#pragma unroll
    for (int e = 0; e < SW; ++e) th[e] = tg[e] = dka[e] = 0;
    acc_t own = 0;

    for (int tb = 0; tb < L; tb += BN) {
      const int nq = L - tb < BN ? L - tb : BN;
      __syncthreads();
      load_line_tile<NT, BN, DPAD>(T0, p.q, p.sq, b, g, ln, tb, nq, d);
      load_line_tile<NT, BN, DPAD>(T1, p.dout, p.sdo, b, g, ln, tb, nq, dv, half);
      if (FULL) load_line_tile<NT, BN, DPAD>(T2, io.Gm, sacc, b, g, ln, tb, nq, dv);
      for (int r = tid; r < BN; r += NT) {
        const int64_t pr = ln.pos(tb + r < L ? tb + r : L - 1);
        c_s[r] = cb[pr];
        lse_s[r] = p.lse[token_index(N, G, b, pr, g) * 2 + wl];
        D_s[r] = FULL ? p.delta[int64_t(bg) * N + pr] : acc_t(0);
      }
      __syncthreads();
#pragma unroll 2
      for (int qq = 0; qq < nq; ++qq) {
        const int t = tb + qq;
        const acc_t sc = group_sum<TPQ>(slice_dot<SW>(kr, &T0[qq][e0]));
        const acc_t P = fast_exp(sc + line_bias(t, u, c_s[qq], cu) - lse_s[qq]);
#pragma unroll
        for (int e = 0; e < SW; ++e) th[e] += P * T1[qq][e0 + e];
        if (FULL) {
          const acc_t gg = group_sum<TPQ>(slice_dot<SW>(zr, &T1[qq][e0]) + slice_dot<SW>(vr, &T2[qq][e0]));
          const acc_t dS = P * (gg - D_s[qq]);
#pragma unroll
          for (int e = 0; e < SW; ++e) {
            tg[e] += P * T2[qq][e0 + e];
            dka[e] += dS * T0[qq][e0 + e];
          }
          own += sgn_diff<acc_t>(u, t) * dS;
        }
      }
    }
    if (valid) {
#pragma unroll
      for (int e = 0; e < SW; ++e) {
        if (e0 + e < dv) {
          if (io.PTh) io.PTh[row * dv + e0 + e] = th[e];
          if (FULL) io.PTG[row * dv + e0 + e] = tg[e];
        }
        if (FULL && e0 + e < d) io.dk[row * d + e0 + e] = p.scale * dka[e];
      }
      if (FULL && sub == 0) io.own[int64_t(bg) * N + pu] += own;  // this block wrote the phase-1 part
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Packed short lines (L <= kShortLine, DPAD <= 32, fp32 accumulation): a block takes lpb = kPackTokens / L whole
// lines, so that the 28- and 56-long lines of the early PPMA stages keep every thread busy, and each line's
// L x L probability tile stays in shared memory for all products of the kernel (the generic kernels above
// recompute the scores in each of their two phases). Work is spread over the block by output element: scores over
// (line, t, u), products over (line, t, channel), in 2 x 2 register tiles.
// Shared memory (dynamic): NTILE token tiles [kPackTokens][DPAD + 1] (q scaled, k, v, ...), NMAT line matrices
// [lpb][L][L] (P, dS), and per-token vectors (prefix sums, lse).
// ---------------------------------------------------------------------------------------------
constexpr int kShortLine = 64;
constexpr int kPackTokens = 64;

template <int DPAD, int NTILE, int NMAT>
struct PackLayout {
  static constexpr int LDT = DPAD + 1;  // odd row stride: column walks hit distinct banks
  static constexpr int kVecs = 2;
  int L, lpb;
  PPMA_HD PackLayout(int L_, int lpb_) : L(L_), lpb(lpb_) {}
  PPMA_HD int64_t tile(int i) const { return int64_t(i) * kPackTokens * LDT; }
  PPMA_HD int64_t mat(int i) const { return tile(NTILE) + int64_t(i) * lpb * L * L; }
  PPMA_HD int64_t vec(int i) const { return mat(NMAT) + int64_t(i) * kPackTokens; }
  PPMA_HD size_t bytes() const { return size_t(vec(kVecs)) * sizeof(float); }
};

// Lines per block for lines of length L.
PPMA_HD int pack_lines(int L) { return L >= kPackTokens ? 1 : kPackTokens / L; }

template <typename acc_t>
PPMA_HD bool criss_cross_packed(int L, int dpad) {
  return sizeof(acc_t) == 4 && L <= kShortLine && dpad <= 32;
}

// For m < batch, t < M, u < N: epi(m, t, u, sum_{e < K} a(m, t, e) b(m, e, u)); 2 x 2 outputs per job, jobs dealt
// to the NT threads with u fastest.
template <int NT, typename FA, typename FB, typename Epi>
__device__ __forceinline__ void block_mm(int batch, int M, int N, int K, const FA& a, const FB& b, const Epi& epi,
                                         int tid) {
  const int mt = (M + 1) >> 1, nt = (N + 1) >> 1, per = mt * nt;
  for (int job = tid; job < batch * per; job += NT) {
    const int m = job / per, r = job % per;
    const int t0 = (r / nt) << 1, u0 = (r % nt) << 1;
    const int t1 = t0 + 1 < M ? t0 + 1 : t0, u1 = u0 + 1 < N ? u0 + 1 : u0;
    float c00 = 0.f, c01 = 0.f, c10 = 0.f, c11 = 0.f;
    for (int e = 0; e < K; ++e) {
      const float a0 = a(m, t0, e), a1 = a(m, t1, e), b0 = b(m, e, u0), b1 = b(m, e, u1);
      c00 += a0 * b0;
      c01 += a0 * b1;
      c10 += a1 * b0;
      c11 += a1 * b1;
    }
    epi(m, t0, u0, c00);
    if (u0 + 1 < N) epi(m, t0, u0 + 1, c01);
    if (t0 + 1 < M) {
      epi(m, t0 + 1, u0, c10);
      if (u0 + 1 < N) epi(m, t0 + 1, u0 + 1, c11);
    }
  }
}

// The lines of a block: lines li0 .. li0 + nl - 1 of one direction, token slot s = m * L + t.
struct LinePack {
  bool rows;
  int li0, nl, L, W;
  PPMA_HD int64_t pos(int s) const {
    const int li = li0 + s / L, t = s % L;
    return rows ? int64_t(li) * W + t : int64_t(t) * W + li;
  }
};

PPMA_HD LinePack line_pack(bool rows, int H, int W, int lpb, unsigned block, int& bg) {
  const int L = rows ? W : H, nlines = rows ? H : W;
  const int packs = (nlines + lpb - 1) / lpb;
  bg = int(block / unsigned(packs));
  LinePack lp;
  lp.rows = rows;
  lp.li0 = int(block % unsigned(packs)) * lpb;
  lp.nl = nlines - lp.li0 < lpb ? nlines - lp.li0 : lpb;
  lp.L = L;
  lp.W = W;
  return lp;
}

// dst[s][e] = src(token of slot s)[e] * mul for s < nl * L, e < DPAD (0 beyond dim).
template <int NT, int DPAD, typename T>
__device__ __forceinline__ void pack_load(float* dst, const T* base, const Strides4& s, int b, int g,
                                          const LinePack& lp, int dim, float mul, int tid) {
  constexpr int LDT = DPAD + 1;
  const int tok = lp.nl * lp.L;
  for (int e = tid; e < tok * DPAD; e += NT) {
    const int sl = e / DPAD, c = e % DPAD;
    float v = 0.f;
    if (c < dim) v = to_acc(token_ptr(base, s, b, g, lp.pos(sl), lp.W)[c]) * mul;
    dst[sl * LDT + c] = v;
  }
}

// Softmax statistics of a row of logits x[0, L) in place: P = exp(x - max) / sum, returns max + log(sum).
PPMA_D float pack_softmax_row(float* x, int L) {
  float mx = -INFINITY;
  for (int u = 0; u < L; ++u) mx = max(mx, x[u]);
  float sum = 0.f;
  for (int u = 0; u < L; ++u) {
    const float e = fast_exp(x[u] - mx);
    x[u] = e;
    sum += e;
  }
  const float inv = 1.f / sum;
  for (int u = 0; u < L; ++u) x[u] *= inv;
  return mx + fast_log(sum);
}

// Forward, MODE as criss_cross_fwd_kernel: 0 rows z1 = A v; 1 columns z2 = B v, out1 = B z1; 2 rows
// out = (out1 + A z2) / 2 with A from the saved lse.
template <typename scalar_t, int DPAD, int MODE>
__global__ void __launch_bounds__(128) criss_cross_pack_fwd_kernel(CrissCrossParams<scalar_t, float> p, int lpb) {
  constexpr int NT = 128, LDT = DPAD + 1;
  constexpr bool kRows = MODE != 1;
  using Lay = PackLayout<DPAD, MODE == 1 ? 4 : 3, 1>;
  PPMA_DYNAMIC_SMEM(float, sbase);
  float* sm = &sbase;
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  int bg;
  const LinePack lp = line_pack(kRows, H, W, lpb, blockIdx.x, bg);
  const int b = bg / G, g = bg % G, L = lp.L, tok = lp.nl * L, tid = threadIdx.x;
  const Lay lay(L, lpb);
  float *q = sm + lay.tile(0), *k = sm + lay.tile(1), *v0 = sm + lay.tile(2), *v1 = sm + lay.tile(MODE == 1 ? 3 : 2);
  float *P = sm + lay.mat(0), *c = sm + lay.vec(0), *lse = sm + lay.vec(1);
  const float* cb = (kRows ? p.cr : p.cc) + int64_t(bg) * N;
  const Strides4 sacc = contiguous_strides(H, W, G, dv);
  const int wl = kRows ? 0 : 1;

  pack_load<NT, DPAD>(q, p.q, p.sq, b, g, lp, d, p.scale, tid);
  pack_load<NT, DPAD>(k, p.k, p.sk, b, g, lp, d, 1.f, tid);
  if (MODE == 2)
    pack_load<NT, DPAD>(v0, static_cast<const float*>(p.z2), sacc, b, g, lp, dv, 1.f, tid);
  else
    pack_load<NT, DPAD>(v0, p.v, p.sv, b, g, lp, dv, 1.f, tid);
  if (MODE == 1) pack_load<NT, DPAD>(v1, static_cast<const float*>(p.z1), sacc, b, g, lp, dv, 1.f, tid);
  for (int s = tid; s < tok; s += NT) {
    const int64_t pt = lp.pos(s);
    c[s] = cb[pt];
    if (MODE == 2) lse[s] = p.lse[((int64_t(b) * N + pt) * G + g) * 2 + wl];
  }
  __syncthreads();

  // logits, then the row softmax in place (MODE 2: exp(x - lse) with the saved statistics)
  block_mm<NT>(
      lp.nl, L, L, DPAD, [&](int m, int t, int e) { return q[(m * L + t) * LDT + e]; },
      [&](int m, int e, int u) { return k[(m * L + u) * LDT + e]; },
      [&](int m, int t, int u, float x) {
        P[(m * L + t) * L + u] = x + line_bias(t, u, c[m * L + t], c[m * L + u]);
      },
      tid);
  __syncthreads();
  for (int s = tid; s < tok; s += NT) {
    float* row = P + s * L;
    if (MODE == 2) {
      for (int u = 0; u < L; ++u) row[u] = fast_exp(row[u] - lse[s]);
    } else {
      const float l = pack_softmax_row(row, L);
      p.lse[((int64_t(b) * N + lp.pos(s)) * G + g) * 2 + wl] = l;
    }
  }
  __syncthreads();

  auto pa = [&](int m, int t, int u) { return P[(m * L + t) * L + u]; };
  auto row_of = [&](int m, int t) { return (int64_t(b) * N + lp.pos(m * L + t)) * G + g; };
  block_mm<NT>(
      lp.nl, L, dv, L, pa, [&](int m, int u, int e) { return v0[(m * L + u) * LDT + e]; },
      [&](int m, int t, int e, float x) {
        const int64_t o = row_of(m, t) * dv + e;
        if (MODE == 0) p.z1[o] = x;
        if (MODE == 1) p.z2[o] = x;
        if (MODE == 2) p.out[o] = from_acc<scalar_t>(0.5f * (p.out1[o] + x));
      },
      tid);
  if (MODE == 1)
    block_mm<NT>(
        lp.nl, L, dv, L, pa, [&](int m, int u, int e) { return v1[(m * L + u) * LDT + e]; },
        [&](int m, int t, int e, float x) { p.out1[row_of(m, t) * dv + e] = x; }, tid);
}

// Backward of one direction (see criss_cross_bwd_kernel for BR1 / BC / BR2 and LineBwdIO): P from the saved lse,
// [FULL] gg = h Z^T + G v^T, dS = P (gg - rowsum(P gg)), all in shared memory, then every product from them.
template <typename scalar_t, int DPAD, bool ROWS, bool FULL>
__global__ void __launch_bounds__(128) criss_cross_pack_bwd_kernel(CrissCrossParams<scalar_t, float> p,
                                                                  LineBwdIO<float> io, int lpb) {
  constexpr int NT = 128, LDT = DPAD + 1;
  using Lay = PackLayout<DPAD, FULL ? 6 : 4, FULL ? 2 : 1>;
  PPMA_DYNAMIC_SMEM(float, sbase);
  float* sm = &sbase;
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  int bg;
  const LinePack lp = line_pack(ROWS, H, W, lpb, blockIdx.x, bg);
  const int b = bg / G, g = bg % G, L = lp.L, tok = lp.nl * L, tid = threadIdx.x;
  const Lay lay(L, lpb);
  float *q = sm + lay.tile(0), *k = sm + lay.tile(1), *v = sm + lay.tile(2), *h = sm + lay.tile(3);
  float *Z = sm + lay.tile(FULL ? 4 : 0), *Gm = sm + lay.tile(FULL ? 5 : 0);
  float *P = sm + lay.mat(0), *dS = sm + lay.mat(FULL ? 1 : 0), *c = sm + lay.vec(0), *lse = sm + lay.vec(1);
  const float* cb = (ROWS ? p.cr : p.cc) + int64_t(bg) * N;
  const Strides4 sacc = contiguous_strides(H, W, G, dv);
  const int wl = ROWS ? 0 : 1;

  pack_load<NT, DPAD>(q, p.q, p.sq, b, g, lp, d, p.scale, tid);
  pack_load<NT, DPAD>(k, p.k, p.sk, b, g, lp, d, 1.f, tid);
  pack_load<NT, DPAD>(v, p.v, p.sv, b, g, lp, dv, 1.f, tid);
  pack_load<NT, DPAD>(h, p.dout, p.sdo, b, g, lp, dv, 0.5f, tid);
  if (FULL) {
    pack_load<NT, DPAD>(Z, io.Z, sacc, b, g, lp, dv, 1.f, tid);
    pack_load<NT, DPAD>(Gm, io.Gm, sacc, b, g, lp, dv, 1.f, tid);
  }
  for (int s = tid; s < tok; s += NT) {
    const int64_t pt = lp.pos(s);
    c[s] = cb[pt];
    lse[s] = p.lse[((int64_t(b) * N + pt) * G + g) * 2 + wl];
  }
  __syncthreads();

  block_mm<NT>(
      lp.nl, L, L, DPAD, [&](int m, int t, int e) { return q[(m * L + t) * LDT + e]; },
      [&](int m, int e, int u) { return k[(m * L + u) * LDT + e]; },
      [&](int m, int t, int u, float x) {
        const int s = m * L + t;
        P[s * L + u] = fast_exp(x + line_bias(t, u, c[s], c[m * L + u]) - lse[s]);
      },
      tid);
  if (FULL)  // gg[t, u] = h_t . Z_u + G_t . v_u (one product over the two halves)
    block_mm<NT>(
        lp.nl, L, L, 2 * DPAD,
        [&](int m, int t, int e) {
          return e < DPAD ? h[(m * L + t) * LDT + e] : Gm[(m * L + t) * LDT + e - DPAD];
        },
        [&](int m, int e, int u) {
          return e < DPAD ? Z[(m * L + u) * LDT + e] : v[(m * L + u) * LDT + e - DPAD];
        },
        [&](int m, int t, int u, float x) { dS[(m * L + t) * L + u] = x; }, tid);
  __syncthreads();
  if (FULL) {
    for (int s = tid; s < tok; s += NT) {  // dS = P (gg - D), D = sum_u P gg
      const float* pr = P + s * L;
      float* gr = dS + s * L;
      float D = 0.f;
      for (int u = 0; u < L; ++u) D += pr[u] * gr[u];
      for (int u = 0; u < L; ++u) gr[u] = pr[u] * (gr[u] - D);
    }
    __syncthreads();
  }

  auto row_of = [&](int m, int t) { return (int64_t(b) * N + lp.pos(m * L + t)) * G + g; };
  auto pt_ = [&](int m, int u, int t) { return P[(m * L + t) * L + u]; };  // P^T
  if (io.Pv)
    block_mm<NT>(
        lp.nl, L, dv, L, [&](int m, int t, int u) { return P[(m * L + t) * L + u]; },
        [&](int m, int u, int e) { return v[(m * L + u) * LDT + e]; },
        [&](int m, int t, int e, float x) { io.Pv[row_of(m, t) * dv + e] = x; }, tid);
  if (io.PTh)
    block_mm<NT>(
        lp.nl, L, dv, L, pt_, [&](int m, int t, int e) { return h[(m * L + t) * LDT + e]; },
        [&](int m, int u, int e, float x) { io.PTh[row_of(m, u) * dv + e] = x; }, tid);
  if (FULL) {
    block_mm<NT>(
        lp.nl, L, dv, L, pt_, [&](int m, int t, int e) { return Gm[(m * L + t) * LDT + e]; },
        [&](int m, int u, int e, float x) { io.PTG[row_of(m, u) * dv + e] = x; }, tid);
    block_mm<NT>(
        lp.nl, L, d, L, [&](int m, int t, int u) { return dS[(m * L + t) * L + u]; },
        [&](int m, int u, int e) { return k[(m * L + u) * LDT + e]; },
        [&](int m, int t, int e, float x) { io.dq[row_of(m, t) * d + e] = p.scale * x; }, tid);
    block_mm<NT>(  // q is stored times scale: dk = scale sum_t dS q_t
        lp.nl, L, d, L, [&](int m, int u, int t) { return dS[(m * L + t) * L + u]; },
        [&](int m, int t, int e) { return q[(m * L + t) * LDT + e]; },
        [&](int m, int u, int e, float x) { io.dk[row_of(m, u) * d + e] = x; }, tid);
    // bias gradient of token x on its line: sum_y sgn(x - y) (dS[x, y] + dS[y, x]), one thread per token
    for (int s = tid; s < tok; s += NT) {
      const int m = s / L, x = s % L;
      const float* rowx = dS + s * L;
      const float* colx = dS + m * L * L + x;
      float own = 0.f;
      for (int y = 0; y < L; ++y) own += sgn_diff<float>(x, y) * (rowx[y] + colx[y * L]);
      io.own[int64_t(bg) * N + lp.pos(s)] = own;
    }
  }
}

// grad_q = dq_c + dq_r, grad_k = dk_c + dk_r, grad_v = gv_c + gv_r (contiguous), one thread per element.
template <typename scalar_t>
__global__ void criss_cross_combine_kernel(CrissCrossParams<scalar_t, typename AccType<scalar_t>::type> p) {
  const int64_t nqk = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G * p.sz.d;
  const int64_t nv = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G * p.sz.dv;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < nqk) {
    p.dq[t] = from_acc<scalar_t>(p.dq_c[t] + p.dq_r[t]);
    p.dk[t] = from_acc<scalar_t>(p.dk_c[t] + p.dk_r[t]);
  }
  if (t < nv) p.dv[t] = from_acc<scalar_t>(p.gv_c[t] + p.gv_r[t]);
}

// Host-side launch helpers (no torch). Forward needs z1, z2, out1 scratch; backward needs all scratch of
// CrissCrossParams (delta, g_cr, g_cc as [BG][N]). Each direction runs the packed kernels when its lines are
// short (criss_cross_packed), else the generic line kernels.

// Blocks of the largest grid of the criss-cross kernels (the launcher checks them against the grid limit).
inline int64_t criss_cross_blocks(const GridSizes& sz) {
  const int64_t lines = sz.H > sz.W ? sz.H : sz.W;
  const int64_t elems = (int64_t(sz.B) * sz.H * sz.W * sz.G * (sz.d > sz.dv ? sz.d : sz.dv) + 255) / 256;
  const int64_t blocks = lines * sz.B * sz.G;
  return blocks > elems ? blocks : elems;
}

template <typename scalar_t, int DPAD, int MODE>
inline void launch_criss_cross_fwd_pass(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                        cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const bool rows = MODE != 1;
  const int L = rows ? p.sz.W : p.sz.H, nlines = rows ? p.sz.H : p.sz.W;
  const int64_t bgs = int64_t(p.sz.B) * p.sz.G;
  if constexpr (sizeof(acc_t) == 4 && DPAD <= 32) {
    if (criss_cross_packed<acc_t>(L, DPAD)) {
      const int lpb = pack_lines(L);
      auto kernel = criss_cross_pack_fwd_kernel<scalar_t, DPAD, MODE>;
      const size_t smem = PackLayout<DPAD, MODE == 1 ? 4 : 3, 1>(L, lpb).bytes();
      allow_dynamic_smem(kernel, PackLayout<DPAD, MODE == 1 ? 4 : 3, 1>(kShortLine, 1).bytes());
      launch_kernel(kernel, dim3(unsigned((nlines + lpb - 1) / lpb * bgs)), dim3(128), smem, stream, p, lpb);
      return;
    }
  }
  launch_kernel(criss_cross_fwd_kernel<scalar_t, DPAD, MODE>, dim3(unsigned(nlines * bgs)), dim3(128), 0, stream,
                p);
}

template <typename scalar_t, int DPAD, bool ROWS, bool FULL>
inline void launch_criss_cross_bwd_pass(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                        const LineBwdIO<typename AccType<scalar_t>::type>& io, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const int L = ROWS ? p.sz.W : p.sz.H, nlines = ROWS ? p.sz.H : p.sz.W;
  const int64_t bgs = int64_t(p.sz.B) * p.sz.G;
  if constexpr (sizeof(acc_t) == 4 && DPAD <= 32) {
    if (criss_cross_packed<acc_t>(L, DPAD)) {
      const int lpb = pack_lines(L);
      using Lay = PackLayout<DPAD, FULL ? 6 : 4, FULL ? 2 : 1>;
      auto kernel = criss_cross_pack_bwd_kernel<scalar_t, DPAD, ROWS, FULL>;
      allow_dynamic_smem(kernel, Lay(kShortLine, 1).bytes());
      launch_kernel(kernel, dim3(unsigned((nlines + lpb - 1) / lpb * bgs)), dim3(128), Lay(L, lpb).bytes(), stream,
                    p, io, lpb);
      return;
    }
  }
  launch_kernel(criss_cross_bwd_kernel<scalar_t, DPAD, ROWS, FULL>, dim3(unsigned(nlines * bgs)), dim3(128), 0,
                stream, p, io);
}

template <typename scalar_t, int DPAD>
inline void launch_criss_cross_fwd(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                   cudaStream_t stream) {
  launch_criss_cross_fwd_pass<scalar_t, DPAD, 0>(p, stream);
  launch_criss_cross_fwd_pass<scalar_t, DPAD, 1>(p, stream);
  launch_criss_cross_fwd_pass<scalar_t, DPAD, 2>(p, stream);
}

template <typename scalar_t, int DPAD>
inline void launch_criss_cross_bwd(const CrissCrossParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                   cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  LineBwdIO<acc_t> r1;
  r1.Pv = p.z1;
  r1.PTh = p.gz2;
  launch_criss_cross_bwd_pass<scalar_t, DPAD, true, false>(p, r1, stream);
  LineBwdIO<acc_t> c;
  c.Z = p.z1;
  c.Gm = p.gz2;
  c.Pv = p.z2;
  c.PTh = p.gz1;
  c.PTG = p.gv_c;
  c.dq = p.dq_c;
  c.dk = p.dk_c;
  c.own = p.g_cc;
  launch_criss_cross_bwd_pass<scalar_t, DPAD, false, true>(p, c, stream);
  LineBwdIO<acc_t> r2;
  r2.Z = p.z2;
  r2.Gm = p.gz1;
  r2.PTG = p.gv_r;
  r2.dq = p.dq_r;
  r2.dk = p.dk_r;
  r2.own = p.g_cr;
  launch_criss_cross_bwd_pass<scalar_t, DPAD, true, true>(p, r2, stream);
  const int64_t n = int64_t(p.sz.B) * p.sz.H * p.sz.W * p.sz.G * (p.sz.d > p.sz.dv ? p.sz.d : p.sz.dv);
  launch_kernel(criss_cross_combine_kernel<scalar_t>, dim3(unsigned((n + 255) / 256)), dim3(256), 0, stream, p);
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
