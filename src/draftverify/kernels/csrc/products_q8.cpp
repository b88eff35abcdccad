// The q8 arithmetic (kernels/q8.py): y = x W^T with W a GGUF block weight (codes q, fp32 D and M per sub-block of 16
// or 32 weights, w = D q + M), repacked by kernels/q8.py `prepare` into tiles of 16 outputs, and x rounded to int8 per
// block of 32 activations, as llama.cpp rounds them for its Q8_0 dot products:
//   dx = max|x| / 127, qx = round-to-nearest-even(x * (1 / dx)) in -127..127 (dx = 0: all codes 0).
// Per sub-block s the integer sums I_s = sum q qx and X_s = sum qx are exact in int32. A "centred" weight (M = -c D
// for one whole c, as Q4_0, Q5_0, Q8_0, Q3_K and Q6_K are) folds M in exactly: I_s <- I_s - c X_s. Then, in fp32
// and in this fixed order, per block b of 32 activations (one sub-block s of 32, or two s0, s1 of 16):
//   centred:  t = D_s I_s                      | t = fma(D_s1, I_s1, D_s0 I_s0)
//   else:     t = fma(M_s, X_s, D_s I_s)       | t = fma(M_s1, X_s1, fma(D_s1, I_s1, fma(M_s0, X_s0, D_s0 I_s0)))
//   acc = fma(t, dx_b, acc)   (acc starts at 0, the blocks in order), y = acc (+ bias).
// Each row is rounded and summed alone, so each row of a forward is bit for bit the one-row product of that row (row
// independence by construction), and integer sums do not depend on the order or the instructions that form them:
// AVX-512 VNNI (vpdpbusd on 16 outputs x 4 k a instruction), AVX-VNNI, or AVX2 maddubs + madd give the same bits.
// kernels/q8.py `reference` is this arithmetic in numpy, which the tests compare bit for bit.
//
// Tiles (kernels/q8.py `prepare`): outputs in tiles of 16 (the last padded with zero codes and scales). Codes of a
// tile are 64-byte chunks, output o's 4 bytes at 4 o: u8, chunk g holds k = 4 g .. 4 g + 3; u4, chunk j holds k = 8 j
// + i in the low nibble and k = 8 j + 4 + i in the high one (i < 4); u5 (codes 0..31, Q5_0 / Q5_1 / Q5_K), u4's
// nibbles and then, per block of 32, the four chunks' high bits (`block_bytes`). D and M: [tiles, sub-blocks, 16], fp32, or
// fp16 where every one of them is exact in fp16 (Q4_0..Q8_0 keep fp16 scales in the file): upcast exactly, so the
// arithmetic is the same and a one-row product streams fewer bytes.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "q8_lanes.h"

namespace {

// x [M, K] rounded per block of 32: qx int8 [M, K], dx [M, K / 32], and per sub-block of S the sum of qx, sx
// [M, K / S] (times -c when the weight is centred, so that I + sx is I - c X). Vectorised; every step is the same
// IEEE operation as the scalar rule at the top of this file (one multiply, round to nearest even, clamp).
void round_rows(const float* x, int64_t M, int64_t K, int S, int32_t centre, int8_t* qx, float* dx, int32_t* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = x + r * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float a = _mm_cvtss_f32(m4), d = a / 127.0f, inv = a > 0.0f ? 1.0f / d : 0.0f;
      const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
      }
      // int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + r * K + b * 32),
                          _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      dx[r * (K / 32) + b] = d;
      const __m256i h0 = _mm256_add_epi32(q[0], q[1]), h1 = _mm256_add_epi32(q[2], q[3]);
      auto hsum = [](__m256i s) {
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        return _mm_cvtsi128_si32(t);
      };
      const int32_t s0 = hsum(h0), s1 = hsum(h1), factor = centre >= 0 ? -centre : 1;
      if (S == 32) {
        sx[r * (K / 32) + b] = factor * (s0 + s1);
      } else {
        sx[r * (K / 16) + 2 * b] = factor * s0;
        sx[r * (K / 16) + 2 * b + 1] = factor * s1;
      }
    }
}

// The integer sums of one sub-block: C chunks of codes (each 4 k for 16 outputs) times row r's activations from xr.
// One row alone (Many false) runs four independent chains (C = 8) or two (C = 4), so that it does not wait on one
// chain of dot products; with several rows in flight (Many) the rows are the independent chains, and each row runs
// half as many, saving the adds that join them. Integer sums: the same bits in any order.
template <int L, int C, bool Many>
inline Q::I sums(const Q::I* w, const int8_t* xr) {
  if constexpr (C == 8 && !Many) {
    Q::I a0 = Q::dot<L>(w[0], Q::bcast(xr)), a1 = Q::dot<L>(w[1], Q::bcast(xr + 4));
    Q::I a2 = Q::dot<L>(w[2], Q::bcast(xr + 8)), a3 = Q::dot<L>(w[3], Q::bcast(xr + 12));
    a0 = Q::dpacc<L>(a0, w[4], Q::bcast(xr + 16)), a1 = Q::dpacc<L>(a1, w[5], Q::bcast(xr + 20));
    a2 = Q::dpacc<L>(a2, w[6], Q::bcast(xr + 24)), a3 = Q::dpacc<L>(a3, w[7], Q::bcast(xr + 28));
    return Q::add(Q::add(a0, a1), Q::add(a2, a3));
  } else if constexpr (C == 8) {
    Q::I a0 = Q::dot<L>(w[0], Q::bcast(xr)), a1 = Q::dot<L>(w[1], Q::bcast(xr + 4));
    a0 = Q::dpacc<L>(a0, w[2], Q::bcast(xr + 8)), a1 = Q::dpacc<L>(a1, w[3], Q::bcast(xr + 12));
    a0 = Q::dpacc<L>(a0, w[4], Q::bcast(xr + 16)), a1 = Q::dpacc<L>(a1, w[5], Q::bcast(xr + 20));
    a0 = Q::dpacc<L>(a0, w[6], Q::bcast(xr + 24)), a1 = Q::dpacc<L>(a1, w[7], Q::bcast(xr + 28));
    return Q::add(a0, a1);
  } else if constexpr (!Many) {
    Q::I a0 = Q::dot<L>(w[0], Q::bcast(xr)), a1 = Q::dot<L>(w[1], Q::bcast(xr + 4));
    a0 = Q::dpacc<L>(a0, w[2], Q::bcast(xr + 8)), a1 = Q::dpacc<L>(a1, w[3], Q::bcast(xr + 12));
    return Q::add(a0, a1);
  } else {
    Q::I a0 = Q::dot<L>(w[0], Q::bcast(xr));
    a0 = Q::dpacc<L>(a0, w[1], Q::bcast(xr + 4));
    a0 = Q::dpacc<L>(a0, w[2], Q::bcast(xr + 8));
    return Q::dpacc<L>(a0, w[3], Q::bcast(xr + 12));
  }
}

// The codes of block b of a tile, one register a chunk (chunk g: k = 32 b + 4 g .. + 3).
template <int L>
inline void block_codes(const uint8_t* ct, int64_t b, Q::I* w) {
  const uint8_t* block = ct + b * block_bytes(L);
  if constexpr (L == U8) {
    for (int g = 0; g < 8; ++g) w[g] = Q::load(block + g * 64);
  } else {
    for (int j = 0; j < 4; ++j) {
      const Q::I raw = Q::load(block + j * 64);
      w[2 * j] = Q::nib_lo(raw), w[2 * j + 1] = Q::nib_hi(raw);
      if constexpr (L == U5) Q::high_bits(block + 256 + j * 16, w[2 * j], w[2 * j + 1]);
    }
  }
}

// t of block b for one row (the header's formula): xr the row's activations of the block, xs its sub-block sums
// (int32, centred weights) or xf the same sums as floats (exact: |X| <= 32 * 127), read by a broadcast.
template <int L, int S, bool Centred, typename T, bool Many>
inline Q::F block_term(const Q::I* w, const int8_t* xr, const int32_t* xs, const float* xf, const T* dt, const T* mt,
                       int64_t b) {
  if constexpr (S == 32) {
    const Q::I i = sums<L, 8, Many>(w, xr);
    if constexpr (Centred) return Q::mul(Q::scales(dt + b * 16), Q::cvt(Q::sub_scalar(i, -xs[b])));
    return Q::fma(Q::scales(mt + b * 16), Q::set1(xf[b]), Q::mul(Q::scales(dt + b * 16), Q::cvt(i)));
  } else {
    const Q::I i0 = sums<L, 4, Many>(w, xr), i1 = sums<L, 4, Many>(w + 4, xr + 16);
    const Q::F d0 = Q::scales(dt + 2 * b * 16), d1 = Q::scales(dt + (2 * b + 1) * 16);
    if constexpr (Centred) {
      return Q::fma(d1, Q::cvt(Q::sub_scalar(i1, -xs[2 * b + 1])), Q::mul(d0, Q::cvt(Q::sub_scalar(i0, -xs[2 * b]))));
    } else {
      const Q::F m0 = Q::scales(mt + 2 * b * 16), m1 = Q::scales(mt + (2 * b + 1) * 16);
      Q::F t = Q::fma(m0, Q::set1(xf[2 * b]), Q::mul(d0, Q::cvt(i0)));
      t = Q::fma(d1, Q::cvt(i1), t);
      return Q::fma(m1, Q::set1(xf[2 * b + 1]), t);
    }
  }
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
  int64_t M, K, N;
};

// Rows [r0, r0 + R) of outputs [16 t0, 16 t1): each row's accumulator stays in a register over the whole of K.
// T: how D and M are stored, float or fp16 (uint16_t, where every scale is exact in fp16: fewer bytes to stream).
template <int L, int S, bool Centred, typename T, int R>
void q8_rows(const Args& a, int64_t r0, int64_t t0, int64_t t1) {
  const int64_t K = a.K, blocks = K / 32, subs = K / S, tile_bytes = blocks * block_bytes(L);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* ct = a.codes + t * tile_bytes;
    const T* dt = static_cast<const T*>(a.d) + t * subs * 16;
    const T* mt = Centred ? nullptr : static_cast<const T*>(a.m) + t * subs * 16;
    Q::F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Q::zero();
    for (int64_t b = 0; b < blocks; ++b) {
      Q::I w[8];
      block_codes<L>(ct, b, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const Q::F tb = block_term<L, S, Centred, T, (R >= 4)>(w, a.qx + row * K + b * 32, a.sx + row * subs,
                                                              a.sxf + row * subs, dt, mt, b);
        acc[r] = Q::fma(tb, Q::set1(a.dx[row * blocks + b]), acc[r]);
      }
    }
    const int64_t n0 = t * 16, live = std::min<int64_t>(16, a.N - n0);
    alignas(64) float out[16];
    for (int r = 0; r < R; ++r) {
      Q::storef(out, acc[r]);
      float* yr = a.y + (r0 + r) * a.N + n0;
      for (int64_t o = 0; o < live; ++o) yr[o] = a.bias ? out[o] + a.bias[n0 + o] : out[o];
    }
  }
}

// Passes of kRows rows; the last pass takes what is left, up to kLast rows: with AVX-512's 32 registers 7 or 8 rows
// go in one pass rather than 6 + 1 or 6 + 2 (a pass of few rows costs nearly a one-token product: the codes are
// unpacked again), as in products_q4q8.cpp. Every pass forms a row's sums the same way, so the split never changes a
// bit. The timings behind these choices are in docs/backends.md.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kRows = 6;  // rows a pass holds in registers
constexpr int kLast = 8;
#else
constexpr int kRows = 4;  // 16 registers: 4 accumulators beside the codes
constexpr int kLast = kRows;
#endif

// Every row of outputs [16 t0, 16 t1), kRows rows a pass and the rest, up to kLast, in one.
template <int L, int S, bool Centred, typename T>
void q8_tiles(const Args& a, int64_t t0, int64_t t1) {
  int64_t r0 = 0;
  for (; a.M - r0 > kLast; r0 += kRows) q8_rows<L, S, Centred, T, kRows>(a, r0, t0, t1);
  switch (a.M - r0) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case 8: q8_rows<L, S, Centred, T, 8>(a, r0, t0, t1); break;
    case 7: q8_rows<L, S, Centred, T, 7>(a, r0, t0, t1); break;
    case 6: q8_rows<L, S, Centred, T, 6>(a, r0, t0, t1); break;
    case 5: q8_rows<L, S, Centred, T, 5>(a, r0, t0, t1); break;
#endif
    case 4: q8_rows<L, S, Centred, T, 4>(a, r0, t0, t1); break;
    case 3: q8_rows<L, S, Centred, T, 3>(a, r0, t0, t1); break;
    case 2: q8_rows<L, S, Centred, T, 2>(a, r0, t0, t1); break;
    case 1: q8_rows<L, S, Centred, T, 1>(a, r0, t0, t1); break;
    default: break;
  }
}

using TilesFn = decltype(&q8_tiles<U4, 32, true, float>);

template <int L, int S, bool Centred>
TilesFn pick_scales(bool half) { return half ? q8_tiles<L, S, Centred, uint16_t> : q8_tiles<L, S, Centred, float>; }

template <int L, int S>
TilesFn pick_centred(bool centred, bool half) { return centred ? pick_scales<L, S, true>(half) : pick_scales<L, S, false>(half); }

TilesFn pick(int64_t layout, int64_t sub, bool centred, bool half) {
  if (layout == U4) return sub == 16 ? pick_centred<U4, 16>(centred, half) : pick_centred<U4, 32>(centred, half);
  if (layout == U5) return sub == 16 ? pick_centred<U5, 16>(centred, half) : pick_centred<U5, 32>(centred, half);
  return sub == 16 ? pick_centred<U8, 16>(centred, half) : pick_centred<U8, 32>(centred, half);
}
}  // namespace

bool vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 contiguous, K a multiple of 32; layout 0 (u4), 1 (u8) or 2 (u5); sub 16 or 32; codes uint8 in tiles
// (top of this file) for N outputs; d, m [tiles, K / sub, 16], both float32 or both float16 (m empty when centre >= 0:
// M = -centre D); bias [N] or empty. Returns y [M, N] in the q8 arithmetic.
torch::Tensor q8_linear(torch::Tensor x, int64_t layout, int64_t sub, int64_t N, torch::Tensor codes, torch::Tensor d,
                        torch::Tensor m, int64_t centre, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_linear: x must be [M, K] float32");
  TORCH_CHECK((layout == U4 || layout == U8 || layout == U5) && (sub == 16 || sub == 32),
              "q8_linear: layout 0 (u4), 1 (u8) or 2 (u5), sub 16 or 32");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * (K / 32) * block_bytes(static_cast<int>(layout)),
              "q8_linear: codes must be uint8 tiles of 16 outputs (kernels/q8.py prepare) and K a multiple of 32");
  const bool centred = centre >= 0, half = d.scalar_type() == at::kHalf;
  TORCH_CHECK((d.scalar_type() == at::kFloat || half) && d.is_contiguous() && d.numel() == tiles * (K / sub) * 16 &&
                  (centred || (m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.numel() == d.numel())),
              "q8_linear: d (and m unless centred) must be float32 or float16 [tiles, K / sub, 16], one dtype");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N && bias.is_contiguous()), "q8_linear: bias");
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * K / 32);
  std::vector<int32_t> sx(M * K / sub);
  round_rows(x.data_ptr<float>(), M, K, static_cast<int>(sub), static_cast<int32_t>(centre), qx.data(), dx.data(), sx.data());
  std::vector<float> sxf(centred ? 0 : sx.size());
  for (size_t i = 0; i < sxf.size(); ++i) sxf[i] = static_cast<float>(sx[i]);
  auto y = torch::empty({M, N}, x.options());
  const TilesFn run = pick(layout, sub, centred, half);
  const Args a{qx.data(), dx.data(), sx.data(), sxf.data(), codes.data_ptr<uint8_t>(), d.data_ptr(), centred ? nullptr : m.data_ptr(),
               bias.numel() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N};
  // a thread's share at least ~64 K multiply-adds: smaller products run on one thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * K * 16));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) { run(a, t0, t1); });
  return y;
}

// A block weight's codes (blocks.py's layouts: u4, byte j of each 32 k holding q_j | q_{j+16} << 4; u8, a byte a
// code) for N outputs of K, rewritten in the tiles of the top of this file for `layout` 0 (u4), 1 (u8) or 2 (u5:
// u8 codes below 32, which the caller has checked), written into `out` (uint8 [tiles, tile bytes], contiguous: the
// caller places it, kernels/q8.py `TileArena`), the last tile padded with zero codes. A byte shuffle: the codes are
// not changed, only placed.
void q8_repack(torch::Tensor codes, int64_t from, int64_t layout, int64_t N, int64_t K, torch::Tensor out) {
  TORCH_CHECK((from == U4 || from == U8) && (layout == U4 || layout == U8 || layout == U5) && (layout == U4) == (from == U4),
              "q8_repack: u4 codes go to u4 tiles, u8 codes to u8 or u5 tiles");
  const int64_t row_bytes = from == U4 ? K / 2 : K;
  TORCH_CHECK(K % 32 == 0 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == N * row_bytes,
              "q8_repack: codes must be uint8 [N, K / 2] (u4) or [N, K] (u8), K a multiple of 32");
  const int L = static_cast<int>(layout);
  const int64_t tiles = (N + 15) / 16, blocks = K / 32, tile_bytes = blocks * block_bytes(L);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == tiles * tile_bytes,
              "q8_repack: out must be uint8 [tiles, tile bytes], contiguous");
  std::memset(out.data_ptr(), 0, out.numel());
  const uint8_t* src = codes.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> q(K);  // one output's codes, a byte each
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t o = 0; o < 16 && t * 16 + o < N; ++o) {
        const uint8_t* row = src + (t * 16 + o) * row_bytes;
        if (from == U8) {
          std::memcpy(q.data(), row, K);
        } else {
          for (int64_t b = 0; b < blocks; ++b)
            for (int j = 0; j < 16; ++j) {
              q[32 * b + j] = row[16 * b + j] & 15;
              q[32 * b + 16 + j] = row[16 * b + j] >> 4;
            }
        }
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* blk = dst + t * tile_bytes + b * block_bytes(L);
          const uint8_t* qb = q.data() + 32 * b;
          if (L == U8) {
            for (int g = 0; g < 8; ++g) std::memcpy(blk + 64 * g + 4 * o, qb + 4 * g, 4);
            continue;
          }
          for (int j = 0; j < 4; ++j) {
            uint8_t high = 0;
            for (int i = 0; i < 4; ++i) {
              const uint8_t lo = qb[8 * j + i], hi = qb[8 * j + 4 + i];
              blk[64 * j + 4 * o + i] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
              high |= static_cast<uint8_t>((((lo >> 4) & 1) << i) | (((hi >> 4) & 1) << (4 + i)));
            }
            if (L == U5) blk[256 + 16 * j + o] = high;
          }
        }
      }
    }
  });
}
