#include "transport/completions.h"

#include "kernels.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace tide::completions {
namespace {

DeviceWords rings(kWords, "tide.completions");
std::atomic<uint32_t> last_claimed[kMaxDevices];  // per device: the last op id claimed

bool word_reached(const MappedWords& w, uint32_t op) {
  const uint32_t word = reinterpret_cast<const volatile uint32_t*>(w.host)[op % kWords];
  return static_cast<int32_t>(word - op) >= 0;
}

}  // namespace

const MappedWords& DeviceWords::on(int64_t device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, what_, ": device ", num(device), " out of range");
  std::call_once(allocated_[device], [&] {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    // A host allocation during someone's CUDA-graph capture needs the relaxed mode.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* host = nullptr;
    void* dev = nullptr;
    TORCH_CHECK(cudaHostAlloc(&host, n_ * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess,
                what_, ": cudaHostAlloc failed");
    std::memset(host, 0, n_ * sizeof(uint32_t));
    TORCH_CHECK(cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess, what_, ": cudaHostGetDevicePointer failed");
    words_[device] = MappedWords{static_cast<uint32_t*>(host), reinterpret_cast<uint64_t>(dev)};
  });
  return words_[device];
}

driver::MemOp claim(int64_t device) {
  const MappedWords& w = rings.on(device);
  const uint32_t op = last_claimed[device].fetch_add(1) + 1;
  return driver::MemOp{w.dev + 4 * static_cast<uint64_t>(op % kWords), op};
}

bool completed(int64_t device, uint32_t op) { return word_reached(rings.on(device), op); }

bool all_completed(int64_t device) {
  const MappedWords& w = rings.on(device);
  const uint32_t last = last_claimed[device].load();
  for (uint32_t op = last > kWords ? last - kWords + 1 : 1; op <= last; ++op)
    if (!word_reached(w, op)) return false;
  return true;
}

uint64_t InFlight::begin(const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  drop_completed();
  entries_.push_back(Entry{next_, 0, true, std::chrono::steady_clock::now(), op});
  return next_++;
}

void InFlight::issued(uint64_t ticket, uint32_t op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.empty() || ticket < entries_.front().ticket) return;
  Entry& e = entries_[ticket - entries_.front().ticket];
  e.op = op;
  e.issuing = false;
}

std::optional<std::tuple<uint64_t, std::string, double, bool>> InFlight::oldest() {
  std::lock_guard<std::mutex> lock(mu_);
  drop_completed();
  for (const Entry& e : entries_) {
    if (done(e)) continue;
    const double age = std::chrono::duration<double>(std::chrono::steady_clock::now() - e.began).count();
    return std::make_tuple(e.ticket, std::string(e.name), age, e.issuing);
  }
  return std::nullopt;
}

void InFlight::drop_completed() {
  while (!entries_.empty() && done(entries_.front())) entries_.pop_front();
}

}  // namespace tide::completions
