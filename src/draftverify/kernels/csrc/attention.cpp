// ---- Attention of a few new tokens against one layer's static cache. Each query row's allowed keys, in slot
// order, are cut into chunks of kChunk (its keys 0..kChunk-1, kChunk..2 kChunk-1, ...: counted over the keys the
// row may attend, so a tree's gaps or the masked keys after a row change no chunk). For each row, head and chunk:
// the scores against the chunk's keys, their maximum m, l = sum e^(s - m) and the unnormalised sum of e^(s - m) v;
// then the chunks are merged in order (out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c). Every (row, head) is
// so computed alone, in a fixed order over the same keys, so a token's attention output does not depend on how many
// tokens came with it or where in the cache its ancestors sit (as for the quantized product). All rows go chunk by
// chunk, so a chunk's keys and values come from memory once and serve every row from L1 (rather than each row
// streaming the whole cache again), and the threads share out chunks rather than the few kv heads; rows that attend
// the same keys of a chunk (a prefill's, rows with no mask) share each key's load too (attend_rows). One kernel call
// replaces the ~6 small ops of the stock formula (two bmm, scale, softmax, casts; or SDPA), whose fixed costs
// dominate at decoding sizes.
#include <cstring>

#include "ops.h"
#include "scratch.h"
#include "simd.h"

namespace {
using dv::V16;
using dv::exp_nonpositive;
constexpr int64_t kChunk = 128;
// The head dims the kernels take (d = 16 C floats, `attend_group`'s C).
constexpr bool head_dim_supported(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128 || d == 256; }
// Below this many (row, key) pairs of a kv group's heads, summed over the groups, attention runs on the calling
// thread (a step over a context of about 340 keys with 3 groups), and below kSerialMerge floats of partials a
// thread, the merge: a parallel region's start and join cost more than that work.
constexpr int64_t kSerialWork = 1024, kSerialMerge = 16384;

// Asks for one key or value row (`bytes` long) into L2. A long context's keys and values come from memory (a step
// reads every layer's, far more than L2 holds), and the hardware's prefetch does not run ahead of the chunk-by-chunk
// reads: asked for as a thread reads its chunk before, the chunk it reads next is in L2 when it comes. That is the
// thread's next task, not the next chunk: the tasks are dealt out by cost, so the next chunk is often another
// thread's, and a one-thread call goes on to the next kv group's first chunk (asking for the next chunk instead left
// many of a thread's chunks cold, and a step over a long context measurably slower: timings in issue 41's note).
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(row) + o, _MM_HINT_T1);
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
void attend_rows(const float* const* q, const T* keys, const T* values, const int64_t* idx, const int64_t* counts,
                 float scale, float* const* top, float* const* total, float* const* out, int64_t ahead,
                 int64_t ahead_n) {
  constexpr int P = G * R;  // (row, head) pairs, row-major: pair r * G + g
  const int64_t count = *std::max_element(counts, counts + R);  // the keys any row reads
  alignas(64) float scores[P][kChunk];
  const int64_t blocks = (count + 15) / 16;
  V16 best[P];
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
  for (int p = 0; p < P; ++p) {
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
  // the values, two rows at a time (2 * G * C accumulators in registers)
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

// The heads of one kv group (`group` of them) for R rows that attend the same keys of a chunk (q[r], top[r],
// total[r], out[r]: row r's first head of the group), up to kHeadsAtOnce heads at a time.
constexpr int kHeadsAtOnce = 3;
constexpr int kRowsAtOnce = 4;  // rows that share a chunk's keys, computed together

template <int C, int R, typename T>
void attend_group(const float* const* q, const T* keys, const T* values, const int64_t* idx, const int64_t* counts,
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

// Whether every one of `count` mask entries from `allowed` is true (a causal prefill's rows mostly are, chunk after
// chunk): memchr's vector scan for a false byte rather than a test per key.
inline bool all_allowed(const bool* allowed, int64_t count) {
  return std::memchr(allowed, 0, static_cast<size_t>(count)) == nullptr;
}

}  // namespace

// The plan of one attention call (dv::AttentionPlan, ops.h): q [n, H, d] at `q` (rows `row_stride` floats apart;
// heads and features contiguous); keys, values [kv, capacity, d], the first S slots valid (kv divides H: query head
// h reads kv head h / (H / kv)); mask [n, S] bool (True = may attend) or null (every key); the output [n, H * d] at
// `out`. Works out every row's chunks and deals the tasks out to at most `threads` threads; its buffers are this
// thread's scratch, valid until this thread's next plan.
dv::AttentionPlan dv::attention_plan(const float* q, int64_t row_stride, const at::Tensor& keys, const at::Tensor& values,
                                     int64_t n, int64_t H, int64_t S, const bool* mask, double scale, float* out,
                                     int64_t threads) {
  AttentionPlan p;
  p.q = q, p.row_stride = row_stride, p.mask = mask, p.out = out, p.n = n, p.H = H, p.S = S;
  p.keys = static_cast<const char*>(keys.data_ptr()), p.values = static_cast<const char*>(values.data_ptr());
  p.half = keys.scalar_type() == at::kHalf, p.item = keys.element_size();
  p.kv = keys.size(0), p.cap = keys.size(1), p.d = keys.size(2), p.group = H / p.kv;
  p.scale = static_cast<float>(scale);
  // Each row's chunk boundaries in slot order (its allowed keys cut every kChunk): b[0] = 0, ..., b[e - 1] = S.
  // A row whose keys are all allowed (the usual case) takes them directly, and a masked row skips whole allowed
  // chunks a memchr at a time, so a long context is not scanned key by key.
  p.stride = (S + kChunk - 1) / kChunk + 2;
  p.bounds = dv::scratch<int64_t, dv::kChunkBounds>(n * p.stride);
  p.ends = dv::scratch<int64_t, dv::kChunkCounts>(n);
  p.chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t* const b = p.bounds + i * p.stride;
    int64_t e = 0;
    b[e++] = 0;
    if (!mask) {
      for (int64_t j = kChunk; j < S; j += kChunk) b[e++] = j;
    } else {
      const bool* allowed = mask + i * S;
      int64_t count = 0, masked_at = -1;  // the last masked key a look ahead found
      for (int64_t j = 0; j < S;) {
        if (count % kChunk == 0 && j > masked_at && j + kChunk <= S) {  // a whole chunk of allowed keys at once?
          const void* hole = std::memchr(allowed + j, 0, kChunk);
          if (hole == nullptr) {
            j += kChunk, count += kChunk;
            b[e++] = j;
            continue;
          }
          masked_at = static_cast<const bool*>(hole) - allowed;
        }
        if (allowed[j] && ++count % kChunk == 0) b[e++] = j + 1;
        ++j;
      }
      if (count % kChunk == 0) --e;  // the last boundary closes the last chunk: S does
    }
    b[e++] = S;
    p.ends[i] = e;
    p.chunks = std::max<int64_t>(p.chunks, e - 1);
  }
  // Partials per (row, chunk, head) of the rows with more than one chunk: top, total, acc [d] (a kv group's heads
  // together); a row with one chunk is normalised where it is computed (the merge of one chunk, e^0 = 1, is that).
  // Each is written before it is read (a chunk with no key of a row writes its top, -inf, which the merge skips).
  p.tops = dv::scratch<float, dv::kTops>(n * p.chunks * H);
  p.totals = dv::scratch<float, dv::kTotals>(n * p.chunks * H);
  p.accs = dv::scratch<float, dv::kAccs>(p.chunks > 1 ? n * p.chunks * H * p.d : 0);
  // The tasks are dealt out before they run, costliest first, each to the thread with the least work so far
  // (`dv::deal`, as a batch's sequences are; a task costs about its rows times the keys they read in its chunk): a
  // kv group's heads are the unit of work, and there are few groups (SmolLM2's 3 for 2 threads) and chunks of unequal
  // size (a tree's last chunk holds its few new keys), so an even split by count left one thread with twice the
  // other's work. A task's result does not depend on which thread runs it. Too little work for two threads (a step
  // over a short context) goes to one: starting the others would cost more than it saves.
  p.row_blocks = (n + kRowsAtOnce - 1) / kRowsAtOnce, p.tasks = p.kv * p.chunks * p.row_blocks;
  int64_t* const cost = dv::scratch<int64_t, dv::kTasks>(p.tasks);
  int64_t work = 0;
  for (int64_t t = 0; t < p.tasks; ++t) {
    const int64_t c = (t / p.row_blocks) % p.chunks, i0 = (t % p.row_blocks) * kRowsAtOnce;
    cost[t] = 0;
    for (int64_t i = i0; i < std::min(n, i0 + kRowsAtOnce); ++i)
      if (c < p.ends[i] - 1) cost[t] += p.bounds[i * p.stride + c + 1] - p.bounds[i * p.stride + c];
    work += cost[t];
  }
  p.threads = work < kSerialWork ? 1 : std::max<int64_t>(1, std::min(threads, p.tasks));
  p.owner = dv::deal(cost, p.tasks, p.threads);
  return p;
}

// The tasks of threads [m0, m1) of a plan, in order: consecutive ones share a chunk, kept in L1.
void dv::attention_run(const AttentionPlan& p, int64_t m0, int64_t m1) {
  const int64_t n = p.n, H = p.H, d = p.d, S = p.S, chunks = p.chunks, row_blocks = p.row_blocks, group = p.group;
  const int64_t stride = p.stride, cap = p.cap, item = p.item;
  const int64_t *const bounds = p.bounds, *const ends = p.ends;
  const bool* const mp = p.mask;
  const float sc = p.scale;
  int64_t idx[kRowsAtOnce][kChunk];
  int64_t counts[kRowsAtOnce];
  const auto own = [&](int64_t t) { return p.owner[t] >= m0 && p.owner[t] < m1; };
  int64_t next = 0;  // this thread's next task
  while (next < p.tasks && !own(next)) ++next;
  while (next < p.tasks) {
    const int64_t t = next;
    for (++next; next < p.tasks && !own(next);) ++next;
    const int64_t g = t / (chunks * row_blocks), c = (t / row_blocks) % chunks, i0 = (t % row_blocks) * kRowsAtOnce;
    const int rows = static_cast<int>(std::min<int64_t>(kRowsAtOnce, n - i0));
    const float* qh[kRowsAtOnce];
    float *acc[kRowsAtOnce], *top[kRowsAtOnce], *total[kRowsAtOnce];
    int64_t mine[kRowsAtOnce];
    for (int r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      const int64_t* const b = bounds + i * stride;
      const int64_t slot = (i * chunks + c) * H + g * group;
      mine[r] = ends[i] - 1;
      int64_t count = 0;
      if (c < mine[r]) {
        const bool* allowed = mp ? mp + i * S : nullptr;
        if (!allowed || all_allowed(allowed + b[c], b[c + 1] - b[c])) {
          for (int64_t j = b[c]; j < b[c + 1]; ++j) idx[r][count++] = j;
        } else {
          for (int64_t j = b[c]; j < b[c + 1]; ++j)
            if (allowed[j]) idx[r][count++] = j;
        }
      }
      counts[r] = count;
      if (count == 0) {  // no key of this chunk for this row
        std::fill(p.tops + slot, p.tops + slot + group, -INFINITY);
        continue;
      }
      for (int64_t a = count; a % 16; ++a) idx[r][a] = idx[r][count - 1];
      qh[r] = p.q + i * p.row_stride + g * group * d;
      acc[r] = mine[r] == 1 ? p.out + i * H * d + g * group * d : p.accs + slot * d;
      top[r] = p.tops + slot, total[r] = p.totals + slot;
    }
    // the rows go together where each one's keys of the chunk begin the longest one's (rows of a causal prefill or of
    // a chain: the same keys, or the diagonal's one key more a row)
    const int longest = static_cast<int>(std::max_element(counts, counts + rows) - counts);
    bool together = rows == kRowsAtOnce;
    for (int r = 0; together && r < rows; ++r)
      together = counts[r] > 0 && std::equal(idx[r], idx[r] + counts[r], idx[longest]);
    const int64_t offset = g * cap * d * item;
    // The keys and values this thread reads next (its next task's chunk, unless that is this chunk for other rows),
    // asked for as this chunk is read: `ahead` elements past each of this chunk's first `ahead_n` keys and values.
    int64_t ahead = 0, ahead_n = 0;
    if (next < p.tasks) {
      const int64_t g2 = next / (chunks * row_blocks), c2 = (next / row_blocks) % chunks;
      const int64_t i2 = (next % row_blocks) * kRowsAtOnce, *const b2 = bounds + i2 * stride;
      if ((g2 != g || c2 != c) && c2 < ends[i2] - 1 && c < ends[i0] - 1) {
        ahead = ((g2 - g) * cap + b2[c2] - bounds[i0 * stride + c]) * d;
        ahead_n = std::min(kChunk, b2[c2 + 1] - b2[c2]);
      }
    }
    const auto run = [&](const auto* kg, const auto* vg) {
      // rows of this task that share the chunk's keys go together (above), else one at a time
      const auto rows_of = [&](auto r_count, const float* const* qr, const int64_t* ir, const int64_t* cs,
                               float* const* tr, float* const* sr, float* const* ar, int64_t ahead_n) {
        constexpr int R = decltype(r_count)::value;
        switch (d) {
          case 16: attend_group<1, R>(qr, kg, vg, ir, cs, sc, tr, sr, ar, group, ahead, ahead_n); break;
          case 32: attend_group<2, R>(qr, kg, vg, ir, cs, sc, tr, sr, ar, group, ahead, ahead_n); break;
          case 64: attend_group<4, R>(qr, kg, vg, ir, cs, sc, tr, sr, ar, group, ahead, ahead_n); break;
          case 128: attend_group<8, R>(qr, kg, vg, ir, cs, sc, tr, sr, ar, group, ahead, ahead_n); break;
          default: attend_group<16, R>(qr, kg, vg, ir, cs, sc, tr, sr, ar, group, ahead, ahead_n); break;  // Gemma's 256
        }
      };
      if (together) {
        rows_of(std::integral_constant<int, kRowsAtOnce>{}, qh, idx[longest], counts, top, total, acc, ahead_n);
        return;
      }
      for (int r = 0; r < rows; ++r)  // the first row's call asks for the next task's keys and values
        if (counts[r] > 0)
          rows_of(std::integral_constant<int, 1>{}, &qh[r], idx[r], &counts[r], &top[r], &total[r], &acc[r],
                  r == 0 ? ahead_n : 0);
    };
    if (p.half) {
      run(reinterpret_cast<const uint16_t*>(p.keys + offset), reinterpret_cast<const uint16_t*>(p.values + offset));
    } else {
      run(reinterpret_cast<const float*>(p.keys + offset), reinterpret_cast<const float*>(p.values + offset));
    }
    for (int r = 0; r < rows; ++r) {
      if (counts[r] == 0 || mine[r] != 1) continue;
      for (int64_t h = 0; h < group; ++h) {
        const float inv = 1.0f / total[r][h];
        for (int64_t e = 0; e < d; ++e) acc[r][h * d + e] *= inv;
      }
    }
  }
}

// (row, head) pairs [r0, r1) of a plan: each of a row with more than one chunk gets its chunks merged in order.
void dv::attention_merge(const AttentionPlan& p, int64_t r0, int64_t r1) {
  const int64_t H = p.H, d = p.d, chunks = p.chunks;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r / H, h = r % H, mine = p.ends[i] - 1;
    if (mine == 1) continue;
    float M = -INFINITY;
    for (int64_t c = 0; c < mine; ++c) M = std::max(M, p.tops[(i * chunks + c) * H + h]);
    float* o = p.out + i * H * d + h * d;
    std::fill(o, o + d, 0.0f);
    float L = 0.0f;
    for (int64_t c = 0; c < mine; ++c) {
      const int64_t slot = (i * chunks + c) * H + h;
      if (p.tops[slot] == -INFINITY) continue;  // no key of this chunk for this row
      const float w = exp_nonpositive(p.tops[slot] - M);
      L += w * p.totals[slot];
      const float* a = p.accs + slot * d;
      for (int64_t e = 0; e < d; ++e) o[e] += w * a[e];
    }
    const float inv = 1.0f / L;
    for (int64_t e = 0; e < d; ++e) o[e] *= inv;
  }
}

// Checks the cache and the head dim as `attention` and `rope_attention` need them (before anything is written).
void dv::check_cache(const at::Tensor& keys, const at::Tensor& values, int64_t heads, const char* op) {
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
              op, ": keys and values must be [kv, capacity, d], contiguous, of one shape");
  TORCH_CHECK(head_dim_supported(keys.size(2)), op, ": head dim 16, 32, 64, 128 or 256");
  TORCH_CHECK((keys.scalar_type() == at::kHalf || keys.scalar_type() == at::kFloat) && values.scalar_type() == keys.scalar_type(),
              op, ": keys and values both float32 or both float16");
  TORCH_CHECK(heads % keys.size(0) == 0, op, ": the kv heads must divide the query heads");
}

// q [n, H, d] (rows may be strided; heads and features contiguous); keys, values [kv, capacity, d], the
// first S slots valid (kv divides H: query head h reads kv head h / (H / kv)); mask [n, S] bool (True = may
// attend) or empty (every key); d 16, 32, 64, 128 or 256. q float32; keys and values float32, or float16 (a q8
// target's cache: each read upcast exactly, so the arithmetic is the fp32 one on the stored values). Returns [n, H * d].
// A call from a parallel region (a batch's sequences) runs on its own thread.
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t S, at::Tensor mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attention: q must be [n, H, d] float32");
  dv::check_cache(keys, values, q.size(1), "attention");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  TORCH_CHECK(keys.size(2) == d && S <= keys.size(1), "attention: sizes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d, "attention: layout");
  const bool masked = mask.numel() > 0;
  TORCH_CHECK(!masked || (mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.size(0) == n && mask.size(1) == S), "attention: mask");
  auto out = at::empty({n, H * d}, q.options());
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const dv::AttentionPlan p = dv::attention_plan(q.data_ptr<float>(), q.stride(0), keys, values, n, H, S,
                                                 masked ? mask.data_ptr<bool>() : nullptr, scale, out.data_ptr<float>(), threads);
  at::parallel_for(0, p.threads, 1, [&](int64_t m0, int64_t m1) { dv::attention_run(p, m0, m1); });  // a share a thread
  if (p.chunks == 1) return out;
  at::parallel_for(0, n * H, std::max<int64_t>(1, kSerialMerge / (p.chunks * d)),
                   [&](int64_t r0, int64_t r1) { dv::attention_merge(p, r0, r1); });
  return out;
}
