// Plans of the CUDA transport, built once per group layout in Python (tide/transport/plans.py, from
// tide.meta.layout.GroupLayout) and looked up by the shapes and dtypes of a call.
#pragma once

#include <cstdint>
#include <vector>

namespace tide {

// One piece of an own shard, in elements of that shard: [first, first + n) of param `param`.
struct ShardRange {
  int64_t param, first, n;
};

// Where this rank's shard of every param lands in a slot, and the pipeline chunks of the own-shard
// cast: chunk c casts its ranges into my slot, then the copy engines push exactly those bytes to every
// peer while chunk c + 1 is cast. The chunks cover every own shard once, in slot order.
struct AgPlan {
  std::vector<int64_t> own_off;    // bytes from slot start to this rank's shard of param j
  std::vector<int64_t> out_off;    // bytes from slot start to param j's output
  std::vector<int64_t> out_numel;  // elements of param j's output (W * shard numel)
  std::vector<int32_t> out_dtype;  // DType of param j's output
  std::vector<std::vector<ShardRange>> chunks;
  int64_t slot_bytes = 0;
  size_t size() const { return own_off.size(); }
};

// One reduce-scatter chunk: n gradient elements of `param` from element grad_off, summed into element
// shard_off of the destination's shard grad, staged at byte entry_off of the contributor's entry.
struct RsChunk {
  int64_t param, grad_off, shard_off, n, entry_off;
};

struct RsPlan {
  std::vector<std::vector<std::vector<RsChunk>>> rounds;  // rounds[d][j]: rank d's j-th round
  std::vector<ShardRange> pads;  // this rank's padding: (param, shard element, n), zero unless accumulating
  std::vector<int32_t> grad_dtype;
  int64_t max_rounds = 0;
};

// A node arena's share of one multi-node reduce-scatter step (tide/ops/reference_multinode.py): its
// rounds write every destination's node partials into one fp32 buffer (shard_off: elements into it), so
// the call's checks need the elements each gradient and the buffer must hold.
struct PartialsPlan {
  RsPlan rs;
  std::vector<int64_t> grad_need;  // per param: elements the rounds read
  int64_t out_need = 0;            // elements this rank's own rounds write
};

}  // namespace tide
