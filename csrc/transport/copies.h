// Copy-engine copies, issued as one cudaMemcpyBatchAsync per list (NCCL's CE collectives do the same);
// under CUDA-graph capture, as one memcpy node per copy (the batch call cannot be captured).
//
// Measured on 2 x H200 over NV18 (bench/ce_patterns.cu, docs/performance.md): one batch of all the
// pieces on one stream reaches 380-389 GB/s per direction from 256 MiB (a single copy: 390), while one
// cudaMemcpyAsync per piece reaches 357-371 and spreading pieces over 2-4 streams or coalescing them
// into 2-D copies gains nothing. Copies inside one batch are unordered: a flag that must follow data
// goes in a later list on the same stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

namespace tide {

struct CopyCounters {
  int64_t copies = 0, bytes = 0, flags = 0, api_calls = 0;
};

class CopyList {
 public:
  void add(uint64_t dst, uint64_t src, size_t bytes) {
    if (bytes == 0) return;
    dst_.push_back(reinterpret_cast<void*>(dst));
    src_.push_back(reinterpret_cast<const void*>(src));
    size_.push_back(bytes);
  }
  bool empty() const { return dst_.empty(); }
  size_t size() const { return dst_.size(); }
  void clear() {
    dst_.clear();
    src_.clear();
    size_.clear();
  }
  // Issues every copy on `stream` (one call), counts them as data or as 4-B flags, and clears the list.
  void issue(cudaStream_t stream, bool flags, CopyCounters& counters);

 private:
  std::vector<void*> dst_;
  std::vector<const void*> src_;
  std::vector<size_t> size_;
};

}  // namespace tide
