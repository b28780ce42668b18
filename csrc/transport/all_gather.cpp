// TIDE-AG: every rank's shard of every param written straight into the outputs of one lane (flags.h):
// bound in one arena slot, or in the call's direct lease (caching-allocator memory every rank maps).
//
// Lane layout (tide.meta.layout.GroupLayout, param-major): param j's output starts at out_offset[j] and
// rank r's shard of it at own_offset[j] = out_offset[j] + r * shard_bytes[j]; every rank has the same
// layout, so rank r's pieces go to the same offsets in every peer's lane. Below, "slot i" is lane i.
//
// Rank r, outputs in lane i, use v (lane i's use count, identical on all ranks):
//   S (caller's stream): record "start"; per pipeline chunk c: one kernel writes the chunk's ranges of my
//                        shards into my slot i (cast to the output dtype, or copied), record "chunk c";
//   P (AG push stream):  after "start": write ag_free[i][r] = v into every peer (stream memop) and wait
//                        for ag_free[i][p] >= v of every peer p; per chunk c: one batch of copy-engine
//                        copies of its bytes to every peer's slot i at the same offsets, read from my
//                        slot after "chunk c" (cast ranges) or from the shard itself (same dtype); then
//                        post ag_ready[i][r] = v with 4-B copies (they follow the data on P);
//   S:                   wait ag_ready[i][p] >= v for every peer; wait for P.
// A slot's last use off the caller's stream (its previous all-gather, a Slot-Reuse reduce-scatter reading
// gradients there: the arena's slot events, arena.h) is waited for on S before "start", so no rank writes
// into slot i before it is free; the op then records its own use of slot i on S. The direct lane is leased
// per call and has no uses.
// Captured into a CUDA graph, the same steps run with the captured protocol's words (flags.h): each set
// to 1 and reset by its reader after its wait, so every replay starts from the words the last one left.
// "free" flags (write after read) are stream-memop writes into the peer's word: the stream has finished
// reading when it reaches them. "ready" flags (read after write) are 4-B copy-engine copies that follow
// the data on the same stream, as in NCCL's CE collectives.
#include <c10/cuda/CUDAGuard.h>

#include "transport/collectives.h"

namespace tide {
namespace {

bool gather_tensors(at::TensorList ts) {
  for (const auto& t : ts)
    if (gather_code(t.scalar_type()) < 0 || !t.is_contiguous()) return false;
  return true;
}

// The conditions of tide.meta.checks (which words the errors: tide/transport/all_gather.py) for a call
// of `plan`, plus every tensor on the arena's device.
bool args_ok(const Arena& a, const AgPlan& plan, at::TensorList shards,
             at::TensorList outs) {
  if (shards.size() != plan.size() || outs.size() != plan.size() || !gather_tensors(shards) || !gather_tensors(outs))
    return false;
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(a.device()));
  for (size_t i = 0; i < shards.size(); ++i) {
    const at::Tensor& s = shards[i];
    const at::Tensor& o = outs[i];
    if (s.device() != dev || o.device() != dev || s.dim() == 0) return false;
    const int32_t sd = gather_code(s.scalar_type()), od = gather_code(o.scalar_type());
    if (od != plan.out_dtype[i] || o.numel() != plan.out_numel[i] || ((sd == kU8) != (od == kU8))) return false;
    std::vector<int64_t> full(s.sizes().begin(), s.sizes().end());
    full[0] *= a.world();
    const bool is_flat = o.dim() == 1 && o.size(0) == a.world() * s.numel();
    if (!is_flat && o.sizes().vec() != full) return false;
  }
  return true;
}

}  // namespace

const char* ran_name(Ran r) { return r == Ran::kTide ? "tide" : "bad_args"; }

Ran all_gather(Arena& a, const AgPlan& plan, at::TensorList shards,
               at::TensorList outs, int64_t lane, int64_t mark) {
  const char* op = "all_gather_into_params_";
  if (!args_ok(a, plan, shards, outs)) return Ran::kBadArgs;
  const int64_t K = a.layout().flags.K;
  TORCH_CHECK_VALUE(lane >= 0 && lane <= K && plan.slot_bytes <= a.lane_bytes(lane), "tide.", op, ": lane ", num(lane),
                    " is no lane of the arena that holds the plan's ", num(plan.slot_bytes), " bytes (slots 0..",
                    num(K - 1), ", direct lane ", num(K), " while its lease is held)");
  if (lane < K) a.check_leased(op);
  HostTimer total(a.host_ns(kTotal));
  a.count_call(true);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(a.device()));
  const Issue is = issue_on_current_stream(a.device(), op, mark);
  const WatchedOp watched(a, op, is);
  cudaStream_t S = is.stream;
  if (lane < K) a.slot_wait(lane, S);
  a.start(is);
  {
    HostTimer t(a.host_ns(kEvent));
    TIDE_CUDA(cudaEventRecord(a.ev_start(), S));
  }
  const uint32_t v = a.open_lane(lane, a.ev_start(), is);
  const int64_t rank = a.rank(), world = a.world();
  const uint64_t mine = a.lane_base(rank, lane);
  CopyList& data = a.data_copies();
  // Pipeline chunk c: one kernel writes its ranges of my shards into my slot i on S (cast to the output
  // dtype, or copied); the pushes read cast ranges from my slot once "chunk c" is recorded, same-dtype
  // ranges from the shard itself at once. A chunk with nothing to cast waits for nothing: its copies
  // and its kernel segments join the next batch and launch, so an AG without casts is one batch.
  CastArgs cast{};
  for (size_t c = 0; c < plan.chunks.size(); ++c) {
    bool casts = false;
    for (const ShardRange& r : plan.chunks[c]) {
      const at::Tensor& s = shards[r.param];
      const int32_t sd = gather_code(s.scalar_type()), od = plan.out_dtype[r.param];
      const int64_t off = plan.own_offset[r.param] + r.first * dtype_size(od);  // in the slot
      const auto* shard = static_cast<const char*>(s.data_ptr()) + r.first * dtype_size(sd);
      if (cast.nseg == kMaxSegments) a.launch_cast(cast, S);
      cast.seg[cast.nseg++] = CastSegment{shard, reinterpret_cast<void*>(mine + off), r.numel, sd, od};
      casts = casts || sd != od;
      const uint64_t src = sd != od ? mine + off : reinterpret_cast<uint64_t>(shard);
      const size_t bytes = static_cast<size_t>(r.numel * dtype_size(od));
      for (int64_t k = 1; k < world; ++k) data.add(a.lane_base((rank + k) % world, lane) + off, src, bytes);
    }
    if (!casts && c + 1 < plan.chunks.size()) continue;
    a.launch_cast(cast, S);
    if (casts) a.join(a.ag_push(), S, a.chunk_event(c));
    a.issue_copies(data, a.ag_push(), false);
  }
  a.close_lane(lane, v, is);
  if (lane < K) a.slot_used(lane, S);
  return Ran::kTide;
}

}  // namespace tide
