// A host emulator of the part of the CUDA execution model that ppma's kernels use, so that the real kernel
// sources (csrc/kernels/*.cuh) run on a machine without a GPU and can be compared against a plain reference.
//
// Include this header before any kernel header and compile with a host compiler (g++ -std=c++17, the CUDA
// toolkit's include folder on the path for cuda_fp16.h / cuda_bf16.h / vector_types.h). It provides:
//   * the CUDA keywords as host code (__global__, __device__ -> nothing; __shared__ -> static: one CTA runs at a
//     time, so a function-static array is exactly "one copy per block");
//   * threadIdx / blockIdx / blockDim / gridDim of the running thread;
//   * __syncthreads, __syncwarp, __shfl_xor_sync, __shfl_sync, __ldg;
//   * warp-collective emulation of mma.sync.m16n8k16 (bf16 / f16 in, f32 accumulate), ldmatrix (.x1/.x2/.x4,
//     with and without .trans) and cp.async (16 bytes, zero-fill), written from the PTX ISA's fragment tables
//     (section "Matrix Fragments for mma.m16n8k16 with floating point type" and the ldmatrix description),
//     independently of the helpers in csrc/kernels/warp_mma.h that the kernels use; cp.async copies land only
//     when the issuing thread waits for them;
//   * emu::launch(kernel, grid, block, args...), used by PPMA_LAUNCH in csrc/kernels/common.cuh.
//
// Every block runs as blockDim fibers (ucontext) on one OS thread, round-robin; a fiber runs until it reaches a
// barrier or a warp collective. So execution is deterministic, and a barrier that not every live thread of the
// block reaches (or a warp collective that not all 32 lanes reach) is reported as a deadlock instead of hanging.
// Not emulated: races between threads that the hardware could reorder (the emulator runs fibers to the next
// barrier one after the other), uninitialised shared memory (function-static arrays keep the previous block's
// values), memory-model details, timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>  // before the built-in macros below, which would clash with its declarations
#include <driver_types.h>
#include <ucontext.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __CUDACC__
#error "tests/cuda_emu/emu.h is for host compilers only"
#endif

#define PPMA_EMULATE 1
#undef __shared__
#define __shared__ static
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#define __launch_bounds__(...)
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif

using std::max;
using std::min;

namespace emu {

constexpr int kStack = 512 * 1024;

struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
  ucontext_t ctx;
  enum State { kRunnable, kWaiting, kDone } state = kRunnable;
  uint3 tid{0, 0, 0};
  int lin = 0;                      // linear thread index in the block
  std::vector<AsyncCopy> pending;   // cp.async issued by this thread and not yet waited for
};

struct WarpExchange {  // one slot per lane for the warp collectives
  uint32_t u[32][8];
  float f[32][8];
  const void* ptr[32];
};

struct Machine {
  dim3 grid, block;
  uint3 bid{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  ucontext_t sched;
  int cur = -1;
  int nthreads = 0;
  // barrier state
  int block_arrived = 0;
  std::vector<int> warp_arrived;
  std::vector<WarpExchange> exch;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  long long switches = 0;
};

inline Machine& m() {
  static Machine mm;
  return mm;
}

inline Fiber& self() { return m().fibers[m().cur]; }

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emu: %s (block %u,%u,%u thread %d)\n", what, m().bid.x, m().bid.y, m().bid.z,
               m().cur >= 0 ? m().fibers[m().cur].lin : -1);
  std::abort();
}

inline void yield() {
  Machine& mm = m();
  ++mm.switches;
  swapcontext(&mm.fibers[mm.cur].ctx, &mm.sched);
}

inline int live_in_block() {
  int n = 0;
  for (auto& f : m().fibers) n += f.state != Fiber::kDone;
  return n;
}

// __syncthreads: waits for every live thread of the block (exited threads do not count, as on the hardware).
inline void block_barrier() {
  Machine& mm = m();
  if (++mm.block_arrived == live_in_block()) {
    mm.block_arrived = 0;
    for (auto& f : mm.fibers)
      if (f.state == Fiber::kWaiting) f.state = Fiber::kRunnable;
    yield();  // let the others run first: keeps the interleaving fair
  } else {
    self().state = Fiber::kWaiting;
    yield();
  }
}

// A warp collective: all 32 lanes must take part (the kernels always use full masks).
inline void warp_barrier() {
  Machine& mm = m();
  const int w = self().lin / 32;
  for (int l = 0; l < 32; ++l) {
    const int i = w * 32 + l;
    if (i >= mm.nthreads || mm.fibers[i].state == Fiber::kDone) fail("warp collective with exited or missing lanes");
  }
  if (++mm.warp_arrived[w] == 32) {
    mm.warp_arrived[w] = 0;
    for (int l = 0; l < 32; ++l) {
      Fiber& f = mm.fibers[w * 32 + l];
      if (f.state == Fiber::kWaiting) f.state = Fiber::kRunnable;
    }
    yield();
  } else {
    self().state = Fiber::kWaiting;
    yield();
  }
}

inline int lane() { return self().lin % 32; }
inline WarpExchange& wx() { return m().exch[self().lin / 32]; }

inline void entry() {
  Machine& mm = m();
  mm.body(mm.body_arg);
  if (!mm.fibers[mm.cur].pending.empty()) fail("thread exits with cp.async copies it never waited for");
  mm.fibers[mm.cur].state = Fiber::kDone;
  // a block barrier may now be complete without this thread
  if (mm.block_arrived > 0 && mm.block_arrived == live_in_block()) {
    mm.block_arrived = 0;
    for (auto& f : mm.fibers)
      if (f.state == Fiber::kWaiting) f.state = Fiber::kRunnable;
  }
  // uc_link returns to the scheduler
}

inline void run_block(dim3 grid, dim3 block, uint3 bid, void (*body)(void*), void* arg) {
  Machine& mm = m();
  mm.grid = grid;
  mm.block = block;
  mm.bid = bid;
  mm.body = body;
  mm.body_arg = arg;
  const int n = int(block.x * block.y * block.z);
  if (n % 32 != 0) fail("block size must be a multiple of 32 in the emulator");
  mm.nthreads = n;
  mm.fibers.assign(n, Fiber());
  if (mm.stacks.size() < size_t(n) * kStack) mm.stacks.resize(size_t(n) * kStack);
  mm.warp_arrived.assign(n / 32, 0);
  mm.exch.assign(n / 32, WarpExchange());
  mm.block_arrived = 0;
  for (int i = 0; i < n; ++i) {
    Fiber& f = mm.fibers[i];
    f.lin = i;
    f.tid = uint3{unsigned(i % block.x), unsigned((i / block.x) % block.y), unsigned(i / (block.x * block.y))};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = mm.stacks.data() + size_t(i) * kStack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &mm.sched;
    makecontext(&f.ctx, entry, 0);
  }
  for (;;) {
    bool any = false, ran = false;
    for (int i = 0; i < n; ++i) {
      if (mm.fibers[i].state == Fiber::kDone) continue;
      any = true;
      if (mm.fibers[i].state != Fiber::kRunnable) continue;
      mm.cur = i;
      swapcontext(&mm.sched, &mm.fibers[i].ctx);
      ran = true;
    }
    if (!any) break;
    if (!ran) {
      mm.cur = -1;
      fail("deadlock: threads wait at a barrier that the others never reach");
    }
  }
  mm.cur = -1;
}

std::vector<unsigned char>& dyn_buf();

// Runs kernel(args...) over the whole grid, block after block.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t /*stream*/,
            Args&&... args) {
  struct Call {
    void (*k)(KArgs...);
    std::tuple<std::decay_t<Args>...> a;
  } call{kernel, std::tuple<std::decay_t<Args>...>(args...)};
  auto body = [](void* p) {
    Call* c = static_cast<Call*>(p);
    std::apply([&](auto&... xs) { c->k(xs...); }, c->a);
  };
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) fail("launch with an empty grid");
  if (grid.y > 65535 || grid.z > 65535) fail("gridDim.y / gridDim.z above 65535 (the hardware limit)");
  if (block.x * block.y * block.z > 1024) fail("more than 1024 threads per block");
  if (smem > 227 * 1024) fail("more dynamic shared memory than an sm_90 block can have (227 KiB)");
  std::vector<unsigned char>& buf = dyn_buf();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        buf.assign(smem + 128, 0xff);
        run_block(grid, block, uint3{x, y, z}, body, &call);
      }
}

// ---------------------------------------------------------------------------------------------
// Warp collectives
// ---------------------------------------------------------------------------------------------
template <typename T>
T shfl_xor(T v, int mask) {
  static_assert(sizeof(T) <= 8, "");
  WarpExchange& x = wx();
  const int l = lane();
  std::memcpy(&x.u[l][0], &v, sizeof(T));
  warp_barrier();
  T r;
  std::memcpy(&r, &x.u[l ^ mask][0], sizeof(T));
  warp_barrier();
  return r;
}

template <typename T>
T shfl(T v, int src) {
  WarpExchange& x = wx();
  const int l = lane();
  std::memcpy(&x.u[l][0], &v, sizeof(T));
  warp_barrier();
  T r;
  std::memcpy(&r, &x.u[src & 31][0], sizeof(T));
  warp_barrier();
  return r;
}

inline float b16_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half x;
  std::memcpy(&x, &h, 2);
  return __half2float(x);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: d = A B + c, from the PTX ISA's tables:
//   A (16x16, row-major fragments a0..a7, two per register): row = groupID for ai with i < 2 or 4 <= i < 6,
//     groupID + 8 otherwise; col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4.
//   B (16x8, b0..b3): row = threadID_in_group * 2 + (i & 1), + 8 for i >= 2; col = groupID.
//   C, D (16x8, c0..c3): row = groupID for i < 2, groupID + 8 otherwise; col = threadID_in_group * 2 + (i & 1).
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                         bool bf16) {
  WarpExchange& x = wx();
  const int l = lane();
  for (int r = 0; r < 4; ++r) x.u[l][r] = a[r];
  x.u[l][4] = b[0];
  x.u[l][5] = b[1];
  warp_barrier();
  float A[16][16], B[16][8];
  for (int ln = 0; ln < 32; ++ln) {
    const int gid = ln >> 2, tig = ln % 4;
    for (int i = 0; i < 8; ++i) {
      const uint32_t reg = x.u[ln][i / 2];
      const uint16_t h = uint16_t((i & 1) ? reg >> 16 : reg & 0xffffu);
      const int row = (i < 2 || (i >= 4 && i < 6)) ? gid : gid + 8;
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = b16_to_float(h, bf16);
    }
    for (int i = 0; i < 4; ++i) {
      const uint32_t reg = x.u[ln][4 + i / 2];
      const uint16_t h = uint16_t((i & 1) ? reg >> 16 : reg & 0xffffu);
      const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][gid] = b16_to_float(h, bf16);
    }
  }
  warp_barrier();
  const int gid = l >> 2, tig = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? gid : gid + 8, col = tig * 2 + (i & 1);
    float s = c[i];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] = s;
  }
}

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16: threads 8m .. 8m+7 give the row addresses of
// matrix m (16 bytes each); register m of lane l then holds elements (row l / 4, cols 2 (l % 4), +1) of matrix
// m, or with .trans elements (rows 2 (l % 4), +1, col l / 4), the lower half first.
inline void ldmatrix(uint32_t* r, int count, bool trans, const void* row_ptr) {
  WarpExchange& x = wx();
  const int l = lane();
  x.ptr[l] = row_ptr;
  warp_barrier();
  const int gid = l >> 2, tig = l % 4;
  for (int mi = 0; mi < count; ++mi) {
    uint16_t h[2];
    for (int e = 0; e < 2; ++e) {
      const uint16_t* rowp;
      int col;
      if (!trans) {
        rowp = static_cast<const uint16_t*>(x.ptr[8 * mi + gid]);
        col = 2 * tig + e;
      } else {
        rowp = static_cast<const uint16_t*>(x.ptr[8 * mi + 2 * tig + e]);
        col = gid;
      }
      if ((reinterpret_cast<uintptr_t>(rowp) & 15) != 0) fail("ldmatrix row address not 16-byte aligned");
      h[e] = rowp[col];
    }
    r[mi] = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
  }
  warp_barrier();
}

// cp.async (16 bytes; valid == false writes zeros): the copy is only recorded, and done when the issuing thread
// waits (cp_async_wait). So a kernel that reads the destination before its wait (and a barrier, for the other
// threads) reads the poisoned or stale bytes there, as it could on the hardware.
inline void cp_async(void* dst, const void* src, bool valid) { self().pending.push_back({dst, src, valid}); }
inline void cp_async_wait() {
  for (const AsyncCopy& c : self().pending) {
    if ((reinterpret_cast<uintptr_t>(c.dst) & 15) != 0) fail("cp.async destination not 16-byte aligned");
    if (c.valid) {
      if ((reinterpret_cast<uintptr_t>(c.src) & 15) != 0) fail("cp.async source not 16-byte aligned");
      std::memcpy(c.dst, c.src, 16);
    } else {
      std::memset(c.dst, 0, 16);
    }
  }
  self().pending.clear();
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------
// CUDA built-ins seen by the kernels
// ---------------------------------------------------------------------------------------------
namespace emu_builtin {
inline uint3 tidx() { return emu::self().tid; }
inline uint3 bidx() { return emu::m().bid; }
inline dim3 bdim() { return emu::m().block; }
inline dim3 gdim() { return emu::m().grid; }
}  // namespace emu_builtin
#define threadIdx (::emu_builtin::tidx())
#define blockIdx (::emu_builtin::bidx())
#define blockDim (::emu_builtin::bdim())
#define gridDim (::emu_builtin::gdim())

inline void __syncthreads() { emu::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return emu::shfl_xor(v, mask);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) {
  return emu::shfl(v, src);
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }

namespace emu {
// Dynamic shared memory of the running launch (PPMA_DYNAMIC_SMEM); poisoned with 0xff bytes (NaN) before each
// block, so that a read of shared memory that the block never wrote shows up in the results.
inline std::vector<unsigned char>& dyn_buf() {
  static std::vector<unsigned char> b;
  return b;
}
inline void* dynamic_smem() {
  auto& b = dyn_buf();
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(b.data()) + 127) & ~uintptr_t(127));
}
}  // namespace emu
