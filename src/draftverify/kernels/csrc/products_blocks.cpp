// The products of GGUF block weights (kernels/blocks.py packs the file's blocks into these layouts):
//   U4   codes 0..15, two a byte (byte j of a 32-weight block: q_j | q_{j+16} << 4); fp32 D, M per sub-block
//   U8   codes 0..255, one a byte; fp32 D, M per sub-block
//   F16  IEEE half weights, BF16 bfloat16 weights (2 bytes a weight, upcast exactly); F32 dense fp32 weights
// A sub-block is 16 or 32 consecutive weights of a row; every code layout's weight is w = fma(q, D, M), which gives
// the bits gguf's dequantization gives (blocks.py says why for each GGML type). Codes are unsigned so that an int8
// activation product (u8 weights x s8 activations: VNNI's vpdpbusd, AVX2's maddubs) can run over the same layouts:
// sum_i w_i x_i = D sum_i q_i x_i + M sum_i x_i per sub-block.
//
// y = x W^T (+ bias) for x [M, K] fp32: each 32-weight block is rebuilt in fp32 registers once per pass of rows
// and FMA'd into every row of the pass; a one-row product reads only the packed bytes. Every (row, output) sum is
// formed the same way for any number of rows (two 16-lane accumulators over the blocks in order, then one fixed
// reduction), so each row of a forward is bit for bit the one-row product of that row: verification is lossless.
#include "block_passes.h"

namespace {
using dv::V16;

enum Layout : int64_t { U4 = 0, U8 = 1, F16 = 2, BF16 = 3, F32 = 4 };

template <int L>
constexpr int64_t row_bytes(int64_t K) {
  return L == U4 ? K / 2 : L == U8 ? K : L == F32 ? 4 * K : 2 * K;
}

// A packed block weight of layout L (sub-blocks of S weights) as the pass loop (block_passes.h) reads it.
template <int L, int S>
struct Packed {
  const uint8_t* codes;  // U4 [N, K / 2], U8 [N, K], F16 / BF16 [N, K] of 2 bytes, F32 [N, K] of 4
  const float* d;        // [N, K / S] (code layouts)
  const float* m;        // [N, K / S] (code layouts)
  const float* b;        // [N] or null
  int64_t K;

  // Block `blk` (weights 32 blk .. 32 blk + 31) of output row n, rebuilt in fp32: lanes 0..15 in w0, 16..31 in w1.
  inline void rebuild(int64_t n, int64_t blk, V16& w0, V16& w1) const {
    const uint8_t* row = codes + n * row_bytes<L>(K);
    if constexpr (L == F32) {
      const float* f = reinterpret_cast<const float*>(row) + blk * 32;
      w0 = V16::load(f);
      w1 = V16::load(f + 16);
    } else if constexpr (L == F16 || L == BF16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + blk * 32;
      w0 = L == F16 ? V16::halves(h) : V16::bhalves(h);
      w1 = L == F16 ? V16::halves(h + 16) : V16::bhalves(h + 16);
    } else {
      if constexpr (L == U4) {
        V16::nibbles(row + blk * 16, w0, w1);
      } else {
        w0 = V16::ubytes(row + blk * 32);
        w1 = V16::ubytes(row + blk * 32 + 16);
      }
      const int64_t s0 = (n * K + blk * 32) / S, s1 = S == 16 ? s0 + 1 : s0;
      w0 = V16::fma(w0, V16::set1(d[s0]), V16::set1(m[s0]));
      w1 = V16::fma(w1, V16::set1(d[s1]), V16::set1(m[s1]));
    }
  }

  inline void prefetch(int64_t n) const {
    const char* q = reinterpret_cast<const char*>(codes + n * row_bytes<L>(K));
    for (int64_t at = 0; at < row_bytes<L>(K); at += 64) _mm_prefetch(q + at, _MM_HINT_T0);
    if constexpr (L == U4 || L == U8) {
      const int64_t subs = K / S;
      const char *dp = reinterpret_cast<const char*>(d + n * subs), *mp = reinterpret_cast<const char*>(m + n * subs);
      for (int64_t at = 0; at < subs * 4; at += 64) {
        _mm_prefetch(dp + at, _MM_HINT_T0);
        _mm_prefetch(mp + at, _MM_HINT_T0);
      }
    }
  }

  inline float bias(int64_t n) const { return b ? b[n] : 0.0f; }
};

template <int L, int S>
void run(const float* x, const uint8_t* codes, const float* d, const float* m, const float* bias, float* y, int64_t M,
         int64_t K, int64_t N) {
  dv::block_product(x, Packed<L, S>{codes, d, m, bias, K}, y, M, K, N);
}

using RunFn = void (*)(const float*, const uint8_t*, const float*, const float*, const float*, float*, int64_t,
                       int64_t, int64_t);

RunFn pick(int64_t layout, int64_t sub) {
  if (layout == U4) return sub == 16 ? run<U4, 16> : run<U4, 32>;
  if (layout == U8) return sub == 16 ? run<U8, 16> : run<U8, 32>;
  if (layout == F32) return run<F32, 32>;
  return layout == F16 ? run<F16, 32> : run<BF16, 32>;
}
}  // namespace

// x [M, K] float32 contiguous, K a multiple of 32; layout 0 (U4), 1 (U8), 2 (F16), 3 (BF16), 4 (F32); sub 16 or 32
// (code layouts); codes [N, row bytes] of any dtype (F16 / BF16 / F32: the weights); d, m float32 [N, K / sub] (empty
// for F16 / BF16 / F32); bias [N] or empty. Returns y [M, N].
at::Tensor block_linear(at::Tensor x, int64_t layout, int64_t sub, at::Tensor codes, at::Tensor d, at::Tensor m,
                        at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "block_linear: x must be [M, K] float32");
  TORCH_CHECK(layout >= U4 && layout <= F32 && (sub == 16 || sub == 32), "block_linear: layout 0..4 and sub 16 or 32");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const bool coded = layout == U4 || layout == U8;
  const int64_t width = layout == U4 ? K / 2 : layout == U8 ? K : layout == F32 ? 4 * K : 2 * K;
  TORCH_CHECK(K % 32 == 0 && codes.is_contiguous() && codes.nbytes() == N * width, "block_linear: codes must be [N, row bytes]");
  TORCH_CHECK(!coded || (d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && d.is_contiguous() && m.is_contiguous() &&
                         d.numel() == N * K / sub && m.numel() == N * K / sub),
              "block_linear: d and m must be float32 [N, K / sub]");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N && bias.is_contiguous()), "block_linear: bias");
  auto y = at::empty({M, N}, x.options());
  pick(layout, sub)(x.data_ptr<float>(), reinterpret_cast<const uint8_t*>(codes.data_ptr()),
                    coded ? d.data_ptr<float>() : nullptr, coded ? m.data_ptr<float>() : nullptr,
                    bias.numel() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N);
  return y;
}
