// Stream memory operations of the CUDA driver (flag writes and waits that run in the GPU front end,
// not on SMs), resolved at run time through cudaGetDriverEntryPointByVersion so the extension never
// links libcuda itself.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

namespace tide::driver {

// One 32-bit stream memory operation: a write (*addr = value) or a wait until
// (int32_t)(*addr - value) >= 0 (wrap-around safe "greater or equal" on sequence numbers that only grow).
struct MemOp {
  uint64_t addr;
  uint32_t value;
};

// True when the driver exposes the stream memory operations (resolved once, cached).
bool available();

// The writes, then the waits, on `stream`: one cuStreamBatchMemOp where the driver takes writes and
// waits together (probed once per process), else one cuStreamWriteValue32 per write and one batch of
// waits; more calls only beyond the batch's 256-op limit. Returns the number of driver calls made.
int batch(cudaStream_t stream, const std::vector<MemOp>& writes, const std::vector<MemOp>& waits);

}  // namespace tide::driver
