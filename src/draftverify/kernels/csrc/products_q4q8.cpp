

// ---- Quantized weights, exact: y = x W^T where every 32-weight block of a row of W is stored as it
// was quantized (the model's own GGUF blocks, recovered bit-exactly from its fp32 weights by
// kernels/quant.py):
//   q4 (llama.cpp Q4_1): w_i = fma(q_i, d, m), q_i in 0..15, two per byte (byte j: q_j | q_{j+16} << 4)
//   q8 (llama.cpp Q8_0): w_i = q_i * d,      q_i in -128..127
// Each weight is rebuilt in fp32 exactly as the fp32 model holds it, then multiplied in fp32: the
// same model, reading 5 or 8.5 bits a weight instead of 32. One row's sum is formed the same way
// whatever the number of rows (two 16-lane accumulators over the blocks in order, then one fixed
// reduction), so a verified token's logits are bit for bit those of a one-token step.
#include "ops.h"
#include "products.h"
#include "simd.h"

namespace {
using dv::kAheadRows;
using dv::V16;

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
// against output rows n0..n1. A pass's rows of x stay in L1 while the weights stream, which timed faster
// than tiling the outputs so that the weights stream once (the product is bound by arithmetic here).
// The row count is chosen once per pass, outside the loop over outputs (chosen per output, passes of a
// few rows ran slower). The last pass takes what is left, up to kLast rows: with AVX-512's 32 registers
// 7 or 8 rows go in one pass rather than 6 + 1 or 6 + 2 (a pass of few rows costs nearly a one-token
// product: the weights stream again). With AVX2 (16 registers, a V16 is two) passes of 6. The timings
// behind these choices are in docs/backends.md. Every pass forms a row's sums the same way, so the split
// never changes a bit.
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
}  // namespace

// x [M, K] float32 contiguous; q uint8 (q4: [N, K / 2]) or int8 (q8: [N, K]); d [N, K / 32]; m [N, K / 32]
// (q4) or empty (q8); bias [N] or empty. Returns y [M, N].
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "quant_linear: x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  const bool q4 = m.numel() > 0;
  TORCH_CHECK(K % 32 == 0 && d.size(1) == K / 32 && q.size(0) == N && q.size(1) == (q4 ? K / 2 : K), "quant_linear: shapes");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && (!q4 || m.is_contiguous()), "quant_linear: layout");
  auto y = at::empty({M, N}, x.options());
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
