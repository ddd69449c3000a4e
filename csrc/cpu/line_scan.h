// The 1-D linear-time scan of one line and its backward (docs/ops.md "polyline_scan"; paper Algorithm 1), shared by
// the 2-D polyline_scan (csrc/cpu/polyline_scan.cpp) and the 3-D ops (csrc/cpu/polyline_3d.h).
//
// One line of n positions with log-decays a_0..a_{n-1} (a_0 unused) and A_ts = exp(c_max - c_min):
//   y = A x:  f_0 = x_0, f_t = e^{a_t} f_{t-1} + x_t;  g_{n-1} = 0, g_t = e^{a_{t+1}} (g_{t+1} + x_{t+1});
//             y = f + g.
//   backward: A is symmetric, so grad_x = A grad_y; with F_t(u) = sum_{i >= t} A_ti u_i,
//             grad a_s = e^{a_s} (f_{s-1}(x) . F_s(gy) + f_{s-1}(gy) . F_s(x)) for s >= 1, grad a_0 = 0.
// Torch-free; rows of c contiguous values at the given strides. The loops vectorise at the lane width of the
// caller's with_lanes() (cpu/simd.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/simd.h"

namespace ppma {
namespace cpu {

// y = A x along one line. x / y rows (c contiguous values) at stride xs / ys; decays at stride as.
// e: scratch [n]; g: scratch [c]. y must not alias x.
template <typename T>
void scan_line(int64_t n, int64_t c, const T* x, int64_t xs, const T* a, int64_t as, T* y, int64_t ys, T* e,
               T* g) {
  for (int64_t t = 1; t < n; ++t) e[t] = std::exp(a[t * as]);
  std::copy(x, x + c, y);
  for (int64_t t = 1; t < n; ++t) {
    const T et = e[t];
    const T* xt = x + t * xs;
    const T* yp = y + (t - 1) * ys;
    T* yt = y + t * ys;
#pragma omp simd
    for (int64_t u = 0; u < c; ++u) yt[u] = et * yp[u] + xt[u];
  }
  std::fill(g, g + c, T(0));
  for (int64_t t = n - 2; t >= 0; --t) {
    const T en = e[t + 1];
    const T* xn = x + (t + 1) * xs;
    T* yt = y + t * ys;
#pragma omp simd
    for (int64_t u = 0; u < c; ++u) {
      g[u] = en * (g[u] + xn[u]);
      yt[u] += g[u];
    }
  }
}

// Backward of y = A z along one line: gz = A gy, ga[s] (stride gas) = gradient of the log-decay a_s.
// Scratch: e [n], fz, fg [n * c], Fz, Fg [c].
template <typename T>
void scan_line_backward(int64_t n, int64_t c, const T* z, int64_t zs, const T* gy, int64_t gys, const T* a,
                        int64_t as, T* gz, int64_t gzs, T* ga, int64_t gas, T* e, T* fz, T* fg, T* Fz, T* Fg) {
  for (int64_t t = 1; t < n; ++t) e[t] = std::exp(a[t * as]);
  std::copy(z, z + c, fz);
  std::copy(gy, gy + c, fg);
  for (int64_t t = 1; t < n; ++t) {
    const T et = e[t];
    const T* zt = z + t * zs;
    const T* gt = gy + t * gys;
    T* fzt = fz + t * c;
    T* fgt = fg + t * c;
#pragma omp simd
    for (int64_t u = 0; u < c; ++u) {
      fzt[u] = et * fzt[u - c] + zt[u];
      fgt[u] = et * fgt[u - c] + gt[u];
    }
  }
  for (int64_t t = n - 1; t >= 0; --t) {
    const T* zt = z + t * zs;
    const T* gt = gy + t * gys;
    if (t == n - 1) {
      std::copy(zt, zt + c, Fz);
      std::copy(gt, gt + c, Fg);
    } else {
      const T en = e[t + 1];
#pragma omp simd
      for (int64_t u = 0; u < c; ++u) {
        Fz[u] = zt[u] + en * Fz[u];
        Fg[u] = gt[u] + en * Fg[u];
      }
    }
    T* gzt = gz + t * gzs;
    const T* fgt = fg + t * c;
#pragma omp simd
    for (int64_t u = 0; u < c; ++u) gzt[u] = fgt[u] + Fg[u] - gt[u];
    if (t >= 1) {
      ga[t * gas] = e[t] * (dot(c, fz + (t - 1) * c, Fg) + dot(c, fg + (t - 1) * c, Fz));
    }
  }
  ga[0] = T(0);
}

}  // namespace cpu
}  // namespace ppma
