// Decoder layers of q8 products in one parallel region: one layer (`layer_many`'s q8 case) or a whole stack of them
// (`LayerStack::forward`, a forward's every layer in one call).
//
// At decoding sizes a layer's work is small next to what surrounds it when each product, attention and SiLU opens a
// parallel region of its own: the regions' starts and joins, the serial rounding of each product's rows, the tensors
// made between them (outputs, views, a concatenation, additions), and, once a layer, the call from Python and the
// conversion of its ~26 tensors. Here the threads enter one region and go through the phases of every layer apart
// by barriers: RMSNorm and each product's rounding of its rows shared out by rows; each product by pairs of tiles
// (`dv::q8_share`); the rotation, cache writes and attention's plan on one thread, then attention's tasks as the plan
// deals them (in a stacked forward, each sequence's whole attention on the thread it is dealt to); SiLU(gate) * up and
// the residual adds by rows. A thread keeps the same rows from a layer's last phase to the next layer's first, so
// no barrier is needed there. Each phase calls the functions the op-by-op layer calls, each row and output formed
// alone, so the split between threads changes no bit (tests/test_q8_engine.py).
#include <omp.h>

#include <algorithm>
#include <utility>

#include "ops.h"
#include "scratch.h"

namespace {

// A one-call layer's weight ({spec, codes, d, m} a run, then the bias) as a product of q8 runs of K inputs.
dv::Q8Product q8_of(const std::vector<at::Tensor>& w, int64_t K) {
  dv::Q8Product p{};
  p.count = static_cast<int>(w.size() / 4), p.K = K;
  TORCH_CHECK(p.count <= dv::kMaxRuns, "layer: at most ", dv::kMaxRuns, " runs of blocks a weight");
  for (int r = 0; r < p.count; ++r) {
    const int64_t* spec = w[4 * r].data_ptr<int64_t>();
    p.runs[r] = dv::q8_weight(spec[1], spec[2], spec[3], w[4 * r + 1], w[4 * r + 2], w[4 * r + 3], spec[4], at::Tensor(), K);  // bias: below
    p.col[r] = p.N, p.N += spec[3];
  }
  const at::Tensor& bias = w.back();  // added to each run's columns as it stores them: the same fp32 add
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == p.N), "layer: bias");
  for (int r = 0; bias.numel() && r < p.count; ++r) p.runs[r].bias = bias.data_ptr<float>() + p.col[r];
  return p;
}

// Rows [r0, r1) of n that thread t of T takes in a phase of rows.
std::pair<int64_t, int64_t> row_share(int64_t n, int64_t t, int64_t T) {
  const int64_t each = (n + T - 1) / T, r0 = std::min(n, t * each);
  return {r0, std::min(n, r0 + each)};
}

// What layers_region runs over: h's rows and widths (I: the widest MLP), the sequences, their rotary rows and masks
// (null: none), its threads T and which of them runs each sequence's attention (`owner`, for several sequences).
struct Region {
  int64_t n, H, parts, d, width, A, I, heads;
  const float *cp, *sp;
  int64_t cs_stride, ss_stride;
  const std::vector<int64_t>&firsts, &ns, &pasts;
  std::vector<const bool*> mask;
  int64_t T;
  std::vector<int64_t> owner;
};

// layers_region's Region, every check made before the region (nothing may throw inside it).
Region region_of(const at::Tensor& h, const dv::LayerQ8* layers, int64_t L, const at::Tensor& cos,
                 const at::Tensor& sin, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                 const std::vector<int64_t>& firsts, const std::vector<int64_t>& ns, const std::vector<int64_t>& pasts,
                 int64_t heads, const std::vector<at::Tensor>& masks, const std::vector<int64_t>& skips) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat, "layer: h must be [n, H] float32, contiguous");
  const int64_t n = h.size(0), H = h.size(1), parts = static_cast<int64_t>(firsts.size());
  TORCH_CHECK(L > 0 && parts > 0 && ns.size() == firsts.size() && pasts.size() == firsts.size() &&
                  masks.size() == firsts.size() && static_cast<int64_t>(keys.size()) == L * parts &&
                  values.size() == keys.size() && (skips.empty() || static_cast<int64_t>(skips.size()) == L),
              "layer: one first, n, past and mask a sequence, a cache a layer and sequence, none or one skip a layer");
  const int64_t d = keys[0].size(2), width = (heads + 2 * keys[0].size(0)) * d, A = heads * d;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n, "layer: one rotary row per row of h");
  int64_t I = 0;
  for (int64_t l = 0; l < L; ++l) {  // every check before the region: nothing may throw inside it
    const dv::LayerQ8& w = layers[l];
    TORCH_CHECK(w.wq.N == width && w.wq.K == H && w.wo.K == A && w.wo.N == H, "layer: the weights do not fit h and the caches");
    I = std::max(I, w.wg.N / 2);
    for (int64_t j = 0; j < parts; ++j) {
      const at::Tensor &k = keys[l * parts + j], &v = values[l * parts + j];
      TORCH_CHECK(firsts[j] >= 0 && ns[j] > 0 && firsts[j] + ns[j] <= n, "layer: a sequence's rows lie outside h");
      TORCH_CHECK(k.dim() == 3 && k.size(2) == d && k.size(0) == keys[0].size(0), "layer: the caches' shapes differ");
      dv::check_rope(ns[j], width, cos, sin, k, v, pasts[j], heads, masks[j]);
    }
  }
  std::vector<const bool*> mask(parts);
  for (int64_t j = 0; j < parts; ++j) mask[j] = masks[j].numel() ? masks[j].data_ptr<bool>() : nullptr;
  const int64_t T = at::in_parallel_region() ? 1 : at::get_num_threads();
  // a batch's sequences: each attention whole on one thread, dealt out by cost (as the op-by-op path does)
  std::vector<int64_t> owner = dv::deal_sequences(ns, pasts, parts > 1 ? T : 1);
  return Region{n, H, parts, d, width, A, I, heads, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0),
                sin.stride(0), firsts, ns, pasts, std::move(mask), T, std::move(owner)};
}

// The region's buffers (this thread's scratch, shared by the region's threads): the activations (normed rows,
// q/k/v, rotated q, attention, h after attention, normed again, gate | up, SiLU, a product's output), then one
// product's rounded rows at a time (scales, sums as floats), a run's each: a product's runs each round the rows for
// themselves (their sums depend on the run's sub-blocks and centre).
struct Buffers {
  float *x1, *qkv, *q, *att, *h2, *x2, *gu, *sl, *y;
  dv::Q8Rows r8[dv::kMaxRuns];

  Buffers(int64_t n, int64_t H, int64_t width, int64_t A, int64_t I) {
    const int64_t Kmax = std::max({H, A, I}), acts = n * (3 * H + width + 2 * A + 3 * I + H);
    x1 = dv::scratch<float, dv::kLayerFloats>(acts);
    qkv = x1 + n * H, q = qkv + n * width, att = q + n * A, h2 = att + n * A;
    x2 = h2 + n * H, gu = x2 + n * H, sl = gu + n * 2 * I, y = sl + n * I;
    const int64_t codes = n * Kmax, scales = n * Kmax / 32, sums = n * Kmax / 16;
    float* const dx = dv::scratch<float, dv::kLayerScales>(dv::kMaxRuns * (scales + sums));
    int8_t* const qx = dv::scratch<int8_t, dv::kLayerCodes>(dv::kMaxRuns * codes);
    int32_t* const sx = dv::scratch<int32_t, dv::kLayerSums>(dv::kMaxRuns * sums);
    for (int k = 0; k < dv::kMaxRuns; ++k)
      r8[k] = {qx + k * codes, dx + k * (scales + sums), sx + k * sums, dx + k * (scales + sums) + scales};
  }
};

// A layer's attention inside the region, on thread t of `threads` (q/k/v in b.qkv -> b.att): one sequence's
// rotation, cache writes and plan on thread 0, then its tasks as the plan deals them (and the merge by rows); several
// sequences', each whole on the thread `owner` deals it to.
void region_attention(const Region& g, const Buffers& b, const dv::LayerQ8& w, const at::Tensor* ks,
                      const at::Tensor* vs, dv::AttentionPlan& plan, int64_t t, int64_t threads) {
  const int64_t n = g.n, width = g.width, A = g.A, heads = g.heads;
  if (g.parts == 1) {
    if (t == 0) {
      dv::rope_store(b.qkv, width, g.cp, g.sp, g.cs_stride, n, heads, ks[0], vs[0], g.pasts[0], b.q);
      plan = dv::attention_plan(b.q, A, ks[0], vs[0], n, heads, g.pasts[0] + n, g.mask[0], w.scale, b.att, threads);
    }
#pragma omp barrier
    if (t < plan.threads) dv::attention_run(plan, t, t + 1);
    if (plan.chunks > 1) {
#pragma omp barrier
      const auto [m0, m1] = row_share(n * heads, t, threads);
      dv::attention_merge(plan, m0, m1);
    }
    return;
  }
  for (int64_t j = 0; j < g.parts; ++j) {
    if (g.owner[j] != t) continue;
    const int64_t f = g.firsts[j];
    dv::rope_store(b.qkv + f * width, width, g.cp + f * g.cs_stride, g.sp + f * g.ss_stride, g.cs_stride, g.ns[j],
                   heads, ks[j], vs[j], g.pasts[j], b.q + f * A);
    const dv::AttentionPlan p = dv::attention_plan(b.q + f * A, A, ks[j], vs[j], g.ns[j], heads, g.pasts[j] + g.ns[j],
                                                   g.mask[j], w.scale, b.att + f * A, 1);
    dv::attention_run(p, 0, 1);
    if (p.chunks > 1) dv::attention_merge(p, 0, g.ns[j] * heads);
  }
}

}  // namespace

bool dv::q8_runs(
const std::vector<at::Tensor>& w) {
  if (w.size() % 4 != 1 || w.size() / 4 > kMaxRuns) return false;
  for (size_t i = 0; i + 1 < w.size(); i += 4)
    if (w[i].scalar_type() != at::kLong || w[i].numel() != 5 || w[i].data_ptr<int64_t>()[0] != 1) return false;
  return true;
}

// One layer's weights, checked (H features in and out, A = heads x head dim the attention's width).
dv::LayerQ8 dv::q8_layer(const at::Tensor& norm_in, const at::Tensor& norm_post, double eps, double scale,
                         const std::vector<at::Tensor>& qkv, const std::vector<at::Tensor>& o,
                         const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, int64_t H,
                         int64_t A) {
  TORCH_CHECK(q8_runs(qkv) && q8_runs(o) && q8_runs(gate_up) && q8_runs(down), "layer: every product must be q8 runs");
  TORCH_CHECK(norm_in.scalar_type() == at::kFloat && norm_in.is_contiguous() && norm_in.numel() == H &&
                  norm_post.scalar_type() == at::kFloat && norm_post.is_contiguous() && norm_post.numel() == H,
              "layer: the norms' weights must be float32 [H]");
  LayerQ8 l;
  l.norm_in = norm_in.data_ptr<float>(), l.norm_post = norm_post.data_ptr<float>();
  l.eps = static_cast<float>(eps), l.scale = scale;
  l.wq = q8_of(qkv, H), l.wo = q8_of(o, A), l.wg = q8_of(gate_up, H);
  l.wd = q8_of(down, l.wg.N / 2);
  TORCH_CHECK(l.wo.N == H && l.wg.N % 2 == 0 && l.wd.N == H, "layer: the products' sizes do not chain");
  return l;
}

// h [n, H] through layers[0..L) (each `q8_layer`), sequence j owning rows [firsts[j], firsts[j] + ns[j]) of h, cos
// and sin, its mask (empty: none) and in layer l the cache keys[l * parts + j], values[...] with pasts[j] tokens;
// skips: none, or a layer's sub-layers left out (kSkipAttention | kSkipMlp: a layer-skipping draft's).
at::Tensor dv::layers_region(const at::Tensor& h, const LayerQ8* layers, int64_t L, const at::Tensor& cos,
                             const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                             const std::vector<at::Tensor>& values, const std::vector<int64_t>& firsts,
                             const std::vector<int64_t>& ns, const std::vector<int64_t>& pasts, int64_t heads,
                             const std::vector<at::Tensor>& masks, const std::vector<int64_t>& skips) {
  const Region g = region_of(h, layers, L, cos, sin, keys, values, firsts, ns, pasts, heads, masks, skips);
  const int64_t n = g.n, H = g.H;
  const Buffers b(n, H, g.width, g.A, g.I);
  auto out = at::empty({n, H}, h.options());
  float* const op = out.data_ptr<float>();
  dv::AttentionPlan plan;  // one sequence's, made by thread 0 each layer
#pragma omp parallel num_threads(g.T)
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const auto [r0, r1] = row_share(n, t, threads);
    const auto round = [&](const dv::Q8Product& p, const float* x) {  // this thread's rows, for every run
      for (int k = 0; k < p.count; ++k) dv::q8_round(p.runs[k], x, r0, r1, b.r8[k]);
    };
    const auto product = [&](const dv::Q8Product& p, float* result) {  // every run's share of this thread
#pragma omp barrier
      for (int k = 0; k < p.count; ++k) dv::q8_share(p.runs[k], b.r8[k], n, result + p.col[k], p.N, t, threads);
#pragma omp barrier
    };
    for (int64_t l = 0; l < L; ++l) {
      const LayerQ8& w = layers[l];
      const at::Tensor *const ks = keys.data() + l * g.parts, *const vs = values.data() + l * g.parts;
      const float* const hp = l == 0 ? h.data_ptr<float>() : op;  // later layers: in place, a thread its own rows
      const int64_t skip = skips.empty() ? 0 : skips[l];
      if (skip & kSkipAttention) {  // the sub-layer adds nothing and stores no key (as the op-by-op layer skips it)
        std::copy(hp + r0 * H, hp + r1 * H, b.h2 + r0 * H);
      } else {
        for (int64_t r = r0; r < r1; ++r) dv::norm_row(hp + r * H, w.norm_in, b.x1 + r * H, H, w.eps);
        round(w.wq, b.x1);
        product(w.wq, b.qkv);
        region_attention(g, b, w, ks, vs, plan, t, threads);
#pragma omp barrier
        round(w.wo, b.att);
        product(w.wo, b.y);
        for (int64_t r = r0; r < r1; ++r)  // the residual add
          for (int64_t k = 0; k < H; ++k) b.h2[r * H + k] = hp[r * H + k] + b.y[r * H + k];
      }
      if (skip & kSkipMlp) {
        std::copy(b.h2 + r0 * H, b.h2 + r1 * H, op + r0 * H);
        continue;
      }
      for (int64_t r = r0; r < r1; ++r) dv::norm_row(b.h2 + r * H, w.norm_post, b.x2 + r * H, H, w.eps);
      round(w.wg, b.x2);
      product(w.wg, b.gu);
      const int64_t Il = w.wg.N / 2;  // (gate | up and SiLU rows Il wide, at most I)
      dv::silu_rows(b.gu, b.sl, Il, r0, r1);
      round(w.wd, b.sl);
      product(w.wd, b.y);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t k = 0; k < H; ++k) op[r * H + k] = b.h2[r * H + k] + b.y[r * H + k];
    }
  }
  return out;
}

// A forward's layers, checked once (`q8_layer`); `forward` runs them all in one region (`layers_region`).
dv::LayerStack::LayerStack(std::vector<at::Tensor> norms_in, std::vector<at::Tensor> norms_post, std::vector<double> eps,
                           std::vector<double> scales, std::vector<std::vector<at::Tensor>> qkv,
                           std::vector<std::vector<at::Tensor>> o, std::vector<std::vector<at::Tensor>> gate_up,
                           std::vector<std::vector<at::Tensor>> down, int64_t heads, int64_t head_dim) {
  const size_t L = norms_in.size();
  TORCH_CHECK(L > 0 && norms_post.size() == L && eps.size() == L && scales.size() == L && qkv.size() == L &&
                  o.size() == L && gate_up.size() == L && down.size() == L, "LayerStack: one of each a layer");
  const int64_t H = norms_in[0].numel();
  for (size_t l = 0; l < L; ++l) {
    layers_.push_back(q8_layer(norms_in[l], norms_post[l], eps[l], scales[l], qkv[l], o[l], gate_up[l], down[l], H,
                               heads * head_dim));
    for (const auto* group : {&qkv[l], &o[l], &gate_up[l], &down[l]}) keep_.insert(keep_.end(), group->begin(), group->end());
    keep_.push_back(norms_in[l]), keep_.push_back(norms_post[l]);
  }
  heads_ = heads;
}

at::Tensor dv::LayerStack::forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                                   std::vector<at::Tensor> values, std::vector<int64_t> firsts, std::vector<int64_t> ns,
                                   std::vector<int64_t> pasts, std::vector<at::Tensor> masks, std::vector<int64_t> skips) {
  return layers_region(h, layers_.data(), static_cast<int64_t>(layers_.size()), cos, sin, keys, values, firsts, ns, pasts,
                       heads_, masks, skips);
}
