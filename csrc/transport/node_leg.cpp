// The intra-node legs of a multi-node all-gather and reduce-scatter on a node arena (the L ranks of one
// node of a multi-node group: tide/transport/node_leg.py), on TIDE-AG's and TIDE-RS's flags.
//
// All-gather (push_spans): the node arena's slots hold outputs of the whole multi-node group
// (param-major, all W ranks' rows: GroupLayout of W); batch b of (byte offset in the slot, bytes) pairs
// of my slot i goes to every node peer's slot i at the same offsets once event landed[b] has fired (the
// rail round that received those pieces, or the own copy), between TIDE-AG's "free" and "ready" flags
// (all_gather.cpp), with P waiting for event `start`, recorded on S as the op began.
// Reduce-scatter (reduce_partials): TIDE-RS rounds (reduce_scatter.cpp) whose destinations are the node's
// ranks, each summing the node partials the Latin square gives it into one fp32 buffer at the plan's
// shard_offset elements, unscaled, in local rank order (the reference's order).
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "transport/collectives.h"

namespace tide {

std::shared_ptr<PartialsPlan> partials_plan(const Arena& a, RsPlan plan) {
  TORCH_CHECK(static_cast<int64_t>(plan.rounds.size()) == a.world() && plan.pads.empty(),
              "tide.partials_plan: need one list of rounds per rank and no padding");
  for (int32_t dt : plan.grad_dtype)
    TORCH_CHECK(dt == kF32 || dt == kBF16 || dt == kF16, "tide.partials_plan: gradient dtype code ", num(dt));
  auto p = std::make_shared<PartialsPlan>();
  p->grad_need.assign(plan.grad_dtype.size(), 0);
  const int64_t entry = a.layout().entry_bytes;
  for (int64_t d = 0; d < a.world(); ++d) {
    for (const auto& round : plan.rounds[d])
      for (const RsChunk& c : round) {
        // Every term is checked on its own first, so no sum below can overflow.
        TORCH_CHECK(c.param >= 0 && c.param < static_cast<int64_t>(p->grad_need.size()) && c.numel >= 0 &&
                        c.numel <= entry && c.grad_offset >= 0 && c.shard_offset >= 0 && c.entry_offset >= 0 &&
                        c.entry_offset <= entry &&
                        c.numel * dtype_size(plan.grad_dtype[c.param]) <= entry - c.entry_offset &&
                        c.grad_offset <= INT64_MAX - c.numel && c.shard_offset <= INT64_MAX - c.numel,
                    "tide.partials_plan: a chunk lies outside its gradient list or its staging entry");
        p->grad_need[c.param] = std::max(p->grad_need[c.param], c.grad_offset + c.numel);
        if (d == a.rank()) p->out_need = std::max(p->out_need, c.shard_offset + c.numel);
      }
  }
  p->rs = std::move(plan);
  return p;
}

void reduce_partials(Arena& a, const PartialsPlan& p, at::TensorList grads, const at::Tensor& out) {
  const char* op = "reduce_scatter_params_";
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(a.device()));
  TORCH_CHECK_VALUE(grads.size() == p.grad_need.size(), "tide.", op, ": the node partials plan reads ",
                    num(p.grad_need.size()), " gradients, got ", num(grads.size()));
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK_VALUE(g.device() == dev && g.is_contiguous() && dtype_code(g.scalar_type()) == p.rs.grad_dtype[i] &&
                          g.numel() >= p.grad_need[i],
                      "tide.", op, ": grads[", num(i), "] must be a contiguous tensor of the plan's dtype on the node "
                      "arena's device with at least ", num(p.grad_need[i]), " elements");
  }
  TORCH_CHECK_VALUE(out.device() == dev && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                        out.numel() >= p.out_need,
                    "tide.", op, ": the node partials must be a contiguous fp32 tensor on the node arena's device "
                    "with at least ", num(p.out_need), " elements");
  a.check_leased(op);
  run_reduce_scatter(a, p.rs, grads, std::vector<at::Tensor>(grads.size(), out), 1.0f, false, -1);
}

namespace {
void check_spans(const Arena& a, int64_t slot, uint64_t start, const std::vector<uint64_t>& landed,
                 const std::vector<std::vector<int64_t>>& spans) {
  const char* op = "all_gather_into_params_";
  const int64_t K = a.layout().flags.K, slot_bytes = a.layout().slot_bytes;
  TORCH_CHECK_VALUE(slot >= 0 && slot < K, "tide.", op, ": node arena slot ", num(slot), " not in [0, ", num(K), ")");
  TORCH_CHECK_VALUE(landed.size() == spans.size() && start != 0, "tide.", op,
                    ": push_spans needs a recorded start event and one event per batch of spans");
  for (size_t b = 0; b < spans.size(); ++b) {
    TORCH_CHECK_VALUE(spans[b].size() % 2 == 0 && landed[b] != 0, "tide.", op, ": batch ", num(b),
                      " needs a recorded event and (offset, bytes) pairs");
    for (size_t i = 0; i < spans[b].size(); i += 2)
      TORCH_CHECK_VALUE(spans[b][i] >= 0 && spans[b][i] <= slot_bytes && spans[b][i + 1] >= 0 &&
                            spans[b][i + 1] <= slot_bytes - spans[b][i],
                        "tide.", op, ": span of ", num(spans[b][i + 1]), " bytes at ", num(spans[b][i]), " of batch ",
                        num(b), " is not inside a slot of ", num(slot_bytes), " bytes");
  }
  a.check_leased(op);
}
}  // namespace

void push_spans(Arena& a, int64_t slot, uint64_t start, const std::vector<uint64_t>& landed,
                const std::vector<std::vector<int64_t>>& spans) {
  check_spans(a, slot, start, landed, spans);
  HostTimer total(a.host_ns(kTotal));
  a.count_call(true);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(a.device()));
  const Issue is = issue_on_current_stream(a.device(), "all_gather_into_params_", -1);  // eager only
  const WatchedOp watched(a, "all_gather_into_params_ (node leg)", is);
  const uint32_t v = a.open_lane(slot, reinterpret_cast<cudaEvent_t>(start), is);
  const int64_t rank = a.rank(), world = a.world();
  const uint64_t mine = a.slot_base(rank, slot);
  CopyList& data = a.data_copies();
  for (size_t b = 0; b < spans.size(); ++b) {
    {
      HostTimer t(a.host_ns(kEvent));
      TIDE_CUDA(cudaStreamWaitEvent(a.ag_push(), reinterpret_cast<cudaEvent_t>(landed[b]), 0));
    }
    for (size_t i = 0; i < spans[b].size(); i += 2)
      for (int64_t k = 1; k < world; ++k)
        data.add(a.slot_base((rank + k) % world, slot) + spans[b][i], mine + spans[b][i],
                 static_cast<size_t>(spans[b][i + 1]));
    a.issue_copies(data, a.ag_push(), false);
  }
  a.close_lane(slot, v, is);
}

}  // namespace tide
