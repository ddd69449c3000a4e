// Host unit tests of the index math of the tensor-core kernels, with plain loops (tests/test_cuda_emulation.py
// builds and runs this program; it prints "ok" and exits 0, or names the first failure and exits 1):
//   1. the fragment coordinates of csrc/kernels/warp_mma.h against the PTX ISA's formulas for mma.m16n8k16
//      (f16 / bf16 inputs, f32 accumulators), written out again here;
//   2. one mma emulated with plain loops through those coordinates equals the matrix product;
//   3. the ldmatrix row addresses of warp_mma.h, run through ldmatrix's documented semantics, give the A and B
//      fragments; two C fragments packed to 16 bits are one A fragment (the P register reuse);
//   4. the per-tile bias tables of polyline_attention_tc.cuh (tc_token, tc_cross_entry_*, tc_bias) give, for every
//      (query tile, key tile) pair of several maps and tilings, the biases M and M' of the direct definitions.
#include "emu.h"
// clang-format off
#include "polyline_attention_tc.cuh"
// clang-format on

#include <cstdio>
#include <random>
#include <vector>

using namespace ppma;

static int failures = 0;
#define EXPECT(cond, ...)                         \
  do {                                            \
    if (!(cond)) {                                \
      if (failures++ < 10) {                      \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                 \
        std::printf("\n");                        \
      }                                           \
    }                                             \
  } while (0)

// PTX ISA formulas, element index i of the fragment (two 16-bit elements per register for A and B).
static int doc_a_row(int lane, int i) { return (i < 2 || (i >= 4 && i < 6)) ? (lane >> 2) : (lane >> 2) + 8; }
static int doc_a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
static int doc_b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
static int doc_b_col(int lane) { return lane >> 2; }
static int doc_c_row(int lane, int i) { return i < 2 ? (lane >> 2) : (lane >> 2) + 8; }
static int doc_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

static void test_coordinates() {
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        EXPECT(mma::a_row(lane, r) == doc_a_row(lane, 2 * r + h), "a_row lane %d reg %d", lane, r);
        EXPECT(mma::a_col(lane, r, h) == doc_a_col(lane, 2 * r + h), "a_col lane %d reg %d half %d", lane, r, h);
      }
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < 2; ++h) EXPECT(mma::b_row(lane, r, h) == doc_b_row(lane, 2 * r + h), "b_row %d", lane);
    EXPECT(mma::b_col(lane) == doc_b_col(lane), "b_col %d", lane);
    for (int i = 0; i < 4; ++i) {
      EXPECT(mma::c_row(lane, i) == doc_c_row(lane, i), "c_row lane %d i %d", lane, i);
      EXPECT(mma::c_col(lane, i) == doc_c_col(lane, i), "c_col lane %d i %d", lane, i);
    }
  }
}

static float bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
static uint16_t bits(float x) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

static void test_mma_and_ldmatrix() {
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  float A[16][16], B[16][8], C[16][8];
  for (auto& r : A)
    for (float& x : r) x = bf(nd(gen));
  for (auto& r : B)
    for (float& x : r) x = bf(nd(gen));
  // one mma with plain loops: gather the fragments through the helpers, multiply, scatter through the helpers
  float D[16][8] = {};
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int row = mma::c_row(lane, i), col = mma::c_col(lane, i);
      float s = 0;
      for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
      D[row][col] = s;
    }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      C[m][n] = 0;
      for (int k = 0; k < 16; ++k) C[m][n] += A[m][k] * B[k][n];
      EXPECT(std::fabs(C[m][n] - D[m][n]) < 1e-4f, "mma element (%d, %d)", m, n);
    }
  // ldmatrix per its documented semantics, from row-major shared tiles with the kernels' padded row stride
  constexpr int LD = 24;
  uint16_t sa[16 * LD], sk[16 * LD], sv[16 * LD];  // A [m][k]; K [n][k] for two n8 tiles; V [k][n]
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      sa[m * LD + k] = bits(A[m][k]);
      sk[m * LD + k] = bits(A[m][k]);  // n = m: B(k, n) = K[n][k]
      sv[k * LD + m] = bits(A[m][k]);  // V[k][n] with n = m
    }
  auto ldsm = [&](const uint16_t* base, int (*row)(int), int (*col)(int), bool trans, uint32_t (&out)[32][4]) {
    for (int lane = 0; lane < 32; ++lane)
      for (int mi = 0; mi < 4; ++mi) {
        uint16_t h[2];
        for (int e = 0; e < 2; ++e) {
          // matrix mi's row r is addressed by lane 8 mi + r; lane receives row lane/4, cols 2 (lane%4) + e
          // (trans: rows 2 (lane%4) + e, col lane/4)
          const int src = trans ? 8 * mi + 2 * (lane % 4) + e : 8 * mi + lane / 4;
          const int c = trans ? lane / 4 : 2 * (lane % 4) + e;
          h[e] = base[row(src) * LD + col(src) + c];
        }
        out[lane][mi] = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
      }
  };
  uint32_t ra[32][4], rb[32][4], rt[32][4];
  ldsm(sa, mma::ldsm_a_row, mma::ldsm_a_col, false, ra);
  ldsm(sk, mma::ldsm_b_row, mma::ldsm_b_col, false, rb);
  ldsm(sv, mma::ldsm_bt_row, mma::ldsm_bt_col, true, rt);
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        const uint16_t got = uint16_t(h ? ra[lane][r] >> 16 : ra[lane][r] & 0xffff);
        EXPECT(got == bits(A[mma::a_row(lane, r)][mma::a_col(lane, r, h)]), "ldsm A lane %d reg %d", lane, r);
      }
    // registers: b0, b1 of n8 tile 0, then b0, b1 of n8 tile 1; the B matrix is A^T (n = m)
    for (int t = 0; t < 2; ++t)
      for (int r = 0; r < 2; ++r)
        for (int h = 0; h < 2; ++h) {
          const float want = A[8 * t + mma::b_col(lane)][mma::b_row(lane, r, h)];
          const uint16_t gb = uint16_t(h ? rb[lane][2 * t + r] >> 16 : rb[lane][2 * t + r] & 0xffff);
          const uint16_t gt = uint16_t(h ? rt[lane][2 * t + r] >> 16 : rt[lane][2 * t + r] & 0xffff);
          EXPECT(gb == bits(want), "ldsm B lane %d tile %d reg %d", lane, t, r);
          EXPECT(gt == bits(want), "ldsm B.trans lane %d tile %d reg %d", lane, t, r);
        }
  }
  // C fragments of n8 tiles 0 and 1 of a 16 x 16 block, packed: the A fragment of that block
  for (int lane = 0; lane < 32; ++lane) {
    float c[2][4];
    for (int t = 0; t < 2; ++t)
      for (int i = 0; i < 4; ++i) c[t][i] = A[mma::c_row(lane, i)][8 * t + mma::c_col(lane, i)];
    uint32_t pf[1][4];
    tc_pack_a<__nv_bfloat16, 2>(pf, c);
    for (int r = 0; r < 4; ++r) EXPECT(pf[0][r] == ra[lane][r], "C -> A repack lane %d reg %d", lane, r);
  }
}

// ---------------------------------------------------------------------------------------------
static double seg(double ct, double cs, int t, int s) { return t >= s ? ct - cs : cs - ct; }

static void test_bias_tables(int H, int W, int BM, int BN) {
  std::mt19937 gen(H * 131 + W);
  std::uniform_real_distribution<float> ud(-1.f, 0.f);
  const int N = H * W;
  std::vector<float> la(N), lb(N), cr(N), cc(N);
  for (int i = 0; i < N; ++i) {
    la[i] = ud(gen);
    lb[i] = ud(gen);
  }
  for (int i = 0; i < H; ++i) {
    float c = 0;
    for (int j = 0; j < W; ++j) {
      if (j > 0) c += la[i * W + j];
      cr[i * W + j] = c;
    }
  }
  for (int j = 0; j < W; ++j) {
    float c = 0;
    for (int i = 0; i < H; ++i) {
      if (i > 0) c += lb[i * W + j];
      cc[i * W + j] = c;
    }
  }
  const RowTiling tq_(H, W, BM), tk_(H, W, BN);
  const int cap_q = tq_.cap(), cap_k = tk_.cap(), TBL = BM > BN ? BM : BN;
  std::vector<float2> xq(TBL), xk(TBL);
  std::vector<char> setq(TBL), setk(TBL);
  for (int a = 0; a < tq_.num_tiles; ++a)
    for (int b = 0; b < tk_.num_tiles; ++b) {
      const TileDesc tq = tq_.tile(a), tk = tk_.tile(b);
      std::fill(setq.begin(), setq.end(), 0);
      std::fill(setk.begin(), setk.end(), 0);
      for (int e = 0; e < tq.rows * tk.ncols; ++e) {
        int idx;
        float2 v;
        tc_cross_entry_q(tq, tk, cap_k, e, cr.data(), cc.data(), W, idx, v);
        EXPECT(idx >= 0 && idx < TBL, "XQ index %d out of the table (H %d W %d)", idx, H, W);
        if (idx < 0 || idx >= TBL) return;
        EXPECT(!setq[idx], "XQ entry %d written twice", idx);
        setq[idx] = 1;
        xq[idx] = v;
      }
      for (int e = 0; e < tk.rows * tq.ncols; ++e) {
        int idx;
        float2 v;
        tc_cross_entry_k(tq, tk, cap_q, e, cr.data(), cc.data(), W, idx, v);
        EXPECT(idx >= 0 && idx < TBL, "XK index %d out of the table (H %d W %d)", idx, H, W);
        if (idx < 0 || idx >= TBL) return;
        EXPECT(!setk[idx], "XK entry %d written twice", idx);
        setk[idx] = 1;
        xk[idx] = v;
      }
      for (int qa = 0; qa < tq.count; ++qa)
        for (int kc = 0; kc < tk.count; ++kc) {
          const TcTok q = tc_token(tq, qa, true, cap_k, cr.data(), cc.data(), W);
          const TcTok k = tc_token(tk, kc, false, cap_q, cr.data(), cc.data(), W);
          EXPECT(setq[q.o1() + k.o1()] && setk[q.o2() + k.o2()], "bias reads an unset table entry");
          float m1, m2;
          tc_bias(q, k, xq[q.o1() + k.o1()], xk[q.o2() + k.o2()], m1, m2);
          const int i = q.row(), j = q.col(), kr = k.row(), l = k.col();
          const int p = tq.tok0 + qa, s = tk.tok0 + kc;
          EXPECT(i * W + j == p && kr * W + l == s, "token of a local index");
          // M[p,s] = R_i(j,l) + C_l(i,k), M'[p,s] = R_k(j,l) + C_j(i,k) (natural units; the tables hold log2 units)
          const double w1 = seg(cr[i * W + j], cr[i * W + l], j, l) + seg(cc[kr * W + l], cc[i * W + l], kr, i);
          const double w2 = seg(cr[kr * W + j], cr[kr * W + l], j, l) + seg(cc[i * W + j], cc[kr * W + j], i, kr);
          EXPECT(std::fabs(m1 / kLog2e - w1) < 1e-5 * (1 + std::fabs(w1)) &&
                     std::fabs(m2 / kLog2e - w2) < 1e-5 * (1 + std::fabs(w2)),
                 "bias H %d W %d BM %d BN %d p %d s %d: %g %g vs %g %g", H, W, BM, BN, p, s, m1 / kLog2e,
                 m2 / kLog2e, w1, w2);
        }
    }
}

int main() {
  test_coordinates();
  test_mma_and_ldmatrix();
  const int maps[][2] = {{1, 1}, {7, 7}, {14, 14}, {3, 20}, {9, 1}, {2, 70}, {1, 300}, {5, 33}, {64, 64}, {3, 130}};
  const int tiles[][2] = {{64, 64}, {64, 32}};
  for (auto& m : maps)
    for (auto& t : tiles) test_bias_tables(m[0], m[1], t[0], t[1]);
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
