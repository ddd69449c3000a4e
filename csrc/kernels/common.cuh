// Device helpers shared by the ppma CUDA kernels: element conversions, accumulation types, the
// thread-group dot products, the row-aligned tiling, the prefix-sum kernel and the reverse-cumsum
// kernel that turns prefix-sum gradients into log-decay gradients. Torch-free (style rule 4).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/math.h"  // shared with the CPU kernels (floor_log_decay)
#include "params.h"

#define PPMA_HD __host__ __device__ __forceinline__
#define PPMA_D __device__ __forceinline__

namespace ppma {

// ---------------------------------------------------------------------------------------------
// Types
// ---------------------------------------------------------------------------------------------

// fp32 statistics and accumulation for float/half/bfloat16, fp64 for double (semantics: numerics).
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

PPMA_D float to_acc(float x) { return x; }
PPMA_D double to_acc(double x) { return x; }
PPMA_D float to_acc(__half x) { return __half2float(x); }
PPMA_D float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
struct Cast;
template <>
struct Cast<float> {
  static PPMA_D float from(float x) { return x; }
};
template <>
struct Cast<double> {
  static PPMA_D double from(double x) { return x; }
};
template <>
struct Cast<__half> {
  static PPMA_D __half from(float x) { return __float2half_rn(x); }
};
template <>
struct Cast<__nv_bfloat16> {
  static PPMA_D __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};
template <typename T, typename A>
PPMA_D T from_acc(A x) {
  return Cast<T>::from(x);
}

PPMA_D float fast_exp(float x) { return __expf(x); }
PPMA_D double fast_exp(double x) { return exp(x); }
PPMA_D float fast_log(float x) { return __logf(x); }
PPMA_D double fast_log(double x) { return log(x); }

template <typename A>
PPMA_HD A neg_inf() {
  return -static_cast<A>(INFINITY);
}

// sign(a - b) as +1 / 0 / -1
template <typename A>
PPMA_HD A sgn_diff(int a, int b) {
  return static_cast<A>((a > b) - (a < b));
}

// Bias of a pair of positions t, u on one line with prefix sums ct = c[t], cu = c[u] (semantics: written
// in position order, c[max] - c[min], never with abs()).
template <typename A>
PPMA_HD A line_bias(int t, int u, A ct, A cu) {
  return u >= t ? cu - ct : ct - cu;
}

// ---------------------------------------------------------------------------------------------
// Thread groups: TPQ consecutive lanes of a warp share one token; lane `sub` holds elements
// [sub * SW, sub * SW + SW) of its head-dim vectors (zero beyond the real dim).
// ---------------------------------------------------------------------------------------------

// Sum over the TPQ lanes of a group (xor butterfly: stays inside an aligned group of TPQ lanes).
template <int TPQ, typename A>
PPMA_D A group_sum(A x) {
#pragma unroll
  for (int off = TPQ / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// dot of a register slice with a shared-memory slice
template <int SW, typename A>
PPMA_D A slice_dot(const A (&r)[SW], const A* s) {
  A acc = 0;
#pragma unroll
  for (int e = 0; e < SW; ++e) acc += r[e] * s[e];
  return acc;
}

// Load elements [e0, e0 + SW) of a vector of length `len` into registers (zero beyond len), scaled.
template <int SW, typename T, typename A>
PPMA_D void load_slice(A (&r)[SW], const T* ptr, int e0, int len, A mul = A(1)) {
#pragma unroll
  for (int e = 0; e < SW; ++e) r[e] = (e0 + e < len) ? to_acc(ptr[e0 + e]) * mul : A(0);
}

// ---------------------------------------------------------------------------------------------
// Row-aligned tiling of the N = H * W tokens into tiles of at most BM consecutive tokens.
// W <= BM: a tile is R = floor(BM / W) whole rows (S = 1 segment per row);
// W >  BM: a tile is one segment of one row (R = 1, S = ceil(W / BM) segments per row).
// Each tile owns a "table" of R * W entries (W <= BM) or W entries (W > BM): entry r * W + x stands for
// token (row0 + r, x). Cross-term bias gradients are accumulated there by the tile's block alone
// (deterministic, no atomics), then summed over the S segments of a row in a fixed order.
// ---------------------------------------------------------------------------------------------
struct RowTiling {
  int H, W, R, S, num_tiles, table;

  PPMA_HD RowTiling(int H_, int W_, int BM) : H(H_), W(W_) {
    if (W_ <= BM) {
      R = BM / W_;
      S = 1;
      num_tiles = (H_ + R - 1) / R;
      table = R * W_;
    } else {
      R = 1;
      S = (W_ + BM - 1) / BM;
      num_tiles = H_ * S;
      table = W_;
    }
  }
  // Tile t: first token, token count, first row, rows, first column (of its first row).
  PPMA_HD void tile(int t, int BM, int& tok0, int& count, int& row0, int& rows, int& col0) const {
    if (S == 1) {
      row0 = t * R;
      rows = min(R, H - row0);
      col0 = 0;
      tok0 = row0 * W;
      count = rows * W;
    } else {
      row0 = t / S;
      rows = 1;
      col0 = (t % S) * BM;
      tok0 = row0 * W + col0;
      count = min(BM, W - col0);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Prefix sums of the log-decays (each floored at -1e4, common/math.h), excluding index 0 (semantics), into
// acc_t [BG][N].
// Threads: one per (bg, row) for cr, then one per (bg, column) for cc. Sequential along the line, which
// keeps the sums deterministic; lines are at most a few hundred long.
// ---------------------------------------------------------------------------------------------
template <typename acc_t>
__global__ void prefix_sums_kernel(PrefixParams<acc_t> p) {
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const int64_t N = int64_t(H) * W;
  const int64_t nrow = int64_t(p.sz.B) * G * H, ncol = int64_t(p.sz.B) * G * W;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < nrow) {
    const int64_t bg = t / H;
    const int i = int(t % H), b = int(bg / G), g = int(bg % G);
    const acc_t* la = p.log_alpha + b * p.sa.b + i * p.sa.h + g * p.sa.g;
    acc_t* out = p.cr + bg * N + int64_t(i) * W;
    acc_t c = 0;
    out[0] = 0;
    for (int j = 1; j < W; ++j) {
      c += floor_log_decay(la[j * p.sa.w]);
      out[j] = c;
    }
  } else if (t < nrow + ncol) {
    const int64_t u = t - nrow;
    const int64_t bg = u / W;
    const int j = int(u % W), b = int(bg / G), g = int(bg % G);
    const acc_t* lb = p.log_beta + b * p.sb.b + j * p.sb.w + g * p.sb.g;
    acc_t* out = p.cc + bg * N + j;
    acc_t c = 0;
    out[0] = 0;
    for (int i = 1; i < H; ++i) {
      c += floor_log_decay(lb[i * p.sb.h]);
      out[int64_t(i) * W] = c;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Log-decay gradients from prefix-sum gradients (semantics):
//   grad_cr(a, x) = own1[a, x] + own2[a, x] + sum over tables (x1, x2) of the entries of token (a, x)
//   grad_log_alpha[a, n] = sum_{x >= n} grad_cr(a, x) for n >= 1, exactly 0 for n = 0 (reverse cumsum
//   along each row); the same along each column for cc / log_beta.
// One thread per (bg, row) and per (bg, column); fixed summation order, so deterministic.
// ---------------------------------------------------------------------------------------------
template <typename acc_t>
struct DecayGradParams {
  GridSizes sz;
  const acc_t* own_r[2] = {nullptr, nullptr};  // [BG][N] row (cr) terms
  const acc_t* own_c[2] = {nullptr, nullptr};  // [BG][N] column (cc) terms
  const acc_t* tab_r[2] = {nullptr, nullptr};  // [BG][num_tiles][table] row cross terms
  const acc_t* tab_c[2] = {nullptr, nullptr};
  int tile_bm = 1;  // tile size of the RowTiling of the tables
  acc_t* g_log_alpha = nullptr;  // contiguous [B, H, W, heads]
  acc_t* g_log_beta = nullptr;
};

template <typename acc_t>
PPMA_D acc_t token_grad(const acc_t* const (&own)[2], const acc_t* const (&tab)[2], const RowTiling& tl,
                        int64_t bg, int a, int x) {
  const int64_t N = int64_t(tl.H) * tl.W;
  const int64_t p = int64_t(a) * tl.W + x;
  acc_t s = 0;
#pragma unroll
  for (int o = 0; o < 2; ++o)
    if (own[o]) s += own[o][bg * N + p];
#pragma unroll
  for (int o = 0; o < 2; ++o) {
    if (!tab[o]) continue;
    const acc_t* base = tab[o] + bg * int64_t(tl.num_tiles) * tl.table;
    if (tl.S == 1) {
      s += base[int64_t(a / tl.R) * tl.table + (a % tl.R) * tl.W + x];
    } else {
      for (int c = 0; c < tl.S; ++c) s += base[(int64_t(a) * tl.S + c) * tl.table + x];
    }
  }
  return s;
}

template <typename acc_t>
__global__ void decay_grad_kernel(DecayGradParams<acc_t> p) {
  const int H = p.sz.H, W = p.sz.W, G = p.sz.G;
  const RowTiling tl(H, W, p.tile_bm);
  const int64_t nrow = int64_t(p.sz.B) * G * H, ncol = int64_t(p.sz.B) * G * W;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < nrow) {
    const int64_t bg = t / H;
    const int a = int(t % H), b = int(bg / G), g = int(bg % G);
    acc_t* out = p.g_log_alpha + ((int64_t(b) * H + a) * W) * G + g;
    acc_t run = 0;
    for (int x = W - 1; x >= 1; --x) {
      run += token_grad(p.own_r, p.tab_r, tl, bg, a, x);
      out[int64_t(x) * G] = run;
    }
    out[0] = 0;
  } else if (t < nrow + ncol) {
    const int64_t u = t - nrow;
    const int64_t bg = u / W;
    const int x = int(u % W), b = int(bg / G), g = int(bg % G);
    acc_t* out = p.g_log_beta + (int64_t(b) * H * W + x) * G + g;
    acc_t run = 0;
    for (int a = H - 1; a >= 1; --a) {
      run += token_grad(p.own_c, p.tab_c, tl, bg, a, x);
      out[int64_t(a) * W * G] = run;
    }
    out[0] = 0;
  }
}

}  // namespace ppma
