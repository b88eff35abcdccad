// The static path's CPU kernels (fp32, AVX2 + FMA; AVX-512 where the CPU has it): the one-row matrix product,
// RMSNorm, the exact quantized products, the attention of a few new tokens, SiLU(gate) * up, one decoder
// layer of those in one call and the draft-only ops, one file per operation and weight layout (module.cpp lists them).
// This file:
//
// linear: y[n] = sum_k x[k] * w[n, k] (+ bias[n]) for one row x.
// Autoregressive decoding and drafting multiply one row by every weight matrix, so their time
// is the time to stream the weights from memory once. Each thread walks its output rows in
// order, one sequential weight stream that the hardware prefetcher follows, with four
// independent 8-lane FMA accumulators to hide the FMA latency, which is why one row comes here rather
// than to oneDNN's prepacked product (the bench's forward cost curve compares the two). Several rows go
// to oneDNN (backend/linear.py). Output rows are split across torch's own thread pool
// (at::parallel_for), so no second thread pool competes for the cores.
//
#include "ops.h"
#include "simd.h"

namespace {
using dv::hsum4;

#define FMA(acc, wp, xp) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wp), _mm256_loadu_ps(xp), acc)

void one_row(const float* x, const float* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* r = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; k += 32) {
      FMA(a0, r + k, x + k);
      FMA(a1, r + k + 8, x + k + 8);
      FMA(a2, r + k + 16, x + k + 16);
      FMA(a3, r + k + 24, x + k + 24);
    }
    y[n] = hsum4(a0, a1, a2, a3);
  }
}

}  // namespace

// x [1, K], w [N, K]: float32, contiguous, K a multiple of 32; bias [N] or empty.
at::Tensor linear(at::Tensor x, at::Tensor w, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes differ");
  TORCH_CHECK(x.size(0) == 1, "linear: one row");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.size(1) % 32 == 0, "linear: layout");
  const int64_t K = x.size(1), N = w.size(0);
  auto y = at::empty({1, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { one_row(xp, wp, yp, K, n0, n1); });
  if (bias.defined() && bias.numel()) y.add_(bias);
  return y;
}
