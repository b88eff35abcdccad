// The q8 products' registers (products_q8.cpp, its only includer): a tile's 16 outputs as int32 / float lanes, in
// one AVX-512 register (with VNNI's vpdpbusd) or two AVX2 ones (AVX-VNNI, else maddubs + madd), and the tile layouts.
// Every path forms the same integer sums, so the same bits (products_q8.cpp's header says why).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {
enum Layout : int64_t { U4 = 0, U8 = 1, U5 = 2, U6 = 3 };

// Bytes of one block of 32 k of a tile: 16 outputs x 32 codes as nibbles (u4), bytes (u8; u6: bytes of codes below
// 64, Q6_K's, which AVX2 multiplies without splitting them), or nibbles then one high bit each (u5: per chunk of 8 k,
// 16 bytes, output o's byte holding bit 4 of its codes k = 8 j + i as bit i).
constexpr int64_t block_bytes(int L) { return L == U4 ? 256 : L == U8 || L == U6 ? 512 : 320; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 int32 / float lanes in one register; codes of a chunk in one register.
struct Q {
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I nib_lo(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
  static I nib_hi(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
  static I bcast(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return _mm512_set1_epi32(v); }
  // u5: 16 to the codes of lanes o * 4 + i whose high bit is set, from output o's byte, bit i (lo) or 4 + i (hi).
  static void high_bits(const uint8_t* p, I& lo, I& hi) {
    const __m512i bytes = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                              _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12,
                                                              11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8,
                                                              7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4,
                                                              3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
    const __m512i bit = _mm512_set1_epi32(0x08040201), sixteen = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bytes, bit), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bytes, _mm512_slli_epi32(bit, 4)), hi, sixteen);
  }
  template <int L> static I dpacc(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  // A chunk's products go into int32 at once, so a pass adds chunk by chunk (`dpacc`), each row's broadcast serving
  // every tile of the pass: no `half_dot` (declared only for the other lanes' interface, never called).
  static constexpr bool kHalfDot = false;
  template <int L> static I half_dot(I acc, const I* w, const int8_t* x);
  static I zero_i() { return _mm512_setzero_si512(); }
  static I sub_scalar(I a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F zero() { return _mm512_setzero_ps(); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F scales(const float* p) { return loadf(p); }
  static F scales(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void storef(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
// 16 lanes as two AVX2 registers (outputs 0..7, 8..15): a chunk's first 32 bytes are outputs 0..7.
struct Q {
  struct I { __m256i a, b; };
  struct F { __m256 a, b; };
  static I load(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static __m256i lo4(__m256i w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
  static __m256i hi4(__m256i w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
  static I nib_lo(I w) { return {lo4(w.a), lo4(w.b)}; }
  static I nib_hi(I w) { return {hi4(w.a), hi4(w.b)}; }
  static I bcast(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); const __m256i s = _mm256_set1_epi32(v); return {s, s}; }
  static __m256i add_high(__m256i w, __m256i bytes, __m256i bit) {
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_add_epi8(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  }
  // u5: 16 to the codes of lanes o * 4 + i whose high bit is set, from output o's byte, bit i (lo) or 4 + i (hi).
  static void high_bits(const uint8_t* p, I& lo, I& hi) {
    const __m256i all = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i first = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                           4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    const __m256i a = _mm256_shuffle_epi8(all, first), b = _mm256_shuffle_epi8(all, _mm256_add_epi8(first, _mm256_set1_epi8(8)));
    const __m256i bit = _mm256_set1_epi32(0x08040201), bit_hi = _mm256_slli_epi32(bit, 4);
    lo = {add_high(lo.a, a, bit), add_high(lo.b, b, bit)};
    hi = {add_high(hi.a, a, bit_hi), add_high(hi.b, b, bit_hi)};
  }
  // Lane j: sum of 4 codes (u8) x 4 activations (s8). maddubs adds pairs in int16 with saturation: codes <= 63 keep a
  // pair within 2 * 63 * 127, so only u8 codes are split into nibbles.
  template <int L> static __m256i dot8(__m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (L != U8) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  // codes <= 31: no saturation
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo4(w), x), ones);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi4(w), x), ones);
    return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
#endif
  }
  template <int L> static I dot(I w, I x) { return {dot8<L>(w.a, x.a), dot8<L>(w.b, x.b)}; }
  template <int L> static I dpacc(I acc, I w, I x) { return add(acc, dot<L>(w, x)); }
#if defined(__AVXVNNI__)
  static constexpr bool kHalfDot = false;  // AVX-VNNI's dot products go into int32 at once, as AVX-512's
  template <int L> static I half_dot(I acc, const I* w, const int8_t* x);  // never called, as AVX-512's
#else
  static constexpr bool kHalfDot = true;  // maddubs: a half block at once (`half_dot`)
  // The four chunks w[0..3] of a half block (16 k) of a tile times the row's 16 activations at x, added to acc: the
  // integers dpacc chunk by chunk gives. maddubs's pairs (at most 2 * 31 * 127 = 7874 apart from 0) of the four
  // chunks are added in int16 (at most 31496 < 32767: no saturation) and widened once (madd), not once a chunk:
  // fewer of the multiplying instructions that bound this product. u8 codes go as their two nibbles.
  template <int L> static I half_dot(I acc, const I* w, const int8_t* x) {
    const __m256i ones = _mm256_set1_epi16(1);
    // chunks [g0, g1) with their codes through `code`, their pairs added in int16, widened once
    auto pairs = [&](auto code, int g0, int g1) {
      __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
      for (int g = g0; g < g1; ++g) {
        int32_t v;
        std::memcpy(&v, x + 4 * g, 4);
        const __m256i xg = _mm256_set1_epi32(v);
        a = _mm256_add_epi16(a, _mm256_maddubs_epi16(code(w[g].a), xg));
        b = _mm256_add_epi16(b, _mm256_maddubs_epi16(code(w[g].b), xg));
      }
      return I{_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)};
    };
    const auto whole = [](__m256i c) { return c; };
    // codes <= 63: two chunks' pairs at a time in int16 (at most 2 * 2 * 63 * 127 = 32004)
    if constexpr (L == U6) return add(acc, add(pairs(whole, 0, 2), pairs(whole, 2, 4)));
    if constexpr (L != U8) return add(acc, pairs(whole, 0, 4));  // codes <= 31
    const I lo = pairs([](__m256i c) { return lo4(c); }, 0, 4), hi = pairs([](__m256i c) { return hi4(c); }, 0, 4);
    return add(acc, {_mm256_add_epi32(lo.a, _mm256_slli_epi32(hi.a, 4)), _mm256_add_epi32(lo.b, _mm256_slli_epi32(hi.b, 4))});
  }
#endif
  static I add(I p, I q) { return {_mm256_add_epi32(p.a, q.a), _mm256_add_epi32(p.b, q.b)}; }
  static I zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I sub_scalar(I p, int32_t s) { const __m256i v = _mm256_set1_epi32(s); return {_mm256_sub_epi32(p.a, v), _mm256_sub_epi32(p.b, v)}; }
  static F cvt(I p) { return {_mm256_cvtepi32_ps(p.a), _mm256_cvtepi32_ps(p.b)}; }
  static F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F scales(const float* p) { return loadf(p); }
  static F scales(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
  static F set1(float s) { const __m256 v = _mm256_set1_ps(s); return {v, v}; }
  static F mul(F p, F q) { return {_mm256_mul_ps(p.a, q.a), _mm256_mul_ps(p.b, q.b)}; }
  static F fma(F p, F q, F r) { return {_mm256_fmadd_ps(p.a, q.a, r.a), _mm256_fmadd_ps(p.b, q.b, r.b)}; }
};
#endif
}  // namespace
