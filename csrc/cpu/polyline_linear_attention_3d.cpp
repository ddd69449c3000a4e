// CPU kernels of ppma::polyline_linear_attention_3d (3-D PPMLA; paper appendix C.2 with the scan form of paper §4,
// Theorem 3; docs/video.md) and its backward.
//
// Per (batch, head), with v' = [v, 1] (C = dv + 1 channels; C = dv without normalisation) and X_s = k_s (x) v'_s
// (d x C per token): ((A*L) v')_p = q_p^T (L X)_p, and L X = exp(M) X is the 3-D Algorithm 1 on the d*C channels
// (csrc/cpu/polyline_3d.h: scans along T, H, W; L^T X along W, H, T). Time O(N d C); extra memory O(N d C)
// (linear in N; unlike the 2-D kernel this one does not stream over rows).
//
// Backward, with dO'_p per direction (C values: (0.5 dO / (den + eps), -0.5 <dO, o> / (den + eps)) for
// normalize=True, o the direction's normalised term; 0.5 dO otherwise) and Z = q (x) dO' per direction:
//   the loss is <Z1, L X> + <Z2, L^T X>, so dq_p = (L X)_p dO'1_p + (L^T X)_p dO'2_p, the gradient of X is
//   L^T Z1 + L Z2 (the scan backward of each term), dk_s = dX_s v'_s, dv'_s = dX_s^T k_s, and the decay gradients
//   are the scan backward's (one per direction, summed).
// Every pass is per token or per line with a fixed order: deterministic and independent of the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/polyline_3d.h"

namespace ppma {
namespace cpu {
namespace {

constexpr const char* kOp = "polyline_linear_attention_3d";
constexpr const char* kOpBwd = "polyline_linear_attention_3d_backward";

// X[tok][a * C + e] = k[tok][a] * v'[tok][e], v' = [v, 1] when C = dv + 1.
template <typename T>
void outer_kv(int64_t ntok, int64_t d, int64_t dv, int64_t C, const T* k, const T* v, T* X) {
  at::parallel_for(0, ntok, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t tok = b0; tok < b1; ++tok) {
      const T* kt = k + tok * d;
      const T* vt = v + tok * dv;
      T* x = X + tok * d * C;
      for (int64_t a = 0; a < d; ++a) {
        for (int64_t e = 0; e < dv; ++e) x[a * C + e] = kt[a] * vt[e];
        if (C > dv) x[a * C + dv] = kt[a];
      }
    }
  });
}

// num[e] = sum_a q[a] Y[a * C + e]
template <typename T>
inline void contract_q(int64_t d, int64_t C, const T* q, const T* Y, T* num) {
  std::fill(num, num + C, T(0));
  for (int64_t a = 0; a < d; ++a) axpy(C, q[a], Y + a * C, num);
}

std::tuple<at::Tensor, at::Tensor> polyline_linear_attention_3d_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                    const at::Tensor& v, const at::Tensor& log_alpha,
                                                                    const at::Tensor& log_beta,
                                                                    const at::Tensor& log_gamma, bool normalize,
                                                                    double eps) {
  p3d::check_inputs_3d(kOp, q, k, v, log_alpha, log_beta, log_gamma);
  check_eps(kOp, eps);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), W = q.size(3), G = q.size(4), d = q.size(5);
  const int64_t dv = v.size(5), C = dv + (normalize ? 1 : 0), ntok = B * T * H * W * G;
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor out = at::empty({B, T, H, W, G, dv}, opts);
  at::Tensor stats = at::empty({B, T, H, W, G, 2, C}, opts);
  if (out.numel() > 0) {
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
    at::Tensor lg = log_gamma.to(acc).contiguous();
    at::Tensor X = at::empty({ntok, d * C}, opts), Y = at::empty_like(X), tmp = at::empty_like(X);
    const p3d::Grid3 Gd{B, T, H, W, G, d * C};
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_linear_attention_3d_cpu", [&] {
      using S = scalar_t;
      const std::array<const S*, 3> dec{lg.data_ptr<S>(), lb.data_ptr<S>(), la.data_ptr<S>()};
      const S* qp = qc.data_ptr<S>();
      S* st = stats.data_ptr<S>();
      S* op = out.data_ptr<S>();
      outer_kv(ntok, d, dv, C, kc.data_ptr<S>(), vc.data_ptr<S>(), X.data_ptr<S>());
      for (int dir = 0; dir < 2; ++dir) {
        p3d::scan3<S>(Gd, X.data_ptr<S>(), dec, dir == 1, Y.data_ptr<S>(), tmp.data_ptr<S>());
        const S* Yp = Y.data_ptr<S>();
        at::parallel_for(0, ntok, 256, [&](int64_t b0, int64_t b1) {
          std::vector<S> num(C);
          for (int64_t tok = b0; tok < b1; ++tok) {
            contract_q(d, C, qp + tok * d, Yp + tok * d * C, num.data());
            S* s = st + (tok * 2 + dir) * C;
            S* o = op + tok * dv;
            if (normalize) {
              const S den = num[dv] + static_cast<S>(eps);
              for (int64_t e = 0; e < dv; ++e) s[e] = num[e] / den;
              s[dv] = den;
            } else {
              for (int64_t e = 0; e < dv; ++e) s[e] = num[e];
            }
            for (int64_t e = 0; e < dv; ++e) o[e] = dir == 0 ? S(0.5) * s[e] : o[e] + S(0.5) * s[e];
          }
        });
      }
    });
  }
  return {out.to(v.scalar_type()), stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
polyline_linear_attention_3d_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& log_alpha,
                                          const at::Tensor& log_beta, const at::Tensor& log_gamma,
                                          const at::Tensor& stats, bool normalize, double eps) {
  p3d::check_inputs_3d(kOpBwd, q, k, v, log_alpha, log_beta, log_gamma);
  check_eps(kOpBwd, eps);
  check_shape(kOpBwd, "grad_out", grad_out, v.sizes(), q);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), W = q.size(3), G = q.size(4), d = q.size(5);
  const int64_t dv = v.size(5), C = dv + (normalize ? 1 : 0), ntok = B * T * H * W * G;
  check_shape(kOpBwd, "stats", stats, {B, T, H, W, G, 2, C}, q);
  const auto acc = acc_type(q);
  auto opts = q.options().dtype(acc);
  at::Tensor dq = at::zeros(q.sizes(), opts), dk = at::zeros(q.sizes(), opts), dvv = at::zeros(v.sizes(), opts);
  at::Tensor gla = at::zeros(log_alpha.sizes(), opts), glb = at::zeros_like(gla), glg = at::zeros_like(gla);
  if (dq.numel() > 0 && dvv.numel() > 0) {
    at::Tensor qc = q.to(acc).contiguous(), kc = k.to(acc).contiguous(), vc = v.to(acc).contiguous();
    at::Tensor la = log_alpha.to(acc).contiguous(), lb = log_beta.to(acc).contiguous();
    at::Tensor lg = log_gamma.to(acc).contiguous();
    at::Tensor go = grad_out.to(acc).contiguous(), sc = stats.to(acc).contiguous();
    at::Tensor dO = at::empty({ntok, 2, C}, opts);  // dO' per direction
    at::Tensor X = at::empty({ntok, d * C}, opts), Y = at::empty_like(X), Z = at::empty_like(X);
    at::Tensor dX = at::zeros_like(X), gxd = at::empty_like(X);
    at::Tensor s1 = at::empty_like(X), s2 = at::empty_like(X), s3 = at::empty_like(X);
    at::Tensor gdec_dir = at::empty({3, ntok}, opts);
    const p3d::Grid3 Gd{B, T, H, W, G, d * C};
    AT_DISPATCH_FLOATING_TYPES(acc, "ppma_polyline_linear_attention_3d_backward_cpu", [&] {
      using S = scalar_t;
      const std::array<const S*, 3> dec{lg.data_ptr<S>(), lb.data_ptr<S>(), la.data_ptr<S>()};
      S* gsum[3] = {glg.data_ptr<S>(), glb.data_ptr<S>(), gla.data_ptr<S>()};
      const std::array<S*, 3> gdir{gdec_dir.data_ptr<S>(), gdec_dir.data_ptr<S>() + ntok,
                                   gdec_dir.data_ptr<S>() + 2 * ntok};
      const S* qp = qc.data_ptr<S>();
      const S* kp = kc.data_ptr<S>();
      const S* vp = vc.data_ptr<S>();
      const S* gop = go.data_ptr<S>();
      const S* sp = sc.data_ptr<S>();
      S* dOp = dO.data_ptr<S>();
      S* Xp = X.data_ptr<S>();
      S* Yp = Y.data_ptr<S>();
      S* Zp = Z.data_ptr<S>();
      S* dXp = dX.data_ptr<S>();
      S* dqp = dq.data_ptr<S>();
      // dO'
      at::parallel_for(0, ntok, 256, [&](int64_t b0, int64_t b1) {
        for (int64_t tok = b0; tok < b1; ++tok) {
          const S* g = gop + tok * dv;
          for (int dir = 0; dir < 2; ++dir) {
            S* o = dOp + (tok * 2 + dir) * C;
            const S* s = sp + (tok * 2 + dir) * C;
            if (normalize) {
              const S den = s[dv];
              S dot_go = 0;
              for (int64_t e = 0; e < dv; ++e) {
                o[e] = S(0.5) * g[e] / den;
                dot_go += g[e] * s[e];
              }
              o[dv] = S(-0.5) * dot_go / den;
            } else {
              for (int64_t e = 0; e < dv; ++e) o[e] = S(0.5) * g[e];
            }
          }
        }
      });
      outer_kv(ntok, d, dv, C, kp, vp, Xp);
      for (int dir = 0; dir < 2; ++dir) {
        const bool tr = dir == 1;
        // Y = L X (or L^T X); dq += Y dO'
        p3d::scan3<S>(Gd, Xp, dec, tr, Yp, s1.data_ptr<S>());
        // Z = q (x) dO'
        at::parallel_for(0, ntok, 256, [&](int64_t b0, int64_t b1) {
          for (int64_t tok = b0; tok < b1; ++tok) {
            const S* y = Yp + tok * d * C;
            const S* o = dOp + (tok * 2 + dir) * C;
            const S* qt = qp + tok * d;
            S* z = Zp + tok * d * C;
            S* dqt = dqp + tok * d;
            for (int64_t a = 0; a < d; ++a) {
              dqt[a] += dot(C, y + a * C, o);
              for (int64_t e = 0; e < C; ++e) z[a * C + e] = qt[a] * o[e];
            }
          }
        });
        // gradient of <Z, L X> w.r.t. X and the decays
        p3d::scan3_backward<S>(Gd, Xp, Zp, dec, tr, gxd.data_ptr<S>(), gdir, s1.data_ptr<S>(), s2.data_ptr<S>(),
                               s3.data_ptr<S>());
        const S* gx = gxd.data_ptr<S>();
        at::parallel_for(0, ntok * d * C, 4096, [&](int64_t b0, int64_t b1) {
          for (int64_t i = b0; i < b1; ++i) dXp[i] += gx[i];
        });
        for (int a = 0; a < 3; ++a) {
          S* gs = gsum[a];
          const S* gd = gdir[a];
          at::parallel_for(0, ntok, 4096, [&](int64_t b0, int64_t b1) {
            for (int64_t i = b0; i < b1; ++i) gs[i] += gd[i];
          });
        }
      }
      // dk_s = dX_s v'_s, dv_s = dX_s^T k_s (the last channel of v' is the constant 1)
      S* dkp = dk.data_ptr<S>();
      S* dvp = dvv.data_ptr<S>();
      at::parallel_for(0, ntok, 256, [&](int64_t b0, int64_t b1) {
        for (int64_t tok = b0; tok < b1; ++tok) {
          const S* x = dXp + tok * d * C;
          const S* vt = vp + tok * dv;
          const S* kt = kp + tok * d;
          S* dkt = dkp + tok * d;
          S* dvt = dvp + tok * dv;
          for (int64_t a = 0; a < d; ++a) {
            S acc_k = dot(dv, x + a * C, vt);
            if (C > dv) acc_k += x[a * C + dv];
            dkt[a] = acc_k;
            axpy(dv, kt[a], x + a * C, dvt);
          }
        }
      });
    });
  }
  return {dq.to(q.scalar_type()),          dk.to(k.scalar_type()),          dvv.to(v.scalar_type()),
          gla.to(log_alpha.scalar_type()), glb.to(log_beta.scalar_type()), glg.to(log_gamma.scalar_type())};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("polyline_linear_attention_3d", &ppma::cpu::polyline_linear_attention_3d_cpu);
  m.impl("polyline_linear_attention_3d_backward", &ppma::cpu::polyline_linear_attention_3d_backward_cpu);
}
