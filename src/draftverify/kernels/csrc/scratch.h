// Per-thread scratch memory for a kernel's temporaries (rounded activations, attention's partials and chunk
// bounds): kept from call to call rather than allocated (and zero-filled) each time; at decoding sizes the
// allocations cost more than the work they hold.
#pragma once
#include <cstddef>
#include <memory>

namespace dv {

// The temporaries that can be live at once on one thread, one buffer each.
enum Scratch {
  kRoundedX, kRowScales, kRowSums, kRowSumsF,                   // q8_linear's rounded rows
  kChunkBounds, kChunkCounts, kTasks, kTops, kTotals, kAccs,  // attention's plan and partials
  kLayerFloats, kLayerCodes, kLayerSums, kLayerScales,        // a layer's activations and rounded rows (region.cpp)
};

// A buffer up to this size stays for the next call; a larger one (a long prefill's) is given back when a later
// call needs less, so that a thread holds little between calls.
constexpr size_t kScratchKeep = size_t{4} << 20;

// n Ts, not initialised, from this thread's buffer `Slot`; valid until the next call for the same slot on this thread.
template <typename T, Scratch Slot>
T* scratch(size_t n) {
  thread_local std::unique_ptr<T[]> buffer;
  thread_local size_t size = 0;
  if (n > size || (size * sizeof(T) > kScratchKeep && n * sizeof(T) <= kScratchKeep)) {
    buffer.reset();  // the old one first: never both at once
    buffer.reset(new T[n]);
    size = n;
  }
  return buffer.get();
}

}  // namespace dv
