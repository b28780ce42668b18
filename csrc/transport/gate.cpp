// The gatekeeper of gate.h: its verdicts, in the order of its table, and the group names bound to arenas.
#include "transport/gate.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace tide {
namespace {

struct Bound {
  std::weak_ptr<Arena> arena;
  int64_t world = 0;
};

std::mutex groups_mu;
std::unordered_map<std::string, Bound>& groups() {
  static auto* g = new std::unordered_map<std::string, Bound>();
  return *g;
}
std::atomic<uint64_t> groups_version{1};  // bumped at every change of groups()

// The binding of `group_name`; each thread keeps its last lookup while no binding changed (the training
// thread issues every call of a group: no lock, no string built on its way).
Bound bound(c10::string_view group_name) {
  struct Last {
    uint64_t version = 0;
    std::string name;
    Bound bound;
  };
  thread_local Last last;
  const uint64_t version = groups_version.load(std::memory_order_acquire);
  if (last.version != version || c10::string_view(last.name) != group_name) {
    std::lock_guard<std::mutex> lock(groups_mu);
    auto it = groups().find(std::string(group_name));
    last = Last{version, std::string(group_name), it == groups().end() ? Bound{} : it->second};
  }
  return last.bound;
}

bool requires_grad(at::TensorList a, at::TensorList b) {
  if (!at::GradMode::is_enabled()) return false;
  for (at::TensorList l : {a, b})
    for (const at::Tensor& t : l)
      if (t.requires_grad()) return true;
  return false;
}

// The verdicts both ops share (the table's rows up to the lease); the caller's stream and the id of the
// capture it is in (0: none) in `stream` and `capture`.
Verdict common(c10::string_view group, int64_t world, at::TensorList a, at::TensorList b,
               std::shared_ptr<Arena>* arena, c10::cuda::CUDAStream* stream, uint64_t* capture) {
  const Bound binding = bound(group);
  *arena = binding.arena.lock();
  if (*arena == nullptr) return Verdict::kNoArena;
  if (binding.world != world) return Verdict::kWorldSize;
  if (requires_grad(a, b)) return Verdict::kGrad;
  const Steady& s = (*arena)->steady();
  *stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>((*arena)->device()));
  *capture = capture_id(stream->stream());
  if (s.region().defined() && !s.held_in(*capture)) return Verdict::kLeaseAcrossCapture;
  return Verdict::kTransport;
}

}  // namespace

void bind_group(const std::string& group_name, const std::shared_ptr<Arena>& arena, int64_t world) {
  std::lock_guard<std::mutex> lock(groups_mu);
  groups()[group_name] = Bound{arena, world};
  ++groups_version;
}

void forget_arena(const std::shared_ptr<Arena>& arena) {
  std::lock_guard<std::mutex> lock(groups_mu);
  for (auto it = groups().begin(); it != groups().end();) {
    auto held = it->second.arena.lock();
    it = held == nullptr || held == arena ? groups().erase(it) : std::next(it);
  }
  ++groups_version;
}

AgGate gate_all_gather(at::TensorList shards, at::TensorList outs, int64_t world, c10::string_view group) {
  AgGate g{Verdict::kTransport, nullptr, nullptr, -1, c10::cuda::getDefaultCUDAStream()};
  uint64_t capture = 0;
  g.verdict = common(group, world, shards, outs, &g.arena, &g.stream, &capture);
  if (g.verdict != Verdict::kTransport) return g;
  // Outputs can lie only in a held region: without one they lie in no slot.
  if (g.arena->outputs_slot(outs) < 0) return g.verdict = Verdict::kOutputsNotInSlot, g;
  g.plan = g.arena->steady().ag_plan(ag_key(shards, outs));
  if (g.plan == nullptr) return g.verdict = Verdict::kNoPlan, g;
  g.slot = g.arena->placed_slot(outs, g.plan->out_offset, g.plan->slot_bytes);
  if (g.slot < 0) return g.verdict = Verdict::kOutputsNotInSlot, g;
  if (capture != 0) g.verdict = Verdict::kCapturing;
  return g;
}

RsGate gate_reduce_scatter(at::TensorList grads, at::TensorList shard_grads, int64_t world, c10::string_view group) {
  RsGate g{Verdict::kTransport, nullptr, nullptr, c10::cuda::getDefaultCUDAStream()};
  uint64_t capture = 0;
  g.verdict = common(group, world, grads, shard_grads, &g.arena, &g.stream, &capture);
  if (g.verdict != Verdict::kTransport) return g;
  if (!g.arena->steady().region().defined()) return g.verdict = Verdict::kNoLease, g;
  g.plan = g.arena->steady().rs_plan(rs_key(grads));
  if (g.plan == nullptr) return g.verdict = Verdict::kNoPlan, g;
  if (capture != 0) g.verdict = Verdict::kCapturing;
  return g;
}

}  // namespace tide
