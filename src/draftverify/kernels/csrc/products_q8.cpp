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
#include "q8_blocks.h"
#include "q8_lanes.h"
#include "scratch.h"

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

// Rows [r0, r0 + R) of the outputs of tiles [t0, t1), P tiles at a time (t1 - t0 a multiple of P). Each half block
// the P tiles' codes are unpacked once for the R rows, and each of a row's activation broadcasts feeds all P tiles'
// dot products: with one tile, every dot product needed a load of its own beside its codes, and the loads bounded the
// product (docs/q8.md). `first`: the first pass over these tiles, which reads them from memory (a step's weights
// stream from DRAM), so it prefetches the next tiles' codes as it goes. Each (row, output) keeps its accumulator in
// a register over the whole of K and forms its sums and terms exactly as the header says, whatever R and P: the same
// bits for any split. T: how D and M are stored, float or fp16 (uint16_t, where every scale is exact in fp16).
template <int L, int S, bool Centred, typename T, int R, int P>
void q8_pass(const Args& a, int64_t r0, int64_t t0, int64_t t1, bool first) {
  const int64_t K = a.K, blocks = K / 32, subs = K / S, tile_bytes = blocks * block_bytes(L);
  for (int64_t t = t0; t + P <= t1; t += P) {
    const uint8_t* ct[P];
    const T *dt[P], *mt[P];
    for (int p = 0; p < P; ++p) {
      ct[p] = a.codes + (t + p) * tile_bytes;
      dt[p] = static_cast<const T*>(a.d) + (t + p) * subs * 16;
      mt[p] = Centred ? nullptr : static_cast<const T*>(a.m) + (t + p) * subs * 16;
    }
    Q::F acc[P][R];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) acc[p][r] = Q::zero();
    for (int64_t b = 0; b < blocks; ++b) {
      Q::I sum[P][R];   // integer sums of the sub-block (S = 32: both halves; S = 16: this half)
      Q::F term[P][R];  // S = 16: the block's term so far
      block_sums<L, S, Centred, T, R, P>(a, r0, ct, dt, mt, b, first, tile_bytes, sum, term);
      add_block<S, Centred, T, R, P>(a, r0, dt, mt, b, sum, term, acc);
    }
    alignas(64) float out[16];
    for (int p = 0; p < P; ++p) {
      const int64_t n0 = (t + p) * 16, live = std::min<int64_t>(16, a.N - n0);
      for (int r = 0; r < R; ++r) {
        Q::storef(out, acc[p][r]);
        float* yr = a.y + (r0 + r) * a.ldy + n0;
        for (int64_t o = 0; o < live; ++o) yr[o] = a.bias ? out[o] + a.bias[n0 + o] : out[o];
      }
    }
  }
}

// The plan of passes. A forward of a few rows (a step, a verified draft, a batch's steps) reads every weight from
// memory once: up to kOnePass rows go in one pass (no tile is read twice), two tiles at once while their sums and
// accumulators fit in registers, else one. More rows (a prefill, wide trees) are compute-bound: passes of up to
// kRows rows, shared out evenly (10 rows: 5 + 5, so no pass of one or two rows unpacks every code again), over
// chunks of tiles that stay in L2 (the LM head does not fit: each pass would read it from memory again), each chunk
// through every pass before the next. AVX-512's 32 registers hold two tiles' codes with six rows' sums and
// accumulators, or one tile's with eight; AVX2's 16 one tile's with four. The timings are in docs/q8.md.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kRows = 6, kOnePass = 8, kPairRows = 6;  // kPairRows: most rows of a two-tile pass
#else
constexpr int kRows = 4, kOnePass = 4, kPairRows = 0;
#endif
constexpr int64_t kChunkBytes = 256 << 10;

template <int L, int S, bool Centred, typename T, int P>
void pass_of(const Args& a, int64_t r0, int rows, int64_t t0, int64_t t1, bool first) {
  switch (rows) {  // 7 or 8 rows only in passes of one tile (the plan's kPairRows)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case 8: if constexpr (P == 1) { q8_pass<L, S, Centred, T, 8, 1>(a, r0, t0, t1, first); break; } [[fallthrough]];
    case 7: if constexpr (P == 1) { q8_pass<L, S, Centred, T, 7, 1>(a, r0, t0, t1, first); break; } [[fallthrough]];
    case 6: q8_pass<L, S, Centred, T, 6, P>(a, r0, t0, t1, first); break;
    case 5: q8_pass<L, S, Centred, T, 5, P>(a, r0, t0, t1, first); break;
#endif
    case 4: q8_pass<L, S, Centred, T, 4, P>(a, r0, t0, t1, first); break;
    case 3: q8_pass<L, S, Centred, T, 3, P>(a, r0, t0, t1, first); break;
    case 2: q8_pass<L, S, Centred, T, 2, P>(a, r0, t0, t1, first); break;
    default: q8_pass<L, S, Centred, T, 1, P>(a, r0, t0, t1, first); break;
  }
}

// Rows [0, M) of tiles [c0, c1) in passes of `rows` rows at most (shared out evenly), P tiles at a time.
template <int L, int S, bool Centred, typename T, int P>
void chunk_passes(const Args& a, int64_t c0, int64_t c1, int most) {
  const int64_t passes = (a.M + most - 1) / most, whole = c0 + (c1 - c0) / P * P;
  int64_t r0 = 0;
  for (int64_t q = 0; q < passes; ++q) {
    const int rows = static_cast<int>(a.M / passes + (q < a.M % passes ? 1 : 0));
    pass_of<L, S, Centred, T, P>(a, r0, rows, c0, whole, q == 0);
    if (whole < c1) pass_of<L, S, Centred, T, 1>(a, r0, rows, whole, c1, q == 0);
    r0 += rows;
  }
}

// Every row of outputs [16 t0, 16 t1), by the plan above.
template <int L, int S, bool Centred, typename T>
void q8_tiles(const Args& a, int64_t t0, int64_t t1) {
  constexpr int P = S == 32 && kPairRows > 0 ? 2 : 1;  // sub-blocks of 16 keep a term per row too: one tile a pass
  if (a.M <= kOnePass) {
    if (P == 2 && a.M <= kPairRows) return chunk_passes<L, S, Centred, T, P>(a, t0, t1, kOnePass);
    return chunk_passes<L, S, Centred, T, 1>(a, t0, t1, kOnePass);
  }
  const int64_t tile_bytes = (a.K / 32) * block_bytes(L), chunk = std::max<int64_t>(2, kChunkBytes / tile_bytes / 2 * 2);
  for (int64_t c0 = t0; c0 < t1; c0 += chunk) chunk_passes<L, S, Centred, T, P>(a, c0, std::min(t1, c0 + chunk), kRows);
}

using TilesFn = decltype(&q8_tiles<U4, 32, true, float>);

template <int L, int S, bool Centred>
TilesFn pick_scales(bool half) { return half ? q8_tiles<L, S, Centred, uint16_t> : q8_tiles<L, S, Centred, float>; }

template <int L, int S>
TilesFn pick_centred(bool centred, bool half) { return centred ? pick_scales<L, S, true>(half) : pick_scales<L, S, false>(half); }

TilesFn pick(int64_t layout, int64_t sub, bool centred, bool half) {
  if (layout == U4) return sub == 16 ? pick_centred<U4, 16>(centred, half) : pick_centred<U4, 32>(centred, half);
  if (layout == U5) return sub == 16 ? pick_centred<U5, 16>(centred, half) : pick_centred<U5, 32>(centred, half);
  if (layout == U6) return sub == 16 ? pick_centred<U6, 16>(centred, half) : pick_centred<U6, 32>(centred, half);
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

// A weight as q8_linear takes it, checked: layout 0 (u4), 1 (u8), 2 (u5) or 3 (u6); sub 16 or 32; codes uint8 in tiles (top of
// this file) for N outputs of K inputs; d, m [tiles, K / sub, 16], both float32 or both float16 (m empty when
// centre >= 0: M = -centre D); bias [N], or empty or undefined (none).
dv::Q8Weight dv::q8_weight(int64_t layout, int64_t sub, int64_t N, const at::Tensor& codes, const at::Tensor& d,
                           const at::Tensor& m, int64_t centre, const at::Tensor& bias, int64_t K) {
  TORCH_CHECK((layout == U4 || layout == U8 || layout == U5 || layout == U6) && (sub == 16 || sub == 32),
              "q8_linear: layout 0 (u4), 1 (u8), 2 (u5) or 3 (u6), sub 16 or 32");
  const int64_t tiles = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * (K / 32) * block_bytes(static_cast<int>(layout)),
              "q8_linear: codes must be uint8 tiles of 16 outputs (kernels/q8.py prepare) and K a multiple of 32");
  const bool centred = centre >= 0, half = d.scalar_type() == at::kHalf, biased = bias.defined() && bias.numel();
  TORCH_CHECK((d.scalar_type() == at::kFloat || half) && d.is_contiguous() && d.numel() == tiles * (K / sub) * 16 &&
                  (centred || (m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.numel() == d.numel())),
              "q8_linear: d (and m unless centred) must be float32 or float16 [tiles, K / sub, 16], one dtype");
  TORCH_CHECK(!biased || (bias.scalar_type() == at::kFloat && bias.numel() == N && bias.is_contiguous()), "q8_linear: bias");
  return {layout, sub, N, K, centre, codes.data_ptr<uint8_t>(), d.data_ptr(), centred ? nullptr : m.data_ptr(), half,
          biased ? bias.data_ptr<float>() : nullptr};
}

// Rows [r0, r1) of x [M, K] rounded for w's product into `rows` (each row alone).
void dv::q8_round(const Q8Weight& w, const float* x, int64_t r0, int64_t r1, const Q8Rows& rows) {
  const int64_t K = w.K, sub = w.sub;
  round_rows(x + r0 * K, r1 - r0, K, static_cast<int>(sub), static_cast<int32_t>(w.centre), rows.qx + r0 * K,
             rows.dx + r0 * (K / 32), rows.sx + r0 * (K / sub));
  if (w.centre < 0)  // a weight that is not centred takes the sums as floats (exact)
    for (int64_t i = r0 * (K / sub); i < r1 * (K / sub); ++i) rows.sxf[i] = static_cast<float>(rows.sx[i]);
}

// The outputs of pairs of tiles [p0, p1) of M rounded rows, into y (rows ldy floats apart).
static void pairs_of(const dv::Q8Weight& w, const dv::Q8Rows& rows, int64_t M, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const Args a{rows.qx, rows.dx, rows.sx, rows.sxf, w.codes, w.d, w.m, w.bias, y, M, w.K, w.N, ldy};
  pick(w.layout, w.sub, w.centre >= 0, w.half)(a, 2 * p0, std::min((w.N + 15) / 16, 2 * p1));
}

// Share `share` of `shares` of the outputs of M rounded rows, into y [M, N] (rows ldy floats apart): the pairs of
// tiles (a pass takes two at once) cut into `shares` runs of the same length (the last shorter).
void dv::q8_share(const Q8Weight& w, const Q8Rows& rows, int64_t M, float* y, int64_t ldy, int64_t share, int64_t shares) {
  const int64_t pairs = ((w.N + 15) / 16 + 1) / 2, each = (pairs + shares - 1) / shares, p0 = share * each;
  if (p0 < pairs) pairs_of(w, rows, M, y, ldy, p0, std::min(pairs, p0 + each));
}

// x [M, K] float32 contiguous times the weight `dv::q8_weight` checks. Returns y [M, N] in the q8 arithmetic.
at::Tensor q8_linear(at::Tensor x, int64_t layout, int64_t sub, int64_t N, at::Tensor codes, at::Tensor d,
                     at::Tensor m, int64_t centre, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_linear: x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + 15) / 16;
  const dv::Q8Weight w = dv::q8_weight(layout, sub, N, codes, d, m, centre, bias, K);
  // the rounded rows live in this thread's scratch (every element written below before it is read)
  const dv::Q8Rows rows{dv::scratch<int8_t, dv::kRoundedX>(M * K), dv::scratch<float, dv::kRowScales>(M * K / 32),
                        dv::scratch<int32_t, dv::kRowSums>(M * K / sub),
                        dv::scratch<float, dv::kRowSumsF>(centre >= 0 ? 0 : M * K / sub)};
  // rows are rounded alone, so a prefill's many rows are shared out between the threads (a few rows: one thread)
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) { dv::q8_round(w, xp, r0, r1, rows); });
  auto y = at::empty({M, N}, x.options());
  // shared out in pairs of tiles (a pass takes two at once), a thread's share at least ~64 K multiply-adds: smaller
  // products run on one thread
  const int64_t pairs = (tiles + 1) / 2, grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * K * 32));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) { pairs_of(w, rows, M, yp, N, p0, p1); });
  return y;
}

// A block weight's codes (blocks.py's layouts: u4, byte j of each 32 k holding q_j | q_{j+16} << 4; u8, a byte a
// code) for N outputs of K, rewritten in the tiles of the top of this file for `layout` 0 (u4), 1 (u8), 2 (u5:
// u8 codes below 32) or 3 (u6: u8 codes below 64; the caller has checked the codes' range), written into `out` (uint8 [tiles, tile bytes], contiguous: the
// caller places it, kernels/q8.py `TileArena`), the last tile padded with zero codes. A byte shuffle: the codes are
// not changed, only placed.
void q8_repack(at::Tensor codes, int64_t from, int64_t layout, int64_t N, int64_t K, at::Tensor out) {
  TORCH_CHECK((from == U4 || from == U8) && layout >= U4 && layout <= U6 && (layout == U4) == (from == U4),
              "q8_repack: u4 codes go to u4 tiles, u8 codes to u8, u5 or u6 tiles");
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
          if (L == U8 || L == U6) {
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
