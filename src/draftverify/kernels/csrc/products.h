// What the weight products share.
#pragma once
#include <cstdint>

namespace dv {
// How many output rows ahead a product asks for the weights (a software prefetch). A one-row product waits on the
// weight stream and a few rows' products on arithmetic; with the hardware prefetcher alone the two did not overlap.
// Why 16 rather than 8, 32 or 64: docs/backends.md, "What the static path does".
constexpr int64_t kAheadRows = 16;
}  // namespace dv
