// What the weight products share.
#pragma once
#include <cstdint>

namespace dv {
// How many output rows ahead a product asks for the weights (a software prefetch). A one-row product waits on the
// weight stream and a few rows' products on arithmetic; with the hardware prefetcher alone the two did not overlap.
// Measured on SmolLM2 (2-core Zen 5, forwards of 1-8 new tokens interleaved in one process): ~10% faster with 16 rows
// ahead; 8 and 32 alike, 64 slower.
constexpr int64_t kAheadRows = 16;
}  // namespace dv
