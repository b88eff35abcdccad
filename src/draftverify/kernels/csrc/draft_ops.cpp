// The ops only drafting uses: a feature head's layer input and the top-k of a head's logits.
#include "ops.h"
#include "simd.h"

using dv::V16;
using dv::exp_nonpositive;

// A feature head's layer input (feature_draft.FeatureDraft.inputs) in one call: fc([norm(features) ; norm(embed[tokens])])
// for features [n, H] and embed [V, H] float32, tokens [n] int64 and fc quantized ({q, d, m, bias}, as `layer` takes
// them). The same kernels as the op-by-op path (norm_row per row, a copy, quant_linear), so the same bits.
at::Tensor head_inputs(at::Tensor features, at::Tensor tokens, at::Tensor embed, at::Tensor w_feature,
                       at::Tensor w_embed, double eps, std::vector<at::Tensor> fc) {
  TORCH_CHECK(features.dim() == 2 && embed.dim() == 2 && features.size(1) == embed.size(1), "head_inputs: shapes");
  TORCH_CHECK(features.scalar_type() == at::kFloat && embed.scalar_type() == at::kFloat && w_feature.scalar_type() == at::kFloat &&
              w_embed.scalar_type() == at::kFloat, "head_inputs: float32 only");
  TORCH_CHECK(features.is_contiguous() && embed.is_contiguous() && w_feature.is_contiguous() && w_embed.is_contiguous() &&
              tokens.is_contiguous() && tokens.scalar_type() == at::kLong && tokens.numel() == features.size(0), "head_inputs: layout");
  const int64_t n = features.size(0), H = features.size(1), V = embed.size(0);
  auto x = at::empty({n, 2 * H}, features.options());
  const float *fp = features.data_ptr<float>(), *ep = embed.data_ptr<float>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < V, "head_inputs: token id out of range");
    dv::norm_row(fp + i * H, w_feature.data_ptr<float>(), xp + i * 2 * H, H, static_cast<float>(eps));
    dv::norm_row(ep + tp[i] * H, w_embed.data_ptr<float>(), xp + i * 2 * H + H, H, static_cast<float>(eps));
  }
  return dv::quant_product(x, fc);
}

// logits [n, N] float32 -> per row its k largest logits' positions j (ties: the lower j first) as vocab[j] (vocab [N]
// int64) and their probabilities under the softmax of the row's N logits. What a drafter asks of a head's logits each
// step, in one single-threaded pass over a few thousand floats instead of topk, logsumexp and their dispatch.
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_probs(at::Tensor logits, at::Tensor vocab, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "top_probs: logits must be [n, N] float32");
  const int64_t n = logits.size(0), N = logits.size(1);
  TORCH_CHECK(vocab.scalar_type() == at::kLong && vocab.is_contiguous() && vocab.numel() == N && k >= 1 && k <= N, "top_probs: vocab, k");
  const int64_t* ids = vocab.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> tokens(n, std::vector<int64_t>(k));
  std::vector<std::vector<double>> probs(n, std::vector<double>(k));
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.data_ptr<float>() + i * N;
    std::fill(best.begin(), best.end(), -INFINITY);
    std::fill(where.begin(), where.end(), 0);
    for (int64_t j = 0; j < N; ++j) {  // best[] descending; a value equal to a kept one goes after it
      const float v = row[j];
      if (!(v > best[k - 1])) continue;
      int64_t p = k - 1;
      for (; p > 0 && v > best[p - 1]; --p) {
        best[p] = best[p - 1];
        where[p] = where[p - 1];
      }
      best[p] = v;
      where[p] = j;
    }
    const float top = best[0];
    V16 acc = V16::zero();
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) acc = V16::add(acc, exp_nonpositive(V16::sub(V16::load(row + j), V16::set1(top))));
    float total = V16::sum(acc);
    for (; j < N; ++j) total += exp_nonpositive(row[j] - top);
    for (int64_t c = 0; c < k; ++c) {
      tokens[i][c] = ids[where[c]];
      probs[i][c] = exp_nonpositive(best[c] - top) / total;
    }
  }
  return {tokens, probs};
}
