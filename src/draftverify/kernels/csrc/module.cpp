// The one place the kernels' Python functions are registered (the compiled module's names and signatures).
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [M, 2 I] gate | up product, float32");
  m.def("layer", &layer, "one pre-norm decoder layer on quantized weights for a few rows, float32");
  py::class_<dv::LayerStack>(m, "LayerStack", "a forward's q8 layers, checked once; forward runs them all in one call")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>, std::vector<double>,
                    std::vector<std::vector<at::Tensor>>, std::vector<std::vector<at::Tensor>>,
                    std::vector<std::vector<at::Tensor>>, std::vector<std::vector<at::Tensor>>, int64_t, int64_t>())
      .def("forward", &dv::LayerStack::forward, "h through every layer, each sequence with its caches, float32");
  m.def("layer_many", &layer_many, "the same layer for several sequences' rows stacked, each with its own cache, float32");
  m.def("linear", &linear, "x @ w.T (+ bias) for one row, float32");
  m.def("quant_linear", &quant_linear, "x @ w.T (+ bias) with w in exact Q4_1 / Q8_0 blocks, float32");
  m.def("block_linear", &block_linear, "x @ w.T (+ bias) with w in a GGUF block layout (kernels/blocks.py), float32");
  m.def("q8_linear", &q8_linear, "x @ w.T (+ bias) in the q8 arithmetic: x rounded to int8 per 32, integer dot products with u4 / u8 block codes");
  m.def("q8_repack", &q8_repack, "a block weight's u4 / u8 codes placed in the q8 product's tiles of 16 outputs, into out");
  m.def("vnni", &vnni, "whether the q8 products were built with AVX-512 VNNI");
  m.def("attention", &attention, "softmax(q k^T * scale, masked) v per query row and head, float32");
  m.def("rope_attention", &rope_attention, "rotate q, k; store k, v in the cache; attention; float32");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row, float32");
  m.def("head_inputs", &head_inputs, "a feature head's fc([norm(features) ; norm(embed[tokens])]), fc quantized, float32");
  m.def("argmax_rows", &argmax_rows, "each row's argmax as torch.argmax gives it (first largest; a NaN row: its first NaN)");
  m.def("top_probs", &top_probs, "per row of logits the k largest as vocab ids and their softmax probabilities");
}
