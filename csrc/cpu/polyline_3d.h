// What the three 3-D polyline CPU operators share (paper appendix C.2, Eq. 40; docs/video.md):
// argument checks, the [B, T, H, W, heads, c] geometry of the lines along T, H and W, the 1-D linear-time scans
// of one line and the 3-D Algorithm 1 built from them, and the per-line prefix sums of the log-decays.
//
// Lines: axis 0 (T, log_gamma), axis 1 (H, log_beta), axis 2 (W, log_alpha). The 3-D V2H mask of a query
// p = (t, i, j) and a key s = (u, k, l) is M[p, s] = Gamma_(k,l)[t..u] + Beta_(t,l)[i..k] + Alpha_(t,i)[j..l], so
// exp(M) x is three 1-D scans: along T (each (k, l) line), then H (each (t, l) line), then W (each (t, i) line);
// exp(M)^T x runs them in the reverse order (W, H, T). With T = 1 this is the 2-D Algorithm 1 (csrc/cpu/polyline_scan.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common/checks.h"
#include "common/math.h"
#include "cpu/line_scan.h"
#include "cpu/simd.h"

namespace ppma {
namespace cpu {
namespace p3d {

// ---------------------------------------------------------------------------------------------
// Checks (named errors, as common/checks.h for the 2-D ops)
// ---------------------------------------------------------------------------------------------
inline void check_decays_3d(const char* op, const at::Tensor& ref, const at::Tensor& la, const at::Tensor& lb,
                            const at::Tensor& lg) {
  const auto grid = ref.sizes().slice(0, 5);
  const char* names[3] = {"log_alpha", "log_beta", "log_gamma"};
  const at::Tensor* ts[3] = {&la, &lb, &lg};
  for (int n = 0; n < 3; ++n) {
    TORCH_CHECK(ts[n]->dim() == 5 && ts[n]->sizes() == grid, op, ": ", names[n],
                " must be [B, T, H, W, heads] = ", grid, ", got shape ", ts[n]->sizes());
    check_floating(op, names[n], *ts[n]);
    TORCH_CHECK(ts[n]->device() == ref.device(), op, ": ", names[n], " is on ", ts[n]->device(),
                " but the features are on ", ref.device());
    TORCH_CHECK(ts[n]->scalar_type() == la.scalar_type(), op, ": ", names[n], " has dtype ", ts[n]->scalar_type(),
                " but log_alpha has dtype ", la.scalar_type());
  }
}

// q, k: [B, T, H, W, heads, d]; v: [B, T, H, W, heads, dv]; decays [B, T, H, W, heads].
inline void check_inputs_3d(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& la, const at::Tensor& lb, const at::Tensor& lg) {
  TORCH_CHECK(q.dim() == 6, op, ": q must be [B, T, H, W, heads, d], got shape ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have the shape of q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.dim() == 6 && v.sizes().slice(0, 5) == q.sizes().slice(0, 5), op,
              ": v must be [B, T, H, W, heads, dv] matching q ", q.sizes(), ", got shape ", v.sizes());
  check_floating(op, "q", q);
  check_like(op, "k", k, "q", q);
  check_like(op, "v", v, "q", q);
  check_decays_3d(op, q, la, lb, lg);
  TORCH_CHECK(q.size(4) > 0 && q.size(5) > 0 && v.size(5) > 0, op,
              ": heads and head dims must be positive, got q ", q.sizes(), " and v ", v.sizes());
}

// x: [B, T, H, W, heads, c].
inline void check_scan_inputs_3d(const char* op, const at::Tensor& x, const at::Tensor& la, const at::Tensor& lb,
                                 const at::Tensor& lg) {
  TORCH_CHECK(x.dim() == 6, op, ": x must be [B, T, H, W, heads, c], got shape ", x.sizes());
  check_floating(op, "x", x);
  check_decays_3d(op, x, la, lb, lg);
}

// ---------------------------------------------------------------------------------------------
// Geometry of the contiguous [B, T, H, W, heads, c] layout. Spatial token n = (t * H + i) * W + j; element
// (b, n, g, ch) at ((b * N + n) * G + g) * c + ch; the decay tensors [B, T, H, W, heads] at (b * N + n) * G + g.
// ---------------------------------------------------------------------------------------------
struct Grid3 {
  int64_t B, T, H, W, G, c;
  int64_t N() const { return T * H * W; }
  int64_t size(int axis) const { return axis == 0 ? T : (axis == 1 ? H : W); }
  int64_t token_stride(int axis) const { return axis == 0 ? H * W : (axis == 1 ? W : 1); }
  // Lines along `axis`: B * G * N / size(axis) of them, each size(axis) positions.
  int64_t count(int axis) const { return B * G * (N() / size(axis)); }
  // Decay-tensor index of the first position of line `idx` along `axis`; positions are step(axis) apart.
  int64_t start(int axis, int64_t idx) const {
    const int64_t per = N() / size(axis);
    const int64_t bg = idx / per, rest = idx % per, b = bg / G, g = bg % G;
    const int o1 = axis == 0 ? 1 : 0, o2 = axis == 2 ? 1 : 2;  // the other two axes, in order
    const int64_t n = (rest / size(o2)) * token_stride(o1) + (rest % size(o2)) * token_stride(o2);
    return (b * N() + n) * G + g;
  }
  int64_t step(int axis) const { return token_stride(axis) * G; }
};

// scan_line / scan_line_backward: one line's scan and its backward (cpu/line_scan.h).

// y = A x on every line along `axis`; a: the decays of that axis. Each line is one independent task.
template <typename T>
void scan_pass(const Grid3& Gd, int axis, const T* x, const T* a, T* y) {
  const int64_t n = Gd.size(axis), c = Gd.c, st = Gd.step(axis);
  at::parallel_for(0, Gd.count(axis), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> e(n), g(c);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t s = Gd.start(axis, idx);
      scan_line(n, c, x + s * c, st * c, a + s, st, y + s * c, st * c, e.data(), g.data());
    }
  });
}

template <typename T>
void scan_backward_pass(const Grid3& Gd, int axis, const T* z, const T* gy, const T* a, T* gz, T* ga) {
  const int64_t n = Gd.size(axis), c = Gd.c, st = Gd.step(axis);
  at::parallel_for(0, Gd.count(axis), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> e(n), fz(n * c), fg(n * c), Fz(c), Fg(c);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t s = Gd.start(axis, idx);
      scan_line_backward(n, c, z + s * c, st * c, gy + s * c, st * c, a + s, st, gz + s * c, st * c, ga + s, st,
                         e.data(), fz.data(), fg.data(), Fz.data(), Fg.data());
    }
  });
}

// The axes in the order the factors apply to x: exp(M) x = W(H(T(x))); exp(M)^T x = T(H(W(x))).
inline std::array<int, 3> scan_order(bool transpose) {
  return transpose ? std::array<int, 3>{2, 1, 0} : std::array<int, 3>{0, 1, 2};
}

// y = exp(M) x (transpose: exp(M)^T x); dec[axis]: the decays of each axis (0: gamma, 1: beta, 2: alpha);
// tmp: scratch of x's size. y must not alias x or tmp.
template <typename T>
void scan3(const Grid3& Gd, const T* x, const std::array<const T*, 3>& dec, bool transpose, T* y, T* tmp) {
  const auto ax = scan_order(transpose);
  scan_pass(Gd, ax[0], x, dec[ax[0]], y);
  scan_pass(Gd, ax[1], y, dec[ax[1]], tmp);
  scan_pass(Gd, ax[2], tmp, dec[ax[2]], y);
}

// Backward of y = exp(M) x (or its transpose) for upstream gy: gx (may be null: not wanted) and the decay
// gradients gdec[axis] (decay layout). Scratch: z1, z2, g of x's size each.
template <typename T>
void scan3_backward(const Grid3& Gd, const T* x, const T* gy, const std::array<const T*, 3>& dec, bool transpose,
                    T* gx, const std::array<T*, 3>& gdec, T* z1, T* z2, T* g) {
  const auto ax = scan_order(transpose);
  scan_pass(Gd, ax[0], x, dec[ax[0]], z1);   // z1 = P0 x
  scan_pass(Gd, ax[1], z1, dec[ax[1]], z2);  // z2 = P1 z1; y = P2 z2
  scan_backward_pass(Gd, ax[2], z2, gy, dec[ax[2]], g, gdec[ax[2]]);  // g = P2 gy
  scan_backward_pass(Gd, ax[1], z1, g, dec[ax[1]], z2, gdec[ax[1]]);  // z2 <- P1 g
  scan_backward_pass(Gd, ax[0], x, z2, dec[ax[0]], gx ? gx : g, gdec[ax[0]]);
}

// ---------------------------------------------------------------------------------------------
// Prefix sums of the floored log-decays along every line (docs/ops.md "Prefix sums and biases", per axis):
// returns [B * heads, N] tensors {ca (along W), cb (along H), cg (along T)} in dtype `acc`, index bg * N + n.
// ---------------------------------------------------------------------------------------------
inline std::array<at::Tensor, 3> prefix_sums_3d(const at::Tensor& la, const at::Tensor& lb, const at::Tensor& lg,
                                                at::ScalarType acc) {
  const int64_t B = la.size(0), T = la.size(1), H = la.size(2), W = la.size(3), G = la.size(4);
  const int64_t N = T * H * W;
  const at::Tensor src[3] = {lg.to(acc).contiguous(), lb.to(acc).contiguous(), la.to(acc).contiguous()};
  std::array<at::Tensor, 3> out;  // indexed by axis below, returned as {ca, cb, cg}
  at::Tensor byaxis[3];
  for (int a = 0; a < 3; ++a) byaxis[a] = at::empty({B * G, N}, src[0].options());
  const Grid3 Gd{B, T, H, W, G, 1};
  AT_DISPATCH_FLOATING_TYPES(acc, "ppma_prefix_sums_3d", [&] {
    for (int a = 0; a < 3; ++a) {
      const scalar_t* s = src[a].data_ptr<scalar_t>();
      scalar_t* o = byaxis[a].data_ptr<scalar_t>();
      const int64_t n = Gd.size(a), st = Gd.step(a), per = N / n;
      at::parallel_for(0, Gd.count(a), 1, [&](int64_t begin, int64_t end) {
        for (int64_t idx = begin; idx < end; ++idx) {
          const int64_t s0 = Gd.start(a, idx);  // (b * N + n0) * G + g
          const int64_t bg = idx / per, g = bg % G, b = bg / G;
          const int64_t n0 = (s0 - g) / G - b * N;
          line_prefix_sums(n, s + s0, st, o + bg * N + n0, Gd.token_stride(a));
        }
      });
    }
  });
  return {byaxis[2], byaxis[1], byaxis[0]};
}

}  // namespace p3d
}  // namespace cpu
}  // namespace ppma
