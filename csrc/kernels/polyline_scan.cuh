// polyline_scan: y = L x (transpose=False: columns with log_beta, then rows with log_alpha) or L^T x
// (rows first), as products with the symmetric 1-semiseparable matrix of every line (docs/ops.md "polyline_scan").
//
// Implementation: the per-line parallel recurrence (not Mamba2's chunked SSD): one thread per
// (line, channel) runs, in fp32 (fp64 for fp64),
//   f_0 = x_0, f_t = e^{a_t} f_{t-1} + x_t            (forward sweep, f kept in a scratch buffer)
//   g_{n-1} = 0, g_t = e^{a_{t+1}} (g_{t+1} + x_{t+1}) (reverse sweep),  y_t = f_t + g_t.
// Consecutive threads take consecutive channels, so every access is coalesced along the channel dim.
// Lines are at most a few hundred long; the work is O(N c) and memory-bound.
//
// Decay gradient of one factor y = A u with upstream gy (docs/ops.md "polyline_scan"):
//   grad a_s = e^{a_s} (f_{s-1}(u) F_s(gy) + f_{s-1}(gy) F_s(u)), s >= 1, grad a_0 = 0,
//   F_t(w) = w_t + e^{a_{t+1}} F_{t+1}(w) (reverse inclusive). The per-channel terms go to `contrib`
//   and a second kernel sums them over channels in a fixed order (deterministic, no atomics).
#pragma once

#include "common.cuh"

namespace ppma {

// Line geometry of a scan pass: line index -> (b, fixed row or column, g), position t -> token.
struct ScanLine {
  int b, fixed, g;
  bool rows;
  int W;
  PPMA_HD int64_t tok(int t) const { return line_token(rows, fixed, t, W); }
};

PPMA_D ScanLine scan_line(int64_t line, const GridSizes& sz, bool rows) {
  // line = ((b * F + fixed) * G + g), F = H (rows) or W (columns): heads fastest
  const int F = rows ? sz.H : sz.W;
  ScanLine s;
  s.g = int(line % sz.G);
  const int64_t bf = line / sz.G;
  s.fixed = int(bf % F);
  s.b = int(bf / F);
  s.rows = rows;
  s.W = sz.W;
  return s;
}

template <typename T>
PPMA_D const T* feat_ptr(const T* base, const Strides4& s, int b, int g, int64_t tok, int W) {
  const int64_t i = tok / W, j = tok - i * W;
  return base + b * s.b + i * s.h + j * s.w + g * s.g;
}

template <typename in_t, typename out_t, typename acc_t>
__global__ void polyline_scan_line_kernel(ScanLineParams<in_t, out_t, acc_t> p) {
  const int C = p.sz.dv, G = p.sz.G, W = p.sz.W;
  const int64_t N = int64_t(p.sz.H) * W;
  const int64_t lines = int64_t(p.sz.B) * (p.along_rows ? p.sz.H : p.sz.W) * G;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= lines * C) return;
  const int ch = int(t % C);
  const ScanLine ln = scan_line(t / C, p.sz, p.along_rows);
  const int L = p.along_rows ? W : p.sz.H;
  auto dec = [&](int pos) { return p.decay[token_index(N, G, ln.b, ln.tok(pos), ln.g)]; };
  auto oidx = [&](int pos) { return token_index(N, G, ln.b, ln.tok(pos), ln.g) * C + ch; };
  auto xin = [&](int pos) { return acc_t(to_acc(feat_ptr(p.in, p.s_in, ln.b, ln.g, ln.tok(pos), W)[ch])); };

  acc_t f = 0;
  for (int pos = 0; pos < L; ++pos) {
    f = (pos > 0 ? fast_exp(dec(pos)) * f : acc_t(0)) + xin(pos);
    p.fbuf[oidx(pos)] = f;
  }
  acc_t gacc = 0;  // g_pos
  for (int pos = L - 1; pos >= 0; --pos) {
    const acc_t fv = p.fbuf[oidx(pos)];  // read before the (possibly aliased) write below
    p.out[oidx(pos)] = from_acc<out_t>(fv + gacc);
    if (pos > 0) gacc = fast_exp(dec(pos)) * (gacc + xin(pos));
  }
}

template <typename u_t, typename g_t, typename acc_t>
__global__ void polyline_scan_grad_kernel(ScanGradParams<u_t, g_t, acc_t> p) {
  const int C = p.sz.dv, G = p.sz.G, W = p.sz.W;
  const int64_t N = int64_t(p.sz.H) * W;
  const int64_t lines = int64_t(p.sz.B) * (p.along_rows ? p.sz.H : p.sz.W) * G;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= lines * C) return;
  const int ch = int(t % C);
  const ScanLine ln = scan_line(t / C, p.sz, p.along_rows);
  const int L = p.along_rows ? W : p.sz.H;
  auto dec = [&](int pos) { return p.decay[token_index(N, G, ln.b, ln.tok(pos), ln.g)]; };
  auto oidx = [&](int pos) { return token_index(N, G, ln.b, ln.tok(pos), ln.g) * C + ch; };
  auto uin = [&](int pos) { return acc_t(to_acc(feat_ptr(p.u, p.s_u, ln.b, ln.g, ln.tok(pos), W)[ch])); };
  auto gin = [&](int pos) { return acc_t(to_acc(feat_ptr(p.gy, p.s_gy, ln.b, ln.g, ln.tok(pos), W)[ch])); };

  acc_t fu = 0, fg = 0;
  for (int pos = 0; pos < L; ++pos) {
    const acc_t a = pos > 0 ? fast_exp(dec(pos)) : acc_t(0);
    fu = a * fu + uin(pos);
    fg = a * fg + gin(pos);
    p.fu[oidx(pos)] = fu;
    p.fg[oidx(pos)] = fg;
  }
  acc_t Fu = 0, Fg = 0;  // F_{pos}
  for (int pos = L - 1; pos >= 0; --pos) {
    const acc_t a = pos < L - 1 ? fast_exp(dec(pos + 1)) : acc_t(0);
    Fu = uin(pos) + a * Fu;
    Fg = gin(pos) + a * Fg;
    p.contrib[oidx(pos)] = pos > 0 ? p.fu[oidx(pos - 1)] * Fg + p.fg[oidx(pos - 1)] * Fu : acc_t(0);
  }
}

// grad_decay[b, tok, g] = e^{a} * sum_channels contrib (0 at line position 0); one thread per (b, tok, g).
template <typename acc_t>
__global__ void polyline_scan_grad_reduce_kernel(ScanGradParams<acc_t, acc_t, acc_t> p) {
  const int C = p.sz.dv, G = p.sz.G, W = p.sz.W;
  const int64_t N = int64_t(p.sz.H) * W;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (b * N + tok) * G + g
  if (t >= int64_t(p.sz.B) * N * G) return;
  const int64_t tok = (t / G) % N;
  const int pos = p.along_rows ? int(tok % W) : int(tok / W);
  if (pos == 0) {
    p.grad_decay[t] = 0;
    return;
  }
  const acc_t* c = p.contrib + t * C;
  acc_t s = 0;
  for (int ch = 0; ch < C; ++ch) s += c[ch];
  p.grad_decay[t] = fast_exp(p.decay[t]) * s;
}

// ---------------------------------------------------------------------------------------------
// Host-side launch helpers (no torch). Scratch: acc_t contiguous [B,H,W,heads,c] buffers.
// ---------------------------------------------------------------------------------------------
template <typename acc_t>
struct ScanScratch {
  acc_t* z = nullptr;   // first-pass output
  acc_t* gz = nullptr;  // backward: second-pass transform of grad_y
  acc_t* f = nullptr;   // forward-sweep scratch
  acc_t* fu = nullptr;
  acc_t* fg = nullptr;
  acc_t* contrib = nullptr;
};

template <typename in_t, typename out_t, typename acc_t>
inline void launch_scan_pass(const GridSizes& sz, bool rows, const in_t* in, const Strides4& s_in,
                             const acc_t* decay, acc_t* fbuf, out_t* out, cudaStream_t stream) {
  ScanLineParams<in_t, out_t, acc_t> p;
  p.sz = sz;
  p.along_rows = rows;
  p.in = in;
  p.s_in = s_in;
  p.decay = decay;
  p.fbuf = fbuf;
  p.out = out;
  const int64_t n = int64_t(sz.B) * (rows ? sz.H : sz.W) * sz.G * sz.dv;
  launch_kernel(polyline_scan_line_kernel<in_t, out_t, acc_t>, dim3(unsigned((n + 127) / 128)), dim3(128), 0, stream,
                p);
}

template <typename u_t, typename g_t, typename acc_t>
inline void launch_scan_grad(const GridSizes& sz, bool rows, const u_t* u, const Strides4& s_u, const g_t* gy,
                             const Strides4& s_gy, const acc_t* decay, const ScanScratch<acc_t>& ws,
                             acc_t* grad_decay, cudaStream_t stream) {
  ScanGradParams<u_t, g_t, acc_t> p;
  p.sz = sz;
  p.along_rows = rows;
  p.u = u;
  p.s_u = s_u;
  p.gy = gy;
  p.s_gy = s_gy;
  p.decay = decay;
  p.fu = ws.fu;
  p.fg = ws.fg;
  p.contrib = ws.contrib;
  p.grad_decay = grad_decay;
  const int64_t n = int64_t(sz.B) * (rows ? sz.H : sz.W) * sz.G * sz.dv;
  launch_kernel(polyline_scan_grad_kernel<u_t, g_t, acc_t>, dim3(unsigned((n + 127) / 128)), dim3(128), 0, stream, p);
  ScanGradParams<acc_t, acc_t, acc_t> r;
  r.sz = sz;
  r.along_rows = rows;
  r.decay = decay;
  r.contrib = ws.contrib;
  r.grad_decay = grad_decay;
  const int64_t m = int64_t(sz.B) * sz.H * sz.W * sz.G;
  launch_kernel(polyline_scan_grad_reduce_kernel<acc_t>, dim3(unsigned((m + 255) / 256)), dim3(256), 0, stream, r);
}

// y = L x (transpose=false: columns then rows) or L^T x (rows then columns). decays contiguous acc_t.
template <typename scalar_t>
inline void launch_polyline_scan_fwd(const GridSizes& sz, bool transpose, const scalar_t* x, const Strides4& sx,
                                     const typename AccType<scalar_t>::type* log_alpha,
                                     const typename AccType<scalar_t>::type* log_beta,
                                     const ScanScratch<typename AccType<scalar_t>::type>& ws, scalar_t* y,
                                     cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const bool first_rows = transpose;
  const Strides4 sc = [&] {
    Strides4 s;
    s.g = sz.dv;
    s.w = int64_t(sz.G) * sz.dv;
    s.h = int64_t(sz.W) * s.w;
    s.b = int64_t(sz.H) * s.h;
    return s;
  }();
  launch_scan_pass<scalar_t, acc_t, acc_t>(sz, first_rows, x, sx, first_rows ? log_alpha : log_beta, ws.z, ws.z,
                                           stream);
  launch_scan_pass<acc_t, scalar_t, acc_t>(sz, !first_rows, ws.z, sc, first_rows ? log_beta : log_alpha, ws.f, y,
                                           stream);
}

// Backward of y = Second(First(x)): z = First(x), gz = Second(gy), gx = First(gz);
// grad of Second's decay from (u = z, upstream gy), grad of First's decay from (u = x, upstream gz).
template <typename scalar_t>
inline void launch_polyline_scan_bwd(const GridSizes& sz, bool transpose, const scalar_t* gy, const Strides4& sgy,
                                     const scalar_t* x, const Strides4& sx,
                                     const typename AccType<scalar_t>::type* log_alpha,
                                     const typename AccType<scalar_t>::type* log_beta,
                                     const ScanScratch<typename AccType<scalar_t>::type>& ws, scalar_t* gx,
                                     typename AccType<scalar_t>::type* g_log_alpha,
                                     typename AccType<scalar_t>::type* g_log_beta, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  const bool first_rows = transpose;
  const acc_t* d_first = first_rows ? log_alpha : log_beta;
  const acc_t* d_second = first_rows ? log_beta : log_alpha;
  acc_t* g_first = first_rows ? g_log_alpha : g_log_beta;
  acc_t* g_second = first_rows ? g_log_beta : g_log_alpha;
  Strides4 sc;
  sc.g = sz.dv;
  sc.w = int64_t(sz.G) * sz.dv;
  sc.h = int64_t(sz.W) * sc.w;
  sc.b = int64_t(sz.H) * sc.h;
  launch_scan_pass<scalar_t, acc_t, acc_t>(sz, first_rows, x, sx, d_first, ws.z, ws.z, stream);
  launch_scan_pass<scalar_t, acc_t, acc_t>(sz, !first_rows, gy, sgy, d_second, ws.gz, ws.gz, stream);
  launch_scan_pass<acc_t, scalar_t, acc_t>(sz, first_rows, ws.gz, sc, d_first, ws.f, gx, stream);
  launch_scan_grad<acc_t, scalar_t, acc_t>(sz, !first_rows, ws.z, sc, gy, sgy, d_second, ws, g_second, stream);
  launch_scan_grad<scalar_t, acc_t, acc_t>(sz, first_rows, x, sx, ws.gz, sc, d_first, ws, g_first, stream);
}

}  // namespace ppma
