// Host-side helpers shared by the ppma CPU operators: packing of the inputs into per-(batch, head)
// contiguous accumulation-dtype buffers, prefix sums of the log-decays, head-dim dispatch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/math.h"

namespace ppma {
namespace cpu {

// [B, H, W, heads, d] (any dtype, any strides) -> [B, heads, H, W, d] contiguous in dtype `acc`.
// May return a view of `t` (when no copy is needed): read-only use.
inline at::Tensor pack_heads(const at::Tensor& t, at::ScalarType acc) {
  return t.to(acc).permute({0, 3, 1, 2, 4}).contiguous();
}

// [B, H, W, heads, d] -> [B, heads, d, H, W] contiguous (keys / values transposed per head).
inline at::Tensor pack_heads_t(const at::Tensor& t, at::ScalarType acc) {
  return t.to(acc).permute({0, 3, 4, 1, 2}).contiguous();
}

// Prefix sums of the log-decays excluding index 0, per (batch, head), in dtype `acc`:
//   cr[b, g, i, j] = sum_{1 <= n <= j} log_alpha[b, i, n, g]   (along each row)
//   cc[b, g, i, j] = sum_{1 <= n <= i} log_beta[b, n, j, g]    (along each column)
// with every log-decay floored at -1e4 first (floor_log_decay, common/math.h).
// Returns {cr, cc}, each [B, heads, H, W] contiguous.
inline std::pair<at::Tensor, at::Tensor> prefix_sums(const at::Tensor& log_alpha, const at::Tensor& log_beta,
                                                     at::ScalarType acc) {
  // Fresh buffers (never views of the inputs: they are overwritten in place below).
  const std::vector<int64_t> perm{log_alpha.size(0), log_alpha.size(3), log_alpha.size(1), log_alpha.size(2)};
  at::Tensor cr = at::empty(perm, log_alpha.options().dtype(acc)).copy_(log_alpha.permute({0, 3, 1, 2}));
  at::Tensor cc = at::empty(perm, log_beta.options().dtype(acc)).copy_(log_beta.permute({0, 3, 1, 2}));
  const int64_t BG = cr.size(0) * cr.size(1), H = cr.size(2), W = cr.size(3);
  AT_DISPATCH_FLOATING_TYPES(cr.scalar_type(), "ppma_prefix_sums", [&] {
    scalar_t* r = cr.data_ptr<scalar_t>();
    scalar_t* c = cc.data_ptr<scalar_t>();
    at::parallel_for(0, BG, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t bg = b0; bg < b1; ++bg) {
        scalar_t* rr = r + bg * H * W;
        scalar_t* cg = c + bg * H * W;
        for (int64_t i = 0; i < H; ++i) {
          scalar_t* row = rr + i * W;
          scalar_t run = 0;
          row[0] = 0;
          for (int64_t j = 1; j < W; ++j) {
            run += floor_log_decay(row[j]);
            row[j] = run;
          }
        }
        for (int64_t j = 0; j < W; ++j) cg[j] = 0;
        for (int64_t i = 1; i < H; ++i)
          for (int64_t j = 0; j < W; ++j) cg[i * W + j] = floor_log_decay(cg[i * W + j]) + cg[(i - 1) * W + j];
      }
    });
  });
  return {cr, cc};
}

// Calls f(std::integral_constant<int, D>{}, std::integral_constant<int, DV>{}) with compile-time head
// dims for the common cases (the models use 16 and 32) and 0 (= read at run time) otherwise.
template <typename F>
inline void dispatch_head_dims(int64_t d, int64_t dv, F&& f) {
  if (d == 16 && dv == 16) {
    f(std::integral_constant<int, 16>{}, std::integral_constant<int, 16>{});
  } else if (d == 32 && dv == 32) {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 32>{});
  } else if (d == 64 && dv == 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  } else {
    f(std::integral_constant<int, 0>{}, std::integral_constant<int, 0>{});
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Runs body(task, scratch) for task in [0, ntasks) on the torch thread pool, tasks claimed one at a
// time from a shared counter (dynamic scheduling: on a loaded machine a thread that is descheduled
// does not hold up a static half of the work). scratch = init() is created once per worker thread.
// Every task must write only its own outputs, so results do not depend on which thread ran it.
template <typename Init, typename Body>
inline void parallel_tasks(int64_t ntasks, const Init& init, const Body& body) {
  if (ntasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = init();
    for (int64_t t = next.fetch_add(1); t < ntasks; t = next.fetch_add(1)) body(t, scratch);
  });
}

}  // namespace cpu
}  // namespace ppma
