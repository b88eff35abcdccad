

// ---- Quantized weights, exact: y = x W^T where every 32-weight block of a row of W is stored as it
// was quantized (the model's own GGUF blocks, recovered bit-exactly from its fp32 weights by
// kernels/quant.py):
//   q4 (llama.cpp Q4_1): w_i = fma(q_i, d, m), q_i in 0..15, two per byte (byte j: q_j | q_{j+16} << 4)
//   q8 (llama.cpp Q8_0): w_i = q_i * d,      q_i in -128..127
// Each weight is rebuilt in fp32 exactly as the fp32 model holds it, then multiplied in fp32: the
// same model, reading 5 or 8.5 bits a weight instead of 32. One row's sum is formed the same way
// whatever the number of rows (two 16-lane accumulators over the blocks in order, then one fixed
// reduction), so a verified token's logits are bit for bit those of a one-token step.
#include "block_passes.h"

namespace {
using dv::V16;

// A Q4_1 (`Q4`) or Q8_0 weight as the pass loop (block_passes.h) reads it.
template <bool Q4>
struct Quant {
  const uint8_t* q;  // q4: [N, K / 2]; q8: [N, K]
  const float* d;    // [N, K / 32]
  const float* m;    // [N, K / 32] (q4) or null (q8)
  const float* b;    // [N] or null
  int64_t K;

  // Block `blk` of output row n's 32 weights, rebuilt in fp32 (lanes 0..15 and 16..31).
  inline void rebuild(int64_t n, int64_t blk, V16& w0, V16& w1) const {
    const int64_t i = n * (K / 32) + blk;
    const V16 dv = V16::set1(d[i]);
    if constexpr (Q4) {
      V16::nibbles(q + i * 16, w0, w1);
      const V16 mv = V16::set1(m[i]);
      w0 = V16::fma(w0, dv, mv);
      w1 = V16::fma(w1, dv, mv);
    } else {
      const int8_t* s = reinterpret_cast<const int8_t*>(q) + i * 32;
      w0 = V16::mul(V16::bytes(s), dv);
      w1 = V16::mul(V16::bytes(s + 16), dv);
    }
  }

  inline void prefetch(int64_t n) const {
    const int64_t qbytes = Q4 ? K / 2 : K, blocks = K / 32;
    const char* at_q = reinterpret_cast<const char*>(q) + n * qbytes;
    for (int64_t at = 0; at < qbytes; at += 64) _mm_prefetch(at_q + at, _MM_HINT_T0);
    const char* at_d = reinterpret_cast<const char*>(d + n * blocks);
    const char* at_m = Q4 ? reinterpret_cast<const char*>(m + n * blocks) : nullptr;
    for (int64_t at = 0; at < blocks * 4; at += 64) {
      _mm_prefetch(at_d + at, _MM_HINT_T0);
      if constexpr (Q4) _mm_prefetch(at_m + at, _MM_HINT_T0);
    }
  }

  inline float bias(int64_t n) const { return b ? b[n] : 0.0f; }
};
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
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (q4) dv::block_product(xp, Quant<true>{qp, d.data_ptr<float>(), m.data_ptr<float>(), bp, K}, yp, M, K, N);
  else dv::block_product(xp, Quant<false>{qp, d.data_ptr<float>(), nullptr, bp, K}, yp, M, K, N);
  return y;
}
