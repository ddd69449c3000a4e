// polyline_linear_attention (PPMLA, docs/ops.md "polyline_linear_attention") on CUDA, the next generation of the
// scan kernels of polyline_linear_attention.cuh (opt-in: internal option cuda_next_polyline_linear_attention,
// docs/configuration.md; docs/cuda-kernels.md "polyline_linear_attention"). Same math, workspace roles, token-local
// kernels (pack, finish, reduce) and decay gradients as that header, which states the decomposition; what changes
// is where the scan state lives and who touches it:
//
//  - Shared memory. The channel slices are as narrow as it takes for a block's row buffers ([W][m] each, m = d x
//    slice width: 2 in the forward and the backward's scans, 5 in the prefix-sum gradients, which take slices of
//    their own) to fit kLinV2SmemBudget bytes of shared memory (more blocks in the grid, one thread per state
//    element). Only when one channel does not fit (W * d large) does the state go to global scratch, with the same
//    kernels.
//  - One owner per state element. A thread owns element e of every buffer for all W columns: the column step, the
//    two row recurrences (docs/model.md A.7; row_product of polyline_linear_attention.cuh) and their fusion are
//    thread-local, so a row step needs a barrier only around the contraction with the tokens' vectors (the one
//    place that reads other threads' elements): 2 barriers per row step instead of 3 (forward, backward scans) and
//    2 instead of 5-6 (the prefix-sum gradients, with a fifth buffer for the strict row product of the column
//    state).
//  - The row recurrences stage their operands in registers kRowChunk columns at a time (loads of the chunk, then
//    the dependent FMAs and stores), over __restrict__ buffers: no load waits on the store before it.
//
// Results: the forward's terms are sums over the state rows in the verified order (the slicing splits only the
// channels), so up to floating-point contraction they equal the verified kernel's; the backward's partial sums
// over channel slices are reduced in a fixed order (no atomics: bitwise-equal reruns) and differ from the verified
// kernel's by rounding when the slices differ. Accumulation in fp32 (fp64 for fp64 inputs).
#pragma once

#include "polyline_linear_attention.cuh"

namespace ppma {

constexpr int kLinV2MaxThreads = 256;               // threads per block at most (one per state element)
constexpr int64_t kLinV2SmemBudget = 96 * 1024;     // bytes of dynamic shared memory per block for its state
constexpr int kLinV2FwdBuffers = 2;                 // column state, row product (also the backward's scans)
constexpr int kLinV2BwdBuffers = 5;                 // prefix-sum gradients: colB, colD, D, E, Q

// Slice width for C channels of a kernel with `buffers` row buffers per block: the widest whose buffers fit `budget`
// bytes of shared memory and whose m = d x width state elements fit one block (at most kLinearMaxSlice), balanced
// like polyline_linear_attention_slice.
inline int polyline_linear_attention_v2_slice(const GridSizes& sz, int C, int acc_bytes, int buffers,
                                              int64_t budget = kLinV2SmemBudget) {
  const int64_t per_channel = int64_t(buffers) * sz.W * sz.d * acc_bytes;
  int64_t cap = kLinearMaxSlice;
  if (sz.d > 0) cap = std::min<int64_t>(cap, std::max<int64_t>(1, kLinV2MaxThreads / sz.d));
  if (per_channel > 0 && budget / per_channel >= 1) cap = std::min<int64_t>(cap, budget / per_channel);
  const int64_t S = (C + cap - 1) / cap;
  return int((C + S - 1) / S);
}

// The slices and state placement of the next kernels: the forward, or the backward's scans (2 buffers per block)
// and, with their own slices, its prefix-sum gradients (5 buffers per block). The scans' slices set the partial sums
// of dq and dk ([2][S][BG][N][d]); the mask kernel's only those of the prefix-sum gradients ([2][2][S_mask][BG][N]),
// so its narrower slices cost little memory. smem: the state in shared memory (else in global scratch, when one
// channel's buffers exceed the budget). forced_cs > 0: that width everywhere (tests).
struct LinV2Plan {
  int cs = 0, cs_mask = 0;
  bool smem = false, smem_mask = false;
};

inline LinV2Plan polyline_linear_attention_v2_plan(const GridSizes& sz, int C, int acc_bytes, bool backward,
                                                   int forced_cs = 0, int64_t budget = kLinV2SmemBudget) {
  auto fits = [&](int cs, int buffers) { return int64_t(buffers) * sz.W * sz.d * cs * acc_bytes <= budget; };
  LinV2Plan pl;
  pl.cs = forced_cs > 0 ? forced_cs : polyline_linear_attention_v2_slice(sz, C, acc_bytes, kLinV2FwdBuffers, budget);
  pl.smem = fits(pl.cs, kLinV2FwdBuffers);
  if (backward) {
    pl.cs_mask =
        forced_cs > 0 ? forced_cs : polyline_linear_attention_v2_slice(sz, C, acc_bytes, kLinV2BwdBuffers, budget);
    pl.smem_mask = fits(pl.cs_mask, kLinV2BwdBuffers);
  }
  return pl;
}

// Blocks of the largest scan kernel of a plan (the launcher checks them against the grid limit).
inline int64_t polyline_linear_attention_v2_blocks(const GridSizes& sz, int C, const LinV2Plan& pl, bool backward) {
  const int64_t scans = polyline_linear_attention_blocks(sz, C, pl.cs, backward);
  return backward ? std::max(scans, polyline_linear_attention_blocks(sz, C, pl.cs_mask, false)) : scans;
}

// Threads of a scan block for m state elements: one per element, whole warps (row_dots uses a warp per token).
inline int polyline_linear_attention_v2_threads(int64_t m) {
  const int64_t t = (m + 31) / 32 * 32;
  return int(std::min<int64_t>(kLinV2MaxThreads, std::max<int64_t>(32, t)));
}

namespace lin_v2 {

constexpr int kRowChunk = 4;  // columns whose operands a row recurrence loads before it computes them

// The two-sided row product (row_product of polyline_linear_attention.cuh) of one state element along row i:
// f_j = ea_j f_{j-1} + Z_j, g_{j-1} = ea_j (g_j + Z_j); D_j = f_j + g_j and/or E_j = f_j - Z_j - g_j (D, E: the
// element's column of a [W][m] buffer, stride m; either may be null). zf(j) gives Z_j to the f pass (j increasing,
// once each: it may update the state it reads), zg(j) to the g pass (j decreasing from W - 1 to 1). Operands are
// loaded kRowChunk columns at a time before the chunk's dependent arithmetic; the same operations in the same order
// as the verified row_product.
template <typename acc_t, typename ZF, typename ZG>
PPMA_D void row_product_elem(int W, int64_t m, const acc_t* __restrict__ ea, const ZF& zf, const ZG& zg,
                             acc_t* __restrict__ D, acc_t* __restrict__ E) {
  acc_t f = 0;
  for (int j0 = 0; j0 < W; j0 += kRowChunk) {
    acc_t z[kRowChunk], a[kRowChunk];
#pragma unroll
    for (int t = 0; t < kRowChunk; ++t) {
      const int j = j0 + t;
      z[t] = j < W ? zf(j) : acc_t(0);
      a[t] = j < W && j > 0 ? ea[j] : acc_t(0);
    }
#pragma unroll
    for (int t = 0; t < kRowChunk; ++t) {
      const int j = j0 + t;
      if (j < W) {
        const acc_t strict = j == 0 ? acc_t(0) : a[t] * f;  // f_j - Z_j
        f = strict + z[t];
        if (D) D[j * m] = f;
        if (E) E[j * m] = strict;
      }
    }
  }
  acc_t g = 0;
  for (int j1 = W - 1; j1 >= 1; j1 -= kRowChunk) {
    acc_t z[kRowChunk], a[kRowChunk], dd[kRowChunk], ee[kRowChunk];
#pragma unroll
    for (int t = 0; t < kRowChunk; ++t) {
      const int j = j1 - t;
      const bool in = j >= 1;
      z[t] = in ? zg(j) : acc_t(0);
      a[t] = in ? ea[j] : acc_t(0);
      dd[t] = in && D ? D[(j - 1) * m] : acc_t(0);
      ee[t] = in && E ? E[(j - 1) * m] : acc_t(0);
    }
#pragma unroll
    for (int t = 0; t < kRowChunk; ++t) {
      const int j = j1 - t;
      if (j >= 1) {
        g = a[t] * (g + z[t]);  // g_{j-1}
        if (D) D[(j - 1) * m] = dd[t] + g;
        if (E) E[(j - 1) * m] = ee[t] - g;
      }
    }
  }
}

// Row i's decay multiplier of the column recurrence at column l (0 on row 0).
template <typename acc_t>
PPMA_D acc_t col_decay(const LinUnit<acc_t>& u, int i, int l) {
  return i == 0 ? acc_t(0) : u.eb[int64_t(i) * u.W + l];
}

// masked_scan of polyline_linear_attention.cuh with one owner per state element: for every token p,
// S_p = sum_s Lm[p, s] X_s (the slice), Lm = L (transpose = false: V2H) or L^T (true: H2V), contracted as k says.
// col, row: [W][m] each (shared memory or the block's global scratch). Per row step: the owners' elementwise phase,
// a barrier, the contraction (contract_row, which reads every element), a barrier.
template <typename acc_t>
PPMA_D void masked_scan(const LinUnit<acc_t>& u, const LinOuter<acc_t>& X, bool transpose, const LinContract<acc_t>& k,
                        acc_t* __restrict__ col, acc_t* __restrict__ row) {
  const int H = u.H, W = u.W;
  const int64_t m = u.m;
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x)
      for (int l = 0; l < W; ++l) col[l * m + e] = acc_t(0);
    for (int step = 0; step < H; ++step) {
      const int i = down ? step : H - 1 - step;
      const int64_t p0 = int64_t(i) * W;
      const acc_t* __restrict__ ea = u.ea + p0;
      const bool contract = down || i < H - 1;
      for (int64_t e = threadIdx.x; e < m; e += blockDim.x) {
        acc_t* __restrict__ c = col + e;
        acc_t* __restrict__ r = row + e;
        auto x = [&](int l) { return X(p0 + l, int(e)); };
        auto c_at = [&](int l) { return c[l * m]; };
        if (!transpose) {
          if (down) {  // F_i = eb_i F_{i-1} + X_i, updated as the f pass reads it, then the row product of F_i
            auto update = [&](int l) {
              const acc_t v = col_decay(u, i, l) * c[l * m] + x(l);
              c[l * m] = v;
              return v;
            };
            row_product_elem(W, m, ea, update, c_at, r, static_cast<acc_t*>(nullptr));
          } else {  // the row product of G_i, then G_{i-1} = eb_i (G_i + X_i) (only the owner reads col)
            if (contract) row_product_elem(W, m, ea, c_at, c_at, r, static_cast<acc_t*>(nullptr));
            if (i > 0)
              for (int l = 0; l < W; ++l) c[l * m] = col_decay(u, i, l) * (c[l * m] + x(l));
          }
        } else {  // R_i = the row product of X_i; down: F_i = eb_i F_{i-1} + R_i (the contraction reads F_i)
          if (down || i > 0) row_product_elem(W, m, ea, x, x, r, static_cast<acc_t*>(nullptr));
          if (down)
            for (int l = 0; l < W; ++l) c[l * m] = col_decay(u, i, l) * c[l * m] + r[l * m];
        }
      }
      if (contract) {
        __syncthreads();
        contract_row(u, i, transpose ? col : row, k, down);
        __syncthreads();
      }
      if (transpose && !down && i > 0)  // G_{i-1} = eb_i (G_i + R_i), once the contraction has read G_i
        for (int64_t e = threadIdx.x; e < m; e += blockDim.x)
          for (int l = 0; l < W; ++l) col[l * m + e] = col_decay(u, i, l) * (col[l * m + e] + row[l * m + e]);
    }
  }
}

// mask_grads of polyline_linear_attention.cuh (its header and the CPU kernel's derive the terms) with one owner per
// state element and a fifth buffer Q for the strict row product of the column half Z = colB, so that both inner
// products of a row step run after one barrier: column terms <D, F(B) - B> + <B, F(D) - D> (top-down) and
// -<D, G(B)> - <B, G(D)> (bottom-up) into gcc, row terms <A, E(Z)> + <Z, E(A)> into gcr. Buffers [W][m].
template <typename acc_t>
PPMA_D void mask_grads(const LinUnit<acc_t>& u, const LinOuter<acc_t>& A, const LinOuter<acc_t>& B, acc_t* gcr,
                       acc_t* gcc, acc_t* __restrict__ colB, acc_t* __restrict__ colD, acc_t* __restrict__ D,
                       acc_t* __restrict__ E, acc_t* __restrict__ Q) {
  const int H = u.H, W = u.W;
  const int64_t m = u.m;
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    for (int64_t e = threadIdx.x; e < m; e += blockDim.x)
      for (int l = 0; l < W; ++l) colB[l * m + e] = colD[l * m + e] = acc_t(0);
    for (int step = 0; step < H; ++step) {
      const int i = down ? step : H - 1 - step;
      const int64_t p0 = int64_t(i) * W;
      const acc_t* __restrict__ ea = u.ea + p0;
      for (int64_t e = threadIdx.x; e < m; e += blockDim.x) {
        auto a_at = [&](int l) { return A(p0 + l, int(e)); };
        auto b_at = [&](int l) { return B(p0 + l, int(e)); };
        auto cb_at = [&](int l) { return colB[l * m + e]; };
        row_product_elem(W, m, ea, a_at, a_at, D + e, E + e);  // D = L^H A (row-local), E its strict part
        if (down)
          for (int l = 0; l < W; ++l) {
            const acc_t s = col_decay(u, i, l);
            colB[l * m + e] = s * colB[l * m + e] + b_at(l);
            colD[l * m + e] = s * colD[l * m + e] + D[l * m + e];
          }
        row_product_elem(W, m, ea, cb_at, cb_at, static_cast<acc_t*>(nullptr), Q + e);  // Q = E(Z)
      }
      __syncthreads();
      const acc_t two = down ? acc_t(2) : acc_t(0);
      row_dots(
          u, i,
          [&](int l, int e) {
            const int64_t x = int64_t(l) * m + e;
            return colB[x] * D[x] + (colD[x] - two * D[x]) * B(p0 + l, e);
          },
          gcc, down ? acc_t(1) : acc_t(-1), down);
      row_dots(
          u, i,
          [&](int l, int e) {
            const int64_t x = int64_t(l) * m + e;
            return Q[x] * A(p0 + l, e) + colB[x] * E[x];
          },
          gcr, acc_t(1), down);
      __syncthreads();
      if (!down && i > 0)  // G_{i-1} of D and B, once the inner products have read G_i
        for (int64_t e = threadIdx.x; e < m; e += blockDim.x)
          for (int l = 0; l < W; ++l) {
            const acc_t s = col_decay(u, i, l);
            colD[l * m + e] = s * (colD[l * m + e] + D[l * m + e]);
            colB[l * m + e] = s * (colB[l * m + e] + B(p0 + l, int(e)));
          }
    }
  }
}

// The block's state: dynamic shared memory (kSmem; a compile-time choice, so that the compiler sees the shared
// address space and emits shared loads and stores), or `bufs` buffers of [W][d * cs] in global scratch.
template <bool kSmem, typename acc_t>
PPMA_D acc_t* state(const LinearAttnWork<acc_t>& w, int bufs) {
  if constexpr (kSmem) {
    PPMA_DYNAMIC_SMEM(acc_t, smem);
    return &smem;
  } else {
    return w.state + int64_t(blockIdx.x) * bufs * w.state_stride;
  }
}

}  // namespace lin_v2

// Forward: as polyline_linear_attention_fwd_kernel. kSmem: the state in dynamic shared memory (else w.state).
template <typename acc_t, bool kSmem>
__global__ void __launch_bounds__(kLinV2MaxThreads, 1)
    polyline_linear_attention_v2_fwd_kernel(LinearAttnWork<acc_t> w) {
  const LinBlock blk = lin_block(w.S, 1);
  const LinUnit<acc_t> u = lin_unit(w, blk.bg, blk.slice);
  const int G = w.sz.G, d = u.d, C = u.C;
  const int64_t N = int64_t(u.H) * u.W, b = blk.bg / G, g = blk.bg % G;
  const LinOuter<acc_t> X{w.k + blk.bg * N * d, w.v + blk.bg * N * C + u.c0, d, C, u.cw};
  LinContract<acc_t> k;
  k.a = w.q + blk.bg * N * d;
  k.out_a = w.stats + token_index(N, G, b, 0, g) * 2 * C + blk.dir * C + u.c0;
  k.oas = int64_t(G) * 2 * C;
  acc_t* st = lin_v2::state<kSmem>(w, kLinV2FwdBuffers);
  lin_v2::masked_scan(u, X, blk.dir == 1, k, st, st + int64_t(u.W) * u.m);
}

// Backward scans: as polyline_linear_attention_bwd_scan_kernel (task 0: dq; task 1: dk, dv'), 2 buffers per block.
template <typename acc_t, bool kSmem>
__global__ void __launch_bounds__(kLinV2MaxThreads, 1)
    polyline_linear_attention_v2_bwd_scan_kernel(LinearAttnWork<acc_t> w) {
  const LinBwdUnit<acc_t> b = lin_bwd_unit(w, 2);
  const bool dq = b.blk.task == 0;
  const int d = b.u.d, C = b.u.C;
  const int64_t N = int64_t(b.u.H) * b.u.W, BG = int64_t(w.sz.B) * w.sz.G, bg = b.blk.bg;
  LinContract<acc_t> k;
  k.out_b = (dq ? w.dq_part : w.dk_part) + (b.part + bg * N) * d;
  k.obs = d;
  k.b = dq ? b.dop : b.v;
  if (!dq) {
    k.a = b.k;
    k.out_a = w.dv_part + (b.blk.dir * BG + bg) * N * C + b.u.c0;
    k.oas = C;
  }
  const LinOuter<acc_t> X{dq ? b.k : b.q, dq ? b.v : b.dop, d, C, b.u.cw};  // k ⊗ v' or q ⊗ dO'
  acc_t* st = lin_v2::state<kSmem>(w, 2);
  lin_v2::masked_scan(b.u, X, dq == (b.blk.dir == 1), k, st, st + int64_t(b.u.W) * b.u.m);
}

// Backward prefix-sum gradients: as polyline_linear_attention_bwd_mask_kernel, 5 buffers per block.
template <typename acc_t, bool kSmem>
__global__ void __launch_bounds__(kLinV2MaxThreads, 1)
    polyline_linear_attention_v2_bwd_mask_kernel(LinearAttnWork<acc_t> w) {
  const LinBwdUnit<acc_t> b = lin_bwd_unit(w, 1);
  const int d = b.u.d, C = b.u.C;
  const int64_t N = int64_t(b.u.H) * b.u.W, BG = int64_t(w.sz.B) * w.sz.G;
  acc_t* gcr = w.gc_part + b.part + b.blk.bg * N;
  acc_t* gcc = gcr + 2 * w.S * BG * N;
  const bool v2h = b.blk.dir == 0;  // (A, B) = (q ⊗ dO', k ⊗ v') for V2H, swapped for H2V
  const LinOuter<acc_t> A{v2h ? b.q : b.k, v2h ? b.dop : b.v, d, C, b.u.cw};
  const LinOuter<acc_t> B{v2h ? b.k : b.q, v2h ? b.v : b.dop, d, C, b.u.cw};
  acc_t* st = lin_v2::state<kSmem>(w, kLinV2BwdBuffers);
  const int64_t buf = int64_t(b.u.W) * b.u.m;
  lin_v2::mask_grads(b.u, A, B, gcr, gcc, st, st + buf, st + 2 * buf, st + 3 * buf, st + 4 * buf);
}

// ---------------------------------------------------------------------------------------------
// Host side (no torch)
// ---------------------------------------------------------------------------------------------

// The work buffers of polyline_linear_attention_workspace for the next kernels (w.sz and C
// set; slices from the plan): the state only where a kernel keeps it in global scratch (one region that the
// backward's scan and mask kernels use in turn, as in the verified kernels), the prefix-sum partials over the mask
// kernel's slices. Sets w.cs, w.S (the forward's or the backward scans' slices) and w.state_stride (one buffer of
// the scans).
template <typename acc_t>
inline int64_t polyline_linear_attention_v2_workspace(LinearAttnWork<acc_t>& w, bool backward, const LinV2Plan& pl,
                                                      acc_t* base) {
  w.cs = pl.cs;
  w.S = (w.C + w.cs - 1) / w.cs;
  const int S_mask = backward ? (w.C + pl.cs_mask - 1) / pl.cs_mask : 0;
  const int64_t N = int64_t(w.sz.H) * w.sz.W, BG = int64_t(w.sz.B) * w.sz.G, d = w.sz.d, C = w.C;
  int64_t off = 0;
  auto take = [&](int64_t n) {
    acc_t* ptr = base ? base + off : nullptr;
    off += n;
    return ptr;
  };
  w.q = take(BG * N * d);
  w.k = take(BG * N * d);
  w.v = take(BG * N * C);
  w.ea = take(BG * N);
  w.eb = take(BG * N);
  w.state_stride = int64_t(w.sz.W) * d * w.cs;
  // scans: 2 buffers per block, (backward: 2 tasks per unit); mask kernel: 5 buffers per unit of its slices
  const int64_t scans = pl.smem ? 0 : BG * 2 * w.S * (backward ? 2 : 1) * kLinV2FwdBuffers * w.state_stride;
  const int64_t mask =
      backward && !pl.smem_mask ? BG * 2 * S_mask * kLinV2BwdBuffers * int64_t(w.sz.W) * d * pl.cs_mask : 0;
  const int64_t state = std::max(scans, mask);
  w.state = state ? take(state) : nullptr;
  if (backward) {
    w.dop = take(2 * BG * N * C);
    w.dq_part = take(2 * w.S * BG * N * d);
    w.dk_part = take(2 * w.S * BG * N * d);
    w.dv_part = take(2 * BG * N * C);
    w.gc_part = take(4 * S_mask * BG * N);
    w.gc_sum = take(2 * BG * N);
  }
  return off;
}

// Forward: p.w laid out by polyline_linear_attention_v2_workspace(.., false, pl, ..), p.w.stats the statistics
// output.
template <typename scalar_t, typename acc_t>
inline void launch_polyline_linear_attention_v2_fwd(const LinearAttnParams<scalar_t, acc_t>& p, const LinV2Plan& pl,
                                                    cudaStream_t stream) {
  const GridSizes& sz = p.w.sz;
  const int64_t units = polyline_linear_attention_blocks(sz, p.w.C, p.w.cs, false);
  const int64_t bytes = int64_t(kLinV2FwdBuffers) * sz.W * sz.d * p.w.cs * int64_t(sizeof(acc_t));
  const int threads = polyline_linear_attention_v2_threads(int64_t(sz.d) * p.w.cs);
  launch_per_token(polyline_linear_attention_pack_kernel<scalar_t, acc_t>, p, stream);
  if (pl.smem) {
    allow_dynamic_smem(polyline_linear_attention_v2_fwd_kernel<acc_t, true>, size_t(bytes));
    launch_kernel(polyline_linear_attention_v2_fwd_kernel<acc_t, true>, dim3(unsigned(units)), dim3(threads),
                  size_t(bytes), stream, p.w);
  } else {
    launch_kernel(polyline_linear_attention_v2_fwd_kernel<acc_t, false>, dim3(unsigned(units)), dim3(threads), 0,
                  stream, p.w);
  }
  launch_per_token(polyline_linear_attention_finish_kernel<scalar_t, acc_t>, p, stream);
}

// Backward: p.w laid out by polyline_linear_attention_v2_workspace(.., true, pl, ..), p.w.stats the forward's
// statistics (contiguous), p.dout set. The mask kernel sees the work buffers with its own slices.
template <typename scalar_t, typename acc_t>
inline void launch_polyline_linear_attention_v2_bwd(const LinearAttnParams<scalar_t, acc_t>& p, const LinV2Plan& pl,
                                                    cudaStream_t stream) {
  const GridSizes& sz = p.w.sz;
  const int64_t units = polyline_linear_attention_blocks(sz, p.w.C, p.w.cs, false);
  LinearAttnWork<acc_t> wm = p.w;
  wm.cs = pl.cs_mask;
  wm.S = (wm.C + wm.cs - 1) / wm.cs;
  wm.state_stride = int64_t(sz.W) * sz.d * wm.cs;
  const int64_t mask_units = polyline_linear_attention_blocks(sz, wm.C, wm.cs, false);
  const int64_t scan_bytes = int64_t(kLinV2FwdBuffers) * sz.W * sz.d * p.w.cs * int64_t(sizeof(acc_t));
  const int64_t mask_bytes = int64_t(kLinV2BwdBuffers) * sz.W * sz.d * wm.cs * int64_t(sizeof(acc_t));
  launch_per_token(polyline_linear_attention_pack_kernel<scalar_t, acc_t>, p, stream);
  const dim3 scan_grid = dim3(unsigned(2 * units));
  const dim3 scan_block = dim3(unsigned(polyline_linear_attention_v2_threads(int64_t(sz.d) * p.w.cs)));
  if (pl.smem) {
    allow_dynamic_smem(polyline_linear_attention_v2_bwd_scan_kernel<acc_t, true>, size_t(scan_bytes));
    launch_kernel(polyline_linear_attention_v2_bwd_scan_kernel<acc_t, true>, scan_grid, scan_block,
                  size_t(scan_bytes), stream, p.w);
  } else {
    launch_kernel(polyline_linear_attention_v2_bwd_scan_kernel<acc_t, false>, scan_grid, scan_block, 0, stream, p.w);
  }
  const dim3 mask_grid = dim3(unsigned(mask_units));
  const dim3 mask_block = dim3(unsigned(polyline_linear_attention_v2_threads(int64_t(sz.d) * wm.cs)));
  if (pl.smem_mask) {
    allow_dynamic_smem(polyline_linear_attention_v2_bwd_mask_kernel<acc_t, true>, size_t(mask_bytes));
    launch_kernel(polyline_linear_attention_v2_bwd_mask_kernel<acc_t, true>, mask_grid, mask_block,
                  size_t(mask_bytes), stream, wm);
  } else {
    launch_kernel(polyline_linear_attention_v2_bwd_mask_kernel<acc_t, false>, mask_grid, mask_block, 0, stream, wm);
  }
  const int64_t tokens = int64_t(sz.B) * sz.G * sz.H * sz.W;
  launch_kernel(polyline_linear_attention_reduce_kernel<scalar_t, acc_t>, dim3(unsigned((tokens + 127) / 128)),
                dim3(128), 0, stream, p, int(wm.S));
  DecayGradParams<acc_t> dg;  // as launch_polyline_linear_attention_bwd
  dg.sz = sz;
  dg.own_r[0] = p.w.gc_sum;
  dg.own_c[0] = p.w.gc_sum + int64_t(sz.B) * sz.G * sz.H * sz.W;
  dg.tile_bm = sz.W;
  dg.g_log_alpha = p.g_log_alpha;
  dg.g_log_beta = p.g_log_beta;
  const int64_t lines = int64_t(sz.B) * sz.G * (sz.H + sz.W);
  launch_kernel(decay_grad_kernel<acc_t>, dim3(unsigned((lines + 127) / 128)), dim3(128), 0, stream, dg);
}

}  // namespace ppma
