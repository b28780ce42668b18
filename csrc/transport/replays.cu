// Replay marks (csrc/transport/replays.h).
#include "transport/replays.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

#include "kernels.h"
#include "transport/completions.h"

namespace tide::replays {
namespace {

constexpr int kMaxDevices = 64;

struct Marks {
  std::once_flag allocated;
  uint32_t* host = nullptr;  // kMarks (active, done) pairs
  uint32_t* dev = nullptr;   // their device address
  std::atomic<int64_t> claimed{0};
};

Marks& marks(int64_t device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "tide.replays: device ", num(device), " out of range");
  static Marks all[kMaxDevices];
  Marks& m = all[device];
  std::call_once(m.allocated, [&] {
    const completions::MappedWords w = completions::mapped_words(device, 2 * kMarks, "tide.replays");
    m.host = w.host;
    m.dev = reinterpret_cast<uint32_t*>(w.dev);
  });
  return m;
}

__global__ void close_replay(uint32_t* pair) {
  volatile uint32_t* words = pair;
  words[1] = words[1] + 1;
  __threadfence_system();  // done moves before active drops: the watchdog never sees an idle op un-counted
  words[0] = 0;
}

}  // namespace

int64_t claim(int64_t device) {
  Marks& m = marks(device);
  const int64_t mark = m.claimed.fetch_add(1);
  TORCH_CHECK(mark < kMarks, "tide: more than ", num(kMarks), " TIDE ops were captured into CUDA graphs in this process");
  return mark;
}

driver::MemOp begin(int64_t device, int64_t mark) {
  return driver::MemOp{reinterpret_cast<uint64_t>(marks(device).dev + 2 * mark), 1};
}

void end(int64_t device, int64_t mark, cudaStream_t stream) {
  close_replay<<<1, 1, 0, stream>>>(marks(device).dev + 2 * mark);
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tide.replays: the closing kernel failed to launch: ", cudaGetErrorString(err));
}

std::vector<std::pair<uint32_t, uint32_t>> states(int64_t device, int64_t first, int64_t count) {
  const Marks& m = marks(device);
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= kMarks, "tide.replays: marks out of range");
  const volatile uint32_t* words = m.host;
  std::vector<std::pair<uint32_t, uint32_t>> out;
  out.reserve(count);
  for (int64_t k = first; k < first + count; ++k) out.emplace_back(words[2 * k], words[2 * k + 1]);
  return out;
}

}  // namespace tide::replays
