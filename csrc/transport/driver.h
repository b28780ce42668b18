// Stream memory operations of the CUDA driver (flag writes and waits that run in the GPU front end,
// not on SMs), resolved at run time through cudaGetDriverEntryPointByVersion so the extension never
// links libcuda itself.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

namespace tide::driver {

// One 32-bit stream memory operation: a write (*addr = value) or a wait until
// (int32_t)(*addr - value) >= 0 (wrap-around safe "greater or equal" on monotonically increasing
// sequence numbers).
struct MemOp {
  uint64_t addr;
  uint32_t value;
};

// True when the driver exposes the stream memory operations (resolved once, cached).
bool available();

// *addr = value, ordered after the prior work of `stream` (cuStreamWriteValue32).
void write_value(cudaStream_t stream, uint64_t addr, uint32_t value);

// Blocks `stream` until (int32_t)(*addr - value) >= 0 for every address, in one cuStreamBatchMemOp.
void wait_geq(cudaStream_t stream, const std::vector<uint64_t>& addrs, uint32_t value);

// The writes, then the waits, in one cuStreamBatchMemOp (more calls only beyond its 256-op limit).
// Each op has its own value. Returns the CUresult instead of throwing when `nothrow` is set.
int batch(cudaStream_t stream, const std::vector<MemOp>& writes, const std::vector<MemOp>& waits,
          bool nothrow = false);

}  // namespace tide::driver
