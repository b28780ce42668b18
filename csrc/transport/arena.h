// The host side of TIDE-AG and TIDE-RS inside one NVLink domain: one Arena per set of ranks, over a
// symmetric flag region and a leased data region laid out as csrc/transport/flags.h says.
//
// TIDE-AG, rank r, outputs bound in slot i, use v (slot i's use count, identical on all ranks):
//   S (caller's stream): record "start"; per pipeline chunk c: one kernel writes the chunk's ranges of my
//                        shards into my slot i (cast to the output dtype, or copied), record "chunk c";
//   P (AG push stream):  after "start": write ag_free[i][r] = v into every peer (stream memop) and wait
//                        for ag_free[i][p] >= v of every peer p; per chunk c: one batch of copy-engine
//                        copies of its bytes to every peer's slot i at the same offsets, read from my
//                        slot after "chunk c" (cast ranges) or from the shard itself (same dtype); then
//                        post ag_ready[i][r] = v with 4-B copies (they follow the data on P);
//   S:                   wait ag_ready[i][p] >= v for every peer; wait for P.
// TIDE-RS, rank r, every gradient read where it lies (autograd's memory, or its param-major place in a
// slot where FSDP's Slot-Reuse hooks moved it); round j, destination d, g = rounds done for d + 1, ring
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
// "free" flags (write after read) are stream-memop writes into the peer's word: the stream has finished
// reading when it reaches them. "ready" flags (read after write) are 4-B copy-engine copies that follow
// the data on the same stream, as in NCCL's CE collectives.
#pragma once

#include <torch/extension.h>

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels.h"
#include "transport/completions.h"
#include "transport/copies.h"
#include "transport/driver.h"
#include "transport/flags.h"
#include "transport/plans.h"

namespace tide {

// Plan registries are keyed by what a plan depends on, as integers (dtype codes and sizes), so a call
// finds its plan without building any Python object.
using PlanKey = std::vector<int64_t>;
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const;
};

// What an op call did: ran, or why nothing was issued.
enum class Ran { kTide, kNotBound, kNoPlan, kBadArgs };
const char* ran_name(Ran r);

class Arena {
 public:
  // flag_bases: every rank's flag region (symmetric memory). The data region comes later, per lease.
  Arena(int64_t rank, int64_t world, std::vector<int64_t> flag_bases, int64_t device, int64_t num_slots,
        int64_t slot_bytes, int64_t ring_depth, int64_t entry_bytes, int64_t sum_ctas, int64_t cast_ctas);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // TIDE-AG of `shards` into `outs` bound in a slot: kTide, kNotBound (outs lie in no slot at their
  // plan's addresses), kNoPlan or kBadArgs (nothing issued).
  Ran all_gather(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs);
  // TIDE-RS: kTide, kNoPlan or kBadArgs (nothing issued).
  Ran reduce_scatter(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads, double scale,
                     bool accumulate);
  // The intra-node leg of a multi-node all-gather whose outputs are bound in slot `slot` of this node
  // arena (tide/ops/reference_multinode.py): TIDE-AG's flags around it, and batch b of (byte offset in
  // the slot, bytes) pairs of my slot copied to every peer's slot at the same offsets once event
  // landed[b] has fired (the rail round that received them, or the own copy); P waits for event `start`
  // (recorded on S as the op began) before posting "free". Events are cudaEvent_t values.
  void push_spans(int64_t slot, uint64_t start, const std::vector<uint64_t>& landed,
                  const std::vector<std::vector<int64_t>>& spans);
  // The node-local stage of a multi-node reduce-scatter step on this node arena: TIDE-RS's rounds of
  // plan `id` (add_partials_plan), every destination's sums written into the fp32 buffer `out` at the
  // plan's offsets, unscaled (the node partials, summed in local rank order: the reference's order).
  void reduce_partials(int64_t id, const std::vector<at::Tensor>& grads, const at::Tensor& out);
  void add_partials_plan(int64_t id, RsPlan plan);
  void add_ag_plan(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs, AgPlan plan);
  void add_rs_plan(const std::vector<at::Tensor>& grads, RsPlan plan);

  const ArenaLayout& layout() const { return layout_; }
  // Every rank's data region (slots and ring) for the ops from now on: set at each lease, on every rank
  // at the same point (tide/transport/lease.py). Copy lists are built per call, so nothing is re-planned.
  void set_data_bases(const std::vector<int64_t>& bases);
  // Waits for this arena's push streams: nothing of this rank's still writes into a peer's old lease
  // before its mapping is closed.
  void sync_pushes();
  // What this rank has issued (the flag values its waits expect): all-gathers per slot, reduce-scatter
  // rounds per destination.
  // Safe from another thread (the watchdog's) while an op runs: the ops release the GIL.
  std::vector<int64_t> ag_uses() const;
  std::vector<int64_t> rs_rounds() const;
  std::vector<std::pair<std::string, int64_t>> counters() const;
  // Mirrors ag_uses() then rs_rounds() as K + W uint32 words at `address`, host memory that the other
  // processes of the host map (tide/transport/board.py): a peer's watchdog reads them with no CUDA call,
  // even while a launch wedged in the driver keeps the flag words unreadable. 0 stops the mirror.
  void publish_progress_to(uint64_t address);
  // The id of this arena's latest op (transport/completions.h: the watchdog reads its completion word).
  uint32_t last_op() const { return last_op_; }
  // Copies the flag words into pinned `host` on a stream of its own: "ok", "timeout" (not done within
  // wait_s: the driver may be wedged) or the CUDA error. Called without the GIL.
  std::string read_flags(const at::Tensor& host, double wait_s);

 private:
  uint64_t local_flag(int64_t word) const { return flag_bases_[rank_] + 4 * word; }
  uint64_t peer_flag(int64_t p, int64_t word) const { return flag_bases_[p] + 4 * word; }
  uint64_t slot_base(int64_t p, int64_t slot) const {
    return data_bases_[p] + layout_.slots_off() + slot * layout_.slot_bytes;
  }
  uint64_t entry(int64_t d, int64_t s, int64_t q) const {
    return data_bases_[d] + layout_.ring_off() + (s * world_ + q) * layout_.entry_bytes;
  }
  void check_leased(const char* op) const;
  int64_t bound_slot(const AgPlan& plan, const std::vector<at::Tensor>& outs) const;
  bool ag_args_ok(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& outs) const;
  bool rs_args_ok(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& shard_grads) const;
  void run_all_gather(const AgPlan& plan, const std::vector<at::Tensor>& shards, int64_t slot);
  // One use of slot i by an all-gather: counts it (v), makes P wait for `start`, then the "free" handshake.
  uint32_t open_slot(int64_t slot, cudaEvent_t start);
  // After P's copies: "ready" into every peer; S waits for every peer's and for P.
  void close_slot(int64_t slot, uint32_t v, cudaStream_t S);
  void run_reduce_scatter(const RsPlan& plan, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& shard_grads, float scale, bool accumulate);
  void memops(cudaStream_t stream, const std::vector<driver::MemOp>& writes, const std::vector<driver::MemOp>& waits);
  void join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t ev);
  void launch_cast(CastArgs& a, cudaStream_t stream);
  void launch_sum(SumArgs& a);
  void mark_completion(cudaStream_t stream);  // the op's last stream operation
  void publish_locked();  // the counters into the issued board's words (progress_mu_ held)

  int64_t rank_, world_, device_, sum_ctas_, cast_ctas_;
  ArenaLayout layout_;
  std::vector<uint64_t> flag_bases_, data_bases_;  // data_bases_ all 0 until the first lease
  std::vector<uint32_t> ag_uses_;   // per slot: all-gathers so far (the flag value of the next is + 1)
  std::vector<int64_t> rs_rounds_;  // per destination: reduce-scatter rounds issued (counted as an op starts)
  bool fresh_lease_ = false;        // the next reduce-scatter skips R rounds and posts its first permits
  volatile uint32_t* published_ = nullptr;  // the two above's mirror (publish_progress_to)
  mutable std::mutex progress_mu_;  // guards the three above against the readers of ag_uses() / rs_rounds()
  cudaStream_t ag_push_ = nullptr, rs_push_ = nullptr, reduce_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_ag_push_ = nullptr, ev_rs_push_ = nullptr, ev_reduce_ = nullptr;
  std::vector<cudaEvent_t> ev_chunk_;
  uint32_t last_op_ = 0;
  cudaStream_t report_ = nullptr;
  cudaEvent_t ev_report_ = nullptr;
  std::unordered_map<PlanKey, std::shared_ptr<AgPlan>, PlanKeyHash> ag_plans_;
  std::unordered_map<PlanKey, std::shared_ptr<RsPlan>, PlanKeyHash> rs_plans_;
  std::unordered_map<int64_t, std::shared_ptr<PartialsPlan>> partials_plans_;
  CopyList data_, flags_;
  CopyCounters copied_;
  int64_t kernels_ = 0, memop_calls_ = 0, ag_calls_ = 0, rs_calls_ = 0;
  std::array<int64_t, 5> host_ns_{};  // total, kernels, memops, copies, events
};

}  // namespace tide
