// The collectives of the CUDA transport, one file each (as torch's symm_mem ops are): each is handed
// its plan (plans.h, built and agreed in Python) and works on an Arena (arena.h).
//   all_gather.cpp      TIDE-AG into outputs bound in a slot
//   reduce_scatter.cpp  TIDE-RS into fp32 shard grads
//   node_leg.cpp        the intra-node legs of a multi-node all-gather and reduce-scatter on a node arena
#pragma once

#include <torch/extension.h>

#include <vector>

#include "transport/arena.h"
#include "transport/plans.h"

namespace tide {

// What an op call did: ran, or refused its arguments with nothing issued (Python words the error with
// tide.meta.checks).
enum class Ran { kTide, kBadArgs };
const char* ran_name(Ran r);

// TIDE-AG of `shards` into `outs`, which lie at the plan's places of lane `lane` (flags.h: slot `lane`,
// or the direct lane's lease when lane is K); `mark` is the call's replay mark when the current stream
// captures a CUDA graph, else -1 (arena.h: Issue).
Ran all_gather(Arena& a, const AgPlan& plan, at::TensorList shards,
               at::TensorList outs, int64_t lane, int64_t mark);

// TIDE-RS of `grads` into this rank's fp32 `shard_grads` (`mark` as for all_gather).
Ran reduce_scatter(Arena& a, const RsPlan& plan, at::TensorList grads,
                   at::TensorList shard_grads, double scale, bool accumulate, int64_t mark);
// The rounds of a reduce-scatter plan, issued: shared by reduce_scatter and the node leg's partials.
void run_reduce_scatter(Arena& a, const RsPlan& plan, at::TensorList grads,
                        at::TensorList shard_grads, float scale, bool accumulate, int64_t mark);

// The node leg's plans and calls (node_leg.cpp).
std::shared_ptr<PartialsPlan> partials_plan(const Arena& a, RsPlan plan);
void push_spans(Arena& a, int64_t slot, uint64_t start, const std::vector<uint64_t>& landed,
                const std::vector<std::vector<int64_t>>& spans);
void reduce_partials(Arena& a, const PartialsPlan& p, at::TensorList grads, const at::Tensor& out);

}  // namespace tide
