// SiLU(gate) * up and one decoder layer of quantized products in one call.
#include <omp.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "ops.h"
#include "scratch.h"
#include "simd.h"

using dv::exp_nonpositive;

// silu(g) * u for rows [m0, m1) of gate_up [M, 2 I] (gate | up per row) into y [M, I]. silu(g) = g * sigmoid(g),
// the sigmoid from e^-|g| (exp_nonpositive), so every element is formed the same way on every path.
void dv::silu_rows(const float* gate_up, float* y, int64_t I, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float *g = gate_up + m * 2 * I, *u = g + I;
    float* out = y + m * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float x = g[i];
      const float t = exp_nonpositive(x < 0.0f ? x : -x);  // e^-|x|
      out[i] = x * ((x < 0.0f ? t : 1.0f) / (1.0f + t)) * u[i];
    }
  }
}

// gate_up [M, 2 I] float32 contiguous (gate | up per row) -> silu(gate) * up [M, I] (`dv::silu_rows`).
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [M, 2 I] float32");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = at::empty({M, I}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)),
                   [&](int64_t m0, int64_t m1) { dv::silu_rows(src, yp, I, m0, m1); });
  return y;
}

// A weight as the one-call layer takes it, either exact Q4_1 / Q8_0 blocks recovered from fp32 weights, {q, d, m
// (empty for Q8_0), bias (empty for none)} (quant_linear), or a file's weight (backend/linear.py BlockLinear
// `layer_weight`): runs fused along out, each {spec, codes, d, m} with spec int64 [product, layout, sub, out,
// centre] (product 0: block_linear, 1: q8_linear), then the bias (empty for none). Each run is the product the
// op-by-op path calls for it, the runs joined and the bias added as it joins and adds them, so the bits are the same.
at::Tensor dv::quant_product(const at::Tensor& x, const std::vector<at::Tensor>& w) {
  if (w.size() == 4) return quant_linear(x, w[0], w[1], w[2], w[3]);
  TORCH_CHECK(w.size() % 4 == 1, "layer: a weight is {q, d, m, bias} or runs of {spec, codes, d, m} then the bias");
  const auto none = at::empty({0}, x.options());
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i + 1 < w.size(); i += 4) {
    TORCH_CHECK(w[i].scalar_type() == at::kLong && w[i].numel() == 5, "layer: a run's spec is int64 [product, layout, sub, out, centre]");
    const int64_t* spec = w[i].data_ptr<int64_t>();
    outs.push_back(spec[0] == 0 ? block_linear(x, spec[1], spec[2], w[i + 1], w[i + 2], w[i + 3], none)
                                : q8_linear(x, spec[1], spec[2], spec[3], w[i + 1], w[i + 2], w[i + 3], spec[4], none));
  }
  at::Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  return w.back().numel() ? y + w.back() : y;
}

std::vector<int64_t> dv::deal(const int64_t* cost, int64_t n, int64_t threads) {
  std::vector<int64_t> owner(n, 0);
  if (threads <= 1) return owner;
  std::vector<int64_t> order(n), load(threads, 0);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  for (const int64_t j : order) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[j] = least;
    load[least] += cost[j];
  }
  return owner;
}

namespace {

// A weight of the one-call layer that is one q8 product (one run, product 1): the layer can run in one parallel
// region (`layer_region`).
bool one_q8_run(const std::vector<at::Tensor>& w) {
  return w.size() == 5 && w[0].scalar_type() == at::kLong && w[0].numel() == 5 && w[0].data_ptr<int64_t>()[0] == 1;
}

dv::Q8Weight q8_of(const std::vector<at::Tensor>& w, int64_t K) {
  const int64_t* spec = w[0].data_ptr<int64_t>();
  return dv::q8_weight(spec[1], spec[2], spec[3], w[1], w[2], w[3], spec[4], w[4], K);
}

// Rows [r0, r1) of n that thread t of T takes in a phase of rows.
std::pair<int64_t, int64_t> row_share(int64_t n, int64_t t, int64_t T) {
  const int64_t each = (n + T - 1) / T, r0 = std::min(n, t * each);
  return {r0, std::min(n, r0 + each)};
}

// `layer_many` when its four products are q8 products: the whole layer in one parallel region, its phases apart by
// barriers, instead of a region per product, attention and SiLU and the serial steps between them on one thread.
// At decoding sizes those regions' starts and joins, the serial rounding of each product's rows and the tensors made
// between them (allocations, views, additions) cost as much as the products (docs/backends.md). Every phase calls the
// kernels the op-by-op layer calls, each row and output formed alone, so the split between threads changes no bit.
at::Tensor layer_region(const at::Tensor& h, const at::Tensor& norm_in, const at::Tensor& norm_post, double eps,
                        const std::vector<std::vector<at::Tensor>>& weights, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                        const std::vector<int64_t>& firsts, const std::vector<int64_t>& ns,
                        const std::vector<int64_t>& pasts, int64_t heads, const std::vector<at::Tensor>& masks,
                        double scale) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat, "layer: h must be [n, H] float32, contiguous");
  const int64_t n = h.size(0), H = h.size(1), parts = static_cast<int64_t>(firsts.size());
  TORCH_CHECK(norm_in.scalar_type() == at::kFloat && norm_in.is_contiguous() && norm_in.numel() == H &&
                  norm_post.scalar_type() == at::kFloat && norm_post.is_contiguous() && norm_post.numel() == H,
              "layer: the norms' weights must be float32 [H]");
  const int64_t d = keys[0].size(2), width = (heads + 2 * keys[0].size(0)) * d, A = heads * d;
  const dv::Q8Weight wq = q8_of(weights[0], H), wo = q8_of(weights[1], A), wg = q8_of(weights[2], H);
  const int64_t I = wg.N / 2;
  const dv::Q8Weight wd = q8_of(weights[3], I);
  TORCH_CHECK(wq.N == width && wo.N == H && wg.N == 2 * I && wd.N == H, "layer: the products' sizes do not chain");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n, "layer: one rotary row per row of h");
  for (int64_t j = 0; j < parts; ++j) {  // every check before the region: nothing may throw inside it
    TORCH_CHECK(firsts[j] >= 0 && ns[j] > 0 && firsts[j] + ns[j] <= n, "layer_many: a sequence's rows lie outside h");
    TORCH_CHECK(keys[j].size(2) == d && keys[j].size(0) == keys[0].size(0), "layer_many: the caches' shapes differ");
    dv::check_rope(ns[j], width, cos, sin, keys[j], values[j], pasts[j], heads, masks[j]);
  }
  // this thread's scratch: the activations (normed rows, q/k/v, rotated q, attention, h after attention, normed
  // again, gate | up, SiLU, a product's output), then one product's rounded rows at a time (scales, sums as floats)
  const int64_t Kmax = std::max({H, A, I}), acts = n * (3 * H + width + 2 * A + 3 * I + H);
  float* const x1 = dv::scratch<float, dv::kLayerFloats>(acts + n * Kmax / 32 + n * Kmax / 16);
  float *const qkv = x1 + n * H, *const q = qkv + n * width, *const att = q + n * A, *const h2 = att + n * A;
  float *const x2 = h2 + n * H, *const gu = x2 + n * H, *const sl = gu + n * 2 * I, *const y = sl + n * I;
  float* const dx = x1 + acts;
  const dv::Q8Rows r8{dv::scratch<int8_t, dv::kLayerCodes>(n * Kmax), dx, dv::scratch<int32_t, dv::kLayerSums>(n * Kmax / 16),
                      dx + n * Kmax / 32};
  auto out = at::empty({n, H}, h.options());
  const float *const hp = h.data_ptr<float>(), *const cp = cos.data_ptr<float>(), *const sp = sin.data_ptr<float>();
  float* const op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t T = at::in_parallel_region() ? 1 : at::get_num_threads();
  // a batch's sequences: each attention whole on one thread, dealt out by cost (as the op-by-op path does)
  std::vector<int64_t> owner(parts, 0);
  if (parts > 1) {
    std::vector<int64_t> cost(parts);
    for (int64_t j = 0; j < parts; ++j) cost[j] = ns[j] * (pasts[j] + ns[j]);
    owner = dv::deal(cost.data(), parts, T);
  }
  const auto mask_of = [&](int64_t j) { return masks[j].numel() ? masks[j].data_ptr<bool>() : nullptr; };
  dv::AttentionPlan plan;  // one sequence's, made by thread 0
#pragma omp parallel num_threads(T)
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const auto [r0, r1] = row_share(n, t, threads);
    const auto product = [&](const dv::Q8Weight& w, float* result) {
#pragma omp barrier
      dv::q8_share(w, r8, n, result, t, threads);
#pragma omp barrier
    };
    for (int64_t r = r0; r < r1; ++r) dv::norm_row(hp + r * H, norm_in.data_ptr<float>(), x1 + r * H, H, e);
    dv::q8_round(wq, x1, r0, r1, r8);
    product(wq, qkv);
    if (parts == 1) {
      if (t == 0) {
        dv::rope_store(qkv, width, cp, sp, cos.stride(0), n, heads, keys[0], values[0], pasts[0], q);
        plan = dv::attention_plan(q, A, keys[0], values[0], n, heads, pasts[0] + n, mask_of(0), scale, att, threads);
      }
#pragma omp barrier
      if (t < plan.threads) dv::attention_run(plan, t, t + 1);
      if (plan.chunks > 1) {
#pragma omp barrier
        const auto [m0, m1] = row_share(n * heads, t, threads);
        dv::attention_merge(plan, m0, m1);
      }
    } else {
      for (int64_t j = 0; j < parts; ++j) {
        if (owner[j] != t) continue;
        const int64_t f = firsts[j];
        dv::rope_store(qkv + f * width, width, cp + f * cos.stride(0), sp + f * sin.stride(0), cos.stride(0), ns[j], heads,
                       keys[j], values[j], pasts[j], q + f * A);
        const dv::AttentionPlan p = dv::attention_plan(q + f * A, A, keys[j], values[j], ns[j], heads, pasts[j] + ns[j],
                                                       mask_of(j), scale, att + f * A, 1);
        dv::attention_run(p, 0, 1);
        if (p.chunks > 1) dv::attention_merge(p, 0, ns[j] * heads);
      }
    }
#pragma omp barrier
    dv::q8_round(wo, att, r0, r1, r8);
    product(wo, y);
    for (int64_t r = r0; r < r1; ++r) {  // the residual add, the second norm
      for (int64_t k = 0; k < H; ++k) h2[r * H + k] = hp[r * H + k] + y[r * H + k];
      dv::norm_row(h2 + r * H, norm_post.data_ptr<float>(), x2 + r * H, H, e);
    }
    dv::q8_round(wg, x2, r0, r1, r8);
    product(wg, gu);
    dv::silu_rows(gu, sl, I, r0, r1);
    dv::q8_round(wd, sl, r0, r1, r8);
    product(wd, y);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < H; ++k) op[r * H + k] = h2[r * H + k] + y[r * H + k];
  }
  return out;
}

}  // namespace

// One pre-norm decoder layer (Llama family, no q/k norms) for a few new rows h [n, H] of one sequence, every
// product quantized or a file's blocks (`dv::quant_product`): h + o(attention(rope(qkv(norm_in(h))))), then
// + down(silu_mul(gate_up(norm_post(.)))). The same kernels, in the same order, as the static path's op-by-op layer,
// so the result is the same to the bit; one call instead of about a dozen small ops and their dispatch, which
// dominate at decoding sizes. It is `layer_many` with one sequence.
at::Tensor layer(at::Tensor h, at::Tensor norm_in, at::Tensor norm_post, double eps, std::vector<at::Tensor> qkv,
                 std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, at::Tensor cos,
                 at::Tensor sin, at::Tensor keys, at::Tensor values, int64_t past, int64_t heads, at::Tensor mask, double scale) {
  return layer_many(h, norm_in, norm_post, eps, qkv, o, gate_up, down, cos, sin, {keys}, {values}, {0}, {h.size(0)}, {past}, heads,
                    {mask}, scale);
}

// The same layer for several sequences stacked row-wise (a batch of decoding steps or trees): sequence j owns rows
// [firsts[j], firsts[j] + ns[j]) of h, cos and sin, its cache (keys[j], values[j], past[j]) and its mask (empty: none).
// The products run once over every row (each row's product is that row's own: the weights are row-invariant), the
// attention per sequence, as the op-by-op path's `Spans` and `attend` do, so each sequence gets its own bits.
at::Tensor layer_many(at::Tensor h, at::Tensor norm_in, at::Tensor norm_post, double eps, std::vector<at::Tensor> qkv,
                      std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                      at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                      std::vector<int64_t> firsts, std::vector<int64_t> ns, std::vector<int64_t> pasts, int64_t heads,
                      std::vector<at::Tensor> masks, double scale) {
  const size_t parts = firsts.size();
  TORCH_CHECK(parts && ns.size() == parts && pasts.size() == parts && keys.size() == parts && values.size() == parts &&
                  masks.size() == parts, "layer_many: one first, n, past, cache and mask per sequence");
  if (one_q8_run(qkv) && one_q8_run(o) && one_q8_run(gate_up) && one_q8_run(down))
    return layer_region(h, norm_in, norm_post, eps, {qkv, o, gate_up, down}, cos, sin, keys, values, firsts, ns, pasts,
                        heads, masks, scale);
  const auto projected = dv::quant_product(rms_norm(h, norm_in, eps), qkv);
  std::vector<at::Tensor> outs(parts);
  const auto attend = [&](size_t j) {
    const auto rows = [&](const at::Tensor& t) { return t.narrow(0, firsts[j], ns[j]); };
    outs[j] = rope_attention(rows(projected), rows(cos), rows(sin), keys[j], values[j], pasts[j], heads, masks[j], scale);
  };
  if (parts == 1) {
    attend(0);  // its own parallel region: a region around it would run it on one thread (ParallelGuard)
  } else {
    // The sequences' attentions share one parallel region (each runs whole on its thread: an attention's result
    // does not depend on how its tasks are split or which thread runs them), rather than one short region each.
    // A sequence costs about its rows times the keys they read, and a batch's contexts differ widely, so the
    // sequences are dealt out costliest first, each to the thread with the least work so far: split by count, one
    // thread could get the long contexts while the other waits.
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(parts));
    std::vector<int64_t> cost(parts);
    for (size_t j = 0; j < parts; ++j) cost[j] = ns[j] * (pasts[j] + ns[j]);
    const std::vector<int64_t> owner = dv::deal(cost.data(), static_cast<int64_t>(parts), threads);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {  // one share per thread
      for (size_t j = 0; j < parts; ++j)
        if (owner[j] >= t0 && owner[j] < t1) attend(j);
    });
  }
  h = h + dv::quant_product(parts == 1 ? outs[0] : at::cat(outs), o);
  return h + dv::quant_product(silu_mul(dv::quant_product(rms_norm(h, norm_post, eps), gate_up)), down);
}
