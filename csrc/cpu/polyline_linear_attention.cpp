// CPU kernels of ppma::polyline_linear_attention (PPMLA, docs/model.md §2 Theorem 3 and A.7; docs/ops.md
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
// Backward. dO'_p (C per token, per direction) = 0.5 dO / (den + eps) and -0.5 <dO, o> / (den + eps) with
// normalisation, 0.5 dO without. Each direction's share of the loss is F = sum_{p,s} L[p, s] <A_p, B_s> with L
// the V2H mask: V2H A = q ⊗ dO'1, B = k ⊗ v'; H2V A = k ⊗ v', B = q ⊗ dO'2 (<dY, L^T X> = <X, L dY>). So
//   dA = L B   (V2H: dq_p = (L B)_p dO'1_p; H2V: dk, dv'),   dB = L^T A   (V2H: dk_s = (L^T A)_s v'_s, dv'; H2V: dq),
// and the gradient w.r.t. the prefix sum c_t of a line is sum_{u<t} (G_tu + G_ut) - sum_{u>t} (G_tu + G_ut)
// over the line's pairs (bias = c_max - c_min), with G(j, l) = Lrow(j, l) <A_ij, Z_il> along rows (Z = L^V B)
// and G(i, k) = Lcol(i, k) <D_il, B_kl> along columns (D = L^H A); the log-decay gradients are their reverse
// cumsums (d_0 gets exactly 0). One routine per direction (term_grads) builds the three states these need
// once per pass, Z's column half, D and D's column half, and reads everything off them as it sweeps: L B is
// Z's row product and L^T A = L^V D, contracted at every token, and each of the gradient sums is a one-sided
// recurrence paired with a token-local quantity, most of them products of those contractions with the token's
// vectors; only <Z, D> and <Z, g(A)> are full d x C dot products. Per token and pass a term reads or writes
// about 10 matrices of the row buffers (the forward: about 5 per direction), in three sweeps per row.
// The backward stores its matrices C x d (v' ⊗ k, dO' ⊗ q; the forward d x C): dq and dk, most of the
// contractions, are then sums of rows of d values, and only dv' needs a dot product per row.
// Every task writes only its own (batch, head) slice: deterministic and independent of the thread count.
// Accumulation in fp32 (fp64 for fp64 inputs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
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

// What to do with S_p (n1 x n2) at token p: out[p] += S_p^T a_p (n2 values; a [N, n1]).
template <typename T>
struct Contract {
  int64_t n1, n2;
  const T* a;
  T* out;

  void operator()(int64_t p, const T* S) const {
    const T* ap = a + p * n1;
    T* op = out + p * n2;
    for (int64_t r = 0; r < n1; ++r) axpy(n2, ap[r], S + r * n2, op);
  }
};

// Per-thread scratch: three row buffers of W matrices (m values each), three single matrices, seven vectors of
// n values (the contractions of one token) and W values (one per token of a row).
template <typename T>
struct Scratch {
  int64_t W, m, n;
  std::vector<T> buf;
  Scratch(int64_t W_, int64_t m_, int64_t n_) : W(W_), m(m_), n(n_), buf(3 * W * m + 3 * m + 7 * n + W) {}
  T* row(int k) { return buf.data() + k * W * m; }
  T* one(int k) { return buf.data() + 3 * W * m + k * m; }
  T* vec(int k) { return buf.data() + 3 * W * m + 3 * m + k * n; }
  T* line() { return buf.data() + 3 * W * m + 3 * m + 7 * n; }
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
  T* col = s.row(0);
  T* row = s.row(1);
  T* vec = s.one(0);
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

// sum of x[0:n]
template <typename T>
inline T sum(int64_t n, const T* __restrict x) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < n; ++e) s += x[e];
  return s;
}

// S = s * P + x ⊗ y with P the previous matrix of a recurrence (P = nullptr: S = x ⊗ y).
template <typename T>
inline void next_outer(int64_t n1, int64_t n2, T s, const T* __restrict P, const T* __restrict x,
                       const T* __restrict y, T* __restrict S) {
  for (int64_t r = 0; r < n1; ++r) {
    const T xr = x[r];
    T* Sr = S + r * n2;
    if (P) {
      const T* Pr = P + r * n2;
#pragma omp simd
      for (int64_t c = 0; c < n2; ++c) Sr[c] = s * Pr[c] + xr * y[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n2; ++c) Sr[c] = xr * y[c];
    }
  }
}

// One of the two terms of the backward, F = sum_{p,s} L[p, s] <A_p, B_s> with L the V2H mask and A, B rank-1
// per token (A_p = a1_p ⊗ a2_p, n1 x n2). Its gradients, contracted as the inputs need them:
//   da2_p += (L B)_p^T a1_p and da1_p += (L B)_p a2_p;   db2_s += (L^T A)_s^T b1_s and db1_s += (L^T A)_s b2_s
// (da1, db1 may be null) and the prefix-sum gradients gcr, gcc.
template <typename T>
struct Term {
  Outer<T> A, B;
  T* da2;  // [N, n2]
  T* da1;  // [N, n1] or null
  T* db2;  // [N, n2]
  T* db1;  // [N, n1] or null
};

// f(R, r) for blocks of R consecutive rows r .. r + R - 1 covering [0, n1): fours, then single rows. Blocks let
// the sweeps below keep their per-token sums in registers over R rows, instead of reading and writing them for
// every row (that traffic, not the row buffers, bounds the sweeps).
template <typename F>
inline void in_row_blocks(int64_t n1, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= n1; r += 4) f(std::integral_constant<int, 4>{}, r);
  for (; r < n1; ++r) f(std::integral_constant<int, 1>{}, r);
}

// Sweep 2 of term_grads on R consecutive rows of token l's matrices (Z, D, gA, gZ point at the first; a1 at its
// entry): D gets g_l(A), and g(A), g(Z) move on to l - 1 (decay e); the per-token accumulators (gz = g_l(Z)^T a1,
// zgv = <Z, g_l(A)> by lanes) are read and written once for all R rows.
template <int R, typename T>
inline void sweep2_rows(int64_t n2, T e, const T* __restrict a1, const T* __restrict a2, const T* __restrict Z,
                        T* __restrict D, T* __restrict gA, T* __restrict gZ, T* __restrict gz, T* __restrict zgv) {
#pragma omp simd
  for (int64_t c = 0; c < n2; ++c) {
    T gzc = gz[c], zgc = zgv[c];
    for (int k = 0; k < R; ++k) {
      const int64_t x = k * n2 + c;
      const T ga = gA[x], gzk = gZ[x], z = Z[x];
      D[x] += ga;
      zgc += z * ga;
      gzc += a1[k] * gzk;
      gA[x] = e * (ga + a1[k] * a2[c]);
      gZ[x] = e * (gzk + z);
    }
    gz[c] = gzc;
    zgv[c] = zgc;
  }
}

// Sweep 3 of term_grads on R consecutive rows of token l's matrices (Z, D, cD, fZ point at the first; a1, b1 at
// its entries): f(Z) moves on and, top-down, cD takes the row; the per-token accumulators (fz = f^T a1,
// za = Z^T a1, zdv = <Z, D> by lanes, dd = D^T b1, cd = cD^T b1) are read and written once for all R rows.
template <int R, bool Down, typename T>
inline void sweep3_rows(int64_t n2, T ef, T ec, const T* __restrict a1, const T* __restrict b1, const T* __restrict Z,
                        const T* __restrict D, T* __restrict cD, T* __restrict fZ, T* __restrict fz,
                        T* __restrict za, T* __restrict zdv, T* __restrict dd, T* __restrict cd) {
#pragma omp simd
  for (int64_t c = 0; c < n2; ++c) {
    T fzc = fz[c], zac = za[c], zdc = zdv[c], ddc = dd[c], cdc = cd[c];
    for (int k = 0; k < R; ++k) {
      const int64_t e = k * n2 + c;
      const T z = Z[e], dl = D[e];
      const T f = ef * fZ[e] + z;
      fZ[e] = f;
      fzc += a1[k] * f;
      zac += a1[k] * z;
      zdc += z * dl;
      if (Down) {
        ddc += b1[k] * dl;
        const T x = ec * cD[e] + dl;
        cD[e] = x;
        cdc += b1[k] * x;
      } else {
        cdc += b1[k] * cD[e];
      }
    }
    fz[c] = fzc;
    za[c] = zac;
    zdv[c] = zdc;
    if (Down) dd[c] = ddc;
    cd[c] = cdc;
  }
}

// Everything of one term in two passes over the rows (top-down: the inclusive column halves F; bottom-up: the
// exclusive halves G), each row in three sweeps. With Z = the column half of B (L B = L^H (F(B) + G(B))),
// D = L^H A (row-local, two-sided) and its column half cD (L^T A = F(D) + G(D)):
//   1 (left to right): in the top-down pass Z = F(B) takes row i; D = the forward half f(A) of the row product.
//   2 (right to left): the backward halves g(A) (completing D) and g(Z) (contracted: the g share of L B).
//   3 (left to right): the forward half f(Z) (contracted: the f share of L B); cD takes row i (contracted: its
//      share of L^T A); bottom-up, Z and cD move on to row i - 1 afterwards.
// The decay gradients (see the header) reduce to token-local products of what the contractions give:
//   columns: sum_u sign(t-u) (G_tu + G_ut) = <D_t, Z_t> + <B_t, cD_t> (- 2 <B_t, D_t>, the diagonal, top-down)
//            negated bottom-up, with <B_t, S> = b2_t . (S^T b1_t);
//   rows:    <A_t, f_t(Z) - Z_t - g_t(Z)> + <Z_t, E_t>, E = f(A) - A - g(A) = D - 2 g(A) - A, so
//            <Z_t, E_t> = <Z_t, D_t> - 2 <Z_t, g_t(A)> - a2_t . (Z_t^T a1_t): only <Z, g(A)> (sweep 2) and
//            <Z, D> (sweep 3, shared with the column term) are products of two full matrices.
template <typename T>
void term_grads(const Grid<T>& g, const Term<T>& t, T* gcr, T* gcc, Scratch<T>& s) {
  const Outer<T>& A = t.A;
  const Outer<T>& B = t.B;
  const int64_t H = g.H, W = g.W, n1 = A.n1, n2 = A.n2, m = A.size();
  T* cB = s.row(0);  // Z: the column half of B, row i
  T* cD = s.row(1);  // the column half of D, row i
  T* D = s.row(2);   // D = L^H A, row i
  T* gA = s.one(0);  // g_l(A)
  T* gZ = s.one(1);  // g_l(Z)
  T* fZ = s.one(2);  // f_l(Z)
  T* gz = s.vec(0);  // g_l(Z)^T a1
  T* fz = s.vec(1);  // f_l(Z)^T a1
  T* za = s.vec(2);  // Z_l^T a1
  T* dd = s.vec(3);  // D_l^T b1
  T* cd = s.vec(4);  // cD_l^T b1
  // The two full dot products are summed over rows lane by lane and reduced once per token: a scalar sum per
  // row would be a serial chain through every lane of every row.
  T* zgv = s.vec(5);  // <Z_l, g_l(A)> by lanes
  T* zdv = s.vec(6);  // <Z_l, D_l> by lanes
  T* zg = s.line();   // <Z_l, g_l(A)>
  for (int pass = 0; pass < 2; ++pass) {
    const bool down = pass == 0;
    std::fill(cB, cB + W * m, T(0));
    std::fill(cD, cD + W * m, T(0));
    for (int64_t step = 0; step < H; ++step) {
      const int64_t i = down ? step : H - 1 - step;
      const T* ax = A.x + i * W * n1;
      const T* ay = A.y + i * W * n2;
      const T* bx = B.x + i * W * n1;
      const T* by = B.y + i * W * n2;
      const T* ea = g.ea + i * W;
      const T* eb = g.eb + i * W;
      // 1: F_i = eb_i F_{i-1} + B_i (top-down); f_l(A) = ea_l f_{l-1}(A) + A_l
      for (int64_t l = 0; l < W; ++l) {
        if (down) decay_add_outer(n1, n2, i == 0 ? T(0) : eb[l], bx + l * n1, by + l * n2, cB + l * m);
        next_outer(n1, n2, ea[l], l == 0 ? nullptr : D + (l - 1) * m, ax + l * n1, ay + l * n2, D + l * m);
      }
      // 2: at l, gA and gZ hold g_l; then g_{l-1} = ea_l (g_l + X_l)
      std::fill(gA, gA + m, T(0));
      std::fill(gZ, gZ + m, T(0));
      for (int64_t l = W - 1; l >= 0; --l) {
        const T e = l > 0 ? ea[l] : T(0);  // g_{-1} is never read
        const T* a1 = ax + l * n1;
        const T* a2 = ay + l * n2;
        std::fill(gz, gz + n2, T(0));
        std::fill(zgv, zgv + n2, T(0));
        if (t.da1)
          for (int64_t r = 0; r < n1; ++r) t.da1[(i * W + l) * n1 + r] += dot(n2, gZ + r * n2, a2);
        in_row_blocks(n1, [&](auto R, int64_t r) {
          const int64_t o = l * m + r * n2;
          sweep2_rows<R()>(n2, e, a1 + r, a2, cB + o, D + o, gA + r * n2, gZ + r * n2, gz, zgv);
        });
        zg[l] = sum(n2, zgv);
        const int64_t p = i * W + l;
        axpy(n2, T(1), gz, t.da2 + p * n2);
        gcr[p] -= dot(n2, a2, gz);
      }
      // 3: f_l(Z) = ea_l f_{l-1}(Z) + Z_l; top-down cD_l = eb_l cD_l + D_l (F_i); bottom-up cD_l is G_i
      for (int64_t l = 0; l < W; ++l) {
        const int64_t p = i * W + l;
        const T ef = l == 0 ? T(0) : ea[l];
        const T ec = down ? (i == 0 ? T(0) : eb[l]) : eb[l];
        const bool move_up = !down && i > 0;
        const T* a1 = ax + l * n1;
        const T* a2 = ay + l * n2;
        const T* b1 = bx + l * n1;
        const T* b2 = by + l * n2;
        if (l == 0) std::fill(fZ, fZ + m, T(0));
        std::fill(fz, fz + n2, T(0));
        std::fill(za, za + n2, T(0));
        std::fill(dd, dd + n2, T(0));
        std::fill(cd, cd + n2, T(0));
        std::fill(zdv, zdv + n2, T(0));
        in_row_blocks(n1, [&](auto R, int64_t r) {
          const int64_t o = l * m + r * n2;
          T* fZr = fZ + r * n2;
          if (down)
            sweep3_rows<R(), true>(n2, ef, ec, a1 + r, b1 + r, cB + o, D + o, cD + o, fZr, fz, za, zdv, dd, cd);
          else
            sweep3_rows<R(), false>(n2, ef, ec, a1 + r, b1 + r, cB + o, D + o, cD + o, fZr, fz, za, zdv, dd, cd);
        });
        // the n1-valued contractions (one dot product per row), then bottom-up the move to row i - 1
        for (int64_t r = 0; r < n1; ++r) {
          T* Zr = cB + l * m + r * n2;
          const T* Dr = D + l * m + r * n2;
          T* cDr = cD + l * m + r * n2;
          const T b1r = b1[r];
          if (t.db1) t.db1[p * n1 + r] += dot(n2, cDr, b2);  // top-down F_i, bottom-up G_i
          if (t.da1) t.da1[p * n1 + r] += dot(n2, fZ + r * n2, a2);
          if (move_up) {  // G_{i-1} = eb_i (G_i + X_i)
#pragma omp simd
            for (int64_t c = 0; c < n2; ++c) {
              cDr[c] = ec * (cDr[c] + Dr[c]);
              Zr[c] = ec * (Zr[c] + b1r * b2[c]);
            }
          }
        }
        const T zd = sum(n2, zdv);  // <Z_l, D_l>
        axpy(n2, T(1), fz, t.da2 + p * n2);
        axpy(n2, T(1), cd, t.db2 + p * n2);
        gcr[p] += dot(n2, a2, fz) - 2 * dot(n2, a2, za) + zd - 2 * zg[l];
        if (down)
          gcc[p] += zd - 2 * dot(n2, b2, dd) + dot(n2, b2, cd);
        else
          gcc[p] -= zd + dot(n2, b2, cd);
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

// The inputs as both kernels read them (checked first): sizes, q, k [B * heads, N, d], v' [B * heads, N, C] (v with a
// ones channel when normalising) and the decay multipliers [B * heads, N], in the accumulation dtype.
struct Packed {
  int64_t B, H, W, G, d, dv, N, BG, C;
  at::ScalarType acc;
  at::Tensor q, k, v, ea, eb;

  Packed(const char* op, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
         const at::Tensor& log_alpha, const at::Tensor& log_beta, bool normalize) {
    check_inputs(op, q_in, k_in, v_in, log_alpha, log_beta);
    B = q_in.size(0), H = q_in.size(1), W = q_in.size(2), G = q_in.size(3), d = q_in.size(4), dv = v_in.size(4);
    N = H * W, BG = B * G, C = dv + (normalize ? 1 : 0);
    acc = acc_type(q_in);
    q = heads_major(q_in, acc);
    k = heads_major(k_in, acc);
    v = heads_major(v_in, acc);
    if (normalize) v = at::cat({v, at::ones({BG, N, 1}, v.options())}, -1);
    ea = decay_factors(log_alpha, acc);
    eb = decay_factors(log_beta, acc);
  }
};

// [B * heads, N, n] -> [B, H, W, heads, n]
at::Tensor heads_last(const at::Tensor& t, int64_t B, int64_t H, int64_t W, int64_t G) {
  return t.view({B, G, H, W, t.size(-1)}).permute({0, 2, 3, 1, 4});
}

std::tuple<at::Tensor, at::Tensor> polyline_linear_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, const at::Tensor& log_alpha,
                                                                 const at::Tensor& log_beta, bool normalize,
                                                                 double eps) {
  check_eps(kOp, eps);
  const Packed in(kOp, q, k, v, log_alpha, log_beta, normalize);
  const int64_t B = in.B, H = in.H, W = in.W, G = in.G, d = in.d, dv = in.dv, N = in.N, BG = in.BG, C = in.C;
  const at::Tensor &qp = in.q, &kp = in.k, &vp = in.v, &ea = in.ea, &eb = in.eb;
  at::Tensor num = at::zeros({2, BG, N, C}, vp.options());  // [direction (V2H, H2V), BG, N, C]
  AT_DISPATCH_FLOATING_TYPES(in.acc, "ppma_polyline_linear_attention_cpu", [&] {
    using T = scalar_t;
    const T *qd = qp.data_ptr<T>(), *kd = kp.data_ptr<T>(), *vd = vp.data_ptr<T>();
    const T *ead = ea.data_ptr<T>(), *ebd = eb.data_ptr<T>();
    T* nd = num.data_ptr<T>();
    parallel_tasks(
        2 * BG, [&] { return Scratch<T>(W, d * C, C); },
        [&](int64_t task, Scratch<T>& s) {
          const int64_t dir = task % 2, bg = task / 2;
          const Grid<T> g{H, W, ead + bg * N, ebd + bg * N};
          const Outer<T> X{kd + bg * N * d, d, vd + bg * N * C, C};
          const Contract<T> c{d, C, qd + bg * N * d, nd + (dir * BG + bg) * N * C};
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
  const Packed in(kOpBwd, q, k, v, log_alpha, log_beta, normalize);
  const int64_t B = in.B, H = in.H, W = in.W, G = in.G, d = in.d, dv = in.dv, N = in.N, BG = in.BG, C = in.C;
  const at::ScalarType acc = in.acc;
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  check_shape(kOpBwd, "stats", stats, {B, H, W, G, 2, C}, q);
  const at::Tensor &qp = in.q, &kp = in.k, &vp = in.v, &ea = in.ea, &eb = in.eb;
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
      T* dqb = dqd + bg * N * d;
      T* dkb = dkd + bg * N * d;
      T* dvb = dvd + bg * N * C;
      // V2H: A = dO'1 ⊗ q, B = v' ⊗ k: L B gives dq, L^T A gives dk, dv'.
      term_grads(g, Term<T>{{do1, C, qb, d}, {vb, C, kb, d}, dqb, nullptr, dkb, dvb}, gcrd + bg * N,
                 gccd + bg * N, s);
      // H2V: A = v' ⊗ k, B = dO'2 ⊗ q: L B gives dk, dv', L^T A gives dq.
      term_grads(g, Term<T>{{vb, C, kb, d}, {do2, C, qb, d}, dkb, dvb, dqb, nullptr}, gcrd + bg * N,
                 gccd + bg * N, s);
    };
    parallel_tasks(
        BG, [&] { return Scratch<T>(W, d * C, d); },
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
