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

#include "attention_chunk.h"
#include "ops.h"
#include "scratch.h"

namespace {
using dv::exp_nonpositive;
using dv::chunk::attend_group;
using dv::chunk::kChunk;
using dv::chunk::kRowsAtOnce;
// The head dims the kernels take (d = 16 C floats, `attend_group`'s C).
constexpr bool head_dim_supported(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128 || d == 256; }
// Below this many (row, key) pairs of a kv group's heads, summed over the groups, attention runs on the calling
// thread (a step over a context of about 340 keys with 3 groups), and below kSerialMerge floats of partials a
// thread, the merge: a parallel region's start and join cost more than that work.
constexpr int64_t kSerialWork = 1024, kSerialMerge = 16384;

// Whether every one of `count` mask entries from `allowed` is true (a causal prefill's rows mostly are, chunk after
// chunk): memchr's vector scan for a false byte rather than a test per key.
inline bool all_allowed(const bool* allowed, int64_t count) {
  return std::memchr(allowed, 0, static_cast<size_t>(count)) == nullptr;
}

// One task's rows (at most kRowsAtOnce): each one's keys of the chunk (idx[r][0..counts[r]), padded to a multiple of
// 16 with repeats of its last), its chunks (`mine`), its query heads of the kv group, and where its partials go (a
// row with one chunk: its output).
struct TaskRows {
  int rows;
  int64_t idx[kRowsAtOnce][kChunk], counts[kRowsAtOnce], mine[kRowsAtOnce];
  const float* qh[kRowsAtOnce];
  float *acc[kRowsAtOnce], *top[kRowsAtOnce], *total[kRowsAtOnce];
};

// The rows of task (kv group g, chunk c, rows from i0) into `t`; a row with no key in the chunk writes its tops, -inf
// (which the merge skips).
void task_rows(const dv::AttentionPlan& p, int64_t g, int64_t c, int64_t i0, TaskRows& t) {
  const int64_t H = p.H, d = p.d, group = p.group;
  t.rows = static_cast<int>(std::min<int64_t>(kRowsAtOnce, p.n - i0));
  for (int r = 0; r < t.rows; ++r) {
    const int64_t i = i0 + r;
    const int64_t* const b = p.bounds + i * p.stride;
    const int64_t slot = (i * p.chunks + c) * H + g * group;
    t.mine[r] = p.ends[i] - 1;
    int64_t count = 0;
    if (c < t.mine[r]) {
      const bool* allowed = p.mask ? p.mask + i * p.S : nullptr;
      if (!allowed || all_allowed(allowed + b[c], b[c + 1] - b[c])) {
        for (int64_t j = b[c]; j < b[c + 1]; ++j) t.idx[r][count++] = j;
      } else {
        for (int64_t j = b[c]; j < b[c + 1]; ++j)
          if (allowed[j]) t.idx[r][count++] = j;
      }
    }
    t.counts[r] = count;
    if (count == 0) {  // no key of this chunk for this row
      std::fill(p.tops + slot, p.tops + slot + group, -INFINITY);
      continue;
    }
    for (int64_t a = count; a % 16; ++a) t.idx[r][a] = t.idx[r][count - 1];
    t.qh[r] = p.q + i * p.row_stride + g * group * d;
    t.acc[r] = t.mine[r] == 1 ? p.out + i * H * d + g * group * d : p.accs + slot * d;
    t.top[r] = p.tops + slot, t.total[r] = p.totals + slot;
  }
}

// The keys and values this thread reads next (task `next`'s chunk, unless that is task (g, c, i0)'s chunk for other
// rows), asked for as this chunk is read: `ahead` elements past each of this chunk's first `ahead_n` keys and values
// (both 0: none).
std::pair<int64_t, int64_t> next_reads(const dv::AttentionPlan& p, int64_t g, int64_t c, int64_t i0, int64_t next) {
  const int64_t chunks = p.chunks, row_blocks = p.row_blocks, stride = p.stride;
  int64_t ahead = 0, ahead_n = 0;
  if (next < p.tasks) {
    const int64_t g2 = next / (chunks * row_blocks), c2 = (next / row_blocks) % chunks;
    const int64_t i2 = (next % row_blocks) * kRowsAtOnce, *const b2 = p.bounds + i2 * stride;
    if ((g2 != g || c2 != c) && c2 < p.ends[i2] - 1 && c < p.ends[i0] - 1) {
      ahead = ((g2 - g) * p.cap + b2[c2] - p.bounds[i0 * stride + c]) * p.d;
      ahead_n = std::min(kChunk, b2[c2 + 1] - b2[c2]);
    }
  }
  return {ahead, ahead_n};
}

// Task rows `t` of kv group g attend their chunk's keys: together where each one's keys of the chunk begin the
// longest one's (rows of a causal prefill or of a chain: the same keys, or the diagonal's one key more a row), else
// one at a time.
void attend_task(const dv::AttentionPlan& p, TaskRows& t, int64_t g, int64_t ahead, int64_t ahead_n) {
  const int rows = t.rows;
  const int64_t d = p.d, group = p.group;
  const float sc = p.scale;
  const int longest = static_cast<int>(std::max_element(t.counts, t.counts + rows) - t.counts);
  bool together = rows == kRowsAtOnce;
  for (int r = 0; together && r < rows; ++r)
    together = t.counts[r] > 0 && std::equal(t.idx[r], t.idx[r] + t.counts[r], t.idx[longest]);
  const int64_t offset = g * p.cap * d * p.item;
  const auto run = [&](const auto* kg, const auto* vg) {
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
      rows_of(std::integral_constant<int, kRowsAtOnce>{}, t.qh, t.idx[longest], t.counts, t.top, t.total, t.acc,
              ahead_n);
      return;
    }
    for (int r = 0; r < rows; ++r)  // the first row's call asks for the next task's keys and values
      if (t.counts[r] > 0)
        rows_of(std::integral_constant<int, 1>{}, &t.qh[r], t.idx[r], &t.counts[r], &t.top[r], &t.total[r], &t.acc[r],
                r == 0 ? ahead_n : 0);
  };
  if (p.half) {
    run(reinterpret_cast<const uint16_t*>(p.keys + offset), reinterpret_cast<const uint16_t*>(p.values + offset));
  } else {
    run(reinterpret_cast<const float*>(p.keys + offset), reinterpret_cast<const float*>(p.values + offset));
  }
}

// A row with one chunk is normalised where it is computed (the merge of one chunk, e^0 = 1, is that).
void normalise_one_chunk_rows(const TaskRows& t, int64_t group, int64_t d) {
  for (int r = 0; r < t.rows; ++r) {
    if (t.counts[r] == 0 || t.mine[r] != 1) continue;
    for (int64_t h = 0; h < group; ++h) {
      const float inv = 1.0f / t.total[r][h];
      for (int64_t e = 0; e < d; ++e) t.acc[r][h * d + e] *= inv;
    }
  }
}

// A row's chunk boundaries in slot order (its allowed keys cut every kChunk) into b: b[0] = 0, ..., b[e - 1] = S;
// returns e. `allowed`: the row's mask [S], or null (every key). A row whose keys are all allowed takes them directly,
// and a masked row skips whole allowed chunks a memchr at a time, so a long context is not scanned key by key.
inline int64_t chunk_bounds(const bool* allowed, int64_t S, int64_t* b) {
  int64_t e = 0;
  b[e++] = 0;
  if (!allowed) {
    for (int64_t j = kChunk; j < S; j += kChunk) b[e++] = j;
  } else {
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
  return e;
}

// A plan's tasks (kv group, chunk, block of kRowsAtOnce rows) dealt out to at most `threads` threads by their cost,
// about their rows times the keys they read in the chunk (see attention_plan): p.threads and p.owner.
inline void deal_tasks(dv::AttentionPlan& p, int64_t threads) {
  int64_t* const cost = dv::scratch<int64_t, dv::kTasks>(p.tasks);
  int64_t work = 0;
  for (int64_t t = 0; t < p.tasks; ++t) {
    const int64_t c = (t / p.row_blocks) % p.chunks, i0 = (t % p.row_blocks) * kRowsAtOnce;
    cost[t] = 0;
    for (int64_t i = i0; i < std::min(p.n, i0 + kRowsAtOnce); ++i)
      if (c < p.ends[i] - 1) cost[t] += p.bounds[i * p.stride + c + 1] - p.bounds[i * p.stride + c];
    work += cost[t];
  }
  p.threads = work < kSerialWork ? 1 : std::max<int64_t>(1, std::min(threads, p.tasks));
  p.owner = dv::deal(cost, p.tasks, p.threads);
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
  // Each row's chunk boundaries in slot order (`chunk_bounds`).
  p.stride = (S + kChunk - 1) / kChunk + 2;
  p.bounds = dv::scratch<int64_t, dv::kChunkBounds>(n * p.stride);
  p.ends = dv::scratch<int64_t, dv::kChunkCounts>(n);
  p.chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    p.ends[i] = chunk_bounds(mask ? mask + i * S : nullptr, S, p.bounds + i * p.stride);
    p.chunks = std::max<int64_t>(p.chunks, p.ends[i] - 1);
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
  deal_tasks(p, threads);
  return p;
}

// The tasks of threads [m0, m1) of a plan, in order: consecutive ones share a chunk, kept in L1.
void dv::attention_run(const AttentionPlan& p, int64_t m0, int64_t m1) {
  TaskRows rows;
  const auto own = [&](int64_t t) { return p.owner[t] >= m0 && p.owner[t] < m1; };
  int64_t next = 0;  // this thread's next task
  while (next < p.tasks && !own(next)) ++next;
  while (next < p.tasks) {
    const int64_t t = next;
    for (++next; next < p.tasks && !own(next);) ++next;
    const int64_t g = t / (p.chunks * p.row_blocks), c = (t / p.row_blocks) % p.chunks;
    const int64_t i0 = (t % p.row_blocks) * kRowsAtOnce;
    task_rows(p, g, c, i0, rows);
    const auto [ahead, ahead_n] = next_reads(p, g, c, i0, next);
    attend_task(p, rows, g, ahead, ahead_n);
    normalise_one_chunk_rows(rows, p.group, p.d);
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
