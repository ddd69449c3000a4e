// Device helpers shared by the ppma CUDA kernels: element conversions, the thread-group dot products, the
// row-aligned tiling, the prefix-sum kernel and the reverse-cumsum kernel that turns prefix-sum gradients into
// log-decay gradients. The math they share with the CPU kernels (accumulation type, token addressing, prefix-sum
// conventions, segment bias) is in common/math.h. Torch-free (docs/design.md §1).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>

#include "common/math.h"
#include "params.h"

#define PPMA_D __device__ __forceinline__

namespace ppma {

// ---------------------------------------------------------------------------------------------
// Types
// ---------------------------------------------------------------------------------------------

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
// Local index a of a tile is token (row0 + a / ncols, col0 + a % ncols), ncols = W (whole rows) or the
// segment length.
//
// The backward kernels run one CTA per "outer" unit that owns a table of cross-term bias gradients: entry
// r * W + x stands for token (cta_row0 + r, x). Whole rows: a CTA is one tile (table R * W). Segments: the S
// segments of a row are dealt to SG = min(S, kMaxSegmentGroups) CTAs (segments g, g + SG, ...), each with a
// table of W entries that it alone accumulates, in a fixed order (deterministic, no atomics); the SG tables of
// a row are then summed in a fixed order. The tables hold at most kMaxSegmentGroups * N entries per (b, head),
// however wide the map.
// ---------------------------------------------------------------------------------------------
constexpr int kMaxSegmentGroups = 4;

struct TileDesc {
  int tok0, count, row0, rows, col0, ncols;
};

struct RowTiling {
  int H, W, BM, R, S, SG, num_tiles, num_ctas, table;

  PPMA_HD RowTiling(int H_, int W_, int BM_) : H(H_), W(W_), BM(BM_) {
    if (W_ <= BM_) {
      R = BM_ / W_;
      S = 1;
      SG = 1;
      num_tiles = (H_ + R - 1) / R;
      num_ctas = num_tiles;
      table = R * W_;
    } else {
      R = 1;
      S = (W_ + BM_ - 1) / BM_;
      SG = S < kMaxSegmentGroups ? S : kMaxSegmentGroups;
      num_tiles = H_ * S;
      num_ctas = H_ * SG;
      table = W_;
    }
  }
  // Column capacity of a tile: the fixed row stride of per-tile tables indexed by (local row, local column).
  PPMA_HD int cap() const { return S == 1 ? W : BM; }
  PPMA_HD TileDesc tile(int t) const {
    TileDesc d;
    if (S == 1) {
      d.row0 = t * R;
      d.rows = min(R, H - d.row0);
      d.col0 = 0;
      d.tok0 = d.row0 * W;
      d.count = d.rows * W;
      d.ncols = W;
    } else {
      d.row0 = t / S;
      d.rows = 1;
      d.col0 = (t % S) * BM;
      d.tok0 = d.row0 * W + d.col0;
      d.count = min(BM, W - d.col0);
      d.ncols = d.count;
    }
    return d;
  }
  // Outer CTA c: its m-th tile (m < cta_count(c)), and the first row of its table.
  PPMA_HD int cta_count(int c) const { return S == 1 ? 1 : (S - c % SG + SG - 1) / SG; }
  PPMA_HD int cta_tile(int c, int m) const { return S == 1 ? c : (c / SG) * S + c % SG + m * SG; }
  PPMA_HD int cta_row0(int c) const { return S == 1 ? c * R : c / SG; }
  // Index of the table entry of token (a, x) in the table of group grp of its row (grp < SG; S == 1: grp = 0).
  PPMA_HD int64_t table_index(int a, int x, int grp) const {
    if (S == 1) return int64_t(a / R) * table + (a % R) * W + x;
    return (int64_t(a) * SG + grp) * table + x;
  }
};

// A 1-D grid of `blocks` blocks (gridDim.y and .z are limited to 65535; x to 2^31 - 1). The kernels decode
// blockIdx.x into (tile, b * heads + g) with the tile fastest, so that neighbouring blocks share K/V in L2.
constexpr int64_t kMaxGridX = 2147483647;
inline bool grid_fits(int64_t blocks) { return blocks >= 1 && blocks <= kMaxGridX; }

// Dynamic shared memory of a kernel, seen as a `Type&` (the host emulator of the tests provides its own).
#ifdef PPMA_EMULATE
#define PPMA_DYNAMIC_SMEM(Type, name) Type& name = *reinterpret_cast<Type*>(::emu::dynamic_smem())
#else
#define PPMA_DYNAMIC_SMEM(Type, name)                                 \
  extern __shared__ __align__(16) unsigned char ppma_dynamic_smem[]; \
  Type& name = *reinterpret_cast<Type*>(ppma_dynamic_smem)
#endif

#ifndef PPMA_EMULATE
// The dynamic shared-memory limits already raised, per (kernel, device): the launchers ask on every launch, and
// cudaFuncSetAttribute is a driver call, so each (kernel, device) is set once, and again only for a larger size.
// A small table under a mutex (a launcher uses a handful of kernels; lookups are a few compares).
class DynamicSmemLimits {
 public:
  static DynamicSmemLimits& instance() {
    static DynamicSmemLimits limits;  // one per process (an inline function's static)
    return limits;
  }
  // Raises the limit of `kernel` on the current device to at least `bytes` unless already done.
  void raise(const void* kernel, size_t bytes) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return;  // the launch that follows reports the error
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < count_; ++i)
      if (entries_[i].kernel == kernel && entries_[i].device == device) {
        if (entries_[i].bytes >= bytes) return;
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) == cudaSuccess)
          entries_[i].bytes = bytes;
        return;
      }
    // not cached when the call fails (the launch then fails and is reported) or the table is full (set each time)
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) == cudaSuccess &&
        count_ < kMaxEntries)
      entries_[count_++] = {kernel, device, bytes};
  }

 private:
  struct Entry {
    const void* kernel;
    int device;
    size_t bytes;
  };
  static constexpr int kMaxEntries = 1024;
  std::mutex mutex_;
  Entry entries_[kMaxEntries];
  int count_ = 0;
};
#endif

// Allows a kernel more than the default 48 KiB of dynamic shared memory (no-op below that), once per kernel,
// device and size (DynamicSmemLimits).
template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, size_t bytes) {
#ifndef PPMA_EMULATE
  if (bytes > 48 * 1024) DynamicSmemLimits::instance().raise(reinterpret_cast<const void*>(kernel), bytes);
#else
  (void)kernel;
  (void)bytes;
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...); under the host emulator used by the tests
// (tests/cuda_emu/emu.h) the same launch runs on the CPU.
template <typename... KArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
#ifdef PPMA_EMULATE
  ::emu::launch(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
#endif
}

// ---------------------------------------------------------------------------------------------
// Prefix sums of the log-decays (docs/ops.md "Prefix sums and biases"; line_prefix_sums), into acc_t [BG][N].
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
    line_prefix_sums(W, la, p.sa.w, p.cr + bg * N + int64_t(i) * W, 1);
  } else if (t < nrow + ncol) {
    const int64_t u = t - nrow;
    const int64_t bg = u / W;
    const int j = int(u % W), b = int(bg / G), g = int(bg % G);
    const acc_t* lb = p.log_beta + b * p.sb.b + j * p.sb.w + g * p.sb.g;
    line_prefix_sums(H, lb, p.sb.h, p.cc + bg * N + j, W);
  }
}

// ---------------------------------------------------------------------------------------------
// Log-decay gradients from prefix-sum gradients (docs/ops.md "Prefix sums and biases"; decay_grads_from_prefix):
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
  const acc_t* tab_r[2] = {nullptr, nullptr};  // [BG][num_ctas][table] row cross terms (RowTiling)
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
    const acc_t* base = tab[o] + bg * int64_t(tl.num_ctas) * tl.table;
    for (int grp = 0; grp < tl.SG; ++grp) s += base[tl.table_index(a, x, grp)];
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
    decay_grads_from_prefix<acc_t>(W, [&](int x) { return token_grad(p.own_r, p.tab_r, tl, bg, a, x); },
                                   p.g_log_alpha + token_index(int64_t(H) * W, G, b, int64_t(a) * W, g), G);
  } else if (t < nrow + ncol) {
    const int64_t u = t - nrow;
    const int64_t bg = u / W;
    const int x = int(u % W), b = int(bg / G), g = int(bg % G);
    decay_grads_from_prefix<acc_t>(H, [&](int a) { return token_grad(p.own_c, p.tab_c, tl, bg, a, x); },
                                   p.g_log_beta + token_index(int64_t(H) * W, G, b, x, g), int64_t(W) * G);
  }
}

}  // namespace ppma
