// rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) row by row. ATen's CPU rms_norm is a
// composite of seven ops (about 40 us a call on a few rows of SmolLM2's 576 features, 60 calls
// a forward); this is one pass. Each row is computed alone, so a row's result does not depend
// on how many rows came with it, as for every op of a forward that must give a verified token
// the same logits as a one-token step.
#include "ops.h"
#include "simd.h"

void dv::norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t k = 0;
  for (; k + 16 <= H; k += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  const __m256 zero = _mm256_setzero_ps();
  float squares = dv::hsum4(a0, a1, zero, zero);
  for (; k < H; ++k) squares += x[k] * x[k];
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  k = 0;
  for (; k + 8 <= H; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), rv)));
  for (; k < H; ++k) y[k] = w[k] * (x[k] * r);
}

// x [..., H] and w [H]: float32, contiguous.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1), "rms_norm: layout");
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) dv::norm_row(xp + m * H, wp, yp + m * H, H, static_cast<float>(eps));
  return y;
}
