// Driver entry points for TIDE's flags: cuStreamWriteValue32 and cuStreamBatchMemOp(WAIT_VALUE_32).
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

#include "tide.h"

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

}  // namespace

bool available() {
  const Api& a = api();
  return a.write32 != nullptr && a.batch != nullptr;
}

void write_value(cudaStream_t stream, uint64_t addr, uint32_t value) {
  const Api& a = api();
  TORCH_CHECK(a.write32, "tide.transport: cuStreamWriteValue32 is not available from the CUDA driver");
  check(a.write32(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(addr), value, 0),
        "cuStreamWriteValue32");
}

void wait_geq(cudaStream_t stream, const std::vector<uint64_t>& addrs, uint32_t value) {
  std::vector<MemOp> waits;
  waits.reserve(addrs.size());
  for (auto a : addrs) waits.push_back(MemOp{a, value});
  batch(stream, {}, waits);
}

int batch(cudaStream_t stream, const std::vector<MemOp>& writes, const std::vector<MemOp>& waits, bool nothrow) {
  const Api& a = api();
  TORCH_CHECK(a.batch, "tide.transport: cuStreamBatchMemOp is not available from the CUDA driver");
  thread_local std::vector<CUstreamBatchMemOpParams> ops;
  ops.clear();
  for (const MemOp& w : writes) {
    CUstreamBatchMemOpParams p{};
    p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    p.writeValue.address = static_cast<CUdeviceptr>(w.addr);
    p.writeValue.value = w.value;
    p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    ops.push_back(p);
  }
  for (const MemOp& w : waits) {
    CUstreamBatchMemOpParams p{};
    p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    p.waitValue.address = static_cast<CUdeviceptr>(w.addr);
    p.waitValue.value = w.value;
    p.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    ops.push_back(p);
  }
  for (size_t start = 0; start < ops.size(); start += kMaxBatch) {
    const unsigned n = static_cast<unsigned>(std::min<size_t>(kMaxBatch, ops.size() - start));
    const CUresult r = a.batch(reinterpret_cast<CUstream>(stream), n, ops.data() + start, 0);
    if (r != CUDA_SUCCESS) {
      if (nothrow) return static_cast<int>(r);
      check(r, "cuStreamBatchMemOp");
    }
  }
  return 0;
}

}  // namespace tide::driver
