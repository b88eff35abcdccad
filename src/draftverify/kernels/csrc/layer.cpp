// SiLU(gate) * up and one decoder layer of quantized products in one call.
#include <algorithm>
#include <numeric>

#include "ops.h"
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

std::vector<int64_t> dv::deal_sequences(const std::vector<int64_t>& ns, const std::vector<int64_t>& pasts, int64_t threads) {
  std::vector<int64_t> cost(ns.size());
  for (size_t j = 0; j < ns.size(); ++j) cost[j] = ns[j] * (pasts[j] + ns[j]);  // rows times the keys they read
  return deal(cost.data(), static_cast<int64_t>(ns.size()), threads);
}

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
  if (dv::q8_runs(qkv) && dv::q8_runs(o) && dv::q8_runs(gate_up) && dv::q8_runs(down)) {  // region.cpp
    TORCH_CHECK(keys[0].dim() == 3, "layer_many: the caches must be [kv, capacity, d]");
    const dv::LayerQ8 layer =
        dv::q8_layer(norm_in, norm_post, eps, scale, qkv, o, gate_up, down, h.size(-1), heads * keys[0].size(2));
    return dv::layers_region(h, &layer, 1, cos, sin, keys, values, firsts, ns, pasts, heads, masks, {});
  }
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
    const std::vector<int64_t> owner = dv::deal_sequences(ns, pasts, threads);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {  // one share per thread
      for (size_t j = 0; j < parts; ++j)
        if (owner[j] >= t0 && owner[j] < t1) attend(j);
    });
  }
  h = h + dv::quant_product(parts == 1 ? outs[0] : at::cat(outs), o);
  return h + dv::quant_product(silu_mul(dv::quant_product(rms_norm(h, norm_post, eps), gate_up)), down);
}
