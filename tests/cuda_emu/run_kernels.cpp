// Runs ppma's CUDA kernels (csrc/kernels) on the CPU through the emulator in emu.h, for the tests in
// tests/test_cuda_emulation.py: polyline_attention (CUDA-core or tensor-core kernels), criss_cross_attention and
// polyline_linear_attention, forward and backward, with the same host-side sequence of launches and scratch buffers
// as the launchers in csrc/cuda/*.cu (which need torch and a GPU).
//
//   run_kernels IN OUT
// IN: int32 header[12] = {op (0 polyline_attention, 1 criss_cross_attention, 2 polyline_linear_attention), path
//     (op 0: 0 CUDA cores, 1 tensor cores, 2 tensor cores with the next forward and backward
//     (polyline_attention_tc_fwd2.cuh, _bwd2.cuh: the option cuda_next_polyline_attention); op 2: normalize 0/1
//     + 2 x kernels (0 the verified ones, 1 the next ones, polyline_linear_attention_v2.cuh, the option
//     cuda_next_polyline_linear_attention, 2 the next ones with their state in global scratch)), dtype (0 float32,
//     1 float64, 2 float16, 3 bfloat16), B, H, W, heads, d, dv, backward (0/1), layout of q and k (0 contiguous
//     [B, H, W, heads, d], 1 stored as [B, W, H, heads, d] and passed with the strides of that permutation), op 2:
//     channel slice width
//     (0: the launcher's choice) else 0}, float64 scale (op 2: eps), then float64 arrays q, k [B*H*W*heads*d],
//     v [...*dv], log_alpha, log_beta [B*H*W*heads], grad_out [...*dv] (values already rounded to dtype).
// OUT: float64 arrays out, out_v2h (polyline_attention only), lse [B*H*W*heads*2] (polyline_linear_attention: stats
//     [B*H*W*heads*2*C], C = dv + normalize), then with backward grad_q, grad_k, grad_v, grad_log_alpha,
//     grad_log_beta.
#include "emu.h"
// clang-format off
#include "criss_cross_attention.cuh"
#include "criss_cross_attention_tc.cuh"
#include "polyline_attention_fwd.cuh"
#include "polyline_attention_tc.cuh"
#include "polyline_attention_tc_bwd2.cuh"
#include "polyline_attention_tc_fwd2.cuh"
#include "polyline_linear_attention.cuh"
#include "polyline_linear_attention_v2.cuh"
// clang-format on

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

using namespace ppma;

namespace {

template <typename T>
T from_double(double x) {
  return Cast<T>::from(float(x));
}
template <>
double from_double<double>(double x) {
  return x;
}
double to_double(float x) { return x; }
double to_double(double x) { return x; }
double to_double(__half x) { return __half2float(x); }
double to_double(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
std::vector<T> convert(const std::vector<double>& a) {
  std::vector<T> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = from_double<T>(a[i]);
  return r;
}

template <typename T>
void put(std::FILE* f, const std::vector<T>& a) {
  std::vector<double> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = to_double(a[i]);
  std::fwrite(r.data(), sizeof(double), r.size(), f);
}

struct Case {
  int op, path, dtype, B, H, W, G, d, dv, bwd, layout, slice;
  double scale;
  std::vector<double> q, k, v, la, lb, go;
};

Strides4 contiguous4(const Case& c, int dim) { return contiguous_strides(c.H, c.W, c.G, dim); }

// q or k in the storage the case asks for, and its strides.
template <typename T>
std::vector<T> stored(const Case& c, const std::vector<double>& a, int dim, Strides4& s) {
  std::vector<T> r = convert<T>(a);
  if (c.layout == 0) {
    s = contiguous4(c, dim);
    return r;
  }
  std::vector<T> p(r.size());  // storage [B, W, H, G, dim]
  for (int b = 0; b < c.B; ++b)
    for (int i = 0; i < c.H; ++i)
      for (int j = 0; j < c.W; ++j)
        for (int g = 0; g < c.G; ++g)
          for (int e = 0; e < dim; ++e)
            p[((((int64_t(b) * c.W + j) * c.H + i) * c.G + g) * dim) + e] =
                r[((((int64_t(b) * c.H + i) * c.W + j) * c.G + g) * dim) + e];
  s.g = dim;
  s.h = int64_t(c.G) * dim;
  s.w = int64_t(c.H) * c.G * dim;
  s.b = int64_t(c.W) * c.H * c.G * dim;
  return p;
}

int padded(int m) { return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : m <= 128 ? 128 : m <= 256 ? 256 : 512; }

template <typename F>
void dpad_switch(int dp, F&& f) {
  switch (dp) {
    case 16: f(std::integral_constant<int, 16>()); break;
    case 32: f(std::integral_constant<int, 32>()); break;
    case 64: f(std::integral_constant<int, 64>()); break;
    case 128: f(std::integral_constant<int, 128>()); break;
    case 256: f(std::integral_constant<int, 256>()); break;
    default: f(std::integral_constant<int, 512>()); break;
  }
}

template <typename F>
void tc_switch(int dp, F&& f) {
  switch (dp) {
    case 16: f(std::integral_constant<int, 16>()); break;
    case 32: f(std::integral_constant<int, 32>()); break;
    case 64: f(std::integral_constant<int, 64>()); break;
    default: f(std::integral_constant<int, 128>()); break;
  }
}

// q, k (stored as the case asks) and v (contiguous) in the fields of an attention's Params.
template <typename P, typename T>
void bind_qkv(P& p, const Case& c, const std::vector<T>& q, const Strides4& sq, const std::vector<T>& k,
              const Strides4& sk, const std::vector<T>& v) {
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.sq = sq;
  p.sk = sk;
  p.sv = contiguous4(c, c.dv);
}

// polyline_linear_attention: the launcher's sequence (csrc/cuda/polyline_linear_attention.cu) with its workspace;
// next = 0: the verified kernels, 1: the next ones (state in shared memory where it fits, as the launcher), 2: the
// next ones with the state forced into global scratch.
template <typename T, typename A>
void run_linear(const Case& c, const GridSizes& sz, const std::vector<T>& q, const Strides4& sq,
                const std::vector<T>& k, const Strides4& sk, const std::vector<T>& v, const std::vector<A>& la,
                const std::vector<A>& lb, const std::vector<T>& go, std::FILE* out) {
  const int64_t n = int64_t(c.B) * c.H * c.W * c.G;
  const int next = c.path >> 1;
  LinearAttnParams<T, A> p;
  p.normalize = (c.path & 1) != 0;
  p.eps = A(c.scale);
  p.w.sz = sz;
  p.w.C = c.dv + (p.normalize ? 1 : 0);
  const int64_t budget = next == 2 ? 0 : kLinV2SmemBudget;
  // poisoned workspace (NaN): a read of an element no kernel wrote shows up in the results
  auto layout = [&](LinearAttnWork<A>& w, bool backward, std::vector<A>& buf) {
    LinV2Plan pl;
    if (next) {
      pl = polyline_linear_attention_v2_plan(sz, w.C, int(sizeof(A)), backward, c.slice, budget);
      buf.assign(polyline_linear_attention_v2_workspace(w, backward, pl, static_cast<A*>(nullptr)), A(NAN));
      polyline_linear_attention_v2_workspace(w, backward, pl, buf.data());
    } else {
      w.cs = c.slice > 0 ? c.slice : polyline_linear_attention_slice(w.C);
      buf.assign(polyline_linear_attention_workspace(w, backward, static_cast<A*>(nullptr)), A(NAN));
      polyline_linear_attention_workspace(w, backward, buf.data());
    }
    return pl;
  };
  bind_qkv(p, c, q, sq, k, sk, v);
  p.log_alpha = la.data();
  p.log_beta = lb.data();
  p.sa = p.sb = contiguous4(c, 1);
  std::vector<T> o(n * c.dv), dq(n * c.d), dk(n * c.d), dv(n * c.dv);
  std::vector<A> stats(n * 2 * p.w.C), gla(n), glb(n);
  p.out = o.data();
  p.w.stats = stats.data();
  std::vector<A> work;
  const LinV2Plan fwd_plan = layout(p.w, false, work);
  if (next)
    launch_polyline_linear_attention_v2_fwd(p, fwd_plan, nullptr);
  else
    launch_polyline_linear_attention_fwd(p, nullptr);
  put(out, o);
  put(out, stats);
  if (!c.bwd) return;
  LinearAttnParams<T, A> b = p;
  b.dout = go.data();
  b.sdo = contiguous4(c, c.dv);
  b.dq = dq.data();
  b.dk = dk.data();
  b.dv = dv.data();
  b.g_log_alpha = gla.data();
  b.g_log_beta = glb.data();
  std::vector<A> bwork;
  const LinV2Plan bwd_plan = layout(b.w, true, bwork);
  if (next)
    launch_polyline_linear_attention_v2_bwd(b, bwd_plan, nullptr);
  else
    launch_polyline_linear_attention_bwd(b, nullptr);
  put(out, dq);
  put(out, dk);
  put(out, dv);
  put(out, gla);
  put(out, glb);
}

// polyline_attention path 2: the launcher's backward under cuda_next_polyline_attention = 1. The row-uniform
// kernels write every entry of the cross-term tables, so there the tables start poisoned (NaN) instead of zeroed:
// an entry they missed shows up in the decay gradients.
template <typename T, typename A>
void run_tc_bwd_next(PolylineAttnParams<T, A>& p, int dp, std::vector<A>& tabs) {
  if constexpr (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value) {
    if (polyline_attention_tc_next_covers(p.sz.W)) std::fill(tabs.begin(), tabs.end(), A(NAN));
    tc_switch(dp, [&](auto D) { launch_polyline_attention_tc_bwd_next<T, D()>(p, nullptr); });
  } else {
    throw std::runtime_error("the tensor-core path takes float16 / bfloat16");
  }
}

// criss_cross_attention's launch sequence by path: 0 the verified kernels (launch_criss_cross_fwd / _bwd), 1 the
// tensor-core kernels (criss_cross_attention_tc.cuh, fp16 / bf16; directions whose lines do not fit them run the
// verified kernels, as in the launcher) with fp32 scratch, 2 the same with 16-bit scratch z16 where
// criss_cross_tc_scratch16 holds (as the launcher allocates it; the fp32 maps it replaces are poisoned with NaN).
template <typename T, typename A>
void criss_cross_fwd(int path, int dp, const CrissCrossParams<T, A>& p, T* z16) {
  if (path == 1 || path == 2) {
    if constexpr (sizeof(T) == 2) {
      dpad_switch(dp, [&](auto D) { launch_criss_cross_tc_fwd<T, D()>(p, nullptr, path == 2 ? z16 : nullptr); });
      return;
    }
    throw std::runtime_error("the tensor-core criss_cross_attention takes float16 / bfloat16");
  }
  dpad_switch(dp, [&](auto D) { launch_criss_cross_fwd<T, D()>(p, nullptr); });
}

template <typename T, typename A>
void criss_cross_bwd(int path, int dp, const CrissCrossParams<T, A>& p, T* z16) {
  if (path == 1 || path == 2) {
    if constexpr (sizeof(T) == 2) {
      dpad_switch(dp, [&](auto D) { launch_criss_cross_tc_bwd<T, D()>(p, nullptr, path == 2 ? z16 : nullptr); });
      return;
    }
    throw std::runtime_error("the tensor-core criss_cross_attention takes float16 / bfloat16");
  }
  dpad_switch(dp, [&](auto D) { launch_criss_cross_bwd<T, D()>(p, nullptr); });
}

template <typename T>
void run(const Case& c, std::FILE* out) {
  using A = typename AccType<T>::type;
  GridSizes sz;
  sz.B = c.B;
  sz.H = c.H;
  sz.W = c.W;
  sz.G = c.G;
  sz.d = c.d;
  sz.dv = c.dv;
  const int64_t N = int64_t(c.H) * c.W, BG = int64_t(c.B) * c.G, rows = BG * N;
  Strides4 sq, sk;
  const std::vector<T> q = stored<T>(c, c.q, c.d, sq), k = stored<T>(c, c.k, c.d, sk);
  const std::vector<T> v = convert<T>(c.v), go = convert<T>(c.go);
  std::vector<A> la(c.la.begin(), c.la.end()), lb(c.lb.begin(), c.lb.end());  // as the launchers: .to(acc)
  if (c.op == 2) return run_linear<T>(c, sz, q, sq, k, sk, v, la, lb, go, out);  // no prefix sums
  std::vector<A> cr(rows), cc(rows);
  {
    PrefixParams<A> pp;
    pp.sz = sz;
    pp.log_alpha = la.data();
    pp.log_beta = lb.data();
    pp.sa = pp.sb = contiguous_strides(c.H, c.W, c.G, 1);
    pp.cr = cr.data();
    pp.cc = cc.data();
    const int64_t n = BG * (c.H + c.W);
    launch_kernel(prefix_sums_kernel<A>, dim3(unsigned((n + 127) / 128)), dim3(128), 0, nullptr, pp);
  }
  const int dp = padded(c.d > c.dv ? c.d : c.dv);
  std::vector<T> o(rows * c.dv), ov(rows * c.dv), dq(rows * c.d), dk(rows * c.d), dv(rows * c.dv);
  std::vector<A> lse(rows * 2), gla(rows), glb(rows);

  auto set_inputs = [&](auto& p) {
    p.sz = sz;
    p.scale = A(c.scale);
    bind_qkv(p, c, q, sq, k, sk, v);
    p.cr = cr.data();
    p.cc = cc.data();
  };

  if (c.op == 0) {
    PolylineAttnParams<T, A> p;
    set_inputs(p);
    p.out = o.data();
    p.out_v2h = ov.data();
    p.lse = lse.data();
    int tile = 0;
    if (c.path == 1 || c.path == 2) {
      if constexpr (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value) {
        tc_switch(dp, [&](auto D) {
          if (c.path == 2)  // the launcher's forward under cuda_next_polyline_attention = 1
            launch_polyline_attention_tc_fwd_next<T, D()>(p, nullptr);
          else
            launch_polyline_attention_tc_fwd<T, D()>(p, nullptr);
          tile = polyline_attention_tc_bwd_tile<D()>();
        });
      } else {
        throw std::runtime_error("the tensor-core path takes float16 / bfloat16");
      }
    } else {
      dpad_switch(dp, [&](auto D) {
        launch_polyline_attention_fwd<T, D()>(p, nullptr);
        tile = polyline_attention_bwd_tile<T, D()>();
      });
    }
    put(out, o);
    put(out, ov);
    put(out, lse);
    if (!c.bwd) return;
    const RowTiling tl(c.H, c.W, tile);
    std::vector<A> delta(rows * 2), own(4 * rows), tabs(4 * BG * int64_t(tl.num_ctas) * tl.table, A(0));
    p.dout = go.data();
    p.sdo = contiguous4(c, c.dv);
    p.out_c = o.data();
    p.out_v2h_c = ov.data();
    p.delta = delta.data();
    p.dq = dq.data();
    p.dk = dk.data();
    p.dv = dv.data();
    p.gq_cr = own.data();
    p.gq_cc = own.data() + rows;
    p.gk_cr = own.data() + 2 * rows;
    p.gk_cc = own.data() + 3 * rows;
    const int64_t ts = BG * int64_t(tl.num_ctas) * tl.table;
    p.x1_cr = tabs.data();
    p.x1_cc = tabs.data() + ts;
    p.x2_cr = tabs.data() + 2 * ts;
    p.x2_cc = tabs.data() + 3 * ts;
    p.g_log_alpha = gla.data();
    p.g_log_beta = glb.data();
    if (c.path == 2) {
      run_tc_bwd_next(p, dp, tabs);
    } else if (c.path == 1) {
      if constexpr (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value)
        tc_switch(dp, [&](auto D) { launch_polyline_attention_tc_bwd<T, D()>(p, nullptr); });
    } else {
      dpad_switch(dp, [&](auto D) { launch_polyline_attention_bwd<T, D()>(p, nullptr); });
    }
  } else {
    CrissCrossParams<T, A> p;
    set_inputs(p);
    std::vector<A> scratch(3 * rows * c.dv);
    p.out = o.data();
    p.lse = lse.data();
    p.z1 = scratch.data();
    p.z2 = scratch.data() + rows * c.dv;
    p.out1 = scratch.data() + 2 * rows * c.dv;
    std::vector<T> z16(4 * rows * c.dv);
    if (c.path == 2 && criss_cross_tc_scratch16<T>(p.sz, dp)) {  // the fp32 maps the 16-bit scratch replaces
      std::fill(scratch.begin(), scratch.begin() + 2 * rows * c.dv, A(NAN));
    }
    criss_cross_fwd(c.path, dp, p, z16.data());
    put(out, o);
    put(out, lse);
    if (!c.bwd) return;
    std::vector<A> tok(3 * rows), sv(6 * rows * c.dv), sd(4 * rows * c.d);
    p.dout = go.data();
    p.sdo = contiguous4(c, c.dv);
    const int64_t mv = rows * c.dv, md = rows * c.d;
    p.z1 = sv.data();
    p.z2 = sv.data() + mv;
    p.gz1 = sv.data() + 2 * mv;
    p.gz2 = sv.data() + 3 * mv;
    p.gv_c = sv.data() + 4 * mv;
    p.gv_r = sv.data() + 5 * mv;
    p.dq_c = sd.data();
    p.dk_c = sd.data() + md;
    p.dq_r = sd.data() + 2 * md;
    p.dk_r = sd.data() + 3 * md;
    p.delta = tok.data();
    p.g_cr = tok.data() + rows;
    p.g_cc = tok.data() + 2 * rows;
    p.dq = dq.data();
    p.dk = dk.data();
    p.dv = dv.data();
    p.g_log_alpha = gla.data();
    p.g_log_beta = glb.data();
    if (c.path == 2 && criss_cross_tc_scratch16<T>(p.sz, dp)) {
      std::fill(sv.begin(), sv.begin() + 4 * mv, A(NAN));
      std::fill(sv.begin() + 5 * mv, sv.end(), A(NAN));  // gv_r
      std::fill(sd.begin() + 2 * md, sd.end(), A(NAN));  // dq_r, dk_r
    }
    criss_cross_bwd(c.path, dp, p, z16.data());
  }
  put(out, dq);
  put(out, dk);
  put(out, dv);
  put(out, gla);
  put(out, glb);
}

std::vector<double> read_doubles(std::FILE* f, int64_t n) {
  std::vector<double> a(n);
  if (int64_t(std::fread(a.data(), sizeof(double), n, f)) != n) throw std::runtime_error("short input file");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: run_kernels IN OUT\n");
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  int32_t h[12];
  Case c;
  if (std::fread(h, sizeof(int32_t), 12, in) != 12 || std::fread(&c.scale, sizeof(double), 1, in) != 1) return 2;
  c.op = h[0];
  c.path = h[1];
  c.dtype = h[2];
  c.B = h[3];
  c.H = h[4];
  c.W = h[5];
  c.G = h[6];
  c.d = h[7];
  c.dv = h[8];
  c.bwd = h[9];
  c.layout = h[10];
  c.slice = h[11];
  const int64_t n = int64_t(c.B) * c.H * c.W * c.G;
  c.q = read_doubles(in, n * c.d);
  c.k = read_doubles(in, n * c.d);
  c.v = read_doubles(in, n * c.dv);
  c.la = read_doubles(in, n);
  c.lb = read_doubles(in, n);
  c.go = read_doubles(in, n * c.dv);
  std::fclose(in);
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  try {
    switch (c.dtype) {
      case 0: run<float>(c, out); break;
      case 1: run<double>(c, out); break;
      case 2: run<__half>(c, out); break;
      default: run<__nv_bfloat16>(c, out); break;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "run_kernels: %s\n", e.what());
    return 1;
  }
  std::fclose(out);
  std::fprintf(stderr, "emulated context switches: %lld\n", emu::m().switches);
  return 0;
}
