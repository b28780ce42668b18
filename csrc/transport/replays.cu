// Replay marks (csrc/transport/replays.h).
#include "transport/replays.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

#include "kernels.h"
#include "transport/driver.h"

namespace tide::replays {
namespace {

completions::DeviceWords marks(2 * kMarks, "tide.replays");  // per mark: (active, done)
std::atomic<int64_t> claimed[completions::kMaxDevices];

uint32_t* pair_on_device(int64_t device, int64_t mark) {
  return reinterpret_cast<uint32_t*>(marks.on(device).dev) + 2 * mark;
}

__global__ void close_replay(uint32_t* pair) {
  volatile uint32_t* words = pair;
  words[1] = words[1] + 1;
  __threadfence_system();  // done moves before active drops: the watchdog never sees an idle op un-counted
  words[0] = 0;
}

}  // namespace

int64_t claim(int64_t device) {
  marks.on(device);  // allocated before any capture needs it
  const int64_t mark = claimed[device].fetch_add(1);
  TORCH_CHECK(mark < kMarks, "tide: more than ", num(kMarks),
              " TIDE ops were captured into CUDA graphs in this process");
  return mark;
}

driver::MemOp begin(int64_t device, int64_t mark) {
  return driver::MemOp{reinterpret_cast<uint64_t>(pair_on_device(device, mark)), 1};
}

void end(int64_t device, int64_t mark, cudaStream_t stream) {
  close_replay<<<1, 1, 0, stream>>>(pair_on_device(device, mark));
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tide.replays: the closing kernel failed to launch: ", cudaGetErrorString(err));
}

std::vector<std::pair<uint32_t, uint32_t>> states(int64_t device, int64_t first, int64_t count) {
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= kMarks, "tide.replays: marks out of range");
  const volatile uint32_t* words = marks.on(device).host;
  std::vector<std::pair<uint32_t, uint32_t>> out;
  out.reserve(count);
  for (int64_t k = first; k < first + count; ++k) out.emplace_back(words[2 * k], words[2 * k + 1]);
  return out;
}

}  // namespace tide::replays
