// TIDE-RS: bf16 (or fp16, fp32) gradients reduced into fp32 shard grads, summed on short-lived CTAs.
//
// Staging layout (csrc/transport/flags.h): destination d's ring holds R slots of W entries;
// contributor q's entry of ring slot s starts at ring_off + (s * W + q) * entry_bytes. A plan's round j
// for destination d is a list of chunks, each `numel` elements of a gradient from grad_offset, staged
// at entry_offset of the entry and summed into shard_offset of d's shard grad.
//
// Rank r, every gradient read where it lies (autograd's memory, or its param-major place in a slot
// where FSDP's Slot-Reuse hooks moved it); round j, destination d, g = rounds done for d + 1, ring
// slot s = (g - 1) % R:
//   Q (RS push stream): wait rs_free[d][s] >= g (d's permit: it has summed what last used ring slot s);
//                       rs_push_src[d][s] = g; one batch of my round-j pieces for every d into their
//                       entries (s, r); then one batch of 4-B flags rs_ready[s][r] = g into every d;
//   D (reduce stream), my own round j: wait rs_ready[s][q] >= g for every q != r; summing kernel over
//                       the round's chunks (own contribution read in place); write rs_free[r][s] = g + R
//                       into every q (stream memop, batched with the next round's waits).
//   After a new lease the round counters skip R and the first reduce-scatter's D permits its first R
//   rounds at its start: a producer writes into a fresh ring only once its destination has issued an
//   op after the lease (flags.h). Every rank issues rounds in one order, a push depends only on its
//   destination's issue or sums R rounds back and a sum only on pushes of its own round, so no wait
//   cycle can form. No kernel ever spins on a flag.
// Captured into a CUDA graph, an op is self-contained (flags.h, the captured protocol): its rounds count
// from 1, D permits its first min(R, rounds) at its start and, after summing round j, round j + R only
// if that round exists; each wait resets its word. Every permit is used within the op, so none is left
// for the next replay, and the eager permits (into the eager lease's ring) are never touched.
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "transport/collectives.h"

namespace tide {
namespace {

bool float_tensors(at::TensorList ts, bool fp32_only) {
  for (const auto& t : ts) {
    const int32_t d = dtype_code(t.scalar_type());
    if (d < 0 || (fp32_only && d != kF32) || !t.is_contiguous()) return false;
  }
  return true;
}

// The conditions of tide.meta.checks (which words the errors: tide/transport/reduce_scatter.py) for a
// call of `plan`, plus every tensor on the arena's device.
bool args_ok(const Arena& a, const RsPlan& plan, at::TensorList grads,
             at::TensorList shard_grads) {
  if (grads.size() != plan.grad_dtype.size() || shard_grads.size() != grads.size() || !float_tensors(grads, false) ||
      !float_tensors(shard_grads, true))
    return false;
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(a.device()));
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].device() != dev || shard_grads[i].device() != dev) return false;
    if (dtype_code(grads[i].scalar_type()) != plan.grad_dtype[i]) return false;
    std::vector<int64_t> want(grads[i].sizes().begin(), grads[i].sizes().end());
    if (want.empty()) want.push_back(1);  // a 0-d gradient is one row of one element
    want[0] = (want[0] + a.world() - 1) / a.world();
    if (shard_grads[i].sizes().vec() != want) return false;
  }
  return true;
}

// One reduce-scatter on its streams: the flag values it builds on and the permits it owes.
struct RsRun {
  Arena& a;
  const RsPlan& plan;
  at::TensorList grads;
  at::TensorList shard_grads;
  float scale;
  bool accumulate;
  bool captured;
  std::vector<int64_t> before;  // rounds per destination before this op (captured: 0)
  std::vector<driver::MemOp> permits;

  const FlagLayout& f() const { return a.layout().flags; }
  int64_t free_word(int64_t d, int64_t s) const { return captured ? f().g_rs_free(d, s) : f().rs_free(d, s); }
  int64_t ready_word(int64_t s, int64_t q) const { return captured ? f().g_rs_ready(s, q) : f().rs_ready(s, q); }
  uint32_t value(uint32_t g) const { return captured ? 1 : g; }

  // rs_free[me][(g - 1) % R] = g into every producer: it may push its round g to me.
  void permit(uint32_t g) {
    for (int64_t k = 1; k < a.world(); ++k)
      permits.push_back(driver::MemOp{a.peer_flag((a.rank() + k) % a.world(), free_word(a.rank(), (g - 1) % f().R)),
                                      value(g)});
  }

  // Padding rows of the shard grads are zero unless the op accumulates.
  void zero_pads() {
    if (accumulate || plan.pads.empty()) return;
    SumArgs s{};
    s.k = 1;
    s.scale = scale;
    for (const ShardRange& p : plan.pads) {
      s.seg[s.nseg++] = SumSegment{shard_grads[p.param].data_ptr<float>() + p.first, nullptr, 0, p.numel, kF32, 1};
      if (s.nseg == kMaxSegments) a.launch_sum(s);
    }
    a.launch_sum(s);
  }

  // My round-j pieces for every destination, rotated so that the W producers start on different peers.
  void push_round(int64_t j) {
    std::vector<driver::MemOp> writes, waits, resets;
    CopyList& data = a.data_copies();
    CopyList& flags = a.flag_copies();
    for (int64_t k = 1; k < a.world(); ++k) {
      const int64_t d = (a.rank() + k) % a.world();
      if (j >= static_cast<int64_t>(plan.rounds[d].size())) continue;
      const uint32_t g = static_cast<uint32_t>(before[d] + j + 1);
      const int64_t s = (g - 1) % f().R;
      waits.push_back(driver::MemOp{a.local_flag(free_word(d, s)), value(g)});
      if (captured)
        resets.push_back(driver::MemOp{a.local_flag(free_word(d, s)), 0});
      else
        writes.push_back(driver::MemOp{a.local_flag(f().rs_push_src(d, s)), g});
      for (const RsChunk& c : plan.rounds[d][j]) {
        const int sz = dtype_size(plan.grad_dtype[c.param]);
        data.add(a.entry(d, s, a.rank()) + c.entry_offset, ptr_of(grads[c.param]) + c.grad_offset * sz,
                 static_cast<size_t>(c.numel * sz));
      }
      flags.add(a.peer_flag(d, ready_word(s, a.rank())), a.local_flag(captured ? f().one() : f().rs_push_src(d, s)), 4);
    }
    if (waits.empty()) return;
    a.memops(a.rs_push(), writes, waits);
    a.memops(a.rs_push(), resets, {});
    a.issue_copies(data, a.rs_push(), false);
    a.issue_copies(flags, a.rs_push(), true);
  }

  // My own round j: post the pending permits and wait for every contributor's entry (one memop batch),
  // then sum in rank order; its permit goes out with the next round's waits.
  void sum_round(int64_t j) {
    const int64_t rank = a.rank(), world = a.world();
    const uint32_t g = static_cast<uint32_t>(before[rank] + j + 1);
    const int64_t s = (g - 1) % f().R;
    if (world > 1) {
      std::vector<driver::MemOp> waits, resets;
      for (int64_t q = 0; q < world; ++q) {
        if (q == rank) continue;
        waits.push_back(driver::MemOp{a.local_flag(ready_word(s, q)), value(g)});
        if (captured) resets.push_back(driver::MemOp{a.local_flag(ready_word(s, q)), 0});
      }
      a.memops(a.reduce(), permits, waits);
      a.memops(a.reduce(), resets, {});
      permits.clear();
    }
    SumArgs sum{};
    sum.staging = reinterpret_cast<const char*>(a.entry(rank, s, 0));
    sum.stride = a.layout().entry_bytes;
    sum.k = static_cast<int32_t>(world);
    sum.own_rank = static_cast<int32_t>(rank);
    sum.scale = scale;
    sum.accumulate = accumulate;
    int32_t dtype = -1;
    for (const RsChunk& c : plan.rounds[rank][j]) {
      const int32_t dt = plan.grad_dtype[c.param];
      if ((dtype >= 0 && dt != dtype) || sum.nseg == kMaxSegments) a.launch_sum(sum);
      dtype = dt;
      const void* own = static_cast<const char*>(grads[c.param].data_ptr()) + c.grad_offset * dtype_size(dt);
      sum.seg[sum.nseg++] =
          SumSegment{shard_grads[c.param].data_ptr<float>() + c.shard_offset, own, c.entry_offset, c.numel, dt, 0};
    }
    a.launch_sum(sum);
    // Written by a stream memop straight into the producers' flags: the sum has read the entries when
    // the stream reaches it (a write-after-read order, so no data has to land first). Captured, only for
    // a round of this op.
    if (!captured || j + f().R < static_cast<int64_t>(plan.rounds[rank].size()))
      permit(g + static_cast<uint32_t>(f().R));
  }
};

}  // namespace

void run_reduce_scatter(Arena& a, const RsPlan& plan, at::TensorList grads,
                        at::TensorList shard_grads, float scale, bool accumulate, int64_t mark) {
  HostTimer total(a.host_ns(kTotal));
  a.count_call(false);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(a.device()));
  const Issue is = issue_on_current_stream(a.device(), "reduce_scatter_params_", mark);
  const WatchedOp watched(a, "reduce_scatter_params_", is);
  cudaStream_t S = is.stream;
  a.start(is);
  // Counted (and mirrored to the issued board) before anything launches, as an all-gather's use is: a
  // launch can block behind a dead peer's flags, and the peers' reports must see this op as issued.
  std::vector<int64_t> rounds;
  for (const auto& per_dest : plan.rounds) rounds.push_back(static_cast<int64_t>(per_dest.size()));
  bool fresh = is.captured();
  RsRun run{a, plan, grads, shard_grads, scale, accumulate, is.captured(),
            is.captured() ? std::vector<int64_t>(a.world(), 0) : a.count_rounds(rounds, fresh), {}};
  a.join(a.rs_push(), S, a.ev_start());
  TIDE_CUDA(cudaStreamWaitEvent(a.reduce(), a.ev_start(), 0));
  // Permits go out on D, which has waited for S: after a lease, the ring is leased and this op issued.
  const int64_t first_permits = is.captured() ? std::min(a.layout().flags.R, rounds[a.rank()]) : a.layout().flags.R;
  if (fresh)
    for (int64_t j = 0; j < first_permits; ++j) run.permit(static_cast<uint32_t>(run.before[a.rank()] + j + 1));
  run.zero_pads();
  for (int64_t j = 0; j < plan.max_rounds; ++j) {
    run.push_round(j);
    if (j < rounds[a.rank()]) run.sum_round(j);
  }
  a.memops(a.reduce(), run.permits, {});
  a.join(S, a.rs_push(), a.ev_rs_push());
  a.join(S, a.reduce(), a.ev_reduce());
  a.finish(is);
}

Ran reduce_scatter(Arena& a, const RsPlan& plan, at::TensorList grads,
                   at::TensorList shard_grads, double scale, bool accumulate, int64_t mark) {
  if (!args_ok(a, plan, grads, shard_grads) || static_cast<int64_t>(plan.rounds.size()) != a.world())
    return Ran::kBadArgs;
  a.check_leased("reduce_scatter_params_");
  run_reduce_scatter(a, plan, grads, shard_grads, static_cast<float>(scale), accumulate, mark);
  return Ran::kTide;
}

}  // namespace tide
