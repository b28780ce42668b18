// Plans of the CUDA transport, built and agreed in Python (tide/meta/plans.py, from
// tide.meta.layout.GroupLayout) before the extension is entered, and handed to each op call. They cross
// the binding as the named structs below (bindings.cpp), with the field names tide/meta/plans.py uses.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace tide {

// The DType of a tensor's scalar type, or -1 when the ops do not take it: the one place dtypes get codes.
inline int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

// The all-gather's dtypes: the float wire dtypes, and uint8 (bytes, copied into uint8 only).
inline int32_t gather_code(at::ScalarType t) { return t == at::kByte ? kU8 : dtype_code(t); }

// A range of one param's elements: [first, first + numel) of its own shard (an all-gather chunk) or of
// its shard grad (a reduce-scatter's padding).
struct ShardRange {
  int64_t param = 0, first = 0, numel = 0;
};

// Where this rank's shard of every param lands in a slot, and the pipeline chunks of the own-shard
// cast: chunk c casts its ranges into my slot, then the copy engines push exactly those bytes to every
// peer while chunk c + 1 is cast. The chunks cover every own shard once, in slot order.
struct AgPlan {
  std::vector<int64_t> own_offset;  // bytes from slot start to this rank's shard of param j
  std::vector<int64_t> out_offset;  // bytes from slot start to param j's output
  std::vector<int64_t> out_numel;   // elements of param j's output (W * shard numel)
  std::vector<int32_t> out_dtype;   // DType of param j's output
  std::vector<std::vector<ShardRange>> chunks;
  int64_t slot_bytes = 0;
  size_t size() const { return own_offset.size(); }
};

// One reduce-scatter chunk: `numel` gradient elements of `param` from element grad_offset, summed into
// element shard_offset of the destination's shard grad, staged at byte entry_offset of the
// contributor's entry.
struct RsChunk {
  int64_t param = 0, grad_offset = 0, shard_offset = 0, numel = 0, entry_offset = 0;
};

struct RsPlan {
  std::vector<std::vector<std::vector<RsChunk>>> rounds;  // rounds[d][j]: rank d's j-th round
  std::vector<ShardRange> pads;  // this rank's padding, zero unless accumulating
  std::vector<int32_t> grad_dtype;
  int64_t max_rounds = 0;  // the most rounds of any destination
};

// A node arena's share of one multi-node reduce-scatter step (node_leg.cpp): its rounds write every
// destination's node partials into one fp32 buffer (shard_offset: elements into it), so the call's
// checks need the elements each gradient and the buffer must hold.
struct PartialsPlan {
  RsPlan rs;
  std::vector<int64_t> grad_need;  // per param: elements the rounds read
  int64_t out_need = 0;            // elements this rank's own rounds write
};

}  // namespace tide
