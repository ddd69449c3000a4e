// polyline_linear_attention (PPMLA, docs/model.md §2 Theorem 3 and A.7; docs/ops.md "polyline_linear_attention") and its
// backward on CUDA: the scan form of the CPU kernel (csrc/cpu/polyline_linear_attention.cpp, whose header states
// the math), parallelised over channel slices.
//
// With v' = [v, 1] (C channels) and X_s = k_s ⊗ v'_s, each direction's term is q_p^T (L X)_p, linear in the channels
// of v'. So the C channels are split into S slices of at most kLinearMaxSlice, and one block runs one unit
// (b * heads + g, direction, slice): the CPU kernel's recurrences over the rows (two passes, the top-down inclusive
// and bottom-up exclusive halves of the column recurrence), with the state of one row, W x d x (slice width), in a
// global scratch region of its own (shared memory would hold it only for small maps; the region stays in L1/L2).
// Threads run over the state elements: a column step is elementwise, a row product runs each element's recurrences
// along the row (sequential over the columns, parallel over d x slice), and the contractions with the token's
// vectors give one thread per output element. Every output element of a unit is
// written by one thread, first in the top-down pass (=) and then in the bottom-up pass (+=).
//
// What sums over channels is partial per slice: dq, dk (sums over v' channels) and the prefix-sum gradients (inner
// products over the d x C state) are written per (direction, slice) and summed in a fixed order by the last kernels,
// so the results are deterministic (no atomics) and independent of the launch. The normalisation (division by the
// denominator channel), the statistics and dO' are token-local kernels; the log-decay gradients are the reverse
// cumsums of decay_grad_kernel (common.cuh).
//
// Kernels, in launch order (launch_polyline_linear_attention_fwd / _bwd below; scratch: the work buffers of
// LinearAttnWork, laid out by polyline_linear_attention_workspace):
//   forward:  pack (q, k, v', decay multipliers) -> scan (stats <- unnormalised terms) -> finish (out, stats)
//   backward: pack (+ dO') -> bwd scan (two tasks per unit: dq; dk, dv') -> bwd mask (prefix-sum gradients) ->
//             reduce (dq, dk, dv, summed prefix-sum gradients) -> decay_grad_kernel
// Accumulation in fp32 (fp64 for fp64 inputs).
#pragma once

#include "common.cuh"

namespace ppma {

constexpr int kLinearThreads = 256;
constexpr int kLinearMaxSlice = 32;

// Slice width for C channels: the fewest slices of at most kLinearMaxSlice, balanced (C = 33: 17 + 16).
inline int polyline_linear_attention_slice(int C) {
  const int S = (C + kLinearMaxSlice - 1) / kLinearMaxSlice;
  return (C + S - 1) / S;
}

// One (b * heads + g, slice) unit as its block sees it: the grid, the slice [c0, c0 + cw) of the C channels, the
// m = d * cw state elements of one token (element e = r * cw + c) and the decay multipliers of its (b, head).
template <typename acc_t>
struct LinUnit {
  int H, W, d, C;
  int c0, cw, m;
  const acc_t* ea;  // [N]: multiplier on the edge (i, j-1)-(i, j) (never read at column 0)
  const acc_t* eb;  // [N]: multiplier on the edge (i-1, j)-(i, j) (never read at row 0)
};

// The slice of the per-token rank-1 matrices x_p ⊗ y_p: x [N][d], y [N][C] (pointer at channel c0).
template <typename acc_t>
struct LinOuter {
  const acc_t* x;
  const acc_t* y;
  int d, C, cw;
  PPMA_HD acc_t operator()(int64_t p, int e) const { return x[p * d + e / cw] * y[p * C + e % cw]; }
};

// What a pass does with S_p (its slice, d x cw) at token p: out_a[p][c] = sum_r a_p[r] S_p[r][c] (a [N][d], out_a at
// channel c0, token stride oas) and/or out_b[p][r] = sum_c S_p[r][c] b_p[c] (b [N][C] at channel c0, token stride
// obs).
template <typename acc_t>
struct LinContract {
  const acc_t* a = nullptr;
  acc_t* out_a = nullptr;
  int64_t oas = 0;
  const acc_t* b = nullptr;
  acc_t* out_b = nullptr;
  int64_t obs = 0;
};

template <typename acc_t>
PPMA_D void block_fill(acc_t* x, int64_t n) {
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) x[t] = acc_t(0);
}

// Row i of the two-sided row product of Z (z(j, e): element e of Z at column j): D_j = f_j + g_j (= sum_l
// Lrow(j, l) Z_l) and/or E_j = f_j - Z_j - g_j, with f_j = ea_j f_{j-1} + Z_j and g_j = ea_{j+1} (g_{j+1} + Z_{j+1}).
// D, E: [W][m] (either may be null). Each thread runs the recurrences of its elements.
template <typename acc_t, typename Z>
PPMA_D void row_product(const LinUnit<acc_t>& u, int i, const Z& z, acc_t* D, acc_t* E) {
  const int W = u.W, m = u.m;
  const acc_t* ea = u.ea + int64_t(i) * W;
  for (int e = threadIdx.x; e < m; e += blockDim.x) {
    acc_t f = 0;
    for (int j = 0; j < W; ++j) {
      const acc_t strict = j == 0 ? acc_t(0) : ea[j] * f;  // f_j - Z_j
      f = strict + z(j, e);
      if (D) D[int64_t(j) * m + e] = f;
      if (E) E[int64_t(j) * m + e] = strict;
    }
    acc_t g = 0;
    for (int j = W - 1; j >= 1; --j) {
      g = ea[j] * (g + z(j, e));  // g_{j-1}
      if (D) D[int64_t(j - 1) * m + e] += g;
      if (E) E[int64_t(j - 1) * m + e] -= g;
    }
  }
}

// One step of a one-sided column recurrence at row i for every column l: col_l = s col_l + U_l (top-down,
// inclusive) or col_l = s (col_l + U_l) (bottom-up, exclusive), s the row's eb (0 on row 0); u(l, e) reads U.
template <typename acc_t, typename U>
PPMA_D void column_step(const LinUnit<acc_t>& u, int i, acc_t* col, const U& src, bool decay_after) {
  const int m = u.m;
  const int64_t n = int64_t(u.W) * m;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const int l = int(t / m), e = int(t % m);
    const acc_t s = i == 0 ? acc_t(0) : u.eb[int64_t(i) * u.W + l];
    col[t] = decay_after ? s * (col[t] + src(l, e)) : s * col[t] + src(l, e);
  }
}

// The contractions of LinContract for the tokens of row i, S: [W][m] (S_j of token (i, j)); first: assign.
template <typename acc_t>
PPMA_D void contract_row(const LinUnit<acc_t>& u, int i, const acc_t* S, const LinContract<acc_t>& k, bool first) {
  const int W = u.W, d = u.d, cw = u.cw, m = u.m;
  const int64_t p0 = int64_t(i) * W;
  if (k.a) {
    for (int t = threadIdx.x; t < W * cw; t += blockDim.x) {
      const int j = t / cw, c = t % cw;
      const acc_t* Sj = S + int64_t(j) * m + c;
      const acc_t* ap = k.a + (p0 + j) * d;
      acc_t s = 0;
      for (int r = 0; r < d; ++r) s += ap[r] * Sj[r * cw];
      acc_t& o = k.out_a[(p0 + j) * k.oas + c];
      o = first ? s : o + s;
    }
  }
  if (k.b) {
    for (int t = threadIdx.x; t < W * d; t += blockDim.x) {
      const int j = t / d, r = t % d;
      const acc_t* Sj = S + int64_t(j) * m + r * cw;
      const acc_t* bp = k.b + (p0 + j) * u.C;
      acc_t s = 0;
      for (int c = 0; c < cw; ++c) s += Sj[c] * bp[c];
      acc_t& o = k.out_b[(p0 + j) * k.obs + r];
      o = first ? s : o + s;
    }
  }
}

// For every token p: S_p = sum_s Lm[p, s] X_s (the slice), Lm = L (transpose = false: V2H, columns then rows) or
// L^T (true: H2V, rows then columns), contracted as k says. Two passes over the rows, one per one-sided half of the
// column recurrence; col and row: [W][m] each.
template <typename acc_t>
PPMA_D void masked_scan(const LinUnit<acc_t>& u, const LinOuter<acc_t>& X, bool transpose, const LinContract<acc_t>& k,
                        acc_t* col, acc_t* row) {
  const int H = u.H, W = u.W, m = u.m;
  auto col_at = [&](int l, int e) { return col[int64_t(l) * m + e]; };
  auto row_at = [&](int l, int e) { return row[int64_t(l) * m + e]; };
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    block_fill(col, int64_t(W) * m);
    __syncthreads();
    for (int step = 0; step < H; ++step) {
      const int i = down ? step : H - 1 - step;
      auto x_at = [&](int l, int e) { return X(int64_t(i) * W + l, e); };
      if (!transpose) {
        if (down) {  // F_i = eb_i F_{i-1} + X_i, then the row product of F_i
          column_step(u, i, col, x_at, false);
          __syncthreads();
          row_product(u, i, col_at, row, static_cast<acc_t*>(nullptr));
          __syncthreads();
          contract_row(u, i, row, k, true);
          __syncthreads();
        } else {  // the row product of G_i, then G_{i-1} = eb_i (G_i + X_i)
          if (i < H - 1) {
            row_product(u, i, col_at, row, static_cast<acc_t*>(nullptr));
            __syncthreads();
            contract_row(u, i, row, k, false);
            __syncthreads();
          }
          if (i > 0) {
            column_step(u, i, col, x_at, true);
            __syncthreads();
          }
        }
      } else {
        if (down) {  // F_i = eb_i F_{i-1} + R_i, R_i the row product of X_i
          row_product(u, i, x_at, row, static_cast<acc_t*>(nullptr));
          __syncthreads();
          column_step(u, i, col, row_at, false);
          __syncthreads();
          contract_row(u, i, col, k, true);
          __syncthreads();
        } else {
          if (i < H - 1) {
            contract_row(u, i, col, k, false);
            __syncthreads();
          }
          if (i > 0) {
            row_product(u, i, x_at, row, static_cast<acc_t*>(nullptr));
            __syncthreads();
            column_step(u, i, col, row_at, true);
            __syncthreads();
          }
        }
      }
    }
  }
}

// Per-token inner products over the m state elements of row i's tokens: one warp per token, lanes over the elements,
// a fixed butterfly; term(l, e) is the summand of token (i, l); lane 0 stores (first: =, else +=) sign * sum.
template <typename acc_t, typename Term>
PPMA_D void row_dots(const LinUnit<acc_t>& u, int i, const Term& term, acc_t* out, acc_t sign, bool first) {
  const int lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  for (int l = threadIdx.x / 32; l < u.W; l += nwarps) {
    acc_t s = 0;
    for (int e = lane; e < u.m; e += 32) s += term(l, e);
    s = group_sum<32>(s);
    if (lane == 0) {
      acc_t& o = out[int64_t(i) * u.W + l];
      o = first ? sign * s : o + sign * s;
    }
  }
}

// The slice's share of the gradients of sum_{p,s} L[p, s] <A_p, B_s> (L the V2H mask) w.r.t. the row and column
// prefix sums, into gcr, gcc [N] (mask_grads of the CPU kernel, whose header derives it). With D = L^H A (row-local)
// and F, G the top-down inclusive and bottom-up exclusive column halves: column terms <D_l, F(B)_l - B_l> +
// <B_l, F(D)_l - D_l> (top-down pass) and -<D_l, G(B)_l> - <B_l, G(D)_l> (bottom-up pass); row terms
// <A_j, E(Z)_j> + <Z_j, E(A)_j>, Z = the pass's column half of B and E the strict row product f - Z - g. Buffers
// colB, colD, D, E: [W][m]; E(Z) goes into D once D is consumed.
template <typename acc_t>
PPMA_D void mask_grads(const LinUnit<acc_t>& u, const LinOuter<acc_t>& A, const LinOuter<acc_t>& B, acc_t* gcr,
                       acc_t* gcc, acc_t* colB, acc_t* colD, acc_t* D, acc_t* E) {
  const int H = u.H, W = u.W, m = u.m;
  auto at = [m](const acc_t* buf) { return [buf, m](int l, int e) { return buf[int64_t(l) * m + e]; }; };
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    block_fill(colB, int64_t(W) * m);
    block_fill(colD, int64_t(W) * m);
    __syncthreads();
    for (int step = 0; step < H; ++step) {
      const int i = down ? step : H - 1 - step;
      const int64_t p0 = int64_t(i) * W;
      auto a_at = [&](int l, int e) { return A(p0 + l, e); };
      auto b_at = [&](int l, int e) { return B(p0 + l, e); };
      row_product(u, i, a_at, D, E);
      __syncthreads();
      if (down) {
        column_step(u, i, colB, b_at, false);
        column_step(u, i, colD, at(D), false);
        __syncthreads();
      }
      // <D, F(B) - B> + <B, F(D) - D>  or  -(<D, G(B)> + <B, G(D)>)
      const acc_t two = down ? acc_t(2) : acc_t(0);
      row_dots(
          u, i,
          [&](int l, int e) {
            const int64_t x = int64_t(l) * m + e;
            const acc_t bb = B(p0 + l, e);
            return colB[x] * D[x] + (colD[x] - two * D[x]) * bb;
          },
          gcc, down ? acc_t(1) : acc_t(-1), down);
      __syncthreads();
      if (!down && i > 0) {
        column_step(u, i, colD, at(D), true);
        __syncthreads();
      }
      row_product(u, i, at(colB), static_cast<acc_t*>(nullptr), D);  // Q = E(Z) into D
      __syncthreads();
      row_dots(
          u, i,
          [&](int l, int e) {
            const int64_t x = int64_t(l) * m + e;
            return D[x] * A(p0 + l, e) + colB[x] * E[x];
          },
          gcr, acc_t(1), down);
      __syncthreads();
      if (!down && i > 0) {
        column_step(u, i, colB, b_at, true);
        __syncthreads();
      }
    }
  }
}

// Block -> unit: blockIdx.x = ((bg * 2 + dir) * S + slice) * tasks + task.
struct LinBlock {
  int64_t bg, unit;
  int dir, slice, task;
};

PPMA_D LinBlock lin_block(int S, int tasks) {
  LinBlock k;
  k.task = int(blockIdx.x % tasks);
  k.unit = int64_t(blockIdx.x) / tasks;
  k.slice = int(k.unit % S);
  k.dir = int((k.unit / S) % 2);
  k.bg = k.unit / (2 * int64_t(S));
  return k;
}

template <typename acc_t>
PPMA_D LinUnit<acc_t> lin_unit(const LinearAttnWork<acc_t>& w, int64_t bg, int slice) {
  const int64_t N = int64_t(w.sz.H) * w.sz.W;
  LinUnit<acc_t> u;
  u.H = w.sz.H;
  u.W = w.sz.W;
  u.d = w.sz.d;
  u.C = w.C;
  u.c0 = slice * w.cs;
  u.cw = min(w.cs, w.C - u.c0);
  u.m = u.d * u.cw;
  u.ea = w.ea + bg * N;
  u.eb = w.eb + bg * N;
  return u;
}

// ---------------------------------------------------------------------------------------------
// Token-local kernels: one thread per (bg, token)
// ---------------------------------------------------------------------------------------------

// Packs q, k, v' = [v, 1] (without normalisation: v) and the decay multipliers exp(floored log-decay) into the
// heads-major work buffers; with dout set, also dO' from grad_out and the saved statistics:
//   normalize: dO'_dir = (0.5 dO / den_dir, -0.5 <dO, o_dir> / den_dir); otherwise dO'_dir = 0.5 dO.
template <typename scalar_t, typename acc_t>
__global__ void polyline_linear_attention_pack_kernel(LinearAttnParams<scalar_t, acc_t> p) {
  const LinearAttnWork<acc_t>& w = p.w;
  const int H = w.sz.H, W = w.sz.W, G = w.sz.G, d = w.sz.d, dv = w.sz.dv, C = w.C;
  const int64_t N = int64_t(H) * W, BG = int64_t(w.sz.B) * G;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // bg * N + token
  if (t >= BG * N) return;
  const int64_t bg = t / N, tok = t % N;
  const int b = int(bg / G), g = int(bg % G), i = int(tok / W), j = int(tok % W);
  auto at = [&](const Strides4& s) { return b * s.b + i * s.h + j * s.w + g * s.g; };
  const scalar_t* qs = p.q + at(p.sq);
  const scalar_t* ks = p.k + at(p.sk);
  const scalar_t* vs = p.v + at(p.sv);
  for (int r = 0; r < d; ++r) {
    w.q[t * d + r] = to_acc(qs[r]);
    w.k[t * d + r] = to_acc(ks[r]);
  }
  for (int c = 0; c < C; ++c) w.v[t * C + c] = c < dv ? acc_t(to_acc(vs[c])) : acc_t(1);
  w.ea[t] = fast_exp(floor_log_decay(p.log_alpha[at(p.sa)]));
  w.eb[t] = fast_exp(floor_log_decay(p.log_beta[at(p.sb)]));
  if (!p.dout) return;
  const scalar_t* go = p.dout + at(p.sdo);
  const acc_t* st = w.stats + token_index(N, G, b, tok, g) * 2 * C;
  for (int dir = 0; dir < 2; ++dir) {
    acc_t* o = w.dop + ((dir * BG + bg) * N + tok) * C;
    if (p.normalize) {
      const acc_t den = st[dir * C + dv];
      acc_t s = 0;
      for (int c = 0; c < dv; ++c) {
        const acc_t gc = to_acc(go[c]);
        o[c] = gc * acc_t(0.5) / den;
        s += gc * st[dir * C + c];
      }
      o[dv] = s * acc_t(-0.5) / den;
    } else {
      for (int c = 0; c < dv; ++c) o[c] = acc_t(to_acc(go[c])) * acc_t(0.5);
    }
  }
}

// stats hold each direction's unnormalised terms; with normalisation they become (term / den, den), den = the
// denominator channel + eps; out = the mean of the two directions, one thread per token of [B, H, W, heads].
template <typename scalar_t, typename acc_t>
__global__ void polyline_linear_attention_finish_kernel(LinearAttnParams<scalar_t, acc_t> p) {
  const LinearAttnWork<acc_t>& w = p.w;
  const int dv = w.sz.dv, C = w.C;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // token_index order
  if (t >= int64_t(w.sz.B) * w.sz.H * w.sz.W * w.sz.G) return;
  acc_t* st = w.stats + t * 2 * C;
  if (p.normalize) {
    for (int dir = 0; dir < 2; ++dir) {
      acc_t* s = st + dir * C;
      const acc_t den = s[dv] + p.eps;
      for (int c = 0; c < dv; ++c) s[c] = s[c] / den;
      s[dv] = den;
    }
  }
  for (int c = 0; c < dv; ++c) p.out[t * dv + c] = from_acc<scalar_t>((st[c] + st[C + c]) * acc_t(0.5));
}

// The backward's partial sums, in a fixed order: dq, dk over (direction, slice), dv' over the directions, and the
// prefix-sum gradients over (direction, mask slice) into gc_sum ([2][2][S_mask][BG][N]: S_mask = w.S here, the
// decay-gradient kernel's own slices in the next kernels of polyline_linear_attention_v2.cuh). One thread per
// (bg, token).
template <typename scalar_t, typename acc_t>
__global__ void polyline_linear_attention_reduce_kernel(LinearAttnParams<scalar_t, acc_t> p, int S_mask) {
  const LinearAttnWork<acc_t>& w = p.w;
  const int G = w.sz.G, d = w.sz.d, dv = w.sz.dv, C = w.C, S = w.S;
  const int64_t N = int64_t(w.sz.H) * w.sz.W, BG = int64_t(w.sz.B) * G;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // bg * N + token
  if (t >= BG * N) return;
  const int64_t bg = t / N, tok = t % N;
  const int64_t out = token_index(N, G, bg / G, tok, bg % G);
  const int64_t part = BG * N;  // elements (tokens) per (direction, slice)
  for (int r = 0; r < d; ++r) {
    acc_t sq = 0, sk = 0;
    for (int u = 0; u < 2 * S; ++u) {
      sq += w.dq_part[(u * part + t) * d + r];
      sk += w.dk_part[(u * part + t) * d + r];
    }
    p.dq[out * d + r] = from_acc<scalar_t>(sq);
    p.dk[out * d + r] = from_acc<scalar_t>(sk);
  }
  for (int c = 0; c < dv; ++c)
    p.dv[out * dv + c] = from_acc<scalar_t>(w.dv_part[t * C + c] + w.dv_part[(part + t) * C + c]);
  for (int rc = 0; rc < 2; ++rc) {
    acc_t s = 0;
    for (int u = 0; u < 2 * S_mask; ++u) s += w.gc_part[(rc * 2 * S_mask + u) * part + t];
    w.gc_sum[rc * part + t] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// The scans: one block per unit (forward) or per (unit, task) (backward)
// ---------------------------------------------------------------------------------------------

// Forward: direction dir's unnormalised terms q_p^T (Lm X)_p of the slice's channels, into stats[..., dir, c].
template <typename acc_t>
__global__ void __launch_bounds__(kLinearThreads) polyline_linear_attention_fwd_kernel(LinearAttnWork<acc_t> w) {
  const LinBlock blk = lin_block(w.S, 1);
  const LinUnit<acc_t> u = lin_unit(w, blk.bg, blk.slice);
  const int G = w.sz.G, d = u.d, C = u.C;
  const int64_t N = int64_t(u.H) * u.W, b = blk.bg / G, g = blk.bg % G;
  const LinOuter<acc_t> X{w.k + blk.bg * N * d, w.v + blk.bg * N * C + u.c0, d, C, u.cw};
  LinContract<acc_t> k;
  k.a = w.q + blk.bg * N * d;
  k.out_a = w.stats + token_index(N, G, b, 0, g) * 2 * C + blk.dir * C + u.c0;
  k.oas = int64_t(G) * 2 * C;
  acc_t* st = w.state + blk.unit * w.state_stride;
  masked_scan(u, X, blk.dir == 1, k, st, st + int64_t(u.W) * d * w.cs);
}

// Backward, per unit (bg, dir, slice), with X = k ⊗ v', Y = q ⊗ dO'dir and Lm = L (V2H) or L^T (H2V):
//   dq_p  += (Lm X)_p dO'dir_p                              (scan kernel, task 0)
//   dk_s  += (Lm^T Y)_s v'_s, dv'_s += (Lm^T Y)_s^T k_s      (scan kernel, task 1)
//   the prefix-sum gradients of sum L[p, s] <A_p, B_s>, (A, B) = (Y, X) for V2H and (X, Y) for H2V (mask kernel).
// Two kernels rather than one with three tasks: each fits the register file without spills. State buffers of a
// unit: [0, 2) task 0, [2, 4) task 1; the mask kernel, which runs after the scan kernel on the same stream, reuses
// [0, 4).
template <typename acc_t>
struct LinBwdUnit {
  LinBlock blk;
  LinUnit<acc_t> u;
  const acc_t* q;    // [N][d] of the unit's (b, head)
  const acc_t* k;
  const acc_t* v;    // v' [N][C] at the slice
  const acc_t* dop;  // dO' of the unit's direction [N][C] at the slice
  int64_t part;      // token offset of the unit's (direction, slice) in the partial sums
  acc_t* st;         // its state buffers, `buf` elements each
  int64_t buf;
};

template <typename acc_t>
PPMA_D LinBwdUnit<acc_t> lin_bwd_unit(const LinearAttnWork<acc_t>& w, int tasks) {
  LinBwdUnit<acc_t> r;
  r.blk = lin_block(w.S, tasks);
  r.u = lin_unit(w, r.blk.bg, r.blk.slice);
  const int d = r.u.d, C = r.u.C;
  const int64_t N = int64_t(r.u.H) * r.u.W, BG = int64_t(w.sz.B) * w.sz.G, bg = r.blk.bg;
  r.q = w.q + bg * N * d;
  r.k = w.k + bg * N * d;
  r.v = w.v + bg * N * C + r.u.c0;
  r.dop = w.dop + (r.blk.dir * BG + bg) * N * C + r.u.c0;
  r.part = (int64_t(r.blk.dir) * w.S + r.blk.slice) * BG * N;
  r.buf = int64_t(r.u.W) * d * w.cs;
  r.st = w.state + r.blk.unit * w.state_stride;
  return r;
}

// (The operands are built from selected pointers, not by selecting between two LinOuter objects: a runtime choice
// between two structs would put both in local memory.)
template <typename acc_t>
__global__ void __launch_bounds__(kLinearThreads) polyline_linear_attention_bwd_scan_kernel(LinearAttnWork<acc_t> w) {
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
  acc_t* st = b.st + (dq ? 0 : 2) * b.buf;
  masked_scan(b.u, X, dq == (b.blk.dir == 1), k, st, st + b.buf);
}

// Minimum one block per SM: without it ptxas trades registers for occupancy and spills (119 registers for fp32, 168
// for fp64 on sm_90 instead).
template <typename acc_t>
__global__ void __launch_bounds__(kLinearThreads, 1)
    polyline_linear_attention_bwd_mask_kernel(LinearAttnWork<acc_t> w) {
  const LinBwdUnit<acc_t> b = lin_bwd_unit(w, 1);
  const int d = b.u.d, C = b.u.C;
  const int64_t N = int64_t(b.u.H) * b.u.W, BG = int64_t(w.sz.B) * w.sz.G;
  acc_t* gcr = w.gc_part + b.part + b.blk.bg * N;
  acc_t* gcc = gcr + 2 * w.S * BG * N;
  const bool v2h = b.blk.dir == 0;  // (A, B) = (q ⊗ dO', k ⊗ v') for V2H, swapped for H2V
  const LinOuter<acc_t> A{v2h ? b.q : b.k, v2h ? b.dop : b.v, d, C, b.u.cw};
  const LinOuter<acc_t> B{v2h ? b.k : b.q, v2h ? b.v : b.dop, d, C, b.u.cw};
  mask_grads(b.u, A, B, gcr, gcc, b.st, b.st + b.buf, b.st + 2 * b.buf, b.st + 3 * b.buf);
}

// ---------------------------------------------------------------------------------------------
// Host side (no torch)
// ---------------------------------------------------------------------------------------------

// Lays the work buffers of w (sizes and C, cs set) out from base (nullptr: only counts) and returns their total
// number of elements; the forward needs no dO' and no partial sums. State: 2 row buffers per unit (forward) or 4
// (backward: 2 + 2 for the scan kernel's tasks, then the mask kernel's 4).
template <typename acc_t>
inline int64_t polyline_linear_attention_workspace(LinearAttnWork<acc_t>& w, bool backward, acc_t* base) {
  w.S = (w.C + w.cs - 1) / w.cs;
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
  w.state_stride = (backward ? 4 : 2) * int64_t(w.sz.W) * d * w.cs;
  w.state = take(BG * 2 * w.S * w.state_stride);
  if (backward) {
    w.dop = take(2 * BG * N * C);
    w.dq_part = take(2 * w.S * BG * N * d);
    w.dk_part = take(2 * w.S * BG * N * d);
    w.dv_part = take(2 * BG * N * C);
    w.gc_part = take(4 * w.S * BG * N);
    w.gc_sum = take(2 * BG * N);
  }
  return off;
}

// Blocks of the largest scan kernel (the launchers check them against the grid limit): one per unit, two per unit
// for the backward's scan kernel.
inline int64_t polyline_linear_attention_blocks(const GridSizes& sz, int C, int cs, bool backward) {
  return int64_t(sz.B) * sz.G * 2 * ((C + cs - 1) / cs) * (backward ? 2 : 1);
}

// Launches a token-local kernel (pack, finish, reduce): 128 threads, one per (b * heads + g, token).
template <typename scalar_t, typename acc_t>
inline void launch_per_token(void (*kernel)(LinearAttnParams<scalar_t, acc_t>),
                             const LinearAttnParams<scalar_t, acc_t>& p, cudaStream_t stream) {
  const int64_t tokens = int64_t(p.w.sz.B) * p.w.sz.G * p.w.sz.H * p.w.sz.W;
  launch_kernel(kernel, dim3(unsigned((tokens + 127) / 128)), dim3(128), 0, stream, p);
}

// Forward: p.w laid out by polyline_linear_attention_workspace(.., false, ..), p.w.stats the statistics output.
template <typename scalar_t, typename acc_t>
inline void launch_polyline_linear_attention_fwd(const LinearAttnParams<scalar_t, acc_t>& p, cudaStream_t stream) {
  const int64_t units = polyline_linear_attention_blocks(p.w.sz, p.w.C, p.w.cs, false);
  launch_per_token(polyline_linear_attention_pack_kernel<scalar_t, acc_t>, p, stream);
  launch_kernel(polyline_linear_attention_fwd_kernel<acc_t>, dim3(unsigned(units)), dim3(kLinearThreads), 0, stream,
                p.w);
  launch_per_token(polyline_linear_attention_finish_kernel<scalar_t, acc_t>, p, stream);
}

// Backward: p.w laid out by polyline_linear_attention_workspace(.., true, ..), p.w.stats the forward's statistics
// (contiguous), p.dout set.
template <typename scalar_t, typename acc_t>
inline void launch_polyline_linear_attention_bwd(const LinearAttnParams<scalar_t, acc_t>& p, cudaStream_t stream) {
  const GridSizes& sz = p.w.sz;
  const int64_t units = polyline_linear_attention_blocks(sz, p.w.C, p.w.cs, false);
  launch_per_token(polyline_linear_attention_pack_kernel<scalar_t, acc_t>, p, stream);
  launch_kernel(polyline_linear_attention_bwd_scan_kernel<acc_t>, dim3(unsigned(2 * units)), dim3(kLinearThreads), 0,
                stream, p.w);
  launch_kernel(polyline_linear_attention_bwd_mask_kernel<acc_t>, dim3(unsigned(units)), dim3(kLinearThreads), 0,
                stream, p.w);
  const int64_t tokens = int64_t(sz.B) * sz.G * sz.H * sz.W;
  launch_kernel(polyline_linear_attention_reduce_kernel<scalar_t, acc_t>, dim3(unsigned((tokens + 127) / 128)),
                dim3(128), 0, stream, p, int(p.w.S));
  DecayGradParams<acc_t> dg;  // reverse cumsums of the summed prefix-sum gradients (no cross-term tables)
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
