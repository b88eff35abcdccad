// The q8 products' block steps (products_q8.cpp, its only includer): a half block's codes unpacked, a block's
// integer sums and terms for R rows and P tiles, and its add to the accumulators, each in the order and form
// products_q8.cpp's header gives, so the same bits wherever they are called from.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "q8_lanes.h"

namespace {

// The codes of half h of block b of a tile (chunks 4 h .. 4 h + 3: k = 32 b + 16 h .. + 15), one register a chunk.
template <int L>
inline void half_codes(const uint8_t* ct, int64_t b, int h, Q::I* w) {
  const uint8_t* block = ct + b * block_bytes(L);
  if constexpr (L == U8 || L == U6) {
    for (int g = 0; g < 4; ++g) w[g] = Q::load(block + (4 * h + g) * 64);
  } else {
    for (int j = 0; j < 2; ++j) {
      const Q::I raw = Q::load(block + (2 * h + j) * 64);
      w[2 * j] = Q::nib_lo(raw), w[2 * j + 1] = Q::nib_hi(raw);
      if constexpr (L == U5) Q::high_bits(block + 256 + (2 * h + j) * 16, w[2 * j], w[2 * j + 1]);
    }
  }
}

// Asks for the codes of half h of block b of the tile at ct (a prefetch: never faults, so past the last tile too).
template <int L>
inline void prefetch_half(const uint8_t* ct, int64_t b, int h) {
  constexpr bool bytes = L == U8 || L == U6;
  const char* half = reinterpret_cast<const char*>(ct + b * block_bytes(L)) + h * (bytes ? 256 : 128);
  for (int line = 0; line < (bytes ? 4 : 2); ++line) _mm_prefetch(half + 64 * line, _MM_HINT_T0);
  if constexpr (L == U5) _mm_prefetch(reinterpret_cast<const char*>(ct + b * block_bytes(L) + 256), _MM_HINT_T0);
}

// The first term of sub-block s (the header's formula): D_s I_s, with c X_s folded into I (centred, xs[s] = -c X_s)
// or fma(M_s, X_s, D_s I_s) (xf[s] = X_s as a float: exact, |X| <= 32 * 127).
template <bool Centred>
inline Q::F first_term(Q::I i, Q::F d, Q::F m, const int32_t* xs, const float* xf, int64_t s) {
  if constexpr (Centred) return Q::mul(d, Q::cvt(Q::sub_scalar(i, -xs[s])));
  else return Q::fma(m, Q::set1(xf[s]), Q::mul(d, Q::cvt(i)));
}

struct Args {
  const int8_t* qx;
  const float* dx;
  const int32_t* sx;
  const float* sxf;  // sx as floats (weights that are not centred)
  const uint8_t* codes;
  const void *d, *m;  // float or fp16 (uint16_t) scales: the kernels' T
  const float* bias;
  float* y;
  int64_t M, K, N, ldy;  // ldy: floats between y's rows (N, or more where runs of weights share y)
};

// q8_pass' sums of block b for rows [r0, r0 + R) and its P tiles (codes ct[p], scales dt[p], mt[p]): each half's
// integer sums (S = 32: both halves into one sum; S = 16: each half a sub-block, its term joined to the block's in
// the header's order, `term`). `first`: prefetch the next tiles' same half block.
template <int L, int S, bool Centred, typename T, int R, int P>
__attribute__((always_inline)) inline void block_sums(const Args& a, int64_t r0, const uint8_t* const* ct,
                                                      const T* const* dt, const T* const* mt, int64_t b, bool first,
                                                      int64_t tile_bytes, Q::I (&sum)[P][R], Q::F (&term)[P][R]) {
  const int64_t K = a.K, subs = K / S;
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    Q::I w[P][4];
    for (int p = 0; p < P; ++p) half_codes<L>(ct[p], b, h, w[p]);
    if (first)  // the next tiles' same half block, while this one's products run (docs/q8.md)
      for (int p = 0; p < P; ++p) prefetch_half<L>(ct[p] + P * tile_bytes, b, h);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.qx + (r0 + r) * K + b * 32 + 16 * h;
      if (h == 0 || S == 16)
        for (int p = 0; p < P; ++p) sum[p][r] = Q::zero_i();
      if constexpr (Q::kHalfDot) {
        for (int p = 0; p < P; ++p) sum[p][r] = Q::template half_dot<L>(sum[p][r], w[p], xr);
      } else {
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const Q::I xg = Q::bcast(xr + 4 * g);
          for (int p = 0; p < P; ++p) sum[p][r] = Q::template dpacc<L>(sum[p][r], w[p][g], xg);
        }
      }
    }
    if constexpr (S == 16) {  // sub-block s = 2 b + h: its terms join the block's in the header's order
      const int64_t s = 2 * b + h;
      for (int p = 0; p < P; ++p) {
        const Q::F d = Q::scales(dt[p] + s * 16), m = Centred ? Q::zero() : Q::scales(mt[p] + s * 16);
        for (int r = 0; r < R; ++r) {
          const int32_t* xs = a.sx + (r0 + r) * subs;
          const float* xf = a.sxf + (r0 + r) * subs;
          if (h == 0) term[p][r] = first_term<Centred>(sum[p][r], d, m, xs, xf, s);
          else if constexpr (Centred) term[p][r] = Q::fma(d, Q::cvt(Q::sub_scalar(sum[p][r], -xs[s])), term[p][r]);
          else term[p][r] = Q::fma(m, Q::set1(xf[s]), Q::fma(d, Q::cvt(sum[p][r]), term[p][r]));
        }
      }
    }
  }
}

// q8_pass' accumulators after block b: acc += the block's term times the row's activation scale.
template <int S, bool Centred, typename T, int R, int P>
__attribute__((always_inline)) inline void add_block(const Args& a, int64_t r0, const T* const* dt, const T* const* mt,
                                                     int64_t b, const Q::I (&sum)[P][R], const Q::F (&term)[P][R],
                                                     Q::F (&acc)[P][R]) {
  const int64_t blocks = a.K / 32, subs = a.K / S;
  Q::F d[P], m[P];
  if constexpr (S == 32)
    for (int p = 0; p < P; ++p) d[p] = Q::scales(dt[p] + b * 16), m[p] = Centred ? Q::zero() : Q::scales(mt[p] + b * 16);
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const Q::F dx = Q::set1(a.dx[row * blocks + b]);
    for (int p = 0; p < P; ++p) {
      Q::F tb;
      if constexpr (S == 32) tb = first_term<Centred>(sum[p][r], d[p], m[p], a.sx + row * subs, a.sxf + row * subs, b);
      else tb = term[p][r];
      acc[p][r] = Q::fma(tb, dx, acc[p][r]);
    }
  }
}

}  // namespace
