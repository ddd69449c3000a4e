// CPU kernel of ppma::depthwise_conv2d_backward (docs/ops.md "depthwise_conv2d_backward"): the weight and bias
// gradients of a depthwise k x k convolution (stride 1, padding k // 2, odd k) on channels-last maps, the
// convolution of the LePE, CPE and FFN of every PPMA block (ppma.nn.DWConv2d):
//   grad_weight[c, 0, i, j] = sum_{b, h, w} grad_out[b, h, w, c] * x[b, h + i - k // 2, w + j - k // 2, c]
//   grad_bias[c]            = sum_{b, h, w} grad_out[b, h, w, c]
// (x zero outside the map). One pass over grad_out and x: every task owns a group of channels and sums its
// k * k + 1 partial vectors over a fixed chunk of rows, and the chunks are added in a fixed order, so the result
// does not depend on the thread count. torch's CPU backward of a 5 x 5 depthwise convolution takes 10-35x its
// forward (PPMA-T's LePE shapes); this pass takes a few forwards.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "cpu/simd.h"
#include "cpu/utils.h"

namespace ppma {
namespace cpu {
namespace {

// Channels per vector block: one 16-lane vector of floats (two of the 8-lane path, four of the 4-lane one).
constexpr int64_t CB = 16;

// Adds g[c] * x[c] to acc[c] for the n <= CB channels of a block: whole vectors of the task's lane width for a
// full float block, a plain loop otherwise (double, the last block of a C that is not a multiple of CB).
template <int L, typename T>
PPMA_SIMD_INLINE void fma_block(Lanes<L>, int64_t n, const T* __restrict g, const T* __restrict x,
                                T* __restrict acc) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == CB) {
      for (int64_t c = 0; c < CB; c += L) store<L>(acc + c, load<L>(acc + c) + load<L>(g + c) * load<L>(x + c));
      return;
    }
  }
  for (int64_t c = 0; c < n; ++c) acc[c] += g[c] * x[c];
}

// Adds g[c] to acc[c] for the n <= CB channels of a block (the bias gradient).
template <int L, typename T>
PPMA_SIMD_INLINE void add_block(Lanes<L>, int64_t n, const T* __restrict g, T* __restrict acc) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == CB) {
      for (int64_t c = 0; c < CB; c += L) store<L>(acc + c, load<L>(acc + c) + load<L>(g + c));
      return;
    }
  }
  for (int64_t c = 0; c < n; ++c) acc[c] += g[c];
}

// Channels per task group (CG / CB blocks; the k * k + 1 sums of a group stay in L1) and the fixed number of
// row chunks the B * H rows are split into (partial sums added in chunk order afterwards): the split depends on
// the shapes only, never on the thread count.
constexpr int64_t CG = 1024;
// Floats between the sums of two taps: CG plus one block, so that the taps' sums do not share cache sets.
constexpr int64_t CS = CG + CB;
constexpr int64_t kChunks = 8;

// go, x: [B, H, W, C] contiguous; gw: [C, K, K]; gb: [C].
template <typename T>
void weight_grad(const T* go, const T* x, int64_t B, int64_t H, int64_t W, int64_t C, int64_t K, T* gw, T* gb) {
  const int64_t P = K / 2, KK = K * K, ngrp = ceil_div(C, CG), R = B * H;
  const int64_t nchunk = std::min(R, kChunks), rows_per = ceil_div(R, nchunk);
  const int64_t psize = (KK + 1) * CS;
  std::vector<T> part(ngrp * nchunk * psize, T(0));
  parallel_tasks(
      ngrp * nchunk, [] { return 0; },
      [&](int64_t t, int) {
    with_lanes([&](auto ln) {
      const int64_t grp = t / nchunk, chunk = t % nchunk;
      const int64_t cg0 = grp * CG, cgn = std::min(CG, C - cg0);
      T* acc = part.data() + t * psize;  // [KK + 1][CS]: the taps, then the bias
      T* ab = acc + KK * CS;
      const int64_t r1 = std::min(R, (chunk + 1) * rows_per);
      for (int64_t r = chunk * rows_per; r < r1; ++r) {
        const int64_t b = r / H, h = r % H;
        const int64_t i0 = std::max<int64_t>(0, P - h), i1 = std::min<int64_t>(K, H + P - h);
        for (int64_t w = 0; w < W; ++w) {
          const T* gp = go + (r * W + w) * C + cg0;
          const int64_t j0 = std::max<int64_t>(0, P - w), j1 = std::min<int64_t>(K, W + P - w);
          for (int64_t c = 0; c < cgn; c += CB) {
            const int64_t n = std::min(CB, cgn - c);
            add_block(ln, n, gp + c, ab + c);
            for (int64_t i = i0; i < i1; ++i) {
              const T* xr = x + ((b * H + h + i - P) * W + (w - P)) * C + cg0 + c;
              T* ar = acc + i * K * CS + c;
              for (int64_t j = j0; j < j1; ++j) fma_block(ln, n, gp + c, xr + j * C, ar + j * CS);
            }
          }
        }
      }
    });
  });
  // The chunks' partial sums in chunk order.
  for (int64_t grp = 0; grp < ngrp; ++grp) {
    const int64_t cg0 = grp * CG, cgn = std::min(CG, C - cg0);
    for (int64_t c = 0; c < cgn; ++c) {
      for (int64_t ij = 0; ij <= KK; ++ij) {
        T s = 0;
        for (int64_t ch = 0; ch < nchunk; ++ch) s += part[(grp * nchunk + ch) * psize + ij * CS + c];
        if (ij < KK) {
          gw[(cg0 + c) * KK + ij] = s;
        } else {
          gb[cg0 + c] = s;
        }
      }
    }
  }
}

constexpr const char* kOp = "ppma::depthwise_conv2d_backward";

std::tuple<at::Tensor, at::Tensor> depthwise_conv2d_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                                 int64_t kernel_size) {
  TORCH_CHECK(x.dim() == 4, kOp, ": x must be [B, H, W, C], got shape ", x.sizes());
  TORCH_CHECK(grad_out.sizes() == x.sizes(), kOp, ": grad_out must have x's shape ", x.sizes(), ", got ",
              grad_out.sizes());
  TORCH_CHECK(kernel_size > 0 && kernel_size % 2 == 1, kOp, ": kernel_size must be a positive odd number, got ",
              kernel_size);
  check_floating(kOp, "x", x);
  check_like(kOp, "grad_out", grad_out, "x", x);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, kOp,
              ": x must be float32 or float64, got ", x.scalar_type());
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3), K = kernel_size;
  at::Tensor gw = at::zeros({C, 1, K, K}, x.options()), gb = at::zeros({C}, x.options());
  if (B * H * W * C == 0) return {gw, gb};
  const at::Tensor xc = x.contiguous(), gc = grad_out.contiguous();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ppma_depthwise_conv2d_backward_cpu", [&] {
    weight_grad<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), B, H, W, C, K, gw.data_ptr<scalar_t>(),
                          gb.data_ptr<scalar_t>());
  });
  return {gw, gb};
}

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_IMPL(ppma, CPU, m) { m.impl("depthwise_conv2d_backward", &ppma::cpu::depthwise_conv2d_backward_cpu); }
