// argmax_rows: each row's argmax, as torch.argmax gives it (the first index of the largest value; a row holding a NaN:
// the first NaN's index). Greedy decoding asks it of every verified row (49,152 logits for the default model) and
// ATen's generic reduction reads them at about a byte a nanosecond; this is one vectorised pass. Each lane keeps its
// largest value and that value's first index (it moves only on a strictly larger one), then the lanes holding the
// row's largest value give their smallest index; any NaN sends the row to a scalar search for the first NaN.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace {
int64_t argmax_row(const float* x, int64_t V) {
  int64_t j = 0, best_at = 0;
  float best = -INFINITY;
  bool nan = false;
  if (V >= 8) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), here = at;
    const __m256i step = _mm256_set1_epi32(8);
    for (; j + 8 <= V; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      const __m256 larger = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
      top = _mm256_blendv_ps(top, v, larger);
      at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(here), larger));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      here = _mm256_add_epi32(here, step);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float tops[8];
    alignas(32) int32_t ats[8];
    _mm256_store_ps(tops, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ats), at);
    best = tops[0], best_at = ats[0];
    for (int lane = 1; lane < 8; ++lane)
      if (tops[lane] > best || (tops[lane] == best && ats[lane] < best_at)) best = tops[lane], best_at = ats[lane];
  }
  for (; j < V; ++j) {
    if (std::isnan(x[j])) nan = true;
    else if (x[j] > best) best = x[j], best_at = j;
  }
  if (nan)
    for (int64_t k = 0; k < V; ++k)
      if (std::isnan(x[k])) return k;
  return best_at;
}
}  // namespace

// logits [n, V] float32, contiguous -> each row's argmax (n ints). Rows are shared out between the threads by fours.
std::vector<int64_t> argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: logits must be [n, V] float32, contiguous");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V < (int64_t(1) << 31), "argmax_rows: a row must hold 1 .. 2^31 - 1 logits");
  std::vector<int64_t> out(n);
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * V, V);
  });
  return out;
}
