// What an op call on a layout seen before needs, kept in C++ so that the ops' CUDA kernels
// (dispatch.cpp) take it without entering Python: the held lease (its region, the capture it was leased
// in, the streams recorded as its users), the plans by call shape, and the slots' busy events. Python
// writes it where it decides (tide/transport/lease.py at each lease, all_gather.py and reduce_scatter.py
// at a new plan, tide/transport/slots.py for the slots); the gate (gate.h) reads it for every call and
// hands any call it does not cover to Python. One thread issues an arena's ops at a time (FSDP2: the training thread,
// or the autograd thread in backward): nothing here is locked but the plans.
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "transport/plans.h"

namespace tide {

// A call shape: per tensor its dims, its sizes and its dtype, then the list's length (the key Python's
// plans had, one tuple per tensor).
using ShapeKey = std::vector<int64_t>;
struct ShapeKeyHash {
  size_t operator()(const ShapeKey& k) const;
};
// shards' shapes and outs' dtypes (an all-gather's plan); grads' shapes and dtypes (a reduce-scatter's).
ShapeKey ag_key(at::TensorList shards, at::TensorList outs);
ShapeKey rs_key(at::TensorList grads);

// The id of the CUDA-graph capture `stream` is in, 0 when it captures none.
uint64_t capture_id(cudaStream_t stream);

class Steady {
 public:
  Steady(int64_t device, int64_t num_slots);
  ~Steady();
  Steady(const Steady&) = delete;
  Steady& operator=(const Steady&) = delete;

  // ---- the lease: the region held (undefined once released) and the context it was leased in: the
  // capture's id, 0 eagerly, kEveryContext for a symmetric region (never freed, so any context may use it)
  static constexpr uint64_t kEveryContext = ~uint64_t{0};
  void set_region(const at::Tensor& region, uint64_t context);
  const at::Tensor& region() const { return region_; }
  // Whether a call in `context` (capture_id of its stream) may use the held region: a capture must not
  // bake in memory that eager work uses, nor eager work use a graph's.
  bool held_in(uint64_t context) const {
    return region_.defined() && (context_ == kEveryContext || context_ == context);
  }
  // Records `stream` as a user of the held region, once per lease: the allocator reuses the block only
  // after every such stream has passed its use.
  void use_region_on(const c10::cuda::CUDAStream& stream);

  // ---- plans by call shape (null: none yet)
  std::shared_ptr<AgPlan> ag_plan(const ShapeKey& k) const;
  std::shared_ptr<RsPlan> rs_plan(const ShapeKey& k) const;
  void keep(const ShapeKey& k, std::shared_ptr<AgPlan> p);
  void keep(const ShapeKey& k, std::shared_ptr<RsPlan> p);
  void forget_plans();

  // ---- slot i's busy event: its latest use off the compute stream, in the context it was recorded in
  // (eager, or one capture). A stream waits only for a use of its own context: CUDA refuses a wait across
  // a capture's boundary, and none is needed there (tide/transport/slots.py).
  void slot_used(int64_t slot, cudaStream_t stream);
  void slot_wait(int64_t slot, cudaStream_t stream) const;
  int64_t slot_uses(int64_t slot) const { return slots_.at(slot).uses; }

 private:
  struct SlotEvent {
    cudaEvent_t eager = nullptr, captured = nullptr;  // one per kind of context, created at first use
    uint64_t context = 0;  // of the latest use
    int64_t uses = 0;
  };

  int64_t device_;
  at::Tensor region_;
  uint64_t context_ = 0;
  std::vector<cudaStream_t> users_;  // streams recorded as the region's users
  mutable std::mutex plans_mu_;
  std::unordered_map<ShapeKey, std::shared_ptr<AgPlan>, ShapeKeyHash> ag_plans_;
  std::unordered_map<ShapeKey, std::shared_ptr<RsPlan>, ShapeKeyHash> rs_plans_;
  std::vector<SlotEvent> slots_;
};

}  // namespace tide
