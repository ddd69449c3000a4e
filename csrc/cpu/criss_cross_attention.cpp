// CPU kernels of ppma::criss_cross_attention (the official "chunk" mode, spec §3.3) and its backward.
//
// Per (batch, head): row attention A_i = softmax(S + R_i) inside every row (W x W) and column attention
// B_l = softmax(S + C_l) inside every column (H x H); out = 0.5 B (A v) + 0.5 A (B v). The maps live
// only in per-task scratch (one line at a time). Three parallel phases, each over lines:
//   forward:  rows (A, lse0, z1 = A v) -> columns (B, lse1, out1 = B z1, z2 = B v) -> rows (A from lse0,
//             out = 0.5 out1 + 0.5 A z2)
//   backward: rows (z1 = A v, dz2 = A^T g) -> columns (z2 = B v, dz1 = B^T g, dB, softmax backward,
//             column grads, grad log_beta) -> rows (dA, softmax backward, row grads, grad log_alpha)
// with g = 0.5 grad_out. Every output element is written by exactly one task: deterministic.
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

// X[j][l] = <Qs_j, K_l> + bias(j, l) for one line of n tokens. Qs rows have stride qs; Kt is [d][n];
// c holds the line's prefix sums; bias = c_max - c_min (position order).
template <typename T, int DC>
inline void line_logits(int64_t n, int64_t d_rt, const T* Q, int64_t qs, const T* Kt, const T* c, T* X) {
  const int64_t d = DC ? DC : d_rt;
  for (int64_t j = 0; j < n; ++j) {
    T* __restrict x = X + j * n;
    const T* qj = Q + j * qs;
    std::fill(x, x + n, T(0));
    for (int64_t e = 0; e < d; ++e) axpy(n, qj[e], Kt + e * n, x);
    const T cj = c[j];
#pragma omp simd
    for (int64_t l = 0; l < j; ++l) x[l] += cj - c[l];
#pragma omp simd
    for (int64_t l = j; l < n; ++l) x[l] += c[l] - cj;
  }
}

// In-place row softmax of X [n][n]; lse[j * ls] = logsumexp of row j.
template <typename T>
inline void line_softmax(int64_t n, T* X, T* lse, int64_t ls) {
  for (int64_t j = 0; j < n; ++j) {
    T* x = X + j * n;
    const T m = max_of(n, x);
    const T s = exp_shift_sum(n, x, m);
    scale_inplace(n, x, T(1) / s);
    lse[j * ls] = m + std::log(s);
  }
}

// X[j][:] = exp(X[j][:] - lse[j * ls]): the softmax recomputed from its statistics.
template <typename T>
inline void line_softmax_from_lse(int64_t n, T* X, const T* lse, int64_t ls) {
  for (int64_t j = 0; j < n; ++j) exp_shift(n, X + j * n, lse[j * ls]);
}

// out[j] = sum_l P[j][l] V[l] (rows of V / out with strides vs / os, dv columns).
template <typename T, int DVC>
inline void line_apply(int64_t n, int64_t dv_rt, const T* P, const T* V, int64_t vs, T* out, int64_t os) {
  const int64_t dv = DVC ? DVC : dv_rt;
  for (int64_t j = 0; j < n; ++j) {
    T* o = out + j * os;
    const T* p = P + j * n;
    if constexpr (DVC != 0) {
      T r[DVC ? DVC : 1] = {};
      for (int64_t l = 0; l < n; ++l) {
        const T w = p[l];
        const T* vr = V + l * vs;
#pragma omp simd
        for (int64_t e = 0; e < dv; ++e) r[e] += w * vr[e];
      }
      for (int64_t e = 0; e < dv; ++e) o[e] = r[e];
    } else {
      std::fill(o, o + dv, T(0));
      for (int64_t l = 0; l < n; ++l) axpy(dv, p[l], V + l * vs, o);
    }
  }
}

// out[l] = sum_j P[j][l] G[j] (the transposed map).
template <typename T, int DVC>
inline void line_apply_t(int64_t n, int64_t dv_rt, const T* P, const T* Gm, int64_t gs, T* out, int64_t os) {
  const int64_t dv = DVC ? DVC : dv_rt;
  for (int64_t l = 0; l < n; ++l) {
    T* o = out + l * os;
    if constexpr (DVC != 0) {
      T r[DVC ? DVC : 1] = {};
      for (int64_t j = 0; j < n; ++j) {
        const T w = P[j * n + l];
        const T* gr = Gm + j * gs;
#pragma omp simd
        for (int64_t e = 0; e < dv; ++e) r[e] += w * gr[e];
      }
      for (int64_t e = 0; e < dv; ++e) o[e] = r[e];
    } else {
      std::fill(o, o + dv, T(0));
      for (int64_t j = 0; j < n; ++j) axpy(dv, P[j * n + l], Gm + j * gs, o);
    }
  }
}

// Backward of one line's softmax attention, given the map P [n][n] and the gradient of the map
// dP[j][l] = <G1_j, U1_l> + <G2_j, U2_l> (G rows strided, U given transposed [dv][n]):
//   dX = P * (dP - rowsum(P * dP)) (written into dP's scratch DX),
//   prefix-sum gradient of the line into gc (then reverse-cumsummed by the caller),
//   dq_j = scale * sum_l dX[j][l] K_l (written, stride dqs), dk_l += sum_j dX[j][l] Qs_j (accumulated).
template <typename T, int DC, int DVC>
inline void line_backward(int64_t n, int64_t d_rt, int64_t dv_rt, const T* P, const T* G1, const T* G2,
                          int64_t gs, const T* U1t, const T* U2t, const T* Q, int64_t qs, const T* K, int64_t ks,
                          T scale, T* DX, T* gc, T* dq, int64_t dqs, T* dk, int64_t dks) {
  const int64_t d = DC ? DC : d_rt, dv = DVC ? DVC : dv_rt;
  std::fill(gc, gc + n, T(0));
  for (int64_t j = 0; j < n; ++j) {
    T* __restrict x = DX + j * n;
    const T* p = P + j * n;
    std::fill(x, x + n, T(0));
    const T* g1 = G1 + j * gs;
    const T* g2 = G2 + j * gs;
    for (int64_t e = 0; e < dv; ++e) {
      axpy(n, g1[e], U1t + e * n, x);
      axpy(n, g2[e], U2t + e * n, x);
    }
    const T rs = dot(n, p, x);
    T sneg = 0, spos = 0;
#pragma omp simd reduction(+ : sneg)
    for (int64_t l = 0; l < j; ++l) {  // bias = c_j - c_l
      const T v = p[l] * (x[l] - rs);
      x[l] = v;
      gc[l] -= v;
      sneg += v;
    }
#pragma omp simd reduction(+ : spos)
    for (int64_t l = j; l < n; ++l) {  // bias = c_l - c_j
      const T v = p[l] * (x[l] - rs);
      x[l] = v;
      gc[l] += v;
      spos += v;
    }
    gc[j] += sneg - spos;
    // dq_j
    T* o = dq + j * dqs;
    std::fill(o, o + d, T(0));
    for (int64_t l = 0; l < n; ++l) axpy(d, scale * x[l], K + l * ks, o);
  }
  // dk_l (key-major so each output row is accumulated in one place)
  for (int64_t l = 0; l < n; ++l) {
    T* o = dk + l * dks;
    if constexpr (DC != 0) {
      T r[DC ? DC : 1];
      for (int64_t e = 0; e < d; ++e) r[e] = o[e];
      for (int64_t j = 0; j < n; ++j) {
        const T w = DX[j * n + l];
        const T* qj = Q + j * qs;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) r[e] += w * qj[e];
      }
      for (int64_t e = 0; e < d; ++e) o[e] = r[e];
    } else {
      for (int64_t j = 0; j < n; ++j) axpy(d, DX[j * n + l], Q + j * qs, o);
    }
  }
}

// u [n rows, stride us, dv] -> ut [dv][n]
template <typename T>
inline void transpose_rows(int64_t n, int64_t dv, const T* u, int64_t us, T* ut) {
  for (int64_t l = 0; l < n; ++l)
    for (int64_t e = 0; e < dv; ++e) ut[e * n + l] = u[l * us + e];
}

template <typename T>
struct CCData {
  const T* q;    // [BG, N, d], pre-multiplied by scale
  const T* k;    // [BG, N, d] (backward)
  const T* ktr;  // [BG, H, d, W]
  const T* ktc;  // [BG, W, d, H]
  const T* v;    // [BG, N, dv]
  const T* vtr;  // [BG, H, dv, W] (backward)
  const T* vtc;  // [BG, W, dv, H] (backward)
  const T* cr;   // [BG, H, W]
  const T* cct;  // [BG, W, H] column prefix sums, transposed
  int64_t B, G, H, W, N, d, dv;
};

template <typename T, int DC, int DVC>
void forward_kernel(const CCData<T>& D, T* out, T* lse, T* z1, T* o1, T* z2) {
  const int64_t B = D.B, G = D.G, H = D.H, W = D.W, N = D.N, d = D.d, dv = D.dv;
  const int64_t BG = B * G;
  // lse of token p of head (b, g): lse[((b * N + p) * G + g) * 2 + which]
  // Phase 1: rows.
  at::parallel_for(0, BG * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> X(W * W);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, base = bg * N + i * W;
      line_logits<T, DC>(W, d, D.q + base * d, d, D.ktr + (bg * H + i) * d * W, D.cr + base, X.data());
      line_softmax(W, X.data(), lse + ((b * N + i * W) * G + g) * 2, G * 2);
      line_apply<T, DVC>(W, dv, X.data(), D.v + base * dv, dv, z1 + base * dv, dv);
    }
  });
  // Phase 2: columns.
  at::parallel_for(0, BG * W, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> X(H * H);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bg = t / W, l = t % W, b = bg / G, g = bg % G, base = bg * N + l;
      line_logits<T, DC>(H, d, D.q + base * d, W * d, D.ktc + (bg * W + l) * d * H, D.cct + bg * N + l * H,
                         X.data());
      line_softmax(H, X.data(), lse + ((b * N + l) * G + g) * 2 + 1, W * G * 2);
      line_apply<T, DVC>(H, dv, X.data(), z1 + base * dv, W * dv, o1 + base * dv, W * dv);
      line_apply<T, DVC>(H, dv, X.data(), D.v + base * dv, W * dv, z2 + base * dv, W * dv);
    }
  });
  // Phase 3: rows again, A from its statistics.
  at::parallel_for(0, BG * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> X(W * W), o2(W * dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, base = bg * N + i * W;
      line_logits<T, DC>(W, d, D.q + base * d, d, D.ktr + (bg * H + i) * d * W, D.cr + base, X.data());
      line_softmax_from_lse(W, X.data(), lse + ((b * N + i * W) * G + g) * 2, G * 2);
      line_apply<T, DVC>(W, dv, X.data(), z2 + base * dv, dv, o2.data(), dv);
      for (int64_t j = 0; j < W; ++j) {
        T* o = out + ((b * N + i * W + j) * G + g) * dv;
        const T* a = o1 + (base + j) * dv;
        const T* c = o2.data() + j * dv;
        for (int64_t e = 0; e < dv; ++e) o[e] = T(0.5) * (a[e] + c[e]);
      }
    }
  });
}

// gh: [BG, N, dv] = 0.5 grad_out; lsep: [BG, N, 2]. Scratch buffers [BG, N, *]: z1, dz2, z2, dz1, DQ, DK, DV.
// Outputs in [B, H, W, heads, *] layout.
template <typename T, int DC, int DVC>
void backward_kernel(const CCData<T>& D, const T* gh, const T* lsep, T scale, T* z1, T* dz2, T* z2, T* dz1,
                     T* DQ, T* DK, T* DV, T* dq, T* dk, T* dv_out, T* gla, T* glb) {
  const int64_t B = D.B, G = D.G, H = D.H, W = D.W, N = D.N, d = D.d, dv = D.dv;
  const int64_t BG = B * G;
  // Phase 1: rows. z1 = A v, dz2 = A^T g.
  at::parallel_for(0, BG * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> X(W * W);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bg = t / H, i = t % H, base = bg * N + i * W;
      line_logits<T, DC>(W, d, D.q + base * d, d, D.ktr + (bg * H + i) * d * W, D.cr + base, X.data());
      line_softmax_from_lse(W, X.data(), lsep + base * 2, 2);
      line_apply<T, DVC>(W, dv, X.data(), D.v + base * dv, dv, z1 + base * dv, dv);
      line_apply_t<T, DVC>(W, dv, X.data(), gh + base * dv, dv, dz2 + base * dv, dv);
    }
  });
  // Phase 2: columns. z2 = B v, dz1 = B^T g; dB = g z1^T + dz2 v^T; column grads; grad log_beta.
  at::parallel_for(0, BG * W, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> X(H * H), DX(H * H), z1t(dv * H), gc(H);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bg = t / W, l = t % W, b = bg / G, g = bg % G, base = bg * N + l, rs = W;
      line_logits<T, DC>(H, d, D.q + base * d, rs * d, D.ktc + (bg * W + l) * d * H, D.cct + bg * N + l * H,
                         X.data());
      line_softmax_from_lse(H, X.data(), lsep + base * 2 + 1, rs * 2);
      line_apply<T, DVC>(H, dv, X.data(), D.v + base * dv, rs * dv, z2 + base * dv, rs * dv);
      line_apply_t<T, DVC>(H, dv, X.data(), gh + base * dv, rs * dv, dz1 + base * dv, rs * dv);
      transpose_rows(H, dv, z1 + base * dv, rs * dv, z1t.data());
      for (int64_t k = 0; k < H; ++k) std::fill(DK + (base + k * rs) * d, DK + (base + k * rs) * d + d, T(0));
      line_backward<T, DC, DVC>(H, d, dv, X.data(), gh + base * dv, dz2 + base * dv, rs * dv, z1t.data(),
                                D.vtc + (bg * W + l) * dv * H, D.q + base * d, rs * d, D.k + base * d, rs * d,
                                scale, DX.data(), gc.data(), DQ + base * d, rs * d, DK + base * d, rs * d);
      // dv (column part) = B^T dz2
      line_apply_t<T, DVC>(H, dv, X.data(), dz2 + base * dv, rs * dv, DV + base * dv, rs * dv);
      reverse_cumsum_excl_first(H, gc.data(), 1, glb + (b * N + l) * G + g, W * G);
    }
  });
  // Phase 3: rows. dA = dz1 v^T + g z2^T; row grads; grad log_alpha; final sums.
  at::parallel_for(0, BG * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> X(W * W), DX(W * W), z2t(dv * W), gc(W), rq(W * d), rk(W * d), rv(W * dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bg = t / H, i = t % H, b = bg / G, g = bg % G, base = bg * N + i * W;
      line_logits<T, DC>(W, d, D.q + base * d, d, D.ktr + (bg * H + i) * d * W, D.cr + base, X.data());
      line_softmax_from_lse(W, X.data(), lsep + base * 2, 2);
      transpose_rows(W, dv, z2 + base * dv, dv, z2t.data());
      std::fill(rk.begin(), rk.end(), T(0));
      line_backward<T, DC, DVC>(W, d, dv, X.data(), dz1 + base * dv, gh + base * dv, dv,
                                D.vtr + (bg * H + i) * dv * W, z2t.data(), D.q + base * d, d, D.k + base * d, d,
                                scale, DX.data(), gc.data(), rq.data(), d, rk.data(), d);
      line_apply_t<T, DVC>(W, dv, X.data(), dz1 + base * dv, dv, rv.data(), dv);
      reverse_cumsum_excl_first(W, gc.data(), 1, gla + (b * N + i * W) * G + g, G);
      for (int64_t j = 0; j < W; ++j) {
        const int64_t o = (b * N + i * W + j) * G + g, p = base + j;
        for (int64_t e = 0; e < d; ++e) {
          dq[o * d + e] = DQ[p * d + e] + rq[j * d + e];
          dk[o * d + e] = DK[p * d + e] + rk[j * d + e];
        }
        for (int64_t e = 0; e < dv; ++e) dv_out[o * dv + e] = DV[p * dv + e] + rv[j * dv + e];
      }
    }
  });
}

constexpr const char* kOp = "criss_cross_attention";
constexpr const char* kOpBwd = "criss_cross_attention_backward";

struct Packed {
  at::Tensor q, k, ktr, ktc, v, vtr, vtc, cr, cct;
};

Packed pack(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& log_alpha,
            const at::Tensor& log_beta, double scale, bool backward) {
  const auto acc = acc_type(q);
  Packed P;
  P.q = pack_heads(q, acc) * scale;
  at::Tensor ka = k.to(acc), va = v.to(acc);
  P.ktr = ka.permute({0, 3, 1, 4, 2}).contiguous();  // [B, G, H, d, W]
  P.ktc = ka.permute({0, 3, 2, 4, 1}).contiguous();  // [B, G, W, d, H]
  P.v = pack_heads(v, acc);
  if (backward) {
    P.k = pack_heads(k, acc);
    P.vtr = va.permute({0, 3, 1, 4, 2}).contiguous();
    P.vtc = va.permute({0, 3, 2, 4, 1}).contiguous();
  }
  auto sums = prefix_sums(log_alpha, log_beta, acc);
  P.cr = sums.first;
  P.cct = sums.second.transpose(-1, -2).contiguous();
  return P;
}

template <typename T>
CCData<T> make_data(const Packed& P, const at::Tensor& q, const at::Tensor& v) {
  auto ptr = [](const at::Tensor& t) -> const T* { return t.defined() ? t.data_ptr<T>() : nullptr; };
  return CCData<T>{ptr(P.q),   ptr(P.k),  ptr(P.ktr), ptr(P.ktc), ptr(P.v),   ptr(P.vtr), ptr(P.vtc),
                   ptr(P.cr),  ptr(P.cct), q.size(0), q.size(3), q.size(1),  q.size(2),  q.size(1) * q.size(2),
                   q.size(4), v.size(4)};
}

std::tuple<at::Tensor, at::Tensor> criss_cross_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& log_alpha,
                                                             const at::Tensor& log_beta, double scale) {
  check_inputs(kOp, q, k, v, log_alpha, log_beta);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor out = at::empty({B, H, W, G, dv}, opts);
  at::Tensor lse = at::empty({B, H, W, G, 2}, opts);
  if (out.numel() > 0) {
    Packed P = pack(q, k, v, log_alpha, log_beta, scale, false);
    at::Tensor bufs = at::empty({3, B * G * H * W * dv}, opts);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_criss_cross_attention_cpu", [&] {
      auto D = make_data<scalar_t>(P, q, v);
      scalar_t* z1 = bufs[0].data_ptr<scalar_t>();
      scalar_t* o1 = bufs[1].data_ptr<scalar_t>();
      scalar_t* z2 = bufs[2].data_ptr<scalar_t>();
      dispatch_head_dims(d, dv, [&](auto dc, auto dvc) {
        forward_kernel<scalar_t, decltype(dc)::value, decltype(dvc)::value>(
            D, out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), z1, o1, z2);
      });
    });
  }
  return {out.to(v.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> criss_cross_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& log_alpha, const at::Tensor& log_beta, const at::Tensor& lse, double scale) {
  check_inputs(kOpBwd, q, k, v, log_alpha, log_beta);
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), G = q.size(3), d = q.size(4), dv = v.size(4);
  check_shape(kOpBwd, "lse", lse, {B, H, W, G, 2}, q);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor dq = at::zeros({B, H, W, G, d}, opts), dk = at::zeros_like(dq);
  at::Tensor dv_ = at::zeros({B, H, W, G, dv}, opts);
  at::Tensor gla = at::zeros({B, H, W, G}, opts), glb = at::zeros_like(gla);
  if (dq.numel() > 0) {
    Packed P = pack(q, k, v, log_alpha, log_beta, scale, true);
    at::Tensor gh = pack_heads(grad_out, acc) * 0.5;
    at::Tensor lsep = pack_heads(lse, acc);
    const int64_t M = B * G * H * W;
    at::Tensor vbufs = at::empty({5, M * dv}, opts);
    at::Tensor kbufs = at::empty({2, M * d}, opts);
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_criss_cross_attention_backward_cpu", [&] {
      auto D = make_data<scalar_t>(P, q, v);
      dispatch_head_dims(d, dv, [&](auto dc, auto dvc) {
        backward_kernel<scalar_t, decltype(dc)::value, decltype(dvc)::value>(
            D, gh.data_ptr<scalar_t>(), lsep.data_ptr<scalar_t>(), static_cast<scalar_t>(scale),
            vbufs[0].data_ptr<scalar_t>(), vbufs[1].data_ptr<scalar_t>(), vbufs[2].data_ptr<scalar_t>(),
            vbufs[3].data_ptr<scalar_t>(), kbufs[0].data_ptr<scalar_t>(), kbufs[1].data_ptr<scalar_t>(),
            vbufs[4].data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
            dv_.data_ptr<scalar_t>(), gla.data_ptr<scalar_t>(), glb.data_ptr<scalar_t>());
      });
    });
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv_.to(v.scalar_type()),
          gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("criss_cross_attention", &ppma::cpu::criss_cross_attention_cpu);
  m.impl("criss_cross_attention_backward", &ppma::cpu::criss_cross_attention_backward_cpu);
}
