// The kernels' entry points, one declaration per op, grouped by the file that defines each; module.cpp registers them.
#pragma once
#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace dv {
// norms.cpp: y = w * (x / sqrt(mean(x^2) + eps)) for one row of H floats (shared by rms_norm and head_inputs).
void norm_row(const float* x, const float* w, float* y, int64_t H, float eps);
// layer.cpp: a quantized weight {q, d, m, bias} as `layer` and `head_inputs` take it, times x (quant_linear).
torch::Tensor quant_product(const torch::Tensor& x, const std::vector<torch::Tensor>& w);
}  // namespace dv

// argmax.cpp
std::vector<int64_t> argmax_rows(torch::Tensor logits);
// products_fp32.cpp
torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias);
// products_q4q8.cpp
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m, torch::Tensor bias);
// norms.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
// attention.cpp
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t S, torch::Tensor mask, double scale);
torch::Tensor rope_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values,
                             int64_t past, int64_t heads, torch::Tensor mask, double scale);
// layer.cpp
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor layer(torch::Tensor h, torch::Tensor norm_in, torch::Tensor norm_post, double eps, std::vector<torch::Tensor> qkv,
                    std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, torch::Tensor cos,
                    torch::Tensor sin, torch::Tensor keys, torch::Tensor values, int64_t past, int64_t heads, torch::Tensor mask, double scale);
torch::Tensor layer_many(torch::Tensor h, torch::Tensor norm_in, torch::Tensor norm_post, double eps, std::vector<torch::Tensor> qkv,
                         std::vector<torch::Tensor> o, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                         torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                         std::vector<int64_t> firsts, std::vector<int64_t> ns, std::vector<int64_t> pasts, int64_t heads,
                         std::vector<torch::Tensor> masks, double scale);
// draft_ops.cpp
torch::Tensor head_inputs(torch::Tensor features, torch::Tensor tokens, torch::Tensor embed, torch::Tensor w_feature,
                          torch::Tensor w_embed, double eps, std::vector<torch::Tensor> fc);
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_probs(torch::Tensor logits, torch::Tensor vocab,
                                                                                          int64_t k);
// products_blocks.cpp: the GGUF block layouts (kernels/blocks.py packs them)
torch::Tensor block_linear(torch::Tensor x, int64_t layout, int64_t sub, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                           torch::Tensor bias);
// products_q8.cpp: the q8 arithmetic over u4 / u8 codes in tiles of 16 outputs (kernels/q8.py prepare)
torch::Tensor q8_linear(torch::Tensor x, int64_t layout, int64_t sub, int64_t N, torch::Tensor codes, torch::Tensor d,
                        torch::Tensor m, int64_t centre, torch::Tensor bias);
void q8_repack(torch::Tensor codes, int64_t from, int64_t layout, int64_t N, int64_t K, torch::Tensor out);
bool vnni();
