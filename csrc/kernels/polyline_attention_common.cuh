// Shared pieces of the polyline_attention kernels: tile traits, tile loaders and the two biases.
//
// Math (docs/ops.md "polyline_attention"): per (b, g), query p = (i, j), key s = (k, l), prefix sums cr, cc (excluding 0):
//   M [p, s] = R_i(j, l) + C_l(i, k)     R_i(j, l) = cr[i, max(j,l)] - cr[i, min(j,l)]
//   M'[p, s] = R_k(j, l) + C_j(i, k)     C_l(i, k) = cc[max(i,k), l] - cc[min(i,k), l]
// The four prefix sums that belong to neither p nor s, cr/cc at the "cross" tokens (i, l) (query row,
// key column) and (k, j) (key row, query column), are read from the [BG][N] prefix-sum buffers (they stay
// in L1/L2: a tile touches only a few rows of them).
#pragma once

#include "common.cuh"

namespace ppma {

// Compile-time tile sizes. DPAD: padded head dim (16, 32, 64 fast paths; 128, 256, 512 the generic paths for any
// d, dv up to that size, zero-padded). Each token is handled by TPQ = DPAD / 16 lanes (up to a whole warp)
// holding 16 elements each.
template <typename scalar_t, int DPAD>
struct AttnTraits {
  using acc_t = typename AccType<scalar_t>::type;
  static constexpr int NT = 128;             // threads per block
  static constexpr int SW = 16;              // elements per lane
  static constexpr int TPQ = DPAD / SW;      // lanes per token
  static constexpr int BM = NT / TPQ;        // tokens of the outer tile (one per thread group)
  static constexpr bool kWide = sizeof(acc_t) == 8;
  // inner tile: K and V tiles of BN x DPAD acc_t take 2 * 16 KiB of static shared memory at most
  static constexpr int BN0 = (kWide ? 2048 : 4096) / DPAD;
  static constexpr int BN = BN0 < (kWide ? 32 : 64) ? BN0 : (kWide ? 32 : 64);
  static constexpr int KC = 8;               // keys per online-softmax chunk
  static_assert(DPAD % SW == 0 && TPQ >= 1 && TPQ <= 32 && (TPQ & (TPQ - 1)) == 0,
                "DPAD must be 16, 32, 64, 128, 256 or 512");
};

// Feature element pointer of token p (flat) in batch b, head g.
template <typename T>
PPMA_D const T* token_ptr(const T* base, const Strides4& s, int b, int g, int64_t p, int W) {
  const int64_t i = p / W, j = p - i * W;
  return base + b * s.b + i * s.h + j * s.w + g * s.g;
}

// Load tokens [t0, t0 + n) of a [B,H,W,G,dim] tensor into a shared [rows][DPAD] acc_t tile, zero padded
// (rows beyond n and dims beyond dim).
template <int NT, int ROWS, int DPAD, typename T, typename A>
PPMA_D void load_tile(A (*dst)[DPAD], const T* base, const Strides4& s, int b, int g, int64_t t0, int n, int dim,
                      int W) {
  for (int e = threadIdx.x; e < ROWS * DPAD; e += NT) {
    const int r = e / DPAD, c = e % DPAD;
    A val = 0;
    if (r < n && c < dim) val = to_acc(token_ptr(base, s, b, g, t0 + r, W)[c]);
    dst[r][c] = val;
  }
}

// The two biases of query (qi, qj) with prefix sums (crq, ccq) and key (k, l) with (crk, cck).
// crb, ccb: the [N] prefix sums of this (b, g).
template <typename A>
PPMA_D void pair_biases(int qi, int qj, A crq, A ccq, int k, int l, A crk, A cck, const A* __restrict__ crb,
                        const A* __restrict__ ccb, int W, A& m1, A& m2) {
  const int64_t il = int64_t(qi) * W + l, kj = int64_t(k) * W + qj;
  const A cr_il = __ldg(crb + il), cc_il = __ldg(ccb + il);
  const A cr_kj = __ldg(crb + kj), cc_kj = __ldg(ccb + kj);
  m1 = line_bias(qj, l, crq, cr_il) + line_bias(qi, k, cc_il, cck);  // R_i(j,l) + C_l(i,k)
  m2 = line_bias(qj, l, cr_kj, crk) + line_bias(qi, k, ccq, cc_kj);  // R_k(j,l) + C_j(i,k)
}

}  // namespace ppma
