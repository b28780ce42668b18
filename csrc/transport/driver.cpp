// What the collectives put on a stream below the kernels (driver.h), in three parts: the driver entry points
// of the flags' stream memory ops (cuStreamWriteValue32, cuStreamBatchMemOp), the issue of a batch of
// copies, and the completion words' rings and the eager ops in flight.
#include "transport/driver.h"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "kernels.h"

// ---- stream memory ops
// Readiness protocol (NCCL's CE collectives, src/ce_coll.cc): a producer writes its data with copies,
// then a 4-byte sequence number into the consumer's flag word; the consumer's stream waits for
// flag >= seq with a stream memory operation. The wait is in the front end: no kernel spins, so on a
// shared GPU the SM-run copies of the producers are never starved.
namespace tide::driver {
namespace {

using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

struct Api {
  WriteValue32 write32 = nullptr;
  BatchMemOp batch = nullptr;
};

constexpr unsigned kMaxBatch = 256;  // cuStreamBatchMemOp's documented per-call limit

void* resolve(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  // 12000: the CUDA 12 ABI of these entry points (the *_v2 variants that cuda.h maps them to).
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) return nullptr;
  return fn;
}

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    a.write32 = reinterpret_cast<WriteValue32>(resolve("cuStreamWriteValue32"));
    a.batch = reinterpret_cast<BatchMemOp>(resolve("cuStreamBatchMemOp"));
  });
  return a;
}

void check(CUresult r, const char* what) {
  TORCH_CHECK(r == CUDA_SUCCESS, "tide.transport: ", what, " failed with CUresult ", num(static_cast<int>(r)));
}

CUstreamBatchMemOpParams write_op(const MemOp& w) {
  CUstreamBatchMemOpParams p{};
  p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  p.writeValue.address = static_cast<CUdeviceptr>(w.addr);
  p.writeValue.value = w.value;
  p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return p;
}

CUstreamBatchMemOpParams wait_op(const MemOp& w) {
  CUstreamBatchMemOpParams p{};
  p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  p.waitValue.address = static_cast<CUdeviceptr>(w.addr);
  p.waitValue.value = w.value;
  p.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  return p;
}

CUresult submit(CUstream stream, std::vector<CUstreamBatchMemOpParams>& ops, int* calls) {
  for (size_t start = 0; start < ops.size(); start += kMaxBatch) {
    const unsigned n = static_cast<unsigned>(std::min<size_t>(kMaxBatch, ops.size() - start));
    const CUresult r = api().batch(stream, n, ops.data() + start, 0);
    ++*calls;
    if (r != CUDA_SUCCESS) return r;
  }
  return CUDA_SUCCESS;
}

// Whether this driver takes writes in a cuStreamBatchMemOp (some refuse any write op there): decided by
// the first batch that holds both, which is retried the other way when refused.
enum class Mixed { kUnknown, kYes, kNo };
Mixed g_mixed = Mixed::kUnknown;

}  // namespace

bool available() {
  const Api& a = api();
  return a.write32 != nullptr && a.batch != nullptr;
}

int batch(cudaStream_t stream, const std::vector<MemOp>& writes, const std::vector<MemOp>& waits) {
  TORCH_CHECK(available(), "tide.transport: the CUDA driver lacks stream memory operations (cuStreamBatchMemOp)");
  const auto s = reinterpret_cast<CUstream>(stream);
  thread_local std::vector<CUstreamBatchMemOpParams> ops;
  int calls = 0;
  if (!writes.empty() && g_mixed != Mixed::kNo) {
    ops.clear();
    for (const MemOp& w : writes) ops.push_back(write_op(w));
    for (const MemOp& w : waits) ops.push_back(wait_op(w));
    // A refused batch enqueues nothing: the first call may fall through to the other way.
    const CUresult r = submit(s, ops, &calls);
    if (r == CUDA_SUCCESS) {
      g_mixed = Mixed::kYes;
      return calls;
    }
    if (g_mixed == Mixed::kYes || ops.size() > kMaxBatch) check(r, "cuStreamBatchMemOp");
    (void)cudaGetLastError();
    g_mixed = Mixed::kNo;
  }
  for (const MemOp& w : writes) {
    check(api().write32(s, static_cast<CUdeviceptr>(w.addr), w.value, 0), "cuStreamWriteValue32");
    ++calls;
  }
  if (!waits.empty()) {
    ops.clear();
    for (const MemOp& w : waits) ops.push_back(wait_op(w));
    check(submit(s, ops, &calls), "cuStreamBatchMemOp");
  }
  return calls;
}

}  // namespace tide::driver

// ---- batched copies
namespace tide {

void CopyList::issue(cudaStream_t stream, bool flags, CopyCounters& counters) {
  if (dst_.empty()) return;
  cudaError_t err = cudaSuccess;
  // cudaMemcpyBatchAsync refuses the legacy default stream (an op called on torch's default stream), and
  // has no graph-node form: a stream capturing a CUDA graph gets one memcpy node per copy (peer copies
  // in a graph still run on the copy engines).
  const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (!legacy) err = cudaStreamIsCapturing(stream, &capture);
  TORCH_CHECK(err == cudaSuccess, "tide.transport: cudaStreamIsCapturing failed: ", cudaGetErrorString(err));
#if CUDART_VERSION >= 13000
  if (dst_.size() > 1 && !legacy && capture == cudaStreamCaptureStatusNone) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_index = 0;
    err = cudaMemcpyBatchAsync(dst_.data(), src_.data(), size_.data(), dst_.size(), &attr, &attr_index, 1, stream);
    ++counters.api_calls;
  } else
#endif
  {
    for (size_t i = 0; i < dst_.size() && err == cudaSuccess; ++i) {
      err = cudaMemcpyAsync(dst_[i], src_[i], size_[i], cudaMemcpyDefault, stream);
      ++counters.api_calls;
    }
  }
  TORCH_CHECK(err == cudaSuccess, "tide.transport: copy issue failed: ", cudaGetErrorString(err));
  for (size_t b : size_) {
    if (flags) {
      ++counters.flags;
    } else {
      ++counters.copies;
      counters.bytes += static_cast<int64_t>(b);
    }
  }
  clear();
}

}  // namespace tide

// ---- completion words
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
