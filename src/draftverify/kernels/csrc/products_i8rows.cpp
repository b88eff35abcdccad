// ---- Int8 rows, for drafts only (never the target): y = x W^T with W's rows rounded to int8 with one scale a row
// (kernels/quant.py `i8_rows`) and each row of x rounded the same way when the product is called, the sums
// formed in int32 with AVX-512 VNNI (`vpdpbusd`: 64 products a step, four times the lanes of an fp32 FMA).
// NOT the fp32 weights: a draft's precision changes what it proposes, never what verification accepts.
// vpdpbusd multiplies unsigned by signed bytes, so x is stored as q + 128 and 128 * (the row's sum of q)
// is taken off afterwards. Compiled where the CPU has AVX-512 VNNI; `int8_rows()` says whether it was.
// Measured in-process (2-core Zen 5; the dev prompts plus long stdlib summaries and code prompts, interleaved, 3
// repeats), int8 rows against Q8_0 blocks for the shipped feature head: the same tokens per target forward (1.426
// and 1.426 with `speculative:chain`, 1.581 and 1.570 with `auto`), drafting 0.52 against 0.57 ms a round (0.51
// against 0.58 with `auto`), a 128-row catch-up 2.5-2.7 against 3.5 ms; one head forward and its token choice,
// warm, 0.09 against 0.16 ms. In a round the head's weights come from memory, hence the software prefetch.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "products.h"

using dv::kAheadRows;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Rows = true;

// x [M, K] -> xu [M, K] (round(x / s) + 128, s = max |x| / 127 per row) and s [M]; K a multiple of 16.
void quantize_rows_u8(const float* x, int64_t M, int64_t K, uint8_t* xu, float* sx) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    __m512 top = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
    const float amax = _mm512_reduce_max_ps(top);
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < K; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), inv));  // round to nearest even
      q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xu + r * K + k), _mm512_cvtepi32_epi8(q));
    }
    sx[r] = s;
  }
}

// Outputs n..n+G (G weight rows held in registers per step) against rows r0..r0+R of xu.
template <int G, int R>
inline void i8_tile(const uint8_t* xu, const float* sx, const int8_t* q, const float* d, const int32_t* sums, const float* bias,
                    float* y, int64_t K, int64_t N, int64_t r0, int64_t n) {
  __m512i acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    __m512i w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_si512(q + (n + g) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xu + (r0 + r) * K + k);
      for (int g = 0; g < G; ++g) acc[g][r] = _mm512_dpbusd_epi32(acc[g][r], xv, w[g]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) {
      const int32_t total = _mm512_reduce_add_epi32(acc[g][r]) - 128 * sums[n + g];
      y[(r0 + r) * N + n + g] = static_cast<float>(total) * (d[n + g] * sx[r0 + r]) + (bias ? bias[n + g] : 0.0f);
    }
}

template <int G>
void i8_rows_tile(const uint8_t* xu, const float* sx, const int8_t* q, const float* d, const int32_t* sums, const float* bias,
                  float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  if (n + kAheadRows + G <= N)  // the weight rows kAheadRows ahead, as quant_rows asks for its blocks
    for (int64_t at = 0; at < G * K; at += 64) _mm_prefetch(reinterpret_cast<const char*>(q + (n + kAheadRows) * K) + at, _MM_HINT_T0);
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) i8_tile<G, 4>(xu, sx, q, d, sums, bias, y, K, N, r, n);
  switch (M - r) {
    case 3: i8_tile<G, 3>(xu, sx, q, d, sums, bias, y, K, N, r, n); break;
    case 2: i8_tile<G, 2>(xu, sx, q, d, sums, bias, y, K, N, r, n); break;
    case 1: i8_tile<G, 1>(xu, sx, q, d, sums, bias, y, K, N, r, n); break;
    default: break;
  }
}

// x [M, K] float32 contiguous, K a multiple of 64; q int8 [N, K]; d float32 [N]; sums int32 [N] (each row's sum of q);
// bias [N] or empty. Returns y [M, N].
torch::Tensor i8_rows_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor sums, torch::Tensor bias) {
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  TORCH_CHECK(K % 64 == 0 && q.scalar_type() == at::kChar && q.size(0) == N && q.size(1) == K && sums.scalar_type() == at::kInt &&
              sums.numel() == N && q.is_contiguous() && d.is_contiguous() && sums.is_contiguous(), "quant_linear: int8 rows: shapes");
  auto y = torch::empty({M, N}, x.options());
  std::vector<uint8_t> xu(M * K);
  std::vector<float> sx(M);
  quantize_rows_u8(x.data_ptr<float>(), M, K, xu.data(), sx.data());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const int32_t* sp = sums.data_ptr<int32_t>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = (N + 3) / 4;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = 4 * g;
      if (n + 4 <= N) i8_rows_tile<4>(xu.data(), sx.data(), qp, dp, sp, bp, yp, M, K, N, n);
      else for (int64_t m = n; m < N; ++m) i8_rows_tile<1>(xu.data(), sx.data(), qp, dp, sp, bp, yp, M, K, N, m);
    }
  });
  return y;
}
#else
constexpr bool kInt8Rows = false;

torch::Tensor i8_rows_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "quant_linear: int8 rows need a build with AVX-512 VNNI");
}
#endif

bool int8_rows() { return kInt8Rows; }
