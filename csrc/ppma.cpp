// Operator schemas of the ppma library (docs/ops.md). One place for every op and
// every backward op; each backend registers its kernels with
// TORCH_LIBRARY_IMPL(ppma, <Key>, m) at the bottom of its own file.
//
// Layout: q, k: [B, H, W, heads, d]; v: [B, H, W, heads, dv];
// log_alpha, log_beta: [B, H, W, heads] (values <= 0).
// lse: float32 [B, H, W, heads, 2] softmax log-sum-exp statistics:
//   polyline_attention:    [..., 0] for softmax(S + M) (V2H), [..., 1] for softmax(S + M^T) (H2V)
//   criss_cross_attention: [..., 0] for the row softmax,  [..., 1] for the column softmax
// out_v2h: softmax(S + M) v (the V2H term alone), kept for the backward pass.
// polyline_linear_attention stats: [B, H, W, heads, 2, C] in the accumulation dtype, [..., 0, :] for the V2H
//   and [..., 1, :] for the H2V term: normalize=True: (term / (den + eps), den + eps) with C = dv + 1;
//   normalize=False: the unnormalised term, C = dv.
#include <Python.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "common/options.h"
#include "generated/stamp.h"  // PPMA_SOURCE_STAMP, written by setup.py (ppma/_stamp.py)

// The kernels' run-time options (common/options.h), as ops that take no tensor: ppma/config.py sets them.
//   ppma::set_option(str name, int value) -> int   sets one and returns its previous value
//   ppma::get_option(str name) -> int              its current value
//   ppma::source_stamp() -> str                     the hash of the sources this library was built from
namespace {
int64_t set_option_op(const std::string& name, int64_t value) {
  return ppma::set_option(ppma::option_by_name(name), static_cast<int>(value));
}
int64_t get_option_op(const std::string& name) { return ppma::get_option(ppma::option_by_name(name)); }
std::string source_stamp_op() { return PPMA_SOURCE_STAMP; }
}  // namespace

extern "C" {
// ppma._C is imported only to run the static registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(ppma, m) {
  m.def("set_option(str name, int value) -> int", &set_option_op);
  m.def("get_option(str name) -> int", &get_option_op);
  m.def("source_stamp() -> str", &source_stamp_op);
  m.def(
      "polyline_attention(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta, float scale)"
      " -> (Tensor out, Tensor out_v2h, Tensor lse)");
  m.def(
      "polyline_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_alpha,"
      " Tensor log_beta, Tensor out, Tensor out_v2h, Tensor lse, float scale)"
      " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_log_alpha, Tensor grad_log_beta)");
  // polyline_attention's output alone, without the statistics of the backward pass (no_grad / inference_mode;
  // CPU kernel only: the wrapper runs it for CPU tensors when no gradient is needed).
  m.def(
      "polyline_attention_inference(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta, float scale)"
      " -> Tensor");
  // polyline_attention's out and lse without out_v2h, and its backward, whose rows' D terms come from the maps
  // (CPU kernel only: the wrapper's training forward of float32 / float64 CPU tensors; one P v product).
  m.def(
      "polyline_attention_lse(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta, float scale)"
      " -> (Tensor out, Tensor lse)");
  m.def(
      "polyline_attention_lse_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_alpha,"
      " Tensor log_beta, Tensor lse, float scale)"
      " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_log_alpha, Tensor grad_log_beta)");
  m.def(
      "criss_cross_attention(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta, float scale)"
      " -> (Tensor out, Tensor lse)");
  m.def(
      "criss_cross_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_alpha,"
      " Tensor log_beta, Tensor lse, float scale)"
      " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_log_alpha, Tensor grad_log_beta)");
  m.def(
      "polyline_linear_attention(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta, bool normalize,"
      " float eps) -> (Tensor out, Tensor stats)");
  m.def(
      "polyline_linear_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_alpha,"
      " Tensor log_beta, Tensor stats, bool normalize, float eps)"
      " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_log_alpha, Tensor grad_log_beta)");
  m.def("rope(Tensor x, Tensor sin, Tensor cos, float scale, bool transpose) -> Tensor");
  // The same rotation written over x (contiguous; CPU inference: no second map of q's or k's size).
  m.def("rope_(Tensor(a!) x, Tensor sin, Tensor cos, float scale, bool transpose) -> ()");
  // LayerNorm over the last dimension of a contiguous float32 map (CPU inference), and the same after x <- x + residual
  // in place in one pass (the block's residual sum followed by its norm).
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("add_layer_norm_(Tensor(a!) x, Tensor residual, Tensor weight, Tensor bias, float eps) -> Tensor");
  // x <- x + depthwise_conv(x) + bias in place on a channels-last [B, H, W, C] map (CPU inference; x float32 or
  // bfloat16, weight and bias float32).
  m.def("depthwise_conv2d_residual_(Tensor(a!) x, Tensor weight, Tensor? bias) -> ()");
  // Weight and bias gradients of a depthwise k x k convolution on channels-last [B, H, W, C] maps (CPU).
  m.def(
      "depthwise_conv2d_backward(Tensor grad_out, Tensor x, int kernel_size)"
      " -> (Tensor grad_weight, Tensor grad_bias)");
  // out = a + depthwise_conv(a) + bias with a = GELU(h) (exact) on a channels-last [B, H, W, C] float32 map, and its
  // gradients (float32 / float64; the FFN's middle in training; CPU).
  m.def("gelu_depthwise_conv2d_residual_forward(Tensor h, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "gelu_depthwise_conv2d_residual_backward(Tensor grad_out, Tensor h, Tensor weight)"
      " -> (Tensor grad_h, Tensor grad_weight, Tensor grad_bias)");
  // PPMA's per-token log-decays d[..., g, c] = softplus(<x_g, weight[c]> + dt_bias[g]) * A[g] of x [..., heads *
  // head_dim] (float32 / float64, or bfloat16 with float32 parameters: CPU bf16 autocast), weight [D, head_dim],
  // dt_bias and A [heads], and their gradients (CPU).
  m.def("path_decay(Tensor x, Tensor weight, Tensor dt_bias, Tensor A) -> Tensor");
  m.def(
      "path_decay_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor dt_bias, Tensor A)"
      " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_dt_bias, Tensor grad_A)");
  m.def("polyline_scan(Tensor x, Tensor log_alpha, Tensor log_beta, bool transpose) -> Tensor");
  m.def(
      "polyline_scan_backward(Tensor grad_y, Tensor x, Tensor log_alpha, Tensor log_beta, bool transpose)"
      " -> (Tensor grad_x, Tensor grad_log_alpha, Tensor grad_log_beta)");
  // 3-D ops (paper appendix C.2; docs/video.md): q, k [B, T, H, W, heads, d], v [..., dv],
  // log_alpha (along W), log_beta (along H), log_gamma (along T): [B, T, H, W, heads].
  m.def(
      "polyline_attention_3d(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta, Tensor log_gamma,"
      " float scale) -> (Tensor out, Tensor out_v2h, Tensor lse)");
  m.def(
      "polyline_attention_3d_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_alpha,"
      " Tensor log_beta, Tensor log_gamma, Tensor out, Tensor out_v2h, Tensor lse, float scale)"
      " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_log_alpha, Tensor grad_log_beta,"
      " Tensor grad_log_gamma)");
  m.def(
      "polyline_linear_attention_3d(Tensor q, Tensor k, Tensor v, Tensor log_alpha, Tensor log_beta,"
      " Tensor log_gamma, bool normalize, float eps) -> (Tensor out, Tensor stats)");
  m.def(
      "polyline_linear_attention_3d_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor log_alpha,"
      " Tensor log_beta, Tensor log_gamma, Tensor stats, bool normalize, float eps)"
      " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_log_alpha, Tensor grad_log_beta,"
      " Tensor grad_log_gamma)");
  m.def("polyline_scan_3d(Tensor x, Tensor log_alpha, Tensor log_beta, Tensor log_gamma, bool transpose) -> Tensor");
  m.def(
      "polyline_scan_3d_backward(Tensor grad_y, Tensor x, Tensor log_alpha, Tensor log_beta, Tensor log_gamma,"
      " bool transpose) -> (Tensor grad_x, Tensor grad_log_alpha, Tensor grad_log_beta, Tensor grad_log_gamma)");
}
