// tide cast_segments: the only kernel of TIDE-AG (the own-shard cast), also the Slot-Reuse packing
// copy and the copy-out of an all-gather into caller-owned outputs.
//
// For every segment s of a launch (see CastSegment in csrc/tide.h):
//
//   dst[i] = cast<dst_dtype>(float(src[i]))        i in [0, n)
//
// TIDE-AG uses it with src = this rank's padded shard of param p and
//   dst = slot + slot_offset(p) + rank * shard_numel(p) * itemsize(p)      (GroupLayout.slot_byte_range)
// so the own shard lands at its final param-major address in one pass, in the output dtype; the
// copy engines then push that very range to every peer's slot. Conversions round to nearest even
// like torch's copy_ (NaN payloads may differ: cvt gives the canonical NaN). Same-dtype segments
// whose pointers are 16-B aligned are copied as 16-B vectors; everything else element by element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include "tide.h"

namespace tide {
namespace {

__device__ __forceinline__ float load_as_float(const void* p, int32_t dtype, int64_t i) {
  if (dtype == kBF16) return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  if (dtype == kF16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_from_float(void* p, int32_t dtype, int64_t i, float v) {
  if (dtype == kBF16) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  } else if (dtype == kF16) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

__global__ void __launch_bounds__(kCastThreads) cast_segments_kernel(const __grid_constant__ CastArgs a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int i = 0; i < a.nseg; ++i) {
    const CastSegment s = a.seg[i];
    if (s.src_dtype == s.dst_dtype) {
      const int64_t bytes = s.n * dtype_size(s.src_dtype);
      const auto* src = static_cast<const unsigned char*>(s.src);
      auto* dst = static_cast<unsigned char*>(s.dst);
      int64_t done = 0;
      if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
        const int64_t nvec = bytes / 16;
        for (int64_t v = tid; v < nvec; v += nthreads)
          reinterpret_cast<uint4*>(dst)[v] = __ldg(reinterpret_cast<const uint4*>(src) + v);
        done = nvec * 16;
      }
      const int esz = dtype_size(s.src_dtype);
      for (int64_t e = done / esz + tid; e < s.n; e += nthreads) {
        if (esz == 4) {
          reinterpret_cast<uint32_t*>(dst)[e] = reinterpret_cast<const uint32_t*>(src)[e];
        } else {
          reinterpret_cast<uint16_t*>(dst)[e] = reinterpret_cast<const uint16_t*>(src)[e];
        }
      }
    } else {
      for (int64_t e = tid; e < s.n; e += nthreads) store_from_float(s.dst, s.dst_dtype, e, load_as_float(s.src, s.src_dtype, e));
    }
  }
}

}  // namespace

void launch_cast_segments(const CastArgs& args, int ctas, cudaStream_t stream) {
  TORCH_CHECK(args.nseg >= 0 && args.nseg <= kMaxSegments, "tide.cast_segments: nseg=", num(args.nseg),
              " out of range [0, ", num(kMaxSegments), "]");
  TORCH_CHECK(ctas >= 1, "tide.cast_segments: ctas must be >= 1, got ", num(ctas));
  if (args.nseg == 0) return;
  cast_segments_kernel<<<ctas, kCastThreads, 0, stream>>>(args);
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tide.cast_segments: launch failed: ", cudaGetErrorString(err));
}

}  // namespace tide
