// CPU kernels of ppma::polyline_attention (the official "whole" mode, spec §3.4) and its backward.
//
// Per (batch, head) and tile of TQ queries, one pass over the keys in tiles of TK: the q.k tile is
// computed once and shared by two online softmaxes, one with the V2H bias M[p, s] = R_i(j, l) + C_l(i, k)
// and one with the H2V bias M'[p, s] = M[s, p] = R_k(j, l) + C_j(i, k) (query p = (i, j), key s = (k, l)).
// Biases come from the prefix sums on the fly; no N x N tensor exists, in forward or backward.
//
// Backward (flash-style, from lse / out / out_v2h): each task owns a query block range of one (batch,
// head) and writes dq directly; dk, dv and the prefix-sum gradients go to the task's own partial buffer,
// reduced afterwards in a fixed order (deterministic, no atomics). The number of partial buffers depends
// on the shapes only, so results do not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "common/cpu_math.h"
#include "common/cpu_utils.h"
#include "common/math.h"

namespace ppma {
namespace cpu {
namespace {

constexpr int64_t TQ = 32;  // queries per tile
constexpr int64_t TK = 64;  // keys per tile

template <typename T>
struct PAData {
  const T* q;   // [BG, N, d], pre-multiplied by scale
  const T* kt;  // [BG, d, N]
  const T* k;   // [BG, N, d] (backward)
  const T* v;   // [BG, N, dv]
  const T* vt;  // [BG, dv, N] (backward)
  const T* cr;  // [BG, N] row prefix sums
  const T* cc;  // [BG, N] column prefix sums
  int64_t B, G, H, W, N, d, dv;
};

// X1[a][c] = S + M, X2[a][c] = S + M' for queries p0 .. p0 + tq and keys s0 .. s0 + n of head bg.
// Row stride of X1 / X2 is TK.
template <typename T, int DC>
inline void logits_tile(const PAData<T>& D, int64_t bg, int64_t p0, int64_t tq, int64_t s0, int64_t n,
                        T* __restrict X1, T* __restrict X2) {
  const int64_t N = D.N, W = D.W, d = DC ? DC : D.d;
  const T* Q = D.q + bg * N * d;
  const T* Kt = D.kt + bg * d * N + s0;
  const T* cr = D.cr + bg * N;
  const T* cc = D.cc + bg * N;
  for (int64_t a = 0; a < tq; ++a) {
    T* __restrict x1 = X1 + a * TK;
    const T* qa = Q + (p0 + a) * d;
    std::fill(x1, x1 + n, T(0));
    for (int64_t dd = 0; dd < d; ++dd) axpy(n, qa[dd], Kt + dd * N, x1);
  }
  for (int64_t a = 0; a < tq; ++a) {
    const int64_t p = p0 + a, i = p / W, j = p % W;
    T* __restrict x1 = X1 + a * TK;
    T* __restrict x2 = X2 + a * TK;
    const T* crI = cr + i * W;
    const T* ccI = cc + i * W;
    for (int64_t c = 0; c < n;) {
      const int64_t s = s0 + c, k = s / W, l0 = s % W, len = std::min(W - l0, n - c);
      const T* crK = cr + k * W;
      const T* ccK = cc + k * W;
      const T sk = pos_sign<T>(k, i);
      const T ct2 = sk * (ccK[j] - ccI[j]);  // C_j(i, k), constant over the segment
      const T crIj = crI[j], crKj = crK[j];
      // keys l < j: R = crX[j] - crX[l]; keys l >= j: R = crX[l] - crX[j]
      const int64_t ub = std::min(std::max(j - l0, int64_t(0)), len);
      T* y1 = x1 + c - l0;
      T* y2 = x2 + c - l0;
#pragma omp simd
      for (int64_t l = l0; l < l0 + ub; ++l) {
        const T sv = y1[l];
        y1[l] = sv + (crIj - crI[l]) + sk * (ccK[l] - ccI[l]);
        y2[l] = sv + (crKj - crK[l]) + ct2;
      }
#pragma omp simd
      for (int64_t l = l0 + ub; l < l0 + len; ++l) {
        const T sv = y1[l];
        y1[l] = sv + (crI[l] - crIj) + sk * (ccK[l] - ccI[l]);
        y2[l] = sv + (crK[l] - crKj) + ct2;
      }
      c += len;
    }
  }
}

template <typename T, int DC, int DVC>
void forward_kernel(const PAData<T>& D, T* out, T* out_v2h, T* lse) {
  const int64_t N = D.N, G = D.G, dv = DVC ? DVC : D.dv;
  const int64_t nqb = ceil_div(N, TQ);
  at::parallel_for(0, D.B * G * nqb, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(2 * TQ * TK + 2 * TQ * dv + 4 * TQ);
    T* X1 = buf.data();
    T* X2 = X1 + TQ * TK;
    T* acc1 = X2 + TQ * TK;
    T* acc2 = acc1 + TQ * dv;
    T* m1 = acc2 + TQ * dv;
    T* l1 = m1 + TQ;
    T* m2 = l1 + TQ;
    T* l2 = m2 + TQ;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
      const T* V = D.v + bg * N * dv;
      std::fill(acc1, acc1 + 2 * TQ * dv, T(0));
      for (int64_t a = 0; a < tq; ++a) {
        m1[a] = m2[a] = neg_inf<T>();
        l1[a] = l2[a] = 0;
      }
      for (int64_t s0 = 0; s0 < N; s0 += TK) {
        const int64_t n = std::min(TK, N - s0);
        logits_tile<T, DC>(D, bg, p0, tq, s0, n, X1, X2);
        for (int64_t a = 0; a < tq; ++a) {
          T* x1 = X1 + a * TK;
          T* x2 = X2 + a * TK;
          T* a1 = acc1 + a * dv;
          T* a2 = acc2 + a * dv;
          const T mn1 = std::max(m1[a], max_of(n, x1));
          const T mn2 = std::max(m2[a], max_of(n, x2));
          const T c1 = fast_exp(m1[a] - mn1), c2 = fast_exp(m2[a] - mn2);
          l1[a] = l1[a] * c1 + exp_shift_sum(n, x1, mn1);
          l2[a] = l2[a] * c2 + exp_shift_sum(n, x2, mn2);
          m1[a] = mn1;
          m2[a] = mn2;
          T r1[DVC ? DVC : 1], r2[DVC ? DVC : 1];
          if constexpr (DVC != 0) {
            for (int64_t e = 0; e < dv; ++e) {
              r1[e] = a1[e] * c1;
              r2[e] = a2[e] * c2;
            }
            for (int64_t c = 0; c < n; ++c) {
              const T* vr = V + (s0 + c) * dv;
              const T p1 = x1[c], p2 = x2[c];
#pragma omp simd
              for (int64_t e = 0; e < dv; ++e) {
                r1[e] += p1 * vr[e];
                r2[e] += p2 * vr[e];
              }
            }
            for (int64_t e = 0; e < dv; ++e) {
              a1[e] = r1[e];
              a2[e] = r2[e];
            }
          } else {
            scale_inplace(dv, a1, c1);
            scale_inplace(dv, a2, c2);
            for (int64_t c = 0; c < n; ++c) {
              const T* vr = V + (s0 + c) * dv;
              axpy(dv, x1[c], vr, a1);
              axpy(dv, x2[c], vr, a2);
            }
          }
        }
      }
      const int64_t b = bg / G, g = bg % G;
      for (int64_t a = 0; a < tq; ++a) {
        const int64_t o = ((b * N + p0 + a) * G + g);
        const T i1 = T(1) / l1[a], i2 = T(1) / l2[a];
        T* ov = out_v2h + o * dv;
        T* oo = out + o * dv;
        for (int64_t e = 0; e < dv; ++e) {
          const T v1 = acc1[a * dv + e] * i1, v2 = acc2[a * dv + e] * i2;
          ov[e] = v1;
          oo[e] = T(0.5) * (v1 + v2);
        }
        lse[o * 2 + 0] = m1[a] + std::log(l1[a]);
        lse[o * 2 + 1] = m2[a] + std::log(l2[a]);
      }
    }
  });
}

// Prefix-sum gradients of one query row a against one key-row segment, k != i (rows differ, so the
// four target lines never alias). g1 = dS1 (flows to M), g2 = dS2 (flows to M').
template <typename T>
inline void bias_grad_segment(int64_t l0, int64_t ub, int64_t len, int64_t j, T sk, const T* __restrict g1,
                              const T* __restrict g2, T* __restrict gcrI, T* __restrict gccI,
                              T* __restrict gcrK, T* __restrict gccK) {
  T s1 = 0, s2 = 0, t2 = 0;
#pragma omp simd reduction(+ : s1, s2, t2)
  for (int64_t l = l0; l < l0 + ub; ++l) {  // sign(l - j) = -1
    const T a = g1[l], b = g2[l];
    gcrI[l] -= a;
    gcrK[l] -= b;
    gccK[l] += sk * a;
    gccI[l] -= sk * a;
    s1 -= a;
    s2 -= b;
    t2 += b;
  }
#pragma omp simd reduction(+ : s1, s2, t2)
  for (int64_t l = l0 + ub; l < l0 + len; ++l) {  // sign(l - j) = +1
    const T a = g1[l], b = g2[l];
    gcrI[l] += a;
    gcrK[l] += b;
    gccK[l] += sk * a;
    gccI[l] -= sk * a;
    s1 += a;
    s2 += b;
    t2 += b;
  }
  gcrI[j] -= s1;
  gcrK[j] -= s2;
  gccK[j] += sk * t2;
  gccI[j] -= sk * t2;
}

// Same row (k == i): the column terms vanish; both row terms land on row i.
template <typename T>
inline void bias_grad_segment_same_row(int64_t l0, int64_t ub, int64_t len, int64_t j, const T* __restrict g1,
                                       const T* __restrict g2, T* __restrict gcrI) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t l = l0; l < l0 + ub; ++l) {
    const T a = g1[l] + g2[l];
    gcrI[l] -= a;
    s -= a;
  }
#pragma omp simd reduction(+ : s)
  for (int64_t l = l0 + ub; l < l0 + len; ++l) {
    const T a = g1[l] + g2[l];
    gcrI[l] += a;
    s += a;
  }
  gcrI[j] -= s;
}

// dOh: [BG, N, dv] = 0.5 * grad_out; Dl: [BG, N, 4] = (D1, D2, lse0, lse1).
// part: [BG, nchunk, N * (d + dv + 2)] zero-initialised partial sums (dk, dv, grad cr, grad cc).
template <typename T, int DC, int DVC>
void backward_kernel(const PAData<T>& D, const T* dOh, const T* Dl, T scale, int64_t nchunk, T* dq, T* part) {
  const int64_t N = D.N, G = D.G, d = DC ? DC : D.d, dv = DVC ? DVC : D.dv, W = D.W;
  const int64_t nqb = ceil_div(N, TQ), qb_per_chunk = ceil_div(nqb, nchunk);
  const int64_t part_size = N * (d + dv + 2);
  at::parallel_for(0, D.B * G * nchunk, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(5 * TQ * TK + TQ * d);
    T* X1 = buf.data();
    T* X2 = X1 + TQ * TK;
    T* DP = X2 + TQ * TK;
    T* G1 = DP + TQ * TK;
    T* G2 = G1 + TQ * TK;
    T* dqacc = G2 + TQ * TK;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / nchunk, chunk = task % nchunk;
      const int64_t b = bg / G, g = bg % G;
      T* pdk = part + (bg * nchunk + chunk) * part_size;
      T* pdv = pdk + N * d;
      T* gcr = pdv + N * dv;
      T* gcc = gcr + N;
      const T* Q = D.q + bg * N * d;
      const T* K = D.k + bg * N * d;
      const T* Vt = D.vt + bg * dv * N;
      const T* dO = dOh + bg * N * dv;
      const T* Dlb = Dl + bg * N * 4;
      const int64_t qb_end = std::min(nqb, (chunk + 1) * qb_per_chunk);
      for (int64_t qb = chunk * qb_per_chunk; qb < qb_end; ++qb) {
        const int64_t p0 = qb * TQ, tq = std::min(TQ, N - p0);
        std::fill(dqacc, dqacc + tq * d, T(0));
        for (int64_t s0 = 0; s0 < N; s0 += TK) {
          const int64_t n = std::min(TK, N - s0);
          logits_tile<T, DC>(D, bg, p0, tq, s0, n, X1, X2);
          for (int64_t a = 0; a < tq; ++a) {
            const T* st = Dlb + (p0 + a) * 4;
            const T D1 = st[0], D2 = st[1];
            T* x1 = X1 + a * TK;
            T* x2 = X2 + a * TK;
            T* dp = DP + a * TK;
            T* g1 = G1 + a * TK;
            T* g2 = G2 + a * TK;
            exp_shift(n, x1, st[2]);
            exp_shift(n, x2, st[3]);
            std::fill(dp, dp + n, T(0));
            const T* ga = dO + (p0 + a) * dv;
            for (int64_t e = 0; e < dv; ++e) axpy(n, ga[e], Vt + e * N + s0, dp);
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) {
              const T p1 = x1[c], p2 = x2[c];
              const T d1 = p1 * (dp[c] - D1), d2 = p2 * (dp[c] - D2);
              g1[c] = d1;
              g2[c] = d2;
              dp[c] = d1 + d2;  // dS, the gradient of the shared logits
              x1[c] = p1 + p2;  // P1 + P2 for dv
            }
            // Prefix-sum gradients, one key-row segment at a time.
            const int64_t p = p0 + a, i = p / W, j = p % W;
            for (int64_t c = 0; c < n;) {
              const int64_t s = s0 + c, k = s / W, l0 = s % W, len = std::min(W - l0, n - c);
              const int64_t ub = std::min(std::max(j - l0, int64_t(0)), len);
              if (k == i) {
                bias_grad_segment_same_row(l0, ub, len, j, g1 + c - l0, g2 + c - l0, gcr + i * W);
              } else {
                bias_grad_segment(l0, ub, len, j, pos_sign<T>(k, i), g1 + c - l0, g2 + c - l0, gcr + i * W,
                                  gcc + i * W, gcr + k * W, gcc + k * W);
              }
              c += len;
            }
            // dq (without the scale) += dS K
            T* dqa = dqacc + a * d;
            if constexpr (DC != 0) {
              T r[DC ? DC : 1];
              for (int64_t e = 0; e < d; ++e) r[e] = dqa[e];
              for (int64_t c = 0; c < n; ++c) {
                const T* kr = K + (s0 + c) * d;
                const T w = dp[c];
#pragma omp simd
                for (int64_t e = 0; e < d; ++e) r[e] += w * kr[e];
              }
              for (int64_t e = 0; e < d; ++e) dqa[e] = r[e];
            } else {
              for (int64_t c = 0; c < n; ++c) axpy(d, dp[c], K + (s0 + c) * d, dqa);
            }
          }
          // dk += dS^T (scale q), dv += (P1 + P2)^T (0.5 dO), key-major so each row stays in registers.
          for (int64_t c = 0; c < n; ++c) {
            T* dkr = pdk + (s0 + c) * d;
            T* dvr = pdv + (s0 + c) * dv;
            if constexpr (DC != 0 && DVC != 0) {
              T rk[DC ? DC : 1], rv[DVC ? DVC : 1];
              for (int64_t e = 0; e < d; ++e) rk[e] = dkr[e];
              for (int64_t e = 0; e < dv; ++e) rv[e] = dvr[e];
              for (int64_t a = 0; a < tq; ++a) {
                const T w = DP[a * TK + c], pw = X1[a * TK + c];
                const T* qa = Q + (p0 + a) * d;
                const T* ga = dO + (p0 + a) * dv;
#pragma omp simd
                for (int64_t e = 0; e < d; ++e) rk[e] += w * qa[e];
#pragma omp simd
                for (int64_t e = 0; e < dv; ++e) rv[e] += pw * ga[e];
              }
              for (int64_t e = 0; e < d; ++e) dkr[e] = rk[e];
              for (int64_t e = 0; e < dv; ++e) dvr[e] = rv[e];
            } else {
              for (int64_t a = 0; a < tq; ++a) {
                axpy(d, DP[a * TK + c], Q + (p0 + a) * d, dkr);
                axpy(dv, X1[a * TK + c], dO + (p0 + a) * dv, dvr);
              }
            }
          }
        }
        for (int64_t a = 0; a < tq; ++a) {
          T* o = dq + ((b * N + p0 + a) * G + g) * d;
          for (int64_t e = 0; e < d; ++e) o[e] = scale * dqacc[a * d + e];
        }
      }
    }
  });
}

// Sums the partial buffers in chunk order and turns prefix-sum gradients into log-decay gradients.
template <typename T>
void reduce_partials(const PAData<T>& D, int64_t nchunk, const T* part, T* dk, T* dv_out, T* gla, T* glb) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv, H = D.H, W = D.W;
  const int64_t part_size = N * (d + dv + 2);
  // Rows: dk, dv and grad log_alpha (reverse cumsum along the row).
  at::parallel_for(0, D.B * G * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> row(W);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / H, i = task % H, b = bg / G, g = bg % G;
      std::fill(row.begin(), row.end(), T(0));
      for (int64_t j = 0; j < W; ++j) {
        const int64_t p = i * W + j;
        T* ok = dk + ((b * N + p) * G + g) * d;
        T* ov = dv_out + ((b * N + p) * G + g) * dv;
        std::fill(ok, ok + d, T(0));
        std::fill(ov, ov + dv, T(0));
        for (int64_t ch = 0; ch < nchunk; ++ch) {
          const T* pp = part + (bg * nchunk + ch) * part_size;
          axpy(d, T(1), pp + p * d, ok);
          axpy(dv, T(1), pp + N * d + p * dv, ov);
          row[j] += pp[N * (d + dv) + p];
        }
      }
      reverse_cumsum_excl_first(W, row.data(), 1, gla + ((b * N + i * W) * G + g), G);
    }
  });
  // Columns: grad log_beta (reverse cumsum along the column).
  at::parallel_for(0, D.B * G * W, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> col(H);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / W, j = task % W, b = bg / G, g = bg % G;
      std::fill(col.begin(), col.end(), T(0));
      for (int64_t ch = 0; ch < nchunk; ++ch) {
        const T* pc = part + (bg * nchunk + ch) * part_size + N * (d + dv + 1);
        for (int64_t i = 0; i < H; ++i) col[i] += pc[i * W + j];
      }
      reverse_cumsum_excl_first(H, col.data(), 1, glb + ((b * N + j) * G + g), W * G);
    }
  });
}

constexpr const char* kOp = "polyline_attention";
constexpr const char* kOpBwd = "polyline_attention_backward";

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                       const at::Tensor& v,
                                                                       const at::Tensor& log_alpha,
                                                                       const at::Tensor& log_beta, double scale) {
  check_inputs(kOp, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const auto acc = acc_type(q);
  at::Tensor out = at::empty({B, H, W, G, dv}, q.options().dtype(acc));
  at::Tensor out_v2h = at::empty_like(out);
  at::Tensor lse = at::empty({B, H, W, G, 2}, q.options().dtype(acc));
  if (out.numel() > 0) {
    at::Tensor Qs = pack_heads(q, acc) * scale;
    at::Tensor Kt = pack_heads_t(k, acc);
    at::Tensor Vp = pack_heads(v, acc);
    auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_cpu", [&] {
      PAData<scalar_t> D{Qs.data_ptr<scalar_t>(), Kt.data_ptr<scalar_t>(), nullptr, Vp.data_ptr<scalar_t>(),
                         nullptr, cr.data_ptr<scalar_t>(), cc.data_ptr<scalar_t>(), B, G, H, W, H * W, d, dv};
      dispatch_head_dims(d, dv, [&](auto dc, auto dvc) {
        forward_kernel<scalar_t, decltype(dc)::value, decltype(dvc)::value>(
            D, out.data_ptr<scalar_t>(), out_v2h.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
      });
    });
  }
  return {out.to(v.scalar_type()), out_v2h.to(v.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& out, const at::Tensor& out_v2h,
    const at::Tensor& lse, double scale) {
  check_inputs(kOpBwd, q, k, v, log_alpha, log_beta);
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  check_shape(kOpBwd, "out", out, v.sizes(), q);
  check_shape(kOpBwd, "out_v2h", out_v2h, v.sizes(), q);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  check_shape(kOpBwd, "lse", lse, {B, H, W, G, 2}, q);
  const int64_t N = H * W;
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor dq = at::empty({B, H, W, G, d}, opts), dk = at::empty_like(dq);
  at::Tensor dv_ = at::empty({B, H, W, G, dv}, opts);
  at::Tensor gla = at::empty({B, H, W, G}, opts), glb = at::empty_like(gla);
  if (dq.numel() > 0) {
    at::Tensor Qs = pack_heads(q, acc) * scale;
    at::Tensor Kp = pack_heads(k, acc);
    at::Tensor Kt = pack_heads_t(k, acc);
    at::Tensor Vt = pack_heads_t(v, acc);
    auto [cr, cc] = prefix_sums(log_alpha, log_beta, acc);
    at::Tensor go = grad_out.to(acc);
    at::Tensor o = out.to(acc), ov = out_v2h.to(acc);
    at::Tensor D1 = (go * ov).sum(-1).mul_(0.5);
    at::Tensor D2 = (go * (2 * o - ov)).sum(-1).mul_(0.5);
    at::Tensor Dl = at::cat({D1.unsqueeze(-1), D2.unsqueeze(-1), lse.to(acc)}, -1).permute({0, 3, 1, 2, 4}).contiguous();
    at::Tensor dOh = pack_heads(grad_out, acc) * 0.5;
    // Partial buffers: enough independent tasks for a multi-core machine, independent of the thread count.
    const int64_t nqb = ceil_div(N, TQ);
    const int64_t nchunk = std::max<int64_t>(1, std::min<int64_t>(nqb, ceil_div(32, B * G)));
    at::Tensor part = at::zeros({B * G, nchunk, N * (d + dv + 2)}, opts);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_backward_cpu", [&] {
      PAData<scalar_t> D{Qs.data_ptr<scalar_t>(), Kt.data_ptr<scalar_t>(), Kp.data_ptr<scalar_t>(), nullptr,
                         Vt.data_ptr<scalar_t>(), cr.data_ptr<scalar_t>(), cc.data_ptr<scalar_t>(), B, G, H, W, N,
                         d, dv};
      dispatch_head_dims(d, dv, [&](auto dc, auto dvc) {
        backward_kernel<scalar_t, decltype(dc)::value, decltype(dvc)::value>(
            D, dOh.data_ptr<scalar_t>(), Dl.data_ptr<scalar_t>(), static_cast<scalar_t>(scale), nchunk,
            dq.data_ptr<scalar_t>(), part.data_ptr<scalar_t>());
      });
      reduce_partials<scalar_t>(D, nchunk, part.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                dv_.data_ptr<scalar_t>(), gla.data_ptr<scalar_t>(), glb.data_ptr<scalar_t>());
    });
  } else {
    dk.zero_(), dv_.zero_(), gla.zero_(), glb.zero_(), dq.zero_();
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv_.to(v.scalar_type()),
          gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_attention", &ppma::cpu::polyline_attention_cpu);
  m.impl("polyline_attention_backward", &ppma::cpu::polyline_attention_backward_cpu);
}
