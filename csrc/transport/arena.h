// One arena's C++ state, in one object: the memory and identity of one set of ranks inside one NVLink
// domain (a symmetric flag region, a data region leased per phase, laid out as csrc/transport/flags.h
// says), the streams the collectives issue on, the flag handshakes they share, what this rank has issued,
// and what an op call on a layout seen before needs (the held lease and its rule, the plans by call shape,
// the slots' busy events), so that the ops' C++ kernels (dispatch.cpp) take it without entering Python.
// The collectives themselves are all_gather.cpp, reduce_scatter.cpp and node_leg.cpp (collectives.h), each
// handed its plan and, for an all-gather, its lane: by the ops' C++ kernels once the gate (gate.h) lets a
// call through, else by Python's drivers (tide/transport/all_gather.py, reduce_scatter.py, node_leg.py).
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels.h"
#include "transport/driver.h"
#include "transport/flags.h"
#include "transport/plans.h"

namespace tide {

// Host nanoseconds inside the ops' C++ part, by kind of call (Arena::counters).
enum HostCat { kTotal = 0, kKernel, kMemop, kCopy, kEvent, kHostCats };

class HostTimer {
 public:
  explicit HostTimer(int64_t& ns) : ns_(ns), t0_(std::chrono::steady_clock::now()) {}
  ~HostTimer() {
    ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  int64_t& ns_;
  std::chrono::steady_clock::time_point t0_;
};

inline uint64_t ptr_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// How one op call issues on the caller's stream S: eagerly (flag values count up on the host, a
// completion word for the watchdog: driver.h), or into the CUDA graph S is capturing (the captured
// protocol of flags.h, a replay mark for the watchdog: replays.h).
struct Issue {
  cudaStream_t stream;
  int64_t mark;  // the replay mark when captured, else -1
  bool captured() const { return mark >= 0; }
};

// The current stream of `device` for `op`: `mark` (>= 0) must be given exactly when it is capturing.
Issue issue_on_current_stream(int64_t device, const char* op, int64_t mark);

// The id of the CUDA-graph capture `stream` is in, 0 when it captures none.
uint64_t capture_id(cudaStream_t stream);

// A call shape: per tensor its dims, its sizes and its dtype, then the list's length (the key Python's
// plans had, one tuple per tensor). The arena keeps its plans by it.
using ShapeKey = std::vector<int64_t>;
struct ShapeKeyHash {
  size_t operator()(const ShapeKey& k) const;
};
// shards' shapes and outs' dtypes (an all-gather's plan); grads' shapes and dtypes (a reduce-scatter's).
ShapeKey ag_key(at::TensorList shards, at::TensorList outs);
ShapeKey rs_key(at::TensorList grads);

class Arena;

// An eager op's entry in its arena's in-flight list, from before it issues anything until the call
// returns: then it carries the op's completion word, or none when the call ended without writing one
// (an error). A captured op has a replay mark instead (replays.h).
class WatchedOp {
 public:
  WatchedOp(Arena& a, const char* op, const Issue& is);
  ~WatchedOp();
  WatchedOp(const WatchedOp&) = delete;
  WatchedOp& operator=(const WatchedOp&) = delete;

 private:
  Arena& a_;
  uint64_t ticket_ = 0;  // 0: not watched here (captured)
  uint32_t op_before_;
};

class Arena {
 public:
  // flag_bases: every rank's flag region (symmetric memory). The data region comes later, per lease.
  Arena(int64_t rank, int64_t world, std::vector<int64_t> flag_bases, int64_t device, int64_t num_slots,
        int64_t slot_bytes, int64_t ring_depth, int64_t entry_bytes, int64_t sum_ctas, int64_t cast_ctas);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // ---- identity and memory
  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t device() const { return device_; }
  const ArenaLayout& layout() const { return layout_; }
  uint64_t local_flag(int64_t word) const { return flag_bases_[rank_] + 4 * word; }
  uint64_t peer_flag(int64_t p, int64_t word) const { return flag_bases_[p] + 4 * word; }
  uint64_t slot_base(int64_t p, int64_t slot) const {
    return data_bases_[p] + layout_.slots_off() + slot * layout_.slot_bytes;
  }
  // Rank p's outputs of an all-gather on lane `lane` (flags.h): its slot, or its direct lease.
  uint64_t lane_base(int64_t p, int64_t lane) const {
    return lane == layout_.flags.K ? direct_bases_[p] : slot_base(p, lane);
  }
  // The bytes an all-gather may write at lane_base(p, lane).
  int64_t lane_bytes(int64_t lane) const { return lane == layout_.flags.K ? direct_bytes_ : layout_.slot_bytes; }
  // Contributor q's staging entry of ring slot s at destination d.
  uint64_t entry(int64_t d, int64_t s, int64_t q) const {
    return data_bases_[d] + layout_.ring_off() + (s * world_ + q) * layout_.entry_bytes;
  }
  // This rank's leased region (undefined when released), leased in `context` (the lease, below), and
  // every rank's region address for the ops from now on: set at each lease, on every rank at the same
  // point (tide/transport/lease.py); all 0 while none is leased.
  void set_region(const at::Tensor& region, const std::vector<int64_t>& bases, uint64_t context);
  void check_leased(const char* op) const;
  // Where tensors lie in this rank's held region: the one rule, for the ops' C++ kernels (gate.h) and
  // for Python (tide/transport/arena.py, all_gather.py, the multi-node schedule) alike.
  // The slot whose bytes start at `ptr`, or -1 (no region held, no slots, or outside them).
  int64_t slot_of(uint64_t ptr) const;
  // The slot an all-gather's outputs can lie in: the one their first non-empty output starts in; with
  // every output empty, slot 0 of a held region (the handshake then moves no data); -1 if none.
  int64_t outputs_slot(at::TensorList outs) const;
  // outputs_slot(outs) if there every non-empty output j starts at `offsets[j]` bytes from the slot's
  // start (the plan's param-major places) and the group's `need` bytes fit a slot, else -1.
  int64_t placed_slot(at::TensorList outs, const std::vector<int64_t>& offsets, int64_t need) const;
  // The direct lane's lease (tide/transport/lease.py, one per all-gather call on it), like set_region.
  void set_direct(const at::Tensor& region, const std::vector<int64_t>& bases, uint64_t context);
  // Waits for this arena's push streams: nothing of this rank's still writes into a peer's old lease
  // before its mapping is closed.
  void sync_pushes();

  // ---- the streams and flag handshakes the collectives share
  cudaStream_t ag_push() const { return ag_push_; }
  cudaStream_t rs_push() const { return rs_push_; }
  cudaStream_t reduce() const { return reduce_; }
  cudaEvent_t ev_start() const { return ev_start_; }
  cudaEvent_t ev_rs_push() const { return ev_rs_push_; }
  cudaEvent_t ev_reduce() const { return ev_reduce_; }
  cudaEvent_t chunk_event(size_t c);  // created on first use
  void memops(cudaStream_t stream, const std::vector<driver::MemOp>& writes, const std::vector<driver::MemOp>& waits);
  void join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t ev);
  void launch_cast(CastArgs& a, cudaStream_t stream);
  void launch_sum(SumArgs& a);
  void issue_copies(CopyList& list, cudaStream_t stream, bool flags);
  CopyList& data_copies() { return data_; }
  CopyList& flag_copies() { return flags_; }
  int64_t& host_ns(HostCat c) { return host_ns_[c]; }
  // An op's first stream operation (captured: its replay mark opens) and its last (the completion word,
  // or the replay mark's close).
  void start(const Issue& is);
  void finish(const Issue& is);
  // One use of lane i by an all-gather: counts it (v; eager), makes P wait for `start`, then the "free"
  // handshake.
  uint32_t open_lane(int64_t lane, cudaEvent_t start, const Issue& is);
  // After P's copies: "ready" into every peer; S waits for every peer's and for P; the op's finish.
  void close_lane(int64_t lane, uint32_t v, const Issue& is);
  // A reduce-scatter's start: its rounds counted per destination (R skipped after a new lease, `fresh`),
  // returning the rounds per destination before it, which its flag values build on.
  std::vector<int64_t> count_rounds(const std::vector<int64_t>& rounds, bool& fresh);
  void count_call(bool all_gather) { ++(all_gather ? ag_calls_ : rs_calls_); }

  // ---- what a call on a layout seen before needs: the held lease, plans by call shape, the slots' busy
  // events. The ops' C++ kernels (dispatch.cpp) take it from here without entering Python. Python writes
  // it where it decides (tide/transport/lease.py at each lease, all_gather.py and reduce_scatter.py at a
  // new plan, tide/transport/slots.py for the slots); the gate (gate.h) reads it for every call and hands
  // any call it does not cover to Python. One thread issues an arena's ops at a time (FSDP2: the training
  // thread, or the autograd thread in backward): of this, nothing is locked but the plans.
  //
  // The lease: the region held (set_region; undefined once released) and the context it was leased in:
  // the capture's id, 0 eagerly, kEveryContext for a symmetric region (never freed, so any context may
  // use it).
  static constexpr uint64_t kEveryContext = ~uint64_t{0};
  const at::Tensor& region() const { return region_; }
  // Whether a call in `context` (capture_id of its stream) may use the held region: a capture must not
  // bake in memory that eager work uses, nor eager work use a graph's.
  bool held_in(uint64_t context) const {
    return region_.defined() && (context_ == kEveryContext || context_ == context);
  }
  // Records `stream` as a user of the held region, once per lease: the allocator reuses the block only
  // after every such stream has passed its use.
  void use_region_on(const c10::cuda::CUDAStream& stream);
  // Plans by call shape (null: none yet).
  std::shared_ptr<AgPlan> ag_plan(const ShapeKey& k) const;
  std::shared_ptr<RsPlan> rs_plan(const ShapeKey& k) const;
  void keep(const ShapeKey& k, std::shared_ptr<AgPlan> p);
  void keep(const ShapeKey& k, std::shared_ptr<RsPlan> p);
  void forget_plans();
  // Slot i's busy event: its latest use off the compute stream, in the context it was recorded in (eager,
  // or one capture). A stream waits only for a use of its own context: CUDA refuses a wait across a
  // capture's boundary, and none is needed there (tide/transport/slots.py).
  void slot_used(int64_t slot, cudaStream_t stream);
  void slot_wait(int64_t slot, cudaStream_t stream) const;
  int64_t slot_uses(int64_t slot) const { return slots_.at(slot).uses; }

  // ---- the eager ops in flight (driver.h)
  const std::shared_ptr<completions::InFlight>& in_flight() const { return in_flight_; }

  // ---- what this rank has issued (safe from the watchdog's thread while an op runs: the ops release the GIL)
  std::vector<int64_t> ag_uses() const;
  std::vector<int64_t> rs_rounds() const;
  std::vector<std::pair<std::string, int64_t>> counters() const;
  // Mirrors ag_uses() then rs_rounds() as K + 1 + W uint32 words at `address`, host memory that the other
  // processes of the host map (tide/transport/board.py): a peer's watchdog reads them with no CUDA call,
  // even while a launch wedged in the driver keeps the flag words unreadable. 0 stops the mirror.
  void publish_progress_to(uint64_t address);
  // The id of this arena's latest op (transport/driver.h: the watchdog reads its completion word).
  uint32_t last_op() const { return last_op_; }
  // Copies the flag words into pinned `host` on a stream of its own: "ok", "timeout" (not done within
  // wait_s: the driver may be wedged) or the CUDA error. Called without the GIL.
  std::string read_flags(const at::Tensor& host, double wait_s);

 private:
  struct SlotEvent {
    cudaEvent_t eager = nullptr, captured = nullptr;  // one per kind of context, created at first use
    uint64_t context = 0;  // of the latest use
    int64_t uses = 0;
  };

  void publish_locked();  // the counters into the issued board's words (progress_mu_ held)

  int64_t rank_, world_, device_, sum_ctas_, cast_ctas_;
  ArenaLayout layout_;
  std::vector<uint64_t> flag_bases_, data_bases_;  // data_bases_ all 0 until the first lease
  std::vector<uint64_t> direct_bases_;  // the direct lane's lease, all 0 outside its call
  int64_t direct_bytes_ = 0;
  std::vector<uint32_t> ag_uses_;   // per lane: all-gathers so far (the flag value of the next is + 1)
  std::vector<int64_t> rs_rounds_;  // per destination: reduce-scatter rounds issued (counted as an op starts)
  bool fresh_lease_ = false;        // the next reduce-scatter skips R rounds and posts its first permits
  volatile uint32_t* published_ = nullptr;  // the two above's mirror (publish_progress_to)
  mutable std::mutex progress_mu_;  // guards the three above against the readers of ag_uses() / rs_rounds()
  cudaStream_t ag_push_ = nullptr, rs_push_ = nullptr, reduce_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_ag_push_ = nullptr, ev_rs_push_ = nullptr, ev_reduce_ = nullptr;
  std::vector<cudaEvent_t> ev_chunk_;
  uint32_t last_op_ = 0;
  at::Tensor region_;  // the lease: the region held, and the context it was leased in
  uint64_t context_ = 0;
  std::vector<cudaStream_t> users_;  // streams recorded as the region's users
  mutable std::mutex plans_mu_;
  std::unordered_map<ShapeKey, std::shared_ptr<AgPlan>, ShapeKeyHash> ag_plans_;
  std::unordered_map<ShapeKey, std::shared_ptr<RsPlan>, ShapeKeyHash> rs_plans_;
  std::vector<SlotEvent> slots_;  // per slot, its busy event
  std::shared_ptr<completions::InFlight> in_flight_;
  cudaStream_t report_ = nullptr;
  cudaEvent_t ev_report_ = nullptr;
  CopyList data_, flags_;
  CopyCounters copied_;
  int64_t kernels_ = 0, memop_calls_ = 0, ag_calls_ = 0, rs_calls_ = 0;
  std::array<int64_t, kHostCats> host_ns_{};  // total, kernels, memops, copies, events
};

}  // namespace tide
