// Rotary positions and the cache writes of a layer's new tokens, then their attention (attention.cpp): the
// rotate-half rotation of q and k, k and v stored in the static cache (as they are, or rounded to fp16).
#include <cstring>

#include "ops.h"
#include "simd.h"

using dv::V16;

// Rows of a layer's fused q/k/v projection at `src` (n rows `width` floats apart: heads q heads, then kv k heads and
// kv v heads of d), their rotary tables cos, sin (rows cs_stride apart): rotates q and k (rotate-half convention:
// x * cos + rotate_half(x) * sin), writes q to `q` [n, heads, d] and k, v into the cache slots past..past + n - 1 of
// keys / values [kv, capacity, d] (float32, or float16: each value rounded to the nearest half, ties to even, as
// torch's copy rounds; F16C's conversion, 16 at a time, is that rounding). Each row alone.
void dv::rope_store(const float* src, int64_t width, const float* cos, const float* sin, int64_t cs_stride, int64_t n,
                    int64_t heads, const at::Tensor& keys, const at::Tensor& values, int64_t past, float* q) {
  const int64_t kv = keys.size(0), cap = keys.size(1), d = keys.size(2), half = d / 2;
  const bool fp16 = keys.scalar_type() == at::kHalf;
  void *const kp = keys.data_ptr(), *const vp = values.data_ptr();
  const auto put = [&](void* cache, int64_t g, int64_t slot, const float* x) {
    const int64_t offset = (g * cap + slot) * d;
    if (fp16) {
      uint16_t* to = static_cast<uint16_t*>(cache) + offset;
      for (int64_t j = 0; j < d; j += 16) V16::load(x + j).store_halves(to + j);
    } else {
      std::memcpy(static_cast<float*>(cache) + offset, x, d * sizeof(float));
    }
  };
  alignas(64) float k[256];  // one rotated key (d <= 256)
  for (int64_t i = 0; i < n; ++i) {
    const float* row = src + i * width;
    const float* c = cos + i * cs_stride;
    const float* sn = sin + i * cs_stride;
    for (int64_t h = 0; h < heads + kv; ++h) {  // q heads, then k heads: rotated
      const float* x = row + h * d;
      float* out = h < heads ? q + (i * heads + h) * d : k;
      int64_t j = 0;
      for (; j + 16 <= half; j += 16) {  // the scalar rule below, 16 lanes at a time (each product rounded, then summed)
        const V16 lo = V16::load(x + j), hi = V16::load(x + j + half);
        V16::sub(V16::mul(lo, V16::load(c + j)), V16::mul(hi, V16::load(sn + j))).store(out + j);
        V16::add(V16::mul(hi, V16::load(c + j + half)), V16::mul(lo, V16::load(sn + j + half))).store(out + j + half);
      }
      for (; j < half; ++j) {
        out[j] = x[j] * c[j] - x[j + half] * sn[j];
        out[j + half] = x[j + half] * c[j + half] + x[j] * sn[j + half];
      }
      if (h >= heads) put(kp, h - heads, past + i, out);
    }
    for (int64_t g = 0; g < kv; ++g) put(vp, g, past + i, row + (heads + kv + g) * d);
  }
}

// Checks rope_attention's arguments but the rotary tables' row count (before anything is written; `layer_many` checks
// each sequence's before its one parallel region): n rows of `width` floats of q/k/v, their rotary tables cos, sin
// [rows, d] (one stride), the cache, the mask [n, past + n] or empty.
void dv::check_rope(int64_t n, int64_t width, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                    const at::Tensor& values, int64_t past, int64_t heads, const at::Tensor& mask) {
  dv::check_cache(keys, values, heads, "rope_attention");
  const int64_t kv = keys.size(0), d = keys.size(2);
  TORCH_CHECK(width == (heads + 2 * kv) * d, "rope_attention: shapes");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == d && cos.stride(1) == 1 && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_attention: rotary tables");
  TORCH_CHECK(past + n <= keys.size(1), "rope_attention: cache too small");
  TORCH_CHECK(!mask.numel() || (mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 2 &&
                                mask.size(0) == n && mask.size(1) == past + n), "rope_attention: mask");
}

// qkv [n, (H + 2 kv) d]: a layer's fused q/k/v projection of n new tokens (float32, contiguous); cos, sin
// [n, d]: their rotary tables. Rotates q and k, stores k and v in the cache (`dv::rope_store`), and returns
// attention(q, keys, values, past + n, mask, scale) [n, H d]: one call for what is otherwise about ten
// small ops a layer. Each row is handled alone, as in `attention`.
at::Tensor rope_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                          int64_t past, int64_t heads, at::Tensor mask, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "rope_attention: qkv");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == qkv.size(0), "rope_attention: one rotary row per row of qkv");
  dv::check_rope(qkv.size(0), qkv.size(1), cos, sin, keys, values, past, heads, mask);
  const int64_t n = qkv.size(0);
  auto q = at::empty({n, heads, keys.size(2)}, qkv.options());
  dv::rope_store(qkv.data_ptr<float>(), qkv.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0), n, heads,
                 keys, values, past, q.data_ptr<float>());
  return attention(q, keys, values, past + n, mask, scale);
}
