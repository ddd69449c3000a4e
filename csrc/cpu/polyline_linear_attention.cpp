// CPU kernels of ppma::polyline_linear_attention (PPMLA, spec §2 Theorem 3 and A.7; docs/ops.md
// "polyline_linear_attention") and its backward: time O(N d C) and memory linear in N = H W.
//
// Scan form. With v' = [v, 1] (C = dv + 1 channels; C = dv without normalisation) and X_s = k_s ⊗ v'_s
// (d x C), ((A ⊙ L) v')_p = q_p^T (L X)_p: the first dv entries are the numerator, the last the
// denominator. L = L^H L^V (columns first, then rows; V2H) and L^T = L^V L^H (rows first; H2V), every 1-D factor
// the symmetric product of one line's decays, applied by the recurrences of polyline_scan. Per (batch, head)
// the column recurrence is split into its two one-sided halves (top-down inclusive, bottom-up exclusive), each
// one pass over the rows with a state of one row (W x d x C); the result is linear in them, so each pass
// contracts its share with q as it goes. The N x d x C state is never formed.
//
// Backward (all in the same scan primitive, T_L(x, y)_p = sum_s L[p, s] x_s ⊗ y_s contracted on either side):
//   dO'_p (C per token, per direction): 0.5 dO / (den + eps) and -0.5 <dO, o> / (den + eps)   (normalize)
//   dq_p  = T_L(k, v')_p dO'1_p + T_{L^T}(k, v')_p dO'2_p
//   dk_s  = T_{L^T}(q, dO'1)_s v'_s + T_L(q, dO'2)_s v'_s,  dv'_s = the same T^T k_s.
//   Log-decays through the prefix sums: the gradient of sum_{p,s} L[p, s] <A_p, B_s> (V2H: A = q ⊗ dO'1,
//   B = k ⊗ v'; H2V: A = k ⊗ v', B = q ⊗ dO'2, since <dY, L^T X> = <X, L dY>) w.r.t. the prefix sum c_t of a
//   line is sum_{u<t} (G_tu + G_ut) - sum_{u>t} (G_tu + G_ut) over the line's pairs (bias = c_max - c_min); each
//   of the four sums is a one-sided recurrence paired with a token-local quantity (mask_grads below), and the
//   log-decay gradients are their reverse cumsums (d_0 gets exactly 0).
// Every task writes only its own (batch, head) slice: deterministic and independent of the thread count.
// Accumulation in fp32 (fp64 for fp64 inputs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/checks.h"
#include "common/math.h"
#include "cpu/simd.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

// The decays of one (batch, head) grid, as multipliers: ea[p] = exp(log_alpha) on the edge (i, j-1)-(i, j),
// eb[p] = exp(log_beta) on the edge (i-1, j)-(i, j) (floored log-decays). ea at column 0 and eb at row 0 are
// never read.
template <typename T>
struct Grid {
  int64_t H, W;
  const T* ea;  // [N]
  const T* eb;  // [N]
};

// Per-token rank-1 matrices x_p ⊗ y_p (n1 x n2, row-major): x [N, n1], y [N, n2].
template <typename T>
struct Outer {
  const T* x;
  int64_t n1;
  const T* y;
  int64_t n2;
  int64_t size() const { return n1 * n2; }
};

// S = s * S + x ⊗ y
template <typename T>
inline void decay_add_outer(int64_t n1, int64_t n2, T s, const T* __restrict x, const T* __restrict y,
                            T* __restrict S) {
  for (int64_t r = 0; r < n1; ++r) {
    const T xr = x[r];
    T* Sr = S + r * n2;
#pragma omp simd
    for (int64_t c = 0; c < n2; ++c) Sr[c] = s * Sr[c] + xr * y[c];
  }
}

// S = s * (S + x ⊗ y)
template <typename T>
inline void add_outer_decay(int64_t n1, int64_t n2, T s, const T* __restrict x, const T* __restrict y,
                            T* __restrict S) {
  for (int64_t r = 0; r < n1; ++r) {
    const T xr = x[r];
    T* Sr = S + r * n2;
#pragma omp simd
    for (int64_t c = 0; c < n2; ++c) Sr[c] = s * (Sr[c] + xr * y[c]);
  }
}

// S = s * S + U
template <typename T>
inline void decay_add(int64_t m, T s, const T* __restrict U, T* __restrict S) {
#pragma omp simd
  for (int64_t e = 0; e < m; ++e) S[e] = s * S[e] + U[e];
}

// S = s * (S + U)
template <typename T>
inline void add_decay(int64_t m, T s, const T* __restrict U, T* __restrict S) {
#pragma omp simd
  for (int64_t e = 0; e < m; ++e) S[e] = s * (S[e] + U[e]);
}

// x^T S y
template <typename T>
inline T bilinear(int64_t n1, int64_t n2, const T* S, const T* x, const T* y) {
  T acc = 0;
  for (int64_t r = 0; r < n1; ++r) acc += x[r] * dot(n2, S + r * n2, y);
  return acc;
}

// What to do with S_p (n1 x n2) at token p: out_a[p] += S_p^T a_p (n2 values; a [N, n1]) and/or
// out_b[p] += S_p b_p (n1 values; b [N, n2]).
template <typename T>
struct Contract {
  int64_t n1, n2;
  const T* a = nullptr;
  T* out_a = nullptr;
  const T* b = nullptr;
  T* out_b = nullptr;

  void operator()(int64_t p, const T* S) const {
    if (a) {
      const T* ap = a + p * n1;
      T* op = out_a + p * n2;
      for (int64_t r = 0; r < n1; ++r) axpy(n2, ap[r], S + r * n2, op);
    }
    if (b) {
      const T* bp = b + p * n2;
      T* op = out_b + p * n1;
      for (int64_t r = 0; r < n1; ++r) op[r] += dot(n2, S + r * n2, bp);
    }
  }
};

// Per-thread scratch: four row buffers of W matrices and two single matrices.
template <typename T>
struct Scratch {
  std::vector<T> buf;
  T* row(int k, int64_t W, int64_t m) { return buf.data() + k * W * m; }
  T* one(int k, int64_t W, int64_t m) { return buf.data() + 4 * W * m + k * m; }
};

// The 1-D symmetric product along row i (decays ea) of the row of matrices Z [W, m], contracted at every token:
// forward f_j = ea_j f_{j-1} + Z_j (diagonal counted here), backward g_j = ea_{j+1} (g_{j+1} + Z_{j+1}).
template <typename T>
void row_scan_contract(const Grid<T>& g, int64_t i, int64_t m, const T* Z, const Contract<T>& contract, T* f) {
  const int64_t W = g.W;
  for (int64_t j = 0; j < W; ++j) {
    const int64_t p = i * W + j;
    if (j == 0)
      std::copy(Z, Z + m, f);
    else
      decay_add(m, g.ea[p], Z + j * m, f);
    contract(p, f);
  }
  std::fill(f, f + m, T(0));
  for (int64_t j = W - 1; j >= 1; --j) {
    const int64_t p = i * W + j;
    add_decay(m, g.ea[p], Z + j * m, f);  // now g_{j-1}
    contract(p - 1, f);
  }
}

// R [W, m] = the 1-D symmetric product along row i of the row of rank-1 matrices X.
template <typename T>
void row_scan(const Grid<T>& g, int64_t i, const Outer<T>& X, T* R, T* acc) {
  const int64_t W = g.W, m = X.size();
  for (int64_t j = 0; j < W; ++j) {
    const int64_t p = i * W + j;
    T* Rj = R + j * m;  // f_j = ea_j f_{j-1} + X_j
    if (j == 0)
      std::fill(Rj, Rj + m, T(0));
    else
      std::copy(Rj - m, Rj, Rj);
    decay_add_outer(X.n1, X.n2, j == 0 ? T(0) : g.ea[p], X.x + p * X.n1, X.y + p * X.n2, Rj);
  }
  std::fill(acc, acc + m, T(0));
  for (int64_t j = W - 1; j >= 1; --j) {
    const int64_t p = i * W + j;
    add_outer_decay(X.n1, X.n2, g.ea[p], X.x + p * X.n1, X.y + p * X.n2, acc);  // g_{j-1}
    axpy(m, T(1), acc, R + (j - 1) * m);
  }
}

// For every token p: S_p = sum_s Lm[p, s] X_s with Lm = L (transpose = false: V2H, columns then rows) or L^T
// (transpose = true: H2V, rows then columns); contract(p, S_p). Two passes over the rows, one per one-sided
// half of the column recurrence (S is linear in it).
template <typename T>
void masked_scan(const Grid<T>& g, const Outer<T>& X, bool transpose, const Contract<T>& contract, Scratch<T>& s) {
  const int64_t H = g.H, W = g.W, m = X.size();
  T* col = s.row(0, W, m);
  T* row = s.row(1, W, m);
  T* vec = s.one(0, W, m);
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    std::fill(col, col + W * m, T(0));
    for (int64_t step = 0; step < H; ++step) {
      const int64_t i = down ? step : H - 1 - step;
      if (!transpose) {
        if (down) {  // F_i = eb_i F_{i-1} + X_i, then the row product of F_i
          for (int64_t l = 0; l < W; ++l) {
            const int64_t p = i * W + l;
            decay_add_outer(X.n1, X.n2, i == 0 ? T(0) : g.eb[p], X.x + p * X.n1, X.y + p * X.n2, col + l * m);
          }
          row_scan_contract(g, i, m, col, contract, vec);
        } else {  // the row product of G_i, then G_{i-1} = eb_i (G_i + X_i)
          if (i < H - 1) row_scan_contract(g, i, m, col, contract, vec);
          if (i > 0) {
            for (int64_t l = 0; l < W; ++l) {
              const int64_t p = i * W + l;
              add_outer_decay(X.n1, X.n2, g.eb[p], X.x + p * X.n1, X.y + p * X.n2, col + l * m);
            }
          }
        }
      } else {
        if (down) {  // F_i = eb_i F_{i-1} + R_i with R_i the row product of X_i
          row_scan(g, i, X, row, vec);
          for (int64_t l = 0; l < W; ++l) {
            const int64_t p = i * W + l;
            decay_add(m, i == 0 ? T(0) : g.eb[p], row + l * m, col + l * m);
            contract(p, col + l * m);
          }
        } else {
          if (i < H - 1)
            for (int64_t l = 0; l < W; ++l) contract(i * W + l, col + l * m);
          if (i > 0) {
            row_scan(g, i, X, row, vec);
            for (int64_t l = 0; l < W; ++l) add_decay(m, g.eb[i * W + l], row + l * m, col + l * m);
          }
        }
      }
    }
  }
}

// Row i of the two-sided row product of A: D_j = f_j(A) + g_j(A) (= (L^H A)_j) and E_j = f_j(A) - A_j - g_j(A).
template <typename T>
void row_products(const Grid<T>& g, int64_t i, const Outer<T>& A, T* D, T* E, T* acc) {
  const int64_t W = g.W, m = A.size();
  for (int64_t j = 0; j < W; ++j) {
    const int64_t p = i * W + j;
    T* Dj = D + j * m;
    T* Ej = E + j * m;
    if (j == 0) {
      std::fill(Ej, Ej + m, T(0));
    } else {
      const T e = g.ea[p];
#pragma omp simd
      for (int64_t u = 0; u < m; ++u) Ej[u] = e * Dj[u - m];  // f_j - A_j
    }
    std::copy(Ej, Ej + m, Dj);
    decay_add_outer(A.n1, A.n2, T(1), A.x + p * A.n1, A.y + p * A.n2, Dj);  // f_j
  }
  std::fill(acc, acc + m, T(0));
  for (int64_t j = W - 1; j >= 1; --j) {
    const int64_t p = i * W + j;
    add_outer_decay(A.n1, A.n2, g.ea[p], A.x + p * A.n1, A.y + p * A.n2, acc);  // g_{j-1}
    axpy(m, T(1), acc, D + (j - 1) * m);
    axpy(m, T(-1), acc, E + (j - 1) * m);
  }
}

// Row-decay share of one pass: for the row Z of the column half at row i, grad c_j += <A_j, f_j(Z) - Z_j -
// g_j(Z)> + <Z_j, E_j>.
template <typename T>
void row_grads(const Grid<T>& g, int64_t i, const Outer<T>& A, const T* Z, const T* E, T* gcr, T* acc) {
  const int64_t W = g.W, m = A.size();
  for (int64_t j = 0; j < W; ++j) {
    const int64_t p = i * W + j;
    const T* Zj = Z + j * m;
    const T* ap = A.x + p * A.n1;
    const T* bp = A.y + p * A.n2;
    T strict = 0;  // <A_j, f_j - Z_j>
    if (j == 0) {
      std::copy(Zj, Zj + m, acc);
    } else {
      strict = g.ea[p] * bilinear(A.n1, A.n2, acc, ap, bp);
      decay_add(m, g.ea[p], Zj, acc);
    }
    gcr[p] += strict + dot(m, Zj, E + j * m);
  }
  std::fill(acc, acc + m, T(0));
  for (int64_t j = W - 1; j >= 1; --j) {
    const int64_t p = i * W + j;
    add_decay(m, g.ea[p], Z + j * m, acc);  // g_{j-1}
    gcr[p - 1] -= bilinear(A.n1, A.n2, acc, A.x + (p - 1) * A.n1, A.y + (p - 1) * A.n2);
  }
}

// Gradients of sum_{p,s} L[p, s] <A_p, B_s> (L the V2H mask) w.r.t. the row and column prefix sums, added to
// gcr, gcc [N]. Column l, rows i (query side) and k: G_ik = Lcol(i, k) <D_il, B_kl> with D = L^H A; row i,
// columns j and l: G_jl = Lrow(j, l) <A_ij, Z_il> with Z = L^V B. Two passes over the rows as in masked_scan
// (top-down: Z = the inclusive column half F(B); bottom-up: the exclusive half G(B)).
template <typename T>
void mask_grads(const Grid<T>& g, const Outer<T>& A, const Outer<T>& Bm, T* gcr, T* gcc, Scratch<T>& s) {
  const int64_t H = g.H, W = g.W, m = A.size();
  T* colB = s.row(0, W, m);
  T* colD = s.row(1, W, m);
  T* D = s.row(2, W, m);
  T* E = s.row(3, W, m);
  T* acc = s.one(0, W, m);
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    std::fill(colB, colB + W * m, T(0));
    std::fill(colD, colD + W * m, T(0));
    for (int64_t step = 0; step < H; ++step) {
      const int64_t i = down ? step : H - 1 - step;
      row_products(g, i, A, D, E, acc);
      for (int64_t l = 0; l < W; ++l) {
        const int64_t p = i * W + l;
        const T* bx = Bm.x + p * Bm.n1;
        const T* by = Bm.y + p * Bm.n2;
        T* cB = colB + l * m;
        T* cD = colD + l * m;
        const T* Dl = D + l * m;
        if (down) {
          const T e = i == 0 ? T(0) : g.eb[p];
          decay_add_outer(Bm.n1, Bm.n2, e, bx, by, cB);
          decay_add(m, e, Dl, cD);
          // <D, F(B) - B> + <B, F(D) - D>
          gcc[p] += dot(m, cB, Dl) + bilinear(Bm.n1, Bm.n2, cD, bx, by) - 2 * bilinear(Bm.n1, Bm.n2, Dl, bx, by);
        } else {
          gcc[p] -= dot(m, cB, Dl) + bilinear(Bm.n1, Bm.n2, cD, bx, by);  // <D, G(B)> + <B, G(D)>
        }
      }
      row_grads(g, i, A, colB, E, gcr, acc);
      if (!down && i > 0) {
        for (int64_t l = 0; l < W; ++l) {
          const int64_t p = i * W + l;
          add_outer_decay(Bm.n1, Bm.n2, g.eb[p], Bm.x + p * Bm.n1, Bm.y + p * Bm.n2, colB + l * m);
          add_decay(m, g.eb[p], D + l * m, colD + l * m);
        }
      }
    }
  }
}

constexpr const char* kOp = "polyline_linear_attention";
constexpr const char* kOpBwd = "polyline_linear_attention_backward";

// [B, H, W, heads, n] (any strides) -> contiguous [B * heads, N, n] in dtype acc.
at::Tensor heads_major(const at::Tensor& t, at::ScalarType acc) {
  return t.to(acc).permute({0, 3, 1, 2, 4}).contiguous().view({t.size(0) * t.size(3), t.size(1) * t.size(2), -1});
}

// exp of the floored log-decays (docs/ops.md "Edges"), [B * heads, N]; NaN stays NaN.
at::Tensor decay_factors(const at::Tensor& log_decay, at::ScalarType acc) {
  const at::Tensor d = log_decay.to(acc);
  const at::Tensor floored = at::where(d < -1e4, at::full({}, -1e4, d.options()), d);
  return floored.exp().permute({0, 3, 1, 2}).contiguous().view({d.size(0) * d.size(3), -1});
}

// [B * heads, N, n] -> [B, H, W, heads, n]
at::Tensor heads_last(const at::Tensor& t, int64_t B, int64_t H, int64_t W, int64_t G) {
  return t.view({B, G, H, W, t.size(-1)}).permute({0, 2, 3, 1, 4});
}

template <typename T>
Scratch<T> make_scratch(int64_t W, int64_t m) {
  return Scratch<T>{std::vector<T>(4 * W * m + 2 * m)};
}

std::tuple<at::Tensor, at::Tensor> polyline_linear_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, const at::Tensor& log_alpha,
                                                                 const at::Tensor& log_beta, bool normalize,
                                                                 double eps) {
  check_inputs(kOp, q, k, v, log_alpha, log_beta);
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), kOp, ": eps must be finite and >= 0, got ", eps);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const int64_t N = H * W, BG = B * G, C = dv + (normalize ? 1 : 0);
  const auto acc = acc_type(q);
  const at::Tensor qp = heads_major(q, acc), kp = heads_major(k, acc);
  at::Tensor vp = heads_major(v, acc);
  if (normalize) vp = at::cat({vp, at::ones({BG, N, 1}, vp.options())}, -1);
  const at::Tensor ea = decay_factors(log_alpha, acc), eb = decay_factors(log_beta, acc);
  at::Tensor num = at::zeros({2, BG, N, C}, vp.options());  // [direction (V2H, H2V), BG, N, C]
  AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_linear_attention_cpu", [&] {
    using T = scalar_t;
    const T *qd = qp.data_ptr<T>(), *kd = kp.data_ptr<T>(), *vd = vp.data_ptr<T>();
    const T *ead = ea.data_ptr<T>(), *ebd = eb.data_ptr<T>();
    T* nd = num.data_ptr<T>();
    parallel_tasks(
        2 * BG, [&] { return make_scratch<T>(W, d * C); },
        [&](int64_t task, Scratch<T>& s) {
          const int64_t dir = task % 2, bg = task / 2;
          const Grid<T> g{H, W, ead + bg * N, ebd + bg * N};
          const Outer<T> X{kd + bg * N * d, d, vd + bg * N * C, C};
          Contract<T> c{d, C};
          c.a = qd + bg * N * d;
          c.out_a = nd + (dir * BG + bg) * N * C;
          // The loops above vectorise to the lane width with_lanes() picks (AVX + FMA where the CPU has them).
          with_lanes([&](auto) { masked_scan(g, X, dir == 1, c, s); });
        });
  });
  at::Tensor stats, out;
  if (normalize) {
    const at::Tensor den = num.narrow(-1, dv, 1) + eps;
    const at::Tensor o = num.narrow(-1, 0, dv) / den;
    stats = at::cat({o, den}, -1);
    out = (o[0] + o[1]) * 0.5;
  } else {
    stats = num;
    out = (num[0] + num[1]) * 0.5;
  }
  // stats [2, BG, N, C] -> [B, H, W, heads, 2, C]
  stats = stats.view({2, B, G, H, W, C}).permute({1, 3, 4, 2, 0, 5}).contiguous();
  return {heads_last(out, B, H, W, G).to(v.scalar_type()).contiguous(), stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_linear_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& stats, bool normalize, double eps) {
  check_inputs(kOpBwd, q, k, v, log_alpha, log_beta);
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const int64_t N = H * W, BG = B * G, C = dv + (normalize ? 1 : 0);
  check_shape(kOpBwd, "stats", stats, {B, H, W, G, 2, C}, q);
  const auto acc = acc_type(q);
  const at::Tensor qp = heads_major(q, acc), kp = heads_major(k, acc);
  at::Tensor vp = heads_major(v, acc);
  if (normalize) vp = at::cat({vp, at::ones({BG, N, 1}, vp.options())}, -1);
  const at::Tensor ea = decay_factors(log_alpha, acc), eb = decay_factors(log_beta, acc);
  const at::Tensor go = heads_major(grad_out, acc);  // [BG, N, dv]
  // stats [B, H, W, heads, 2, C] -> [2, BG, N, C]
  const at::Tensor st = stats.to(acc).permute({4, 0, 3, 1, 2, 5}).reshape({2, BG, N, C});
  at::Tensor dop;  // dO' [2, BG, N, C]: the gradient of each direction's (numerator, denominator)
  if (normalize) {
    const at::Tensor o = st.narrow(-1, 0, dv), den = st.narrow(-1, dv, 1);
    dop = at::cat({go.unsqueeze(0) * 0.5 / den, (go.unsqueeze(0) * o).sum(-1, true) * -0.5 / den}, -1);
  } else {
    dop = (go * 0.5).unsqueeze(0).expand({2, BG, N, C});
  }
  dop = dop.contiguous();
  auto opts = qp.options();
  at::Tensor dq = at::zeros({BG, N, d}, opts), dk = at::zeros({BG, N, d}, opts), dvp = at::zeros({BG, N, C}, opts);
  at::Tensor gcr = at::zeros({BG, N}, opts), gcc = at::zeros({BG, N}, opts);
  AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_linear_attention_backward_cpu", [&] {
    using T = scalar_t;
    const T *qd = qp.data_ptr<T>(), *kd = kp.data_ptr<T>(), *vd = vp.data_ptr<T>(), *dod = dop.data_ptr<T>();
    const T *ead = ea.data_ptr<T>(), *ebd = eb.data_ptr<T>();
    T *dqd = dq.data_ptr<T>(), *dkd = dk.data_ptr<T>(), *dvd = dvp.data_ptr<T>();
    T *gcrd = gcr.data_ptr<T>(), *gccd = gcc.data_ptr<T>();
    auto backward_task = [&](int64_t bg, Scratch<T>& s) {
      const Grid<T> g{H, W, ead + bg * N, ebd + bg * N};
      const T* qb = qd + bg * N * d;
      const T* kb = kd + bg * N * d;
      const T* vb = vd + bg * N * C;
      const T* do1 = dod + bg * N * C;         // V2H
      const T* do2 = dod + (BG + bg) * N * C;  // H2V
      const Outer<T> KV{kb, d, vb, C};
      // dq_p = T_L(k, v')_p dO'1_p + T_{L^T}(k, v')_p dO'2_p
      for (int dir = 0; dir < 2; ++dir) {
        Contract<T> c{d, C};
        c.b = dir == 0 ? do1 : do2;
        c.out_b = dqd + bg * N * d;
        masked_scan(g, KV, dir == 1, c, s);
      }
      // dk_s = T_s v'_s and dv'_s = T_s^T k_s, T = T_{L^T}(q, dO'1) + T_L(q, dO'2)
      for (int dir = 0; dir < 2; ++dir) {
        Contract<T> c{d, C};
        c.a = kb;
        c.out_a = dvd + bg * N * C;
        c.b = vb;
        c.out_b = dkd + bg * N * d;
        masked_scan(g, Outer<T>{qb, d, dir == 0 ? do1 : do2, C}, dir == 0, c, s);
      }
      mask_grads(g, Outer<T>{qb, d, do1, C}, KV, gcrd + bg * N, gccd + bg * N, s);
      mask_grads(g, KV, Outer<T>{qb, d, do2, C}, gcrd + bg * N, gccd + bg * N, s);
    };
    parallel_tasks(
        BG, [&] { return make_scratch<T>(W, d * C); },
        [&](int64_t bg, Scratch<T>& s) { with_lanes([&](auto) { backward_task(bg, s); }); });
  });
  // Log-decay gradients: reverse cumsums of the prefix-sum gradients along rows / columns; index 0 gets 0.
  at::Tensor gla = gcr.view({B, G, H, W}).flip(3).cumsum(3).flip(3);
  gla.select(3, 0).zero_();
  at::Tensor glb = gcc.view({B, G, H, W}).flip(2).cumsum(2).flip(2);
  glb.select(2, 0).zero_();
  return {heads_last(dq, B, H, W, G).to(q.scalar_type()).contiguous(),
          heads_last(dk, B, H, W, G).to(k.scalar_type()).contiguous(),
          heads_last(dvp.narrow(-1, 0, dv), B, H, W, G).to(v.scalar_type()).contiguous(),
          gla.permute({0, 2, 3, 1}).to(log_alpha.scalar_type()).contiguous(),
          glb.permute({0, 2, 3, 1}).to(log_beta.scalar_type()).contiguous()};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_linear_attention", &ppma::cpu::polyline_linear_attention_cpu);
  m.impl("polyline_linear_attention_backward", &ppma::cpu::polyline_linear_attention_backward_cpu);
}
