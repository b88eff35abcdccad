// The kernels' entry points, one declaration per op, grouped by the file that defines each; module.cpp registers them.
#pragma once
// The kernels need ATen's tensor and the few ops below; only module.cpp includes torch/extension.h (pybind11, the
// whole C++ API), whose parsing alone takes most of a source's compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/TensorOperators.h>

#include <tuple>
#include <vector>

namespace dv {
// norms.cpp: y = w * (x / sqrt(mean(x^2) + eps)) for one row of H floats (shared by rms_norm and head_inputs).
void norm_row(const float* x, const float* w, float* y, int64_t H, float eps);
// layer.cpp: a quantized weight {q, d, m, bias} as `layer` and `head_inputs` take it, times x (quant_linear).
at::Tensor quant_product(const at::Tensor& x, const std::vector<at::Tensor>& w);
// layer.cpp: the thread (0..threads-1) of each of n pieces of work of these costs, dealt out costliest first (ties in
// order), each to the thread with the least cost so far (a batch's sequences, attention's tasks).
std::vector<int64_t> deal(const int64_t* cost, int64_t n, int64_t threads);
// layer.cpp: a batch's sequences dealt out so (`deal`), each costing its rows times the keys they read
std::vector<int64_t> deal_sequences(const std::vector<int64_t>& ns, const std::vector<int64_t>& pasts, int64_t threads);

// products_q8.cpp: one q8 product's weight (checked, as q8_linear takes it) and room for its rounded rows, so that a
// layer's products can run in shares inside one parallel region (layer.cpp): rows rounded by `q8_round` (any split
// of the rows), then every output by `q8_share` (any split of the shares): the bits of q8_linear.
struct Q8Weight {
  int64_t layout, sub, N, K, centre;
  const uint8_t* codes;
  const void *d, *m;  // float, or fp16 where `half`
  bool half;
  const float* bias;  // or null
};
struct Q8Rows {  // for M rows of K: int8 codes [M, K], scales [M, K / 32], sums [M, K / sub] and as floats
  int8_t* qx;
  float* dx;
  int32_t* sx;
  float* sxf;
};
Q8Weight q8_weight(int64_t layout, int64_t sub, int64_t N, const at::Tensor& codes, const at::Tensor& d,
                   const at::Tensor& m, int64_t centre, const at::Tensor& bias, int64_t K);
void q8_round(const Q8Weight& w, const float* x, int64_t r0, int64_t r1, const Q8Rows& rows);
void q8_share(const Q8Weight& w, const Q8Rows& rows, int64_t M, float* y, int64_t ldy, int64_t share, int64_t shares);

// attention.cpp: one attention call's plan, which its threads share (`attention_plan`), then each thread's tasks
// (`attention_run`) and the merge of the rows' chunks, in any split of the (row, head) pairs (`attention_merge`).
struct AttentionPlan {
  const float* q;
  int64_t row_stride;
  const char *keys, *values;
  int64_t item;
  bool half;
  const bool* mask;  // or null
  float* out;
  int64_t n, H, S, kv, cap, d, group;
  float scale;
  int64_t stride, chunks, row_blocks, tasks, threads;
  int64_t *bounds, *ends;
  float *tops, *totals, *accs;
  std::vector<int64_t> owner;
};
AttentionPlan attention_plan(const float* q, int64_t row_stride, const at::Tensor& keys, const at::Tensor& values,
                             int64_t n, int64_t H, int64_t S, const bool* mask, double scale, float* out, int64_t threads);
void attention_run(const AttentionPlan& p, int64_t m0, int64_t m1);
void attention_merge(const AttentionPlan& p, int64_t r0, int64_t r1);
void check_cache(const at::Tensor& keys, const at::Tensor& values, int64_t heads, const char* op);
// rope.cpp: rope_attention's checks, and the rotation and cache writes of new rows (before their attention)
void check_rope(int64_t n, int64_t width, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                const at::Tensor& values, int64_t past, int64_t heads, const at::Tensor& mask);
void rope_store(const float* src, int64_t width, const float* cos, const float* sin, int64_t cs_stride, int64_t n,
                int64_t heads, const at::Tensor& keys, const at::Tensor& values, int64_t past, float* q);
// layer.cpp: silu(gate) * up of rows [m0, m1) of gate_up [M, 2 I] into y [M, I]
void silu_rows(const float* gate_up, float* y, int64_t I, int64_t m0, int64_t m1);

// region.cpp: layers of q8 products in one parallel region. A layer's weights, checked once (`q8_layer`: its four
// products each runs of q8 weights, `q8_runs`); `layers_region` runs L of them over h; `LayerStack` holds a forward's
// layers so that one call runs them all.
constexpr int kMaxRuns = 4;
struct Q8Product {  // runs of q8 weights fused along the outputs (a K-quant file's q|k and v), each from column col
  Q8Weight runs[kMaxRuns];
  int64_t col[kMaxRuns];
  int count;
  int64_t N, K;
};
struct LayerQ8 {
  const float *norm_in, *norm_post;
  float eps;
  double scale;
  Q8Product wq, wo, wg, wd;
};
bool q8_runs(const std::vector<at::Tensor>& w);
LayerQ8 q8_layer(const at::Tensor& norm_in, const at::Tensor& norm_post, double eps, double scale,
                 const std::vector<at::Tensor>& qkv, const std::vector<at::Tensor>& o,
                 const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, int64_t H, int64_t A);
at::Tensor layers_region(const at::Tensor& h, const LayerQ8* layers, int64_t L, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                         const std::vector<int64_t>& firsts, const std::vector<int64_t>& ns,
                         const std::vector<int64_t>& pasts, int64_t heads, const std::vector<at::Tensor>& masks,
                         const std::vector<int64_t>& skips);
// a layer's skips (`layers_region`, `LayerStack::forward`: none, or one a layer): the sub-layers a draft leaves out
constexpr int64_t kSkipAttention = 1, kSkipMlp = 2;
class LayerStack {
 public:
  LayerStack(std::vector<at::Tensor> norms_in, std::vector<at::Tensor> norms_post, std::vector<double> eps,
             std::vector<double> scales, std::vector<std::vector<at::Tensor>> qkv, std::vector<std::vector<at::Tensor>> o,
             std::vector<std::vector<at::Tensor>> gate_up, std::vector<std::vector<at::Tensor>> down, int64_t heads,
             int64_t head_dim);
  // keys, values: layer-major, a cache a layer and sequence (keys[l * sequences + j]); the rest as `layer_many`'s
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, std::vector<int64_t> firsts, std::vector<int64_t> ns,
                     std::vector<int64_t> pasts, std::vector<at::Tensor> masks, std::vector<int64_t> skips);

 private:
  std::vector<LayerQ8> layers_;
  std::vector<at::Tensor> keep_;  // the tensors layers_ points into
  int64_t heads_ = 0;
};
}  // namespace dv

// argmax.cpp
std::vector<int64_t> argmax_rows(at::Tensor logits);
// products_fp32.cpp
at::Tensor linear(at::Tensor x, at::Tensor w, at::Tensor bias);
// products_q4q8.cpp
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, at::Tensor bias);
// norms.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
// attention.cpp
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t S, at::Tensor mask, double scale);
// rope.cpp
at::Tensor rope_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                          int64_t past, int64_t heads, at::Tensor mask, double scale);
// layer.cpp
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor layer(at::Tensor h, at::Tensor norm_in, at::Tensor norm_post, double eps, std::vector<at::Tensor> qkv,
                 std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, at::Tensor cos,
                 at::Tensor sin, at::Tensor keys, at::Tensor values, int64_t past, int64_t heads, at::Tensor mask, double scale);
at::Tensor layer_many(at::Tensor h, at::Tensor norm_in, at::Tensor norm_post, double eps, std::vector<at::Tensor> qkv,
                      std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                      at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                      std::vector<int64_t> firsts, std::vector<int64_t> ns, std::vector<int64_t> pasts, int64_t heads,
                      std::vector<at::Tensor> masks, double scale);
// draft_ops.cpp
at::Tensor head_inputs(at::Tensor features, at::Tensor tokens, at::Tensor embed, at::Tensor w_feature,
                       at::Tensor w_embed, double eps, std::vector<at::Tensor> fc);
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_probs(at::Tensor logits, at::Tensor vocab,
                                                                                          int64_t k);
// products_blocks.cpp: the GGUF block layouts (kernels/blocks.py packs them)
at::Tensor block_linear(at::Tensor x, int64_t layout, int64_t sub, at::Tensor codes, at::Tensor d, at::Tensor m,
                        at::Tensor bias);
// products_q8.cpp: the q8 arithmetic over u4 / u8 codes in tiles of 16 outputs (kernels/q8.py prepare)
at::Tensor q8_linear(at::Tensor x, int64_t layout, int64_t sub, int64_t N, at::Tensor codes, at::Tensor d,
                     at::Tensor m, int64_t centre, at::Tensor bias);
void q8_repack(at::Tensor codes, int64_t from, int64_t layout, int64_t N, int64_t K, at::Tensor out);
bool vnni();
