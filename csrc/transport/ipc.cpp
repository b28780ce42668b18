// Legacy CUDA IPC of caching-allocator segments (csrc/transport/ipc.h).
#include "transport/ipc.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstring>

#include "kernels.h"

namespace tide::ipc {

Export export_segment(const at::Tensor& t) {
  Export e;
  if (!t.is_cuda()) {
    e.error = "not a CUDA tensor";
    return e;
  }
  c10::cuda::CUDAGuard guard(t.device());
  size_t size = 0;
  void* base = nullptr;
  try {  // the allocator refuses memory of expandable segments
    base = c10::cuda::CUDACachingAllocator::getBaseAllocation(t.data_ptr(), &size);
  } catch (const c10::Error& err) {
    e.error = err.what_without_backtrace();
    return e;
  }
  cudaIpcMemHandle_t h;
  // A lease taken while the training step is being captured into a CUDA graph (its region then lies in
  // the graph's pool): the IPC calls capture nothing, and need the relaxed mode to be allowed then.
  c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  const cudaError_t err = cudaIpcGetMemHandle(&h, base);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    e.error = cudaGetErrorString(err);
    return e;
  }
  e.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  e.offset = static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(base);
  return e;
}

int64_t open_segment(const std::string& handle, int64_t device) {
  TORCH_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t), "tide.transport.ipc: a handle has ",
              num(static_cast<int64_t>(sizeof(cudaIpcMemHandle_t))), " bytes, got ",
              num(static_cast<int64_t>(handle.size())));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* base = nullptr;
  c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);  // as in export_segment
  const cudaError_t err = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  TORCH_CHECK(err == cudaSuccess, "tide.transport.ipc: cudaIpcOpenMemHandle failed: ", cudaGetErrorString(err));
  return reinterpret_cast<int64_t>(base);
}

void close_segment(int64_t base, int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  const cudaError_t err = cudaIpcCloseMemHandle(reinterpret_cast<void*>(base));
  TORCH_CHECK(err == cudaSuccess, "tide.transport.ipc: cudaIpcCloseMemHandle failed: ", cudaGetErrorString(err));
}

}  // namespace tide::ipc
