// CPU kernels of ppma::polyline_attention_3d (softmax attention under the 3-D polyline mask, paper appendix C.2,
// Eq. 40; docs/video.md) and its backward. The structure of the 2-D kernel
// (csrc/cpu/polyline_attention.cpp): per (batch, head) and tile of TQ queries, the logits against all N = T H W keys
// are computed once by BLAS into per-thread scratch (TQ x N, linear in N) and shared by two exact softmaxes, one with
// the V2H bias M[p, s] and one with M'[p, s] = M[s, p]; the biases come from per-line prefix sums on the fly:
//   query p = (t, i, j), key s = (u, k, l), cg / cb / ca the prefix sums along T / H / W:
//   M[p, s]  = seg(cg @ (k, l); t, u) + seg(cb @ (t, l); i, k) + seg(ca @ (t, i); j, l)
//   M'[p, s] = seg(cg @ (i, j); u, t) + seg(cb @ (u, j); k, i) + seg(ca @ (u, k); l, j)
// with seg(c; a, b) = c[max(a, b)] - c[min(a, b)], written as sign(a, b) * (c[a] - c[b]) (common/math.h line_bias).
// No N x N tensor exists, in forward or backward.
//
// Backward (flash-style, from lse and out_v2h; the V2H half's D term from out_v2h, the H2V half's from the maps): each task owns a fixed range of query tiles of one (batch, head)
// and writes dq directly; dk, dv and the three prefix-sum gradients go to the task's own partial buffer, reduced
// afterwards in a fixed order. The number of partial buffers depends on the shapes only: deterministic and
// independent of the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu/polyline_3d.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

constexpr int64_t TQ = 64;

template <typename T>
struct PA3 {
  const T* q;   // [B, N, G, d]
  const T* k;   // [B, N, G, d]
  const T* v;   // [B, N, G, dv]
  const T* ca;  // [BG, N] prefix sums along W
  const T* cb;  // [BG, N] along H
  const T* cg;  // [BG, N] along T
  int64_t B, G, T_, H, W, N, d, dv;
  T scale;
};

template <typename T>
inline at::Tensor mat(const T* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// As the 2-D kernel: BLAS skips the product when alpha == 0, which would drop NaN/Inf in q or k.
inline void gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double alpha, double beta) {
  if (alpha == 0.0) {
    const at::Tensor prod = at::mm(a, b).mul_(0.0);
    if (beta == 0.0)
      out.copy_(prod);
    else
      out.mul_(beta).add_(prod);
    return;
  }
  at::addmm_out(out, out, a, b, beta, alpha);
}

template <typename T>
inline T sgn_of(int64_t key, int64_t query) {  // line_bias's sign: -1 when the key index is past the query's
  return key > query ? T(-1) : T(1);
}

// X1 holds S of queries p0 .. p0 + tq against all keys; adds the biases: X1 = S + M, X2 = S + M'.
template <typename T>
void add_biases(const PA3<T>& D, int64_t bg, int64_t p0, int64_t tq, T* X1, T* X2) {
  const int64_t N = D.N, H = D.H, W = D.W, HW = H * W;
  const T* ca = D.ca + bg * N;
  const T* cb = D.cb + bg * N;
  const T* cg = D.cg + bg * N;
  for (int64_t a = 0; a < tq; ++a) {
    const int64_t p = p0 + a, t = p / HW, i = (p / W) % H, j = p % W;
    const T* caTI = ca + t * HW + i * W;  // row (t, i)
    const T* cbT = cb + t * HW;           // frame t
    for (int64_t u = 0; u < D.T_; ++u) {
      const T sg = sgn_of<T>(u, t);
      const T* cgT = cg + t * HW;  // frame t
      const T* cgU = cg + u * HW;  // frame u
      const T* cbU = cb + u * HW;
      const T* caU = ca + u * HW;
      const T g2 = sg * (cg[t * HW + i * W + j] - cg[u * HW + i * W + j]);  // gamma of M' on line (i, j)
      for (int64_t k = 0; k < H; ++k) {
        const T sk = sgn_of<T>(k, i);
        T* y1 = X1 + a * N + u * HW + k * W;
        T* y2 = X2 + a * N + u * HW + k * W;
        const T* cgTk = cgT + k * W;
        const T* cgUk = cgU + k * W;
        const T* cbTi = cbT + i * W;
        const T* cbTk = cbT + k * W;
        const T* caUk = caU + k * W;
        const T b2 = sk * (cbU[i * W + j] - cbU[k * W + j]);
        const T caUkj = caUk[j], caTIj = caTI[j];
        const T c2 = g2 + b2;
#pragma omp simd
        for (int64_t l = 0; l < W; ++l) {
          const T sl = l > j ? T(-1) : T(1);
          const T s = y1[l];
          y1[l] = s + sg * (cgTk[l] - cgUk[l]) + sk * (cbTi[l] - cbTk[l]) + sl * (caTIj - caTI[l]);
          y2[l] = s + c2 + sl * (caUkj - caUk[l]);
        }
      }
    }
  }
}

template <typename T>
void logits_block(const PA3<T>& D, int64_t bg, int64_t p0, int64_t tq, T* X1, T* X2) {
  const int64_t N = D.N, G = D.G, d = D.d, b = bg / G, g = bg % G;
  at::Tensor s = mat(X1, tq, N, N);
  const at::Tensor qm = mat(D.q + token_index(N, G, b, p0, g) * d, tq, d, G * d);
  gemm(s, qm, mat(D.k + token_index(N, G, b, 0, g) * d, N, d, G * d).t(), static_cast<double>(D.scale), 0.0);
  add_biases(D, bg, p0, tq, X1, X2);
}

template <typename T>
void forward_kernel(const PA3<T>& D, T* out, T* out_v2h, T* lse) {
  const int64_t N = D.N, G = D.G, dv = D.dv;
  const int64_t nqb = ceil_div(N, TQ);
  parallel_tasks(
      D.B * G * nqb, [&] { return std::vector<T>(2 * TQ * N + 2 * TQ * dv); },
      [&](int64_t task, std::vector<T>& buf) {
        T* X1 = buf.data();
        T* X2 = X1 + TQ * N;
        T* O1 = X2 + TQ * N;
        T* O2 = O1 + TQ * dv;
        const int64_t bg = task / nqb, p0 = (task % nqb) * TQ, tq = std::min(TQ, N - p0);
        const int64_t b = bg / G, g = bg % G;
        logits_block(D, bg, p0, tq, X1, X2);
        T inv1[TQ], inv2[TQ];
        with_lanes([&](auto ln) {
          for (int64_t a = 0; a < tq; ++a)
            softmax_pair_row(ln, N, X1 + a * N, X2 + a * N, inv1 + a, inv2 + a,
                             lse + token_index(N, G, b, p0 + a, g) * 2);
        });
        at::Tensor vb = mat(D.v + token_index(N, G, b, 0, g) * dv, N, dv, G * dv);
        at::Tensor ob1 = mat(O1, tq, dv, dv), ob2 = mat(O2, tq, dv, dv);
        gemm(ob1, mat(X1, tq, N, N), vb, 1.0, 0.0);
        gemm(ob2, mat(X2, tq, N, N), vb, 1.0, 0.0);
        for (int64_t a = 0; a < tq; ++a) {
          const int64_t o = token_index(N, G, b, p0 + a, g);
          average_pair_row(dv, O1 + a * dv, O2 + a * dv, inv1[a], inv2[a], out_v2h + o * dv, out + o * dv);
        }
      });
}

// a[l] += s * g[l], b[l] -= s * g[l] for l < n (a and b distinct rows).
template <typename T>
inline void row_pair_update(int64_t n, T s, const T* __restrict g, T* __restrict a, T* __restrict b) {
#pragma omp simd
  for (int64_t l = 0; l < n; ++l) {
    a[l] += s * g[l];
    b[l] -= s * g[l];
  }
}

// r[l] -= sl * g[l] with sl = line_bias's sign of key l against query j (-1 for l > j, else +1); returns
// sum_l sl * g[l], the gradient of the prefix sum at the query's own index j.
template <typename T>
inline T signed_row_update(int64_t n, int64_t j, const T* __restrict g, T* __restrict r) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t l = 0; l <= j; ++l) {
    r[l] -= g[l];
    acc += g[l];
  }
#pragma omp simd reduction(+ : acc)
  for (int64_t l = j + 1; l < n; ++l) {
    r[l] += g[l];
    acc -= g[l];
  }
  return acc;
}

// Prefix-sum gradients of one query p = (t, i, j) against all keys: g1 = dS1 (to M), g2 = dS2 (to M'), both [N].
// The derivative of sign * (c[a] - c[b]) is +sign at a and -sign at b (common/math.h line_bias / sgn_diff).
template <typename T>
void bias_grads_query(const PA3<T>& D, int64_t p, const T* g1, const T* g2, T* gca, T* gcb, T* gcg) {
  const int64_t H = D.H, W = D.W, HW = H * W;
  const int64_t t = p / HW, i = (p / W) % H, j = p % W;
  T sa_q = 0;  // gca[t, i, j]
  for (int64_t u = 0; u < D.T_; ++u) {
    const T sg = sgn_of<T>(u, t);
    T sum2_u = 0;  // sum of g2 over keys of frame u: gcg at (t, i, j) / (u, i, j)
    for (int64_t k = 0; k < H; ++k) {
      const T sk = sgn_of<T>(k, i);
      const T* a1 = g1 + u * HW + k * W;
      const T* a2 = g2 + u * HW + k * W;
      T* gcgTk = gcg + t * HW + k * W;
      T* gcgUk = gcg + u * HW + k * W;
      T* gcbTi = gcb + t * HW + i * W;
      T* gcbTk = gcb + t * HW + k * W;
      T* gcaTI = gca + t * HW + i * W;
      T* gcaUk = gca + u * HW + k * W;
      // M: gamma on line (k, l) at t / u (cancels when u == t); beta on line (t, l) at i / k (cancels when k == i);
      // alpha on row (t, i) at j / l. M': alpha on row (u, k) at j / l. One loop per target pair of rows, so that
      // no two pointers of a loop alias and every loop vectorises.
      if (u != t) row_pair_update(W, sg, a1, gcgTk, gcgUk);
      if (k != i) row_pair_update(W, sk, a1, gcbTi, gcbTk);
      const T sl1 = signed_row_update(W, j, a1, gcaTI);
      const T sl2 = signed_row_update(W, j, a2, gcaUk);
      T s2 = 0;
#pragma omp simd reduction(+ : s2)
      for (int64_t l = 0; l < W; ++l) s2 += a2[l];
      sa_q += sl1;
      gcaUk[j] += sl2;
      // M': beta on line (u, j) at i / k
      gcb[u * HW + i * W + j] += sk * s2;
      gcb[u * HW + k * W + j] -= sk * s2;
      sum2_u += s2;
    }
    // M': gamma on line (i, j) at t / u
    gcg[t * HW + i * W + j] += sg * sum2_u;
    gcg[u * HW + i * W + j] -= sg * sum2_u;
  }
  gca[t * HW + i * W + j] += sa_q;
}

template <typename T>
void backward_kernel(const PA3<T>& D, const T* go, const T* out, const T* out_v2h, const T* lse, int64_t nchunk,
                     T* dq, T* part) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv;
  const int64_t nqb = ceil_div(N, TQ), qb_per_chunk = ceil_div(nqb, nchunk);
  const int64_t part_size = N * (d + dv + 3);
  const double scale = static_cast<double>(D.scale);
  parallel_tasks(
      D.B * G * nchunk, [&] { return std::vector<T>(4 * TQ * N + TQ * d); },
      [&](int64_t task, std::vector<T>& buf) {
        T* X1 = buf.data();
        T* X2 = X1 + TQ * N;
        T* DP = X2 + TQ * N;
        T* G1 = DP + TQ * N;
        T* DQ = G1 + TQ * N;
        const int64_t bg = task / nchunk, chunk = task % nchunk;
        const int64_t b = bg / G, g = bg % G;
        T* pdk = part + (bg * nchunk + chunk) * part_size;
        T* pdv = pdk + N * d;
        T* gca = pdv + N * dv;
        T* gcb = gca + N;
        T* gcg = gcb + N;
        at::Tensor dkm = mat(pdk, N, d, d), dvm = mat(pdv, N, dv, dv);
        at::Tensor km = mat(D.k + token_index(N, G, b, 0, g) * d, N, d, G * d);
        at::Tensor vm = mat(D.v + token_index(N, G, b, 0, g) * dv, N, dv, G * dv);
        const int64_t qb_end = std::min(nqb, (chunk + 1) * qb_per_chunk);
        for (int64_t qb = chunk * qb_per_chunk; qb < qb_end; ++qb) {
          const int64_t p0 = qb * TQ, tq = std::min(TQ, N - p0);
          const int64_t row0 = token_index(N, G, b, p0, g);
          logits_block(D, bg, p0, tq, X1, X2);
          at::Tensor gom = mat(go + row0 * dv, tq, dv, G * dv);
          at::Tensor dpm = mat(DP, tq, N, N);
          gemm(dpm, gom, vm.t(), 0.5, 0.0);  // DP = 0.5 dO v^T
          for (int64_t a = 0; a < tq; ++a) {
            const int64_t o = row0 + a * G;
            // D1 = 0.5 <dO, out_v2h> = 0.5 <dO, P1 v>. D2 = 0.5 <dO, P2 v> comes from the maps, sum_s P2[s] DP[s],
            // not from 2 out - out_v2h: out is the average of both halves, so a NaN row of P1 (a NaN log-decay on
            // one line of M) would reach D2 through it, and the reference keeps the halves apart (docs/ops.md
            // "Edges").
            T D1 = 0;
            for (int64_t e = 0; e < dv; ++e) D1 += go[o * dv + e] * out_v2h[o * dv + e];
            D1 *= T(0.5);
            T* x1 = X1 + a * N;
            T* x2 = X2 + a * N;
            T* dp = DP + a * N;
            T* g1 = G1 + a * N;
            T D2 = 0;
            with_lanes([&](auto ln) {
              exp_shift(ln, N, x1, lse[o * 2 + 0]);  // P1
              exp_shift(ln, N, x2, lse[o * 2 + 1]);  // P2
              D2 = dot_lanes(ln, N, x2, dp);
            });
#pragma omp simd
            for (int64_t c = 0; c < N; ++c) {
              const T p1 = x1[c], p2 = x2[c], dpc = dp[c];
              const T d1 = p1 * (dpc - D1), d2 = p2 * (dpc - D2);
              g1[c] = d1;
              x2[c] = d2;
              dp[c] = d1 + d2;
              x1[c] = p1 + p2;
            }
            bias_grads_query(D, p0 + a, g1, x2, gca, gcb, gcg);
          }
          at::Tensor dqm = mat(DQ, tq, d, d);
          gemm(dqm, dpm, km, scale, 0.0);
          for (int64_t a = 0; a < tq; ++a)
            for (int64_t e = 0; e < d; ++e) dq[(row0 + a * G) * d + e] = DQ[a * d + e];
          gemm(dkm, dpm.t(), mat(D.q + row0 * d, tq, d, G * d), scale, 1.0);
          gemm(dvm, mat(X1, tq, N, N).t(), gom, 0.5, 1.0);
        }
      });
}

// Sums the partial buffers in chunk order, then turns each line's prefix-sum gradients into log-decay gradients.
template <typename T>
void reduce_partials(const PA3<T>& D, int64_t nchunk, const T* part, T* dk, T* dv_out, T* gla, T* glb, T* glg,
                     T* gsum /* [BG, 3, N] scratch */) {
  const int64_t N = D.N, G = D.G, d = D.d, dv = D.dv;
  const int64_t part_size = N * (d + dv + 3);
  at::parallel_for(0, D.B * G, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bg = b0; bg < b1; ++bg) {
      const int64_t b = bg / G, g = bg % G;
      T* gs = gsum + bg * 3 * N;
      std::fill(gs, gs + 3 * N, T(0));
      for (int64_t p = 0; p < N; ++p) {
        T* ok = dk + token_index(N, G, b, p, g) * d;
        T* ov = dv_out + token_index(N, G, b, p, g) * dv;
        std::fill(ok, ok + d, T(0));
        std::fill(ov, ov + dv, T(0));
      }
      for (int64_t ch = 0; ch < nchunk; ++ch) {
        const T* pp = part + (bg * nchunk + ch) * part_size;
        for (int64_t p = 0; p < N; ++p) {
          axpy(d, T(1), pp + p * d, dk + token_index(N, G, b, p, g) * d);
          axpy(dv, T(1), pp + N * d + p * dv, dv_out + token_index(N, G, b, p, g) * dv);
        }
        axpy(3 * N, T(1), pp + N * (d + dv), gs);
      }
    }
  });
  // gs[bg] = [gca, gcb, gcg] in token order; reverse cumsums along each line (decay layout [B, N, G]).
  const p3d::Grid3 Gd{D.B, D.T_, D.H, D.W, G, 1};
  T* outs[3] = {glg, glb, gla};  // by axis
  const int64_t which[3] = {2, 1, 0};  // axis -> index in gs
  for (int axis = 0; axis < 3; ++axis) {
    const int64_t n = Gd.size(axis), st = Gd.step(axis), per = N / n, ts = Gd.token_stride(axis);
    at::parallel_for(0, Gd.count(axis), 1, [&](int64_t begin, int64_t end) {
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t s0 = Gd.start(axis, idx), bg = idx / per, g = bg % G, b = bg / G;
        const int64_t n0 = (s0 - g) / G - b * N;
        decay_grads_from_prefix(n, gsum + (bg * 3 + which[axis]) * N + n0, ts, outs[axis] + s0, st);
      }
    });
  }
}

constexpr const char* kOp = "polyline_attention_3d";
constexpr const char* kOpBwd = "polyline_attention_3d_backward";

std::tuple<at::Tensor, at::Tensor, at::Tensor> polyline_attention_3d_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                          const at::Tensor& v,
                                                                          const at::Tensor& log_alpha,
                                                                          const at::Tensor& log_beta,
                                                                          const at::Tensor& log_gamma, double scale) {
  p3d::check_inputs_3d(kOp, q, k, v, log_alpha, log_beta, log_gamma);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), W = q.size(3), G = q.size(4), d = q.size(5);
  const int64_t dv = v.size(5);
  const auto acc = acc_type(q);
  at::Tensor out = at::empty({B, T, H, W, G, dv}, q.options().dtype(acc));
  at::Tensor out_v2h = at::empty_like(out);
  at::Tensor lse = at::empty({B, T, H, W, G, 2}, q.options().dtype(acc));
  if (out.numel() > 0) {
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    auto cs = p3d::prefix_sums_3d(log_alpha, log_beta, log_gamma, acc);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_3d_cpu", [&] {
      PA3<scalar_t> D{qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                      cs[0].data_ptr<scalar_t>(), cs[1].data_ptr<scalar_t>(), cs[2].data_ptr<scalar_t>(),
                      B, G, T, H, W, T * H * W, d, dv, static_cast<scalar_t>(scale)};
      forward_kernel<scalar_t>(D, out.data_ptr<scalar_t>(), out_v2h.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
    });
  }
  return {out.to(v.scalar_type()), out_v2h.to(v.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> polyline_attention_3d_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& log_gamma, const at::Tensor& out,
    const at::Tensor& out_v2h, const at::Tensor& lse, double scale) {
  p3d::check_inputs_3d(kOpBwd, q, k, v, log_alpha, log_beta, log_gamma);
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  check_shape(kOpBwd, "out", out, v.sizes(), q);
  check_shape(kOpBwd, "out_v2h", out_v2h, v.sizes(), q);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), W = q.size(3), G = q.size(4), d = q.size(5);
  const int64_t dv = v.size(5), N = T * H * W;
  check_shape(kOpBwd, "lse", lse, {B, T, H, W, G, 2}, q);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor dq = at::empty(q.sizes(), opts), dk = at::empty_like(dq), dv_ = at::empty(v.sizes(), opts);
  at::Tensor gla = at::empty(log_alpha.sizes(), opts), glb = at::empty_like(gla), glg = at::empty_like(gla);
  if (dq.numel() > 0) {
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    at::Tensor goc = grad_out.to(acc).contiguous(), oc = out.to(acc).contiguous();
    at::Tensor ovc = out_v2h.to(acc).contiguous(), lsec = lse.to(acc).contiguous();
    auto cs = p3d::prefix_sums_3d(log_alpha, log_beta, log_gamma, acc);
    const int64_t nqb = ceil_div(N, TQ);
    const int64_t nchunk = std::max<int64_t>(1, std::min<int64_t>(nqb, ceil_div(32, B * G)));
    at::Tensor part = at::zeros({B * G, nchunk, N * (d + dv + 3)}, opts);
    at::Tensor gsum = at::empty({B * G, 3, N}, opts);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_attention_3d_backward_cpu", [&] {
      using S = scalar_t;
      PA3<S> D{qc.data_ptr<S>(), kc.data_ptr<S>(), vc.data_ptr<S>(), cs[0].data_ptr<S>(), cs[1].data_ptr<S>(),
               cs[2].data_ptr<S>(), B, G, T, H, W, N, d, dv, static_cast<S>(scale)};
      backward_kernel<S>(D, goc.data_ptr<S>(), oc.data_ptr<S>(), ovc.data_ptr<S>(), lsec.data_ptr<S>(), nchunk,
                         dq.data_ptr<S>(), part.data_ptr<S>());
      reduce_partials<S>(D, nchunk, part.data_ptr<S>(), dk.data_ptr<S>(), dv_.data_ptr<S>(), gla.data_ptr<S>(),
                         glb.data_ptr<S>(), glg.data_ptr<S>(), gsum.data_ptr<S>());
    });
  }
  return {dq.to(q.scalar_type()),          dk.to(k.scalar_type()),          dv_.to(v.scalar_type()),
          gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type()), glg.to(log_gamma.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_attention_3d", &ppma::cpu::polyline_attention_3d_cpu);
  m.impl("polyline_attention_3d_backward", &ppma::cpu::polyline_attention_3d_backward_cpu);
}
