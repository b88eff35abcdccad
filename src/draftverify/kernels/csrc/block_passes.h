// The pass loop every fp32-rebuilding weight product shares (products_q4q8.cpp, products_blocks.cpp): the products
// differ only in how a 32-weight block is unpacked, which a weight type `W` says with
//   void rebuild(int64_t n, int64_t b, V16& w0, V16& w1) const;  // block b of output row n in fp32 (lanes 0..31)
//   void prefetch(int64_t n) const;                              // ask for output row n's bytes
//   float bias(int64_t n) const;                                 // 0 where there is none
// Every (row, output) sum is formed the same way for any number of rows (two 16-lane accumulators over the blocks in
// order, then one fixed reduction), so each row of a forward is bit for bit the one-row product of that row.
#pragma once
#include <ATen/Parallel.h>

#include "ops.h"
#include "products.h"
#include "simd.h"

namespace dv {

// Rows r0..r0+R of x [M, K] against output rows n0..n1 of W: y [M, N].
template <int R, class W>
void block_pass(const float* x, const W& w, float* y, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t blocks = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    if (n + kAheadRows < N) w.prefetch(n + kAheadRows);
    V16 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = V16::zero();
    for (int64_t b = 0; b < blocks; ++b) {
      V16 w0, w1;
      w.rebuild(n, b, w0, w1);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (r0 + r) * K + b * 32;
        acc0[r] = V16::fma(w0, V16::load(xr), acc0[r]);
        acc1[r] = V16::fma(w1, V16::load(xr + 16), acc1[r]);
      }
    }
    const float bias = w.bias(n);
    for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = V16::sum(V16::add(acc0[r], acc1[r])) + bias;
  }
}

// Rows of x in passes of kPassRows (each pass rebuilds the weights once, in registers, for its rows) against output
// rows n0..n1. A pass's rows of x stay in L1 while the weights stream (the product is bound by arithmetic here). The
// row count is chosen once per pass, outside the loop over outputs. The last pass takes what is left, up to
// kLastRows: with AVX-512's 32 registers 7 or 8 rows go in one pass rather than 6 + 1 or 6 + 2 (a pass of few rows
// costs nearly a one-token product: the weights stream again); with AVX2 (16 registers, a V16 is two) passes of 6.
// docs/backends.md says why. Every pass forms a row's sums the same way, so the split never changes a bit.
constexpr int kPassRows = 6;
#ifdef __AVX512F__
constexpr int kLastRows = 8;
#else
constexpr int kLastRows = kPassRows;
#endif

// The pass of exactly `rows` rows (1..R), chosen once.
template <int R, class W>
void last_pass(const float* x, const W& w, float* y, int64_t rows, int64_t K, int64_t N, int64_t r0, int64_t n0,
               int64_t n1) {
  if constexpr (R > 0) {
    if (rows == R) block_pass<R>(x, w, y, K, N, r0, n0, n1);
    else last_pass<R - 1>(x, w, y, rows, K, N, r0, n0, n1);
  }
}

template <class W>
void block_rows(const float* x, const W& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; M - r > kLastRows; r += kPassRows) block_pass<kPassRows>(x, w, y, K, N, r, n0, n1);
  last_pass<kLastRows>(x, w, y, M - r, K, N, r, n0, n1);
}

// y [M, N] = x [M, K] W^T over torch's thread pool, output rows split in chunks of 16.
template <class W>
void block_product(const float* x, const W& w, float* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { block_rows(x, w, y, M, K, N, n0, n1); });
}
}  // namespace dv
