// The gatekeeper: when a call of the two mutating ops may take the transport, written once.
//
// The ops' C++ kernels (dispatch.cpp) ask it on every call. On kTransport they run the collective
// themselves; on any other verdict they enter the op's Python kernel (tide/ops/cuda.py) with the
// verdict's name and what the gate found (AgGate / RsGate: the arena, plan, slot). Python does what that
// verdict says and decides nothing of it again: it issues with the plan and slot handed over, or makes what
// the verdict names as missing (the group's binding, a lease, a plan) and asks the gate again. Python's
// table of what each verdict means (tide/ops/cuda.py, VERDICTS) names exactly the kVerdicts below:
// tests/ops/test_gate.py compares them, so no condition can change on one side only.
//
//   verdict               holds when                                        Python then
//   transport             every condition below passed                       issues with the plan and slot
//   no_arena              no arena is bound to the group name                binds it (tide/transport/serving.py)
//                                                                            if an arena serves the group's ranks
//                                                                            and asks again; else reference
//   world_size            the call's world size is not the arena's           raises ValueError
//   grad                  an argument requires grad under grad mode          raises (tide.meta.checks)
//   lease_across_capture  the region was leased in another context than the  reference backend
//                         stream's (eagerly vs in one CUDA-graph capture)
//   no_lease              reduce-scatter: no region is leased                leases (collective), asks again
//   outputs_not_in_slot   all-gather: the outputs lie in no slot at their    reference backend
//                         plan's places (none without a region)
//   no_plan               no plan for the call shape yet                     builds and agrees one, asks again
//   capturing             the stream captures a CUDA graph                   issues with a replay mark
//   refused               the collective refused the arguments               words the argument error
//
// The order is the table's: the first that holds is the verdict. "refused" comes from running the
// collective, so only the C++ kernel reaches it; with the steady path off (TIDE_TRACE, or after a TIDE op
// timed out) the kernel hands every call to Python with its verdict.
#pragma once

#include <torch/extension.h>

#include <array>
#include <memory>
#include <string>

#include "transport/arena.h"

namespace tide {

enum class Verdict : int {
  kTransport = 0,
  kNoArena,
  kWorldSize,
  kGrad,
  kLeaseAcrossCapture,
  kNoLease,
  kOutputsNotInSlot,
  kNoPlan,
  kCapturing,
  kRefused,
  kCount
};
constexpr std::array<const char*, static_cast<size_t>(Verdict::kCount)> kVerdicts = {
    "transport", "no_arena", "world_size", "grad", "lease_across_capture", "no_lease",
    "outputs_not_in_slot", "no_plan", "capturing", "refused"};
inline const char* verdict_name(Verdict v) { return kVerdicts[static_cast<size_t>(v)]; }

// The arena serving each group name and its world size, written only by tide/transport/serving.py (at an
// arena's enable, at a group name's first op call, and at its disable). Held weakly.
void bind_group(const std::string& group_name, const std::shared_ptr<Arena>& arena, int64_t world);
void forget_arena(const std::shared_ptr<Arena>& arena);

// What an all-gather / reduce-scatter call needs to run the transport: the verdict and what the gate found.
struct AgGate {
  Verdict verdict;
  std::shared_ptr<Arena> arena;
  std::shared_ptr<AgPlan> plan;
  int64_t slot = -1;
  c10::cuda::CUDAStream stream;
};
struct RsGate {
  Verdict verdict;
  std::shared_ptr<Arena> arena;
  std::shared_ptr<RsPlan> plan;
  c10::cuda::CUDAStream stream;
};
AgGate gate_all_gather(at::TensorList shards, at::TensorList outs, int64_t world, c10::string_view group);
RsGate gate_reduce_scatter(at::TensorList grads, at::TensorList shard_grads, int64_t world, c10::string_view group);

}  // namespace tide
