// The aliasing check of the in-place CPU ops (add_layer_norm_, rope_, depthwise_conv2d_residual_; docs/ops.md
// "Edges").
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

namespace ppma {
namespace cpu {

// The in-place ops' aliasing rule (docs/ops.md "Edges"), as torch's in-place ops: the written tensor `out` (named
// out_name) and an input t (named name) must not share memory, except that with allow_full an input that is `out`
// itself (same start, sizes and strides: every element read before it is written) is fine. An undefined t passes.
inline void check_no_overlap(const char* op, const char* out_name, const at::Tensor& out, const char* name,
                             const at::Tensor& t, bool allow_full = false) {
  if (!t.defined() || out.numel() == 0 || t.numel() == 0) return;
  const at::MemOverlapStatus st = at::get_overlap_status(out, t);
  const bool full = st == at::MemOverlapStatus::Full ||
                    (t.data_ptr() == out.data_ptr() && t.sizes() == out.sizes() && t.strides() == out.strides());
  if (st == at::MemOverlapStatus::No || (allow_full && full)) return;
  // TooHard (neither dense): compare the byte ranges, a conservative answer
  if (st == at::MemOverlapStatus::TooHard && !full) {
    const auto lo = [](const at::Tensor& a) { return static_cast<const char*>(a.const_data_ptr()); };
    const auto hi = [](const at::Tensor& a) {
      int64_t last = 0;
      for (int64_t d = 0; d < a.dim(); ++d) last += (a.size(d) - 1) * a.stride(d);
      return static_cast<const char*>(a.const_data_ptr()) + (last + 1) * a.element_size();
    };
    if (hi(out) <= lo(t) || hi(t) <= lo(out)) return;
  }
  TORCH_CHECK(false, op, ": ", name, " shares memory with ", out_name, ", which the op writes in place; pass a ",
              name, " that does not overlap ", out_name, " (e.g. ", name, ".clone())");
}

}  // namespace cpu
}  // namespace ppma
