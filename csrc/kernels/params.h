// Parameter structs of the ppma CUDA kernels (docs/design.md §1): plain pointers, sizes, element strides,
// scale and flags. No torch types, so the kernels can be compiled and reused without torch.
//
// Conventions shared by every kernel:
// * A feature tensor [B, H, W, heads, dim] is addressed through its element strides of the first four
//   dimensions (`Strides4`); the last dimension is contiguous (the launchers guarantee it).
// * Tokens are flattened row-major: token p = (i, j) has index p = i * W + j, N = H * W.
// * Per-head scratch buffers of the kernels ("[BG][N]", "[BG][N][dim]") are contiguous, with the
//   batch-head index bg = b * G + g outermost.
// * `acc_t` is float for float/half/bfloat16 inputs and double for double inputs; log-decays, prefix
//   sums, softmax statistics and every accumulator use it.
#pragma once

#include <cstdint>

namespace ppma {

// Element strides of the [B, H, W, heads] dimensions of a [B, H, W, heads, dim] (or [B, H, W, heads]) tensor.
struct Strides4 {
  int64_t b = 0, h = 0, w = 0, g = 0;
};

// Sizes shared by all ops.
struct GridSizes {
  int B = 0, H = 0, W = 0, G = 0;  // batch, rows, columns, heads
  int d = 0, dv = 0;               // head dim of q/k and of v (polyline_scan: channels in dv, d unused)
};

// Prefix sums of the log-decays (docs/ops.md "Prefix sums and biases": excluding index 0), acc_t [BG][N]:
// cr[bg][i*W+j] = sum_{1<=n<=j} log_alpha[b,i,n,g], cc[bg][i*W+j] = sum_{1<=n<=i} log_beta[b,n,j,g].
template <typename acc_t>
struct PrefixParams {
  GridSizes sz;
  const acc_t* log_alpha = nullptr;  // [B, H, W, heads], strides `sa`
  const acc_t* log_beta = nullptr;   // [B, H, W, heads], strides `sb`
  Strides4 sa, sb;
  acc_t* cr = nullptr;  // [BG][N]
  acc_t* cc = nullptr;  // [BG][N]
};

// polyline_attention forward and backward.
template <typename scalar_t, typename acc_t>
struct PolylineAttnParams {
  GridSizes sz;
  acc_t scale = 0;  // S = scale * <q, k>
  const scalar_t* q = nullptr;
  const scalar_t* k = nullptr;
  const scalar_t* v = nullptr;
  Strides4 sq, sk, sv;
  const acc_t* cr = nullptr;  // prefix sums [BG][N]
  const acc_t* cc = nullptr;
  // forward outputs (contiguous [B, H, W, heads, dv]) and statistics (contiguous [B, H, W, heads, 2])
  scalar_t* out = nullptr;
  scalar_t* out_v2h = nullptr;
  acc_t* lse = nullptr;  // written by the forward, read by the backward
  // backward inputs
  const scalar_t* dout = nullptr;      // grad_out, strides `sdo`
  const scalar_t* out_c = nullptr;     // saved out (contiguous)
  const scalar_t* out_v2h_c = nullptr; // saved out_v2h (contiguous)
  Strides4 sdo;
  acc_t* delta = nullptr;  // [BG][N][2]: 0.5 * rowsum(dO * out_v2h), 0.5 * rowsum(dO * out_h2v)
  // backward outputs: grad_q, grad_k (contiguous [B,H,W,heads,d]), grad_v (contiguous [..., dv])
  scalar_t* dq = nullptr;
  scalar_t* dk = nullptr;
  scalar_t* dv = nullptr;
  // prefix-sum gradients, acc_t [BG][N] each: the terms a query owns (dq kernel), a key owns (dkdv kernel)
  acc_t* gq_cr = nullptr;
  acc_t* gq_cc = nullptr;
  acc_t* gk_cr = nullptr;
  acc_t* gk_cc = nullptr;
  // cross terms, per outer CTA of the backward: [BG][num_ctas][table] (see RowTiling), zero-initialised.
  // x1: token (query row, key col) from the V2H scores (dq kernel); x2: token (key row, query col) from
  // the H2V scores (dkdv kernel).
  acc_t* x1_cr = nullptr;
  acc_t* x1_cc = nullptr;
  acc_t* x2_cr = nullptr;
  acc_t* x2_cc = nullptr;
  // grad_log_alpha / grad_log_beta in acc_t, contiguous [B, H, W, heads]
  acc_t* g_log_alpha = nullptr;
  acc_t* g_log_beta = nullptr;
};

// criss_cross_attention forward and backward. Scratch buffers are acc_t, contiguous [B, H, W, heads, dv]
// (or [B, H, W, heads, d] for the q/k gradient parts), [BG][N] for per-token scalars.
template <typename scalar_t, typename acc_t>
struct CrissCrossParams {
  GridSizes sz;
  acc_t scale = 0;
  const scalar_t* q = nullptr;
  const scalar_t* k = nullptr;
  const scalar_t* v = nullptr;
  const scalar_t* dout = nullptr;
  Strides4 sq, sk, sv, sdo;
  const acc_t* cr = nullptr;
  const acc_t* cc = nullptr;
  scalar_t* out = nullptr;  // contiguous [B, H, W, heads, dv]
  acc_t* lse = nullptr;     // contiguous [B, H, W, heads, 2]: [...,0] row softmax, [...,1] column softmax
  // scratch, acc_t [B, H, W, heads, dv]
  acc_t* z1 = nullptr;    // A v            (forward and backward)
  acc_t* z2 = nullptr;    // B v
  acc_t* out1 = nullptr;  // B z1           (forward)
  acc_t* gz1 = nullptr;   // grad of z1     (backward)
  acc_t* gz2 = nullptr;   // grad of z2
  acc_t* gv_c = nullptr;  // column part of grad_v
  acc_t* gv_r = nullptr;  // row part of grad_v
  acc_t* dq_c = nullptr;  // [B,H,W,heads,d] column part of grad_q (times 1/scale folded in: see kernel)
  acc_t* dk_c = nullptr;
  acc_t* dq_r = nullptr;
  acc_t* dk_r = nullptr;
  acc_t* delta = nullptr;  // [BG][N] softmax-backward row sums of the current line pass
  acc_t* g_cr = nullptr;   // [BG][N] prefix-sum gradient of the row biases
  acc_t* g_cc = nullptr;   // [BG][N] prefix-sum gradient of the column biases
  // final outputs
  scalar_t* dq = nullptr;
  scalar_t* dk = nullptr;
  scalar_t* dv = nullptr;
  acc_t* g_log_alpha = nullptr;  // contiguous [B, H, W, heads]
  acc_t* g_log_beta = nullptr;
};

// polyline_scan: 1-D symmetric semiseparable products along rows or columns.
// A "line pass" reads `in` ([B,H,W,heads,c] with strides `s_in`) and writes `out` (contiguous acc_t or
// scalar_t [B,H,W,heads,c]); the log-decays are contiguous acc_t [B, H, W, heads].
template <typename in_t, typename out_t, typename acc_t>
struct ScanLineParams {
  GridSizes sz;        // dv = channels
  bool along_rows = true;  // true: lines are rows (decay log_alpha, length W); false: columns (log_beta, H)
  const in_t* in = nullptr;
  Strides4 s_in;
  const acc_t* decay = nullptr;  // contiguous [B, H, W, heads]
  acc_t* fbuf = nullptr;         // contiguous acc_t [B,H,W,heads,c] scratch (may alias out if out_t == acc_t)
  out_t* out = nullptr;          // contiguous [B,H,W,heads,c]
};

// Decay gradient of one 1-D factor y = A u with upstream gy (both [B,H,W,heads,c]):
// contrib[token, channel] = f_{s-1}(u) F_s(gy) + f_{s-1}(gy) F_s(u) (0 at line position 0); the reduction
// kernel then forms grad a_s = e^{a_s} * sum_channels contrib.
template <typename u_t, typename g_t, typename acc_t>
struct ScanGradParams {
  GridSizes sz;
  bool along_rows = true;
  const u_t* u = nullptr;
  Strides4 s_u;
  const g_t* gy = nullptr;
  Strides4 s_gy;
  const acc_t* decay = nullptr;  // contiguous [B, H, W, heads]
  acc_t* fu = nullptr;           // scratch contiguous [B,H,W,heads,c]
  acc_t* fg = nullptr;           // scratch contiguous [B,H,W,heads,c]
  acc_t* contrib = nullptr;      // contiguous [B,H,W,heads,c]
  acc_t* grad_decay = nullptr;   // contiguous [B,H,W,heads] (written by the reduction kernel)
};

// polyline_linear_attention forward and backward (kernels/polyline_linear_attention.cuh). v' = [v, 1] has C = dv + 1
// channels with normalisation, C = dv without; they are split into S = ceil(C / cs) slices of cs channels (the last
// one may be shorter), and one block runs one (b * heads + g, direction, slice) unit. The work buffers are acc_t
// and contiguous, heads-major ("[BG][N][n]", bg = b * G + g), like the CPU kernel's copies of the inputs.
template <typename acc_t>
struct LinearAttnWork {
  GridSizes sz;
  int C = 0, cs = 0, S = 0;  // channels of v', slice width, slices
  // packed inputs: q, k [BG][N][d], v' [BG][N][C], decay multipliers exp(floored log-decay) [BG][N], and for the
  // backward dO' [2][BG][N][C] (the gradient of each direction's numerator and denominator channels)
  acc_t* q = nullptr;
  acc_t* k = nullptr;
  acc_t* v = nullptr;
  acc_t* ea = nullptr;
  acc_t* eb = nullptr;
  acc_t* dop = nullptr;
  // the recurrences' row states: `state_stride` elements per block (polyline_linear_attention_state())
  acc_t* state = nullptr;
  int64_t state_stride = 0;
  // forward: the unnormalised terms, then the statistics, contiguous [B, H, W, heads, 2, C] ([..., dir, c])
  acc_t* stats = nullptr;
  // backward partial sums, reduced in a fixed order by the last kernels: grad q and k per (direction, slice)
  // [2][S][BG][N][d], grad v' per direction [2][BG][N][C], prefix-sum gradients [2 (rows, columns)][2][S][BG][N]
  // and their sums [2][BG][N]
  acc_t* dq_part = nullptr;
  acc_t* dk_part = nullptr;
  acc_t* dv_part = nullptr;
  acc_t* gc_part = nullptr;
  acc_t* gc_sum = nullptr;
};

template <typename scalar_t, typename acc_t>
struct LinearAttnParams {
  LinearAttnWork<acc_t> w;
  bool normalize = true;
  acc_t eps = 0;
  const scalar_t* q = nullptr;  // [B, H, W, heads, d], strides sq (unit last stride)
  const scalar_t* k = nullptr;
  const scalar_t* v = nullptr;  // [B, H, W, heads, dv]
  Strides4 sq, sk, sv;
  const acc_t* log_alpha = nullptr;  // [B, H, W, heads], strides sa, sb
  const acc_t* log_beta = nullptr;
  Strides4 sa, sb;
  const scalar_t* dout = nullptr;  // backward: grad_out [B, H, W, heads, dv], strides sdo
  Strides4 sdo;
  scalar_t* out = nullptr;  // forward output, contiguous [B, H, W, heads, dv]
  scalar_t* dq = nullptr;   // backward outputs, contiguous [B, H, W, heads, d | d | dv]
  scalar_t* dk = nullptr;
  scalar_t* dv = nullptr;
  acc_t* g_log_alpha = nullptr;  // contiguous [B, H, W, heads]
  acc_t* g_log_beta = nullptr;
};

}  // namespace ppma
