// The static path's CPU kernels (fp32, AVX2 + FMA; AVX-512 where the CPU has it): the one-row matrix product,
// RMSNorm, the exact quantized product and the attention of a few new tokens, SiLU(gate) * up, and one
// decoder layer of those in one call (below).
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

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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


// ---- Quantized weights, exact: y = x W^T where every 32-weight block of a row of W is stored as it
// was quantized (the model's own GGUF blocks, recovered bit-exactly from its fp32 weights by
// kernels/quant.py):
//   q4 (llama.cpp Q4_1): w_i = fma(q_i, d, m), q_i in 0..15, two per byte (byte j: q_j | q_{j+16} << 4)
//   q8 (llama.cpp Q8_0): w_i = q_i * d,      q_i in -128..127
// Each weight is rebuilt in fp32 exactly as the fp32 model holds it, then multiplied in fp32: the
// same model, reading 5 or 8.5 bits a weight instead of 32. One row's sum is formed the same way
// whatever the number of rows (two 16-lane accumulators over the blocks in order, then one fixed
// reduction), so a verified token's logits are bit for bit those of a one-token step.
#ifdef __AVX512F__
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
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
};
#else
struct V16 {
  __m256 a, b;  // lanes 0..7, 8..15
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const { _mm256_storeu_ps(p, a); _mm256_storeu_ps(p + 8, b); }
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
};
#endif

struct Quant {
  const uint8_t* q;  // q4: [N, K / 2]; q8: [N, K]
  const float* d;    // [N, K / 32]
  const float* m;    // [N, K / 32] (q4) or null (q8)
  const float* bias; // [N] or null
};

// One block's 32 weights of output row n, rebuilt in fp32 (lanes 0..15 and 16..31).
template <bool Q4>
inline void rebuild(const Quant& w, int64_t i, V16& w0, V16& w1) {  // i = n * blocks + b
  const V16 dv = V16::set1(w.d[i]);
  if constexpr (Q4) {
    V16::nibbles(w.q + i * 16, w0, w1);
    const V16 mv = V16::set1(w.m[i]);
    w0 = V16::fma(w0, dv, mv);
    w1 = V16::fma(w1, dv, mv);
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + i * 32;
    w0 = V16::mul(V16::bytes(q), dv);
    w1 = V16::mul(V16::bytes(q + 16), dv);
  }
}

// How many output rows ahead quant_rows asks for the weights (a software prefetch). A one-row product waits on the
// weight stream and a few rows' products on arithmetic; with the hardware prefetcher alone the two did not overlap.
// Measured on SmolLM2 (2-core Zen 5, forwards of 1-8 new tokens interleaved in one process): ~10% faster with 16 rows
// ahead; 8 and 32 alike, 64 slower.
constexpr int64_t kAheadRows = 16;

// Rows r0..r0+R of x [M, K] against output row n of W: y [M, N]. Every (row, output) sum is formed
// the same way for any R: two 16-lane accumulators over the blocks in order, then one fixed reduction.
template <int R, bool Q4>
__attribute__((always_inline)) inline void quant_rows(const float* x, const Quant& w, float* y, int64_t K, int64_t N, int64_t r0, int64_t n) {
  const int64_t blocks = K / 32;
  if (n + kAheadRows < N) {
    const int64_t qbytes = Q4 ? K / 2 : K;
    const char* q = reinterpret_cast<const char*>(w.q) + (n + kAheadRows) * qbytes;
    for (int64_t at = 0; at < qbytes; at += 64) _mm_prefetch(q + at, _MM_HINT_T0);
    const char* d = reinterpret_cast<const char*>(w.d + (n + kAheadRows) * blocks);
    const char* m = Q4 ? reinterpret_cast<const char*>(w.m + (n + kAheadRows) * blocks) : nullptr;
    for (int64_t at = 0; at < blocks * 4; at += 64) {
      _mm_prefetch(d + at, _MM_HINT_T0);
      if constexpr (Q4) _mm_prefetch(m + at, _MM_HINT_T0);
    }
  }
  V16 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = V16::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    V16 w0, w1;
    rebuild<Q4>(w, n * blocks + b, w0, w1);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * K + b * 32;
      acc0[r] = V16::fma(w0, V16::load(xr), acc0[r]);
      acc1[r] = V16::fma(w1, V16::load(xr + 16), acc1[r]);
    }
  }
  const float bias = w.bias ? w.bias[n] : 0.0f;
  for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = V16::sum(V16::add(acc0[r], acc1[r])) + bias;
}

template <int R, bool Q4>
void quant_pass(const float* x, const Quant& w, float* y, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) quant_rows<R, Q4>(x, w, y, K, N, r0, n);
}

// Rows of x in passes of kRows (each pass rebuilds the weights once, in registers, for its rows)
// against output rows n0..n1. A pass's rows of x stay in L1 while the weights stream; measured faster
// than tiling the outputs so that the weights stream once (the product is bound by arithmetic here).
// The row count is chosen once per pass, outside the loop over outputs (choosing it per output made
// 3-5 rows ~15% slower). The last pass takes what is left, up to kLast rows: with AVX-512's 32
// registers 7 or 8 rows go in one pass rather than 6 + 1 or 6 + 2 (a pass of few rows costs nearly a
// one-token product: the weights stream again). Measured on SmolLM2 (2-core Zen 5, whole forwards
// after 128 tokens, interleaved): 7 new tokens 15% faster, 8 6%; passes of 8 throughout or shared out
// evenly (10 rows: 5 + 5) were slower at 9-10 rows. With AVX2 (16 registers, a V16 is two) passes of 6.
// Every pass forms a row's sums the same way, so the split never changes a bit.
constexpr int kRows = 6;
#ifdef __AVX512F__
constexpr int kLast = 8;
#else
constexpr int kLast = kRows;
#endif

// The pass of exactly `rows` rows (1..R), chosen once.
template <int R, bool Q4>
void quant_rows_pass(const float* x, const Quant& w, float* y, int64_t rows, int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  if constexpr (R > 0) {
    if (rows == R) quant_pass<R, Q4>(x, w, y, K, N, r0, n0, n1);
    else quant_rows_pass<R - 1, Q4>(x, w, y, rows, K, N, r0, n0, n1);
  }
}

template <bool Q4>
void quant_block(const float* x, const Quant& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; M - r > kLast; r += kRows) quant_pass<kRows, Q4>(x, w, y, K, N, r, n0, n1);
  quant_rows_pass<kLast, Q4>(x, w, y, M - r, K, N, r, n0, n1);
}


// ---- Attention of a few new tokens against one layer's static cache. Each query row's allowed keys, in slot
// order, are cut into chunks of kChunk (its keys 0..kChunk-1, kChunk..2 kChunk-1, ...: counted over the keys the
// row may attend, so a tree's gaps or the masked keys after a row change no chunk). For each row, head and chunk:
// the scores against the chunk's keys, their maximum m, l = sum e^(s - m) and the unnormalised sum of e^(s - m) v;
// then the chunks are merged in order (out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c). Every (row, head) is
// so computed alone, in a fixed order over the same keys, so a token's attention output does not depend on how many
// tokens came with it or where in the cache its ancestors sit (as for the quantized product). All rows go chunk by
// chunk, so a chunk's keys and values come from memory once and serve every row from L1 (each row used to stream
// the whole cache again: ~1 ms a row at 1,500 cached tokens on SmolLM2), and the threads share out chunks rather
// than the few kv heads. One kernel call replaces the ~6 small ops of the stock formula (two bmm, scale, softmax,
// casts; or SDPA), whose fixed costs dominate at decoding sizes.
constexpr int64_t kChunk = 128;

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

// G query heads (d = 16 * C floats each, consecutive in q) that read the same keys/values [S, d], over one chunk:
// the slots idx[0..count) (count <= kChunk; idx padded to a multiple of 16 with repeats of its last slot). Writes
// each head's partial: top[g] (the chunk's largest score), total[g] and acc (G * d floats, unnormalised). The
// scores go 16 keys at a time (`sums16`: one transposing sum instead of 16 horizontal ones); a key's score, like
// every sum here, is formed the same way wherever the key sits in its 16 and for any G.
template <int C, int G>
void attend_chunk(const float* q, const float* keys, const float* values, const int64_t* idx, int64_t count,
                  float scale, float* top, float* total, float* out) {
  alignas(64) float scores[G][kChunk];
  const int64_t blocks = (count + 15) / 16;
  for (int g = 0; g < G; ++g) {
    V16 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = V16::load(q + g * 16 * C + 16 * c);
    V16 best = V16::set1(-INFINITY);
    for (int64_t b = 0; b < blocks; ++b) {
      V16 dots[16];
      for (int k = 0; k < 16; ++k) {
        const float* key = keys + idx[16 * b + k] * 16 * C;
        V16 acc = V16::mul(qv[0], V16::load(key));
        for (int c = 1; c < C; ++c) acc = V16::fma(qv[c], V16::load(key + 16 * c), acc);
        dots[k] = acc;
      }
      const int valid = static_cast<int>(std::min<int64_t>(16, count - 16 * b));
      const V16 s = V16::first(V16::mul(V16::sums16(dots), V16::set1(scale)), valid, -INFINITY);
      s.store(scores[g] + 16 * b);
      best = V16::max(best, s);
    }
    top[g] = V16::max_lane(best);
    const V16 shift = V16::set1(top[g]);
    V16 sum = V16::zero();
    for (int64_t b = 0; b < blocks; ++b) {
      const int valid = static_cast<int>(std::min<int64_t>(16, count - 16 * b));
      const V16 e = V16::first(exp_nonpositive(V16::sub(V16::load(scores[g] + 16 * b), shift)), valid, 0.0f);
      e.store(scores[g] + 16 * b);
      sum = V16::add(sum, e);
    }
    total[g] = V16::sum(sum);
  }
  V16 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = V16::zero();
  for (int64_t a = 0; a < count; ++a) {
    const float* v = values + idx[a] * 16 * C;
    V16 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = V16::load(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const V16 pj = V16::set1(scores[g][a]);
      for (int c = 0; c < C; ++c) acc[g][c] = V16::fma(pj, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c].store(out + g * 16 * C + 16 * c);
}

// The heads of one kv group (`group` of them) for one query row and one chunk, up to kHeadsAtOnce at a time.
constexpr int kHeadsAtOnce = 3;

template <int C>
void attend_group(const float* q, const float* keys, const float* values, const int64_t* idx, int64_t count, float scale,
                  float* top, float* total, float* out, int64_t group) {
  const int64_t d = 16 * C;
  int64_t h = 0;
  for (; h + kHeadsAtOnce <= group; h += kHeadsAtOnce)
    attend_chunk<C, kHeadsAtOnce>(q + h * d, keys, values, idx, count, scale, top + h, total + h, out + h * d);
  for (; h + 2 <= group; h += 2) attend_chunk<C, 2>(q + h * d, keys, values, idx, count, scale, top + h, total + h, out + h * d);
  for (; h < group; ++h) attend_chunk<C, 1>(q + h * d, keys, values, idx, count, scale, top + h, total + h, out + h * d);
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

// x [M, K] float32 contiguous; q uint8 (q4: [N, K / 2]) or int8 (q8: [N, K]); d [N, K / 32]; m [N, K / 32]
// (q4) or empty (q8); bias [N] or empty. Returns y [M, N].
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "quant_linear: x must be [M, K] float32");
  if (d.dim() == 1) return i8_rows_linear(x, q, d, m, bias);  // a draft's int8 rows (m: the rows' sums of q)
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  const bool q4 = m.numel() > 0;
  TORCH_CHECK(K % 32 == 0 && d.size(1) == K / 32 && q.size(0) == N && q.size(1) == (q4 ? K / 2 : K), "quant_linear: shapes");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && (!q4 || m.is_contiguous()), "quant_linear: layout");
  auto y = torch::empty({M, N}, x.options());
  const Quant w{reinterpret_cast<const uint8_t*>(q.data_ptr()), d.data_ptr<float>(), q4 ? m.data_ptr<float>() : nullptr,
                bias.numel() ? bias.data_ptr<float>() : nullptr};
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (q4) quant_block<true>(xp, w, yp, M, K, N, n0, n1);
    else quant_block<false>(xp, w, yp, M, K, N, n0, n1);
  });
  return y;
}


// q [n, H, d] (rows may be strided; heads and features contiguous); keys, values [kv, capacity, d], the
// first S slots valid (kv divides H: query head h reads kv head h / (H / kv)); mask [n, S] bool (True = may
// attend) or empty (every key); d 16, 32, 64 or 128. All float32. Returns [n, H * d].
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t S, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "attention: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "attention: float32 only");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), kv = keys.size(0), cap = keys.size(1);
  TORCH_CHECK(keys.size(2) == d && (d == 16 || d == 32 || d == 64 || d == 128) && H % kv == 0 && S <= cap, "attention: sizes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && keys.is_contiguous() && values.is_contiguous(), "attention: layout");
  const bool masked = mask.numel() > 0;
  TORCH_CHECK(!masked || (mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.size(0) == n && mask.size(1) == S), "attention: mask");
  auto out = torch::empty({n, H * d}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t group = H / kv, row_stride = q.stride(0);
  const float sc = static_cast<float>(scale);
  // Each row's chunks: chunk c of row i is slots bounds[i][c]..bounds[i][c + 1] - 1, holding kChunk of its allowed keys
  // (the last one the rest); a row with fewer chunks than `chunks` has empty ones at the end.
  std::vector<std::vector<int64_t>> bounds(n);
  int64_t chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t>& b = bounds[i];
    b.push_back(0);
    if (!mp) {
      for (int64_t j = kChunk; j < S; j += kChunk) b.push_back(j);
    } else {
      const bool* allowed = mp + i * S;
      int64_t count = 0;
      for (int64_t j = 0; j < S; ++j)
        if (allowed[j] && ++count % kChunk == 0) b.push_back(j + 1);
      if (count % kChunk == 0) b.pop_back();  // the last boundary closes the last chunk: S does
    }
    b.push_back(S);
    chunks = std::max<int64_t>(chunks, b.size() - 1);
  }
  // Partials per (row, chunk, head) of the rows with more than one chunk: top, total, acc [d] (a kv group's heads
  // together); a row with one chunk is normalised where it is computed (the merge of one chunk, e^0 = 1, is that).
  std::vector<float> tops(n * chunks * H), totals(n * chunks * H), accs(chunks > 1 ? n * chunks * H * d : 0);
  // One task: a kv group's heads over one chunk for one row. Consecutive tasks share the chunk, which stays in
  // L1 from one row to the next.
  at::parallel_for(0, kv * chunks * n, 1, [&](int64_t t0, int64_t t1) {
    int64_t idx[kChunk];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / (chunks * n), c = (t / n) % chunks, i = t % n;
      const std::vector<int64_t>& b = bounds[i];
      const int64_t slot = (i * chunks + c) * H + g * group, mine = static_cast<int64_t>(b.size()) - 1;
      int64_t count = 0;
      if (c < mine) {
        const bool* allowed = mp ? mp + i * S : nullptr;
        for (int64_t j = b[c]; j < b[c + 1]; ++j)
          if (!allowed || allowed[j]) idx[count++] = j;
      }
      if (count == 0) {  // no key of this chunk for this row
        std::fill(&tops[slot], &tops[slot + group], -INFINITY);
        continue;
      }
      for (int64_t a = count; a % 16; ++a) idx[a] = idx[count - 1];
      const float* qh = qp + i * row_stride + g * group * d;
      const float *kg = kp + g * cap * d, *vg = vp + g * cap * d;
      float* acc = mine == 1 ? op + i * H * d + g * group * d : &accs[slot * d];
      switch (d) {
        case 16: attend_group<1>(qh, kg, vg, idx, count, sc, &tops[slot], &totals[slot], acc, group); break;
        case 32: attend_group<2>(qh, kg, vg, idx, count, sc, &tops[slot], &totals[slot], acc, group); break;
        case 64: attend_group<4>(qh, kg, vg, idx, count, sc, &tops[slot], &totals[slot], acc, group); break;
        default: attend_group<8>(qh, kg, vg, idx, count, sc, &tops[slot], &totals[slot], acc, group); break;
      }
      if (mine == 1)
        for (int64_t h = 0; h < group; ++h) {
          const float inv = 1.0f / totals[slot + h];
          for (int64_t e = 0; e < d; ++e) acc[h * d + e] *= inv;
        }
    }
  });
  if (chunks == 1) return out;
  // Each (row, head) of more than one chunk: its chunks merged in order.
  at::parallel_for(0, n * H, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r / H, h = r % H, mine = static_cast<int64_t>(bounds[i].size()) - 1;
      if (mine == 1) continue;
      float M = -INFINITY;
      for (int64_t c = 0; c < mine; ++c) M = std::max(M, tops[(i * chunks + c) * H + h]);
      float* o = op + i * H * d + h * d;
      std::fill(o, o + d, 0.0f);
      float L = 0.0f;
      for (int64_t c = 0; c < mine; ++c) {
        const int64_t slot = (i * chunks + c) * H + h;
        if (tops[slot] == -INFINITY) continue;  // no key of this chunk for this row
        const float w = exp_nonpositive(tops[slot] - M);
        L += w * totals[slot];
        const float* a = &accs[slot * d];
        for (int64_t e = 0; e < d; ++e) o[e] += w * a[e];
      }
      const float inv = 1.0f / L;
      for (int64_t e = 0; e < d; ++e) o[e] *= inv;
    }
  });
  return out;
}

// qkv [n, (H + 2 kv) d]: a layer's fused q/k/v projection of n new tokens (float32, contiguous); cos, sin
// [n, d]: their rotary tables. Rotates q and k (rotate-half convention: x * cos + rotate_half(x) * sin),
// writes k and v into the cache slots past..past + n - 1 of keys / values [kv, capacity, d], and returns
// attention(q, keys, values, past + n, mask, scale) [n, H d]: one call for what is otherwise about ten
// small ops a layer. Each row is handled alone, as in `attention`.
torch::Tensor rope_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values,
                             int64_t past, int64_t heads, torch::Tensor mask, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "rope_attention: qkv");
  const int64_t n = qkv.size(0), kv = keys.size(0), d = keys.size(2), half = d / 2;
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv) * d && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes(),
              "rope_attention: shapes");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && cos.size(1) == d && cos.stride(1) == 1 && sin.sizes() == cos.sizes() && sin.stride(1) == 1 &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope_attention: rotary tables");
  TORCH_CHECK(past + n <= keys.size(1), "rope_attention: cache too small");
  auto q = torch::empty({n, heads, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const int64_t cap = keys.size(1), width = qkv.size(1);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = src + i * width;
    const float* c = cos.data_ptr<float>() + i * cos.stride(0);
    const float* sn = sin.data_ptr<float>() + i * sin.stride(0);
    for (int64_t h = 0; h < heads + kv; ++h) {  // q heads, then k heads: rotated
      const float* x = row + h * d;
      float* out = h < heads ? qp + (i * heads + h) * d : kp + ((h - heads) * cap + past + i) * d;
      for (int64_t j = 0; j < half; ++j) {
        out[j] = x[j] * c[j] - x[j + half] * sn[j];
        out[j + half] = x[j + half] * c[j + half] + x[j] * sn[j + half];
      }
    }
    for (int64_t g = 0; g < kv; ++g) std::memcpy(vp + (g * cap + past + i) * d, row + (heads + kv + g) * d, d * sizeof(float));
  }
  return attention(q, keys, values, past + n, mask, scale);
}

// gate_up [M, 2 I] float32 contiguous (gate | up per row) -> silu(gate) * up [M, I]. silu(g) = g * sigmoid(g),
// the sigmoid from e^-|g| (exp_nonpositive), so every element is formed the same way on every path.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [M, 2 I] float32");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({M, I}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float *g = src + m * 2 * I, *u = g + I;
      float* out = yp + m * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = g[i];
        const float t = exp_nonpositive(x < 0.0f ? x : -x);  // e^-|x|
        out[i] = x * ((x < 0.0f ? t : 1.0f) / (1.0f + t)) * u[i];
      }
    }
  });
  return y;
}

namespace {
// A quantized weight as the static path holds it: {q, d, m (empty for Q8_0), bias (empty for none)}.
torch::Tensor quant_product(const torch::Tensor& x, const std::vector<torch::Tensor>& w) {
  TORCH_CHECK(w.size() == 4, "layer: a weight is {q, d, m, bias}");
  return quant_linear(x, w[0], w[1], w[2], w[3]);
}
}  // namespace

// One pre-norm decoder layer (Llama family, no q/k norms) for a few new rows h [n, H] of one sequence, every
// product quantized: h + o(attention(rope(qkv(norm_in(h))))), then + down(silu_mul(gate_up(norm_post(.)))).
// The same kernels, in the same order, as the static path's op-by-op layer, so the result is the same to the
// bit; one call instead of about a dozen small ops and their dispatch, which dominate at decoding sizes.
torch::Tensor layer(torch::Tensor h, torch::Tensor norm_in, torch::Tensor norm_post, double eps, std::vector<torch::Tensor> qkv,
                    std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, torch::Tensor cos,
                    torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t past, int64_t heads, torch::Tensor mask, double scale) {
  auto attended = rope_attention(quant_product(rms_norm(h, norm_in, eps), qkv), cos, sin, keys, values, past, heads, mask, scale);
  h = h + quant_product(attended, o);
  return h + quant_product(silu_mul(quant_product(rms_norm(h, norm_post, eps), gate_up)), down);
}

// A feature head's layer input (feature_draft.FeatureDraft.inputs) in one call: fc([norm(features) ; norm(embed[tokens])])
// for features [n, H] and embed [V, H] float32, tokens [n] int64 and fc quantized ({q, d, m, bias}, as `layer` takes
// them). The same kernels as the op-by-op path (norm_row per row, a copy, quant_linear), so the same bits.
torch::Tensor head_inputs(torch::Tensor features, torch::Tensor tokens, torch::Tensor embed, torch::Tensor w_feature,
                          torch::Tensor w_embed, double eps, std::vector<torch::Tensor> fc) {
  TORCH_CHECK(features.dim() == 2 && embed.dim() == 2 && features.size(1) == embed.size(1), "head_inputs: shapes");
  TORCH_CHECK(features.scalar_type() == at::kFloat && embed.scalar_type() == at::kFloat && w_feature.scalar_type() == at::kFloat &&
              w_embed.scalar_type() == at::kFloat, "head_inputs: float32 only");
  TORCH_CHECK(features.is_contiguous() && embed.is_contiguous() && w_feature.is_contiguous() && w_embed.is_contiguous() &&
              tokens.is_contiguous() && tokens.scalar_type() == at::kLong && tokens.numel() == features.size(0), "head_inputs: layout");
  const int64_t n = features.size(0), H = features.size(1), V = embed.size(0);
  auto x = torch::empty({n, 2 * H}, features.options());
  const float *fp = features.data_ptr<float>(), *ep = embed.data_ptr<float>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < V, "head_inputs: token id out of range");
    norm_row(fp + i * H, w_feature.data_ptr<float>(), xp + i * 2 * H, H, static_cast<float>(eps));
    norm_row(ep + tp[i] * H, w_embed.data_ptr<float>(), xp + i * 2 * H + H, H, static_cast<float>(eps));
  }
  return quant_product(x, fc);
}

// logits [n, N] float32 -> per row its k largest logits' positions j (ties: the lower j first) as vocab[j] (vocab [N]
// int64) and their probabilities under the softmax of the row's N logits. What a drafter asks of a head's logits each
// step, in one single-threaded pass over a few thousand floats instead of topk, logsumexp and their dispatch.
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_probs(torch::Tensor logits, torch::Tensor vocab, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "top_probs: logits must be [n, N] float32");
  const int64_t n = logits.size(0), N = logits.size(1);
  TORCH_CHECK(vocab.scalar_type() == at::kLong && vocab.is_contiguous() && vocab.numel() == N && k >= 1 && k <= N, "top_probs: vocab, k");
  const int64_t* ids = vocab.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> tokens(n, std::vector<int64_t>(k));
  std::vector<std::vector<double>> probs(n, std::vector<double>(k));
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.data_ptr<float>() + i * N;
    std::fill(best.begin(), best.end(), -INFINITY);
    std::fill(where.begin(), where.end(), 0);
    for (int64_t j = 0; j < N; ++j) {  // best[] descending; a value equal to a kept one goes after it
      const float v = row[j];
      if (!(v > best[k - 1])) continue;
      int64_t p = k - 1;
      for (; p > 0 && v > best[p - 1]; --p) {
        best[p] = best[p - 1];
        where[p] = where[p - 1];
      }
      best[p] = v;
      where[p] = j;
    }
    const float top = best[0];
    V16 acc = V16::zero();
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) acc = V16::add(acc, exp_nonpositive(V16::sub(V16::load(row + j), V16::set1(top))));
    float total = V16::sum(acc);
    for (; j < N; ++j) total += exp_nonpositive(row[j] - top);
    for (int64_t c = 0; c < k; ++c) {
      tokens[i][c] = ids[where[c]];
      probs[i][c] = exp_nonpositive(best[c] - top) / total;
    }
  }
  return {tokens, probs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [M, 2 I] gate | up product, float32");
  m.def("layer", &layer, "one pre-norm decoder layer on quantized weights for a few rows, float32");
  m.def("linear", &linear, "x @ w.T (+ bias) for one row, float32");
  m.def("quant_linear", &quant_linear, "x @ w.T (+ bias) with w in exact Q4_1 / Q8_0 blocks (or a draft's int8 rows), float32");
  m.def("int8_rows", &int8_rows, "whether quant_linear takes int8 rows (built with AVX-512 VNNI)");
  m.def("attention", &attention, "softmax(q k^T * scale, masked) v per query row and head, float32");
  m.def("rope_attention", &rope_attention, "rotate q, k; store k, v in the cache; attention; float32");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row, float32");
  m.def("head_inputs", &head_inputs, "a feature head's fc([norm(features) ; norm(embed[tokens])]), fc quantized, float32");
  m.def("top_probs", &top_probs, "per row of logits the k largest as vocab ids and their softmax probabilities");
}
