// ---- The attention of R query rows against one chunk of at most kChunk keys (attention.cpp's inner kernels; the
// chunking, the plan and the merge are there): per (row, head) the chunk's largest score, the sum of e^(s - top) and
// the unnormalised weighted sum of values, each pair's formed alone, so it gets the bits it gets alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace dv::chunk {
constexpr int64_t kChunk = 128;

// Asks for one key or value row (`bytes` long) into L2. A long context's keys and values come from memory (a step
// reads every layer's, far more than L2 holds), and the hardware's prefetch does not run ahead of the chunk-by-chunk
// reads: asked for as a thread reads its chunk before, the chunk it reads next is in L2 when it comes. That is the
// thread's next task, not the next chunk: the tasks are dealt out by cost, so the next chunk is often another
// thread's, and a one-thread call goes on to the next kv group's first chunk (asking for the next chunk instead left
// many of a thread's chunks cold, and a step over a long context slower).
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(row) + o, _MM_HINT_T1);
}

// attend_rows' scores: the (row, head) pairs' (pair p = r * G + g) scores against the chunk's keys, scaled, 16 keys
// at a time, into scores[p] (a key past the row's count: -inf), and each pair's largest 16 lanes in best[p].
template <int C, int G, int R, typename T>
inline void score_keys(const float* const* q, const T* keys, const int64_t* idx, const int64_t* counts, int64_t count,
                       float scale, int64_t ahead, int64_t ahead_n, float (*scores)[kChunk], V16* best) {
  constexpr int P = G * R;
  const int64_t blocks = (count + 15) / 16;
  for (int p = 0; p < P; ++p) best[p] = V16::set1(-INFINITY);
  for (int64_t b = 0; b < blocks; ++b) {
    V16 dots[P][16];
    for (int k = 0; k < 16; ++k) {
      const T* key = keys + idx[16 * b + k] * 16 * C;
      if (16 * b + k < ahead_n) prefetch_row(key + ahead, 16 * C * sizeof(T));
      V16 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = V16::load(key + 16 * c);
      for (int p = 0; p < P; ++p) {
        const float* qp = q[p / G] + (p % G) * 16 * C;
        V16 acc = V16::mul(V16::load(qp), kv[0]);
        for (int c = 1; c < C; ++c) acc = V16::fma(V16::load(qp + 16 * c), kv[c], acc);
        dots[p][k] = acc;
      }
    }
    for (int p = 0; p < P; ++p) {
      const int valid = static_cast<int>(std::clamp<int64_t>(counts[p / G] - 16 * b, 0, 16));
      const V16 s = V16::first(V16::mul(V16::sums16(dots[p]), V16::set1(scale)), valid, -INFINITY);
      s.store(scores[p] + 16 * b);
      best[p] = V16::max(best[p], s);
    }
  }
}

// attend_rows' weights: each pair's top (its largest score), its scores made e^(s - top) in place, and their total.
template <int G, int R>
inline void exponentiate(const int64_t* counts, const V16* best, float (*scores)[kChunk], float* const* top,
                         float* const* total) {
  for (int p = 0; p < G * R; ++p) {
    const float m = V16::max_lane(best[p]);
    top[p / G][p % G] = m;
    const V16 shift = V16::set1(m);
    V16 sum = V16::zero();
    for (int64_t b = 0; b < (counts[p / G] + 15) / 16; ++b) {
      const int valid = static_cast<int>(std::min<int64_t>(16, counts[p / G] - 16 * b));
      const V16 e = V16::first(exp_nonpositive(V16::sub(V16::load(scores[p] + 16 * b), shift)), valid, 0.0f);
      e.store(scores[p] + 16 * b);
      sum = V16::add(sum, e);
    }
    total[p / G][p % G] = V16::sum(sum);
  }
}

// attend_rows' values: out[r] (G * d floats) = sum over the row's keys of its heads' weights times the values, two
// rows at a time (2 * G * C accumulators in registers).
template <int C, int G, int R, typename T>
inline void weigh_values(const T* values, const int64_t* idx, const int64_t* counts, int64_t count,
                         float (*scores)[kChunk], float* const* out, int64_t ahead, int64_t ahead_n) {
  for (int r0 = 0; r0 < R; r0 += 2) {
    const int rows = std::min(2, R - r0);
    V16 acc[2][G][C];
    for (int r = 0; r < 2; ++r)
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[r][g][c] = V16::zero();
    for (int64_t a = 0; a < count; ++a) {
      const T* v = values + idx[a] * 16 * C;
      if (a < ahead_n && r0 == 0) prefetch_row(v + ahead, 16 * C * sizeof(T));
      V16 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = V16::load(v + 16 * c);
      for (int r = 0; r < rows; ++r) {
        if (a >= counts[r0 + r]) continue;  // past this row's keys
        for (int g = 0; g < G; ++g) {
          const V16 pj = V16::set1(scores[(r0 + r) * G + g][a]);
          for (int c = 0; c < C; ++c) acc[r][g][c] = V16::fma(pj, vv[c], acc[r][g][c]);
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[r][g][c].store(out[r0 + r] + g * 16 * C + 16 * c);
  }
}

// R query rows x G query heads (d = 16 * C floats each, a row's heads consecutive from q[r]) that read the same
// keys/values [S, d], over one chunk: row r the slots idx[0..counts[r]) (each <= kChunk; idx padded to a multiple of
// 16 with repeats of its last slot; a row's keys past its own count are left out of its scores, sums
// and values exactly as if it went alone: a causal prefill's or a chain's rows share a chunk's first keys). Writes
// each (row, head)'s partial: top[r][g] (the chunk's largest score), total[r][g] and out[r] (G * d floats,
// unnormalised). The scores go 16 keys at a time (`sums16`: one transposing sum instead
// of 16 horizontal ones); a key's score, like every sum here, is formed the same way wherever the key sits in its 16
// and for any G and R, so each (row, head) gets the bits it gets alone. A key is loaded (and, from an fp16 cache,
// upcast) once for every row and head, a value once for every head of two rows. As the first ahead_n keys and
// values are read, the ones `ahead` elements further on (the thread's next chunk's) are asked for (`prefetch_row`).
template <int C, int G, int R, typename T>
inline void attend_rows(const float* const* q, const T* keys, const T* values, const int64_t* idx, const int64_t* counts,
                 float scale, float* const* top, float* const* total, float* const* out, int64_t ahead,
                 int64_t ahead_n) {
  const int64_t count = *std::max_element(counts, counts + R);  // the keys any row reads
  alignas(64) float scores[G * R][kChunk];
  V16 best[G * R];
  score_keys<C, G, R>(q, keys, idx, counts, count, scale, ahead, ahead_n, scores, best);
  exponentiate<G, R>(counts, best, scores, top, total);
  weigh_values<C, G, R>(values, idx, counts, count, scores, out, ahead, ahead_n);
}

// The heads of one kv group (`group` of them) for R rows that attend the same keys of a chunk (q[r], top[r],
// total[r], out[r]: row r's first head of the group), up to kHeadsAtOnce heads at a time.
constexpr int kHeadsAtOnce = 3;
constexpr int kRowsAtOnce = 4;  // rows that share a chunk's keys, computed together

template <int C, int R, typename T>
inline void attend_group(const float* const* q, const T* keys, const T* values, const int64_t* idx, const int64_t* counts,
                  float scale, float* const* top, float* const* total, float* const* out, int64_t group, int64_t ahead,
                  int64_t ahead_n) {
  const int64_t d = 16 * C;
  const auto heads = [&](int64_t h, auto width) {
    constexpr int W = decltype(width)::value;
    const float* qh[R];
    float *th[R], *sh[R], *oh[R];
    for (int r = 0; r < R; ++r) qh[r] = q[r] + h * d, th[r] = top[r] + h, sh[r] = total[r] + h, oh[r] = out[r] + h * d;
    attend_rows<C, W, R, T>(qh, keys, values, idx, counts, scale, th, sh, oh, ahead, h == 0 ? ahead_n : 0);
  };
  int64_t h = 0;
  for (; h + kHeadsAtOnce <= group; h += kHeadsAtOnce) heads(h, std::integral_constant<int, kHeadsAtOnce>{});
  for (; h + 2 <= group; h += 2) heads(h, std::integral_constant<int, 2>{});
  for (; h < group; ++h) heads(h, std::integral_constant<int, 1>{});
}

}  // namespace dv::chunk
