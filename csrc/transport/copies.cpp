#include "transport/copies.h"

#include <c10/util/Exception.h>

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
