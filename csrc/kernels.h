// The kernels of the TIDE CUDA extension, declared in one place: wire dtypes, argument structs and
// launchers (the .cu files in csrc/ops/ define them).
//
// Kernel arguments travel by value as one __grid_constant__ struct, so a launch needs no device-side
// descriptor table and no extra copy. kMaxSegments bounds that struct below the classic 4 KB
// kernel-parameter limit (96 * 40 B + header = 3.9 KB); a host call with more segments splits into
// several launches on the same stream.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

// A CUDA runtime call that must succeed, else a named error.
#define TIDE_CUDA(expr)                                                                                 \
  do {                                                                                                  \
    const cudaError_t err_ = (expr);                                                                    \
    TORCH_CHECK(err_ == cudaSuccess, "tide.transport: ", #expr, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace tide {

// Wire dtypes of the tide ops (tide.meta.checks.FLOAT_DTYPES), and the all-gather's bytes (kU8: copied,
// never cast; tide.meta.checks.GATHER_DTYPES).
enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kU8 = 3 };

#if defined(__CUDACC__)
#define TIDE_HOST_DEVICE __host__ __device__
#else
#define TIDE_HOST_DEVICE
#endif

TIDE_HOST_DEVICE inline int dtype_size(int32_t dtype) { return dtype == kF32 ? 4 : dtype == kU8 ? 1 : 2; }

// Numbers in error messages go through num(), never through an ostream: on the GPU machine (torch
// 2.11), a number streamed by this extension (c10::str, TORCH_CHECK) crashed the process inside
// libstdc++'s locale code, the failure of pytorch/pytorch#109923, while strings streamed fine.
// std::to_string formats through libc.
inline std::string num(long long v) { return std::to_string(v); }

constexpr int kMaxSegments = 96;    // keeps SumArgs / CastArgs under 4 KB of kernel parameters
constexpr int kSumThreads = 512;    // 16 warps per summing CTA: enough 16-B loads in flight per SM
constexpr int kCastThreads = 256;

// One segment of the summing kernel:
//   out[i] (+)= scale * (x_0[i] + x_1[i] + ... + x_{K-1}[i]),  i in [0, n), fp32, k in rank order,
// where x_k = own                                     for k == own_rank (read where it lies), and
//       x_k = staging + j * stride + entry_off         otherwise (the k-th contributor's entry), with
//       j = k, or j = k - 1 for k > own_rank when own_skipped (the staging holds no entry for own_rank).
// zero != 0 makes it a padding segment: out[i] = 0.
struct SumSegment {
  float* out;
  const void* own;
  int64_t entry_off;
  int64_t n;
  int32_t dtype;  // dtype of every x_k
  int32_t zero;
};

struct SumArgs {
  const char* staging;
  int64_t stride;
  int32_t k;
  int32_t own_rank;
  float scale;
  int32_t accumulate;
  int32_t own_skipped;
  int32_t nseg;
  SumSegment seg[kMaxSegments];
};

// Launches the bounded-grid summing kernel (csrc/ops/sum_contributions.cu) on `stream`.
void launch_sum_contributions(const SumArgs& args, int ctas, cudaStream_t stream);

// One segment of the cast kernel: dst[i] = cast<dst_dtype>(src[i]), i in [0, n).
struct CastSegment {
  const void* src;
  void* dst;
  int64_t n;
  int32_t src_dtype;
  int32_t dst_dtype;
};

struct CastArgs {
  int32_t nseg;
  CastSegment seg[kMaxSegments];
};

// Launches the cast kernel (csrc/ops/cast_segments.cu) on `stream` with as many CTAs as the segments'
// elements need, up to `max_ctas`.
void launch_cast_segments(const CastArgs& args, int max_ctas, cudaStream_t stream);

}  // namespace tide
