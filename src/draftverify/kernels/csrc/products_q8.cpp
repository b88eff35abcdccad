// The q8 arithmetic (kernels/q8.py): y = x W^T with W a GGUF block weight in the U4 / U8 layouts of
// products_blocks.cpp (codes q, fp32 D and M per sub-block of 16 or 32, w = D q + M) and x rounded to int8 per
// block of 32 activations, as llama.cpp rounds them for its Q8_0 dot products:
//   dx = max|x| / 127, qx = round-to-nearest-even(x * (1 / dx)) in -127..127 (dx = 0: all codes 0).
// Per sub-block s the integer sums I_s = sum q qx (u8 x s8) and X_s = sum qx are exact (int32, below 2^24, so exact
// in fp32 too); then, in fp32 and in this fixed order, lane s % 8 of an 8-lane accumulator takes
//   acc = fma(D_s * dx_s, I_s, acc); acc = fma(M_s * dx_s, X_s, acc)
// over the sub-blocks in order (zero lanes past the last sub-block), and y = ((a0 + a4) + (a2 + a6)) +
// ((a1 + a5) + (a3 + a7)) (+ bias). Every row is rounded and summed alone, whatever M is, so each row of a forward is
// bit for bit the one-row product of that row (row independence by construction), and the integer parts do not depend
// on the instruction set: AVX-512 VNNI (vpdpbusd), AVX-VNNI where built with it, else AVX2 maddubs + madd give the
// same bits. kernels/q8.py `reference` is this arithmetic in numpy, which the tests compare bit for bit.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"

namespace {
enum Layout : int64_t { U4 = 0, U8 = 1 };

// Lane j: sum of w[4j + i] * x[4j + i], i < 4 (codes u8 x activations s8), as vpdpbusd forms it.
template <int L>
inline __m256i dot32(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__)
  const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(w), _mm512_zextsi256_si512(x));
  return _mm512_castsi512_si256(s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  // maddubs adds pairs in int16 with saturation: codes <= 15 keep each pair within 2 * 15 * 127; U8 codes are split
  // into nibbles so that it holds for them too.
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  if constexpr (L == U4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, low), x), ones);
  const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), x), ones);
  return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
#endif
}

// The 32 codes of block b of output row n, one a byte, in weight order.
template <int L>
inline __m256i codes32(const uint8_t* codes, int64_t K, int64_t n, int64_t b) {
  if constexpr (L == U4) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + n * (K / 2) + b * 16));
    const __m128i f = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), f), _mm_and_si128(p, f));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + n * K + b * 32));
  }
}

// Sub-block sums of a group of 8 sub-blocks, lane s = sub-block s: from 8 blocks of 32 (S = 32) or 4 (S = 16).
template <int S>
inline __m256i group_sums(const __m256i* v) {
  if constexpr (S == 32) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    const __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    return _mm256_set_m128i(s1, s0);
  } else {  // lanes: sub-blocks 0 2 4 6 | 1 3 5 7, put in order
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
}

// x [M, K] rounded per block of 32: qx int8 [M, K]; per sub-block, padded to whole groups of 8 with zeros,
// dx [M, G * 8] (the block's scale) and sx [M, G * 8] (the sub-block's sum of qx, as a float).
void round_rows(const float* x, int64_t M, int64_t K, int S, int64_t G, int8_t* qx, float* dx, float* sx) {
  std::fill(dx, dx + M * G * 8, 0.0f);
  std::fill(sx, sx + M * G * 8, 0.0f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = x + r * K + b * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 1.0f / d : 0.0f;
      int32_t sum[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[i] * inv)));
        qx[r * K + b * 32 + i] = static_cast<int8_t>(q);
        sum[S == 16 && i >= 16] += static_cast<int32_t>(q);
      }
      for (int h = 0; h < 32 / S; ++h) {
        const int64_t s = b * (32 / S) + h;
        dx[r * G * 8 + s] = d;
        sx[r * G * 8 + s] = static_cast<float>(sum[h]);
      }
    }
}

struct Rounded {
  const int8_t* qx;
  const float* dx;
  const float* sx;
};

// Output n for every row of x: y[r, n].
template <int L, int S>
void q8_output(const Rounded& a, const uint8_t* codes, const float* d, const float* m, const float* bias, float* y, float* acc,
               int64_t M, int64_t K, int64_t N, int64_t G, int64_t n) {
  constexpr int kBlocks = S == 32 ? 8 : 4;  // blocks of 32 in a group of 8 sub-blocks
  const int64_t subs = K / S, blocks = K / 32;
  std::fill(acc, acc + M * 8, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    __m256i w[kBlocks];
    const int64_t b0 = g * kBlocks, nb = std::min<int64_t>(kBlocks, blocks - b0);
    for (int i = 0; i < kBlocks; ++i) w[i] = i < nb ? codes32<L>(codes, K, n, b0 + i) : _mm256_setzero_si256();
    alignas(32) float dg[8] = {0}, mg[8] = {0};
    for (int64_t j = 0; j < std::min<int64_t>(8, subs - g * 8); ++j) dg[j] = d[n * subs + g * 8 + j], mg[j] = m[n * subs + g * 8 + j];
    const __m256 D = _mm256_load_ps(dg), Mv = _mm256_load_ps(mg);
    for (int64_t r = 0; r < M; ++r) {
      const int8_t* xr = a.qx + r * K + b0 * 32;
      __m256i v[kBlocks];
      for (int i = 0; i < kBlocks; ++i)
        v[i] = i < nb ? dot32<L>(w[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * i))) : _mm256_setzero_si256();
      const __m256 I = _mm256_cvtepi32_ps(group_sums<S>(v));
      const __m256 dx = _mm256_loadu_ps(a.dx + (r * G + g) * 8), X = _mm256_loadu_ps(a.sx + (r * G + g) * 8);
      __m256 s = _mm256_loadu_ps(acc + r * 8);
      s = _mm256_fmadd_ps(_mm256_mul_ps(D, dx), I, s);
      s = _mm256_fmadd_ps(_mm256_mul_ps(Mv, dx), X, s);
      _mm256_storeu_ps(acc + r * 8, s);
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const float* l = acc + r * 8;
    const float t0 = l[0] + l[4], t1 = l[1] + l[5], t2 = l[2] + l[6], t3 = l[3] + l[7];
    const float total = (t0 + t2) + (t1 + t3);
    y[r * N + n] = bias ? total + bias[n] : total;
  }
}

using OutputFn = decltype(&q8_output<U4, 32>);

OutputFn pick(int64_t layout, int64_t sub) {
  if (layout == U4) return sub == 16 ? q8_output<U4, 16> : q8_output<U4, 32>;
  return sub == 16 ? q8_output<U8, 16> : q8_output<U8, 32>;
}
}  // namespace

// x [M, K] float32 contiguous, K a multiple of 32; layout 0 (U4) or 1 (U8); sub 16 or 32; codes uint8 [N, row bytes];
// d, m float32 [N, K / sub]; bias [N] or empty. Returns y [M, N] in the q8 arithmetic (top of this file).
torch::Tensor q8_linear(torch::Tensor x, int64_t layout, int64_t sub, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                        torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_linear: x must be [M, K] float32");
  TORCH_CHECK((layout == U4 || layout == U8) && (sub == 16 || sub == 32), "q8_linear: layout 0 (u4) or 1 (u8), sub 16 or 32");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), width = layout == U4 ? K / 2 : K;
  TORCH_CHECK(K % 32 == 0 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == N * width,
              "q8_linear: codes must be uint8 [N, row bytes] and K a multiple of 32");
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && d.is_contiguous() && m.is_contiguous() &&
                  d.numel() == N * K / sub && m.numel() == N * K / sub,
              "q8_linear: d and m must be float32 [N, K / sub]");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N && bias.is_contiguous()), "q8_linear: bias");
  const int64_t G = (K / sub + 7) / 8;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * G * 8), sx(M * G * 8);
  round_rows(x.data_ptr<float>(), M, K, static_cast<int>(sub), G, qx.data(), dx.data(), sx.data());
  auto y = torch::empty({M, N}, x.options());
  const Rounded a{qx.data(), dx.data(), sx.data()};
  const OutputFn out = pick(layout, sub);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>(), *bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M * 8);
    for (int64_t n = n0; n < n1; ++n) out(a, cp, dp, mp, bp, yp, acc.data(), M, K, N, G, n);
  });
  return y;
}
