// Process-wide run-time options of the kernels (docs/configuration.md). The kernels never read the environment:
// ppma/config.py parses it once, at import, and sets these through the op ppma::set_option (registered in
// csrc/ppma.cpp); the kernels read them with one relaxed atomic load. Torch-free.
#pragma once

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ppma {

enum class Option : int {
  // The SIMD path cap of the CPU kernels (cpu/simd.h "The run-time dispatch"): 0 default, 1 avx2, 2 avx512. The
  // kernels run the lower of the cap and the CPU's best path. Read once, when the first CPU kernel runs.
  kCpuCapability = 0,
  // 1: polyline_attention's tensor-core kernels where they apply (sm_80+, fp16 / bf16, d, dv multiples of 8);
  // 0: the CUDA-core kernels only, for comparisons. The two differ in rounding only.
  kCudaTensorCores,
  // 1: the next generation of a CUDA kernel, not yet verified on a GPU (docs/configuration.md "Internal
  // options"); 0: the verified kernel. One option per op, so each becomes the default on its own once verified.
  kCudaNextPolylineAttention,
  kCudaNextCrissCrossAttention,
  kCudaNextPolylineLinearAttention,
  // The products of bf16 / fp16 q, k, v in the CPU attention kernels (docs/configuration.md "Internal options",
  // docs/performance.md "bf16 and fp16 on the CPU", cpu/lowp_gemm.h): 0 by the CPU's matrix unit (torch's CPU
  // batch-reduce micro-kernel on VNNI-packed operands where torch can pack for it, i.e. AMX; ppma's own SIMD products
  // elsewhere), 1 ppma's own SIMD products, 2 torch's CPU batch-reduce GEMM on plain operands
  // (at::native::cpublas::brgemm), 3 its micro-kernel on VNNI-packed operands, 4 the same packing with the
  // micro-kernel emulated by a scalar loop (tests), 5 ppma's own SIMD products with AVX-512 BF16's dot products
  // (vdpbf16ps) emulated on AVX-512F (tests of that path on CPUs without them; cpu/simd.h dpbf16). Read on every call.
  kCpuLowpProducts,
  kCount
};

struct OptionSpec {
  const char* name;
  int default_value;
  int min_value;
  int max_value;
};

inline constexpr OptionSpec kOptionSpecs[] = {
    {"cpu_capability", 2, 0, 2},
    {"cuda_tensor_cores", 1, 0, 1},
    {"cuda_next_polyline_attention", 0, 0, 1},
    {"cuda_next_criss_cross_attention", 0, 0, 1},
    {"cuda_next_polyline_linear_attention", 0, 0, 1},
    {"cpu_lowp_products", 0, 0, 5},
};
static_assert(sizeof(kOptionSpecs) / sizeof(kOptionSpecs[0]) == static_cast<int>(Option::kCount),
              "one OptionSpec per Option");

// The values, one per Option, initialised to the defaults (an inline function's static: one copy per process).
inline std::atomic<int>* option_values() {
  static std::atomic<int> values[] = {
      kOptionSpecs[0].default_value, kOptionSpecs[1].default_value, kOptionSpecs[2].default_value,
      kOptionSpecs[3].default_value, kOptionSpecs[4].default_value, kOptionSpecs[5].default_value,
  };
  static_assert(sizeof(values) / sizeof(values[0]) == static_cast<int>(Option::kCount), "one value per Option");
  return values;
}

inline int get_option(Option o) { return option_values()[static_cast<int>(o)].load(std::memory_order_relaxed); }

inline Option option_by_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(Option::kCount); ++i)
    if (name == kOptionSpecs[i].name) return static_cast<Option>(i);
  std::string known;
  for (const auto& s : kOptionSpecs) known += std::string(known.empty() ? "" : ", ") + s.name;
  throw std::invalid_argument("ppma: unknown option '" + name + "' (known: " + known + ")");
}

// Sets an option and returns its previous value; throws std::invalid_argument for an unknown name or a value
// outside the option's range.
inline int set_option(Option o, int value) {
  const OptionSpec& s = kOptionSpecs[static_cast<int>(o)];
  if (value < s.min_value || value > s.max_value)
    throw std::invalid_argument(std::string("ppma: option '") + s.name + "' must be in [" +
                                std::to_string(s.min_value) + ", " + std::to_string(s.max_value) + "], got " +
                                std::to_string(value));
  return option_values()[static_cast<int>(o)].exchange(value, std::memory_order_relaxed);
}

}  // namespace ppma
