// The vector helpers every kernel shares: hsum4 (an 8-lane reduction), V16 (16 float lanes: one AVX-512 register,
// or two AVX2 ones, chosen at build time) and exp_nonpositive (a softmax's e^x, scalar and on 16 lanes).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace dv {

inline float hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#ifdef __AVX512F__
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 load(const uint16_t* p) { return halves(p); }  // 16 IEEE halves, upcast exactly
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_halves(uint16_t* p) const {  // rounded to the nearest IEEE half, ties to even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V16 set1(float a) { return {_mm512_set1_ps(a)}; }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static float sum(V16 a) { return _mm512_reduce_add_ps(a.v); }
  static V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  static float max_lane(V16 a) { return _mm512_reduce_max_ps(a.v); }
  static V16 first(V16 a, int k, float fill) {  // lanes k.. set to fill
    return {_mm512_mask_blend_ps(static_cast<__mmask16>((1u << k) - 1), _mm512_set1_ps(fill), a.v)};
  }
  static V16 scale2(V16 p, V16 n) {  // p * 2^n, n whole
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_mul_ps(p.v, _mm512_castsi512_ps(bits))};
  }
  // Lane k: the sum of x[k]'s lanes, by the same tree for every k: (i + i+8), then (+ i+4), (+ i+2), (+ i+1).
  static V16 sums16(const V16* x) {
    __m512 l1[8], l2[4], l3[2];
    for (int p = 0; p < 8; ++p) {  // 128-bit blocks [a0 a1 b0 b1] + [a2 a3 b2 b3]
      const __m512 a = x[2 * p].v, b = x[2 * p + 1].v;
      l1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int p = 0; p < 4; ++p) {  // [u0 u2 w0 w2] + [u1 u3 w1 w3]: one block per vector
      const __m512 u = l1[2 * p], w = l1[2 * p + 1];
      l2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u, w, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u, w, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    for (int p = 0; p < 2; ++p) {  // within blocks: [s0 s1 t0 t1] + [s2 s3 t2 t3]
      const __m512d s = _mm512_castps_pd(l2[2 * p]), t = _mm512_castps_pd(l2[2 * p + 1]);
      l3[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(s, t)), _mm512_castpd_ps(_mm512_unpackhi_pd(s, t)));
    }
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // lane 4 k + m holds x[k + 4 m]
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return {_mm512_permutexvar_ps(order, r)};
  }
  // q4: 16 bytes -> lanes q_0..15 (low nibbles) and q_16..31 (high nibbles)
  static void nibbles(const uint8_t* p, V16& lo, V16& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
    hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
  }
  static V16 bytes(const int8_t* p) {  // 16 signed bytes -> 16 floats
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static V16 ubytes(const uint8_t* p) {  // 16 unsigned bytes -> 16 floats
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static V16 halves(const uint16_t* p) {  // 16 IEEE halves -> 16 floats (exact)
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static V16 bhalves(const uint16_t* p) {  // 16 bfloat16 -> 16 floats (exact: the bits shifted up)
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(b, 16))};
  }
};
#else
struct V16 {
  __m256 a, b;  // lanes 0..7, 8..15
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V16 load(const uint16_t* p) { return halves(p); }  // 16 IEEE halves, upcast exactly
  void store(float* p) const { _mm256_storeu_ps(p, a); _mm256_storeu_ps(p + 8, b); }
  void store_halves(uint16_t* p) const {  // rounded to the nearest IEEE half, ties to even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V16 fma(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  static V16 mul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static V16 add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  static float sum(V16 x) {
    const __m256 z = _mm256_setzero_ps();
    return hsum4(x.a, x.b, z, z);
  }
  static V16 sub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
  static V16 max(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
  static float max_lane(V16 x) {
    __m256 m = _mm256_max_ps(x.a, x.b);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V16 first(V16 x, int k, float fill) {  // lanes k.. set to fill
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 f = _mm256_set1_ps(fill);
    const __m256 keep_a = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), lane));
    const __m256 keep_b = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k - 8), lane));
    return {_mm256_blendv_ps(f, x.a, keep_a), _mm256_blendv_ps(f, x.b, keep_b)};
  }
  static V16 scale2(V16 p, V16 n) {  // p * 2^n, n whole
    const __m256i e = _mm256_set1_epi32(127);
    const __m256i ba = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.a), e), 23);
    const __m256i bb = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.b), e), 23);
    return {_mm256_mul_ps(p.a, _mm256_castsi256_ps(ba)), _mm256_mul_ps(p.b, _mm256_castsi256_ps(bb))};
  }
  // Lane k: the sum of x[k]'s lanes, by the same tree for every k: (i + i+8), then (+ i+4), (+ i+2), (+ i+1).
  static V16 sums16(const V16* x) {
    __m256 out[2];
    for (int half = 0; half < 2; ++half) {
      __m256 y[8], z[4], w[2];
      for (int k = 0; k < 8; ++k) y[k] = _mm256_add_ps(x[8 * half + k].a, x[8 * half + k].b);
      for (int p = 0; p < 4; ++p)  // [y0 lo | y1 lo] + [y0 hi | y1 hi]
        z[p] = _mm256_add_ps(_mm256_permute2f128_ps(y[2 * p], y[2 * p + 1], 0x20), _mm256_permute2f128_ps(y[2 * p], y[2 * p + 1], 0x31));
      for (int p = 0; p < 2; ++p) {  // within 128-bit halves: [s0 s1 t0 t1] + [s2 s3 t2 t3]
        const __m256d s = _mm256_castps_pd(z[2 * p]), t = _mm256_castps_pd(z[2 * p + 1]);
        w[p] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(s, t)), _mm256_castpd_ps(_mm256_unpackhi_pd(s, t)));
      }
      const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
      // lanes hold y0 y2 y4 y6 | y1 y3 y5 y7
      out[half] = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    }
    return {out[0], out[1]};
  }
  static void nibbles(const uint8_t* p, V16& lo, V16& hi) {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i f = _mm256_set1_epi32(15);
    lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, f)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, f))};
    hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
  }
  static V16 bytes(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  static V16 ubytes(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  static V16 halves(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static V16 bhalves(const uint16_t* p) {
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  }
};
#endif

// e^x for x <= 0 (a softmax's shifted scores), Cephes' way: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two
// parts), e^x = 2^n (1 + r + r^2 P(r)); within about 1 ulp of expf. The scalar and the 16-lane forms share these.
constexpr float kExpMin = -87.0f, kLog2e = 1.44269504088896341f, kRoundUp = 12582912.0f;  // 1.5 * 2^23: adding it rounds
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Plain float arithmetic, which the compiler vectorises.
inline float exp_nonpositive(float x) {
  x = x < kExpMin ? kExpMin : x;
  const float n = (x * kLog2e + kRoundUp) - kRoundUp;  // round to nearest
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpP[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp_nonpositive on 16 lanes.
inline V16 exp_nonpositive(V16 x) {
  x = V16::max(x, V16::set1(kExpMin));
  const V16 n = V16::sub(V16::add(V16::mul(x, V16::set1(kLog2e)), V16::set1(kRoundUp)), V16::set1(kRoundUp));
  V16 r = V16::fma(n, V16::set1(-kLn2Hi), x);
  r = V16::fma(n, V16::set1(-kLn2Lo), r);
  V16 p = V16::set1(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = V16::fma(p, r, V16::set1(kExpP[i]));
  p = V16::add(V16::fma(V16::mul(p, r), r, r), V16::set1(1.0f));
  return V16::scale2(p, n);
}

}  // namespace dv
