// CPU kernels of ppma::path_decay (docs/ops.md "path_decay"): the per-token log-decays of PPMA (paper §3.2, the
// Mamba2 Δ/A parametrisation of the decay factors; docs/model.md §1.4) in one pass over the features, and their
// backward in one more. For every token t, head g (C = G * hd channels, head g's slice x_g) and direction c < D:
//   z[t, g, c] = <x_g, weight[c]> + dt_bias[g],   d[t, g, c] = softplus(z) * A[g]     (A = -exp(A_log) <= 0)
// softplus as torch's (threshold 20: z itself above it). The backward, given gd = dL/dd:
//   gu = gd * A * sigmoid(z);  grad_x_g = sum_c gu[c] weight[c];  grad_weight[c] = sum_{t, g} gu[c] x_g;
//   grad_dt_bias[g] = sum_{t, c} gu;  grad_A[g] = sum_{t, c} gd * softplus(z).
// torch runs this as a GEMM with 2 output columns (slow: a few GMAC/s), a broadcast add, softplus, a multiplication,
// and in the backward the same again with two strided reductions for dt_bias and A: about 4 ms forward and backward
// at PPMA-T's stage 1 (b8 at 224², 2 threads) against a fraction of a millisecond here.
//
// float: the dots and the per-token elementwise work at the lane width of the SIMD path (softplus and sigmoid from
// fast_exp and log1p_unit, cpu/simd.h: max(z, 0) + log1p(exp(-|z|)), within a few float32 roundings of torch's
// log1p(exp(z)); below z = -87.3 exp(-|z|) is 0, so softplus is 0 where torch returns a denormal). double: the
// formula with std::exp and std::log1p (the gradcheck path). Tokens run in fixed chunks; the backward's sums go to a
// partial buffer per chunk, reduced in chunk order afterwards: the results do not depend on the thread count.
//
// bf16 x (CPU bf16 autocast, docs/ops.md "path_decay"): x bf16 with float32 weight, dt_bias and A (and a float32
// grad_out), the formula autocast runs (ppma.ops.reference.path_decay_ref under torch.autocast): its linear layer
// rounds the weight to bf16, sums the products in float32 and rounds u = <x_g, weight[c]> to bf16 once; z = u +
// dt_bias, softplus and the scaling are float32. Here x is widened as it is read, the weight rounded to bf16 once per
// call, u summed in float32 (in this kernel's order, so u is autocast's up to a sum that lands on the other side of a
// bf16 rounding boundary) and rounded to bf16 once; the rest is the float path. The output is float32. Backward: gu
// is rounded to bf16 before the products of grad_x and grad_weight, as autocast's backward does (the linear layer's
// gradient is that of its bf16 output: torch casts gu to bf16); grad_x_g = sum_c bf16(gu[c]) bf16(weight[c]) in
// float32, rounded to bf16 once; grad_weight[c] = sum bf16(gu[c]) x_g, float32 sums (autocast's is that sum rounded
// to bf16); grad_dt_bias from the float32 gu (autocast's addition is float32) and grad_A float32, all in the same
// fixed chunks.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "cpu/simd.h"
#include "cpu/utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace ppma {
namespace cpu {
namespace {

// Tokens per task: the unit of the backward's partial sums (fixed, so the sums' order is the shapes' alone).
constexpr int64_t kChunk = 256;
// Tokens whose softplus runs as one array (a multiple of nothing in particular: 32 tokens of G * D values).
constexpr int64_t kBlock = 32;
// The most directions (D) a decay has: alpha and beta in 2-D, and gamma along T in 3-D (docs/video.md).
constexpr int64_t kMaxDirections = 3;
constexpr float kThreshold = 20.0f;  // torch's softplus threshold (beta = 1)

// v rounded to bf16 (to nearest even) and widened back.
inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// x's element types: float, double, or the bits of bf16 (uint16_t, widened to float exactly as they are read by
// load_map); grad_x is stored in x's type (store_map: a bf16 value rounded once, to nearest even).
template <typename X>
constexpr bool kBf16 = std::is_same_v<X, uint16_t>;

struct DecayShape {
  int64_t T, G, hd, D;  // tokens, heads, channels per head, directions
};

// sp = softplus(z), s = sigmoid(z) (torch's softplus_backward factor; 1 above the threshold) of n values, float at
// the path's lane width.
template <int L>
PPMA_SIMD_INLINE void softplus_sigmoid(Lanes<L> ln, int64_t n, const float* __restrict z, float* __restrict sp,
                                       float* __restrict sg) {
  for_lanes(ln, n, [&](auto lm, int64_t e) {
    constexpr int M = decltype(lm)::value;
    using V = vec<M>;
    const V zv = load<M>(z + e);
    const V neg = zv < 0.0f ? zv : -zv;           // -|z|
    const V t = fast_exp<M>(neg);                 // exp(-|z|) in [0, 1]
    const V pos = zv > 0.0f ? zv : V{};           // max(z, 0)
    const auto above = zv > kThreshold;
    const V soft = pos + log1p_unit<M>(t);
    const V inv = 1.0f / (1.0f + t);
    const V sig = zv >= 0.0f ? inv : t * inv;
    store<M>(sp + e, above ? zv : soft);
    if (sg) store<M>(sg + e, above ? V{} + 1.0f : sig);
  });
}

template <typename T>
inline void softplus_sigmoid_scalar(int64_t n, const T* z, T* sp, T* sg) {
  for (int64_t e = 0; e < n; ++e) {
    const T ez = std::exp(z[e]);
    const bool above = z[e] > T(kThreshold);
    sp[e] = above ? z[e] : std::log1p(ez);
    if (sg) sg[e] = above ? T(1) : ez / (ez + T(1));
  }
}

// z[g * D + c] = <x_g, w[c]> + dt_bias[g] for one token; a bf16 x: u = <x_g, w[c]> (w rounded to bf16 by the
// caller) rounded to bf16 once before dt_bias is added, as autocast's bf16 linear layer returns it.
template <int L, typename T, typename X>
PPMA_SIMD_INLINE void token_logits(Lanes<L> ln, const DecayShape& S, const X* __restrict x, const T* __restrict w,
                                   const T* __restrict dt_bias, T* __restrict z) {
  for (int64_t g = 0; g < S.G; ++g)
    for (int64_t c = 0; c < S.D; ++c) {
      T u = dot_lanes(ln, S.hd, x + g * S.hd, w + c * S.hd);
      if constexpr (kBf16<X>) u = round_bf16(u);
      z[g * S.D + c] = u + dt_bias[g];
    }
}

template <int L, typename T>
PPMA_SIMD_INLINE void softplus_sigmoid_any(Lanes<L> ln, int64_t n, const T* z, T* sp, T* sg) {
  if constexpr (std::is_same_v<T, float>) {
    softplus_sigmoid(ln, n, z, sp, sg);
  } else {
    softplus_sigmoid_scalar(n, z, sp, sg);
  }
}

// out[t, g, c] = softplus(z) * A[g] for the tokens [t0, t1), kBlock tokens at a time: the block's logits first,
// then softplus over all of them in whole vectors (one token's G * D values alone would leave the exp and log
// polynomials' dependency chains unoverlapped). Ar: A[g] repeated D times (G * D).
template <int L, typename T, typename X>
PPMA_SIMD_INLINE void forward_chunk(Lanes<L> ln, const DecayShape& S, const X* x, const T* w, const T* dt_bias,
                                    const T* Ar, int64_t t0, int64_t t1, T* out) {
  const int64_t C = S.G * S.hd, GD = S.G * S.D;
  for (int64_t b0 = t0; b0 < t1; b0 += kBlock) {
    const int64_t nt = std::min(kBlock, t1 - b0);
    T* o = out + b0 * GD;
    for (int64_t t = 0; t < nt; ++t) token_logits(ln, S, x + (b0 + t) * C, w, dt_bias, o + t * GD);
    softplus_sigmoid_any(ln, nt * GD, o, o, static_cast<T*>(nullptr));
    for (int64_t t = 0; t < nt; ++t) {
      T* ot = o + t * GD;
#pragma omp simd
      for (int64_t j = 0; j < GD; ++j) ot[j] *= Ar[j];
    }
  }
}

// The tokens [t0, t1), kBlock at a time as the forward: grad_x written; the chunk's sums added to
// part = [gw (D * hd), g_dt_bias (G), g_A (G)]. scratch: 3 * kBlock * G * D + 2 * G * D. A bf16 x: w is the weight
// rounded to bf16, and gu is rounded to bf16 for grad_x and grad_weight (not for grad_dt_bias).
template <int L, typename T, typename X>
PPMA_SIMD_INLINE void backward_chunk(Lanes<L> ln, const DecayShape& S, const T* gd, const X* x, const T* w,
                                     const T* dt_bias, const T* Ar, int64_t t0, int64_t t1, X* gx, T* part,
                                     T* scratch) {
  const int64_t C = S.G * S.hd, GD = S.G * S.D, hd = S.hd, D = S.D;
  T* z = scratch;               // logits, then gu = gd * A * sigmoid(z)
  T* sp = z + kBlock * GD;      // softplus(z), then gd * softplus(z)
  T* sg = sp + kBlock * GD;     // sigmoid(z)
  T* sum_u = sg + kBlock * GD;  // per (g, c): the chunk's sums of gu and of gd * softplus(z)
  T* sum_a = sum_u + GD;
  std::fill(sum_u, sum_u + 2 * GD, T(0));
  T* gw = part;
  T* gdt = gw + D * hd;
  T* gA = gdt + S.G;
  for (int64_t b0 = t0; b0 < t1; b0 += kBlock) {
    const int64_t nt = std::min(kBlock, t1 - b0);
    for (int64_t t = 0; t < nt; ++t) token_logits(ln, S, x + (b0 + t) * C, w, dt_bias, z + t * GD);
    softplus_sigmoid_any(ln, nt * GD, z, sp, sg);
    for (int64_t t = 0; t < nt; ++t) {
      const T* gt = gd + (b0 + t) * GD;
      T* zt = z + t * GD;
      T* st = sp + t * GD;
      const T* ht = sg + t * GD;
      if constexpr (kBf16<X>) {
#pragma omp simd
        for (int64_t j = 0; j < GD; ++j) {
          const T u = gt[j] * Ar[j] * ht[j];
          st[j] = gt[j] * st[j];
          sum_u[j] += u;
          sum_a[j] += st[j];
          zt[j] = round_bf16(u);  // the bf16 gradient of autocast's linear output
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < GD; ++j) {
          zt[j] = gt[j] * Ar[j] * ht[j];
          st[j] = gt[j] * st[j];
          sum_u[j] += zt[j];
          sum_a[j] += st[j];
        }
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      // Lane blocks of a head's channels: grad_weight's sums over the block's tokens and heads in registers (added
      // to part once per block), grad_x from the block's weight vectors.
      for_lanes(ln, hd, [&](auto lm, int64_t e) {
        constexpr int M = decltype(lm)::value;
        using V = vec<M>;
        V wv[kMaxDirections] = {};  // (D >= 1 of them set; zeroed so that GCC sees no uninitialised read)
        for (int64_t c = 0; c < D; ++c) {
          wv[c] = load<M>(w + c * hd + e);
          V acc{};
          for (int64_t t = 0; t < nt; ++t)
            for (int64_t g = 0; g < S.G; ++g) acc += z[t * GD + g * D + c] * load_map<M>(x + (b0 + t) * C + g * hd + e);
          store<M>(gw + c * hd + e, load<M>(gw + c * hd + e) + acc);
        }
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t g = 0; g < S.G; ++g) {
            const float* gu = z + t * GD + g * D;
            V v = wv[0] * gu[0];
            for (int64_t c = 1; c < D; ++c) v += wv[c] * gu[c];
            store_map<M>(gx + (b0 + t) * C + g * hd + e, v);
          }
      });
    } else {  // double
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < S.G; ++g) {
          const T* gu = z + t * GD + g * D;
          const T* xg = x + (b0 + t) * C + g * hd;
          T* gxg = gx + (b0 + t) * C + g * hd;
          for (int64_t e = 0; e < hd; ++e) {
            T v = gu[0] * w[e];
            for (int64_t c = 1; c < D; ++c) v += gu[c] * w[c * hd + e];
            gxg[e] = v;
          }
          for (int64_t c = 0; c < D; ++c)
            for (int64_t e = 0; e < hd; ++e) gw[c * hd + e] += gu[c] * xg[e];
        }
    }
  }
  for (int64_t g = 0; g < S.G; ++g)
    for (int64_t c = 0; c < D; ++c) {
      gdt[g] += sum_u[g * D + c];
      gA[g] += sum_a[g * D + c];
    }
}

constexpr const char* kOp = "ppma::path_decay";
constexpr const char* kOpBwd = "ppma::path_decay_backward";

// x [..., C] (float32 / float64, or bfloat16), weight [D, hd] with C = G * hd, dt_bias and A [G], all of x's dtype
// (float32 for a bfloat16 x).
DecayShape check_decay_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& dt_bias, const at::Tensor& A) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., C], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32, float64 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= 1 && weight.size(0) <= kMaxDirections && weight.size(1) >= 1,
              op, ": weight must be [D, head_dim] with 1 <= D <= ", kMaxDirections, ", got shape ", weight.sizes());
  TORCH_CHECK(dt_bias.dim() == 1 && dt_bias.size(0) >= 1, op, ": dt_bias must be [heads], got shape ",
              dt_bias.sizes());
  TORCH_CHECK(A.dim() == 1 && A.size(0) == dt_bias.size(0), op, ": A must be [heads] = [", dt_bias.size(0),
              "], got shape ", A.sizes());
  const int64_t G = dt_bias.size(0), hd = weight.size(1), C = x.size(-1);
  TORCH_CHECK(C == G * hd, op, ": x's last dim must be heads * head_dim = ", G, " * ", hd, " = ", G * hd,
              ", got shape ", x.sizes());
  check_param_like(op, "weight", weight, "x", x);
  check_param_like(op, "dt_bias", dt_bias, "x", x);
  check_param_like(op, "A", A, "x", x);
  return {C > 0 ? x.numel() / C : 0, G, hd, weight.size(0)};
}

// The dtype of the output and of the sums: x's, float32 for a bf16 x.
at::ScalarType math_type(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? at::kFloat : x.scalar_type();
}

// A[g] repeated for each direction: [G * D].
template <typename T>
std::vector<T> repeated(const T* A, const DecayShape& S) {
  std::vector<T> r(S.G * S.D);
  for (int64_t j = 0; j < S.G * S.D; ++j) r[j] = A[j / S.D];
  return r;
}

// The weight [D * hd] as the products see it: a bf16 x's rounded to bf16 (autocast's linear layer casts it).
template <typename T, typename X>
std::vector<T> weight_as_read(const at::Tensor& wc, const DecayShape& S) {
  const T* w = wc.data_ptr<T>();
  std::vector<T> r(w, w + S.D * S.hd);
  if constexpr (kBf16<X>) {
    for (auto& v : r) v = round_bf16(v);
  }
  return r;
}

std::vector<int64_t> out_shape(const at::Tensor& x, const DecayShape& S) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(S.G);
  shape.push_back(S.D);
  return shape;
}

// The forward over every chunk: x of X (T, or bf16 bits with T = float), the rest contiguous tensors of T.
template <typename T, typename X>
void run_forward(const DecayShape& S, const at::Tensor& xc, const at::Tensor& wc, const at::Tensor& bc,
                 const at::Tensor& ac, at::Tensor& out) {
  const X* xp = elements<X>(xc);
  const T *bp = bc.data_ptr<T>(), *ap = ac.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const std::vector<T> wr = weight_as_read<T, X>(wc, S);
  const T* wp = wr.data();
  const std::vector<T> Ar = repeated(ap, S);
  at::parallel_for(0, ceil_div(S.T, kChunk), 1, [&](int64_t c0, int64_t c1) {
    with_lanes([&](auto ln) {
      forward_chunk(ln, S, xp, wp, bp, Ar.data(), c0 * kChunk, std::min(S.T, c1 * kChunk), op);
    });
  });
}

// The backward over every chunk, each chunk's sums in its row of part [nchunk, part_size] (of T); gx of X.
template <typename T, typename X>
void run_backward(const DecayShape& S, const at::Tensor& gc, const at::Tensor& xc, const at::Tensor& wc,
                  const at::Tensor& bc, const at::Tensor& ac, at::Tensor& gx, at::Tensor& part) {
  const int64_t nchunk = ceil_div(S.T, kChunk), part_size = part.size(1);
  const T* gp = gc.data_ptr<T>();
  const X* xp = elements<X>(xc);
  const T *bp = bc.data_ptr<T>(), *ap = ac.data_ptr<T>();
  X* gxp = elements<X>(gx);
  T* pp = part.data_ptr<T>();
  const std::vector<T> wr = weight_as_read<T, X>(wc, S);
  const T* wp = wr.data();
  const std::vector<T> Ar = repeated(ap, S);
  at::parallel_for(0, nchunk, 1, [&](int64_t c0, int64_t c1) {
    std::vector<T> scratch((3 * kBlock + 2) * S.G * S.D);
    with_lanes([&](auto ln) {
      for (int64_t ch = c0; ch < c1; ++ch)
        backward_chunk(ln, S, gp, xp, wp, bp, Ar.data(), ch * kChunk, std::min(S.T, (ch + 1) * kChunk), gxp,
                       pp + ch * part_size, scratch.data());
    });
  });
}

at::Tensor path_decay_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& dt_bias,
                          const at::Tensor& A) {
  const DecayShape S = check_decay_inputs(kOp, x, weight, dt_bias, A);
  at::Tensor out = at::empty(out_shape(x, S), x.options().dtype(math_type(x)));
  if (S.T == 0) return out;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = dt_bias.contiguous(), ac = A.contiguous();
  if (x.scalar_type() == at::kBFloat16) {
    run_forward<float, uint16_t>(S, xc, wc, bc, ac, out);
  } else {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ppma_path_decay_cpu", [&] {
      run_forward<scalar_t, scalar_t>(S, xc, wc, bc, ac, out);
    });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> path_decay_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& dt_bias,
    const at::Tensor& A) {
  const DecayShape S = check_decay_inputs(kOpBwd, x, weight, dt_bias, A);
  const auto shape = out_shape(x, S);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(shape), kOpBwd, ": grad_out must be ", at::IntArrayRef(shape),
              ", got shape ", grad_out.sizes());
  TORCH_CHECK(grad_out.device() == x.device(), kOpBwd, ": grad_out is on ", grad_out.device(), " but x is on ",
              x.device());
  const at::ScalarType mt = math_type(x);
  at::Tensor gx = at::empty(x.sizes(), x.options());  // a bf16 x's gradient in bf16
  const int64_t nchunk = ceil_div(S.T, kChunk), part_size = S.D * S.hd + 2 * S.G;
  at::Tensor part = at::zeros({std::max<int64_t>(nchunk, 1), part_size}, x.options().dtype(mt));
  if (S.T > 0) {
    const at::Tensor gc = grad_out.to(mt).contiguous(), xc = x.contiguous();
    const at::Tensor wc = weight.contiguous(), bc = dt_bias.contiguous(), ac = A.contiguous();
    if (x.scalar_type() == at::kBFloat16) {
      run_backward<float, uint16_t>(S, gc, xc, wc, bc, ac, gx, part);
    } else {
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ppma_path_decay_backward_cpu", [&] {
        run_backward<scalar_t, scalar_t>(S, gc, xc, wc, bc, ac, gx, part);
      });
    }
  }
  // The chunks' partial sums added in chunk order.
  at::Tensor total = at::zeros({part_size}, part.options());
  AT_DISPATCH_FLOATING_TYPES(mt, "ppma_path_decay_backward_sums", [&] {
    const scalar_t* pp = part.data_ptr<scalar_t>();
    scalar_t* tp = total.data_ptr<scalar_t>();
    for (int64_t ch = 0; ch < nchunk; ++ch)
      for (int64_t e = 0; e < part_size; ++e) tp[e] += pp[ch * part_size + e];
  });
  at::Tensor gw = total.slice(0, 0, S.D * S.hd).reshape({S.D, S.hd});
  at::Tensor gdt = total.slice(0, S.D * S.hd, S.D * S.hd + S.G);
  at::Tensor gA = total.slice(0, S.D * S.hd + S.G, part_size);
  return {gx, gw.clone(), gdt.clone(), gA.clone()};  // three tensors of their own (no views of one buffer)
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) {
  m.impl("path_decay", &ppma::cpu::path_decay_cpu);
  m.impl("path_decay_backward", &ppma::cpu::path_decay_backward_cpu);
}
