// What the CPU kernels' run-time dispatch chose (cpu/simd.h "The run-time dispatch"), as ops that take no tensor,
// so that Python (ppma.backends) reports the path the kernels actually run rather than guessing it:
//   ppma::cpu_capability() -> str            the path the kernels run: "default", "avx2" or "avx512"
//                                             (the CPU's best, capped by PPMA_CPU_CAPABILITY);
//   ppma::cpu_capability_supported() -> str  the best path this CPU can run, whatever the environment says;
//   ppma::cpu_bf16_dot() -> bool             whether bf16 inputs take the AVX-512 BF16 dot-product path
//                                             (the avx512 path is selected and the CPU has avx512bf16);
//   ppma::cpu_bf16_dot_supported() -> bool   whether the CPU has them, whatever the environment says;
//   ppma::cpu_lowp_gemm(ScalarType dtype) -> bool  whether the attention kernels' products of bf16 / fp16 inputs of
//                                             that dtype run on torch's CPU batch-reduce GEMM (cpu/lowp_gemm.h:
//                                             the internal option cpu_lowp_products, or the CPU's matrix unit);
//   ppma::cpu_lowp_gemm_native(ScalarType dtype) -> bool  whether torch packs that dtype for its batch-reduce
//                                             micro-kernels on this CPU (AMX), the default choice of the above;
//   ppma::cpu_lowp_route(ScalarType dtype) -> str  which products: "simd", "brgemm" (plain operands),
//                                             "brgemm_vnni" (VNNI-packed, the micro-kernel) or "brgemm_vnni_emulated";
//   ppma::cpu_lowp_vnni_available(ScalarType dtype) -> bool  whether the VNNI-packed route runs on this CPU (probed).
#include <torch/library.h>

#include <string>

#include "cpu/lowp_gemm.h"
#include "cpu/simd.h"

namespace ppma {
namespace cpu {
namespace {

std::string cpu_capability_op() { return capability_name(cpu_capability()); }

std::string cpu_capability_supported_op() { return capability_name(cpu_supported_capability()); }

bool cpu_bf16_dot_op() { return cpu_bf16_dot(); }

bool cpu_bf16_dot_supported_op() { return cpu_supports_avx512_bf16(); }

bool cpu_lowp_gemm_op(at::ScalarType dtype) { return use_lowp_gemm(dtype); }

bool cpu_lowp_gemm_native_op(at::ScalarType dtype) { return lowp_gemm_native(dtype); }

std::string cpu_lowp_route_op(at::ScalarType dtype) { return lowp_route_name(lowp_route(dtype)); }

bool cpu_lowp_vnni_available_op(at::ScalarType dtype) { return lowp_vnni_available(dtype); }

}  // namespace
}  // namespace cpu
}  // namespace ppma

TORCH_LIBRARY_FRAGMENT(ppma, m) {
  m.def("cpu_capability() -> str", &ppma::cpu::cpu_capability_op);
  m.def("cpu_capability_supported() -> str", &ppma::cpu::cpu_capability_supported_op);
  m.def("cpu_bf16_dot() -> bool", &ppma::cpu::cpu_bf16_dot_op);
  m.def("cpu_bf16_dot_supported() -> bool", &ppma::cpu::cpu_bf16_dot_supported_op);
  m.def("cpu_lowp_gemm(ScalarType dtype) -> bool", &ppma::cpu::cpu_lowp_gemm_op);
  m.def("cpu_lowp_gemm_native(ScalarType dtype) -> bool", &ppma::cpu::cpu_lowp_gemm_native_op);
  m.def("cpu_lowp_route(ScalarType dtype) -> str", &ppma::cpu::cpu_lowp_route_op);
  m.def("cpu_lowp_vnni_available(ScalarType dtype) -> bool", &ppma::cpu::cpu_lowp_vnni_available_op);
}
