// The bf16 / fp16 products of the CPU attention kernels through torch's CPU batch-reduce GEMM
// (at::native::cpublas::brgemm; docs/performance.md "bf16 and fp16 on the CPU"): operands in bf16 or fp16, results
// and accumulation in float32. The kernels call lowp_gemm inside their own tasks, one call per product on the task's
// own operands and outputs; the results do not depend on the thread count (tests/test_cpu_lowp_products.py: bitwise
// the same for 1, 2 and 3 threads on each route, also for a phase of a single task: parallel_tasks (cpu/utils.h) runs
// every task inside an active parallel region, where the library behind the plain route does not split a product
// over threads).
//
// Two routes into torch's brgemm (the internal option cpu_lowp_products, common/options.h):
// - plain row-major operands (is_vnni = false, option 2): torch runs its bf16 / fp16 GEMM with float32 output (MKL
//   or oneDNN, on AMX tiles, AVX-512 BF16 or AVX-512), on every CPU, one library call per product;
// - VNNI-packed operands (is_vnni = true, option 3), the route torch's own CPU flash attention takes where
//   cpublas::could_pack holds (AMX): B is reordered [k][n] -> [k/2][n][2] (pairs of rows interleaved, an odd k
//   padded with a zero row, and A with a zero column), and oneDNN's batch-reduce micro-kernel multiplies them
//   (AMX tiles; AVX-512 BF16 on CPUs without AMX where oneDNN generates the kernel). Where oneDNN cannot generate it
//   (e.g. AVX-512 without BF16) the route is unavailable: lowp_vnni_available() probes it once with a product of known
//   result. Option 4 runs the same packing with the micro-kernel replaced by a scalar loop reading the packed
//   operands, so that a CPU without the micro-kernel tests the packing (tests/test_cpu_lowp_products.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/options.h"
#include "cpu/simd.h"

namespace ppma {
namespace cpu {

// Which products the attention kernels run for bf16 / fp16 q, k, v (the internal option cpu_lowp_products).
enum class LowpRoute { kSimd, kGemm, kVnni, kVnniEmulated };

// dst[c * ldd + r] = src[r * ss + c] for r < n, c < cols: rows of an [n][cols] operand transposed. 16-bit values
// (bf16 / fp16 bits) in 8 x 8 blocks: widened to 32-bit words, moved by transpose_block (cpu/simd.h; shuffles, so the
// bits are kept) and narrowed again; the rest, and other types, one by one.
template <typename T>
inline void transpose_rows(int64_t n, int64_t cols, const T* src, int64_t ss, T* __restrict dst, int64_t ldd) {
  int64_t r0 = 0;
  if constexpr (sizeof(T) == 2) {
    const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
    uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
    for (; r0 + 8 <= n; r0 += 8) {
      int64_t c0 = 0;
      for (; c0 + 8 <= cols; c0 += 8) {
        uint32_t blk[64], t[64];
        for (int r = 0; r < 8; ++r)
          for (int c = 0; c < 8; ++c) blk[r * 8 + c] = s16[(r0 + r) * ss + c0 + c];
        transpose_block<8>(reinterpret_cast<const float*>(blk), 8, reinterpret_cast<float*>(t), 8);
        for (int c = 0; c < 8; ++c)
          for (int r = 0; r < 8; ++r) d16[(c0 + c) * ldd + r0 + r] = static_cast<uint16_t>(t[c * 8 + r]);
      }
      for (int64_t r = r0; r < r0 + 8; ++r)
        for (int64_t c = c0; c < cols; ++c) dst[c * ldd + r] = src[r * ss + c];
    }
  }
  for (int64_t r = r0; r < n; ++r) {
    const T* s = src + r * ss;
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = s[c];
  }
}

// n floats times a (float32 products; a = 1: the floats themselves) rounded (to nearest even) to Lp: bf16 by
// float_to_bf16 (cpu/simd.h: c10::BFloat16's rounding, written so that the loop vectorises; a NaN stays a quiet
// NaN), fp16 by c10::Half.
template <typename Lp>
inline void to_lowp(int64_t n, const float* __restrict x, Lp* __restrict dst, float a = 1.f) {
  if constexpr (std::is_same_v<Lp, c10::BFloat16>) {
    uint16_t* o = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) o[e] = float_to_bf16(x[e] * a);
  } else {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<Lp>(x[e] * a);
  }
}

// X [n][cols] (row stride xs) times a, rounded to Lp and transposed: dst[c * ldd + r] = Lp(a X[r][c]) (rounding,
// then transposing: the same bits). 8 x 8 blocks transposed as floats (transpose_block), then rounded a row at a
// time.
template <typename Lp>
inline void to_lowp_transposed(int64_t n, int64_t cols, const float* X, int64_t xs, Lp* __restrict dst, int64_t ldd,
                               float a = 1.f) {
  int64_t r0 = 0;
  for (; r0 + 8 <= n; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      float t[64];
      transpose_block<8>(X + r0 * xs + c0, xs, t, 8);
      for (int c = 0; c < 8; ++c) to_lowp(8, t + c * 8, dst + (c0 + c) * ldd + r0, a);
    }
    for (int64_t r = r0; r < r0 + 8; ++r)
      for (int64_t c = c0; c < cols; ++c) to_lowp(1, X + r * xs + c, dst + c * ldd + r, a);
  }
  for (int64_t r = r0; r < n; ++r)
    for (int64_t c = 0; c < cols; ++c) to_lowp(1, X + r * xs + c, dst + c * ldd + r, a);
}

// B [k][ldb] (k, n > 0) reordered as [kp / 2][n][2], kp = k rounded up to even: dst[(r / 2) * 2n + 2c + r % 2] =
// B[r][c], the row past an odd k zero. The layout of torch's at::vec::pack_vnni2 and oneDNN's VNNI-2 B operand.
template <typename Lp>
inline void pack_vnni2(int64_t k, int64_t n, const Lp* b, int64_t ldb, Lp* __restrict dst) {
  static_assert(sizeof(Lp) == 2, "16-bit operands");
  for (int64_t r = 0; r < k; r += 2) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(b + r * ldb);
    uint16_t* o = reinterpret_cast<uint16_t*>(dst + r * n);
    if (r + 1 < k) {
      const uint16_t* r1 = r0 + ldb;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[2 * c] = r0[c], o[2 * c + 1] = r1[c];
    } else {
      for (int64_t c = 0; c < n; ++c) o[2 * c] = r0[c], o[2 * c + 1] = 0;
    }
  }
}

// B packed by pack_vnni2 into buf (grown as needed); returns the packed copy.
template <typename Lp>
inline const Lp* pack_vnni2_into(std::vector<Lp>& buf, int64_t k, int64_t n, const Lp* b, int64_t ldb) {
  const int64_t kp = (k + 1) / 2 * 2;
  if (static_cast<int64_t>(buf.size()) < kp * n) buf.resize(kp * n);
  pack_vnni2(k, n, b, ldb, buf.data());
  return buf.data();
}

// What the micro-kernel computes, in a scalar loop: C[m][n] = (C if add else 0) + A[m][kp] B, B packed by pack_vnni2
// (option 4: tests the packing where the micro-kernel is unavailable; float32 products and sums).
template <typename Lp>
inline void vnni_gemm_emulated(int64_t m, int64_t n, int64_t kp, const Lp* a, int64_t lda, const Lp* bp, float* c,
                               int64_t ldc, bool add) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.f;
      for (int64_t r = 0; r < kp; ++r)
        s += static_cast<float>(a[i * lda + r]) * static_cast<float>(bp[(r / 2) * 2 * n + 2 * j + (r % 2)]);
      c[i * ldc + j] = add ? c[i * ldc + j] + s : s;
    }
  }
}

// Keeps the VNNI micro-kernel's hardware context (AMX's tile configuration) on this thread from one product to the
// next while alive, and releases it when the last one on the thread goes. Each worker of the lowp kernels holds one
// in its scratch (created and destroyed on the worker's thread, around its loop over tasks), as torch's own CPU flash
// attention releases once after its loop: between two products of a worker only ppma's own code runs, and torch's
// brgemm reconfigures the tiles itself when a product's shape differs from the previous one's. Without a hold (the
// probe, a product outside the kernels' tasks) every product releases after itself, so nothing of it outlives the
// call (a oneDNN primitive on the same thread may release or reconfigure the tiles between two calls). Not copyable:
// its scratch is made in place (a returned temporary).
class VnniHold {
 public:
  VnniHold() { ++depth(); }
  ~VnniHold() {
    if (--depth() == 0 && used()) {
      used() = false;
      at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    }
  }
  VnniHold(const VnniHold&) = delete;
  VnniHold& operator=(const VnniHold&) = delete;

  // After a product on the micro-kernel: release now where no hold is alive on this thread, else at its end.
  static void after_product() {
    if (depth() > 0)
      used() = true;
    else
      at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  }

 private:
  static int& depth() {
    thread_local int n = 0;
    return n;
  }
  static bool& used() {
    thread_local bool u = false;
    return u;
  }
};

// The product on the VNNI route with B packed already (pack_vnni2, kp = k rounded up to even rows): A copied into a
// buffer of the calling thread with a zero column where k is odd. The micro-kernel's hardware context is released
// after the call, or at the end of the thread's VnniHold.
template <typename Lp>
inline void lowp_gemm_vnni_packed(int64_t m, int64_t n, int64_t k, const Lp* a, int64_t lda, const Lp* bp, float* c,
                                  int64_t ldc, bool add, bool emulate) {
  thread_local std::vector<Lp> ap;
  const int64_t kp = (k + 1) / 2 * 2;
  if (kp != k) {
    if (static_cast<int64_t>(ap.size()) < m * kp) ap.resize(m * kp);
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(ap.data() + i * kp, a + i * lda, k * sizeof(Lp));
      ap[i * kp + k] = Lp(0.f);
    }
    a = ap.data(), lda = kp;
  }
  if (emulate) {
    vnni_gemm_emulated(m, n, kp, a, lda, bp, c, ldc, add);
  } else {
    at::native::cpublas::brgemm(m, n, kp, lda, n, ldc, add, a, bp, c, /*is_vnni=*/true);
    VnniHold::after_product();
  }
}

// lowp_gemm on the VNNI route (the header's comment) for a B used once: packed into a buffer of the calling thread
// on every call (a k x n copy beside the m x n x k product). A B that several products share: LowpOperand.
template <typename Lp>
inline void lowp_gemm_vnni(int64_t m, int64_t n, int64_t k, const Lp* a, int64_t lda, const Lp* b, int64_t ldb,
                           float* c, int64_t ldc, bool add, bool emulate) {
  thread_local std::vector<Lp> bp;
  lowp_gemm_vnni_packed(m, n, k, a, lda, pack_vnni2_into(bp, k, n, b, ldb), c, ldc, add, emulate);
}

// Whether torch's VNNI micro-kernel route runs correctly for Lp on this CPU: two products with known results (odd and
// even k, leading dimensions past the sizes, with and without add), on the real micro-kernel. False where torch or
// oneDNN refuses (an exception: no ukernel in this torch build, or no kernel for this CPU) or a result differs.
template <typename Lp>
inline bool vnni_probe() {
  try {
    for (const int64_t k : {7, 16}) {
      const int64_t m = 3, n = 5, lda = k + 3, ldb = n + 2, ldc = n + 1;
      std::vector<Lp> a(m * lda, Lp(0.f)), b(k * ldb, Lp(0.f));
      std::vector<float> c(m * ldc, 0.f), want(m * ldc, 0.f);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < k; ++r) a[i * lda + r] = Lp(static_cast<float>((i * 7 + r * 3) % 5) - 2.f);
      for (int64_t r = 0; r < k; ++r)
        for (int64_t j = 0; j < n; ++j) b[r * ldb + j] = Lp(static_cast<float>((r * 5 + j * 2) % 7) - 3.f);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          float s = 0.f;  // small integers: exact in 16 bits and in every order of float32 sums
          for (int64_t r = 0; r < k; ++r) s += static_cast<float>(a[i * lda + r]) * static_cast<float>(b[r * ldb + j]);
          want[i * ldc + j] = s;
        }
      for (const bool add : {false, true}) {
        lowp_gemm_vnni(m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc, add, /*emulate=*/false);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j)
            if (c[i * ldc + j] != (add ? 2.f : 1.f) * want[i * ldc + j]) return false;
      }
    }
    return true;
  } catch (...) {
    return false;
  }
}

// Whether the VNNI route runs on this CPU for dtype t (bf16 or fp16), probed once per dtype.
inline bool lowp_vnni_available(at::ScalarType t) {
  if (t == at::kBFloat16) {
    static const bool ok = vnni_probe<c10::BFloat16>();
    return ok;
  }
  if (t == at::kHalf) {
    static const bool ok = vnni_probe<c10::Half>();
    return ok;
  }
  return false;
}

// Whether torch packs bf16 (or fp16) operands for its batch-reduce micro-kernels on this CPU (AMX), read once.
inline bool lowp_gemm_native(at::ScalarType t) {
  static const bool bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool f16 = at::native::cpublas::could_pack(at::kHalf);
  return t == at::kBFloat16 ? bf16 : (t == at::kHalf ? f16 : false);
}

// The products of q, k, v of dtype t: the internal option cpu_lowp_products (common/options.h): 1 (and 5, with the
// bf16 dot products emulated: cpu/simd.h cpu_bf16_dot_emulated) ppma's SIMD products, 2 the plain route, 3 the
// VNNI route (an error where it is unavailable: lowp_vnni_available), 4 the VNNI route emulated; 0 (default) where
// torch's CPU flash attention would take its batch-reduce micro-kernels (lowp_gemm_native: AMX) the VNNI route, or
// the plain one should its probe fail, and the SIMD products elsewhere.
// Other dtypes than bf16 and fp16: the SIMD products (their float32 paths).
inline LowpRoute lowp_route(at::ScalarType t) {
  if (t != at::kBFloat16 && t != at::kHalf) return LowpRoute::kSimd;
  switch (get_option(Option::kCpuLowpProducts)) {
    case 1:
    case 5:
      return LowpRoute::kSimd;
    case 2:
      return LowpRoute::kGemm;
    case 3:
      TORCH_CHECK(lowp_vnni_available(t), "ppma: internal option cpu_lowp_products=3: torch's VNNI-packed ",
                  "batch-reduce micro-kernel (at::native::cpublas::brgemm with is_vnni) does not run ", t,
                  " products on this CPU (oneDNN generates it for AMX, or AVX-512 BF16 for bf16); use 0, 1 or 2");
      return LowpRoute::kVnni;
    case 4:
      return LowpRoute::kVnniEmulated;
    default:
      if (!lowp_gemm_native(t)) return LowpRoute::kSimd;
      return lowp_vnni_available(t) ? LowpRoute::kVnni : LowpRoute::kGemm;
  }
}

// The route's name, as ppma.backends.cpu_lowp_route reports it.
inline const char* lowp_route_name(LowpRoute r) {
  switch (r) {
    case LowpRoute::kGemm:
      return "brgemm";
    case LowpRoute::kVnni:
      return "brgemm_vnni";
    case LowpRoute::kVnniEmulated:
      return "brgemm_vnni_emulated";
    default:
      return "simd";
  }
}

// C[m][n] = (C[m][n] if add else 0) + sum_k A[m][k] B[k][n]; A [m][lda], B [k][ldb] in Lp (c10::BFloat16 or
// c10::Half), C [m][ldc] float32. m, n, k > 0. On the route of lowp_route(Lp) (the kernels call it where that is not
// kSimd).
template <typename Lp>
inline void lowp_gemm(int64_t m, int64_t n, int64_t k, const Lp* a, int64_t lda, const Lp* b, int64_t ldb, float* c,
                      int64_t ldc, bool add) {
  switch (lowp_route(c10::CppTypeToScalarType<Lp>::value)) {
    case LowpRoute::kVnni:
      lowp_gemm_vnni(m, n, k, a, lda, b, ldb, c, ldc, add, /*emulate=*/false);
      break;
    case LowpRoute::kVnniEmulated:
      lowp_gemm_vnni(m, n, k, a, lda, b, ldb, c, ldc, add, /*emulate=*/true);
      break;
    default:
      at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/false);
  }
}

// Whether route r multiplies VNNI-packed B operands.
inline bool vnni_route(LowpRoute r) { return r == LowpRoute::kVnni || r == LowpRoute::kVnniEmulated; }

// B = Bt^T, Bt [n][k] (row stride ldbt), as route r's B operand in dst (ceil(k / 2) * 2 * n values): on the VNNI
// routes packed straight into the VNNI-2 layout, which for a transposed operand is Bt's rows cut into pairs of
// features, transposed as 32-bit words (gather_pairs_t, cpu/simd.h); on the plain route transposed into row-major
// B [k][n].
template <typename Lp>
inline void pack_transposed(LowpRoute r, int64_t n, int64_t k, const Lp* bt, int64_t ldbt, Lp* __restrict dst) {
  if (vnni_route(r)) {
    gather_pairs_t(n, k, reinterpret_cast<const uint16_t*>(bt), ldbt, reinterpret_cast<uint32_t*>(dst), n);
  } else {
    transpose_rows(n, k, bt, ldbt, dst, n);
  }
}

// C[m][n] = (C if add else 0) + A[m][k] Bt^T: lowp_gemm with B given by its rows transposed, Bt [n][k] (row stride
// ldbt; e.g. the keys of q k^T), packed by pack_transposed into scratch (ceil(k / 2) * 2 * n values of the calling
// task).
template <typename Lp>
inline void lowp_gemm_bt(int64_t m, int64_t n, int64_t k, const Lp* a, int64_t lda, const Lp* bt, int64_t ldbt,
                         float* c, int64_t ldc, bool add, Lp* __restrict scratch) {
  const LowpRoute route = lowp_route(c10::CppTypeToScalarType<Lp>::value);
  pack_transposed(route, n, k, bt, ldbt, scratch);
  if (vnni_route(route)) {
    lowp_gemm_vnni_packed(m, n, k, a, lda, scratch, c, ldc, add, route == LowpRoute::kVnniEmulated);
  } else {
    at::native::cpublas::brgemm(m, n, k, lda, n, ldc, add, a, scratch, c, /*is_vnni=*/false);
  }
}

// A B operand [k][n] (row stride ldb) that several lowp_gemm products share, e.g. the keys or values of a (batch,
// head) against each of its query tiles: on the VNNI routes packed once by set() (as torch's CPU flash attention
// packs a head's keys and values once for all its query blocks), each product then running on the packed copy; on
// the plain route the operand as it is. The products equal lowp_gemm's on the same B bitwise (the same packing and
// micro-kernel call). set() reads the route: call it inside the op, after the option is read for the op's dtype.
template <typename Lp>
struct LowpOperand {
  const Lp* b = nullptr;
  int64_t k = 0, n = 0, ldb = 0;
  LowpRoute route = LowpRoute::kGemm;
  std::vector<Lp> packed;  // [kp / 2][n][2] on the VNNI routes; set_transposed's B [k][n] on the plain route

  void set(int64_t k_, int64_t n_, const Lp* b_, int64_t ldb_) {
    k = k_, n = n_, b = b_, ldb = ldb_;
    route = lowp_route(c10::CppTypeToScalarType<Lp>::value);
    if (vnni_route(route)) pack_vnni2_into(packed, k, n, b, ldb);
  }

  // B = Bt^T, Bt [n][k] (row stride ldbt; e.g. a head's keys for q k^T), packed by pack_transposed into a buffer of
  // its own.
  void set_transposed(int64_t k_, int64_t n_, const Lp* bt, int64_t ldbt) {
    k = k_, n = n_;
    route = lowp_route(c10::CppTypeToScalarType<Lp>::value);
    const int64_t kp = (k + 1) / 2 * 2;
    if (static_cast<int64_t>(packed.size()) < kp * n) packed.resize(kp * n);
    pack_transposed(route, n, k, bt, ldbt, packed.data());
    b = packed.data(), ldb = n;  // read on the plain route only
  }
};

// lowp_gemm with B a LowpOperand (its k and n): C[m][n] = (C if add else 0) + A[m][k] B.
template <typename Lp>
inline void lowp_gemm(int64_t m, const Lp* a, int64_t lda, const LowpOperand<Lp>& B, float* c, int64_t ldc,
                      bool add) {
  if (vnni_route(B.route)) {
    lowp_gemm_vnni_packed(m, B.n, B.k, a, lda, B.packed.data(), c, ldc, add, B.route == LowpRoute::kVnniEmulated);
  } else {
    at::native::cpublas::brgemm(m, B.n, B.k, lda, B.ldb, ldc, add, a, B.b, c, /*is_vnni=*/false);
  }
}

// Whether the attention kernels' products of q, k, v of dtype t run on lowp_gemm (any route but the SIMD products).
inline bool use_lowp_gemm(at::ScalarType t) { return lowp_route(t) != LowpRoute::kSimd; }

// Whether an attention op's products of q, k, v run on lowp_gemm: one dtype, bf16 or fp16, where use_lowp_gemm.
inline bool lowp_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() && use_lowp_gemm(q.scalar_type());
}

// f(Lp{}) for Lp the C++ type of t (bf16 or fp16; the caller checks).
template <typename F>
inline void dispatch_lowp(at::ScalarType t, F&& f) {
  if (t == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    f(c10::Half{});
  }
}

}  // namespace cpu
}  // namespace ppma
