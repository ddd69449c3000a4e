// polyline_attention forward: FlashAttention-style, CUDA cores, fp32 (fp64) accumulation.
//
// Grid: ceil(N / BM) * B * G blocks (1-D, tile fastest). Block: 128 threads = BM thread groups of TPQ lanes, one query per group.
// One pass over K/V tiles of BN keys (shared memory); per chunk of KC keys each group computes the
// score S = scale <q, k> once and feeds TWO online softmaxes: logits S + M (V2H, state 1) and S + M'
// (H2V, state 2), M' = M^T (see polyline_attention_common.cuh for the biases).
// Outputs: out = 0.5 (o1 / l1 + o2 / l2), out_v2h = o1 / l1, lse = (m1 + log l1, m2 + log l2).
#pragma once

#include "polyline_attention_common.cuh"

namespace ppma {

template <typename scalar_t, int DPAD>
__global__ void __launch_bounds__(128)
    polyline_attention_fwd_kernel(PolylineAttnParams<scalar_t, typename AccType<scalar_t>::type> p) {
  using Tr = AttnTraits<scalar_t, DPAD>;
  using acc_t = typename Tr::acc_t;
  constexpr int NT = Tr::NT, SW = Tr::SW, TPQ = Tr::TPQ, BM = Tr::BM, BN = Tr::BN, KC = Tr::KC;

  __shared__ __align__(16) acc_t Ks[BN][DPAD];
  __shared__ __align__(16) acc_t Vs[BN][DPAD];
  __shared__ acc_t crk_s[BN], cck_s[BN];
  __shared__ int ki_s[BN], kj_s[BN];

  const int H = p.sz.H, W = p.sz.W, G = p.sz.G, d = p.sz.d, dv = p.sz.dv;
  const int64_t N = int64_t(H) * W;
  const int tid = threadIdx.x, grp = tid / TPQ, sub = tid % TPQ, e0 = sub * SW;
  const int64_t ntiles = (N + BM - 1) / BM;
  const int bg = int(blockIdx.x / ntiles), b = bg / G, g = bg % G;
  const int64_t p_raw = int64_t(blockIdx.x % ntiles) * BM + grp;
  const bool valid = p_raw < N;
  const int64_t pq = valid ? p_raw : N - 1;  // idle groups compute on the last token, write nothing
  const int qi = int(pq / W), qj = int(pq % W);

  const acc_t* crb = p.cr + bg * N;
  const acc_t* ccb = p.cc + bg * N;
  const acc_t crq = crb[pq], ccq = ccb[pq];

  acc_t qr[SW];
  load_slice<SW>(qr, token_ptr(p.q, p.sq, b, g, pq, W), e0, d, p.scale);  // scale folded into q

  acc_t o1[SW], o2[SW];
#pragma unroll
  for (int e = 0; e < SW; ++e) o1[e] = o2[e] = 0;
  acc_t m1 = neg_inf<acc_t>(), m2 = neg_inf<acc_t>(), l1 = 0, l2 = 0;

  for (int64_t kt = 0; kt < N; kt += BN) {
    const int nk = N - kt < BN ? int(N - kt) : BN;
    __syncthreads();  // previous tile fully consumed
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

    for (int c0 = 0; c0 < nk; c0 += KC) {  // nk, c0 uniform over the block: shuffles stay converged
      acc_t s1[KC], s2[KC];
      acc_t mx1 = neg_inf<acc_t>(), mx2 = neg_inf<acc_t>();
#pragma unroll
      for (int u = 0; u < KC; ++u) {
        const int kk = c0 + u;
        if (kk < nk) {
          const acc_t sc = group_sum<TPQ>(slice_dot<SW>(qr, &Ks[kk][e0]));
          acc_t b1, b2;
          pair_biases(qi, qj, crq, ccq, ki_s[kk], kj_s[kk], crk_s[kk], cck_s[kk], crb, ccb, W, b1, b2);
          s1[u] = sc + b1;
          s2[u] = sc + b2;
        } else {
          s1[u] = s2[u] = neg_inf<acc_t>();
        }
        mx1 = max(mx1, s1[u]);
        mx2 = max(mx2, s2[u]);
      }
      // the chunk holds at least one real key, so the new maxima are finite
      const acc_t n1 = max(m1, mx1), n2 = max(m2, mx2);
      const acc_t a1 = fast_exp(m1 - n1), a2 = fast_exp(m2 - n2);  // exp(-inf) = 0 on the first chunk
      l1 *= a1;
      l2 *= a2;
#pragma unroll
      for (int e = 0; e < SW; ++e) {
        o1[e] *= a1;
        o2[e] *= a2;
      }
#pragma unroll
      for (int u = 0; u < KC; ++u) {
        const int kk = c0 + u;
        if (kk < nk) {
          const acc_t p1 = fast_exp(s1[u] - n1), p2 = fast_exp(s2[u] - n2);
          l1 += p1;
          l2 += p2;
          const acc_t* vrow = &Vs[kk][e0];
#pragma unroll
          for (int e = 0; e < SW; ++e) {
            o1[e] += p1 * vrow[e];
            o2[e] += p2 * vrow[e];
          }
        }
      }
      m1 = n1;
      m2 = n2;
    }
  }

  if (!valid) return;
  const acc_t r1 = acc_t(1) / l1, r2 = acc_t(1) / l2;
  const int64_t row = token_index(N, G, b, pq, g);  // [B, N, G] index
  scalar_t* out = p.out + row * dv;
  scalar_t* ov = p.out_v2h + row * dv;
#pragma unroll
  for (int e = 0; e < SW; ++e) {
    if (e0 + e < dv) {
      const acc_t x1 = o1[e] * r1, x2 = o2[e] * r2;
      out[e0 + e] = from_acc<scalar_t>(acc_t(0.5) * (x1 + x2));
      ov[e0 + e] = from_acc<scalar_t>(x1);
    }
  }
  if (sub == 0) {
    p.lse[row * 2 + 0] = m1 + fast_log(l1);
    p.lse[row * 2 + 1] = m2 + fast_log(l2);
  }
}

// Blocks of the forward grid (the launcher checks them against the grid limit).
template <typename scalar_t, int DPAD>
inline int64_t polyline_attention_fwd_blocks(const GridSizes& sz) {
  const int64_t N = int64_t(sz.H) * sz.W, BM = AttnTraits<scalar_t, DPAD>::BM;
  return (N + BM - 1) / BM * sz.B * sz.G;
}

// Host-side launch helper (no torch): grid and block of the forward kernel for a given DPAD.
template <typename scalar_t, int DPAD>
inline void launch_polyline_attention_fwd(const PolylineAttnParams<scalar_t, typename AccType<scalar_t>::type>& p,
                                          cudaStream_t stream) {
  using Tr = AttnTraits<scalar_t, DPAD>;
  const int64_t N = int64_t(p.sz.H) * p.sz.W;
  const dim3 grid(unsigned((N + Tr::BM - 1) / Tr::BM * p.sz.B * p.sz.G));
  launch_kernel(polyline_attention_fwd_kernel<scalar_t, DPAD>, grid, dim3(Tr::NT), 0, stream, p);
}

}  // namespace ppma
