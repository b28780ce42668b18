// tide cast_segments: the own-shard cast of TIDE-AG (the op's only kernel), a typed, vectorised burst.
//
// For every segment s of a launch (see CastSegment in csrc/kernels.h):
//
//   dst[i] = cast<dst_dtype>(float(src[i]))        i in [0, n)
//
// TIDE-AG uses it with src = a range of this rank's padded shard of param p and
//   dst = slot + slot_offset(p) + (rank * shard_numel(p) + first) * itemsize(p)   (GroupLayout.slot_byte_range)
// so the own shard lands at its final param-major address in one pass, in the output dtype, one
// pipeline chunk per launch: the copy engines push a chunk to the peers while the next one is cast.
//
// The dtype pair is resolved once per segment, never per element. Segments whose two pointers are
// 16-B aligned move 8 elements per thread and step (fp32: two 16-B vectors, bf16/fp16: one); the rest,
// and the tail of fewer than 8 elements, go element by element. Same-dtype segments are copied bit for
// bit (bytes, kU8, only so); conversions round to nearest even like torch's copy_ (NaN payloads may differ: cvt gives
// the canonical NaN). The launcher sizes the grid to the elements (up to max_ctas): a short burst that
// reads and writes at HBM speed, not a resident grid.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include <c10/util/Exception.h>

#include "kernels.h"

namespace tide {
namespace {

constexpr int kVec = 8;  // elements per thread and step on the vector path

// 8 elements of T <-> 8 floats, at vector index v (elements [8v, 8v + 8)).
template <typename T>
struct Vec8;

template <>
struct Vec8<float> {
  static __device__ __forceinline__ void load(const void* p, int64_t v, float* f) {
    const float4* q = static_cast<const float4*>(p) + 2 * v;
    const float4 a = __ldg(q), b = __ldg(q + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
  static __device__ __forceinline__ void store(void* p, int64_t v, const float* f) {
    float4* q = static_cast<float4*>(p) + 2 * v;
    q[0] = make_float4(f[0], f[1], f[2], f[3]);
    q[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
};

template <>
struct Vec8<__nv_bfloat16> {
  static __device__ __forceinline__ void load(const void* p, int64_t v, float* f) {
    const uint4 u = __ldg(static_cast<const uint4*>(p) + v);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[2 * j] = __uint_as_float(w[j] << 16);
      f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ void store(void* p, int64_t v, const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 h = __float22bfloat162_rn(make_float2(f[2 * j], f[2 * j + 1]));
      w[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    static_cast<uint4*>(p)[v] = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Vec8<__half> {
  static __device__ __forceinline__ void load(const void* p, int64_t v, float* f) {
    const uint4 u = __ldg(static_cast<const uint4*>(p) + v);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 g = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
      f[2 * j] = g.x;
      f[2 * j + 1] = g.y;
    }
  }
  static __device__ __forceinline__ void store(void* p, int64_t v, const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half2 h = __float22half2_rn(make_float2(f[2 * j], f[2 * j + 1]));
      w[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    static_cast<uint4*>(p)[v] = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename S, typename D>
__device__ void cast_segment(const CastSegment& s, int64_t tid, int64_t nthreads) {
  const S* src = static_cast<const S*>(s.src);
  D* dst = static_cast<D*>(s.dst);
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const int64_t nvec = s.n / kVec;
    float f[kVec];
    for (int64_t v = tid; v < nvec; v += nthreads) {
      Vec8<S>::load(src, v, f);
      Vec8<D>::store(dst, v, f);
    }
    done = nvec * kVec;
  }
  for (int64_t i = done + tid; i < s.n; i += nthreads) dst[i] = from_float<D>(to_float<S>(src[i]));
}

// Bit-for-bit copy of a same-dtype segment: 16-B vectors when both pointers allow, else elements.
template <typename W>
__device__ void copy_segment(const CastSegment& s, int64_t tid, int64_t nthreads) {
  const int64_t bytes = s.n * static_cast<int64_t>(sizeof(W));
  const auto* src = static_cast<const unsigned char*>(s.src);
  auto* dst = static_cast<unsigned char*>(s.dst);
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const int64_t nvec = bytes / 16;
    for (int64_t v = tid; v < nvec; v += nthreads)
      reinterpret_cast<uint4*>(dst)[v] = __ldg(reinterpret_cast<const uint4*>(src) + v);
    done = nvec * 16 / static_cast<int64_t>(sizeof(W));
  }
  for (int64_t i = done + tid; i < s.n; i += nthreads)
    reinterpret_cast<W*>(dst)[i] = reinterpret_cast<const W*>(src)[i];
}

template <typename S>
__device__ void cast_from(const CastSegment& s, int64_t tid, int64_t nthreads) {
  switch (s.dst_dtype) {
    case kBF16: cast_segment<S, __nv_bfloat16>(s, tid, nthreads); break;
    case kF16: cast_segment<S, __half>(s, tid, nthreads); break;
    default: cast_segment<S, float>(s, tid, nthreads); break;
  }
}

__global__ void __launch_bounds__(kCastThreads) cast_segments_kernel(const __grid_constant__ CastArgs a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int i = 0; i < a.nseg; ++i) {
    const CastSegment& s = a.seg[i];
    if (s.src_dtype == s.dst_dtype) {
      if (s.src_dtype == kF32) {
        copy_segment<uint32_t>(s, tid, nthreads);
      } else if (s.src_dtype == kU8) {
        copy_segment<uint8_t>(s, tid, nthreads);
      } else {
        copy_segment<uint16_t>(s, tid, nthreads);
      }
    } else if (s.src_dtype == kBF16) {
      cast_from<__nv_bfloat16>(s, tid, nthreads);
    } else if (s.src_dtype == kF16) {
      cast_from<__half>(s, tid, nthreads);
    } else {
      cast_from<float>(s, tid, nthreads);
    }
  }
}

}  // namespace

void launch_cast_segments(const CastArgs& args, int max_ctas, cudaStream_t stream) {
  TORCH_CHECK(args.nseg >= 0 && args.nseg <= kMaxSegments, "tide.cast_segments: nseg=", num(args.nseg),
              " out of range [0, ", num(kMaxSegments), "]");
  TORCH_CHECK(max_ctas >= 1, "tide.cast_segments: max_ctas must be >= 1, got ", num(max_ctas));
  if (args.nseg == 0) return;
  // One thread per 8 elements of the largest segment (every segment is walked by the whole grid).
  int64_t largest = 0;
  for (int i = 0; i < args.nseg; ++i) largest = std::max<int64_t>(largest, args.seg[i].n);
  const int64_t want = (largest / kVec + kCastThreads - 1) / kCastThreads;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, max_ctas)));
  cast_segments_kernel<<<ctas, kCastThreads, 0, stream>>>(args);
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tide.cast_segments: launch failed: ", cudaGetErrorString(err));
}

}  // namespace tide
