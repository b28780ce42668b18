// Replay marks (csrc/transport/replays.h).
#include "transport/replays.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "kernels.h"

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
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    // Allocated at the first op captured into a graph: a host allocation needs the relaxed mode then.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* host = nullptr;
    void* dev = nullptr;
    TORCH_CHECK(cudaHostAlloc(&host, 2 * kMarks * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable) ==
                    cudaSuccess, "tide.replays: cudaHostAlloc failed");
    std::memset(host, 0, 2 * kMarks * sizeof(uint32_t));
    TORCH_CHECK(cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess, "tide.replays: cudaHostGetDevicePointer failed");
    m.host = static_cast<uint32_t*>(host);
    m.dev = static_cast<uint32_t*>(dev);
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
