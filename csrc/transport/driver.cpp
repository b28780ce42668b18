// Driver entry points for TIDE's flags: cuStreamWriteValue32 and cuStreamBatchMemOp.
//
// Readiness protocol (NCCL's CE collectives, src/ce_coll.cc): a producer writes its data with copies,
// then a 4-byte sequence number into the consumer's flag word; the consumer's stream waits for
// flag >= seq with a stream memory operation. The wait is in the front end: no kernel spins, so on a
// shared GPU the SM-run copies of the producers are never starved.
#include "transport/driver.h"

#include <cuda.h>

#include <algorithm>
#include <mutex>

#include <c10/util/Exception.h>

#include "kernels.h"

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
