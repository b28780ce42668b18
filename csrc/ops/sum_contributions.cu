// tide sum_contributions: the destination-side kernel of TIDE-RS, and the multi-node schedule's sums
// (node partials, then a destination's partials: the extension's sum_rows, tide/sums.py).
//
// For every segment s of a launch (see SumSegment in csrc/kernels.h):
//
//   x_k(i) = k == own_rank ? own[i] : (staging + j * stride + entry_off)[i]      k = 0 .. K-1
//   j      = own_skipped && k > own_rank ? k - 1 : k
//   acc    = float(x_0(i));  acc = acc + float(x_1(i));  ...;  acc = acc + float(x_{K-1}(i))
//   v      = acc * float(scale)
//   out[i] = accumulate ? out[i] + v : v                                           i in [0, n)
//
// in exactly that order, each step one IEEE fp32 operation rounded to nearest (__fadd_rn /
// __fmul_rn, so nvcc cannot contract a step into an FMA). That is bit for bit what the reference
// backend computes (tide.sums.sum_rows_reference). Padding segments (zero != 0) write 0.
//
// The grid is persistent and bounded (default 16 CTAs, TIDE_RS_CTAS): the kernel is short-lived,
// shares the GPU with the model's kernels, and never waits on a flag (the stream waits before it with
// cuStreamWaitValue32), so it cannot starve the SM-run "copies" of a 1-GPU test. A thread's vector is
// four elements of every source (16 B of fp32, 8 B of bf16/fp16), so each thread writes exactly one
// float4 and a warp's store covers 512 contiguous bytes (16-B source vectors of bf16 made every warp
// store half-fill its sectors, which bound the kernel by its stores). Each thread keeps
// kUnrollFor<T, K> vectors of each of the K sources in flight before it adds (K templated for 1..8);
// segments whose pointers are not all vector-aligned, and vector tails, take a scalar path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include "kernels.h"

namespace tide {
namespace {

// Four elements of T, loaded as one vector.
template <typename T>
struct Vec4 {
  static_assert(sizeof(T) == 2, "tide.sum_contributions: sources are fp32, bf16 or fp16");
  using type = uint2;  // bf16 / fp16
};
template <>
struct Vec4<float> {
  using type = uint4;
};

// Vectors per source per thread in flight before the adds: at most about 256 B per thread in all, the
// old fp32 outputs included when accumulating (at least two vectors). On a bounded grid the kernel is
// bound by the bytes in flight per SM, so few contributions (W = 2) need a deeper unroll to read as fast
// as many.
template <typename T, int K, bool kAccumulate>
constexpr int kUnrollFor = [] {
  constexpr int v = static_cast<int>(sizeof(typename Vec4<T>::type));
  const int u = kAccumulate ? 256 / (K * v + 16) : (K >= 8 ? 2 : 16 / K) * (16 / v);
  return u < 2 ? 2 : u;
}();

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
};
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const void* p, int64_t i) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ float load(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
};

// Unpacks one vector of four elements into fp32 (exact conversions).
__device__ __forceinline__ void unpack4(const uint4& v, float* f) {
  f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}
template <typename T>
__device__ __forceinline__ void unpack4(const uint2& v, float* f);
template <>
__device__ __forceinline__ void unpack4<__nv_bfloat16>(const uint2& v, float* f) {
  f[0] = __uint_as_float(v.x << 16);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = __uint_as_float(v.y << 16);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
}
template <>
__device__ __forceinline__ void unpack4<__half>(const uint2& v, float* f) {
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  f[0] = lo.x; f[1] = lo.y; f[2] = hi.x; f[3] = hi.y;
}
template <typename T>
__device__ __forceinline__ void unpack(const typename Vec4<T>::type& v, float* f) {
  if constexpr (sizeof(T) == 4) {
    unpack4(v, f);
  } else {
    unpack4<T>(v, f);
  }
}

// The launch-wide scalars, copied out of the parameter struct into registers (passing the whole
// SumArgs by reference would make nvcc copy its 3.9 KB to the stack).
struct Common {
  const char* staging;
  int64_t stride;
  int32_t k;
  int32_t own_rank;
  float scale;
  int32_t accumulate;
  int32_t own_skipped;
};

// Streaming loads: read-only path, no L1 allocation, and a 256-B L2 prefetch hint, which keeps more
// bytes in flight per CTA than a plain __ldg (the sources are read exactly once).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_stream(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ const void* source(const Common& a, const SumSegment& s, int k) {
  const int j = a.own_skipped && k > a.own_rank ? k - 1 : k;
  return k == a.own_rank ? s.own : static_cast<const void*>(a.staging + j * a.stride + s.entry_off);
}

__device__ __forceinline__ float finish(float acc, float scale, bool accumulate, float old) {
  const float v = __fmul_rn(acc, scale);
  return accumulate ? __fadd_rn(old, v) : v;
}

// Scales the four sums of vector `idx` of the sources and writes them, or adds them to `old` (the
// outputs' values, loaded by the caller), to their fp32 outputs.
__device__ __forceinline__ void store_vector(const Common& a, float* out, int64_t idx, const float* acc,
                                             const float4& old) {
  float4 r;
  r.x = finish(acc[0], a.scale, a.accumulate, old.x);
  r.y = finish(acc[1], a.scale, a.accumulate, old.y);
  r.z = finish(acc[2], a.scale, a.accumulate, old.z);
  r.w = finish(acc[3], a.scale, a.accumulate, old.w);
  reinterpret_cast<float4*>(out)[idx] = r;
}

__device__ __forceinline__ float4 old_vector(const Common& a, const float* out, int64_t idx) {
  return a.accumulate ? reinterpret_cast<const float4*>(out)[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
}

// Scalar path over elements [begin, n): any alignment, any K.
template <typename T>
__device__ void sum_scalar(const Common& a, const SumSegment& s, int64_t begin) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n; i += stride) {
    float acc = Elem<T>::load(source(a, s, 0), i);
    for (int k = 1; k < a.k; ++k) acc = __fadd_rn(acc, Elem<T>::load(source(a, s, k), i));
    s.out[i] = finish(acc, a.scale, a.accumulate, a.accumulate ? s.out[i] : 0.f);
  }
}

// Vector path over the first nvec vectors of every source; K and accumulate known at compile time. When
// accumulating, the old outputs are loaded with the sources, so their latency overlaps too.
template <typename T, int K, bool kAccumulate>
__device__ void sum_vector(const Common& a, const SumSegment& s, int64_t nvec) {
  using V = typename Vec4<T>::type;
  const V* src[K];
#pragma unroll
  for (int k = 0; k < K; ++k) src[k] = static_cast<const V*>(source(a, s, k));
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  constexpr int kUnroll = kUnrollFor<T, K, kAccumulate>;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < nvec;
       base += nthreads * kUnroll) {
    V v[kUnroll][K];
    float4 old[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t idx = base + u * nthreads;
      if (idx < nvec) {
#pragma unroll
        for (int k = 0; k < K; ++k) v[u][k] = ld_stream(src[k] + idx);
        old[u] = kAccumulate ? reinterpret_cast<const float4*>(s.out)[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t idx = base + u * nthreads;
      if (idx >= nvec) continue;
      float acc[4], x[4];
      unpack<T>(v[u][0], acc);
#pragma unroll
      for (int k = 1; k < K; ++k) {
        unpack<T>(v[u][k], x);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], x[e]);
      }
      store_vector(a, s.out, idx, acc, old[u]);
    }
  }
}

// Vector path with K known only at run time (K > 8): one vector per source at a time.
template <typename T>
__device__ void sum_vector_any_k(const Common& a, const SumSegment& s, int64_t nvec) {
  using V = typename Vec4<T>::type;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < nvec; idx += nthreads) {
    float acc[4], x[4];
    unpack<T>(ld_stream(static_cast<const V*>(source(a, s, 0)) + idx), acc);
    for (int k = 1; k < a.k; ++k) {
      unpack<T>(ld_stream(static_cast<const V*>(source(a, s, k)) + idx), x);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], x[e]);
    }
    store_vector(a, s.out, idx, acc, old_vector(a, s.out, idx));
  }
}

template <typename T, int K, bool kAccumulate>
__device__ void sum_segment(const Common& a, const SumSegment& s) {
  constexpr uintptr_t kSourceAlign = sizeof(typename Vec4<T>::type);
  bool aligned = (reinterpret_cast<uintptr_t>(s.out) & 15) == 0;
  for (int k = 0; k < a.k; ++k)
    aligned = aligned && (reinterpret_cast<uintptr_t>(source(a, s, k)) & (kSourceAlign - 1)) == 0;
  if (!aligned) {
    sum_scalar<T>(a, s, 0);
    return;
  }
  const int64_t nvec = s.n / 4;
  if constexpr (K > 0) {
    sum_vector<T, K, kAccumulate>(a, s, nvec);
  } else {
    sum_vector_any_k<T>(a, s, nvec);
  }
  sum_scalar<T>(a, s, nvec * 4);  // tail: fewer than 4 elements
}

__device__ void zero_segment(const SumSegment& s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n; i += stride) s.out[i] = 0.f;
}

// One instantiation per (source dtype, K, accumulate): every non-padding segment of a launch has dtype T,
// and K = 0 means "K known at run time" (more than 8 contributions).
template <typename T, int K, bool kAccumulate>
__global__ void __launch_bounds__(kSumThreads, 1) sum_contributions_kernel(const __grid_constant__ SumArgs a) {
  const Common c{a.staging, a.stride, a.k, a.own_rank, a.scale, a.accumulate, a.own_skipped};
  for (int i = 0; i < a.nseg; ++i) {
    const SumSegment s = a.seg[i];
    if (s.zero) {
      zero_segment(s);
    } else {
      sum_segment<T, K, kAccumulate>(c, s);
    }
  }
}

template <typename T, bool kAccumulate>
void launch_typed(const SumArgs& a, int ctas, cudaStream_t stream) {
  switch (a.k) {
    case 1: sum_contributions_kernel<T, 1, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 2: sum_contributions_kernel<T, 2, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 3: sum_contributions_kernel<T, 3, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 4: sum_contributions_kernel<T, 4, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 5: sum_contributions_kernel<T, 5, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 6: sum_contributions_kernel<T, 6, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 7: sum_contributions_kernel<T, 7, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    case 8: sum_contributions_kernel<T, 8, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
    default: sum_contributions_kernel<T, 0, kAccumulate><<<ctas, kSumThreads, 0, stream>>>(a); break;
  }
}

template <typename T>
void launch_typed(const SumArgs& a, int ctas, cudaStream_t stream) {
  if (a.accumulate) {
    launch_typed<T, true>(a, ctas, stream);
  } else {
    launch_typed<T, false>(a, ctas, stream);
  }
}

}  // namespace

void launch_sum_contributions(const SumArgs& args, int ctas, cudaStream_t stream) {
  TORCH_CHECK(args.nseg >= 0 && args.nseg <= kMaxSegments, "tide.sum_contributions: nseg=", num(args.nseg),
              " out of range [0, ", num(kMaxSegments), "]");
  TORCH_CHECK(args.k >= 1, "tide.sum_contributions: needs at least one contribution, got k=", num(args.k));
  TORCH_CHECK(ctas >= 1, "tide.sum_contributions: ctas must be >= 1 (TIDE_RS_CTAS), got ", num(ctas));
  if (args.nseg == 0) return;
  int32_t dtype = -1;
  for (int i = 0; i < args.nseg; ++i) {
    if (args.seg[i].zero) continue;
    TORCH_CHECK(dtype < 0 || dtype == args.seg[i].dtype,
                "tide.sum_contributions: all segments of one launch must share a dtype (segment ", num(i), ")");
    dtype = args.seg[i].dtype;
  }
  if (dtype == kBF16) {
    launch_typed<__nv_bfloat16>(args, ctas, stream);
  } else if (dtype == kF16) {
    launch_typed<__half>(args, ctas, stream);
  } else {
    launch_typed<float>(args, ctas, stream);
  }
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tide.sum_contributions: launch failed: ", cudaGetErrorString(err));
}

}  // namespace tide
