// Host-side helpers of the ppma CPU operators: the prefix sums of the log-decays and the task scheduler.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/math.h"

namespace ppma {
namespace cpu {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A tensor's elements as the kernels read and write them: X (float, double), or the bits of a bf16 tensor for
// X = uint16_t (cpu/simd.h widens them with load_map and rounds with store_map).
template <typename X>
X* elements(const at::Tensor& t) {
  if constexpr (std::is_same_v<X, uint16_t>) {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  } else {
    return t.data_ptr<X>();
  }
}

// Prefix sums of the log-decays [B, H, W, heads] (any strides) along every line, in dtype `acc`
// (docs/ops.md "Prefix sums and biases"; line_prefix_sums in common/math.h):
//   cr[bg][i * W + j] = sum_{1 <= n <= j} log_alpha[b, i, n, g]   (along each row)
//   cc[bg][i * W + j] = sum_{1 <= n <= i} log_beta[b, n, j, g]    (along each column)
// with bg = b * heads + g. columns_major: cc is stored [bg][j * H + i] instead (each column contiguous).
// Returns {cr, cc}, [B * heads, H * W] each.
inline std::pair<at::Tensor, at::Tensor> prefix_sums(const at::Tensor& log_alpha, const at::Tensor& log_beta,
                                                     at::ScalarType acc, bool columns_major = false) {
  const int64_t B = log_alpha.size(0), H = log_alpha.size(1), W = log_alpha.size(2), G = log_alpha.size(3);
  const at::Tensor la = log_alpha.to(acc), lb = log_beta.to(acc);
  at::Tensor cr = at::empty({B * G, H * W}, la.options()), cc = at::empty_like(cr);
  AT_DISPATCH_FLOATING_TYPES(acc, "ppma_prefix_sums", [&] {
    const scalar_t* a = la.data_ptr<scalar_t>();
    const scalar_t* bb = lb.data_ptr<scalar_t>();
    scalar_t* r = cr.data_ptr<scalar_t>();
    scalar_t* c = cc.data_ptr<scalar_t>();
    at::parallel_for(0, B * G, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t bg = b0; bg < b1; ++bg) {
        const int64_t b = bg / G, g = bg % G;
        for (int64_t i = 0; i < H; ++i)
          line_prefix_sums(W, a + b * la.stride(0) + i * la.stride(1) + g * la.stride(3), la.stride(2),
                           r + bg * H * W + i * W, 1);
        for (int64_t j = 0; j < W; ++j)
          line_prefix_sums(H, bb + b * lb.stride(0) + j * lb.stride(2) + g * lb.stride(3), lb.stride(1),
                           c + bg * H * W + (columns_major ? j * H : j), columns_major ? 1 : W);
      }
    });
  });
  return {cr, cc};
}

// Runs body(task, scratch) for task in [0, ntasks) on the torch thread pool, tasks claimed one at a
// time from a shared counter (dynamic scheduling: on a loaded machine a thread that is descheduled
// does not hold up a static half of the work). scratch = init() is created once per worker thread.
// Every task must write only its own outputs, so results do not depend on which thread ran it.
// A single task still gets two workers where torch has two threads or more (the second finds nothing to do): the
// task then runs inside an active OpenMP parallel region, as every task does where there are several, so a library
// it calls (oneDNN's or MKL's bf16 GEMM behind cpublas::brgemm's plain route, cpu/lowp_gemm.h) runs single-threaded
// there too; outside a region such a library splits a product over the threads, and its sums then depend on their
// number (seen on AVX512-BF16 CPUs: a gradient off by one float32 ulp between 1 and 2 threads).
template <typename Init, typename Body>
inline void parallel_tasks(int64_t ntasks, const Init& init, const Body& body) {
  if (ntasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(ntasks, 2));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = init();
    for (int64_t t = next.fetch_add(1); t < ntasks; t = next.fetch_add(1)) body(t, scratch);
  });
}

// parallel_tasks over tasks t = image * parts + part (an image's channel blocks, say): where there are at least as
// many images as threads, one task per image running its parts in order; else one task per (image, part). The
// parts of one image on two cores at a time slow both down (each core's prefetchers pull the other's adjacent lines
// of the same rows, which it then writes): the FFN's in-place depthwise convolution at PPMA-T's b8@224 shapes, 2
// threads, measured 0.64-0.70 against 0.41-0.54 ms at [8, 28, 28, 384] and 1.5-2.3 against 1.3-1.6 ms at
// [8, 56, 56, 192] per part against per image. body(t, scratch) must not depend on which grouping ran it.
template <typename Init, typename Body>
inline void parallel_image_tasks(int64_t images, int64_t parts, const Init& init, const Body& body) {
  if (images >= at::get_num_threads()) {
    parallel_tasks(images, init, [&](int64_t b, auto& scratch) {
      for (int64_t j = 0; j < parts; ++j) body(b * parts + j, scratch);
    });
  } else {
    parallel_tasks(images * parts, init, body);
  }
}

}  // namespace cpu
}  // namespace ppma
