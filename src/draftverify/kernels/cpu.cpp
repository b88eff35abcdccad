// The static path's CPU kernels (fp32, AVX2 + FMA): the one-row matrix product and RMSNorm.
//
// linear: y[n] = sum_k x[k] * w[n, k] (+ bias[n]) for one row x.
// Autoregressive decoding and drafting multiply one row by every weight matrix, so their time
// is the time to stream the weights from memory once. Each thread walks its output rows in
// order, one sequential weight stream that the hardware prefetcher follows, with four
// independent 8-lane FMA accumulators to hide the FMA latency; on the 2-core test machine it
// streams SmolLM2-135M's fp32 weights faster than oneDNN's prepacked one-row product (the
// forward cost curves in docs/benchmarks/). Several rows go to oneDNN (static.py). Output rows are split across torch's own thread pool
// (at::parallel_for), so no second thread pool competes for the cores.
//
// rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) row by row. ATen's CPU rms_norm is a
// composite of seven ops (about 40 us a call on a few rows of SmolLM2's 576 features, 60 calls
// a forward); this is one pass. Each row is computed alone, so a row's result does not depend
// on how many rows came with it, as for every op of a forward that must give a verified token
// the same logits as a one-token step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

inline float hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t k = 0;
  for (; k + 16 <= H; k += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  const __m256 zero = _mm256_setzero_ps();
  float squares = hsum4(a0, a1, zero, zero);
  for (; k < H; ++k) squares += x[k] * x[k];
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  k = 0;
  for (; k + 8 <= H; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), rv)));
  for (; k < H; ++k) y[k] = w[k] * (x[k] * r);
}

}  // namespace

// x [1, K], w [N, K]: float32, contiguous, K a multiple of 32; bias [N] or empty.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes differ");
  TORCH_CHECK(x.size(0) == 1, "linear: one row");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.size(1) % 32 == 0, "linear: layout");
  const int64_t K = x.size(1), N = w.size(0);
  auto y = torch::empty({1, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { one_row(xp, wp, yp, K, n0, n1); });
  if (bias.defined() && bias.numel()) y.add_(bias);
  return y;
}

// x [..., H] and w [H]: float32, contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1), "rms_norm: layout");
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) norm_row(xp + m * H, wp, yp + m * H, H, static_cast<float>(eps));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ w.T (+ bias) for one row, float32");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row, float32");
}
